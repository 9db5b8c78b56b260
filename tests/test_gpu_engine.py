"""Engine on the GPU (bf16): transformers agreement, CUDA graphs, invariant battery."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.testing.gpu_checks import assert_launch_never_syncs

pytestmark = pytest.mark.gpu



def test_gpu_greedy_close_to_transformers(gpu_model):
    from vllm.testing.tiny_models import load_hf_model
    # float32 against transformers' float32: the fast path (invariant numerics are verified
    # on the GPU for bf16/fp16, and refuse float32: test_gpu_invariant_selfcheck_and_contract)
    llm = LLM(gpu_model, device="cuda", dtype="float32", numerics="fast", gpu_memory_utilization=0.2,
              enforce_eager=True)
    hf = load_hf_model(gpu_model, torch.float32, device="cuda")
    prompt = list(range(5, 60))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids], device="cuda")).logits[0].double()
    ref = torch.log_softmax(logits, -1)
    for i, t in enumerate(out.token_ids):
        assert abs(out.logprobs[i][t].logprob - ref[len(prompt) - 1 + i, t].item()) < 2e-2


@pytest.mark.parametrize("numerics", ["fast", "invariant"])
def test_gpu_graph_and_eager_agree_on_tokens(gpu_model, numerics):
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 100, 7, 250)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    eager = LLM(gpu_model, device="cuda", numerics=numerics, gpu_memory_utilization=0.2, enforce_eager=True)
    a = [o.outputs[0].token_ids for o in eager.generate(prompts, sp, use_tqdm=False)]
    del eager
    graph = LLM(gpu_model, device="cuda", numerics=numerics, gpu_memory_utilization=0.2, cuda_graph_batch_sizes=[1, 2, 4, 8])
    assert graph.llm_engine.executor.info.has_cuda_graphs
    b = [o.outputs[0].token_ids for o in graph.generate(prompts, sp, use_tqdm=False)]
    if numerics == "invariant":
        assert a == b


def test_gpu_invariant_battery(gpu_model):
    from vllm.testing.parity_battery import Battery

    def make(**kw):
        opts = dict(device="cuda", numerics="invariant", gpu_memory_utilization=0.2, max_num_batched_tokens=1024,
                    cuda_graph_batch_sizes=[1, 2, 4, 8, 16, 32, 64])
        opts.update(kw)
        return LLM(gpu_model, **opts)
    bat = Battery(make, vocab=512, max_tokens=10, batch_sizes=(3, 33), long_len=200)
    for res in bat.run_all(gpu=True):
        assert res.differing == 0, f"{res.name}: {res.differing}/{res.comparisons} ({res.detail})"


def test_gpu_invariant_selfcheck_and_contract(gpu_model):
    llm = LLM(gpu_model, device="cuda", numerics="invariant", gpu_memory_utilization=0.2, enforce_eager=True)
    assert llm.llm_engine.executor.info.self_check_report
    c = llm.execution_contract()
    assert c.numerical["device"]["type"] == "cuda"
    with pytest.raises(ValueError, match="verified"):
        LLM(gpu_model, device="cuda", numerics="invariant", dtype="float32", gpu_memory_utilization=0.2)


@pytest.mark.parametrize("numerics", ["fast", "invariant"])
def test_gpu_async_launch_never_waits_for_the_gpu(gpu_model, numerics):
    """With async scheduling, launching step N+1 must not synchronise the host with the
    GPU (a blocking H2D copy, .item(), .tolist(), nonzero ...): otherwise the host work of
    the next step cannot overlap the GPU and async scheduling buys nothing. Checked with
    torch's sync debug mode set to raise, for prefill (eager) and decode (graph) steps,
    temperature and greedy rows, with and without the sampled token's logprob, and
    logprobs=1 (two sampler groups in one step). Top-k / top-p / logprobs >= 2 still
    read one value back per step for exact tie handling (docs/sampling.md)."""
    llm = LLM(gpu_model, device="cuda", numerics=numerics, gpu_memory_utilization=0.2, async_scheduling=True,
              cuda_graph_batch_sizes=[1, 2, 4, 8])
    assert_launch_never_syncs(llm, [
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1, logprobs=0),
        SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True, seed=2, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)])


def test_gpu_kernel_options_are_bit_neutral(gpu_model):
    """gemm_cublaslt and fused_gumbel change which kernels compute, never a bit: the same
    tokens and logprob bits with both off, in invariant mode (this model's GEMM shapes take
    the generic tables, which have no cuBLASLt bucket: the GEMM half of the claim is
    test_invariant_kernels.py::test_gpu_cublaslt_nosplit_equals_triton at Qwen3-8B shapes);
    the contract records cuBLASLt's use in its numerical part and the sampler path in its
    deployment part."""
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5, logprobs=0)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (9, 40, 70, 300)]
    outs, contracts = [], []
    for opts in ({}, {"gemm_cublaslt": False, "fused_gumbel": False}):
        llm = LLM(gpu_model, device="cuda", numerics="invariant", gpu_memory_utilization=0.2,
                  max_num_batched_tokens=1024, **opts)
        res = llm.generate(prompts, sp, use_tqdm=False)
        outs.append([(o.outputs[0].token_ids, [o.outputs[0].logprobs[i][t].logprob
                                                for i, t in enumerate(o.outputs[0].token_ids)]) for o in res])
        contracts.append(llm.execution_contract())
        del llm
        torch.cuda.empty_cache()
    for (ta, la), (tb, lb) in zip(*outs):
        assert ta == tb
        assert torch.equal(torch.tensor(la).view(torch.int32), torch.tensor(lb).view(torch.int32))
    on, off = contracts
    assert off.numerical["kernels"]["linear"].endswith("(allow_cublaslt=False)")
    assert off.numerical["gemm"]["cublaslt"] is None
    assert on.deployment["fused_gumbel"] is True and off.deployment["fused_gumbel"] is False
