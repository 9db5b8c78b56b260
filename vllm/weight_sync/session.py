"""One weight update of a running engine: begin -> load(bucket)... -> finish.

    with llm.weight_update(contract=trainer_contract) as update:   # begin: requests pause
        for bucket in buckets:                                      # partial updates
            update.load(bucket)                                     # validated on arrival
    # finish on leaving the block: written, new weight version, requests resume
    # (an exception inside the block aborts: the previous weights stay, bit for bit)

`llm.update_weights(named_tensors)` is the one-bucket case.

Rules, whatever the transport:
- Names, shapes, dtypes and coverage go through the model's own weight mapping (the one
  the checkpoint loader uses). Another float dtype is cast by the load rule
  (`tensor.to(param.dtype)`), so an update from a checkpoint's tensors equals a fresh
  engine loaded from that checkpoint. Non-finite values are refused (unless
  `check_finite=False`); a retained bucket's are found at finish, before anything is
  written.
- A bucket is validated whole before any of its bytes are written; with the default
  `load(bucket)` (the bucket's tensors stay valid until finish) nothing is written before
  `finish`, so a bucket that fails leaves the previous weights untouched. A transport that
  reuses its receive buffer loads with `retain=False`: the bucket is written at once and
  the bytes it overwrote are kept (`backup`: "auto", the default: on the device while it has
  room for them, else in host memory; "device"; "host") to be put back if the update fails
  later; `backup="none"` saves that memory and leaves the engine refusing requests after
  such a failure (never serving a mix of two versions).
- Writes are copies INTO the existing parameters (storage addresses unchanged: captured
  CUDA graphs stay valid); a source that already is the parameter's memory (a colocated
  `llm.policy()`) is not copied at all. An FP8 layer without a master weight
  (keep_master_weights=False) is written by quantizing the source into its fp8 rows
  (`QuantizedRows`), and backed up as those fp8 rows and scales.
- Requests are paused from begin to finish and continue under the new weights; each
  reports the versions it was computed under (`CompletionOutput.weight_versions`).
- Finiteness is checked on the device: launched per bucket, read once at finish for
  retained buckets (before a write-through bucket is written). `check_finite=False` skips
  it, for a trainer that checked its own weights: reading every byte costs about as much as
  copying it. Large tensors are copied one memcpy each, the small ones in multi-tensor
  kernels: no per-tensor host syncs.
"""
from __future__ import annotations

import logging
import time
from typing import Iterable, Mapping

import torch

from vllm.layers.linear import QuantizedRows
from vllm.weight_sync.bucket import FlatBucket, copy_all

logger = logging.getLogger(__name__)

BACKUPS = ("auto", "device", "host", "none")
# backup="auto" keeps a written bucket's previous bytes on the device while the device has room
# for them and this much more (a model's whole copy may not fit beside the KV cache), else in
# host memory
AUTO_BACKUP_HEADROOM_BYTES = 256 << 20


class WeightUpdateError(RuntimeError):
    """A weight update failed after it had started writing and could not be undone
    (`backup="none"`): the engine refuses requests until a complete update finishes."""


def weight_mapping_of(model: torch.nn.Module):
    """`model.weight_mapping()`, built once per set of parameter objects: weight sync asks
    for it on every update, and building it walks every module (milliseconds on a
    400-tensor model, as long as copying a small model's bytes). A parameter replaced by
    another object rebuilds it."""
    ids = tuple(map(id, model.parameters()))
    cached = model.__dict__.get("_weight_mapping_cache")
    if cached is None or cached[0] != ids:
        cached = (ids, model.weight_mapping())
        model.__dict__["_weight_mapping_cache"] = cached
    return cached[1]


def plan_update(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], require_complete: bool = False):
    """Validate HF-named tensors against the model's own mapping (`model.weight_mapping()`)
    and return the (destination view, source) pairs to copy, sources cast to the
    parameter's dtype by the load rule. Raises ValueError on any problem; writes nothing."""
    planner = weight_mapping_of(model).planner(exact_dtype=False, check_finite=False)
    plan, names = [], []
    for name, tensor in weights:
        if (w := _add(planner, name, tensor)) is not None:
            plan.append(w)
            names.append(name)
    plan += planner.finish()
    check_finite(plan, names + [""] * (len(plan) - len(names)))
    if require_complete:
        missing = planner.missing()
        if missing:
            raise ValueError(f"incomplete update: missing {missing[:6]}")
    return plan


def _add(planner, name: str, tensor):
    if torch.is_tensor(tensor) and not tensor.is_floating_point():   # bool and integer data is no float weight
        dest_dtype = _dest_dtype(planner, name)
        if dest_dtype is not None and dest_dtype.is_floating_point:
            raise ValueError(f"weight {name!r}: dtype {tensor.dtype} is not a float dtype; the model's is {dest_dtype}")
    return planner.add(name, tensor)


def _dest_dtype(planner, name: str) -> torch.dtype | None:
    try:
        m = planner.mapping
        return m.destination(m.slot(name)).dtype
    except ValueError:
        return None


def finite_flags(plan: list[tuple[torch.Tensor, torch.Tensor]], names: list[str] | None = None) -> list:
    """Launch the finiteness check of `plan`'s sources without waiting for it: one
    max-abs norm per tensor (NaN and +-Inf make it non-finite), stacked per (device,
    dtype). `raise_if_non_finite` reads the result. On the H200 at Qwen3-8B dims this reads
    15 GiB in 7.1 ms; multi-tensor norms took 8.4 ms and single-pass min/max reductions
    13.1 ms (benchmarks/weight_sync.py)."""
    norms: dict[tuple, list[torch.Tensor]] = {}
    labels: dict[tuple, list[str]] = {}
    for i, (_, src) in enumerate(plan):
        if src.is_floating_point() and src.numel():
            key = (src.device, src.dtype)
            norms.setdefault(key, []).append(torch.linalg.vector_norm(src, float("inf")))
            labels.setdefault(key, []).append(names[i] if names and i < len(names) and names[i] else f"tensor {i}")
    return [(torch.isfinite(torch.stack(ns)), labels[key]) for key, ns in norms.items()]


def raise_if_non_finite(pending: list) -> None:
    """ValueError naming the first non-finite tensor of flags from `finite_flags` (one host
    synchronisation per device)."""
    by_device: dict[torch.device, list] = {}
    for flags, labels in pending:
        by_device.setdefault(flags.device, []).append((flags, labels))
    bad: list[str] = []
    for items in by_device.values():
        ok = torch.cat([f for f, _ in items]).cpu().tolist()
        labels = [lab for _, ls in items for lab in ls]
        bad += [lab for lab, fine in zip(labels, ok) if not fine]
    if bad:
        raise ValueError(f"weight {bad[0]!r} has non-finite values" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))


def check_finite(plan: list[tuple[torch.Tensor, torch.Tensor]], names: list[str] | None = None) -> None:
    """ValueError if any source holds NaN or Inf (`finite_flags`, then wait for them)."""
    raise_if_non_finite(finite_flags(plan, names))


def _as_pairs(weights) -> list[tuple[str, torch.Tensor]]:
    """A mapping, a FlatBucket, or an iterable of (name, tensor) pairs, as a list; anything
    else is a ValueError that says what was given."""
    if isinstance(weights, FlatBucket):
        return weights.tensors()
    if isinstance(weights, Mapping):
        return list(weights.items())
    expected = "weights must be a mapping {HF name: tensor} or an iterable of (HF name, tensor) pairs"
    if torch.is_tensor(weights) or isinstance(weights, (str, bytes)):
        raise ValueError(f"{expected}, got a {type(weights).__name__}")
    try:
        items = list(weights)
    except TypeError:
        raise ValueError(f"{expected}, got {type(weights).__name__}") from None
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"{expected}; item {i} is a {type(item).__name__}"
                             + (" (a list of tensors has no names: pass model.hf_state_dict() or zip(names, tensors))"
                                if torch.is_tensor(item) else ""))
    return [(name, tensor) for name, tensor in items]


def _same_memory(dest, src: torch.Tensor) -> bool:
    """src already is dest's memory (colocated Policy): the copy would be a no-op."""
    return (torch.is_tensor(dest) and src.device == dest.device and src.dtype == dest.dtype
            and src.data_ptr() == dest.data_ptr() and src.shape == dest.shape and src.stride() == dest.stride())


class WeightUpdate:
    """An open weight update of `engine` (an LLMEngine); see the module docstring.

    `contract`: the sender's ExecutionContract, refused unless compatible with the
    engine's (the error names the differing fields). `require_complete`: every parameter
    (every fused shard) must be given before finish. `backup`: where buckets loaded with
    retain=False keep the bytes they overwrite ("auto": the device while it has room, else
    the host; "device", "host", or "none").
    `check_finite`: refuse NaN/Inf (reads every byte once; off for a trainer that checked)."""

    def __init__(self, engine, *, contract=None, require_complete: bool = False, backup: str = "auto",
                 check_finite: bool = True):
        if backup not in BACKUPS:
            raise ValueError(f"backup must be one of {BACKUPS}, got {backup!r}")
        if getattr(engine, "weight_update", None) is not None:
            raise ValueError("another weight update is open on this engine: finish or abort it first")
        engine.drain()
        engine.check_weights_can_change()
        if contract is not None:
            engine.execution_contract().check_compatible(contract)  # ValueError names the differing keys
        self.engine = engine
        self.model = engine.executor.model
        # a failed update left the weights torn (part new, part old): only an update that gives
        # every parameter lifts that, else the engine would serve a mix of two versions
        self.require_complete = require_complete or bool(getattr(engine, "weights_torn", False))
        self.backup = backup
        self.check_finite = check_finite
        self._pending_checks: list = []   # finiteness of retained buckets, read once at finish
        self.planner = weight_mapping_of(self.model).planner(exact_dtype=False, check_finite=False)
        self._staged: list[tuple[torch.Tensor, torch.Tensor]] = []     # validated, written at finish
        self._undo: list[tuple[torch.Tensor, torch.Tensor]] = []       # (destination, its previous bytes)
        self._written = False
        self._live_non_finite = False   # a colocated source held NaN / Inf: the engine's own weights
        self._planned_complete = False
        self.closed = False
        self.num_buckets = 0
        self.copy_s = 0.0   # finish's write of the staged buckets (synchronized on CUDA)
        # a torn engine's pause belongs to the failed update: a complete update lifts it
        self._was_paused = engine.paused and not engine.weights_torn
        engine.paused = True  # from the first bucket to finish nothing steps
        engine.weight_update = self

    # ---- buckets ------------------------------------------------------------------------
    def load(self, weights, *, retain: bool = True) -> None:
        """Validate one bucket (a mapping, (name, tensor) pairs, or a FlatBucket). With
        `retain=True` its tensors must stay valid and unchanged until finish (they are
        written then); `retain=False` writes it now (the caller reuses its memory), keeping
        the overwritten bytes per `backup`. A bucket that fails validation writes nothing
        and aborts the update (the previous weights stay); a retained bucket's non-finite
        values are found at finish, which then aborts the same way."""
        self._check_open()
        try:
            pairs = _as_pairs(weights)
            self.planner.copy_held = not retain   # tied pairs are compared at finish, after the buffer is reused
            plan, names = [], []
            for name, tensor in pairs:
                if torch.is_tensor(tensor) and tensor.is_meta:   # (planners check manifests with meta tensors)
                    raise ValueError(f"weight {name!r} is a meta tensor: it has no values to load")
                w = _add(self.planner, name, tensor)
                if w is not None:
                    plan.append(w)
                    names.append(name)
            # a source that is the parameter's own memory (a colocated trainer's) is already live:
            # nothing to copy. Its values are checked all the same: the old weights cannot be
            # kept (they are gone), but the update is refused rather than counted as good
            live = [i for i, (d, s) in enumerate(plan) if _same_memory(d, s)]
            if live and self.check_finite:
                try:
                    check_finite([plan[i] for i in live], [names[i] for i in live])
                except ValueError as err:
                    # the bad values are already the engine's: abort cannot keep the old weights,
                    # so the engine stops serving (as after a torn update) until a good update
                    self._live_non_finite = True
                    raise ValueError(f"{err}: it is the engine's own parameter (a colocated trainer wrote it), "
                                     "so the engine already computes with it") from None
            dropped = frozenset(live)
            keep = [i for i in range(len(plan)) if i not in dropped]
            plan, names = [plan[i] for i in keep], [names[i] for i in keep]
            self.num_buckets += 1
            if retain:
                if self.check_finite:   # launched now, read at finish: no host sync per bucket
                    self._pending_checks += finite_flags(plan, names)
                self._staged += plan
            else:
                if self.check_finite:   # written now: checked first
                    check_finite(plan, names)
                self._write_through(plan)
        except BaseException as err:
            self.abort(f"{type(err).__name__}: {err}")
            raise

    def load_planned(self, plan: list[tuple[torch.Tensor, torch.Tensor]], *, complete: bool = False) -> None:
        """Stage (parameter view, source) pairs that a planner of this model already
        validated and checked for finiteness, sources in the parameters' dtypes (a
        checkpoint staged off the engine loop: vllm/weight_sync/staging.py); written at
        finish. Nothing is checked again: the pause then covers the copy alone.
        `complete`: that planner found every parameter covered (a whole checkpoint), which
        satisfies `require_complete` (and so lifts a torn engine)."""
        self._check_open()
        self.num_buckets += 1
        self._staged += plan
        self._planned_complete = self._planned_complete or complete

    def _write_through(self, plan: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not plan:
            return
        if self.backup != "none":
            where = self._backup_device(plan)
            with torch.no_grad():
                self._undo += [(d, d.snapshot(where) if isinstance(d, QuantizedRows)
                                else d.detach().to(where, copy=True) if where else d.detach().clone()) for d, _ in plan]
        self._written = True
        self._copy(plan)

    def _backup_device(self, plan) -> str | None:
        """Where a written bucket's previous bytes go: "cpu", or None for the device."""
        if self.backup == "host":
            return "cpu"
        dev = self.engine.executor.info.device
        if self.backup == "device" or dev.type != "cuda":
            return None
        need = sum(d.numel() * (1 if isinstance(d, QuantizedRows) else d.element_size()) for d, _ in plan)
        free, _ = torch.cuda.mem_get_info(dev)
        spare = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)   # the allocator's own
        return None if need + AUTO_BACKUP_HEADROOM_BYTES <= free + spare else "cpu"

    def _copy(self, plan) -> None:
        if not plan:
            return
        dev = self.engine.executor.info.device
        if any(s.is_cuda and s.device != dev for _, s in plan) or (dev.type == "cuda" and any(s.is_cuda for _, s in plan)):
            torch.cuda.synchronize()  # the sender may have written the sources on another stream
        with torch.no_grad():
            copy_all([d for d, _ in plan if not isinstance(d, QuantizedRows)],
                     [s for d, s in plan if not isinstance(d, QuantizedRows)])
            for d, s in plan:
                if isinstance(d, QuantizedRows):   # an FP8 layer without a master: quantized on arrival
                    d.write(s)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    # ---- closing ------------------------------------------------------------------------
    def finish(self) -> int:
        """Close the version: check coverage, write what was staged, bump the engine's
        weight version (dropping prefix-cache entries of the old weights), verify the
        CUDA-graph pointers, resume requests. Returns the new version."""
        self._check_open()
        try:
            tail = self.planner.finish()      # aliases given without their target (tied weights)
            if self.check_finite:
                raise_if_non_finite(self._pending_checks + finite_flags(tail, self.planner.alias_writes))
            if self.require_complete and not self._planned_complete:
                missing = self.planner.missing()
                if missing:
                    torn = (" (a failed update tore the weights: only a complete update lifts that)"
                            if getattr(self.engine, "weights_torn", False) else "")
                    raise ValueError(f"incomplete update{torn}: missing {missing[:6]}")
            t0 = time.perf_counter()
            self._copy(self._staged + [(d, s) for d, s in tail if not _same_memory(d, s)])
            self.copy_s = time.perf_counter() - t0
        except BaseException as err:
            self.abort(f"{type(err).__name__}: {err}")
            raise
        eng = self.engine
        self._close()
        eng.on_weights_updated()
        eng.weight_error = None
        eng.weights_torn = False
        eng.executor.verify_graph_pointers()
        if not self._was_paused:
            eng.resume()
        return eng.weight_version

    def abort(self, reason: str = "aborted") -> None:
        """Give up: put back what was written (the previous weights, bit for bit), record
        `reason` as the engine's `weight_error`, resume requests. With backup="none" and
        bytes already written, the engine instead refuses requests (WeightUpdateError)."""
        if self.closed:
            return
        eng = self.engine
        undo = self._undo
        self._close()
        if self._written and self.backup == "none":
            eng.weights_torn = True
            eng.weight_error = (f"weight update failed after writing ({reason}); the engine refuses requests "
                                "until a complete update finishes")
            logger.error(eng.weight_error)
            return
        if undo:
            with torch.no_grad():
                copy_all([d for d, _ in undo if not isinstance(d, QuantizedRows)],
                         [b.to(d.device) for d, b in undo if not isinstance(d, QuantizedRows)])
                for d, b in undo:
                    if isinstance(d, QuantizedRows):
                        d.restore(b)
            if eng.executor.info.device.type == "cuda":
                torch.cuda.synchronize(eng.executor.info.device)
            if hasattr(eng, "record_parameter_versions"):   # the old weights, written back: not a new version
                eng.record_parameter_versions()
        if self._live_non_finite:
            eng.weights_torn = True
            eng.weight_error = (f"weight update refused ({reason}); the non-finite values are in the engine's own "
                                "parameters (a colocated trainer wrote them in place), so the previous weights are "
                                "gone: the engine refuses requests until an update with finite weights finishes")
            logger.error(eng.weight_error)
            return
        if getattr(eng, "weights_torn", False):
            # an earlier failure tore the weights and this one wrote nothing: still torn
            eng.weight_error = (f"weight update failed ({reason}); the weights are still torn by an earlier failed "
                                "update: the engine refuses requests until a complete update finishes")
        else:
            eng.weight_error = (f"weight update failed, previous weights kept (version {eng.weight_version}): "
                                f"{reason}")
        logger.warning(eng.weight_error)
        if not self._was_paused and not getattr(eng, "weights_torn", False):
            eng.resume()

    def _close(self) -> None:
        self.closed = True
        self._staged, self._undo, self._pending_checks = [], [], []
        self.engine.weight_update = None

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("this weight update is already finished or aborted")

    def __enter__(self) -> "WeightUpdate":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort(f"{exc_type.__name__}: {exc}")


def update_weights(engine, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                   contract=None, require_complete: bool = False, check_finite: bool = True) -> int:
    """Copy `weights` (HF names; any float dtype, cast by the load rule) into the engine's
    model in place: one bucket, validated whole before anything is written. Returns the
    new weight version."""
    pairs = _as_pairs(weights)  # a malformed argument is refused before the engine pauses
    update = WeightUpdate(engine, contract=contract, require_complete=require_complete, check_finite=check_finite)
    update.load(pairs)
    return update.finish()
