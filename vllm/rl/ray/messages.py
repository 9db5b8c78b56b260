"""What crosses an actor boundary, as dataclasses (Ray pickles them; no dicts of loose keys).

Weight versions here are the trainer's sync count (`RayRollout.version`: 1 after the first
sync), not an engine's own counter: a restarted engine counts from 0 again, so only the
trainer's number says whether every rollout of a step was made with the same weights.
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm.rl.rollout import RolloutGroup


@dataclass(frozen=True)
class EngineSpec:
    """How to build one rollout engine: the arguments `vllm train` gives its in-process LLM
    (Trainer._build_colocated), so an engine actor is the same engine."""
    model_dir: str
    dtype: str
    device: str
    seed: int
    numerics: str
    max_model_len: int | None
    gpu_memory_utilization: float
    enforce_eager: bool
    load_format: str
    sleep: bool
    max_num_seqs: int
    torch_threads: int
    tensor_parallel_size: int = 1
    tp_leaves: int | None = None
    kv_cache_dtype: str = "auto"
    quantization: str | None = None

    @classmethod
    def from_config(cls, cfg, model_dir: str, device: str, sleep: bool, torch_threads: int) -> "EngineSpec":
        """`cfg`: a validated TrainConfig."""
        m, a = cfg.model, cfg.algorithm
        return cls(model_dir=model_dir, dtype=m.dtype, device=device, seed=cfg.run.seed, numerics=m.numerics,
                   max_model_len=m.max_model_len, gpu_memory_utilization=m.gpu_memory_utilization,
                   enforce_eager=m.enforce_eager, load_format=m.load_format, sleep=sleep,
                   max_num_seqs=max(1, min(512, a.prompts_per_step * a.group_size)), torch_threads=torch_threads,
                   tensor_parallel_size=m.tensor_parallel_size, tp_leaves=m.tp_leaves,
                   kv_cache_dtype=m.kv_cache_dtype, quantization=m.quantization)


@dataclass(frozen=True)
class EngineFault:
    """A crash to inject (fault tests): engine `engine` exits its process at the start of its
    `generate_call`-th generate call (1-based), in its first incarnation only, so the
    restarted actor runs normally."""
    engine: int
    generate_call: int

    def __post_init__(self):
        if self.engine < 0 or self.generate_call < 1:
            raise ValueError(f"EngineFault needs engine >= 0 and generate_call >= 1, got {self}")


@dataclass(frozen=True)
class EngineState:
    """An engine actor's answer to `describe()`."""
    index: int
    incarnation: str               # new for every start of the actor (Ray restarts included)
    pid: int
    node_ip: str
    restarted: bool                # this incarnation is a restart by Ray (max_restarts)
    weights_version: int | None    # trainer version of its weights; None: as loaded, never synced
    contract_json: str


@dataclass(frozen=True)
class EngineRollout:
    """An engine's groups for its share of a step's requests, with the trainer version its
    weights were at. `groups` is None when the engine refused because its weights were not
    at the version asked for (it was restarted since its last sync)."""
    groups: list[RolloutGroup] | None
    weights_version: int | None


@dataclass(frozen=True)
class EngineEvent:
    """A fault the trainer handled: `kind` is "died" (an engine call failed because the
    actor died), "restarted" (Ray brought it back; it was re-synced), "gone" (no restarts
    left: its prompts go to the others) or "stale" (its weights were behind: re-synced)."""
    engine: int
    kind: str
    detail: str

    def line(self) -> str:
        return f"rollout engine {self.engine} {self.kind}: {self.detail}"


def trainer_tp_leaves(tensor_parallel_size: int, tp_leaves: int | None) -> int | None:
    """The K-leaf tree the engines resolve from these knobs (8 leaves by default at TP > 1),
    which the trainer (TP=1) must run too: its own resolution of tp_leaves=None at TP=1
    would be no tree."""
    from vllm.config import ParallelConfig
    return ParallelConfig(tensor_parallel_size=tensor_parallel_size, tp_leaves=tp_leaves).leaves


@dataclass(frozen=True)
class TrainerSetup:
    """What the trainer actor needs besides the TrainConfig: the engines' slots in the plan."""
    model_dir: str
    tp_leaves: int | None              # the engines' K-leaf tree: the trainer (TP=1) runs the same
    engine_routes: tuple[str, ...]     # per engine: "ipc" | "broadcast" (placement.WEIGHT_ROUTES)
    sleep: bool                        # engines release their KV cache while the trainer runs
    torch_threads: int
    bucket_bytes: int
    engine_timeout_s: float            # how long a (re)starting engine may take to answer


def split_requests(n: int, engines: list[int]) -> dict[int, list[int]]:
    """Request indices 0..n-1 cut into contiguous shares, one per engine in the given order
    (the first n % len(engines) engines get one more): a pure function of (n, engines), so
    a rerun splits the same way. Results are put back by index, so the split never changes
    what the step sees."""
    if not engines:
        raise ValueError("no rollout engine is alive to take the requests")
    k = len(engines)
    out, start = {}, 0
    for j, e in enumerate(engines):
        size = n // k + (1 if j < n % k else 0)
        out[e] = list(range(start, start + size))
        start += size
    return {e: idx for e, idx in out.items() if idx}
