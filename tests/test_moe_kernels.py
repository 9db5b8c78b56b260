"""MoE kernels on their own: routing (values, the lower-id tie rule, row invariance), the
expert plan, the grouped Triton GEMM (forward, dgrad, wgrad; in the interpreter on CPU,
compiled on the GPU), the CPU per-row experts, the fixed-slot merge; each against a
float64 reference, each parity claim by bit pattern. The backward of each kernel has
its own check (gradcheck where the forward runs in float64)."""
from __future__ import annotations

import pytest
import torch

from vllm.kernels import moe as K
from vllm.kernels import ops
from vllm.kernels.matmul import invariant_matmul
from vllm.kernels.moe_autograd import GroupedGemmFn, MergeFn, RouterFn

D64 = torch.float64
SILU = ops.silu_and_mul  # the activation the op shim hands the expert MLPs


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
                   torch.float64: torch.int64}[t.dtype])


def random_ids(T: int, E: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.argsort(torch.rand(T, E, generator=gen), dim=-1)[:, :k].contiguous()


# ---------------------------------------------------------------------------- routing
@pytest.mark.parametrize("norm", [True, False])
def test_routing_matches_float64_reference(norm):
    logits = torch.randn(37, 16, generator=torch.Generator().manual_seed(0))
    got = K.route_invariant(logits, 4, norm)
    ref = K.route_reference(logits, 4, norm)
    assert torch.equal(got.ids, ref.ids)
    assert (got.weights.double() - ref.weights).abs().max() < 1e-6
    assert (got.probs.double() - ref.probs).abs().max() < 1e-6
    assert got.weights.dtype == got.probs.dtype == torch.float32
    if norm:
        assert (got.weights.sum(-1) - 1).abs().max() < 1e-6


def test_routing_ties_go_to_the_lower_expert_id():
    logits = torch.zeros(3, 8)
    logits[1, [2, 5, 6]] = 1.0   # three equal leaders
    logits[2, [7, 3]] = 2.0      # two equal leaders, then a tie among the other six
    got = K.route_invariant(logits, 3, True)
    assert got.ids.tolist() == [[0, 1, 2], [2, 5, 6], [3, 7, 0]]
    assert torch.equal(bits(got.weights[0]), bits(torch.full((3,), 1 / 3)))
    # the fast formulation makes no promise about ties; the invariant one is the rule


def test_routing_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 12, generator=gen)
    full = K.route_invariant(logits, 3, True)
    for lo, hi in ((0, 1), (5, 6), (7, 40), (63, 64), (1, 64)):
        part = K.route_invariant(logits[lo:hi].clone(), 3, True)
        assert torch.equal(part.ids, full.ids[lo:hi])
        assert torch.equal(bits(part.weights), bits(full.weights[lo:hi]))
        assert torch.equal(bits(part.probs), bits(full.probs[lo:hi]))


@pytest.mark.parametrize("norm", [True, False])
def test_router_backward_gradcheck(norm):
    logits = torch.randn(5, 6, dtype=D64, generator=torch.Generator().manual_seed(2)).requires_grad_(True)

    def f(lg):
        w, p, _ = RouterFn.apply(lg, 3, norm, K.route_invariant)
        return w, p
    assert torch.autograd.gradcheck(f, (logits,))


def test_router_backward_matches_torch_autograd_of_the_reference():
    logits = torch.randn(9, 8, dtype=D64, generator=torch.Generator().manual_seed(3))
    dw, dp = torch.randn(9, 2, dtype=D64), torch.randn(9, 8, dtype=D64)
    a = logits.clone().requires_grad_(True)
    w, p, _ = RouterFn.apply(a, 2, True, K.route_invariant)
    ((w * dw).sum() + (p * dp).sum()).backward()
    b = logits.clone().requires_grad_(True)
    probs = torch.softmax(b, -1)
    top = probs.gather(1, K.route_reference(logits, 2, True).ids)
    ((top / top.sum(-1, keepdim=True) * dw).sum() + (probs * dp).sum()).backward()
    assert (a.grad - b.grad).abs().max() < 1e-12


# ---------------------------------------------------------------------------- plan
def test_plan_blocks_never_mix_experts():
    gen = torch.Generator().manual_seed(4)
    T, E, k, bm = 23, 6, 3, 4
    ids = random_ids(T, E, k, gen)
    ids[:10] = torch.tensor([0, 1, 2])  # a crowded expert next to sparse ones
    plan = K.make_plan(ids, E, bm)
    pair_at = plan.pair_at.tolist()
    flat = ids.reshape(-1).tolist()
    assert sorted(p for p in pair_at if p >= 0) == list(range(T * k))
    for b, e in enumerate(plan.block_expert.tolist()):
        rows = [p for p in pair_at[b * bm:(b + 1) * bm] if p >= 0]
        if e < 0:
            assert not rows
        else:
            assert rows and all(flat[p] == e for p in rows)
            assert rows == sorted(rows)  # ascending pair order inside an expert
    assert all(pair_at[pos] == p for p, pos in enumerate(plan.pos_of_pair.tolist()))
    for e in range(E):
        lo, hi = plan.expert_block_start[e].item(), plan.expert_block_end[e].item()
        assert all(plan.block_expert[b].item() == e for b in range(lo, hi))
        assert (hi - lo) == -(-flat.count(e) // bm)


# ---------------------------------------------------------------------------- grouped GEMM
def _gemm_case(T=9, E=4, k=2, H=40, N=24, seed=5):
    gen = torch.Generator().manual_seed(seed)
    ids = random_ids(T, E, k, gen)
    x = torch.randn(T, H, generator=gen)
    w = torch.randn(E, N, H, generator=gen) * 0.2
    return ids, x, w


def test_grouped_gemm_matches_float64_and_a_fixed_order_sum():
    """Under the interpreter the kernel sums exact fp32 products per K tile in ascending
    order (np.matmul's bits depend on the row's place in the tile). On the GPU it equals
    the dense invariant GEMM bit for bit: test_gpu_grouped_gemm_every_config_same_bits_as_dense_kernel."""
    ids, x, w = _gemm_case()
    T, k = ids.shape
    bk = K.MOE_INTERPRET_CONFIG[2]
    plan = K.make_plan(ids, w.shape[0], K.MOE_INTERPRET_CONFIG[0])
    c = K.grouped_gemm(x, w, plan, a_indexed=True, a_div=k, c_indexed=False)
    ref = K.grouped_gemm_reference(x, w, ids)
    for t in range(T):
        for s in range(k):
            row = c[plan.pos_of_pair[t * k + s]]
            assert (row.double() - ref[t, s]).abs().max() < 1e-5
            acc = torch.zeros(w.shape[1], dtype=torch.float32)
            for k0 in range(0, x.shape[1], bk):
                prod = x[t, k0:k0 + bk].float()[:, None] * w[ids[t, s], :, k0:k0 + bk].float().T
                tile = prod[0].clone()
                for r in range(1, prod.shape[0]):
                    tile = tile + prod[r]
                acc = acc + tile
            assert torch.equal(bits(row), bits(acc.to(row.dtype)))


def test_grouped_gemm_rows_independent_of_batch_and_crowding():
    ids, x, w = _gemm_case(T=20, E=4, k=2, H=24, N=16, seed=6)
    T, k = ids.shape
    E = w.shape[0]

    def run(xs, ids_):
        plan = K.make_plan(ids_, E, 16)
        y = K.grouped_gemm(xs, w, plan, a_indexed=True, a_div=k, c_indexed=False)
        return y.index_select(0, plan.pos_of_pair).view(xs.shape[0], k, -1)
    full = run(x, ids)
    for lo, hi in ((0, 1), (19, 20), (3, 11)):
        assert torch.equal(bits(run(x[lo:hi].clone(), ids[lo:hi].clone())), bits(full[lo:hi]))
    # every token on experts (0, 1): expert 0 gets all rows, the row's bits stay its own
    crowd = torch.tensor([0, 1]).expand(T, k).contiguous()
    crowded = run(x, crowd)
    alone = run(x[7:8].clone(), crowd[7:8].clone())
    assert torch.equal(bits(alone), bits(crowded[7:8]))


def test_grouped_gemm_backward_matches_float64():
    """GroupedGemmFn's dgrad (the grouped kernel on transposed weights, slots summed in
    order) and wgrad (the grouped wgrad kernel) against float64 autograd."""
    ids, x, w = _gemm_case(T=7, E=3, k=2, H=20, N=12, seed=7)
    T, k = ids.shape
    plan = K.make_plan(ids, w.shape[0], 16)
    # up projection: rows gathered from tokens, output in the padded layout
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    c = GroupedGemmFn.apply(xa, wa, plan, True, k, False, None, None, None, K.grouped_gemm, K.grouped_wgrad)
    gc = torch.randn_like(c)
    c.backward(gc)
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    ref = sum((w64[ids[t, s]] @ x64[t] * gc[plan.pos_of_pair[t * k + s]].double()).sum()
              for t in range(T) for s in range(k))
    ref.backward()
    assert (xa.grad.double() - x64.grad).abs().max() < 1e-5
    assert (wa.grad.double() - w64.grad).abs().max() < 1e-5
    # down projection: rows read in the padded layout, output scattered to (token, slot)
    a = torch.randn(plan.num_rows, 20).requires_grad_(True)
    wd = w.clone().requires_grad_(True)
    y = GroupedGemmFn.apply(a, wd, plan, False, 1, True, T * k, torch.float32, None, K.grouped_gemm, K.grouped_wgrad)
    gy = torch.randn_like(y)
    y.backward(gy)
    a64, wd64 = a.detach().double().requires_grad_(True), w.double().requires_grad_(True)
    ref = sum((wd64[ids.reshape(-1)[p]] @ a64[plan.pos_of_pair[p]] * gy[p].double()).sum() for p in range(T * k))
    ref.backward()
    assert (a.grad.double() - a64.grad).abs().max() < 1e-5
    assert (wd.grad.double() - wd64.grad).abs().max() < 1e-5
    assert a.grad[plan.pair_at < 0].abs().max() == 0  # padding rows get exact zeros
    # experts without rows get exact-zero gradients
    unused = set(range(w.shape[0])) - set(ids.reshape(-1).tolist())
    assert all(wd.grad[e].abs().max() == 0 for e in unused)


def test_grouped_gemm_refuses_float64():
    ids, x, w = _gemm_case()
    plan = K.make_plan(ids, w.shape[0], 16)
    with pytest.raises(ValueError, match="float64"):
        K.grouped_gemm(x.double(), w.double(), plan, a_indexed=True, a_div=2, c_indexed=False)


# ---------------------------------------------------------------------------- experts
def _experts_case(T=11, E=4, k=2, H=32, I=16, seed=8):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(T, H, generator=gen), torch.randn(E, 2 * I, H, generator=gen) * 0.2,
            torch.randn(E, H, I, generator=gen) * 0.2, random_ids(T, E, k, gen))


@pytest.mark.parametrize("impl", ["experts_grouped_triton", "experts_rows_cpu", "experts_loop"])
def test_experts_match_float64(impl):
    x, w13, w2, ids = _experts_case()
    y = getattr(K, impl)(x, w13, w2, ids, SILU)
    assert y.shape == (11, 2, 32)
    assert (y.double() - K.experts_reference(x, w13, w2, ids)).abs().max() < 1e-5


def test_cpu_experts_rows_are_invariant():
    x, w13, w2, ids = _experts_case(T=30)
    full = K.experts_rows_cpu(x, w13, w2, ids, SILU)
    assert full.dtype == torch.float32
    for lo, hi in ((0, 1), (29, 30), (4, 17)):
        assert torch.equal(bits(K.experts_rows_cpu(x[lo:hi].clone(), w13, w2, ids[lo:hi].clone(), SILU)), bits(full[lo:hi]))
    crowd = torch.tensor([0, 1]).expand(30, 2).contiguous()
    assert torch.equal(bits(K.experts_rows_cpu(x[9:10].clone(), w13, w2, crowd[:1].clone(), SILU)),
                       bits(K.experts_rows_cpu(x, w13, w2, crowd, SILU)[9:10]))
    # grouped Triton and CPU rows agree in value (their bits may differ: different kernels)
    assert (K.experts_grouped_triton(x, w13, w2, ids, SILU) - full).abs().max() < 1e-5


def test_empty_batch():
    x, w13, w2, ids = _experts_case(T=0)
    for fn in (K.experts_grouped_triton, K.experts_rows_cpu, K.experts_fast):
        assert fn(x, w13, w2, ids, SILU).shape == (0, 2, 32)
    assert K.merge_slots_triton(torch.zeros(0, 2, 32), torch.zeros(0, 2), torch.float32).shape == (0, 32)


# ---------------------------------------------------------------------------- merge
def test_merge_slot_order_triton_equals_torch_and_reference():
    gen = torch.Generator().manual_seed(9)
    y, w = torch.randn(13, 3, 40, generator=gen), torch.rand(13, 3, generator=gen)
    a = K.merge_slots_torch(y, w, torch.float32)
    # float32 out: the interpreter's bfloat16 cast truncates, the GPU's rounds (GPU test)
    assert torch.equal(bits(a), bits(K.merge_slots_triton(y, w, torch.float32)))
    assert (a.double() - K.merge_reference(y, w)).abs().max() < 1e-5
    # the slot order is the formula, not "any order": reversing the slots may change bits
    expect = y[:, 0] * w[:, 0:1]
    for s in (1, 2):
        expect = expect + y[:, s] * w[:, s:s + 1]
    assert torch.equal(bits(a), bits(expect))
    # rows are independent of the batch
    assert torch.equal(bits(K.merge_slots_torch(y[5:6].clone(), w[5:6].clone(), torch.float32)), bits(a[5:6]))


def test_merge_backward_gradcheck():
    gen = torch.Generator().manual_seed(10)
    y = torch.randn(4, 3, 5, dtype=D64, generator=gen).requires_grad_(True)
    w = torch.rand(4, 3, dtype=D64, generator=gen).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda y, w: MergeFn.apply(y, w, D64, K.merge_slots_torch), (y, w))


# ---------------------------------------------------------------------------- GPU
QWEN3_30B_A3B = dict(E=128, k=8, H=2048, I=768)


def _gpu_case(T, E=QWEN3_30B_A3B["E"], k=QWEN3_30B_A3B["k"], H=QWEN3_30B_A3B["H"], I=QWEN3_30B_A3B["I"], seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, generator=gen, device="cuda").bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=gen, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(E, H, I, generator=gen, device="cuda") * 0.02).bfloat16()
    ids = torch.argsort(torch.rand(T, E, generator=gen, device="cuda"), dim=-1)[:, :k].contiguous()
    return x, w13, w2, ids


@pytest.mark.gpu
def test_gpu_grouped_experts_invariant_over_batch_and_crowding():
    """Qwen3-30B-A3B expert shapes, bf16: a token's float32 expert outputs are the same bits
    at every batch size (each picks its own block size and tiles) and when every token
    crowds onto the same experts."""
    x, w13, w2, ids = _gpu_case(2048)
    full = K.experts_grouped_triton(x, w13, w2, ids, SILU)
    for m in (1, 2, 3, 16, 17, 64, 100, 257, 1024):
        assert torch.equal(bits(K.experts_grouped_triton(x[:m].clone(), w13, w2, ids[:m].clone(), SILU)), bits(full[:m])), m
    crowd = torch.arange(8, device="cuda").expand(2048, 8).contiguous()
    crowded = K.experts_grouped_triton(x, w13, w2, crowd, SILU)
    for t in (0, 777, 2047):
        assert torch.equal(bits(K.experts_grouped_triton(x[t:t + 1].clone(), w13, w2, crowd[:1].clone(), SILU)),
                           bits(crowded[t:t + 1]))
    ref = K.experts_reference(x[:4], w13, w2, ids[:4])
    assert (full[:4].double() - ref).abs().max().item() < 2e-2 * ref.abs().max().item()


@pytest.mark.gpu
def test_gpu_grouped_gemm_every_config_same_bits_as_dense_kernel():
    x, w13, _, ids = _gpu_case(300)
    k = ids.shape[1]
    rows = {}
    for bm, bn, bk, warps, stages in [c[1:] for c in K.MOE_GPU_CONFIGS] + [(16, 32, 64, 2, 3), (64, 64, 128, 4, 3)]:
        plan = K.make_plan(ids, w13.shape[0], bm)
        c = K.grouped_gemm(x, w13, plan, a_indexed=True, a_div=k, c_indexed=False, config=(bm, bn, bk, warps, stages))
        rows[(bm, bn, bk)] = c.index_select(0, plan.pos_of_pair)
    first = next(iter(rows.values()))
    for cfg, r in rows.items():
        assert torch.equal(bits(r), bits(first)), cfg
    for p in (0, 5, 299 * k + 7):
        t, s = divmod(p, k)
        dense = invariant_matmul(x[t:t + 1].clone(), w13[ids[t, s]])
        assert torch.equal(bits(dense[0]), bits(first[p])), p


@pytest.mark.gpu
def test_gpu_merge_triton_equals_torch_bf16():
    gen = torch.Generator(device="cuda").manual_seed(1)
    y = torch.randn(333, 8, 2048, generator=gen, device="cuda")
    w = torch.rand(333, 8, generator=gen, device="cuda")
    assert torch.equal(bits(K.merge_slots_triton(y, w, torch.bfloat16)), bits(K.merge_slots_torch(y, w, torch.bfloat16)))


@pytest.mark.gpu
def test_gpu_grouped_backward_and_fast_path_match_reference():
    x, w13, w2, ids = _gpu_case(64, E=16, k=4, H=256, I=128)
    ref = K.experts_reference(x, w13, w2, ids)
    scale = ref.abs().max().item()
    for y in (K.experts_grouped_triton(x, w13, w2, ids, SILU), K.experts_fast(x, w13, w2, ids, SILU)):
        assert (y.double() - ref).abs().max().item() < 2e-2 * scale
    xa, w13a, w2a = (t.clone().requires_grad_(True) for t in (x, w13, w2))
    y = K.experts_grouped_triton(xa, w13a, w2a, ids, SILU)
    g = torch.randn_like(y)
    y.backward(g)
    x64, w1364, w264 = (t.detach().double().requires_grad_(True) for t in (x, w13, w2))
    (K.experts_reference(x64, w1364, w264, ids) * g.double()).sum().backward()
    for ours, theirs in ((xa, x64), (w13a, w1364), (w2a, w264)):
        err = ((ours.grad.double() - theirs.grad).norm() / theirs.grad.norm()).item()
        assert err < 2e-2, err


# ---------------------------------------------------------------------------- start-up self-check
def test_moe_self_check_passes_and_catches_a_batch_dependent_kernel(tiny_qwen3_moe, monkeypatch):
    """Reached through the self-check's generic layer hook (the MoE block's
    `invariant_self_check`), as the engine's start-up check reaches it."""
    from vllm.kernels.selfcheck import SelfCheckError, layer_self_checks
    from vllm.config import NumericsSpec
    from vllm.model_loader.build import build_model, resolve_model

    mc, dtype = resolve_model(tiny_qwen3_moe, dtype="float32", device="cpu")
    model = build_model(mc, NumericsSpec(dtype, "fast"), "cpu")[0]
    from vllm.kernels import moe_selfcheck
    monkeypatch.setattr(moe_selfcheck, "SELF_CHECK_MS", (1, 3, 9))
    report = layer_self_checks(model, torch.device("cpu"), torch.float32, max_tokens=9)
    assert report == {"model.layers.0.mlp": {"experts": 8, "top_k": 2, "H": 64, "Ms": [1, 3, 9]}}  # layer 2: same shape
    real = K.experts_grouped_triton
    monkeypatch.setattr(K, "experts_grouped_triton", lambda x, *a: real(x, *a) * (1 + 1e-3 * (x.shape[0] > 3)))
    with pytest.raises(SelfCheckError, match="at M=1 differ"):
        layer_self_checks(model, torch.device("cpu"), torch.float32, max_tokens=9)
