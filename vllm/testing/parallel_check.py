"""Logprobs of a model sharded over processes, for tests and the GPU suite: EP=P
(`ep_token_logprobs`) and TP=C (`tp_token_logprobs`) against one process.

One process per rank (torch.multiprocessing spawn, gloo on CPU or NCCL on GPUs): each rank
loads the same checkpoint as a Policy, applies the parallelism over the process group
(keeping only its experts or shards) and scores sequences with `token_logprobs` under
no_grad. Every rank runs the same number of forward passes, so the collectives line up. The
checkpoint is read without a tokenizer (token ids only), which keeps transformers out of the
workers' start-up.
"""
from __future__ import annotations

import os
import tempfile

import torch


def _apply(model, kind: str, leaves: int | None, group) -> None:
    if kind == "ep":
        from vllm.parallel.expert_parallel import apply_expert_parallel
        apply_expert_parallel(model, group=group)
    else:
        from vllm.parallel.tensor_parallel import apply_tensor_parallel
        apply_tensor_parallel(model, leaves=leaves, group=group)


def _worker(rank: int, world: int, init_file: str, path: str, sequences_per_rank, prompt_lens_per_rank, kind: str,
            leaves: int | None, numerics: str, device: str, out_dir: str) -> None:
    import torch.distributed as dist

    from vllm.model_loader.build import build_model, read_model_config, resolve_numerics
    from vllm.training import Policy

    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        mc = read_model_config(path)
        spec = resolve_numerics(mc, dev, numerics=numerics)
        policy = Policy(build_model(mc, spec, dev)[0], mc, spec, torch.device(dev))
        _apply(policy.model, kind, leaves, dist.group.WORLD)
        with torch.no_grad():
            lps = policy.token_logprobs(sequences_per_rank[rank], prompt_lens_per_rank[rank])
        torch.save([t.cpu() for t in lps], os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(path: str, sequences_per_rank: list, prompt_lens_per_rank: list, kind: str, leaves: int | None,
           numerics: str, device: str) -> list[list[torch.Tensor]]:
    import torch.multiprocessing as mp

    world = len(sequences_per_rank)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "rendezvous"), path, sequences_per_rank, prompt_lens_per_rank,
                                kind, leaves, numerics, device, d), nprocs=world, join=True)
        return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)]


def ep_token_logprobs(path: str, sequences_per_rank: list, prompt_lens_per_rank: list, numerics: str = "invariant",
                      device: str = "cpu") -> list[list[torch.Tensor]]:
    """Per rank, the float32 logprobs of its own sequences with the experts sharded over
    len(sequences_per_rank) processes."""
    return _spawn(path, sequences_per_rank, prompt_lens_per_rank, "ep", None, numerics, device)


def tp_token_logprobs(path: str, sequences: list, prompt_lens: list, world: int = 2, leaves: int = 8,
                      numerics: str = "invariant", device: str = "cpu") -> list[list[torch.Tensor]]:
    """Per rank, the float32 logprobs of `sequences` (every rank scores all of them: every
    rank runs every layer) with the model sharded over `world` processes; all must be equal."""
    return _spawn(path, [sequences] * world, [prompt_lens] * world, "tp", leaves, numerics, device)
