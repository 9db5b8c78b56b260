"""Runs the invariance battery on the GPU in each numerics mode and prints how
many comparisons differ: `invariant` must show 0 everywhere; `fast` shows the
problem (batch-dependent cuBLAS tiles, flash prefill vs decode, ...).

    python benchmarks/parity_battery.py --modes fast,invariant
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from json_out import write_json_out
from vllm import LLM
from vllm.testing.parity_battery import Battery
from vllm.testing.tiny_models import make_tiny_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="fast,invariant")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch-sizes", default="2,17,64,256")
    ap.add_argument("--identical", type=int, default=1000)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    path = make_tiny_checkpoint(tempfile.mkdtemp(prefix="parity_"), "qwen3", hidden_size=args.hidden,
                                num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                                num_key_value_heads=max(1, args.hidden // 512), head_dim=128,
                                intermediate_size=3 * args.hidden, dtype=torch.bfloat16, max_position_embeddings=4096,
                                init_std=0.05)
    table = {}
    for mode in args.modes.split(","):
        def make(**kw):
            opts = dict(device="cuda", dtype="bfloat16", numerics=mode, gpu_memory_utilization=0.3,
                        max_num_batched_tokens=2048, cuda_graph_batch_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256])
            opts.update(kw)
            return LLM(path, **opts)
        bat = Battery(make, vocab=512, max_tokens=12, batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
                      long_len=300)
        t0 = time.perf_counter()
        res = [bat.batch_slots(), bat.prefill_vs_decode(), bat.chunked_prefill(budgets=(64, 100, 517)),
               bat.prefix_cache(), bat.preemption(), bat.identical_requests(n=args.identical), bat.cuda_graph_vs_eager()]
        table[mode] = res
        print(f"[{mode}] battery took {time.perf_counter() - t0:.1f} s", flush=True)
        for r in res:
            print(f"  {r.name}: {r.differing}/{r.comparisons} differ {r.detail}", flush=True)
        del bat
        torch.cuda.empty_cache()
    print("\n== parity battery (comparisons that differ in bits / comparisons)")
    modes = list(table)
    print(f"{'check':<58}" + "".join(m.rjust(14) for m in modes))
    for i, r in enumerate(table[modes[0]]):
        print(f"{r.name[:57]:<58}" + "".join(f"{table[m][i].differing}/{table[m][i].comparisons}".rjust(14) for m in modes))
    write_json_out(args.json_out, {m: [vars(r) for r in rs] for m, rs in table.items()})


if __name__ == "__main__":
    main()
