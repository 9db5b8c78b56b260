"""OpenAI-compatible serving: `vllm serve` (see docs/serving.md).

Modules: protocol (pydantic request/response models), async_engine (AsyncLLM:
one engine thread behind an asyncio API), api_server (the FastAPI app).
Nothing is imported here, so `import vllm.entrypoints.openai.protocol` does
not pull in torch or FastAPI.
"""
