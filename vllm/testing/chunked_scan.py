"""What the tests of the chunked recurrences (tests/test_gdn_chunk.py, tests/test_mamba2_chunk.py)
share: bit views and errors, a step's StateMetadata, NaN-filled caches, running a schedule of
steps through an entry, the schedules that cut one sequence differently, and the checks that
every schedule gives the same bits.

A schedule is a list of steps, each a list of (sequence id, tokens of it in the step); a
sequence's tokens are a tuple of per-token tensors [T, ...]. Parity claims compare bits (int
views), never allclose."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from vllm.forward_context import StateMetadata
from vllm.kernels.chunk_scan import ROUNDED_STATE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# sequence "x" of the invariance schedules: two full chunks of 16 and a partial one
X_LEN = 41


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.double() - ref.double()).norm().item()
    norm = ref.double().norm().item()
    return diff / norm if norm else diff


def step_metadata(start_pos, q_lens, slots=None, host=True, device=DEVICE) -> StateMetadata:
    """One step's sequences: each starts at start_pos with q_lens tokens (slots None: no
    cache); host=False leaves the chunks to be planned on the device (one-token steps)."""
    cu = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    return StateMetadata(
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        start_pos=torch.tensor(start_pos, dtype=torch.int32, device=device),
        slots=None if slots is None else torch.tensor(slots, dtype=torch.int32, device=device),
        max_query_len=int(max(q_lens)),
        host_start_pos=np.asarray(start_pos) if host else None,
        host_q_lens=np.asarray(q_lens) if host else None)


def assert_rounded_state(state: dict[str, torch.Tensor], slots) -> None:
    """Where the cache keeps the state's model-dtype copy ("ssm_rounded", invariant mode), it is
    the fp32 state rounded, bit for bit, in every slot of `slots` (what decode steps read must be
    what the whole-chunk path would round)."""
    if state is None or ROUNDED_STATE not in state:
        return
    for slot in slots:
        rounded = state[ROUNDED_STATE][slot]
        assert torch.equal(bits(rounded), bits(state["ssm"][slot].to(rounded.dtype))), slot


def nan_state(num_slots: int, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
              device=DEVICE) -> dict[str, torch.Tensor]:
    """A cache filled with NaN, name -> (shape after the slot dim, dtype): reading any stale
    entry shows in the outputs. Integer tensors (stamps) get 2**30, a position no test reaches."""
    return {name: torch.full((num_slots, *shape), float("nan") if dtype.is_floating_point else 2 ** 30, dtype=dtype,
                             device=device)
            for name, (shape, dtype) in tensors.items()}


def cat_rows(parts: list, device=DEVICE) -> tuple:
    """The step's inputs: each per-token tensor of the sequences' slices concatenated, contiguous."""
    return tuple(torch.cat(col).to(device).contiguous() for col in zip(*parts))


def run_steps(run_step: Callable, seqs: dict, slots: dict, schedule: list, join: Callable = cat_rows) -> dict:
    """Run `schedule` (module docstring), each step through run_step(join(slices), md) -> the
    step's outputs [T, ...] (the op bound to its cache). seqs: {id: per-token tensors}, slots:
    {id: cache slot}. Returns {id: the sequence's outputs, all steps} for the sequences run."""
    pos = {sid: 0 for sid in seqs}
    outs = {sid: [] for sid in seqs}
    for step in schedule:
        inputs = join([[t[pos[sid]:pos[sid] + n] for t in seqs[sid]] for sid, n in step])
        q_lens = [n for _, n in step]
        md = step_metadata([pos[sid] for sid, _ in step], q_lens, [slots[sid] for sid, _ in step],
                           host=max(q_lens) > 1)
        o = run_step(inputs, md).cpu()
        at = 0
        for sid, n in step:
            outs[sid].append(o[at:at + n])
            at += n
            pos[sid] += n
    return {sid: torch.cat(o) for sid, o in outs.items() if o}


# ---- schedules ----------------------------------------------------------------------------------

def invariance_schedules() -> dict:
    """Ways to run sequence "x" (X_LEN tokens) with company ("y": 60, "z": 31 tokens); each is
    (slots, steps)."""
    one = [("x", 1)]
    return {
        "alone": ({"x": 0}, [[("x", X_LEN)]]),
        "batch": ({"y": 3, "x": 1, "z": 2}, [[("y", 30), ("x", X_LEN), ("z", 7)]]),
        "batch_reordered": ({"x": 2, "z": 0, "y": 3}, [[("z", 19)], [("x", X_LEN), ("y", 0), ("z", 12)]]),
        "cuts": ({"x": 3, "y": 1}, [[("x", 5)], [("y", 9), ("x", 11)], [("x", 17), ("y", 2)], [("x", 8)]]),
        # steps that resume mid-chunk and end in a later partial chunk (the buffer is read
        # and rewritten by one step)
        "cuts_across": ({"x": 0, "z": 3}, [[("x", 5), ("z", 3)], [("z", 4), ("x", 20)], [("x", 9)], [("x", 7)]]),
        "prefill_decode": ({"x": 1, "y": 0}, [[("x", 20), ("y", 33)]]
                           + [[("y", 1), ("x", 1)] if i % 3 else one for i in range(X_LEN - 20)]),
        "all_decode": ({"x": 2}, [one] * X_LEN),
    }


# the invariance tests' cases: (dtype, the schedules compared, the first one's error bound)
INVARIANCE_CASES = {"fp32": (torch.float32, list(invariance_schedules()), 1e-5),
                    "bf16": (torch.bfloat16, ["alone", "cuts", "prefill_decode"], 2e-2)}


def used_ids(steps: list) -> set:
    return {sid for step in steps for sid, _ in step}


# the GPU tests at real dims: two sequences, in the slots given
REAL_DIMS_LENS = {0: 300, 1: 137}
REAL_DIMS_SLOTS = {0: 1, 1: 2}


def real_dims_schedules() -> dict:
    """The REAL_DIMS_LENS sequences as one prefill, as prefills cut off the chunk grid, as a
    prefill then decode steps and as all-decode."""
    return {
        "whole": [[(0, 300), (1, 137)]],
        "cuts": [[(0, 37), (1, 100)], [(1, 37), (0, 200)], [(0, 63)]],
        "prefill+decode": [[(0, 130), (1, 65)]] + [[(0, 1), (1, 1)]] * 72 + [[(0, 1)]] * 98,
        "decode": [[(0, 1), (1, 1)]] * 137 + [[(0, 1)]] * 163,
    }


# ---- checks -------------------------------------------------------------------------------------

def assert_schedules_agree(run: Callable, names: list, buffers: tuple, chunk: int, ref: torch.Tensor,
                           tol: float) -> dict:
    """Sequence "x" run by each named invariance schedule, run(seqs used, slots, steps) ->
    (outputs, state) with an aligned cache: the first schedule's outputs are within tol of ref
    and its state has no NaN; every other gives its bits (outputs, state and the `buffers`
    rows of the partial last chunk)."""
    results = {}
    for name in names:
        slots, steps = invariance_schedules()[name]
        outs, state = run(used_ids(steps), slots, steps)
        sl = slots["x"]
        tail = X_LEN % chunk
        results[name] = (outs["x"], state["ssm"][sl].cpu(), *(state[b][sl, :tail].cpu() for b in buffers))
    base_name = names[0]
    base = results[base_name]
    assert rel_err(base[0], ref) < tol
    assert not torch.isnan(base[1]).any()
    for name in names[1:]:
        got = results[name]
        assert torch.equal(bits(got[0]), bits(base[0])), f"{name}: outputs differ from {base_name}"
        assert torch.equal(bits(got[1]), bits(base[1])), f"{name}: state differs from {base_name}"
        for a, b in zip(got[2:], base[2:]):
            assert torch.equal(bits(a), bits(b)), f"{name}: buffer differs from {base_name}"
    return results


def assert_unused_slots_untouched(run: Callable) -> None:
    """The "batch_reordered" schedule (run as in assert_schedules_agree): "y" has a 0-token
    entry (slot 3) and slot 1 is nobody's, so both keep nan_state's fill in every cache tensor."""
    slots, steps = invariance_schedules()["batch_reordered"]
    _, state = run(set(slots), slots, steps)
    for name, t in state.items():
        untouched = torch.isnan if t.is_floating_point() else (lambda x: x == 2 ** 30)
        assert untouched(t[1]).all() and untouched(t[3]).all(), name


def assert_runs_close(run: Callable, impls: tuple, aligned: bool, tol: float = 1e-5) -> None:
    """Two implementations on the "cuts" schedule, run(impl, seqs used, slots, steps, aligned)
    -> (outputs, state): outputs and every sequence's state within tol of the first's."""
    slots, steps = invariance_schedules()["cuts"]
    used = used_ids(steps)
    a, sa = run(impls[0], used, slots, steps, aligned)
    b, sb = run(impls[1], used, slots, steps, aligned)
    for sid in a:
        assert rel_err(b[sid], a[sid]) < tol
    for sid in used:
        assert rel_err(sb["ssm"][slots[sid]].cpu(), sa["ssm"][slots[sid]].cpu()) < tol


def assert_cuts_match_alone(run: Callable, x: tuple, y: tuple, ref: torch.Tensor, tol: float = 1e-5) -> None:
    """Sequence x (37 tokens) alone and cut into steps beside y (20 tokens), run(seqs, slots,
    steps) -> (outputs, state): alone within tol of ref; cut, the same output and state bits."""
    n = x[0].shape[0]
    scheds = {
        "alone": ({"x": 0}, [[("x", n)]]),
        "cuts": ({"x": 2, "y": 0}, [[("x", 3), ("y", 20)], [("x", n - 7)], [("x", 1)], [("x", 3)]]),
    }
    res = {}
    for name, (slots, steps) in scheds.items():
        seqs = {"x": x, "y": y} if name == "cuts" else {"x": x}
        outs, state = run(seqs, slots, steps)
        res[name] = (outs["x"], state["ssm"][slots["x"]].cpu())
    assert rel_err(res["alone"][0], ref) < tol
    assert torch.equal(bits(res["cuts"][0]), bits(res["alone"][0]))
    assert torch.equal(bits(res["cuts"][1]), bits(res["alone"][1]))


def assert_real_dims_schedules_agree(run: Callable) -> tuple:
    """Every real_dims_schedules() schedule, run(steps) -> (outputs, state) with an aligned
    cache at REAL_DIMS_SLOTS, gives the "whole" schedule's output and state bits. Returns the
    whole schedule's (outputs, state)."""
    schedules = real_dims_schedules()
    ref, ref_state = run(schedules["whole"])
    for name, steps in schedules.items():
        got, state = run(steps)
        for sid, slot in REAL_DIMS_SLOTS.items():
            assert torch.equal(bits(got[sid]), bits(ref[sid])), (name, sid)
            assert torch.equal(bits(state["ssm"][slot]), bits(ref_state["ssm"][slot])), (name, sid)
    return ref, ref_state


def assert_fast_decode_differs(run: Callable) -> None:
    """Fast mode's decode is the native recurrence, run(steps) -> (outputs, state): some of its
    rows after a prefill differ from the whole prefill's."""
    lens = REAL_DIMS_LENS
    whole, _ = run(real_dims_schedules()["whole"])
    dec, _ = run(real_dims_schedules()["prefill+decode"])
    differ = sum(int(not torch.equal(bits(dec[s][t]), bits(whole[s][t]))) for s in lens for t in range(lens[s]))
    print(f"fast mode: {differ} of {sum(lens.values())} token rows differ between prefill and prefill+decode")
    assert differ > 0


def transformers_delta_rule(fn_name: str, q, k, v, g, beta, **kw):
    """transformers' torch reference of the gated delta rule (`torch_recurrent_gated_delta_rule`
    or `torch_chunk_gated_delta_rule`) on [B, T, H, D] inputs, with q and k repeated to the
    value heads first: older transformers releases (the GPU host's) do not repeat them."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    r = v.shape[-2] // k.shape[-2]
    return getattr(hf, fn_name)(q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2), v, g, beta, **kw)
