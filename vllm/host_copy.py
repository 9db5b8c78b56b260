"""Host values -> device tensors without making the host wait for the GPU."""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype | None, device) -> torch.Tensor:
    """A list / numpy array as a tensor on `device`. On CUDA the values are staged in
    pinned memory and copied non_blocking: a plain `torch.tensor(values, device="cuda")`
    is a blocking copy, which synchronises the stream -- it waits for every step already
    enqueued, which with async scheduling serialises the host and the GPU again
    (tests/test_gpu_engine.py runs the runner's launch() under torch's sync debug mode).
    The caching host allocator keeps the pinned block until its copy has completed."""
    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
