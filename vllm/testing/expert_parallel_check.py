"""EP=1 vs EP=P logprobs, for tests and the GPU suite.

`ep_token_logprobs` runs one process per rank (torch.multiprocessing spawn, gloo on CPU
or NCCL on GPUs): each rank loads the same checkpoint as a Policy, applies expert
parallelism over the process group (keeping only its experts), and scores its own
sequences with `token_logprobs` under no_grad. Every rank runs the same number of
forward passes (one micro-batch each), so the MoE layers' collectives line up.
"""
from __future__ import annotations

import os
import tempfile

import torch


def _worker(rank: int, world: int, init_file: str, path: str, sequences, prompt_lens, numerics: str, device: str,
            out_dir: str) -> None:
    import torch.distributed as dist

    from vllm.model_loader.build import build_model, resolve_model
    from vllm.parallel.expert_parallel import apply_expert_parallel
    from vllm.training import Policy

    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        # no tokenizer (scoring token ids only): keeps transformers out of the workers' start-up
        mc, dtype = resolve_model(path, dtype="auto", device=dev)
        policy = Policy(build_model(mc, dtype, dev, numerics=numerics)[0], mc, dtype, torch.device(dev), numerics)
        apply_expert_parallel(policy.model, group=dist.group.WORLD)
        with torch.no_grad():
            lps = policy.token_logprobs(sequences[rank], prompt_lens[rank])
        torch.save([t.cpu() for t in lps], os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def ep_token_logprobs(path: str, sequences_per_rank: list, prompt_lens_per_rank: list, numerics: str = "invariant",
                      device: str = "cpu") -> list[list[torch.Tensor]]:
    """Per rank, the float32 logprobs of its sequences computed with experts sharded over
    len(sequences_per_rank) processes."""
    import torch.multiprocessing as mp

    world = len(sequences_per_rank)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "rendezvous"), path, sequences_per_rank, prompt_lens_per_rank,
                                numerics, device, d), nprocs=world, join=True)
        return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)]
