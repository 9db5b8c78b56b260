"""upstream vLLM's `vllm.distributed.parallel_state` names that RL frameworks call when they
tear an engine down (verl, OpenRLHF: `destroy_model_parallel()` then
`destroy_distributed_environment()` before dropping an LLM). This engine's tensor
parallelism runs inside one worker with no global process groups (docs/parallelism.md), so
there is nothing global to destroy: both are no-ops, and an engine's memory goes with its
LLM object."""


def destroy_model_parallel() -> None:
    """Nothing to destroy: no global model-parallel groups here."""


def destroy_distributed_environment() -> None:
    """Nothing to destroy: the engine creates no global process group (a weight-sync group
    belongs to its LLM and closes with it)."""


def get_tensor_model_parallel_world_size() -> int:
    """1: an LLM's tensor-parallel partitions run inside its one worker, not as ranks."""
    return 1


def get_tensor_model_parallel_rank() -> int:
    return 0
