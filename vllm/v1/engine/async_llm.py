"""upstream vLLM's import path of AsyncLLM (`from vllm.v1.engine.async_llm import AsyncLLM`):
this engine's AsyncLLM (vllm/entrypoints/openai/async_engine.py), the engine core in its own
process behind it."""
from vllm.entrypoints.openai.async_engine import AsyncLLM

__all__ = ["AsyncLLM"]
