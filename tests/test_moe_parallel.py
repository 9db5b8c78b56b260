"""Expert parallelism gives EP=1's bits: experts sharded over two gloo processes (each rank
scoring its own sequences), and over partitions inside one process (the mode for one
GPU), through the same dispatch and fixed-slot merge code."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.parallel.expert_parallel import apply_expert_parallel
from vllm.testing.parallel_check import ep_token_logprobs
from vllm.testing.parity_battery import signature
from vllm.training import Policy


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _sequences():
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (17, 30, 9)]
    return seqs, [5, 12, 4]


def test_ep2_over_gloo_equals_ep1_bits(tiny_qwen3_moe):
    seqs, plens = _sequences()
    per_rank_seqs, per_rank_plens = [seqs[:2], seqs[2:]], [plens[:2], plens[2:]]
    ep2 = ep_token_logprobs(tiny_qwen3_moe, per_rank_seqs, per_rank_plens, numerics="invariant")
    policy = Policy.from_pretrained(tiny_qwen3_moe, device="cpu", numerics="invariant")
    with torch.no_grad():
        for rank in range(2):
            ep1 = policy.token_logprobs(per_rank_seqs[rank], per_rank_plens[rank])
            assert len(ep2[rank]) == len(ep1)
            for a, b in zip(ep2[rank], ep1):
                assert torch.equal(bits(a), bits(b)), rank


@pytest.mark.parametrize("partitions", [2, 4])
def test_in_process_partitions_equal_ep1_in_the_engine(tiny_qwen3_moe, partitions):
    llm = LLM(tiny_qwen3_moe, device="cpu", numerics="invariant", block_size=4)
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=g).tolist()} for n in (21, 3, 14, 30)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=5, logprobs=0, ignore_eos=True) for i in range(4)]
    ep1 = [signature(o.outputs[0]) for o in llm.generate(prompts, params, use_tqdm=False)]
    apply_expert_parallel(llm.llm_engine.executor.model, partitions)
    llm.reset_prefix_cache()
    ep = [signature(o.outputs[0]) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert ep == ep1


def test_in_process_partitions_with_one_partition_idle(tiny_qwen3_moe):
    """Router zeroed: every token goes to experts (0, 1), all in partition 0; partition 1
    receives nothing. Still EP=1's bits, for rollout and the trainer's logprobs."""
    llm = LLM(tiny_qwen3_moe, device="cpu", numerics="invariant")
    model = llm.llm_engine.executor.model
    llm.update_weights({n: torch.zeros_like(t) for n, t in model.hf_state_dict().items() if n.endswith("mlp.gate.weight")})
    prompt = {"prompt_token_ids": list(range(100, 125))}
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=5, logprobs=0, ignore_eos=True)
    ep1 = signature(llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0])
    policy = llm.policy()
    seq, plen = prompt["prompt_token_ids"] + list(ep1[0]), 25
    with torch.no_grad():
        before = policy.token_logprobs([seq], [plen])[0]
    apply_expert_parallel(model, 2)
    llm.reset_prefix_cache()
    assert signature(llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]) == ep1
    with torch.no_grad():
        assert torch.equal(bits(policy.token_logprobs([seq], [plen])[0]), bits(before))


def test_expert_parallel_refusals(tiny_qwen3_moe, tiny_qwen3):
    policy = Policy.from_pretrained(tiny_qwen3_moe, device="cpu", numerics="invariant")
    with pytest.raises(ValueError, match="cannot be split into 3"):
        apply_expert_parallel(policy.model, 3)
    with pytest.raises(ValueError, match="num_partitions"):
        apply_expert_parallel(policy.model)
    with pytest.raises(ValueError, match="integer num_partitions"):
        apply_expert_parallel(policy.model, 2.0)
    apply_expert_parallel(policy.model, 2)
    with pytest.raises(ValueError, match="already applied"):
        apply_expert_parallel(policy.model, 2)
    dense = Policy.from_pretrained(tiny_qwen3, device="cpu")
    with pytest.raises(ValueError, match="no MoE layer"):
        apply_expert_parallel(dense.model, 2)


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_in_process_partitions_equal_ep1(tmp_path):
    """bf16 on one GPU: two expert partitions in one process (eager: EP reads per-partition
    counts on the host) give the bits of EP=1 with CUDA graphs, for rollout and trainer."""
    from vllm.testing.tiny_models import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", hidden_size=512, num_hidden_layers=3,
                                num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=1024,
                                dtype=torch.bfloat16, init_std=0.05,
                                config_overrides={"num_experts": 16, "num_experts_per_tok": 4,
                                                  "moe_intermediate_size": 256, "mlp_only_layers": [1]})
    g = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=g).tolist()} for n in (50, 7, 130, 33)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=12, logprobs=0, ignore_eos=True) for i in range(4)]
    graphs = LLM(path, numerics="invariant", gpu_memory_utilization=0.3)
    ep1 = [signature(o.outputs[0]) for o in graphs.generate(prompts, params, use_tqdm=False)]
    del graphs
    llm = LLM(path, numerics="invariant", enforce_eager=True, gpu_memory_utilization=0.3)
    apply_expert_parallel(llm.llm_engine.executor.model, 2)
    assert [signature(o.outputs[0]) for o in llm.generate(prompts, params, use_tqdm=False)] == ep1
    seqs = [p["prompt_token_ids"] + list(s[0]) for p, s in zip(prompts, ep1)]
    with torch.no_grad():
        got = llm.policy().token_logprobs(seqs, [len(p["prompt_token_ids"]) for p in prompts])
    for lp, s in zip(got, ep1):
        assert torch.equal(bits(lp.cpu()), torch.tensor(list(s[1]), dtype=torch.int32))
