"""GRPO / DAPO pieces as plain tensor functions (hand-checked in tests/test_rl_losses.py).

Shapes: rewards are [prompts, group]; token tensors are flat over the response
tokens of a micro-batch, with `token_weights` carrying the aggregation, so the sum
over micro-batches is the loss of the whole mini-batch whatever the split.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def group_advantages(rewards: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: A = (r - mean_group) / (std_group + eps), std with Bessel's correction;
    `norm_by_std=False` keeps only the centring (Dr. GRPO)."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [prompts, group >= 2], got {tuple(rewards.shape)}")
    r = rewards.to(torch.float64)
    centred = r - r.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    return centred.to(torch.float32)


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Eq. 13): 0 up to max - buffer tokens, then a
    linear ramp down to -factor at max_tokens (responses never exceed max_tokens)."""
    lengths = lengths.to(torch.float64)
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    exceed = lengths - (max_tokens - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0).to(torch.float32)


def informative_groups(scores: torch.Tensor) -> torch.Tensor:
    """Dynamic sampling: True for groups whose scores are not all equal (a group where
    every response is equally right or wrong has zero advantage and no gradient)."""
    return scores.amax(dim=1) != scores.amin(dim=1)


def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref) from samples of pi: e^(ref-lp) - (ref-lp) - 1
    (log-ratio clamped to +-20, result to [-10, 10], as verl's low_var_kl; TRL's does not
    clamp): past |ref - lp| of about 11 the clamp holds k3 at 10 and its gradient is 0."""
    d = torch.clamp(ref_logp - logp, -20.0, 20.0)
    return torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)


def aggregation_weights(lengths: list[int], mode: str, total_tokens: int, total_seqs: int,
                        max_response_tokens: int = 0) -> torch.Tensor:
    """Per-token weights whose dot product with per-token losses is the aggregated loss.
    token-mean: 1 / (tokens in the mini-batch) (DAPO); seq-mean-token-mean: 1 / (len * seqs)
    (GRPO); seq-mean-token-sum: 1 / seqs, each response's token sum, then the mean over
    responses (verl's mode of that name); seq-mean-token-sum-norm: 1 / (max_response_tokens *
    seqs), a constant in place of each response's length (Dr. GRPO, TRL's dr_grpo; verl's mode
    of that name in its versions whose agg_loss divides by the response count, older ones
    divide the token sum by max_response_tokens alone)."""
    if mode == "token-mean":
        return torch.full((sum(lengths),), 1.0 / total_tokens, dtype=torch.float32)
    if mode == "seq-mean-token-mean":
        return torch.cat([torch.full((n,), 1.0 / (n * total_seqs), dtype=torch.float32) for n in lengths])
    if mode == "seq-mean-token-sum":
        return torch.full((sum(lengths),), 1.0 / total_seqs, dtype=torch.float32)
    if mode == "seq-mean-token-sum-norm":
        if max_response_tokens <= 0:
            raise ValueError("seq-mean-token-sum-norm needs max_response_tokens > 0 (its constant normaliser)")
        return torch.full((sum(lengths),), 1.0 / (max_response_tokens * total_seqs), dtype=torch.float32)
    raise ValueError(f"loss_agg must be one of {LOSS_AGGREGATIONS}, got {mode!r}")


@dataclass
class PolicyLossStats:
    clipped_low: int      # tokens with A < 0 and ratio < 1 - eps_low
    clipped_high: int     # tokens with A > 0 and ratio > 1 + eps_high
    tokens: int           # tokens that carry loss (weight > 0: not overlong-filtered)
    kl_sum: float         # sum of per-token k3 to the reference over those tokens (0 without one)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, token_weights: torch.Tensor, *,
                eps_low: float, eps_high: float, tis_weight: torch.Tensor | None = None,
                ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0) -> tuple[torch.Tensor, PolicyLossStats]:
    """Clipped surrogate with separate low/high clip (DAPO clip-higher):

        L_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) * w_tis + kl_coef * k3(lp, ref)

    r = exp(logp - old_logp); `tis_weight` (detached, truncated p_old/p_rollout) corrects
    for a rollout that sampled from different numbers than the trainer computes.
    The max is taken by its condition: a token is clipped (a constant, no gradient) where
    A > 0 and r > 1 + eps_high or A < 0 and r < 1 - eps_low, else it is -A r with its full
    gradient. The value is the max's bit for bit; the gradient differs only where the two
    sides tie (r on a clip bound: r = 1 under an eps of 0), where torch.maximum would halve it.
    Returns sum(token_weights * L_t) and, over the tokens of non-zero weight (an overlong-
    filtered response's carry none), counts for the clip fraction and the KL sum."""
    # the log-ratio clamped to +-20 (as verl's): a ratio past e^88 would overflow to inf, and
    # the unselected side's gradient, 0 * inf, would be NaN
    ratio = torch.exp(torch.clamp(logp - old_logp.detach(), -20.0, 20.0))
    with torch.no_grad():
        clipped_high = (advantages > 0) & (ratio > 1.0 + eps_high)
        clipped_low = (advantages < 0) & (ratio < 1.0 - eps_low)
    unclipped = -advantages * ratio
    clipped = (-advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)).detach()
    per_token = torch.where(clipped_high | clipped_low, clipped, unclipped)
    if tis_weight is not None:
        per_token = per_token * tis_weight.detach()
    kl_sum = 0.0
    if ref_logp is not None and kl_coef > 0:
        kl = k3(logp, ref_logp.detach())
        per_token = per_token + kl_coef * kl
        kl_sum = float(kl.detach()[token_weights > 0].sum())
    loss = (per_token * token_weights).sum()
    with torch.no_grad():
        counted = token_weights > 0
        low = int((clipped_low & counted).sum())
        high = int((clipped_high & counted).sum())
    return loss, PolicyLossStats(low, high, int(counted.sum()), kl_sum)


def truncated_is_weight(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """TIS: min(p_old / p_rollout, cap), detached (exactly 1 when the two are equal)."""
    return torch.clamp(torch.exp(old_logp - rollout_logp), max=cap).detach()


def mismatch_stats(train_logp: torch.Tensor, rollout_logp: torch.Tensor) -> dict[str, float]:
    """Rollout vs trainer logprobs of the same tokens under the same weights: |diff|
    max/mean/std and the k3 estimate of KL(rollout || trainer). All 0 in invariant mode."""
    d = (train_logp.detach().to(torch.float64) - rollout_logp.to(torch.float64))
    a = d.abs()
    n = a.numel()
    if n == 0:
        return {"logprob_diff_max": 0.0, "logprob_diff_mean": 0.0, "logprob_diff_std": 0.0, "k3_kl": 0.0}
    k3_kl = (torch.exp(d) - 1.0 - d).mean()
    return {"logprob_diff_max": float(a.max()), "logprob_diff_mean": float(a.mean()),
            "logprob_diff_std": float(a.std(correction=0)), "k3_kl": float(k3_kl)}
