"""Qwen3-MoE in training mode: rollout logprobs == Policy.token_logprobs bit for bit,
gradients (router included) against transformers in float64, the optional
load-balancing loss against transformers', and weight sync of MoE parameters."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM
from vllm.layers.moe import collect_router_stats
from vllm.testing.rollouts import rollout, trainer_mismatches
from vllm.testing.tiny_models import compare_grads
from vllm.testing.transformers_parity import logprob_gradients
from vllm.training import Policy


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def load_hf_model(path, dtype):
    """transformers' reference with its eager per-expert loop (its grouped-mm path has no float64)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager",
                                                experts_implementation="eager", local_files_only=True).eval()


@pytest.fixture(scope="module")
def prompts(trainer_prompts):
    return trainer_prompts


def test_rollout_logprobs_equal_trainer_bits(tiny_qwen3_moe, prompts):
    assert not trainer_mismatches(tiny_qwen3_moe, prompts)


def _hf_logprobs(hf, seqs, plens, temperature):
    out = []
    for s, pl in zip(seqs, plens):
        lp = torch.log_softmax(hf(torch.tensor([s])).logits[0] / temperature, dim=-1)
        out.append(lp[pl - 1:len(s) - 1].gather(1, torch.tensor(s[pl:])[:, None])[:, 0])
    return out


def _our_grads(policy) -> dict[str, torch.Tensor]:
    """Gradients under transformers' in-memory names: split projections from hf_state_dict,
    the fused expert tensors (same layout and names as transformers') as they are."""
    grads = policy.model.hf_state_dict(grads=True)
    grads.update({n: p.grad for n, p in policy.model.named_parameters() if ".experts." in n and p.grad is not None})
    return grads


@pytest.mark.parametrize("numerics", ["invariant", "fast"])
def test_gradients_match_transformers_float64(tiny_qwen3_moe, prompts, numerics):
    policy, hf = logprob_gradients(tiny_qwen3_moe, prompts, numerics, load_hf_model)
    checked = compare_grads(_our_grads(policy), hf)
    for layer in (0, 2):  # experts and router of both MoE layers were compared
        assert {f"model.layers.{layer}.mlp.{p}" for p in ("experts.gate_up_proj", "experts.down_proj", "gate.weight")} <= checked
    assert len(checked) >= 30


def test_load_balancing_loss_matches_transformers(tiny_qwen3_moe, prompts):
    """Optional auxiliary loss (collect_router_stats): value and router gradient vs transformers'."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    seq = prompts[2] + [5, 6, 7]
    policy = Policy.from_pretrained(tiny_qwen3_moe, device="cpu", dtype="float32", numerics="invariant")
    with collect_router_stats() as stats:
        policy.token_logprobs([seq], [len(prompts[2])])
    assert len(stats.calls) == 2  # layers 0 and 2 (layer 1 is dense)
    aux = stats.load_balancing_loss()
    aux.backward()
    hf = load_hf_model(tiny_qwen3_moe, torch.float64)
    out = hf(torch.tensor([seq]), output_router_logits=True)
    ref = load_balancing_loss_func(out.router_logits, 8, 2)
    assert abs(aux.item() - ref.item()) < 1e-5
    ref.backward()
    for layer in (0, 2):
        ours = policy.model.model.layers[layer].mlp.gate.weight.grad.double()
        theirs = hf.model.layers[layer].mlp.gate.weight.grad
        assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-4
    with pytest.raises(ValueError, match="no MoE layer"):
        with collect_router_stats() as empty:
            pass
        empty.load_balancing_loss()


def test_weight_sync_of_moe_parameters_keeps_parity(tiny_qwen3_moe, prompts):
    llm = LLM(tiny_qwen3_moe, device="cpu", numerics="invariant")
    policy = Policy.from_pretrained(tiny_qwen3_moe, device="cpu", numerics="invariant")
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    seqs, _ = rollout(llm, prompts[:2])
    (-sum(lp.sum() for lp in policy.token_logprobs(seqs, [len(p) for p in prompts[:2]], temperature=0.8))).backward()
    opt.step()
    model = llm.llm_engine.executor.model
    experts = model.model.layers[0].mlp.experts
    before = experts.gate_up_proj.detach().clone()
    ptr = experts.gate_up_proj.data_ptr()
    update = policy.model.hf_state_dict()
    assert sum(".experts." in n for n in update) == 2 * 8 * 3
    # bad MoE entries are refused before anything is written
    good = update["model.layers.0.mlp.experts.3.up_proj.weight"]
    for bad, msg in ((("model.layers.0.mlp.experts.8.up_proj.weight", good), "unknown weight"),
                     (("model.layers.0.mlp.experts.3.up_proj.weight", good[:-1]), "shape"),
                     (("model.layers.1.mlp.experts.0.up_proj.weight", good), "unknown weight")):
        with pytest.raises(ValueError, match=msg):
            llm.update_weights([(k, v) for k, v in update.items() if k != bad[0]] + [bad])
        assert torch.equal(experts.gate_up_proj, before)
    partial = {k: v for k, v in update.items() if k != "model.layers.2.mlp.experts.5.down_proj.weight"}
    with pytest.raises(ValueError, match=r"incomplete update.*experts\.down_proj\[\(5, 'down'\)\]"):
        llm.update_weights(partial, require_complete=True)
    llm.update_weights(update, contract=policy.execution_contract(), require_complete=True)
    assert experts.gate_up_proj.data_ptr() == ptr and not torch.equal(experts.gate_up_proj, before)
    seqs2, roll = rollout(llm, prompts[:2])
    with torch.no_grad():
        got = policy.token_logprobs(seqs2, [len(p) for p in prompts[:2]], temperature=0.8)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, roll))
    # the fused tensor given whole (our own name) covers all its expert shards
    whole = {"model.layers.0.mlp.experts.down_proj": policy.model.model.layers[0].mlp.experts.down_proj.detach()}
    llm.update_weights(whole)


def test_activation_checkpointing_same_bits_and_grads(tiny_qwen3_moe, prompts):
    seqs = [p + [5, 6, 7] for p in prompts[:2]]
    plens = [len(p) for p in prompts[:2]]
    outs, grads = [], []
    for ckpt in (False, True):
        pol = Policy.from_pretrained(tiny_qwen3_moe, device="cpu", numerics="invariant", activation_checkpointing=ckpt)
        calls = []
        pol.model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        lps = pol.token_logprobs(seqs, plens)
        sum(lp.sum() for lp in lps).backward()
        assert len(calls) == (2 if ckpt else 1)  # the model's own loop recomputes the MoE layer in backward
        outs.append(lps)
        grads.append({n: p.grad for n, p in pol.model.named_parameters()})
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(*outs))
    for k in grads[0]:
        assert torch.equal(bits(grads[0][k]), bits(grads[1][k])), k


def test_router_stats_are_recorded_once_under_activation_checkpointing(tiny_qwen3_moe, prompts):
    """A collect_router_stats block over gradient accumulation (a backward inside the block):
    the recomputation of activation checkpointing records no routing a second time, so the
    load-balancing loss is the same with it on or off."""
    seqs = [[p + [5, 6, 7]] for p in prompts[:2]]
    plens = [[len(p)] for p in prompts[:2]]
    got = []
    for ckpt in (False, True):
        pol = Policy.from_pretrained(tiny_qwen3_moe, device="cpu", numerics="invariant", activation_checkpointing=ckpt)
        with collect_router_stats() as stats:
            for seq, plen in zip(seqs, plens):     # micro-batches: forward + backward each
                pol.token_logprobs(seq, plen)[0].sum().backward()
        got.append((len(stats.calls), stats.load_balancing_loss().detach()))
    assert got[0][0] == got[1][0] == 4       # 2 MoE layers x 2 micro-batches
    assert torch.equal(bits(got[0][1]), bits(got[1][1]))


def test_save_pretrained_writes_hf_expert_names(tiny_qwen3_moe, tmp_path):
    """The trainer's checkpoint has the hub layout (one tensor per expert and projection)
    and transformers loads it to our values."""
    from safetensors import safe_open
    policy = Policy.from_pretrained(tiny_qwen3_moe, device="cpu", numerics="invariant")
    with torch.no_grad():
        policy.model.model.layers[2].mlp.experts.down_proj[5].mul_(1.5)  # a change only this expert has
    policy.save_pretrained(str(tmp_path / "saved"))
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    with safe_open(f"{tiny_qwen3_moe}/model.safetensors", "pt") as f:
        assert names == set(f.keys())
    hf = load_hf_model(str(tmp_path / "saved"), torch.float32)
    ours = dict(policy.model.named_parameters())
    for layer in (0, 2):
        for p in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{p}"
            assert torch.equal(dict(hf.named_parameters())[name].view(torch.int32), ours[name].detach().view(torch.int32))
