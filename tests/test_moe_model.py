"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM (random weights, CPU): logits within
float32 tolerance and equal greedy tokens in both numerics modes; its config parsing
(num_experts, top-k, norm_topk_prob, decoder_sparse_step, mlp_only_layers), its HF-name
mapping (per-expert checkpoint tensors onto the fused layout, and back), bad input."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm import LLM, SamplingParams
from vllm.forward_context import ForwardContext, set_forward_context
from vllm.layers.moe import SparseMoeBlock
from vllm.config import NumericsSpec
from vllm.model_loader.build import build_model, resolve_model
from vllm.models.qwen3_moe import Qwen3MoeConfig
from vllm.testing.tiny_models import load_hf_model, make_tiny_checkpoint
from vllm.training.attention import PackedAttentionBackend

BENCH_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "configs",
                            "qwen3-30b-a3b.json")


def _model(path):
    mc, dtype = resolve_model(path, dtype="float32", device="cpu")
    return build_model(mc, NumericsSpec(dtype, "fast"), "cpu")[0]


@pytest.fixture(scope="module")
def sparse_step_moe(tmp_path_factory):
    """decoder_sparse_step=2 (layers 1 and 3 sparse, 0 and 2 dense), no norm_topk_prob, top-3 of 6."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe_step2"), "qwen3_moe", num_hidden_layers=4, seed=11,
                                config_overrides={"decoder_sparse_step": 2, "norm_topk_prob": False,
                                                  "num_experts": 6, "num_experts_per_tok": 3})


def _our_logits(path, numerics, ids):
    model = _model(path)
    backend = PackedAttentionBackend([len(ids)], torch.device("cpu"))
    with torch.no_grad(), set_forward_context(ForwardContext(backend, numerics)):
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)))), model


@pytest.mark.parametrize("numerics", ["invariant", "fast"])
@pytest.mark.parametrize("fixture", ["tiny_qwen3_moe", "sparse_step_moe"])
def test_logits_match_transformers(request, fixture, numerics):
    path = request.getfixturevalue(fixture)
    ids = torch.randint(3, 500, (33,), generator=torch.Generator().manual_seed(0)).tolist()
    ours, model = _our_logits(path, numerics, ids)
    hf = load_hf_model(path, torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4
    # the layer plan is transformers' plan
    for i, (a, b) in enumerate(zip(model.model.layers, hf.model.layers)):
        assert isinstance(a.mlp, SparseMoeBlock) == hasattr(b.mlp, "experts"), i


@pytest.mark.parametrize("fixture", ["tiny_qwen3_moe", "sparse_step_moe"])
def test_greedy_tokens_match_transformers(request, fixture):
    path = request.getfixturevalue(fixture)
    hf = load_hf_model(path, torch.float32)
    prompts = [list(range(10, 30)), [7, 300, 12, 5]]
    for numerics in ("invariant", "fast"):
        llm = LLM(path, device="cpu", numerics=numerics)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == _hf_greedy(hf, p, 10), (numerics, p)


def _hf_greedy(hf, prompt, n):
    """argmax decoding with transformers' forward (generate would stop at, or with
    min_new_tokens suppress, the eos token; the engine runs with ignore_eos)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_config_parsing():
    """The model parses its own config.json: Qwen3's fields and the MoE ones, from the
    dict alone (nothing read again from disk)."""
    with open(BENCH_CONFIG) as f:
        full = json.load(f)
    base = {**full, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    cfg = Qwen3MoeConfig.from_hf({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": True})
    assert [cfg.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    assert cfg.norm_topk_prob and cfg.qk_norm and not cfg.qkv_bias
    assert (cfg.architecture, cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size) == ("Qwen3MoeForCausalLM", 2048, 128, 16)
    # transformers 5 writes num_local_experts
    no_experts = {k: v for k, v in base.items() if k != "num_experts"}
    assert Qwen3MoeConfig.from_hf({**no_experts, "num_local_experts": 4}).num_experts == 4
    assert Qwen3MoeConfig.from_hf({**base, "decoder_sparse_step": None}).decoder_sparse_step == 1
    no_hidden = {k: v for k, v in base.items() if k != "hidden_size"}
    bad = [(no_experts, "num_experts"),
           ({**base, "num_experts_per_tok": 9}, "num_experts_per_tok"),
           ({**base, "num_experts_per_tok": 0}, "num_experts_per_tok"),
           ({**base, "decoder_sparse_step": -1}, "decoder_sparse_step"),
           ({**base, "decoder_sparse_step": 0}, "decoder_sparse_step"),
           ({**base, "use_sliding_window": True}, "sliding_window"),
           ({**base, "attention_bias": True}, "attention_bias"),
           ({**base, "hidden_act": "gelu"}, "hidden_act"),
           (no_hidden, "config.json of a Qwen3MoeForCausalLM lacks 'hidden_size'"),
           ({**base, "architectures": ["Qwen3ForCausalLM"]}, "is not Qwen3MoeForCausalLM")]
    for hf, msg in bad:
        with pytest.raises(ValueError, match=msg):
            Qwen3MoeConfig.from_hf(hf)


def test_bad_config_is_refused_by_the_engine(tiny_qwen3_moe, tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(tiny_qwen3_moe, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_experts_per_tok"] = 99
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        LLM(str(d), device="cpu")


def test_hf_names_round_trip(tiny_qwen3_moe):
    """hf_state_dict gives back the checkpoint's own names (one tensor per expert and
    projection) and bits; loading checked every expected shard."""
    model = _model(tiny_qwen3_moe)
    ckpt = load_file(os.path.join(tiny_qwen3_moe, "model.safetensors"))
    ours = model.hf_state_dict()
    assert set(ours) == set(ckpt)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in ours and "model.layers.1.mlp.gate_proj.weight" in ours
    for name, t in ckpt.items():
        assert torch.equal(ours[name].contiguous().view(torch.int32), t.view(torch.int32)), name
    mapping = model.weight_mapping()
    slot = mapping.slot("model.layers.0.mlp.experts.3.up_proj.weight")
    assert (slot.param, slot.shard) == ("model.layers.0.mlp.experts.gate_up_proj", (3, "up"))
    experts = model.model.layers[0].mlp.experts
    assert torch.equal(bits(mapping.destination(slot)), bits(experts.gate_up_proj[3, 32:]))  # I = 32: the up rows
    slot = mapping.slot("model.layers.1.mlp.up_proj.weight")
    assert (slot.param, slot.shard) == ("model.layers.1.mlp.gate_up_proj.weight", 1)
    assert len([k for k in mapping.keys() if ".experts." in k[0]]) == 2 * 8 * 3


def bits(t):
    return t.detach().contiguous().view(torch.int32)


def _rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return str(dst)


def test_loader_refuses_incomplete_or_misshapen_experts(tiny_qwen3_moe, tmp_path):
    missing = _rewrite(tiny_qwen3_moe, tmp_path / "missing",
                       lambda t: t.pop("model.layers.2.mlp.experts.5.gate_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks weights for.*layers\.2\.mlp\.experts\.gate_up_proj\[\(5, 'gate'\)\]"):
        LLM(missing, device="cpu")

    def shrink(t):
        t["model.layers.0.mlp.experts.1.down_proj.weight"] = t["model.layers.0.mlp.experts.1.down_proj.weight"][:, :-1].clone()
    with pytest.raises(ValueError, match=r"experts.1.down_proj.weight': shape \(64, 31\) != expected \(64, 32\)"):
        LLM(_rewrite(tiny_qwen3_moe, tmp_path / "shape", shrink), device="cpu")

    def extra(t):
        t["model.layers.1.mlp.experts.0.gate_proj.weight"] = t["model.layers.0.mlp.experts.0.gate_proj.weight"].clone()
    with pytest.raises(ValueError, match="unknown weight 'model.layers.1.mlp.experts.0.gate_proj.weight'"):
        LLM(_rewrite(tiny_qwen3_moe, tmp_path / "dense_layer_expert", extra), device="cpu")

    def too_many(t):
        t["model.layers.0.mlp.experts.8.gate_proj.weight"] = t["model.layers.0.mlp.experts.0.gate_proj.weight"].clone()
    with pytest.raises(ValueError, match="unknown weight 'model.layers.0.mlp.experts.8.gate_proj.weight'"):
        LLM(_rewrite(tiny_qwen3_moe, tmp_path / "too_many", too_many), device="cpu")


def test_transformers_fused_names_load_too(tiny_qwen3_moe, tmp_path):
    """transformers' in-memory fused expert tensors (mlp.experts.gate_up_proj [E, 2I, H]) load whole."""
    hf = load_hf_model(tiny_qwen3_moe, torch.float32)
    d = tmp_path / "fused"
    shutil.copytree(tiny_qwen3_moe, d)
    os.remove(d / "model.safetensors")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(d / "model.safetensors"))
    a = _model(str(d))
    b = _model(tiny_qwen3_moe)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa.view(torch.int32), pb.view(torch.int32)), na


def test_execution_contract_names_moe(tiny_qwen3_moe, tiny_qwen3):
    inv = LLM(tiny_qwen3_moe, device="cpu", numerics="invariant").execution_contract()
    fast = LLM(tiny_qwen3_moe, device="cpu", numerics="fast").execution_contract()
    # semantic: the model's own config dataclass, MoE fields included
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
           "decoder_sparse_step": 1, "mlp_only_layers": [1]}
    assert {k: inv.semantic[k] for k in moe} == moe
    assert inv.semantic["architecture"] == "Qwen3MoeForCausalLM" and "router_aux_loss_coef" not in inv.semantic
    assert inv.semantic == fast.semantic
    # numerical: the MoE block names its kernels (the generic layer hook of vllm.contract)
    assert "lower expert id" in inv.numerical["layer_kernels"]["moe"]["routing"]
    assert "slot order" in inv.numerical["layer_kernels"]["moe"]["merge"]
    assert inv.numerical["layer_kernels"] != fast.numerical["layer_kernels"]
    with pytest.raises(ValueError, match="numerical"):
        inv.check_compatible(fast)
    # a dense model's contract has no such entry
    assert "layer_kernels" not in LLM(tiny_qwen3, device="cpu").execution_contract().numerical


def test_benchmark_config_builds_and_loads_dummy_weights(tmp_path):
    """benchmarks/configs/qwen3-30b-a3b.json: Qwen3-30B-A3B's 30.5B parameters (built on the
    meta device), and the dummy-weight path throughput.py takes, on the same config shrunk."""
    from vllm.model_loader.build import parse_model_config
    from vllm.models.registry import model_class
    from vllm.testing.tiny_models import build_tokenizer
    src = BENCH_CONFIG
    (tmp_path / "full").mkdir()
    shutil.copy(src, tmp_path / "full" / "config.json")
    mc, _ = resolve_model(str(tmp_path / "full"), dtype="bfloat16", device="cpu")
    with torch.device("meta"):
        model = model_class(mc.architecture)(parse_model_config(mc), torch.bfloat16)
    assert 30.4e9 < sum(p.numel() for p in model.parameters()) < 30.6e9
    assert sum(isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers) == 48
    assert tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape) == (128, 1536, 2048)

    cfg = json.loads(open(src).read())
    cfg.update(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_experts=16, vocab_size=512, max_position_embeddings=256)
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "config.json").write_text(json.dumps(cfg))
    build_tokenizer(tmp_path / "small")
    for numerics in ("fast", "invariant"):
        llm = LLM(str(tmp_path / "small"), device="cpu", load_format="dummy", numerics=numerics)
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
