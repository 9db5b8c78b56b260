"""upstream's `collective_rpc` by name, shared by the offline LLM (its worker in the caller's
process) and the engine core's process (AsyncLLM, `vllm serve`): the names that run as the
engine's own methods, and the message for a name that is none of them."""
from __future__ import annotations

from typing import Sequence

# run as the engine's own methods, so its record of the cache and of sleep stays true
ENGINE_RPC_METHODS = ("reset_prefix_cache", "sleep", "wake_up")


def check_rpc_args(args, kwargs) -> tuple[tuple, dict]:
    if not isinstance(args, (tuple, list)):
        raise ValueError(f"collective_rpc: args must be a tuple, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"collective_rpc: kwargs must be a dict or None, got {type(kwargs).__name__}")
    return tuple(args), dict(kwargs or {})


def unknown_rpc_message(name: str, worker_methods: Sequence[str]) -> str:
    return (f"collective_rpc: no method {name!r}; by name it calls "
            f"{sorted([*ENGINE_RPC_METHODS, 'reload_weights', *worker_methods])}, "
            "or pass a function called as fn(worker, *args, **kwargs). Weights change through llm.update_weights, "
            "weight_update, update_weights_from_ipc or init_weight_transfer_engine (versioned and checked), "
            "not through worker methods")
