"""Gated DeltaNet ops (vllm/kernels/gdn_ops.py): the torch entries and the Triton entries
(through TRITON_INTERPRET=1 on CPU) against transformers' Qwen3-Next formulas, bit-pattern
batch invariance, the conv's independence from how a sequence is cut into steps, and
each autograd Function's gradients against float64 autograd of the formula.

In bf16 the entries should reproduce transformers' bits wherever the float32 value before a
rounding agrees (almost every element: `mostly_same_bits`). The Triton interpreter casts
float32 to bf16 by truncation (compiled kernels round to nearest even), so there that check
covers the torch entries only; on the GPU it covers both.
"""
from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vllm.testing.chunked_scan import transformers_delta_rule
from vllm.forward_context import StateMetadata  # noqa: E402
from vllm.kernels import gdn_ops  # noqa: E402

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

CONV = {"torch": gdn_ops.causal_conv1d_torch, "triton": gdn_ops.causal_conv1d_triton}
GATING = {"torch": gdn_ops.gdn_gating_torch, "triton": gdn_ops.gdn_gating_triton}
NORM = {"torch": gdn_ops.rms_norm_gated_torch, "triton": gdn_ops.rms_norm_gated_triton}
RECURRENT = {"torch": gdn_ops.gdn_recurrent_torch, "triton": gdn_ops.gdn_recurrent_triton}
IMPLS = ["torch", "triton"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def mostly_same_bits(impl: str, out: torch.Tensor, ref: torch.Tensor, frac: float = 0.97) -> None:
    """bf16 roundings where transformers has them: a missing or extra rounding leaves only
    ~75% of the elements bit-equal, differing float32 arithmetic (exp, sum order) a few."""
    if impl == "triton" and INTERPRET:
        return
    assert out.dtype == ref.dtype == torch.bfloat16
    assert (bits(out) == bits(ref)).float().mean().item() >= frac


def make_md(start_pos, q_lens, slots) -> StateMetadata:
    q_lens = np.asarray(q_lens, dtype=np.int64)
    cu = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    i32 = lambda a: torch.tensor(np.asarray(a), dtype=torch.int32, device=DEV)  # noqa: E731
    return StateMetadata(cu_seqlens=i32(cu), start_pos=i32(start_pos), slots=None if slots is None else i32(slots),
                         max_query_len=int(q_lens.max()) if len(q_lens) else 0,
                         host_start_pos=np.asarray(start_pos, dtype=np.int64), host_q_lens=q_lens)


def strided(x: torch.Tensor, pad: int = 5) -> torch.Tensor:
    """x's values in a non-contiguous view (last dim contiguous), as a split of a wider tensor gives."""
    big = torch.randn(*x.shape[:-1], x.shape[-1] + pad, dtype=x.dtype, device=x.device)
    view = big[..., 2:2 + x.shape[-1]]
    view.copy_(x)
    return view


# ---- 1. causal conv1d ----------------------------------------------------------------------------

def hf_conv(x_seq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' prefill conv of one sequence [L, D] -> [L, D]."""
    return hf.causal_conv1d_fn(x_seq.t()[None], weight, None, activation="silu")[0].t()


def run_conv(fn, xs, weight, schedule, slot_of, n_slots):
    """Feed sequences xs ([L_s, D] each) in steps; schedule: steps of (seq, n_tokens).
    Returns each sequence's outputs and the conv state (unused slots start as NaN)."""
    D, W = weight.shape
    conv_state = torch.full((n_slots, W - 1, D), float("nan"), dtype=xs[0].dtype, device=DEV)
    pos = [0] * len(xs)
    outs = [[] for _ in xs]
    for step in schedule:
        x = strided(torch.cat([xs[s][pos[s]:pos[s] + n] for s, n in step]))
        md = make_md([pos[s] for s, _ in step], [n for _, n in step], [slot_of[s] for s, _ in step])
        y = fn(x, weight, md, conv_state)
        assert y.shape == x.shape and y.dtype == x.dtype
        for (s, n), part in zip(step, y.split([n for _, n in step])):
            outs[s].append(part)
            pos[s] += n
    assert pos == [len(x) for x in xs]
    return [torch.cat(o) for o in outs], conv_state


def cut_schedule(lens, rng):
    """Each sequence cut at random points; step i batches every sequence's i-th piece in a
    shuffled order (some pieces empty: a sequence with no token in a step)."""
    pieces = []
    for L in lens:
        cuts = sorted(rng.choice(np.arange(1, L), size=min(L - 1, rng.integers(1, 5)), replace=False)) if L > 1 else []
        p = np.diff([0, *cuts, L]).tolist()
        if len(p) > 1:
            p.insert(1, 0)
        pieces.append(p)
    steps = []
    for i in range(max(map(len, pieces))):
        step = [(s, p[i]) for s, p in enumerate(pieces) if i < len(p)]
        rng.shuffle(step)
        steps.append(step)
    return steps


def decode_schedule(lens):
    """One token per sequence per step (T == S), every sequence with tokens left."""
    return [[(s, 1) for s, L in enumerate(lens) if t < L] for t in range(max(lens))]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("W", [2, 3, 4])
def test_conv_prefill_matches_transformers(impl, W):
    g = torch.Generator().manual_seed(W)
    D, lens = 40, [7, 1, 19, 2]
    xs = [torch.randn(L, D, generator=g).to(DEV) for L in lens]
    weight = (torch.randn(D, W, generator=g) * 0.5).to(DEV)
    x = strided(torch.cat(xs))
    # no cache: every sequence at position 0, its final window dropped
    y = CONV[impl](x, weight, make_md([0] * len(lens), lens, None), None)
    torch.testing.assert_close(y, torch.cat([hf_conv(s, weight) for s in xs]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W", [2, 4])
def test_conv_cut_independent(impl, dtype, W):
    """One prefill, random cuts into steps, one-token steps: identical outputs and windows."""
    g = torch.Generator().manual_seed(10 + W)
    D, lens = 96, [13, 1, 29, 2, 6]
    xs = [torch.randn(L, D, generator=g).to(DEV, dtype) for L in lens]
    weight = (torch.randn(D, W, generator=g) * 0.5).to(DEV, dtype)
    slot_of, n_slots = [4, 0, 2, 5, 1], 7
    fn = CONV[impl]
    full, st_full = run_conv(fn, xs, weight, [[(s, L) for s, L in enumerate(lens)]], slot_of, n_slots)
    runs = [run_conv(fn, xs, weight, cut_schedule(lens, np.random.default_rng(seed)), slot_of, n_slots)
            for seed in range(2)]
    runs.append(run_conv(fn, xs, weight, decode_schedule(lens), slot_of, n_slots))
    for outs, st in runs:
        for s in range(len(lens)):
            assert same_bits(outs[s], full[s]), s
        assert torch.equal(bits(st), bits(st_full))
    for s, L in enumerate(lens):
        # the window is the last W-1 inputs, zeros before position 0
        expect = torch.cat((torch.zeros(W - 1, D, dtype=dtype, device=DEV), xs[s]))[-(W - 1):]
        assert same_bits(st_full[slot_of[s]], expect)
        if dtype == torch.float32:
            torch.testing.assert_close(full[s], hf_conv(xs[s], weight), rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(full[s], hf_conv(xs[s], weight), rtol=2e-2, atol=2e-2)
    if dtype == torch.bfloat16:
        mostly_same_bits(impl, torch.cat(full), torch.cat([hf_conv(x, weight) for x in xs]))
    for slot in set(range(n_slots)) - set(slot_of):
        assert st_full[slot].isnan().all()  # slots no sequence owns are never written


@pytest.mark.parametrize("impl", IMPLS)
def test_conv_decode_matches_causal_conv1d_update(impl):
    g = torch.Generator().manual_seed(3)
    D, W, S = 48, 4, 3
    weight = torch.randn(D, W, generator=g).to(DEV)
    conv_state = torch.randn(5, W - 1, D, generator=g).to(DEV)
    slots = [3, 0, 4]
    hf_state = conv_state[slots].transpose(1, 2).clone()  # [S, D, W-1]
    x = strided(torch.randn(S, D, generator=g).to(DEV))
    y = CONV[impl](x, weight, make_md([5, 3, 9], [1] * S, slots), conv_state)
    ref = hf.causal_conv1d_update(x[:, :, None].clone(), hf_state, weight, None, "silu")[:, :, 0]
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(conv_state[slots], hf_state.transpose(1, 2))


# ---- 2. gating ---------------------------------------------------------------------------------

def gating_inputs(T, Hk=2, Hv=4, K=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mixed = (torch.randn(T, Hk, 3 * K, generator=g) * 2).to(DEV, dtype)
    q, k = mixed[..., :K], mixed[..., K:2 * K]  # views of a split
    ba = (torch.randn(T, 2 * Hv, generator=g) * 4).to(DEV, dtype)
    b, a = ba[:, :Hv], ba[:, Hv:]
    a[0, 0] = 30.0  # past softplus' threshold
    a[1, 0] = -25.0  # where log1p matters
    A_log = torch.log(torch.empty(Hv).uniform_(0.5, 16, generator=g)).to(DEV, dtype)
    dt_bias = torch.randn(Hv, generator=g).to(DEV, dtype)
    return q, k, a, b, A_log, dt_bias


def gating_reference(q, k, a, b, A_log, dt_bias):
    """transformers' formulas (l2norm in float32, its gates), unrounded."""
    return (hf.l2norm(q.double(), dim=-1, eps=1e-6), hf.l2norm(k.double(), dim=-1, eps=1e-6),
            -A_log.double().exp() * F.softplus(a.double() + dt_bias.double()), b.double().sigmoid())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gating_matches_reference(impl, dtype):
    ins = gating_inputs(23, dtype=dtype)
    qn, kn, g, beta = GATING[impl](*ins)
    assert qn.dtype == dtype and qn.is_contiguous() and g.dtype == beta.dtype == torch.float32
    rqn, rkn, rg, rbeta = gating_reference(*ins)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(qn.double(), rqn, **tol)
    torch.testing.assert_close(kn.double(), rkn, **tol)
    torch.testing.assert_close(g.double(), rg, rtol=1e-5, atol=1e-6)
    assert g[1, 0].item() < 0 and g[0, 0].item() == pytest.approx(-ins[4][0].float().exp().item() * (30.0 + ins[5][0].float().item()))
    if dtype == torch.float32:
        torch.testing.assert_close(beta.double(), rbeta, rtol=1e-6, atol=1e-7)
    else:  # b.sigmoid() in bf16, as transformers computes beta
        torch.testing.assert_close(beta, ins[3].sigmoid().float(), rtol=0, atol=2 ** -8)
        assert same_bits(beta.bfloat16().float(), beta)  # rounded to bf16, returned in float32
        mostly_same_bits(impl, beta.bfloat16(), ins[3].sigmoid())
        for x, xn in ((ins[0], qn), (ins[1], kn)):
            mostly_same_bits(impl, xn, hf.l2norm(x.float(), dim=-1, eps=1e-6).to(dtype))


@pytest.mark.parametrize("impl", IMPLS)
def test_gating_rows_independent_of_batch(impl):
    q, k, a, b, A_log, dt_bias = gating_inputs(29, seed=1)
    full = GATING[impl](q, k, a, b, A_log, dt_bias)
    for rows in ([0], [5], [28], list(range(3, 20))):
        part = GATING[impl](q[rows], k[rows], a[rows], b[rows], A_log, dt_bias)
        for p, f in zip(part, full):
            assert same_bits(p, f[rows]), rows


# ---- 3. gated RMSNorm ----------------------------------------------------------------------------

def hf_norm(x, z, weight, eps):
    m = hf.Qwen3NextRMSNormGated(x.shape[-1], eps=eps).to(DEV, weight.dtype)
    with torch.no_grad():
        m.weight.copy_(weight)
        return m(x, z)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [32, 24])
def test_rms_norm_gated_matches_transformers(impl, dtype, V):
    g = torch.Generator().manual_seed(V)
    x = strided(torch.randn(40, V, generator=g).to(DEV, dtype))
    z = strided((torch.randn(40, V, generator=g) * 3).to(DEV, dtype))
    w = (1 + 0.5 * torch.randn(V, generator=g)).to(DEV, dtype)
    out = NORM[impl](x, z, w, 1e-6)
    ref = hf_norm(x, z, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
        mostly_same_bits(impl, out, ref)


@pytest.mark.parametrize("impl", IMPLS)
def test_rms_norm_gated_rows_independent_of_batch(impl):
    g = torch.Generator().manual_seed(7)
    T, H, V = 21, 4, 32
    x = torch.randn(T * H, V, generator=g).to(DEV)
    z = strided(torch.randn(T, H, V, generator=g).to(DEV))  # the gate as a [T, H, V] view
    w = torch.randn(V, generator=g).to(DEV)
    full = NORM[impl](x, z.reshape(T * H, V), w, 1e-6)
    assert same_bits(NORM[impl](x.view(T, H, V), z, w, 1e-6).reshape(T * H, V), full)
    for rows in ([0], [83], list(range(10, 37))):
        assert same_bits(NORM[impl](x[rows], z.reshape(T * H, V)[rows], w, 1e-6), full[rows]), rows


# ---- 4. recurrent step ---------------------------------------------------------------------------

def recurrent_inputs(lens, Hk=2, Hv=4, K=16, V=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for L in lens:
        seqs.append(dict(
            q=F.normalize(torch.randn(L, Hk, K, generator=g), dim=-1).to(DEV),
            k=F.normalize(torch.randn(L, Hk, K, generator=g), dim=-1).to(DEV),
            v=torch.randn(L, Hv, V, generator=g).to(DEV),
            g=(-torch.rand(L, Hv, generator=g) * 0.5).to(DEV),
            beta=torch.rand(L, Hv, generator=g).to(DEV)))
    return seqs


def run_recurrent(fn, seqs, steps, slot_of, n_slots, scale):
    """steps: lists of sequence indices, each taking its next token. Slots start as NaN."""
    Hv, K, V = seqs[0]["v"].shape[1], seqs[0]["q"].shape[2], seqs[0]["v"].shape[2]
    ssm = torch.full((n_slots, Hv, K, V), float("nan"), device=DEV)
    pos = [0] * len(seqs)
    outs = [[] for _ in seqs]
    for step in steps:
        t = {name: torch.stack([seqs[s][name][pos[s]] for s in step]) for name in ("q", "k", "v", "g", "beta")}
        md = make_md([pos[s] for s in step], [1] * len(step), [slot_of[s] for s in step])
        o = fn(strided(t["q"]), strided(t["k"]), strided(t["v"]), t["g"], t["beta"], scale, md, {"ssm": ssm})
        for s, row in zip(step, o):
            outs[s].append(row)
            pos[s] += 1
    return [torch.stack(o) for o in outs], ssm


@pytest.mark.parametrize("impl", IMPLS)
def test_recurrent_matches_transformers(impl):
    lens = [5, 3, 6]
    seqs = recurrent_inputs(lens)
    K = seqs[0]["q"].shape[2]
    # sequence 1 joins at the third step; the batch order changes from step to step
    steps = [[0, 2], [2, 0], [1, 0, 2], [2, 1, 0], [0, 2, 1], [2]]
    slot_of = [2, 0, 3]
    outs, ssm = run_recurrent(RECURRENT[impl], seqs, steps, slot_of, 4, K ** -0.5)
    for s, d in enumerate(seqs):
        ref, state = transformers_delta_rule(
            "torch_recurrent_gated_delta_rule", d["q"][None].double(), d["k"][None].double(), d["v"][None].double(), d["g"][None].double(),
            d["beta"][None].double(), output_final_state=True, use_qk_l2norm_in_kernel=False)
        torch.testing.assert_close(outs[s].double(), ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ssm[slot_of[s]].double(), state[0].double(), rtol=1e-5, atol=1e-5)
    assert ssm[1].isnan().all()


@pytest.mark.parametrize("impl", IMPLS)
def test_recurrent_row_alone_equals_row_in_batch(impl):
    lens = [4, 4, 4, 4]
    seqs = recurrent_inputs(lens, seed=2)
    slot_of = [1, 3, 0, 2]
    fn = RECURRENT[impl]
    full, ssm_full = run_recurrent(fn, seqs, [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2], [2, 0, 3, 1]], slot_of, 4, 0.25)
    alone, ssm_alone = run_recurrent(fn, seqs, [[s] for s in (0, 1, 2, 3) for _ in range(4)], slot_of, 4, 0.25)
    for s in range(4):
        assert same_bits(full[s], alone[s])
    assert same_bits(ssm_full, ssm_alone)


@pytest.mark.parametrize("impl", IMPLS)
def test_recurrent_without_cache(impl):
    """slots None: every sequence starts from zeros and its final state is dropped."""
    seqs = recurrent_inputs([1, 1, 1], seed=4)
    t = {name: torch.cat([d[name] for d in seqs]) for name in ("q", "k", "v", "g", "beta")}
    K = t["q"].shape[2]
    o = RECURRENT[impl](t["q"], t["k"], t["v"], t["g"], t["beta"], K ** -0.5, make_md([0, 0, 0], [1, 1, 1], None), None)
    ref, _ = transformers_delta_rule("torch_recurrent_gated_delta_rule", t["q"][:, None], t["k"][:, None],
                                     t["v"][:, None], t["g"][:, None], t["beta"][:, None], use_qk_l2norm_in_kernel=False)
    torch.testing.assert_close(o, ref[:, 0], rtol=1e-5, atol=1e-6)


# ---- gradients -----------------------------------------------------------------------------------

def grads(out, inputs, dy):
    outs = out if isinstance(out, tuple) else (out,)
    dys = dy if isinstance(dy, tuple) else (dy,)
    return torch.autograd.grad(outs, inputs, dys)


def close_grads(got, ref):
    for a, b in zip(got, ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("stateful", [False, True])
def test_conv_fn_gradients(impl, stateful):
    g = torch.Generator().manual_seed(11)
    D, W, lens = 24, 4, [6, 1, 9]
    start = [3, 1, 0] if stateful else [0, 0, 0]
    x = torch.randn(sum(lens), D, generator=g).to(DEV).requires_grad_()
    w = (torch.randn(D, W, generator=g) * 0.5).to(DEV).requires_grad_()
    conv_state = torch.randn(3, W - 1, D, generator=g).to(DEV) if stateful else None
    slots = [2, 0, 1] if stateful else None
    window = conv_state[slots].clone() if stateful else None
    md = make_md(start, lens, slots)
    fn = CONV[impl]
    y = gdn_ops.CausalConv1dFn.apply(x, w, md, conv_state.clone() if stateful else None, fn)
    assert same_bits(y, fn(x.detach(), w.detach(), md, conv_state.clone() if stateful else None))
    dy = torch.randn(y.shape, generator=g).to(DEV)
    got = grads(y, (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref, a = [], 0
    for s, L in enumerate(lens):
        seq = x64[a:a + L]
        if start[s]:  # the cached window's rows (a constant), zeros before position 0
            past = window[s].double().clone()
            past[:max(0, W - 1 - start[s])] = 0
            seq = torch.cat((past, seq))
        ref.append(hf_conv(seq, w64)[-L:])
        a += L
    close_grads(got, grads(torch.cat(ref), (x64, w64), dy.double()))


@pytest.mark.parametrize("impl", IMPLS)
def test_gating_fn_gradients(impl):
    g = torch.Generator().manual_seed(12)
    ins = [t.detach().clone().requires_grad_() for t in gating_inputs(9, seed=5)]
    outs = gdn_ops.GdnGatingFn.apply(*ins, GATING[impl])
    for o, r in zip(outs, GATING[impl](*[t.detach() for t in ins])):
        assert same_bits(o, r)
    dys = tuple(torch.randn(o.shape, generator=g).to(DEV) for o in outs)
    got = grads(outs, ins, dys)
    ins64 = [t.detach().double().requires_grad_() for t in ins]
    close_grads(got, grads(gating_reference(*ins64), ins64, tuple(d.double() for d in dys)))


@pytest.mark.parametrize("impl", IMPLS)
def test_rms_norm_gated_fn_gradients(impl):
    g = torch.Generator().manual_seed(13)
    x = strided(torch.randn(12, 32, generator=g).to(DEV)).requires_grad_()
    z = (torch.randn(12, 32, generator=g) * 2).to(DEV).requires_grad_()
    w = (1 + 0.3 * torch.randn(32, generator=g)).to(DEV).requires_grad_()
    out = gdn_ops.RMSNormGatedFn.apply(x, z, w, 1e-6, NORM[impl])
    assert same_bits(out, NORM[impl](x.detach(), z.detach(), w.detach(), 1e-6))
    dy = torch.randn(out.shape, generator=g).to(DEV)
    got = grads(out, (x, z, w), dy)
    ins64 = [t.detach().double().requires_grad_() for t in (x, z, w)]
    close_grads(got, grads(_norm64(*ins64), ins64, dy.double()))


def _norm64(x, z, w, eps=1e-6):
    """Qwen3NextRMSNormGated's formula without its roundings (float64 throughout)."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * F.silu(z)


def test_pointwise_puts_every_element_on_one_path():
    """An element's silu/sigmoid/softplus bits do not depend on where the batch put it."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 6
    for fn in (F.silu, torch.sigmoid, F.softplus):
        full = gdn_ops._pointwise(fn, x)
        for a, b in itertools.pairwise([0, 1, 17, 2049, 4100, 5000]):
            assert same_bits(gdn_ops._pointwise(fn, x[a:b]), full[a:b]), (fn, a, b)
