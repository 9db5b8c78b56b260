"""A checkpoint directory staged off the engine loop (`POST /v1/weights/update`).

Reading a 15 GiB checkpoint takes seconds; copying it into the parameters takes
milliseconds (device memory) to a few hundred (pinned host memory over PCIe). So a
background thread does everything that does not write a parameter while the engine
keeps stepping:

1. read every safetensors header and validate the names, shapes and dtypes through the
   model's own weight mapping, before any byte is read or any buffer allocated;
2. read each tensor in chunks, cast it by the load rule (`tensor.to(param.dtype)`, on
   the host, as a fresh load casts) into a staging buffer, and check it is finite
   (on the engine's device when it has one: the host's reductions run at ~1 GB/s);
3. check tied tensors agree and build the (parameter view, staged source) pairs.

The engine core then pauses at a step boundary only for `WeightUpdate.finish`'s
copy, the version bump and the prefix-cache drop (vllm/engine/core.py).

Where the staged bytes live (`staging`):
- "host" (the default): page-locked host memory on CUDA (the copy is a DMA over PCIe),
  ordinary memory on CPU. The KV cache is sized to fill the engine's share of the
  device (gpu_memory_utilization, less a headroom), so a checkpoint-sized buffer does
  not fit in that share, and memory beyond it may be a co-tenant's (a trainer on the
  same GPU). Page-locking holds driver-wide locks that every CUDA call of the engine's
  steps waits on: `cudaHostAlloc` (`torch.empty(pin_memory=True)`, the GIL held) of
  4 GiB stalled a step 1.66 s on the H200, and 15 GiB of 1 GiB buckets a decode step
  7.4 s. So each buffer is ordinary memory registered by one `cudaHostRegister` (the GIL
  released; 4 GiB in 0.76 s with the longest step 71 ms, benchmarks/pinned_staging.py),
  and `HOST_POOL` keeps the buffers for the next update: a server that updates every RL
  step pins once. (Registering a buffer in several pieces is no way around the lock: a
  copy spanning two registrations fails with "invalid argument".)
- "device": buffers on the engine's device, as many 1 GiB buckets as the free device
  memory holds after keeping DEVICE_HEADROOM_BYTES free, the rest on the host as above.
  The copy is then a device memcpy. For a GPU the engine has to itself; the buffers are
  freed (and returned to the driver) once the update is done.

The reader parses the safetensors format itself (an 8-byte header length, a JSON header,
then the raw little-endian data): `readinto` releases the GIL for the whole read and
lands the bytes straight in the staging buffer, where `safe_open().get_tensor` would
copy each tensor under the GIL, stalling the engine loop for a large one.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from vllm.weight_sync.bucket import DEFAULT_BUCKET_BYTES, FlatBucket, dtype_name, plan_buckets
from vllm.weight_sync.session import _add, _dest_dtype, finite_flags, raise_if_non_finite, weight_mapping_of

logger = logging.getLogger(__name__)

STAGINGS = ("host", "device")
# kept free on the device when staging there: what the KV-cache sizing keeps for CUDA
# graphs, the sampler's temporaries and fragmentation
DEVICE_HEADROOM_BYTES = 2 << 30
# bytes read (and cast, and checked) per step: bounds the scratch memory, and how long a
# cancel waits
CHUNK_BYTES = 64 << 20
# host staging buffers are whole multiples of this (so a checkpoint layout finds its pooled
# buffers again)
HOST_ROUND_BYTES = 2 << 20

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of a safetensors file: its stored dtype and shape, and its bytes' place."""
    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int      # absolute byte offset in the file
    nbytes: int


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _file_identity(path: str) -> tuple:
    """What changes when a file is replaced or rewritten: inode, size, modification time."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def read_header(path: str) -> list[TensorRecord]:
    """The tensors of one safetensors file, in the order their bytes are stored.
    ValueError for a file that is not a complete safetensors file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n <= 1 or 8 + n > size:
                raise ValueError("no valid header length")
            meta = json.loads(f.read(n))
        if not isinstance(meta, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError) as err:   # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise ValueError(f"checkpoint file {path!r} is not a readable safetensors file: {err}") from None
    records = []
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        if isinstance(info, dict) and info.get("dtype") not in _DTYPES:
            raise ValueError(f"checkpoint file {path!r}: tensor {name!r} has dtype {info.get('dtype')!r}, which "
                             f"is not loaded (one of {sorted(_DTYPES)})")
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"checkpoint file {path!r}: tensor {name!r} has an unreadable header entry "
                             f"({type(err).__name__}: {err})") from None
        numel = 1
        for s in shape:
            numel *= s
        if min(shape, default=0) < 0 or begin < 0 or end - begin != numel * _itemsize(dtype) or 8 + n + end > size:
            raise ValueError(f"checkpoint file {path!r}: tensor {name!r} (shape {list(shape)}, {info['dtype']}) does "
                             f"not fit its data offsets [{begin}, {end}) in a file of {size} bytes (truncated?)")
        records.append(TensorRecord(str(name), path, dtype, shape, 8 + n + begin, end - begin))
    records.sort(key=lambda r: r.start)
    return records


def _page_lock(buf: torch.Tensor) -> None:
    """Register `buf` (ordinary host memory) with the CUDA driver in one call: a copy
    needs its whole source range inside one registration."""
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.numel()} bytes failed: "
                           f"{torch.cuda.cudart().cudaGetErrorString(err)}")


class HostPool:
    """Page-locked host buffers kept between weight updates. A buffer is registered once
    (`_page_lock`) and reused by any later update that needs as many bytes or fewer;
    sizes are rounded up to whole `round_bytes` so the same checkpoint layout finds its
    buffers again. Never unregistered: the memory stays the process's until it exits, as
    torch's own pinned-memory cache keeps its blocks."""

    def __init__(self, round_bytes: int = HOST_ROUND_BYTES, page_lock: Callable[[torch.Tensor], None] = _page_lock):
        self.round_bytes = round_bytes
        self._page_lock = page_lock
        self._free: list[torch.Tensor] = []
        # every buffer ever registered stays referenced: freeing registered memory without
        # unregistering it would leave the driver a stale registration over reused pages
        self._all: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        size = -(-max(1, nbytes) // self.round_bytes) * self.round_bytes
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= size]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        buf = torch.empty(size, dtype=torch.uint8)
        buf[::4096].zero_()     # fault the pages in outside the driver's lock
        self._page_lock(buf)
        with self._lock:
            self._all.append(buf)
        return buf

    def give(self, bufs) -> None:
        with self._lock:
            mine = {b.data_ptr() for b in self._all}
            self._free.extend(b for b in bufs if b.device.type == "cpu" and b.data_ptr() in mine
                              and all(f.data_ptr() != b.data_ptr() for f in self._free))

    @property
    def free_bytes(self) -> int:
        return sum(b.numel() for b in self._free)


HOST_POOL = HostPool()


def _param_ptrs(model: torch.nn.Module) -> tuple[int, ...]:
    return tuple(p.data_ptr() for p in model.parameters())


class _Cancelled(Exception):
    pass


class StagedCheckpoint:
    """A checkpoint validated and held in staging buffers: `plan` is the (parameter view,
    staged source) pairs WeightUpdate.load_planned writes, valid while the parameters
    stay where they were when it was made (`plan_for`)."""

    def __init__(self, plan, pairs, mapping, ptrs, buckets, device_bytes: int, host_bytes: int,
                 pool: "HostPool | None" = None):
        self.plan = plan
        self.pairs = pairs              # (HF name, staged tensor): to place again if parameters moved
        self.mapping = mapping
        self.ptrs = ptrs
        self.buckets = buckets
        self.device_bytes = device_bytes
        self.host_bytes = host_bytes
        self.pool = pool                # where page-locked host buffers go back to

    def plan_for(self, model: torch.nn.Module):
        """The staged plan, or None when the model's parameters moved since staging."""
        if weight_mapping_of(model) is self.mapping and _param_ptrs(model) == self.ptrs:
            return self.plan
        return None

    def release(self) -> None:
        if self.pool is not None:
            self.pool.give(b.buffer for b in self.buckets)
        self.plan, self.pairs, self.buckets = [], [], []


class CheckpointStaging:
    """One checkpoint directory staged on a background thread (see the module docstring).
    `done` is set once `result` (a StagedCheckpoint) or `error` (a ValueError) is.
    `hook(staging, name)`, if given, runs on the thread before each tensor is read (tests
    hold the staging there, until `staging.cancelled`, to check what the engine does
    meanwhile)."""

    def __init__(self, engine, path: str, files: list[str], *, staging: str = "host",
                 hook: Callable[["CheckpointStaging", str], None] | None = None, chunk_bytes: int = CHUNK_BYTES,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        if staging not in STAGINGS:
            raise ValueError(f"staging must be one of {STAGINGS}, got {staging!r}")
        self.engine = engine
        self.model = engine.executor.model
        self.device = torch.device(engine.executor.info.device)
        self.path = path
        self.files = list(files)
        self.staging = staging
        self.hook = hook
        self.chunk_bytes = max(16, int(chunk_bytes))
        self.bucket_bytes = bucket_bytes
        self.call_id: int | None = None     # the utility call answered when this is done
        self.result: StagedCheckpoint | None = None
        self.error: ValueError | None = None
        self.stage_s = 0.0
        self.started = 0.0
        self.device_bytes = 0               # staging buffers taken on the device (even if it then failed)
        self.done = threading.Event()
        self._stats: dict[str, tuple] = {}   # each file's identity when its header was read
        self._cancel = threading.Event()
        self._cancel_reason = ""
        self._thread = threading.Thread(target=self._run, name="vllm-weight-staging", daemon=True)

    # ---- control (the engine loop's thread) ---------------------------------------------
    def start(self) -> "CheckpointStaging":
        self.started = time.perf_counter()
        self._thread.start()
        return self

    def cancel(self, reason: str) -> None:
        self._cancel_reason = reason
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread; True once it has ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the staging thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.no_grad():
                if self.device.type == "cuda":
                    # a stream of its own: the uploads and checks never queue behind (or in
                    # front of) the engine's steps; the current stream is per thread
                    with torch.cuda.device(self.device), torch.cuda.stream(torch.cuda.Stream(self.device)):
                        self.result = self._stage()
                        torch.cuda.current_stream().synchronize()
                else:
                    self.result = self._stage()
        except _Cancelled:
            self.error = ValueError(f"the weight update from {self.path!r} was cancelled while staging "
                                    f"({self._cancel_reason}); the previous weights keep serving")
        except ValueError as err:
            self.error = err
        except Exception as err:  # noqa: BLE001 -- an I/O or allocation failure is the caller's 400
            logger.warning("staging %s failed", self.path, exc_info=True)
            self.error = ValueError(f"could not read the checkpoint {self.path!r}: {type(err).__name__}: {err}")
        finally:
            if self.error is not None:
                self.result = None
            self.stage_s = time.perf_counter() - self.started
            self.done.set()

    def _check_cancel(self) -> None:
        if self._cancel.is_set():
            raise _Cancelled()

    def _stage(self) -> StagedCheckpoint:
        model = self.model
        self._stats = {f: _file_identity(f) for f in self.files}   # before anything of them is read
        records = [r for f in self.files for r in read_header(f)]
        mapping = weight_mapping_of(model)
        ptrs = _param_ptrs(model)
        # 1. names, shapes, dtypes from the headers alone: a wrong checkpoint is refused
        #    before anything is read or allocated
        planner = mapping.planner(exact_dtype=False, check_finite=False)
        staged: list[tuple[TensorRecord, torch.dtype]] = []
        for r in records:
            self._check_cancel()
            _add(planner, r.name, torch.empty(r.shape, dtype=r.dtype, device="meta"))
            if not mapping.is_derived(r.name):
                staged.append((r, _dest_dtype(planner, r.name)))
        # a checkpoint is a whole model: one missing a tensor (a shard lost, a name dropped)
        # would leave those parameters at the old weights, a mix no fresh load gives
        missing = planner.missing()
        if missing:
            raise ValueError(f"the checkpoint at {self.path!r} is incomplete: no {missing[:6]}"
                             f"{f' and {len(missing) - 6} more' if len(missing) > 6 else ''}; "
                             "the previous weights keep serving")
        # 2. buffers, in the parameters' dtypes
        layouts = plan_buckets([(r.name, dtype_name(dt), r.shape) for r, dt in staged], self.bucket_bytes)
        buckets, device_bytes, host_bytes = self._allocate(layouts)
        try:
            return self._fill(staged, buckets, device_bytes, host_bytes, mapping, ptrs)
        except BaseException:
            HOST_POOL.give(b.buffer for b in buckets)
            raise

    def _fill(self, staged, buckets, device_bytes, host_bytes, mapping, ptrs) -> StagedCheckpoint:
        device = self.device
        views = {name: view for b in buckets for name, view in b.tensors()}
        # 3. read, cast, check
        flags: list = []
        check_buf = None
        if device.type == "cuda" and host_bytes:
            check_buf = torch.empty(self.chunk_bytes, dtype=torch.uint8, device=device)
        scratch = None
        handles: dict[str, object] = {}
        try:
            for r, dt in staged:
                self._check_cancel()
                if self.hook is not None:
                    self.hook(self, r.name)
                flat = views[r.name].reshape(-1)
                if r.dtype != dt or flat.device.type != "cpu":
                    need = min(r.nbytes, self.chunk_bytes)
                    if scratch is None or scratch.numel() < need:
                        scratch = torch.empty(max(need, 1), dtype=torch.uint8)
                fh = handles.get(r.file)
                if fh is None:
                    fh = handles[r.file] = open(r.file, "rb", buffering=0)
                flags += self._stage_one(fh, r, dt, flat, scratch, check_buf)
        finally:
            for fh in handles.values():
                fh.close()
        # a file rewritten while it was read would give a version made of two checkpoints
        changed = [f for f in self.files if _file_identity(f) != self._stats[f]]
        if changed:
            raise ValueError(f"checkpoint file(s) {changed} changed while they were staged; the previous weights "
                             "keep serving (write a checkpoint to a new directory, then update from it)")
        raise_if_non_finite(flags)
        # 4. tied tensors, and the pairs to write: sources already in the parameters' dtypes
        planner = mapping.planner(exact_dtype=False, check_finite=False)
        plan = [w for r, _ in staged if (w := planner.add(r.name, views[r.name])) is not None]
        plan += planner.finish()
        pairs = [(r.name, views[r.name]) for r, _ in staged]
        return StagedCheckpoint(plan, pairs, mapping, ptrs, buckets, device_bytes, host_bytes,
                                pool=HOST_POOL if device.type == "cuda" else None)

    def _allocate(self, layouts) -> tuple[list[FlatBucket], int, int]:
        device = self.device
        budget = 0
        if self.staging == "device" and device.type == "cuda" and not self.engine.is_sleeping():
            # a sleeping engine gets its KV cache back on wake-up: that memory is not free
            free, _ = torch.cuda.mem_get_info(device)
            budget = free - DEVICE_HEADROOM_BYTES - self.chunk_bytes
        buckets, on_device, on_host = [], 0, 0
        try:
            for layout in layouts:
                self._check_cancel()
                n = max(1, layout.nbytes)
                buf = None
                if n <= budget:
                    try:
                        buf = torch.empty(n, dtype=torch.uint8, device=device)
                        budget -= n
                        on_device += n
                        self.device_bytes = on_device
                    except torch.cuda.OutOfMemoryError:
                        budget = 0
                if buf is None:
                    buf = HOST_POOL.take(n) if device.type == "cuda" else torch.empty(n, dtype=torch.uint8)
                    on_host += n
                buckets.append(FlatBucket(buf, layout))
        except BaseException:
            # cancelled (or out of host memory) part way: the page-locked buffers taken so far
            # go back to the pool, which would otherwise hold them registered and unusable
            HOST_POOL.give(b.buffer for b in buckets)
            raise
        return buckets, on_device, on_host

    def _stage_one(self, fh, r: TensorRecord, dt: torch.dtype, flat: torch.Tensor, scratch, check_buf) -> list:
        """Read record `r` chunk by chunk into `flat` (its staging view, dtype `dt`); returns
        the finiteness flags launched for it."""
        flags: list = []
        src_size, dst_size = _itemsize(r.dtype), _itemsize(dt)
        per_chunk = max(1, self.chunk_bytes // max(src_size, dst_size))   # elements
        numel = flat.numel()
        direct = r.dtype == dt and flat.device.type == "cpu"   # the bytes land where they stay
        for e0 in range(0, numel, per_chunk):
            self._check_cancel()
            e1 = min(numel, e0 + per_chunk)
            dest = flat[e0:e1]
            if direct:
                _read_into(fh, r, e0 * src_size, dest.view(torch.uint8))
            else:
                raw = scratch[:(e1 - e0) * src_size]
                _read_into(fh, r, e0 * src_size, raw)
                src = raw.view(r.dtype)
                if dest.device.type == "cpu":
                    dest.copy_(src)              # the load rule's cast: tensor.to(dtype) is this copy
                else:
                    dest.copy_(src if r.dtype == dt else src.to(dt))   # cast on the host, as a fresh load does
            if dest.is_floating_point():
                if dest.device.type == "cpu" and check_buf is not None:
                    # checked on the engine's device: pinned bytes up, a reduction there
                    probe = check_buf[:dest.numel() * dst_size].view(dt)
                    probe.copy_(dest, non_blocking=True)
                    flags += finite_flags([(None, probe)], [r.name])
                else:
                    flags += finite_flags([(None, dest)], [r.name])
        return flags


def _read_into(fh, r: TensorRecord, offset: int, out: torch.Tensor) -> None:
    """Fill the uint8 CPU tensor `out` with `r`'s bytes from `offset` on."""
    view = memoryview(out.numpy()).cast("B")
    pos, got = r.start + offset, 0
    while got < len(view):
        n = os.preadv(fh.fileno(), [view[got:]], pos + got)
        if n <= 0:
            raise ValueError(f"checkpoint file {r.file!r} ends inside tensor {r.name!r} (truncated)")
        got += n
