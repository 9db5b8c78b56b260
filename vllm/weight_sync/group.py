"""Weight broadcast over a stateless process group (another GPU, another node).

The trainer (rank 0) and the engine (rank 1; more engines take ranks 2, 3, ...) build a
group of their own from a TCPStore (the trainer hosts it): ProcessGroupNCCL on GPUs,
ProcessGroupGloo on CPU. Nothing touches torch.distributed's default group, so a
trainer that already runs FSDP/DDP keeps its own.

One update is:
1. the engine receives the manifest [(name, dtype, shape), ...] and the bucket size over
   HTTP (POST /v1/weights/update_from_group) and validates it against its model;
2. handshake: the engine broadcasts one int (1: ready, 0: refused), so a refused update
   costs the trainer no transfer and no timeout;
3. the trainer broadcasts each flat bucket (vllm/weight_sync/bucket.py: both sides derive
   the same layout from the manifest) into the engine's receive buffer; the engine
   validates it and copies it into its parameters (write-through, with the overwritten
   bytes kept as undo). A bucket the engine refuses is still received (the two sides
   stay in step) but not written, and the update is undone;
4. the engine broadcasts the outcome (1: finished, 0: failed) and answers the HTTP call.
"""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch

from vllm.weight_sync.bucket import BucketLayout, FlatBucket, plan_buckets
from vllm.weight_sync.session import weight_mapping_of

logger = logging.getLogger(__name__)

BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class GroupSpec:
    """Where the group meets: the trainer's TCPStore at host:port, `world_size` ranks."""
    host: str
    port: int
    rank: int
    world_size: int = 2
    backend: str = "nccl"
    timeout_s: float = 300.0
    group_name: str = "vllm-weights"

    def validate(self) -> "GroupSpec":
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not (0 <= self.rank < self.world_size) or self.world_size < 2:
            raise ValueError(f"rank {self.rank} / world_size {self.world_size}: need 0 <= rank < world_size, world_size >= 2")
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"port must be an int in 1..65535, got {self.port!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        return self


class WeightGroup:
    """One member of a weight-broadcast group; `device` is where its buffers live
    (CUDA with nccl; CPU with gloo)."""

    def __init__(self, spec: GroupSpec, device: torch.device | str | None = None, store=None):
        """`store`: the TCPStore already made by `host_store` (the trainer makes it first,
        to learn its port before asking the engine to join)."""
        import torch.distributed as dist

        self.spec = spec.validate()
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        if spec.backend == "nccl":
            if not torch.cuda.is_available():
                raise ValueError("backend 'nccl' needs a CUDA device (use 'gloo' on CPU)")
            self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if store is None:
            store = dist.TCPStore(spec.host, spec.port, spec.world_size, spec.rank == 0, timeout=timeout,
                                  wait_for_workers=False)
        self.store = store
        prefixed = dist.PrefixStore(spec.group_name, store)
        if spec.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            with torch.cuda.device(self.device):
                self.pg = dist.ProcessGroupNCCL(prefixed, spec.rank, spec.world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, spec.rank, spec.world_size, timeout)
        self.rank = spec.rank

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()
        return tensor

    def flag(self, value: int | None, src: int) -> int:
        """Broadcast one int from `src` (value ignored elsewhere); returns it on every rank."""
        t = torch.tensor([value if value is not None else -1], dtype=torch.int32, device=self.device)
        return int(self.broadcast(t, src).item())

    def close(self) -> None:
        try:
            if hasattr(self.pg, "shutdown"):
                self.pg.shutdown()
        except Exception:  # noqa: BLE001 -- closing a broken group must not raise
            pass
        self.pg = None


def host_store(host: str, port: int = 0, world_size: int = 2, timeout_s: float = 300.0):
    """The trainer's TCPStore (rank 0 hosts it); port 0 picks a free port (`store.port`)."""
    import torch.distributed as dist
    return dist.TCPStore(host, port, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


# ---- the engine's side ------------------------------------------------------------------
def receive_update(engine, group: WeightGroup, manifest, bucket_bytes: int, *, backup: str = "auto",
                   require_complete: bool = False, contract=None) -> int:
    """Steps 1-4 of the module docstring on the engine (rank `group.rank`). Returns the
    new weight version; ValueError (after staying in step with the trainer) if refused."""
    from vllm.weight_sync.session import WeightUpdate

    update = None
    try:
        if not isinstance(manifest, list) or not manifest:
            raise ValueError("manifest must be a non-empty list of [name, dtype, shape]")
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        try:
            layouts = plan_buckets([(str(n), str(d), tuple(s)) for n, d, s in manifest], bucket_bytes)
        except (TypeError, ValueError) as err:
            raise ValueError(f"malformed manifest: {err}") from None
        _check_manifest(engine.executor.model, layouts)
        update = WeightUpdate(engine, contract=contract, require_complete=require_complete, backup=backup)
    except Exception:
        group.flag(0, src=group.rank)
        raise
    group.flag(1, src=group.rank)
    error: BaseException | None = None
    buf = None
    for layout in layouts:
        if buf is None or buf.numel() < layout.nbytes:
            buf = torch.empty(max(1, max(lo.nbytes for lo in layouts)), dtype=torch.uint8, device=group.device)
        bucket = FlatBucket(buf, layout)
        try:
            group.broadcast(buf[:max(1, layout.nbytes)], src=0)
        except Exception as err:  # noqa: BLE001 -- the transfer itself failed: the group is unusable
            update.abort(f"transfer failed: {type(err).__name__}: {err}")
            raise ValueError(f"weight broadcast failed: {type(err).__name__}: {err}") from err
        if error is None:
            try:
                update.load(_to_device(bucket, engine.executor.info.device), retain=False)
            except Exception as err:  # noqa: BLE001 -- keep receiving to stay in step, then report
                error = err
    version = None
    if error is None:
        try:
            version = update.finish()
        except Exception as err:  # noqa: BLE001
            error = err
    group.flag(0 if error is not None else 1, src=group.rank)
    if error is not None:
        raise error if isinstance(error, ValueError) else ValueError(str(error))
    return version


def _to_device(bucket: FlatBucket, device: torch.device) -> FlatBucket:
    if bucket.buffer.device == device:
        return bucket
    return FlatBucket(bucket.buffer[:max(1, bucket.layout.nbytes)].to(device), bucket.layout)


def receive_buckets(update, group: WeightGroup, layouts: list[BucketLayout], device: torch.device, *,
                    trainer_rank: int = 0) -> None:
    """Steps 2-4 of the module docstring into an update opened by the caller (the four-phase
    transfer: vllm/weight_sync/transfer.py): handshake, each bucket written through with
    its overwritten bytes kept, outcome. A refused bucket is still received (the sides stay
    in step) and aborts `update`; the error is raised after the outcome flag."""
    group.flag(1, src=group.rank)
    error: BaseException | None = None
    buf = torch.empty(max(1, max(lo.nbytes for lo in layouts)), dtype=torch.uint8, device=group.device)
    for layout in layouts:
        try:
            group.broadcast(buf[:max(1, layout.nbytes)], src=trainer_rank)
        except Exception as err:  # noqa: BLE001 -- the transfer itself failed: the group is unusable
            update.abort(f"transfer failed: {type(err).__name__}: {err}")
            raise ValueError(f"weight broadcast failed: {type(err).__name__}: {err}") from err
        if error is None:
            try:
                update.load(_to_device(FlatBucket(buf, layout), device), retain=False)
            except Exception as err:  # noqa: BLE001 -- keep receiving to stay in step, then report
                error = err
    group.flag(0 if error is not None else 1, src=group.rank)
    if error is not None:
        raise error if isinstance(error, ValueError) else ValueError(str(error))


def store_barrier(store, n: int, world_size: int, timeout_s: float = 300.0) -> None:
    """The `n`-th barrier of a group's ranks, on its TCPStore (TRL's per-tensor protocol
    ends each broadcast with one; both sides count them)."""
    import time

    key = f"vllm-barrier/{n}"
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < world_size:
        if time.monotonic() > deadline:
            raise ValueError(f"barrier {n}: the other ranks did not arrive within {timeout_s} s")
        time.sleep(0.0005)


def check_manifest(model, layouts: list[BucketLayout]) -> None:
    """Names, shapes and dtypes of a manifest against `model`, before any byte moves."""
    _check_manifest(model, layouts)


def _check_manifest(model, layouts: list[BucketLayout]) -> None:
    """Names, shapes and dtypes of a manifest, before any byte moves (meta tensors)."""
    planner = weight_mapping_of(model).planner(exact_dtype=False, check_finite=False)
    for layout in layouts:
        for e in layout.entries:
            if not e.torch_dtype.is_floating_point:
                raise ValueError(f"weight {e.name!r}: dtype {e.dtype} is not a float dtype")
            planner.add(e.name, torch.empty(e.shape, dtype=e.torch_dtype, device="meta"))
    # coverage (require_complete) needs the aliases resolved: WeightUpdate.finish checks it


# ---- the trainer's side -----------------------------------------------------------------
def send_update(group: WeightGroup, named: list[tuple[str, torch.Tensor]], bucket_bytes: int, *,
                engine_rank: int = 1) -> bool:
    """Steps 2-4 on the trainer (rank 0), engine at `engine_rank`: returns False if the
    engine refused before the transfer or reported a failure after it."""
    from vllm.weight_sync.bucket import manifest_of

    if group.flag(None, src=engine_rank) != 1:
        return False
    sources = dict(named)
    layouts = plan_buckets(manifest_of(named), bucket_bytes)
    buf = torch.empty(max(1, max(lo.nbytes for lo in layouts)), dtype=torch.uint8, device=group.device)
    for layout in layouts:
        srcs = {e.name: sources[e.name].to(group.device) for e in layout.entries} \
            if any(sources[e.name].device != group.device for e in layout.entries) else sources
        FlatBucket(buf, layout).fill(srcs)
        if buf.is_cuda:
            torch.cuda.current_stream(buf.device).synchronize()
        group.broadcast(buf[:max(1, layout.nbytes)], src=0)
    return group.flag(None, src=engine_rank) == 1
