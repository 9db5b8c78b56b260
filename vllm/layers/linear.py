"""Linear layers; fused projections (qkv, gate_up) stack several HF projections.

`FusedLinear.shard` is the one definition of where each shard's rows live: the
model's HF-name mapping (`vllm.models.weights`) reads and writes through it.
Models contain no parallelism: tensor parallelism is applied after build
(`vllm/parallel/tensor_parallel.py`), which sets a layer's `parallel` hook; the forward then
calls it instead of the local GEMM.

FP8 (`enable_fp8`, quantization="fp8"): `weight` stays the master copy (model dtype, what
the trainer updates and save_pretrained writes); the buffers `weight_fp8` (float8_e4m3fn)
and `weight_scale_inv` (float32 per 128 x 128 block) are what the forward multiplies,
quantized once per weight version (`requantize`, called at weight sync; the forward also
notices an in-place change of `weight` through its version counter).

A rollout-only engine may drop the master (`drop_master_weights`, keep_master_weights=False):
`weight` becomes a meta tensor (shape and dtype only, no memory) and the fp8 buffers are the
weights. Weight sync then writes each arriving tensor through a `QuantizedRows` destination,
quantized by the same rule into the rows it covers; that equals quantizing the whole weight
because every shard starts on a 128-row block boundary (checked when the master is dropped).
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
        # set by vllm.parallel.tensor_parallel after build; a plain attribute, not a submodule
        self.parallel = None

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

    @property
    def has_master(self) -> bool:
        return not self.weight.is_meta

    def drop_master(self) -> None:
        """Keep only the fp8 copy: `weight` becomes a meta tensor of its shape and dtype.
        ValueError unless the layer is FP8 and every shard starts on a 128-row block (a
        shard written alone must quantize as the whole weight would)."""
        if not self.fp8:
            raise ValueError("only an FP8 linear layer can drop its master weight")
        if (bad := self.misaligned_shard()) is not None:
            raise ValueError(_MISALIGNED.format(*bad))
        w = self.weight
        self.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
        self._fp8_version = self.weight._version

    def misaligned_shard(self) -> tuple | None:
        """(shard id, first row) of a shard that does not start on a 128-row block, or None."""
        from vllm.kernels.fp8 import BLOCK
        return next(((sid, off) for sid, (off, _) in getattr(self, "shard_offsets", {}).items() if off % BLOCK), None)

    def quantized_rows(self, view: torch.Tensor) -> "QuantizedRows":
        """The destination for `view`, a block of whole rows of the (meta) master weight."""
        K = self.in_features
        if view.dim() != 2 or view.shape[1] != K or (view.shape[0] > 1 and view.stride() != (K, 1)):
            raise ValueError("an FP8 layer without a master weight takes whole rows only")
        return QuantizedRows(self, view.storage_offset() // K, view.shape[0])

    @torch.no_grad()
    def requantize(self) -> None:
        """Quantize the master weight into the fp8 buffers (in place: captured CUDA graphs
        read the new values). Without a master the buffers are the weights: nothing to do."""
        if not self.has_master:
            return
        from vllm.kernels.fp8 import quantize_weight
        wq, ws = quantize_weight(self.weight.detach())
        self.weight_fp8.copy_(wq)
        self.weight_scale_inv.copy_(ws)
        self._fp8_version = self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel is not None:
            return self.parallel(self, x)
        if self.fp8:
            if self.weight._version != self._fp8_version:
                self.requantize()
            return ops.fp8_linear(x, self.weight, self.weight_fp8, self.weight_scale_inv, self.bias)
        return ops.linear(x, self.weight, self.bias)


_MISALIGNED = ("keep_master_weights=False: shard {!r} starts at row {}, not on a 128-row block, so weight sync "
               "could not quantize it alone as the whole weight would be; keep the master weights")


class QuantizedRows:
    """Weight sync's destination for rows [row0, row0 + rows) of an FP8 layer without a
    master weight: `write` quantizes the source by the deployment rule into those fp8 rows
    and their scale rows; `snapshot` / `restore` keep and put back the bytes an update
    overwrites. Has the shape and dtype of the master rows (what the planner checks)."""

    def __init__(self, layer: Linear, row0: int, rows: int):
        self.layer, self.row0, self.rows = layer, row0, rows
        self.shape = torch.Size((rows, layer.in_features))
        self.dtype = layer.weight.dtype
        self.device = layer.weight_fp8.device

    def _scale_rows(self) -> slice:
        from vllm.kernels.fp8 import BLOCK
        return slice(self.row0 // BLOCK, -(-(self.row0 + self.rows) // BLOCK))

    @torch.no_grad()
    def write(self, src: torch.Tensor) -> None:
        from vllm.kernels.fp8 import quantize_weight
        wq, ws = quantize_weight(src.to(self.device))
        self.layer.weight_fp8[self.row0:self.row0 + self.rows].copy_(wq)
        self.layer.weight_scale_inv[self._scale_rows()].copy_(ws)

    def snapshot(self, device: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.layer.weight_fp8[self.row0:self.row0 + self.rows]
        s = self.layer.weight_scale_inv[self._scale_rows()]
        return (q.to(device, copy=True), s.to(device, copy=True)) if device else (q.clone(), s.clone())

    @torch.no_grad()
    def restore(self, snap: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.layer.weight_fp8[self.row0:self.row0 + self.rows].copy_(snap[0])
        self.layer.weight_scale_inv[self._scale_rows()].copy_(snap[1])


def drop_master_weights(model: nn.Module) -> int:
    """keep_master_weights=False: every FP8 linear layer keeps only its fp8 copy (the
    master's memory is freed once nothing else holds it). Returns the count. ValueError,
    before anything is dropped, if a layer's shards are not block-aligned."""
    layers = fp8_linears(model)
    if not layers:
        raise ValueError("keep_master_weights=False needs quantization='fp8' (only FP8 layers can drop masters)")
    for m in layers:   # check every layer first: all or nothing
        if (bad := m.misaligned_shard()) is not None:
            raise ValueError(_MISALIGNED.format(*bad))
    for m in layers:
        m.drop_master()
    return len(layers)


def fp8_linears(model: nn.Module) -> list["Linear"]:
    """The FP8 linear layers of `model` (each re-quantizes with `requantize()`)."""
    return [m for m in model.modules() if isinstance(m, Linear) and m.fp8]


def enable_fp8(model: nn.Module, skip: set[str] | frozenset = frozenset()) -> int:
    """quantization="fp8": every Linear of `model` (attention and dense MLP projections; the
    embedding, lm_head and MoE expert stacks stay in the model dtype) but those named in
    `skip` (an FP8 checkpoint's modules_to_not_convert). Returns the count."""
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, Linear) and not m.fp8 and name not in skip:
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
