"""Training mode on the GPU: rollout (CUDA graphs, bf16, invariant) == trainer bits,
gradients against transformers."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM
from vllm.testing.gpu_checks import assert_rollout_equals_trainer
from vllm.training import Policy

pytestmark = pytest.mark.gpu



def test_gpu_rollout_equals_trainer_bits(gpu_model):
    llm = LLM(gpu_model, device="cuda", numerics="invariant", gpu_memory_utilization=0.2,
              cuda_graph_batch_sizes=[1, 2, 4, 8, 16])
    assert_rollout_equals_trainer(llm, gpu_model)


def test_gpu_gradients_vs_transformers(gpu_model):
    from vllm.testing.tiny_models import load_hf_model
    prompts = [list(range(5, 60)), list(range(100, 130))]
    seqs = [p + [7, 8, 9, 10] for p in prompts]
    plens = [len(p) for p in prompts]
    hf = load_hf_model(gpu_model, torch.float64, device="cuda")
    ref_lps = []
    for s, pl in zip(seqs, plens):
        lp = torch.log_softmax(hf(torch.tensor([s], device="cuda")).logits[0], -1)
        ref_lps.append(lp[pl - 1:len(s) - 1].gather(1, torch.tensor(s[pl:], device="cuda")[:, None])[:, 0])
    sum(lp.sum() for lp in ref_lps).backward()
    ref = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    for numerics, dtype, tol in (("fast", "float32", 1e-3), ("invariant", "bfloat16", 0.1)):
        pol = Policy.from_pretrained(gpu_model, device="cuda", dtype=dtype, numerics=numerics)
        sum(lp.sum() for lp in pol.token_logprobs(seqs, plens)).backward()
        ours = pol.model.hf_state_dict(grads=True)
        for name, gref in ref.items():
            if name in ours and gref.norm() > 0:
                err = ((ours[name].double() - gref).norm() / gref.norm()).item()
                assert err < tol, f"{numerics}/{dtype} {name}: {err:.2e}"


def test_gpu_attention_backward_vs_float64():
    """The bf16 attention backward (flash varlen adjoint) against float64 autograd."""
    from vllm.training.attention import PackedAttentionBackend
    torch.manual_seed(0)
    lens = [37, 300, 1, 129]
    T = sum(lens)
    q = torch.randn(T, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(T, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(T, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    be = PackedAttentionBackend(lens, torch.device("cuda"))
    out = be.forward(0, q, k, v, 0.125)
    go = torch.randn_like(out)
    out.backward(go)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    refs = []
    for a, b in zip(be.cu[:-1], be.cu[1:]):
        qs, ks, vs = qd[a:b].transpose(0, 1), kd[a:b].transpose(0, 1).repeat_interleave(4, 0), vd[a:b].transpose(0, 1).repeat_interleave(4, 0)
        s = (qs @ ks.transpose(1, 2)) * 0.125
        L = b - a
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool, device="cuda").tril(), float("-inf"))
        refs.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
    ref = torch.cat(refs)
    ref.backward(go.double())
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    for a, b in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        assert ((a.double() - b).norm() / b.norm()).item() < 2e-2


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def test_gpu_norm_rope_silu_backward_kernels_vs_float64():
    """The Triton backwards at Qwen3-4B's dims in bf16, through the autograd Functions the op
    shim uses, against float64 autograd: RMSNorm with the fused residual add (the residual
    gradient of a later layer flowing in), the per-head q norm reading the fused qkv output
    in place, RoPE and SiLU-and-mul."""
    from vllm.kernels import ops
    torch.manual_seed(0)
    T, H, I, D = 2048, 2560, 9728, 128
    dev, bf = "cuda", torch.bfloat16

    # RMSNorm + residual: (y, r') = (rms_norm(x + r) * w, x + r)
    x, r = torch.randn(T, H, device=dev, dtype=bf), torch.randn(T, H, device=dev, dtype=bf)
    w = (1 + 0.1 * torch.randn(H, device=dev)).to(bf)
    dy, dres = torch.randn(T, H, device=dev, dtype=bf), torch.randn(T, H, device=dev, dtype=bf)
    xg, rg, wg = (t.clone().requires_grad_() for t in (x, r, w))
    y, res = ops.add_rms_norm(xg, rg, wg, 1e-6)
    torch.autograd.backward((y, res), (dy, dres))
    xd, rd, wd = (t.double().requires_grad_() for t in (x, r, w))
    s = xd + rd
    yd = wd * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.autograd.backward((yd, s), (dy.double(), dres.double()))
    assert _rel(xg.grad, xd.grad) < 1e-2 and _rel(rg.grad, rd.grad) < 1e-2 and _rel(wg.grad, wd.grad) < 1e-2

    # per-head q norm on a strided view of the fused qkv output
    qkv = torch.randn(T, 48 * D, device=dev, dtype=bf)
    qn = (1 + 0.1 * torch.randn(D, device=dev)).to(bf)
    qkvg, qng = qkv.clone().requires_grad_(), qn.clone().requires_grad_()
    q = qkvg[:, :32 * D].reshape(T, 32, D)
    dq = torch.randn(T, 32, D, device=dev, dtype=bf)
    ops.rms_norm(q, qng, 1e-6).backward(dq)
    qd, qnd = qkv[:, :32 * D].reshape(T, 32, D).double().requires_grad_(), qn.double().requires_grad_()
    (qnd * qd * torch.rsqrt(qd.pow(2).mean(-1, keepdim=True) + 1e-6)).backward(dq.double())
    assert _rel(qkvg.grad[:, :32 * D].reshape(T, 32, D), qd.grad) < 1e-2 and _rel(qng.grad, qnd.grad) < 1e-2
    assert qkvg.grad[:, 32 * D:].abs().max().item() == 0

    # RoPE
    q, k = torch.randn(T, 32, D, device=dev, dtype=bf), torch.randn(T, 8, D, device=dev, dtype=bf)
    ang = torch.outer(torch.arange(T, device=dev, dtype=torch.float32), 1e6 ** -(torch.arange(0, D, 2, device=dev) / D))
    cos, sin = ang.cos(), ang.sin()
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    torch.autograd.backward(ops.apply_rope(qg, kg, cos, sin), (dq, dk))

    def rope64(t):
        t1, t2 = t[..., :D // 2], t[..., D // 2:]
        c, s_ = cos.double()[:, None], sin.double()[:, None]
        return torch.cat((t1 * c - t2 * s_, t2 * c + t1 * s_), -1)
    qd, kd = q.double().requires_grad_(), k.double().requires_grad_()
    torch.autograd.backward((rope64(qd), rope64(kd)), (dq.double(), dk.double()))
    assert _rel(qg.grad, qd.grad) < 1e-2 and _rel(kg.grad, kd.grad) < 1e-2

    # SiLU-and-mul
    gu = torch.randn(T, 2 * I, device=dev, dtype=bf) * 3
    dy = torch.randn(T, I, device=dev, dtype=bf)
    gug = gu.clone().requires_grad_()
    ops.silu_and_mul(gug).backward(dy)
    gud = gu.double().requires_grad_()
    (torch.nn.functional.silu(gud[:, :I]) * gud[:, I:]).backward(dy.double())
    assert _rel(gug.grad, gud.grad) < 1e-2


def test_gpu_training_step_never_waits_for_the_gpu(gpu_model):
    """Forward + backward of the invariant trainer issue no synchronising CUDA call (no
    blocking host->device copy, no .item(), no .tolist() of a device tensor): torch's sync
    debug mode raises on the first one."""
    pol = Policy.from_pretrained(gpu_model, device="cuda", numerics="invariant")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (300, 41, 700, 64)]
    plens = [10, 40, 350, 1]

    def step():
        lps = pol.token_logprobs(seqs, plens, temperature=0.9, max_tokens_per_micro_batch=800)
        (-sum(lp.sum() for lp in lps)).backward()
    step()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in pol.parameters())
