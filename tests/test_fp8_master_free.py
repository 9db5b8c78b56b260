"""FP8 engines without master weights (keep_master_weights=False): the same bits as with
them, weight sync quantizing on arrival equal to a fresh engine loaded from the same
weights, failed updates restoring the fp8 bytes, and clear refusals."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.layers.linear import fp8_linears


def _make(path, **kw):
    opts = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=512, quantization="fp8")
    opts.update(kw)
    return LLM(path, **opts)


def _model(llm):
    return llm.llm_engine.executor.model


def _fp8_bytes(llm) -> list[torch.Tensor]:
    return [t for m in fp8_linears(_model(llm))
            for t in (m.weight_fp8.view(torch.uint8).clone(), m.weight_scale_inv.view(torch.int32).clone())]


def _rollout(llm, seed=3):
    g = torch.Generator().manual_seed(seed)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=g).tolist()} for n in (3, 40, 130)]
    sp = SamplingParams(temperature=0.8, max_tokens=6, seed=1, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [(tuple(o.outputs[0].token_ids), tuple(torch.tensor([next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
                                                   .view(torch.int32).tolist())) for o in outs]


@pytest.fixture(scope="module")
def pair(tiny_qwen3_128):
    return _make(tiny_qwen3_128), _make(tiny_qwen3_128, keep_master_weights=False)


def test_no_master_same_bits_less_memory(pair):
    with_master, without = pair
    layers = fp8_linears(_model(without))
    assert layers and all(m.weight.is_meta and not m.has_master for m in layers)
    assert not any(m.weight.is_meta for m in fp8_linears(_model(with_master)))
    assert all(torch.equal(a, b) for a, b in zip(_fp8_bytes(with_master), _fp8_bytes(without)))
    assert _rollout(with_master) == _rollout(without)
    real = lambda llm: sum(p.numel() * p.element_size() for p in _model(llm).parameters() if not p.is_meta)
    dropped = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    assert real(without) == real(with_master) - dropped and dropped > 0
    assert without.execution_contract().deployment["keep_master_weights"] is False
    with_master.execution_contract().check_compatible(without.execution_contract())


@pytest.mark.parametrize("buckets", [1, 3])
def test_no_master_weight_sync_equals_engine_with_masters(tiny_qwen3_128, tiny_qwen3_128_other, buckets):
    """Each arriving tensor is quantized into the rows it covers: the fp8 bytes and the
    rollout equal those of an engine with masters given the same update (fused q/k/v and
    gate/up shards arriving one at a time, in buckets)."""
    weights = [(n, t.to(torch.bfloat16)) for n, t in
               _model(_make(tiny_qwen3_128_other, quantization=None)).hf_state_dict().items()]
    engines = [_make(tiny_qwen3_128, keep_master_weights=False), _make(tiny_qwen3_128)]
    for llm in engines:
        with llm.weight_update() as u:
            for i in range(buckets):
                u.load(dict(weights[i::buckets]))
    without, with_master = engines
    assert all(torch.equal(a, b) for a, b in zip(_fp8_bytes(without), _fp8_bytes(with_master)))
    assert _rollout(without) == _rollout(with_master)
    # the update really changed the weights: an engine loaded from the fp32 checkpoint
    # itself differs (the bf16 rounding of the sent tensors reaches the fp8 scales)
    assert not all(torch.equal(a, b) for a, b in zip(_fp8_bytes(without), _fp8_bytes(_make(tiny_qwen3_128_other))))
    assert not all(torch.equal(a, b) for a, b in zip(_fp8_bytes(without), _fp8_bytes(_make(tiny_qwen3_128))))


@pytest.mark.parametrize("backup", ["device", "host"])
def test_no_master_failed_update_restores_fp8_bytes(tiny_qwen3_128, tiny_qwen3_128_other, backup):
    llm = _make(tiny_qwen3_128, keep_master_weights=False)
    before, roll = _fp8_bytes(llm), _rollout(llm)
    weights = list(_model(_make(tiny_qwen3_128_other, quantization=None)).hf_state_dict().items())
    half = len(weights) // 2
    bad = dict(weights[half:])
    name = next(n for n in bad if "mlp" in n)
    bad[name] = bad[name].clone().fill_(float("nan"))
    with pytest.raises(ValueError, match="non-finite"):
        with llm.weight_update(backup=backup) as u:
            u.load(dict(weights[:half]), retain=False)   # written at once, its fp8 rows backed up
            assert not all(torch.equal(a, b) for a, b in zip(before, _fp8_bytes(llm)))
            u.load(bad, retain=False)
    assert all(torch.equal(a, b) for a, b in zip(before, _fp8_bytes(llm)))
    assert _rollout(llm) == roll


def test_no_master_refusals(tiny_qwen3, tiny_qwen3_128):
    with pytest.raises(ValueError, match="needs quantization='fp8'"):
        _make(tiny_qwen3_128, quantization=None, keep_master_weights=False)
    # tiny_qwen3: q = 4 x 32 rows, k = 2 x 32: v starts at row 192, inside a 128-row block
    with pytest.raises(ValueError, match="shard 'v' starts at row 192"):
        _make(tiny_qwen3, keep_master_weights=False)
    llm = _make(tiny_qwen3_128, keep_master_weights=False)
    with pytest.raises(ValueError, match="keep_master_weights"):
        llm.policy()
    with pytest.raises(ValueError, match="no master weight"):
        _model(llm).hf_state_dict()
