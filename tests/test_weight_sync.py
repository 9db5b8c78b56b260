"""Trainer -> engine weight sync: in place, validated before anything is written,
contract-checked; rollout logprobs equal the standalone trainer's after a sync."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.training import Policy


def bits(t):
    return t.detach().contiguous().view(torch.int32)


def rollout(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.8, max_tokens=6, seed=2, logprobs=0, ignore_eos=True), use_tqdm=False)
    seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
    lps = [torch.tensor([o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(o.outputs[0].token_ids)]) for o in outs]
    return seqs, lps


PROMPTS = [list(range(10, 25)), list(range(40, 47))]


def test_standalone_trainer_sync_keeps_parity(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant")
    policy = Policy.from_pretrained(tiny_qwen3, device="cpu", numerics="invariant")
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    seqs, lps = rollout(llm, PROMPTS)
    (-sum(lp.sum() for lp in policy.token_logprobs(seqs, [len(p) for p in PROMPTS], temperature=0.8))).backward()
    opt.step()
    params_before = {n: p.detach().clone() for n, p in llm.llm_engine.runner.model.named_parameters()}
    ptrs = {n: p.data_ptr() for n, p in llm.llm_engine.runner.model.named_parameters()}
    version = llm.update_weights(policy.model.hf_state_dict(), contract=policy.execution_contract(), require_complete=True)
    assert version == 1 == llm.weight_version
    model = llm.llm_engine.runner.model
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs  # in place: graph-safe
    assert any(not torch.equal(params_before[n], p) for n, p in model.named_parameters())
    seqs2, lps2 = rollout(llm, PROMPTS)
    with torch.no_grad():
        got = policy.token_logprobs(seqs2, [len(p) for p in PROMPTS], temperature=0.8)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, lps2))


def test_rejected_updates_leave_old_weights(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant")
    seqs, lps = rollout(llm, PROMPTS)
    good = Policy.from_pretrained(tiny_qwen3, device="cpu").model.hf_state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    scaled = {k: v * 1.5 for k, v in good.items()}  # a valid update, had it been accepted
    bad_entries = {
        "shape": (name, good[name][:-1]),
        "unknown": ("model.layers.99.mlp.up_proj.weight", good[name]),
        "dtype": (name, good[name].double()),
        "non-finite": (name, torch.full_like(good[name], float("nan"))),
    }
    for why, (key, value) in bad_entries.items():
        # valid tensors come before the bad one: none of them may have been written
        with pytest.raises(ValueError):
            llm.update_weights({**scaled, key: value})
        assert llm.weight_version == 0
        s2, l2 = rollout(llm, PROMPTS)
        assert s2 == seqs and all(torch.equal(bits(a), bits(b)) for a, b in zip(l2, lps)), why
    partial = dict(list(good.items())[:3])
    with pytest.raises(ValueError, match="incomplete"):
        llm.update_weights(partial, require_complete=True)
    fast = LLM(tiny_qwen3, device="cpu", numerics="fast").execution_contract()
    with pytest.raises(ValueError, match="numerical"):
        llm.update_weights(good, contract=fast)
    assert llm.weight_version == 0
