"""`vllm train --rollout-url`: the trainer rolls out on a running `vllm serve` subprocess
(127.0.0.1, CPU) and syncs weights through its HTTP endpoints (gloo broadcast group, or
the checkpoint-path fallback); the rollout logprobs the server returned equal the
trainer's bit for bit on every step."""
from __future__ import annotations

import json
import os
import random

import pytest

from vllm.entrypoints.cli.main import main
from vllm.rl.metrics import read_metrics

ADMIN = "admin-rl"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("rl_remote")
    r = random.Random(0)
    with open(d / "train.jsonl", "w") as f:
        for _ in range(20):
            a, b = r.randint(0, 99), r.randint(0, 99)
            f.write(json.dumps({"question": f"{a}+{b}=", "solution": a + b}) + "\n")
    # any reward that differs within a group, so every step moves the weights
    (d / "toy_reward.py").write_text("def digits(response, answer, record):\n"
                                     "    return (sum(map(ord, response)) % 7) / 7\n")
    return {"train": str(d / "train.jsonl"), "reward": f"{d / 'toy_reward.py'}:digits"}


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    from vllm.testing.rollout_server import cpu_server
    with cpu_server(tiny_qwen3, "--admin-key", ADMIN, "--max-num-seqs", "16", env=dict(os.environ)) as srv:
        yield srv


@pytest.mark.parametrize("sync", ["group", "path"])
def test_train_against_a_server_keeps_parity(server, tiny_qwen3, data, tmp_path, capsys, sync):
    out = tmp_path / "run"
    rc = main(["train", "--model", tiny_qwen3, "--device", "cpu", "--rollout-url", server.url,
               "--rollout-admin-key", ADMIN, "--weight-sync", sync, "--data", data["train"],
               "--prompt-field", "question", "--answer-field", "solution", "--reward", data["reward"],
               "--group-size", "3", "--prompts-per-step", "2", "--max-response-tokens", "5", "--lr", "1e-2",
               "--steps", "2", "--output-dir", str(out), "--no-progress", "--no-tensorboard", "--no-plots"])
    assert rc == 0, capsys.readouterr()
    records = [r for r in read_metrics(str(out / "metrics.jsonl")) if r.get("kind") != "eval"]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["updated"] and r["grad_norm"] > 0 for r in records)
    assert all(r["logprob_diff_max"] == 0.0 for r in records)
    assert records[-1]["weight_version"] == 2


def test_a_server_that_dies_is_named(tiny_qwen3, capsys, monkeypatch):
    """A rollout server gone mid-run: rollouts and the weight update raise RolloutServerError
    naming it (not a raw socket or gloo error), and `vllm train` exits 1 with that line."""
    from vllm.rl import trainer as trainer_module
    from vllm.rl.rollout import RolloutRequest, RolloutSettings
    from vllm.rl.server_rollout import RolloutServerError, ServerRollout
    from vllm.testing.rollout_server import cpu_server

    with cpu_server(tiny_qwen3, "--admin-key", ADMIN, "--max-num-seqs", "4", env=dict(os.environ)) as srv:
        ro = ServerRollout([srv.url], tiny_qwen3, device="cpu", admin_key=ADMIN, timeout_s=60)
        settings = RolloutSettings(temperature=1.0, top_p=1.0, max_tokens=3)
        assert len(ro.generate([RolloutRequest([5, 6, 7], 2, 0)], settings)[0].completions) == 2  # group made
        srv.stop()
        with pytest.raises(RolloutServerError, match=f"{srv.url} stopped answering"):
            ro.generate([RolloutRequest([5, 6, 7], 2, 0)], settings)
        with pytest.raises(RolloutServerError, match=f"{srv.url}: the weight update failed"):
            ro.sync_weights(ro.policy())
        ro.close()

    def run(self):
        raise RolloutServerError("rollout server http://127.0.0.1:1 stopped answering (refused)")
    monkeypatch.setattr(trainer_module.Trainer, "run", run)
    monkeypatch.setattr(trainer_module.Trainer, "__init__", lambda self, cfg: setattr(self, "output_dir", "/nonexistent"))
    assert main(["train", "--model", tiny_qwen3, "--device", "cpu", "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "stopped answering" in err and "nothing to resume" in err
