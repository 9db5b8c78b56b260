"""Chunked gated delta rule (vllm/kernels/gdn_chunk.py): float64 references, bit-pattern
invariance across batches and step cuts (aligned mode), fast-mode accuracy, gradients.

On CPU the Triton kernels run under TRITON_INTERPRET=1 at tiny dims; the torch entry is
what the CPU engine runs. Parity claims compare bits (int views), never allclose.
"""
from __future__ import annotations

import functools
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vllm.forward_context import ChunkPlan
from vllm.kernels import gdn_chunk
from vllm.kernels.gdn_chunk import GatedDeltaRuleFn, gdn_chunk_torch, gdn_chunk_triton, gdn_reference
from vllm.testing.chunked_scan import (DEVICE as DEV, INVARIANCE_CASES, REAL_DIMS_LENS, REAL_DIMS_SLOTS, X_LEN,
                                       assert_cuts_match_alone, assert_fast_decode_differs,
                                       assert_real_dims_schedules_agree, assert_rounded_state, assert_runs_close,
                                       assert_schedules_agree, assert_unused_slots_untouched, bits,
                                       invariance_schedules,
                                       nan_state, real_dims_schedules, rel_err, run_steps, step_metadata, used_ids)

HK, HV, K, V, C = 2, 4, 16, 32, 16
IMPLS = {"torch": gdn_chunk_torch, "triton": gdn_chunk_triton}


def make_inputs(T, hk=HK, hv=HV, kd=K, vd=V, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, hk, kd, generator=gen), dim=-1)
    k = F.normalize(torch.randn(T, hk, kd, generator=gen), dim=-1)
    v = torch.randn(T, hv, vd, generator=gen)
    g = -0.6 * torch.rand(T, hv, generator=gen)       # log decays in (-0.6, 0]
    beta = torch.rand(T, hv, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta


def recurrence64(q, k, v, g, beta, cu, scale):
    """The per-token recurrence, float64."""
    Hk, Kd = q.shape[1:]
    Hv, Vd = v.shape[1:]
    G = Hv // Hk
    o = torch.zeros(q.shape[0], Hv, Vd, dtype=torch.float64)
    for s in range(len(cu) - 1):
        S = torch.zeros(Hv, Kd, Vd, dtype=torch.float64)
        for t in range(cu[s], cu[s + 1]):
            kt = k[t].double().repeat_interleave(G, 0)
            qt = q[t].double().repeat_interleave(G, 0)
            S = S * g[t].double().exp()[:, None, None]
            kv = (S * kt[:, :, None]).sum(1)
            S = S + kt[:, :, None] * (beta[t].double()[:, None] * (v[t].double() - kv))[:, None, :]
            o[t] = scale * (S * qt[:, :, None]).sum(1)
    return o


def ref64(q, k, v, g, beta, cu, scale):
    return gdn_reference(*(t.double() for t in (q, k, v, g, beta)), cu, scale, chunk_size=C)


def new_state(num_slots, dtype, aligned, hk, hv, kd, vd, chunk=C, t_cache=True):
    """A NaN-filled cache: the matrix state and, aligned, the rows of a partial chunk (with
    `t_cache`, also the decode caches, as the layer declares: their rows of T and of v_new)."""
    bufs = {"buf_k": ((chunk, hk, kd), dtype), "buf_v": ((chunk, hv, vd), dtype),
            "buf_g": ((chunk, hv), torch.float32), "buf_beta": ((chunk, hv), torch.float32)}
    if t_cache:
        bufs.update(t_cache=((hv, chunk, chunk), torch.float32), t_pos=((hv,), torch.int32),
                    buf_vn=((chunk, hv, vd), dtype), ssm_rounded=((hv, kd, vd), dtype))
    return nan_state(num_slots, {"ssm": ((hv, kd, vd), torch.float32), **(bufs if aligned else {})})


def run_schedule(op, seqs, slots, schedule, aligned, num_slots=4, chunk=C, t_cache=True):
    """Run `schedule` through `op` with a cache (chunked_scan.run_steps). seqs: {id: (q, k,
    v, g, beta)}. Returns ({id: outputs}, state)."""
    q0, _, v0, _, _ = next(iter(seqs.values()))
    state = new_state(num_slots, q0.dtype, aligned, q0.shape[1], v0.shape[1], q0.shape[2], v0.shape[2], chunk,
                      t_cache)
    scale = q0.shape[2] ** -0.5

    def step(inputs, md):
        return op(*inputs, scale, md, state, chunk_size=chunk, aligned=aligned)
    outs = run_steps(step, seqs, slots, schedule)
    if op is not gdn_chunk_triton or DEV != "cpu":
        # Triton's interpreter rounds fp32 to bf16 toward zero (the GPU and torch: to nearest
        # even), so on the CPU the kernels' rounded state is checked through the outputs only
        assert_rounded_state(state, set(slots.values()))
    return outs, state


# ---- 1. the reference ---------------------------------------------------------------------------

def test_reference_matches_recurrences():
    from vllm.testing.chunked_scan import transformers_delta_rule
    lens = [37, 5, 20]
    cu = [0, 37, 42, 62]
    q, k, v, g, beta = make_inputs(cu[-1], seed=1)
    scale = 0.3
    ref = ref64(q, k, v, g, beta, cu, scale)
    rec = recurrence64(q, k, v, g, beta, cu, scale)
    assert rel_err(ref, rec) < 1e-13
    # transformers' forms (they compute in float32 and always scale q by K^-0.5)
    q_hf = q.double() * (scale * K ** 0.5)
    for s, n in enumerate(lens):
        sl = slice(cu[s], cu[s + 1])
        args = (q_hf[None, sl], k[None, sl].double(), v[None, sl].double(), g[None, sl].double(),
                beta[None, sl].double())
        hf, _ = transformers_delta_rule("torch_recurrent_gated_delta_rule", *args, use_qk_l2norm_in_kernel=False)
        assert rel_err(ref[sl], hf[0]) < 1e-5
        hf, _ = transformers_delta_rule("torch_chunk_gated_delta_rule", *args, chunk_size=C,
                                        use_qk_l2norm_in_kernel=False)
        assert rel_err(ref[sl], hf[0]) < 1e-5
    # the chunk size is an implementation detail of the reference
    for c in (4, 64):
        other = gdn_reference(*(t.double() for t in (q, k, v, g, beta)), cu, scale, chunk_size=c)
        assert rel_err(other, rec) < 1e-13


def test_reference_gradcheck():
    q, k, v, g, beta = (t.double().requires_grad_() for t in make_inputs(7, kd=4, vd=3, seed=2))
    assert torch.autograd.gradcheck(
        lambda *xs: gdn_reference(*xs, [0, 4, 7], 0.5, chunk_size=2), (q, k, v, g, beta))


# ---- 2. both implementations against the float64 reference --------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("aligned,chunk", [(True, C), (False, C), (True, 64)])
def test_prefill_matches_reference(impl, aligned, chunk):
    lens = [37, 5, 20]
    cu = [0, 37, 42, 62]
    q, k, v, g, beta = make_inputs(cu[-1], seed=3)
    scale = K ** -0.5
    o = IMPLS[impl](*(t.to(DEV) for t in (q, k, v, g, beta)), scale, step_metadata([0, 0, 0], lens), None,
                    chunk_size=chunk, aligned=aligned)
    assert o.dtype == torch.float32
    assert rel_err(o.cpu(), ref64(q, k, v, g, beta, cu, scale)) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_and_padded_head_dims(impl):
    """bf16 inputs, and K, V multiples of 16 that are not powers of two (padded tiles)."""
    kd, vd = 48, 48
    q, k, v, g, beta = make_inputs(40, kd=kd, vd=vd, seed=4, dtype=torch.bfloat16)
    scale = kd ** -0.5
    cu = [0, 23, 40]
    o = IMPLS[impl](*(t.to(DEV) for t in (q, k, v, g, beta)), scale, step_metadata([0, 0], [23, 17]), None,
                    chunk_size=C, aligned=True)
    assert o.dtype == torch.bfloat16
    assert rel_err(o.cpu(), ref64(q, k, v, g, beta, cu, scale)) < 2e-2


# ---- 3. invariance (aligned): batches and step cuts ----------------------------------------------

def _x_seqs(dtype):
    x = make_inputs(X_LEN, seed=10, dtype=dtype)
    y = make_inputs(60, seed=11, dtype=dtype)
    z = make_inputs(31, seed=12, dtype=dtype)
    return {"x": x, "y": y, "z": z}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", INVARIANCE_CASES)
def test_invariance(impl, case):
    dtype, names, tol = INVARIANCE_CASES[case]
    seqs = _x_seqs(dtype)

    def run(used, slots, steps):
        return run_schedule(IMPLS[impl], {s: seqs[s] for s in used}, slots, steps, aligned=True)
    assert_schedules_agree(run, names, ("buf_k", "buf_v", "buf_g"), C, ref64(*seqs["x"], [0, X_LEN], K ** -0.5), tol)


@pytest.mark.parametrize("schedule", ["cuts", "prefill_decode"])
def test_t_cache_resumes_with_the_same_bits(schedule):
    """A step that resumes a chunk from the T rows an earlier step left (and, on the decode
    path, from its v_new rows) gives the bits of the same step solving the chunk's T from row 1
    through the whole-chunk path (no decode caches), outputs and states alike; and the cache is
    used: after the last step its stamp is the sequence's end position."""
    seqs = _x_seqs(torch.float32)
    slots, steps = invariance_schedules()[schedule]
    used = {s: seqs[s] for s in used_ids(steps)}
    with_t, st_t = run_schedule(gdn_chunk_triton, used, slots, steps, aligned=True)
    without, st = run_schedule(gdn_chunk_triton, used, slots, steps, aligned=True, t_cache=False)
    for sid in with_t:
        assert torch.equal(bits(with_t[sid]), bits(without[sid])), sid
        slot = slots[sid]
        assert torch.equal(bits(st_t["ssm"][slot]), bits(st["ssm"][slot])), sid
        n = with_t[sid].shape[0]
        if n % C:  # a partial last chunk leaves its T rows, stamped with the end position
            assert (st_t["t_pos"][slot] == n).all(), (sid, st_t["t_pos"][slot])


def test_t_cache_cleared_where_a_step_resumes_and_ends_in_a_later_chunk():
    """A step that resumes a chunk (reading its T rows) and ends in a later partial chunk of
    the same slot does not overwrite the rows it reads: it clears the stamp, and the next step
    solves its chunk from row 1, with the bits of a single prefill."""
    x = make_inputs(3 * C, seed=50)
    scale = K ** -0.5
    whole = gdn_chunk_triton(*(t.to(DEV) for t in x), scale, step_metadata([0], [3 * C]), None, chunk_size=C,
                             aligned=True).cpu()
    state = new_state(2, torch.float32, True, HK, HV, K, V)
    # stamps after each step: cleared; the next step solves from row 1 and stamps; a step
    # completing its chunk leaves no partial chunk; a fresh partial chunk stamps
    cuts = {(0, 5): 5, (5, C + 7): -1, (C + 7, C + 8): C + 8, (C + 8, 2 * C): C + 8, (2 * C, 2 * C + 3): 2 * C + 3}
    outs = []
    for (lo, hi), stamp in cuts.items():
        md = step_metadata([lo], [hi - lo], [1])
        outs.append(gdn_chunk_triton(*(t[lo:hi].to(DEV) for t in x), scale, md, state, chunk_size=C,
                                     aligned=True).cpu())
        assert (state["t_pos"][1] == stamp).all(), (lo, hi, state["t_pos"][1])
    n = 2 * C + 3
    assert torch.equal(bits(torch.cat(outs)), bits(whole[:n]))


# ---- 3b. the decode path (gdn_chunk_triton with the decode caches) on the model's 64-row chunk ----
# A chunk that is its sequence's only chunk in the step and stays partial computes its new rows
# in tiles of DECODE_ROWS (16) rows from the cached state and the slot's earlier v_new rows; every
# other chunk takes the whole-chunk path. Each schedule below must give one prefill's bits.

DC = 64


def _dc_inputs(lens: dict, dtype, seed: int) -> dict:
    return {sid: make_inputs(n, 1, 2, K, V, seed=seed + i, dtype=dtype) for i, (sid, n) in enumerate(lens.items())}


def _assert_one_prefill_bits(seqs: dict, slots: dict, steps: list):
    """`steps` run with and without the decode caches give every sequence the bits of its one
    prefill: outputs (against the trainer's forward, no cache), the state and the partial
    chunk's buffer rows (against one cached prefill without the decode caches) and, with the
    caches, the partial chunk's rows of v_new and of T (against one cached prefill with them)."""
    scale = K ** -0.5
    runs = {t_cache: run_schedule(gdn_chunk_triton, seqs, slots, steps, aligned=True, chunk=DC, t_cache=t_cache)
            for t_cache in (True, False)}
    for sid, x in seqs.items():
        n = x[0].shape[0]
        want = gdn_chunk_triton(*(t.to(DEV) for t in x), scale, step_metadata([0], [n]), None, chunk_size=DC,
                                aligned=True).cpu()
        _, plain = run_schedule(gdn_chunk_triton, {sid: x}, {sid: 0}, [[(sid, n)]], aligned=True, chunk=DC,
                                t_cache=False)
        _, cached = run_schedule(gdn_chunk_triton, {sid: x}, {sid: 0}, [[(sid, n)]], aligned=True, chunk=DC)
        tail = n % DC
        sl = slots[sid]
        for t_cache, (outs, st) in runs.items():
            where = (sid, "decode caches" if t_cache else "no decode caches")
            assert torch.equal(bits(outs[sid]), bits(want)), where
            assert torch.equal(bits(st["ssm"][sl]), bits(plain["ssm"][0])), where
            for name in ("buf_k", "buf_v", "buf_g", "buf_beta"):
                assert torch.equal(bits(st[name][sl, :tail]), bits(plain[name][0, :tail])), (where, name)
            if t_cache and tail:
                assert torch.equal(bits(st["buf_vn"][sl, :tail]), bits(cached["buf_vn"][0, :tail])), where
                if (st["t_pos"][sl] == n).all() and (cached["t_pos"][0] == n).all():
                    assert torch.equal(bits(st["t_cache"][sl, :, :tail]), bits(cached["t_cache"][0, :, :tail]))


def test_decode_path_row_tiles():
    """One-token steps at rows 0, 15, 16, 17, 62 and 63 (the last one completes the chunk) of a
    64-row chunk, multi-row steps inside one chunk that span two or three 16-row tiles, from
    position 0 (a zero state) and resumed, and a step that completes a chunk from its row 21
    (float32: a wrong bit in v_new or T shows in the outputs and states unrounded)."""
    seqs = _dc_inputs({"x": 150, "y": 74}, torch.float32, 60)
    steps = [[("x", 15), ("y", 20)],     # x rows 0..14; y rows 0..19 (two tiles, zero state)
             [("x", 1), ("y", 1)],       # x row 15, y row 20
             [("x", 1)],                 # 16
             [("x", 1), ("y", 11)],      # 17; y rows 21..31
             [("x", 44)],                # rows 18..61: three tiles
             [("x", 1), ("y", 2)],       # 62; y rows 32, 33
             [("x", 1)],                 # 63: the chunk completes (folded by the state kernel)
             [("x", 1)],                 # 64: row 0 of the next chunk
             [("x", 20)],                # rows 1..20 of chunk 1: tiles 0 and 1
             [("x", 43)],                # rows 21..63: completes chunk 1 in one step
             [("x", 10), ("y", 40)],     # x rows 0..9 of chunk 2; y resumes chunk 0 at 34, ends in chunk 1
             [("x", 12)]]                # rows 10..21
    _assert_one_prefill_bits(seqs, {"x": 1, "y": 3}, steps)


def test_decode_path_beside_folds_and_prefills():
    """One step holding a sequence that completes its chunk with one token (a), one resuming its
    chunk with one token (b), a prefill from position 0 past a chunk (c) and a first token (d);
    then a step where b resumes its chunk and ends in the next one (which clears its T stamp:
    its next step solves T from row 1, the one after resumes from the rows that one left)."""
    seqs = _dc_inputs({"a": 67, "b": 71, "c": 103, "d": 19}, torch.bfloat16, 70)
    steps = [[("a", 63), ("b", 17)],
             [("a", 1), ("b", 1), ("c", 100), ("d", 1)],
             [("d", 16), ("a", 1), ("b", 51), ("c", 1)],
             [("a", 1), ("b", 1), ("c", 1), ("d", 1)],
             [("b", 1), ("a", 1), ("d", 1), ("c", 1)]]
    _assert_one_prefill_bits(seqs, {"a": 0, "b": 2, "c": 3, "d": 1}, steps)


def test_decode_path_every_offset():
    """All-decode through a chunk and into the next: every row offset of the 64-row chunk."""
    seqs = _dc_inputs({"x": 67}, torch.bfloat16, 80)
    _assert_one_prefill_bits(seqs, {"x": 2}, [[("x", 1)]] * 67)


@pytest.mark.parametrize("block", [256, 2])
def test_state_work_list(monkeypatch, block):
    """The state kernel's sequences (built on the device): all with a chunk in the step but
    those on the decode path at a position > 0 (a chunk that stays partial, one token or
    more); with the decode caches only. `block` 2: the kernel's loop over blocks of sequences."""
    from vllm.kernels import gdn_chunk
    monkeypatch.setattr(gdn_chunk, "WORK_BLOCK", block)
    # position 0 (its zero state is written), inside a chunk, completing one, row 0 of the
    # next, 30 tokens inside one chunk, no token, a step across a chunk edge
    start_pos, q_lens = [0, 5, 63, 64, 10, 7, 60], [1, 1, 1, 1, 30, 0, 5]
    md = step_metadata(start_pos, q_lens, list(range(len(q_lens))))
    for aligned, has_dc, want in ((True, 1, [0, 2, 6]), (True, 0, [0, 1, 2, 3, 4, 6]), (False, 0, [0, 1, 2, 3, 4, 6])):
        work, count = gdn_chunk.state_work_list(md, md.chunk_plan(DC, aligned), 1, has_dc, DC, aligned)
        assert count.tolist() == [len(want)], (aligned, has_dc)
        assert work[:len(want)].tolist() == want, (aligned, has_dc)


def test_state_programs_stride_over_the_work_list(monkeypatch):
    """One state program per (V tile, head) walking every listed sequence in turn gives the
    bits of one prefill (the decode path beside folds and prefills)."""
    from vllm.kernels import gdn_chunk
    monkeypatch.setattr(gdn_chunk, "STATE_PROGRAMS", 1)
    test_decode_path_beside_folds_and_prefills()


@pytest.mark.parametrize("impl", IMPLS)
def test_training_forward_equals_rollout(impl):
    """No cache (the trainer) gives the bits of the cached prefill and of decode steps."""
    seqs = _x_seqs(torch.float32)
    x = seqs["x"]
    y = seqs["y"]
    scale = K ** -0.5
    args = [torch.cat((a, b)).to(DEV) for a, b in zip(y, x)]
    o = IMPLS[impl](*args, scale, step_metadata([0, 0], [60, X_LEN]), None, chunk_size=C, aligned=True).cpu()
    slots, steps = invariance_schedules()["prefill_decode"]
    outs, _ = run_schedule(IMPLS[impl], {"x": x, "y": y}, slots, steps, aligned=True)
    assert torch.equal(bits(o[60:]), bits(outs["x"]))


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_sequence_and_unused_slots_untouched(impl):
    seqs = _x_seqs(torch.float32)
    assert_unused_slots_untouched(
        lambda used, slots, steps: run_schedule(IMPLS[impl], {s: seqs[s] for s in used}, slots, steps, aligned=True))


@pytest.fixture
def small_tiles(monkeypatch):
    """16-wide K / V tiles: several tiles per head dim at test sizes."""
    from vllm.kernels import gdn_chunk
    for name in ("BLOCK_K_MAX", "PREP_BLOCK_V_MAX", "STATE_BLOCK_V_MAX", "OUT_BLOCK_V_MAX"):
        monkeypatch.setattr(gdn_chunk, name, 16)


def test_triton_several_tiles(small_tiles):
    """K = 32 (two K tiles), V = 48 (padded to 64: four V tiles, the last one masked)."""
    kd, vd, n = 32, 48, 37
    x = make_inputs(n, kd=kd, vd=vd, seed=30)
    y = make_inputs(20, kd=kd, vd=vd, seed=31)
    assert_cuts_match_alone(lambda seqs, slots, steps: run_schedule(gdn_chunk_triton, seqs, slots, steps, aligned=True),
                            x, y, ref64(*x, [0, n], kd ** -0.5))


def test_one_token_plan_matches_host_plan():
    start_pos = np.array([0, 15, 16, 47])
    dev_plan = ChunkPlan.one_token_each(torch.tensor(start_pos, dtype=torch.int32), C, True)
    host_plan = ChunkPlan.from_host(start_pos, np.ones(4, dtype=np.int64), C, True, torch.device("cpu"))
    for f in ("seq", "start", "first_new", "end", "token0", "seq_chunks"):
        assert torch.equal(getattr(dev_plan, f), getattr(host_plan, f)), f


# ---- 4. fast mode: continuation is accurate (not bit-equal to one prefill) -----------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_fast_mode_continuation(impl):
    seqs = _x_seqs(torch.float32)
    scale = K ** -0.5
    for name in ("cuts", "prefill_decode"):
        slots, steps = invariance_schedules()[name]
        outs, state = run_schedule(IMPLS[impl], {s: seqs[s] for s in used_ids(steps)}, slots, steps, aligned=False)
        for sid, o in outs.items():
            n = o.shape[0]
            assert rel_err(o, ref64(*(t[:n] for t in seqs[sid]), [0, n], scale)) < 1e-5, (name, sid)
    # the final state is the state after every token: continuing from it matches the reference
    x = seqs["x"]
    s = state["ssm"][slots["x"]].cpu().double()
    ref_state = torch.zeros_like(s)
    Gq = HV // HK
    for t in range(X_LEN):
        kt = x[1][t].double().repeat_interleave(Gq, 0)
        ref_state = ref_state * x[3][t].double().exp()[:, None, None]
        kv = (ref_state * kt[:, :, None]).sum(1)
        ref_state = ref_state + kt[:, :, None] * (x[4][t].double()[:, None] * (x[2][t].double() - kv))[:, None, :]
    assert rel_err(s, ref_state) < 1e-5


# ---- 5. Triton (interpreted) and torch agree ------------------------------------------------------

@pytest.mark.parametrize("aligned", [True, False])
def test_triton_matches_torch(aligned):
    seqs = _x_seqs(torch.float32)
    assert_runs_close(lambda op, used, slots, steps, aligned: run_schedule(op, {s: seqs[s] for s in used}, slots,
                                                                          steps, aligned=aligned),
                      (gdn_chunk_torch, gdn_chunk_triton), aligned)


# ---- 6. gradients --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_t_feeds_the_backward(dtype, monkeypatch):
    """SAVE_T_FOR_BACKWARD (on): the trainer's forward stores each chunk's T (as w and u took
    it) without moving a bit of its output against the prep kernel compiled without the store, and the fused backward given those T (the forward's
    chunk plan mapping a sequence's chunks to them) gives the gradients of the reference:
    within 1e-5 of float64 autograd in float32, 1e-2 in bf16, as when it builds T itself.
    Three sequences of 1, 2 and 3 chunks (the last ones partial), so a chunk taken from the
    wrong sequence or chunk moves the gradients."""
    from vllm.kernels import gdn_chunk
    from vllm.kernels.gdn_backward import gdn_backward_triton
    lens = [21, 9, 40]
    cu = np.concatenate([[0], np.cumsum(lens)]).tolist()
    scale = K ** -0.5
    xs = [t.to(DEV) for t in make_inputs(cu[-1], seed=22)]
    if dtype == torch.bfloat16:
        xs = [t.bfloat16() if i < 3 else t for i, t in enumerate(xs)]
    md = step_metadata([0] * len(lens), lens)
    monkeypatch.setattr(gdn_chunk, "SAVE_T_FOR_BACKWARD", False)  # the prep kernel without the store
    plain = gdn_chunk_triton(*xs, scale, md, None, chunk_size=C, aligned=True)
    monkeypatch.setattr(gdn_chunk, "SAVE_T_FOR_BACKWARD", True)
    plan = md.chunk_plan(C, True)
    t_out = torch.full((plan.num_chunks, HV, C, C), float("nan"), dtype=dtype, device=DEV)
    o = gdn_chunk_triton(*xs, scale, md, None, chunk_size=C, aligned=True, t_out=t_out)
    assert torch.equal(bits(o), bits(plain))
    assert torch.equal(bits(gdn_chunk_triton(*xs, scale, md, None, chunk_size=C, aligned=True)), bits(plain))
    assert not t_out.isnan().any()  # every chunk's T written
    tri = torch.ones(C, C, dtype=torch.bool, device=DEV).triu(1)
    assert (t_out[:, :, tri] == 0).all() and (t_out.diagonal(dim1=-2, dim2=-1) == 1).all()  # unit lower
    do = torch.randn(xs[2].shape, generator=torch.Generator().manual_seed(23)).to(DEV).to(dtype)
    got = gdn_backward_triton(*xs, do, cu, scale, C, t_out, plan.seq_chunks.to(torch.int32))
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in xs]
    gdn_reference(*ref_leaves, cu, scale, chunk_size=C).backward(do.cpu().double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, b in zip("q k v g beta".split(), got, ref_leaves):
        assert rel_err(a.float().cpu(), b.grad) < tol, name
    with pytest.raises(ValueError, match="t_chunks"):
        gdn_backward_triton(*xs, do, cu, scale, C, t_out, plan.seq_chunks[:-1].to(torch.int32))
    with pytest.raises(ValueError, match="t_out"):
        gdn_chunk_triton(*xs, scale, md, None, chunk_size=C, aligned=True, t_out=t_out[1:])



def test_the_layers_forward_is_the_one_that_stores_t():
    """GatedDeltaRuleFn keeps T only from the Triton kernel (the torch form has no t_out):
    the layer's op (ops.gated_delta_rule: the numerics table's CUDA entry, bound to the chunk
    size) is that kernel, so the trainer's forward on a GPU does keep T."""
    from vllm.kernels import gdn_chunk, numerics_table
    cuda_fwd = functools.partial(numerics_table._GDN_CHUNK_ALIGNED.cuda, chunk_size=C)
    assert gdn_chunk._stores_t(cuda_fwd)
    assert not gdn_chunk._stores_t(functools.partial(gdn_chunk_torch, chunk_size=C, aligned=True))


@pytest.mark.gpu
def test_gpu_saved_t_autograd_fn(monkeypatch):
    """On CUDA GatedDeltaRuleFn keeps T from the forward for the fused backward
    (SAVE_T_FOR_BACKWARD): the output has the bits of the prep kernel compiled without the
    store (the store leaves the rest of the compiled kernel's arithmetic alone), and the
    gradients are within 1e-4 of float64 (float32 inputs: 3xTF32 dots)."""
    from vllm.kernels import gdn_chunk
    lens, scale = [100, 37], K ** -0.5
    cu = [0, 100, 137]
    xs = make_inputs(cu[-1], seed=24)
    md = step_metadata([0, 0], lens)
    fwd = functools.partial(gdn_chunk_triton, chunk_size=C, aligned=True)
    do = torch.randn(cu[-1], HV, V, generator=torch.Generator().manual_seed(25))
    outs, grads = {}, {}
    for save in (False, True):
        monkeypatch.setattr(gdn_chunk, "SAVE_T_FOR_BACKWARD", save)
        leaves = [t.cuda().requires_grad_() for t in xs]
        o = GatedDeltaRuleFn.apply(fwd, *leaves, scale, md, C)
        o.backward(do.cuda())
        outs[save], grads[save] = o.detach(), [t.grad for t in leaves]
    assert torch.equal(bits(outs[True]), bits(outs[False]))
    ref_leaves = [t.double().requires_grad_() for t in xs]
    gdn_reference(*ref_leaves, cu, scale, chunk_size=C).backward(do.double())
    for name, a, b in zip("q k v g beta".split(), grads[True], ref_leaves):
        assert rel_err(a.cpu(), b.grad) < 1e-4, name


@pytest.mark.parametrize("impl", IMPLS)
def test_autograd_fn_gradients(impl):
    lens = [21, 9]
    cu = [0, 21, 30]
    scale = K ** -0.5
    xs = make_inputs(cu[-1], seed=20)
    fwd = functools.partial(IMPLS[impl], chunk_size=C, aligned=True)
    md = step_metadata([0, 0], lens)
    leaves = [t.to(DEV).clone().requires_grad_() for t in xs]
    o = GatedDeltaRuleFn.apply(fwd, *leaves, scale, md, C)
    # the forward is the kernel's bits
    plain = IMPLS[impl](*(t.to(DEV) for t in xs), scale, md, None, chunk_size=C, aligned=True)
    assert torch.equal(bits(o.detach()), bits(plain))
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(21)).to(DEV)
    o.backward(do)
    ref_leaves = [t.detach().double().requires_grad_() for t in xs]
    ref = gdn_reference(*ref_leaves, cu, scale, chunk_size=C)
    ref.backward(do.cpu().double())
    for name, a, b in zip("q k v g beta".split(), leaves, ref_leaves):
        assert a.grad.dtype == torch.float32
        assert rel_err(a.grad.cpu(), b.grad) < 1e-5, name


# ---- 7. real dims on the GPU ------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_real_dims_prefill_cuts_decode_and_trainer_bits():
    _real_dims_check(16, 32, 128, 128, 64)


def _real_dims_check(hk, hv, kd, vd, c):
    """Qwen3-Next's GDN dims (16 key / 32 value heads of 128, C = 64, bf16): two sequences
    computed as one prefill, as prefills cut off the grid, as a prefill then decode steps and
    as all-decode give the same output and state bits (aligned), and the trainer's forward (no
    cache) gives the prefill's bits; the fast mode's decode (the fused recurrence) does not."""
    from vllm.kernels.gdn_ops import gdn_recurrent_triton

    lens, slots = REAL_DIMS_LENS, REAL_DIMS_SLOTS
    seqs = {sid: make_inputs(n, hk, hv, kd, vd, seed=40 + sid, dtype=torch.bfloat16) for sid, n in lens.items()}
    run = functools.partial(run_schedule, gdn_chunk_triton, seqs, slots, aligned=True, chunk=c)
    ref, ref_state = assert_real_dims_schedules_agree(run)
    # without the decode caches every decode step takes the whole-chunk path: the same bits
    # as the decode path's 16-row tiles
    got, state = run(real_dims_schedules()["prefill+decode"], t_cache=False)
    for sid, slot in slots.items():
        assert torch.equal(bits(got[sid]), bits(ref[sid])), sid
        assert torch.equal(bits(state["ssm"][slot]), bits(ref_state["ssm"][slot])), sid
    # the trainer: no cache, both sequences from position 0
    q, k, v, g, beta = (torch.cat([seqs[s][i] for s in lens]).to(DEV) for i in range(5))
    md = step_metadata([0, 0], list(lens.values()))
    o = gdn_chunk_triton(q, k, v, g, beta, kd ** -0.5, md, None, chunk_size=c, aligned=True).cpu()
    assert torch.equal(bits(o), bits(torch.cat([ref[s] for s in lens])))

    # fast mode's decode is the native recurrence: its rows differ from the chunked prefill's
    def fast_op(q, k, v, g, beta, scale, md, state, *, chunk_size, aligned):
        op = gdn_recurrent_triton if md.max_query_len == 1 else gdn_chunk_triton
        kw = {} if md.max_query_len == 1 else {"aligned": False}
        return op(q, k, v, g, beta, scale, md, state, chunk_size=chunk_size, **kw)
    assert_fast_decode_differs(functools.partial(run_schedule, fast_op, seqs, slots, aligned=False, chunk=c))
