"""Checkpoint writes: refused up front when the disk lacks room, a failed write leaves no
partial checkpoint and `latest` where it was, background errors are never lost."""
from __future__ import annotations

import errno
import os
from collections import namedtuple

import pytest
import torch

from vllm.rl import checkpoint as ck


def _snapshot(weight: float = 1.0) -> ck.CheckpointSnapshot:
    return ck.CheckpointSnapshot(
        model_config={"architectures": ["Toy"]}, model_files=[],
        hf_tensors={"w": torch.full((256, 256), weight)},
        training_state={"optimizer": {"state": {0: {"exp_avg": torch.ones(256, 256)}}}, "master_weights": None,
                        "reference": None},
        rng=ck.rng_state(), trainer_state=dict(STATE), config_yaml="a: 1\n", contract_json="{}")


STATE = {"step": 1, "weight_version": 1, "data": {}, "seed": 0}


def _latest(run):
    return (run / "checkpoints" / "latest").read_text().strip()


def test_write_then_open(tmp_path):
    path = ck.checkpoint_path(str(tmp_path), 3)
    ck.CheckpointSnapshot.write(_snapshot(), path)
    c = ck.Checkpoint.open(ck.find_checkpoint("latest", str(tmp_path)))
    assert c.trainer_state == STATE and torch.equal(c.hf_weights()["w"], torch.ones(256, 256))
    assert torch.equal(c.training_state()["optimizer"]["state"][0]["exp_avg"], torch.ones(256, 256))


def test_no_room_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    first = ck.checkpoint_path(str(tmp_path), 1)
    _snapshot().write(first)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: usage(1 << 30, (1 << 30) - 4096, 4096))
    second = ck.checkpoint_path(str(tmp_path), 2)
    with pytest.raises(OSError) as info:
        _snapshot().write(second)
    assert info.value.errno == errno.ENOSPC
    msg = str(info.value)
    assert second in msg and os.path.dirname(second) in msg and "bytes" in msg and "GiB free" in msg
    assert not os.path.exists(second) and not os.path.exists(second + ".tmp")
    assert _latest(tmp_path) == "step_000001"


def test_a_failed_write_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    _snapshot().write(ck.checkpoint_path(str(tmp_path), 1))

    def broken(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos 4160 vs 4096")
    monkeypatch.setattr(ck.torch, "save", broken)
    path = ck.checkpoint_path(str(tmp_path), 2)
    with pytest.raises(OSError, match="writing failed .*unexpected pos") as info:
        _snapshot().write(path)
    assert path in str(info.value) and "GiB were free" in str(info.value)
    assert not os.path.exists(path) and not os.path.exists(path + ".tmp")
    assert _latest(tmp_path) == "step_000001"


def test_background_writer_reports_errors_and_keeps_order(tmp_path, monkeypatch):
    w = ck.CheckpointWriter(background=True)
    w.submit(_snapshot(1.0), ck.checkpoint_path(str(tmp_path), 1))
    w.submit(_snapshot(2.0), ck.checkpoint_path(str(tmp_path), 2))  # waits for the first
    w.wait()
    assert _latest(tmp_path) == "step_000002"
    assert w.last_path == ck.checkpoint_path(str(tmp_path), 2)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: usage(1, 1, 0))
    w.submit(_snapshot(3.0), ck.checkpoint_path(str(tmp_path), 3))
    with pytest.raises(OSError, match="needs about"):
        w.wait()
    w.wait()  # reported once
    assert _latest(tmp_path) == "step_000002"


def test_host_copy_is_a_copy():
    t = torch.zeros(4)
    snap = ck._host_copy({"a": [t]})
    t.add_(1)
    assert snap["a"][0].sum() == 0


def _truncate(p):
    data = p.read_bytes()
    p.write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize("damage, part", [
    (lambda d: (d / "config.yaml").unlink(), "config.yaml"),
    (lambda d: (d / "config.yaml").write_text(""), "config.yaml"),
    (lambda d: (d / "config.yaml").write_text("a: [1\n"), "config.yaml"),
    (lambda d: (d / "contract.json").unlink(), "contract.json"),
    (lambda d: (d / "trainer_state.json").write_text("{not json"), "trainer_state.json"),
    (lambda d: (d / "trainer_state.json").write_text('{"step": 1}'), "trainer_state.json"),
    (lambda d: (d / "rng.pt").unlink(), "rng.pt"),
    (lambda d: __import__("shutil").rmtree(d / "model"), "model/"),
])
def test_a_damaged_checkpoint_is_refused_by_name(tmp_path, damage, part):
    """A resume from a checkpoint with a missing, empty or unreadable part is a ValueError
    naming the part (not a FileNotFoundError / JSONDecodeError / KeyError from deep inside,
    nor, for an empty config.yaml, a run silently resumed on the default settings)."""
    path = ck.checkpoint_path(str(tmp_path), 3)
    ck.CheckpointSnapshot.write(_snapshot(), path)
    damage(tmp_path / "checkpoints" / os.path.basename(path))
    with pytest.raises(ValueError, match=f"incomplete or damaged: {part}"):
        ck.Checkpoint.open(path)


@pytest.mark.parametrize("name", ["training_state.pt", "rng.pt", "model/model.safetensors"])
def test_a_truncated_file_is_refused_by_name_when_read(tmp_path, name):
    path = ck.checkpoint_path(str(tmp_path), 3)
    ck.CheckpointSnapshot.write(_snapshot(), path)
    _truncate(tmp_path / "checkpoints" / os.path.basename(path) / name)
    c = ck.Checkpoint.open(path)
    read = {"training_state.pt": c.training_state, "rng.pt": c.rng_state, "model/model.safetensors": c.hf_weights}
    with pytest.raises(ValueError, match=f"incomplete or damaged: {name}"):
        read[name]()
