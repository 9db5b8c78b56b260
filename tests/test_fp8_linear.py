"""FP8 linear layers (quantization="fp8"): quantize/dequantize vs float64, the GEMMs vs the
float64 reference, batch invariance of the CPU kernel, the straight-through backward, FP8
checkpoints, rollout == training bits and the invariance battery under FP8 GEMMs."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.kernels import fp8, fp8_gemm
from vllm.kernels.fp8_gemm import (FP8LinearFn, fp8_gemm_triton, fp8_linear_rows,
                                   fp8_linear_triton)
from vllm.testing.parity_battery import Battery
from vllm.training import Policy
from vllm.testing.rollouts import sequences_and_logprobs


def bits(t):
    t = t.detach().contiguous()
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def test_quantize_act_and_weight_against_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 300, generator=g) * torch.logspace(-2, 2, 300)
    q, s = fp8.quantize_act(x)
    assert q.shape == x.shape and s.shape == (7, 3)
    for b in range(3):
        blk = x[:, b * 128:(b + 1) * 128].double()
        sr = blk.abs().amax(1) / 448
        assert torch.allclose(s[:, b].double(), sr, rtol=2 ** -23, atol=0)
        qr = fp8.fp8_round_ref((blk / s[:, b, None].double()).clamp(-448, 448))
        assert (q[:, b * 128:(b + 1) * 128].double() != qr).float().mean() < 1e-3
    w = torch.randn(200, 300, generator=g)
    wq, ws = fp8.quantize_weight(w)
    assert ws.shape == (2, 3)
    assert torch.allclose(ws[1, 2].double(), w[128:, 256:].double().abs().amax() / 448, rtol=2 ** -23, atol=0)
    deq = fp8.dequantize_weight(wq, ws, torch.float64)
    rel = (deq - w.double()).abs().amax() / w.abs().amax()
    assert rel <= 2 ** -4
    # a row's activation quantization does not depend on the others
    q1, s1 = fp8.quantize_act(x[3:4])
    assert torch.equal(q1.view(torch.uint8), q[3:4].view(torch.uint8)) and torch.equal(s1, s[3:4])


@pytest.mark.parametrize("M,K,N", [(5, 64, 96), (9, 300, 260)])
def test_cpu_gemm_matches_float64_and_is_batch_invariant(M, K, N):
    g = torch.Generator().manual_seed(M)
    x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * 0.05, torch.randn(N, generator=g)
    y = fp8_linear_rows(x, *fp8.quantize_weight(w), b)
    ref = fp8.fp8_linear_ref(x, w, b)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
    # the FP8 error itself (vs the unquantized product) is a few percent, stated in docs/fp8.md
    exact = x.double() @ w.double().T + b.double()
    assert ((y.double() - exact).abs().amax() / exact.abs().amax()) < 0.08
    for m in (1, 2, M - 1):
        part = fp8_linear_rows(x[:m], *fp8.quantize_weight(w), b)
        assert torch.equal(bits(part), bits(y[:m]))


def test_triton_gemm_interpreter_matches_reference():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(20, 200, generator=g), torch.randn(130, 200, generator=g)
    xq, xs = fp8.quantize_act(x)
    wq, ws = fp8.quantize_weight(w)
    y = fp8_gemm_triton(xq, xs, wq, ws, None, torch.float32)
    assert torch.allclose(y.double(), fp8.fp8_linear_ref(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("cfg", [dict(BLOCK_M=16, BLOCK_N=128, GROUP_M=1, num_warps=1, num_stages=1, TMA=True),
                                 dict(BLOCK_M=32, BLOCK_N=256, GROUP_M=2, num_warps=1, num_stages=1, TMA=False),
                                 dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=2, num_warps=1, num_stages=1, TMA=True),
                                 dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=1, num_warps=1, num_stages=1, TMA=False)])
def test_triton_gemm_interpreter_tile_variants(cfg):
    """The sweep's variants (TMA descriptors, BLOCK_N=256 with per-column weight scales,
    BLOCK_N=64/32 with one weight scale per tile spanning two/four tiles, M-contiguous
    scales, ragged K and N) compute the default's bits."""
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(21, 330, generator=g), torch.randn(300, 330, generator=g), torch.randn(300, generator=g)
    wq, ws = fp8.quantize_weight(w)
    y = fp8_gemm_triton(*fp8.quantize_act(x), wq, ws, b, torch.float32)
    assert torch.allclose(y.double(), fp8.fp8_linear_ref(x, w, b), rtol=1e-5, atol=1e-4)
    xq, xs = fp8.quantize_act(x)
    xs_m_contiguous = xs.t().contiguous().t()
    assert torch.equal(bits(fp8_gemm_triton(xq, xs_m_contiguous, wq, ws, b, torch.float32, config=cfg)), bits(y))


def test_straight_through_gradients():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 200, generator=g, dtype=torch.float64).requires_grad_(True)
    w = torch.randn(70, 200, generator=g, dtype=torch.float64).requires_grad_(True)
    b = torch.randn(70, generator=g, dtype=torch.float64).requires_grad_(True)
    wq, ws = fp8.quantize_weight(w.detach())
    y = FP8LinearFn.apply(x, w, wq, ws, b, fp8_linear_rows)
    dy = torch.randn_like(y)
    y.backward(dy)
    # STE: gradients of the matmul of the dequantized operands, exactly
    xd = fp8.dequantize_act(*fp8.quantize_act(x.detach()), torch.float64).requires_grad_(True)
    wd = fp8.dequantize_weight(wq, ws, torch.float64).requires_grad_(True)
    torch.nn.functional.linear(xd, wd, b.detach()).backward(dy)
    assert torch.allclose(x.grad, xd.grad, rtol=1e-12, atol=1e-12)
    assert torch.allclose(w.grad, wd.grad, rtol=1e-12, atol=1e-12)
    assert torch.allclose(b.grad, dy.sum(0))
    # and within the FP8 error of the unquantized (bf16-style) reference: stated tolerance 8%
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(x2, w2, b.detach()).backward(dy)
    for got, ref in ((x.grad, x2.grad), (w.grad, w2.grad)):
        assert ((got - ref).abs().amax() / ref.abs().amax()) < 0.08


def _make(path, **kw):
    opts = dict(device="cpu", dtype="float32", numerics="invariant", block_size=4, max_num_batched_tokens=512,
                quantization="fp8")
    opts.update(kw)
    return LLM(path, **opts)


@pytest.fixture(scope="module")
def battery(tiny_qwen3):
    return Battery(lambda **kw: _make(tiny_qwen3, **kw), vocab=512, max_tokens=5)


@pytest.mark.parametrize("check", ["batch_slots", "prefill_vs_decode", "chunked_prefill", "prefix_cache"])
def test_fp8_gemm_invariance_battery(battery, check):
    res = getattr(battery, check)()
    assert res.comparisons > 0
    assert res.differing == 0, f"{res.name}: {res.differing}/{res.comparisons} differ ({res.detail})"


def _rollout(llm, prompts):
    sp = SamplingParams(temperature=0.8, max_tokens=5, seed=3, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return sequences_and_logprobs(prompts, outs)


def test_fp8_rollout_equals_training_bits_and_sync_requantizes(tiny_qwen3):
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 17, 30)]
    llm = _make(tiny_qwen3, kv_cache_dtype="fp8")
    seqs, roll = _rollout(llm, prompts)
    plens = [len(p) for p in prompts]
    pol = Policy.from_pretrained(tiny_qwen3, device="cpu", dtype="float32", quantization="fp8", kv_cache_dtype="fp8")
    got = pol.token_logprobs(seqs, plens, temperature=0.8, max_tokens_per_micro_batch=25)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, roll))
    pol.execution_contract().check_compatible(llm.execution_contract())
    assert llm.execution_contract().numerical["quantization"]["weights"].startswith("per 128 x 128")
    plain = Policy.from_pretrained(tiny_qwen3, device="cpu", dtype="float32", kv_cache_dtype="fp8")
    other = plain.token_logprobs(seqs, plens, temperature=0.8)
    assert not all(torch.equal(bits(a), bits(b)) for a, b in zip(other, roll))
    # a training step on the master weights, then weight sync: the engine re-quantizes and the
    # rollout again equals the trainer (which re-quantized at its own forward) bit for bit
    opt = torch.optim.SGD(pol.parameters(), lr=0.05)
    loss = -sum(lp.sum() for lp in pol.token_logprobs(seqs, plens, temperature=0.8))
    loss.backward()
    assert all(p.grad is not None for n, p in pol.named_parameters() if "proj" in n)
    opt.step()
    llm.update_weights(pol.model.hf_state_dict())
    seqs2, roll2 = _rollout(llm, prompts)
    got2 = pol.token_logprobs(seqs2, plens, temperature=0.8)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got2, roll2))
    assert not all(torch.equal(bits(a), bits(b)) for a, b in zip(got2, got))


def _quantize_power_of_two(w: torch.Tensor):
    """Block FP8 with power-of-two scales (UE8M0, as DeepSeek-V3.1's checkpoints): not what
    the deployment rule (amax / 448) gives for the dequantized weight."""
    N, K = w.shape
    n, k = -(-N // fp8.BLOCK), -(-K // fp8.BLOCK)
    wp = torch.zeros(n * fp8.BLOCK, k * fp8.BLOCK)
    wp[:N, :K] = w.float()
    blocks = wp.view(n, fp8.BLOCK, k, fp8.BLOCK)
    s = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0)))
    q = (blocks / s[:, None, :, None]).clamp(-448, 448).to(fp8.FP8_DTYPE).view(n * fp8.BLOCK, k * fp8.BLOCK)
    return q[:N, :K].contiguous(), s


def _write_fp8_checkpoint(src: str, dst: str, *, quantize=None, skip=(), extra=None) -> None:
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    files = [f for f in os.listdir(dst) if f.endswith(".safetensors")]
    for f in files:
        sd = load_file(os.path.join(dst, f))
        out = {}
        for name, t in sd.items():
            if name.endswith("proj.weight") and t.dim() == 2 and not any(s in name for s in skip):
                q, s = (quantize or fp8.quantize_weight)(t)
                out[name], out[name + "_scale_inv"] = q, s
            else:
                out[name] = t
        save_file(out, os.path.join(dst, f), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic", "fmt": "e4m3", **(extra or {})}
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh)


def test_fp8_checkpoint_loads(tiny_qwen3, tmp_path):
    dst = str(tmp_path / "fp8")
    _write_fp8_checkpoint(tiny_qwen3, dst)
    llm = LLM(dst, device="cpu", dtype="float32", block_size=4)  # quantization detected from the config
    assert llm.config.quantization == "fp8"
    model = llm.llm_engine.executor.model
    from safetensors.torch import load_file
    sd = {}
    for f in os.listdir(dst):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(dst, f)))
    # an unfused projection keeps the checkpoint's fp8 bits and scales as they are
    o_name = next(n for n in sd if n.endswith("o_proj.weight"))
    mods = dict(model.named_modules())
    slot = model.weight_mapping().slot(o_name)
    mod = mods[slot.param.rsplit(".", 1)[0]]
    assert torch.equal(mod.weight_fp8.view(torch.uint8), sd[o_name].view(torch.uint8))
    assert torch.equal(mod.weight_scale_inv, sd[o_name + "_scale_inv"])
    # master weight = the dequantized checkpoint
    assert torch.equal(mod.weight, fp8.dequantize_weight(sd[o_name], sd[o_name + "_scale_inv"], torch.float32))
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    bad = str(tmp_path / "bad")
    shutil.copytree(dst, bad)
    cfg = json.load(open(os.path.join(bad, "config.json")))
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
    with pytest.raises(ValueError, match="weight_block_size"):
        LLM(bad, device="cpu")


def test_fp8_checkpoint_of_other_scales_keeps_rollout_and_trainer_equal(tiny_qwen3_128, tmp_path):
    """Power-of-two scales at bfloat16: the master re-quantizes to other bits than the
    checkpoint's. The fp8 copy is the master quantized on both sides, so the engine (which
    re-quantizes every layer at a sync) equals the trainer (which re-quantizes the layers
    that changed) after a sync of unchanged weights, and an engine without masters equals
    one with them after a partial update."""
    dst = str(tmp_path / "fp8_pow2")
    _write_fp8_checkpoint(tiny_qwen3_128, dst, quantize=_quantize_power_of_two)
    kw = dict(device="cpu", dtype="bfloat16", numerics="invariant", block_size=4)
    llm = LLM(dst, **kw)
    pol = Policy.from_pretrained(dst, device="cpu", dtype="bfloat16")
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 17)]
    plens = [len(p) for p in prompts]
    for sync in (False, True):
        if sync:
            llm.update_weights(pol.model.hf_state_dict())
        seqs, roll = _rollout(llm, prompts)
        got = pol.token_logprobs(seqs, plens, temperature=0.8)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, roll)), f"sync={sync}"
    free = LLM(dst, keep_master_weights=False, **kw)
    name = "model.layers.0.self_attn.q_proj.weight"
    sd = llm.llm_engine.executor.model.hf_state_dict()
    update = {name: (sd[name].float() * 1.01).to(sd[name].dtype)}
    llm.update_weights(update)
    free.update_weights(update)
    (_, a), (_, b) = _rollout(llm, prompts), _rollout(free, prompts)
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


def test_fp8_checkpoint_modules_to_not_convert_stay_unquantized(tiny_qwen3, tmp_path):
    dst = str(tmp_path / "fp8_skip")
    _write_fp8_checkpoint(tiny_qwen3, dst, skip=("layers.0.self_attn.o_proj", "down_proj"),
                          extra={"modules_to_not_convert": ["layers.0.self_attn.o_proj", "down_proj"]})
    llm = LLM(dst, device="cpu", dtype="float32", block_size=4)
    pol = Policy.from_pretrained(dst, device="cpu", dtype="float32")
    for model in (llm.llm_engine.executor.model, pol.model):
        mods = dict(model.named_modules())
        kept = sorted(n for n, m in mods.items() if hasattr(m, "fp8") and not m.fp8)
        assert "model.layers.0.self_attn.o_proj" in kept and "model.layers.1.self_attn.o_proj" not in kept
        assert all(not m.fp8 for n, m in mods.items() if n.endswith("down_proj"))
    unq = llm.execution_contract().numerical["quantization"]["unquantized_linears"]
    assert "model.layers.0.self_attn.o_proj" in unq
    pol.execution_contract().check_compatible(llm.execution_contract())
    every = Policy.from_pretrained(tiny_qwen3, device="cpu", dtype="float32", quantization="fp8")
    with pytest.raises(ValueError, match="numerical differs"):
        every.execution_contract().check_compatible(llm.execution_contract())


def test_fp8_checkpoint_scales_without_their_weights_are_refused(tiny_qwen3, tmp_path):
    from safetensors.torch import load_file, save_file
    for case in ("orphan", "e5m2"):
        dst = str(tmp_path / case)
        _write_fp8_checkpoint(tiny_qwen3, dst)
        f = next(os.path.join(dst, x) for x in os.listdir(dst) if x.endswith(".safetensors"))
        sd = load_file(f)
        name = next(n for n in sd if n.endswith("o_proj.weight"))
        if case == "orphan":   # the weight stored unquantized, its scale left behind
            sd[name] = fp8.dequantize_weight(sd[name], sd[name + "_scale_inv"], torch.float32)
        else:
            sd[name] = sd[name].float().to(torch.float8_e5m2)
        save_file(sd, f, metadata={"format": "pt"})
        with pytest.raises(ValueError, match="without an fp8 weight" if case == "orphan" else "float8_e5m2"):
            LLM(dst, device="cpu", dtype="float32")


@pytest.mark.gpu
@pytest.mark.parametrize("K,N", [(4096, 4096), (4096, 12288), (12288, 4096)])
def test_gpu_fp8_gemm_vs_float64_and_batch_invariant(K, N):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2048, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16()
    wq, ws = fp8.quantize_weight(w)
    y = fp8_linear_triton(x, wq, ws, None)
    ref = fp8.fp8_linear_ref(x[:64], w)
    assert ((y[:64].double() - ref).abs().amax() / ref.abs().amax()) < 1e-2  # bf16 output rounding
    # m <= SMALL_M_MAX runs the decode tiles: proven bit-identical on this device by the probe
    assert fp8_gemm.small_m_tiles_verified(N, K, x.device)
    for m in (1, 3, 16, 64, 129, 256, 257, 1000):
        assert torch.equal(bits(fp8_linear_triton(x[:m], wq, ws, None)), bits(y[:m])), m


def test_gemm_config_small_m_only_where_verified(monkeypatch):
    """Decode-sized M gets the small-M tiles only for a (shape, device) whose probe passed."""
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(fp8_gemm, "_SMALL_M_OK", {(512, 256, 0): True, (256, 256, 0): False})
    small, cap = fp8_gemm.small_m_config(512, 256), fp8_gemm.SMALL_M_MAX
    assert fp8_gemm.gemm_config(512, 256, cap, dev) is small
    assert fp8_gemm.gemm_config(512, 256, cap + 1, dev) is not small
    assert fp8_gemm.gemm_config(512, 256) is not small
    assert fp8_gemm.gemm_config(256, 256, 1, dev) is not small


def test_fp8_linear_cuda_pads_rows_for_cublaslt(monkeypatch):
    """The cuBLASLt route: activations quantized into rows padded to cuBLAS's multiple, with
    M-contiguous scales, and the padding rows dropped from the output (the library call is
    replaced by the CPU kernel on the rows it was given)."""
    seen = {}

    def fake_cublaslt(xq, xs, wq, ws, out_dtype):
        seen.update(rows=xq.shape[0], xs_stride=xs.stride())
        return fp8_gemm.fp8_gemm_rows(xq, xs.contiguous(), wq, ws, None, out_dtype)

    monkeypatch.setattr(fp8_gemm, "cublaslt_serves", lambda M, wq, bias, dt: True)
    monkeypatch.setattr(fp8_gemm.fp8_cublaslt, "fp8_gemm_cublaslt", fake_cublaslt)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 256, generator=g)
    wq, ws = fp8.quantize_weight(torch.randn(128, 256, generator=g) * 0.05)
    y = fp8_gemm.fp8_linear_cuda(x, wq, ws, None)
    assert seen == {"rows": 8, "xs_stride": (1, 8)} and y.shape == (2, 3, 128)
    assert torch.equal(bits(y.reshape(6, 128)), bits(fp8_linear_rows(x.reshape(6, 256), wq, ws, None)))
    # allow_cublaslt=False (KernelConfig.gemm_cublaslt) never takes the route
    seen.clear()
    monkeypatch.setattr(fp8_gemm, "fp8_linear_triton", fp8_linear_rows)
    y2 = fp8_gemm.fp8_linear_cuda(x, wq, ws, None, allow_cublaslt=False)
    assert seen == {} and torch.equal(bits(y2), bits(y))


def test_cublaslt_serves_only_verified_large_unbiased_cuda():
    w = torch.zeros(256, 256, dtype=fp8.FP8_DTYPE)
    assert not fp8_gemm.cublaslt_serves(4096, w, None, torch.bfloat16)  # a CPU weight


@pytest.mark.gpu
@pytest.mark.parametrize("K,N", [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)])
def test_gpu_fp8_cublaslt_equals_triton_bits(K, N):
    """From CUBLASLT_MIN_M rows the layer runs cuBLASLt: its bits equal the Triton kernel's
    (rows padded to 4 included), every row equals the same row of any other M across the
    switch, and a CUDA graph replays the eager bits."""
    assert fp8_gemm.cublaslt_verified(N, K, torch.device("cuda", 0))
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2051, K, device="cuda", generator=g).bfloat16()
    wq, ws = fp8.quantize_weight((torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16())
    y = fp8_gemm.fp8_linear_cuda(x, wq, ws, None)
    assert fp8_gemm.cublaslt_serves(x.shape[0], wq, None, x.dtype)
    assert torch.equal(bits(y), bits(fp8_linear_triton(x, wq, ws, None)))
    for m in (1, 5, 64, 191, 192, 193, 256, 257, 1027, 2048):
        assert torch.equal(bits(fp8_gemm.fp8_linear_cuda(x[:m], wq, ws, None)), bits(y[:m])), m
    assert torch.equal(bits(fp8_gemm.fp8_linear_cuda(x[:300], wq, ws, None, allow_cublaslt=False)), bits(y[:300]))
    xs = x[:333].clone()
    out = fp8_gemm.fp8_linear_cuda(xs, wq, ws, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemm.fp8_linear_cuda(xs, wq, ws, None)
    xs.copy_(x[1000:1333])
    graph.replay()
    assert torch.equal(bits(out), bits(y[1000:1333]))


@pytest.mark.gpu
def test_gpu_fp8_cublaslt_battery_and_training_parity(tiny_qwen3_128):
    """The battery and rollout == training with steps on both sides of the cuBLASLt switch:
    decode and small prefills on Triton, long prefills and the trainer's forward on cuBLASLt."""
    test_gpu_fp8_battery_and_training_parity(tiny_qwen3_128, prompt_lens=(5, 190, 420))


@pytest.mark.gpu
def test_gpu_fp8_battery_and_training_parity(tiny_qwen3, prompt_lens=(5, 70, 300)):
    mk = lambda **kw: LLM(tiny_qwen3, device="cuda", dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8",
                          gpu_memory_utilization=0.3,
                          **{"max_num_batched_tokens": 1024, "cuda_graph_batch_sizes": [1, 2, 4, 8, 16, 32, 64], **kw})
    b = Battery(mk, vocab=512, max_tokens=8)
    for res in b.run_all(gpu=True):
        assert res.differing == 0, res
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in prompt_lens]
    seqs, roll = _rollout(b.base, prompts)
    pol = Policy.from_pretrained(tiny_qwen3, device="cuda", dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8")
    got = pol.token_logprobs(seqs, [len(p) for p in prompts], temperature=0.8)
    assert all(torch.equal(bits(a.cpu()), bits(b_.cpu())) for a, b_ in zip(got, roll))


def test_fp8_gemm_self_check_rows_and_ms(monkeypatch):
    """The start-up check of FP8 layers: it compares each M's rows with the largest batch's,
    covers the cuBLASLt range where cuBLASLt serves, skips model-dtype layers, and raises
    when a row depends on the batch (the op is replaced by fakes here; the GPU tests run the
    real one through engine start-up)."""
    from vllm.kernels import selfcheck
    from vllm.layers.linear import Linear
    lin, plain = Linear(256, 128, dtype=torch.float32), Linear(256, 128, dtype=torch.float32)
    lin.weight.data.normal_()
    lin.enable_fp8()
    calls = []

    def invariant(x, wq, ws, bias, allow_cublaslt=True):
        calls.append(x.shape[0])
        return (x[:, :128] * 2).bfloat16()

    monkeypatch.setattr(fp8_gemm, "fp8_linear_cuda", invariant)
    monkeypatch.setattr(fp8_gemm, "cublaslt_serves", lambda M, wq, bias, dt: True)
    rep = selfcheck.fp8_gemm_self_check([("a", lin), ("b", plain)], torch.device("cpu"), torch.bfloat16, max_tokens=2048)
    ms = rep["a (fp8)"]["Ms"]
    assert list(rep) == ["a (fp8)"] and ms[-1] == 2048 and {1, 191, 192, 200, 1024, 1025, 1089} <= set(ms)
    assert calls[0] == 2048 and sorted(calls[1:]) == ms

    def batch_dependent(x, wq, ws, bias, allow_cublaslt=True):
        return (x[:, :128] * x.shape[0]).bfloat16()

    monkeypatch.setattr(fp8_gemm, "fp8_linear_cuda", batch_dependent)
    with pytest.raises(selfcheck.SelfCheckError, match="FP8 GEMM self-check failed for a"):
        selfcheck.fp8_gemm_self_check([("a", lin)], torch.device("cpu"), torch.bfloat16, max_tokens=2048)
    # the model-dtype GEMM check leaves the FP8 layer out
    assert selfcheck.model_gemm_shapes(torch.nn.ModuleDict({"a": lin, "b": plain})) == [("b", 256, 128, False)]


def test_fp8_policy_requantizes_after_writes_its_version_counters_miss(tiny_qwen3_128, tiny_qwen3_128_other):
    """An FP8 Policy without an engine multiplies its quantized copy: a checkpoint written in by
    load_weights (through views with their own version counters) and a fused optimizer's step
    (which bumps none) must both reach it, or the trainer computes with the old weights."""
    from vllm.model_loader.loader import load_weights
    seqs, plens = [[5, 6, 7, 8, 9, 10, 11]], [3]
    p = Policy.from_pretrained(tiny_qwen3_128, device="cpu", quantization="fp8")
    other = Policy.from_pretrained(tiny_qwen3_128_other, device="cpu", quantization="fp8")
    with torch.no_grad():
        want = other.token_logprobs(seqs, plens)[0]
        p.token_logprobs(seqs, plens)     # the forward has seen the current version
    load_weights(p.model, other.model.hf_state_dict().items())
    with torch.no_grad():
        assert torch.equal(p.token_logprobs(seqs, plens)[0].view(torch.int32), want.view(torch.int32))

    def fresh(policy):
        for layer in (m for m in policy.model.modules() if getattr(m, "fp8", False)):
            layer.requantize()
        with torch.no_grad():
            return policy.token_logprobs(seqs, plens)[0]
    opt = torch.optim.AdamW(p.parameters(), lr=1e-2, fused=True)
    p.attach_optimizer(opt)
    (-p.token_logprobs(seqs, plens)[0].sum()).backward()
    opt.step()
    with torch.no_grad():
        stepped = p.token_logprobs(seqs, plens)[0]
    assert not torch.equal(stepped, want)
    assert torch.equal(stepped.view(torch.int32), fresh(p).view(torch.int32))


def test_policy_from_an_fp8_checkpoint_saves_what_it_holds(tiny_qwen3, tmp_path):
    """save_pretrained writes the master weights (the FP8 checkpoint dequantized) without the
    source's quantization_config, which would tell loaders the tensors are FP8-serialized;
    quantization="fp8" quantizes them again, to the source's own fp8 bits."""
    from safetensors.torch import load_file
    src, out = str(tmp_path / "fp8"), str(tmp_path / "saved")
    _write_fp8_checkpoint(tiny_qwen3, src)
    p = Policy.from_pretrained(src, device="cpu", dtype="float32")
    p.save_pretrained(out)
    assert "quantization_config" not in json.load(open(os.path.join(out, "config.json")))
    sd = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(out, f)))
    assert not any(n.endswith("_scale_inv") for n in sd) and all(t.dtype == torch.float32 for t in sd.values())
    q = Policy.from_pretrained(out, device="cpu", dtype="float32", quantization="fp8")
    seqs, plens = [[5, 6, 7, 8, 9, 10]], [2]
    with torch.no_grad():
        assert torch.equal(p.token_logprobs(seqs, plens)[0].view(torch.int32),
                           q.token_logprobs(seqs, plens)[0].view(torch.int32))
