"""`vllm generate`: offline generation from the command line (the README's main job)."""
from __future__ import annotations

import json
import time

from vllm.entrypoints.cli.engine_args import HelpFormatter, add_engine_args, engine_kwargs

# Without --prompt: held-out problems of the task the embedded model is trained on
# (vllm/rl/tasks/arithmetic.py), asked in chat format and checked against their answers.
NUM_BUILTIN_PROBLEMS = 8


def builtin_problems() -> list[dict]:
    from vllm.rl.tasks.arithmetic import generate_problems
    return generate_problems(NUM_BUILTIN_PROBLEMS, 0, "test")


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="offline generation", formatter_class=HelpFormatter)
    add_engine_args(p)
    p.add_argument("--prompt", action="append",
                   help="prompt text, used as it is (repeatable); default: a few arithmetic problems in chat format, "
                        "each printed with the model's answer and whether it is right")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per completion")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens whose "
                                                             "probability adds up to top-p; 1 = off")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--logprobs", type=int, default=None,
                   help="return the logprobs of the N most likely tokens and of the sampled one at each step "
                        "(printed with --json; default: none; -1: every token of the vocabulary, which needs "
                        "--max-logprobs -1)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="largest --logprobs allowed (upstream's engine argument; -1: the whole vocabulary)")
    p.add_argument("--json", action="store_true", help="print one JSON object per completion")

def run(args) -> int:
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args), max_logprobs=args.max_logprobs)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        n=args.n, logprobs=args.logprobs, seed=args.seed)
    problems = None
    t0 = time.perf_counter()
    if args.prompt:
        outs = llm.generate(args.prompt, sp)
    else:
        problems = builtin_problems()
        if getattr(llm.get_tokenizer(), "chat_template", None) is not None:
            outs = llm.chat([p["prompt"] for p in problems], sp)
        else:  # a model without a chat template gets the bare questions
            outs = llm.generate([p["prompt"][-1]["content"] for p in problems], sp)
    dt = time.perf_counter() - t0
    n_tok = right = 0
    reward = None
    if problems is not None:
        from vllm.rl.rewards import build_reward
        reward = build_reward("math", 1.0, 0.0)
    for i, o in enumerate(outs):
        question = problems[i]["prompt"][-1]["content"] if problems is not None else o.prompt
        for c in o.outputs:
            n_tok += len(c.token_ids)
            verdict = None
            if problems is not None:
                ok = reward(c.text, problems[i]["answer"], problems[i]) > 0
                right += ok
                verdict = "right" if ok else f"wrong, {problems[i]['answer']}"
            if args.json:
                rec = {"prompt": question, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                       "finish_reason": c.finish_reason,
                       "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] if c.logprobs else None}
                if problems is not None:
                    rec.update(answer=problems[i]["answer"], correct=verdict == "right")
                print(json.dumps(rec))
            elif problems is not None:
                print(f"{question:<24} -> {c.text.strip()!r:<10} ({verdict})")
            else:
                print(f"--- {question!r} [{c.index}] ({c.finish_reason})\n{c.text}")
    cfg = llm.config
    score = f"; {right} of {sum(len(o.outputs) for o in outs)} right" if problems is not None else ""
    print(f"\n{len(outs)} prompts, {n_tok} tokens in {dt:.2f} s ({n_tok / max(dt, 1e-9):.1f} tok/s) "
          f"on {cfg.device} {str(cfg.dtype).replace('torch.', '')}, numerics={cfg.numerics}, model={cfg.model.path}"
          f"{score}")
    return 0
