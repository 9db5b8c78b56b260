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
