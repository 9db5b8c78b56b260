"""A step's inputs packed into flat host arrays with a handful of numpy calls (no per-token
Python), in the scheduler's request order."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np


@dataclass
class StepInputs:
    input_ids: np.ndarray   # [T] int64, the step's tokens packed request after request
    positions: np.ndarray   # [T] int64, each token's position in its sequence
    slots: np.ndarray       # [T] int64, each token's KV slot (block * block_size + offset)
    table: np.ndarray       # [S, width] int32, the block tables (zeros past a sequence's blocks)
    cu: np.ndarray          # [S + 1] int64, cumulative query lengths
    seq_lens: np.ndarray    # [S] int64, context length after the step
    starts: np.ndarray      # [S] int64, tokens computed before the step
    q_lens: np.ndarray      # [S] int64, tokens in the step

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def max_query_len(self) -> int:
        return int(self.q_lens.max())

    @property
    def fresh_prefill(self) -> bool:
        """Every sequence starts at position 0 and some has more than one token."""
        return bool(self.max_query_len > 1 and (self.starts == 0).all())


def pack_step(requests, block_size: int) -> StepInputs:
    n = len(requests)
    q_lens = np.fromiter((len(r.token_ids) for r in requests), dtype=np.int64, count=n)
    starts = np.fromiter((r.num_computed for r in requests), dtype=np.int64, count=n)
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    total = int(cu[-1])
    input_ids = np.fromiter(itertools.chain.from_iterable(r.token_ids for r in requests), dtype=np.int64, count=total)
    seq_of_token = np.repeat(np.arange(n), q_lens)
    positions = np.arange(total, dtype=np.int64) - cu[:-1][seq_of_token] + starts[seq_of_token]
    width = max(len(r.block_table) for r in requests)
    table = np.zeros((n, width), dtype=np.int32)
    for i, r in enumerate(requests):
        table[i, :len(r.block_table)] = r.block_table
    slots = table[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return StepInputs(input_ids, positions, slots, table, cu, starts + q_lens, starts, q_lens)
