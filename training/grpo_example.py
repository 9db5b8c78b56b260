"""A minimal GRPO run written against the `vllm.rl` API (what `vllm train` runs), with
a toy reward: the importance ratio exp(logp_trainer - logp_rollout) is exactly 1.0 for
every token before each update, because both sides run the same kernels.

    python training/grpo_example.py [--model DIR] [--steps 3] [--device cpu]

Reward: the fraction of generated characters that are digits (swap in yours: any
function `reward(response: str, answer: str, record: dict) -> float`).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

PROMPTS = ["Count: 1, 2, 3,", "The year was", "Numbers:"]


def digit_fraction(response: str, answer: str, record: dict) -> float:
    return sum(c.isdigit() for c in response) / max(1, len(response))


def main(argv=None) -> dict:
    from vllm.rl.config import TrainConfig
    from vllm.rl.trainer import Trainer

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args(argv)

    work = tempfile.mkdtemp(prefix="grpo_example_")
    data = os.path.join(work, "prompts.jsonl")
    with open(data, "w") as f:
        for p in PROMPTS:
            f.write(json.dumps({"prompt": p, "answer": ""}) + "\n")
    cfg = TrainConfig.from_dict({
        "model": args.model, "device": args.device, "numerics": "invariant",
        "dtype": "float32" if args.device == "cpu" else "auto",
        "data": data, "reward": f"{os.path.abspath(__file__)}:digit_fraction",
        "group_size": args.group, "prompts_per_step": len(PROMPTS), "max_response_tokens": args.max_tokens,
        "lr": args.lr, "steps": args.steps, "output_dir": os.path.join(work, "run"),
        "progress": False, "tensorboard": False, "plots": False,
    })
    trainer = Trainer(cfg)
    history = {"max_abs_logratio": [], "mean_reward": []}
    for _ in range(args.steps):
        m = trainer.step().metrics
        # max |logp_trainer - logp_rollout| over every response token, same weights
        history["max_abs_logratio"].append(m["logprob_diff_max"])
        history["mean_reward"].append(m["reward_mean"])
        print(f"step {m['step']}: weight version {m['weight_version']}, max |log ratio| before update = "
              f"{m['logprob_diff_max']:.1e}, mean reward {m['reward_mean']:.3f}")
    return history


if __name__ == "__main__":
    main()
