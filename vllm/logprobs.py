"""Logprob entries as RequestOutputs carry them (upstream vLLM's `vllm.logprobs`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """One token's value in a logprob entry: its logprob under the request's logprobs_mode,
    its rank (1 + the number of tokens with a strictly greater value; the position, best
    first, for a top-k alternative) and its decoded text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per prompt token {token id: Logprob} (None for the first token, which nothing predicts)
PromptLogprobs = list[dict[int, Logprob] | None]
# per output token {token id: Logprob}: the sampled token and the top-k alternatives
SampleLogprobs = list[dict[int, Logprob]]
