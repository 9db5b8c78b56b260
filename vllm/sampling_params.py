"""SamplingParams: upstream vLLM's names and defaults, validated on construction."""
from __future__ import annotations

import copy
import math
import numbers
import warnings
from dataclasses import dataclass

from vllm.structured_outputs import StructuredOutputsParams

# positive temperatures below this are raised to it (upstream's floor)
MIN_TEMPERATURE = 0.01
# What logprobs report (docs/sampling.md). upstream vLLM's four modes, with its meanings: raw
# is before any logits processing (penalties, grammar masks, temperature, truncation),
# processed after all of it; tempered_logprobs is this engine's own.
LOGPROBS_MODES = (
    "tempered_logprobs",   # log_softmax(logits / T), full vocab, before truncation and grammar masks (T == 0 -> T = 1)
    "raw_logprobs",        # log_softmax(logits)
    "raw_logits",          # logits as given
    "processed_logprobs",  # log_softmax of the truncated tempered logits (masked tokens -inf; grammar masks too)
    "processed_logits",    # the truncated tempered logits (masked tokens -inf; grammar masks too)
)
# An engine's logprobs_mode unless it is given one (LLM(logprobs_mode=...), vllm serve
# --logprobs-mode): the sampling distribution, which the trainer recomputes bit for bit.
# upstream's default is raw_logprobs, which ignores the temperature the tokens were drawn with.
DEFAULT_LOGPROBS_MODE = "tempered_logprobs"


def check_logprobs_mode(mode) -> None:
    """ValueError naming the valid modes unless `mode` is one (a request's or an engine's)."""
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {mode!r}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # 0 or -1: disabled
    min_p: float = 0.0
    # Penalties on the raw logits, from this request's own output tokens (upstream's
    # semantics, docs/sampling.md): presence/frequency subtract, repetition divides
    # positive logits (multiplies negative ones) of tokens seen in the prompt or output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None         # None: none; 0: the sampled token's; k: plus the top-k alternatives
    # None: none; k >= 0: per prompt token after the first, its logprob (and rank) plus the
    # top-k alternatives, under the same logprob head as the sampled tokens (docs/sampling.md,
    # docs/serving.md)
    prompt_logprobs: int | None = None
    # one of LOGPROBS_MODES; None: the engine's (its logprobs_mode, DEFAULT_LOGPROBS_MODE
    # unless it was given one), set when the request is queued
    logprobs_mode: str | None = None
    skip_special_tokens: bool = True
    # upstream's; only slow tokenizers put spaces between special tokens, and every tokenizer
    # here is a fast one (as in upstream, where it then changes nothing either)
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # Constrain the output to a JSON schema, regex, choice or grammar (None: free)
    structured_outputs: "StructuredOutputsParams | None" = None

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            # as upstream: logits / 1e-40 overflow to infinity (a NaN distribution, a draw
            # that is not the greedy token)
            warnings.warn(f"temperature {self.temperature} is below {MIN_TEMPERATURE} and is raised to it "
                          "(temperature=0 is greedy)", stacklevel=3)
            self.temperature = MIN_TEMPERATURE
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is None:
            self.top_k = 0
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        self.top_k = int(self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or not isinstance(self.prompt_logprobs, int)
                                                 or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be None or an integer >= 0, got {self.prompt_logprobs!r}")
        if self.logprobs_mode is not None:
            check_logprobs_mode(self.logprobs_mode)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.seed is not None and not -2 ** 63 <= self.seed < 2 ** 63:
            # the sampler keys its noise by a signed 64-bit seed; a larger one would fail
            # inside the step, with every request of the batch
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}")
        if self.seed == -1:  # upstream's "no seed"
            self.seed = None
        # upstream's normal form: lists, read where they are used (a field set after
        # construction, as RL frameworks do per batch, takes effect)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative ints")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched in the output text)")
        self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        if self.structured_outputs is not None and self.min_tokens > 0:
            # the eos ban of min_tokens and a complete grammar (which allows only eos) would
            # leave no token to sample
            raise ValueError("min_tokens cannot be combined with structured_outputs")

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def clone(self) -> "SamplingParams":
        """A deep copy (upstream's name)."""
        return copy.deepcopy(self)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
