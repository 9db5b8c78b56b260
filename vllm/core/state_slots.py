"""Recurrent-state slots: the block manager's counterpart for layers whose cache is a
fixed-size state per sequence (vllm/layers/cache_spec.py, `RecurrentStateSpec`).

Slot 0 is the null slot (padding rows write there). Slots 1 .. num_slots - 1 hold the
states of running sequences, one each, taken when a request first gets blocks and given
back when it frees them (finished, aborted, preempted: a preempted request recomputes its
state from its tokens). There are as many as the scheduler runs sequences at most.

Slots num_slots .. num_slots + num_snapshots - 1 hold prefix-cache snapshots: the state of a
prompt at a multiple of the states' chunk size, keyed by the KV block that ends there. A
prefix-cache hit on a hybrid model is cut back to the last block that has a snapshot, and
that snapshot is copied into the new request's slot before its first step. A snapshot is
dropped when its block is reallocated or the prefix cache is reset (a weight update, sleep),
and the least recently used one makes room for a new one.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Collection


class StateSlots:
    def __init__(self, num_slots: int, num_snapshots: int, chunk_size: int):
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is reserved), got {num_slots}")
        self.num_slots, self.num_snapshots, self.chunk_size = num_slots, num_snapshots, chunk_size
        self._free = list(range(num_slots - 1, 0, -1))  # pop() hands out 1, 2, ...
        self._owner: dict[str, int] = {}
        self._free_snapshots = list(range(num_slots + num_snapshots - 1, num_slots - 1, -1))
        self._snapshot_of: OrderedDict[int, int] = OrderedDict()  # block id -> snapshot slot, LRU first

    # ---- running sequences ---------------------------------------------------------------
    def assign(self, request_id: str) -> int:
        if request_id in self._owner:
            return self._owner[request_id]
        if not self._free:
            raise RuntimeError("no free recurrent-state slot: more running requests than max_num_seqs")
        slot = self._owner[request_id] = self._free.pop()
        return slot

    def slot(self, request_id: str) -> int:
        return self._owner[request_id]

    def release(self, request_id: str) -> None:
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    # ---- prefix-cache snapshots ------------------------------------------------------------
    def snapshot(self, block_id: int) -> int | None:
        """The snapshot taken where block `block_id` ends, if any (and mark it used)."""
        slot = self._snapshot_of.get(block_id)
        if slot is not None:
            self._snapshot_of.move_to_end(block_id)
        return slot

    def take_snapshot(self, block_id: int, keep: Collection[int] = ()) -> int:
        """A snapshot slot for the state where block `block_id` ends (-1 when snapshots are
        off, or when every snapshot slot is in `keep`); the least recently used snapshot not
        in `keep` makes room. `keep`: the slots the step being scheduled saves into already:
        two saves of one step into one slot would race (the runner copies them with one
        index_copy_, whose result with repeated indices is undefined on the GPU)."""
        if self.num_snapshots == 0:
            return -1
        if block_id in self._snapshot_of:
            self._snapshot_of.move_to_end(block_id)
            slot = self._snapshot_of[block_id]
            return -1 if slot in keep else slot   # another request of the step saves this block's state
        if not self._free_snapshots:
            victim = next((b for b, s in self._snapshot_of.items() if s not in keep), None)
            if victim is None:
                return -1   # every snapshot slot is written this step: no snapshot for this prompt
            self._free_snapshots.append(self._snapshot_of.pop(victim))
        slot = self._snapshot_of[block_id] = self._free_snapshots.pop()
        return slot

    def drop_snapshot(self, block_id: int) -> None:
        """Block `block_id` holds other tokens now (or none): its snapshot is stale."""
        slot = self._snapshot_of.pop(block_id, None)
        if slot is not None:
            self._free_snapshots.append(slot)

    def clear_snapshots(self) -> None:
        for block_id in list(self._snapshot_of):
            self.drop_snapshot(block_id)

    @property
    def num_snapshots_held(self) -> int:
        return len(self._snapshot_of)
