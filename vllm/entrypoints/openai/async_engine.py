"""AsyncLLM: an asyncio front for an engine core running in another process (or thread).

    API server process                                   engine core process
    ------------------                                   -------------------
    add_requests: tokenize, validate --AddRequest------>  LLMEngine.add_request
    abort / stop string        --AbortRequest/StopChild->  abort / finish one sample
    pause, weights, stats      --UtilityCall----------->  EngineCore.utility_*
    receiver thread  <--one EngineCoreOutputs per step---  step(): every request's new token ids
      detokenize, stop strings (RequestState)
      -> each request's RequestStream, on its event loop

Prompts are tokenized, validated and later detokenized here, so the engine
process spends its host time on scheduling and the model only.

A RequestStream holds the request's latest output. Outputs are cumulative (text
and token ids so far), so a consumer that falls behind the engine skips to the
newest one instead of working through a backlog: a slow HTTP writer gets fewer,
larger chunks and never slows the engine down.

Failure isolation:
  * Bad input raises ValueError from add_requests before anything reaches the
    engine; a multi-prompt request is validated as a whole.
  * A failed engine step fails every request in flight with EngineError (500);
    the engine carries on.
  * If the engine process dies, every request fails with EngineDeadError (503),
    is_running turns False (health checks fail), and the callbacks given to
    on_engine_death run, from the receiver thread that found the engine gone.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Sequence

from vllm.core.request import check_priority
from vllm.engine.core_client import EngineCoreClient, EngineDeadError
from vllm.engine.core_messages import AbortRequest, AddRequest, EngineCoreOutputs, EngineStats, RequestDelta, StopChild
from vllm.engine.llm_engine import bad_words_token_ids, check_max_tokens, tokenize_truncated, validate_prompt
from vllm.inputs import prompt_cache_salt
from vllm.engine.output_processor import RequestState, TokenTextCache
from vllm.entrypoints.openai.latency import LatencyStats, RequestSizes, RequestTimes
from vllm.engine.rpc_names import check_rpc_args
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineError", "EngineDeadError", "QueueFullError", "RequestStream"]


class EngineError(RuntimeError):
    """The engine failed while running a request (not the request's fault: HTTP 500)."""


class QueueFullError(RuntimeError):
    """More requests are waiting than the server accepts (--max-queued-requests): HTTP 429."""


# upstream's AsyncLLM.from_engine_args / from_vllm_config keywords that mean nothing here
UPSTREAM_FROM_ENGINE_ARGS_NOOPS = frozenset({"usage_context", "start_engine_loop", "stat_loggers",
                                             "enable_log_requests", "disable_log_requests", "disable_log_stats",
                                             "client_addresses", "client_count", "client_index"})

_ABORTED = object()
_CHANGED = object()   # the request advanced: build its output when the consumer reads


class RequestStream:
    """The outputs of one request, consumed on the event loop that created it.

    An async iterator of RequestOutputs: partial ones (when added with stream=True),
    then exactly one with finished=True, after which it stops. Outputs are
    cumulative: when several arrive before the consumer reads, it gets only the
    newest. If the request is aborted by someone else it just stops; if the engine
    fails, EngineError (or EngineDeadError) is raised.
    """

    def __init__(self, owner: "AsyncLLM", request_id: str, loop: asyncio.AbstractEventLoop, stream: bool, *,
                 tail: bool = False, delta: bool = False, samples: int = 1):
        self.owner = owner
        self.request_id = request_id
        self.loop = loop
        self.stream = stream
        # tail: each output carries what is new since the previous one (RequestState.output_tail),
        # built when the consumer reads, the final one included: for a caller that asked for
        # tails (the server's streamed responses: tail_for_caller) and under output_kind=DELTA
        self.tail_for_caller = tail
        self.tail = tail or delta
        self._marks = [[0, 0] for _ in range(samples)]   # per sample: characters, tokens handed out
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self.finished = False  # True once the final output, an error or an abort was seen
        self.state: RequestState | None = None
        self.engine_id: str | None = None   # this add's id in the engine (AsyncLLM._engine_ids)
        self.abort_after_send = False       # aborted before its AddRequest was sent (_Entry.sent)
        # A _CHANGED marker is queued and unread: the receiver need not queue another.
        self.notified = False

    # -- loop side: called through loop.call_soon_threadsafe ------------------------------
    def _put(self, item: Any) -> None:
        self._items.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- consumer side ----------------------------------------------------------------------
    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self.finished:
                raise StopAsyncIteration
            while not self._items:
                self._waiter = self.loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            item = self._items.popleft()
            if item is _CHANGED:
                # One snapshot covers every step since the last read (cumulative, or the tail
                # since the previous output).
                with self.owner._lock:
                    self.notified = False
                    item = self.state.output_tail(self._marks) if self.tail else self.state.output()
            if item is _ABORTED:
                self.finished = True
                raise StopAsyncIteration
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finished:
                self.finished = True
            kind = self.state.params.output_kind if self.state is not None else RequestOutputKind.CUMULATIVE
            if kind is RequestOutputKind.FINAL_ONLY and not item.finished:
                continue
            if kind is RequestOutputKind.DELTA and not self.tail_for_caller:
                item = self._delta(item)
                if item is None:
                    continue
            return item

    def _delta(self, out: RequestOutput) -> RequestOutput | None:
        """SamplingParams.output_kind=DELTA, from the tail output_tail built: each sample's text,
        token ids and logprobs since the last output returned, only the samples with something
        new (or just finished, once); prompt logprobs on the first output only. None when
        nothing is new."""
        done = self.__dict__.setdefault("_done", set())
        outputs = []
        for c in out.outputs:
            if c.index in done or (not c.text and not c.token_ids and c.finish_reason is None):
                continue
            if c.finish_reason is not None:
                done.add(c.index)
            outputs.append(c)
        first = not self.__dict__.get("_delta_sent", False)
        if not outputs and not (first and out.prompt_logprobs is not None) and not out.finished:
            return None
        self._delta_sent = True
        return dataclasses.replace(out, outputs=outputs, prompt_logprobs=out.prompt_logprobs if first else None)

    def abort(self) -> None:
        """Abort the request unless it already ended; safe to call any number of times. By
        its engine id: a later request reusing the caller's id is not touched."""
        if not self.finished:
            self.finished = True
            self.owner._abort_engine_id(self.engine_id)


@dataclasses.dataclass
class _Entry:
    state: RequestState
    stream: RequestStream
    times: RequestTimes
    # the AddRequest is on its way to the engine (add_requests sends it outside the lock): an
    # abort meanwhile must follow it, not overtake it (the engine would drop the unknown id,
    # then run the request for nobody), so add_requests sends that abort once its send is done
    sent: bool = False


class AsyncLLM:
    """Requests in, RequestStreams out; every method is safe to call from any thread.

    >>> async_llm = AsyncLLM.from_engine_args({"device": "cpu"})   # engine in its own process
    >>> async for out in async_llm.generate("Hello", SamplingParams(max_tokens=8)):
    ...     final = out
    >>> async_llm.shutdown()
    """

    def __init__(self, client: EngineCoreClient, *, max_queued_requests: int | None = None):
        info = client.info
        self.client = client
        self.info = info
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.max_queued_requests = max_queued_requests
        # Three tokenizers: HF fast tokenizers must not be used by two threads at once; the
        # receiver thread detokenizes, handlers render chat templates on the event loop, and
        # text prompts are tokenized on a thread of their own (a multi-megabyte prompt takes
        # seconds to tokenize: on the loop it would stall every stream meanwhile).
        self.tokenizer = load_tokenizer(info.tokenizer_path)
        self._detok_tokenizer = load_tokenizer(info.tokenizer_path)
        self._prep_tokenizer = load_tokenizer(info.tokenizer_path)
        self._prep_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-prep")
        self._decode_one = TokenTextCache(self._detok_tokenizer)
        # Each add gets an engine id of its own (the request id + a serial): a step already under
        # way when a request is aborted may still report on it, and those outputs must not
        # reach a new request that reuses the id. Outputs carry the caller's id. Several requests
        # may share an id while they run, as upstream's engine takes them (a proxy passing one
        # trace id to a fan-out, a retry racing its first try): each is its own engine request,
        # and an abort by the id ends all of them.
        self._requests: dict[str, _Entry] = {}     # by engine id
        self._engine_ids: dict[str, list[str]] = {}   # request id -> engine ids, while they run
        self._serial = itertools.count()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._outstanding = 0          # samples (prompts x n) added and not finished
        self.weight_version = info.weight_version
        self.stats = EngineStats(0, 0, 0.0, info.num_kv_blocks - 1, 0, 0, False)
        # counters for /metrics
        self.num_requests_received = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.finished_by_reason: collections.Counter = collections.Counter()
        self.latency = LatencyStats()   # /metrics histograms (vllm/entrypoints/openai/latency.py)
        self.sizes = RequestSizes(info.max_model_len)
        self._dead_error: EngineDeadError | None = None
        self._death_callbacks: list[Callable[[str], None]] = []   # on_engine_death's, not yet called
        client.on_outputs = self._on_outputs
        client.on_dead = self._on_dead

    @classmethod
    def from_engine_args(cls, engine_kwargs, *, max_queued_requests: int | None = None,
                         startup_timeout: float | None = None, **upstream_kwargs) -> "AsyncLLM":
        """Start the engine core in its own process (what `vllm serve` does). `engine_kwargs`:
        LLM's keyword arguments, a dict or upstream's (Async)EngineArgs. upstream's other
        keywords (usage_context, start_engine_loop, stat_loggers, ...) are accepted and change
        nothing."""
        from vllm.engine.arg_utils import EngineArgs
        unknown = set(upstream_kwargs) - UPSTREAM_FROM_ENGINE_ARGS_NOOPS
        if unknown:
            raise ValueError(f"from_engine_args: unknown keyword arguments {sorted(unknown)}")
        if isinstance(engine_kwargs, EngineArgs):
            engine_kwargs = engine_kwargs.to_kwargs()
        if not isinstance(engine_kwargs, dict):
            raise ValueError(f"engine_kwargs must be a dict of LLM's keyword arguments or an AsyncEngineArgs, got "
                             f"{type(engine_kwargs).__name__}")
        return cls(EngineCoreClient.start_process(engine_kwargs, startup_timeout=startup_timeout),
                   max_queued_requests=max_queued_requests)

    @classmethod
    def from_engine(cls, engine, *, max_queued_requests: int | None = None) -> "AsyncLLM":
        """Drive an LLMEngine you built, on a thread of this process (tests, notebooks).
        From then on only that thread may touch the engine."""
        return cls(EngineCoreClient.start_thread(engine), max_queued_requests=max_queued_requests)

    # ---- lifecycle ------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self.client.is_alive

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine core (process or thread) and fail what is still in flight with 503."""
        self.client.shutdown(timeout)
        self._prep_pool.shutdown(wait=False)

    def on_engine_death(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once the engine stops by itself (a crash, an exit, a kill;
        not `shutdown()`): on the receiver thread, as soon as it finds the engine's output
        pipe closed, or here and now if the engine is gone already. Nothing polls."""
        with self._lock:
            # _on_dead takes the callbacks under the same lock once dead_reason is set: a
            # callback is either taken by it or called here, never both, never neither
            if self.client.is_alive:
                self._death_callbacks.append(callback)
                return
        if not self.client.shutdown_requested:
            callback(self.client.dead_reason)

    def _check_alive(self) -> None:
        if not self.client.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.client.dead_reason}")

    # ---- requests -------------------------------------------------------------------------
    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def _prepare(self, items: list, tokenizer, default_max_tokens: int | None = None) -> list:
        """Each request's (id, text, ids, validated params copy, cache salt); ValueError for
        the first bad one. `tokenizer`: the prompt thread's (None: token-id prompts only).
        `default_max_tokens`: caps a request that leaves max_tokens unset, within the context
        its prompt leaves (the checkpoint's max_new_tokens, as upstream's get_max_tokens)."""
        prepared = []
        for rid, prompt, params in items:
            # a validated copy, before anything is registered: fields set on the caller's object
            # after construction are checked, and later changes to it reach no running request
            params = dataclasses.replace(params)
            text, ids = tokenize_truncated(tokenizer, prompt, params.truncate_prompt_tokens, self.max_model_len)
            validate_prompt(ids, params, self.vocab_size, self.max_model_len, self.info.eos_token_ids)
            if params.max_tokens is None and default_max_tokens and self.max_model_len - len(ids) >= 1:
                params.max_tokens = min(int(default_max_tokens), self.max_model_len - len(ids))
            if params.bad_words:   # a word that cannot be banned is a 400, not an engine-side failure
                bad_words_token_ids(tokenizer, params.bad_words, self.vocab_size)
            check_max_tokens(len(ids), params.max_tokens, self.max_model_len)
            prepared.append((rid, text, ids, params, prompt_cache_salt(prompt)))
        return prepared

    async def on_prompt_thread(self, fn):
        """fn(tokenizer) on the prompt thread, with that thread's own tokenizer: rendering a
        chat template or tokenizing a large prompt there leaves the event loop to every other
        stream (a megabyte prompt takes seconds)."""
        return await asyncio.get_running_loop().run_in_executor(self._prep_pool, fn, self._prep_tokenizer)

    @property
    def num_in_flight(self) -> int:
        """Sequences (prompts x n) accepted and not finished: upstream's /load server_load."""
        return self._outstanding

    async def add_requests(self, items: Sequence[tuple[str, Any, SamplingParams]], *,
                           stream: bool = False, priority: int = 0,
                           default_max_tokens: int | None = None, tail: bool = False) -> list[RequestStream]:
        """Add several requests atomically; returns one stream per request, in order.
        tail: each output carries each sample's text, token ids and logprobs since the
        previous output (every sample, its finish and stop reason as they stand; prompt
        fields on every output), whatever the params' output_kind: a streamed response's
        chunks cost what they carry, not the output's length.

        Raises ValueError (nothing added) if any prompt or params is invalid -- including a
        max_tokens that does not fit in the context left, and a non-zero `priority` (every
        request's; lower runs earlier) on an engine that does not run
        scheduling_policy="priority" --, QueueFullError when the queue is full, and
        EngineDeadError if the engine is not running.
        """
        self._check_alive()
        arrived = time.monotonic()   # the latency metrics count from here, tokenization included (as upstream)
        priority = check_priority(priority, self.info.scheduling_policy)
        loop = asyncio.get_running_loop()
        items = list(items)
        if any(not (isinstance(p, dict) and "prompt_token_ids" in p) or params.bad_words for _, p, params in items):
            prepared = await loop.run_in_executor(self._prep_pool, self._prepare, items, self._prep_tokenizer,
                                                  default_max_tokens)
        else:   # token ids only: nothing to tokenize, no thread hop
            prepared = self._prepare(items, None, default_max_tokens)
        n_samples = sum(p.n for _, _, _, p, _ in prepared)
        msgs, streams = [], []
        with self._lock:
            if self.max_queued_requests is not None:
                if n_samples > self.info.max_num_seqs + self.max_queued_requests:
                    # never fits, however long the client waits: not a 429
                    raise ValueError(f"the request asks for {n_samples} sequences; this server runs at most "
                                     f"{self.info.max_num_seqs} and queues at most {self.max_queued_requests}")
                queued = self._outstanding + n_samples - self.info.max_num_seqs
                if queued > self.max_queued_requests:
                    raise QueueFullError(f"the server is at capacity ({self._outstanding} sequences in flight, at most "
                                         f"{self.info.max_num_seqs} running + {self.max_queued_requests} queued); retry later")
            for rid, text, ids, params, cache_salt in prepared:
                s = RequestStream(self, rid, loop, stream, tail=tail, delta=params.output_kind is RequestOutputKind.DELTA,
                                  samples=params.n)
                s.state = RequestState(rid, text, ids, params, self._detok_tokenizer, self._decode_one)
                eid = s.engine_id = f"{rid}@{next(self._serial)}"
                self._requests[eid] = _Entry(s.state, s, RequestTimes(arrived))
                self._engine_ids.setdefault(rid, []).append(eid)
                streams.append(s)
                # the engine works on token ids only: stop strings and text are ours
                msgs.append(AddRequest(eid, ids, dataclasses.replace(params, stop=None, detokenize=False), cache_salt,
                                       priority))
            self._outstanding += n_samples
        try:
            self.client.send(msgs)
        except BaseException:
            # nothing reached the engine (a dead engine, a message that cannot be pickled): the
            # requests' ids and slots must not stay taken
            with self._lock:
                for s in streams:
                    self._forget(s.engine_id)
            raise
        with self._lock:   # counted once the engine has them (/metrics, the stats line)
            late_aborts = []
            for s in streams:
                entry = self._requests.get(s.engine_id)
                if entry is not None:
                    entry.sent = True
                elif s.abort_after_send:
                    late_aborts.append(AbortRequest(s.engine_id))
            self.num_requests_received += len(prepared)
            self.num_prompt_tokens += sum(len(ids) for _, _, ids, _, _ in prepared)
        if late_aborts:
            try:
                self.client.send(late_aborts)
            except EngineDeadError:
                pass
        return streams

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None, *,
                       stream: bool = False, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs: with stream=True as they arrive, the last one finished.

        The ValueError of an invalid request is raised from the first iteration. To stop
        early, leave the loop inside `contextlib.aclosing(...)` (or call abort(request_id)).
        """
        rid = request_id or self.new_request_id()
        (s,) = await self.add_requests([(rid, prompt, params)], stream=stream, priority=priority)
        try:
            async for out in s:
                yield out
        finally:
            s.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (every one running under that id; no-op if unknown or finished).
        Never blocks on the engine."""
        with self._lock:
            eids = list(self._engine_ids.get(request_id, ()))
        for eid in eids:
            self._abort_engine_id(eid)

    def _abort_engine_id(self, eid: str | None) -> None:
        with self._lock:
            entry = self._forget(eid)
            if entry is not None:   # its unfinished samples end as aborted (/metrics' request_success)
                aborted = sum(1 for f in entry.state.finish if f is None)
                if aborted:
                    self.finished_by_reason["abort"] += aborted
            unsent = entry is not None and not entry.sent
            if unsent:
                entry.stream.abort_after_send = True   # add_requests sends it after the add
        if entry is None:
            return
        if not entry.stream.finished:  # aborted by someone else than its consumer: end its iteration
            try:
                entry.stream.loop.call_soon_threadsafe(_deliver, [(entry.stream, _ABORTED)])
            except RuntimeError:
                pass
        if unsent:
            return
        try:
            self.client.send([AbortRequest(eid)])
        except EngineDeadError:
            pass

    def _forget(self, engine_id: str | None) -> _Entry | None:
        """Drop a request's bookkeeping (caller holds the lock)."""
        entry = self._requests.pop(engine_id, None) if engine_id is not None else None
        if entry is not None:
            self._outstanding -= sum(1 for f in entry.state.finish if f is None)
            self._drop_engine_id(entry.state.request_id, engine_id)
        return entry

    def _drop_engine_id(self, request_id: str, engine_id: str) -> None:
        """(caller holds the lock)"""
        eids = self._engine_ids.get(request_id)
        if eids is not None and engine_id in eids:
            eids.remove(engine_id)
            if not eids:
                del self._engine_ids[request_id]

    # ---- engine utilities -----------------------------------------------------------------
    async def utility(self, method: str, *args: Any) -> Any:
        """Run EngineCore.utility_<method>(*args) in the engine between two steps."""
        self._check_alive()
        return await asyncio.wrap_future(self.client.utility(method, *args))

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> dict:
        """Pause generation. "keep": the requests in flight stop where they are, with their KV,
        and continue after resume(); "abort": they end now with what they generated
        (finish_reason "abort"); "wait": they finish first, and this returns once they have
        (new requests wait for resume). `clear_cache` then drops every cached prefix."""
        return await self.utility("pause", mode, bool(clear_cache))

    async def resume(self) -> dict:
        return await self.utility("resume")

    # upstream vLLM's names for the same calls (its defaults: abort, and clear the cache;
    # its older keyword wait_for_inflight_requests=True is mode "wait", False "abort")
    async def pause_generation(self, mode: str | None = None, clear_cache: bool = True, *,
                               wait_for_inflight_requests: bool | None = None) -> dict:
        if mode is None:
            mode = "wait" if wait_for_inflight_requests else "abort"
        elif wait_for_inflight_requests is not None and (mode == "wait") != wait_for_inflight_requests:
            raise ValueError(f"pause_generation: mode={mode!r} and wait_for_inflight_requests="
                             f"{wait_for_inflight_requests} disagree")
        return await self.pause(mode, clear_cache)

    # upstream's AsyncLLM calls RL frameworks make between rollouts
    async def sleep(self, level: int = 1) -> int:
        """Release the KV cache's memory (an engine built with enable_sleep_mode; refused
        while requests run); the weights stay. Returns the bytes released."""
        return await self.utility("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.utility("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return await self.utility("is_sleeping")

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix; False (nothing changed) while requests hold blocks,
        unless reset_running_requests. reset_connector: upstream's KV connector, none here."""
        return await self.utility("reset_prefix_cache", reset_running_requests, reset_connector)

    async def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        """upstream's call into every worker, in the engine's process between two steps: one
        result per worker (one here). `method`: a worker method's name (LLM.collective_rpc
        lists them) or a function called as fn(worker, *args, **kwargs), which travels
        pickled (a module-level function, not a lambda), as its result does. `timeout`
        (seconds): how long to wait for the answer (TimeoutError)."""
        args, kwargs = check_rpc_args(args, kwargs)
        if callable(method):   # anything else the engine refuses by name
            try:
                pickle.dumps(method)
            except Exception as err:  # noqa: BLE001 -- any pickling failure says the same
                raise ValueError(f"collective_rpc: {method!r} cannot travel to the engine's process "
                                 f"({type(err).__name__}: {err}); pass a module-level function or a worker "
                                 "method's name") from None
        call = self.utility("collective_rpc", method, args, kwargs)
        return await (asyncio.wait_for(call, timeout) if timeout is not None else call)

    async def get_tokenizer(self):
        return self.tokenizer

    async def resume_generation(self) -> dict:
        return await self.resume()

    async def is_paused(self) -> bool:
        return bool((await self.utility("stats"))["paused"])

    async def abort_requests(self, request_ids: list[str] | None = None) -> dict:
        """End requests now (None or empty: every one in flight) with what they generated so
        far, finish_reason "abort", without pausing."""
        if isinstance(request_ids, tuple):
            request_ids = list(request_ids)
        # "every request" only from None or []: a malformed value (a string, a number, false)
        # must not end everyone's work
        if request_ids is not None and not (isinstance(request_ids, list)
                                            and all(isinstance(r, str) for r in request_ids)):
            raise ValueError(f"request_ids must be a list of request id strings (or absent / null / [] for every "
                             f"request), got {request_ids!r}")
        unsent = []
        if request_ids:
            with self._lock:  # the engine knows them by their engine ids
                # ids not running are left out (a raw "<id>@<n>" could name another request)
                eids = [e for r in dict.fromkeys(request_ids) for e in self._engine_ids.get(r, ())]
                # an add still on its way must not be overtaken by this call (the engine would
                # not know the id yet): those are aborted after their add (_abort_engine_id)
                unsent = [e for e in eids if not self._requests[e].sent]
                request_ids = [e for e in eids if e not in unsent]
            for eid in unsent:
                self._abort_engine_id(eid)
            if not request_ids:
                return {"aborted": [e.rsplit("@", 1)[0] for e in unsent]}
        res = await self.utility("abort_requests", request_ids or None)
        # engine ids back to the callers' (an engine id is "<request id>@<serial>")
        return {**res, "aborted": [r.rsplit("@", 1)[0] for r in [*unsent, *res.get("aborted", [])]]}

    async def update_weights_from_path(self, path: str, staging: str = "host", contract: dict | None = None) -> dict:
        """Stage the checkpoint while requests run, then pause only to copy it in
        (EngineCore.utility_update_weights_from_path); {"weight_version", "stage_s",
        "pause_s", "copy_s", ...}."""
        res = await self.utility("update_weights_from_path", path, staging, contract)
        self.weight_version = max(self.weight_version, res["weight_version"])
        return res

    async def engine_stats(self) -> dict:
        return await self.utility("stats")

    # upstream vLLM's four-phase weight transfer (vllm/weight_sync/transfer.py)
    async def weight_transfer(self, op: str, *args: Any) -> Any:
        """Run one WeightTransfer operation in the engine; a new version is recorded here."""
        res = await self.utility("weight_transfer", op, *args)
        if isinstance(res, dict) and isinstance(res.get("weight_version"), int):
            self.weight_version = max(self.weight_version, res["weight_version"])
        return res

    async def init_weight_transfer_engine(self, request) -> dict:
        """Join the trainer's broadcast group: `request` is {"init_info": {master_address,
        master_port, rank_offset, world_size}} (or the init_info itself). Blocks until the
        trainer joins."""
        return await self.weight_transfer("init", _unwrap(request, "init_info"))

    async def start_weight_update(self) -> dict:
        """Open one update: generation pauses (requests keep their KV) until finish."""
        return await self.weight_transfer("start")

    async def update_weights(self, request) -> dict:
        """Receive one manifest's tensors into the started update: `request` is
        {"update_info": {names, dtype_names, shapes}} (or the update_info itself)."""
        return await self.weight_transfer("receive", _unwrap(request, "update_info"))

    async def finish_weight_update(self, weight_version: str | None = None) -> dict:
        """Close the update (one new version, labelled `weight_version`); requests resume."""
        return await self.weight_transfer("finish", weight_version)

    async def update_weight_version(self, new_version: str) -> dict:
        return await self.weight_transfer("set_label", new_version)

    async def get_weight_version(self) -> str:
        """The label of the weights serving now (their version number when unlabelled)."""
        return await self.weight_transfer("label")

    async def shutdown_weight_transfer_engine(self) -> dict:
        return await self.weight_transfer("close")

    # ---- receiver thread ------------------------------------------------------------------
    def _on_outputs(self, out: EngineCoreOutputs) -> None:
        self.weight_version = out.weight_version
        self.stats = out.stats
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        stops, gen, broken = [], 0, []
        now = time.monotonic()
        with self._lock:
            for t in out.deltas:
                d = RequestDelta(*t)   # fills in the defaults of trailing fields a shorter tuple lacks
                entry = self._requests.get(d.request_id)
                if entry is None:
                    continue  # aborted while this step ran
                try:
                    gen += self._apply_delta(d, entry, now, stops, deliveries)
                except Exception as exc:  # noqa: BLE001 -- one request's bad output must not lose the others
                    logger.exception("handling the engine's output for request %s failed", d.request_id)
                    if self._forget(d.request_id) is not None:
                        err = EngineError(f"handling the engine's output for this request failed: {exc!r}")
                        deliveries.setdefault(entry.stream.loop, []).append((entry.stream, err))
                        broken.append(AbortRequest(d.request_id))
            for f in out.failures:
                err = ValueError(f.message) if f.invalid else EngineError(f.message)
                for rid in f.request_ids:
                    entry = self._forget(rid)
                    if entry is not None:
                        deliveries.setdefault(entry.stream.loop, []).append((entry.stream, err))
            self.num_generation_tokens += gen
        if stops or broken:
            try:
                self.client.send(stops + broken)
            except EngineDeadError:
                pass
        for loop, items in deliveries.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: nobody will read these
                for s, item in items:
                    if not ((isinstance(item, RequestOutput) and item.finished)
                            or (item is _CHANGED and s.state is not None and s.state.finished)):
                        self._abort_engine_id(s.engine_id)

    def _apply_delta(self, d: RequestDelta, entry: _Entry, now: float, stops: list, deliveries: dict) -> int:
        """One delta into its request's state (caller holds the lock): its stop, its latency,
        its delivery. Returns the tokens it brought."""
        state = entry.state
        was_done = state.finish[d.index] is not None
        stop = state.apply(d)
        if not was_done:   # tokens after a stop string are dropped: not latency
            self.latency.tokens(entry.times, d.index, len(d.new_token_ids), now, d.scheduled_time)
        if stop is not None:
            stops.append(StopChild(d.request_id, d.index, stop))
        if not was_done and state.finish[d.index] is not None:
            self._outstanding -= 1
            self.finished_by_reason[state.finish[d.index]] += 1
        s = entry.stream
        if state.finished:
            generated = [len(ids) for ids in state.token_ids]
            self.latency.finished(entry.times, now, max(generated, default=0))
            self.sizes.finished(len(state.prompt_token_ids), generated, state.params.n, state.params.max_tokens)
            del self._requests[d.request_id]
            self._drop_engine_id(state.request_id, d.request_id)
            if not s.tail:
                deliveries.setdefault(s.loop, []).append((s, state.output()))
            elif not s.notified:   # the reader builds the last tail (a queued _CHANGED builds it too)
                s.notified = True
                deliveries.setdefault(s.loop, []).append((s, _CHANGED))
        elif s.stream and not s.notified:  # non-streaming consumers need the final output only
            s.notified = True
            deliveries.setdefault(s.loop, []).append((s, _CHANGED))
        return len(d.new_token_ids)

    def _on_dead(self, reason: str) -> None:
        err = EngineDeadError(f"the engine is not running: {reason}")
        with self._lock:
            entries = list(self._requests.values())
            self._requests.clear()
            self._engine_ids.clear()
            self._outstanding = 0
            callbacks, self._death_callbacks = self._death_callbacks, []
        deliveries: dict = {}
        for e in entries:
            deliveries.setdefault(e.stream.loop, []).append((e.stream, err))
        for loop, items in deliveries.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass
        if self.client.shutdown_requested:
            return   # stopped on purpose: no death to report
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 -- one failing callback must not keep the others from running
                logger.exception("an engine-death callback failed")


def _deliver(items: list) -> None:
    for stream, item in items:
        stream._put(item)


def _unwrap(request, key: str) -> dict:
    """upstream's request objects or dicts ({key: {...}}), or the inner dict itself."""
    if hasattr(request, key):
        return getattr(request, key)
    if isinstance(request, dict) and key in request:
        return request[key]
    return request
