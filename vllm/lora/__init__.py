"""LoRA: not supported by this engine. `vllm.lora.request.LoRARequest` exists so code written for
upstream vLLM that imports it (verl's rollout does, at module level) imports unchanged; passing
one to `generate` / `chat` is a ValueError."""
