"""Rollout outputs as the trainer takes them: the full token sequences and the sampled
tokens' logprobs (float32), shared by the parity tests."""
from __future__ import annotations

import torch


def sequences_and_logprobs(prompts: list[list[int]], outputs) -> tuple[list[list[int]], list[torch.Tensor]]:
    """For each prompt and its RequestOutput (first sample, generated with logprobs=0):
    prompt + response token ids, and the response tokens' logprobs as a float32 tensor."""
    seqs, lps = [], []
    for p, o in zip(prompts, outputs):
        c = o.outputs[0]
        seqs.append(p + c.token_ids)
        lps.append(torch.tensor([c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)], dtype=torch.float32))
    return seqs, lps


def rollout(llm, prompts: list[list[int]], seed: int = 11, temperature: float = 0.8,
            max_tokens: int = 7) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Sample every prompt once with logprobs (ignore_eos): sequences_and_logprobs of the outputs."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return sequences_and_logprobs(prompts, outs)


def trainer_mismatches(path: str, prompts: list[list[int]], temperature: float = 0.8) -> list[str]:
    """A CPU invariant engine's rollout of `prompts` against the standalone trainer's logprobs
    for the same sequences, packed three ways (all at once in order; 45-token micro-batches in
    another order; one sequence per micro-batch): the sequences whose bits differ."""
    from vllm import LLM
    from vllm.training import Policy

    llm = LLM(path, device="cpu", numerics="invariant", block_size=8)
    seqs, roll = rollout(llm, prompts, temperature=temperature)
    policy = Policy.from_pretrained(path, device="cpu", numerics="invariant")
    plens = [len(p) for p in prompts]
    n = len(prompts)
    bad = []
    for budget, order in ((None, list(range(n))), (45, list(range(n))[::-1]), (1, list(range(1, n)) + [0])):
        got = policy.token_logprobs([seqs[i] for i in order], [plens[i] for i in order], temperature=temperature,
                                    max_tokens_per_micro_batch=budget)
        bad += [f"seq {i} budget {budget}" for j, i in enumerate(order)
                if not torch.equal(got[j].detach().view(torch.int32), roll[i].view(torch.int32))]
    return bad
