"""Linear layers; fused projections (qkv, gate_up) stack several HF projections.

`FusedLinear.shard` is the one definition of where each shard's rows live: the
model's HF-name mapping (`vllm.models.weights`) reads and writes through it.
Models contain no parallelism: tensor parallelism would be applied after build.

FP8 (`enable_fp8`, quantization="fp8"): `weight` stays the master copy (model dtype, what
the trainer updates and save_pretrained writes); the buffers `weight_fp8` (float8_e4m3fn)
and `weight_scale_inv` (float32 per 128 x 128 block) are what the forward multiplies,
quantized once per weight version (`requantize`, called at weight sync; the forward also
notices an in-place change of `weight` through its version counter).
"""
from __future__ import annotations

import torch
from torch import nn

from vllm.kernels import ops


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)

        self.fp8 = False

    def enable_fp8(self) -> None:
        """Switch this layer to block-scaled FP8 GEMMs, quantizing the current weight."""
        from vllm.kernels.fp8 import BLOCK, FP8_DTYPE
        n, k = self.out_features, self.in_features
        dev = self.weight.device
        self.register_buffer("weight_fp8", torch.zeros(n, k, dtype=FP8_DTYPE, device=dev), persistent=False)
        self.register_buffer("weight_scale_inv", torch.ones(-(-n // BLOCK), -(-k // BLOCK), dtype=torch.float32,
                                                            device=dev), persistent=False)
        self.fp8 = True
        self.requantize()
        if dev.type == "cuda":
            # decide the decode tiles and whether cuBLASLt may serve this shape now, in eager
            # mode, not first inside a graph capture
            from vllm.kernels.fp8_gemm import HAS_TRITON, cublaslt_verified, small_m_tiles_verified
            if HAS_TRITON:
                small_m_tiles_verified(n, k, dev)
                cublaslt_verified(n, k, dev)

    @torch.no_grad()
    def requantize(self) -> None:
        """Quantize the master weight into the fp8 buffers (in place: captured CUDA graphs
        read the new values)."""
        from vllm.kernels.fp8 import quantize_weight
        wq, ws = quantize_weight(self.weight.detach())
        self.weight_fp8.copy_(wq)
        self.weight_scale_inv.copy_(ws)
        self._fp8_version = self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            if self.weight._version != self._fp8_version:
                self.requantize()
            return ops.fp8_linear(x, self.weight, self.weight_fp8, self.weight_scale_inv, self.bias)
        return ops.linear(x, self.weight, self.bias)


def fp8_linears(model: nn.Module) -> list["Linear"]:
    """The FP8 linear layers of `model` (each re-quantizes with `requantize()`)."""
    return [m for m in model.modules() if isinstance(m, Linear) and m.fp8]


def enable_fp8(model: nn.Module) -> int:
    """quantization="fp8": every Linear of `model` (attention and dense MLP projections; the
    embedding, lm_head and MoE expert stacks stay in the model dtype). Returns the count."""
    n = 0
    for m in model.modules():
        if isinstance(m, Linear) and not m.fp8:
            m.enable_fp8()
            n += 1
    return n


class FusedLinear(Linear):
    """Several HF projections stacked along the output dim.

    `shard_sizes` maps a shard id (e.g. "q", "k", "v" or 0, 1) to its output rows,
    in stacking order.
    """

    def __init__(self, in_features: int, shard_sizes: dict, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias, dtype=dtype)
        self.shard_offsets: dict = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    def shard(self, tensor: torch.Tensor, shard_id) -> torch.Tensor:
        """The rows of `tensor` (this layer's weight or bias, or its gradient) that hold
        shard `shard_id`: a view, so writing into it writes the parameter."""
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shard_offsets)}")
        offset, size = self.shard_offsets[shard_id]
        return tensor.narrow(0, offset, size)
