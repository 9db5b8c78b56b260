"""FP8 KV cache (kv_cache_dtype="fp8"): the quantization rule against float64, one read
path (the invariance battery with an FP8 cache), the trainer's private FP8 copy (rollout ==
training logprobs by bits), the round trip really there, capacity, the contract."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.kernels import fp8
from vllm.kernels.cache_dequant import dequant_kv_blocks_ref, dequant_kv_blocks_triton
from vllm.testing.parity_battery import Battery
from vllm.training import Policy
from vllm.worker.kv_format import KVFormat
from vllm.testing.rollouts import sequences_and_logprobs


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def test_fp8_round_reference_agrees_with_torch_cast():
    # float32 inputs, as the rules cast (x / scale is float32): a float64 cast may round
    # through float32 first, and that double rounding differs from one rounding at ties
    # the float32 step creates (about 1 element in 10^6)
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g) * s for s in (1e-3, 0.1, 1, 30, 200)]).clamp(-448, 448)
    assert torch.equal(fp8.fp8_round_ref(x.double()), x.to(fp8.FP8_DTYPE).double())


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


def _fp8_paged_cache(g, nb=7, bs=4, H=2, D=32, lens=(13, 1, 9)):
    """An FP8 cache with scales holding `lens` tokens per sequence in shuffled blocks, and the
    raw K/V it was written from."""
    per = [-(-n // bs) for n in lens]
    perm = torch.randperm(nb - 1, generator=g) + 1
    table = torch.zeros(len(lens), max(per), dtype=torch.int32)
    at = 0
    for s, p in enumerate(per):
        table[s, :p] = perm[at:at + p]
        at += p
    k, v = torch.randn(nb, bs, H, D, generator=g) * 3, torch.randn(nb, bs, H, D, generator=g)
    kq, ks = fp8.quantize_kv(k)
    vq, vs = fp8.quantize_kv(v)
    return kq, vq, ks, vs, table, torch.tensor(lens, dtype=torch.int32), perm[at:]


def test_dequant_blocks_reference_writes_exactly_the_used_blocks():
    g = torch.Generator().manual_seed(1)
    kq, vq, ks, vs, table, lens, unused = _fp8_paged_cache(g)
    kd = torch.full(kq.shape, 7.0)
    vd = torch.full(kq.shape, 7.0)
    dequant_kv_blocks_ref(kq, vq, ks, vs, kd, vd, table, lens)
    used = torch.unique(torch.cat([table[s, :-(-int(n) // 4)] for s, n in enumerate(lens)])).long()
    assert torch.equal(bits(kd[used]), bits(fp8.dequantize_kv(kq[used], ks[used], torch.float32)))
    assert torch.equal(bits(vd[used]), bits(fp8.dequantize_kv(vq[used], vs[used], torch.float32)))
    untouched = [b for b in range(kq.shape[0]) if b not in used.tolist()]
    assert untouched and (kd[untouched] == 7).all() and (vd[untouched] == 7).all()
    with pytest.raises(ValueError, match="shape"):
        dequant_kv_blocks_ref(kq, vq, ks, vs, kd[:3], vd, table, lens)


def test_dequant_blocks_triton_interpreter_equals_reference():
    # float32 copies: the interpreter casts float32 -> bf16 by truncation, not the GPU's
    # round-to-nearest-even; the bf16 copy is checked on the GPU
    # (test_gpu_fp8_cache_real_dims_kernel_bits)
    dtype = torch.float32
    g = torch.Generator().manual_seed(2)
    kq, vq, ks, vs, table, lens, _ = _fp8_paged_cache(g, nb=9, bs=8, H=3, D=16, lens=(30, 8, 17, 0))
    want = [torch.zeros(kq.shape, dtype=dtype) for _ in range(2)]
    got = [torch.zeros(kq.shape, dtype=dtype) for _ in range(2)]
    dequant_kv_blocks_ref(kq, vq, ks, vs, *want, table, lens)
    dequant_kv_blocks_triton(kq, vq, ks, vs, *got, table, lens, max_seq_len=32)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want))


def test_engine_reads_fp8_cache_through_the_model_dtype_copy():
    """The backend's FP8 read: the copy holds the dequantized used blocks, and attention
    over it equals attention over a model-dtype cache of the round-tripped K/V."""
    from vllm.worker.attention_backend import AttentionMetadata, PagedAttentionBackend
    from vllm.forward_context import ForwardContext, set_forward_context

    g = torch.Generator().manual_seed(3)
    bs, H, D, Hq, T = 4, 2, 16, 4, 11
    k, v, q = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g), torch.randn(T, Hq, D, generator=g)
    shape = (5, bs, H, D)
    kc, vc = torch.zeros(shape, dtype=fp8.FP8_DTYPE), torch.zeros(shape, dtype=fp8.FP8_DTYPE)
    ks, vs = torch.ones(shape[:3]), torch.ones(shape[:3])
    fp8_backend = PagedAttentionBackend([kc], [vc], [ks], [vs], [(torch.zeros(shape), torch.zeros(shape))])
    plain = PagedAttentionBackend([torch.zeros(shape)], [torch.zeros(shape)])
    table = torch.tensor([[3, 1, 4]], dtype=torch.int32)
    md = AttentionMetadata(slot_mapping=(table[0, torch.arange(T) // bs] * bs + torch.arange(T) % bs).long(),
                           block_table=table, cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32),
                           seq_lens=torch.tensor([T], dtype=torch.int32), max_query_len=T, max_seq_len=T)
    fp8_backend.metadata = plain.metadata = md
    with set_forward_context(ForwardContext(fp8_backend, "invariant")):
        got = fp8_backend.forward(0, q, k, v, D ** -0.5)
    with set_forward_context(ForwardContext(plain, "invariant")):
        want = plain.forward(0, q, fp8.kv_round_trip(k), fp8.kv_round_trip(v), D ** -0.5)
    assert torch.equal(bits(got), bits(want))
    with pytest.raises(ValueError, match="dequantization copy"):
        PagedAttentionBackend([kc], [vc], [ks], [vs])


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
    # Qwen3-8B dims: 36 layers, 8 kv heads, head_dim 128, at the same 40 GiB budget: per token
    # and kv head, 36 layers x (128 + 4) bytes plus one layer's bf16 read copy (256) vs 36 x 256
    a, b = (f.capacity_tokens(40 << 30, 36, 16, 8, 128) for f in (f16, f8))
    assert abs(b / a - (36 * 256) / (36 * 132 + 256)) < 1e-3  # 1.84x
    llm = _make(tiny_qwen3, cpu_kv_cache_bytes=1 << 20)
    ref = _make(tiny_qwen3, cpu_kv_cache_bytes=1 << 20, kv_cache_dtype="auto")
    r8, r32 = llm.llm_engine.executor.worker, ref.llm_engine.executor.worker
    assert r8.kv_cache.k[0].dtype == torch.float8_e4m3fn and r8.kv_cache.k_scales[0].dtype == torch.float32
    # float32 model dtype on CPU; at 2 layers the one-layer float32 read copy weighs as much
    # as the FP8 layers themselves, so the gain is smaller than at real depths (above)
    assert r8.kv_capacity_tokens > r32.kv_capacity_tokens
    assert r8.kv_capacity_tokens == (1 << 20) // r8.cache_plan.kv_bytes_per_block * r8.block_size
    (copy, _), = r8.kv_cache.dequant.values()  # one layer shape: one read copy
    assert copy.dtype == torch.float32 and copy.shape == r8.kv_cache.k[0].shape
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


@pytest.mark.gpu
def test_gpu_fp8_cache_real_dims_kernel_bits():
    """Qwen3-1.7B attention dims (16 q heads, 8 kv heads, head_dim 128), contexts up to 1000:
    the FP8 read (dequantized blocks + the model-dtype kernel) gives the same bits for a row
    whether it is computed in the whole prefill, a 7-token chunk or a decode at its position,
    equal to a bf16 cache holding the round trip and to the trainer's block-size-1 layout.
    Dequantizing inside the attention kernel failed the chunk and decode cases here."""
    from vllm.kernels.attention import paged_attention_triton as attend
    from vllm.kernels.cache_write import cache_kv, cache_kv_fp8

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    Hq, Hk, D, bs, n = 16, 8, 128, 16, 1000
    k = (torch.randn(n, Hk, D, device=dev, generator=g) * 1.5).bfloat16()
    v = (torch.randn(n, Hk, D, device=dev, generator=g) * 0.3).bfloat16()
    q = torch.randn(n, Hq, D, device=dev, generator=g).bfloat16()
    nb = n // bs + 2
    table = (torch.randperm(nb - 1, device=dev, generator=g) + 1)[None].int()
    pos = torch.arange(n, device=dev)
    slots = table[0, pos // bs].long() * bs + pos % bs
    kc, vc = (torch.zeros(nb, bs, Hk, D, device=dev, dtype=fp8.FP8_DTYPE) for _ in range(2))
    ks, vs = (torch.ones(nb, bs, Hk, device=dev) for _ in range(2))
    cache_kv_fp8(k, v, kc, vc, ks, vs, slots)
    krt, vrt = fp8.kv_round_trip(k), fp8.kv_round_trip(v)
    kb, vb = (torch.zeros(nb, bs, Hk, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    cache_kv(krt, vrt, kb, vb, slots)
    kd, vd = torch.zeros_like(kb), torch.zeros_like(vb)
    I = lambda *x: torch.tensor(x, device=dev, dtype=torch.int32)

    def fp8_read(c0, c1):
        dequant_kv_blocks_triton(kc, vc, ks, vs, kd, vd, table, I(c1), c1)
        return attend(q[c0:c1], kd, vd, table, I(0, c1 - c0), I(c1), D ** -0.5, max_query_len=c1 - c0, max_seq_len=c1)

    whole = fp8_read(0, n)
    used = table[0, :-(-n // bs)].long()
    assert torch.equal(bits(kd[used]), bits(kb[used])) and torch.equal(bits(vd[used]), bits(vb[used]))
    rt = attend(q, kb, vb, table, I(0, n), I(n), D ** -0.5, max_query_len=n, max_seq_len=n)
    assert torch.equal(bits(whole), bits(rt))
    cu = I(0, n)
    trainer = attend(q, krt.unsqueeze(1), vrt.unsqueeze(1), cu[:-1, None] + torch.arange(n, device=dev, dtype=torch.int32),
                     cu, I(n), D ** -0.5, max_query_len=n, max_seq_len=n)
    assert torch.equal(bits(trainer), bits(whole))
    for c0 in range(0, n, 7):
        c1 = min(n, c0 + 7)
        assert torch.equal(bits(fp8_read(c0, c1)), bits(whole[c0:c1])), f"chunk [{c0}, {c1})"
    for p in range(0, n, 13):
        assert torch.equal(bits(fp8_read(p, p + 1)), bits(whole[p:p + 1])), f"decode at {p}"
