"""Offline rollout throughput on a random-weight model of real dimensions.

Prints, measured in one run: our output tokens/s per numerics mode, transformers'
padded batched `generate` on the same architecture and dims, and the floor that
the H200's memory bandwidth (decode) and matrix rate (prefill) allow.

    python benchmarks/throughput.py --config benchmarks/configs/qwen3-8b.json \
        --num-prompts 256 --input-len 512 --output-len 256 --hf

By default it compares the product (numerics="invariant") with the plain-speed
baseline (numerics="fast"), both with async scheduling as the engine runs on CUDA.

FP8: `--kv-cache-dtype auto,fp8` and `--quantization none,fp8` run every numerics mode
with each combination (labels `mode kv=fp8 q=fp8`) and print each one's ratio to the
mode's model-dtype run (`auto`/`none`), side by side in the same run. `fp8-nomaster` is
fp8 with keep_master_weights=False (the fp8 copy only: more KV tokens, the same tokens
out, which the run checks).

MoE configs (benchmarks/configs/qwen3-30b-a3b.json) work the same way; their floor counts
the top-k experts per token for prefill and every expert a decode step touches.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import tempfile
import time

import torch

# Ceilings measured on the H200 (copy bandwidth and bf16 matrix rate); override on other machines.
COPY_BW = float(os.environ.get("BENCH_COPY_BW", 4.24e12))        # bytes/s, read + write
MATMUL_RATE = float(os.environ.get("BENCH_MATMUL_RATE", 755e12))  # bf16 FLOP/s


def make_model_dir(config_path: str) -> str:
    from vllm.testing.tiny_models import build_tokenizer

    d = tempfile.mkdtemp(prefix="bench_model_")
    shutil.copy(config_path, os.path.join(d, "config.json"))
    build_tokenizer(d)
    return d


def body_params(cfg: dict, n: int) -> tuple[float, float]:
    """(weights each token multiplies, weights one decode step of n sequences reads).
    Dense: both are every layer's weights. MoE (Qwen3-MoE fields): a token uses its top-k
    experts; a step reads every expert some sequence chose (expected E * (1 - (1 - k/E)^n))."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hq, hk, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg.get("head_dim", h // cfg["num_attention_heads"])
    full, gdn = layer_kinds(cfg)
    gated = 2 if gdn else 1  # Qwen3-Next's attention q_proj also makes the output gate
    attn = (full * (h * (gated * hq + 2 * hk) * d + hq * d * h) + (gdn * gdn_weights(cfg) if gdn else 0)) / layers
    if not cfg.get("num_experts"):
        return layers * (attn + 3 * h * inter), layers * (attn + 3 * h * inter)
    E, k, im = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    step, dense_only = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or [])
    sparse = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    dense = layers * attn + (layers - sparse) * 3 * h * inter + sparse * h * E  # + the routers
    touched = E * (1 - (1 - k / E) ** n)
    return dense + sparse * k * 3 * h * im, dense + sparse * touched * 3 * h * im


def layer_kinds(cfg: dict) -> tuple[int, int]:
    """(full-attention layers, Gated DeltaNet layers): a hybrid's plan, else all attention."""
    layers = cfg["num_hidden_layers"]
    if "linear_num_key_heads" not in cfg:
        return layers, 0
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0
                                       else "linear_attention" for i in range(layers)]
    full = sum(t == "full_attention" for t in types)
    return full, layers - full


def gdn_weights(cfg: dict) -> int:
    h, hk, hv = cfg["hidden_size"], cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    return h * (2 * hk * dk + 2 * hv * dv + 2 * hv) + hv * dv * h


def floor_seconds(cfg: dict, n: int, lin: int, lout: int, elem: int = 2) -> tuple[float, float]:
    h, layers, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hq, hk, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg.get("head_dim", h // cfg["num_attention_heads"])
    full, gdn = layer_kinds(cfg)
    body, step_body = body_params(cfg, n)
    lm = v * h
    # prefill: 2 FLOP per weight per token + causal attention (QK^T and PV: 2 * 2 * L^2/2 * hq * d per layer)
    prefill_flops = n * (2 * body * lin + 2 * lm + full * 2 * lin * lin * hq * d)
    prefill = prefill_flops / MATMUL_RATE
    # decode: every step reads all weights once plus every sequence's KV so far, and reads
    # and writes every sequence's float32 GDN state
    weight_bytes = (step_body + lm + (0 if cfg.get("tie_word_embeddings") else 0)) * elem
    kv_per_token = 2 * full * hk * d * elem
    state_bytes = 0 if not gdn else 2 * gdn * cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * \
        cfg["linear_value_head_dim"] * 4
    decode = 0.0
    for step in range(1, lout):
        decode += (weight_bytes + n * (lin + step) * kv_per_token + n * state_bytes) / COPY_BW
    return prefill, decode


def run_ours(model_dir: str, prompts, warm_prompts, args, mode: str, kv_cache_dtype: str = "auto",
             quantization: str | None = None) -> dict:
    from vllm import LLM, SamplingParams

    numerics, *variants = mode.split("+")
    unknown = set(variants) - {"async", "sync", "unfused", "nocublaslt"}
    if unknown:
        raise ValueError(f"unknown mode variant(s) {sorted(unknown)} in {mode!r}")
    # "+unfused": the unfused Gumbel-max sampler; "+nocublaslt": invariant GEMMs all in Triton
    keep_master = quantization != "fp8-nomaster"
    llm = LLM(model=model_dir, dtype="bfloat16", load_format="dummy", numerics=numerics, seed=0,
              async_scheduling="async" in variants, fused_gumbel="unfused" not in variants,
              gemm_cublaslt="nocublaslt" not in variants,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
              max_model_len=args.input_len + args.output_len + 16,
              kv_cache_dtype=kv_cache_dtype, quantization="fp8" if quantization == "fp8-nomaster" else quantization,
              keep_master_weights=keep_master)
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=args.temperature, detokenize=False)
    # Warm-up: the whole workload once on OTHER prompts of the same shapes, so every
    # Triton specialization and graph bucket is compiled before timing, and nothing
    # timed is a prefix-cache hit.
    llm.generate([{"prompt_token_ids": p} for p in warm_prompts], sp, use_tqdm=False)
    llm.reset_prefix_cache()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    digest = hashlib.sha256(json.dumps([c.token_ids for o in outs for c in o.outputs]).encode()).hexdigest()[:16]
    label = mode + (f" kv={kv_cache_dtype}" if kv_cache_dtype != "auto" else "") + (f" q={quantization}" if quantization else "")
    res = {"numerics": label, "mode": mode, "kv_cache_dtype": kv_cache_dtype, "quantization": quantization,
           "kv_capacity_tokens": llm.llm_engine.executor.info.kv_capacity_tokens, "seconds": dt, "output_tokens": n_out, "tok_s": n_out / dt, "tokens_sha256": digest,
           "kv_blocks": llm.llm_engine.executor.info.num_blocks, "steps": llm.llm_engine.step_count}
    if args.profile:
        # a second, synchronised run (fresh cache) that splits the step time into phases
        llm.reset_prefix_cache()
        runner = llm.llm_engine.executor.worker
        runner.timer.enabled = True
        runner.timer.timings.clear()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        res["profile_total_s"] = time.perf_counter() - t0
        res["profile"] = dict(runner.timer.timings)
        runner.timer.enabled = False
        print(f"[{mode}] phases (s, synchronised run of {res['profile_total_s']:.2f} s): "
              + ", ".join(f"{k}={v:.2f}" for k, v in sorted(runner.timer.timings.items(), key=lambda kv: -kv[1])), flush=True)
    del llm, outs
    gc.collect()
    torch.cuda.empty_cache()
    return res


def run_hf(cfg_path: str, prompts, args) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(os.path.dirname(cfg_path) if cfg_path.endswith("config.json") else cfg_path)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    n = args.hf_num_prompts or len(prompts)
    ids = torch.tensor(prompts[:n], device="cuda")
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=True, top_k=0, top_p=1.0,
              temperature=1.0, pad_token_id=0)
    model.generate(ids[:2, :32], attention_mask=mask[:2, :32], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, **kw)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n_out = (out.shape[1] - ids.shape[1]) * n
    del model, out
    gc.collect()
    torch.cuda.empty_cache()
    return {"numerics": "transformers generate (padded)", "seconds": dt, "output_tokens": n_out, "tok_s": n_out / dt}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="benchmarks/configs/qwen3-8b.json")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--numerics", default="invariant+async,fast+async", help="comma-separated: fast,invariant; append +async (async scheduling), "
                    "+unfused (unfused Gumbel-max sampler) and/or +nocublaslt (invariant GEMMs without cuBLASLt) "
                    "to a mode, e.g. fast,fast+async,invariant+async,invariant+async+nocublaslt")
    ap.add_argument("--kv-cache-dtype", default="auto", help="comma-separated: auto,fp8 (each numerics mode runs each)")
    ap.add_argument("--quantization", default="none",
                    help="comma-separated: none,fp8,fp8-nomaster (each numerics mode runs each; fp8-nomaster: "
                         "keep_master_weights=False)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--hf", action="store_true", help="also time transformers' padded generate")
    ap.add_argument("--hf-num-prompts", type=int, default=0)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--profile", action="store_true", help="also run once with per-phase timing")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("throughput.py needs a CUDA device")

    with open(args.config) as f:
        cfg = json.load(f)
    model_dir = make_model_dir(args.config)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, cfg["vocab_size"] - 100, (args.num_prompts, args.input_len), generator=g).tolist()
    warm_prompts = torch.randint(100, cfg["vocab_size"] - 100, (args.num_prompts, args.input_len), generator=g).tolist()
    kvs = args.kv_cache_dtype.split(",")
    quants = [None if q == "none" else q for q in args.quantization.split(",")]
    results = [run_ours(model_dir, prompts, warm_prompts, args, m, kv, q) for m in args.numerics.split(",")
               for q in quants for kv in kvs]
    if args.hf:
        results.append(run_hf(os.path.join(model_dir, "config.json"), prompts, args))
    pf, dc = floor_seconds(cfg, args.num_prompts, args.input_len, args.output_len)
    floor_tok_s = args.num_prompts * args.output_len / (pf + dc)
    name = os.path.basename(args.config)
    print(f"\n== throughput: {name}, {args.num_prompts} prompts x {args.input_len} in, {args.output_len} out, T={args.temperature}")
    print(f"floor: prefill {pf:.2f} s (matrix rate) + decode {dc:.2f} s (bandwidth) -> {floor_tok_s:,.0f} output tok/s")
    print(f"{'engine':<34}{'seconds':>9}{'out tok/s':>12}{'x floor':>9}")
    for r in results:
        print(f"{r['numerics']:<34}{r['seconds']:>9.2f}{r['tok_s']:>12,.0f}{r['tok_s'] / floor_tok_s:>9.2f}")
    ours = {r["numerics"]: r["tok_s"] for r in results}
    if len(kvs) > 1 or len(quants) > 1:
        base = {r["mode"]: r for r in results if r.get("kv_cache_dtype") == "auto" and r.get("quantization") is None}
        print(f"{'fp8 vs model dtype':<34}{'tok/s ratio':>12}{'KV tokens':>12}{'KV ratio':>9}")
        for r in results:
            b = base.get(r.get("mode"))
            if b is not None and r is not b:
                print(f"[fp8] {r['numerics']:<28}{r['tok_s'] / b['tok_s']:>12.3f}{r['kv_capacity_tokens']:>12,}"
                      f"{r['kv_capacity_tokens'] / b['kv_capacity_tokens']:>9.2f}")
    for r in results:
        twin = next((o for o in results if o["mode"] == r["mode"] and o["kv_cache_dtype"] == r["kv_cache_dtype"]
                     and o["quantization"] == "fp8"), None) if r["quantization"] == "fp8-nomaster" else None
        if twin is not None:   # dropping the master weights must not change a single token
            print(f"[fp8] {r['numerics']} vs q=fp8: same tokens = {r['tokens_sha256'] == twin['tokens_sha256']}")
    for suffix in ("", "+async"):
        if "fast" + suffix in ours and "invariant" + suffix in ours:
            print(f"invariant{suffix} / fast{suffix} = {ours['invariant' + suffix] / ours['fast' + suffix]:.3f}")
    digests = {r["numerics"]: r.get("tokens_sha256") for r in results}
    if "invariant" in digests and "invariant+async" in digests:
        # same weights, same seeds: async scheduling must not change a single token
        print(f"invariant vs invariant+async: same tokens = {digests['invariant'] == digests['invariant+async']}")
    if args.hf:
        for mode in ("invariant+async", "invariant", "fast+async", "fast"):
            if mode in ours:
                print(f"{mode} / transformers = {ours[mode] / results[-1]['tok_s']:.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"config": name, "floor_tok_s": floor_tok_s, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
