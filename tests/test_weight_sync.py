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
    params_before = {n: p.detach().clone() for n, p in llm.llm_engine.executor.model.named_parameters()}
    ptrs = {n: p.data_ptr() for n, p in llm.llm_engine.executor.model.named_parameters()}
    version = llm.update_weights(policy.model.hf_state_dict(), contract=policy.execution_contract(), require_complete=True)
    assert version == 1 == llm.weight_version
    model = llm.llm_engine.executor.model
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
        "dtype": (name, good[name].to(torch.int32)),
        "non-finite": (name, torch.full_like(good[name], float("nan"))),
        "meta": (name, torch.empty_like(good[name], device="meta")),
        "sparse": (name, good[name].to_sparse()),
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


def test_weight_sync_edge_cases(tiny_qwen3, tiny_llama):
    llm = LLM(tiny_qwen3, device="cpu")
    good = Policy.from_pretrained(tiny_qwen3, device="cpu").model.hf_state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="twice"):
        llm.update_weights([(name, good[name]), (name, good[name])])
    fused = llm.llm_engine.executor.model.model.layers[0].self_attn.qkv_proj.weight.detach().clone()
    with pytest.raises(ValueError, match="overlaps"):
        llm.update_weights({"model.layers.0.self_attn.qkv_proj.weight": fused, name: good[name]})
    assert llm.weight_version == 0
    # tied embeddings: lm_head.weight is checked, and written as the embedding when sent alone
    tied = LLM(tiny_llama, device="cpu")
    emb = tied.llm_engine.executor.model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="non-finite"):
        tied.update_weights({"lm_head.weight": torch.full_like(emb, float("nan"))})
    with pytest.raises(ValueError, match="differs"):
        tied.update_weights({"lm_head.weight": emb.detach() * 2, "model.embed_tokens.weight": emb.detach().clone()})
    new = emb.detach() * 0.5
    tied.update_weights({"lm_head.weight": new})
    assert torch.equal(tied.llm_engine.executor.model.model.embed_tokens.weight, new)
    assert tied.llm_engine.executor.model.lm_head.weight is tied.llm_engine.executor.model.model.embed_tokens.weight


def test_async_engine_aborted_then_updated(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu", async_scheduling=True)
    eng = llm.llm_engine
    eng.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    eng.abort_request("a")
    assert not eng.has_unfinished_requests()
    good = Policy.from_pretrained(tiny_qwen3, device="cpu").model.hf_state_dict()
    assert llm.update_weights(good) == 1


def test_update_weights_without_names_says_so(tiny_qwen3):
    """A list of tensors (no names) is refused with a message saying what is expected,
    before anything is written."""
    llm = LLM(tiny_qwen3, device="cpu", numerics="fast")
    tensors = [p.detach().clone() for p in llm.llm_engine.executor.model.parameters()]
    for bad, match in ((tensors, r"item 0 is a Tensor.*no names"), (tensors[0], "got a Tensor"),
                       (7, "got int"), ([("a.weight", tensors[0], 1)], "item 0 is a tuple")):
        with pytest.raises(ValueError, match=match):
            llm.update_weights(bad)
    assert llm.weight_version == 0
