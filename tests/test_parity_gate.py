"""The parity gate (vllm/testing/parity_gate.py, benchmarks/parity_gate.py): every axis at tiny
dims on the CPU, and the FP8 axes at Qwen3-1.7B dims on the GPU (the whole gate at real dims
is the GPU suite's `gate` step)."""
from __future__ import annotations

import shutil

import pytest

from vllm.testing.parity_gate import (AXES, GDN_AXES, NEMOTRON_AXES, Gate, GateOptions, Row, format_table, gate_passes,
                                     gdn_config, make_model_dir, model_configs, nemotron_config)


def _run(axes, modes=("invariant",), tiny=True, **opts):
    dense, moe = model_configs(tiny=tiny)
    dirs = [make_model_dir(dense), make_model_dir(moe), make_model_dir(gdn_config(tiny)),
            make_model_dir(nemotron_config(tiny))]
    try:
        gate = Gate(GateOptions(**opts), dirs[0], dirs[1], vocab=dense["vocab_size"], gdn_dir=dirs[2],
                    nemotron_dir=dirs[3])
        return [r for m in modes for r in gate.run(m, list(axes))]
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def _check_cpu_rows(rows, axes):
    # sleep-wake and graphs are CUDA axes
    assert {r.axis for r in rows} == set(axes) - {"sleep-wake", "graphs", "gdn-sleep-wake", "gdn-graphs"}
    for r in rows:
        assert r.layouts_total > 0 and r.trainer_total == 8, r
        assert r.layouts_differ == 0 and r.trainer_differ == 0, r
    for r in rows:
        if r.axis.endswith("update"):
            assert "8/8 rollouts changed" in r.detail  # the update really changed the weights
        if r.axis.endswith("prefix-cache"):
            assert not r.detail.startswith("0 ")  # the warm pass did hit the prefix cache
        if r.axis.endswith("preempt"):
            assert "(0 preemptions)" not in r.detail
    assert gate_passes(rows)


def test_gate_every_axis_is_zero_in_invariant_mode_on_cpu():
    axes = [a for a in AXES if a not in GDN_AXES + NEMOTRON_AXES]
    _check_cpu_rows(_run(axes, device="cpu", num_requests=8, max_prompt_len=40, max_tokens=5), axes)


def test_gate_gdn_axes_are_zero_in_invariant_mode_on_cpu():
    """The hybrid's axes, with prompts long enough (up to 150 tokens) to cross the 64-row chunk
    grid and leave prefix-cache state snapshots."""
    _check_cpu_rows(_run(GDN_AXES, device="cpu", num_requests=8, max_prompt_len=150, max_tokens=5), GDN_AXES)


def test_gate_nemotron_axes_are_zero_in_invariant_mode_on_cpu():
    """The Mamba-2 hybrid's axes, with prompts long enough (up to 70 tokens) to cross its 16-row
    chunk grid several times and leave prefix-cache state snapshots."""
    _check_cpu_rows(_run(NEMOTRON_AXES, device="cpu", num_requests=8, max_prompt_len=70, max_tokens=5), NEMOTRON_AXES)


def test_gate_verdict_and_table():
    rows = [Row("kv-fp8", "invariant", 0, 200, 1, 100, 0.1, 1.0), Row("kv-fp8", "fast", 7, 200, 9, 100, 0.1, 1.0)]
    assert not gate_passes(rows)
    assert gate_passes(rows[1:])  # the fast column never fails the gate
    table = format_table(rows, ["invariant", "fast"])
    assert "kv-fp8" in table and "1/100" in table and "7/200" in table


@pytest.mark.gpu
@pytest.mark.parametrize("axis", ["kv-fp8", "q-fp8", "kv+q-fp8"])
def test_gpu_fp8_axes_at_real_dims(axis):
    """Qwen3-1.7B dims (28 layers, head_dim 128), 24 requests of 1-600 prompt tokens, 24
    sampled tokens: layouts and rollout-vs-trainer bits equal with the FP8 switches."""
    rows = _run([axis], tiny=False, device="cuda", num_requests=24, max_prompt_len=600, max_tokens=24)
    assert len(rows) == 1 and rows[0].layouts_differ == 0 and rows[0].trainer_differ == 0, rows[0]
