"""Executors: the seam between LLMEngine and the workers that hold the model and the KV cache."""
from vllm.executor.base import Executor, ExecutorInfo
from vllm.executor.in_process import InProcessExecutor

__all__ = ["Executor", "ExecutorInfo", "InProcessExecutor"]
