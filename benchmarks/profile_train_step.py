"""Where a training step's time goes: torch.profiler's kernel table for transformers' own
step (SDPA, full-vocab log-softmax) and for our Policy step, same weights, same tokens
(benchmarks/train_common.py), plus the host side: wall time against GPU kernel time (the
difference is time the GPU waited for the host), kernel launches per step, and the host
ops with the most self CPU time.

    python benchmarks/profile_train_step.py --config benchmarks/configs/qwen3-4b.json --layout 4x1024
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import train_common as tc
from json_out import write_json_out


def profile_one(name: str, step, steps: int, rows: int, host_rows: int, tokens: int) -> dict:
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
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    events = [e for e in averages if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) or 1.0
    launches = sum(e.count for e in events)
    events.sort(key=lambda e: -e.self_device_time_total)
    print(f"\n== {name}: {ms:.1f} ms/step (wall), GPU kernel time {total / 1e3:.1f} ms "
          f"(GPU waited {max(0.0, ms - total / 1e3):.1f} ms), {launches} kernels, peak {peak:.1f} GiB, "
          f"{tokens / ms * 1e3:,.0f} tok/s")
    table = []
    for e in events[:rows]:
        share = e.self_device_time_total / total
        table.append({"kernel": e.key[:100], "ms": e.self_device_time_total / 1e3, "share": share, "calls": e.count})
        print(f"  {share * 100:5.1f}%  {e.self_device_time_total / 1e3:8.2f} ms  x{e.count:<5} {e.key[:110]}")
    host = [e for e in averages if e.device_type.name == "CPU" and e.self_cpu_time_total > 0]
    host.sort(key=lambda e: -e.self_cpu_time_total)
    host_total = sum(e.self_cpu_time_total for e in host)
    print(f"  -- host: {host_total / 1e3:.1f} ms of op self time (profiler overhead included); top ops:")
    host_table = []
    for e in host[:host_rows]:
        host_table.append({"op": e.key[:100], "ms": e.self_cpu_time_total / 1e3, "calls": e.count})
        print(f"     {e.self_cpu_time_total / 1e3:8.2f} ms  x{e.count:<6} {e.key[:100]}")
    return {"ms": ms, "peak_gib": peak, "kernel_ms": total / 1e3, "kernels": launches, "top": table, "host": host_table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="benchmarks/configs/qwen3-4b.json", help="HF config.json of the dims")
    ap.add_argument("--layout", default="4x1024", help="NxLEN or mix (see train_common.make_layout)")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per sequence of NxLEN layouts")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after two warm-ups")
    ap.add_argument("--rows", type=int, default=25, help="kernels listed per configuration")
    ap.add_argument("--host-rows", type=int, default=12, help="host ops listed per configuration")
    ap.add_argument("--which", default="transformers,invariant,fast", help="configurations to profile")
    ap.add_argument("--json-out", default=None, help="write the tables here")
    args = ap.parse_args()
    path = tc.model_dir(args.config)
    which = args.which.split(",")
    out = {}
    from vllm.config import NumericsSpec
    from vllm.training import Policy
    model, mc = tc.build_ours(path, "cuda")
    layout = tc.make_layout(args.layout, mc.vocab_size, args.prompt_len)
    weights = tc.hf_weights_on_host(model)
    for numerics in [w for w in which if w != "transformers"]:
        tc.restore_weights(model, weights)
        policy = Policy(model, mc, NumericsSpec(torch.bfloat16, numerics.split("+")[0]), torch.device("cuda"),
                        activation_checkpointing=numerics.endswith("+ckpt"))
        opt = tc.new_optimizer(model.parameters())
        out[numerics] = profile_one(numerics, lambda: tc.policy_train_step(policy, layout, opt), args.steps, args.rows,
                                    args.host_rows, layout.tokens)
        model.zero_grad(set_to_none=True)
        del opt, policy
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    if "transformers" in which:
        varlen = tc.hf_varlen_available()
        hf = tc.build_hf(path, weights, "cuda", varlen)
        batch = tc.HFBatch(layout, "cuda", varlen)
        opt = tc.new_optimizer(hf.parameters())
        out["transformers"] = profile_one("transformers", lambda: tc.hf_train_step(hf, batch, opt), args.steps,
                                          args.rows, args.host_rows, layout.tokens)
        del hf, opt
        torch.cuda.empty_cache()
    print(f"\n== train step summary: {args.config}, layout {args.layout} ({layout.tokens} tokens)")
    base = out.get("transformers", {}).get("ms")
    for k, r in out.items():
        ratio = f"{base / r['ms']:.3f}x transformers" if base else ""
        print(f"{k:<16}{r['ms']:>9.1f} ms {layout.tokens / r['ms'] * 1e3:>10,.0f} tok/s  kernels {r['kernel_ms']:7.1f} ms "
              f"x{r['kernels']:<6} {r['peak_gib']:>6.1f} GiB  {ratio}")
    write_json_out(args.json_out, out)


if __name__ == "__main__":
    main()
