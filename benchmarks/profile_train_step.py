"""Where a training step's GPU time goes: torch.profiler's kernel table for
transformers' own Qwen3 step (SDPA, full-vocab log-softmax) and for our Policy
step, on the same dims and tokens, in one run.

    python benchmarks/profile_train_step.py --config benchmarks/configs/qwen3-4b.json --batch 4 --seq-len 1024
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile


def hf_step_fn(cfg_path: str, ids: torch.Tensor, plen: int):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(os.path.dirname(cfg_path))
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)

    def step():
        logits = model(input_ids=ids).logits[:, plen - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, plen:, None])
        (-lp.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, (model, opt)


def policy_step_fn(cfg_dir: str, ids: torch.Tensor, plen: int, numerics: str):
    from vllm.model_loader.build import build_model, resolve_model
    from vllm.training import Policy
    mc, dtype = resolve_model(cfg_dir, dtype="bfloat16", device="cuda")
    model, _ = build_model(mc, dtype, "cuda", numerics=numerics, load_format="dummy")
    policy = Policy(model, mc, dtype, torch.device("cuda"), numerics)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6, foreach=True)
    seqs = ids.tolist()

    def step():
        lps = policy.token_logprobs(seqs, [plen] * len(seqs))
        (-sum(lp.sum() for lp in lps)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, (policy, opt)


def profile_one(name: str, step, steps: int, rows: int) -> dict:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) or 1.0
    events.sort(key=lambda e: -e.self_device_time_total)
    print(f"\n== {name}: {ms:.1f} ms/step, peak {peak:.1f} GiB; GPU kernel time {total / 1e3:.1f} ms")
    table = []
    for e in events[:rows]:
        share = e.self_device_time_total / total
        table.append({"kernel": e.key[:100], "ms": e.self_device_time_total / 1e3, "share": share, "calls": e.count})
        print(f"  {share * 100:5.1f}%  {e.self_device_time_total / 1e3:8.2f} ms  x{e.count:<5} {e.key[:110]}")
    return {"ms": ms, "peak_gib": peak, "kernel_ms": total / 1e3, "top": table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="benchmarks/configs/qwen3-4b.json", help="HF config.json of the dims")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--prompt-len", type=int, default=256, help="tokens per sequence that are not scored")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after two warm-ups")
    ap.add_argument("--rows", type=int, default=25, help="kernels listed per configuration")
    ap.add_argument("--which", default="transformers,invariant,fast", help="configurations to profile")
    ap.add_argument("--json-out", default=None, help="write the tables here")
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="prof_train_")
    shutil.copy(args.config, os.path.join(d, "config.json"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 150000, (args.batch, args.seq_len), generator=g).cuda()
    out = {}
    for which in args.which.split(","):
        if which == "transformers":
            step, keep = hf_step_fn(os.path.join(d, "config.json"), ids, args.prompt_len)
        else:
            step, keep = policy_step_fn(d, ids, args.prompt_len, which)
        out[which] = profile_one(which, step, args.steps, args.rows)
        del step, keep
        torch.cuda.empty_cache()
    print("\n== train step summary")
    base = out.get("transformers", {}).get("ms")
    for k, r in out.items():
        ratio = f"{base / r['ms']:.3f}x transformers" if base else ""
        print(f"{k:<14}{r['ms']:>9.1f} ms {args.batch * args.seq_len / r['ms'] * 1e3:>10,.0f} tok/s {r['peak_gib']:>6.1f} GiB  {ratio}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
