"""`RayRollout`: the trainer's rollout client over rollout-engine actors (inside the trainer actor).

- Policy: a standalone Policy of the engines' checkpoint, built by the engine's own path.
- Contract: before the first sync every engine's execution contract is compared with the
  Policy's, on both sides (the engine keeps the trainer's and checks every update against it).
- Weights: `version` counts syncs. Each sync goes to every live engine by its route: "ipc"
  (an engine sharing the trainer's bundle maps the trainer's flat buckets: CUDA IPC
  handles, shared memory on CPU) or "broadcast" (a group per engine, the trainer rank 0:
  NCCL on GPUs, gloo on CPU).
- Rollouts: the requests are cut into contiguous shares over the live engines
  (`split_requests`), sent at once as Ray calls, and put back in request order, so a
  step sees the groups the in-process engine would have produced (each group's sampling
  seed is its own; invariant numerics make a row's bits independent of its batch).
- Faults: an engine call that fails because the actor died is logged; if Ray restarts
  the actor (`max_restarts`), the new incarnation is checked, given the current weights
  and its share sent again; if not, its share goes to the others. An engine asked to
  generate at another weight version than the trainer's refuses, is re-synced and asked
  again, so every rollout of a step is made with the same weights.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from vllm.rl.ray.messages import EngineEvent, EngineRollout, TrainerSetup, split_requests
from vllm.rl.rollout import RolloutClient, RolloutGroup, RolloutRequest, RolloutSettings

logger = logging.getLogger(__name__)


def node_ip() -> str:
    """This process's node address as the cluster sees it (the trainer's group store binds to it)."""
    try:
        import ray
        return ray.util.get_node_ip_address()
    except ImportError:
        return "127.0.0.1"


class RayRollout(RolloutClient):
    def __init__(self, engines: list, setup: TrainerSetup, *, dtype: str, device: str, numerics: str,
                 load_format: str = "safetensors", kv_cache_dtype: str = "auto", quantization: str | None = None):
        if not engines:
            raise ValueError("RayRollout needs at least one rollout engine actor")
        if len(setup.engine_routes) != len(engines):
            raise ValueError(f"{len(engines)} engines but {len(setup.engine_routes)} weight routes")
        self.engines = list(engines)
        self.setup = setup
        self.routes = list(setup.engine_routes)
        self.dtype, self.device, self.numerics, self.load_format = dtype, device, numerics, load_format
        self.kv_cache_dtype, self.quantization = kv_cache_dtype, quantization   # the engines' (EngineSpec)
        self.backend = "nccl" if str(device).startswith("cuda") else "gloo"
        self.alive = [True] * len(engines)
        self.version = 0              # syncs done: the weights every rollout is made with
        self._synced = False
        self._policy = None
        self._contract = None
        self._ready: dict[int, str] = {}   # engine -> the incarnation that accepted the contract
        self._groups: dict[int, object] = {}
        self._export = None
        self.events: list[EngineEvent] = []
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(engines)), thread_name_prefix="weight-broadcast")

    # ---- faults ---------------------------------------------------------------------------
    def _event(self, engine: int, kind: str, detail: str) -> None:
        ev = EngineEvent(engine, kind, detail)
        self.events.append(ev)
        logger.warning(ev.line())

    def _live(self) -> list[int]:
        return [i for i, ok in enumerate(self.alive) if ok]

    @staticmethod
    def _get(ref, timeout: float | None = None):
        """The call's result; a generate or a weight update may take as long as it takes (a
        dead actor fails it at once); `timeout` bounds waiting for a (re)starting engine."""
        import ray
        return ray.get(ref, timeout=timeout)

    @staticmethod
    def _is_death(err: BaseException) -> bool:
        import ray.exceptions as rex
        return isinstance(err, (rex.RayActorError, rex.GetTimeoutError))

    def _revive(self, k: int, cause: BaseException) -> bool:
        """After engine k's call failed because the actor died: wait for Ray's restart, then
        check it and give it the current weights. False (and no more work for it) if it is gone."""
        self._event(k, "died", f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}")
        self._ready.pop(k, None)
        group = self._groups.pop(k, None)
        if group is not None:
            group.close()
        try:
            self._connect(k)
        except Exception as err:  # noqa: BLE001 -- a dead or broken engine leaves the job, not the step
            if not self._is_death(err):
                raise
            self.alive[k] = False
            left = self._live()
            self._event(k, "gone", f"no restart left ({type(err).__name__}); its prompts go to engines {left}")
            if not left:
                raise RuntimeError("every rollout engine is gone: the step cannot be completed") from err
            return False
        if self._synced:
            self._push([k])
            if not self.alive[k]:   # it died again while taking the weights, with no restart left
                return False
        self._event(k, "restarted", f"back at weight version {self.version}")
        return True

    # ---- connecting -------------------------------------------------------------------------
    def _connect(self, k: int) -> None:
        """Contract check both ways with engine k (once per incarnation), and its broadcast group."""
        from vllm.contract import ExecutionContract

        state = self._describe(k)
        if self._ready.get(k) == state.incarnation:
            return
        try:
            self._contract.check_compatible(ExecutionContract.from_json(state.contract_json))
        except ValueError as err:
            raise ValueError(f"rollout engine {k} (pid {state.pid} on {state.node_ip}): {err}") from None
        self._get(self.engines[k].accept_trainer.remote(self._contract.to_json()))
        if self.routes[k] == "broadcast":
            self._join(k)
        self._ready[k] = state.incarnation

    def _describe(self, k: int):
        """Engine k's state; while Ray restarts the actor its calls fail as unavailable, so
        they are repeated until `engine_timeout_s` (then GetTimeoutError: treated as gone)."""
        import ray.exceptions as rex

        deadline = time.monotonic() + self.setup.engine_timeout_s
        while True:
            try:
                return self._get(self.engines[k].describe.remote(), timeout=max(0.0, deadline - time.monotonic()))
            except rex.ActorUnavailableError:
                if time.monotonic() >= deadline:
                    raise rex.GetTimeoutError(f"rollout engine {k} did not come back within "
                                              f"{self.setup.engine_timeout_s:g} s") from None
                time.sleep(0.1)

    def _join(self, k: int) -> None:
        from vllm.weight_sync.group import GroupSpec, WeightGroup, host_store

        old = self._groups.pop(k, None)
        if old is not None:   # the group of a previous incarnation of engine k
            old.close()
        host = node_ip()
        store = host_store(host, 0, world_size=2)
        spec = GroupSpec(host=host, port=store.port, rank=0, world_size=2, backend=self.backend,
                         group_name=f"vllm-rollout-engine-{k}")
        joined = self.engines[k].join_group.remote(GroupSpec(host=host, port=store.port, rank=1, world_size=2,
                                                             backend=self.backend, group_name=spec.group_name))
        device = self._policy.device if self.backend == "nccl" else None
        self._groups[k] = WeightGroup(spec, device=device, store=store)
        self._get(joined)

    # ---- RolloutClient ----------------------------------------------------------------------
    def policy(self, activation_checkpointing: bool = False):
        if self._policy is None:
            from vllm.training import Policy

            # every engine up first: sharing a GPU, each engine sizes its KV cache before the
            # trainer's Policy and optimizer state take their memory, in the same order every run
            for k in self._live():
                try:
                    self._describe(k)
                except Exception as err:  # noqa: BLE001
                    if not self._is_death(err):
                        raise
                    raise ValueError(f"rollout engine {k} did not start: {err}") from None
            self._policy = Policy.from_pretrained(self.setup.model_dir, dtype=self.dtype, device=self.device,
                                                  numerics=self.numerics, load_format=self.load_format,
                                                  tp_leaves=self.setup.tp_leaves, kv_cache_dtype=self.kv_cache_dtype,
                                                  quantization=self.quantization,
                                                  activation_checkpointing=activation_checkpointing)
            self._contract = self._policy.execution_contract()
            for k in self._live():
                self._connect(k)
        return self._policy

    def execution_contract(self):
        return self.policy().execution_contract()

    @property
    def weight_version(self) -> int:
        return self.version

    def sync_weights(self, policy) -> int:
        if policy is not self._policy:
            raise ValueError("RayRollout syncs the Policy it built (policy()), not another one")
        self.version += 1
        self._synced = True
        self._push(self._live())
        return self.version

    def _push(self, engines: list[int]) -> None:
        """Send the Policy's weights (trainer version `self.version`) to `engines`; an engine
        that dies meanwhile is revived (and pushed to again) or left out."""
        from vllm.weight_sync.bucket import manifest_of
        from vllm.weight_sync.group import send_update
        from vllm.weight_sync.ipc import IpcExport

        named = list(self._policy.model.hf_state_dict().items())
        refs, sends = {}, {}
        ipc = [k for k in engines if self.routes[k] == "ipc"]
        if ipc:
            if self._export is None:
                self._export = IpcExport(named, self.setup.bucket_bytes)
            else:
                self._export.refill(named)
            message = self._export.message()
            refs.update({k: self.engines[k].apply_ipc.remote(message, self.version) for k in ipc})
        bcast = [k for k in engines if self.routes[k] == "broadcast"]
        if bcast:
            manifest = [[n, d, list(s)] for n, d, s in manifest_of(named)]
            for k in bcast:
                refs[k] = self.engines[k].receive_broadcast.remote(manifest, self.setup.bucket_bytes, self.version)
                sends[k] = self._pool.submit(send_update, self._groups[k], named, self.setup.bucket_bytes)
        died = []
        for k, ref in refs.items():
            try:
                self._get(ref)
            except Exception as err:  # noqa: BLE001
                if not self._is_death(err):
                    raise
                died.append((k, err))
                continue
            if k in sends and not sends[k].result():
                raise ValueError(f"rollout engine {k} refused the weight update (see its log)")
        for k, err in died:
            self._revive(k, err)

    def load_weights(self, weights: dict[str, torch.Tensor], contract) -> None:
        from vllm.model_loader.loader import load_weights

        policy = self.policy()
        policy.execution_contract().check_compatible(contract)
        load_weights(policy.model, weights.items())
        self._synced = False      # the engines get them before the next rollout

    def generate(self, requests: list[RolloutRequest], settings: RolloutSettings) -> list[RolloutGroup]:
        if not self._synced:
            self.sync_weights(self.policy())
        results: list[RolloutGroup | None] = [None] * len(requests)
        pending = split_requests(len(requests), self._live())
        rounds = 0
        while pending:
            rounds += 1
            if rounds > 2 * len(self.engines) + 2:
                raise RuntimeError(f"rollouts did not complete after {rounds - 1} rounds of engine faults")
            refs = {k: self.engines[k].generate.remote([requests[i] for i in idx], settings, self.version)
                    for k, idx in pending.items()}
            retry: dict[int, list[int]] = {}
            for k, ref in refs.items():
                idx = pending[k]
                try:
                    out: EngineRollout = self._get(ref)
                except Exception as err:  # noqa: BLE001
                    if not self._is_death(err):
                        raise
                    if self._revive(k, err):
                        retry.setdefault(k, []).extend(idx)
                    else:
                        for j, e in split_requests(len(idx), self._live()).items():
                            retry.setdefault(j, []).extend(idx[i] for i in e)
                    continue
                if out.groups is None or out.weights_version != self.version:
                    self._event(k, "stale", f"weights at version {out.weights_version}, the step's are at "
                                            f"{self.version}: re-synced, its prompts sent again")
                    self._connect(k)
                    self._push([k])
                    retry.setdefault(k, []).extend(idx)
                    continue
                for i, g in zip(idx, out.groups):
                    results[i] = RolloutGroup(g.prompt_token_ids, g.completions, self.version)
            pending = retry
        return results

    def release_memory(self) -> int:
        if not self.setup.sleep:
            return 0
        return sum(self._each(lambda e: e.sleep.remote(), default=0))

    def resume_memory(self) -> None:
        if self.setup.sleep:
            self._each(lambda e: e.wake_up.remote(), default=None)

    def _each(self, call, default) -> list:
        """`call` on every live engine at once; a dead engine is left to the next generate."""
        refs = [(k, call(self.engines[k])) for k in self._live()]
        out = []
        for k, ref in refs:
            try:
                out.append(self._get(ref))
            except Exception as err:  # noqa: BLE001
                if not self._is_death(err):
                    raise
                out.append(default)
        return out

    def close(self) -> None:
        for g in self._groups.values():
            g.close()
        self._groups = {}
        if self._export is not None:
            self._export.release()
            self._export = None
        self._pool.shutdown(wait=False)
