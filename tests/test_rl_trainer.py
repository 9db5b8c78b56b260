"""The RL loop end to end on a tiny model: zero rollout/trainer mismatch at every step in
invariant mode, bit-exact resume, the DAPO / KL / multi-update paths, and the default
recipe (the embedded model on the arithmetic task)."""
from __future__ import annotations

import json
import math
import os
import random
import re
import sys
import threading

import pytest
import torch
import yaml

from vllm.entrypoints.cli.main import main
from vllm.rl.config import TrainConfig
from vllm.rl.metrics import STEP_KEYS, read_metrics
from vllm.rl.trainer import Trainer

REWARD_SRC = (
    "def digit_fraction(response, answer, record):\n"
    "    return sum(c.isdigit() for c in response) / max(1, len(response))\n"
)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


@pytest.fixture(scope="module")
def rl_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("rl_data")
    r = random.Random(0)
    for name, n in (("train.jsonl", 40), ("eval.jsonl", 4)):
        with open(d / name, "w") as f:
            for _ in range(n):
                a, b = r.randint(0, 99), r.randint(0, 99)
                f.write(json.dumps({"question": f"{a}+{b}=", "solution": a + b}) + "\n")
    (d / "toy_reward.py").write_text(REWARD_SRC)
    return {"train": str(d / "train.jsonl"), "eval": str(d / "eval.jsonl"), "reward": f"{d / 'toy_reward.py'}:digit_fraction"}


def _config(tiny_qwen3, rl_files, out, **over) -> TrainConfig:
    base = {"model": tiny_qwen3, "device": "cpu", "numerics": "invariant", "data": rl_files["train"],
            "prompt_field": "question", "answer_field": "solution", "reward": rl_files["reward"],
            "group_size": 4, "prompts_per_step": 3, "max_response_tokens": 6, "lr": 1e-3, "steps": 3,
            "output_dir": str(out), "progress": False, "plots": False, "tensorboard": False}
    base.update(over)
    return TrainConfig.from_dict(base)


def test_invariant_run_has_zero_mismatch_every_step(tiny_qwen3, rl_files, tmp_path, capsys):
    rc = main(["train", "--model", tiny_qwen3, "--device", "cpu", "--data", rl_files["train"], "--prompt-field",
               "question", "--answer-field", "solution", "--reward", rl_files["reward"], "--eval-data",
               rl_files["eval"], "--eval-interval", "2", "--group-size", "4", "--prompts-per-step", "3",
               "--max-response-tokens", "6", "--lr", "1e-3", "--steps", "3", "--output-dir", str(tmp_path / "run"),
               "--no-progress", "--no-tensorboard", "--no-plots"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "step 3/3" in out and "diff max 0 mean 0 std 0" in out
    rows = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    steps = [r for r in rows if r.get("kind") != "eval"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["step"] for r in evals] == [0, 2, 3] and all(r["eval_problems"] == 4 for r in evals)
    for r in steps:
        assert all(k in r for k in STEP_KEYS)
        assert r["logprob_diff_max"] == 0.0 and r["logprob_diff_mean"] == 0.0 and r["k3_kl"] == 0.0
        assert r["clip_fraction"] == 0.0  # one update per batch: the ratio is exactly 1
        assert r["updated"] and r["grad_norm"] > 0
        # the policy's entropy at its response tokens (nats; a random tiny model's is high)
        assert 0 < r["entropy"] < 20
    assert "| ent " in out
    assert [r["weight_version"] for r in steps] == [1, 2, 3]
    ckpt = tmp_path / "run" / "checkpoints" / "step_000003"
    assert (ckpt / "model" / "model.safetensors").is_file() and (ckpt / "contract.json").is_file()
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["weight_version"] == 3 and state["data"]["consumed"] == 9


def test_resume_is_bit_exact(tiny_qwen3, rl_files, tmp_path, monkeypatch):
    """Steps 1-3 in one go vs steps 1-2, a checkpoint, a fresh process state, step 3:
    the same rollouts, rollout and trainer logprobs, and updated weights, bit for bit. The
    checkpoint is written in the background while step 3 runs (held back until step 3 has
    changed the weights), so it must hold the snapshot of step 2, not live tensors."""
    from vllm.rl import checkpoint as ck

    started, release = threading.Event(), threading.Event()
    write = ck.CheckpointSnapshot.write

    def held_write(self, path):
        started.set()
        release.wait(30)
        return write(self, path)
    monkeypatch.setattr(ck.CheckpointSnapshot, "write", held_write)
    cfg = _config(tiny_qwen3, rl_files, tmp_path / "a", checkpoint_interval=2)
    a = Trainer(cfg)
    results = []
    for _ in range(3):
        results.append(a.step())
        if a.step_count == 2:
            a.save()
            before = [p.detach().clone() for p in a.params]
            assert started.wait(30)
    release.set()
    a.checkpoints.wait()
    weights_a = [p.detach().clone() for p in a.params]
    assert any(not torch.equal(x, y) for x, y in zip(before, weights_a)), "step 3 must change the weights"
    # other RNG use between the runs must not matter
    torch.manual_seed(1234)
    random.seed(99)
    b = Trainer(_config(tiny_qwen3, rl_files, tmp_path / "a", resume="latest", checkpoint_interval=2))
    assert b.step_count == 2 and b.weight_version == 2 and b.sampler.consumed == a.sampler.consumed - 3
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(before, b.params))
    rb, ra = b.step(), results[2]
    assert rb.sequences == ra.sequences and rb.prompt_lens == ra.prompt_lens
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(ra.rollout_logprobs, rb.rollout_logprobs))
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(ra.train_logprobs, rb.train_logprobs))
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(weights_a, b.params))
    for k in ("reward_mean", "grad_norm", "loss", "logprob_diff_max"):
        assert ra.metrics[k] == rb.metrics[k], k


def test_resume_via_cli_continues_metrics(tiny_qwen3, rl_files, tmp_path, capsys):
    common = ["--model", tiny_qwen3, "--device", "cpu", "--data", rl_files["train"], "--prompt-field", "question",
              "--answer-field", "solution", "--reward", rl_files["reward"], "--group-size", "2", "--prompts-per-step",
              "2", "--max-response-tokens", "4", "--output-dir", str(tmp_path / "run"), "--no-progress",
              "--no-tensorboard", "--no-plots", "--lr", "1e-5", "--warmup-steps", "0", "--lr-schedule", "cosine",
              "--min-lr-ratio", "0.1"]
    assert main(["train", *common, "--steps", "2"]) == 0
    assert main(["train", *common, "--steps", "2"]) == 2  # refuses to overwrite the run
    assert "--resume" in capsys.readouterr().err
    saved = yaml.safe_load((tmp_path / "run" / "checkpoints" / "step_000002" / "config.yaml").read_text())
    assert saved["optim"]["lr_decay_steps"] == 2  # the schedule's length is pinned in the run's config
    # --resume alone: the checkpoint's configuration, extended by --steps; the cosine schedule
    # keeps the length the first two steps were computed with, so step 3 runs at the floor
    assert main(["train", "--resume", "--output-dir", str(tmp_path / "run"), "--steps", "3", "--no-progress"]) == 0
    rows = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["lr"] for r in rows] == pytest.approx([1e-5, 0.55e-5, 0.1e-5], rel=1e-12)
    out = capsys.readouterr().out
    assert "resumed at step 2" in out and "changed knobs" not in out


def test_resume_from_another_directory_with_relative_paths(tiny_qwen3, rl_files, tmp_path, monkeypatch, capsys):
    """A run started with relative paths (data, reward file, output directory) resumes from
    another working directory by its checkpoint's path alone: the checkpoint keeps them absolute."""
    import shutil
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(rl_files["train"], work / "train.jsonl")
    shutil.copy(rl_files["reward"].rpartition(":")[0], work / "toy_reward.py")
    monkeypatch.chdir(work)
    common = ["--device", "cpu", "--no-progress", "--no-tensorboard", "--no-plots"]
    assert main(["train", *common, "--model", tiny_qwen3, "--data", "train.jsonl", "--prompt-field", "question",
                 "--answer-field", "solution", "--reward", "toy_reward.py:digit_fraction", "--group-size", "2",
                 "--prompts-per-step", "2", "--max-response-tokens", "4", "--output-dir", "run", "--steps", "1"]) == 0
    saved = yaml.safe_load((work / "run" / "checkpoints" / "step_000001" / "config.yaml").read_text())
    flat = {k: v for section in saved.values() if isinstance(section, dict) for k, v in section.items()}
    assert flat["data"] == str(work / "train.jsonl") and flat["output_dir"] == str(work / "run")
    assert flat["reward"] == f"{work / 'toy_reward.py'}:digit_fraction"
    monkeypatch.chdir(tmp_path)
    assert main(["train", *common, "--resume", str(work / "run" / "checkpoints" / "latest"), "--steps", "2"]) == 0
    assert [r["step"] for r in read_metrics(str(work / "run" / "metrics.jsonl"))] == [1, 2]
    assert not (tmp_path / "run").exists()


def test_cli_resume_rederives_the_knobs_a_rule_set(tiny_qwen3, rl_files, tmp_path, capsys):
    """The checkpoint's config pins overlong_buffer (DAPO: max_response_tokens // 5); a resume
    through the CLI that changes max_response_tokens re-derives it, as a resume through the
    API does, instead of refusing the pinned value against the new length."""
    out = str(tmp_path / "run")
    assert main(["train", "--model", tiny_qwen3, "--device", "cpu", "--data", rl_files["train"], "--prompt-field",
                 "question", "--answer-field", "solution", "--reward", rl_files["reward"], "--algorithm", "dapo",
                 "--group-size", "2", "--prompts-per-step", "2", "--max-response-tokens", "10", "--steps", "1",
                 "--output-dir", out, "--no-progress", "--no-tensorboard", "--no-plots"]) == 0
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    assert state["derived_knobs"] == ["lr_decay_steps", "overlong_buffer"]
    capsys.readouterr()
    assert main(["train", "--resume", "--output-dir", out, "--steps", "2", "--max-response-tokens", "1",
                 "--no-progress"]) == 0, capsys.readouterr().err
    saved = yaml.safe_load((tmp_path / "run" / "checkpoints" / "step_000002" / "config.yaml").read_text())
    assert (saved["algorithm"]["overlong_buffer"], saved["optim"]["lr_decay_steps"]) == (0, 1)


def test_dapo_kl_multi_update_paths(tiny_qwen3, rl_files, tmp_path):
    cfg = _config(tiny_qwen3, rl_files, tmp_path / "dapo", algorithm="dapo", kl_coef=0.1, updates_per_step=2,
                  micro_batch_tokens=40, tis_cap=2.0, max_gen_batches=2, steps=2, prompts_per_step=4)
    t = Trainer(cfg)
    assert t.cfg.algorithm.dynamic_sampling and t.cfg.algorithm.loss_agg == "token-mean"
    assert t.cfg.algorithm.overlong_buffer == 1
    # the resolved defaults are pinned in the config saved with every checkpoint
    assert (t.raw_config.algorithm.overlong_buffer, t.raw_config.optim.lr_decay_steps) == (1, 2)
    for _ in range(2):
        m = t.step().metrics
        assert m["logprob_diff_max"] == 0.0  # the rollout's weights, before the first update
        assert m["groups_kept"] <= 4 and m["gen_batches"] <= 2
        assert "ref_kl" in m and m["ref_kl"] >= 0.0
        if m["updated"]:
            assert m["grad_norm"] > 0


def test_loss_metric_is_the_mean_over_the_updates_made(tiny_qwen3, rl_files, tmp_path, monkeypatch):
    """With fewer kept groups than updates_per_step some mini-batches are empty and make no
    update: the reported loss is the mean over the updates made, not over every mini-batch.
    Dr. GRPO's aggregation (seq-mean-token-sum-norm) runs."""
    from vllm.rl import losses
    from vllm.rl.trainer import Trainer as T
    per_update, current = [], []
    real_loss, real_step = losses.policy_loss, T._optimizer_step

    def loss_spy(*args, **kw):
        loss, st = real_loss(*args, **kw)
        current.append(float(loss.detach()))
        return loss, st

    def step_spy(self, step):
        per_update.append(sum(current))
        current.clear()
        return real_step(self, step)
    def one_group_kept(scores):   # dynamic sampling keeps the first group only
        keep = torch.zeros(scores.shape[0], dtype=torch.bool)
        keep[0] = True
        return keep
    monkeypatch.setattr(losses, "policy_loss", loss_spy)
    monkeypatch.setattr(losses, "informative_groups", one_group_kept)
    # advantages that are never all 0 (the tiny model's rewards may tie), so the loss is not 0
    monkeypatch.setattr(losses, "group_advantages",
                        lambda rewards, norm_by_std=True: torch.linspace(0.5, 1.0, rewards.numel()).reshape(rewards.shape))
    monkeypatch.setattr(T, "_optimizer_step", step_spy)
    t = Trainer(_config(tiny_qwen3, rl_files, tmp_path / "upd", algorithm="dapo", updates_per_step=4,
                        prompts_per_step=4, max_gen_batches=1, steps=1, loss_agg="seq-mean-token-sum-norm",
                        norm_adv_by_std=False))
    m = t.step().metrics
    assert m["groups_kept"] == 1 and len(per_update) == 1   # one update; three mini-batches empty
    assert per_update[0] != 0.0
    assert m["loss"] == pytest.approx(per_update[0], rel=1e-9, abs=1e-12)


def test_a_skipped_update_shows_in_the_metrics(tiny_qwen3, rl_files, tmp_path, monkeypatch):
    """An update whose loss (so its gradient norm) is nan is skipped: grad_norm is the mean of
    the finite norms and updates_skipped counts the skipped one (a max over the norms hid it)."""
    from vllm.rl import losses
    from vllm.rl.trainer import Trainer as T
    calls, norms = [0], []
    real_loss, real_step = losses.policy_loss, T._optimizer_step

    def nan_second(*args, **kw):
        loss, st = real_loss(*args, **kw)
        calls[0] += 1
        return (loss * float("nan") if calls[0] == 2 else loss), st

    def step_spy(self, step):
        norms.append(real_step(self, step))
        return norms[-1]
    monkeypatch.setattr(losses, "policy_loss", nan_second)
    monkeypatch.setattr(T, "_optimizer_step", step_spy)
    # advantages that are never all 0 (the tiny model's rewards may tie): the first update has a
    # gradient, so it is taken (a gradient of exactly 0 is skipped too)
    monkeypatch.setattr(losses, "group_advantages",
                        lambda rewards, norm_by_std=True: torch.linspace(0.5, 1.0, rewards.numel()).reshape(rewards.shape))
    t = Trainer(_config(tiny_qwen3, rl_files, tmp_path / "nan", updates_per_step=2, prompts_per_step=2, steps=1))
    m = t.step().metrics
    assert [ok for _, ok in norms] == [True, False] and math.isnan(norms[1][0])
    assert m["grad_norm"] == norms[0][0] and m["updates_skipped"] == 1 and m["updated"]


def test_a_step_without_learning_signal_takes_no_optimizer_step(tiny_qwen3, rl_files, tmp_path, monkeypatch):
    """Every advantage 0 and no KL term: the gradient is exactly 0, and AdamW would still move
    the weights by the momentum of the step before. No step is taken, reported as a step
    without kept groups reports it: not updated, weight_version kept, nothing synced."""
    from vllm.rl import losses
    t = Trainer(_config(tiny_qwen3, rl_files, tmp_path / "zero", steps=2))
    monkeypatch.setattr(losses, "group_advantages",
                        lambda rewards, norm_by_std=True: torch.linspace(-1.0, 1.0, rewards.numel()).reshape(rewards.shape))
    first = t.step().metrics
    assert first["updated"] and first["weight_version"] == 1 and first["updates_skipped"] == 0
    monkeypatch.setattr(losses, "group_advantages", lambda rewards, norm_by_std=True: torch.zeros_like(rewards))
    synced = []
    monkeypatch.setattr(t.client, "sync_weights", lambda policy: synced.append(policy))
    before = [p.detach().clone() for p in t.params]
    adam_steps = [float(st["step"]) for st in t.optimizer.state.values()]
    m = t.step().metrics
    assert not m["updated"] and m["weight_version"] == 1 and t.weight_version == 1 and not synced
    assert m["updates_skipped"] == 1 and m["grad_norm"] == 0.0 and m["loss"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, t.params))
    assert [float(st["step"]) for st in t.optimizer.state.values()] == adam_steps


def test_a_step_without_kept_groups_logs_a_trained_steps_columns(tiny_qwen3, rl_files, tmp_path, monkeypatch):
    from vllm.rl import losses
    cfg = dict(algorithm="dapo", kl_coef=0.1, max_gen_batches=1, steps=1)
    trained = Trainer(_config(tiny_qwen3, rl_files, tmp_path / "t", dynamic_sampling=False, **cfg)).step().metrics
    monkeypatch.setattr(losses, "informative_groups", lambda scores: torch.zeros(scores.shape[0], dtype=torch.bool))
    empty = Trainer(_config(tiny_qwen3, rl_files, tmp_path / "e", **cfg)).step().metrics
    assert empty["groups_kept"] == 0 and not empty["updated"]
    assert set(trained) == set(empty)


def test_dynamic_sampling_short_of_groups_warns(tiny_qwen3, rl_files, tmp_path, monkeypatch, caplog):
    """max_gen_batches ran out before prompts_per_step informative groups: the step trains
    on what it found and says so (a warning beside groups_kept)."""
    from vllm.rl import losses
    monkeypatch.setattr(losses, "informative_groups",
                        lambda scores: torch.arange(scores.shape[0]) == 0)   # one group a batch
    with caplog.at_level("WARNING", logger="vllm.rl.trainer"):
        m = Trainer(_config(tiny_qwen3, rl_files, tmp_path / "d", algorithm="dapo", max_gen_batches=2,
                            steps=1)).step().metrics
    assert m["groups_kept"] == 2 and "found 2 of 3 informative groups" in caplog.text


def test_a_response_budget_past_the_context_is_refused_up_front(tiny_qwen3, rl_files, tmp_path):
    with pytest.raises(ValueError, match="max_response_tokens=100000 leaves no room"):
        Trainer(_config(tiny_qwen3, rl_files, tmp_path / "c", max_response_tokens=100000))


def test_fp8_kv_cache_run_has_zero_mismatch(tiny_qwen3, rl_files, tmp_path):
    """kv_cache_dtype fp8: the rollout reads K/V through the FP8 round trip, the trainer's
    logprobs take the same one, so every step's difference is still exactly 0."""
    t = Trainer(_config(tiny_qwen3, rl_files, tmp_path / "fp8", kv_cache_dtype="fp8", steps=2))
    assert t.client.llm.llm_engine.config.kv_cache_dtype == "fp8"
    assert t.policy.kv_cache_dtype == "fp8"
    for _ in range(2):
        m = t.step().metrics
        assert m["logprob_diff_max"] == 0.0 and m["updated"]


def test_overlong_filter_drops_cut_responses_from_the_loss(tiny_qwen3, rl_files, tmp_path, monkeypatch):
    """Responses cut by the length limit get token weight 0 in the loss (every response is
    cut here); with the filter off the same responses weigh in."""
    from vllm.rl import losses
    seen = {}
    real = losses.policy_loss

    def spy(logp, old_logp, advantages, token_weights, **kw):
        seen.setdefault(on, []).append(token_weights.detach().clone())
        return real(logp, old_logp, advantages, token_weights, **kw)
    monkeypatch.setattr(losses, "policy_loss", spy)
    for on in (True, False):
        t = Trainer(_config(tiny_qwen3, rl_files, tmp_path / f"f{on}", overlong_filter=on, max_response_tokens=1,
                            steps=1))
        m = t.step().metrics
        assert m["response_clip_ratio"] == 1.0  # 3 prompts x 4 samples, every one cut at 1 token
        assert m["overlong_filtered"] == (12 if on else 0)
    assert all(float(w.abs().sum()) == 0.0 for w in seen[True])
    assert sum(float(w.sum()) for w in seen[False]) == pytest.approx(1.0)  # token-mean over all 12 tokens


def test_wandb_logs_every_step_and_a_resume_continues_the_run(tiny_qwen3, rl_files, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    Trainer(_config(tiny_qwen3, rl_files, out, steps=1, wandb_project="vllm-parity-test")).run()
    run_id = (out / "wandb_run_id").read_text()
    runs = list((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    Trainer(_config(tiny_qwen3, rl_files, out, steps=2, resume="latest", wandb_project="vllm-parity-test")).run()
    assert (out / "wandb_run_id").read_text() == run_id  # the same wandb run


def test_checkpoint_configs_resolve_as_their_run_did():
    """A config saved before the resolved knobs were pinned resolves with the rules of its
    time: DAPO's overlong buffer max_response_tokens // 4, lr_decay_steps the run's steps."""
    from vllm.rl.trainer import _as_resolved_then
    old = TrainConfig.from_dict({"task": "arithmetic", "algorithm": "dapo", "max_response_tokens": 100, "steps": 30})
    r = _as_resolved_then(old)
    assert (r.algorithm.overlong_buffer, r.optim.lr_decay_steps) == (25, 30)
    assert TrainConfig.from_dict({"task": "arithmetic", "algorithm": "dapo", "max_response_tokens": 100}
                                 ).validate().algorithm.overlong_buffer == 20  # a new run: the paper's 1/5


def test_default_recipe_runs_with_zero_mismatch(tmp_path, capsys):
    """`vllm train` with no model and no data: the default recipe (the embedded model on
    vllm.rl.tasks.arithmetic), shortened; every step's logprob difference is exactly 0."""
    rc = main(["train", "--device", "cpu", "--steps", "2", "--prompts-per-step", "4", "--eval-size", "4",
               "--eval-interval", "1", "--output-dir", str(tmp_path / "run"), "--no-progress", "--no-tensorboard",
               "--no-plots"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "grpo on task arithmetic" in out and "eval  @ step 1" in out
    rows = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [(r["step"], r.get("kind")) for r in rows] == [(0, "eval"), (1, None), (1, "eval"), (2, None), (2, "eval")]
    steps = [r for r in rows if r.get("kind") is None]
    assert all(r["logprob_diff_max"] == 0.0 and r["updated"] for r in steps)
    # the trained default model answers: some rewards are non-zero, responses end their turn
    assert sum(r["reward_mean"] for r in steps) > 0
    assert all(r["response_clip_ratio"] < 0.5 for r in steps)
    assert os.path.isfile(tmp_path / "run" / "config.yaml")


@pytest.mark.gpu
def test_gpu_run_zero_mismatch_with_sleep(gpu_model, rl_files, tmp_path):
    """bf16 on the GPU, CUDA graphs, KV cache released during training: zero mismatch in
    invariant mode at every step; the KV memory released is reported."""
    t = Trainer(_config(gpu_model, rl_files, tmp_path / "gpu", device="cuda", dtype="bfloat16", sleep_mode=True,
                        gpu_memory_utilization=0.3, max_response_tokens=32, group_size=8, prompts_per_step=4,
                        lr=1e-5))
    for _ in range(3):
        m = t.step().metrics
        print({k: m[k] for k in ("step", "logprob_diff_max", "kv_freed_gib", "time_generate_s", "time_train_s",
                                 "time_sync_s")})
        assert m["logprob_diff_max"] == 0.0 and m["k3_kl"] == 0.0
        assert m["kv_freed_gib"] > 0
    del t
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    fast = Trainer(_config(gpu_model, rl_files, tmp_path / "gpu_fast", device="cuda", dtype="bfloat16",
                           numerics="fast", sleep_mode=True, gpu_memory_utilization=0.3, max_response_tokens=32,
                           group_size=8, prompts_per_step=4))
    m = fast.step().metrics
    print("fast mode mismatch:", {k: m[k] for k in ("logprob_diff_max", "logprob_diff_mean", "k3_kl")})


def test_tensorboard_and_plots_are_optional(tiny_qwen3, rl_files, tmp_path, monkeypatch, capsys):
    """Without tensorboard/matplotlib the run completes and says what it skipped; with
    them it writes the event files and the two PNGs."""
    from vllm.rl.metrics import MetricsLogger

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    log = MetricsLogger(str(tmp_path / "without"), total_steps=1, tensorboard=True, progress=False)
    log.close(plots=True)
    out = capsys.readouterr().out
    assert "skipped: TensorBoard logs" in out and "skipped: PNG plots" in out
    monkeypatch.undo()

    pytest.importorskip("matplotlib")
    pytest.importorskip("tensorboard")
    t = Trainer(_config(tiny_qwen3, rl_files, tmp_path / "with", steps=2, plots=True, tensorboard=True,
                        group_size=2, prompts_per_step=2, max_response_tokens=4))
    t.run()
    run = tmp_path / "with"
    assert (run / "reward.png").stat().st_size > 0 and (run / "mismatch.png").stat().st_size > 0
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(run / "tensorboard"))


def test_master_weights_path_matches_plain_fp32(tiny_qwen3, rl_files, tmp_path):
    """fp32 master weights over fp32 parameters must give the very same update as AdamW on
    the parameters (the master path is what bf16 GPU runs use: grads accumulated per
    micro-batch in fp32, the step on the masters, the result copied into the parameters)."""
    weights = {}
    for master in (False, True):
        t = Trainer(_config(tiny_qwen3, rl_files, tmp_path / f"m{master}", master_weights=master,
                            micro_batch_tokens=30, steps=1))
        assert (t.master is not None) == master
        m = t.step().metrics
        assert m["updated"] and m["grad_norm"] > 0
        weights[master] = [p.detach().clone() for p in t.params]
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(weights[False], weights[True]))


def test_hybrid_gated_deltanet_run_has_zero_mismatch_every_step(tiny_qwen3_next, rl_files, tmp_path):
    """`vllm train` on a Qwen3-Next hybrid (Gated DeltaNet states in the engine, none in the
    trainer): the rollout's logprobs equal the trainer's bit for bit at every step, across
    weight updates."""
    trainer = Trainer(_config(tiny_qwen3_next, rl_files, tmp_path / "run", steps=3))
    trainer.run()
    steps = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r.get("kind") != "eval"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["logprob_diff_max"] == 0.0 and r["updated"] and r["grad_norm"] > 0


@pytest.mark.parametrize("body, needle", [
    ("raise KeyError('score')", r"raised KeyError: 'score'"),
    ("return None", r"returned None; it must return a finite number"),
    ("return float('nan')", r"returned nan"),
])
def test_a_failing_reward_names_its_record(tiny_qwen3, rl_files, tmp_path, capsys, body, needle):
    """A custom reward that raises or returns no finite number stops the run with one line
    naming the reward and the data record (exit 1), not a traceback from inside the trainer."""
    reward = tmp_path / "r.py"
    reward.write_text(f"def r(response, answer, record):\n    {body}\n")
    rc = main(["train", "--model", tiny_qwen3, "--device", "cpu", "--data", rl_files["train"], "--prompt-field",
               "question", "--answer-field", "solution", "--reward", f"{reward}:r", "--group-size", "2",
               "--prompts-per-step", "1", "--max-response-tokens", "3", "--steps", "1", "--output-dir",
               str(tmp_path / "run"), "--no-progress", "--no-tensorboard", "--no-plots"])
    err = capsys.readouterr().err
    assert rc == 1 and re.search(rf"the reward '.*r\.py:r' on record \d+ of the data {needle}", err), err


def test_rollout_server_knobs_without_servers_are_named(tiny_qwen3, rl_files, tmp_path, capsys):
    """--weight-sync / --sync-host / --rollout-admin-key only act with --rollout-url: a local
    run that sets them says it ignores them."""
    rc = main(["train", "--model", tiny_qwen3, "--device", "cpu", "--data", rl_files["train"], "--prompt-field",
               "question", "--answer-field", "solution", "--reward", rl_files["reward"], "--group-size", "2",
               "--prompts-per-step", "1", "--max-response-tokens", "3", "--steps", "1", "--weight-sync", "path",
               "--rollout-admin-key", "k", "--output-dir", str(tmp_path / "run"), "--no-progress",
               "--no-tensorboard", "--no-plots"])
    assert rc == 0
    assert "note: --weight-sync, --rollout-admin-key apply only with --rollout-url: ignored here" in \
        capsys.readouterr().out
