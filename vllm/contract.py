"""The execution contract: every choice that can change a logprob's bits, in one
serializable document with SHA-256 digests.

Three parts, each hashed separately (canonical JSON: sorted keys, no spaces):
- semantic: the logical model (architecture, dims, dtype, vocabulary, rope, eps,
  tied embeddings, a digest of the weights' names and shapes);
- numerical: everything that changes bits (numerics mode, device kind and
  compute capability, torch/triton versions, each kernel, the SHA-256 of the source of
  the packages that compute a token (kernels, layers, models, sampler), tile
  and split sizes, accumulation dtypes, quantization rule, sampler rules and
  tie-breaking, logprobs definition; under `layer_kernels`, what layers with kernels
  of their own name, e.g. an MoE block's routing and grouped GEMM);
- deployment: everything that must NOT change bits in invariant mode (batch
  limits, block size, memory fraction, prefix caching, CUDA graph sizes, kernel
  options measured bit-neutral such as the fused Gumbel sampler, the tensor-parallel
  size under the K-leaf tree, whose G is numerical).

Rollout and trainer exchange contracts before a weight sync and refuse to go on
when the semantic or numerical digests differ (`check_compatible`).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from vllm.config import NumericsSpec


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def code_digests() -> dict[str, str]:
    """{part: SHA-256 of its Python source (file paths and bytes, in path order)} for the
    parts of vllm whose code decides a token's bits (numerics_table.CODE_PACKAGES). Two peers
    whose code differs in any of them may round differently, so the contract carries the
    digests themselves rather than a version someone must remember to bump: a rollout engine
    and a trainer from different builds are refused, even where the difference is a comment
    (the check cannot tell)."""
    return dict(_code_digests())  # a copy: contracts keep it, the cache must not change


@functools.lru_cache(maxsize=None)
def _code_digests() -> dict[str, str]:
    from vllm.kernels.numerics_table import CODE_PACKAGES
    root = Path(__file__).resolve().parent
    return {pkg: source_digest(root / pkg) for pkg in CODE_PACKAGES}


def source_digest(path: Path) -> str:
    """SHA-256 over the .py files at or below `path`: each one's relative path and bytes."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(path.rglob("*.py"))
    for f in files:
        name = f.name if f == path else f.relative_to(path).as_posix()
        h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def device_kind(device: str | torch.device) -> dict:
    dev = torch.device(device)
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        return {"type": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}",
                "cuda": torch.version.cuda}
    return {"type": dev.type, "threads": torch.get_num_threads()}


def numerical_policy(spec: NumericsSpec, device: str | torch.device) -> dict:
    import triton

    from vllm.kernels import attention as attn
    from vllm.kernels import fp8
    from vllm.kernels import matmul
    from vllm.kernels.numerics_table import describe

    numerics, dtype, kernels = spec.numerics, spec.dtype, spec.kernels
    quantization, kv_cache_dtype = spec.quantization, spec.kv_cache_dtype
    dev = torch.device(device)
    gpu = dev.type == "cuda"
    policy = {
        "numerics": numerics,
        "device": device_kind(dev),
        "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__.split("+")[0],
        "triton": triton.__version__,
        "code_sha256": code_digests(),
        "kernels": describe(numerics, dev, kernels),
        # linear layers: None (model dtype) or the block-scaled FP8 rule (scales, rounding, GEMM order)
        "quantization": None if quantization is None else {
            "method": quantization, **fp8.LINEAR_RULE,
            "cublaslt": _fp8_cublaslt_policy() if gpu and kernels.gemm_cublaslt else None},
        # the KV cache: the model dtype, or float8_e4m3fn with its scale granularity and rounding
        "kv_cache_dtype": (str(dtype).replace("torch.", "") if kv_cache_dtype == "auto"
                           else {"dtype": "float8_e4m3fn", **fp8.KV_RULE}),
        "sampler": {"rng": "counter-hash(seed, position, token_id) -> gumbel-max",
                    "ties": "lowest token id", "sort": "stable descending",
                    "float_reductions": "fixed pairwise order over the row"},
        "logprobs": "float32 log_softmax(logits / T) over the full vocabulary (T=0 -> 1), before truncation",
    }
    # what runs is named by policy["kernels"] (the numerics table); below, the rules inside them
    if numerics == "invariant":
        policy["gemm"] = ({"form": "acc = tl.dot(a, b, acc)", "k_split": "none: one float32 accumulation over all of K",
                           "accumulate": "float32", "k_order": "ascending",
                           "tiles_by_M": matmul.GPU_CONFIGS, "tiles_by_M_wide": matmul.GPU_CONFIGS_WIDE,
                           "tuned_tables_sha256": matmul.tuned_tables_digest(),
                           "cublaslt": _cublaslt_policy(matmul) if kernels.gemm_cublaslt else None}
                          if gpu else {"form": "torch F.linear one row at a time", "accumulate": "backend"})
        policy["norm"] = "one program per row, BLOCK by hidden size" if gpu else "torch one row at a time"
        policy["lm_head"] = "invariant gemm, float32 output"
    else:
        policy["gemm"] = {"batch_invariant": False}
        policy["lm_head"] = "F.linear in model dtype, then float32"
    policy["attention"] = {
        "kv_tile": attn.KV_TILE, "kv_split_size": attn.KV_SPLIT_SIZE,
        "merge": "ascending splits, fixed formula", "accumulate": "float32",
    }
    policy["block_size_affects_bits"] = False
    return policy


def _cublaslt_policy(matmul) -> dict | None:
    """cuBLASLt serves some M buckets (impl "cublaslt") with split-K forbidden: its version
    and that rule are bits-relevant, so they are named (None: the tables never use it)."""
    if not any(e[1].startswith("cublaslt") for table in matmul.tuned_tables().values() for e in table):
        return None
    return {"reduction_scheme": "NONE (no split-K): one float32 MMA sequence along K",
            "available": matmul.cublaslt_nosplit_supported(), "version": matmul.cublaslt_version()}


def _fp8_cublaslt_policy() -> dict:
    """FP8 linears from fp8_gemm.CUBLASLT_MIN_M rows run on cuBLASLt where proved bit-equal
    to the Triton kernel per weight shape: the library's version and its rules are named."""
    from vllm.kernels import fp8_cublaslt, fp8_gemm
    try:
        version = fp8_cublaslt.version()
    except Exception:  # noqa: BLE001 -- a library we cannot load is reported as None
        version = None
    return {"min_m": fp8_gemm.CUBLASLT_MIN_M, "scale_modes": "VEC128_32F x BLK128x128_32F",
            "reduction_scheme": "NONE", "workspace_bytes": 0, "version": version}


@dataclass
class ExecutionContract:
    semantic: dict
    numerical: dict
    deployment: dict

    @property
    def digests(self) -> dict[str, str]:
        return {"semantic": _digest(self.semantic), "numerical": _digest(self.numerical),
                "deployment": _digest(self.deployment)}

    def to_dict(self) -> dict:
        return {"semantic": self.semantic, "numerical": self.numerical, "deployment": self.deployment,
                "digests": self.digests}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> "ExecutionContract":
        if not isinstance(d, dict):
            raise ValueError(f"an execution contract is a JSON object, got {type(d).__name__}")
        for part in ("semantic", "numerical", "deployment"):
            if part not in d:
                raise ValueError(f"not an execution contract: no {part!r} part")
            if not isinstance(d[part], dict):
                raise ValueError(f"execution contract part {part!r} must be an object, got {type(d[part]).__name__}")
        c = cls(d["semantic"], d["numerical"], d["deployment"])
        if "digests" in d and d["digests"] != c.digests:
            raise ValueError("execution contract digests do not match its content (corrupted or edited)")
        return c

    @classmethod
    def from_json(cls, s: str) -> "ExecutionContract":
        """A saved contract (to_json's document): its digests must be there and match its
        content, so an edit to the file is found even where nobody compares it with a peer."""
        try:
            d = json.loads(s)
        except (TypeError, ValueError) as err:
            raise ValueError(f"an execution contract document is JSON: {err}") from None
        if isinstance(d, dict) and "digests" not in d:
            raise ValueError("execution contract document has no digests (to_json writes them): corrupted or edited")
        return cls.from_dict(d)

    def check_compatible(self, other: "ExecutionContract | dict") -> None:
        """Raise ValueError unless `other` (a contract, or its to_dict() as it travels) computes
        the same bits as self (semantic + numerical)."""
        if isinstance(other, dict):
            other = ExecutionContract.from_dict(other)
        elif not isinstance(other, ExecutionContract):
            raise ValueError(f"contract must be an ExecutionContract or its dict, got {type(other).__name__}")
        bad = []
        for part in ("semantic", "numerical"):
            if self.digests[part] != other.digests[part]:
                a, b = getattr(self, part), getattr(other, part)
                # as the digests see them (1, 1.0 and true are three values there)
                keys = sorted(k for k in set(a) | set(b) if k not in a or k not in b or _digest(a[k]) != _digest(b[k]))
                bad.append(f"{part} differs in {keys}")
        if bad:
            raise ValueError("execution contracts are incompatible: " + "; ".join(bad))


def weights_layout_digest(model: torch.nn.Module) -> str:
    return _digest(sorted((n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()))


def build_contract(model: torch.nn.Module, spec: NumericsSpec, *, device: str | torch.device,
                   deployment: Mapping[str, Any] | None = None) -> ExecutionContract:
    """The contract of `model` (its own parsed config, `model.config`, a dataclass, is the
    semantic part, so a new architecture's fields enter it without changes here) run as
    `spec` says (dtype, numerics mode, kernel options, KV cache dtype, quantization) on
    `device`; the tensor-parallel tree is read from the model, as built. `deployment`: the
    caller's settings that must not change bits (the engine's batch limits, block size,
    bit-neutral kernel options, ...; the trainer's block size)."""
    if not isinstance(spec, NumericsSpec):
        raise ValueError(f"build_contract takes a NumericsSpec (vllm.config), got {type(spec).__name__}")
    if not dataclasses.is_dataclass(getattr(model, "config", None)):
        raise ValueError(f"{type(model).__name__}.config must be the model's config dataclass")
    dtype, numerics = spec.dtype, spec.numerics
    semantic = {
        **dataclasses.asdict(model.config),
        "dtype": str(dtype).replace("torch.", ""),
        "weights_layout": weights_layout_digest(model),
    }
    numerical = numerical_policy(spec, device)
    deployment = dict(deployment or {})
    # tensor parallelism (vllm/parallel/tensor_parallel.py): the K-leaf tree's G and rule are
    # numerical (None: the plain invariant GEMM); the size is bit-neutral in invariant mode,
    # while fast mode's plain partial sums depend on it
    tp = getattr(model, "tensor_parallel", None)
    numerical["row_parallel_tree"] = tp.policy() if tp is not None else None
    (deployment if numerics == "invariant" else numerical)["tensor_parallel_size"] = tp.size if tp is not None else 1
    if numerical.get("quantization") is not None:
        # which linear layers an FP8 checkpoint keeps in the model dtype (modules_to_not_convert)
        from vllm.layers.linear import Linear
        numerical["quantization"]["unquantized_linears"] = sorted(
            n for n, m in model.named_modules() if isinstance(m, Linear) and not m.fp8)
    layer_kernels = layer_kernel_policies(model, numerics, device)
    if layer_kernels:
        numerical["layer_kernels"] = layer_kernels
    states = recurrent_state_policies(model, numerics, dtype)
    if states:
        numerical["recurrent_states"] = states
    return ExecutionContract(semantic, numerical, deployment)


def recurrent_state_policies(model: torch.nn.Module, numerics: str, dtype: torch.dtype) -> dict:
    """What the recurrent layers keep per sequence under `numerics`, by kind: the grid their
    states are defined on and each state tensor's dtype. A state rounded to another dtype,
    or chunked on another grid, gives other bits; the layers' own declarations say which."""
    out: dict = {}
    for m in model.modules():
        if not hasattr(m, "cache_spec"):
            continue
        spec = m.cache_spec(numerics)
        if not hasattr(spec, "chunk_size"):
            continue  # a paged KV cache: its format is the kv_cache_dtype entry
        out[spec.kind] = {"chunk_size": spec.chunk_size,
                          "tensors": {t.name: str(t.dtype or dtype).replace("torch.", "") for t in spec.tensors}}
    return out


def layer_kernel_policies(model: torch.nn.Module, numerics: str, device: str | torch.device) -> dict:
    """Numerical entries for kernels that a layer runs outside the op shim (a grouped expert
    GEMM, say): every layer class of `model` that defines `kernel_policy(numerics, device)`
    names its own, once per class. They change bits as the GEMM's tiles do, and only the
    layer knows them; the model's config (the semantic part) cannot say how it is computed."""
    out: dict = {}
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        policy = getattr(cls, "kernel_policy", None)
        if policy is not None:
            out.update(policy(numerics, device))
    return out
