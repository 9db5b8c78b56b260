"""Config variants of the Llama family a real checkpoint carries, against transformers' own
classes (tiny random checkpoints written by `save_pretrained`, float32 on CPU): biases on
every projection (attention_bias, mlp_bias), linear rope scaling's longer context, a null
num_key_value_heads, and sliding-window attention refused rather than run as full attention."""
from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vllm.models.llama_family import LlamaFamilyConfig  # noqa: E402
from vllm.testing.tiny_models import build_tokenizer  # noqa: E402
from vllm.testing.transformers_parity import our_logits  # noqa: E402

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def _checkpoint(path, config_class: str, model_class: str, **fields) -> str:
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**BASE, **fields}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(str(path))
    return str(path)


def _max_logit_diff(path, num_tokens: int) -> float:
    ids = torch.randint(3, 500, (num_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        ref = hf.eval()(torch.tensor([ids])).logits[0]
    return (our_logits(path, "fast", ids) - ref).abs().max().item()


@pytest.mark.parametrize("config_class,model_class,fields", [
    ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    ("Qwen3Config", "Qwen3ForCausalLM", dict(attention_bias=True, head_dim=16)),
], ids=["llama-attention-and-mlp-bias", "qwen3-attention-bias"])
def test_biases_on_every_projection(tmp_path, config_class, model_class, fields):
    """attention_bias puts a bias on q, k, v and o (transformers' Llama and Qwen3), mlp_bias on
    gate, up and down: every one loads and takes part."""
    path = _checkpoint(tmp_path / "m", config_class, model_class, **fields)
    assert _max_logit_diff(path, 24) < 1e-4


def test_linear_rope_scaling_serves_its_longer_context(tmp_path):
    """Linear scaling by 4 stretches 64 trained positions to 256 (upstream's max length): the
    engine takes max_model_len 256 and position 200's logits are transformers'."""
    from vllm import LLM
    path = _checkpoint(tmp_path / "m", "LlamaConfig", "LlamaForCausalLM",
                       rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    assert _max_logit_diff(path, 200) < 1e-4
    assert LLM(path, device="cpu", max_model_len=256).llm_engine.config.model.max_model_len == 256
    with pytest.raises(ValueError, match="256 positions"):
        LLM(path, device="cpu", max_model_len=257)


def test_null_kv_heads_is_multi_head(tmp_path):
    path = _checkpoint(tmp_path / "m", "LlamaConfig", "LlamaForCausalLM", num_key_value_heads=4)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["num_key_value_heads"] = None
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    assert LlamaFamilyConfig.from_hf(cfg).num_key_value_heads == 4
    assert _max_logit_diff(path, 16) < 1e-4


@pytest.mark.parametrize("arch,fields", [
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)),
    ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    ("Qwen3ForCausalLM", dict(layer_types=["full_attention", "sliding_attention"])),
])
def test_sliding_window_attention_is_refused(arch, fields):
    """Not implemented: refused by name instead of run as full attention (other logits)."""
    hf = {**BASE, "architectures": [arch], **fields}
    with pytest.raises(ValueError, match="sliding-window"):
        LlamaFamilyConfig.from_hf(hf)
    # every layer below max_window_layers attends fully: nothing to refuse
    LlamaFamilyConfig.from_hf({**BASE, "architectures": [arch], "use_sliding_window": True, "max_window_layers": 2})
