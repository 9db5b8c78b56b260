"""The server's periodic stats line, as upstream's API server logs it every 10 s (off with
`vllm serve --disable-log-stats`): throughputs over the interval, the engine's queues, KV-cache
use and the prefix cache's hit rate. It reads the counters /metrics exports; nothing is counted
for it on the hot path."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

logger = logging.getLogger("vllm.stats")


class StatsLogger:
    """One line per interval while the engine has work, one more as it goes idle, then silence
    until work arrives (an idle server's log is not filled with zeros)."""

    def __init__(self, llm, interval: float = 10.0, clock: Callable[[], float] = time.monotonic):
        if not interval > 0:
            raise ValueError(f"the stats interval must be positive, got {interval!r}")
        self.llm = llm
        self.interval = float(interval)
        self._clock = clock
        self._last = self._snapshot()
        self._was_idle = True

    def _snapshot(self) -> tuple[float, int, int, int, int]:
        st = self.llm.stats
        return (self._clock(), self.llm.num_prompt_tokens, self.llm.num_generation_tokens,
                st.prefix_cache_queries, st.prefix_cache_hits)

    def line(self) -> str | None:
        """The line for the interval since the last call, or None when there is nothing to say."""
        now = self._snapshot()
        t0, p0, g0, q0, h0 = self._last
        t1, p1, g1, q1, h1 = now
        self._last = now
        st = self.llm.stats
        idle = p1 == p0 and g1 == g0 and st.num_running == 0 and st.num_waiting == 0
        if idle and self._was_idle:
            return None
        self._was_idle = idle
        dt = max(t1 - t0, 1e-9)
        # the interval's lookups; none in it: the rate since the start
        queries, hits = (q1 - q0, h1 - h0) if q1 > q0 else (q1, h1)
        hit_rate = 100.0 * hits / queries if queries else 0.0
        return (f"Engine 000: Avg prompt throughput: {(p1 - p0) / dt:.1f} tokens/s, "
                f"Avg generation throughput: {(g1 - g0) / dt:.1f} tokens/s, "
                f"Running: {st.num_running} reqs, Waiting: {st.num_waiting} reqs, "
                f"GPU KV cache usage: {100.0 * st.kv_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%")

    async def run(self) -> None:
        """Log every interval until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            text = self.line()
            if text is not None:
                logger.info(text)
