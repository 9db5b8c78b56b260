"""Gated DeltaNet per-layer cost on the H200: the invariant mode against the native forms.

    python benchmarks/kernels/gdn.py [--json-out F] [--cases train,prefill,decode]
    python benchmarks/kernels/gdn.py --bits-vs OTHER_gdn_chunk.py   (bits against another copy)
    python benchmarks/kernels/gdn.py --backward   (the trainer's backward against the fused kernels)

Qwen3-Next's GDN dims (16 key / 32 value heads of 128, chunk 64, bf16), the three cases
SkyRL IsoExec measured its CPR at (1.43x train, 1.67x prefill, 1.38x decode against native):

- train: forward + backward of the delta rule over 1 x 10,240 tokens;
- prefill: 5 x 2,048 tokens from position 0, states written to the cache;
- decode: 256 sequences x 1 token at positions spread over the chunk grid, states in the cache.

Columns: ours invariant (the chunked form on the absolute grid; decode computes the new row of
its partial chunk from the rows its state kept, with their rows of T and v_new), ours fast (our
native form: step-grid chunks, the fused recurrence for decode), and flash-linear-attention's
chunk / fused-recurrent kernels where `fla` imports (else `-`). The ratio column is invariant /
native (fla where present, else our fast mode); the issue's target is <= 1.15. Decode is timed
inside a CUDA graph (as the engine replays it). Also printed: whether invariant decode rows
equal the prefill's rows bit for bit, and how many fast-mode decode rows differ from fast
prefill rows.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm import bench_graph  # noqa: E402
from scan_bench import (DEV, bench, decode_metadata, decode_rows_differing, main, metadata,  # noqa: E402
                        optional_baseline, prefill_metadata)

from vllm.kernels.gdn_chunk import GatedDeltaRuleFn, gdn_chunk_triton  # noqa: E402
from vllm.kernels.gdn_ops import gdn_recurrent_triton  # noqa: E402

HK, HV, K, V, C = 16, 32, 128, 128, 64
SCALE = K ** -0.5

fla_chunk, fla_recurrent = optional_baseline("fla.ops.gated_delta_rule.chunk_gated_delta_rule",
                                             "fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule")


def inputs(T: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = F.normalize(torch.randn(T, HK, K, device=DEV, generator=g), dim=-1).to(torch.bfloat16)
    k = F.normalize(torch.randn(T, HK, K, device=DEV, generator=g), dim=-1).to(torch.bfloat16)
    v = torch.randn(T, HV, V, device=DEV, generator=g).to(torch.bfloat16)
    gate = -0.6 * torch.rand(T, HV, device=DEV, generator=g)
    beta = torch.rand(T, HV, device=DEV, generator=g)
    return q, k, v, gate, beta


def state(num_slots: int, aligned: bool, md=None) -> dict:
    """A cache as the layer declares it. With a decode step's metadata `md`, the T cache of
    slots md.slots holds the rows before each sequence's new token (as the previous step left
    it); otherwise its stamps match nothing and the T of every chunk is solved in full. The
    partial chunk's rows (buffers, v_new) are random: timing does not depend on their values."""
    st = {"ssm": torch.randn(num_slots, HV, K, V, device=DEV) * 0.1}
    if aligned:
        st.update(buf_k=F.normalize(torch.randn(num_slots, C, HK, K, device=DEV), dim=-1).to(torch.bfloat16),
                  buf_v=torch.randn(num_slots, C, HV, V, device=DEV).to(torch.bfloat16),
                  buf_g=-0.6 * torch.rand(num_slots, C, HV, device=DEV), buf_beta=torch.rand(num_slots, C, HV, device=DEV),
                  t_cache=torch.eye(C, device=DEV).expand(num_slots, HV, C, C).contiguous(),
                  t_pos=torch.full((num_slots, HV), -1, dtype=torch.int32, device=DEV),
                  buf_vn=torch.randn(num_slots, C, HV, V, device=DEV).to(torch.bfloat16))
        st["ssm_rounded"] = st["ssm"].to(torch.bfloat16)  # as the state kernel writes it with "ssm"
        if md is not None:
            st["t_pos"][md.slots.long()] = md.start_pos.to(torch.int32)[:, None]
    return st


def ours(aligned: bool):
    return functools.partial(gdn_chunk_triton, chunk_size=C, aligned=aligned)


@contextlib.contextmanager
def rebuilding_t():
    """The training backward building each chunk's T itself (gdn_chunk.SAVE_T_FOR_BACKWARD
    off), to show what keeping the forward's T saves."""
    from vllm.kernels import gdn_chunk
    saved, gdn_chunk.SAVE_T_FOR_BACKWARD = gdn_chunk.SAVE_T_FOR_BACKWARD, False
    try:
        yield
    finally:
        gdn_chunk.SAVE_T_FOR_BACKWARD = saved


def train_case(T: int = 10240) -> dict:
    x = inputs(T, 0)
    do = torch.randn(T, HV, V, device=DEV).to(torch.bfloat16)
    md = metadata([0], [T])
    out = {}
    for name, aligned in (("invariant", True), ("fast", False)):
        leaves = [t.clone().requires_grad_() for t in x]

        def step(leaves=leaves, aligned=aligned):
            o = GatedDeltaRuleFn.apply(ours(aligned), *leaves, SCALE, md, C)
            o.backward(do)
        out[name] = bench(step)
        out[name + "_fwd"] = bench(lambda aligned=aligned: ours(aligned)(*x, SCALE, md, None))
    with rebuilding_t():
        leaves = [t.clone().requires_grad_() for t in x]

        def step(leaves=leaves):
            o = GatedDeltaRuleFn.apply(ours(True), *leaves, SCALE, md, C)
            o.backward(do)
        out["invariant_rebuild_t"] = bench(step)
    if fla_chunk is not None:
        with torch.no_grad():
            out["fla_fwd"] = bench(lambda: fla_chunk(*(t[None] for t in x), scale=SCALE))
        out["fla"] = bench(fla_train_step(x, do))
    return out


def fla_train_step(x, do):
    """fla's forward + backward over x (the guard that refuses its backward on Hopper with
    Triton in [3.4, 3.7.1), its issue #640: wrong results there, lifted so the kernels run as
    they would; for a time only, their values are not used)."""
    leaves = [t[None].clone().requires_grad_() for t in x]

    def step():
        o, _ = fla_chunk(*leaves, scale=SCALE)
        o.backward(do[None])
    try:
        step()
    except RuntimeError as err:
        import fla.ops.common.chunk_o as fla_chunk_o
        if "#640" not in str(err) or not hasattr(fla_chunk_o, "TRITON_ABOVE_3_7_1"):
            raise
        print("fla backward: guard for its issue #640 lifted to time it (values unused)")
        fla_chunk_o.TRITON_ABOVE_3_7_1 = True
    return step


def prefill_case(n: int = 5, L: int = 2048, others: bool = True) -> dict:
    """others: also our fast mode and fla (else the invariant mode alone)."""
    x = inputs(n * L, 1)
    md = prefill_metadata(n, L)
    out = {}
    for name, aligned in (("invariant", True), ("fast", False))[:2 if others else 1]:
        st = state(n + 1, aligned)
        out[name] = bench(lambda aligned=aligned, st=st: ours(aligned)(*x, SCALE, md, st))
    if not others:
        return out
    if fla_chunk is not None:
        cu = md.cu_seqlens.long()
        out["fla"] = bench(lambda: fla_chunk(*(t[None] for t in x), scale=SCALE, output_final_state=True, cu_seqlens=cu))
    return out


def decode_case(n: int = 256, others: bool = True) -> dict:
    """others: also our fast mode and fla (else the invariant mode alone)."""
    x = inputs(n, 2)
    md = decode_metadata(n, C)
    out = {}
    st_inv, st_fast = state(n + 1, True, md), state(n + 1, False)
    out["invariant"] = bench_graph(lambda i: ours(True)(*x, SCALE, md, st_inv), 20)
    if not others:
        return out
    out["fast"] = bench_graph(lambda i: gdn_recurrent_triton(*x, SCALE, md, st_fast), 20)
    if fla_recurrent is not None:
        h0 = st_fast["ssm"][1:].clone()
        out["fla"] = bench_graph(lambda i: fla_recurrent(*(t[:, None] for t in x), scale=SCALE, initial_state=h0,
                                                         output_final_state=True), 20)
    return out


def bits_check() -> dict:
    """Invariant: a prefill's rows == the same tokens fed one decode step at a time (after a
    prefill of the first 100); fast: how many such rows differ."""
    x = inputs(300, 3)

    def step(aligned, lo, hi, md, st):
        one = tuple(t[lo:hi] for t in x)
        if md.max_query_len == 1 and not aligned:
            return gdn_recurrent_triton(*one, SCALE, md, st)
        return ours(aligned)(*one, SCALE, md, st)
    return decode_rows_differing(step, functools.partial(state, 2))


def schedule_outputs(fn) -> dict:
    """fn (gdn_chunk_triton's signature) at these dims, aligned, with the layer's cache (NaN-filled)
    on every real_dims_schedules() schedule (one prefill, cuts, prefill + decode steps, all
    decode): per schedule (outputs by sequence, state)."""
    from vllm.testing.chunked_scan import REAL_DIMS_LENS, REAL_DIMS_SLOTS, nan_state, real_dims_schedules, run_steps

    seqs = {sid: inputs(n, 40 + sid) for sid, n in REAL_DIMS_LENS.items()}
    layout = {"ssm": ((HV, K, V), torch.float32), "buf_k": ((C, HK, K), torch.bfloat16),
              "buf_v": ((C, HV, V), torch.bfloat16), "buf_g": ((C, HV), torch.float32),
              "buf_beta": ((C, HV), torch.float32), "t_cache": ((HV, C, C), torch.float32),
              "t_pos": ((HV,), torch.int32), "buf_vn": ((C, HV, V), torch.bfloat16),
              "ssm_rounded": ((HV, K, V), torch.bfloat16)}
    res = {}
    for name, steps in real_dims_schedules().items():
        st = nan_state(max(REAL_DIMS_SLOTS.values()) + 1, layout)
        outs = run_steps(lambda x, md, st=st: fn(*x, SCALE, md, st, chunk_size=C, aligned=True), seqs,
                         REAL_DIMS_SLOTS, steps)
        res[name] = (outs, st)
    return res


def outputs_differing(a: dict, b: dict) -> dict:
    """Per schedule of two schedule_outputs(): the output and state elements whose bits differ."""
    from vllm.testing.chunked_scan import REAL_DIMS_SLOTS

    res = {}
    for name in a:
        (oa, sa), (ob, sb) = a[name], b[name]
        res[name] = {
            "outputs": sum(int((oa[s].view(torch.int16) != ob[s].view(torch.int16)).sum()) for s in oa),
            "states": sum(int((sa["ssm"][sl].view(torch.int32) != sb["ssm"][sl].view(torch.int32)).sum())
                          for sl in REAL_DIMS_SLOTS.values())}
    return res


def bits_vs(path: str) -> dict:
    """This module's kernels against another copy of vllm/kernels/gdn_chunk.py at `path` (e.g. the
    previous commit's, `git show HEAD~1:vllm/kernels/gdn_chunk.py > /tmp/gdn_chunk_old.py`) on
    schedule_outputs()' schedules: per schedule the number of output and state elements whose
    bits differ (0 and 0: not a bit changed)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gdn_chunk_other", path)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    return outputs_differing(schedule_outputs(gdn_chunk_triton), schedule_outputs(other.gdn_chunk_triton))


def backward_case(T: int = 10240) -> None:
    """The backward alone at the train shape: autograd of gdn_reference in float32 (with the
    Triton chunk recurrence) against the fused kernels of vllm/kernels/gdn_backward.py (the
    trainer's path on a GPU), their distance from float64 autograd, the fused kernels' GPU time
    per kernel, at the bf16 dots a bf16 model's backward takes beside the 3xTF32 of a float32 one."""
    from scan_bench import backward_report

    from vllm.kernels.chunk_scan import reference_grads
    from vllm.kernels.gdn_backward import gdn_backward_triton
    from vllm.kernels.gdn_chunk import gdn_reference
    x = inputs(T, 0)
    # seeded, so runs compare (the distances from float64 move with the gradient drawn)
    do = torch.randn(T, HV, V, device=DEV, generator=torch.Generator(device=DEV).manual_seed(5)).to(torch.bfloat16)
    cu = [0, T]

    def ref_step(dy=do):
        return reference_grads(lambda *a: gdn_reference(*a, cu, SCALE), x, [True] * 5, dy)

    backward_report(T, ref_step, lambda: gdn_backward_triton(*x, do, cu, SCALE),
                    ref_step(do.double()), "q k v g beta".split())  # exact: float64 autograd
    if fla_chunk is not None:
        # fla's kernels per call, its forward alone and forward + backward (the backward's are
        # the second list's less the first's)
        from scan_bench import kernel_times, report
        with torch.no_grad():
            report("fla forward kernels", kernel_times(lambda: fla_chunk(*(t[None] for t in x), scale=SCALE)))
        report("fla forward + backward kernels", kernel_times(fla_train_step(x, do)))


if __name__ == "__main__":
    if "--backward" in sys.argv:
        backward_case()
        sys.exit(0)
    if "--bits-vs" in sys.argv:
        for name, r in bits_vs(sys.argv[sys.argv.index("--bits-vs") + 1]).items():
            print(f"{name:<16} elements whose bits differ: outputs {r['outputs']}, states {r['states']}")
        sys.exit(0)
    main(__doc__, "Gated DeltaNet, one layer ({device}, Hk 16 / Hv 32 x 128, C 64, bf16; us, median)",
         {"train 1x10240 fwd+bwd": train_case, "prefill 5x2048": prefill_case, "decode 256x1": decode_case},
         bits_check, "fla")
