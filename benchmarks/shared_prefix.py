"""Prompts that share a prefix (a system prompt, few-shot examples), submitted together: the
time to serve them with prefix caching, where each after the first waits for the shared blocks
and reuses them, against without it, where each computes the prefix itself; one run, side by
side.

    python benchmarks/shared_prefix.py [--model DIR] [--device cpu|cuda] [--prompts 8]
        [--shared-tokens 256] [--max-tokens 4]

Defaults: the embedded default model on the CPU. Prints per mode the wall time (best of 3),
the tokens each request reused from the cache, and the ratio.
"""
from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    import vllm
    from vllm import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(os.path.dirname(vllm.__file__), "default_model"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--shared-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=4)
    args = ap.parse_args()
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    shared = list(range(1000, 1000 + args.shared_tokens))
    times = {}
    for caching in (False, True):
        llm = LLM(args.model, device=args.device, enable_prefix_caching=caching)
        best, cached = float("inf"), None
        for trial in range(3):
            # a new tail each trial; the prefix cache emptied, so the shared part is computed anew
            prompts = [{"prompt_token_ids": shared + [2000 + 100 * trial + i, 7, 8]} for i in range(args.prompts)]
            llm.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            best = min(best, time.perf_counter() - t)
            cached = [o.num_cached_tokens for o in outs]
        times[caching] = best
        print(f"prefix caching {'on ' if caching else 'off'}: {best:.3f} s, tokens reused per request {cached}")
        del llm
    print(f"{args.prompts} prompts sharing {args.shared_tokens} tokens, submitted together: "
          f"off / on = {times[False] / times[True]:.2f}x")


if __name__ == "__main__":
    main()
