"""Chunked Mamba-2 scan (vllm/kernels/mamba2_chunk.py) and its ops (vllm/kernels/mamba2_ops.py):
float64 references, bit-pattern invariance across batches and step cuts (aligned mode),
fast-mode accuracy, gradients.

On CPU the Triton kernels run under TRITON_INTERPRET=1 at tiny dims; the torch entry is
what the CPU engine runs. Parity claims compare bits (int views), never allclose.
"""
from __future__ import annotations

import functools
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

from vllm.forward_context import StateMetadata
from vllm.kernels.mamba2_chunk import Mamba2ChunkScanFn, mamba2_chunk_torch, mamba2_chunk_triton, mamba2_reference
from vllm.kernels.mamba2_ops import (GatedNormFn, gated_norm_torch, gated_norm_triton, selective_state_update_torch,
                                     selective_state_update_triton)
from vllm.testing.chunked_scan import (DEVICE as DEV, INVARIANCE_CASES, REAL_DIMS_LENS, REAL_DIMS_SLOTS, X_LEN,
                                       assert_cuts_match_alone, assert_fast_decode_differs,
                                       assert_real_dims_schedules_agree, assert_rounded_state, assert_runs_close,
                                       assert_schedules_agree, assert_unused_slots_untouched, bits,
                                       invariance_schedules,
                                       nan_state, real_dims_schedules, rel_err, run_steps, step_metadata, used_ids)

H, P, G, N, C = 4, 16, 2, 16, 16
DT_MIN = 1e-3
IMPLS = {"torch": mamba2_chunk_torch, "triton": mamba2_chunk_triton}
SSU = {"torch": selective_state_update_torch, "triton": selective_state_update_triton}


def params(h=H, seed=99, dtype=torch.float32):
    """(dt_bias, A_log, D) per head: A in -[0.5, 4.5], dt around softplus(-2)."""
    g = torch.Generator().manual_seed(seed)
    dt_bias = 0.5 * torch.randn(h, generator=g)
    A_log = torch.log(0.5 + 4 * torch.rand(h, generator=g))
    D = torch.randn(h, generator=g)
    return tuple(t.to(dtype).to(DEV) for t in (dt_bias, A_log, D))


def make_inputs(T, h=H, p=P, g=G, n=N, seed=0, dtype=torch.float32):
    """(x, dt, B, C), as the layer passes them: views of one projection row (contiguous rows at
    a row stride wider than the row)."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.randn(T, h * p + 2 * g * n + h + 8, generator=gen)
    row[:, h * p + 2 * g * n:h * p + 2 * g * n + h] -= 2.0  # dt before softplus, around -2
    row = row.to(dtype)
    x = row[:, :h * p].view(T, h, p)
    B = row[:, h * p:h * p + g * n].view(T, g, n)
    Cm = row[:, h * p + g * n:h * p + 2 * g * n].view(T, g, n)
    dt = row[:, h * p + 2 * g * n:h * p + 2 * g * n + h]
    return x, dt, B, Cm


def recurrence64(x, dt, B, Cm, dt_bias, A_log, D, cu):
    """The per-token recurrence, float64."""
    x, dt, B, Cm = (t.double().cpu() for t in (x, dt, B, Cm))
    d = torch.clamp(F.softplus(dt + dt_bias.double().cpu()), min=DT_MIN)
    A = -torch.exp(A_log.double().cpu())
    R = x.shape[1] // B.shape[1]
    y = torch.zeros_like(x)
    for s in range(len(cu) - 1):
        S = torch.zeros(x.shape[1], x.shape[2], B.shape[2], dtype=torch.float64)
        for t in range(cu[s], cu[s + 1]):
            bh, ch = B[t].repeat_interleave(R, 0), Cm[t].repeat_interleave(R, 0)
            S = S * torch.exp(d[t] * A)[:, None, None] + (d[t][:, None] * x[t])[:, :, None] * bh[:, None, :]
            y[t] = (S * ch[:, None, :]).sum(-1) + D.double().cpu()[:, None] * x[t]
    return y


def ref64(x, dt, B, Cm, prm, cu, chunk=C):
    return mamba2_reference(*(t.double().cpu() for t in (x, dt, prm[0], prm[1], B, Cm, prm[2])), DT_MIN, cu, chunk)


def new_state(num_slots, dtype, aligned, h, p, g, n, chunk=C):
    """A NaN-filled cache: the state and, aligned, the rows of a partial chunk."""
    bufs = {"buf_x": ((chunk, h, p), dtype), "buf_B": ((chunk, g, n), dtype), "buf_dt": ((chunk, h), torch.float32),
            "ssm_rounded": ((h, p, n), dtype)}
    return nan_state(num_slots, {"ssm": ((h, p, n), torch.float32), **(bufs if aligned else {})})


def _cat_rows(parts):
    """Concatenate per-sequence slices of (x, dt, B, C) into one step, keeping the layer's
    layout (views of one wider row)."""
    x, dt, B, Cm = (torch.cat([p[i] for p in parts]) for i in range(4))
    T, h, p = x.shape
    g, n = B.shape[1:]
    row = torch.cat((x.reshape(T, -1), B.reshape(T, -1), Cm.reshape(T, -1), dt, x.new_zeros(T, 8)), 1).to(DEV)
    return (row[:, :h * p].view(T, h, p), row[:, h * p + 2 * g * n:h * p + 2 * g * n + h],
            row[:, h * p:h * p + g * n].view(T, g, n), row[:, h * p + g * n:h * p + 2 * g * n].view(T, g, n))


def run_schedule(op, seqs, prm, slots, schedule, aligned, num_slots=4, chunk=C):
    """Run `schedule` through `op` with a cache (chunked_scan.run_steps), each step in the
    layer's layout (_cat_rows). seqs: {id: (x, dt, B, C)}. Returns ({id: outputs}, state)."""
    x0, _, b0, _ = next(iter(seqs.values()))
    state = new_state(num_slots, x0.dtype, aligned, x0.shape[1], x0.shape[2], b0.shape[1], b0.shape[2], chunk)

    def step(inputs, md):
        x, dt, B, Cm = inputs
        return op(x, dt, prm[0], prm[1], B, Cm, prm[2], DT_MIN, md, state, chunk_size=chunk, aligned=aligned)
    outs = run_steps(step, seqs, slots, schedule, join=_cat_rows)
    if op is not mamba2_chunk_triton or DEV != "cpu":
        # Triton's interpreter rounds fp32 to bf16 toward zero (the GPU and torch: to nearest
        # even), so on the CPU the kernels' rounded state is checked through the outputs only
        assert_rounded_state(state, set(slots.values()))
    return outs, state


# ---- 1. the reference ---------------------------------------------------------------------------

def test_reference_matches_recurrence_and_transformers():
    import inspect

    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan
    mamba2_chunk_scan = inspect.unwrap(mamba2_chunk_scan)  # its torch form, even where mamba_ssm is installed
    cu = [0, 37, 42, 62]
    prm = params()
    x, dt, B, Cm = make_inputs(cu[-1], seed=1)
    ref = ref64(x, dt, B, Cm, prm, cu)
    rec = recurrence64(x, dt, B, Cm, *prm, cu)
    assert rel_err(ref, rec) < 1e-13
    # the chunk size is an implementation detail of the reference
    for c in (4, 64):
        assert rel_err(ref64(x, dt, B, Cm, prm, cu, chunk=c), rec) < 1e-13
    # transformers' torch form (it computes in float32 whatever it is given)
    dt_bias, A_log, D = (t.double().cpu() for t in prm)
    for s in range(len(cu) - 1):
        sl = slice(cu[s], cu[s + 1])
        hf = mamba2_chunk_scan(x[None, sl].double(), dt[None, sl].double(), -torch.exp(A_log), B[None, sl].double(),
                               Cm[None, sl].double(), chunk_size=C, D=D, dt_bias=dt_bias, dt_softplus=True,
                               dt_limit=(DT_MIN, float("inf")))
        assert rel_err(ref[sl], hf[0]) < 1e-5


def test_reference_gradcheck():
    prm = [t.double().cpu().requires_grad_() for t in params(h=2)]
    x, dt, B, Cm = (t.double().contiguous().requires_grad_() for t in make_inputs(7, h=2, p=3, g=1, n=2, seed=2))
    assert torch.autograd.gradcheck(
        lambda x, dt, b, c, *p: mamba2_reference(x, dt, p[0], p[1], b, c, p[2], DT_MIN, [0, 4, 7], 2),
        (x, dt, B, Cm, *prm))


# ---- 2. both implementations against the float64 reference --------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("aligned,chunk", [(True, C), (False, C), (True, 32)])
def test_prefill_matches_reference(impl, aligned, chunk):
    cu = [0, 37, 42, 62]
    prm = params()
    x, dt, B, Cm = (t.to(DEV) for t in make_inputs(cu[-1], seed=3))
    y = IMPLS[impl](x, dt, prm[0], prm[1], B, Cm, prm[2], DT_MIN, step_metadata([0, 0, 0], [37, 5, 20]), None,
                    chunk_size=chunk, aligned=aligned)
    assert y.dtype == torch.float32
    assert rel_err(y.cpu(), ref64(x, dt, B, Cm, prm, cu)) < 1e-5


def test_row_strided_views_are_read_in_place_with_the_bits_of_copies():
    """x, B, C, dt as views of a projection row whose stride is a multiple of 16 elements (and
    16-byte aligned) are read in place, not copied, and give the bits of contiguous copies."""
    from vllm.kernels.chunk_tiles import rows_aligned16
    T = 40
    prm = params(dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(8)
    row = torch.randn(T, 144, generator=gen).to(torch.bfloat16).to(DEV)   # 132 columns used
    x = row[:, :H * P].view(T, H, P)
    B = row[:, H * P:H * P + G * N].view(T, G, N)
    Cm = row[:, H * P + G * N:H * P + 2 * G * N].view(T, G, N)
    dt = row[:, H * P + 2 * G * N:H * P + 2 * G * N + H]
    assert all(rows_aligned16(t) is t for t in (x, B, Cm, dt))
    md = step_metadata([0, 0], [23, 17])
    ys = [mamba2_chunk_triton(*(t.contiguous().clone() if copy else t for t in (x, dt, prm[0], prm[1], B, Cm)),
                              prm[2], DT_MIN, md, None, chunk_size=C, aligned=True) for copy in (False, True)]
    assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16))


@pytest.mark.parametrize("T", [1, 5])
def test_row_stride_divisible_by_16_for_every_step(T):
    """What the kernels get from rows_aligned16 specialises one way for every step: a 16-byte
    aligned pointer and a row stride divisible by 16, for a one-token step's views (whose row
    stride torch sets as it likes) as for a prefill's, read in place or copied."""
    from vllm.kernels.chunk_tiles import rows_aligned16
    for width in (37, 48, 70):
        row = torch.randn(T, width)
        for t in (row[:, 3:7], row[:, :32].view(T, 2, 16), row[:, 4:36].view(T, 2, 16), row[:, :32].clone()):
            got = rows_aligned16(t)
            assert got.stride(0) % 16 == 0 and got.data_ptr() % 16 == 0 and torch.equal(got, t)
            assert got.stride()[1:] == torch.empty(t.shape[1:]).stride()


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_and_padded_dims(impl):
    """bf16 inputs and parameters, head_dim and d_state multiples of 16 that are not powers of
    two (padded tiles), one group per two heads."""
    prm = params(dtype=torch.bfloat16)
    x, dt, B, Cm = (t.to(DEV) for t in make_inputs(40, p=48, n=48, seed=4, dtype=torch.bfloat16))
    y = IMPLS[impl](x, dt, prm[0], prm[1], B, Cm, prm[2], DT_MIN, step_metadata([0, 0], [23, 17]), None,
                    chunk_size=C, aligned=True)
    assert y.dtype == torch.bfloat16
    assert rel_err(y.cpu(), ref64(x, dt, B, Cm, prm, [0, 23, 40])) < 2e-2


# ---- 3. invariance (aligned): batches and step cuts ----------------------------------------------

def _x_seqs(dtype):
    return {"x": make_inputs(X_LEN, seed=10, dtype=dtype), "y": make_inputs(60, seed=11, dtype=dtype),
            "z": make_inputs(31, seed=12, dtype=dtype)}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", INVARIANCE_CASES)
def test_invariance(impl, case):
    dtype, names, tol = INVARIANCE_CASES[case]
    seqs, prm = _x_seqs(dtype), params(dtype=dtype)

    def run(used, slots, steps):
        return run_schedule(IMPLS[impl], {s: seqs[s] for s in used}, prm, slots, steps, aligned=True)
    assert_schedules_agree(run, names, ("buf_x", "buf_B", "buf_dt"), C, ref64(*seqs["x"], prm, [0, X_LEN]), tol)


@pytest.mark.parametrize("impl", IMPLS)
def test_every_cut_point(impl):
    """A prefill cut at any point (two steps), and after it the rest as decode steps, gives the
    whole prefill's bits (the Triton interpreter takes the cuts around the chunk boundaries)."""
    seqs = _x_seqs(torch.float32)
    prm = params()
    whole, whole_state = run_schedule(IMPLS[impl], {"x": seqs["x"]}, prm, {"x": 1}, [[("x", X_LEN)]], aligned=True)
    for cut in range(1, X_LEN) if impl == "torch" else (15, 16, 17, 31, 32, 40):
        for rest in ([[("x", X_LEN - cut)]], [[("x", 1)]] * (X_LEN - cut)):
            got, state = run_schedule(IMPLS[impl], {"x": seqs["x"]}, prm, {"x": 1}, [[("x", cut)]] + rest,
                                      aligned=True)
            assert torch.equal(bits(got["x"]), bits(whole["x"])), cut
            assert torch.equal(bits(state["ssm"][1]), bits(whole_state["ssm"][1])), cut


@pytest.mark.parametrize("impl", IMPLS)
def test_training_forward_equals_rollout(impl):
    """No cache (the trainer) gives the bits of the cached prefill and of decode steps."""
    seqs = _x_seqs(torch.float32)
    prm = params()
    x, dt, B, Cm = _cat_rows([seqs["y"], seqs["x"]])
    y = IMPLS[impl](x, dt, prm[0], prm[1], B, Cm, prm[2], DT_MIN, step_metadata([0, 0], [60, X_LEN]), None,
                    chunk_size=C, aligned=True).cpu()
    slots, steps = invariance_schedules()["prefill_decode"]
    outs, _ = run_schedule(IMPLS[impl], {"x": seqs["x"], "y": seqs["y"]}, prm, slots, steps, aligned=True)
    assert torch.equal(bits(y[60:]), bits(outs["x"]))
    assert torch.equal(bits(y[:60][:outs["y"].shape[0]]), bits(outs["y"]))


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_sequence_and_unused_slots_untouched(impl):
    seqs = _x_seqs(torch.float32)
    assert_unused_slots_untouched(lambda used, slots, steps: run_schedule(IMPLS[impl], {s: seqs[s] for s in used},
                                                                          params(), slots, steps, aligned=True))


@pytest.fixture
def small_tiles(monkeypatch):
    """16-wide N / P tiles: several tiles per dim at test sizes (the output kernel's C h over N
    blocks, its state operand loaded per row tile)."""
    from vllm.kernels import mamba2_chunk
    for name in ("BLOCK_N_MAX", "OUT_BLOCK_N_MAX", "STATE_BLOCK_P_MAX", "STATE_BLOCK_N_MAX", "OUT_BLOCK_P_MAX"):
        monkeypatch.setattr(mamba2_chunk, name, 16)


def test_triton_several_tiles(small_tiles):
    """N = 32 (two N tiles), P = 48 (padded to 64: four P tiles, the last one masked)."""
    p, n_, T = 48, 32, 37
    prm = params()
    x = make_inputs(T, p=p, n=n_, seed=30)
    y = make_inputs(20, p=p, n=n_, seed=31)
    assert_cuts_match_alone(
        lambda seqs, slots, steps: run_schedule(mamba2_chunk_triton, seqs, prm, slots, steps, aligned=True),
        x, y, ref64(*x, prm, [0, T]))


def test_state_walk_tiles_keep_bits(monkeypatch):
    """The state walk's P and N tiles are the M and N dims of its fold's dot (K: the chunk's
    rows), so 16 x 16 tiles (three P tiles, two N tiles at P = 48, N = 32) give the outputs,
    states and buffer rows of the default whole-state tile, bit for bit, over prefills, cuts
    and decode steps."""
    from vllm.kernels import mamba2_chunk
    p, n_ = 48, 32
    prm = params()
    seqs = {"x": make_inputs(37, p=p, n=n_, seed=30), "y": make_inputs(20, p=p, n=n_, seed=31)}
    steps = [[("x", 17), ("y", 5)], [("y", 1), ("x", 1)], [("x", 19), ("y", 14)]]
    got = {}
    for tiles in ("default", "16x16"):
        if tiles == "16x16":
            monkeypatch.setattr(mamba2_chunk, "STATE_BLOCK_P_MAX", 16)
            monkeypatch.setattr(mamba2_chunk, "STATE_BLOCK_N_MAX", 16)
        got[tiles] = run_schedule(mamba2_chunk_triton, seqs, prm, {"x": 1, "y": 2}, steps, aligned=True)
    _assert_runs_equal(got["16x16"], got["default"], {"x": 1, "y": 2}, seqs, C, "state tiles")


# ---- 3b. row tiles: a step computes only the row tiles of a chunk that hold its rows --------------

CR = 128                                # a chunk of four 32-row tiles (mamba2_chunk.ROW_TILE)
ROW_OFFSETS = (0, 15, 16, 31, 32, 63, 127)  # first and last rows of 16- and 32-row tiles, the chunk's first and last


def _trainer_outputs(op, seqs, prm, chunk):
    """Every sequence of `seqs` from position 0 in one step without a cache (the trainer's call)."""
    ids = list(seqs)
    lens = [seqs[i][0].shape[0] for i in ids]
    x, dt, B, Cm = _cat_rows([seqs[i] for i in ids])
    y = op(x, dt, prm[0], prm[1], B, Cm, prm[2], DT_MIN, step_metadata([0] * len(ids), lens), None,
           chunk_size=chunk, aligned=True).cpu()
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    return {i: y[cu[k]:cu[k + 1]] for k, i in enumerate(ids)}


def _assert_runs_equal(got, base, slots, seqs, chunk, what):
    """Outputs, state and the partial chunk's buffer rows of two runs (run_schedule's results), by bits."""
    (outs, state), (ref, ref_state) = got, base
    for sid, slot in slots.items():
        assert torch.equal(bits(outs[sid]), bits(ref[sid])), (what, sid)
        assert torch.equal(bits(state["ssm"][slot].cpu()), bits(ref_state["ssm"][slot].cpu())), (what, sid)
        tail = seqs[sid][0].shape[0] % chunk
        for b in ("buf_x", "buf_B", "buf_dt"):
            assert torch.equal(bits(state[b][slot, :tail].cpu()), bits(ref_state[b][slot, :tail].cpu())), (what, sid, b)


def _offset_case(dtype):
    """One sequence per offset o of ROW_OFFSETS, CR + o + 1 tokens (its last token at row o of its
    second chunk), and the schedules: one prefill of everything; a prefill of all but the last
    token, then one decode step of all the sequences (each at its own offset)."""
    seqs = {o: make_inputs(CR + o + 1, seed=60 + o, dtype=dtype) for o in ROW_OFFSETS}
    slots = {o: i + 1 for i, o in enumerate(ROW_OFFSETS)}
    steps = {"whole": [[(o, CR + o + 1) for o in ROW_OFFSETS]],
             "decode": [[(o, CR + o) for o in ROW_OFFSETS], [(o, 1) for o in reversed(ROW_OFFSETS)]]}
    return seqs, slots, steps


def _spanning_case(dtype):
    """Sequence "m" (2 CR + 20 tokens) cut into steps whose rows span several row tiles or end one
    chunk and start the next, beside "d" (CR + 40) stepping through its second chunk by single
    rows and short runs across tile edges; both in every step, in alternating order."""
    m = [CR - 3, 20, 1, 42, 8, 1, 1, 78]  # rows 125..127|0..16, 17, 18..59, 60..67, 68, 69, 70..127|0..19
    d = [CR + 14, 5, 1, 1, 11, 1, 1, 6]   # rows 0..127|0..13, 14..18, 19, 20, 21..31, 32, 33, 34..39
    seqs = {"m": make_inputs(2 * CR + 20, seed=70, dtype=dtype), "d": make_inputs(CR + 40, seed=71, dtype=dtype)}
    steps = {"whole": [[("m", 2 * CR + 20), ("d", CR + 40)]],
             "cuts": [[("m", a), ("d", b)] if i % 2 else [("d", b), ("m", a)] for i, (a, b) in enumerate(zip(m, d))]}
    return seqs, {"m": 1, "d": 2}, steps


ROW_TILE_CASES = {"offsets": _offset_case, "spanning": _spanning_case}


# the output kernel's K block of M x beside the default (32; ROW_TILE 32, 16 for decode): the
# whole chunk in one block; 16-column blocks, where a prefill's 32-row tile takes a block more
# than a decode step's 16-row tile for the rows of its first half (exact zeros for them)
TILE_KNOBS = {"default": {}, "k128": {"OUT_K_BLOCK": 128}, "k16": {"OUT_K_BLOCK": 16}}


# both dtypes at the default tiles; the other tilings (the same code on the dtype's dots) in bf16
ROW_TILE_PARAMS = [pytest.param(impl, "default", dt, id=f"{impl}-{name}")
                   for impl in IMPLS for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))] + \
                  [pytest.param("triton", k, torch.bfloat16, id=f"triton-{k}-bf16") for k in TILE_KNOBS if k != "default"]


@pytest.mark.parametrize("impl,knobs,dtype", ROW_TILE_PARAMS)
@pytest.mark.parametrize("case", ROW_TILE_CASES)
def test_row_tiles_match_one_prefill(impl, knobs, case, dtype, monkeypatch):
    """Steps whose new rows lie in different row tiles of a 128-row chunk (a decode row at offsets
    0, 15, 16, 31, 32, 63, 127, all in one step; runs of rows across tile edges and chunk ends) give
    one prefill's output, state and buffer bits, and the trainer's (no cache) outputs. The decode
    rows read the cached state directly (the step stays inside one incomplete chunk), the
    prefill reads the state kernel's copy. knobs: the output kernel's M x dots in blocks of
    OUT_K_BLOCK columns stop at the block holding the tile's last row, whatever the row tile (a
    decode step's or a prefill's), so a row's sums are the same in every step."""
    from vllm.kernels import mamba2_chunk
    for name, value in TILE_KNOBS[knobs].items():
        monkeypatch.setattr(mamba2_chunk, name, value)
    seqs, slots, steps = ROW_TILE_CASES[case](dtype)
    prm = params(dtype=dtype)
    run = functools.partial(run_schedule, IMPLS[impl], seqs, prm, slots, aligned=True, num_slots=len(slots) + 1,
                            chunk=CR)
    whole = run(steps["whole"])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for sid in seqs:
        assert rel_err(whole[0][sid], ref64(*seqs[sid], prm, [0, seqs[sid][0].shape[0]], chunk=CR)) < tol, sid
    for name, sched in steps.items():
        if name != "whole":
            _assert_runs_equal(run(sched), whole, slots, seqs, CR, name)
    trainer = _trainer_outputs(IMPLS[impl], seqs, prm, CR)
    for sid in seqs:
        assert torch.equal(bits(trainer[sid]), bits(whole[0][sid])), ("trainer", sid)


def test_row_tile_size_keeps_bits(monkeypatch):
    """The row tile is only the M dim of the CB and output dots (their K dims and order stay): the
    default 32-row tiles give the bits of whole-chunk tiles (every row of every chunk computed),
    for prefill, decode and the trainer alike. On the GPU this checks the tile-shape fact the kernels rely on (mma.sync
    tiles against wgmma ones)."""
    from vllm.kernels import mamba2_chunk
    variants = {"default": {}, "whole-chunk tiles": {"ROW_TILE": CR}}
    results = {}
    for variant, knobs in variants.items():
        with monkeypatch.context() as m:
            for name, value in knobs.items():
                m.setattr(mamba2_chunk, name, value)
            for case, make in ROW_TILE_CASES.items():
                seqs, slots, steps = make(torch.bfloat16)
                prm = params(dtype=torch.bfloat16)
                for name, sched in steps.items():
                    results[variant, case, name] = run_schedule(mamba2_chunk_triton, seqs, prm, slots, sched,
                                                                aligned=True, num_slots=len(slots) + 1, chunk=CR)
                trainer = _trainer_outputs(mamba2_chunk_triton, seqs, prm, CR)
                for sid in seqs:
                    results[variant, case, "trainer", sid] = trainer[sid]
    for key, got in results.items():
        if key[0] == "default":
            continue
        ref = results[("default", *key[1:])]
        if key[2] == "trainer":
            assert torch.equal(bits(got), bits(ref)), key
        else:
            seqs, slots, _ = ROW_TILE_CASES[key[1]](torch.bfloat16)
            _assert_runs_equal(got, ref, slots, seqs, CR, key)


# ---- 3c. which programs run: the state kernel's work list, the buffer copy -----------------------

# every program count and block at its smallest: one state program per (head, P tile) walking the
# whole work list, a work list built two sequences at a time, one buffer program per sequence
# along the rows, 16-element x blocks (several per row)
FEW_PROGRAMS = {"STATE_PROGRAMS": 1, "WORK_LIST_BLOCK": 2, "BUFFER_ROW_PROGRAMS": 1, "BUFFER_BLOCK_MAX": 16}


def _slot_reuse_case():
    """"a" runs, then "b" takes its slot from position 0 (a's state and buffer rows stay there,
    never to be read), first as a one-token step of its own (planned on the device), then beside
    "c" and "d" in decode steps that end chunks (c at rows 15 and 31, d at 31) and mixed steps
    (a prefill with a partial tail beside decode rows; three resumes across chunk ends)."""
    seqs = {"a": make_inputs(37, seed=80), "b": make_inputs(20, seed=81), "c": make_inputs(40, seed=82),
            "d": make_inputs(50, seed=83)}
    slots = {"a": 1, "b": 1, "c": 2, "d": 3}
    steps = ([[("a", 30), ("c", 14)], [("c", 1), ("a", 1)], [("a", 6), ("c", 1)], [("b", 1)], [("c", 1), ("b", 1)],
              [("d", 23), ("b", 1), ("c", 1)]] + [[("b", 1), ("c", 1), ("d", 1)]] * 11
             + [[("c", 11), ("b", 6), ("d", 16)]])
    return seqs, slots, steps


@pytest.mark.parametrize("impl,knobs", [("torch", {}), ("triton", {}), ("triton", FEW_PROGRAMS)],
                         ids=["torch", "triton", "triton-few-programs"])
def test_slot_reuse_and_program_counts(impl, knobs, monkeypatch):
    """Every sequence of _slot_reuse_case gives its own one-step prefill's output bits (and, but
    for "a", whose slot "b" took, its state and buffer rows): a sequence at position 0 never reads
    its slot, decode steps that stay inside a chunk leave the state alone, the ones that end a
    chunk fold it. In Triton the state kernel walks only its work list's sequences (prep builds
    it) and the buffer copies rows in slices; with FEW_PROGRAMS every walk and copy lands on
    other programs, and the bits stay."""
    from vllm.kernels import mamba2_chunk
    for name, value in knobs.items():
        monkeypatch.setattr(mamba2_chunk, name, value)
    seqs, slots, steps = _slot_reuse_case()
    prm = params()
    outs, state = run_schedule(IMPLS[impl], seqs, prm, slots, steps, aligned=True)
    for sid, seq in seqs.items():
        n = seq[0].shape[0]
        alone, alone_state = run_schedule(IMPLS[impl], {sid: seq}, prm, {sid: 1}, [[(sid, n)]], aligned=True)
        assert torch.equal(bits(outs[sid]), bits(alone[sid])), sid
        if sid != "a":
            sl = slots[sid]
            assert torch.equal(bits(state["ssm"][sl].cpu()), bits(alone_state["ssm"][1].cpu())), sid
            for b in ("buf_x", "buf_B", "buf_dt"):
                assert torch.equal(bits(state[b][sl, :n % C].cpu()), bits(alone_state[b][1, :n % C].cpu())), (sid, b)


# ---- 4. fast mode: continuation is accurate (not bit-equal to one prefill) -----------------------

def _final_state64(seq, prm):
    x, dt, B, Cm = (t.double().cpu() for t in seq)
    d = torch.clamp(F.softplus(dt + prm[0].double().cpu()), min=DT_MIN)
    A = -torch.exp(prm[1].double().cpu())
    S = torch.zeros(H, P, N, dtype=torch.float64)
    for t in range(x.shape[0]):
        bh = B[t].repeat_interleave(H // G, 0)
        S = S * torch.exp(d[t] * A)[:, None, None] + (d[t][:, None] * x[t])[:, :, None] * bh[:, None, :]
    return S


@pytest.mark.parametrize("impl", IMPLS)
def test_fast_mode_continuation(impl):
    seqs = _x_seqs(torch.float32)
    prm = params()

    def fast_op(x, dt, dt_bias, A_log, B, Cm, D, dt_min, md, state, *, chunk_size, aligned):
        if md.max_query_len == 1:
            return SSU[impl](x, dt, dt_bias, A_log, B, Cm, D, dt_min, md, state, chunk_size=chunk_size)
        return IMPLS[impl](x, dt, dt_bias, A_log, B, Cm, D, dt_min, md, state, chunk_size=chunk_size, aligned=False)
    for name in ("cuts", "prefill_decode", "all_decode"):
        slots, steps = invariance_schedules()[name]
        outs, state = run_schedule(fast_op, {s: seqs[s] for s in used_ids(steps)}, prm, slots, steps, aligned=False)
        for sid, o in outs.items():
            n = o.shape[0]
            assert rel_err(o, ref64(*(t[:n] for t in seqs[sid]), prm, [0, n])) < 1e-5, (name, sid)
        # the cached state is the state after every token
        assert rel_err(state["ssm"][slots["x"]].cpu(), _final_state64(seqs["x"], prm)) < 1e-5, name


# ---- 5. Triton (interpreted) and torch agree ------------------------------------------------------

@pytest.mark.parametrize("aligned", [True, False])
def test_triton_matches_torch(aligned):
    seqs = _x_seqs(torch.float32)
    prm = params()
    assert_runs_close(lambda op, used, slots, steps, aligned: run_schedule(op, {s: seqs[s] for s in used}, prm, slots,
                                                                          steps, aligned=aligned),
                      (mamba2_chunk_torch, mamba2_chunk_triton), aligned)


def test_selective_state_update_triton_matches_torch():
    seqs = _x_seqs(torch.float32)
    prm = params()
    x, dt, B, Cm = _cat_rows([tuple(t[:1] for t in seqs[s]) for s in ("x", "y", "z")])
    md = step_metadata([5, 0, 17], [1, 1, 1], [1, 2, 3], host=False)
    init = torch.randn(4, H, P, N, generator=torch.Generator().manual_seed(3)).to(DEV)
    outs = {}
    for name, fn in SSU.items():
        state = {"ssm": init.clone()}
        outs[name] = (fn(x, dt, *prm[:2], B, Cm, prm[2], DT_MIN, md, state), state["ssm"])
    assert rel_err(outs["triton"][0].cpu(), outs["torch"][0].cpu()) < 1e-6
    assert rel_err(outs["triton"][1].cpu(), outs["torch"][1].cpu()) < 1e-6
    assert torch.equal(outs["torch"][1][0].cpu(), init[0].cpu())  # slot 0 untouched


# ---- 6. gradients --------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_autograd_fn_gradients(impl):
    lens = [21, 9]
    cu = [0, 21, 30]
    x, dt, B, Cm = make_inputs(cu[-1], seed=20)
    prm = params()
    fwd = functools.partial(IMPLS[impl], chunk_size=C, aligned=True)
    md = step_metadata([0, 0], lens)
    leaves = [t.detach().contiguous().to(DEV).requires_grad_() for t in (x, dt, prm[0], prm[1], B, Cm, prm[2])]
    y = Mamba2ChunkScanFn.apply(fwd, *leaves, DT_MIN, md, C)
    # the forward is the kernel's bits
    lx, ldt, lb, la, lB, lC, lD = leaves
    plain = IMPLS[impl](lx.detach(), ldt.detach(), lb.detach(), la.detach(), lB.detach(), lC.detach(), lD.detach(),
                        DT_MIN, md, None, chunk_size=C, aligned=True)
    assert torch.equal(bits(y.detach()), bits(plain))
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(21)).to(DEV)
    y.backward(dy)
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in leaves]
    rx, rdt, rb, ra, rB, rC, rD = ref_leaves
    ref = mamba2_reference(rx, rdt, rb, ra, rB, rC, rD, DT_MIN, cu, C)
    ref.backward(dy.cpu().double())
    for name, a, b in zip("x dt dt_bias A_log B C D".split(), leaves, ref_leaves):
        assert a.grad.dtype == torch.float32
        assert rel_err(a.grad.cpu(), b.grad) < 1e-5, name


# ---- 7. the grouped gated norm and the conv's bias -------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_norm_matches_transformers_and_is_batch_invariant(dtype):
    import transformers.models.nemotron_h.modeling_nemotron_h as hf_nemotron
    T, D, groups = 9, 96, 3
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, D, generator=g).to(dtype)
    zrow = torch.randn(T, D + 5, generator=g).to(dtype)
    z = zrow[:, 2:D + 2]  # a strided view, as the layer passes it
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    if hasattr(hf_nemotron, "NemotronHRMSNormGated"):
        hf = hf_nemotron.NemotronHRMSNormGated(D, D // groups, eps=1e-5).to(dtype)
        hf.weight.data.copy_(w)
        want = hf(x, z)
    else:  # older transformers (5.17 on the GPU host): its formula, in float64
        h = (x.double() * F.silu(z.double())).view(T, groups, D // groups)
        want = (w.double() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).view(T, D)).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    for fn in (gated_norm_torch, gated_norm_triton):
        got = fn(x.to(DEV), z.to(DEV), w.to(DEV), 1e-5, groups).cpu()
        assert got.dtype == dtype and rel_err(got, want) < tol
        # a row's bits do not depend on the rows beside it
        one = torch.cat([fn(x[i:i + 1].to(DEV), z[i:i + 1].to(DEV), w.to(DEV), 1e-5, groups).cpu() for i in range(T)])
        assert torch.equal(bits(one), bits(got))
    # gradients through the Function against float64 autograd of transformers' formula
    xs = [t.float().clone().requires_grad_() for t in (x, z, w)]
    out = GatedNormFn.apply(*xs, 1e-5, groups, gated_norm_torch)
    dy = torch.randn(out.shape, generator=g)
    out.backward(dy)
    rx, rz, rw = (t.detach().double().requires_grad_() for t in xs)
    h = (rx * F.silu(rz)).view(T, groups, D // groups)
    (rw * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).view(T, D)).backward(dy.double())
    for a, b in zip(xs, (rx, rz, rw)):
        assert rel_err(a.grad, b.grad) < 1e-5


def test_conv_bias_matches_conv1d_and_trains():
    from vllm.kernels.gdn_ops import CausalConv1dFn, causal_conv1d_torch, causal_conv1d_triton
    T, Dc, W = 11, 24, 4
    g = torch.Generator().manual_seed(8)
    x = torch.randn(T, Dc, generator=g)
    w = torch.randn(Dc, W, generator=g) / 2
    b = torch.randn(Dc, generator=g)
    md = step_metadata([0, 0], [6, 5])
    md_cpu = StateMetadata(torch.tensor([0, 6, 11], dtype=torch.int32), torch.zeros(2, dtype=torch.int32), None, 6)
    want = torch.cat([F.silu(F.conv1d(x[sl].t()[None], w[:, None], b, padding=W - 1, groups=Dc)[0, :, :n].t())
                      for sl, n in ((slice(0, 6), 6), (slice(6, 11), 5))])
    for fn in (causal_conv1d_torch, causal_conv1d_triton):
        assert rel_err(fn(x.to(DEV), w.to(DEV), md, None, b.to(DEV)).cpu(), want) < 1e-6
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y = CausalConv1dFn.apply(leaves[0], leaves[1], md_cpu, None, causal_conv1d_torch, leaves[2])
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    ref = [t.detach().double().requires_grad_() for t in (x, w, b)]
    torch.cat([F.silu(F.conv1d(ref[0][sl].t()[None], ref[1][:, None], ref[2], padding=W - 1, groups=Dc)[0, :, :n].t())
               for sl, n in ((slice(0, 6), 6), (slice(6, 11), 5))]).backward(dy.double())
    for a, r in zip(leaves, ref):
        assert rel_err(a.grad, r.grad) < 1e-6


# ---- 8. real dims on the GPU ------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_real_dims_prefill_cuts_decode_and_trainer_bits():
    _real_dims_check(128, 64, 8, 128, 128)


@pytest.mark.gpu
def test_gpu_real_dims_row_tile_keeps_bits(monkeypatch):
    """At Nemotron-H's dims (bf16) the default tiles (32-row tiles, 16 for decode: mma.sync dots;
    M x in 32-column blocks up to the tile's last row; C h over all of N) give the bits of
    whole-chunk tiles (128 rows: wgmma dots, every row of every chunk computed) with M x over the
    whole chunk in one dot and C h, C B^T in other N blocks, in every real-dims schedule (one
    prefill, cuts, prefill then decode, all decode) and the trainer's, and so does the state
    walk in 32 x 32 tiles: on the GPU the K blocking and the tiles do not move a bit."""
    from vllm.kernels import mamba2_chunk
    h, p, g, n, c = 128, 64, 8, 128, 128
    lens, slots = REAL_DIMS_LENS, REAL_DIMS_SLOTS
    seqs = {sid: make_inputs(L, h, p, g, n, seed=40 + sid, dtype=torch.bfloat16) for sid, L in lens.items()}
    prm = params(h=h, dtype=torch.bfloat16)
    res = {}
    whole = {"ROW_TILE": c, "OUT_CACHED_ROW_TILE": c, "OUT_K_BLOCK": c, "OUT_BLOCK_N_MAX": 32, "BLOCK_N_MAX": 128,
             "STATE_BLOCK_N_MAX": 32, "STATE_BLOCK_P_MAX": 32}
    for variant in ("default", "whole"):
        for name, value in (whole.items() if variant == "whole" else ()):
            monkeypatch.setattr(mamba2_chunk, name, value)
        for name, steps in real_dims_schedules().items():
            res[variant, name] = run_schedule(mamba2_chunk_triton, seqs, prm, slots, steps, aligned=True, chunk=c)
        res[variant, "trainer"] = _trainer_outputs(mamba2_chunk_triton, seqs, prm, c)
    for name in (*real_dims_schedules(), "trainer"):
        if name == "trainer":
            for sid in seqs:
                assert torch.equal(bits(res["whole", name][sid]), bits(res["default", name][sid])), (name, sid)
        else:
            _assert_runs_equal(res["whole", name], res["default", name], slots, seqs, c, name)


def _real_dims_check(h, p, g, n, c):
    """Nemotron-H's Mamba-2 dims (128 heads of 64, d_state 128, 8 groups, C = 128, bf16): two
    sequences computed as one prefill, as prefills cut off the grid, as a prefill then decode
    steps and as all-decode give the same output and state bits (aligned), and the trainer's
    forward (no cache) gives the prefill's bits; the fast mode's decode (the selective state
    update) does not."""
    lens, slots = REAL_DIMS_LENS, REAL_DIMS_SLOTS
    seqs = {sid: make_inputs(L, h, p, g, n, seed=40 + sid, dtype=torch.bfloat16) for sid, L in lens.items()}
    prm = params(h=h, dtype=torch.bfloat16)
    run = functools.partial(run_schedule, mamba2_chunk_triton, seqs, prm, slots, aligned=True, chunk=c)
    ref, _ = assert_real_dims_schedules_agree(run)
    assert rel_err(ref[0], ref64(*seqs[0], prm, [0, 300], chunk=c)) < 2e-2
    # the trainer: no cache, both sequences from position 0
    x, dt, B, Cm = _cat_rows([seqs[s] for s in lens])
    y = mamba2_chunk_triton(x, dt, prm[0], prm[1], B, Cm, prm[2], DT_MIN, step_metadata([0, 0], list(lens.values())),
                            None, chunk_size=c, aligned=True).cpu()
    assert torch.equal(bits(y), bits(torch.cat([ref[s] for s in lens])))

    # fast mode's decode is the native recurrence: its rows differ from the chunked prefill's
    def fast_op(x, dt, dt_bias, A_log, B, Cm, D, dt_min, md, state, *, chunk_size, aligned):
        if md.max_query_len == 1:
            return selective_state_update_triton(x, dt, dt_bias, A_log, B, Cm, D, dt_min, md, state)
        return mamba2_chunk_triton(x, dt, dt_bias, A_log, B, Cm, D, dt_min, md, state, chunk_size=chunk_size,
                                   aligned=False)
    assert_fast_decode_differs(functools.partial(run_schedule, fast_op, seqs, prm, slots, aligned=False, chunk=c))
