"""One training step (forward + backward + AdamW) and the logprob-only no-grad forward:
transformers' own model vs our Policy (invariant, fast, invariant with activation
checkpointing), same weights, same tokens, measured in one run.

    python benchmarks/train_step.py --config benchmarks/configs/qwen3-4b.json \
        --layouts 4x1024,2x8192,mix --reps 5 --json-out train_step.json
    python benchmarks/train_step.py --config benchmarks/configs/qwen3-30b-a3b.json --num-hidden-layers 12 \
        --layouts 4x1024 --rows transformers,invariant,fast

Layouts: NxLEN (N sequences of LEN tokens, --prompt-len of them prompt) and "mix"
(lengths 100-4000 until --mix-tokens tokens, a quarter prompt each). transformers runs
"mix" padded (SDPA with a padding mask), or packed on its flash-attention-2 varlen path
when `flash_attn` is installed. Our Policy packs every layout without padding, one
micro-batch. Each row: median step time over --reps steps after --warmup steps (each
step synchronised), tokens/s of real (unpadded) tokens, and the peak memory allocated
during the timed steps (weights, gradients and optimizer state included, for both). A
configuration that runs out of memory is reported as OOM. The columns run one model at a
time (ours first, then transformers'), so neither's peak includes the other's weights.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

import train_common as tc

TRAIN_ROWS = ("transformers", "invariant", "fast", "invariant+ckpt")
FORWARD_ROWS = ("transformers no-grad", "invariant no-grad")


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(fn, device: str, warmup: int, reps: int) -> dict:
    """Median seconds per call and peak GiB allocated during the timed calls; 'oom' on OOM."""
    try:
        for _ in range(warmup):
            fn()
        _sync(device)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device.startswith("cuda") else float("nan")
        return {"seconds": statistics.median(times), "peak_gib": peak}
    except torch.cuda.OutOfMemoryError:
        return {"oom": True}
    finally:
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def run_ours(path, layouts, args) -> dict:
    from vllm.config import NumericsSpec
    from vllm.training import Policy
    model, mc = tc.build_ours(path, args.device)
    weights = tc.hf_weights_on_host(model)
    out = {}
    for layout in layouts:
        for name in ("invariant", "fast", "invariant+ckpt"):
            if name not in args.rows:
                continue
            tc.restore_weights(model, weights)
            policy = Policy(model, mc, NumericsSpec(torch.bfloat16, name.split("+")[0]), torch.device(args.device),
                            activation_checkpointing=name.endswith("+ckpt"))
            opt = tc.new_optimizer(model.parameters())
            out[(layout.name, name)] = measure(lambda: tc.policy_train_step(policy, layout, opt), args.device,
                                               args.warmup, args.reps)
            model.zero_grad(set_to_none=True)
            del opt, policy
            _report(layout, name, out[(layout.name, name)])
        if "invariant no-grad" in args.rows:
            policy = Policy(model, mc, NumericsSpec(torch.bfloat16), torch.device(args.device))

            def fwd():
                with torch.no_grad():
                    policy.token_logprobs(layout.seqs, layout.prompt_lens)
            out[(layout.name, "invariant no-grad")] = measure(fwd, args.device, args.warmup, args.reps)
            _report(layout, "invariant no-grad", out[(layout.name, "invariant no-grad")])
            del policy
    del model
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out, weights


def run_hf(path, weights, layouts, args) -> dict:
    varlen = args.hf_varlen == "on" or (args.hf_varlen == "auto" and tc.hf_varlen_available())
    model = tc.build_hf(path, weights, args.device, varlen)
    out = {}
    for layout in layouts:
        batch = tc.HFBatch(layout, args.device, varlen)
        if "transformers" in args.rows:
            opt = tc.new_optimizer(model.parameters())
            out[(layout.name, "transformers")] = measure(lambda: tc.hf_train_step(model, batch, opt), args.device,
                                                         args.warmup, args.reps)
            model.zero_grad(set_to_none=True)
            del opt
            _report(layout, "transformers", out[(layout.name, "transformers")])
        if "transformers no-grad" in args.rows:
            def fwd():
                with torch.no_grad():
                    tc.hf_logprobs(model, batch)
            out[(layout.name, "transformers no-grad")] = measure(fwd, args.device, args.warmup, args.reps)
            _report(layout, "transformers no-grad", out[(layout.name, "transformers no-grad")])
    del model
    gc.collect()
    return out, ("varlen (flash_attention_2, packed)" if varlen else "padded (sdpa + mask where lengths differ)")


def _report(layout, name, r) -> None:
    if r.get("oom"):
        print(f"[{layout.name}] {name}: out of memory", flush=True)
    else:
        print(f"[{layout.name}] {name}: {r['seconds'] * 1e3:.1f} ms, {layout.tokens / r['seconds']:,.0f} tok/s, "
              f"peak {r['peak_gib']:.1f} GiB", flush=True)


def _cell(r, layout, base, key):
    if r is None:
        return "-"
    if r.get("oom"):
        return "OOM"
    if key == "speed":
        return f"{base['seconds'] / r['seconds']:.3f}x" if base and not base.get("oom") else "-"
    return f"{r['peak_gib'] / base['peak_gib']:.3f}" if base and not base.get("oom") else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="benchmarks/configs/qwen3-4b.json", help="HF config.json of the dims")
    ap.add_argument("--layouts", default="4x1024,2x8192,mix", help="comma-separated: NxLEN or mix")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per sequence of NxLEN layouts")
    ap.add_argument("--num-hidden-layers", type=int, default=None,
                    help="override the config's depth, e.g. Qwen3-30B-A3B's dims with 12 layers to fit one GPU")
    ap.add_argument("--mix-tokens", type=int, default=8192, help="total tokens of the mix layout")
    ap.add_argument("--rows", default=",".join(TRAIN_ROWS + FORWARD_ROWS), help="which rows to run")
    ap.add_argument("--hf-varlen", choices=("auto", "on", "off"), default="auto",
                    help="transformers on its flash-attention-2 packed path (auto: when flash_attn is installed)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per row first")
    ap.add_argument("--reps", type=int, default=5, help="timed steps per row (the median is reported)")
    ap.add_argument("--device", default="cuda", help="torch device")
    ap.add_argument("--json-out", default=None, help="also write the results here as JSON")
    args = ap.parse_args()
    args.rows = [r.strip() for r in args.rows.split(",")]
    path = tc.model_dir(args.config, args.num_hidden_layers)
    from vllm.model_loader.build import resolve_model
    mc, _ = resolve_model(path, dtype="bfloat16", device=args.device)
    layouts = [tc.make_layout(s.strip(), mc.vocab_size, args.prompt_len, args.mix_tokens) for s in args.layouts.split(",")]
    for lay in layouts:
        print(f"layout {lay.name}: {len(lay.seqs)} sequences, lengths {[len(s) for s in lay.seqs]}, "
              f"{lay.tokens} tokens, {lay.response_tokens} scored", flush=True)
    ours, weights = run_ours(path, layouts, args)
    hf, hf_mode = run_hf(path, weights, layouts, args) if any(r.startswith("transformers") for r in args.rows) else ({}, "-")
    results = {**ours, **hf}

    print(f"\n== train step + logprob-only forward: {args.config}, bf16, AdamW (foreach); transformers {hf_mode}")
    print(f"{'layout':<10}{'row':<22}{'ms':>9}{'tok/s':>11}{'peak GiB':>10}{'speed vs HF':>13}{'mem vs HF':>11}")
    for lay in layouts:
        for name in TRAIN_ROWS + FORWARD_ROWS:
            r = results.get((lay.name, name))
            if r is None:
                continue
            base = results.get((lay.name, "transformers" if name in TRAIN_ROWS else "transformers no-grad"))
            if r.get("oom"):
                print(f"{lay.name:<10}{name:<22}{'OOM':>9}")
                continue
            print(f"{lay.name:<10}{name:<22}{r['seconds'] * 1e3:>9.1f}{lay.tokens / r['seconds']:>11,.0f}"
                  f"{r['peak_gib']:>10.1f}{_cell(r, lay, base, 'speed'):>13}{_cell(r, lay, base, 'mem'):>11}")
    ckpt = [(lay, results.get((lay.name, "invariant")), results.get((lay.name, "invariant+ckpt"))) for lay in layouts]
    for lay, a, b in ckpt:
        if a and b and not a.get("oom") and not b.get("oom"):
            print(f"activation checkpointing, {lay.name}: {b['seconds'] / a['seconds']:.3f}x the time, "
                  f"{b['peak_gib'] - a['peak_gib']:+.1f} GiB")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"config": args.config, "transformers_mode": hf_mode,
                       "layouts": {lay.name: {"lengths": [len(s) for s in lay.seqs], "prompt_lens": lay.prompt_lens}
                                   for lay in layouts},
                       "results": [{"layout": k[0], "row": k[1], **v} for k, v in results.items()]}, f, indent=1)


if __name__ == "__main__":
    main()
