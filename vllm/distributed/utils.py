"""upstream vLLM's `StatelessProcessGroup`: one rank's view of a group's TCPStore."""
from __future__ import annotations

import datetime


class StatelessProcessGroup:
    """Rank `rank` of `world_size` meeting at host:port (rank 0 hosts the store). Nothing
    touches torch.distributed's default group."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, store, timeout_s: float = 300.0):
        self.host, self.port, self.rank, self.world_size = host, port, rank, world_size
        self.store = store
        self.socket = None          # TRL's client clears store and socket to let the group go
        self.timeout_s = timeout_s
        self._barriers = 0

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int, data_expiration_seconds: int = 3600,
               store_timeout: int = 300) -> "StatelessProcessGroup":
        import torch.distributed as dist

        store = dist.TCPStore(host, port, world_size, rank == 0, timeout=datetime.timedelta(seconds=store_timeout),
                              wait_for_workers=False)
        return cls(host, port, rank, world_size, store, float(store_timeout))

    def barrier(self, timeout: float | None = None) -> None:
        """Wait until every rank arrived (the engine counts its barriers the same way)."""
        from vllm.weight_sync.group import store_barrier

        self._barriers += 1
        store_barrier(self.store, self._barriers, self.world_size, timeout or self.timeout_s)
