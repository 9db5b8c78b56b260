"""The executor interface: everything LLMEngine, weight sync and the colocated trainer ask of
the workers that hold the model and the KV cache.

The engine schedules; an executor runs the steps it is handed (one in-process worker today;
the ranks of a tensor-parallel group or Ray actors behind the same methods). Typed messages
cross it in both directions: `SchedulerOutput` in, `ModelRunnerOutput` out
(vllm/core/messages.py). Nothing outside an executor reaches its workers, but for the
function a caller hands `LLM.collective_rpc` (upstream's way in: it gets the worker).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from vllm.core.messages import ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class ExecutorInfo:
    """What the workers report once started (fixed for the executor's life)."""
    device: torch.device  # where the (colocated) model and the KV cache live
    num_blocks: int  # KV-cache blocks per worker, the null block 0 included (the block manager's size)
    kv_capacity_tokens: int  # tokens the KV cache holds
    has_cuda_graphs: bool  # decode steps replay captured CUDA graphs
    self_check_report: dict | None  # the invariant kernels' start-up self-check (None when none ran)
    # recurrent states (models with recurrent layers; 0 / None otherwise): slots per worker,
    # the null slot 0 included, the prefix-cache snapshots after them, and the states' grid
    num_state_slots: int = 0
    num_state_snapshots: int = 0
    state_chunk_size: int | None = None


class Executor(ABC):
    # ---- steps ---------------------------------------------------------------------
    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step to completion: forward, sampling, the sampled tokens on the host."""

    @abstractmethod
    def launch(self, sched: SchedulerOutput, prev=None):
        """Start one step without waiting for it (async scheduling); `prev` is the handle of
        the step before, whose sampled tokens on the device feed this one. Returns a handle."""

    @abstractmethod
    def collect(self, handle) -> ModelRunnerOutput:
        """Wait for a launched step and return its sampled tokens."""

    # ---- what the workers are -------------------------------------------------------
    @property
    @abstractmethod
    def info(self) -> ExecutorInfo:
        """Device, KV-cache size, graphs and the start-up self-check, fixed once started."""

    # ---- the KV cache --------------------------------------------------------------
    @abstractmethod
    def sleep(self) -> int:
        """Release the KV cache's memory; returns the bytes released."""

    @abstractmethod
    def wake_up(self) -> None:
        """Take the KV cache's memory back (zero-filled, as at start-up)."""

    # ---- weights -------------------------------------------------------------------
    @property
    @abstractmethod
    def model(self) -> nn.Module:
        """The model the workers compute with, when it lives in this process (weight sync
        writes into it in place; `LLM.policy()` trains it). An executor whose workers live
        elsewhere raises ValueError."""

    @abstractmethod
    def weights_changed(self) -> None:
        """The weights were written in place: the next graph replay first checks the
        pointers its graphs read."""

    @abstractmethod
    def verify_graph_pointers(self) -> None:
        """Raise StaleGraphPointers if a tensor a captured CUDA graph reads has moved."""

    # ---- calls into the workers (LLM.collective_rpc) ----------------------------------
    @property
    @abstractmethod
    def rpc_methods(self) -> Mapping[str, Callable]:
        """The worker methods `LLM.collective_rpc` may call by name: name -> the function,
        taking the worker first. `LLM.collective_rpc` resolves (and refuses) names here, the
        one place a name is checked."""

    @abstractmethod
    def collective_rpc(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> list:
        """Call `fn(worker, *args, **kwargs)` on every worker; one result per worker, in rank
        order. Takes a function only: a name is resolved through `rpc_methods` by the caller."""

    @property
    @abstractmethod
    def step_timings(self) -> dict[str, float] | None:
        """Seconds per step phase when step profiling is on (EngineConfig.step_profile), else None."""
