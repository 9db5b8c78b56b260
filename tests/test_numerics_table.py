"""The numerics table (vllm/kernels/numerics_table.py): what it covers, that the op shim
dispatches through it with the forward context's mode, and that docs/numerics.md shows it."""
import os

import pytest
import torch

from vllm.forward_context import ForwardContext, set_forward_context
from vllm.kernels import numerics_table as nt
from vllm.kernels import ops, torch_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_table_covers_every_op_with_both_modes():
    required = {"linear", "logits", "rms_norm", "add_rms_norm", "rope", "silu_and_mul", "embedding",
                "prefill_attention", "decode_attention", "kv_cache_write", "log_softmax", "sampling"}
    assert required <= set(nt.NUMERICS_TABLE)
    for op, entry in nt.NUMERICS_TABLE.items():
        for mode in nt.NUMERICS_MODES:
            for device in ("cuda", "cpu"):
                fn = nt.kernel_for(op, mode, device)
                # only the fresh-prefill specialisation may be absent (prefill_attention runs)
                assert callable(fn) or (op == "fresh_prefill_attention" and fn is None), (op, mode, device)


def test_invariant_entries_are_not_the_batch_dependent_library_calls():
    """The GEMMs are where fast and invariant differ: cuBLAS / a whole-batch CPU BLAS call
    must never be the invariant entry, and no fresh-prefill shortcut exists in invariant mode."""
    for op in ("linear", "logits"):
        for device in ("cuda", "cpu"):
            assert nt.kernel_for(op, "invariant", device) not in (torch_ops.linear, torch_ops.logits), (op, device)
    assert nt.kernel_for("fresh_prefill_attention", "invariant", "cuda") is None
    assert nt.kernel_for("linear", "fast", "cuda") is torch_ops.linear


@pytest.mark.parametrize("mode", ["fast", "invariant"])
def test_op_shim_dispatches_through_the_table_with_the_context_mode(mode, monkeypatch):
    calls = []

    def spy(name):
        def fn(x, weight, bias=None):
            calls.append(name)
            return torch.zeros(x.shape[0], weight.shape[0])
        return fn
    entry = nt.OpNumerics(fast=nt.Impl(cuda=None, cpu=spy("fast")), invariant=nt.Impl(cuda=None, cpu=spy("invariant")))
    monkeypatch.setitem(nt.NUMERICS_TABLE, "linear", entry)
    with set_forward_context(ForwardContext(None, mode)):
        ops.linear(torch.ones(2, 3), torch.ones(4, 3))
    ops.linear(torch.ones(2, 3), torch.ones(4, 3))  # no context: the baseline
    assert calls == [mode, "fast"]


def test_cpu_invariant_linear_is_row_by_row_and_fast_is_not():
    """What each mode's entry computes on CPU (bits): invariant = one row at a time."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 64, generator=g), torch.randn(48, 64, generator=g)
    with set_forward_context(ForwardContext(None, "invariant")):
        inv = ops.linear(x, w)
    with set_forward_context(ForwardContext(None, "fast")):
        fast = ops.linear(x, w)
    assert torch.equal(inv.view(torch.int32), torch_ops.linear_rows(x, w).view(torch.int32))
    assert torch.equal(fast.view(torch.int32), torch.nn.functional.linear(x, w).view(torch.int32))


def test_describe_names_what_runs():
    d = nt.describe("invariant", "cpu")
    assert d["linear"] == "kernels.torch_ops.linear_rows"
    assert d["prefill_attention"] == "kernels.attention_cpu.paged_attention_cpu"
    assert nt.describe("invariant", "cuda")["linear"] == "kernels.matmul.invariant_matmul(allow_cublaslt=True)"
    assert nt.describe("fast", "cuda")["fresh_prefill_attention"] == "kernels.flash_varlen.flash_prefill_attention"


def test_docs_show_the_table():
    with open(os.path.join(ROOT, "docs", "numerics.md")) as f:
        doc = f.read()
    assert nt.markdown() in doc, "docs/numerics.md must contain numerics_table.markdown() verbatim"


def test_moe_ops_are_rows_of_the_table():
    """Routing, the expert MLPs and the merge: the table's row shape, split by mode and device."""
    from vllm.kernels import moe
    assert nt.kernel_for("moe_route", "invariant", "cpu") is moe.route_invariant
    assert nt.kernel_for("moe_experts", "invariant", "cuda") is moe.experts_grouped_triton
    assert nt.kernel_for("moe_experts", "invariant", "cpu") is moe.experts_rows_cpu
    assert nt.kernel_for("moe_experts", "fast", "cpu") is moe.experts_loop
    assert nt.kernel_for("moe_merge", "invariant", "cuda") is moe.merge_slots_triton
    assert nt.describe("fast", "cuda")["moe_experts"] == "kernels.moe.experts_fast"
    assert not hasattr(moe, "MOE_OPS")


@pytest.mark.parametrize("mode", ["fast", "invariant"])
def test_op_shim_dispatches_moe_through_the_table(mode, monkeypatch):
    calls = []

    def spy(name):
        def fn(y, w, out_dtype):
            calls.append(name)
            return y.sum(1).to(out_dtype)
        return fn
    entry = nt.OpNumerics(fast=nt.Impl(cuda=None, cpu=spy("fast")), invariant=nt.Impl(cuda=None, cpu=spy("invariant")))
    monkeypatch.setitem(nt.NUMERICS_TABLE, "moe_merge", entry)
    with set_forward_context(ForwardContext(None, mode)):
        ops.moe_merge(torch.ones(2, 3, 4), torch.ones(2, 3), torch.float32)
    assert calls == [mode]
