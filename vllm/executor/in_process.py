"""One worker in the engine's process: the ModelRunner, on this process's device."""
from __future__ import annotations

from typing import Callable, Mapping

from torch import nn

from vllm.config import EngineConfig
from vllm.core.messages import ModelRunnerOutput, SchedulerOutput
from vllm.executor.base import Executor, ExecutorInfo
from vllm.worker.model_runner import ModelRunner, StepHandle


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig):
        # the one worker; `worker` is for in-process diagnostics and tests only
        self.worker = ModelRunner(config)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(sched)

    def launch(self, sched: SchedulerOutput, prev: StepHandle | None = None) -> StepHandle:
        return self.worker.launch(sched, prev)

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        return self.worker.collect(handle)

    @property
    def info(self) -> ExecutorInfo:
        w = self.worker
        return ExecutorInfo(device=w.device, num_blocks=w.num_blocks, kv_capacity_tokens=w.kv_capacity_tokens,
                            has_cuda_graphs=bool(w.decode_graphs.graphs), self_check_report=w.self_check_report,
                            num_state_slots=w.cache_plan.num_state_slots,
                            num_state_snapshots=w.cache_plan.num_state_snapshots,
                            state_chunk_size=w.cache_specs.state_chunk_size)

    def sleep(self) -> int:
        return self.worker.sleep()

    def wake_up(self) -> None:
        self.worker.wake_up()

    @property
    def model(self) -> nn.Module:
        return self.worker.model

    def weights_changed(self) -> None:
        self.worker.weights_changed()

    def verify_graph_pointers(self) -> None:
        self.worker.verify_graph_pointers()

    @property
    def rpc_methods(self) -> Mapping[str, Callable]:
        return {name: getattr(ModelRunner, name) for name in ModelRunner.RPC_METHODS}

    def collective_rpc(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> list:
        return [fn(self.worker, *args, **(kwargs or {}))]   # the one worker

    @property
    def step_timings(self) -> dict[str, float] | None:
        return self.worker.timer.timings if self.worker.timer.enabled else None
