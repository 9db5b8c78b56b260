"""Batch-invariant sampler.

The product promise is that a request's sampled token and its logprobs are a
function of that request's logits row and sampling parameters only: never of
the batch size, the other rows, or the row order.  Two rules make that hold by
construction rather than by luck:

* Only *exact* or *elementwise* operations touch a row.  Elementwise float ops
  (``/``, ``+``, ``exp``, ``log``) compute each element on its own, so its bits
  cannot depend on the tensor's shape.  Exact ops (``amax``, ``argmax``,
  comparisons, integer sums/cumsums, stable sorts, ``topk`` where its answer
  is unique, gathers, scatters to distinct indices) have a single correct
  answer, so whatever algorithm torch picks for a given shape returns the same
  bits.
* Float *reductions* (sums, prefix sums) are never left to torch's reduction
  kernels, whose split/tile choices on CUDA depend on the number of rows (and
  ``cumsum`` of a single row even takes a different code path).  They are
  written as a fixed sequence of elementwise adds over column slices
  (:func:`_pairwise_sum`, :func:`_inclusive_scan`), so the order of additions
  depends only on the row length.

Randomness comes from :mod:`vllm.sample.rng`, a counter-based hash of
``(seed, position, token id)``.  See ``docs/sampling.md`` for the full spec.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from vllm.host_copy import to_device
from vllm.sample.rng import gumbel_argmax, uniform_noise
from vllm.sampling_params import LOGPROBS_MODES

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------- #
# Batch-invariant numerics (also meant for the trainer: see tempered_logprobs)
# --------------------------------------------------------------------------- #
def _pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim with a fixed pairwise order; returns shape [..., 1].

    Each step adds the second half of the columns onto the first half (an
    elementwise add), folding an odd leftover column into column 0.  The order
    of additions is a function of the row length alone.  Pairwise summation is
    also more accurate than a sequential sum (error O(log n) ulps).
    """
    n = x.shape[-1]
    if n == 0:
        return x.new_zeros(x.shape[:-1] + (1,))
    while n > 1:
        half = n // 2
        y = x[..., :half] + x[..., half:2 * half]
        if n % 2:
            y[..., :1] += x[..., 2 * half:]
        x, n = y, half
    return x


def _inclusive_scan(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sum over the last dim, Hillis-Steele order (elementwise adds only).

    Output column j is a fixed combination of input columns 0..j that does not
    depend on the row length either: step ``s`` touches column j only if
    ``j >= s``, and every ``s <= j`` step runs whenever the row is longer than j.
    """
    a = x.contiguous().clone()
    n = a.shape[-1]
    if n <= 1:
        return a
    b = torch.empty_like(a)
    s = 1
    while s < n:
        b[..., :s].copy_(a[..., :s])
        torch.add(a[..., s:], a[..., :-s], out=b[..., s:])
        a, b = b, a
        s *= 2
    return a


def _finite_row_max(x: torch.Tensor) -> torch.Tensor:
    """Row max [B, 1] (exact), with non-finite maxima replaced by 0 so x - max stays sane."""
    m = x.amax(dim=-1, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def batch_invariant_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dim whose bits depend only on each row.

    Same formula as torch's kernel, ``(x - max) - log(sum(exp(x - max)))``, but
    the sum is :func:`_pairwise_sum`.  Rows whose max is not finite (all -inf)
    are not supported (their output is -inf/nan), as in torch.
    """
    x = x.float()
    z = x - _finite_row_max(x)
    s = _pairwise_sum(torch.exp(z))
    return z.sub_(s.log_())


def _effective_temperature(temperature: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """Temperature as a float32 device tensor broadcastable against ``like``'s rows, 0 -> 1."""
    t = torch.as_tensor(temperature, dtype=torch.float32, device=like.device)
    if t.dim() > 0:
        t = t.reshape(t.shape + (1,))  # one value per row -> broadcast over the vocab
    return torch.where(t <= 0, torch.ones_like(t), t)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """``logits / T`` as the sampler computes it (T <= 0 means greedy and is treated as 1).

    It is a true IEEE division by a *device tensor*: ``logits / 0.7`` with a
    Python float would let CUDA multiply by the reciprocal instead (different
    bits), so trainers should call this function rather than re-deriving it.
    ``x / 1.0 == x`` exactly, so greedy rows keep their raw logits bit for bit.
    """
    return logits.float() / _effective_temperature(temperature, logits)


def tempered_logprobs(logits: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """The ``tempered_logprobs`` mode for any ``[..., V]`` logits: what an RL trainer recomputes.

    ``temperature`` is a scalar or one value per row (shape ``logits.shape[:-1]``).
    Calling this on the trainer's logits gives the rollout's logprobs bit for bit
    whenever the logits themselves match.
    """
    return batch_invariant_log_softmax(apply_temperature(logits, temperature))


def tempered_target_logprobs(logits: torch.Tensor, temperature: torch.Tensor | float,
                             targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tempered_logprobs`` at one column per row, without the ``[B, V]`` output: (lp, lse)
    with ``lp[r] == tempered_logprobs(logits, temperature)[r, targets[r]]`` bit for bit and
    ``lse[r]`` the log-sum-exp of row r of ``logits / T`` (what a backward needs).

    The same operations in the same order on the same values (``apply_temperature``'s
    division, the exact row max, the pairwise sum of exp, one subtraction); the
    intermediates are updated in place. ``targets`` is ``[B]`` int64. The trainer's chunked
    logprob head (vllm/training/logprob_head.py) calls it without autograd."""
    z = apply_temperature(logits, temperature)
    m = _finite_row_max(z)
    z = z.sub_(m)                              # x - max
    z_t = z.gather(-1, targets[:, None])       # the target column of x - max
    log_s = _pairwise_sum(z.exp_()).log_()     # log(sum(exp(x - max))), the same pairwise tree
    return (z_t - log_s)[:, 0], (m + log_s)[:, 0]


def prompt_logprob_values(logits: torch.Tensor, temperature: torch.Tensor, logprobs_mode: str) -> torch.Tensor:
    """The values a prompt position reports under `logprobs_mode`: the sampler's own
    operations on the same logits, so a prompt token's logprob has the bits the sampler
    reports when it samples that token (a row without penalties). Truncation and penalties
    belong to the sampling of output tokens: for prompt positions the processed modes
    equal the tempered ones. `temperature` is [R] float32 (0 -> 1, as the sampler)."""
    if logprobs_mode == "raw_logits":
        return logits.float()
    if logprobs_mode == "raw_logprobs":
        return batch_invariant_log_softmax(logits)
    scaled = apply_temperature(logits, temperature)
    return scaled if logprobs_mode == "processed_logits" else batch_invariant_log_softmax(scaled)


def _stable_topk_exact(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`stable_topk` for rows where ties straddle the k-th value (0 < k < N).

    ``torch.topk`` is only trusted for the k-th largest *value* (exact); which
    of the tied indices to keep is decided by exact integer bookkeeping.
    """
    B, N = x.shape
    kth = torch.topk(x, k, dim=-1, largest=True, sorted=False).values.amin(dim=-1, keepdim=True)
    above = x > kth
    at = x == kth
    # Of the entries tied with the k-th value, keep the lowest indices that fit.
    room = k - above.sum(dim=-1, keepdim=True)
    selected = above | (at & (at.cumsum(dim=-1) <= room))
    # A per-row permutation putting the selected indices first (in index order)
    # and the rest after them: every scatter target is distinct, so the scatter
    # is deterministic.
    col = torch.arange(N, device=x.device, dtype=torch.int64).expand(B, N)
    csum = selected.cumsum(dim=-1)
    slot = torch.where(selected, csum - 1, k + col - csum)
    ids = torch.empty_like(slot).scatter_(1, slot, col)[:, :k]
    vals, order = torch.sort(x.gather(1, ids), dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, order)


def stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``k`` entries of a stable descending sort of each row of ``x`` [B, N].

    Returns ``(values, indices)`` [B, k], descending, equal values ordered by
    lower index first: exactly ``torch.sort(x, descending=True, stable=True)``
    truncated to k, without sorting the whole row.

    ``torch.topk`` does not promise which of several tied indices it returns.
    Its chosen *set* is nevertheless forced whenever exactly k entries are >=
    the k-th largest value; then only the order inside the set needs fixing
    (sort by id, then stable sort by value).  Rows where more than k entries
    reach the k-th value (a tie straddling the boundary) are redone by
    :func:`_stable_topk_exact`.  Either way a row's answer is the same unique
    prefix, so which rows take which path never matters.
    """
    B, N = x.shape
    k = max(0, min(int(k), N))
    if k == N:
        return torch.sort(x, dim=-1, descending=True, stable=True)
    if k == 0 or B == 0:
        return x.new_empty((B, k)), torch.empty((B, k), dtype=torch.int64, device=x.device)
    if k == 1:
        # argmax returns the first maximal index (documented), i.e. the stable sort's
        # first entry, with no host sync (the general path below needs one for ties)
        ids = x.argmax(dim=-1, keepdim=True)
        return x.gather(1, ids), ids
    vals, ids = torch.topk(x, k, dim=-1, largest=True, sorted=False)
    ambiguous = (x >= vals.amin(dim=-1, keepdim=True)).sum(dim=-1) > k
    ids = torch.sort(ids, dim=-1).values                   # ascending token id ...
    vals, order = torch.sort(x.gather(1, ids), dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)                              # ... then by value, stably
    rows = ambiguous.nonzero().squeeze(1)                   # host sync; usually empty
    if rows.numel():
        v, i = _stable_topk_exact(x.index_select(0, rows), k)
        vals.index_copy_(0, rows, v)
        ids.index_copy_(0, rows, i)
    return vals, ids


# --------------------------------------------------------------------------- #
# Public dataclasses
# --------------------------------------------------------------------------- #
@dataclass
class Penalties:
    """Presence / frequency / repetition penalties of the rows that use them.

    A row's penalties depend on its own token history only: counts are built per
    row by an integer scatter (exact), and the penalised logits by elementwise
    ops, so a row's bits never depend on the other rows of the batch.
    """

    rows: torch.Tensor          # [P] int64: which batch rows have penalties
    presence: torch.Tensor      # [P] float32
    frequency: torch.Tensor     # [P] float32
    repetition: torch.Tensor    # [P] float32
    output_ids: torch.Tensor    # [N] int64: every output token of every penalised row ...
    output_slot: torch.Tensor   # [N] int64: ... and which of the P rows it belongs to
    prompt_ids: torch.Tensor    # [M] int64: prompt tokens (repetition penalty only) ...
    prompt_slot: torch.Tensor   # [M] int64


@dataclass
class TokenMask:
    """The tokens each constrained row may sample (structured outputs: the grammar's
    mask, vllm/structured_outputs.py). Rows not listed are unconstrained.

    A row's mask comes from its own grammar state only, and applying it is exact per
    element (a -inf fill where the bit is 0), so a masked row's bits depend on nothing
    but its own logits and mask."""

    rows: torch.Tensor          # [R] int64: which batch rows are constrained
    bitmask: torch.Tensor       # [R, W] int32: bit j of word i allows token 32 * i + j


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Unpack [R, W] int32 words into a [R, vocab] bool mask (integer shifts: exact); ids
    past the bitmask's 32 * W are disallowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1)
    if bits.shape[1] < vocab:
        bits = torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]))
    return bits[:, :vocab].bool()


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """``logits`` with the disallowed tokens of the constrained rows set to -inf (a new
    tensor; every other element, and every unconstrained row, copied bit for bit)."""
    out = logits.clone()
    sub = out.index_select(0, mask.rows)
    sub.masked_fill_(~allowed_tokens(mask.bitmask, logits.shape[1]), _NEG_INF)
    return out.index_copy_(0, mask.rows, sub)


@dataclass
class TokenBan:
    """Single tokens a row may not sample this step: EOS and stop tokens while a request is
    short of its min_tokens (pairs: row `rows[i]` bans token `token_ids[i]`)."""

    rows: torch.Tensor          # [N] int64
    token_ids: torch.Tensor     # [N] int64


def apply_token_ban(logits: torch.Tensor, ban: TokenBan) -> torch.Tensor:
    """``logits`` with the banned (row, token) pairs set to -inf (a new tensor; every other
    element copied bit for bit)."""
    out = logits.clone()
    out[ban.rows, ban.token_ids] = _NEG_INF   # a Python scalar: no host-to-device copy to wait for
    return out


@dataclass
class LogitBias:
    """The logit_bias of the rows that set one: row `rows[i]` adds `values[i]` to the logit
    of token `token_ids[i]` (a row names each token once)."""

    rows: torch.Tensor          # [N] int64
    token_ids: torch.Tensor     # [N] int64
    values: torch.Tensor        # [N] float32, in [-100, 100]


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> torch.Tensor:
    """Float32 ``logits`` with each (row, token) pair's bias added (a new tensor). A gather,
    one float32 addition per biased element and a scatter to distinct elements: every other
    element, and every row without a bias, is copied bit for bit."""
    out = logits.float().clone()
    index = (bias.rows, bias.token_ids)
    return out.index_put_(index, out[index] + bias.values.to(device=out.device, dtype=torch.float32))


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """Penalised float32 logits (a new tensor; rows without penalties are copied bit for bit).

    Upstream vLLM's definitions, in its order, on the raw logits:
    * repetition r: a token seen in the prompt or the output has its logit divided
      by r when positive, multiplied by r otherwise;
    * frequency f: minus f x (the token's count in the output);
    * presence p: minus p when the token occurs in the output at all.
    """
    num_pen = int(pen.rows.shape[0])
    out = logits.float().clone()
    if num_pen == 0:
        return out
    vocab = out.shape[1]
    device = out.device
    counts = torch.zeros((num_pen, vocab), dtype=torch.int32, device=device)
    counts.index_put_((pen.output_slot, pen.output_ids),
                      torch.ones(pen.output_ids.shape, dtype=torch.int32, device=device), accumulate=True)
    in_output = counts > 0
    seen = in_output.clone()
    seen.index_put_((pen.prompt_slot, pen.prompt_ids), torch.ones(pen.prompt_ids.shape, dtype=torch.bool, device=device))
    x = out.index_select(0, pen.rows)
    rep = pen.repetition.to(device=device, dtype=torch.float32).unsqueeze(1)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - pen.frequency.to(device=device, dtype=torch.float32).unsqueeze(1) * counts.float()
    x = x - pen.presence.to(device=device, dtype=torch.float32).unsqueeze(1) * in_output.float()
    out.index_copy_(0, pen.rows, x)
    return out


@dataclass
class SamplingBatch:
    """Per-row sampling parameters; one row per request sampled this step.

    All tensors live on the logits' device.  ``all_greedy`` and
    ``no_truncation`` are promises from the engine that let the sampler skip
    work; when False the sampler works it out itself.  A skipped stage is
    exactly the identity for every row it would have left alone, so the flags
    never change any row's result.
    """

    temperature: torch.Tensor   # [B] float32; <= 0 => greedy (argmax of raw logits)
    top_k: torch.Tensor         # [B] int64; <= 0 or >= vocab => disabled
    top_p: torch.Tensor         # [B] float32; >= 1.0 => disabled
    min_p: torch.Tensor         # [B] float32; <= 0.0 => disabled
    seeds: torch.Tensor         # [B] int64; per-request seed
    positions: torch.Tensor     # [B] int64; index of the token within the request's output
    max_num_logprobs: int = -1  # -1: none; 0: sampled token's logprob + rank; k > 0: also top-k
    logprobs_mode: str = "tempered_logprobs"
    all_greedy: bool = False    # promise: every temperature is 0
    no_truncation: bool = False  # promise: no row uses top_k / top_p / min_p
    # The per-row parameters as host values (from_lists keeps them): the sampler then
    # decides which stages to run without reading device tensors back (a host sync).
    # Drop it (host_params=None) when replacing the tensors after construction.
    host_params: "_HostParams | None" = None
    # Rows with presence / frequency / repetition penalties (None: no row has any).
    penalties: Penalties | None = None
    # Rows constrained by a grammar (None: no row is).
    token_mask: TokenMask | None = None
    # Tokens banned this step (min_tokens' EOS and stop tokens, bad words; None: none).
    token_ban: TokenBan | None = None
    # Rows with a logit_bias (None: no row has one).
    logit_bias: LogitBias | None = None

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])

    @classmethod
    def from_lists(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        min_p: Sequence[float],
        seeds: Sequence[int],
        positions: Sequence[int],
        device: torch.device | str,
        max_num_logprobs: int = -1,
        logprobs_mode: str = "tempered_logprobs",
    ) -> "SamplingBatch":
        """Build a batch from Python lists, deriving the fast-path flags."""
        n = len(temperature)
        if not all(len(v) == n for v in (top_k, top_p, min_p, seeds, positions)):
            raise ValueError("all per-row parameter lists must have the same length")
        return cls(
            temperature=to_device(temperature, torch.float32, device),
            top_k=to_device(top_k, torch.int64, device),
            top_p=to_device(top_p, torch.float32, device),
            min_p=to_device(min_p, torch.float32, device),
            seeds=to_device(seeds, torch.int64, device),
            positions=to_device(positions, torch.int64, device),
            host_params=_HostParams(tuple(temperature), tuple(int(k) for k in top_k), tuple(top_p), tuple(min_p)),
            max_num_logprobs=max_num_logprobs,
            logprobs_mode=logprobs_mode,
            all_greedy=all(t <= 0 for t in temperature),
            # top_k >= vocab also disables, but the vocab is unknown here: stay conservative.
            no_truncation=all(k <= 0 for k in top_k) and all(p >= 1.0 for p in top_p)
            and all(m <= 0.0 for m in min_p),
        )


@dataclass(frozen=True)
class _HostParams:
    temperature: tuple
    top_k: tuple
    top_p: tuple
    min_p: tuple

    def plan(self, vocab: int) -> tuple[bool, "_TruncationPlan"]:
        """(all_greedy, truncation plan): the same decisions the device probes would give.
        Comparisons are made on float32 arrays, as the device makes them."""
        with np.errstate(over="ignore"):  # temperatures beyond float32 range become inf, as on the device
            t = np.asarray(self.temperature, dtype=np.float32)
            p = np.asarray(self.top_p, dtype=np.float32)
            m = np.minimum(np.asarray(self.min_p, dtype=np.float32), np.float32(1.0))
        k = np.asarray(self.top_k, dtype=np.int64)
        use_k = (k > 0) & (k < vocab)
        use_p = p < 1.0
        plan = _TruncationPlan(bool(use_k.any()), bool(use_p.any()), bool((m > 0.0).any()),
                               bool((use_p & ~use_k).any()), int(np.where(use_k, k, 0).max(initial=0)))
        return bool((t <= 0).all()), plan


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                     # [B] int64
    logprobs: torch.Tensor | None = None        # [B] float32, sampled token's value under logprobs_mode
    ranks: torch.Tensor | None = None           # [B] int64, 1 + #tokens with a strictly greater value
    topk_ids: torch.Tensor | None = None        # [B, k] int64, descending value, ties -> lower id first
    topk_logprobs: torch.Tensor | None = None   # [B, k] float32


# --------------------------------------------------------------------------- #
# Truncation (top-k, top-p, min-p)
# --------------------------------------------------------------------------- #
# Sorted-prefix width tried first for top-p rows without top-k.  Rows whose
# nucleus does not fit are redone alone with their whole row sorted.  A speed
# knob only: no result depends on it.
_TOP_P_FIRST_WIDTH = 1024


@dataclass
class _TruncationPlan:
    """Which truncation stages some row of the batch uses (host-side booleans)."""

    any_k: bool = False
    any_p: bool = False
    any_m: bool = False
    any_p_without_k: bool = False
    max_top_k: int = 0  # largest top_k among rows that use top-k

    @property
    def any(self) -> bool:
        return self.any_k or self.any_p or self.any_m


def _keep_mask(scaled, plan, top_k, top_p, min_p, use_k, use_p, use_m) -> torch.Tensor:
    """Boolean [B, V] mask of the tokens surviving min-p, then top-k, then top-p (upstream's
    order: its min-p logits processor runs before its top-k / top-p sampler).

    * min-p keeps tokens with exp(x - max) >= min_p, i.e. prob >= min_p * max prob;
    * top-k keeps the first k entries of the stable descending sort of the tempered logits
      left by min-p (ties at the boundary -> lower token id);
    * top-p, on the distribution renormalised over those survivors, keeps sorted entry j
      iff the mass strictly before it is < top_p * total: the shortest prefix reaching
      top_p. Entry 0 is always kept.
    Min-p keeps a prefix of the sorted order (the max and everything within the ratio), so
    it commutes with top-k; top-p's total is the mass left by both.
    """
    keep = None
    if plan.any_m:
        ratio = torch.exp(scaled - _finite_row_max(scaled))
        keep = (ratio >= min_p.unsqueeze(1)) | ~use_m.unsqueeze(1)
        del ratio
    if plan.any_k or plan.any_p:
        # top-p renormalises over what min-p left: its removed tokens take no mass
        after_m = scaled if keep is None else scaled.masked_fill(~keep, _NEG_INF)
        keep_kp = _top_k_top_p_mask(after_m, plan, top_k, top_p, use_k, use_p)
        keep = keep_kp if keep is None else keep.logical_and_(keep_kp)
    return keep


def _top_k_top_p_mask(scaled, plan, top_k, top_p, use_k, use_p) -> torch.Tensor:
    """Keep mask of top-k then top-p, working on a sorted prefix of each row.

    Both stages keep a prefix of the stable descending order, so only the first
    W sorted columns matter, as long as W covers every top-k row's k and every
    top-p row's nucleus.  W starts at max(largest top_k, _TOP_P_FIRST_WIDTH);
    the top-p rows whose nucleus does not fit are then redone on their own
    with W = V.  Neither choice can change a row's result: the sorted prefix,
    column j of the prefix sums (which depends on columns 0..j only) and each
    row's total mass are all independent of W and of the other rows.
    """
    vocab = scaled.shape[1]
    k_eff = torch.where(use_k, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    width = min(vocab, max(plan.max_top_k, _TOP_P_FIRST_WIDTH if plan.any_p_without_k else 1))
    keep, unresolved = _prefix_keep(scaled, width, k_eff, top_p, use_k, use_p, plan)
    if unresolved is not None:
        rows = unresolved.nonzero().squeeze(1)  # host sync; usually empty
        if rows.numel():
            sub, _ = _prefix_keep(scaled.index_select(0, rows), vocab, k_eff[rows], top_p[rows],
                                  use_k[rows], use_p[rows], plan)
            keep.index_copy_(0, rows, sub)
    # Rows using neither top-k nor top-p keep everything (not just the prefix).
    return keep.logical_or_(~(use_k | use_p).unsqueeze(1))


def _prefix_keep(scaled, width, k_eff, top_p, use_k, use_p, plan):
    """Top-k/top-p keep mask from the first ``width`` sorted columns.

    Returns ``(keep [B, V], unresolved [B] or None)``; ``unresolved`` flags the
    top-p rows without top-k whose nucleus may extend past ``width``.
    """
    num_rows, vocab = scaled.shape
    device = scaled.device
    vals, ids = stable_topk(scaled, width)
    col = torch.arange(width, device=device, dtype=torch.int64).unsqueeze(0)
    keep_s = (col < k_eff.unsqueeze(1)) | ~use_k.unsqueeze(1)
    unresolved = None
    if plan.any_p:
        # Sorted column 0 is the row max: masses are exp(x - max).
        mass = torch.exp(vals - _finite_row_max(vals[:, :1])).masked_fill_(~keep_s, 0.0)
        incl = _inclusive_scan(mass)
        # A top-k row's total is read at its own last kept column (k <= width).
        total = incl.gather(1, (k_eff.clamp(max=width) - 1).unsqueeze(1))
        p_only = use_p & ~use_k
        if plan.any_p_without_k:
            # Without top-k the total is the whole row's mass, summed in token-id
            # order (a fixed order set by V), whatever the width.
            full_total = _pairwise_sum(torch.exp(scaled - _finite_row_max(scaled)))
            total = torch.where(use_k.unsqueeze(1), total, full_total)
        before = torch.cat([torch.zeros_like(incl[:, :1]), incl[:, :-1]], dim=1)
        keep_p = (before < top_p.unsqueeze(1) * total) | (col == 0) | ~use_p.unsqueeze(1)
        keep_s &= keep_p
        # keep_p is a prefix of True: a top-p-only row that still keeps its last
        # column may have a nucleus reaching past the width.
        if width < vocab:
            unresolved = p_only & keep_p[:, -1]
    keep = torch.zeros((num_rows, vocab), dtype=torch.bool, device=device)
    return keep.scatter_(1, ids, keep_s), unresolved


# --------------------------------------------------------------------------- #
# Sampler
# --------------------------------------------------------------------------- #
class Sampler(torch.nn.Module):
    """temperature -> min-p -> top-k -> top-p -> Gumbel-max, plus logprobs.

    Stateless: all randomness is keyed by ``(seed, position, token id)``.

    ``fused_gumbel`` (KernelConfig.fused_gumbel): on CUDA, batches without truncation take
    one fused noise + argmax kernel (rng.gumbel_argmax) instead of six passes over [B, V].
    The two paths must never disagree, since which one runs depends on the other rows of
    the batch: test_gpu_fused_gumbel_scores_bits proves their scores equal bit for bit.
    """

    def __init__(self, fused_gumbel: bool = True):
        super().__init__()
        self.fused_gumbel = fused_gumbel

    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        mode = batch.logprobs_mode
        if mode not in LOGPROBS_MODES:
            raise ValueError(f"unknown logprobs_mode {mode!r}; expected one of {LOGPROBS_MODES}")
        num_rows, vocab = logits.shape
        device = logits.device
        want_logprobs = batch.max_num_logprobs >= 0
        num_top = min(batch.max_num_logprobs, vocab) if batch.max_num_logprobs > 0 else 0
        if num_rows == 0:
            return self._empty_output(device, want_logprobs, num_top)

        logits = logits.float()
        # The raw_* and tempered_logprobs modes report the model's own logits (tempered: over
        # the sampling temperature); greedy, sampling and the processed modes see them after
        # the request's bias, penalties and masks, as upstream's sampler does. Bias, penalties
        # and masks are the request's controls, not the policy: the trainer, which knows none
        # of them, recomputes the tempered mode bit for bit (docs/sampling.md).
        raw_logits = logits
        # logit_bias comes before the penalties (upstream's order: its logits processors, then
        # the penalties), so sampling and the processed modes see pen(x + bias)
        if batch.logit_bias is not None:
            logits = apply_logit_bias(logits, batch.logit_bias)
        if batch.penalties is not None:
            logits = apply_penalties(logits, batch.penalties)
        # Grammar masks (structured outputs), allowed_token_ids, min_tokens' and bad words'
        # bans come after the penalties and before temperature, truncation and sampling, so all
        # of them see only the allowed tokens.
        if batch.token_mask is not None:
            logits = apply_token_mask(logits, batch.token_mask)
        if batch.token_ban is not None:
            logits = apply_token_ban(logits, batch.token_ban)
        temperature = batch.temperature.to(device=device, dtype=torch.float32)
        greedy = temperature <= 0
        top_k = batch.top_k.to(device=device, dtype=torch.int64)
        top_p = batch.top_p.to(device=device, dtype=torch.float32)
        # min_p > 1 would reject even the max token; clamping keeps the max (and
        # its exact ties) in every code path.
        min_p = batch.min_p.to(device=device, dtype=torch.float32).clamp(max=1.0)
        use_k = (top_k > 0) & (top_k < vocab)
        use_p = top_p < 1.0
        use_m = min_p > 0.0

        # Batch-level decisions of which stages to run: from the host values when the
        # batch carries them (no sync), else in one host sync.  They only skip work:
        # a disabled stage leaves its row bit-identical.
        all_greedy = batch.all_greedy
        plan = _TruncationPlan()
        probes = []
        host = batch.host_params
        if host is not None and len(host.temperature) != num_rows:
            host = None  # a batch sliced or replaced after from_lists: trust only the tensors
        if host is not None:
            all_greedy, host_plan = host.plan(vocab)
            if not batch.no_truncation:
                plan = host_plan
        elif not all_greedy:
            probes.append(greedy.all())
        if not batch.no_truncation and host is None:
            probes += [use_k.any(), use_p.any(), use_m.any(), (use_p & ~use_k).any(),
                       torch.where(use_k, top_k, torch.zeros_like(top_k)).max()]
        if probes:
            values = torch.stack([p.to(torch.int64) for p in probes]).tolist()
            if not all_greedy:
                all_greedy = bool(values.pop(0))
            if not batch.no_truncation:
                plan = _TruncationPlan(*map(bool, values[:4]), max_top_k=int(values[4]))

        processed_needed = want_logprobs and mode.startswith("processed")
        truncate = plan.any and (processed_needed or not all_greedy)

        # Tempered logits.  Greedy rows divide by exactly 1.0, i.e. stay raw.
        scaled = logits if all_greedy else apply_temperature(logits, temperature)

        keep = None
        if truncate:
            keep = _keep_mask(scaled, plan, top_k, top_p, min_p, use_k, use_p, use_m)

        # ---- sample ---------------------------------------------------------
        greedy_ids = logits.argmax(dim=-1)  # first (lowest) id among ties
        if all_greedy:
            token_ids = greedy_ids
        else:
            # scores = scaled + g with g = -log(-log(u)), computed in place as
            # scaled - log(-log(u)) (a - b is a + (-b) exactly): one pass fewer.
            if keep is None and self.fused_gumbel and device.type == "cuda":
                # one pass instead of six over [B, V]; its scores equal the unfused path's
                # bit for bit (tests/test_sampler.py::test_gpu_fused_gumbel_scores_bits)
                sampled = gumbel_argmax(scaled, batch.seeds, batch.positions)
            else:
                scores = uniform_noise(batch.seeds, batch.positions, vocab, device)
                scores.log_().neg_().log_()
                torch.sub(scaled, scores, out=scores)
                if keep is not None:
                    scores.masked_fill_(~keep, _NEG_INF)
                sampled = scores.argmax(dim=-1)
                del scores
            token_ids = torch.where(greedy, greedy_ids, sampled)

        if not want_logprobs:
            return SamplerOutput(token_ids=token_ids)

        # ---- logprobs -------------------------------------------------------
        if mode == "raw_logits":
            dist = raw_logits
        elif mode == "raw_logprobs":
            dist = batch_invariant_log_softmax(raw_logits)
        elif mode == "tempered_logprobs":
            if raw_logits is not logits:  # the request's controls acted: the model's own logits, tempered
                scaled = raw_logits if all_greedy else apply_temperature(raw_logits, temperature)
            dist = batch_invariant_log_softmax(scaled)
        else:
            processed = scaled if keep is None else scaled.masked_fill(~keep, _NEG_INF)
            dist = processed if mode == "processed_logits" else batch_invariant_log_softmax(processed)

        token_values = dist.gather(1, token_ids.unsqueeze(1))
        # Integer count of strictly greater values: exact, so batch-invariant.
        ranks = (dist > token_values).sum(dim=-1) + 1
        out = SamplerOutput(token_ids=token_ids, logprobs=token_values.squeeze(1), ranks=ranks)
        if num_top > 0:
            out.topk_logprobs, out.topk_ids = stable_topk(dist, num_top)
        return out

    @staticmethod
    def _empty_output(device, want_logprobs: bool, num_top: int) -> SamplerOutput:
        ids = torch.empty(0, dtype=torch.int64, device=device)
        if not want_logprobs:
            return SamplerOutput(token_ids=ids)
        out = SamplerOutput(
            token_ids=ids,
            logprobs=torch.empty(0, dtype=torch.float32, device=device),
            ranks=torch.empty(0, dtype=torch.int64, device=device),
        )
        if num_top > 0:
            out.topk_ids = torch.empty((0, num_top), dtype=torch.int64, device=device)
            out.topk_logprobs = torch.empty((0, num_top), dtype=torch.float32, device=device)
        return out
