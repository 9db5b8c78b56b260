"""vllm-parity: a rollout engine whose logprobs match the trainer's bit for bit.

The CUDA extension in csrc/ is built through CMakeLists.txt only when csrc/ holds an op
(a .cu source; csrc/module.cpp alone registers none) and nvcc and a CUDA build of torch
are present; everything else is pure Python + Triton, so `pip install -e .` never fails
for lack of a GPU toolchain.
"""
import os
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext


def _cuda_toolchain_present() -> bool:
    if os.environ.get("VLLM_PARITY_SKIP_CSRC") == "1":
        return False
    if shutil.which("nvcc") is None or shutil.which("cmake") is None:
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.version.cuda is not None


def _has_compiled_ops() -> bool:
    """csrc/ holds an op to build: a CUDA source next to the module skeleton."""
    csrc = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
    return os.path.isdir(csrc) and any(f.endswith(".cu") for f in os.listdir(csrc))


class CMakeExtension(Extension):
    def __init__(self, name: str, sourcedir: str = ""):
        super().__init__(name, sources=[])
        self.sourcedir = os.path.abspath(sourcedir)


class CMakeBuild(build_ext):
    """Builds csrc/ with CMake; a failure is reported but never fails the install."""

    def build_extensions(self) -> None:
        built = [ext for ext in self.extensions if self._build_cmake(ext)]
        # Outputs (and the editable install's copies) cover only what was built: a
        # missing .so must not turn a failed optional build into a failed install.
        self.extensions[:] = built

    def _build_cmake(self, ext: CMakeExtension) -> bool:
        out_dir = os.path.abspath(os.path.dirname(self.get_ext_fullpath(ext.name)))
        build_dir = os.path.abspath(self.build_temp)
        os.makedirs(build_dir, exist_ok=True)
        import torch

        cfg = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        try:
            subprocess.check_call(["cmake", ext.sourcedir, *cfg], cwd=build_dir)
            subprocess.check_call(["cmake", "--build", ".", "-j"], cwd=build_dir)
        except (subprocess.CalledProcessError, OSError) as err:
            print(f"[vllm-parity] csrc build failed ({err}); continuing without it")
            return False
        return os.path.exists(self.get_ext_fullpath(ext.name))


ext_modules = [CMakeExtension("vllm._C", ".")] if _has_compiled_ops() and _cuda_toolchain_present() else []

setup(
    name="vllm-parity",
    version="0.1.0",
    description="Rollout engine and trainer sharing one model class and one set of kernels, bit for bit",
    packages=find_packages(include=["vllm", "vllm.*", "training", "training.*"]),
    package_data={"vllm": ["default_model/*", "kernels/tuned/*.json", "testing/data/*.txt"], "training": ["*.yaml"]},
    include_package_data=True,
    python_requires=">=3.10",
    # torch / triton: the range actually tested (tests/test_packaging.py fails outside it):
    # torch 2.11 + triton 3.6 on the GPU host, torch 2.14 + triton 3.8 in a fresh venv (.ci/run),
    # torch 2.15 + triton 3.9 in a venv of their own (the whole suite; benchmarks/NOTES.md).
    # Widen a bound only after the suite has passed on the new version.
    install_requires=[
        "torch>=2.11,<2.16",
        "triton>=3.6,<3.10",
        "numpy",
        "safetensors",
        "tokenizers",
        "transformers>=4.51",
        # a hub id already in the local Hugging Face cache resolves to its snapshot (no download)
        "huggingface_hub",
        "jinja2",  # chat templates (LLM.chat, /v1/chat/completions)
        "tqdm",
        "pydantic>=2",
        "pyyaml",  # `vllm train` recipes (training/*.yaml)
    ],
    extras_require={
        "serve": ["fastapi", "starlette", "uvicorn", "prometheus-client"],
        # gguf + accelerate: transformers dequantizes the registry's SmolLM2 GGUF with them
        # (vllm/testing/smollm2.py builds the real-model test fixture from it)
        # trl + requests: tests/test_server_trl.py drives the server with TRL's own VLLMClient (the
        # version tested; its client protocol changes between releases)
        # ray: tests/test_rl_ray.py runs `vllm train --backend ray` on a local cluster (about 12 s to install)
        # xgrammar: tests/test_structured_outputs.py (about 4 s to install: two wheels, 4.6 MB)
        # lm-eval[api]: tests/test_lm_eval.py runs its local-completions model against the server
        # (about 25 s to install)
        # pytest-xdist: scripts/test.sh runs one pytest worker per core
        "test": ["pytest", "pytest-xdist", "packaging", "httpx", "fastapi", "starlette", "uvicorn", "prometheus-client",
                 "openai", "gguf", "accelerate", "trl>=1.16,<1.17", "requests", "ray>=2.40", "xgrammar>=0.2.9,<0.3",
                 "lm-eval[api]>=0.4.13,<0.5"],
        # structured outputs (response_format, structured_outputs, tool_choice "required" / named):
        # xgrammar compiles the grammars (vllm/structured_outputs.py); the version tested
        "structured": ["xgrammar>=0.2.9,<0.3"],
        # sleep mode's CUDA driver virtual-memory path (vllm/worker/cuda_vmm.py)
        "gpu": ["cuda-bindings"],
        # `vllm train`: TensorBoard logs, PNG plots, parquet data (each optional: skipped with a note)
        "train": ["tensorboard", "matplotlib", "pyarrow"],
        # `vllm train --wandb-project`: Weights & Biases logs (vllm/rl/metrics.py)
        "wandb": ["wandb"],
        # `vllm train --backend ray`: trainer and rollout engines as Ray actors (vllm/rl/ray, docs/ray.md)
        "ray": ["ray>=2.40"],
    },
    entry_points={"console_scripts": ["vllm=vllm.entrypoints.cli.main:main"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": CMakeBuild} if ext_modules else {},
)
