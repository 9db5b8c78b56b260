"""The trainer's fused, chunked logprob head (vllm/training/logprob_head.py): its forward
gives the bits of `tempered_logprobs(compute_logits(rows)).gather(targets)` whatever the
chunking (bit patterns compared), its backward matches float64 autograd."""
from __future__ import annotations

import pytest
import torch

from vllm.config import NumericsSpec
from vllm.forward_context import ForwardContext, set_forward_context
from vllm.kernels import ops
from vllm.sample.sampler import tempered_logprobs, tempered_target_logprobs
from vllm.training import Policy
from vllm.training.logprob_head import rows_per_chunk, token_logprobs_head


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _reference(logits, temperature, targets):
    return tempered_logprobs(logits, temperature).gather(-1, targets[:, None])[:, 0]


@pytest.mark.parametrize("V", [1, 7, 512, 1000, 4099])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3, 0.0])
def test_target_logprobs_bits_equal_tempered_logprobs(V, temperature):
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(6, V, generator=g) * 8
    logits[1] *= 100                      # wide rows
    logits[2, : V // 2 + 1] = -1e30       # rows dominated by a few entries
    targets = torch.randint(0, V, (6,), generator=g)
    before = logits.clone()
    for t in (temperature, torch.tensor(temperature)):
        lp, lse = tempered_target_logprobs(logits, t, targets)
        assert torch.equal(bits(lp), bits(_reference(logits, t, targets)))
        # lse is the log-sum-exp of logits / T (T = 0 read as 1)
        T = temperature if temperature > 0 else 1.0
        ref = torch.logsumexp(logits.double() / T, -1)
        assert torch.allclose(lse.double(), ref, rtol=1e-6, atol=1e-5)
    assert torch.equal(logits, before)  # the caller's logits are not modified


def test_rows_per_chunk():
    assert rows_per_chunk(151936) == 768            # 512 MiB of float32 logits, a multiple of 128
    assert rows_per_chunk(512) == 262144
    assert rows_per_chunk(10 ** 9) == 1


def _head(hidden, weight, targets, T, chunk_rows):
    """The head with the invariant lm_head kernel (on CPU: one row at a time): a plain
    `h @ W.T` is not batch-invariant (BLAS picks its algorithm by the row count)."""
    t = torch.tensor(T if T > 0 else 1.0, dtype=torch.float32)
    with set_forward_context(ForwardContext(None, "invariant")):
        return token_logprobs_head(hidden, weight, targets, t, T if T > 0 else 1.0, lambda h: ops.logits(h, weight),
                                   chunk_rows)


@pytest.mark.parametrize("chunk_rows", [1, 5, 37, None])
def test_head_forward_chunks_keep_bits(chunk_rows):
    torch.manual_seed(0)
    h, w = torch.randn(37, 24), torch.randn(300, 24)
    targets = torch.randint(0, 300, (37,))
    ref = _head(h, w, targets, 0.7, 37)  # one chunk
    with torch.no_grad():
        assert torch.equal(bits(_head(h, w, targets, 0.7, chunk_rows)), bits(ref))
    hg = h.clone().requires_grad_()
    assert torch.equal(bits(_head(hg, w, targets, 0.7, chunk_rows)), bits(ref))


@pytest.mark.parametrize("chunk_rows", [3, 37])
@pytest.mark.parametrize("need", ["both", "hidden", "weight"])
def test_head_backward_vs_float64(chunk_rows, need):
    """Gradients w.r.t. hidden and lm_head weight against float64 autograd of
    log_softmax(h W^T / T)[target], weighted per row; chunk_rows=3 walks the vocab in 3
    column blocks in backward."""
    torch.manual_seed(1)
    h, w = torch.randn(37, 24), torch.randn(300, 24) * 0.5
    targets = torch.randint(0, 300, (37,))
    coef = torch.randn(37)
    hg = h.clone().requires_grad_(need in ("both", "hidden"))
    wg = w.clone().requires_grad_(need in ("both", "weight"))
    (coef * _head(hg, wg, targets, 0.7, chunk_rows)).sum().backward()
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    lp = torch.log_softmax((hd @ wd.t()) / 0.7, -1).gather(-1, targets[:, None])[:, 0]
    (coef.double() * lp).sum().backward()
    for ours, ref, wanted in ((hg.grad, hd.grad, hg.requires_grad), (wg.grad, wd.grad, wg.requires_grad)):
        if wanted:
            assert ((ours.double() - ref).norm() / ref.norm()).item() < 1e-5
        else:
            assert ours is None


@pytest.mark.parametrize("chunk_rows", [1, 5, None])
@pytest.mark.parametrize("T", [0.7, 1.0, 0.0])
def test_head_entropy_vs_float64_and_logprob_bits_unchanged(chunk_rows, T, monkeypatch):
    """with_entropy: each row's entropy of softmax(logits / T) within float32 rounding of float64,
    in row blocks of any size; the logprobs' bits and gradients are those without it."""
    from vllm.training import logprob_head
    monkeypatch.setattr(logprob_head, "ENTROPY_BLOCK_BYTES", 4 * 300 * 2)   # two rows at a time
    torch.manual_seed(2)
    h, w = torch.randn(37, 24), torch.randn(300, 24)
    targets = torch.randint(0, 300, (37,))
    t = torch.tensor(T if T > 0 else 1.0, dtype=torch.float32)
    with set_forward_context(ForwardContext(None, "invariant")):
        hg = h.clone().requires_grad_()
        lp, ent = token_logprobs_head(hg, w, targets, t, T if T > 0 else 1.0, lambda x: ops.logits(x, w), chunk_rows,
                                      with_entropy=True)
        assert not ent.requires_grad and ent.shape == (37,)
        lp.sum().backward()
        plain = h.clone().requires_grad_()
        lp0 = _head(plain, w, targets, T, chunk_rows)
        lp0.sum().backward()
    assert torch.equal(bits(lp), bits(lp0)) and torch.equal(hg.grad, plain.grad)
    with set_forward_context(ForwardContext(None, "invariant")):   # the same float32 logits, then float64
        logits = ops.logits(h, w).double()
    p = torch.softmax(logits / (T if T > 0 else 1.0), -1)
    ref = -(p * p.log()).sum(-1)
    assert torch.allclose(ent.double(), ref, rtol=1e-5, atol=1e-5)
    with set_forward_context(ForwardContext(None, "invariant")), torch.no_grad():
        _, ent_ng = token_logprobs_head(h, w, targets, t, T if T > 0 else 1.0, lambda x: ops.logits(x, w), chunk_rows,
                                        with_entropy=True)
    assert torch.equal(ent_ng, ent)


def test_head_bad_input():
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="chunk_rows"):
        _head(h, w, torch.zeros(4, dtype=torch.long), 1.0, 0)
    with pytest.raises(ValueError, match="targets"):
        _head(h, w, torch.zeros(3, dtype=torch.long), 1.0, None)
    for bad in (0, 1.5, True, "4"):
        with pytest.raises(ValueError, match="logprob_chunk_rows"):
            Policy(torch.nn.Linear(1, 1), None, NumericsSpec(torch.float32), "cpu", logprob_chunk_rows=bad)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        Policy(torch.nn.Linear(1, 1), None, NumericsSpec(torch.float32), "cpu", activation_checkpointing="yes")


def test_logprob_grad_kernel_matches_torch_formula():
    """The Triton kernel (on CPU through TRITON_INTERPRET=1) against the torch formula, for a
    block of columns with targets inside and outside it."""
    from vllm.kernels.logprob_grad import logprob_grad_block_torch, logprob_grad_block_triton
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(5, 70, device=dev) * 4
    lse = torch.logsumexp(logits / 0.8, -1) + 0.3    # any per-row value: the formula is what is checked
    targets = torch.tensor([100, 103, 169, 99, 170], device=dev)  # the block holds columns 100..169
    scale = torch.randn(5, device=dev)
    ref = logprob_grad_block_torch(logits, lse, targets, scale, 100, 0.8, torch.float32)
    got = logprob_grad_block_triton(logits, lse, targets, scale, 100, 0.8, torch.float32)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-7)
    p = torch.exp(logits[1] / 0.8 - lse[1])
    assert torch.allclose(ref[1, 3], scale[1] * (1 - p[3])) and torch.allclose(ref[3], -scale[3] * torch.exp(logits[3] / 0.8 - lse[3]))


@pytest.mark.parametrize("arch", ["tiny_qwen3", "tiny_llama"])
def test_policy_chunked_head_same_bits_and_gradients(arch, request):
    """Policy.token_logprobs with the head cut into 1- and 3-row chunks gives the bits of the
    unchunked head, and gradients within float32 rounding of it (tied and untied lm_head)."""
    path = request.getfixturevalue(arch)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 20, 14)]
    plens = [4, 11, 2]
    out, grads = [], []
    for chunk in (None, 3, 1):
        pol = Policy.from_pretrained(path, device="cpu", numerics="invariant", logprob_chunk_rows=chunk)
        lps = pol.token_logprobs(seqs, plens, temperature=0.9)
        sum((torch.linspace(-1, 1, len(lp)) * lp).sum() for lp in lps).backward()
        out.append(lps)
        grads.append(pol.model.hf_state_dict(grads=True))
    for other in out[1:]:
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(out[0], other))
    for other in grads[1:]:
        for k, ref in grads[0].items():
            assert ((other[k].double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item() < 1e-5, k


# ---- GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_lm_head_chunks_keep_bits():
    """Qwen3-8B's lm_head shape (K=4096, V=151936, bf16, float32 logits through the invariant
    GEMM and the cuBLASLt buckets of the tuned table): any row chunking of the fused head
    equals tempered_logprobs over all rows at once, bit for bit."""
    torch.manual_seed(0)
    R = 1100
    h = torch.randn(R, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(151936, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    targets = torch.randint(0, 151936, (R,), device="cuda")
    t = torch.tensor(0.9, device="cuda")
    with set_forward_context(ForwardContext(None, "invariant")), torch.no_grad():
        ref = _reference(ops.logits(h, w), t, targets)
        for chunk in (1100, 768, 513, 256, 100, 17, 1):
            got = token_logprobs_head(h, w, targets, t, 0.9, lambda x: ops.logits(x, w), chunk)
            assert torch.equal(bits(got), bits(ref)), f"chunk_rows={chunk}"


@pytest.mark.gpu
def test_gpu_head_backward_vs_float64():
    torch.manual_seed(0)
    h = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(5000, 512, device="cuda") * 0.05).bfloat16()
    targets = torch.randint(0, 5000, (300,), device="cuda")
    coef = torch.randn(300, device="cuda")
    t = torch.tensor(0.8, device="cuda")
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    with set_forward_context(ForwardContext(None, "invariant")):
        lp = token_logprobs_head(hg, wg, targets, t, 0.8, lambda x: ops.logits(x, wg), 64)  # 5 row chunks, 5 column blocks
    (coef * lp).sum().backward()
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    ref = torch.log_softmax((hd @ wd.t()) / 0.8, -1).gather(-1, targets[:, None])[:, 0]
    assert (lp.double() - ref).abs().max().item() < 1e-3
    (coef.double() * ref).sum().backward()
    for ours, r in ((hg.grad, hd.grad), (wg.grad, wd.grad)):
        assert ((ours.double() - r).norm() / r.norm()).item() < 1e-2


@pytest.mark.gpu
def test_gpu_policy_chunked_head_same_bits(gpu_model):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (300, 41, 700)]
    plens = [10, 40, 350]
    ref = Policy.from_pretrained(gpu_model, device="cuda", numerics="invariant").token_logprobs(seqs, plens, 0.9)
    for chunk in (1, 5, 128):
        pol = Policy.from_pretrained(gpu_model, device="cuda", numerics="invariant", logprob_chunk_rows=chunk)
        got = pol.token_logprobs(seqs, plens, 0.9)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, ref)), f"chunk {chunk}"
