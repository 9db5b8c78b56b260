"""Nemotron-H (Mamba-2 hybrids) against transformers, random weights, CPU.

Config parsing (layers_block_type and its legacy names, hybrid_override_pattern, the original
checkpoints' key spellings, refusals: MoE layers and what else is not implemented), the layer
plan and cache indices (attention and Mamba-2 layers numbered per kind, the state each mode
keeps), the HF-name mapping (bit-exact round trip of the `backbone.*` checkpoint, transformers'
`model.*` names as aliases, the unloaded mtp layers), then on the tiny hybrid: logits and
greedy tokens against transformers in both numerics modes, rollout logprobs equal to the
trainer's bit for bit, gradients against transformers in float64, the invariance battery and
the execution contract. The Mamba-2 kernels themselves are tests/test_mamba2_chunk.py's."""
from __future__ import annotations

import math
import shutil

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.models.nemotron_h import NemotronHConfig
from vllm.testing.parity_battery import BATTERY_CHECKS, cpu_battery, run_zero_check
from vllm.testing.rollouts import trainer_mismatches
from vllm.testing.tiny_models import compare_grads, load_hf_model
from vllm.testing.transformers_parity import (assert_checkpoint_round_trip, assert_config_refusals,
                                              assert_engine_refuses, assert_greedy_match, assert_loads_as_checkpoint,
                                              assert_logits_match, build_on_meta, cpu_model, logprob_gradients)

# Nemotron-H-8B-Base's config.json (the original spelling: hybrid_override_pattern,
# attention_head_dim; 24 Mamba-2, 4 attention and 24 MLP layers)
PATTERN_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
HUB_CONFIG = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "attention_bias": False,
    "attention_dropout": 0.0, "attention_head_dim": 128, "bos_token_id": 1, "chunk_size": 128, "conv_kernel": 4,
    "eos_token_id": 2, "expand": 2, "hidden_dropout": 0.0, "hidden_size": 4096, "hybrid_override_pattern": PATTERN_8B,
    "initializer_range": 0.02, "intermediate_size": 21504, "layer_norm_epsilon": 1e-05, "mamba_head_dim": 64,
    "mamba_hidden_act": "silu", "mamba_num_heads": 128, "mamba_proj_bias": False, "max_position_embeddings": 8192,
    "mlp_bias": False, "mlp_hidden_act": "relu2", "n_groups": 8, "num_attention_heads": 32,
    "num_hidden_layers": 52, "num_key_value_heads": 8, "num_logits_to_keep": 1, "pad_token_id": 0,
    "rescale_prenorm_residual": True, "residual_in_fp32": False, "rms_norm_eps": 1e-05, "sliding_window": None,
    "ssm_state_size": 128, "tie_word_embeddings": False, "time_step_floor": 0.0001, "time_step_limit": [0.0, math.inf],
    "time_step_max": 0.1, "time_step_min": 0.001, "time_step_rank": 256, "torch_dtype": "bfloat16", "use_bias": False,
    "use_cache": True, "use_conv_bias": True, "use_mamba_kernels": True, "vocab_size": 131072,
}


# ---- config ------------------------------------------------------------------------------
def test_layer_types_parsed_as_transformers_does():
    from transformers import NemotronHConfig as HFConfig
    ours = NemotronHConfig.from_hf(HUB_CONFIG)
    theirs = HFConfig(hybrid_override_pattern=PATTERN_8B)
    assert ours.layer_types == theirs.layers_block_type and ours.num_hidden_layers == 52
    assert [ours.layer_types.count(k) for k in ("linear_attention", "full_attention", "mlp")] == [24, 4, 24]
    assert [ours.kind_index(i) for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 0]
    # transformers 5's key (its legacy names remapped as transformers does)
    listed = {k: v for k, v in HUB_CONFIG.items() if k != "hybrid_override_pattern"}
    listed["layers_block_type"] = ["mamba", "mlp", "attention", "linear_attention", "full_attention"]
    got = NemotronHConfig.from_hf(listed)
    assert got.layer_types == HFConfig(layers_block_type=listed["layers_block_type"]).layers_block_type
    assert got.num_hidden_layers == 5  # the list decides, as in transformers


def test_config_fields_and_legacy_spellings():
    cfg = NemotronHConfig.from_hf(HUB_CONFIG)
    assert (cfg.head_dim, cfg.mamba_num_heads, cfg.mamba_head_dim) == (128, 128, 64)
    assert (cfg.n_groups, cfg.ssm_state_size) == (8, 128)
    assert (cfg.chunk_size, cfg.conv_kernel, cfg.use_conv_bias, cfg.time_step_limit_low) == (128, 4, True, 0.0)
    assert (cfg.layer_norm_epsilon, cfg.intermediate_size, cfg.use_bias, cfg.mlp_bias) == (1e-5, 21504, False, False)
    renamed = ("n_groups", "conv_kernel", "chunk_size")
    legacy = {k: v for k, v in HUB_CONFIG.items() if k not in renamed}
    legacy.update(mamba_n_groups=4, mamba_d_conv=3, mamba_chunk_size=64)
    got = NemotronHConfig.from_hf(legacy)
    assert (got.n_groups, got.conv_kernel, got.chunk_size) == (4, 3, 64)
    assert NemotronHConfig.from_hf({**HUB_CONFIG, "time_step_limit": [0.01, math.inf]}).time_step_limit_low == 0.01
    with pytest.raises(ValueError, match="upper limit"):
        NemotronHConfig.from_hf({**HUB_CONFIG, "time_step_limit": [0.0, 0.1]})
    no_mlp = NemotronHConfig.from_hf({**HUB_CONFIG, "hybrid_override_pattern": "M*M"})
    assert no_mlp.intermediate_size == 0


def test_config_refusals():
    no_vocab = {k: v for k, v in HUB_CONFIG.items() if k != "vocab_size"}
    no_plan = {k: v for k, v in HUB_CONFIG.items() if k != "hybrid_override_pattern"}
    bad = [({**HUB_CONFIG, "hybrid_override_pattern": "M-E*"}, "MoE layers"),
           ({**no_plan, "layers_block_type": ["mamba", "moe"]}, "MoE layers"),
           ({**no_plan, "layers_block_type": ["mamba", "sliding_attention"]}, "sliding_attention"),
           ({**HUB_CONFIG, "hybrid_override_pattern": "M-X"}, "letters"),
           (no_plan, "neither layers_block_type nor hybrid_override_pattern"),
           ({**HUB_CONFIG, "mlp_hidden_act": "silu"}, "mlp_hidden_act"),
           ({**HUB_CONFIG, "mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
           ({**HUB_CONFIG, "n_groups": 3}, "n_groups=3"),
           ({**HUB_CONFIG, "chunk_size": 100}, "chunk_size=100"),
           ({**HUB_CONFIG, "ssm_state_size": 24}, "multiples of 16"),
           ({**HUB_CONFIG, "conv_kernel": 5}, "conv_kernel=5"),
           ({**HUB_CONFIG, "num_key_value_heads": 5}, "num_key_value_heads=5"),
           ({**HUB_CONFIG, "architectures": ["Qwen3ForCausalLM"]}, "is not NemotronHForCausalLM"),
           (no_vocab, "lacks 'vocab_size'")]
    assert_config_refusals(NemotronHConfig.from_hf, bad)


def test_moe_checkpoint_is_refused_by_the_engine(tiny_nemotron_h, tmp_path):
    moe = ["linear_attention", "full_attention", "moe", "linear_attention", "mlp"]
    assert_engine_refuses(tiny_nemotron_h, tmp_path, {"layers_block_type": moe}, "MoE layers")


def test_full_size_config_builds_like_transformers():
    """Nemotron-H-8B on the meta device: transformers' parameter count, every layer the mixer
    transformers gives it."""
    from transformers import NemotronHConfig as HFConfig
    from transformers import NemotronHForCausalLM as HFModel
    from vllm.models.nemotron_h import NemotronHForCausalLM
    ours, theirs = build_on_meta(NemotronHForCausalLM, NemotronHConfig.from_hf(HUB_CONFIG), HFModel, HFConfig,
                                 HUB_CONFIG)
    assert 8.0e9 < sum(p.numel() for p in ours.parameters()) < 8.3e9
    same = {"Mamba2Mixer": "NemotronHMamba2Mixer", "NemotronHAttention": "NemotronHAttention",
            "NemotronHMLP": "NemotronHMLP"}
    assert [same[type(a.mixer).__name__] for a in ours.model.layers] == [type(b.mixer).__name__
                                                                          for b in theirs.model.layers]


# ---- layer plan, cache indices, names ------------------------------------------------------
def test_layer_plan_and_cache_specs(tiny_nemotron_h):
    """Each kind numbers its caches 0, 1, ...; the Mamba-2 layers keep the conv window and the
    fp32 state, and in the invariant mode the rows of the partial chunk (x, B, dt)."""
    from vllm.worker.kv_cache import cache_specs
    model = cpu_model(tiny_nemotron_h)
    layers = model.model.layers
    assert [layer.block_type for layer in layers] == ["linear_attention", "full_attention", "mlp", "linear_attention",
                                                      "mlp"]
    assert [layers[i].mixer.state_idx for i in (0, 3)] == [0, 1] and layers[1].mixer.attn.layer_idx == 0
    inv, fast = cache_specs(model, "invariant"), cache_specs(model, "fast")
    assert [s.layer_idx for s in inv.paged] == [0] and [s.layer_idx for s in inv.recurrent] == [0, 1]
    assert inv.state_chunk_size == 16 and fast.state_chunk_size == 16
    spec = inv.recurrent[0]
    shapes = {t.name: (t.shape, t.dtype) for t in spec.tensors}
    assert shapes == {"conv": ((3, 64 + 2 * 2 * 16), None), "ssm": ((4, 16, 16), torch.float32),
                      "buf_x": ((16, 4, 16), None), "buf_B": ((16, 2, 16), None), "buf_dt": ((16, 4), torch.float32),
                      "ssm_rounded": ((4, 16, 16), None)}
    assert spec.kind == "mamba2" and spec.snapshot == ("conv", "ssm", "ssm_rounded")
    assert fast.recurrent[0].snapshot == ("conv", "ssm")
    assert {t.name for t in fast.recurrent[0].tensors} == {"conv", "ssm"}


def test_hf_names_round_trip(tiny_nemotron_h):
    """hf_state_dict gives back the checkpoint's names (`backbone.*`, as transformers saves
    them) and bits, q/k/v as shards of the fused projection."""
    model = cpu_model(tiny_nemotron_h)
    ours = assert_checkpoint_round_trip(model, tiny_nemotron_h)
    assert {"backbone.embeddings.weight", "backbone.norm_f.weight", "backbone.layers.0.mixer.conv1d.bias",
            "backbone.layers.0.mixer.D", "backbone.layers.2.mixer.up_proj.weight", "lm_head.weight"} <= set(ours)
    slot = model.weight_mapping().slot("backbone.layers.1.mixer.k_proj.weight")
    assert (slot.param, slot.shard) == ("model.layers.1.mixer.qkv_proj.weight", "k")


def test_transformers_names_load_and_mtp_is_skipped(tiny_nemotron_h, tmp_path):
    """transformers' in-memory names (`model.*`) load; multi-token-prediction tensors (mtp.*)
    are not taken, as transformers does not take them."""
    tensors = {k: v.contiguous() for k, v in load_hf_model(tiny_nemotron_h).state_dict().items()}
    assert all(k.startswith(("model.", "lm_head.")) for k in tensors)
    tensors["mtp.layers.0.norm.weight"] = torch.zeros(64)
    assert_loads_as_checkpoint(tiny_nemotron_h, tmp_path, tensors)


def test_tie_word_embeddings_is_ignored_as_transformers_ignores_it(tiny_nemotron_h, tmp_path):
    """transformers' NemotronHForCausalLM never ties, whatever the config says: a checkpoint
    whose config says tie_word_embeddings: true, with its own lm_head (what transformers writes),
    loads with that head (not refused as differing from the embedding), and the trainer's
    save_pretrained writes lm_head.weight back."""
    import json

    from vllm.training import Policy
    path = tmp_path / "tied_config"
    shutil.copytree(tiny_nemotron_h, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    assert not NemotronHConfig.from_hf(cfg | {"tie_word_embeddings": True}).tie_word_embeddings
    assert_logits_match(str(path), "invariant", load_hf_model, 20)
    policy = Policy.from_pretrained(str(path), device="cpu")
    policy.save_pretrained(str(tmp_path / "saved"))
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert torch.equal(saved["lm_head.weight"], policy.lm_head_weight.detach())
    assert not torch.equal(saved["lm_head.weight"], saved["backbone.embeddings.weight"])


# ---- against transformers --------------------------------------------------------------------
@pytest.mark.parametrize("numerics", ["invariant", "fast"])
def test_logits_match_transformers(tiny_nemotron_h, numerics):
    assert_logits_match(tiny_nemotron_h, numerics, load_hf_model, 45)  # three chunks of 16


def test_greedy_tokens_match_transformers(tiny_nemotron_h):
    """transformers' tokens from its chunked form, the whole sequence recomputed each step (its
    own decode path rounds and clamps differently); the first prompt crosses the 32-token chunk
    boundary."""
    assert_greedy_match(tiny_nemotron_h, load_hf_model, 14)


def test_rollout_logprobs_equal_trainer_bits(tiny_nemotron_h, trainer_prompts):
    assert not trainer_mismatches(tiny_nemotron_h, trainer_prompts)


def _transformers_before(version: str) -> bool:
    import transformers
    return tuple(int(p) for p in transformers.__version__.split(".")[:2]) < tuple(int(p) for p in version.split("."))


@pytest.mark.skipif(_transformers_before("5.25"),
                    reason="transformers' Nemotron-H before 5.25 is another reference: with 5.17-5.24 the same "
                           "trainer gradients are 1.3e-5 off in the embeddings and 2.4e-2 in layer 3's dt_bias")
@pytest.mark.parametrize("numerics", ["invariant", "fast"])
def test_gradients_match_transformers_float64(tiny_nemotron_h, trainer_prompts, numerics):
    """The backward of every op on the way (norms with their residual adds, attention, relu^2,
    and the Mamba-2 mixer: projection, conv with bias, the chunked scan's dt / A / B / C / D,
    the grouped gated norm) against transformers' autograd in float64. transformers runs its
    Mamba-2 scan in float32 whatever the model's dtype, so its float64 reference is float32
    there. Validated against transformers 5.25 (a fresh install's); its mixer was rewritten
    in 5.25, and the GPU machine's 5.17 gives other gradients for our unchanged ones."""
    policy, hf = logprob_gradients(tiny_nemotron_h, trainer_prompts, numerics, load_hf_model)
    # transformers' in-memory names: model.* for the checkpoint's backbone.*
    ours = {k.replace("backbone.", "model.", 1): v for k, v in policy.model.hf_state_dict(grads=True).items()}
    checked = compare_grads(ours, hf, tol=1e-5, tolerances={"mixer.A_log": 1e-4, "mixer.dt_bias": 1e-4})
    for kind in ("norm.weight", "mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.A_log",
                 "mixer.dt_bias", "mixer.D", "mixer.norm.weight", "mixer.out_proj.weight"):
        assert f"model.layers.3.{kind}" in checked, kind
    for name in ("model.layers.1.mixer.q_proj.weight", "model.layers.2.mixer.up_proj.weight", "model.norm_f.weight",
                 "model.embeddings.weight", "lm_head.weight"):
        assert name in checked, name


@pytest.mark.parametrize("check", BATTERY_CHECKS)
def test_invariant_battery(tiny_nemotron_h, check):
    run_zero_check(cpu_battery(tiny_nemotron_h), check)


def test_execution_contract_names_the_state(tiny_nemotron_h):
    inv = LLM(tiny_nemotron_h, device="cpu", numerics="invariant").execution_contract()
    assert inv.semantic["architecture"] == "NemotronHForCausalLM" and inv.semantic["chunk_size"] == 16
    assert inv.semantic["layer_types"][:2] == ["linear_attention", "full_attention"]
    assert inv.numerical["recurrent_states"]["mamba2"] == {
        "chunk_size": 16, "tensors": {"conv": "float32", "ssm": "float32", "buf_x": "float32", "buf_B": "float32",
                                      "buf_dt": "float32", "ssm_rounded": "float32"}}
    assert inv.numerical["kernels"]["mamba2_scan_decode"] == "kernels.mamba2_chunk.mamba2_chunk_torch(aligned=True)"
    fast = LLM(tiny_nemotron_h, device="cpu", numerics="fast").execution_contract()
    assert fast.numerical["kernels"]["mamba2_scan_decode"] == "kernels.mamba2_ops.selective_state_update_torch"
    with pytest.raises(ValueError, match="numerical"):
        inv.check_compatible(fast)


# ---- real dims on the GPU ------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_nemotron_axes_at_real_dims():
    """Nemotron-H's Mamba-2 dims (128 heads of 64, d_state 128, 8 groups, chunk 128) in a few
    layers, bf16: 24 requests of 1-600 prompt tokens, 24 sampled tokens; layouts, a 97-token
    step budget and a warm prefix cache all give the whole batch's bits, and the trainer
    recomputes the rollout's logprobs bit for bit."""
    from vllm.testing.parity_gate import (NEMOTRON_AXES, Gate, GateOptions, make_model_dir, model_configs,
                                         nemotron_config)
    dense, moe = model_configs()
    d = make_model_dir(nemotron_config())
    try:
        gate = Gate(GateOptions(num_requests=24, max_prompt_len=600, max_tokens=24), "", "", vocab=dense["vocab_size"],
                    nemotron_dir=d)
        rows = gate.run("invariant", list(NEMOTRON_AXES))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    assert {r.axis for r in rows} == set(NEMOTRON_AXES)
    for r in rows:
        assert r.layouts_differ == 0 and r.trainer_differ == 0, r


@pytest.mark.parametrize("snapshots,hits", [(2, False), (4, True)])
def test_num_state_snapshots_bounds_the_hybrid_prefix_cache(tiny_nemotron_h, snapshots, hits):
    """One snapshot per cached prompt, least recently used replaced first: four prompts resent
    in the same order hit nothing with two snapshots (each is evicted before its prompt comes
    back) and all hit with four."""
    llm = LLM(tiny_nemotron_h, device="cpu", num_state_snapshots=snapshots, max_num_seqs=1)
    prompts = [{"prompt_token_ids": [5 + i + 7 * j for j in range(40)]} for i in range(4)]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    cold = llm.generate(prompts, params, use_tqdm=False)
    warm = llm.generate(prompts, params, use_tqdm=False)
    cached = [o.num_cached_tokens for o in warm]
    assert all(c > 0 for c in cached) if hits else all(c == 0 for c in cached), cached
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
    assert llm.llm_engine.executor.info.num_state_snapshots == snapshots
