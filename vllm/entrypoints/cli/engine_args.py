"""Engine flags shared by every subcommand that builds an engine."""
from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF checkpoint directory (default: the embedded model)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--numerics", default="fast", choices=["fast", "invariant"])
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"],
                   help="dummy: random weights of the config's shapes (benchmarks; no checkpoint files needed)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="enqueue step N+1 before waiting for step N's tokens (overlaps host and GPU work; "
                        "default: on for CUDA, off for CPU)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device, seed=args.seed,
                numerics=args.numerics, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, block_size=args.block_size,
                gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=args.enable_prefix_caching,
                enable_chunked_prefill=args.enable_chunked_prefill, enforce_eager=args.enforce_eager,
                load_format=getattr(args, "load_format", "safetensors"),
                async_scheduling=getattr(args, "async_scheduling", None))
