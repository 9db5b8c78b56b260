"""The execution contract: every choice that can change a logprob's bits, in one
serializable document with SHA-256 digests.

Three parts, each hashed separately (canonical JSON: sorted keys, no spaces):
- semantic: the logical model (architecture, dims, dtype, vocabulary, rope, eps,
  tied embeddings, a digest of the weights' names and shapes);
- numerical: everything that changes bits (numerics mode, device kind and
  compute capability, torch/triton versions, each kernel and its version, tile
  and split sizes, accumulation dtypes, quantization rule, sampler rules and
  tie-breaking, logprobs definition);
- deployment: everything that must NOT change bits in invariant mode (batch
  limits, block size, memory fraction, prefix caching, CUDA graph sizes).

Rollout and trainer exchange contracts before a weight sync and refuse to go on
when the semantic or numerical digests differ (`check_compatible`).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def device_kind(device: str | torch.device) -> dict:
    dev = torch.device(device)
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        return {"type": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}",
                "cuda": torch.version.cuda}
    return {"type": dev.type, "threads": torch.get_num_threads()}


def numerical_policy(numerics: str, device: str | torch.device, dtype: torch.dtype, block_size: int) -> dict:
    import triton

    from vllm.kernels import attention as attn
    from vllm.kernels import matmul
    from vllm.kernels.invariant import KERNEL_VERSION

    dev = torch.device(device)
    gpu = dev.type == "cuda"
    policy = {
        "numerics": numerics,
        "device": device_kind(dev),
        "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__.split("+")[0],
        "triton": triton.__version__,
        "kernel_version": KERNEL_VERSION,
        "quantization": None,
        "kv_cache_dtype": str(dtype).replace("torch.", ""),
        "sampler": {"rng": "counter-hash(seed, position, token_id) -> gumbel-max",
                    "ties": "lowest token id", "sort": "stable descending",
                    "float_reductions": "fixed pairwise order over the row"},
        "logprobs": "float32 log_softmax(logits / T) over the full vocabulary (T=0 -> 1), before truncation",
    }
    if numerics == "invariant":
        policy["gemm"] = ({"kernel": "triton invariant_matmul", "form": "acc = tl.dot(a, b, acc)",
                           "k_split_size": matmul.K_SPLIT_SIZE, "split_merge": "float32, ascending, p0 first",
                           "accumulate": "float32", "k_order": "ascending",
                           "tiles_by_M": matmul.GPU_CONFIGS, "tiles_by_M_wide": matmul.GPU_CONFIGS_WIDE,
                           "tuned_tables_sha256": matmul.tuned_tables_digest(),
                           "cublaslt": _cublaslt_policy(matmul)}
                          if gpu else {"kernel": "torch F.linear one row at a time", "accumulate": "backend"})
        policy["norm"] = "triton one row per program, BLOCK by hidden size" if gpu else "torch one row at a time"
        policy["lm_head"] = "invariant gemm, float32 output"
    else:
        policy["gemm"] = {"kernel": "torch F.linear (cuBLAS / CPU BLAS)", "batch_invariant": False}
        policy["norm"] = "torch"
        policy["lm_head"] = "F.linear in model dtype, then float32"
    policy["attention"] = {
        "kernel": "triton paged_attention" if gpu else "torch paged_attention_torch",
        "kv_tile": getattr(attn, "KV_TILE", None), "kv_split_size": getattr(attn, "KV_SPLIT_SIZE", None),
        "merge": "ascending splits, fixed formula", "accumulate": "float32",
        "fast_prefill": "torch varlen flash attention" if (gpu and numerics == "fast") else None,
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
        c = cls(d["semantic"], d["numerical"], d["deployment"])
        if "digests" in d and d["digests"] != c.digests:
            raise ValueError("execution contract digests do not match its content (corrupted or edited)")
        return c

    @classmethod
    def from_json(cls, s: str) -> "ExecutionContract":
        return cls.from_dict(json.loads(s))

    def check_compatible(self, other: "ExecutionContract") -> None:
        """Raise ValueError unless `other` computes the same bits as self (semantic + numerical)."""
        bad = []
        for part in ("semantic", "numerical"):
            if self.digests[part] != other.digests[part]:
                a, b = getattr(self, part), getattr(other, part)
                keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                bad.append(f"{part} differs in {keys}")
        if bad:
            raise ValueError("execution contracts are incompatible: " + "; ".join(bad))


def weights_layout_digest(model: torch.nn.Module) -> str:
    return _digest(sorted((n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()))


def build_contract(config, model: torch.nn.Module) -> ExecutionContract:
    mc = config.model
    semantic = {
        "architecture": mc.architecture, "vocab_size": mc.vocab_size, "hidden_size": mc.hidden_size,
        "intermediate_size": mc.intermediate_size, "num_hidden_layers": mc.num_hidden_layers,
        "num_attention_heads": mc.num_attention_heads, "num_key_value_heads": mc.num_key_value_heads,
        "head_dim": mc.head_dim, "rms_norm_eps": mc.rms_norm_eps, "rope_theta": mc.rope_theta,
        "rope_scaling": vars(mc.rope_scaling), "tie_word_embeddings": mc.tie_word_embeddings,
        "qkv_bias": mc.qkv_bias, "qk_norm": mc.qk_norm, "dtype": str(config.dtype).replace("torch.", ""),
        "weights_layout": weights_layout_digest(model), "tensor_parallel_size": 1,
    }
    numerical = numerical_policy(config.numerics, config.device, config.dtype, config.cache.block_size)
    # architecture-specific entries (e.g. MoE routing fields and kernels), named by the model
    contract_extra = getattr(model, "contract_extra", None)
    if contract_extra is not None:
        extra_semantic, extra_numerical = contract_extra(config.numerics, config.device)
        semantic.update(extra_semantic)
        numerical.update(extra_numerical)
    deployment = {
        "max_num_seqs": config.scheduler.max_num_seqs, "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "enable_chunked_prefill": config.scheduler.enable_chunked_prefill, "block_size": config.cache.block_size,
        "gpu_memory_utilization": config.cache.gpu_memory_utilization,
        "enable_prefix_caching": config.cache.enable_prefix_caching, "enforce_eager": config.enforce_eager,
        "cuda_graph_batch_sizes": config.cuda_graph_batch_sizes, "max_model_len": config.model.max_model_len,
        "seed": config.seed,
    }
    return ExecutionContract(semantic, numerical, deployment)
