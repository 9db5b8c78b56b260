"""Upstream vLLM's path to the worker's model, `llm.llm_engine.model_executor.driver_worker
.model_runner.model` (and verl's `driver_worker.worker.model_runner.model`), for the one call
RL scripts make through it: `load_weights(weights)`. TRL's colocated sync makes it once per
parameter, older verl and OpenRLHF workers and many hand-written loops once per state dict.

Here each call is an `LLM.update_weights`: validated whole before anything is written,
versioned, the prefix cache dropped, refused while an app serves the LLM. Every other
attribute on the way is an AttributeError naming the ways in: a write through the model
object itself would skip the engine's versions and cached prefixes."""
from __future__ import annotations

import weakref
from typing import Callable

_WAYS_IN = ("this engine's worker is behind its executor; on upstream's path only "
            "model_executor.driver_worker.model_runner.model.load_weights(weights) is here (a versioned weight "
            "update). Change weights with llm.update_weights(weights), llm.weight_update() for buckets, "
            "update_weights_from_ipc or init_weight_transfer_engine; llm.collective_rpc(fn) runs a function on "
            "the worker (docs/architecture.md)")


class _Step:
    """One object on the path: `attrs` maps the next names to what they give."""

    def __init__(self, path: str, attrs: dict):
        self._path, self._attrs = path, attrs

    def __getattr__(self, name: str):
        attrs = self.__dict__.get("_attrs", {})
        if name in attrs:
            return attrs[name]
        raise AttributeError(f"{self.__dict__.get('_path', '')}.{name}: {_WAYS_IN}")

    def __repr__(self) -> str:
        return f"<{self._path}: upstream's path to load_weights>"


class UpstreamModel(_Step):
    """The end of the path: `load_weights(weights)` as a weight update."""

    def __init__(self, path: str, update: Callable):
        super().__init__(path, {})
        # a bound method held weakly: the engine holds this object, and the LLM the engine,
        # so a strong reference would keep a dropped LLM (and its caches) alive until a
        # collection
        self._update = weakref.WeakMethod(update) if hasattr(update, "__self__") else (lambda: update)

    def load_weights(self, weights) -> set[str]:
        """Write (HF name, tensor) pairs (a state dict's items, one parameter, ...) into the
        engine's model as one weight update; returns the names written, as upstream returns
        the names it loaded. A bad name, shape or value is a ValueError and changes nothing."""
        from vllm.weight_sync.session import _as_pairs, weight_mapping_of
        pairs = _as_pairs(weights)
        update = self._update()
        if update is None:
            raise ValueError("the LLM this engine belonged to is gone")
        # a tied model skips the names tied to another tensor (lm_head.weight to the embedding),
        # as upstream's loaders do: a trainer whose lm_head is its own tensor must not overwrite
        # the embedding with it
        engine = getattr(getattr(update, "__self__", None), "llm_engine", None)
        if engine is not None:
            tied = {a for a in weight_mapping_of(engine.executor.model).aliases if a.startswith("lm_head.")}
            pairs = [(name, t) for name, t in pairs if name not in tied]
        if pairs:
            update(pairs)
        return {name for name, _ in pairs}


def upstream_executor(update: Callable) -> _Step:
    """`model_executor` for an LLM whose `update_weights` is `update`."""
    root = "llm_engine.model_executor"
    model = UpstreamModel(f"{root}.driver_worker.model_runner.model", update)
    runner = _Step(f"{root}.driver_worker.model_runner", {"model": model})
    worker = _Step(f"{root}.driver_worker", {"model_runner": runner})
    worker._attrs["worker"] = worker  # verl's driver_worker.worker.model_runner
    return _Step(root, {"driver_worker": worker})
