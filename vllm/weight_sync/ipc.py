"""Weight buckets handed to another process on the same node, without copying them
through a socket: CUDA IPC handles of flat bucket buffers on GPUs, named shared-memory
segments on CPU (the same protocol, so CI tests it across processes).

Trainer:  export = IpcExport(named_tensors, bucket_bytes)   # packs flat buckets
          engine.update_weights_from_ipc(export.message())  # any channel: pipe, HTTP JSON
          export.refill(next_named_tensors)                 # next version, same buffers
          engine.update_weights_from_ipc(export.message())  # same handles: nothing to open
          export.release()                                  # when done
Engine:   apply_ipc_update(engine, message)                 # one WeightUpdate, buckets staged
                                                            # by reference, written at finish

The engine keeps the CUDA buffers of the last update mapped (opening a handle costs
milliseconds per bucket); an update that names other handles drops the old ones.

The message is JSON (no pickle): each bucket is its layout (bucket.py) and a handle,
{"kind": "cuda", "args": [...]} (torch's CUDA IPC rebuild arguments, encoded) or
{"kind": "shm", "name": ..., "nbytes": ...}. The trainer must keep the buckets alive and
unchanged until the engine answers; the engine reads them in place (no staging copy) and
writes each parameter once.
"""
from __future__ import annotations

import base64
import json
from multiprocessing import shared_memory
from typing import Sequence

import torch

from vllm.weight_sync.bucket import DEFAULT_BUCKET_BYTES, BucketLayout, FlatBucket, manifest_of, plan_buckets


class IpcExport:
    """Flat buckets of `named` tensors in memory another process can map."""

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 device: torch.device | str | None = None):
        named = list(named)
        if not named:
            raise ValueError("nothing to export")
        device = torch.device(device) if device is not None else named[0][1].device
        sources = {n: t.detach() for n, t in named}
        self._shms: list[shared_memory.SharedMemory] = []
        self.buckets: list[FlatBucket] = []
        self._handles: list[dict] = []
        for layout in plan_buckets(manifest_of(named), bucket_bytes):
            n = max(1, layout.nbytes)
            if device.type == "cuda":
                buf = torch.empty(n, dtype=torch.uint8, device=device)
                bucket = FlatBucket(buf, layout).fill(sources)
                handle = None  # taken after the fills are done (below)
            else:
                shm = shared_memory.SharedMemory(create=True, size=n)
                self._shms.append(shm)
                buf = torch.frombuffer(shm.buf, dtype=torch.uint8, count=n)
                bucket = FlatBucket(buf, layout).fill(sources)
                handle = {"kind": "shm", "name": shm.name, "nbytes": n}
            self.buckets.append(bucket)
            self._handles.append(handle)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self._handles = [{"kind": "cuda", "args": _encode(_cuda_ipc_args(b.buffer))} for b in self.buckets]

    def refill(self, named: Sequence[tuple[str, torch.Tensor]]) -> "IpcExport":
        """Write a new version of the same tensors (same names, dtypes, shapes) into the
        same buckets: the handles stay, so an engine that still has them open reads the
        new bytes without opening anything (opening a CUDA IPC handle costs milliseconds)."""
        named = list(named)
        if not self.buckets:
            raise ValueError("this export was released")
        have = [(e.name, e.dtype, tuple(e.shape)) for b in self.buckets for e in b.layout.entries]
        if [(n, d, tuple(sh)) for n, d, sh in manifest_of(named)] != have:
            raise ValueError("refill needs the tensors the export was made of (same names, dtypes, shapes, order)")
        sources = {n: t.detach() for n, t in named}
        for b in self.buckets:
            b.fill(sources)
        if self.buckets[0].buffer.is_cuda:
            torch.cuda.synchronize(self.buckets[0].buffer.device)
        return self

    def message(self) -> list[dict]:
        return [{"layout": b.layout.to_json(), "handle": h} for b, h in zip(self.buckets, self._handles)]

    def release(self) -> None:
        """Free the buckets (after the engine answered)."""
        self.buckets = []
        for shm in self._shms:
            try:
                shm.close()
            except BufferError:
                pass  # a view is still alive somewhere: the mapping goes with it
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        self._shms = []


def _cuda_ipc_args(buf: torch.Tensor) -> tuple:
    from torch.multiprocessing.reductions import reduce_tensor
    fn, args = reduce_tensor(buf)
    if fn.__name__ != "rebuild_cuda_tensor":
        raise ValueError(f"unexpected CUDA IPC reduction {fn.__name__}")
    return args


# ---- JSON encoding of torch's rebuild arguments (no pickle on the wire) ------------------
_TYPES = {"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter, "UntypedStorage": torch.UntypedStorage}


def _encode(x):
    if isinstance(x, bytes):
        return {"b64": base64.b64encode(x).decode()}
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).replace("torch.", "")}
    if isinstance(x, type):
        name = x.__name__
        if name not in _TYPES and not name.endswith("Storage"):
            raise ValueError(f"cannot encode type {name}")
        return {"type": name}
    if isinstance(x, (tuple, list, torch.Size)):
        return {"seq": [_encode(v) for v in x]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise ValueError(f"cannot encode {type(x).__name__} in an IPC handle")


def _decode(x):
    if isinstance(x, dict):
        if "b64" in x:
            return base64.b64decode(x["b64"])
        if "dtype" in x:
            dt = getattr(torch, x["dtype"], None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"unknown dtype {x['dtype']!r}")
            return dt
        if "type" in x:
            name = x["type"]
            if name in _TYPES:
                return _TYPES[name]
            cls = getattr(torch, name, None) or getattr(torch.storage, name, None)
            if not (isinstance(cls, type) and name.endswith("Storage")):
                raise ValueError(f"unknown type {name!r} in an IPC handle")
            return cls
        if "seq" in x:
            return tuple(_decode(v) for v in x["seq"])
        raise ValueError("malformed IPC handle")
    return x


# ---- the engine's side ------------------------------------------------------------------
class _Opened:
    def __init__(self, bucket: FlatBucket, shm: shared_memory.SharedMemory | None):
        self.bucket, self.shm = bucket, shm

    def close(self) -> None:
        self.bucket = None
        if self.shm is not None:
            try:
                self.shm.close()
            except BufferError:
                pass


class OpenedCudaBuffers:
    """The CUDA IPC buckets of the last update, kept mapped: an exporter that refills the
    same buckets (`IpcExport.refill`) sends the same handles, and reopening them would cost
    milliseconds per bucket. A bucket whose layout is also unchanged keeps its tensor views.
    An update whose message names other handles drops the ones it does not name. Held per
    engine (`engine.ipc_buffers`)."""

    def __init__(self):
        self.buckets: dict[str, tuple[str, FlatBucket]] = {}   # handle -> (layout JSON, bucket)

    def get(self, key: str) -> tuple[str, FlatBucket] | None:
        return self.buckets.get(key)

    def keep_only(self, opened: dict[str, tuple[str, FlatBucket]]) -> None:
        self.buckets = dict(opened)


def _handle_key(h: dict) -> str:
    return json.dumps(h.get("args"), sort_keys=True, separators=(",", ":"))


def open_buckets(message: list, device: torch.device, cache: OpenedCudaBuffers | None = None) -> list[_Opened]:
    """Map each exported bucket into this process (ValueError for a malformed message).
    CUDA buffers already open in `cache` are reused; `cache` then holds this message's."""
    out: list[_Opened] = []
    opened_now: dict[str, tuple[str, FlatBucket]] = {}
    try:
        for i, item in enumerate(message):
            if not isinstance(item, dict) or "layout" not in item or "handle" not in item:
                raise ValueError(f"IPC bucket {i}: expected {{'layout': ..., 'handle': ...}}")
            h = item["handle"]
            kind = h.get("kind") if isinstance(h, dict) else None
            if kind in ("shm", "cuda"):
                hit = None
                if kind == "cuda" and cache is not None:
                    key = _handle_key(h)
                    layout_key = json.dumps(item["layout"], separators=(",", ":"))
                    hit = cache.get(key)
                if hit is None or hit[0] != layout_key:   # a layout seen before was checked then
                    try:
                        layout = BucketLayout.from_json(item["layout"])
                    except (KeyError, TypeError, ValueError, AttributeError) as err:
                        raise ValueError(f"IPC bucket {i}: malformed layout ({err})") from None
            if kind == "shm":
                try:
                    name, nbytes = str(h["name"]), int(h["nbytes"])
                except (KeyError, TypeError, ValueError) as err:
                    raise ValueError(f"IPC bucket {i}: a shared-memory handle needs 'name' and an integer "
                                     f"'nbytes' ({type(err).__name__}: {err})") from None
                try:
                    shm = shared_memory.SharedMemory(name=name)
                except FileNotFoundError:
                    raise ValueError(f"IPC bucket {i}: shared memory {name!r} does not exist") from None
                _untrack(shm)
                try:
                    n = max(0, min(nbytes, shm.size))
                    bucket = FlatBucket(torch.frombuffer(shm.buf, dtype=torch.uint8, count=n), layout)
                except BaseException:
                    shm.close()
                    raise
                out.append(_Opened(bucket, shm))
            elif kind == "cuda":
                if device.type != "cuda":
                    raise ValueError("CUDA IPC buckets need an engine on a CUDA device")
                if hit is not None:   # the engine's own cache: same device
                    bucket = hit[1] if hit[0] == layout_key else FlatBucket(hit[1].buffer, layout)
                else:
                    from torch.multiprocessing.reductions import rebuild_cuda_tensor
                    args = list(_decode(h.get("args")))
                    args[6] = device.index if device.index is not None else torch.cuda.current_device()  # storage_device: ours
                    bucket = FlatBucket(rebuild_cuda_tensor(*args), layout)
                if cache is not None:
                    opened_now[key] = (layout_key, bucket)
                out.append(_Opened(bucket, None))
            else:
                raise ValueError(f"IPC bucket {i}: handle kind must be 'cuda' or 'shm', got {kind!r}")
    except BaseException:
        for o in out:
            o.close()
        raise
    if cache is not None:
        cache.keep_only(opened_now)
    return out


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Attaching registers the segment with this process's resource tracker, which would
    unlink it at exit (and warn); the exporter owns it."""
    try:
        from multiprocessing import resource_tracker
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    except Exception:  # noqa: BLE001
        pass


def apply_ipc_update(engine, message: list, *, contract=None, require_complete: bool = False,
                     check_finite: bool = True) -> int:
    """One WeightUpdate from exported buckets; returns the new weight version."""
    from vllm.weight_sync.session import WeightUpdate

    if not isinstance(message, list) or not message:
        raise ValueError("an IPC update is a non-empty list of buckets")
    if getattr(engine, "ipc_buffers", None) is None:
        engine.ipc_buffers = OpenedCudaBuffers()
    opened = open_buckets(message, engine.executor.info.device, engine.ipc_buffers)
    try:
        update = WeightUpdate(engine, contract=contract, require_complete=require_complete, check_finite=check_finite)
        for o in opened:
            update.load(o.bucket)      # staged by reference: the exporter keeps them until we answer
        return update.finish()
    finally:
        for o in opened:
            o.close()
