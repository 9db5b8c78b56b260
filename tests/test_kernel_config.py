"""Kernel options are config fields (vllm.config.KernelConfig, LLM keywords, --help flags,
the execution contract), not environment variables."""
import argparse
import ast
import os

from vllm import LLM
from vllm.config import KernelConfig
from vllm.entrypoints.cli.engine_args import add_engine_args, engine_kwargs
from vllm.kernels import numerics_table as nt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parse(*argv):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p, engine_kwargs(p.parse_args(list(argv)))


def test_cli_flags_reach_the_llm_keywords():
    p, kw = _parse()
    assert (kw["gemm_cublaslt"], kw["fused_gumbel"], kw["step_profile"]) == (True, True, False)
    _, kw = _parse("--no-gemm-cublaslt", "--no-fused-gumbel", "--step-profile")
    assert (kw["gemm_cublaslt"], kw["fused_gumbel"], kw["step_profile"]) == (False, False, True)
    helps = {a.dest: a.help for a in p._actions}
    for dest in ("gemm_cublaslt", "fused_gumbel", "step_profile"):
        assert helps[dest] and len(helps[dest]) > 30, dest


def test_options_reach_the_runner_and_the_contract(tiny_qwen3):
    base = LLM(tiny_qwen3, device="cpu", numerics="invariant")
    other = LLM(tiny_qwen3, device="cpu", numerics="invariant", fused_gumbel=False, gemm_cublaslt=False,
                step_profile=True)
    assert other.config.kernels == KernelConfig(gemm_cublaslt=False, fused_gumbel=False)
    runner = other.llm_engine.executor.worker
    assert runner.sampling.sampler.fused_gumbel is False and runner.timer.enabled is True
    assert base.llm_engine.executor.worker.sampling.sampler.fused_gumbel is True and base.llm_engine.executor.worker.timer.enabled is False
    a, b = base.execution_contract(), other.execution_contract()
    # on CPU no kernel option changes what computes: only the deployment part differs
    assert a.digests["numerical"] == b.digests["numerical"]
    assert a.deployment["fused_gumbel"] is True and b.deployment["fused_gumbel"] is False
    a.check_compatible(b)
    assert b.numerical["kernels"] == nt.describe("invariant", "cpu")
    # the colocated training view carries the engine's options (same contract)
    assert other.policy().execution_contract().digests["numerical"] == b.digests["numerical"]
    assert other.policy().kernels == other.config.kernels


def test_gemm_option_is_bound_to_the_invariant_cuda_gemm_only():
    off = KernelConfig(gemm_cublaslt=False)
    fn = nt.kernel_for("linear", "invariant", "cuda", off)
    assert fn.func is nt.NUMERICS_TABLE["linear"].invariant.cuda and fn.keywords == {"allow_cublaslt": False}
    assert nt.describe("invariant", "cuda", off)["logits"].endswith("(allow_cublaslt=False)")
    assert nt.describe("invariant", "cuda")["linear"].endswith("(allow_cublaslt=True)")
    assert nt.kernel_for("linear", "fast", "cuda", off) is nt.NUMERICS_TABLE["linear"].fast.cuda
    assert nt.kernel_for("linear", "invariant", "cpu", off) is nt.NUMERICS_TABLE["linear"].invariant.cpu


def _environment_reads(tree: ast.AST) -> list[tuple[int, object]]:
    """(line, key) of every os.environ / os.getenv use; key None where it is not a literal."""
    def is_environ(n):
        return isinstance(n, ast.Attribute) and n.attr == "environ"
    found, seen = [], set()
    for node in ast.walk(tree):
        key = node
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                (node.func.attr == "getenv") or (node.func.attr in ("get", "setdefault") and is_environ(node.func.value))):
            key = node.args[0] if node.args else None
            seen.add(id(node.func.value if node.func.attr != "getenv" else node.func))
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            key = node.slice
            seen.add(id(node.value))
        else:
            continue
        found.append((node.lineno, key.value if isinstance(key, ast.Constant) else None))
    found += [(n.lineno, None) for n in ast.walk(tree) if is_environ(n) and id(n) not in seen]
    return found


def test_no_environment_variable_chooses_behaviour():
    """Only Triton's own TRITON_INTERPRET (read where the kernels must know how Triton will
    run them) is read from the environment inside the package, besides the API key below."""
    reads = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "vllm")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path) as fh:
                    tree = ast.parse(fh.read(), path)
                reads += [(os.path.relpath(path, ROOT), line, key) for line, key in _environment_reads(tree)]
    # and `vllm serve`'s VLLM_API_KEY, upstream's way to pass the API key as a secret (the
    # default of --api-key): it chooses no behaviour but the key
    allowed = {("vllm/entrypoints/cli/serve.py", "VLLM_API_KEY")}
    assert reads and all(key == "TRITON_INTERPRET" or (path, key) in allowed for path, _, key in reads), reads
    probe = ast.parse('import os\nA = os.environ.get("VLLM_X", "1")\nB = os.environ["Y"]\nC = os.getenv("Z")\n'
                      'D = dict(os.environ)\n')
    assert sorted(_environment_reads(probe), key=str) == sorted([(2, "VLLM_X"), (3, "Y"), (4, "Z"), (5, None)], key=str)
