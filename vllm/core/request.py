"""A request as the scheduler sees it: tokens, progress through the KV cache, status."""
from __future__ import annotations

import enum
import numbers
import time
from dataclasses import dataclass

import numpy as np

from vllm.sampling_params import SamplingParams


# Stands for a sampled token whose value is still on the GPU (async scheduling):
# the runner fills it in on the device before the forward pass reads it.
PLACEHOLDER = -1


def check_priority(priority, scheduling_policy: str) -> int:
    """A request's priority as the scheduler takes it: an integer, lower admitted earlier, and
    0 unless the engine runs scheduling_policy="priority" (upstream's rule, and its message,
    which clients match to drop the field and retry)."""
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    priority = int(priority)
    if priority != 0 and scheduling_policy != "priority":
        raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled. (Start the engine with "
                         "scheduling_policy='priority', or vllm serve --scheduling-policy priority.)")
    return priority


@dataclass(frozen=True)
class TokenControls:
    """A request's logit_bias, allowed_token_ids and bad_words as the sampler applies them,
    resolved once when the request is queued (the engine knows the vocabulary and the
    tokenizer) and shared by its n samples."""
    # logit_bias: (token ids, biases), in the order given; None: none
    logit_bias: tuple[tuple[int, ...], tuple[float, ...]] | None = None
    # allowed_token_ids as a packed mask (int32 words; bit j of word i allows token 32 i + j),
    # the grammar masks' format; None: every token allowed
    allowed_bitmask: np.ndarray | None = None
    # each bad word's token ids (two tokenizations per word: with and without a leading space)
    bad_words: tuple[tuple[int, ...], ...] = ()

    @property
    def needs_last_token(self) -> bool:
        """A bad word of two tokens or more: which tokens it bans depends on the last output token."""
        return any(len(w) > 1 for w in self.bad_words)

    def bad_word_bans(self, output_token_ids: list[int]) -> list[int]:
        """upstream's rule: a bad word's last token is banned when the output so far ends with
        the word's other tokens (a one-token word: always). Only output tokens count."""
        out = []
        n = len(output_token_ids)
        for word in self.bad_words:
            k = len(word) - 1
            if k <= n and (k == 0 or output_token_ids[n - k:] == list(word[:k])):
                out.append(word[-1])
        return out


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"           # waiting again, KV dropped, will recompute
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    def __init__(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 eos_token_ids: list[int], max_model_len: int, leader: "Request | None" = None,
                 parent_id: str | None = None, index: int = 0, cache_salt: str | None = None, priority: int = 0,
                 controls: TokenControls | None = None):
        self.req_id = req_id
        self.parent_id = parent_id or req_id
        self.index = index                      # which of the n samples this is
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # prefix-cache blocks are shared only among requests of the same salt (None: unsalted)
        self.cache_salt = cache_salt
        # n > 1: siblings wait until the leader's prompt blocks are cached, then share them.
        self.leader = leader
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1             # prefix-cache hit on first schedule (-1: not yet scheduled)
        self.snapshot_branch = 0                # recurrent states: a snapshot point past the hit (Scheduler)
        self.num_preemptions = 0
        self.finishing = False                  # its last sampled token ends it by length (async lookahead)
        self.stop_reason: int | str | None = None
        self.arrival_time = time.monotonic()
        # scheduling_policy="priority": waiting requests are admitted by (priority, arrival_order),
        # lower first; arrival_order is the scheduler's count of add_request calls (a clock can tie)
        self.priority = priority
        self.arrival_order = 0
        self.first_token_time: float | None = None
        # when the scheduler first admitted it (time.monotonic(); kept across preemptions): the
        # end of its queue time and the start of its prefill in the API server's /metrics
        self.scheduled_time: float | None = None
        # Sampled-token logprobs: per output token, (logprob, rank, [(id, logprob), ...])
        self.logprobs: list[tuple[float, int, list[tuple[int, float]]]] = []
        self.cumulative_logprob = 0.0
        # Prompt logprobs (params.prompt_logprobs; one sample of an n > 1 request computes
        # them for all): entry p-1 for prompt token p, in the format of `logprobs`; and how
        # many prompt positions have had their row computed (a recompute after preemption
        # starts there).
        self.prompt_logprobs: list | None = None
        self.num_prompt_logprob_rows = 0
        if params.prompt_logprobs is not None and index == 0:
            self.prompt_logprobs = [None] * (len(self.prompt_token_ids) - 1)
        # Structured outputs: this sample's grammar matcher (vllm/structured_outputs.py), fed
        # every output token once its value is on the host (None: unconstrained)
        self.grammar = None
        # the token ids after which the grammar starts (structured_outputs.after_token_ids);
        # None once they have come (or without them): the grammar masks and is fed every token
        self.grammar_after: tuple[int, ...] | None = None
        # logit_bias, allowed_token_ids, bad_words (None: none of them)
        self.controls = controls
        # which tokens it may not sample depends on its output: min_tokens or bad words
        self.has_bans = params.min_tokens > 0 or (controls is not None and bool(controls.bad_words))

    @property
    def scheduling_key(self) -> tuple[int, int]:
        """Its place under scheduling_policy="priority": admitted before larger keys, preempted
        after them."""
        return self.priority, self.arrival_order

    @property
    def awaiting_last_token(self) -> bool:
        """Async scheduling: its last token is still on the device, and the mask of its next
        token (its grammar's, or its bad words' bans) cannot be computed without it."""
        needs = self.grammar is not None or (self.controls is not None and self.controls.needs_last_token)
        return needs and bool(self.output_token_ids) and self.output_token_ids[-1] == PLACEHOLDER

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def max_output_tokens(self) -> int:
        # a prompt filling the context still samples one token (its KV is never needed)
        room = max(1, self.max_model_len - self.num_prompt_tokens)
        mt = self.params.max_tokens
        return room if mt is None else min(mt, room)

    @property
    def prompt_logprobs_pending(self) -> bool:
        return self.prompt_logprobs is not None and self.num_prompt_logprob_rows < len(self.prompt_logprobs)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def check_token_stop(self) -> RequestStatus | None:
        """Stop conditions decidable from token ids alone (stop strings are the detokenizer's)."""
        n_out = len(self.output_token_ids)
        if n_out == 0:
            return None
        last = self.output_token_ids[-1]
        if n_out >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                # the main EOS (the first: the tokenizer's) has no stop reason; the other ids
                # (generation_config's) stop as stop tokens do, with their id (as upstream)
                self.stop_reason = None if last == self.eos_token_ids[0] else last
                return RequestStatus.FINISHED_STOPPED
            if self.params.stop_token_ids and last in self.params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def banned_token_ids(self) -> tuple[int, ...]:
        """The tokens its next token may not be: eos and stop tokens while min_tokens is not
        reached, and its bad words' bans (as upstream does); each id once."""
        ids = []
        if len(self.output_token_ids) < self.params.min_tokens:
            # eos is banned under ignore_eos too, as upstream: ignore_eos only keeps eos from
            # ending the request, min_tokens keeps it out of the first min_tokens tokens
            ids = list(self.eos_token_ids) + list(self.params.stop_token_ids or [])
        if self.controls is not None and self.controls.bad_words:
            ids += self.controls.bad_word_bans(self.output_token_ids)
        return tuple(dict.fromkeys(ids))
