"""Configuration dataclasses: what the user asked for, resolved once at start-up.

`ModelConfig` describes the logical model (read from an HF `config.json`),
`CacheConfig`/`SchedulerConfig` the engine's resources, `NumericsSpec` every choice
that changes how the numbers are computed (shared by engine and trainer), and
`EngineConfig` bundles them. Every field that can change numerics is also recorded in
the execution contract (docs/numerics.md).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.sampling_params import DEFAULT_LOGPROBS_MODE, DEFAULT_MAX_LOGPROBS, check_logprobs_mode

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

NUMERICS_MODES = ("fast", "invariant")
# "fcfs": waiting requests are admitted in arrival order; "priority": by (priority, arrival),
# lower priority values first, and KV pressure preempts the running request that sorts last
SCHEDULING_POLICIES = ("fcfs", "priority")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
QUANTIZATIONS = (None, "fp8")


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """'auto' (the model dtype) or 'fp8' (float8_e4m3fn with a per-token-per-head scale,
    vllm/kernels/fp8.py); 'fp8_e4m3' is accepted as an alias. Returns the canonical name."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return "fp8" if kv_cache_dtype.startswith("fp8") else "auto"


def check_quantization(quantization: str | None) -> str | None:
    """None (linear layers in the model dtype) or 'fp8' (block-scaled FP8 GEMMs, docs/fp8.md)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    return quantization


def default_model_path() -> str:
    """The embedded default model shipped inside the package."""
    return os.path.join(os.path.dirname(__file__), "default_model")


def resolve_dtype(dtype: str | torch.dtype | None, device: str, hf_dtype: str | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        # Checkpoint dtype on GPU (bf16 when the checkpoint names none); float32 on CPU,
        # where bf16 matmuls are slow and tests want tight agreement with transformers.
        if device == "cpu":
            return torch.float32
        return _DTYPES.get(str(hf_dtype or "bfloat16"), torch.bfloat16)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(set(_DTYPES))} or 'auto'")
    return _DTYPES[dtype]


def generation_defaults_of(gen: dict) -> dict[str, Any]:
    """The sampling defaults a generation_config.json's values set (SamplingParams' names)."""
    defaults = {key: gen[key] for key in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty") if key in gen}
    if isinstance(gen.get("max_new_tokens"), int):  # the server's max_tokens when a request leaves it unset
        defaults["max_tokens"] = gen["max_new_tokens"]
    return defaults


def load_generation_defaults(folder: str) -> dict[str, Any]:
    """generation_defaults_of FOLDER/generation_config.json (`vllm serve --generation-config
    FOLDER`); ValueError, one line, when the folder has none or it is not a JSON object."""
    path = os.path.join(folder, "generation_config.json")
    try:
        with open(path) as f:
            gen = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--generation-config {folder}: the folder has no generation_config.json") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"--generation-config {folder}: cannot read {path}: {err}") from None
    if not isinstance(gen, dict):
        raise ValueError(f"--generation-config {folder}: {path} is not a JSON object")
    return generation_defaults_of(gen)


class HFConfig(dict):
    """config.json as read: a dict, whose keys also read as attributes (upstream vLLM's
    `model_config.hf_config.vocab_size`); a nested object reads the same way."""

    def __getattr__(self, name: str):
        try:
            value = self[name]
        except KeyError:
            raise AttributeError(f"config.json has no {name!r}") from None
        return HFConfig(value) if type(value) is dict else value


class NumericsSpecFields:
    """The fields of the holder's `numerics_spec`, by their own names (EngineConfig, the
    trainer's Policy, and an engine's ModelConfig, where upstream code reads `dtype`):
    read-only, so the spec stays the one value."""
    numerics_spec: "NumericsSpec"

    @property
    def dtype(self) -> torch.dtype:
        return self.numerics_spec.dtype

    @property
    def numerics(self) -> str:
        return self.numerics_spec.numerics

    @property
    def kernels(self) -> "KernelConfig":
        return self.numerics_spec.kernels

    @property
    def kv_cache_dtype(self) -> str:
        return self.numerics_spec.kv_cache_dtype

    @property
    def quantization(self) -> str | None:
        return self.numerics_spec.quantization

    @property
    def parallel(self) -> "ParallelConfig":
        return self.numerics_spec.parallel


def resolve_model_dir(path: str) -> str:
    """A checkpoint directory, or a hub id ("org/name") whose snapshot is already in the local
    Hugging Face cache (HF_HOME / HF_HUB_CACHE; what `AutoModel.from_pretrained(id)` downloaded
    there, and what TRL passes as `model.name_or_path`): its snapshot directory. Nothing is
    downloaded. ValueError otherwise."""
    if os.path.isdir(path):
        return path
    if isinstance(path, str) and path.count("/") == 1 and not path.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download
            return snapshot_download(path, local_files_only=True)
        except Exception:  # noqa: BLE001 -- not cached (or no huggingface_hub): the message below
            pass
    raise ValueError(f"model path {path!r} is not a directory, nor a hub id in the local Hugging Face cache (no model "
                     "hub is reachable: pass a local HF checkpoint directory)")


@dataclass
class ModelConfig(NumericsSpecFields):
    """The checkpoint as the engine sees it: where it is, which model class reads it, and
    the fields every causal LM has (vocabulary, context, dtype, eos and generation defaults).

    Architecture-specific fields (dims, norms, rope, biases, experts ...) are not read
    here: the model class parses `hf_config` itself (its `config_class.from_hf`, see
    `vllm.model_loader.build`), so adding an architecture changes nothing in this file.

    Upstream vLLM's names that code written for its `llm_engine.model_config` reads:
    `max_model_len`, `model` (the checkpoint path), `hf_config` (attribute access),
    `get_vocab_size()`, and, once an engine has resolved its numerics (EngineConfig binds
    them), `dtype` and `quantization`.
    """
    path: str
    architecture: str
    vocab_size: int
    max_position_embeddings: int
    torch_dtype: str | None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)  # config.json as read
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    max_model_len: int = 0
    max_model_len_given: bool = False   # the user's (checked against the KV cache), not the model's default

    def __post_init__(self) -> None:
        if not isinstance(self.hf_config, HFConfig):
            self.hf_config = HFConfig(self.hf_config)

    @property
    def model(self) -> str:
        """upstream's name for the checkpoint's path."""
        return self.path

    def get_vocab_size(self) -> int:
        """upstream's name: the logits' width."""
        return self.vocab_size

    @property
    def numerics_spec(self) -> "NumericsSpec":
        spec = self.__dict__.get("_numerics_spec")
        if spec is None:
            raise AttributeError("this ModelConfig's numerics are not resolved yet (an engine's EngineConfig binds them)")
        return spec

    def bind_numerics(self, spec: "NumericsSpec") -> None:
        """The numerics the engine resolved for this model (its dtype, quantization, ...)."""
        self.__dict__["_numerics_spec"] = spec

    @classmethod
    def from_pretrained(cls, path: str, max_model_len: int | None = None) -> "ModelConfig":
        path = resolve_model_dir(path)
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"model directory {path!r} has no config.json")
        with open(cfg_path) as f:
            hf = json.load(f)
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError(f"{cfg_path} names no 'architectures'")
        if "vocab_size" not in hf:
            raise ValueError(f"{cfg_path} has no 'vocab_size'")
        eos = hf.get("eos_token_id")
        gen_defaults: dict[str, Any] = {}
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
            if gen.get("eos_token_id") is not None:
                eos = gen["eos_token_id"]
            gen_defaults = generation_defaults_of(gen)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        max_pos = hf.get("max_position_embeddings", 4096)
        mc = cls(
            path=path,
            architecture=archs[0],
            vocab_size=hf["vocab_size"],
            max_position_embeddings=max_pos,
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            hf_config=hf,
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            generation_defaults=gen_defaults,
        )
        mc.limit_context(max_model_len)
        return mc

    def limit_context(self, max_model_len: int | None, max_positions: int | None = None) -> None:
        """Set the context: `max_model_len` (None: the model's), at most `max_positions`, the
        positions the model covers (None: config.json's max_position_embeddings; the model
        class knows more, e.g. a linear rope scaling's longer reach: vllm.model_loader.build)."""
        if max_positions is not None:
            self.max_position_embeddings = max_positions
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                          or max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2 (a prompt token and a generated one), got "
                             f"{max_model_len!r}")
        if max_model_len is not None and max_model_len > self.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the {self.max_position_embeddings} positions the "
                             "model covers (max_position_embeddings, with its rope scaling)")
        self.max_model_len = max_model_len or self.max_position_embeddings
        self.max_model_len_given = max_model_len is not None


@dataclass
class CacheConfig:
    """The KV cache's resources. `cache_dtype` (upstream's name) reads the engine's resolved
    KV cache dtype ("auto" or "fp8") once EngineConfig has bound its numerics."""
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks: int | None = None     # override the memory-derived size (tests use it to force preemption)
    cpu_kv_cache_bytes: int = 512 << 20   # KV budget on CPU
    enable_prefix_caching: bool = True
    # sleep()/wake_up(): release the KV cache's memory while a colocated trainer runs.
    # On CUDA the cache then lives in a driver VMM region (same address after wake).
    enable_sleep_mode: bool = False
    # Models with recurrent layers: prefix-cache snapshots of their states (one per cached
    # prompt, at its last multiple of the states' chunk size). None: max(1, max_num_seqs // 4)
    # (at least 1) with prefix caching on, 0 with it off.
    num_state_snapshots: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.num_state_snapshots is not None and self.num_state_snapshots < 0:
            raise ValueError(f"num_state_snapshots must be >= 0, got {self.num_state_snapshots}")
        if self.num_gpu_blocks is not None and (isinstance(self.num_gpu_blocks, bool)
                                                or not isinstance(self.num_gpu_blocks, int) or self.num_gpu_blocks < 2):
            raise ValueError("num_gpu_blocks_override must be an integer >= 2 (block 0 is reserved: the padding "
                             f"slots write there), got {self.num_gpu_blocks!r}")

    @property
    def cache_dtype(self) -> str:
        spec = self.__dict__.get("_numerics_spec")
        if spec is None:
            raise AttributeError("this CacheConfig's KV cache dtype is not resolved yet (an engine's EngineConfig binds it)")
        return spec.kv_cache_dtype

    def bind_numerics(self, spec: "NumericsSpec") -> None:
        """The numerics the engine resolved (cache_dtype reads its KV cache dtype)."""
        self.__dict__["_numerics_spec"] = spec

    def state_snapshots(self, max_num_seqs: int) -> int:
        """Snapshot slots for recurrent states (0 when prefix caching is off)."""
        if not self.enable_prefix_caching:
            return 0
        return self.num_state_snapshots if self.num_state_snapshots is not None else max(1, max_num_seqs // 4)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0 = no per-request cap below the step budget
    # upstream's scheduling policies (SCHEDULING_POLICIES); both only reorder requests, so a
    # token's bits are the same under either
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "long_prefill_token_threshold" else 1):
                raise ValueError(f"{name} must be an integer >= {0 if name == 'long_prefill_token_threshold' else 1}, "
                                 f"got {v!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")


@dataclass(frozen=True)
class KernelConfig:
    """Kernel options a user may change. None changes a bit in invariant mode (each is
    measured and tested to compute the same bits); the execution contract still names the
    ones that change which library computes (numerical part) and lists the rest with the
    deployment choices."""
    # Invariant GEMM on CUDA: the M buckets the tuned table assigns to cuBLASLt run there with
    # split-K forbidden (bit-equal to the Triton kernel, re-checked at start-up); off: those
    # buckets run their Triton fallback. FP8 linears likewise: from fp8_gemm.CUBLASLT_MIN_M
    # rows cuBLASLt's block-scaled GEMM where proved bit-equal per weight shape; off: Triton
    # only. Numerical part of the contract (cuBLASLt's version).
    gemm_cublaslt: bool = True
    # Sampling on CUDA: rows without top-k/top-p/min-p take one fused noise + argmax kernel
    # (its scores equal the unfused path's bit for bit). Deployment part of the contract.
    fused_gumbel: bool = True


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (vllm/parallel/tensor_parallel.py; docs/parallelism.md).

    `tensor_parallel_size` C: ranks sharing every layer (today all in the engine's process,
    on its one device: TP=C's bits, not its memory split). `tp_leaves` G: row-parallel GEMMs
    (o_proj, down_proj, the MoE down projection) cut K into G leaves added in a fixed float32
    tree, so every C dividing G gives the same bits (numerical part of the contract). None:
    no tree (the plain invariant GEMM) at C=1, and DEFAULT_TP_LEAVES at C>1; a trainer at C=1
    that must match a TP>1 engine sets the engine's G."""
    tensor_parallel_size: int = 1
    tp_leaves: int | None = None

    def __post_init__(self) -> None:
        C, G = self.tensor_parallel_size, self.tp_leaves
        if not isinstance(C, int) or isinstance(C, bool) or C < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {C!r}")
        if G is not None and (not isinstance(G, int) or isinstance(G, bool) or G < 1 or G & (G - 1)):
            raise ValueError(f"tp_leaves must be a power of two >= 1, got {G!r}")
        if G is not None and G < C:
            raise ValueError(f"tp_leaves={G} must be >= tensor_parallel_size={C} (each rank owns a subtree)")
        if G is not None and G % C:
            raise ValueError(f"tensor_parallel_size={C} must divide tp_leaves={G}")

    @property
    def leaves(self) -> int | None:
        """G as applied: None when no tree runs."""
        if self.tp_leaves is not None:
            return self.tp_leaves
        return max(DEFAULT_TP_LEAVES, self.tensor_parallel_size) if self.tensor_parallel_size > 1 else None


DEFAULT_TP_LEAVES = 8

_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class NumericsSpec:
    """Every choice that decides how a model's numbers are computed, resolved and validated
    once where the user's options enter (LLM, Policy.from_pretrained: through
    vllm.model_loader.build.resolve_numerics) and carried whole to the model build, the
    forward context's options and the execution contract, so engine and trainer cannot
    canonicalise them differently.

    `dtype`: the model dtype (resolved: never "auto"). `numerics`: "invariant" or "fast".
    `kernels`: the kernel options. `kv_cache_dtype`: "auto" (the model dtype) or "fp8"
    (float8_e4m3fn + a float32 scale per token per kv head, dequantized on every read;
    "fp8_e4m3" is read as "fp8"). `quantization`: None or "fp8" (block-scaled FP8 linear
    layers, docs/fp8.md). `parallel`: the tensor-parallel size and the row-parallel K-leaf
    tree, applied when the model is built (the contract reads the tree from the model)."""
    dtype: torch.dtype
    numerics: str = "invariant"
    kernels: KernelConfig = field(default_factory=KernelConfig)
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.dtype not in _MODEL_DTYPES:
            raise ValueError(f"NumericsSpec.dtype must be one of {[str(d) for d in _MODEL_DTYPES]} "
                             f"(resolve 'auto' first: vllm.config.resolve_dtype), got {self.dtype!r}")
        if self.numerics not in NUMERICS_MODES:
            raise ValueError(f"numerics must be one of {NUMERICS_MODES}, got {self.numerics!r}")
        if not isinstance(self.kernels, KernelConfig):
            raise ValueError(f"kernels must be a KernelConfig, got {type(self.kernels).__name__}")
        if not isinstance(self.parallel, ParallelConfig):
            raise ValueError(f"parallel must be a ParallelConfig, got {type(self.parallel).__name__}")
        object.__setattr__(self, "kv_cache_dtype", check_kv_cache_dtype(self.kv_cache_dtype))
        object.__setattr__(self, "quantization", check_quantization(self.quantization))


@dataclass
class EngineConfig(NumericsSpecFields):
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str
    # dtype, numerics mode ("invariant": logprobs match the trainer's bit for bit, the
    # product; "fast": the measured plain-speed baseline, docs/numerics.md), kernel options,
    # KV cache dtype, quantization, tensor parallelism
    numerics_spec: NumericsSpec
    seed: int = 0
    enforce_eager: bool = False
    tokenizer: str | None = None
    cuda_graph_batch_sizes: list[int] = field(default_factory=list)
    load_format: str = "safetensors"   # "dummy": random weights of the config's shapes (benchmarks)
    # Overlap the host work of step N+1 with the GPU's step N. None = on for CUDA (same
    # tokens and bits as the synchronous loop, ~10% more throughput on the H200), off
    # on CPU, where there is no device queue to overlap with.
    async_scheduling: bool | None = None
    # Synchronise at every step phase and accumulate wall time per phase in the runner's
    # `timings` (diagnostics for benchmarks: the syncs cost throughput).
    step_profile: bool = False
    # quantization="fp8" only. False: FP8 layers keep only their fp8 copy (about half the
    # weight memory, left to the KV cache); for rollout-only engines: no trainer can run
    # over this engine's model, weight sync quantizes the tensors it receives. Same bits.
    keep_master_weights: bool = True
    # what logprobs report for a request whose SamplingParams leave logprobs_mode unset
    # (one of vllm.sampling_params.LOGPROBS_MODES; upstream's engine argument)
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE
    # the most logprobs / prompt_logprobs per token an offline request may ask for (upstream's
    # engine argument and default; -1: the whole vocabulary). The server checks its own
    # --max-logprobs.
    max_logprobs: int = DEFAULT_MAX_LOGPROBS

    def __post_init__(self) -> None:
        check_logprobs_mode(self.logprobs_mode)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0 or -1 (the whole vocabulary), got {self.max_logprobs!r}")
        if not isinstance(self.numerics_spec, NumericsSpec):
            raise ValueError(f"numerics_spec must be a NumericsSpec, got {type(self.numerics_spec).__name__}")
        sizes = self.cuda_graph_batch_sizes
        if not isinstance(sizes, list) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
            raise ValueError(f"cuda_graph_batch_sizes must be a list of integers >= 1, got {sizes!r}")
        if not self.keep_master_weights and self.quantization is None:
            raise ValueError("keep_master_weights=False needs quantization='fp8': only FP8 layers have a copy to keep")
        if self.async_scheduling is None:
            self.async_scheduling = str(self.device).startswith("cuda")
        if self.scheduler.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.scheduler.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if not self.scheduler.enable_chunked_prefill and self.scheduler.max_num_batched_tokens < self.model.max_model_len:
            raise ValueError("without chunked prefill max_num_batched_tokens must be >= max_model_len")
        if not 0.0 < self.cache.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        # upstream code reads the resolved dtype from model_config and the KV cache dtype from
        # cache_config: both read this spec (nothing is copied)
        self.model.bind_numerics(self.numerics_spec)
        self.cache.bind_numerics(self.numerics_spec)

    # upstream's VllmConfig names for the parts (read-only: the same objects)
    @property
    def model_config(self) -> ModelConfig:
        return self.model

    @property
    def cache_config(self) -> CacheConfig:
        return self.cache

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.scheduler
