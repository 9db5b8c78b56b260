"""Upstream vLLM's path to the worker's model, `llm.llm_engine.model_executor.driver_worker
.model_runner.model` (and verl's `driver_worker.worker.model_runner.model`), for the one call
RL scripts make through it: `load_weights(weights)`. TRL's colocated sync makes it once per
parameter, older verl and OpenRLHF workers and many hand-written loops once per state dict.

Here each call is an `LLM.update_weights`: validated whole before anything is written,
versioned, the prefix cache dropped, refused while an app serves the LLM. A generator is one
update written chunk by chunk as it yields (its tensors are never all alive at once), the
overwritten bytes kept until it ends, so a failure still leaves the previous weights. Every other
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
        the names it loaded. A bad name, shape or value is a ValueError and changes nothing.

        A generator (verl's FSDP sync yields each gathered full tensor once) is written as it
        arrives, STREAM_CHUNK_BYTES at a time, each chunk validated before it is written and
        the bytes it overwrites kept (on the device while it has room, else in host memory)
        until the update finishes: at most a chunk of the source is alive at once, as with
        upstream's loader, and a failure anywhere puts every written chunk back."""
        from vllm.weight_sync.session import _as_pairs, weight_mapping_of
        update = self._update()
        if update is None:
            raise ValueError("the LLM this engine belonged to is gone")
        # a tied model skips the names tied to another tensor (lm_head.weight to the embedding),
        # as upstream's loaders do: a trainer whose lm_head is its own tensor must not overwrite
        # the embedding with it
        llm = getattr(update, "__self__", None)
        engine = getattr(llm, "llm_engine", None)
        tied = set() if engine is None else \
            {a for a in weight_mapping_of(engine.executor.model).aliases if a.startswith("lm_head.")}
        if _is_stream(weights) and engine is not None and hasattr(llm, "weight_update") \
                and getattr(engine, "weight_update", None) is None:
            return _load_stream(llm, weights, tied)
        pairs = [(name, t) for name, t in _as_pairs(weights) if name not in tied]
        if pairs:
            update(pairs)
        return {name for name, _ in pairs}


# a streamed load_weights writes its pairs in chunks of about this many bytes
STREAM_CHUNK_BYTES = 256 << 20


def _is_stream(weights) -> bool:
    """An iterator (a generator): its tensors exist one at a time, so they are not collected."""
    try:
        return iter(weights) is weights
    except TypeError:
        return False


def _load_stream(llm, weights, tied: set[str]) -> set[str]:
    import contextlib

    from vllm.weight_sync.session import _as_pairs
    names: set[str] = set()
    with contextlib.ExitStack() as stack:
        update, chunk, size = None, [], 0
        for item in weights:
            (name, tensor), = _as_pairs([item])   # the same checks and messages as a list's items
            if name in tied:
                continue
            if update is None:   # opened at the first weight: an empty generator is no update
                update = stack.enter_context(llm.weight_update())
            chunk.append((name, tensor))
            names.add(name)
            size += tensor.numel() * tensor.element_size() if hasattr(tensor, "element_size") else 0   # a non-tensor: load names it
            if size >= STREAM_CHUNK_BYTES:
                update.load(chunk, retain=False)
                chunk, size = [], 0
        if chunk:
            update.load(chunk, retain=False)
    return names


def upstream_executor(update: Callable) -> _Step:
    """`model_executor` for an LLM whose `update_weights` is `update`."""
    root = "llm_engine.model_executor"
    model = UpstreamModel(f"{root}.driver_worker.model_runner.model", update)
    runner = _Step(f"{root}.driver_worker.model_runner", {"model": model})
    worker = _Step(f"{root}.driver_worker", {"model_runner": runner})
    worker._attrs["worker"] = worker  # verl's driver_worker.worker.model_runner
    return _Step(root, {"driver_worker": worker})
