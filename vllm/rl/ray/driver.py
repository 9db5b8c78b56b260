"""`vllm train --backend ray`: the driver. It starts a local Ray cluster or joins one
(`ray_address`), creates one placement group from the plan (placement.py), places the
rollout-engine actors and the trainer actor in it, and runs the unchanged Trainer loop
inside the trainer actor (docs/ray.md).

    job = RayTrainJob(config)     # cluster, placement group, actors, contract checks
    records = job.run()           # the whole run, as `vllm train` (metrics, checkpoints, --resume)
    job.shutdown()                # actors, placement group, and the cluster if this driver started it

`job.step()` runs one step and returns its StepResult (the exact tokens and logprobs), for
tests that compare it with the single-process run bit for bit.
"""
from __future__ import annotations

import math
import os
import sys
from typing import Sequence

from vllm.rl.config import TrainConfig
from vllm.rl.ray.actors import EngineActor, TrainerActor
from vllm.rl.ray.messages import EngineEvent, EngineFault, EngineSpec, TrainerSetup, trainer_tp_leaves
from vllm.rl.ray.placement import PlacementPlan, plan_placement
from vllm.rl.trainer import MismatchError, StepResult, model_dir_of

# errors raised inside an actor that the driver re-raises as they are (the CLI maps them to exit codes)
PASS_THROUGH = (ValueError, MismatchError, OSError)


class TrainerActorDied(RuntimeError):
    """The trainer actor's process ended mid-run; the last checkpoint resumes it bit-exactly."""


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("backend ray needs the ray package: pip install -e '.[ray]' (or pip install ray)") from None
    return ray


def _device_of(cfg: TrainConfig, ray) -> str:
    """cuda or cpu: the configured device, else cuda when the cluster has GPUs."""
    dev = cfg.model.device
    if dev is not None:
        if dev not in ("cpu", "cuda"):
            raise ValueError(f"backend ray: device must be cpu or cuda (Ray assigns each actor its GPU), got {dev!r}")
        return dev
    if ray.is_initialized():
        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _plan(cfg: TrainConfig, device: str) -> PlacementPlan:
    c = cfg.cluster
    return plan_placement(engines=c.rollout_engines, placement=c.placement, device=device,
                          cpus_per_bundle=c.cpus_per_bundle)


class RayTrainJob:
    """One training job on Ray. `faults` injects engine crashes (tests); `engine_timeout_s`
    bounds how long a (re)starting engine may take to answer; `ready_timeout_s` how long
    the cluster may take to grant the placement group."""

    def __init__(self, config: TrainConfig, *, faults: Sequence[EngineFault] = (), engine_timeout_s: float = 600.0,
                 ready_timeout_s: float = 300.0, stream=None):
        from vllm.weight_sync.bucket import DEFAULT_BUCKET_BYTES

        cfg = config.validate()
        c = cfg.cluster
        if c.backend != "ray":
            raise ValueError(f"RayTrainJob runs backend ray, the configuration says backend {c.backend!r}")
        for f in faults:
            if f.engine >= c.rollout_engines:
                raise ValueError(f"fault for engine {f.engine}, but the job has {c.rollout_engines} engine(s)")
        ray = _import_ray()
        self.stream = stream or sys.stdout
        self.config = config
        model_dir = model_dir_of(cfg)   # checked (and, for a dummy config.json, written) before any actor starts
        self._own_ray = False
        self._pg = None
        self.engines: list = []
        self.trainer = None
        self._interrupted = False   # Ctrl-C / SIGTERM: the trainer actor is busy, not asked to close
        try:
            if not ray.is_initialized():
                if c.ray_address is None:
                    need = _plan(cfg, _device_of(cfg, ray)).total_cpus
                    ray.init(num_cpus=c.ray_num_cpus or max(os.cpu_count() or 1, math.ceil(need)),
                             include_dashboard=False)
                else:
                    try:
                        ray.init(address=c.ray_address)
                    except (ConnectionError, RuntimeError, TimeoutError) as err:
                        raise ValueError(f"cannot join the Ray cluster at {c.ray_address!r}: "
                                         f"{type(err).__name__}: {err}") from None
                self._own_ray = True
            device = _device_of(cfg, ray)
            self.plan = plan = _plan(cfg, device)
            self._print(f"vllm train: backend ray, {plan.placement}, {len(plan.engines)} rollout engine(s), "
                        f"placement group of {len(plan.bundles)} bundle(s) ({plan.strategy}):")
            for line in plan.describe():
                self._print("  " + line)
            self._start(ray, cfg, plan, model_dir, device, faults, engine_timeout_s, ready_timeout_s,
                        DEFAULT_BUCKET_BYTES)
        except BaseException:
            self.shutdown()
            raise

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def _start(self, ray, cfg, plan, model_dir, device, faults, engine_timeout_s, ready_timeout_s, bucket_bytes):
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        have = ray.cluster_resources()
        for res, need in (("CPU", plan.total_cpus), ("GPU", plan.total_gpus)):
            if need > have.get(res, 0):
                raise ValueError(f"the placement group needs {need:g} {res} in all ({len(plan.bundles)} bundle(s) of "
                                 f"{plan.bundles[0]}); the Ray cluster has {have.get(res, 0):g}")
        self._pg = placement_group([dict(b) for b in plan.bundles], strategy=plan.strategy)
        try:
            ray.get(self._pg.ready(), timeout=ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ValueError(f"the Ray cluster did not grant {len(plan.bundles)} bundle(s) of {plan.bundles[0]} "
                             f"({plan.strategy}) within {ready_timeout_s:g} s; available: "
                             f"{ray.available_resources()}") from None

        def where(bundle: int):
            return PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=bundle)

        m = cfg.model
        sleep = m.sleep_mode if m.sleep_mode is not None else (device == "cuda" and plan.placement == "colocated")
        threads = cfg.cluster.cpus_per_bundle
        spec = EngineSpec.from_config(cfg, model_dir, device, sleep, threads)
        fault_of = {}
        for f in faults:
            fault_of.setdefault(f.engine, f)
        remote_engine = ray.remote(EngineActor)
        self.engines = [remote_engine.options(num_cpus=s.num_cpus, num_gpus=s.num_gpus,
                                              max_restarts=cfg.cluster.engine_restarts, max_task_retries=0,
                                              scheduling_strategy=where(s.bundle)).remote(s.index, spec,
                                                                                          fault_of.get(s.index))
                        for s in plan.engines]
        setup = TrainerSetup(model_dir=model_dir, tp_leaves=trainer_tp_leaves(m.tensor_parallel_size, m.tp_leaves),
                             engine_routes=tuple(s.weight_route for s in plan.engines),
                             sleep=sleep, torch_threads=threads, bucket_bytes=bucket_bytes,
                             engine_timeout_s=engine_timeout_s)
        t = plan.trainer[0]
        self.trainer = ray.remote(TrainerActor).options(num_cpus=t.num_cpus, num_gpus=t.num_gpus, max_restarts=0,
                                                        scheduling_strategy=where(t.bundle)).remote(
            self.config, self.engines, setup)
        info = self._call(self.trainer.start.remote())
        self._print(f"vllm train: trainer actor pid {info['pid']} on {info['node_ip']} ({info['device']}) at step "
                    f"{info['step']}; {len(self.engines)} engine(s) checked against its execution contract")

    def _call(self, ref):
        """ray.get, re-raising a ValueError / MismatchError / OSError from inside an actor as
        itself, and the trainer actor's death as TrainerActorDied."""
        import ray
        try:
            return ray.get(ref)
        except KeyboardInterrupt:
            self._interrupted = True
            raise
        except ray.exceptions.RayTaskError as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, PASS_THROUGH):
                raise cause from None
            raise
        except ray.exceptions.RayActorError as err:
            out = self.config.run.output_dir
            raise TrainerActorDied(f"the trainer actor died ({type(err).__name__}); continue from the last checkpoint "
                                   f"with: vllm train --resume --output-dir {out}") from err

    # ---- running ----------------------------------------------------------------------------
    def run(self) -> list[dict]:
        """The whole run (evaluations, checkpoints, the summary), as `vllm train`."""
        return self._call(self.trainer.run.remote())

    def step(self) -> StepResult:
        return self._call(self.trainer.step.remote())

    def events(self) -> list[EngineEvent]:
        """The engine faults the trainer handled so far."""
        return self._call(self.trainer.events.remote())

    def shutdown(self) -> None:
        """Stop the actors and free the placement group; stop the cluster if this job started it."""
        try:
            import ray
        except ImportError:
            return
        if not ray.is_initialized():
            return
        # an interrupted run's trainer actor is still in its task: a close call would queue
        # behind it and wait out its timeout, so the actors are killed at once (a checkpoint
        # being written is left unfinished under its temporary name; `latest` stays)
        if self.trainer is not None and not self._interrupted:
            try:
                ray.get(self.trainer.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 -- a dead trainer has nothing left to close
                pass
        for actor in [self.trainer, *self.engines]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        self.trainer, self.engines = None, []
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self._pg)
            self._pg = None
        if self._own_ray:
            ray.shutdown()
            self._own_ray = False

    def __enter__(self) -> "RayTrainJob":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def run_on_ray(config: TrainConfig, **kwargs) -> list[dict]:
    """`vllm train --backend ray`: the whole run on Ray; returns the metrics records."""
    with RayTrainJob(config, **kwargs) as job:
        return job.run()
