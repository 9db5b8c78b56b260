"""The API server's side of the engine core: start it, send it commands, read its outputs.

`EngineCoreClient.start_process(engine_kwargs)` spawns the engine core in its own
process (what `vllm serve` does); `EngineCoreClient.start_thread(engine)` runs the
same loop on a thread over an engine you already built (tests, notebooks). Either
way the client talks to it through two one-way pipes of pickled message lists
(vllm/engine/core_messages.py). A receiver thread reads the outputs and hands each
EngineCoreOutputs to `on_outputs`; when the engine goes away (crash, exit, kill)
the pipe reaches EOF and `on_dead` is called once.

Utility calls (pause, resume, weight updates, stats) return a
concurrent.futures.Future settled when the engine answers.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import pickle
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

from vllm.engine.core_messages import EngineCoreOutputs, ReadyInfo, UtilityCall

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core is not running (shut down or crashed): HTTP 503."""


class EngineStartError(RuntimeError):
    """The engine core failed while starting (bad model path, out of memory, ...)."""


_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "NotImplementedError": NotImplementedError}


class EngineCoreClient:
    def __init__(self, inbox: Connection, outbox: Connection, info: ReadyInfo, *, process=None, thread=None):
        self._inbox = inbox          # we write commands here
        self._outbox = outbox        # we read outputs here
        self.info = info
        self.process = process
        self.thread = thread
        self._send_lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self.on_outputs: Callable[[EngineCoreOutputs], None] = lambda out: None
        self.on_dead: Callable[[str], None] = lambda reason: None
        self.dead_reason: str | None = None
        self._closing = False
        self._receiver = threading.Thread(target=self._receive_loop, name="vllm-core-receiver", daemon=True)

    # ---- start ----------------------------------------------------------------------------
    @classmethod
    def start_process(cls, engine_kwargs: dict, *, startup_timeout: float | None = None) -> "EngineCoreClient":
        """Spawn the engine core process and wait until its engine is built."""
        from vllm.engine.core import run_engine_core_process

        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA state
        cmd_r, cmd_w = ctx.Pipe(duplex=False)
        out_r, out_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=run_engine_core_process, name="vllm-engine-core",
                           args=(engine_kwargs, cmd_r, out_w, os.getpid(), logging.getLogger().level or logging.INFO),
                           daemon=True)
        proc.start()
        # Our copies of the child's ends: closed, so its death reads as EOF here.
        cmd_r.close()
        out_w.close()
        try:
            info = cls._wait_ready(out_r, proc, startup_timeout)
        except BaseException:
            _stop_process(proc, 5.0)
            raise
        client = cls(cmd_w, out_r, info, process=proc)
        client._receiver.start()
        logger.info("engine core process %d ready", proc.pid)
        return client

    @staticmethod
    def _wait_ready(conn: Connection, proc, timeout: float | None) -> ReadyInfo:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not conn.poll(1.0):
            if not proc.is_alive():
                raise EngineStartError(f"the engine process exited with code {proc.exitcode} while starting")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineStartError(f"the engine did not start within {timeout:.0f} s")
        try:
            kind, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            proc.join(5.0)
            raise EngineStartError(f"the engine process exited with code {proc.exitcode} while starting") from None
        if kind != "ready":
            raise EngineStartError(f"the engine failed to start: {payload}")
        return payload

    @classmethod
    def start_thread(cls, engine) -> "EngineCoreClient":
        """Run the engine core loop on a thread of this process, over `engine` (an LLMEngine).
        From then on only that thread may touch the engine."""
        from vllm.engine.core import EngineCore, ready_info

        cmd_r, cmd_w = multiprocessing.Pipe(duplex=False)
        out_r, out_w = multiprocessing.Pipe(duplex=False)
        core = EngineCore(engine)

        def run() -> None:
            try:
                core.run(cmd_r, out_w)
            except BaseException:  # noqa: BLE001 -- logged; the client sees EOF
                logger.exception("engine core thread crashed")
            finally:
                out_w.close()
                cmd_r.close()
        thread = threading.Thread(target=run, name="vllm-engine-core", daemon=True)
        client = cls(cmd_w, out_r, ready_info(engine), thread=thread)
        client.core = core   # the loop's EngineCore, for tests that hold it between steps (staging_hook)
        thread.start()
        client._receiver.start()
        return client

    # ---- commands -------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None

    @property
    def shutdown_requested(self) -> bool:
        """shutdown() was called: the engine's end that follows is a stop, not a death."""
        return self._closing

    def send(self, msgs: list) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead_reason}")
        data = pickle.dumps(msgs, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._send_lock:
                self._inbox.send_bytes(data)
        except (OSError, ValueError) as err:
            raise EngineDeadError(f"the engine is not running: {err}") from err

    def utility(self, method: str, *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = fut
        try:
            self.send([UtilityCall(call_id, method, args)])
        except EngineDeadError as err:
            self._calls.pop(call_id, None)
            fut.set_exception(err)
        return fut

    # ---- outputs --------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        reason = "the engine stopped"
        try:
            while True:
                try:
                    out: EngineCoreOutputs = pickle.loads(self._outbox.recv_bytes())
                except (EOFError, OSError):
                    break
                # the batch's outputs first, then its utility answers: what the engine generated
                # before it answered (say the last tokens of the requests a pause(mode="wait")
                # let finish) is delivered and counted before the answer reaches its caller
                try:
                    self.on_outputs(out)
                except Exception:  # noqa: BLE001 -- one bad batch must not stop the receiver
                    logger.exception("handling engine outputs failed")
                for res in out.utility_results:
                    fut = self._calls.pop(res.call_id, None)
                    # a caller that gave up on its answer (an awaiting task cancelled, a timeout)
                    # cancelled the future: the answer is dropped, the engine serves on
                    if fut is None or not fut.set_running_or_notify_cancel():
                        continue
                    if res.ok:
                        fut.set_result(res.value)
                    else:
                        name, message = res.value
                        fut.set_exception(_ERRORS.get(name, RuntimeError)(message))
        except BaseException as err:  # noqa: BLE001
            reason = f"the output receiver failed: {err!r}"
            logger.exception("engine output receiver crashed")
        if self.process is not None:
            self.process.join(2.0)
            if self.process.exitcode not in (None, 0):
                reason = f"the engine process died (exit code {self.process.exitcode})"
        self.dead_reason = reason if not self._closing else "the server is shutting down"
        if not self._closing:
            logger.error("engine core is gone: %s", self.dead_reason)
        for fut in list(self._calls.values()):
            if not fut.done():
                fut.set_exception(EngineDeadError(self.dead_reason))
        self._calls.clear()
        self.on_dead(self.dead_reason)

    # ---- stop -----------------------------------------------------------------------------
    def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the engine to stop, wait for it (at most `timeout` s), then make sure it is gone."""
        if self._closing:
            return
        self._closing = True
        if self.dead_reason is None:
            try:
                self.utility("shutdown")
            except EngineDeadError:
                pass
        if self.process is not None:
            _stop_process(self.process, timeout)
        elif self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                logger.warning("engine thread did not stop within %.0f s (a step is still running)", timeout)
        try:
            self._inbox.close()
        except OSError:
            pass
        self._receiver.join(5.0)


def _stop_process(proc, timeout: float) -> None:
    proc.join(timeout)
    if proc.is_alive():
        logger.warning("engine process %d did not exit in %.0f s: terminating it", proc.pid, timeout)
        proc.terminate()
        proc.join(5.0)
    if proc.is_alive():
        proc.kill()
        proc.join(5.0)
