"""Where the GPU time of a rollout goes, kernel by kernel (torch.profiler / CUPTI).

Runs the throughput workload's shapes twice per numerics mode under the profiler:
`prefill` (max_tokens=1: prefill steps only) and `decode` (a short generation after
warm-up, minus nothing: its prefill share is reported by the first table), and prints the
kernels that take most GPU time, grouped into families (GEMM, attention, norm, ...).
Kernels replayed inside CUDA graphs are traced too.

    python benchmarks/profile_kernels.py --config benchmarks/configs/qwen3-8b.json --numerics fast,invariant
"""
from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import os
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(__file__))
from json_out import write_json_out  # noqa: E402
from throughput import make_model_dir  # noqa: E402

FAMILIES = [
    ("gemm", r"gemm|gemv|cutlass|sm90_xmma|nvjet|matmul|_kernel_tma|_plain|invariant_mm|mm_"),
    ("attention", r"attn|attention|flash|fmha|paged"),
    ("norm", r"rms|norm"),
    ("rope", r"rope|rotary"),
    ("act", r"silu|act_and_mul|swiglu"),
    ("sample", r"gumbel|softmax|sort|topk|argmax|exponential|noise|philox|logsumexp|cumsum|max"),
    ("copy/index", r"copy|index|scatter|gather|cat|fill|memcpy|memset|elementwise|cache_kv"),
]


def family(name: str) -> str:
    low = name.lower()
    for fam, pat in FAMILIES:
        if re.search(pat, low):
            return fam
    return "other"


def profile(llm, prompts, sp) -> dict[str, tuple[float, int]]:
    from torch.profiler import ProfilerActivity, profile as tprofile

    llm.reset_prefix_cache()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        torch.cuda.synchronize()
    out: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t = out[ev.name]
            t[0] += ev.time_range.elapsed_us()  # the kernel's own GPU interval
            t[1] += 1
    return {k: (v[0] / 1e6, v[1]) for k, v in out.items()}


def report(title: str, kernels: dict[str, tuple[float, int]], top: int) -> dict:
    total = sum(t for t, _ in kernels.values())
    if total <= 0:
        print(f"\n== {title}: no kernel time recorded")
        return {"total_s": 0.0, "families": {}}
    fams: dict[str, float] = defaultdict(float)
    for name, (t, _) in kernels.items():
        fams[family(name)] += t
    print(f"\n== {title}: {total:.3f} s of kernel time")
    print("  families: " + ", ".join(f"{f}={t:.3f}s ({t / total:.0%})" for f, t in sorted(fams.items(), key=lambda kv: -kv[1])))
    for name, (t, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {t:8.3f} s {n:7d}x {t / n * 1e6:9.1f} us  [{family(name)}] {name[:110]}")
    return {"total_s": total, "families": dict(fams)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="benchmarks/configs/qwen3-8b.json")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--numerics", default="fast,invariant")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    with open(args.config) as f:
        cfg = json.load(f)
    model_dir = make_model_dir(args.config)
    g = torch.Generator().manual_seed(0)
    mk = lambda: torch.randint(100, cfg["vocab_size"] - 100, (args.num_prompts, args.input_len), generator=g).tolist()
    prompts, warm = mk(), mk()
    results = {}
    for mode in args.numerics.split(","):
        llm = LLM(model=model_dir, dtype="bfloat16", load_format="dummy", numerics=mode, seed=0,
                  max_num_seqs=256, max_num_batched_tokens=16384, gpu_memory_utilization=0.85,
                  max_model_len=args.input_len + args.output_len + 16)
        sp_pre = SamplingParams(max_tokens=1, ignore_eos=True, temperature=1.0, detokenize=False)
        sp_gen = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=1.0, detokenize=False)
        llm.generate([{"prompt_token_ids": p} for p in warm], sp_gen, use_tqdm=False)  # compile everything first
        pre = profile(llm, prompts, sp_pre)
        gen = profile(llm, prompts, sp_gen)
        # decode share: the generation's kernels minus the prefill-only run's, name by name
        dec = {k: (t - pre.get(k, (0.0, 0))[0], n - pre.get(k, (0.0, 0))[1]) for k, (t, n) in gen.items()}
        dec = {k: v for k, v in dec.items() if v[0] > 0 and v[1] > 0}
        results[mode] = {
            "prefill": report(f"{mode}: prefill only ({args.num_prompts} x {args.input_len})", pre, args.top),
            "decode": report(f"{mode}: decode share ({args.output_len - 1} steps, generation minus prefill run)", dec, args.top),
        }
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    write_json_out(args.json_out, results)


if __name__ == "__main__":
    main()
