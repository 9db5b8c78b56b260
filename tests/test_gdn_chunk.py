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

from vllm.forward_context import ChunkPlan, StateMetadata
from vllm.kernels.gdn_chunk import GatedDeltaRuleFn, gdn_chunk_torch, gdn_chunk_triton, gdn_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HK, HV, K, V, C = 2, 4, 16, 32, 16
IMPLS = {"torch": gdn_chunk_torch, "triton": gdn_chunk_triton}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.double() - ref.double()).norm().item()
    norm = ref.double().norm().item()
    return diff / norm if norm else diff


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


def metadata(start_pos, q_lens, slots=None, host=True) -> StateMetadata:
    cu = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    return StateMetadata(
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEV),
        start_pos=torch.tensor(start_pos, dtype=torch.int32, device=DEV),
        slots=None if slots is None else torch.tensor(slots, dtype=torch.int32, device=DEV),
        max_query_len=int(max(q_lens)),
        host_start_pos=np.asarray(start_pos) if host else None,
        host_q_lens=np.asarray(q_lens) if host else None)


def new_state(num_slots, dtype, aligned, hk, hv, kd, vd, chunk=C):
    """A cache filled with NaN: reading any stale entry shows in the outputs."""
    nan = float("nan")
    st = {"ssm": torch.full((num_slots, hv, kd, vd), nan, device=DEV)}
    if aligned:
        st["buf_k"] = torch.full((num_slots, chunk, hk, kd), nan, dtype=dtype, device=DEV)
        st["buf_v"] = torch.full((num_slots, chunk, hv, vd), nan, dtype=dtype, device=DEV)
        st["buf_g"] = torch.full((num_slots, chunk, hv), nan, device=DEV)
        st["buf_beta"] = torch.full((num_slots, chunk, hv), nan, device=DEV)
    return st


def run_schedule(op, seqs, slots, schedule, aligned, num_slots=4, chunk=C):
    """Run `schedule` (a list of steps, each a list of (sequence id, tokens)) through `op`
    with a cache. seqs: {id: (q, k, v, g, beta)}. Returns ({id: outputs}, state)."""
    q0, _, v0, _, _ = next(iter(seqs.values()))
    state = new_state(num_slots, q0.dtype, aligned, q0.shape[1], v0.shape[1], q0.shape[2], v0.shape[2], chunk)
    pos = {sid: 0 for sid in seqs}
    outs = {sid: [] for sid in seqs}
    scale = q0.shape[2] ** -0.5
    for step in schedule:
        parts = [[x[pos[sid]:pos[sid] + n] for x in seqs[sid]] for sid, n in step]
        q, k, v, g, beta = (torch.cat([p[i] for p in parts]).to(DEV).contiguous() for i in range(5))
        q_lens = [n for _, n in step]
        md = metadata([pos[sid] for sid, _ in step], q_lens, [slots[sid] for sid, _ in step],
                      host=max(q_lens) > 1)
        o = op(q, k, v, g, beta, scale, md, state, chunk_size=chunk, aligned=aligned).cpu()
        at = 0
        for sid, n in step:
            outs[sid].append(o[at:at + n])
            at += n
            pos[sid] += n
    return {sid: torch.cat(o) for sid, o in outs.items() if o}, state


# ---- 1. the reference ---------------------------------------------------------------------------

def test_reference_matches_recurrences():
    from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                     torch_recurrent_gated_delta_rule)
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
        hf, _ = torch_recurrent_gated_delta_rule(*args, use_qk_l2norm_in_kernel=False)
        assert rel_err(ref[sl], hf[0]) < 1e-5
        hf, _ = torch_chunk_gated_delta_rule(*args, chunk_size=C, use_qk_l2norm_in_kernel=False)
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
    o = IMPLS[impl](*(t.to(DEV) for t in (q, k, v, g, beta)), scale, metadata([0, 0, 0], lens), None,
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
    o = IMPLS[impl](*(t.to(DEV) for t in (q, k, v, g, beta)), scale, metadata([0, 0], [23, 17]), None,
                    chunk_size=C, aligned=True)
    assert o.dtype == torch.bfloat16
    assert rel_err(o.cpu(), ref64(q, k, v, g, beta, cu, scale)) < 2e-2


# ---- 3. invariance (aligned): batches and step cuts ----------------------------------------------

X_LEN = 41  # two full chunks and a partial one


def _schedules():
    """Ways to run sequence "x" (41 tokens) with company. Each is (slots, steps)."""
    one = [("x", 1)]
    return {
        "alone": ({"x": 0}, [[("x", X_LEN)]]),
        "batch": ({"y": 3, "x": 1, "z": 2}, [[("y", 30), ("x", X_LEN), ("z", 7)]]),
        "batch_reordered": ({"x": 2, "z": 0, "y": 3}, [[("z", 19)], [("x", X_LEN), ("y", 0), ("z", 12)]]),
        "cuts": ({"x": 3, "y": 1}, [[("x", 5)], [("y", 9), ("x", 11)], [("x", 17), ("y", 2)], [("x", 8)]]),
        # steps that resume mid-chunk and end in a later partial chunk (the buffer is read
        # and rewritten by one step)
        "cuts_across": ({"x": 0, "z": 3}, [[("x", 5), ("z", 3)], [("z", 4), ("x", 20)], [("x", 9)], [("x", 7)]]),
        "prefill_decode": ({"x": 1, "y": 0}, [[("x", 20), ("y", 33)]]
                           + [[("y", 1), ("x", 1)] if i % 3 else one for i in range(X_LEN - 20)]),
        "all_decode": ({"x": 2}, [one] * X_LEN),
    }


def _x_seqs(dtype):
    x = make_inputs(X_LEN, seed=10, dtype=dtype)
    y = make_inputs(60, seed=11, dtype=dtype)
    z = make_inputs(31, seed=12, dtype=dtype)
    return {"x": x, "y": y, "z": z}


def _check_invariance(impl, dtype, names):
    seqs = _x_seqs(dtype)
    scale = K ** -0.5
    results = {}
    for name in names:
        slots, steps = _schedules()[name]
        used = {sid for st in steps for sid, _ in st}
        outs, state = run_schedule(IMPLS[impl], {s: seqs[s] for s in used}, slots, steps, aligned=True)
        sl = slots["x"]
        tail = X_LEN % C
        results[name] = (outs["x"], state["ssm"][sl].cpu(), state["buf_k"][sl, :tail].cpu(),
                         state["buf_v"][sl, :tail].cpu(), state["buf_g"][sl, :tail].cpu())
    base_name = names[0]
    base = results[base_name]
    ref = ref64(*seqs["x"], [0, X_LEN], scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(base[0], ref) < tol
    assert not torch.isnan(base[1]).any()
    for name in names[1:]:
        got = results[name]
        assert torch.equal(bits(got[0]), bits(base[0])), f"{name}: outputs differ from {base_name}"
        assert torch.equal(bits(got[1]), bits(base[1])), f"{name}: state differs from {base_name}"
        for a, b in zip(got[2:], base[2:]):
            assert torch.equal(bits(a), bits(b)), f"{name}: buffer differs from {base_name}"
    return results


@pytest.mark.parametrize("impl", IMPLS)
def test_invariance_fp32(impl):
    _check_invariance(impl, torch.float32, list(_schedules()))


@pytest.mark.parametrize("impl", IMPLS)
def test_invariance_bf16(impl):
    _check_invariance(impl, torch.bfloat16, ["alone", "cuts", "prefill_decode"])


@pytest.mark.parametrize("impl", IMPLS)
def test_training_forward_equals_rollout(impl):
    """No cache (the trainer) gives the bits of the cached prefill and of decode steps."""
    seqs = _x_seqs(torch.float32)
    x = seqs["x"]
    y = seqs["y"]
    scale = K ** -0.5
    args = [torch.cat((a, b)).to(DEV) for a, b in zip(y, x)]
    o = IMPLS[impl](*args, scale, metadata([0, 0], [60, X_LEN]), None, chunk_size=C, aligned=True).cpu()
    slots, steps = _schedules()["prefill_decode"]
    outs, _ = run_schedule(IMPLS[impl], {"x": x, "y": y}, slots, steps, aligned=True)
    assert torch.equal(bits(o[60:]), bits(outs["x"]))


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_sequence_and_unused_slots_untouched(impl):
    seqs = _x_seqs(torch.float32)
    slots, steps = _schedules()["batch_reordered"]  # y has a 0-token entry (slot 3); slot 1 unused
    _, state = run_schedule(IMPLS[impl], {s: seqs[s] for s in slots}, slots, steps, aligned=True)
    for name, t in state.items():
        assert torch.isnan(t[1]).all() and torch.isnan(t[3]).all(), name


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
    scheds = {
        "alone": ({"x": 0}, [[("x", n)]]),
        "cuts": ({"x": 2, "y": 0}, [[("x", 3), ("y", 20)], [("x", 30)], [("x", 1)], [("x", 3)]]),
    }
    res = {}
    for name, (slots, steps) in scheds.items():
        seqs = {"x": x, "y": y} if name == "cuts" else {"x": x}
        outs, state = run_schedule(gdn_chunk_triton, seqs, slots, steps, aligned=True)
        res[name] = (outs["x"], state["ssm"][slots["x"]].cpu())
    assert rel_err(res["alone"][0], ref64(*x, [0, n], kd ** -0.5)) < 1e-5
    assert torch.equal(bits(res["cuts"][0]), bits(res["alone"][0]))
    assert torch.equal(bits(res["cuts"][1]), bits(res["alone"][1]))


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
        slots, steps = _schedules()[name]
        used = {sid for st in steps for sid, _ in st}
        outs, state = run_schedule(IMPLS[impl], {s: seqs[s] for s in used}, slots, steps, aligned=False)
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
    slots, steps = _schedules()["cuts"]
    used = {sid for st in steps for sid, _ in st}
    a, sa = run_schedule(gdn_chunk_torch, {s: seqs[s] for s in used}, slots, steps, aligned=aligned)
    b, sb = run_schedule(gdn_chunk_triton, {s: seqs[s] for s in used}, slots, steps, aligned=aligned)
    for sid in a:
        assert rel_err(b[sid], a[sid]) < 1e-5
    for sid in used:
        assert rel_err(sb["ssm"][slots[sid]].cpu(), sa["ssm"][slots[sid]].cpu()) < 1e-5


# ---- 6. gradients --------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_autograd_fn_gradients(impl):
    lens = [21, 9]
    cu = [0, 21, 30]
    scale = K ** -0.5
    xs = make_inputs(cu[-1], seed=20)
    fwd = functools.partial(IMPLS[impl], chunk_size=C, aligned=True)
    md = metadata([0, 0], lens)
    leaves = [t.to(DEV).clone().requires_grad_() for t in xs]
    o = GatedDeltaRuleFn.apply(fwd, *leaves, scale, md)
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

    lens = {0: 300, 1: 137}
    seqs = {sid: make_inputs(n, hk, hv, kd, vd, seed=40 + sid, dtype=torch.bfloat16) for sid, n in lens.items()}
    slots = {0: 1, 1: 2}
    schedules = {
        "whole": [[(0, 300), (1, 137)]],
        "cuts": [[(0, 37), (1, 100)], [(1, 37), (0, 200)], [(0, 63)]],
        "prefill+decode": [[(0, 130), (1, 65)]] + [[(0, 1), (1, 1)]] * 72 + [[(0, 1)]] * 98,
        "decode": [[(0, 1), (1, 1)]] * 137 + [[(0, 1)]] * 163,
    }
    run = functools.partial(run_schedule, gdn_chunk_triton, seqs, slots, aligned=True, chunk=c)
    ref, ref_state = run(schedules["whole"])
    for name, steps in schedules.items():
        got, state = run(steps)
        for sid in lens:
            assert torch.equal(bits(got[sid]), bits(ref[sid])), (name, sid)
            assert torch.equal(bits(state["ssm"][slots[sid]]), bits(ref_state["ssm"][slots[sid]])), (name, sid)
    # the trainer: no cache, both sequences from position 0
    q, k, v, g, beta = (torch.cat([seqs[s][i] for s in lens]).to(DEV) for i in range(5))
    md = metadata([0, 0], list(lens.values()))
    o = gdn_chunk_triton(q, k, v, g, beta, kd ** -0.5, md, None, chunk_size=c, aligned=True).cpu()
    assert torch.equal(bits(o), bits(torch.cat([ref[s] for s in lens])))
    # fast mode's decode is the native recurrence: its rows differ from the chunked prefill's
    fast = functools.partial(run_schedule, seqs=seqs, slots=slots, aligned=False, chunk=c)

    def fast_op(q, k, v, g, beta, scale, md, state, *, chunk_size, aligned):
        op = gdn_recurrent_triton if md.max_query_len == 1 else gdn_chunk_triton
        kw = {} if md.max_query_len == 1 else {"aligned": False}
        return op(q, k, v, g, beta, scale, md, state, chunk_size=chunk_size, **kw)
    whole, _ = fast(fast_op, schedule=schedules["whole"])
    dec, _ = fast(fast_op, schedule=schedules["prefill+decode"])
    differ = sum(int(not torch.equal(bits(dec[s][t]), bits(whole[s][t]))) for s in lens for t in range(lens[s]))
    print(f"fast mode: {differ} of {sum(lens.values())} token rows differ between prefill and prefill+decode")
    assert differ > 0
