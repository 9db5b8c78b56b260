"""The invariance battery on a tiny Qwen3-MoE in numerics='invariant' (CPU here; bf16 with
CUDA graphs on the GPU in test_moe_gpu.py), and the crowded-expert case: tokens that all route to the same
experts (router weights zeroed: every probability ties, the lower-id rule sends every
token to experts 0..k-1) keep the bits they have alone. Bit patterns, never allclose."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.layers.moe import collect_router_stats
from vllm.testing.parity_battery import battery_check_params, cpu_battery, run_exercised_check, signature


@pytest.fixture(scope="module")
def battery(tiny_qwen3_moe):
    return cpu_battery(tiny_qwen3_moe)


@pytest.mark.parametrize("check, options", battery_check_params(n_identical=24, n_seeds=4))
def test_moe_invariant_battery(battery, check, options):
    run_exercised_check(battery, check, **options)


def _zero_router(llm):
    model = llm.llm_engine.executor.model
    zeros = {name: torch.zeros_like(t) for name, t in model.hf_state_dict().items() if name.endswith(".mlp.gate.weight")}
    assert len(zeros) == 2
    llm.update_weights(zeros)


def test_crowded_experts_keep_bits(tiny_qwen3_moe):
    """Router weights synced to zero (an MoE weight sync): all router probabilities tie, so
    every token goes to experts (0, 1) of every MoE layer; a request alone and the same
    request among 11 others crowding the same two experts give the same bits."""
    llm = LLM(tiny_qwen3_moe, device="cpu", numerics="invariant", block_size=4)
    _zero_router(llm)
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=5, logprobs=0, ignore_eos=True)
    target = {"prompt_token_ids": list(range(40, 61))}
    with collect_router_stats() as stats:
        alone = signature(llm.generate(target, sp, use_tqdm=False)[0].outputs[0])
    assert all(torch.equal(ids, torch.tensor([[0, 1]]).expand_as(ids)) for _, ids in stats.calls)
    g = torch.Generator().manual_seed(0)
    others = [{"prompt_token_ids": torch.randint(3, 500, (int(n),), generator=g).tolist()} for n in torch.randint(1, 30, (11,), generator=g)]
    outs = llm.generate(others[:6] + [target] + others[6:], [SamplingParams(temperature=1.0, seed=i, max_tokens=5, logprobs=0,
                                                                            ignore_eos=True) for i in range(6)] + [sp] +
                        [SamplingParams(temperature=1.0, seed=i, max_tokens=5, logprobs=0, ignore_eos=True) for i in range(6, 11)],
                        use_tqdm=False)
    assert signature(outs[6].outputs[0]) == alone
