"""EngineCore: the engine's busy loop behind `vllm serve`, in its own process.

The API server and the engine used to share one process and one GIL, so every
HTTP chunk the server wrote was time the engine could not schedule. Now the
engine runs here, alone: it drains the commands the API server sent (typed
messages, vllm/engine/core_messages.py), runs one engine step, and sends ONE
message with every request's new token ids for that step. It never touches text:
the client (vllm/engine/core_client.py) detokenizes and applies stop strings, so
the engine's host time goes to scheduling and the model only.

The loop runs in a child process (`vllm serve`, run_engine_core_process) or in a
thread of the caller's process (build_app_from_llm: tests and notebooks that
want to reach into the engine). Both use the same pipes and messages.

Lifetime: the process exits when its parent does (its command pipe reaches EOF,
its parent pid changes, or the kernel's parent-death signal fires), so it is
never orphaned; the client sees it die as EOF on its output pipe.
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection

from vllm.engine.core_messages import (
    AbortRequest, AddRequest, EngineCoreOutputs, EngineStats, ReadyInfo, RequestFailure, StopChild,
    UtilityCall, UtilityResult,
)

logger = logging.getLogger(__name__)

# While idle the loop wakes this often to check that its parent is still alive.
_IDLE_POLL_S = 1.0
# ... and this often while a checkpoint is staged, so its update lands soon after
_STAGING_POLL_S = 0.005
# how long shutdown waits for a staging thread to notice its cancellation
_STAGING_JOIN_S = 30.0
PAUSE_MODES = ("abort", "wait", "keep")
_DEFERRED = object()  # a utility whose answer comes later (pause(mode="wait"))


class EngineCore:
    """Drives one LLMEngine from a command pipe; see the module docstring."""

    def __init__(self, engine):
        self.engine = engine
        self._deltas: list[tuple] = []   # RequestDelta fields
        self._utility: list[UtilityResult] = []
        self._failures: list[RequestFailure] = []
        # constrained requests whose grammar compiles off the loop, in arrival order: (future,
        # AddRequest); queued once compiled, so a large schema does not stall every stream
        self._compiling: list = []
        # an abort or a stop freed requests without a step: the client's stats (its /metrics
        # gauges) need the new counts even though no token came
        self._stats_changed = False
        self._stop = False
        # pause(mode="wait") calls answered once the requests in flight have finished:
        # (call id, clear_cache); AddRequests that arrive meanwhile are held, then queued
        self._pause_waiting: list[tuple[int, bool]] = []
        self._held: list = []
        self._call_id: int | None = None  # the utility call being handled
        self.weight_group = None      # vllm.weight_sync.group.WeightGroup once init_weight_group ran
        # update_weights_from_path: the checkpoint being staged on its thread (one at a time)
        self._staging = None          # vllm.weight_sync.staging.CheckpointStaging
        self.staging_hook = None      # tests: hook(staging, name) on the staging thread before each tensor is read
        self.group_contract = None    # the trainer's ExecutionContract given at init
        engine.output_builder = self._build_deltas

    # ---- outputs ------------------------------------------------------------------------
    def _build_deltas(self, group, finished: bool) -> None:
        """LLMEngine output builder: the new token ids (and logprobs) of each sample, for the
        client's RequestState (the same deltas an offline engine feeds its own)."""
        self._deltas.extend(self.engine.deltas(group))

    def _stats(self) -> EngineStats:
        eng = self.engine
        sched = eng.scheduler
        queries, hits = eng.kv.prefix_cache_counts
        # waiting: the scheduler's queue of sequences, and those of the requests not in it yet
        # (held by a pending pause(mode="wait"), or their grammars compiling)
        waiting = (len(sched.waiting) + sum(m.params.n for m in self._held)
                   + sum(m.params.n for _, m in self._compiling))
        return EngineStats(len(sched.running), waiting, eng.kv.usage, eng.kv.num_free_blocks,
                           sched.num_preemptions, eng.step_count, eng.paused, queries, hits)

    def take_outputs(self) -> EngineCoreOutputs | None:
        """The outputs gathered since the last call (None when there are none)."""
        if not (self._deltas or self._utility or self._failures or self._stats_changed):
            return None
        out = EngineCoreOutputs(self._deltas, self.engine.weight_version, self._stats(), self._utility, self._failures)
        self._deltas, self._utility, self._failures = [], [], []
        self._stats_changed = False
        return out

    # ---- commands -----------------------------------------------------------------------
    def handle(self, msg) -> None:
        eng = self.engine
        if isinstance(msg, AddRequest):
            self._stats_changed = True   # the waiting count moves, stepping or not (a paused engine does not)
        if isinstance(msg, AddRequest) and self._pause_waiting:
            self._held.append(msg)  # pause(mode="wait") is letting the requests in flight finish
        elif isinstance(msg, AddRequest) and msg.params.structured_outputs is not None:
            try:
                self._compiling.append((eng.grammar_compiler().compile_in_background(msg.params.structured_outputs),
                                        msg))
            except ValueError as err:   # xgrammar missing
                self._failures.append(RequestFailure([msg.request_id], str(err), True))
        elif isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            # the client has forgotten it: wherever it waits (compiling, held by a pause(wait)), it goes
            self._compiling = [(f, m) for f, m in self._compiling if m.request_id != msg.request_id]
            self._held = [m for m in self._held if m.request_id != msg.request_id]
            eng.abort_request(msg.request_id)
            self._stats_changed = True
        elif isinstance(msg, StopChild):
            eng.stop_child(msg.request_id, msg.index, msg.stop_reason)
            self._stats_changed = True
        elif isinstance(msg, UtilityCall):
            try:
                fn = getattr(self, f"utility_{msg.method}", None)
                if fn is None:
                    raise NotImplementedError(f"the engine has no utility method {msg.method!r}")
                self._call_id = msg.call_id
                result = fn(*msg.args)
                if result is not _DEFERRED:
                    self._utility.append(UtilityResult(msg.call_id, True, result))
            except Exception as err:  # noqa: BLE001 -- the caller gets it
                if not isinstance(err, (ValueError, NotImplementedError)):
                    logger.exception("engine utility %s failed", msg.method)
                self._utility.append(UtilityResult(msg.call_id, False, (type(err).__name__, str(err))))
        else:
            logger.error("engine core: unknown message %r", type(msg).__name__)

    def _add(self, msg: AddRequest, compiled_grammar=None) -> None:
        """Queue one request; a ValueError (bad prompt, id in use, bad grammar) fails it alone."""
        try:
            prompt = {"prompt_token_ids": msg.prompt_token_ids}
            if msg.cache_salt is not None:
                prompt["cache_salt"] = msg.cache_salt
            self.engine.add_request(msg.request_id, prompt, msg.params, stream=True, compiled_grammar=compiled_grammar,
                                    priority=msg.priority)
        except ValueError as err:
            self._failures.append(RequestFailure([msg.request_id], str(err), True))

    def _admit_held(self, request_ids=None) -> None:
        """Queue the requests a pending pause(mode="wait") holds (those of `request_ids`; None:
        all), so that an abort that follows ends them like the others: their clients get
        finish_reason "abort" instead of the request running after resume."""
        keep = []
        for m in self._held:
            if request_ids is None or m.request_id in request_ids:
                self._add(m)
            else:
                keep.append(m)
        self._held = keep

    def _settle_compiles(self, wait: bool = False) -> None:
        """Queue the constrained requests whose grammar has compiled, in arrival order (all of
        them with `wait`: a pause or an abort of every request then finds them in the engine)."""
        while self._compiling and (wait or self._compiling[0][0].done()):
            future, msg = self._compiling.pop(0)
            try:
                compiled = future.result()
            except ValueError as err:
                self._failures.append(RequestFailure([msg.request_id], str(err), True))
                continue
            self._add(msg, compiled)

    def step(self) -> None:
        """One engine step; a failure fails (and aborts) every request in flight."""
        eng = self.engine
        try:
            eng.step()
        except Exception as err:  # noqa: BLE001 -- the loop must survive a failed step
            logger.exception("engine step failed; failing every request in flight")
            ids = list(eng._groups)
            for rid in ids:
                try:
                    eng.abort_request(rid)
                except Exception:  # noqa: BLE001
                    logger.exception("abort of %s failed", rid)
            eng._inflight = None
            self._failures.append(RequestFailure(ids, f"engine step failed: {type(err).__name__}: {err}", False))

    @property
    def busy(self) -> bool:
        return self.engine.requests_running

    # ---- utility methods (UtilityCall.method = the name after "utility_") ---------------
    def utility_pause(self, mode: str = "keep", clear_cache: bool = False) -> dict:
        """Pause generation (upstream's `pause_generation` modes): "keep" freezes the requests
        in flight with their KV (resume continues them), "abort" ends them now with what
        they generated (finish_reason "abort"), "wait" lets them finish first (its answer
        comes once they have; requests that arrive meanwhile wait, paused, for resume).
        `clear_cache` then drops every cached prefix."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        eng = self.engine
        self._settle_compiles(wait=True)   # requests still compiling are in flight too
        if mode == "abort":
            self._admit_held()   # held by an earlier pause(mode="wait"): ended too
            eng.abort_requests()
        # an engine already paused runs nothing: "wait" has nothing to wait for (frozen requests
        # would never finish), and it answers now, as upstream's pause_generation does
        if mode == "wait" and eng.has_unfinished_requests() and not eng.paused:
            self._pause_waiting.append((self._call_id, bool(clear_cache)))
            return _DEFERRED
        # pause(mode="wait") calls still waiting are answered too: the engine is paused now
        return self._answer_pause_waits(clear_cache)

    def _settle_pause(self) -> None:
        """Answer the pause(mode="wait") calls once nothing is in flight."""
        if self._pause_waiting and not self.engine.has_unfinished_requests():
            self._answer_pause_waits(False)

    def _answer_pause_waits(self, clear_cache: bool) -> dict:
        """Pause now and answer every pause(mode="wait") call waiting; the requests held
        meanwhile then queue in the paused engine."""
        calls, self._pause_waiting = self._pause_waiting, []
        result = self._pause_now(clear_cache or any(clear for _, clear in calls))
        self._utility += [UtilityResult(call_id, True, result) for call_id, _ in calls]
        held, self._held = self._held, []
        for m in held:
            self.handle(m)
        return result

    def _pause_now(self, clear_cache: bool) -> dict:
        eng = self.engine
        eng.pause()
        transfer = eng.__dict__.get("_weight_transfer")   # an open weight update must not undo this pause
        if transfer is not None:
            transfer.keep_paused()
        if clear_cache:
            eng.kv.reset_prefix_cache(allow_in_use=True)
        return {"paused": True, "weight_version": eng.weight_version}

    def utility_abort_requests(self, request_ids: list[str] | None = None) -> dict:
        """End requests now (none given: every one in flight) with what they generated, without
        pausing."""
        if request_ids is not None and not (isinstance(request_ids, list) and all(isinstance(r, str) for r in request_ids)):
            raise ValueError("request_ids must be a list of request id strings")
        self._settle_compiles(wait=True)   # requests still compiling are in flight too
        self._admit_held(set(request_ids) if request_ids else None)   # held by a pause(mode="wait")
        before = set(self.engine._groups)
        self.engine.abort_requests(request_ids or None)
        return {"aborted": sorted(before - set(self.engine._groups))}

    def utility_resume(self) -> dict:
        self.engine.resume()
        result = {"paused": False, "weight_version": self.engine.weight_version}
        # a pause(mode="wait") still waiting is called off: its requests run on
        calls, self._pause_waiting = self._pause_waiting, []
        self._utility += [UtilityResult(call_id, True, result) for call_id, _ in calls]
        held, self._held = self._held, []
        for m in held:
            self.handle(m)
        return result

    def utility_stats(self) -> dict:
        eng = self.engine
        return {**self._stats()._asdict(), "num_unfinished": eng.scheduler.num_unfinished,
                "num_usable_blocks": eng.kv.num_usable_blocks, "weight_version": eng.weight_version,
                "has_unfinished": eng.has_unfinished_requests()}

    def utility_weight_version(self) -> int:
        return self.engine.weight_version

    def utility_reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self.engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def utility_sleep(self, level: int = 1) -> int:
        """Release the KV cache (LLMEngine.sleep: the weights stay; refused while requests
        run); the bytes released."""
        return self.engine.sleep(level)

    def utility_wake_up(self, tags=None) -> None:
        self.engine.wake_up(tags)

    def utility_is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def utility_collective_rpc(self, method, args=(), kwargs=None) -> list:
        """upstream's collective_rpc in the engine's process, between two steps
        (LLMEngine.collective_rpc; a function came pickled: a module-level one)."""
        return self.engine.collective_rpc(method, None, args, kwargs)

    def utility_execution_contract(self) -> dict:
        return self.engine.execution_contract().to_dict()

    def utility_update_weights_from_path(self, path: str, staging: str = "host", contract: dict | None = None):
        """In-place update from a checkpoint directory. A thread reads, casts (the load rule)
        and validates it into staging buffers (`staging`: "host" or "device";
        vllm/weight_sync/staging.py) while requests keep running; then, at a step boundary,
        the engine pauses only for the copy into the parameters, the version bump and the
        prefix-cache drop (`_settle_staging`). The answer comes then: {"weight_version",
        "stage_s", "pause_s", "copy_s", ...}. A rejected checkpoint changes nothing. One
        update at a time: another while one stages is refused (ValueError). `contract`: the
        sender's ExecutionContract.to_dict(), refused unless compatible."""
        from vllm.model_loader.loader import checkpoint_files
        from vllm.weight_sync.staging import CheckpointStaging

        theirs = _contract_of(contract)
        if theirs is not None:
            self.engine.execution_contract().check_compatible(theirs)   # before anything is read

        if not isinstance(path, str) or not os.path.isdir(path):
            raise ValueError(f"weights path {path!r} is not a directory")
        if self._staging is not None:
            job = self._staging
            where = ("staged, waiting for the open weight update to finish" if job.done.is_set()
                     else f"{time.perf_counter() - job.started:.1f} s so far")
            raise ValueError(f"a weight update from {job.path!r} is already being staged ({where}); one update "
                             "from a path at a time: send this one after it answers (or abort it: "
                             "abort_weight_staging)")
        files = checkpoint_files(path)  # ValueError for a directory without weights, before anything starts
        self._check_checkpoint_config(path)
        job = CheckpointStaging(self.engine, path, files, staging=staging, hook=self.staging_hook)
        job.call_id = self._call_id
        self._staging = job.start()
        logger.info("staging weights from %s (%d file(s), %s staging)", path, len(files), staging)
        return _DEFERRED

    def _check_checkpoint_config(self, path: str) -> None:
        """A checkpoint directory's config.json must parse to the model's own config (the
        contract's semantic part): weights written under another rope theta, norm epsilon or
        layer plan would be served under this engine's, which no fresh load of that directory
        gives. ValueError naming the fields that differ; a directory without config.json passes
        (weights alone)."""
        import dataclasses
        import json

        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            return
        model_cfg = self.engine.executor.model.config
        parse = type(model_cfg).from_hf
        try:
            with open(cfg_path) as f:
                theirs = dataclasses.asdict(parse(json.load(f)))
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as err:
            raise ValueError(f"the config.json at {path!r} is not a config of this model's architecture: {err}")
        # against the engine's own checkpoint parsed the same way (the engine may have set fields
        # after parsing, e.g. the context it serves), else against the model's config
        ours = dataclasses.asdict(model_cfg)
        own = os.path.join(self.engine.config.model.path, "config.json")
        if os.path.isfile(own):
            with open(own) as f:
                ours = dataclasses.asdict(parse(json.load(f)))
        differ = sorted(k for k in ours if ours[k] != theirs.get(k))
        if differ:
            raise ValueError(f"the checkpoint at {path!r} is of another model configuration (differs in {differ}); "
                             "weight updates keep the model: the previous weights keep serving")

    def _settle_staging(self) -> None:
        """Between steps: once the staging thread is done, write the staged checkpoint (or
        answer its error). Waits while another weight update is open (the four-phase
        transfer keeps one open across calls)."""
        job = self._staging
        if job is None or not job.done.is_set() or self.engine.weight_update is not None:
            return
        self._staging = None
        job.join()
        try:
            if job.error is not None:
                raise job.error
            result = self._write_staged(job)
        except Exception as err:  # noqa: BLE001 -- the caller gets it
            if not isinstance(err, ValueError):
                logger.exception("weight update from %s failed", job.path)
            logger.warning("weight update from %s refused: %s", job.path, err)
            self._utility.append(UtilityResult(job.call_id, False, (type(err).__name__, str(err))))
        else:
            self._utility.append(UtilityResult(job.call_id, True, result))
        finally:
            self._release_staged(job)

    def _write_staged(self, job) -> dict:
        from vllm.weight_sync import WeightUpdate

        staged, eng = job.result, self.engine
        plan = staged.plan_for(eng.executor.model)   # this thread moves no parameter before the copy
        with self._paused():
            t0 = time.perf_counter()  # the step boundary: the step still on the GPU has finished
            update = WeightUpdate(eng, check_finite=False)   # the staging thread checked every byte
            if plan is not None:
                update.load_planned(plan, complete=True)   # staging refuses an incomplete checkpoint
            else:
                update.load(staged.pairs)    # the parameters moved since staging: place the tensors again
            version = update.finish()
        pause_s = time.perf_counter() - t0
        gib = 1 / 2**30
        logger.info("weights updated from %s: version %d; staged %.2f GiB (device %.2f, host %.2f) in %.2f s "
                    "while serving, paused %.1f ms (copy %.1f ms)", job.path, version,
                    (staged.device_bytes + staged.host_bytes) * gib, staged.device_bytes * gib,
                    staged.host_bytes * gib, job.stage_s, pause_s * 1e3, update.copy_s * 1e3)
        return {"weight_version": version, "stage_s": job.stage_s, "pause_s": pause_s, "copy_s": update.copy_s,
                "staging": job.staging, "device_bytes": staged.device_bytes, "host_bytes": staged.host_bytes}

    def _release_staged(self, job) -> None:
        """Drop the staging buffers; device ones go back to the driver (they were free
        memory outside the engine's share: the next update measures that again)."""
        if job.result is not None:
            job.result.release()
        job.result = None
        if job.device_bytes and not job.alive:
            import torch
            torch.cuda.empty_cache()

    def utility_abort_weight_staging(self) -> dict:
        """Cancel the update from a path still being staged (its call answers with a
        ValueError; the previous weights keep serving). Once staged, an update is written
        at the next step boundary and cannot be aborted."""
        aborted = self._stop_staging("aborted by the caller")
        return {"aborted": aborted, "weight_version": self.engine.weight_version}

    def _stop_staging(self, reason: str) -> bool:
        """Cancel the staging thread, wait for it, answer its call; False if none ran."""
        job, self._staging = self._staging, None
        if job is None:
            return False
        job.cancel(reason)
        if not job.join(_STAGING_JOIN_S):
            logger.warning("the weight staging thread did not stop within %.0f s (a read is blocked); "
                           "it exits when the read returns", _STAGING_JOIN_S)
        self._utility.append(UtilityResult(job.call_id, False, (
            "ValueError", f"the weight update from {job.path!r} was cancelled while staging ({reason}); "
                          f"the previous weights keep serving (version {self.engine.weight_version})")))
        self._release_staged(job)
        return True

    def _refuse_while_staging(self, what: str) -> None:
        """A checkpoint being staged is written when its staging ends, after whatever update
        lands meanwhile: that newer update would then serve for a moment and be overwritten
        by the older weights under a higher version. So another update waits for it."""
        job = self._staging
        if job is not None:
            raise ValueError(f"{what}: a weight update from {job.path!r} is being staged and is written when it "
                             "ends, after this one, which it would overwrite; send this one after that update "
                             "answers, or abort it first (abort_weight_staging)")

    def utility_update_weights_from_ipc(self, spec: dict) -> dict:
        """Buckets another process on this node exported (vllm/weight_sync/ipc.py), as one update."""
        from vllm.weight_sync.ipc import apply_ipc_update

        self._refuse_while_staging("update_weights_from_ipc")
        if not isinstance(spec, dict) or not isinstance(spec.get("buckets"), list):
            raise ValueError("update_from_ipc takes {'buckets': [...]} as exported by vllm.weight_sync.ipc")
        contract = _contract_of(spec.get("contract"))
        with self._paused():
            version = apply_ipc_update(self.engine, spec["buckets"], contract=contract)
        return {"weight_version": version}

    def utility_init_weight_group(self, spec: dict) -> dict:
        return self.init_weight_group(**_spec(spec, self.init_weight_group))

    def utility_update_weights_from_group(self, spec: dict) -> dict:
        if self.weight_group is None:
            raise ValueError("no weight group: POST /v1/weights/init_group first")
        try:
            self._refuse_while_staging("update_weights_from_group")
            kwargs = _spec(spec, self.update_weights_from_group)
        except ValueError:
            if self.weight_group is not None:
                self.weight_group.flag(0, src=self.weight_group.rank)  # the trainer waits for the handshake
            raise
        with self._paused():
            return self.update_weights_from_group(**kwargs)

    def utility_weight_transfer(self, op: str, *args):
        """upstream vLLM's four-phase weight transfer and TRL's per-tensor protocol
        (vllm/weight_sync/transfer.py: `op` is one of WeightTransfer's operations)."""
        from vllm.weight_sync.transfer import transfer_of
        if op in ("start", "check_trl"):    # the operations that open an update
            self._refuse_while_staging({"start": "start_weight_update", "check_trl": "update_named_param"}[op])
        return transfer_of(self.engine).call(op, *args)

    def _paused(self):
        """Pause stepping for the duration (requests keep their KV and continue after)."""
        import contextlib

        @contextlib.contextmanager
        def paused():
            eng = self.engine
            was = eng.paused
            eng.pause()
            try:
                yield
            finally:
                if not was and not eng.weights_torn:
                    eng.resume()
        return paused()

    def init_weight_group(self, *, host: str, port: int, contract: dict | None = None, backend: str = "nccl",
                          rank: int = 1, world_size: int = 2, timeout_s: float = 300.0,
                          group_name: str = "vllm-weights") -> dict:
        """Join the trainer's weight-broadcast group (vllm/weight_sync/group.py) after
        checking its execution contract against the engine's (ValueError naming the
        fields that differ). Blocks until the trainer joins too (or `timeout_s`)."""
        from vllm.weight_sync.group import GroupSpec, WeightGroup

        theirs = _contract_of(contract)
        if theirs is None:
            raise ValueError("init_group needs the trainer's execution contract ('contract': ExecutionContract.to_dict())")
        self.engine.execution_contract().check_compatible(theirs)
        spec = GroupSpec(str(host), port, rank, world_size, backend, float(timeout_s), str(group_name)).validate()
        if self.weight_group is not None:
            self.weight_group.close()
            self.weight_group = None
        try:
            self.weight_group = WeightGroup(spec, device=self.engine.executor.info.device if backend == "nccl" else None)
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 -- a rendezvous that failed is the caller's 400
            raise ValueError(f"could not join the weight group at {host}:{port} ({backend}): "
                             f"{type(err).__name__}: {err}") from err
        self.group_contract = theirs
        return {"joined": True, "rank": rank, "world_size": world_size, "backend": backend,
                "weight_version": self.engine.weight_version}

    def update_weights_from_group(self, *, manifest: list, bucket_bytes: int, backup: str = "auto",
                                  require_complete: bool = False) -> dict:
        """Receive one update broadcast by the trainer over the group made by
        init_weight_group, while the engine is paused (the caller pauses and resumes
        around it); returns {"weight_version": int}."""
        from vllm.weight_sync.group import receive_update

        if self.weight_group is None:
            raise ValueError("no weight group: POST /v1/weights/init_group first")
        t0 = time.perf_counter()
        version = receive_update(self.engine, self.weight_group, manifest, bucket_bytes, backup=backup,
                                 require_complete=require_complete, contract=self.group_contract)
        logger.info("weights updated from the group in %.2f s: version %d", time.perf_counter() - t0, version)
        return {"weight_version": version}

    def utility_shutdown(self) -> None:
        self._stop = True

    # ---- the loop -----------------------------------------------------------------------
    def run(self, inbox: Connection, outbox: Connection, parent_pid: int | None = None) -> None:
        """Serve commands from `inbox` and write outputs to `outbox` until shut down or orphaned."""
        sender = _Sender(outbox)
        try:
            while not self._stop:
                idle_s = _STAGING_POLL_S if self._staging is not None or self._compiling else _IDLE_POLL_S
                msgs = _receive(inbox, 0.0 if self.busy else idle_s)
                if msgs is None:
                    return  # the client is gone
                for m in msgs:
                    self.handle(m)
                if self._stop:
                    break
                if not msgs and not self.busy and parent_pid is not None and os.getppid() != parent_pid:
                    logger.warning("engine core: parent process %d is gone; exiting", parent_pid)
                    return
                self._settle_compiles()
                if self.busy:
                    self.step()
                self._settle_pause()
                self._settle_staging()
                out = self.take_outputs()
                if out is not None:
                    sender.send(out)
            # answer the shutdown call (and anything before it, a staging update included)
            self._stop_staging("the engine shut down")
            out = self.take_outputs()
            if out is not None:
                sender.send(out)
        finally:
            self._stop_staging("the engine loop ended")   # no thread outlives the loop
            for future, _ in self._compiling:
                future.cancel()
            if self.engine._grammars is not None:
                self.engine._grammars.close()
            sender.close()


def _spec(spec, fn) -> dict:
    """A request body as keyword arguments of `fn`; ValueError naming unknown or missing fields."""
    import inspect

    if not isinstance(spec, dict):
        raise ValueError("the request body must be a JSON object")
    try:
        inspect.signature(fn).bind(**spec)
    except TypeError as err:
        raise ValueError(f"invalid request body: {err}") from None
    return spec


def _contract_of(d):
    """The ExecutionContract in a request body (None if absent); ValueError if malformed."""
    if d is None:
        return None
    from vllm.contract import ExecutionContract
    try:
        return ExecutionContract.from_dict(d)
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"'contract' is not an execution contract (ExecutionContract.to_dict()): {err}") from None


def _receive(inbox: Connection, timeout: float) -> list | None:
    """Every message waiting (after up to `timeout` s for the first); None once the pipe is closed."""
    msgs: list = []
    try:
        if not inbox.poll(timeout):
            return msgs
        while True:
            msgs.extend(pickle.loads(inbox.recv_bytes()))
            if not inbox.poll(0):
                return msgs
    except (EOFError, OSError):
        return None


class _Sender:
    """Writes pickled outputs on a thread: a reader that lags never stalls the engine loop
    (the pipe write, which may block, releases the GIL)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.broken = False
        self.thread = threading.Thread(target=self._run, name="vllm-engine-sender", daemon=True)
        self.thread.start()

    def send(self, obj) -> None:
        self.q.put(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def _run(self) -> None:
        while True:
            data = self.q.get()
            if data is None:
                return
            if self.broken:
                continue
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError):
                self.broken = True  # the client is gone; the loop notices on its own pipe

    def close(self, timeout: float = 5.0) -> None:
        self.q.put(None)
        self.thread.join(timeout)


def ready_info(engine) -> ReadyInfo:
    cfg = engine.config
    return ReadyInfo(model_path=cfg.model.path, tokenizer_path=cfg.tokenizer or cfg.model.path,
                     max_model_len=cfg.model.max_model_len, vocab_size=cfg.model.vocab_size,
                     generation_defaults=dict(cfg.model.generation_defaults), weight_version=engine.weight_version,
                     num_kv_blocks=engine.executor.info.num_blocks, block_size=cfg.cache.block_size,
                     max_num_seqs=cfg.scheduler.max_num_seqs, scheduling_policy=cfg.scheduler.scheduling_policy,
                     eos_token_ids=tuple(engine.eos_token_ids))


def _set_parent_death_signal() -> None:
    """Linux: have the kernel send SIGTERM to this process when its parent dies."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_engine_core_process(engine_kwargs: dict, inbox: Connection, outbox: Connection, parent_pid: int,
                            log_level: int = logging.INFO) -> None:
    """Entry point of the engine process: build the engine, report ready (or the error), serve."""
    _set_parent_death_signal()
    # Ctrl-C reaches the whole process group: the API server shuts the engine down itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s")
    if os.getppid() != parent_pid:
        return
    try:
        from vllm import LLM
        engine = LLM(**engine_kwargs).llm_engine
    except BaseException as err:  # noqa: BLE001 -- reported to the API server, which exits with it
        message = f"{type(err).__name__}: {err}"
        if isinstance(err, (ValueError, NotImplementedError)):
            # bad input (a wrong flag value, a missing model directory): the message says what
            # to change, and the user gets that line; the traceback only for debugging
            logger.debug("engine start-up refused", exc_info=True)
        else:
            message += "\n" + traceback.format_exc()   # unexpected: where it broke matters
        try:
            outbox.send_bytes(pickle.dumps(("error", message)))
        except OSError:
            pass
        return
    core = EngineCore(engine)
    outbox.send_bytes(pickle.dumps(("ready", ready_info(engine))))
    core.run(inbox, outbox, parent_pid)
