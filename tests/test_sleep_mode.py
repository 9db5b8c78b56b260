"""Sleep mode: LLM.sleep() releases the KV cache while a colocated trainer runs,
LLM.wake_up() takes it back, and generation after wake gives the same bits as before
sleep (on CUDA: through the same captured graphs, at the same cache address)."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams

PROMPTS = [[5, 17, 3, 99, 41], [7, 8, 9], list(range(20, 51))]


def _run(llm, seed=3):
    sp = SamplingParams(n=2, temperature=0.9, max_tokens=12, seed=seed, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    toks = [c.token_ids for o in outs for c in o.outputs]
    lps = [torch.tensor([c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)], dtype=torch.float32)
           for o in outs for c in o.outputs]
    return toks, lps


def _same_bits(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a[1], b[1]))


def test_sleep_wake_same_bits_cpu(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant", enable_sleep_mode=True, cpu_kv_cache_bytes=4 << 20)
    before = _run(llm)
    runner = llm.llm_engine.executor.worker
    nbytes = sum(c.untyped_storage().nbytes() for c in runner.kv_cache.k + runner.kv_cache.v)
    freed = llm.sleep()
    assert freed == nbytes > 0
    assert all(c.untyped_storage().nbytes() == 0 for c in runner.kv_cache.k + runner.kv_cache.v)
    assert llm.llm_engine.is_sleeping()
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.sleep() == 0  # already asleep: nothing more to release
    # weights may change while asleep (the trainer's update) and survive
    w = next(iter(llm.policy().parameters()))
    w_bits = w.detach().clone()
    llm.wake_up()
    assert not llm.llm_engine.is_sleeping()
    assert torch.equal(w.detach(), w_bits)
    after = _run(llm)
    assert _same_bits(before, after)
    # a second cycle, with the prefix cache warm before it (it must be dropped by sleep)
    llm.sleep()
    llm.wake_up(tags=["kv_cache"])
    assert _same_bits(before, _run(llm))


def test_sleep_mode_bad_use(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant", cpu_kv_cache_bytes=4 << 20)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        llm.sleep()
    llm2 = LLM(tiny_qwen3, device="cpu", numerics="invariant", enable_sleep_mode=True, cpu_kv_cache_bytes=4 << 20)
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm2.sleep(level=3)
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        llm2.wake_up(tags=["kv"])
    with pytest.raises(ValueError, match="got '1'"):
        llm2.sleep(level="1")
    llm2.wake_up()  # awake already: nothing to do
    llm2.sleep()
    llm2.wake_up(tags="weights")  # one tag given bare
    assert llm2.llm_engine.is_sleeping()
    llm2.wake_up(tags=["weights"])  # the weights are never released: still asleep
    assert llm2.llm_engine.is_sleeping()
    llm2.wake_up()
    assert not llm2.llm_engine.is_sleeping()
    # TRL's colocate cycle: level 2, weights woken and loaded, then the KV cache
    w = next(iter(llm2.policy().parameters()))
    assert llm2.sleep(level=2) > 0
    llm2.wake_up(tags=["weights"])
    assert llm2.update_weights(llm2.policy().model.hf_state_dict(), require_complete=True) is not None
    llm2.wake_up(tags=["kv_cache"])
    assert not llm2.llm_engine.is_sleeping() and w.isfinite().all()


@pytest.mark.gpu
def test_sleep_wake_same_bits_gpu_graphs(gpu_model):
    """bf16 on the GPU with CUDA graphs: the cache comes back at the same address, the
    very same graph objects replay, the bits equal those before sleep, and the memory
    really goes back to the driver while asleep."""
    llm = LLM(gpu_model, device="cuda", numerics="invariant", enable_sleep_mode=True, gpu_memory_utilization=0.3,
              cuda_graph_batch_sizes=[1, 2, 4, 8])
    runner = llm.llm_engine.executor.worker
    assert runner.kv_cache.region is not None, "sleep mode on CUDA should place the KV cache in a driver VMM region"
    assert runner.decode_graphs.graphs, "the test needs captured CUDA graphs"
    before = _run(llm)
    ptrs = [c.data_ptr() for c in runner.kv_cache.k + runner.kv_cache.v]
    graphs = dict(runner.decode_graphs.graphs)
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    freed = llm.sleep()
    free_asleep, _ = torch.cuda.mem_get_info()
    print(f"sleep released {freed / 2**30:.2f} GiB; driver free memory +{(free_asleep - free_before) / 2**30:.2f} GiB")
    assert freed >= runner.num_blocks * runner.cache_plan.kv_bytes_per_block
    assert free_asleep - free_before >= 0.9 * freed
    # a trainer allocates (and frees) memory meanwhile
    scratch = torch.empty(freed // 2, dtype=torch.uint8, device="cuda")
    scratch.fill_(7)
    del scratch
    llm.wake_up()
    assert [c.data_ptr() for c in runner.kv_cache.k + runner.kv_cache.v] == ptrs
    assert runner.decode_graphs.graphs == graphs and all(runner.decode_graphs.graphs[k] is graphs[k] for k in graphs)
    after = _run(llm)
    assert _same_bits(before, after)


@pytest.mark.gpu
def test_sleep_wake_without_vmm_recaptures_gpu(gpu_model, monkeypatch):
    """The fallback when the driver VMM API is unavailable: torch memory, new addresses
    after wake, graphs re-captured; the bits are still those before sleep."""
    import vllm.worker.cuda_vmm as vmm

    def unavailable(*a, **k):
        raise ImportError("cuda-bindings not installed (simulated)")
    monkeypatch.setattr(vmm, "_driver", unavailable)
    llm = LLM(gpu_model, device="cuda", numerics="invariant", enable_sleep_mode=True, gpu_memory_utilization=0.3,
              cuda_graph_batch_sizes=[1, 2, 4, 8])
    runner = llm.llm_engine.executor.worker
    assert runner.kv_cache.region is None
    before = _run(llm)
    assert llm.sleep() > 0
    llm.wake_up()
    assert _same_bits(before, _run(llm))
