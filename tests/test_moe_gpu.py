"""Qwen3-MoE on the GPU (bf16): the invariance battery incl. CUDA graphs vs eager, rollout
(graphs) == trainer bits, gradients against transformers, the start-up self-check, the
crowded-expert case and the fast baseline (torch._grouped_mm)."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.testing.gpu_checks import assert_launch_never_syncs, assert_rollout_equals_trainer
from vllm.testing.parity_battery import Battery, signature
from vllm.training import Policy

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_moe_model(tmp_path_factory):
    from vllm.testing.tiny_models import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gpu_moe"), "qwen3_moe", hidden_size=512, num_hidden_layers=3,
                                num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=1024,
                                dtype=torch.bfloat16, max_position_embeddings=2048, init_std=0.05,
                                config_overrides={"num_experts": 16, "num_experts_per_tok": 4,
                                                  "moe_intermediate_size": 256, "mlp_only_layers": [1]})


def _llm(path, **kw):
    opts = dict(device="cuda", numerics="invariant", gpu_memory_utilization=0.2, max_num_batched_tokens=1024,
                cuda_graph_batch_sizes=[1, 2, 4, 8, 16, 32, 64])
    opts.update(kw)
    return LLM(path, **opts)


def test_gpu_moe_invariant_battery(gpu_moe_model):
    bat = Battery(lambda **kw: _llm(gpu_moe_model, **kw), vocab=512, max_tokens=10, batch_sizes=(3, 33), long_len=200)
    for res in bat.run_all(gpu=True):
        assert res.differing == 0, f"{res.name}: {res.differing}/{res.comparisons} ({res.detail})"


def test_gpu_moe_rollout_equals_trainer_bits(gpu_moe_model):
    llm = _llm(gpu_moe_model)
    assert_rollout_equals_trainer(llm, gpu_moe_model)


def test_gpu_moe_gradients_vs_transformers(gpu_moe_model):
    from transformers import AutoModelForCausalLM
    prompts = [list(range(5, 60)), list(range(100, 130))]
    seqs = [p + [7, 8, 9, 10] for p in prompts]
    plens = [len(p) for p in prompts]
    hf = AutoModelForCausalLM.from_pretrained(gpu_moe_model, dtype=torch.float64, attn_implementation="eager",
                                              experts_implementation="eager", local_files_only=True).cuda().eval()
    ref_lps = []
    for s, pl in zip(seqs, plens):
        lp = torch.log_softmax(hf(torch.tensor([s], device="cuda")).logits[0], -1)
        ref_lps.append(lp[pl - 1:len(s) - 1].gather(1, torch.tensor(s[pl:], device="cuda")[:, None])[:, 0])
    sum(lp.sum() for lp in ref_lps).backward()
    ref = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None and p.grad.norm() > 0}
    # fast bf16 runs torch._grouped_mm under torch's own autograd; fast float32 and invariant
    # run the grouped Triton kernels under GroupedGemmFn
    for numerics, dtype, tol in (("fast", "float32", 2e-2), ("fast", "bfloat16", 0.1), ("invariant", "bfloat16", 0.1)):
        pol = Policy.from_pretrained(gpu_moe_model, device="cuda", dtype=dtype, numerics=numerics)
        sum(lp.sum() for lp in pol.token_logprobs(seqs, plens)).backward()
        ours = pol.model.hf_state_dict(grads=True)
        ours.update({n: p.grad for n, p in pol.model.named_parameters() if ".experts." in n})
        for name, g in ref.items():
            err = ((ours[name].double() - g).norm() / g.norm()).item()
            assert err < tol, f"{numerics} {name}: relative gradient error {err:.2e}"
        assert any(".experts.gate_up_proj" in n for n in ref) and any(".mlp.gate.weight" in n for n in ref)


def test_gpu_moe_selfcheck_contract_and_crowded_experts(gpu_moe_model):
    llm = _llm(gpu_moe_model)
    report = llm.llm_engine.executor.info.self_check_report
    assert "model.layers.0.mlp" in report and report["model.layers.0.mlp"]["experts"] == 16
    assert llm.execution_contract().numerical["layer_kernels"]["moe"]["experts"]["kernel"].startswith("triton grouped gemm")
    model = llm.llm_engine.executor.model
    llm.update_weights({n: torch.zeros_like(t) for n, t in model.hf_state_dict().items() if n.endswith("mlp.gate.weight")})
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=20, logprobs=0, ignore_eos=True)
    target = {"prompt_token_ids": list(range(40, 140))}
    alone = signature(llm.generate(target, sp, use_tqdm=False)[0].outputs[0])
    g = torch.Generator().manual_seed(0)
    crowd = [{"prompt_token_ids": torch.randint(3, 500, (int(n),), generator=g).tolist()}
             for n in torch.randint(1, 400, (60,), generator=g)]
    outs = llm.generate(crowd[:30] + [target] + crowd[30:], [SamplingParams(temperature=1.0, seed=i, max_tokens=20,
                        ignore_eos=True) for i in range(30)] + [sp] +
                        [SamplingParams(temperature=1.0, seed=i, max_tokens=20, ignore_eos=True) for i in range(30, 60)],
                        use_tqdm=False)
    assert signature(outs[30].outputs[0]) == alone


def test_gpu_moe_fast_mode_uses_grouped_mm_and_captures_graphs(gpu_moe_model):
    from vllm.kernels import moe as K
    llm = _llm(gpu_moe_model, numerics="fast")
    assert llm.llm_engine.executor.info.has_cuda_graphs
    outs = llm.generate([{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 300)],
                        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    if hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability()[0] >= 9:
        assert not K._GROUPED_MM_BROKEN, "torch._grouped_mm refused: fast mode measured the Triton kernel instead"


@pytest.mark.parametrize("numerics", ["fast", "invariant"])
def test_gpu_moe_async_launch_never_waits_for_the_gpu(gpu_moe_model, numerics):
    """The MoE step (routing, the expert plan, grouped GEMMs, merge) uses device ops only:
    launching a step under torch's sync debug mode set to raise must not synchronise."""
    llm = _llm(gpu_moe_model, numerics=numerics, async_scheduling=True, cuda_graph_batch_sizes=[1, 2, 4, 8])
    assert_launch_never_syncs(llm, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1, logprobs=0))
