"""Results returned by the offline API, with upstream vLLM's names and shapes."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.logprobs import Logprob  # noqa: F401  (upstream's vllm.outputs name too)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None   # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    lora_request: None = None          # upstream's field (no adapters here)
    # The engine's weight versions this sample was computed under (more than one when a
    # weight update happened while it ran).
    weight_versions: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Fields in upstream's order (code that builds one positionally gets upstream's meaning)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt token
    # {token id: Logprob} holding that token and the top-k alternatives (upstream's shape)
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: None = None               # upstream's per-request stats object: none kept here
    lora_request: None = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    # prompt tokens whose KV came from the prefix cache when the request's first sample was
    # scheduled (upstream's field; the server's usage.prompt_tokens_details.cached_tokens)
    num_cached_tokens: int = 0
