"""SamplingParams.prompt_logprobs in the engine (tiny Qwen3, CPU, invariant numerics).

A prompt token's logprob must carry the same bits as the trainer's
(Policy.token_logprobs) and as the sampled-token logprob the engine reports when it
generates that token after the same prefix; compared as bit patterns, never allclose.
Covered: chunked prefill (a prompt cut over several steps), async scheduling, batching
with requests that do not ask, prefix-cache hits (skipped while prompt logprobs are
missing), preemption, n > 1, the logprobs modes, bad values.
"""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.training.policy import Policy

PROMPT = list(range(5, 45))      # 40 tokens: three steps at max_num_batched_tokens=16


def bits(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(torch.int32)


def prompt_values(out, prompt=PROMPT) -> list[float]:
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(prompt) and pl[0] is None
    return [pl[i][prompt[i]].logprob for i in range(1, len(prompt))]


@pytest.fixture(scope="module")
def policy(tiny_qwen3):
    return Policy.from_pretrained(tiny_qwen3, device="cpu")


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(tiny_qwen3, device="cpu", max_num_batched_tokens=16)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_chunked_prefill_bits_equal_trainer(tiny_qwen3, policy, async_scheduling, temperature):
    llm = LLM(tiny_qwen3, device="cpu", max_num_batched_tokens=16, async_scheduling=async_scheduling)
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(max_tokens=2, temperature=temperature, seed=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    trainer = policy.token_logprobs([PROMPT], [1], temperature=temperature)[0].detach()
    assert torch.equal(bits(prompt_values(out)), trainer.view(torch.int32))
    for i in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[i]
        ranked = sorted((lp.rank, tid) for tid, lp in entry.items() if tid != PROMPT[i] or lp.rank <= 2)
        assert [r for r, _ in ranked][:2] == [1, 2]          # the top-2 alternatives, best first
        assert entry[PROMPT[i]].rank >= 1
        assert entry[PROMPT[i]].decoded_token is not None


def test_prompt_logprob_equals_sampled_logprob(llm):
    """Generate a token, then score the prompt extended by it: the same bits, rank and top-k."""
    params = SamplingParams(max_tokens=1, temperature=0.8, seed=11, logprobs=3)
    gen = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
    tok, sampled = gen.token_ids[0], gen.logprobs[0]
    extended = PROMPT + [tok]
    scored = llm.generate({"prompt_token_ids": extended},
                          SamplingParams(max_tokens=1, temperature=0.8, prompt_logprobs=3), use_tqdm=False)[0]
    entry = scored.prompt_logprobs[-1]
    assert bits([entry[tok].logprob]).item() == bits([sampled[tok].logprob]).item()
    assert entry[tok].rank == sampled[tok].rank
    assert {t: (lp.rank, bits([lp.logprob]).item()) for t, lp in entry.items()} == \
           {t: (lp.rank, bits([lp.logprob]).item()) for t, lp in sampled.items()}


def test_batched_with_requests_that_do_not_ask(llm):
    prompts = [PROMPT, PROMPT[:7], list(range(100, 133)), [9]]
    alone = [llm.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1),
                          use_tqdm=False)[0] for p in prompts]
    mixed_params = [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1 if i % 2 == 0 else None)
                    for i in range(len(prompts))] + [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts + [prompts[1]]], mixed_params, use_tqdm=False)
    for i, p in enumerate(prompts):
        if i % 2:
            assert outs[i].prompt_logprobs is None
        else:
            assert torch.equal(bits(prompt_values(outs[i], p)), bits(prompt_values(alone[i], p)))
        assert outs[i].outputs[0].token_ids == alone[i].outputs[0].token_ids
    assert torch.equal(bits(prompt_values(outs[-1], prompts[1])), bits(prompt_values(alone[1], prompts[1])))
    assert alone[3].prompt_logprobs == [None]   # a one-token prompt has no prompt logprob


def test_prefix_cache_hit_is_skipped_for_prompt_logprobs(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu", max_num_batched_tokens=64, enable_prefix_caching=True)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    first = llm.generate({"prompt_token_ids": PROMPT}, greedy, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    hit = llm.generate({"prompt_token_ids": PROMPT}, greedy, use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0                  # the cache holds the prefix
    scored = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0),
                          use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0              # recomputed: a cached prefix has no logits
    assert all(e is not None for e in scored.prompt_logprobs[1:])
    assert scored.outputs[0].token_ids == first.outputs[0].token_ids
    cold = LLM(tiny_qwen3, device="cpu", max_num_batched_tokens=64, enable_prefix_caching=False)
    ref = cold.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0),
                        use_tqdm=False)[0]
    assert torch.equal(bits(prompt_values(scored)), bits(prompt_values(ref)))


def test_preemption_keeps_prompt_logprobs(tiny_qwen3, policy):
    # 6 blocks of 16 tokens for two 40-token prompts generating 20 tokens each: preemption
    llm = LLM(tiny_qwen3, device="cpu", max_num_batched_tokens=16, num_gpu_blocks_override=7)
    prompts = [PROMPT, list(range(60, 100))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=0), use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    trainer = policy.token_logprobs(prompts, [1, 1], temperature=0)
    for out, p, ref in zip(outs, prompts, trainer):
        assert torch.equal(bits(prompt_values(out, p)), ref.detach().view(torch.int32))


def test_n_samples_and_modes(llm, policy):
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=5,
                                                                     prompt_logprobs=0), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    ref = policy.token_logprobs([PROMPT], [1], temperature=1.0)[0].detach()
    assert torch.equal(bits(prompt_values(out)), ref.view(torch.int32))
    # raw_logprobs ignores the temperature: the T = 1 distribution
    raw = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, temperature=0.5, prompt_logprobs=0,
                                                                     logprobs_mode="raw_logprobs"), use_tqdm=False)[0]
    assert torch.equal(bits(prompt_values(raw)), ref.view(torch.int32))
    # processed_logprobs: no truncation or penalties apply to prompt positions -> tempered
    proc = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, temperature=0.5, top_k=3,
                                                                      prompt_logprobs=0,
                                                                      logprobs_mode="processed_logprobs"),
                        use_tqdm=False)[0]
    ref_half = policy.token_logprobs([PROMPT], [1], temperature=0.5)[0].detach()
    assert torch.equal(bits(prompt_values(proc)), ref_half.view(torch.int32))


def test_bad_values_are_clear_errors(llm, tiny_qwen3):
    for bad in (-2, 1.5):   # True is upstream's 1, False none
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    # upstream's cap (max_logprobs, 20 unless the LLM is given another) and its message
    with pytest.raises(ValueError, match="Requested prompt logprobs of 21, which is greater than max allowed: 20"):
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(prompt_logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="Requested prompt logprobs of 512, which is greater than max allowed: 20"):
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(prompt_logprobs=-1), use_tqdm=False)
    uncapped = LLM(tiny_qwen3, device="cpu", max_logprobs=10**12)
    with pytest.raises(ValueError, match="prompt_logprobs=.* exceeds the vocabulary"):
        uncapped.generate({"prompt_token_ids": PROMPT}, SamplingParams(prompt_logprobs=10**9), use_tqdm=False)
    # the engine serves on
    out = llm.generate({"prompt_token_ids": PROMPT[:5]}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == 5


def test_minus_one_is_every_token_of_the_vocabulary(tiny_qwen3):
    """prompt_logprobs=-1 and logprobs=-1 (upstream's): every token of the vocabulary, on an
    LLM whose max_logprobs allows it (-1); the prompt token's and the sampled token's values
    are the bits of prompt_logprobs=0 / logprobs=0, and the ranks run 1..V."""
    llm = LLM(tiny_qwen3, device="cpu", max_logprobs=-1)
    V = llm.llm_engine.model_config.get_vocab_size()
    full = llm.generate({"prompt_token_ids": PROMPT[:8]}, SamplingParams(max_tokens=2, temperature=0.8, seed=4,
                                                                         prompt_logprobs=-1, logprobs=-1),
                        use_tqdm=False)[0]
    small = llm.generate({"prompt_token_ids": PROMPT[:8]}, SamplingParams(max_tokens=2, temperature=0.8, seed=4,
                                                                          prompt_logprobs=0, logprobs=0),
                         use_tqdm=False)[0]
    assert full.outputs[0].token_ids == small.outputs[0].token_ids
    assert torch.equal(bits(prompt_values(full, PROMPT[:8])), bits(prompt_values(small, PROMPT[:8])))
    for entry in full.prompt_logprobs[1:] + full.outputs[0].logprobs:
        assert len(entry) == V
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks[0] == 1 and ranks[-1] <= V
    sampled = [d[t].logprob for d, t in zip(full.outputs[0].logprobs, full.outputs[0].token_ids)]
    assert bits(sampled).tolist() == bits([d[t].logprob for d, t in zip(small.outputs[0].logprobs,
                                                                        small.outputs[0].token_ids)]).tolist()
