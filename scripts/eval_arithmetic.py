#!/usr/bin/env python
"""Greedy accuracy of a model directory on held-out two-digit additions, asked in chat format.

    python scripts/eval_arithmetic.py                              # SmolLM2 from its cache folder
    python scripts/eval_arithmetic.py --model runs/smollm2_arithmetic_grpo/final --n 200
    python scripts/eval_arithmetic.py --write-data training/data   # the recipe's jsonl files

A problem is a chat: the system message "Be brief." and the user turn
"What is 37 + 45? Answer with just the number." (SmolLM2-135M-Instruct ignores a bare
"What is 37 + 45?" and explains its method past any short token budget; asked this
way, about half of its greedy answers end their turn within 16 tokens), rendered with
the model's chat template and decoded greedily until the end-of-turn token. Two
scores: ``accuracy`` (the last number in the response equals the sum: the math
reward) and ``exact`` (the stripped response is exactly the sum: exact match).

Problems: both operands in 10..99 (8,100 ordered pairs). A fixed pool of 1,000 pairs,
chosen by a seeded shuffle that does not depend on ``--seed``, is the held-out "test"
split; "train" draws from the other 7,100, so no seed's training set can reach the
test set. ``--write-data DIR`` writes ``smollm2_addition_{train,test}.jsonl`` (the
data of ``training/smollm2_arithmetic_grpo.yaml``); the same problems are generated in
memory when no ``--data`` file is given.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SYSTEM = "Be brief."
QUESTION = "What is {a} + {b}? Answer with just the number."
HELD_OUT_POOL = 1000
TRAIN_SIZE, TEST_SIZE = 512, 200  # what --write-data writes
_NUMBER = re.compile(r"-?\d+")


def two_digit_additions(n: int, seed: int, split: str) -> list[dict]:
    """``n`` problems of ``split`` ("train" | "test"): {"prompt": chat messages, "answer": str}."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random("two-digit-addition-pool").shuffle(pairs)  # fixed: the split never depends on `seed`
    pool = pairs[:HELD_OUT_POOL] if split == "test" else pairs[HELD_OUT_POOL:]
    if n > len(pool):
        raise ValueError(f"the {split} split has {len(pool)} problems, asked for {n}")
    rng = random.Random(f"two-digit-addition:{seed}:{split}")
    return [{"prompt": [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": QUESTION.format(a=a, b=b)}],
             "answer": str(a + b)} for a, b in rng.sample(pool, n)]


def final_number_score(response: str, answer: str) -> float:
    """1.0 when the last integer in the response is the answer ("45 + 37 = 82" scores)."""
    numbers = _NUMBER.findall(response.replace(",", ""))
    return 1.0 if numbers and int(numbers[-1]) == int(answer) else 0.0


def write_data(out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for split, n in (("train", TRAIN_SIZE), ("test", TEST_SIZE)):
        path = os.path.join(out_dir, f"smollm2_addition_{split}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for rec in two_digit_additions(n, 0, split):
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        paths.append(path)
    return paths


def read_jsonl(path: str, n: int) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:n]


def main(argv=None) -> dict:
    from vllm.testing.smollm2 import default_cache_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_cache_dir(), help="HF checkpoint directory (default: the SmolLM2 cache)")
    ap.add_argument("--data", default=None, help="jsonl of {prompt: messages, answer} (default: the held-out "
                                                 "split, generated)")
    ap.add_argument("--n", type=int, default=TEST_SIZE, help="number of problems")
    ap.add_argument("--seed", type=int, default=0, help="which held-out problems (without --data)")
    ap.add_argument("--max-tokens", type=int, default=16, help="response budget (the recipe's max_response_tokens)")
    ap.add_argument("--numerics", default="invariant", choices=["fast", "invariant"])
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    ap.add_argument("--show", type=int, default=5, help="print this many responses")
    ap.add_argument("--write-data", metavar="DIR", default=None, help="write the recipe's jsonl files and exit")
    args = ap.parse_args(argv)

    if args.write_data:
        for path in write_data(args.write_data):
            print(path)
        return {}
    from vllm import LLM, SamplingParams

    problems = read_jsonl(args.data, args.n) if args.data else two_digit_additions(args.n, args.seed, "test")
    llm = LLM(args.model, device=args.device, numerics=args.numerics)
    t0 = time.perf_counter()
    outs = llm.chat([p["prompt"] for p in problems], SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                    use_tqdm=False)
    seconds = time.perf_counter() - t0
    texts = [o.outputs[0].text for o in outs]
    correct = [final_number_score(t, p["answer"]) for t, p in zip(texts, problems)]
    exact = [float(t.strip() == p["answer"]) for t, p in zip(texts, problems)]
    for p, t, c in list(zip(problems, texts, correct))[:args.show]:
        print(f"{p['prompt'][-1]['content']} -> {t!r} ({'right' if c else 'wrong'}, answer {p['answer']})")
    result = {"model": os.path.abspath(os.path.expanduser(args.model)), "data": args.data or "generated test split",
              "n": len(problems), "seed": args.seed, "numerics": args.numerics, "max_tokens": args.max_tokens,
              "accuracy": sum(correct) / len(problems), "exact": sum(exact) / len(problems),
              "finished_by_eos": sum(o.outputs[0].finish_reason == "stop" for o in outs) / len(problems),
              "generate_seconds": round(seconds, 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
