"""upstream vLLM's `PyNcclCommunicator`, as a broadcast over this project's weight group
(NCCL for a CUDA device, gloo for the CPU)."""
from __future__ import annotations

import torch

from vllm.distributed.utils import StatelessProcessGroup


class PyNcclCommunicator:
    def __init__(self, group: StatelessProcessGroup, device: int | str | torch.device):
        from vllm.weight_sync.group import GroupSpec, WeightGroup

        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        spec = GroupSpec(group.host, group.port, group.rank, group.world_size, backend, group.timeout_s)
        self.group = group
        self.rank, self.world_size, self.device = group.rank, group.world_size, device
        self.weight_group = WeightGroup(spec, device=device if backend == "nccl" else None, store=group.store)
        self.engine_rank = 1 if group.rank == 0 else 0

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        """Broadcast `tensor` from rank `src` in place, as raw bytes (any dtype)."""
        flat = tensor if tensor.is_contiguous() else tensor.contiguous()
        buf = flat.view(-1).view(torch.uint8)
        if buf.device != self.weight_group.device:
            moved = buf.to(self.weight_group.device)
            self.weight_group.broadcast(moved, src)
            buf.copy_(moved)
        else:
            self.weight_group.broadcast(buf, src)
        if flat is not tensor:
            tensor.copy_(flat)
