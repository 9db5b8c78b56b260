"""Every Triton launch of the shape-heavy kernels compiles for sm_90 (H100 / H200), without a GPU.

The CPU tests run these kernels under TRITON_INTERPRET=1, which never type-checks: a kernel
can pass them all and still fail to compile on the GPU (e.g. a loop-carried variable whose
shape changes inside a loop when two tile sizes differ). Here the tests' own launches are
recorded (vllm/testing/sm90_compile.py) and each distinct specialisation is compiled for
sm_90 with the GPU's constexprs (EMULATE=False), offline.

* The chunked scans (Gated DeltaNet, Mamba-2) and their decode-step ops run as their tests
  run them, at their small dims (GDN: K 16 != V 32, so BK != BV), on the interpreter.
* The GEMMs (invariant GEMM, TP leaf tree) and paged attention are recorded without running
  (their launch code runs, the kernels do not) at the H200's tiles and a real head dim: the
  tiles the interpreter gets are not the GPU's.
"""
from __future__ import annotations

import contextlib
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from vllm.testing import sm90_compile as sm90

_reason = sm90.unavailable_reason()
if _reason is None and os.environ.get("TRITON_INTERPRET") != "1":
    _reason = "needs TRITON_INTERPRET=1 (launches are recorded from the interpreter; a GPU run compiles them itself)"
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

# Known compile failures, (kernel name, ((constexpr, value), ...) the failing launches have)
# -> reason, e.g. ("_gdn_prep_kernel", (("BK", 16), ("BV", 32))): "...": a family whose only
# failures are known xfails with the reasons; any other failure fails.
KNOWN_FAILURES: dict[tuple[str, tuple], str] = {}


# ---- the drivers: each runs code that launches kernels, inside record_launches ---------------------

def _gdn_chunk():
    """tests/test_gdn_chunk.py's dims and calls: a trainer prefill (no cache); prefill, cuts and
    one-token decode steps with the cache and the decode caches (aligned) and in fast mode;
    bf16 with padded head dims; the decode path on a 64-row chunk; 16-wide tiles (several
    K / V tiles a head)."""
    from test_gdn_chunk import C, K, V, make_inputs, run_schedule

    from vllm.kernels import gdn_chunk
    from vllm.testing.chunked_scan import step_metadata

    op = gdn_chunk.gdn_chunk_triton
    x = make_inputs(21, seed=1)
    op(*x, K ** -0.5, step_metadata([0], [21]), None, chunk_size=C, aligned=True)
    # the trainer's forward storing T for the backward (gdn_chunk.SAVE_T_FOR_BACKWARD)
    md = step_metadata([0], [21])
    t_out = torch.empty((md.chunk_plan(C, True).num_chunks, x[2].shape[1], C, C))
    op(*x, K ** -0.5, md, None, chunk_size=C, aligned=True, t_out=t_out)
    run_schedule(op, {"x": make_inputs(20, seed=7)}, {"x": 1}, [[("x", 17)], [("x", 1)]], aligned=True)
    seqs = {"x": make_inputs(24, seed=2), "y": make_inputs(12, seed=3)}
    steps = [[("x", 18), ("y", 9)], [("y", 1), ("x", 1)], [("x", 1)], [("x", 4), ("y", 2)]]
    for aligned in (True, False):
        run_schedule(op, seqs, {"x": 1, "y": 3}, steps, aligned=aligned)
    bf = make_inputs(20, kd=48, vd=48, seed=4, dtype=torch.bfloat16)
    op(*bf, 48 ** -0.5, step_metadata([0], [20]), None, chunk_size=C, aligned=True)
    dc = {"x": make_inputs(18, 1, 2, K, V, seed=5, dtype=torch.bfloat16)}
    run_schedule(op, dc, {"x": 0}, [[("x", 17)], [("x", 1)]], aligned=True, chunk=64)
    saved = {n: getattr(gdn_chunk, n) for n in ("BLOCK_K_MAX", "PREP_BLOCK_V_MAX", "STATE_BLOCK_V_MAX",
                                                "OUT_BLOCK_V_MAX")}
    try:
        for n in saved:
            setattr(gdn_chunk, n, 16)
        tiles = {"x": make_inputs(18, kd=32, vd=48, seed=6)}
        run_schedule(op, tiles, {"x": 0}, [[("x", 17)], [("x", 1)]], aligned=True)
    finally:
        for n, v in saved.items():
            setattr(gdn_chunk, n, v)


def _gdn_ops():
    """The GDN layer's other kernels: the fast mode's recurrent decode step, the causal conv,
    the gating and the gated norm."""
    from test_gdn_chunk import HV, K, V, make_inputs

    from vllm.kernels import gdn_ops
    from vllm.testing.chunked_scan import step_metadata

    q, k, v, g, beta = make_inputs(3, seed=7)
    md = step_metadata([5, 0, 17], [1, 1, 1], [1, 2, 3], host=False)
    state = {"ssm": torch.zeros(4, HV, K, V)}
    gdn_ops.gdn_recurrent_triton(q, k, v, g, beta, K ** -0.5, md, state)
    gdn_ops.rms_norm_gated_triton(v.reshape(-1, V).contiguous(), torch.randn(3 * HV, V), torch.ones(V), 1e-6)


def _mamba2_chunk():
    """tests/test_mamba2_chunk.py's dims and calls: a trainer prefill; prefill, cuts and decode
    steps with the cache (aligned, then fast mode); bf16 on 128-row chunks (row tiles);
    16-wide tiles."""
    from test_mamba2_chunk import C, DT_MIN, make_inputs, params, run_schedule

    from vllm.kernels import mamba2_chunk
    from vllm.testing.chunked_scan import step_metadata

    op = mamba2_chunk.mamba2_chunk_triton
    prm = params()
    x, dt, B, Cm = make_inputs(21, seed=1)
    op(x, dt, prm[0], prm[1], B, Cm, prm[2], DT_MIN, step_metadata([0], [21]), None, chunk_size=C, aligned=True)
    seqs = {"x": make_inputs(24, seed=2), "y": make_inputs(12, seed=3)}
    steps = [[("x", 18), ("y", 9)], [("y", 1), ("x", 1)], [("x", 1)], [("x", 4), ("y", 2)]]
    for aligned in (True, False):
        run_schedule(op, seqs, prm, {"x": 1, "y": 3}, steps, aligned=aligned)
    bf = {"x": make_inputs(20, seed=4, dtype=torch.bfloat16)}
    run_schedule(op, bf, params(dtype=torch.bfloat16), {"x": 0}, [[("x", 19)], [("x", 1)]], aligned=True, chunk=128)
    saved = {n: getattr(mamba2_chunk, n) for n in ("BLOCK_N_MAX", "OUT_BLOCK_N_MAX", "STATE_BLOCK_P_MAX",
                                                     "OUT_BLOCK_P_MAX")}
    try:
        for n in saved:
            setattr(mamba2_chunk, n, 16)
        tiles = {"x": make_inputs(18, p=48, n=32, seed=6)}
        run_schedule(op, tiles, prm, {"x": 0}, [[("x", 17)], [("x", 1)]], aligned=True)
    finally:
        for n, v in saved.items():
            setattr(mamba2_chunk, n, v)


def _mamba2_ops():
    """The Mamba-2 layer's decode step (selective state update) and grouped gated norm."""
    from test_mamba2_chunk import DT_MIN, H, N, P, _cat_rows, make_inputs, params

    from vllm.kernels import mamba2_ops
    from vllm.testing.chunked_scan import step_metadata

    prm = params()
    x, dt, B, Cm = _cat_rows([make_inputs(1, seed=s) for s in (1, 2, 3)])
    md = step_metadata([5, 0, 17], [1, 1, 1], [1, 2, 3], host=False)
    mamba2_ops.selective_state_update_triton(x, dt, *prm[:2], B, Cm, prm[2], DT_MIN, md,
                                             {"ssm": torch.zeros(4, H, P, N)})
    y = x.reshape(3, -1).contiguous()
    mamba2_ops.gated_norm_triton(y, torch.randn_like(y), torch.ones(y.shape[1]), 1e-5, 2)


def _leaf_tree():
    """The TP leaf tree at every H200 config of its table, 8 leaves, bf16;
    the register-counter kernels ("tmar" and its pointer form "plainr") at every depth of
    the counter they unroll (1, 2, 8, 16 leaves); the hybrid "tmah" at 2, 4 and 16 leaves
    (its register counter then holds no level at 2 leaves, one at 4, three at 16)."""
    from vllm.kernels import leaf_tree

    x, w = torch.randn(256, 4096).bfloat16(), torch.randn(1024, 4096).bfloat16()
    for cfg in ([tuple(c) for _, *c in leaf_tree.TREE_GPU_CONFIGS]
                + [leaf_tree.TREE_GPU_LARGE_M, leaf_tree.TREE_GPU_SHORT_LEAF_LARGE_M]):
        leaf_tree.tree_linear_triton(x, w, 8, config=cfg)
    for leaves in (1, 2, 8, 16):
        leaf_tree.tree_linear_triton(x, w, leaves, config=("tmar", 64, 64, 128, 4, 4))
    leaf_tree.tree_linear_triton(x, w, 8, config=("tmar", 16, 32, 128, 4, 4))
    leaf_tree.tree_linear_triton(x, w, 8, config=("plainr", 16, 32, 128, 4, 4))
    for leaves in (2, 4, 16):
        leaf_tree.tree_linear_triton(x, w, leaves, config=("tmah", 64, 64, 128, 4, 4))


def _gemm():
    """The invariant GEMM at its H200 table's impls (plain, TMA, TMA flattened), with a bias.
    (NUM_PROGRAMS, a loop stride, is the CPU's 4 here, the SM count on the GPU.)"""
    from vllm.kernels import matmul

    x, w, b = torch.randn(256, 1024).bfloat16(), torch.randn(2048, 1024).bfloat16(), torch.randn(2048).bfloat16()
    for cfg in (("plain", 64, 64, 128, 4, 4), ("tma", 128, 256, 64, 8, 3), ("tmaf", 128, 128, 64, 4, 4)):
        matmul.invariant_matmul(x, w, b, config=cfg, allow_cublaslt=False)


def _attention():
    """Paged attention, head dim 128, GQA group 4, bf16: a prefill at the GPU's Q tile, a
    decode step and a decode step in parallel KV splits (with the merge kernel)."""
    from vllm.kernels import attention

    d, hq, hkv, bs = 128, 16, 4, 16
    caches = [torch.randn(256, bs, hkv, d).bfloat16() for _ in range(2)]
    table = torch.arange(256, dtype=torch.int32).view(2, 128)
    saved = attention.INTERPRET_PREFILL_BLOCK_M
    attention.INTERPRET_PREFILL_BLOCK_M = attention.PREFILL_BLOCK_M[d]
    try:
        q = torch.randn(300, hq, d).bfloat16()
        cu, lens = torch.tensor([0, 200, 300], dtype=torch.int32), torch.tensor([250, 100], dtype=torch.int32)
        attention.paged_attention_triton(q, *caches, table, cu, lens, d ** -0.5, max_query_len=200)
        q = torch.randn(2, hq, d).bfloat16()
        cu, lens = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([1500, 17], dtype=torch.int32)
        for split in (False, True):
            attention.paged_attention_triton(q, *caches, table, cu, lens, d ** -0.5, max_query_len=1,
                                             max_seq_len=2048, decode_parallel_splits=split)
    finally:
        attention.INTERPRET_PREFILL_BLOCK_M = saved


GPU_DOT_PRECISIONS = ("tf32x3", "bf16")


@contextlib.contextmanager
def _gpu_dot_precision(prec):
    """The training kernels' dots as the GPU compiles them (3xTF32 for float32 inputs, bf16
    operands for bfloat16 ones; "ieee" under the interpreter)."""
    from vllm.kernels import training_tiles
    saved, training_tiles.dot_precision = training_tiles.dot_precision, (lambda x: prec)
    try:
        yield
    finally:
        training_tiles.dot_precision = saved


def _chunk_recurrence():
    """GDN's training recurrence at a padded tile and at a split V (tests/test_chunk_recurrence.py),
    forward and backward (its walk and per-chunk parts)."""
    from vllm.kernels import chunk_recurrence as cr
    for prec in GPU_DOT_PRECISIONS:
        with _gpu_dot_precision(prec):
            _recurrence_shapes(cr)


def _recurrence_shapes(cr):
    from vllm.kernels import training_tiles
    bf16_ops = training_tiles.dot_precision(torch.zeros(1)) == "bf16"
    for shape in ((1, 2, 3, 16, 16, 32), (1, 1, 2, 5, 12, 80)):
        B, H, nC, C, K, V = shape
        u, w, kd = torch.randn(B, H, nC, C, V), torch.randn(B, H, nC, C, K), torch.randn(B, H, nC, C, K)
        e = torch.rand(B, H, nC)
        for ops in (torch.float32, torch.bfloat16) if bf16_ops and K % 8 == 0 else (torch.float32,):
            states, vn = cr.recurrence_forward_triton(u, w.to(ops), kd.to(ops), e, vn_dtype=ops)
            cr.recurrence_backward_triton(w.to(ops), kd.to(ops), e, states, vn, torch.randn_like(states),
                                          torch.randn_like(vn, dtype=torch.float32))


def _gdn_backward():
    """GDN's fused training backward at tests/test_gdn_backward.py's first case, with the
    GPU's dots at each precision (bf16: bfloat16 between the kernels), building T and taking
    the forward's (T_SAVED)."""
    from test_gdn_backward import make

    from vllm.kernels import gdn_backward
    for prec in GPU_DOT_PRECISIONS:
        with _gpu_dot_precision(prec):
            xs, do = make(30, 2, 4, 16, 32, seed=0)
            if prec == "bf16":  # the trainer's case: bf16 q, k, v, do (pointer types the kernels specialise on)
                xs, do = [x.bfloat16() if i < 3 else x for i, x in enumerate(xs)], do.bfloat16()
            gdn_backward.gdn_backward_triton(*xs, do, [0, 21, 30], 0.25, chunk_size=16)
            t = torch.eye(16, dtype=xs[0].dtype).expand(3, 4, 16, 16).contiguous()
            gdn_backward.gdn_backward_triton(*xs, do, [0, 21, 30], 0.25, 16, t,
                                             torch.tensor([0, 2, 3], dtype=torch.int32))


def _mamba2_backward():
    """Mamba-2's fused training backward with the GPU's dots at each precision, at N = 16,
    N = 100 (a partial column block of dB / dC: its masked loads and stores) and N = 128 (B
    and C in column slices for C B^T, dB / dC in two whole column blocks)."""
    from test_mamba2_backward import make

    from vllm.kernels import mamba2_backward
    for prec in GPU_DOT_PRECISIONS:
        with _gpu_dot_precision(prec):
            for n in (16, 100, 128):
                xs, dy = make(30, 2, 16, 1, n, seed=0)
                if prec == "bf16":  # the trainer's case: bf16 x, B, C, dy
                    xs, dy = [t.bfloat16() if i in (0, 4, 5) else t for i, t in enumerate(xs)], dy.bfloat16()
                mamba2_backward.mamba2_backward_triton(*xs, dy, 1e-3, [0, 21, 30], 16)


# name -> (driver, execute on the interpreter, kernels it must launch)
FAMILIES = {
    "gdn_chunk": (_gdn_chunk, True, {"_gdn_prep_kernel", "_gdn_state_kernel", "_gdn_output_kernel"}),
    "gdn_ops": (_gdn_ops, True, {"_recurrent_kernel", "_rms_norm_gated_kernel"}),
    "chunk_recurrence": (_chunk_recurrence, True, {"_fwd_kernel", "_bwd_walk_kernel", "_bwd_parts_kernel"}),
    "mamba2_backward": (_mamba2_backward, True, {"_prep_kernel", "_recurrence_kernel", "_dcb_kernel",
                                                 "_dbc_kernel", "_dx_kernel"}),
    "gdn_backward": (_gdn_backward, True, {"_prep_kernel", "_out_grad_kernel", "_walk_kernel", "_final_out_kernel",
                                           "_final_wu_kernel", "_group_sum_kernel"}),
    "mamba2_chunk": (_mamba2_chunk, True, {"_ssd_prep_kernel", "_ssd_state_kernel", "_ssd_output_kernel",
                                           "_ssd_buffer_kernel"}),
    "mamba2_ops": (_mamba2_ops, True, {"_ssu_kernel", "_gated_norm_kernel"}),
    "leaf_tree": (_leaf_tree, False, {"_tree_tma_regs_kernel", "_tree_regs_kernel"}),
    "gemm": (_gemm, False, {"_invariant_matmul_kernel", "_invariant_matmul_tma_kernel"}),
    "attention": (_attention, False, {"_paged_attn_kernel", "_merge_splits_kernel"}),
}


@pytest.fixture(scope="module")
def compiled():
    """{family: [Result] or the exception its driver raised}: every family recorded first,
    then all launches compiled in one batch (the compile processes start once)."""
    recorded = {}
    for name, (driver, execute, _) in FAMILIES.items():
        try:
            with sm90.record_launches(execute=execute) as rec:
                driver()
            recorded[name] = rec.launches
        except Exception as err:  # reported by that family's test
            recorded[name] = err
    launches = [la for got in recorded.values() if isinstance(got, list) for la in got]
    results = dict(zip(map(id, launches), sm90.compile_launches(launches)))
    return {name: got if isinstance(got, Exception) else [results[id(la)] for la in got]
            for name, got in recorded.items()}


def _known(result) -> str | None:
    consts = result.launch.constexpr_names()
    for (kernel, want), reason in KNOWN_FAILURES.items():
        if result.launch.kernel.qualname == kernel and all(consts.get(k) == v for k, v in want):
            return reason
    return None


@pytest.mark.parametrize("family", FAMILIES)
def test_launches_compile_for_sm90(compiled, family):
    got = compiled[family]
    if isinstance(got, Exception):
        raise got
    kernels = {r.launch.kernel.qualname for r in got}
    missing = FAMILIES[family][2] - kernels
    assert not missing, f"{family}: the driver no longer launches {sorted(missing)}"
    bad = sm90.failures(got)
    unknown = [r for r in bad if _known(r) is None]
    assert not unknown, (f"{len(unknown)} of {len(got)} {family} launches do not compile for sm_90:\n"
                         + sm90.format_failures(unknown))
    if bad:
        pytest.xfail("; ".join(sorted({_known(r) for r in bad})))


def test_resource_usage_is_read_from_the_cubin():
    """compile_launches(usage=True) reports each kernel's registers and stack as ptxas
    allotted them (benchmarks/kernels/sm90_stats.py prints them): a kernel holding a
    [BLOCK] float32 tile in registers reports at least that many, and no stack."""
    x = torch.zeros(128)
    with sm90.record_launches(execute=False) as rec:
        _double[(1,)](x, x, BLOCK=128, num_warps=1)
    (plain,), (used,) = sm90.compile_launches(rec.launches), sm90.compile_launches(rec.launches, usage=True)
    assert plain.ok and plain.registers is None
    assert used.ok and used.registers is not None and used.registers >= 4 and used.stack == 0


import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _double(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) * 2.0)
