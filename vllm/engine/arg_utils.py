"""upstream vLLM's `EngineArgs` / `AsyncEngineArgs` (`vllm.engine.arg_utils`): the keyword
arguments an engine is built from, as `LLM(**kwargs)` takes them. RL frameworks build one and
hand it to `AsyncLLM.from_engine_args`; a field is read and set as an attribute. Only what
`LLM` accepts builds an engine (an unknown name is refused there, by name)."""
from __future__ import annotations

from typing import Any


class EngineArgs:
    """`EngineArgs(model=..., tensor_parallel_size=..., ...)`: LLM's keyword arguments."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.__dict__["_kwargs"] = {"model": model, **kwargs} if model is not None else dict(kwargs)

    def __getattr__(self, name: str) -> Any:
        kwargs = self.__dict__["_kwargs"]
        if name in kwargs:
            return kwargs[name]
        raise AttributeError(f"{type(self).__name__} has no {name!r} set (its fields are the keyword arguments "
                             f"given: {sorted(kwargs)}; unset ones take LLM's defaults)")

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__["_kwargs"][name] = value

    def to_kwargs(self) -> dict[str, Any]:
        """The keyword arguments, as LLM(**kwargs) and AsyncLLM.from_engine_args take them."""
        return dict(self.__dict__["_kwargs"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__['_kwargs'].items())})"


class AsyncEngineArgs(EngineArgs):
    """upstream's async variant: the same arguments."""
