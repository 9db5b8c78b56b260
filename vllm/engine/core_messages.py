"""Typed messages between the API server process and the engine core process.

Both directions carry pickled lists of these NamedTuples over a pipe, except the
per-step RequestDeltas, which travel as plain tuples (RequestDelta(*t) on
arrival, which fills in the defaults of trailing fields a shorter tuple lacks): for
256 requests a step's outputs then pickle in about 0.13 ms and unpickle in 0.23 ms,
against 0.77 / 0.45 ms as NamedTuples and several times that as dataclasses
(measured on the CPU dev box). The engine never waits on a slow reader: a sender
thread does the writing.

client -> core: AddRequest, AbortRequest, StopChild, UtilityCall
core -> client: ReadyInfo (once), then one EngineCoreOutputs per engine step (and
one after each batch of commands that produced results).
"""
from __future__ import annotations

from typing import Any, NamedTuple

from vllm.sampling_params import SamplingParams


class AddRequest(NamedTuple):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams       # stop strings removed and detokenize=False: the client does text
    cache_salt: str | None = None   # checked by the client; prefix-cache blocks are shared within a salt only
    priority: int = 0            # checked by the client against ReadyInfo.scheduling_policy; lower runs earlier


class AbortRequest(NamedTuple):
    request_id: str


class StopChild(NamedTuple):
    """Sample `index` of a request hit a stop string (found by the client's detokenizer)."""
    request_id: str
    index: int
    stop_reason: str


class UtilityCall(NamedTuple):
    """Run EngineCore.utility_<method>(*args) between steps; answered by a UtilityResult."""
    call_id: int
    method: str
    args: tuple


class RequestDelta(NamedTuple):
    """What one sample of one request gained in one step."""
    request_id: str
    index: int
    new_token_ids: list[int]
    # per new token (logprob, rank, [(token id, logprob), ...] top alternatives), or None
    new_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None
    finish_reason: str | None    # set on the sample's last delta
    stop_reason: int | str | None
    weight_versions: list[int]   # the versions the sample has been computed under so far
    num_cached_tokens: int
    # on the first delta of sample 0 of a request that asked for prompt logprobs: per prompt
    # token after the first, (logprob, rank, [(token id, logprob), ...]) (None where missing)
    prompt_logprobs: list | None = None
    # on each sample's first delta: when the engine core's scheduler first admitted it
    # (time.monotonic(), the same system-wide clock in the API server's process), for the
    # queue / prefill / inference times in /metrics; None on later deltas, or never scheduled
    scheduled_time: float | None = None


class EngineStats(NamedTuple):
    num_running: int
    num_waiting: int
    kv_usage: float              # fraction of KV blocks held by requests
    num_free_blocks: int
    num_preemptions: int
    step_count: int
    paused: bool
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (one count per admission)
    prefix_cache_hits: int = 0     # of those, tokens found cached


class UtilityResult(NamedTuple):
    call_id: int
    ok: bool
    value: Any                   # the result, or (exception class name, message)


class RequestFailure(NamedTuple):
    """The engine could not run these requests (a failed step, or an add the engine refused)."""
    request_ids: list[str]
    message: str
    invalid: bool                # True: the request's own fault (HTTP 400), else the engine's (500)


class EngineCoreOutputs(NamedTuple):
    deltas: list[tuple]          # RequestDelta fields as plain tuples (cheaper to pickle)
    weight_version: int
    stats: EngineStats
    utility_results: list[UtilityResult]
    failures: list[RequestFailure]


class ReadyInfo(NamedTuple):
    """Sent once the engine is built: what the API server needs to validate and detokenize."""
    model_path: str
    tokenizer_path: str
    max_model_len: int
    vocab_size: int
    generation_defaults: dict
    weight_version: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    scheduling_policy: str = "fcfs"   # the client refuses a non-zero priority under "fcfs" (HTTP 400)
    eos_token_ids: tuple = ()         # min_tokens bans them: a request allowing nothing else is refused
