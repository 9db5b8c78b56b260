"""TP=1 vs TP=C logprobs across processes, for tests and the GPU suite.

`tp_token_logprobs` runs one process per rank (torch.multiprocessing spawn, gloo on CPU
or NCCL on GPUs): each rank loads the same checkpoint as a Policy, applies tensor
parallelism over the process group (keeping only its shards), and scores the same
sequences with `token_logprobs` under no_grad: every rank runs every layer, so the
collectives line up. Each rank's logprobs come back (they must all be equal).
"""
from __future__ import annotations

import os
import tempfile

import torch


def _worker(rank: int, world: int, init_file: str, path: str, sequences, prompt_lens, leaves: int, numerics: str,
            device: str, out_dir: str) -> None:
    import torch.distributed as dist

    from vllm.model_loader.build import build_model, resolve_model
    from vllm.parallel.tensor_parallel import apply_tensor_parallel
    from vllm.training import Policy

    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        mc, dtype = resolve_model(path, dtype="auto", device=dev)
        policy = Policy(build_model(mc, dtype, dev, numerics=numerics)[0], mc, dtype, torch.device(dev), numerics)
        apply_tensor_parallel(policy.model, leaves=leaves, group=dist.group.WORLD)
        with torch.no_grad():
            lps = policy.token_logprobs(sequences, prompt_lens)
        torch.save([t.cpu() for t in lps], os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def tp_token_logprobs(path: str, sequences: list, prompt_lens: list, world: int = 2, leaves: int = 8,
                      numerics: str = "invariant", device: str = "cpu") -> list[list[torch.Tensor]]:
    """Per rank, the float32 logprobs of `sequences` computed with the model sharded over
    `world` processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "rendezvous"), path, sequences, prompt_lens, leaves, numerics,
                                device, d), nprocs=world, join=True)
        return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)]
