"""The trainer's logprob head: hidden rows -> log_softmax(logits / T)[target], fused and
chunked so the [rows, vocab] float32 logits are never all held at once.

Forward, `rows_per_chunk` rows at a time: the model's own `compute_logits` (the
rollout's lm_head kernel, float32 out) on those rows, then the sampler's
`tempered_target_logprobs`: `tempered_logprobs` evaluated at the target column only,
with the same operations in the same order on the same values (apply_temperature's
division, the exact row max, the pairwise sum of exp, one subtraction). Both the GEMM and the
log-softmax compute each row from that row alone (the GEMM's rows do not depend on how
many rows it is given: the invariance the engine is built on), so cutting the rows into
chunks cannot change a bit; tests/test_logprob_head.py compares bit patterns against
the unchunked path on CPU and GPU.

Backward (custom, gradients need not be batch-invariant): nothing of size [rows,
vocab] was saved, only the rows' log-sum-exp. The vocabulary is walked in column blocks:
logits for the block are recomputed by a plain GEMM with a float32 output, turned into
d logits = g / T * (onehot - softmax) by one kernel (vllm/kernels/logprob_grad.py), and
then dW[block] = d^T h (written once: no cross-block accumulation of the weight
gradient) and dh += d W[block] (float32 accumulator of [rows, hidden]).

Valid for heads whose logits are `hidden @ weight.T` (the `LMHead` of every model here;
tied or not): `weight` is passed in so the gradient reaches it.
"""
from __future__ import annotations

from typing import Callable

import torch

from vllm.kernels.logprob_grad import logprob_grad_block
from vllm.sample.sampler import apply_temperature, tempered_target_logprobs

# float32 logits held at once, forward (per row chunk) and backward (per vocab block)
LOGITS_CHUNK_BYTES = 1 << 29
# float32 held at once beside a chunk's logits while its rows' entropy is taken
ENTROPY_BLOCK_BYTES = 1 << 26


def rows_per_chunk(vocab_size: int, budget_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Rows whose float32 logits fit in the budget (a multiple of 128 when that many fit)."""
    rows = max(1, budget_bytes // (4 * vocab_size))
    return rows - rows % 128 if rows >= 128 else rows


def _forward_chunks(hidden, targets, temperature, logits_fn, chunk_rows, with_entropy=False):
    R = hidden.shape[0]
    lp = torch.empty(R, dtype=torch.float32, device=hidden.device)
    lse = torch.empty(R, dtype=torch.float32, device=hidden.device)
    ent = torch.empty(R if with_entropy else 0, dtype=torch.float32, device=hidden.device)
    chunk_rows = _even_split(R, chunk_rows)
    for a in range(0, R, chunk_rows):
        b = min(R, a + chunk_rows)
        logits = logits_fn(hidden[a:b])
        lp[a:b], lse[a:b] = tempered_target_logprobs(logits, temperature, targets[a:b])
        if with_entropy:
            ent[a:b] = _entropy(logits, temperature, lse[a:b])
    return lp, lse, ent


def _entropy(logits: torch.Tensor, temperature, lse: torch.Tensor) -> torch.Tensor:
    """-sum_v p log p of softmax(logits / T) per row, float32 (a metric, outside every
    gradient and every parity claim): log p = logits / T - lse (lse: the rows' log-sum-exp of
    logits / T; subtracted before the sum, not after it, which would cancel two large terms),
    in row blocks of at most ENTROPY_BLOCK_BYTES of float32."""
    rows = max(1, ENTROPY_BLOCK_BYTES // (4 * max(1, logits.shape[1])))
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for a in range(0, logits.shape[0], rows):
        logp = apply_temperature(logits[a:a + rows], temperature).sub_(lse[a:a + rows, None])
        out[a:a + rows] = -(torch.exp(logp).mul_(logp)).sum(-1)
    return out


def _even_split(n: int, most: int, multiple: int = 1) -> int:
    """The size of equal parts (a multiple of `multiple` where that does not exceed n)
    covering n with as few parts of at most `most` as possible: no small remainder part."""
    parts = -(-n // max(most, 1))
    size = -(-n // max(parts, 1))
    size = -(-size // multiple) * multiple
    return max(1, min(size, n))


def _mm_float(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """a @ b with a float32 (float64 for float64 inputs) result; bf16/fp16 CUDA inputs stay
    in their dtype on the tensor cores with a float32 output."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.to(acc) @ b.to(acc)


class LogprobHeadFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, temperature_value, logits_fn, chunk_rows, with_entropy):
        lp, lse, ent = _forward_chunks(hidden, targets, temperature, logits_fn, chunk_rows, with_entropy)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature = temperature_value
        ctx.chunk_rows = chunk_rows
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g, _g_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        R, H = hidden.shape
        V = weight.shape[0]
        T = ctx.temperature
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        # the GEMM operand dtype: the weight's on the GPU's tensor cores, acc on the CPU
        d_dtype = weight.dtype if (hidden.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)) else acc
        row_scale = g.to(acc) / T
        dh = torch.zeros((R, H), dtype=acc, device=hidden.device) if need_h else None
        dw = torch.empty_like(weight) if need_w else None
        h_op = hidden.to(d_dtype)
        # vocab columns per block: about the float32 budget of the forward's row chunks
        cols = _even_split(V, max(1, (ctx.chunk_rows * V) // max(R, 1)), 128)
        for v0 in range(0, V, cols):
            v1 = min(V, v0 + cols)
            w_blk = weight[v0:v1]
            logits = _mm_float(hidden, w_blk.t(), acc)
            d = logprob_grad_block(logits, lse, targets, row_scale, v0, T, d_dtype)
            del logits
            if need_w:  # one GEMM over all rows per block: a single rounding of dW
                if d_dtype == weight.dtype:
                    torch.mm(d.t(), h_op, out=dw[v0:v1])
                else:
                    dw[v0:v1] = d.t() @ h_op
            if need_h:
                dh += _mm_float(d, w_blk.to(d_dtype), acc)
        return (dh.to(hidden.dtype) if need_h else None), dw, None, None, None, None, None, None


def token_logprobs_head(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        temperature: torch.Tensor, temperature_value: float,
                        logits_fn: Callable[[torch.Tensor], torch.Tensor],
                        chunk_rows: int | None = None, with_entropy: bool = False):
    """log_softmax(logits_fn(hidden) / T)[r, targets[r]] for every row r, float32 [R].

    `logits_fn(h)` must equal `h @ weight.T` in float32 (the model's compute_logits with
    its lm_head weight); `temperature` is the device tensor the division uses (the
    sampler's exact IEEE division), `temperature_value` the same value as a float for the
    backward. Differentiable w.r.t. hidden and weight. `chunk_rows`: rows per forward
    chunk (default: what fits LOGITS_CHUNK_BYTES). `with_entropy`: also each row's entropy
    of softmax(logits / T), float32 [R], not differentiable: returns (logprobs, entropy)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [R, H] and targets [R], got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    chunk = chunk_rows or rows_per_chunk(weight.shape[0])
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        lp, ent = LogprobHeadFn.apply(hidden, weight, targets, temperature, temperature_value, logits_fn, chunk,
                                      with_entropy)
    else:
        with torch.no_grad():
            lp, _, ent = _forward_chunks(hidden, targets, temperature, logits_fn, chunk, with_entropy)
    return (lp, ent) if with_entropy else lp
