"""The MoE kernels' start-up self-check (GPU, invariant mode): the grouped expert GEMM, the
router's logits GEMM and the slot merge give each row the same bits whatever the batch,
checked on the loaded model's expert shapes (vllm/kernels/moe.py; docs/moe.md)."""
from __future__ import annotations

from typing import Callable

import torch

from vllm.kernels import moe
from vllm.kernels.selfcheck import SelfCheckError

SELF_CHECK_MS = (1, 2, 3, 17, 64, 129, 256, 1024)


@torch.inference_mode()
def moe_self_check(blocks, device: torch.device, dtype: torch.dtype, max_tokens: int | None, *,
                   router_gemm: Callable, act: Callable) -> dict:
    """`blocks`: (name, MoE block) pairs of a loaded model (a block has `top_k`, a router
    `gate.weight` [E, H] and `experts.gate_up_proj` / `experts.down_proj`). For each
    distinct expert-layer shape: a token's expert outputs (float32, unrounded) computed in
    batches of M in SELF_CHECK_MS (each M picks its own block size and tiles) and with
    every token routed to the same k experts must equal the same rows computed in the
    largest batch, bit for bit; so must the router's logits; and the Triton merge must
    equal the torch formula. `router_gemm`: the router's logits GEMM as the engine runs it
    (the numerics table's invariant "logits" entry with the engine's kernel options); `act`:
    the op shim's silu_and_mul. Raises SelfCheckError naming the layer and M."""
    report, seen = {}, set()
    gen = torch.Generator(device=device).manual_seed(4321)
    for name, mod in blocks:
        experts = mod.experts
        w13, w2, k = experts.gate_up_proj, experts.down_proj, mod.top_k
        key = (tuple(w13.shape), tuple(w2.shape), k)
        if key in seen:
            continue
        seen.add(key)
        E, H = w13.shape[0], w13.shape[2]
        top = max(m for m in SELF_CHECK_MS if m <= max(1, min(max_tokens or 1024, 1024)))
        ms = [m for m in SELF_CHECK_MS if m <= top]
        x = torch.randn(top, H, generator=gen, device=device).to(dtype)
        ids = torch.argsort(torch.rand(top, E, generator=gen, device=device), dim=-1)[:, :k].contiguous()
        full = moe.experts_grouped_triton(x, w13, w2, ids, act)
        for m in ms:
            part = moe.experts_grouped_triton(x[:m].clone(), w13, w2, ids[:m].clone(), act)
            if not torch.equal(part.view(torch.int32), full[:m].view(torch.int32)):
                raise SelfCheckError(f"MoE self-check failed for {name}: expert rows at M={m} differ from the same "
                                     f"rows computed at M={top}")
        # every token on the same k experts (one expert gets all rows): the last row alone
        skew = torch.arange(k, device=device).expand(top, k).contiguous()
        crowded = moe.experts_grouped_triton(x, w13, w2, skew, act)
        alone = moe.experts_grouped_triton(x[-1:].clone(), w13, w2, skew[-1:].clone(), act)
        if not torch.equal(alone.view(torch.int32), crowded[-1:].view(torch.int32)):
            raise SelfCheckError(f"MoE self-check failed for {name}: a row routed with {top - 1} others to the same "
                                 "experts differs from the row alone")
        # the router's float32-output GEMM (not a Linear: the dense self-check does not see it)
        router = router_gemm(x, mod.gate.weight)
        for m in ms:
            if not torch.equal(router_gemm(x[:m].clone(), mod.gate.weight).view(torch.int32), router[:m].view(torch.int32)):
                raise SelfCheckError(f"MoE self-check failed for {name}.gate (K={H}, N={E}) at M={m}: router logits "
                                     f"differ from the same rows computed at M={top}")
        w = torch.rand(top, k, generator=gen, device=device)
        if not torch.equal(moe.merge_slots_triton(full, w, dtype).view(torch.int16 if dtype != torch.float32 else torch.int32),
                           moe.merge_slots_torch(full, w, dtype).view(torch.int16 if dtype != torch.float32 else torch.int32)):
            raise SelfCheckError(f"MoE self-check failed for {name}: the Triton merge differs from its formula")
        report[name] = {"experts": E, "top_k": k, "H": H, "Ms": ms}
    return report
