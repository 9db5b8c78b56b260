"""The model's one HF-name -> parameter mapping: loading, weight sync and hf_state_dict
all go through it, so a checkpoint round-trips bit for bit and load and sync write the
same bytes to the same places."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vllm import LLM
from vllm.config import NumericsSpec
from vllm.model_loader.build import build_model, resolve_model
from vllm.model_loader.loader import load_weights
from vllm.weight_sync import plan_update


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def _file_tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(path, fn), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _model(path: str, dtype="float32"):
    mc, dt = resolve_model(path, dtype=dtype, device="cpu")
    return build_model(mc, NumericsSpec(dt, "fast"), "cpu")[0]


def _empty_like(model):
    """A second instance of the same class and config, every parameter zeroed."""
    fresh = type(model)(model.config, dtype=next(model.parameters()).dtype)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    return fresh


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen2", "tiny_llama", "tiny_qwen3_moe"])
def test_checkpoint_round_trips_through_the_mapping(request, fixture):
    """load -> hf_state_dict gives the checkpoint's tensors back, bit for bit and under the
    same names (fused q/k/v and gate/up split back, stacked MoE experts split into one
    tensor per expert and projection, a tied lm_head left out); loading that dict into a
    fresh model reproduces every parameter."""
    path = request.getfixturevalue(fixture)
    model = _model(path)
    sd = model.hf_state_dict()
    on_disk = _file_tensors(path)
    assert sorted(sd) == sorted(on_disk)
    for name, t in on_disk.items():
        assert torch.equal(_bytes(sd[name]), _bytes(t)), name
    fresh = _empty_like(model)
    load_weights(fresh, sd.items())
    for (n, a), (m, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert n == m and torch.equal(_bytes(a), _bytes(b)), n


def test_load_and_sync_write_the_same_bytes_to_the_same_places(tiny_qwen3):
    model = _model(tiny_qwen3)
    g = torch.Generator().manual_seed(3)
    new = {k: torch.randn(v.shape, generator=g) for k, v in model.hf_state_dict().items()}
    loaded = _empty_like(model)
    load_weights(loaded, new.items())
    synced = _empty_like(model)
    ptrs = {n: p.data_ptr() for n, p in synced.named_parameters()}
    plan = plan_update(synced, list(new.items()), require_complete=True)
    with torch.no_grad():
        for dest, src in plan:
            dest.copy_(src)
    assert {n: p.data_ptr() for n, p in synced.named_parameters()} == ptrs
    for (n, a), (_, b) in zip(loaded.named_parameters(), synced.named_parameters()):
        assert torch.equal(_bytes(a), _bytes(b)), n
    # every HF name lands where the mapping says: the q rows of the fused qkv weight
    q = new["model.layers.1.self_attn.q_proj.weight"]
    fused = loaded.model.layers[1].self_attn.qkv_proj
    assert torch.equal(_bytes(fused.weight[: q.shape[0]]), _bytes(q))
    assert torch.equal(_bytes(fused.shard(fused.weight, "q")), _bytes(q))


def test_load_and_sync_refuse_the_same_names(tiny_qwen3):
    model = _model(tiny_qwen3)
    sd = model.hf_state_dict()
    bad = {**sd, "model.layers.0.mlp.gate_proj.wieght": sd["model.layers.0.mlp.gate_proj.weight"]}
    errors = []
    for apply in (lambda m: load_weights(m, bad.items()), lambda m: plan_update(m, list(bad.items()))):
        with pytest.raises(ValueError, match="unknown weight 'model.layers.0.mlp.gate_proj.wieght'") as err:
            apply(_empty_like(model))
        errors.append(str(err.value))
    assert errors[0] == errors[1]


def test_skipped_names_match_whole_components(tiny_qwen3):
    """The tensors a model does not take are matched by whole dotted components: a name that
    only contains a skipped fragment's text is an unknown weight, not silently skipped."""
    model = _model(tiny_qwen3)
    mapping = model.weight_mapping()
    assert mapping.is_derived("model.layers.0.self_attn.rotary_emb.inv_freq")
    assert not mapping.is_derived("model.layers.0.self_attn.rotary_emb.inv_freq_garbage")
    assert not mapping.is_derived("model.layers.0.self_attn.xrotary_emb.inv_freq")
    sd = model.hf_state_dict()
    bad = {**sd, "model.layers.0.self_attn.rotary_emb.inv_freq_garbage": torch.zeros(4)}
    with pytest.raises(ValueError, match="unknown weight"):
        plan_update(_empty_like(model), list(bad.items()))
    from vllm.models.weights import WeightMapping
    mtp = WeightMapping(model, {}, derived=("mtp.",))
    assert mtp.is_derived("mtp.layers.0.mlp.weight") and mtp.is_derived("model.mtp.fc.weight")
    assert not mtp.is_derived("model.layers.0.xmtp.weight")


def test_load_reports_missing_weights_and_tied_conflicts(tiny_qwen3, tiny_llama):
    model = _model(tiny_qwen3)
    sd = model.hf_state_dict()
    del sd["model.layers.1.self_attn.v_proj.bias" if "model.layers.1.self_attn.v_proj.bias" in sd
           else "model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks weights for: \['model.layers.1.self_attn.qkv_proj.weight\[v\]'\]"):
        load_weights(_empty_like(model), sd.items())
    # tied embeddings: a checkpoint's lm_head.weight is the embedding, and must agree with it
    tied = _model(tiny_llama)
    emb = tied.hf_state_dict()["model.embed_tokens.weight"]
    only_head = {k: v for k, v in tied.hf_state_dict().items() if k != "model.embed_tokens.weight"}
    only_head["lm_head.weight"] = emb * 2
    fresh = _empty_like(tied)
    load_weights(fresh, only_head.items())
    assert torch.equal(fresh.model.embed_tokens.weight, emb * 2) and fresh.lm_head.weight is fresh.model.embed_tokens.weight
    both = {**tied.hf_state_dict(), "lm_head.weight": emb * 2}
    with pytest.raises(ValueError, match="differs"):
        load_weights(_empty_like(tied), both.items())


def test_checkpoint_with_unknown_tensor_is_refused_by_the_engine(tiny_qwen3, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(tiny_qwen3, bad)
    save_file({"model.layers.0.mlp.extra.weight": torch.zeros(2, 2)}, str(bad / "zz-extra.safetensors"))
    with pytest.raises(ValueError, match="unknown weight 'model.layers.0.mlp.extra.weight'"):
        LLM(str(bad), device="cpu")


def test_bf16_checkpoint_converts_on_load_and_sync_casts_by_the_same_rule(tiny_qwen3):
    """Loading converts the checkpoint's dtype to the model's (as transformers does); a weight
    sync casts another float dtype by that same rule (an update from a checkpoint's tensors
    equals a fresh load), and refuses non-float tensors."""
    model = _model(tiny_qwen3, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    f32 = _model(tiny_qwen3).hf_state_dict()
    for name, t in model.hf_state_dict().items():
        assert torch.equal(_bytes(t), _bytes(f32[name].to(torch.bfloat16))), name
    name = "model.norm.weight"
    (dest, src), = plan_update(model, [(name, f32[name])])
    assert src.dtype == torch.bfloat16 and torch.equal(_bytes(src), _bytes(f32[name].to(torch.bfloat16)))
    with pytest.raises(ValueError, match="dtype"):
        plan_update(model, [(name, f32[name].to(torch.int32))])


def test_update_weights_names_a_list_of_tensors(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu")
    tensors = list(llm.llm_engine.executor.model.hf_state_dict().values())
    with pytest.raises(ValueError, match=r"\(HF name, tensor\) pairs"):
        llm.update_weights(tensors)
    assert llm.weight_version == 0
