"""Wall time per phase of an engine step (prepare, forward, logits, sample...), for benchmarks.

Off by default: each boundary synchronises the device so the time lands in the phase that
spent it, and those syncs cost throughput."""
from __future__ import annotations

import time
from collections import defaultdict

import torch


class PhaseTimer:
    def __init__(self, device: torch.device, enabled: bool = False):
        self.device = device
        self.enabled = enabled
        self.timings: dict[str, float] = defaultdict(float)
        self._t = 0.0

    def mark(self, phase: str | None) -> None:
        """End `phase` here (None: only start timing the next one)."""
        if not self.enabled:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if phase is not None:
            self.timings[phase] += now - self._t
        self._t = now
