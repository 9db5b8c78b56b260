"""The two actor classes of a Ray training job, as plain classes (the driver wraps them with
`ray.remote`, so they import and unit-test without Ray).

- `EngineActor`: one rollout engine, the `LLM` that `vllm train` and `vllm serve` run,
  generating through `ColocatedRollout.generate` (the in-process trainer's own rollout code),
  taking weights by IPC (`apply_ipc_update`) or over a broadcast group (`receive_update`),
  both checked against the trainer's execution contract.
- `TrainerActor`: the unchanged `Trainer` loop with a `RayRollout` as its rollout client.
"""
from __future__ import annotations

import logging
import os
import uuid

from vllm.rl.ray.messages import EngineFault, EngineRollout, EngineSpec, EngineState, TrainerSetup
from vllm.rl.ray.rollout import node_ip

logger = logging.getLogger(__name__)


def _was_restarted() -> bool:
    """True in an actor Ray has restarted after a crash (False outside Ray)."""
    import warnings

    try:
        import ray
        if not ray.is_initialized():
            return False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the property reads Ray's deprecated actor_id internally
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except (ImportError, RuntimeError, AttributeError):
        return False


class EngineActor:
    def __init__(self, index: int, spec: EngineSpec, fault: EngineFault | None = None):
        import torch

        from vllm import LLM
        from vllm.rl.rollout import ColocatedRollout

        # the contract records the CPU thread count: every actor of a job uses the same one
        torch.set_num_threads(spec.torch_threads)
        self.index = index
        self.spec = spec
        self.llm = LLM(spec.model_dir, dtype=spec.dtype, device=spec.device, seed=spec.seed, numerics=spec.numerics,
                       max_model_len=spec.max_model_len, gpu_memory_utilization=spec.gpu_memory_utilization,
                       enforce_eager=spec.enforce_eager, load_format=spec.load_format,
                       enable_sleep_mode=spec.sleep, max_num_seqs=spec.max_num_seqs,
                       tensor_parallel_size=spec.tensor_parallel_size, tp_leaves=spec.tp_leaves,
                       kv_cache_dtype=spec.kv_cache_dtype, quantization=spec.quantization)
        self.rollout = ColocatedRollout(self.llm, sleep=spec.sleep)
        self.restarted = _was_restarted()
        self.incarnation = uuid.uuid4().hex
        self.fault = fault if fault is not None and fault.engine == index and not self.restarted else None
        self.generate_calls = 0
        self.weights_version: int | None = None
        self.trainer_contract = None
        self.group = None

    def describe(self) -> EngineState:
        return EngineState(index=self.index, incarnation=self.incarnation, pid=os.getpid(), node_ip=node_ip(), restarted=self.restarted,
                           weights_version=self.weights_version,
                           contract_json=self.llm.execution_contract().to_json())

    def accept_trainer(self, contract_json: str) -> None:
        """Check the trainer's execution contract against this engine's (ValueError naming the
        differing fields); every later update is checked against it again."""
        from vllm.contract import ExecutionContract

        contract = ExecutionContract.from_json(contract_json)
        self.llm.execution_contract().check_compatible(contract)
        self.trainer_contract = contract

    def join_group(self, spec) -> None:
        """Join the trainer's broadcast group (blocks until the trainer joins too)."""
        from vllm.weight_sync.group import WeightGroup

        if self.group is not None:
            self.group.close()
        self.group = None
        self.group = WeightGroup(spec, device=None)

    def _need_contract(self) -> None:
        if self.trainer_contract is None:
            raise ValueError(f"rollout engine {self.index}: no trainer contract accepted yet (accept_trainer first)")

    def receive_broadcast(self, manifest: list, bucket_bytes: int, version: int) -> int:
        """One weight update over the broadcast group; the weights are then at trainer `version`."""
        from vllm.weight_sync.group import receive_update

        self._need_contract()
        if self.group is None:
            raise ValueError(f"rollout engine {self.index}: not in a broadcast group (join_group first)")
        receive_update(self.llm.llm_engine, self.group, manifest, bucket_bytes, require_complete=True,
                       contract=self.trainer_contract)
        self.weights_version = version
        return version

    def apply_ipc(self, message: list, version: int) -> int:
        """One weight update from buckets the trainer exported on this node (CUDA IPC, or
        shared memory on CPU)."""
        from vllm.weight_sync.ipc import apply_ipc_update

        self._need_contract()
        apply_ipc_update(self.llm.llm_engine, message, contract=self.trainer_contract, require_complete=True)
        self.weights_version = version
        return version

    def generate(self, requests: list, settings, version: int) -> EngineRollout:
        """This engine's share of a step, if its weights are at trainer `version`."""
        self.generate_calls += 1
        if self.fault is not None and self.generate_calls == self.fault.generate_call:
            logger.error("rollout engine %d: injected fault, exiting at generate call %d", self.index,
                         self.generate_calls)
            os._exit(1)
        if self.weights_version != version:
            return EngineRollout(None, self.weights_version)
        return EngineRollout(self.rollout.generate(requests, settings), self.weights_version)

    def sleep(self) -> int:
        return self.rollout.release_memory()

    def wake_up(self) -> None:
        self.rollout.resume_memory()

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class TrainerActor:
    """Holds the Trainer; `start()` builds it (errors arrive as the method's exception, with
    their type, rather than as a dead actor)."""

    def __init__(self, config, engines: list, setup: TrainerSetup):
        self.config = config
        self.engines = engines
        self.setup = setup
        self.trainer = None
        self.rollout = None

    def start(self) -> dict:
        import torch

        from vllm.rl.ray.rollout import RayRollout
        from vllm.rl.trainer import Trainer

        torch.set_num_threads(self.setup.torch_threads)
        cfg = self.config.validate()
        device = cfg.model.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.rollout = RayRollout(self.engines, self.setup, dtype=cfg.model.dtype, device=device,
                                  numerics=cfg.model.numerics, load_format=cfg.model.load_format,
                                  kv_cache_dtype=cfg.model.kv_cache_dtype, quantization=cfg.model.quantization)
        self.trainer = Trainer(self.config, rollout=self.rollout)
        return {"pid": os.getpid(), "node_ip": node_ip(), "device": self.trainer.device,
                "step": self.trainer.step_count}

    def run(self) -> list[dict]:
        return self.trainer.run()

    def step(self):
        return self.trainer.step()

    def events(self) -> list:
        return list(self.rollout.events) if self.rollout is not None else []

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.close()
