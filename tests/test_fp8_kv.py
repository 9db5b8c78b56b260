"""FP8 KV cache (kv_cache_dtype="fp8"): the quantization rule against float64, one read
path (the invariance battery with an FP8 cache), the trainer's private FP8 copy (rollout ==
training logprobs by bits), the round trip really there, capacity, the contract."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.kernels import fp8
from vllm.kernels.attention_cpu import paged_attention_cpu, paged_attention_ref
from vllm.testing.parity_battery import Battery
from vllm.training import Policy
from vllm.worker.kv_format import KVFormat
from vllm.testing.rollouts import sequences_and_logprobs


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def test_fp8_round_reference_agrees_with_torch_cast():
    x = torch.cat([torch.randn(4000, dtype=torch.float64) * s for s in (1e-3, 0.1, 1, 30, 200)])
    x = x.clamp(-448, 448)
    assert torch.equal(fp8.fp8_round_ref(x), x.to(fp8.FP8_DTYPE).double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_kv_against_float64(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 4, 64, generator=g) * torch.logspace(-3, 2, 37)[:, None, None]).to(dtype)
    x[3, 1] = 0  # an all-zero row: scale 1, values 0
    q, s = fp8.quantize_kv(x)
    qr, sr = fp8.quantize_kv_ref(x)
    assert q.dtype == fp8.FP8_DTYPE and s.dtype == torch.float32 and s.shape == x.shape[:2]
    assert torch.allclose(s.double(), sr, rtol=2 ** -23, atol=0)
    # values may differ from the float64 rounding only where fp32 scaling moved a tie
    assert (q.double() != qr).float().mean() < 1e-3
    deq = fp8.dequantize_kv(q, s, torch.float64)
    err = (deq - x.double()).abs() / x.double().abs().amax(-1, keepdim=True).clamp(min=1e-30)
    assert err.max() <= 2 ** -4 + 1e-6  # half an e4m3 ulp at the top binade, relative to amax
    assert s[3, 1] == 1 and (q[3, 1].float() == 0).all()
    # per token per head: a row's bits do not depend on the others
    q1, s1 = fp8.quantize_kv(x[5:6])
    assert torch.equal(q1.view(torch.uint8), q[5:6].view(torch.uint8)) and torch.equal(s1, s[5:6])


def test_attention_reads_fp8_cache_as_dequantized_values():
    g = torch.Generator().manual_seed(1)
    nb, bs, H, D, Hq = 6, 4, 2, 32, 4
    k, v = torch.randn(nb * bs, H, D, generator=g), torch.randn(nb * bs, H, D, generator=g)
    kq, ks = fp8.quantize_kv(k)
    vq, vs = fp8.quantize_kv(v)
    q = torch.randn(10, Hq, D, generator=g)
    table = torch.tensor([[2, 0, 5, 1, 3, 4]], dtype=torch.int32)
    cu, lens = torch.tensor([0, 10], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    shape = (nb, bs, H, D)
    got = paged_attention_cpu(q, kq.view(shape), vq.view(shape), table, cu, lens, D ** -0.5, max_query_len=10,
                              k_scale=ks.view(nb, bs, H), v_scale=vs.view(nb, bs, H))
    want = paged_attention_cpu(q, fp8.kv_round_trip(k).view(shape), fp8.kv_round_trip(v).view(shape), table, cu, lens,
                               D ** -0.5, max_query_len=10)
    assert torch.equal(bits(got), bits(want))
    ref = paged_attention_ref(q.double(), kq.view(shape), vq.view(shape), table, cu, lens, D ** -0.5,
                              max_query_len=10, k_scale=ks.view(nb, bs, H), v_scale=vs.view(nb, bs, H))
    assert torch.allclose(got.double(), ref, atol=1e-5)


def test_attention_triton_interpreter_fp8_cache():
    from vllm.kernels.attention import paged_attention_triton
    g = torch.Generator().manual_seed(2)
    nb, bs, H, D, Hq = 4, 8, 1, 16, 2
    k, v = torch.randn(nb * bs, H, D, generator=g), torch.randn(nb * bs, H, D, generator=g)
    kq, ks = fp8.quantize_kv(k)
    vq, vs = fp8.quantize_kv(v)
    q = torch.randn(3, Hq, D, generator=g)
    table = torch.tensor([[3, 1, 0, 2]], dtype=torch.int32)
    cu, lens = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([30], dtype=torch.int32)
    shape = (nb, bs, H, D)
    got = paged_attention_triton(q, kq.view(shape), vq.view(shape), table, cu, lens, 0.25, max_query_len=3,
                                 max_seq_len=30, k_scale=ks.view(nb, bs, H), v_scale=vs.view(nb, bs, H))
    want = paged_attention_triton(q, fp8.kv_round_trip(k).view(shape), fp8.kv_round_trip(v).view(shape), table, cu,
                                  lens, 0.25, max_query_len=3, max_seq_len=30)
    assert torch.equal(bits(got), bits(want))


def _make(path, **kw):
    opts = dict(device="cpu", dtype="float32", numerics="invariant", block_size=4, max_num_batched_tokens=512,
                kv_cache_dtype="fp8")
    opts.update(kw)
    return LLM(path, **opts)


@pytest.fixture(scope="module")
def battery(tiny_qwen3):
    return Battery(lambda **kw: _make(tiny_qwen3, **kw), vocab=512, max_tokens=6)


@pytest.mark.parametrize("check", ["batch_slots", "prefill_vs_decode", "chunked_prefill", "prefix_cache", "preemption"])
def test_fp8_cache_invariance_battery(battery, check):
    res = getattr(battery, check)()
    assert res.comparisons > 0
    assert res.differing == 0, f"{res.name}: {res.differing}/{res.comparisons} differ ({res.detail})"


def _rollout(llm, prompts):
    sp = SamplingParams(temperature=0.8, max_tokens=6, seed=3, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return sequences_and_logprobs(prompts, outs)


def test_fp8_rollout_equals_training_bits_and_differs_from_bf16_cache(tiny_qwen3):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 19, 33)]
    llm = _make(tiny_qwen3)
    seqs, roll = _rollout(llm, prompts)
    plens = [len(p) for p in prompts]
    policy = Policy.from_pretrained(tiny_qwen3, device="cpu", dtype="float32", kv_cache_dtype="fp8")
    for budget in (None, 20):
        got = policy.token_logprobs(seqs, plens, temperature=0.8, max_tokens_per_micro_batch=budget)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, roll))
    colo = llm.policy()
    assert colo.kv_cache_dtype == "fp8"
    got = colo.token_logprobs(seqs, plens, temperature=0.8)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, roll))
    # the round trip is really there: the model-dtype cache (and trainer) give other logprobs
    plain = Policy.from_pretrained(tiny_qwen3, device="cpu", dtype="float32")
    other = plain.token_logprobs(seqs, plens, temperature=0.8)
    assert not all(torch.equal(bits(a), bits(b)) for a, b in zip(other, roll))
    assert max((a - b).abs().max().item() for a, b in zip(other, roll)) < 0.5
    # straight-through gradient: the trainer's private copy passes gradients to the parameters
    sum(lp.sum() for lp in policy.token_logprobs(seqs, plens, temperature=0.8)).backward()
    qkv = next(p for n, p in policy.named_parameters() if "qkv" in n)
    assert qkv.grad is not None and qkv.grad.abs().sum() > 0


def test_kv_round_trip_ste_gradient_is_identity():
    x = torch.randn(5, 2, 16, requires_grad=True)
    y = fp8.kv_round_trip_ste(x)
    assert not torch.equal(y, x)
    g = torch.randn_like(x)
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_capacity_and_contract(tiny_qwen3):
    f16, f8 = KVFormat(torch.bfloat16, "auto"), KVFormat(torch.bfloat16, "fp8")
    # Qwen3-8B dims: 36 layers, 8 kv heads, head_dim 128, at the same 40 GiB budget
    a, b = (f.capacity_tokens(40 << 30, 36, 16, 8, 128) for f in (f16, f8))
    assert 1.9 < b / a < 2.0  # 1 byte + 4/128 bytes of scale per element vs 2 bytes
    llm = _make(tiny_qwen3, cpu_kv_cache_bytes=1 << 20)
    ref = _make(tiny_qwen3, cpu_kv_cache_bytes=1 << 20, kv_cache_dtype="auto")
    r8, r32 = llm.llm_engine.runner, ref.llm_engine.runner
    assert r8.k_caches[0].dtype == torch.float8_e4m3fn and r8.k_scales[0].dtype == torch.float32
    assert r8.kv_capacity_tokens > 3 * r32.kv_capacity_tokens  # float32 model dtype on CPU: ~3.8x
    c8, c32 = llm.execution_contract(), ref.execution_contract()
    rule = c8.numerical["kv_cache_dtype"]
    assert rule["dtype"] == "float8_e4m3fn" and "per token per kv head" in rule["scale"]
    assert "nearest-even" in rule["rounding"]
    assert c32.numerical["kv_cache_dtype"] == "float32"
    with pytest.raises(ValueError, match="numerical"):
        c8.check_compatible(c32)
    pol = Policy.from_pretrained(tiny_qwen3, device="cpu", dtype="float32", kv_cache_dtype="fp8")
    pol.execution_contract().check_compatible(c8)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(tiny_qwen3, device="cpu", kv_cache_dtype="int4")


@pytest.mark.gpu
def test_gpu_fp8_cache_battery_and_training_parity(tiny_qwen3):
    mk = lambda **kw: LLM(tiny_qwen3, device="cuda", dtype="bfloat16", block_size=16, kv_cache_dtype="fp8",
                          gpu_memory_utilization=0.3,
                          **{"max_num_batched_tokens": 1024, "cuda_graph_batch_sizes": [1, 2, 4, 8, 16, 32, 64], **kw})
    b = Battery(mk, vocab=512, max_tokens=8)
    for res in b.run_all(gpu=True):
        assert res.differing == 0, res
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 70, 600)]
    seqs, roll = _rollout(b.base, prompts)
    policy = Policy.from_pretrained(tiny_qwen3, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8")
    got = policy.token_logprobs(seqs, [len(p) for p in prompts], temperature=0.8)
    assert all(torch.equal(bits(a.cpu()), bits(b_.cpu())) for a, b_ in zip(got, roll))
