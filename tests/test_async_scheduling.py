"""Async scheduling (step N+1 enqueued before step N's tokens reach the host) must
give exactly the synchronous engine's tokens, logprob bits, texts and finish
reasons, across chunking, preemption, prefix caching, n>1, eos and stop strings."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams


def _signature(outs):
    sig = []
    for o in outs:
        for c in o.outputs:
            lps = [torch.tensor([lp[t].logprob]).view(torch.int32).item() for lp, t in zip(c.logprobs or [], c.token_ids)]
            sig.append((o.request_id, c.index, tuple(c.token_ids), tuple(lps), c.text, c.finish_reason, c.stop_reason))
    return sig


def _workload(tok=None):
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=g).tolist()} for n in (5, 37, 60, 17, 3, 44, 29)]
    shared = torch.randint(3, 500, (40,), generator=g).tolist()
    prompts += [{"prompt_token_ids": shared + [7]}, {"prompt_token_ids": shared + [8, 9]}]
    params = [SamplingParams(temperature=1.0, max_tokens=m, seed=i, logprobs=1, n=2 if i == 2 else 1)
              for i, m in enumerate((12, 3, 20, 7, 1, 15, 9, 6, 6))]
    params[3] = SamplingParams(temperature=1.0, seed=3, max_tokens=25, logprobs=0, stop=["e", "a", "o"])
    params[5] = SamplingParams(temperature=0.9, max_tokens=30, seed=5, stop_token_ids=list(range(3, 512, 4)))
    return prompts, params


@pytest.mark.parametrize("opts", [dict(max_num_batched_tokens=40),
                                  dict(max_num_batched_tokens=64, num_gpu_blocks_override=14),
                                  dict(max_num_batched_tokens=512, block_size=4)])
def test_async_equals_sync(tiny_qwen3, opts):
    results = {}
    for a in (False, True):
        llm = LLM(tiny_qwen3, device="cpu", numerics="invariant", async_scheduling=a, **opts)
        prompts, params = _workload(llm.get_tokenizer())
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[a] = _signature(outs)
        # a second round reuses the prefix cache the first round filled
        results[(a, 2)] = _signature(llm.generate(prompts[-2:], params[-2:], use_tqdm=False))
        kv = llm.llm_engine.kv
        kv.check_invariants()
        assert kv.num_free_blocks == kv.num_blocks - 1
        assert not llm.llm_engine.has_unfinished_requests()
        if "num_gpu_blocks_override" in opts:
            assert llm.llm_engine.scheduler.num_preemptions > 0
    assert results[False] == results[True]
    assert results[(False, 2)] == results[(True, 2)]
    assert any(r[5] == "stop" for r in results[True])


def test_async_abort_mid_flight(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu", async_scheduling=True)
    eng = llm.llm_engine
    eng.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("b", {"prompt_token_ids": [8, 9]}, SamplingParams(max_tokens=5, ignore_eos=True))
    outs = []
    for _ in range(3):
        outs += eng.step()
    eng.abort_request("a")
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs] == ["b"] and len(outs[0].outputs[0].token_ids) == 5
    assert eng.kv.num_free_blocks == eng.kv.num_blocks - 1


def _run_engine(path, steps_fn, async_scheduling):
    llm = LLM(path, device="cpu", numerics="invariant", async_scheduling=async_scheduling)
    return steps_fn(llm.llm_engine)


def test_async_reused_request_id_and_cache_hits(tiny_qwen3):
    def scenario(eng):
        outs = []
        eng.add_request("a", {"prompt_token_ids": [3, 4, 5]},
                        SamplingParams(max_tokens=5, stop_token_ids=list(range(512)), seed=1))
        while not any(o.request_id == "a" for o in outs):
            outs += eng.step()
        # the id is reused right away: with async scheduling the old request's next step is still in flight
        eng.add_request("a", {"prompt_token_ids": [9, 10, 11, 12]}, SamplingParams(max_tokens=3, seed=2, ignore_eos=True))
        eng.add_request("n", {"prompt_token_ids": list(range(20, 90))}, SamplingParams(n=3, max_tokens=3, seed=3))
        while eng.has_unfinished_requests():
            outs += eng.step()
        return [(o.request_id, [c.token_ids for c in o.outputs], o.num_cached_tokens) for o in outs], \
            eng.kv.stats()["prefix_cache_hits"]
    sync, hits_sync = _run_engine(tiny_qwen3, scenario, False)
    asy, hits_async = _run_engine(tiny_qwen3, scenario, True)
    assert sync == asy
    assert hits_async == hits_sync > 0  # followers of the n=3 request reuse the leader's prompt blocks
