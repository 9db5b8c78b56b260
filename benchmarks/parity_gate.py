"""The real-dims parity gate: every feature axis, at real model dims, invariant beside fast.

    python benchmarks/parity_gate.py                       # on the H200: Qwen3-1.7B + Qwen3-MoE dims
    python benchmarks/parity_gate.py --modes invariant --axes bf16,kv-fp8

For each axis and numerics mode: ~100 requests with prompts of 1-1000 tokens (a third share
a prefix with an earlier one), 64 tokens sampled at temperature 1 with per-request seeds,
`logprobs=0`. It prints one row per axis: the layouts that differ / compared and the
rollout-vs-trainer sequences that differ / compared, by bit pattern, invariant and fast side
by side (vllm/testing/parity_gate.py says what each axis and count is). Every invariant cell
must be 0: the last line says PASS or FAIL, and the exit code is 1 on FAIL. The fast column
shows the mismatch the invariant mode removes.

Models have random weights (`load_format="dummy"`): dense = Qwen3-1.7B dims (28 layers,
head_dim 128, tied embeddings, vocab 151936); MoE = the Qwen3-30B-A3B expert shapes (128
experts, top-8, hidden 2048, moe_intermediate 768) with --moe-layers layers; gdn = Qwen3-Next's
layer shapes (Gated DeltaNet heads 16/32 x 128, gated attention 16 x 256, partial rope) with a
dense MLP, 6 GDN + 2 attention layers; nemotron = Nemotron-H-8B's layer shapes (Mamba-2 128
heads of 64, d_state 128, 8 groups, chunk 128; attention 32 x 128; relu^2 MLP), 4 Mamba-2 + 1
attention + 4 MLP layers. `--tiny` swaps in small models so the same code runs on
the CPU.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict

import torch

from vllm.testing.parity_gate import (AXES, GDN_AXES, NEMOTRON_AXES, Gate, GateOptions, format_table, gate_passes,
                                     gdn_config, make_model_dir, model_configs, nemotron_config)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="invariant,fast")
    ap.add_argument("--axes", default=",".join(AXES))
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--max-prompt-len", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--dense-layers", type=int, default=None, help="override the dense model's 28 layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    ap.add_argument("--trainer-micro-batch", type=int, default=8192, help="tokens per trainer micro-batch")
    ap.add_argument("--tiny", action="store_true", help="small models (CPU)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    axes = args.axes.split(",")
    unknown = sorted(set(axes) - set(AXES))
    if unknown:
        ap.error(f"unknown axes {unknown}; choose from {','.join(AXES)}")
    dense, moe = model_configs(args.tiny, args.dense_layers, args.moe_layers if not args.tiny else None)
    opts = GateOptions(num_requests=args.num_requests, max_prompt_len=args.max_prompt_len, max_tokens=args.max_tokens,
                       seed=args.seed, device=args.device, gpu_memory_utilization=args.gpu_memory_utilization,
                       trainer_micro_batch=args.trainer_micro_batch)
    dirs = [make_model_dir(dense), make_model_dir(moe)]
    gdn_dir = make_model_dir(gdn_config(args.tiny)) if set(axes) & set(GDN_AXES) else None
    nemotron_dir = make_model_dir(nemotron_config(args.tiny)) if set(axes) & set(NEMOTRON_AXES) else None
    dirs += [d for d in (gdn_dir, nemotron_dir) if d is not None]
    t0 = time.perf_counter()
    try:
        gate = Gate(opts, dirs[0], dirs[1], vocab=dense["vocab_size"], gdn_dir=gdn_dir, nemotron_dir=nemotron_dir)
        rows = []
        for mode in modes:
            rows += gate.run(mode, axes)
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    print(f"\n== parity gate ({args.num_requests} requests, prompts 1-{args.max_prompt_len} tokens, "
          f"{args.max_tokens} sampled at T=1; differing / compared; {time.perf_counter() - t0:.0f} s)")
    print(format_table(rows, modes))
    ok = gate_passes(rows)
    print(f"parity gate: {'PASS' if ok else 'FAIL'} (every invariant cell 0)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
