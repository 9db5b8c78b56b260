"""AsyncLLM: an asyncio front for one LLMEngine driven by one background thread.

The engine is not thread-safe, so exactly one thread -- the engine thread --
ever touches it (and its tokenizer). Everyone else talks to that thread
through a thread-safe command queue:

    caller (any event loop / thread)           engine thread
    --------------------------------           -------------
    add_requests  --("add", ..., Future)-->    engine.add_request(...)  -> Future result / ValueError
    abort         --("abort", rid)------->     engine.abort_request(rid)
    call(fn)      --("call", fn, Future)-->    fn(engine)               -> Future result
                  <--loop.call_soon_threadsafe-- RequestOutputs of each step()

Each request owns a RequestStream: an asyncio.Queue living on the caller's
event loop, fed with loop.call_soon_threadsafe so the engine thread never
blocks on a slow consumer. Between steps the engine thread drains every
pending command, so new requests join the running batch at the next step
(continuous batching), and it sleeps on the queue when there is no work.

Failure isolation:
  * add_request validates before queueing, so a ValueError there (bad prompt,
    bad params) reaches only its caller, as a ValueError, and nothing else.
    A batch of prompts (one HTTP request) is added atomically: if one prompt is
    invalid, the ones already added in that batch are aborted before any step.
  * An unexpected exception inside step() cannot be attributed to one request,
    so every in-flight request fails with EngineError (HTTP 500), all of them
    are aborted to free their KV blocks, the traceback is logged, and the loop
    carries on serving new requests.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while running a request (not the request's fault: HTTP 500)."""


class EngineDeadError(EngineError):
    """The engine thread is not running (shut down or crashed): HTTP 503."""


# Markers pushed into a RequestStream besides RequestOutputs.
_ABORTED = object()


@dataclass
class _Add:
    items: list[tuple[str, Any, SamplingParams]]
    stream: bool
    streams: list["RequestStream"]
    done: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    done: concurrent.futures.Future


@dataclass
class _Shutdown:
    pass


class RequestStream:
    """The outputs of one request, consumed on the event loop that created it.

    An async iterator of RequestOutputs: partial ones when added with
    stream=True, then exactly one with finished=True, after which it stops. If
    the request is aborted by someone else it just stops; if the engine fails,
    EngineError is raised. A consumer that stops early must call abort() (the
    HTTP layer does so whenever a response ends) to free the engine's slot.
    """

    def __init__(self, owner: "AsyncLLM", request_id: str, loop: asyncio.AbstractEventLoop):
        self.owner = owner
        self.request_id = request_id
        self.loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False  # True once the final output, an error or an abort was seen

    # -- engine-thread side ----------------------------------------------------------------
    def _put(self, item: Any) -> bool:
        """Hand an item to the consumer's loop; False if that loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, item)
            return True
        except RuntimeError:  # the consumer's event loop is closed: nobody will read this
            return False

    # -- consumer side ---------------------------------------------------------------------
    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        # A plain iterator, not an async generator: nothing here depends on the
        # iterator being closed, so the owner's abort() is the one cleanup path.
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _ABORTED:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already ended; safe to call any number of times."""
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)


class AsyncLLM:
    """Runs `engine` (an LLMEngine) on a dedicated thread; every method is safe to call from any thread.

    >>> llm = LLM(device="cpu")
    >>> async_llm = AsyncLLM(llm.llm_engine)
    >>> async for out in async_llm.generate("Hello", SamplingParams(max_tokens=8)):
    ...     final = out
    >>> async_llm.shutdown()
    """

    def __init__(self, engine, *, start: bool = True):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # request id -> stream; touched only by the engine thread once the thread runs.
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self.num_step_failures = 0
        if start:
            self.start()

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        # daemon: a step stuck in a kernel must not keep the process alive at exit.
        self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped.is_set()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Fail the in-flight requests, stop the engine thread and wait for it (at most `timeout` s)."""
        if self._thread is None or self._stopped.is_set():
            self._stopped.set()
            return
        self._commands.put(_Shutdown())
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %.0f s (a step is still running)", timeout or 0)

    def _check_alive(self) -> None:
        if not self.is_running:
            raise EngineDeadError("the engine is not running" + (f": {self._error!r}" if self._error else ""))

    # ---- public API (any thread) -------------------------------------------------------
    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def add_requests(self, items: Sequence[tuple[str, Any, SamplingParams]], *,
                           stream: bool = False) -> list[RequestStream]:
        """Add several requests atomically; returns one stream per request, in order.

        Raises ValueError (nothing added) if any prompt or params is invalid, and
        EngineDeadError if the engine is not running.
        """
        self._check_alive()
        loop = asyncio.get_running_loop()
        streams = [RequestStream(self, rid, loop) for rid, _, _ in items]
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Add(list(items), stream, streams, done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # The caller went away while the add was queued: whatever got added must go.
            for s in streams:
                self.abort(s.request_id)
            raise
        return streams

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None, *,
                       stream: bool = False) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs: with stream=True one per step it advances, the last one finished.

        The ValueError of an invalid request is raised from the first iteration.
        To stop early, leave the loop inside `contextlib.aclosing(...)` (or call
        abort(request_id)): a plain `break` only aborts once the abandoned
        generator is garbage-collected.
        """
        rid = request_id or self.new_request_id()
        (s,) = await self.add_requests([(rid, prompt, params)], stream=stream)
        try:
            async for out in s:
                yield out
        finally:  # closed early (break + aclose, cancellation): stop the request
            s.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished). Never blocks."""
        if not self._stopped.is_set():
            self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread (e.g. tokenizer work) and return its result."""
        self._check_alive()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(fn, done))
        return await asyncio.wrap_future(done)

    def _submit(self, cmd) -> None:
        self._commands.put(cmd)
        # The engine thread sets _stopped *before* its last drain of the queue, so a
        # command put before this check is either drained (and answered) by it, or
        # the check sees the thread stopped: no caller can wait forever.
        if self._stopped.is_set():
            _set_exception(cmd.done, EngineDeadError("the engine is not running"))

    # ---- engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        backoff = 0.0
        try:
            while True:
                # Block only when there is nothing to step; otherwise take what is pending.
                busy = engine.has_unfinished_requests()
                cmds = self._drain(block=not busy)
                for i, cmd in enumerate(cmds):
                    if isinstance(cmd, _Shutdown):
                        self._fail_all(EngineDeadError("the server is shutting down"))
                        for later in cmds[i + 1:]:  # drained already: answer them here
                            if isinstance(later, (_Add, _Call)):
                                _set_exception(later.done, EngineDeadError("the server is shutting down"))
                        return
                    try:
                        self._handle(cmd)
                    except Exception:  # noqa: BLE001 -- one bad command must not stop the engine thread
                        logger.exception("engine command %s failed", type(cmd).__name__)
                if not engine.has_unfinished_requests():
                    continue
                try:
                    outputs = engine.step()
                except Exception as err:  # noqa: BLE001 -- any failure here must not kill the thread
                    self.num_step_failures += 1
                    logger.exception("engine step failed; failing %d in-flight request(s)", len(self._streams))
                    self._fail_all(EngineError(f"engine step failed: {type(err).__name__}: {err}"))
                    # If the engine still reports work nobody owns, do not spin on a broken step.
                    backoff = min(max(backoff * 2, 0.01), 1.0)
                    if engine.has_unfinished_requests():
                        time.sleep(backoff)
                    continue
                backoff = 0.0
                for out in outputs:
                    try:
                        self._deliver(out)
                    except Exception:  # noqa: BLE001 -- keep delivering the others
                        logger.exception("delivering the output of %s failed", out.request_id)
        except BaseException as err:  # a bug in this loop itself: record it so /health reports it
            self._error = err
            logger.exception("engine thread crashed")
            self._fail_all(EngineDeadError(f"engine thread crashed: {err!r}"))
        finally:
            self._stopped.set()
            self._reject_pending()

    def _drain(self, block: bool) -> list:
        cmds = []
        if block:
            cmds.append(self._commands.get())
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _handle(self, cmd) -> None:
        engine = self.engine
        if isinstance(cmd, _Add):
            # False when the caller was cancelled while the command was queued: add nothing.
            if not cmd.done.set_running_or_notify_cancel():
                return
            added: list[str] = []
            try:
                for (rid, prompt, params), s in zip(cmd.items, cmd.streams):
                    if rid in self._streams:
                        raise ValueError(f"request id {rid!r} is already in use")
                    engine.add_request(rid, prompt, params, stream=cmd.stream)
                    added.append(rid)
                    self._streams[rid] = s
            except Exception as err:  # noqa: BLE001 -- reported to the caller, nothing else changes
                for rid in added:
                    engine.abort_request(rid)
                    self._streams.pop(rid, None)
                if not isinstance(err, ValueError):
                    logger.exception("add_request failed unexpectedly")
                    err = EngineError(f"add_request failed: {type(err).__name__}: {err}")
                cmd.done.set_exception(err)
                return
            cmd.done.set_result(None)
        elif isinstance(cmd, _Abort):
            s = self._streams.pop(cmd.request_id, None)
            engine.abort_request(cmd.request_id)
            if s is not None and not s.finished:
                s._put(_ABORTED)  # an abort by someone else than the consumer: end its iteration
        elif isinstance(cmd, _Call):
            if cmd.done.set_running_or_notify_cancel():
                try:
                    cmd.done.set_result(cmd.fn(engine))
                except BaseException as err:  # noqa: BLE001 -- belongs to the caller
                    cmd.done.set_exception(err)

    def _deliver(self, out: RequestOutput) -> None:
        s = self._streams.get(out.request_id)
        if s is None:  # aborted after this step was scheduled
            return
        if out.finished:
            del self._streams[out.request_id]
        if not s._put(out) and not out.finished:
            # The consumer's loop is gone: stop spending compute on this request.
            del self._streams[out.request_id]
            self.engine.abort_request(out.request_id)

    def _fail_all(self, err: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for rid, s in streams.items():
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 -- keep failing the others
                logger.exception("abort of %s failed", rid)
            s._put(err)

    def _reject_pending(self) -> None:
        """After the loop ends, answer commands still queued so no caller waits forever."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, (_Add, _Call)):
                _set_exception(cmd.done, EngineDeadError("the engine is not running"))


def _set_exception(fut: concurrent.futures.Future, err: BaseException) -> None:
    """Fail a future unless it is already settled (or cancelled) -- never raises."""
    try:
        if fut.set_running_or_notify_cancel():
            fut.set_exception(err)
    except (RuntimeError, concurrent.futures.InvalidStateError):
        pass  # already running or done: its owner answers it
