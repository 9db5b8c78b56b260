"""chunk_tiles.unit_lower_block_row and unit_lower_block_row_in_place, the block rows of
T = (I + A)^-1 that Gated DeltaNet's kernels build (T carried in registers: the backward's own
T; in a workspace: the forward's prep kernel): against float64 inversion, and the property the
decode path rests on (a block row's bits depend on its operands' values only: computed alone
from T's earlier rows read back from memory, it has the bits of the same row in a whole-tile
pass). In the Triton interpreter on CPU; on the GPU with 3xTF32 dots."""
from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from vllm.kernels.chunk_tiles import HAS_TRITON
from vllm.testing.chunked_scan import DEVICE as DEV

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")

if HAS_TRITON:
    import triton
    import triton.language as tl

    from vllm.kernels.chunk_tiles import invert_diagonal_blocks_in_place, unit_lower_block_row, \
        unit_lower_block_row_in_place

    @triton.jit
    def _inverse_kernel(a_ptr, t_ptr, b_first, C: tl.constexpr, DB: tl.constexpr, EMULATE: tl.constexpr):
        """T's block rows b_first .. C / DB - 1 of (I + A)^-1 for the strictly lower C x C matrix
        at a_ptr into t_ptr; rows before b_first * DB are read from t_ptr (as the decode path
        reads the T cache), the others are carried in registers from block row to block row."""
        NB: tl.constexpr = C // DB
        rows = tl.arange(0, C)
        tiles = tl.arange(0, NB)[:, None, None]
        row3 = tiles * DB + tl.arange(0, DB)[None, :, None]
        cached = row3 < b_first * DB
        T3 = tl.where(row3 == rows[None, None, :], 1.0, 0.0)
        T3 = tl.where(cached, tl.load(t_ptr + row3 * C + rows[None, None, :], mask=cached, other=0.0), T3)
        for bi in range(b_first, NB):
            rb = bi * DB + tl.arange(0, DB)
            Ab = tl.load(a_ptr + rb[:, None] * C + rows[None, :])
            Tb = unit_lower_block_row(Ab, tl.reshape(tl.where(tiles < bi, T3, 0.0), (C, C)), bi, DB, EMULATE)
            T3 = tl.where(tiles == bi, Tb[None, :, :], T3)
            tl.store(t_ptr + rb[:, None] * C + rows[None, :], Tb)


    @triton.jit
    def _inverse_in_place_kernel(a_ptr, t_ptr, b_first, C: tl.constexpr, DB: tl.constexpr, EMULATE: tl.constexpr,
                                 BATCHED: tl.constexpr):
        """The same block rows with t_ptr as the workspace: each block row's rows of A are stored
        there, then overwritten by T's (rows before b_first * DB are T's already). BATCHED: A's
        rows all stored first and their diagonal blocks inverted side by side
        (invert_diagonal_blocks_in_place), as the forward's whole-chunk path does."""
        NB: tl.constexpr = C // DB
        rows = tl.arange(0, C)
        if BATCHED:
            rest = (rows >= b_first * DB)[:, None]
            tl.store(t_ptr + rows[:, None] * C + rows[None, :],
                     tl.load(a_ptr + rows[:, None] * C + rows[None, :], mask=rest, other=0.0), mask=rest)
            tl.debug_barrier()
            invert_diagonal_blocks_in_place(t_ptr, b_first, DB, C, EMULATE)
        for bi in range(b_first, NB):
            rb = bi * DB + tl.arange(0, DB)
            if not BATCHED:
                tl.store(t_ptr + rb[:, None] * C + rows[None, :], tl.load(a_ptr + rb[:, None] * C + rows[None, :]))
                tl.debug_barrier()
            unit_lower_block_row_in_place(t_ptr, bi, BATCHED, DB, C, EMULATE)


def _strict_lower(C: int, seed: int, zero_from: int | None = None) -> torch.Tensor:
    """A as Gated DeltaNet's prep forms it: beta_i (k_i . k_j) exp(gamma_i - gamma_j), j < i."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(C, 32, generator=gen), dim=-1)
    beta = torch.rand(C, generator=gen)
    gam = torch.cumsum(-0.6 * torch.rand(C, generator=gen), 0)
    A = torch.tril(beta[:, None] * (k @ k.T) * torch.exp(gam[:, None] - gam[None, :]), diagonal=-1)
    if zero_from is not None:
        A[zero_from:] = 0.0  # the zero rows past a chunk's last row
    return A


def _run(A: torch.Tensor, T: torch.Tensor, b_first: int, DB: int = 16, form: str = "registers") -> torch.Tensor:
    if form == "registers":
        _inverse_kernel[(1,)](A, T, b_first, C=A.shape[0], DB=DB, EMULATE=not A.is_cuda)
    else:
        _inverse_in_place_kernel[(1,)](A, T, b_first, C=A.shape[0], DB=DB, EMULATE=not A.is_cuda,
                                       BATCHED=form == "workspace-batched")
    return T


FORMS = ["registers", "workspace", "workspace-batched"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("C", [16, 64])
def test_block_rows_invert_against_float64(C, form):
    A = _strict_lower(C, seed=C)
    T = _run(A.to(DEV), torch.zeros(C, C, device=DEV), 0, form=form).cpu()
    exact = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A.double())
    assert ((T.double() - exact).norm() / exact.norm()).item() < 4e-6  # 3xTF32 dots on the GPU
    assert torch.equal(torch.tril(T), T)  # lower triangular, exact zeros above


@pytest.mark.parametrize("form", FORMS)
def test_zero_rows_give_unit_rows_and_leave_earlier_rows_alone(form):
    C, L = 64, 37
    A = _strict_lower(C, seed=1)
    full = _run(A.to(DEV), torch.zeros(C, C, device=DEV), 0, form=form).cpu()
    cut = _run(_strict_lower(C, seed=1, zero_from=L + 1).to(DEV), torch.zeros(C, C, device=DEV), 0,
               form=form).cpu()
    assert torch.equal(cut[: L + 1].view(torch.int32), full[: L + 1].view(torch.int32))
    assert torch.equal(cut[L + 1:], torch.eye(C)[L + 1:])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("b_first", [1, 2, 3])
def test_a_block_row_alone_has_the_whole_pass_bits(b_first, form):
    """The decode path: block rows from b_first on, T's earlier rows read back from memory,
    give the bits of a whole-tile pass (which carries them in registers, or in the workspace)."""
    C = 64
    A = _strict_lower(C, seed=7).to(DEV)
    whole = _run(A, torch.zeros(C, C, device=DEV), 0, form=form)
    resumed = whole.clone()
    resumed[b_first * 16:] = float("nan")  # must be recomputed, never read
    _run(A, resumed, b_first, form=form)
    assert torch.equal(resumed.view(torch.int32), whole.view(torch.int32))


def test_the_forms_sum_x_in_other_orders():
    """The workspace form sums A[b, :b] T[:b, :] by DB-wide K blocks: the same T within 3xTF32's
    error, not the same bits (so the forward's every path runs the one form)."""
    C = 64
    A = _strict_lower(C, seed=3).to(DEV)
    reg = _run(A, torch.zeros(C, C, device=DEV), 0).cpu().double()
    ws = _run(A, torch.zeros(C, C, device=DEV), 0, form="workspace").cpu().double()
    assert ((reg - ws).norm() / reg.norm()).item() < 4e-6


@pytest.mark.parametrize("b_first", [0, 1, 3])
def test_batched_diagonal_inverses_have_the_one_block_bits(b_first):
    """The whole-chunk path inverts the diagonal blocks side by side, the decode path one block
    alone: every entry of T has the same bits either way (whatever the block rows resumed)."""
    C = 64
    A = _strict_lower(C, seed=11).to(DEV)
    one = _run(A, torch.zeros(C, C, device=DEV), 0, form="workspace")
    resumed = one.clone()
    resumed[b_first * 16:] = float("nan")  # must be recomputed, never read
    _run(A, resumed, b_first, form="workspace-batched")
    assert torch.equal(resumed.view(torch.int32), one.view(torch.int32))
