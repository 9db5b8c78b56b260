"""Sampling: a batch-invariant, counter-based-RNG sampler (see docs/sampling.md)."""
from vllm.sample.rng import gumbel_noise, row_keys, uniform_noise
from vllm.sample.sampler import (
    LOGPROBS_MODES,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    TokenMask,
    apply_temperature,
    batch_invariant_log_softmax,
    stable_topk,
    tempered_logprobs,
)

__all__ = [
    "LOGPROBS_MODES",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "TokenMask",
    "apply_temperature",
    "batch_invariant_log_softmax",
    "gumbel_noise",
    "row_keys",
    "stable_topk",
    "tempered_logprobs",
    "uniform_noise",
]
