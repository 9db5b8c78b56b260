"""Checks the GPU tests of the dense and the MoE models share (tests/test_gpu_training.py,
tests/test_gpu_engine.py, tests/test_moe_gpu.py): each takes an engine and asserts the same
property, so both architectures are held to one definition of it."""
from __future__ import annotations

import torch

from vllm import LLM, SamplingParams


def assert_rollout_equals_trainer(llm: LLM, model_path: str) -> None:
    """Sampled rollouts' logprobs (temperature 0.9, prompts of 5-700 tokens) equal the
    trainer's recomputation bit for bit at every micro-batch budget, and the trainer's
    backward gives every parameter a finite gradient."""
    from vllm.training import Policy
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 100, 37, 700, 12, 64)]
    sp = SamplingParams(temperature=0.9, max_tokens=24, seed=5, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
    roll = [torch.tensor([o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(o.outputs[0].token_ids)])
            for o in outs]
    policy = Policy.from_pretrained(model_path, device="cuda", numerics="invariant")
    plens = [len(p) for p in prompts]
    for budget in (None, 800, 1):
        got = policy.token_logprobs(seqs, plens, temperature=0.9, max_tokens_per_micro_batch=budget)
        for a, b in zip(got, roll):
            assert torch.equal(a.detach().cpu().view(torch.int32), b.view(torch.int32)), f"budget {budget}"
    lps = policy.token_logprobs(seqs[:2], plens[:2], temperature=0.9)
    sum(lp.sum() for lp in lps).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in policy.parameters())


def assert_launch_never_syncs(llm: LLM, sps) -> None:
    """With async scheduling, launching a step never waits for the GPU: every launch runs
    under torch's sync debug mode set to raise (after a warm-up run: compilation and the
    pinned-memory pool may synchronise once)."""
    runner = llm.llm_engine.executor.worker
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (9, 40, 70)]
    llm.generate(prompts, sps, use_tqdm=False)
    launch, checked = runner.launch, []

    def strict_launch(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(1)
    runner.launch = strict_launch
    try:
        outs = llm.generate(prompts, sps, use_tqdm=False)
    finally:
        runner.launch = launch
    assert len(checked) >= 12 and all(len(o.outputs[0].token_ids) == 12 for o in outs)
