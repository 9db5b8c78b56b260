"""Tensor parallelism with the K-leaf tree gives TP=1's bits: the tree kernels (CPU rows,
the fused Triton kernel in the interpreter, float64), the subtree rule, the backward, and
whole models (dense Qwen3, Qwen3-MoE) in one process at TP=2 and TP=4, in the engine and in
the trainer, and over two gloo processes. Parity claims compare bit patterns."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM
from vllm.config import ParallelConfig
from vllm.forward_context import ForwardContext, set_forward_context
from vllm.kernels import leaf_tree, ops
from vllm.parallel.tensor_parallel import apply_tensor_parallel
from vllm.testing.rollouts import rollout
from vllm.testing.parallel_check import tp_token_logprobs
from vllm.training import Policy


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _xw(M=5, N=24, K=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)


# ---- the tree ------------------------------------------------------------------------------------
def test_tree_sum_is_the_balanced_tree_lower_index_left():
    parts = [torch.tensor([v], dtype=torch.float32) for v in (1e8, 1.0, -1e8, 1.0)]
    # ((1e8 + 1) + (-1e8 + 1)): each 1 is lost to rounding next to 1e8
    assert leaf_tree.tree_sum(parts).item() == 0.0
    assert ((parts[0] + parts[2]) + (parts[1] + parts[3])).item() == 2.0  # another order gives other bits
    with pytest.raises(ValueError, match="power of two"):
        leaf_tree.tree_sum(parts[:3])


@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("impl", ["rows", "triton"])
def test_rank_subtrees_finish_to_the_same_bits(size, impl):
    """Rank r's subtree root over its contiguous K slice, then the tree over the C roots,
    equals the G-leaf tree over all of K, for every C dividing G."""
    fn = leaf_tree.tree_linear_rows if impl == "rows" else leaf_tree.tree_linear_triton
    # float32 for Triton: the interpreter's emulated bf16 dot is not what the GPU computes
    x, w = _xw(dtype=torch.bfloat16 if impl == "rows" else torch.float32)
    G, K = 8, x.shape[1]
    whole = fn(x, w, G)
    part = K // size
    roots = [fn(x[:, r * part:(r + 1) * part], w[:, r * part:(r + 1) * part].contiguous(), G // size)
             for r in range(size)]
    assert torch.equal(bits(leaf_tree.tree_sum(roots)), bits(whole))


@pytest.mark.parametrize("impl", ["plainr", "tmar", "tmah"])
@pytest.mark.parametrize("leaves", [1, 2, 4, 8, 16])
def test_fused_triton_kernel_equals_one_gemm_per_leaf(leaves, impl):
    """Every kernel (pointer loads, TMA descriptors; the subtrees waiting in registers, or the
    top level in the scratch and the rest in registers) against one GEMM per leaf and the tree; the interpreter's tile (its
    emulated dot rounds per K tile, so BK stays the invariant GEMM's 16 there)."""
    x, w = _xw(M=19, N=40, K=256, seed=leaves)   # K / 16 leaves = BK: every TMA impl at every depth
    fused = leaf_tree.tree_linear_triton(x, w, leaves, config=(impl, 16, 16, 16, 1, 1))
    leafwise = leaf_tree.tree_linear_leafwise(x, w, leaves)
    assert fused.dtype == torch.float32
    assert torch.equal(bits(fused), bits(leafwise))
    ref = leaf_tree.tree_linear_reference(x, w)
    assert torch.allclose(fused.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("impl", ["plainr", "tmar", "tmah"])
@pytest.mark.parametrize("leaves", [1, 2, 4, 8])
@pytest.mark.parametrize("M,N,K", [(1, 40, 128), (5, 30, 128), (33, 40, 96)])
def test_register_counter_kernels_equal_one_gemm_per_leaf(M, N, K, leaves, impl):
    """The one-K-loop kernels with the waiting subtrees in registers, at several M, N not a
    multiple of BN, and K / leaves not a multiple of BK (K = 96: the pointer kernel masks
    each leaf's last K tile; "tmar" then runs it, as where N * 4 bytes is not 16-aligned)."""
    x, w = _xw(M=M, N=N, K=K, seed=M * 100 + leaves)
    fused = leaf_tree.tree_linear_triton(x, w, leaves, config=(impl, 16, 16, 16, 1, 1))
    assert torch.equal(bits(fused), bits(leaf_tree.tree_linear_leafwise(x, w, leaves)))


@pytest.mark.parametrize("impl", ["plainr", "tmar", "tmah"])
@pytest.mark.parametrize("leaves", [4, 8, 16])
def test_register_counter_adds_in_tree_order(leaves, impl):
    """Leaf sums chosen so that every other pairing gives other bits: leaf j's sum is exactly
    v_j (one nonzero product per leaf), v = 1e8, 1, -1e8, 1, ...; the tree gives
    ((1e8 + 1) + (-1e8 + 1)) = 0 per group of four (each 1 lost next to 1e8), a left-to-right
    sum 1 or 2, the pairing (l0 + l2) + (l1 + l3) gives 2."""
    K, N = 16 * leaves, 24
    v = torch.tensor([1e8, 1.0, -1e8, 1.0] * (leaves // 4))
    x, w = torch.zeros(3, K), torch.zeros(N, K)
    x[:, ::16] = 1.0
    w[:, ::16] = v
    fused = leaf_tree.tree_linear_triton(x, w, leaves, config=(impl, 16, 16, 16, 1, 1))
    assert torch.equal(fused, torch.zeros(3, N))
    assert torch.equal(bits(fused), bits(leaf_tree.tree_linear_leafwise(x, w, leaves)))
    left_to_right = torch.zeros(())
    for value in v:
        left_to_right = left_to_right + value
    assert left_to_right.item() != 0.0


@pytest.mark.parametrize("leaves", [2, 4, 8, 16])
@pytest.mark.parametrize("impl,scratch_levels", [("tmar", 0), ("tmah", 1)])
def test_hybrids_keep_their_top_levels_in_the_scratch(monkeypatch, impl, scratch_levels, leaves):
    """"tmah" launches the one-loop TMA kernel with its top counter level in the scratch
    (REG_LEVELS = levels - 1, at least 0) and a scratch of one output tile per scratch level
    per program; "tmar" none (the same bits either way, so only the
    launch tells them apart)."""
    launches = []
    real = leaf_tree._tree_tma_regs_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((grid, args[3], kw["REG_LEVELS"], kw["LEVELS"]))
                return real[grid](*args, **kw)
            return launch
    monkeypatch.setattr(leaf_tree, "_tree_tma_regs_kernel", Spy())
    x, w = _xw(M=19, N=40, K=256)
    out = leaf_tree.tree_linear_triton(x, w, leaves, config=(impl, 16, 16, 16, 1, 1))
    assert torch.equal(bits(out), bits(leaf_tree.tree_linear_leafwise(x, w, leaves)))
    (grid, stack_desc, reg_levels, levels), = launches
    assert levels == leaves.bit_length() - 1 and reg_levels == max(levels - scratch_levels, 0)
    if reg_levels < levels:
        assert tuple(stack_desc.shape) == (grid[0] * (levels - reg_levels) * 16, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["tmah"])
def test_gpu_scratch_kernels_equal_one_gemm_per_leaf(impl):
    """On the GPU, where programs run at once (the interpreter runs them one after another, so
    rows two programs shared would pass there): more output tiles than programs, each
    program's scratch rows its own, 8 and 16 leaves, bits of one GEMM per leaf."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2048, 4096, device="cuda", generator=g).bfloat16()   # 256 tiles of 128 x 128
    w = (torch.randn(2048, 4096, device="cuda", generator=g) * 0.02).bfloat16()
    for leaves in (8, 16):
        got = leaf_tree.tree_linear_triton(x, w, leaves, config=(impl, 128, 128, 64, 8, 3))
        assert torch.equal(bits(got), bits(leaf_tree.tree_linear_leafwise(x, w, leaves))), leaves


@pytest.mark.parametrize("impl", ["tmar", "tmah"])
def test_one_loop_tma_impls_take_the_tma_kernel_where_they_can(monkeypatch, impl):
    """On TMA-able operands (K / leaves a multiple of BK, 16-byte aligned rows) "tmar" and
    "tmah" run the TMA kernel (the interpreter emulates the descriptors), not their
    pointer fallback; elsewhere they fall back to it."""
    x, w = _xw(M=5, N=40, K=128)
    monkeypatch.setattr(leaf_tree, "_tree_regs_kernel", None)
    leaf_tree.tree_linear_triton(x, w, 8, config=(impl, 16, 16, 16, 1, 1))
    with pytest.raises(TypeError):  # N * 4 bytes not 16-aligned: the pointer kernel
        leaf_tree.tree_linear_triton(*_xw(M=5, N=30, K=128), 8, config=(impl, 16, 16, 16, 1, 1))
    with pytest.raises(ValueError, match="tree impl"):
        leaf_tree.tree_linear_triton(x, w, 8, config=("regs", 16, 16, 16, 1, 1))


def test_tree_rows_are_batch_invariant_and_close_to_float64():
    x, w = _xw(M=9, dtype=torch.bfloat16)
    full = leaf_tree.tree_linear_rows(x, w, 8)
    for i in (0, 4, 8):
        assert torch.equal(bits(leaf_tree.tree_linear_rows(x[i:i + 1], w, 8)), bits(full[i:i + 1]))
    assert torch.allclose(full.double(), leaf_tree.tree_linear_reference(x, w), rtol=1e-5, atol=1e-4)


def test_tree_refusals():
    x, w = _xw(K=24)
    with pytest.raises(ValueError, match="power of two"):
        leaf_tree.tree_linear_rows(x, w, 3)
    with pytest.raises(ValueError, match="cannot be cut into 16"):
        leaf_tree.tree_linear_rows(x, w, 16)
    with set_forward_context(ForwardContext(None, numerics="invariant")):
        with pytest.raises(ValueError, match="power of two"):
            ops.tree_linear(x, w, 6)


def test_backward_is_a_plain_gemm_matching_float64():
    x, w = _xw(M=6, N=10, K=32, seed=3)
    x.requires_grad_(True)
    w.requires_grad_(True)
    dy = torch.randn(6, 10, generator=torch.Generator().manual_seed(4))
    with set_forward_context(ForwardContext(None, numerics="invariant")):
        (ops.tree_linear(x, w, 8) * dy).sum().backward()
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    (leaf_tree.tree_linear_reference(x64, w64) * dy.double()).sum().backward()
    assert torch.allclose(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


# ---- models --------------------------------------------------------------------------------------
def _sequences():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (17, 30, 9)], [5, 12, 4]


def _policy_logprobs(path, size, leaves=8):
    policy = Policy.from_pretrained(path, device="cpu", numerics="invariant", tensor_parallel_size=size,
                                    tp_leaves=leaves)
    seqs, plens = _sequences()
    with torch.no_grad():
        return torch.cat(policy.token_logprobs(seqs, plens))


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_qwen3_moe"])
def test_in_process_tp2_tp4_equal_tp1_in_the_trainer(model, request):
    path = request.getfixturevalue(model)
    tp1 = _policy_logprobs(path, 1)
    for size in (2, 4):
        assert torch.equal(bits(_policy_logprobs(path, size)), bits(tp1)), size


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_qwen3_moe"])
def test_engine_at_each_tp_size_equals_tp1_and_its_trainer(model, request, trainer_prompts):
    """Rollout logprobs at TP=1, 2, 4 (tree of 8 leaves) are the same bits, and the
    colocated trainer (llm.policy(), with gradients on) reproduces them at each size."""
    path = request.getfixturevalue(model)
    prompts = trainer_prompts[:3]
    first = None
    for size in (1, 2, 4):
        llm = LLM(path, device="cpu", numerics="invariant", block_size=8, tensor_parallel_size=size, tp_leaves=8)
        seqs, roll = rollout(llm, prompts)
        if first is None:
            first = (seqs, roll)
        assert seqs == first[0], size
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(roll, first[1])), size
        got = llm.policy().token_logprobs(seqs, [len(p) for p in prompts], temperature=0.8)  # rollout's T
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, roll)), size


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_qwen3_moe"])
def test_tp2_over_gloo_equals_tp1_bits(model, request):
    path = request.getfixturevalue(model)
    seqs, plens = _sequences()
    per_rank = tp_token_logprobs(path, seqs, plens, world=2, leaves=8)
    tp1 = _policy_logprobs(path, 1)
    for rank in range(2):
        assert torch.equal(bits(torch.cat(per_rank[rank])), bits(tp1)), rank


def test_fast_mode_sums_plain_partials(tiny_qwen3):
    """Fast mode has no tree: its TP=2 runs and stays close to TP=1 (no bit promise)."""
    seqs, plens = _sequences()
    out = {}
    for size in (1, 2):
        policy = Policy.from_pretrained(tiny_qwen3, device="cpu", numerics="fast", tensor_parallel_size=size)
        with torch.no_grad():
            out[size] = torch.cat(policy.token_logprobs(seqs, plens))
    assert torch.allclose(out[1], out[2], atol=1e-4)


# ---- contract and refusals -----------------------------------------------------------------------
def test_contract_names_the_leaves_and_refuses_another_g(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant", tensor_parallel_size=2)
    engine = llm.llm_engine.execution_contract()
    assert engine.numerical["row_parallel_tree"]["leaves"] == 8
    assert engine.deployment["tensor_parallel_size"] == 2
    assert "tensor_parallel_size" not in engine.semantic
    engine.check_compatible(llm.policy().execution_contract())
    engine.check_compatible(Policy.from_pretrained(tiny_qwen3, device="cpu", tp_leaves=8).execution_contract())
    for other in (Policy.from_pretrained(tiny_qwen3, device="cpu"),
                  Policy.from_pretrained(tiny_qwen3, device="cpu", tp_leaves=4)):
        with pytest.raises(ValueError, match="row_parallel_tree"):
            engine.check_compatible(other.execution_contract())


def test_refusals(tiny_qwen3, tiny_qwen3_next):
    for kw, msg in (({"tensor_parallel_size": 0}, "tensor_parallel_size"), ({"tp_leaves": 6}, "power of two"),
                    ({"tensor_parallel_size": 4, "tp_leaves": 2}, "must be >="),
                    ({"tensor_parallel_size": 3, "tp_leaves": 8}, "divide")):
        with pytest.raises(ValueError, match=msg):
            ParallelConfig(**kw)
    policy = Policy.from_pretrained(tiny_qwen3, device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="already applied"):
        apply_tensor_parallel(policy.model, 2)
    with pytest.raises(ValueError, match="divide tp_leaves"):
        apply_tensor_parallel(Policy.from_pretrained(tiny_qwen3, device="cpu").model, 3)
    with pytest.raises(ValueError, match="does not cover"):
        apply_tensor_parallel(Policy.from_pretrained(tiny_qwen3_next, device="cpu").model, 2)


def test_tree_kernel_refuses_host_tensors_without_the_interpreter(monkeypatch):
    """Where Triton compiles for a GPU, host tensors are refused before any launch (a TMA
    descriptor over host memory faults on the device instead)."""
    from vllm.kernels import matmul
    monkeypatch.setattr(matmul, "_interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        leaf_tree.tree_linear_triton(*_xw(M=5, N=40, K=128), 8, config=("tmar", 16, 16, 16, 1, 1))
