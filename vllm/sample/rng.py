"""Counter-based random numbers for the sampler.

Every random number the sampler uses is a pure function of
``(seed, position, token_id)``: there is no ``torch.Generator`` and no hidden
state, so a request's noise does not depend on which other requests share its
batch, on the order of rows, on how many tokens were sampled before, or on the
device's RNG offset.  Recomputing a token (after a preemption, or in a test)
reproduces it exactly.

The hash is done with plain vectorised torch ``int64`` ops.  Torch's int64
multiplication wraps silently on overflow and its right shift is arithmetic;
instead of relying on that (signed overflow is undefined behaviour in the C++
that implements the CPU kernels), every value is kept in ``[0, 2**32)`` and the
multipliers are odd constants below ``2**31``, so no product ever reaches
``2**63``.  Reducing modulo ``2**32`` is a ``& 0xFFFFFFFF`` after each product.
All integer work is therefore exact and gives identical bits on every device.

Only the final ``-log(-log(u))`` of :func:`gumbel_noise` is floating point; the
uniform ``u`` itself is exact (an odd integer below ``2**24`` times ``2**-24``),
so CPU and GPU agree on ``u`` bit for bit and may differ by an ulp only in the
logarithms (the CPU uses SLEEF/libm, CUDA uses its own ``logf``).
"""
from __future__ import annotations

import torch

try:  # Triton is only used to run the same integer hash faster on CUDA.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without triton
    triton = None

_MASK32 = 0xFFFFFFFF

# Multipliers of the xorshift-multiply finalizer (murmur3-fmix style, the
# well-known "splitmix32" output function constants).  Both are odd (so each
# multiply is a bijection mod 2**32) and below 2**31 (so a 32-bit value times
# either one is below 2**63: no int64 overflow anywhere).
_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97

# Initial values of the two independent key chains (any distinct constants).
_KEY_INIT_A = 0x9E3779B9
_KEY_INIT_B = 0x85EBCA6B

# Elements per chunk when hashing a [B, V] block: bounds the two int64
# temporaries to 2 * 8 * 2**24 bytes = 256 MiB whatever B * V is.  Chunking is
# by whole rows and every op is elementwise, so it never changes a result.
_DEFAULT_CHUNK_ELEMS = 1 << 24


def _mix32(x: torch.Tensor, tmp: torch.Tensor | None = None) -> torch.Tensor:
    """In-place 32-bit avalanche mix of an int64 tensor holding values in [0, 2**32).

    ``tmp`` is an optional scratch tensor of x's shape, so the shifts do not
    allocate a fresh [B, V] int64 tensor each time.
    """
    if tmp is None:
        tmp = torch.empty_like(x)
    # Values are non-negative, so torch's arithmetic right shift is a logical shift.
    torch.bitwise_right_shift(x, 16, out=tmp)
    x.bitwise_xor_(tmp)
    x.mul_(_MUL1).bitwise_and_(_MASK32)
    torch.bitwise_right_shift(x, 15, out=tmp)
    x.bitwise_xor_(tmp)
    x.mul_(_MUL2).bitwise_and_(_MASK32)
    torch.bitwise_right_shift(x, 15, out=tmp)
    x.bitwise_xor_(tmp)
    return x


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Derive two 32-bit per-row keys ``(a, b)`` from int64 ``(seed, position)``.

    Both 64-bit inputs are split into 32-bit words (negative seeds are fine:
    the arithmetic shift + mask yields their two's-complement words) and fed
    through two independently initialised mix chains, so distinct
    ``(seed, position)`` pairs collide with probability ~2**-63.
    ``a`` is forced odd and below 2**31: it is used as a multiplier.
    """
    s = seeds.to(torch.int64)
    p = positions.to(torch.int64)
    words = (
        s & _MASK32,
        (s >> 32) & _MASK32,
        p & _MASK32,
        (p >> 32) & _MASK32,
    )

    def chain(init: int) -> torch.Tensor:
        h = torch.full_like(s, init)
        for w in words:
            h = _mix32(h.bitwise_xor_(w))
        return h

    a = chain(_KEY_INIT_A).bitwise_or_(1).bitwise_and_(0x7FFFFFFF)
    b = chain(_KEY_INIT_B)
    return a, b


def _hash_bits_into(x: torch.Tensor, tmp: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    token_ids: torch.Tensor) -> torch.Tensor:
    """Fill int64 ``x`` [R, V] with 32-bit hashes of (row key, token id)."""
    # (v * a) mod 2**32 is a bijection of v (a is odd) and the row-dependent
    # multiplier keeps two rows' streams from being shifted copies of each other;
    # xor with b then the mix make every bit depend on every input bit.
    # v < 2**32 and a < 2**31, so the product is below 2**63.
    torch.mul(token_ids.unsqueeze(0), a.unsqueeze(1), out=x)
    x.bitwise_and_(_MASK32).bitwise_xor_(b.unsqueeze(1))
    return _mix32(x, tmp)


if triton is not None:

    @triton.jit
    def _mix32_u32(x, mul1, mul2):
        x = x ^ (x >> 16)
        x = x * mul1
        x = x ^ (x >> 15)
        x = x * mul2
        return x ^ (x >> 15)

    @triton.jit
    def _key_chain_u32(init, s_lo, s_hi, p_lo, p_hi, mul1, mul2):
        h = _mix32_u32(init ^ s_lo, mul1, mul2)
        h = _mix32_u32(h ^ s_hi, mul1, mul2)
        h = _mix32_u32(h ^ p_lo, mul1, mul2)
        return _mix32_u32(h ^ p_hi, mul1, mul2)

    @triton.jit
    def _row_keys_u32(seed_ptr, pos_ptr, row, mul1, mul2, init_a_arg, init_b_arg):
        """:func:`row_keys` for one row: (a, b) as uint32. int64 -> uint32 truncation keeps
        the low word; >> 32 (arithmetic) then truncation gives the high word, as the torch
        path's shift-and-mask."""
        seed = tl.load(seed_ptr + row)  # int64
        pos = tl.load(pos_ptr + row)
        s_lo = seed.to(tl.uint32)
        s_hi = (seed >> 32).to(tl.uint32)
        p_lo = pos.to(tl.uint32)
        p_hi = (pos >> 32).to(tl.uint32)
        a = _key_chain_u32(init_a_arg.to(tl.uint32), s_lo, s_hi, p_lo, p_hi, mul1, mul2)
        b = _key_chain_u32(init_b_arg.to(tl.uint32), s_lo, s_hi, p_lo, p_hi, mul1, mul2)
        return (a | 1) & 0x7FFFFFFF, b

    @triton.jit
    def _uniform_u32(cols, a, b, mul1, mul2):
        """u for token ids `cols` of the row with keys (a, b): :func:`_hash_bits_into` + the uniform map."""
        x = _mix32_u32((cols.to(tl.uint32) * a) ^ b, mul1, mul2)
        return ((x >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)

    @triton.jit
    def _uniform_kernel(out_ptr, seed_ptr, pos_ptr, V, stride_out,
                        mul1_arg, mul2_arg, init_a_arg, init_b_arg, BLOCK: tl.constexpr):
        """:func:`row_keys` + :func:`_hash_bits_into` + the uniform map, fused.

        Native uint32 arithmetic wraps mod 2**32 by definition and ``>>`` on
        uint32 is logical: exactly what the torch path computes with masks, so
        both give identical bits (tested).  Constants come in as arguments and
        are truncated to uint32 to avoid any literal-promotion subtleties.
        Each program recomputes its row's keys (a few scalar ops) so that no
        separate key kernels need launching.
        """
        row = tl.program_id(0)
        mul1 = mul1_arg.to(tl.uint32)
        mul2 = mul2_arg.to(tl.uint32)
        a, b = _row_keys_u32(seed_ptr, pos_ptr, row, mul1, mul2, init_a_arg, init_b_arg)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        u = _uniform_u32(cols, a, b, mul1, mul2)
        tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, u, mask=cols < V)


if triton is not None:
    try:
        from triton.language.extra.cuda import libdevice as _libdevice
    except ImportError:  # pragma: no cover
        _libdevice = None

    @triton.jit
    def _gumbel_argmax_kernel(scaled_ptr, stride_row, seed_ptr, pos_ptr, out_ptr, scores_ptr, V,
                              mul1_arg, mul2_arg, init_a_arg, init_b_arg,
                              BLOCK: tl.constexpr, PRECISE_LOG: tl.constexpr, WRITE_SCORES: tl.constexpr):
        """argmax_v(scaled[row, v] - log(-log(u[row, v]))), the lowest v among ties, in one
        pass over the row: the noise is generated in registers (same hash and uniform map
        as _uniform_kernel) instead of being written, logged twice and re-read.
        PRECISE_LOG uses libdevice's logf, the function torch's CUDA `log_` calls, so that
        the scores equal the unfused path's bit for bit (checked on the GPU by
        tests/test_sampler.py before the sampler may use this kernel)."""
        row = tl.program_id(0)
        mul1 = mul1_arg.to(tl.uint32)
        mul2 = mul2_arg.to(tl.uint32)
        a, b = _row_keys_u32(seed_ptr, pos_ptr, row, mul1, mul2, init_a_arg, init_b_arg)
        best_val = -float("inf")
        best_idx = 0
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            u = _uniform_u32(cols, a, b, mul1, mul2)
            if PRECISE_LOG:
                g = _libdevice.log(-_libdevice.log(u))
            else:
                g = tl.log(-tl.log(u))
            sc = tl.load(scaled_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < V, other=-float("inf"))
            score = tl.where(cols < V, sc - g, -float("inf"))
            if WRITE_SCORES:  # tests only: the scores themselves, to compare bits with the unfused path
                tl.store(scores_ptr + row.to(tl.int64) * V + cols, score, mask=cols < V)
            m = tl.max(score, axis=0)
            i = tl.argmax(score, axis=0, tie_break_left=True)
            take = m > best_val  # strictly greater: an earlier block keeps its tie
            best_idx = tl.where(take, start + i, best_idx)
            best_val = tl.where(take, m, best_val)
        tl.store(out_ptr + row, best_idx.to(tl.int64))


def gumbel_argmax(scaled: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  block: int = 2048, scores_out: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids ``argmax(scaled - log(-log(u)))`` per row (first index among ties), fused:
    the same values as ``uniform_noise`` + ``log_().neg_().log_()`` + ``sub`` + ``argmax``
    where the logarithms agree (see _gumbel_argmax_kernel)."""
    if triton is None:
        raise RuntimeError("gumbel_argmax needs triton")
    scaled = scaled.contiguous() if scaled.stride(-1) != 1 else scaled
    B, V = scaled.shape
    out = torch.empty(B, dtype=torch.int64, device=scaled.device)
    if B == 0:
        return out
    seeds = seeds.to(device=scaled.device, dtype=torch.int64).contiguous()
    positions = positions.to(device=scaled.device, dtype=torch.int64).contiguous()
    precise = scaled.device.type == "cuda" and _libdevice is not None
    _gumbel_argmax_kernel[(B,)](scaled, scaled.stride(0), seeds, positions, out,
                                scores_out if scores_out is not None else out, V,
                                _MUL1, _MUL2, _KEY_INIT_A, _KEY_INIT_B, BLOCK=block, PRECISE_LOG=precise,
                                WRITE_SCORES=scores_out is not None, enable_fp_fusion=True)
    return out


def _use_triton(device: torch.device, impl: str) -> bool:
    if impl == "torch":
        return False
    ok = triton is not None and device.type == "cuda"
    if impl == "triton" and not ok:
        raise RuntimeError("the triton noise kernel needs triton and a CUDA device")
    return ok


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int,
                  device: torch.device | str | None = None, *, out: torch.Tensor | None = None,
                  chunk_elems: int = _DEFAULT_CHUNK_ELEMS, impl: str = "auto") -> torch.Tensor:
    """Uniform noise ``u[b, v]`` in the open interval (0, 1) for each (row, token id).

    ``u[b, v]`` depends only on ``(seeds[b], positions[b], v)``.  Values lie on
    the grid ``(2k + 1) * 2**-24`` for ``k`` in ``[0, 2**23)``: strictly inside
    (0, 1) (min 2**-24, max 1 - 2**-24), symmetric around 0.5, and exactly
    representable in float32, so they are bit-identical on every device.

    Returns a float32 tensor [B, vocab_size] (written into ``out`` if given).
    ``impl``: "torch" (int64 ops, any device), "triton" (one fused kernel, CUDA
    only) or "auto" (triton on CUDA when available).  Both give identical bits.
    """
    if device is None:
        device = out.device if out is not None else seeds.device
    device = torch.device(device)
    if not 0 <= vocab_size < 2**32:
        raise ValueError(f"vocab_size must be in [0, 2**32), got {vocab_size}")
    seeds = seeds.to(device=device, dtype=torch.int64).reshape(-1).contiguous()
    positions = positions.to(device=device, dtype=torch.int64).reshape(-1).contiguous()
    if seeds.shape != positions.shape:
        raise ValueError("seeds and positions must have the same length")
    num_rows = seeds.shape[0]
    if out is None:
        out = torch.empty((num_rows, vocab_size), dtype=torch.float32, device=device)
    if num_rows == 0 or vocab_size == 0:
        return out

    if _use_triton(device, impl) and out.stride(1) == 1:
        block = 1024
        grid = (num_rows, triton.cdiv(vocab_size, block))
        _uniform_kernel[grid](out, seeds, positions, vocab_size, out.stride(0),
                              _MUL1, _MUL2, _KEY_INIT_A, _KEY_INIT_B, BLOCK=block, enable_fp_fusion=True)
        return out

    a, b = row_keys(seeds, positions)

    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    rows_per_chunk = max(1, min(num_rows, chunk_elems // vocab_size))
    x_buf = torch.empty((rows_per_chunk, vocab_size), dtype=torch.int64, device=device)
    tmp_buf = torch.empty_like(x_buf)
    for start in range(0, num_rows, rows_per_chunk):
        stop = min(num_rows, start + rows_per_chunk)
        x, tmp = x_buf[: stop - start], tmp_buf[: stop - start]
        _hash_bits_into(x, tmp, a[start:stop], b[start:stop], token_ids)
        # Top 23 bits -> odd integer 2k+1 < 2**24 -> exact float32 -> times 2**-24 (exact).
        x.bitwise_right_shift_(9).mul_(2).add_(1)
        out[start:stop].copy_(x)
    return out.mul_(2.0**-24)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int,
                 device: torch.device | str | None = None, *,
                 chunk_elems: int = _DEFAULT_CHUNK_ELEMS, impl: str = "auto") -> torch.Tensor:
    """Standard Gumbel noise ``g = -log(-log(u))`` with ``u`` from :func:`uniform_noise`.

    Since ``u`` is in [2**-24, 1 - 2**-24], ``g`` is finite, in about
    [-2.81, 16.6].  The float logs are elementwise, so each value depends only on
    its own ``u`` (never on the batch), though CPU and GPU may differ by an ulp.
    """
    g = uniform_noise(seeds, positions, vocab_size, device, chunk_elems=chunk_elems, impl=impl)
    # In place: log(u) < 0, negate -> Exp(1) sample > 0, log, negate -> Gumbel.
    return g.log_().neg_().log_().neg_()
