"""The addresses a captured CUDA graph reads, and the check that they still hold.

A CUDA graph replays kernels with the pointers it saw at capture. If a parameter or a
workspace buffer is given new storage afterwards (`param.data = new`, a reload that
allocates, `.contiguous()` on a non-contiguous weight), replay silently reads the old
memory: stale weights, or an illegal access once that memory is reused. Weight sync
copies in place, so the addresses never change; this table is the check that they
did not, run after every weight update (before the next replay) and on demand.
"""
from __future__ import annotations

import torch


class StaleGraphPointers(RuntimeError):
    """Tensors a captured graph reads now live at other addresses."""


class GraphPointerTable:
    """{name: data_ptr} of every tensor the graphs read, taken at capture."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.pointers = {name: t.data_ptr() for name, t in tensors.items()}

    def stale(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Names whose address changed since capture, or that are gone."""
        out = [n for n, p in self.pointers.items() if n not in tensors or tensors[n].data_ptr() != p]
        return sorted(out)

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        bad = self.stale(tensors)
        if bad:
            raise StaleGraphPointers(
                f"{len(bad)} tensor(s) read by the captured CUDA graphs moved since capture (e.g. {bad[:4]}): "
                "replaying would read freed memory. Weights must be updated in place (LLM.update_weights); "
                "or re-capture the graphs.")
