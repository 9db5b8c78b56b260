"""SamplingParams: upstream vLLM's names and defaults, validated on construction."""
from __future__ import annotations

import copy
import enum
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any

from vllm.structured_outputs import StructuredOutputsParams

# positive temperatures below this are raised to it (upstream's floor)
MIN_TEMPERATURE = 0.01
# a temperature below this is greedy (upstream's _SAMPLING_EPS): top_p, top_k and min_p are reset
_SAMPLING_EPS = 1e-5
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


# logit_bias values are clamped to this range, as OpenAI specifies and upstream vLLM does
MAX_LOGIT_BIAS = 100.0
# upstream's default cap on logprobs / prompt_logprobs per token (LLM(max_logprobs=...),
# vllm serve --max-logprobs); -1: no cap below the vocabulary
DEFAULT_MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """upstream's: what each RequestOutput of a streamed request holds. The offline LLM returns
    each request's final output only, which is what CUMULATIVE (the default: everything so far)
    and FINAL_ONLY both give; DELTA is refused there (LLM.generate)."""
    CUMULATIVE = 0   # the whole output so far
    DELTA = 1        # only what is new since the last output
    FINAL_ONLY = 2   # no intermediate outputs


def check_max_logprobs(params: "SamplingParams", max_logprobs: int, vocab_size: int) -> None:
    """upstream's rule for logprobs and prompt_logprobs against an engine's max_logprobs: -1
    asks for the whole vocabulary, and a cap of -1 allows up to the whole vocabulary; more
    than the cap is a ValueError (upstream's message)."""
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    for name, k in (("sample logprobs", params.logprobs), ("prompt logprobs", params.prompt_logprobs)):
        if k:
            k = vocab_size if k == -1 else k
            if k > limit:
                raise ValueError(f"Requested {name} of {k}, which is greater than max allowed: {limit}")


def _int_id(value, field_name: str) -> int:
    """A token id given as an int (or an integer string: JSON object keys, as upstream converts)."""
    if isinstance(value, bool):
        raise ValueError(f"{field_name} has a token id that is not an integer: {value!r}")
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ValueError(f"{field_name} has a token id that is not an integer: {value!r}")


def _count(value, field_name: str) -> int:
    """A token count given as an integer (numpy's too); a bool, a float or a string is refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{field_name} must be an integer, got {value!r}")
    return int(value)


# upstream's guided-decoding backends (GuidedDecodingParams.backend, "name:option,..."): each
# enforces the same constraint; here xgrammar does, whichever is named
GUIDED_BACKENDS = ("auto", "xgrammar", "outlines", "guidance", "lm-format-enforcer")


@dataclass
class GuidedDecodingParams(StructuredOutputsParams):
    """upstream's deprecated name of StructuredOutputsParams: the same fields, and its
    `backend` (TRL passes "outlines"). Any of upstream's backends is taken (the constraint
    is the same; xgrammar enforces it here); the option "disable-any-whitespace" sets
    disable_any_whitespace, other options are ignored as upstream's other backends ignore
    theirs."""
    backend: str | None = None

    def __post_init__(self) -> None:
        warnings.warn("GuidedDecodingParams is deprecated: use StructuredOutputsParams", DeprecationWarning,
                      stacklevel=3)
        if guided_backend_options(self.backend).get("disable_any_whitespace"):
            self.disable_any_whitespace = True
        super().__post_init__()


def guided_backend_options(backend) -> dict:
    """upstream's guided-decoding `backend` ("name" or "name:option,...") checked, as the
    StructuredOutputsParams fields its options set (only "disable-any-whitespace" changes
    anything here)."""
    if backend is None:
        return {}
    if not isinstance(backend, str) or backend.split(":", 1)[0] not in GUIDED_BACKENDS:
        raise ValueError(f"guided decoding backend {backend!r}: expected one of {GUIDED_BACKENDS} "
                         "(optionally with ':options')")
    options = backend.split(":", 1)[1].split(",") if ":" in backend else []
    return {"disable_any_whitespace": True} if "disable-any-whitespace" in options else {}


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
    # {token id: bias} added to those logits before penalties and sampling (upstream's order);
    # clamped to [-100, 100]. Applied like a grammar mask: the default tempered_logprobs
    # report the unbiased distribution, the trainer's (docs/sampling.md)
    logit_bias: dict[int, float] | None = None
    # only these token ids may be sampled (a mask, like a grammar's)
    allowed_token_ids: list[int] | None = None
    # words not to generate: the last token of a word's tokenization is banned whenever the
    # output so far ends with the tokens before it (upstream's rule, docs/sampling.md)
    bad_words: list[str] | None = None
    # keep only the last k prompt tokens (-1: the last max_model_len - 1; None: all)
    truncate_prompt_tokens: int | None = None
    # upstream's: what a streamed request's outputs hold (RequestOutputKind)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # upstream's: arbitrary data for custom sampling code, carried and never read here
    extra_args: dict[str, Any] | None = None
    # upstream's: None, or n (one sample per output): best-of-n selection is not run here
    best_of: int | None = None
    # upstream's deprecated name of structured_outputs (a StructuredOutputsParams, its subclass
    # GuidedDecodingParams, or their fields as a dict): moved there on construction
    guided_decoding: "StructuredOutputsParams | dict | None" = None

    def __post_init__(self) -> None:
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, numbers.Integral) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        self.n = int(self.n)
        if self.best_of is not None:
            if isinstance(self.best_of, bool) or not isinstance(self.best_of, int):
                raise ValueError(f"best_of must be an integer, got {self.best_of!r}")
            if self.best_of < self.n:   # upstream's rule
                raise ValueError(f"best_of must be greater than or equal to n, got n={self.n} and "
                                 f"best_of={self.best_of}")
            if self.best_of > self.n:
                raise ValueError(f"best_of={self.best_of} is not supported: best-of-n selection is not run here "
                                 f"(leave best_of unset or equal to n={self.n})")
        # a None, a string or a bool here would otherwise fail in a comparison below (a
        # TypeError) or pass as 0 / 1
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.max_tokens is not None:
            self.max_tokens = _count(self.max_tokens, "max_tokens")
        self.min_tokens = _count(self.min_tokens, "min_tokens")
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
        # upstream's: True asks for the sampled token's logprob and one alternative. False means
        # none (a flag passed through, `logprobs=return_logprobs`): upstream reads it as 0 and
        # computes the sampled tokens' logprobs, which such a caller does not read
        if isinstance(self.logprobs, bool):
            self.logprobs = 1 if self.logprobs else None
        if isinstance(self.prompt_logprobs, bool):
            self.prompt_logprobs = 1 if self.prompt_logprobs else None
        # -1: every token of the vocabulary (upstream's), allowed where max_logprobs permits
        if self.logprobs is not None and (isinstance(self.logprobs, bool)
                                          or not isinstance(self.logprobs, numbers.Integral) or self.logprobs < -1):
            raise ValueError(f"logprobs must be None, an integer >= 0 or -1 (all), got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or not isinstance(self.prompt_logprobs, numbers.Integral)
                                                 or self.prompt_logprobs < -1):
            raise ValueError(f"prompt_logprobs must be None, an integer >= 0 or -1 (all), got {self.prompt_logprobs!r}")
        self.logprobs = None if self.logprobs is None else int(self.logprobs)   # numpy's integers as int
        self.prompt_logprobs = None if self.prompt_logprobs is None else int(self.prompt_logprobs)
        if self.logprobs_mode is not None:
            check_logprobs_mode(self.logprobs_mode)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        self.seed = None if self.seed is None else int(self.seed)
        if self.seed is not None and not -2 ** 63 <= self.seed < 2 ** 63:
            # the sampler keys its noise by a signed 64-bit seed; a larger one would fail
            # inside the step, with every request of the batch
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}")
        if self.seed == -1:  # upstream's "no seed"
            self.seed = None
        if self.temperature < _SAMPLING_EPS:
            # greedy, as upstream: truncation would change nothing that is sampled, only the
            # processed_* logprobs, which then depend on the request's T alone
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        # upstream's normal form: lists, read where they are used (a field set after
        # construction, as RL frameworks do per batch, takes effect)
        if self.stop is not None and (isinstance(self.stop, (bytes, dict)) or not hasattr(self.stop, "__iter__")):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None and (isinstance(self.stop_token_ids, (str, bytes, dict))
                                                or not hasattr(self.stop_token_ids, "__iter__")):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        stop_ids = list(self.stop_token_ids) if self.stop_token_ids is not None else []
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = [int(t) for t in stop_ids]
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched in the output text)")
        if self.guided_decoding is not None:
            warnings.warn("SamplingParams(guided_decoding=...) is deprecated: use structured_outputs",
                          DeprecationWarning, stacklevel=3)
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding (its deprecated name), not both")
            spec = self.guided_decoding
            if isinstance(spec, dict) and "backend" in spec:   # upstream's older dict form
                spec = {**{k: v for k, v in spec.items() if k != "backend"}, **guided_backend_options(spec["backend"])}
            self.structured_outputs = StructuredOutputsParams.of(spec)
            self.guided_decoding = None
        self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        if self.structured_outputs is not None and self.min_tokens > 0:
            # the eos ban of min_tokens and a complete grammar (which allows only eos) would
            # leave no token to sample
            raise ValueError("min_tokens cannot be combined with structured_outputs")
        self._check_token_controls()
        if self.truncate_prompt_tokens is not None and (
                isinstance(self.truncate_prompt_tokens, bool) or not isinstance(self.truncate_prompt_tokens, int)
                or self.truncate_prompt_tokens == 0 or self.truncate_prompt_tokens < -1):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {self.truncate_prompt_tokens!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a vllm.sampling_params.RequestOutputKind, got {self.output_kind!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}")

    def _check_token_controls(self) -> None:
        """logit_bias, allowed_token_ids and bad_words in their normal forms (ids as ints, biases
        as floats clamped to [-100, 100], bad words deduplicated); the vocabulary bounds are the
        engine's check (validate_prompt), the bad words' tokenization too."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            bias = {}
            for token, value in self.logit_bias.items():
                tid = _int_id(token, "logit_bias")
                if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
                    raise ValueError(f"logit_bias[{token!r}] must be a number, got {value!r}")
                if tid in bias:
                    raise ValueError(f"logit_bias names token {tid} twice")
                bias[tid] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(value)))
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            if isinstance(self.allowed_token_ids, (str, bytes)) or not hasattr(self.allowed_token_ids, "__iter__"):
                raise ValueError(f"allowed_token_ids must be a list of token ids, got {self.allowed_token_ids!r}")
            self.allowed_token_ids = [_int_id(t, "allowed_token_ids") for t in self.allowed_token_ids]
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is not None and empty: it would allow no token")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (str, list, tuple)):
                raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
            words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
            if any(not isinstance(w, str) or not w for w in words):
                raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r}")
            self.bad_words = list(dict.fromkeys(words))

    @classmethod
    def from_optional(cls, **kwargs) -> "SamplingParams":
        """upstream's constructor for requests whose fields may be None: n, temperature, top_p
        and the penalties given as None take their defaults; every other field is passed as
        given (logit_bias keys may be integer strings, biases are clamped to [-100, 100])."""
        defaults = {"n": 1, "temperature": 1.0, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                    "repetition_penalty": 1.0}
        for name, value in defaults.items():
            if kwargs.get(name, value) is None:
                kwargs[name] = value
        return cls(**kwargs)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def clone(self) -> "SamplingParams":
        """A deep copy (upstream's name)."""
        return copy.deepcopy(self)

    @property
    def has_token_controls(self) -> bool:
        """It sets logit_bias, allowed_token_ids or bad_words (applied per request in the sampler)."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
