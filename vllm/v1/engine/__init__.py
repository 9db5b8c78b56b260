"""upstream vLLM's `vllm.v1.engine` import paths."""
