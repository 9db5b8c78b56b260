"""A minimal on-policy GRPO loop with a colocated policy, showing the promise:
the importance ratio exp(logp_trainer - logp_rollout) is exactly 1.0 for every
token before each update, because both sides run the same kernels.

    python training/grpo_example.py [--model DIR] [--steps 3] [--device cpu]

Reward: fraction of generated tokens that are digits (a toy task; swap in yours).
"""
from __future__ import annotations

import argparse

import torch

from vllm import LLM, SamplingParams


def reward(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(1, len(text))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args(argv)

    llm = LLM(args.model, device=args.device, numerics="invariant", dtype="float32" if args.device == "cpu" else "auto")
    policy = llm.policy()
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    policy.attach_optimizer(opt)  # each step bumps the engine's weight version, drops stale prefixes
    prompts = ["Count: 1, 2, 3,", "The year was", "Numbers:"]
    history = {"max_abs_logratio": [], "mean_reward": []}
    for step in range(args.steps):
        sp = SamplingParams(n=args.group, temperature=1.0, max_tokens=args.max_tokens, logprobs=0, seed=step)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        seqs, plens, old_lps, adv = [], [], [], []
        for o in outs:
            rewards = torch.tensor([reward(c.text) for c in o.outputs])
            a = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
            for c, ai in zip(o.outputs, a):
                seqs.append(o.prompt_token_ids + c.token_ids)
                plens.append(len(o.prompt_token_ids))
                old_lps.append(torch.tensor([c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]))
                adv.append(float(ai))
        new_lps = policy.token_logprobs(seqs, plens, temperature=1.0)
        loss, worst = 0.0, 0.0
        for lp, old, a in zip(new_lps, old_lps, adv):
            logratio = lp - old.to(lp.device)
            worst = max(worst, logratio.detach().abs().max().item())
            loss = loss - (torch.exp(logratio) * a).mean()
        loss = loss / len(seqs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history["max_abs_logratio"].append(worst)
        history["mean_reward"].append(sum(reward(c.text) for o in outs for c in o.outputs) / (len(prompts) * args.group))
        print(f"step {step}: weight version {llm.weight_version}, max |log ratio| before update = {worst:.1e}, "
              f"mean reward {history['mean_reward'][-1]:.3f}")
    return history


if __name__ == "__main__":
    main()
