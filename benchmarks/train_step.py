"""One training step (forward + backward + AdamW) on packed sequences: the
invariant Policy vs a plain PyTorch step of the same model class (fast mode:
cuBLAS linears + torch flash varlen attention), measured in one run.

    python benchmarks/train_step.py --config benchmarks/configs/qwen3-4b.json --tokens 4096 --seq-len 1024

MoE: Qwen3-30B-A3B's dims with fewer layers so bf16 weights, gradients and AdamW state fit
one H200 (12 layers: ~8B parameters), optionally with the load-balancing loss:

    python benchmarks/train_step.py --config benchmarks/configs/qwen3-30b-a3b.json --num-hidden-layers 12 \
        --aux-loss-coef 0.001
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from vllm.forward_context import ForwardContext, set_forward_context
from vllm.model_loader.build import build_model, resolve_model
from vllm.training import Policy
from vllm.training.flash_varlen import FlashVarlenBackend


def _with_aux_loss(loss_fn, coef: float) -> float | None:
    """Run loss_fn() -> loss, add coef * the MoE load-balancing loss when coef > 0, backward;
    returns the auxiliary loss's value (None when off)."""
    if coef <= 0:
        loss_fn().backward()
        return None
    from vllm.layers.moe import collect_router_stats
    with collect_router_stats() as stats:
        loss = loss_fn()
    aux = stats.load_balancing_loss()
    (loss + coef * aux).backward()
    return aux.item()


def plain_step(model, seqs, plens, opt, aux_coef: float = 0.0):
    dev = next(model.parameters()).device
    ids = torch.tensor([t for s in seqs for t in s], device=dev)
    pos = torch.cat([torch.arange(len(s)) for s in seqs]).to(dev)
    rows, tg, off = [], [], 0
    for s, pl in zip(seqs, plens):
        rows.append(torch.arange(off + pl - 1, off + len(s) - 1))
        tg.extend(s[pl:])
        off += len(s)

    def loss():
        with set_forward_context(ForwardContext(FlashVarlenBackend([len(s) for s in seqs], dev), "fast")):
            h = model(ids, pos)
            logits = model.compute_logits(h.index_select(0, torch.cat(rows).to(dev)))
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(tg, device=dev)[:, None])
        return -lp.sum()
    aux = _with_aux_loss(loss, aux_coef)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return aux


def ours_step(policy, seqs, plens, opt, aux_coef: float = 0.0):
    aux = _with_aux_loss(lambda: -sum(lp.sum() for lp in policy.token_logprobs(seqs, plens)), aux_coef)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return aux


def timed(fn, reps):
    fn()  # warm-up (compilation, allocator)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps, torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="benchmarks/configs/qwen3-4b.json")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-hidden-layers", type=int, default=None,
                    help="override the config's layer count (so a large model's training state fits one GPU)")
    ap.add_argument("--aux-loss-coef", type=float, default=0.0,
                    help="MoE: add this times the load-balancing loss (0: off) and report its value")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="train_bench_")
    with open(args.config) as f:
        cfg = json.load(f)
    if args.num_hidden_layers:
        cfg["num_hidden_layers"] = args.num_hidden_layers
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    mc, _ = resolve_model(d, dtype="bfloat16", device="cuda")
    g = torch.Generator().manual_seed(0)
    n = args.tokens // args.seq_len
    seqs = torch.randint(100, mc.vocab_size - 100, (n, args.seq_len), generator=g).tolist()
    plens = [args.prompt_len] * n
    results = {}
    for name in ("plain", "invariant"):
        model, _ = build_model(mc, torch.bfloat16, "cuda", numerics="invariant" if name == "invariant" else "fast",
                               load_format="dummy")
        for p in model.parameters():
            p.requires_grad_(True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
        aux_values = []
        if name == "plain":
            fn = lambda: aux_values.append(plain_step(model, seqs, plens, opt, args.aux_loss_coef))  # noqa: E731
        else:
            policy = Policy(model, mc, torch.bfloat16, torch.device("cuda"), "invariant")
            fn = lambda: aux_values.append(ours_step(policy, seqs, plens, opt, args.aux_loss_coef))  # noqa: E731
        sec, mem = timed(fn, args.reps)
        results[name] = {"seconds": sec, "tok_s": args.tokens / sec, "peak_gib": mem}
        if args.aux_loss_coef > 0:
            results[name]["aux_loss"] = aux_values
        aux_note = f", load-balancing loss {aux_values[-1]:.4f}" if args.aux_loss_coef > 0 else ""
        print(f"[{name}] {sec * 1e3:.0f} ms/step, {args.tokens / sec:,.0f} tok/s, peak {mem:.1f} GiB{aux_note}", flush=True)
        del model, opt, fn
        torch.cuda.empty_cache()
    print(f"\n== train step: {os.path.basename(args.config)}, {n} x {args.seq_len} packed tokens, bf16, AdamW")
    print(f"{'step':<12}{'ms':>8}{'tok/s':>10}{'peak GiB':>10}")
    for k, r in results.items():
        print(f"{k:<12}{r['seconds'] * 1e3:>8.0f}{r['tok_s']:>10,.0f}{r['peak_gib']:>10.1f}")
    print(f"invariant / plain = {results['invariant']['tok_s'] / results['plain']['tok_s']:.3f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
