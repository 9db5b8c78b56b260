"""Start-up self-check for numerics='invariant': verify, on this machine, that
the loaded model's GEMM shapes give bit-identical rows for every M bucket.

A row computed inside a batch of M rows must equal the same row computed in a
batch of 1 (and every bucket's tile configuration must agree). A failure means
the invariance promise does not hold here, so start-up stops.
"""
from __future__ import annotations

import torch

from vllm.config import KernelConfig
from vllm.kernels import matmul
from vllm.kernels.matmul import invariant_matmul

CHECK_MS = (1, 2, 3, 16, 17, 33, 64, 65, 128, 129, 256, 257, 1024)
# M buckets served by cuBLASLt (impl "cublaslt...") pick their kernel by cuBLAS's heuristic
# per M, not by our table: those buckets are checked at every LT_STRIDE-th M up to 1024,
# every LT_STRIDE_LARGE-th beyond (up to the largest step the engine runs), and both ends.
LT_STRIDE = 8
LT_STRIDE_LARGE = 64


def _check_ms(N: int, K: int, fp32_out: bool, max_m: int, lt_max_m: int | None = None) -> list[int]:
    lt_max_m = max(max_m, lt_max_m or max_m)
    ms = {m for m in CHECK_MS if m <= max_m}
    lo = 0
    for hi, impl, *_ in matmul.config_table(N, K, fp32_out):
        if impl.startswith("cublaslt") and lo < lt_max_m:
            top = min(hi, lt_max_m)
            ms.update(range(lo + 1, min(top, 1024) + 1, LT_STRIDE))
            ms.update(range(max(lo + 1, 1025), top + 1, LT_STRIDE_LARGE))
            ms.update((lo + 1, top))
        lo = hi
    return sorted(ms) or [1]


class SelfCheckError(RuntimeError):
    pass


def model_gemm_shapes(model: torch.nn.Module) -> list[tuple[str, int, int, bool]]:
    """(name, K, N, fp32_out) for every distinct linear weight shape in the model (+ lm_head)."""
    from vllm.layers.embedding import LMHead
    from vllm.layers.linear import Linear

    seen, shapes = set(), []
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and mod.fp8:
            continue   # runs the FP8 GEMM, checked by fp8_gemm_self_check
        if isinstance(mod, (Linear, LMHead)):
            N, K = mod.weight.shape
            key = (K, N, isinstance(mod, LMHead))
            if key not in seen:
                seen.add(key)
                shapes.append((name, K, N, isinstance(mod, LMHead)))
    return shapes


@torch.inference_mode()
def gemm_self_check(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, max_m: int = 1024,
                    max_tokens: int | None = None, allow_cublaslt: bool = True) -> dict:
    """max_tokens: the largest M the engine runs (its token budget per step); cuBLASLt
    buckets of the linear layers are checked up to it (logits rows stay within max_m).
    allow_cublaslt: as the engine will run its GEMMs (KernelConfig.gemm_cublaslt)."""
    gen = torch.Generator(device=device).manual_seed(1234)
    report = {}
    for name, K, N, fp32_out in model_gemm_shapes(model):
        ms = _check_ms(N, K, fp32_out, max_m, None if fp32_out else max_tokens)
        w = dict(model.named_modules())[name].weight
        x = torch.randn(max(ms), K, generator=gen, device=device).to(dtype)
        out_dtype = torch.float32 if fp32_out else dtype
        full = invariant_matmul(x, w, out_dtype=out_dtype, allow_cublaslt=allow_cublaslt)
        view = torch.int32 if out_dtype == torch.float32 else torch.int16
        if device.type == "cuda":
            # every impl the table may use computes the same bits: the Triton kernel, with
            # the table's tiles, is the reference for cuBLASLt and for itself
            triton_full = invariant_matmul(x, w, out_dtype=out_dtype, impl="plain")
            same = torch.equal(triton_full.view(view), full.view(view))
            del triton_full  # as large as the logits of the whole check batch
            if not same:
                raise SelfCheckError(f"invariant GEMM self-check failed for {name} (K={K}, N={N}) at M={max(ms)}: "
                                     "the table's kernel and the Triton kernel give different bits")
        for m in ms:
            part = invariant_matmul(x[:m].clone(), w, out_dtype=out_dtype, allow_cublaslt=allow_cublaslt)
            if not torch.equal(part.view(view), full[:m].view(view)):
                raise SelfCheckError(f"invariant GEMM self-check failed for {name} (K={K}, N={N}) at M={m}: "
                                     f"rows differ from the same rows computed at M={max(ms)}")
        # the last row alone, i.e. at another position inside its tile
        last = invariant_matmul(x[-1:].clone(), w, out_dtype=out_dtype, allow_cublaslt=allow_cublaslt)
        if not torch.equal(last.view(view), full[-1:].view(view)):
            raise SelfCheckError(f"invariant GEMM self-check failed for {name} (K={K}, N={N}): row position changes bits")
        report[name] = {"K": K, "N": N, "Ms": ms}
    return report


@torch.inference_mode()
def fp8_gemm_self_check(modules: list, device: torch.device, dtype: torch.dtype, max_tokens: int | None = None,
                        allow_cublaslt: bool = True) -> dict:
    """FP8 linear layers among `modules` ((name, module) pairs): for every distinct weight shape,
    the layer's op (vllm/kernels/fp8_gemm.fp8_linear_cuda, with the layer's bias) at each
    checked M gives the rows it gives inside the largest batch. The M list crosses the
    small-M / large tiles and, where cuBLASLt serves, its range at the strides of the bf16
    cuBLASLt buckets (cuBLAS picks its kernel per M)."""
    from vllm.kernels.fp8_gemm import CUBLASLT_MIN_M, cublaslt_serves, fp8_linear_cuda
    gen = torch.Generator(device=device).manual_seed(4321)
    report, seen = {}, set()
    top = max(1024, max_tokens or 1024)
    for name, mod in modules:
        if not getattr(mod, "fp8", False) or (mod.out_features, mod.in_features) in seen:
            continue
        seen.add((mod.out_features, mod.in_features))
        wq, ws, bias = mod.weight_fp8, mod.weight_scale_inv, mod.bias
        ms = set(CHECK_MS)
        if allow_cublaslt and cublaslt_serves(top, wq, bias, dtype):
            ms.update(range(CUBLASLT_MIN_M, 1025, LT_STRIDE))
            ms.update(range(1025, top + 1, LT_STRIDE_LARGE))
            ms.update((CUBLASLT_MIN_M - 1, CUBLASLT_MIN_M, top))
        ms = sorted(m for m in ms if m <= top)
        x = torch.randn(top, mod.in_features, generator=gen, device=device).to(dtype)
        full = fp8_linear_cuda(x, wq, ws, bias, allow_cublaslt=allow_cublaslt).view(torch.int16)
        for m in ms:
            part = fp8_linear_cuda(x[:m].clone(), wq, ws, bias, allow_cublaslt=allow_cublaslt).view(torch.int16)
            if not torch.equal(part, full[:m]):
                raise SelfCheckError(f"FP8 GEMM self-check failed for {name} (K={mod.in_features}, "
                                     f"N={mod.out_features}) at M={m}: rows differ from the same rows at M={top}")
        report[f"{name} (fp8)"] = {"K": mod.in_features, "N": mod.out_features, "Ms": ms}
    return report


def layer_self_checks(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                      max_tokens: int | None = None, kernels: KernelConfig | None = None) -> dict:
    """Layers with kernels of their own (outside the numerics table: an MoE block's grouped
    expert GEMM, say) check them too: every layer class defining
    `invariant_self_check(modules, device, dtype, max_tokens, kernels)` is called once, with
    all of the model's (name, module) pairs of that class; it raises SelfCheckError."""
    by_class: dict[type, list] = {}
    for name, mod in model.named_modules():
        if hasattr(type(mod), "invariant_self_check"):
            by_class.setdefault(type(mod), []).append((name, mod))
    report = {}
    for cls, mods in by_class.items():
        report.update(cls.invariant_self_check(mods, device, dtype, max_tokens, kernels or KernelConfig()))
    return report


def start_up_check(model: torch.nn.Module, numerics: str, device: torch.device, dtype: torch.dtype,
                   max_tokens: int | None = None, kernels: KernelConfig | None = None) -> dict | None:
    """The check a numerics mode needs on this device before an engine serves: invariant
    mode on CUDA verifies every GEMM shape of the loaded model (`gemm_self_check`, and
    `fp8_gemm_self_check` for FP8 layers) and the kernels of layers that bring their own
    (`layer_self_checks`). Nothing else needs one
    (the CPU's invariant kernels are row-at-a-time torch; fast mode promises nothing).
    Returns the check's report, or None when none ran."""
    if numerics == "invariant" and device.type == "cuda":
        kernels = kernels or KernelConfig()
        report = gemm_self_check(model, device, dtype, max_tokens=max_tokens, allow_cublaslt=kernels.gemm_cublaslt)
        report.update(fp8_gemm_self_check(list(model.named_modules()), device, dtype, max_tokens,
                                          allow_cublaslt=kernels.gemm_cublaslt))
        report.update(layer_self_checks(model, device, dtype, max_tokens, kernels))
        return report
    return None


def check_supported(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse numerics='invariant' where no verified kernel exists."""
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ValueError(f"numerics='invariant' has no verified kernels for device type {device.type!r}")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        raise ValueError(f"numerics='invariant' needs compute capability >= 8.0, this GPU is {major}.{minor}")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"numerics='invariant' on GPU is verified for bfloat16/float16 only, not {dtype}")
