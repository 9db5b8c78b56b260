"""Offline sm_90 resource use of the Gated DeltaNet kernels at Qwen3-Next's dims, no GPU.

    TRITON_INTERPRET=1 python benchmarks/kernels/sm90_stats.py [--backward] [--float32]
        [--only SUBSTRING] [--set module.NAME=JSON ...] [--asm DIR]

Each kernel the layer's forward launches (and, with --backward, the training backward's,
with T from the forward as training runs it) is compiled for sm_90 as the GPU's first launch
would compile it (vllm/testing/sm90_compile.py), and its warps, registers per thread, stack
bytes (spills) and shared memory per block are printed. bfloat16 inputs (bf16 dots in the
backward) unless --float32 (3xTF32). `--set` changes a tunable before the launches are
recorded, e.g. `--set 'gdn_backward.WARPS={"bf16": {"final_out": 8}}'` (JSON values, merged into
a dict tunable key by key; modules under vllm.kernels): a candidate's registers and spills
read before any GPU time is spent on it. `--asm DIR` writes each kernel's compiled stages there
(NAME.ttgir, NAME.ptx, ...: e.g. whether a loop's loads became async copies).
Nothing runs: the launches are recorded without executing.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

T, HK, HV, K, V, C = 256, 16, 32, 128, 128, 64


def _merged(old, new):
    """`new` over `old`: dicts key by key (a --set of one entry keeps the others), else `new`;
    lists of a tuple tunable become tuples."""
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{k: _merged(old.get(k), v) for k, v in new.items()}}
    return tuple(new) if isinstance(old, tuple) and isinstance(new, list) else new


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backward", action="store_true", help="also the training backward's kernels")
    ap.add_argument("--float32", action="store_true", help="float32 inputs (3xTF32 dots in the backward)")
    ap.add_argument("--only", default="", help="kernels whose name holds this substring")
    ap.add_argument("--set", action="append", default=[], metavar="module.NAME=JSON",
                    help="a tunable of vllm.kernels.<module> set before recording")
    ap.add_argument("--asm", default="", metavar="DIR", help="write each kernel's ttir / ttgir / llir / ptx here")
    args = ap.parse_args(argv)

    from vllm.kernels import gdn_chunk, training_tiles
    from vllm.testing import sm90_compile as sm90
    from vllm.testing.chunked_scan import step_metadata

    reason = sm90.unavailable_reason()
    if reason:
        print(f"sm_90 compile unavailable here: {reason}")
        return 1
    for item in args.set:
        target, _, value = item.partition("=")
        module, _, name = target.rpartition(".")
        mod = importlib.import_module(f"vllm.kernels.{module}")
        setattr(mod, name, _merged(getattr(mod, name, None), json.loads(value)))
    dtype = torch.float32 if args.float32 else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(T, HK, K, generator=g), dim=-1).to(dtype) for _ in range(2))
    v, do = (torch.randn(T, HV, V, generator=g).to(dtype) for _ in range(2))
    gg, beta = -0.6 * torch.rand(T, HV, generator=g), torch.rand(T, HV, generator=g)
    md = step_metadata([0], [T])
    plan = md.chunk_plan(C, True)
    t_out = torch.empty((plan.num_chunks, HV, C, C), dtype=dtype)
    with sm90.record_launches(execute=False) as rec:
        gdn_chunk.gdn_chunk_triton(q, k, v, gg, beta, K ** -0.5, md, None, chunk_size=C, aligned=True, t_out=t_out)
        if args.backward:
            from vllm.kernels.gdn_backward import gdn_backward_triton
            # the GPU's dot precision for these inputs (the interpreter's is the emulated one)
            training_tiles.dot_precision = lambda x: "bf16" if x.dtype == torch.bfloat16 else "tf32x3"
            gdn_backward_triton(q, k, v, gg, beta, do, [0, T], K ** -0.5, chunk_size=C, t_saved=t_out,
                                t_chunks=plan.seq_chunks.to(torch.int32))
    launches = [la for la in rec.launches if args.only in str(la.kernel)]
    print(f"{'kernel':<44} {'warps':>5} {'regs':>5} {'stack B':>8} {'shared B':>9}")
    for i, r in enumerate(sm90.compile_launches(launches, usage=True, asm=bool(args.asm))):
        name = str(r.launch.kernel)
        warps = dict(r.launch.options).get("num_warps")
        status = "" if r.ok else f"  FAILS: {r.error[:80]}"
        print(f"{name:<44} {warps!s:>5} {r.registers!s:>5} {r.stack!s:>8} {r.shared!s:>9}{status}")
        if args.asm and r.asm:
            os.makedirs(args.asm, exist_ok=True)
            for stage, text in r.asm.items():
                with open(os.path.join(args.asm, f"{i:02d}_{name.rpartition('.')[2]}.{stage}"), "w") as f:
                    f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
