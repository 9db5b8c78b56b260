"""Typed messages at the scheduler <-> model runner boundary."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PromptLogprobsSlice:
    """The prompt logprobs one step computes for one request: the hidden rows at prompt
    positions [first_position, first_position + len(targets)), which predict `targets`
    (the prompt tokens one position later)."""
    first_row: int                # the first row's offset within the step's slice of the request
    first_position: int           # its position in the prompt
    targets: list[int]
    num_top: int                  # top-k alternatives per position
    temperature: float
    logprobs_mode: str


@dataclass(slots=True)
class ScheduledRequest:
    """One request's slice of a step: compute tokens [num_computed, num_computed + num_new)."""
    req_id: str
    token_ids: list[int]          # the new tokens' ids (len == num_new)
    num_computed: int             # tokens whose KV is already in the cache
    block_table: list[int]
    sample: bool                  # this slice reaches the end of the known tokens: sample the next one
    # Sampling inputs (used when sample is True)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    output_index: int = 0         # position of the token being sampled within the request's output
    num_logprobs: int = -1
    logprobs_mode: str = "tempered_logprobs"
    banned_token_ids: tuple = ()  # token ids it may not sample: eos/stop before min_tokens, bad words
    # Penalties (None: none): (presence, frequency, repetition, prompt ids, output ids). The
    # id lists are the request's own (read at launch, never copied); with async scheduling
    # the output may end in PLACEHOLDER, filled from the previous step's tokens on the device.
    penalties: tuple | None = None
    # Recurrent states (models with recurrent layers): the request's state slot; a snapshot
    # slot copied into it before the step (a prefix-cache hit, -1: none) and one it is copied
    # to after the step (its prefill ended on the states' grid, -1: none)
    state_slot: int = 0
    state_load: int = -1
    state_save: int = -1
    # Prompt logprobs this step computes (None: none; only requests that ask get one)
    prompt_logprobs: PromptLogprobsSlice | None = None
    # The packed mask of the sampled token: its grammar's (structured outputs), ANDed with
    # allowed_token_ids' (int32 words, bit j of word i allows token 32 * i + j;
    # vllm/structured_outputs.py). None: unconstrained.
    grammar_bitmask: object = None
    # logit_bias: (token ids, biases) added before the penalties (None: none)
    logit_bias: tuple | None = None

    @property
    def num_new(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        return self.num_computed + len(self.token_ids)


@dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest]
    num_batched_tokens: int
    preempted: list[str] = field(default_factory=list)
    # The scheduler's own Request objects, aligned with `requests` (never read by the
    # runner): progress is applied to these objects, not to whatever request holds the
    # same id by the time a step completes (an id can be reused after an abort).
    owners: list = field(default_factory=list, repr=False)
    # indices into `requests` of those with a prompt_logprobs slice (the runner looks at
    # no other request for them)
    prompt_logprob_indices: list[int] = field(default_factory=list)

    @property
    def is_decode_only(self) -> bool:
        return all(r.num_new == 1 for r in self.requests)


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] | None = None   # top-k alternatives (id, logprob), best first


@dataclass
class PromptLogprobsChunk:
    """Prompt logprobs of one request from one step: entries for the prompt tokens at
    positions first_target, first_target + 1, ...: (logprob, rank, [(id, logprob), ...])."""
    first_target: int
    entries: list[tuple[float, int, list[tuple[int, float]]]]


@dataclass
class ModelRunnerOutput:
    """Sampled tokens, keyed by request id; requests mid-prefill have no entry."""
    sampled: dict[str, SampledToken]
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
