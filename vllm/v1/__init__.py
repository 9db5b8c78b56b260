"""upstream vLLM's `vllm.v1` import paths for the names RL frameworks take from it."""
