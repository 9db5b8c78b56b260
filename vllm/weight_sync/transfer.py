"""Weight transfer sessions on one engine, under the two protocols RL trainers speak.

upstream vLLM's four phases (`init_weight_transfer_engine`, `start_weight_update`,
`update_weights` x N, `finish_weight_update(weight_version)`): the trainer is rank 0 of a
broadcast group (vllm/weight_sync/group.py) and the engine joins it as `rank_offset`.
start opens one `WeightUpdate` (requests pause: they keep their KV and continue under
the new weights), each update receives one manifest's flat buckets into it, finish closes
the version. A failed update undoes everything written since start and the previous
weights keep serving, bit for bit; finish then reports why.

TRL's own server protocol (`/init_communicator/`, `/update_named_param/`): the engine is
rank 0 and hosts the group's store, the trainer is the last rank and broadcasts one
tensor per call. Its tensors go into one implicit `WeightUpdate` that `settle` closes at
the next generation, prefix-cache reset or close: a request never runs on a mix of old
and new tensors. A tensor the engine refuses aborts that implicit update; the next call
reports why.

Both run where the engine runs (the engine core process behind `vllm serve`, or the
caller's process for `LLM`) and block it while a transfer is in flight.
"""
from __future__ import annotations

import logging
import time

import torch

from vllm.weight_sync.bucket import DEFAULT_BUCKET_BYTES, dtype_from_name, plan_buckets
from vllm.weight_sync.group import GroupSpec, WeightGroup, check_manifest, receive_buckets, store_barrier

logger = logging.getLogger(__name__)

BACKUPS = ("auto", "device", "host")


def _int(info: dict, key: str, default=None) -> int:
    v = info.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key} must be an int, got {v!r}")
    return v


def _timeout(v) -> float:
    """A timeout in seconds (None: the default, 300); anything but a positive number is a ValueError."""
    if v is None:
        return 300.0
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {v!r}")
    return float(v)


def _contract(spec):
    if spec is None:
        return None
    from vllm.contract import ExecutionContract
    if not isinstance(spec, dict):
        raise ValueError("contract must be an ExecutionContract.to_dict() object")
    try:
        return ExecutionContract.from_dict(spec)
    except Exception as err:  # noqa: BLE001 -- a malformed contract is the caller's 400
        raise ValueError(f"malformed contract: {type(err).__name__}: {err}") from None


def parse_manifest(update_info: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """upstream's update_info {names, dtype_names, shapes} as a [(name, dtype, shape)]
    manifest; dtypes may carry torch's prefix ("torch.bfloat16")."""
    if not isinstance(update_info, dict):
        raise ValueError("update_info must be an object {names, dtype_names, shapes}")
    names, dtypes, shapes = (update_info.get(k) for k in ("names", "dtype_names", "shapes"))
    if not all(isinstance(x, list) for x in (names, dtypes, shapes)):
        raise ValueError("update_info needs the lists names, dtype_names and shapes")
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(f"names, dtype_names and shapes must be non-empty and of one length, got "
                         f"{len(names)}, {len(dtypes)}, {len(shapes)}")
    out = []
    for n, d, s in zip(names, dtypes, shapes):
        if not isinstance(n, str) or not isinstance(d, str) or not isinstance(s, list) \
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s):
            raise ValueError(f"malformed entry ({n!r}, {d!r}, {s!r}): expected (str, str, [int, ...])")
        dtype = d.removeprefix("torch.")
        dtype_from_name(dtype)
        out.append((n, dtype, tuple(s)))
    return out


class WeightTransfer:
    """The weight-transfer state of one LLMEngine; every method raises ValueError (with a
    message for the caller) on bad input or a refused update."""

    def __init__(self, engine):
        self.engine = engine
        self.group: WeightGroup | None = None
        self.protocol: str | None = None      # "vllm" (four phases) or "trl" (per tensor)
        self.trainer_rank = 0
        self.contract = None
        self.backup = "auto"
        self.update = None                     # the open WeightUpdate
        self._resume_after = False             # the engine was running before start
        self._failed: str | None = None        # why the open update was aborted
        self._lost: str | None = None          # TRL: a tensor received after its update closed
        self._barriers = 0
        self.labels: dict[int, str] = {}       # weight version -> the trainer's label

    # ---- group --------------------------------------------------------------------------
    def _device_backend(self) -> str:
        return "nccl" if self.engine.executor.info.device.type == "cuda" else "gloo"

    def _join(self, spec: GroupSpec) -> None:
        self.close()
        try:
            self.group = WeightGroup(spec, device=self.engine.executor.info.device if spec.backend == "nccl" else None)
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 -- a failed rendezvous is the caller's 400
            raise ValueError(f"could not join the weight transfer group at {spec.host}:{spec.port} "
                             f"({spec.backend}): {type(err).__name__}: {err}") from err

    def init(self, init_info: dict) -> dict:
        """upstream's init_info {master_address, master_port, rank_offset, world_size} (plus
        optional backend, timeout_s, contract, backup): join the trainer's group. Blocks until
        the trainer joins too."""
        if not isinstance(init_info, dict):
            raise ValueError("init_info must be an object {master_address, master_port, rank_offset, world_size}")
        host = init_info.get("master_address")
        if not isinstance(host, str) or not host:
            raise ValueError("init_info.master_address must be the trainer's address")
        port, world = _int(init_info, "master_port"), _int(init_info, "world_size")
        offset = _int(init_info, "rank_offset", 1)
        if world != offset + 1:
            raise ValueError(f"this server is one engine of one rank: world_size must be rank_offset + 1 "
                             f"(the trainer is rank 0), got world_size {world} and rank_offset {offset}")
        backend = init_info.get("backend") or self._device_backend()
        backup = init_info.get("backup", "auto")
        if backup not in BACKUPS:
            raise ValueError(f"backup must be one of {BACKUPS}, got {backup!r}")
        contract = _contract(init_info.get("contract"))
        if contract is not None:
            self.engine.execution_contract().check_compatible(contract)
        else:
            logger.warning("weight transfer joined without an execution contract (init_info.contract): the "
                           "trainer's numerics are not checked against this engine's")
        spec = GroupSpec(host, port, offset, world, backend, _timeout(init_info.get("timeout_s"))).validate()
        self._join(spec)
        self.protocol, self.trainer_rank, self.contract, self.backup = "vllm", 0, contract, backup
        logger.info("weight transfer group joined at %s:%d as rank %d of %d (%s)", host, port, offset, world, backend)
        return {"joined": True, "rank": offset, "world_size": world, "backend": backend}

    def init_trl(self, host: str, port: int, world_size: int, client_device_uuid: str | None = None,
                 contract: dict | None = None, timeout_s: float = 300.0) -> dict:
        """TRL's /init_communicator/: this engine is rank 0 and hosts the store at host:port;
        the trainer (the last rank) connects to it."""
        if world_size != 2:
            raise ValueError(f"this server is one engine (get_world_size/ is 1): world_size must be 2, got {world_size}")
        if self.engine.executor.info.device.type == "cuda" and client_device_uuid is not None:
            if client_device_uuid == str(torch.cuda.get_device_properties(self.engine.executor.info.device).uuid):
                raise ValueError("the trainer and this server use the same GPU; the communicator needs two devices")
        theirs = _contract(contract)
        if theirs is not None:
            self.engine.execution_contract().check_compatible(theirs)
        else:
            logger.warning("TRL communicator joined without an execution contract: the trainer's numerics are not "
                           "checked against this engine's")
        spec = GroupSpec(host, port, 0, world_size, self._device_backend(), _timeout(timeout_s)).validate()
        self._join(spec)
        self.protocol, self.trainer_rank, self.contract, self.backup, self._barriers = "trl", world_size - 1, theirs, \
            "auto", 0
        logger.info("TRL communicator: hosting rank 0 of %d at %s:%d", world_size, host, port)
        return {"joined": True, "rank": 0, "world_size": world_size}

    def close(self) -> dict:
        """Leave the group; an update still open is aborted (the previous weights stay)."""
        if self.update is not None:
            self._abort("the communicator was closed before the update finished")
        self._failed = self._lost = None
        if self.group is not None:
            self.group.close()
            self.group = None
        self.protocol = None
        return {"closed": True}

    def _broken_group(self, err: BaseException) -> ValueError:
        """The group failed under a collective (the trainer left, a timeout closed its
        connections): it cannot carry another update, so it is left; the caller joins again."""
        if self.group is not None:
            try:
                self.group.close()
            except Exception:  # noqa: BLE001 -- already broken
                pass
            self.group, self.protocol = None, None
        return ValueError(f"the weight transfer group failed ({type(err).__name__}: {err}) and was left; the "
                          f"previous weights (version {self.engine.weight_version}) keep serving: join it again "
                          "(/init_weight_transfer_engine) before the next update")

    def _need_group(self, protocol: str) -> WeightGroup:
        if self.group is None:
            route = "/init_weight_transfer_engine" if protocol == "vllm" else "/init_communicator/"
            raise ValueError(f"no weight transfer group: call {route} first")
        if self.protocol != protocol:
            raise ValueError(f"the group was made by the {self.protocol} protocol, not the {protocol} one")
        return self.group

    # ---- one update ---------------------------------------------------------------------
    def start(self) -> dict:
        """Open one update: generation pauses (requests keep their KV) until finish."""
        from vllm.weight_sync.session import WeightUpdate

        if self.update is not None:
            raise ValueError("a weight update is already started: finish it first")
        eng = self.engine
        was_paused = eng.paused and not eng.weights_torn
        eng.pause()
        try:
            self.update = WeightUpdate(eng, contract=self.contract, backup=self.backup)
        except BaseException:
            if not was_paused and not eng.weights_torn:
                eng.resume()
            raise
        self._resume_after, self._failed = not was_paused, None
        return {"started": True, "weight_version": eng.weight_version}

    def keep_paused(self) -> None:
        """A pause asked for while an update is open stands after it: finishing or aborting
        the update does not resume the engine (the caller resumes it)."""
        self._resume_after = False

    def _open_update(self):
        if self.update is not None and self.update.closed:    # aborted by a failed load
            self._closed()
        if self.update is None:
            if self._failed is not None:
                raise ValueError(f"the weight update was aborted ({self._failed}); the previous weights "
                                 f"(version {self.engine.weight_version}) keep serving: start a new one")
            raise ValueError("no weight update is started: call start_weight_update first")
        return self.update

    def load(self, weights) -> None:
        """Add in-process tensors to the started update (staged by reference until finish).
        A refused bucket ends the update like any refusal: the previous weights keep
        serving and requests resume."""
        update = self._open_update()
        try:
            update.load(weights)
        except Exception as err:
            self._after_failure(err)
            raise

    def receive(self, update_info: dict) -> dict:
        """One update_weights call, one half of a collective (the trainer broadcasts meanwhile):
        the manifest is checked against the model, then the trainer's buckets are received
        into the open update (handshake and outcome flags: vllm/weight_sync/group.py). A
        refusal after parsing is flagged to the trainer, which then sends nothing."""
        # no group, or a body that is no manifest, is refused without touching the group (nobody
        # may be broadcasting), and ends the started update: the engine does not stay paused
        try:
            group = self._need_group("vllm")
            manifest = parse_manifest(update_info)
            bucket_bytes = _int(update_info, "packed_buffer_size_bytes", DEFAULT_BUCKET_BYTES)
            if bucket_bytes <= 0:
                raise ValueError(f"packed_buffer_size_bytes must be > 0, got {bucket_bytes}")
            layouts = plan_buckets(manifest, bucket_bytes)
        except Exception as err:
            self._after_failure(err)
            raise
        try:
            check_manifest(self.engine.executor.model, layouts)
            update = self._open_update()
        except Exception as err:
            self._after_failure(err)          # nothing was written: the started update ends, requests resume
            try:
                group.flag(0, src=group.rank)     # the trainer waits for the handshake: refuse at once
            except Exception as flag_err:  # noqa: BLE001 -- the group itself broke
                raise self._broken_group(flag_err) from flag_err
            raise
        t0 = time.perf_counter()
        try:
            receive_buckets(update, group, layouts, self.engine.executor.info.device, trainer_rank=self.trainer_rank)
        except Exception as err:
            self._after_failure(err)
            if not isinstance(err, ValueError):
                raise self._broken_group(err) from err
            raise
        logger.info("received %d tensors in %d bucket(s) in %.2f s", len(manifest), len(layouts), time.perf_counter() - t0)
        return {"received": len(manifest)}

    def finish(self, weight_version: str | None = None) -> dict:
        """Close the update: write, new version (labelled `weight_version` if given), resume."""
        if weight_version is not None and not isinstance(weight_version, str):
            raise ValueError(f"weight_version must be a string label, got {weight_version!r}")
        update = self._open_update()
        try:
            version = update.finish()
        except Exception as err:
            self._after_failure(err)
            raise ValueError(f"the weight update failed at finish and was undone: {err}") from err
        self._closed()
        if weight_version is not None:
            self.labels[version] = weight_version
        return {"weight_version": version, "label": self.label()}

    def abort(self) -> dict:
        """Give up the open update, if any: the previous weights stay, requests resume."""
        if self.update is not None:
            self._abort("aborted by the caller")
        self._failed = None
        return {"aborted": True, "weight_version": self.engine.weight_version}

    def _abort(self, reason: str) -> None:
        if not self.update.closed:
            self.update.abort(reason)
        self._failed = reason
        self._closed()

    def _after_failure(self, err: BaseException) -> None:
        if self.update is not None:
            self._abort(f"{type(err).__name__}: {err}")

    def _closed(self) -> None:
        """The open update was finished or aborted: resume if start paused the engine."""
        if self.update is not None and self.update.closed and self._failed is None and self.engine.weight_error:
            self._failed = self.engine.weight_error
        self.update = None
        eng = self.engine
        if self._resume_after and not eng.weights_torn:
            eng.resume()
        self._resume_after = False

    # ---- labels -------------------------------------------------------------------------
    def set_label(self, new_version: str) -> dict:
        """upstream's update_weight_version: label the weights serving now."""
        if not isinstance(new_version, str) or not new_version:
            raise ValueError("new_version must be a non-empty string")
        self.labels[self.engine.weight_version] = new_version
        return {"weight_version": self.engine.weight_version, "label": new_version}

    def label(self) -> str:
        """The label of the weights serving now (their version number when unlabelled)."""
        v = self.engine.weight_version
        return self.labels.get(v, str(v))

    # ---- TRL's per-tensor protocol ------------------------------------------------------
    def check_trl(self, name: str, dtype: str, shape: list[int]) -> dict:
        """Validate one announced tensor against the model (before the trainer sends it) and
        open the implicit update; a failure of the previous tensor is reported here."""
        self._need_group("trl")
        self._report_failure()
        manifest = parse_manifest({"names": [name], "dtype_names": [dtype], "shapes": [list(shape)]})
        check_manifest(self.engine.executor.model, plan_buckets(manifest, DEFAULT_BUCKET_BYTES))
        if self.update is None:
            self.start()
        return {"ready": True}

    def receive_trl(self, name: str, dtype: str, shape: list[int]) -> dict:
        """Receive the tensor the trainer broadcasts from its rank (then the group barrier)
        into the implicit update. A refused tensor aborts it; the next call says why."""
        group = self._need_group("trl")
        ((_, dt, shp),) = parse_manifest({"names": [name], "dtype_names": [dtype], "shapes": [list(shape)]})
        torch_dtype = dtype_from_name(dt)
        n = 1
        for s in shp:
            n *= s
        buf = torch.empty(max(1, n * torch.empty((), dtype=torch_dtype).element_size()), dtype=torch.uint8,
                          device=group.device)
        try:
            group.broadcast(buf, src=self.trainer_rank)
            self._barriers += 1
            store_barrier(group.store, self._barriers, group.spec.world_size, group.spec.timeout_s)
        except Exception as err:  # noqa: BLE001 -- the trainer is gone or the group broke
            self._after_failure(ValueError(f"the broadcast of {name!r} failed: {type(err).__name__}: {err}"))
            raise ValueError(f"the broadcast of {name!r} failed: {type(err).__name__}: {err}") from err
        tensor = buf[:n * torch.empty((), dtype=torch_dtype).element_size()].view(torch_dtype).view(shp)
        if self.update is None or self.update.closed:
            if self.update is None and self._failed is None:
                # not aborted: the implicit update was closed (a generate or a prefix-cache reset
                # settled it) between this tensor's check and its broadcast
                self._lost = (f"weight {name!r} arrived after its update was closed (a request or a prefix-cache "
                              "reset came between its check and its broadcast) and was not written; the weights "
                              f"serving (version {self.engine.weight_version}) lack it: send it again")
            return {"received": False}            # reported by the next call
        try:
            self.update.load({name: tensor.to(self.engine.executor.info.device)}, retain=False)
        except Exception as err:  # noqa: BLE001 -- the caller already got its answer: keep it for the next call
            self._after_failure(err)
            logger.warning("TRL update_named_param %s refused: %s", name, err)
            return {"received": False}
        return {"received": True}

    def settle(self) -> dict:
        """Close TRL's implicit update, if one is open (before generating, resetting the
        prefix cache or closing), and report a refused tensor once."""
        if self.protocol == "trl" and self.update is not None and not self.update.closed:
            return self.finish()
        self._report_failure()
        return {"weight_version": self.engine.weight_version}

    def _report_failure(self) -> None:
        if self.update is not None and self.update.closed:
            self._closed()
        if self.protocol == "trl" and self._lost is not None:
            lost, self._lost = self._lost, None
            raise ValueError(lost)
        if self.protocol == "trl" and self.update is None and self._failed is not None:
            reason, self._failed = self._failed, None
            raise ValueError(f"a weight update was refused and undone ({reason}); the previous weights "
                             f"(version {self.engine.weight_version}) keep serving")

    def info(self) -> dict:
        """What a trainer needs before joining: the backend this engine's device uses."""
        return {"backend": self._device_backend(), "device": str(self.engine.executor.info.device),
                "joined": self.group is not None, "protocol": self.protocol, "update_open": self.update is not None}

    def call(self, op: str, *args, **kwargs):
        """Dispatch by name (the engine core's utility hands requests over this way)."""
        fn = {"init": self.init, "init_trl": self.init_trl, "close": self.close, "start": self.start,
              "receive": self.receive, "finish": self.finish, "abort": self.abort, "set_label": self.set_label,
              "label": self.label, "check_trl": self.check_trl, "receive_trl": self.receive_trl,
              "settle": self.settle, "info": self.info}.get(op)
        if fn is None:
            raise ValueError(f"unknown weight transfer operation {op!r}")
        return fn(*args, **kwargs)


def transfer_of(engine) -> WeightTransfer:
    """The engine's WeightTransfer, made on first use."""
    t = engine.__dict__.get("_weight_transfer")
    if t is None:
        t = engine.__dict__["_weight_transfer"] = WeightTransfer(engine)
    return t
