"""Recurrent hybrids on sequences that cross chunk boundaries (Gated DeltaNet's chunk of 64,
Mamba-2's of 16): the engine's logprobs equal the trainer's bit for bit with a warm prefix
cache (snapshots at lcm(block size, chunk) restored), chunked prefill, preemption, n > 1,
and after an in-place weight update and a sleep / wake."""
from __future__ import annotations

import random

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.training import Policy

TEMPERATURE = 0.8


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    # 150 shared tokens: past the first prompt's snapshot point (its last multiple of
    # lcm(block size, chunk): 128 for Gated DeltaNet, 144 for Mamba-2), where a hit can start
    shared = [rng.randrange(3, 500) for _ in range(150)]
    return [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (5, 30)] + \
        [[rng.randrange(3, 500) for _ in range(129)]]


def _rollout(llm, prompts, n=1):
    sp = SamplingParams(temperature=TEMPERATURE, max_tokens=12, seed=7, logprobs=0, ignore_eos=True, n=n)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    seqs, plens, lps = [], [], []
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            seqs.append(p + list(c.token_ids))
            plens.append(len(p))
            lps.append(torch.tensor([c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)], dtype=torch.float32))
    return outs, seqs, plens, lps


def _assert_trainer_bits(model_dir, seqs, plens, lps, policy=None):
    policy = policy or Policy.from_pretrained(model_dir, device="cpu", numerics="invariant")
    with torch.no_grad():
        got = policy.token_logprobs(seqs, plens, temperature=TEMPERATURE)
    for i, (g, r) in enumerate(zip(got, lps)):
        assert torch.equal(g.detach().float().view(torch.int32), r.view(torch.int32)), f"sequence {i}"


@pytest.mark.parametrize("model", ["tiny_qwen3_next", "tiny_nemotron_h"])
def test_warm_prefix_chunked_prefill_and_preemption_keep_trainer_bits(model, request):
    path = request.getfixturevalue(model)
    prompts = _prompts()
    llm = LLM(path, device="cpu", dtype="float32", numerics="invariant", block_size=8, max_num_batched_tokens=37,
              num_gpu_blocks_override=48)
    _rollout(llm, prompts[:1])                        # warms the shared prefix
    outs, seqs, plens, lps = _rollout(llm, prompts[1:2])
    assert outs[0].num_cached_tokens >= 128           # a hit past a chunk boundary: a snapshot restored
    _assert_trainer_bits(path, seqs, plens, lps)
    _, seqs, plens, lps = _rollout(llm, prompts, n=2)   # more than the blocks hold at once
    assert llm.llm_engine.scheduler.num_preemptions > 0
    _assert_trainer_bits(path, seqs, plens, lps)


def test_hybrid_update_and_sleep_keep_trainer_bits(tiny_qwen3_next, tiny_models_root):
    """After an in-place update the engine drops the recurrent snapshots of the old weights:
    a warm prompt then gives the new trainer's bits; the same after sleep(1) / wake_up."""
    from vllm.testing.tiny_models import make_tiny_checkpoint

    other = make_tiny_checkpoint(tiny_models_root / "qwen3_next_other", "qwen3_next", head_dim=32, num_hidden_layers=4,
                                 seed=11, config_overrides={"mlp_only_layers": [1]})
    prompts = _prompts()
    llm = LLM(tiny_qwen3_next, device="cpu", dtype="float32", numerics="invariant", block_size=8,
              enable_sleep_mode=True)
    _rollout(llm, prompts[:1])
    new = Policy.from_pretrained(other, device="cpu", numerics="invariant")
    llm.update_weights(new.model.hf_state_dict(), contract=new.execution_contract(), require_complete=True)
    outs, seqs, plens, lps = _rollout(llm, prompts)
    assert outs[1].num_cached_tokens == 0             # nothing of the old weights is reused
    _assert_trainer_bits(other, seqs, plens, lps, policy=new)
    llm.sleep(level=1)
    llm.wake_up()
    _, seqs, plens, lps = _rollout(llm, prompts)
    _assert_trainer_bits(other, seqs, plens, lps, policy=new)


@pytest.mark.parametrize("model", ["tiny_qwen3_next", "tiny_nemotron_h"])
def test_a_shared_prefix_gets_its_own_snapshot(model, request):
    """Prompts sharing 140 tokens (a system prompt) whose own snapshot points lie past it: the
    first leaves KV for the shared part but no snapshot on it; the second, admitted with
    that KV cached, snapshots at the last grid point inside it (keyed to the first's block);
    the third restores it. Every sample equals the trainer's bits."""
    path = request.getfixturevalue(model)
    rng = random.Random(1)
    shared = [rng.randrange(3, 500) for _ in range(140)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(60 + 5 * i)] for i in range(3)]
    llm = LLM(path, device="cpu", dtype="float32", numerics="invariant", block_size=8)
    grid = llm.llm_engine.scheduler.kv.state_grid
    cached, seqs, plens, lps = [], [], [], []
    for p in prompts:
        outs, s, pl, lp = _rollout(llm, [p])
        cached.append(outs[0].num_cached_tokens)
        seqs += s
        plens += pl
        lps += lp
    assert cached[0] == 0 and cached[1] == 0
    assert cached[2] == 136 // grid * grid > 0      # 17 whole blocks of 8 shared, cut to the grid
    _assert_trainer_bits(path, seqs, plens, lps)

