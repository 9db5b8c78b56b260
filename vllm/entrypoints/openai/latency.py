"""Request latencies and sizes for /metrics, observed by AsyncLLM's receiver thread: upstream
vLLM's histogram names and buckets (Grafana dashboards written for upstream read them),
counted with a bisect and two additions per observation, read at scrape time."""
from __future__ import annotations

import bisect
import dataclasses

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)


class Histogram:
    """Counts per bucket (upper bounds `buckets`, then +Inf), the sum and the count."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' (le, cumulative count) pairs, +Inf last."""
        out, total = [], 0
        for le, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            total += n
            out.append((le, total))
        return out


@dataclasses.dataclass
class RequestTimes:
    """One request's clock: when it was accepted, its first token, each sample's last token,
    and when the engine core first scheduled it (the earliest of its samples'; stamped in the
    engine core's process by time.monotonic(), one system-wide clock on Linux)."""
    arrival: float
    first_token: float | None = None
    last_token: dict = dataclasses.field(default_factory=dict)
    scheduled: float | None = None


class LatencyStats:
    """vllm:time_to_first_token_seconds (per request), vllm:inter_token_latency_seconds (per
    generated token: the gap since its sample's previous token, spread over the tokens of one
    step's delta), vllm:e2e_request_latency_seconds (per request, arrival to its last sample's
    finish), and upstream's per-request phases, observed when a request finishes:
    vllm:request_queue_time_seconds (arrival to first scheduled), vllm:request_prefill_time_seconds
    (first scheduled to first token), vllm:request_decode_time_seconds (first token to finish),
    vllm:request_inference_time_seconds (first scheduled to finish) and
    vllm:request_time_per_output_token_seconds (decode time over its longest sample's tokens
    after the first, when it has two or more). A request that finishes without having been
    scheduled counts in none of them; one without a token only in the queue time."""

    def __init__(self):
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.queue = Histogram(E2E_BUCKETS)
        self.prefill = Histogram(E2E_BUCKETS)
        self.decode = Histogram(E2E_BUCKETS)
        self.inference = Histogram(E2E_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)

    def tokens(self, t: RequestTimes, index: int, n: int, now: float, scheduled: float | None = None) -> None:
        """Sample `index` delivered `n` tokens at `now`; `scheduled`: the engine core's first
        scheduling of that sample, sent on its first delta only."""
        if scheduled is not None and (t.scheduled is None or scheduled < t.scheduled):
            t.scheduled = scheduled
        if n <= 0:
            return
        if t.first_token is None:
            t.first_token = now
            self.ttft.observe(now - t.arrival)
        prev = t.last_token.get(index)
        if prev is not None:
            self.itl.observe((now - prev) / n, n)
        t.last_token[index] = now

    def finished(self, t: RequestTimes, now: float, max_generated: int = 0) -> None:
        """The request's last sample finished at `now`; `max_generated`: its longest sample's
        tokens."""
        self.e2e.observe(now - t.arrival)
        scheduled = t.scheduled
        if scheduled is None:   # ended before the engine core scheduled it
            return
        self.queue.observe(scheduled - t.arrival)
        first = t.first_token
        if first is None:   # ended before its first token: no prefill or decode to time
            return
        decode = now - first
        self.prefill.observe(first - scheduled)
        self.decode.observe(decode)
        self.inference.observe(now - scheduled)
        if max_generated >= 2:
            self.tpot.observe(decode / (max_generated - 1))


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (upstream's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class RequestSizes:
    """vllm:request_prompt_tokens and vllm:request_generation_tokens (per sample, as upstream
    counts each of a request's n samples), vllm:request_max_num_generation_tokens (per request:
    its longest sample), vllm:request_params_n and vllm:request_params_max_tokens (per request,
    max_tokens when it was given), observed when a request finishes."""

    def __init__(self, max_model_len: int):
        tokens = buckets_1_2_5(max(1, max_model_len))
        self.prompt = Histogram(tokens)
        self.generation = Histogram(tokens)
        self.max_generation = Histogram(tokens)
        self.n = Histogram((1, 2, 5, 10, 20))
        self.max_tokens = Histogram(tokens)

    def finished(self, prompt_tokens: int, generated: list[int], n: int, max_tokens: int | None) -> None:
        self.prompt.observe(prompt_tokens, len(generated))
        for g in generated:
            self.generation.observe(g)
        self.max_generation.observe(max(generated, default=0))
        self.n.observe(n)
        if max_tokens is not None:
            self.max_tokens.observe(max_tokens)
