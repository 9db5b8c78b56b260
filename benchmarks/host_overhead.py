"""Host-side cost of one decode step (scheduler + step packing + update), no model:
a stand-in runner returns a token per sampled request instantly. Runs on any
machine; the GPU engine pays this per decode step on top of the GPU work.

    python benchmarks/host_overhead.py --requests 256 --steps 200
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from vllm.config import SchedulerConfig
from vllm.core.kv_cache_manager import KVCacheManager
from vllm.core.messages import ModelRunnerOutput, SampledToken
from vllm.core.request import Request
from vllm.core.scheduler import Scheduler
from vllm.sampling_params import SamplingParams
from vllm.worker.step_inputs import pack_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    kv = KVCacheManager(num_blocks=60000, block_size=16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=args.requests, max_num_batched_tokens=1 << 20), kv)
    sp = SamplingParams(max_tokens=10 ** 6, ignore_eos=True, detokenize=False)
    rng = np.random.default_rng(0)
    for i in range(args.requests):
        sched.add_request(Request(str(i), rng.integers(0, 150000, args.prompt_len).tolist(), sp, i, [2], 1 << 20))
    t = {"schedule": 0.0, "prepare": 0.0, "update": 0.0}
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        pack_step(out.requests, 16)   # the runner's step packing, without a model
        t2 = time.perf_counter()
        res = ModelRunnerOutput({r.req_id: SampledToken(int(rng.integers(0, 150000))) for r in out.requests if r.sample})
        t3 = time.perf_counter()
        sched.update(out, res)
        t4 = time.perf_counter()
        if step == 0:
            continue  # the prefill step
        t["schedule"] += t1 - t0
        t["prepare"] += t2 - t1
        t["update"] += t4 - t3
    n = args.steps
    print(f"host work per decode step, {args.requests} requests: "
          + ", ".join(f"{k} {v / n * 1e3:.2f} ms" for k, v in t.items()) + f", total {sum(t.values()) / n * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
