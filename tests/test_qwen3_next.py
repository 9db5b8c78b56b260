"""Qwen3-Next (and Qwen3.5's text models) against transformers, random weights, CPU.

Its config parsing (layer_types from full_attention_interval as transformers derives them,
refusals), the layer plan and cache indices (attention and Gated DeltaNet layers numbered per
kind), the HF-name mapping (bit-exact round trip, per-expert and stacked expert names, the
unloaded mtp head), and on a config whose layers are all full attention (transformers allows
it; the Gated DeltaNet ops are another file's): logits and greedy tokens against transformers
in both numerics modes, rollout logprobs equal to the trainer's bit for bit, gradients against
transformers in float64, and the invariance battery. The hybrid checkpoints (Gated DeltaNet
layers included) run the same comparisons at the end."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM
from vllm.layers.moe import SparseMoeBlock
from vllm.models.qwen3_next import Qwen3NextConfig, SharedExpertMoeBlock
from vllm.testing import tiny_models
from vllm.testing.parity_battery import BATTERY_CHECKS, cpu_battery, run_zero_check
from vllm.testing.rollouts import trainer_mismatches
from vllm.testing.tiny_models import compare_grads, make_tiny_checkpoint
from vllm.testing.transformers_parity import (assert_checkpoint_round_trip, assert_config_refusals,
                                              assert_engine_refuses, assert_greedy_match, assert_loads_as_checkpoint,
                                              assert_logits_match, build_on_meta, cpu_model, logprob_gradients)

# Qwen3-Next-80B-A3B-Instruct's config.json (hub spelling: top-level partial_rotary_factor,
# rope_theta, no layer_types)
HUB_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "mlp_only_layers": [], "moe_intermediate_size": 512, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "output_router_logits": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def load_hf_model(path, dtype=torch.float32):
    """transformers' reference with eager attention and its per-expert loop (float64 needs it)."""
    return tiny_models.load_hf_model(path, dtype, experts_implementation="eager")


@pytest.fixture(scope="module")
def attention_only(tmp_path_factory):
    """Qwen3-Next with every layer full attention: 3 layers, layer 1 dense, partial rope over
    half of each head (16 of 32 dims), 4 experts top-2 with a shared expert."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_next_attn"), "qwen3_next", head_dim=32,
                                num_hidden_layers=3, seed=6,
                                config_overrides={"layer_types": ["full_attention"] * 3, "mlp_only_layers": [1],
                                                  "partial_rotary_factor": 0.5})


@pytest.fixture(scope="module")
def qwen3_5_attention_only(tmp_path_factory):
    """Qwen3.5's text model (dense MLPs), every layer full attention."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_5_attn"), "qwen3_5", head_dim=32, num_hidden_layers=2,
                                seed=8, config_overrides={"layer_types": ["full_attention"] * 2})


@pytest.fixture(scope="module")
def qwen3_5_moe_attention_only(tmp_path_factory):
    """Qwen3.5-MoE's text model (a MoE block with a shared expert on every layer), every layer
    full attention."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_5_moe_attn"), "qwen3_5_moe", head_dim=32,
                                num_hidden_layers=2, seed=3, config_overrides={"layer_types": ["full_attention"] * 2})


@pytest.fixture(scope="module")
def qwen3_5_hybrid(tmp_path_factory):
    """Qwen3.5's text model: layers [linear, full], four Gated DeltaNet input projections."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_5_hybrid"), "qwen3_5", head_dim=32, num_hidden_layers=2,
                                seed=9, config_overrides={"full_attention_interval": 2})


# ---- config ------------------------------------------------------------------------------
@pytest.mark.parametrize("interval", [None, 2, 1])
def test_layer_types_derived_as_transformers_does(interval):
    from transformers import Qwen3NextConfig as HFConfig
    hf = dict(HUB_CONFIG) if interval is None else {**HUB_CONFIG, "full_attention_interval": interval}
    ours = Qwen3NextConfig.from_hf(hf)
    keys = ("num_hidden_layers", "partial_rotary_factor") + (("full_attention_interval",) if interval else ())
    theirs = HFConfig(**{k: hf[k] for k in keys})
    assert ours.layer_types == theirs.layer_types
    if interval is None:
        assert ours.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
        assert [ours.kind_index(i) for i in range(8)] == [0, 1, 2, 0, 3, 4, 5, 1]


def test_config_fields():
    cfg = Qwen3NextConfig.from_hf(HUB_CONFIG)
    assert (cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling.rope_type) == (64, 1e7, "default")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.shared_expert_intermediate_size) == (512, 10, 512)
    assert cfg.norm_topk_prob and not cfg.split_projections and cfg.intermediate_size == 0  # no dense layer
    assert all(cfg.is_sparse(i) for i in range(48))
    # transformers 5's spelling: partial_rotary_factor and rope_theta inside rope_parameters (which win)
    v5 = {k: v for k, v in HUB_CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}
    assert Qwen3NextConfig.from_hf(v5).rotary_dim == 128 and Qwen3NextConfig.from_hf(v5).rope_theta == 5e6
    # transformers' MLP plan: mlp_only_layers, decoder_sparse_step, num_experts == 0
    cfg = Qwen3NextConfig.from_hf({**HUB_CONFIG, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [cfg.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    assert cfg.intermediate_size == 5120
    dense = Qwen3NextConfig.from_hf({**HUB_CONFIG, "num_experts": 0})
    assert not any(dense.is_sparse(i) for i in range(48)) and dense.num_experts_per_tok == 0
    given = Qwen3NextConfig.from_hf({**HUB_CONFIG, "num_hidden_layers": 3,
                                     "layer_types": ["full_attention", "linear_attention", "full_attention"]})
    assert [given.kind_index(i) for i in range(3)] == [0, 0, 1]


def test_qwen3_5_text_configs():
    base = {k: v for k, v in HUB_CONFIG.items() if k not in ("num_experts", "num_experts_per_tok",
                                                              "moe_intermediate_size", "norm_topk_prob",
                                                              "decoder_sparse_step", "mlp_only_layers")}
    dense = Qwen3NextConfig.from_hf({**base, "architectures": ["Qwen3_5ForCausalLM"], "intermediate_size": 12288,
                                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                                         "mrope_section": [11, 11, 10], "mrope_interleaved": True,
                                                         "partial_rotary_factor": 0.25}})
    assert dense.split_projections and dense.num_experts == 0 and dense.intermediate_size == 12288
    assert not any(dense.is_sparse(i) for i in range(48)) and dense.rotary_dim == 64
    moe = Qwen3NextConfig.from_hf({**base, "architectures": ["Qwen3_5MoeForCausalLM"], "num_experts": 256,
                                   "num_experts_per_tok": 8, "moe_intermediate_size": 512, "mlp_only_layers": [2],
                                   "decoder_sparse_step": 2, "norm_topk_prob": False})
    # Qwen3.5-MoE has neither option: every layer is sparse, the top-k always normalised
    assert all(moe.is_sparse(i) for i in range(48)) and moe.norm_topk_prob and moe.split_projections


def test_config_refusals():
    no_hidden = {k: v for k, v in HUB_CONFIG.items() if k != "hidden_size"}
    no_linear = {k: v for k, v in HUB_CONFIG.items() if k != "linear_num_key_heads"}
    no_shared = {k: v for k, v in HUB_CONFIG.items() if k != "shared_expert_intermediate_size"}
    no_dense_size = {k: v for k, v in HUB_CONFIG.items() if k != "intermediate_size"}
    bad = [({**HUB_CONFIG, "attention_bias": True}, "attention_bias"),
           ({**HUB_CONFIG, "hidden_act": "gelu"}, "hidden_act"),
           ({**HUB_CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
           ({**HUB_CONFIG, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "rope type 'linear'"),
           ({**HUB_CONFIG, "layer_types": ["full_attention"] * 47}, "47 entries for num_hidden_layers=48"),
           ({**HUB_CONFIG, "layer_types": ["sliding_attention"] * 48}, "sliding_attention"),
           ({**HUB_CONFIG, "full_attention_interval": 0}, "full_attention_interval"),
           ({**HUB_CONFIG, "partial_rotary_factor": 0.001}, "partial_rotary_factor=0.001 gives 0 rotary dims"),
           ({**HUB_CONFIG, "head_dim": 252}, "gives 63 rotary dims"),
           ({**HUB_CONFIG, "num_experts_per_tok": 513}, "num_experts_per_tok"),
           ({**HUB_CONFIG, "decoder_sparse_step": -1}, "decoder_sparse_step"),
           ({**HUB_CONFIG, "decoder_sparse_step": 0}, "decoder_sparse_step must be >= 1, got 0"),
           ({**HUB_CONFIG, "linear_conv_kernel_dim": 5}, "linear_conv_kernel_dim=5"),
           ({**HUB_CONFIG, "linear_key_head_dim": 24}, "linear_key_head_dim=24"),
           ({**HUB_CONFIG, "linear_value_head_dim": 40}, "multiples of 16"),
           ({**HUB_CONFIG, "linear_num_value_heads": 24}, "linear_num_value_heads=24"),
           ({**HUB_CONFIG, "num_key_value_heads": 3}, "num_key_value_heads=3"),
           ({**no_dense_size, "num_experts": 0}, "lacks 'intermediate_size'"),
           (no_hidden, "config.json of a Qwen3NextForCausalLM lacks 'hidden_size'"),
           (no_linear, "lacks 'linear_num_key_heads'"),
           (no_shared, "lacks 'shared_expert_intermediate_size'"),
           ({**HUB_CONFIG, "architectures": ["Qwen3MoeForCausalLM"]}, "is not one of")]
    assert_config_refusals(Qwen3NextConfig.from_hf, bad)


def test_bad_config_is_refused_by_the_engine(attention_only, tmp_path):
    assert_engine_refuses(attention_only, tmp_path, {"layer_types": ["full_attention", "mamba", "full_attention"]},
                          "mamba")


def test_full_size_config_builds_like_transformers(tmp_path):
    """Qwen3-Next-80B-A3B on the meta device: transformers' parameter count (the mtp head,
    which neither builds, aside), every layer of the kind and MLP transformers gives it."""
    from transformers import Qwen3NextConfig as HFConfig
    from transformers import Qwen3NextForCausalLM as HFModel
    from vllm.models.qwen3_next import Qwen3NextForCausalLM
    ours, theirs = build_on_meta(Qwen3NextForCausalLM, Qwen3NextConfig.from_hf(HUB_CONFIG), HFModel, HFConfig,
                                 HUB_CONFIG)
    assert 79e9 < sum(p.numel() for p in ours.parameters()) < 82e9
    for a, b in zip(ours.model.layers, theirs.model.layers):
        assert hasattr(a, "linear_attn") == hasattr(b, "linear_attn") and hasattr(a, "self_attn") == hasattr(b, "self_attn")
        assert isinstance(a.mlp, SparseMoeBlock) == hasattr(b.mlp, "experts")


# ---- layer plan, cache indices, names ------------------------------------------------------
def test_layer_plan_and_cache_indices(tiny_qwen3_next):
    """Each kind numbers its caches 0, 1, ...: the Gated DeltaNet layers their state slots, the
    attention layers their KV caches (the worker checks the numbering is gapless)."""
    from vllm.worker.kv_cache import cache_specs
    model = cpu_model(tiny_qwen3_next)
    layers = model.model.layers
    assert [layer.linear_attn.state_idx for layer in layers[:3]] == [0, 1, 2]
    assert not hasattr(layers[3], "linear_attn") and layers[3].self_attn.attn.layer_idx == 0
    assert [isinstance(layer.mlp, SharedExpertMoeBlock) for layer in layers] == [True, False, True, True]
    assert model.model.rotary.rotary_dim == 8 and model.model.rotary.cos_table.shape[-1] == 4
    specs = cache_specs(model, "invariant")
    assert [s.layer_idx for s in specs.paged] == [0] and [s.layer_idx for s in specs.recurrent] == [0, 1, 2]
    assert specs.paged[0].head_dim == 32 and specs.paged[0].num_kv_heads == 2


@pytest.mark.parametrize("fixture", ["tiny_qwen3_next", "attention_only", "qwen3_5_hybrid", "qwen3_5_moe_attention_only"])
def test_hf_names_round_trip(request, fixture):
    """hf_state_dict gives back transformers' checkpoint names and bits: q_proj (2x wide,
    [q | gate] per head) as the q shard of the fused projection, per-expert tensors, the shared
    expert and its gate, the Gated DeltaNet's tensors under their own names."""
    path = request.getfixturevalue(fixture)
    model = cpu_model(path)
    ours = assert_checkpoint_round_trip(model, path)
    mapping = model.weight_mapping()
    attn = next(i for i, layer in enumerate(model.model.layers) if hasattr(layer, "self_attn"))
    slot = mapping.slot(f"model.layers.{attn}.self_attn.q_proj.weight")
    assert (slot.param, slot.shard) == (f"model.layers.{attn}.self_attn.qkv_proj.weight", "q")
    assert mapping.destination(slot).shape == (2 * 4 * 32, 64)
    if fixture == "tiny_qwen3_next":
        assert {"model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.0.linear_attn.A_log",
                "model.layers.2.mlp.shared_expert_gate.weight", "model.layers.2.mlp.shared_expert.up_proj.weight",
                "model.layers.3.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.gate_proj.weight"} <= set(ours)
        slot = mapping.slot("model.layers.2.mlp.experts.1.up_proj.weight")
        assert (slot.param, slot.shard) == ("model.layers.2.mlp.experts.gate_up_proj", (1, "up"))
    if fixture == "qwen3_5_hybrid":
        assert {f"model.layers.0.linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")} <= set(ours)


def test_transformers_names_load_and_mtp_is_skipped(tiny_qwen3_next, tmp_path):
    """transformers' in-memory names (stacked experts) load whole; a hub checkpoint's
    multi-token-prediction tensors (mtp.*) are not taken, as transformers does not take them."""
    tensors = {k: v.contiguous() for k, v in load_hf_model(tiny_qwen3_next).state_dict().items()}
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
    assert_loads_as_checkpoint(tiny_qwen3_next, tmp_path, tensors)


# ---- all-attention config: against transformers ---------------------------------------------
# the all-attention checkpoints and the hybrids (Gated DeltaNet layers included)
@pytest.mark.parametrize("numerics", ["invariant", "fast"])
@pytest.mark.parametrize("fixture", ["attention_only", "qwen3_5_attention_only", "qwen3_5_moe_attention_only",
                                     "tiny_qwen3_next", "qwen3_5_hybrid"])
def test_logits_match_transformers(request, fixture, numerics):
    assert_logits_match(request.getfixturevalue(fixture), numerics, load_hf_model, 33)


@pytest.mark.parametrize("fixture", ["attention_only", "tiny_qwen3_next"])
def test_greedy_tokens_match_transformers(request, fixture):
    assert_greedy_match(request.getfixturevalue(fixture), load_hf_model, 10)


@pytest.mark.parametrize("fixture", ["attention_only", "tiny_qwen3_next"])
def test_rollout_logprobs_equal_trainer_bits(request, fixture, trainer_prompts):
    assert not trainer_mismatches(request.getfixturevalue(fixture), trainer_prompts)


@pytest.mark.parametrize("numerics", ["invariant", "fast"])
@pytest.mark.parametrize("fixture", ["attention_only", "tiny_qwen3_next"])
def test_gradients_match_transformers_float64(request, fixture, trainer_prompts, numerics):
    """The backward of every op on the way (zero-centred norms with their residual adds,
    partial rope, both sigmoid gates, the MoE block; in the hybrid the Gated DeltaNet layers:
    conv, gating, the chunked delta rule, the gated norm) against transformers' autograd in float64."""
    policy, hf = logprob_gradients(request.getfixturevalue(fixture), trainer_prompts, numerics, load_hf_model)
    ours = policy.model.hf_state_dict(grads=True)
    ours.update({n: p.grad for n, p in policy.model.named_parameters() if ".experts." in n and p.grad is not None})
    # A_log and dt_bias (a few values each, summed over every token) are ill-conditioned in
    # float32: transformers' own float32 model is 1.5e-3 off its float64 gradient there
    checked = compare_grads(ours, hf, tolerances={"linear_attn.A_log": 5e-3, "linear_attn.dt_bias": 5e-3})
    mixer = (("self_attn.q_norm.weight", "self_attn.q_proj.weight") if fixture == "attention_only" else
             ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight", "linear_attn.conv1d.weight",
              "linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.norm.weight", "linear_attn.out_proj.weight"))
    for kind in ("input_layernorm.weight", *mixer, "mlp.shared_expert_gate.weight", "mlp.shared_expert.down_proj.weight",
                 "mlp.experts.gate_up_proj"):
        assert f"model.layers.2.{kind}" in checked, kind
    assert "model.norm.weight" in checked and len(checked) >= 40


@pytest.fixture(scope="module")
def battery(attention_only):
    return cpu_battery(attention_only)


@pytest.mark.parametrize("check", BATTERY_CHECKS)
def test_invariant_battery(battery, check):
    run_zero_check(battery, check)


def test_execution_contract_names_the_architecture(attention_only):
    inv = LLM(attention_only, device="cpu", numerics="invariant").execution_contract()
    assert inv.semantic["architecture"] == "Qwen3NextForCausalLM"
    assert inv.semantic["layer_types"] == ["full_attention"] * 3 and inv.semantic["partial_rotary_factor"] == 0.5
    assert inv.semantic["shared_expert_intermediate_size"] == 48 and "router_aux_loss_coef" not in inv.semantic
    assert "moe" in inv.numerical["layer_kernels"]
    assert inv.numerical["kernels"]["zero_centred_rms_norm"] == "kernels.torch_ops.zero_centred_rms_norm_rows"


# ---- the hybrid checkpoints: Gated DeltaNet layers included --------------------------------
@pytest.mark.parametrize("check", BATTERY_CHECKS)
def test_hybrid_invariant_battery(tiny_qwen3_next, check):
    run_zero_check(cpu_battery(tiny_qwen3_next), check)


def test_more_prompts_than_snapshot_slots_in_one_step(tiny_qwen3_next):
    """Three distinct prompts reach their snapshot point in one prefill step with two snapshot
    slots: each step saves into distinct slots (a repeated target raises in the runner), and a
    warm prefix hit later gives a cold run's bits."""
    import random

    from vllm import LLM, SamplingParams
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 200) for _ in range(70)] for _ in range(3)]
    sp = SamplingParams(max_tokens=4, temperature=1.0, seed=3, logprobs=0, ignore_eos=True)
    warm = LLM(tiny_qwen3_next, device="cpu", dtype="float32", block_size=16, max_num_seqs=8, num_state_snapshots=2)
    cold = LLM(tiny_qwen3_next, device="cpu", dtype="float32", block_size=16, max_num_seqs=8,
               enable_prefix_caching=False)
    warm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)   # one step prefills all three
    assert warm.llm_engine.kv.state.num_snapshots_held == 2
    again = [{"prompt_token_ids": p + [9, 10]} for p in prompts]
    warm_out = warm.generate(again, sp, use_tqdm=False)
    assert sorted(o.num_cached_tokens for o in warm_out) == [0, 64, 64]   # two snapshots: two warm starts
    for w, c in zip(warm_out, cold.generate(again, sp, use_tqdm=False)):
        assert w.outputs[0].token_ids == c.outputs[0].token_ids
        lp = [torch.tensor([d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
              for o in (w, c)]
        assert torch.equal(lp[0].view(torch.int32), lp[1].view(torch.int32))
