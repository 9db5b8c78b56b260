"""`vllm generate`: offline generation from the command line (the README's main job)."""
from __future__ import annotations

import json
import time

from vllm.entrypoints.cli.engine_args import HelpFormatter, add_engine_args, engine_kwargs

DEFAULT_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "In a distant future, rollout and training",
    "1, 2, 3, 4,",
]


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="offline generation", formatter_class=HelpFormatter)
    add_engine_args(p)
    p.add_argument("--prompt", action="append", help="prompt text (repeatable); default: a few built-in prompts")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per completion")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens whose "
                                                             "probability adds up to top-p; 1 = off")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--logprobs", type=int, default=None,
                   help="return the logprobs of the N most likely tokens and of the sampled one at each step "
                        "(printed with --json; default: none)")
    p.add_argument("--json", action="store_true", help="print one JSON object per completion")

def run(args) -> int:
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    prompts = args.prompt or DEFAULT_PROMPTS
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        n=args.n, logprobs=args.logprobs, seed=args.seed)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    n_tok = 0
    for o in outs:
        for c in o.outputs:
            n_tok += len(c.token_ids)
            if args.json:
                print(json.dumps({"prompt": o.prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                                  "finish_reason": c.finish_reason,
                                  "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] if c.logprobs else None}))
            else:
                print(f"--- {o.prompt!r} [{c.index}] ({c.finish_reason})\n{c.text}")
    cfg = llm.config
    print(f"\n{len(outs)} prompts, {n_tok} tokens in {dt:.2f} s ({n_tok / max(dt, 1e-9):.1f} tok/s) "
          f"on {cfg.device} {str(cfg.dtype).replace('torch.', '')}, numerics={cfg.numerics}, model={cfg.model.path}")
    return 0
