"""`vllm train` configuration: recipes, overrides, --help, and clear errors before any compute."""
from __future__ import annotations

import json
import os

import pytest

from vllm.entrypoints.cli.main import build_parser, main
from vllm.rl.config import TrainConfig, field_index

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def no_engine(monkeypatch):
    """Fail the test if anything builds an engine: errors must come before any compute."""
    import vllm

    def forbidden(*a, **k):
        raise AssertionError("an engine was built before the configuration error was reported")
    monkeypatch.setattr(vllm, "LLM", forbidden)


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_help_lists_every_knob(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for name in field_index():
        assert f"--{name.replace('_', '-')}" in text, name
    for flag in ("--model", "--data", "--reward", "--algorithm", "--group-size", "--prompts-per-step", "--lr",
                 "--lr-schedule", "--clip-eps-low", "--clip-eps-high", "--max-response-tokens", "--micro-batch-tokens",
                 "--numerics", "--seed", "--steps", "--eval-interval", "--checkpoint-interval", "--output-dir",
                 "--resume", "--recipe"):
        assert flag in text
    assert "train" in build_parser(None).format_help()
    # every knob with a default shows it, switches as on / off
    flat = " ".join(text.split())
    for shown in ("--shuffle, --no-shuffle shuffle the training data each epoch (seeded) (default: on)",
                  "(default: grpo)", "(default: auto)"):
        assert shown in flat, shown


def test_recipes_parse_and_validate():
    for name in ("arithmetic_grpo", "qwen3_dims_grpo"):
        cfg = TrainConfig.from_yaml(os.path.join(REPO, "training", f"{name}.yaml")).validate()
        assert cfg.model.numerics == "invariant"
    dims = TrainConfig.from_yaml(os.path.join(REPO, "training", "qwen3_dims_grpo.yaml"))
    assert os.path.isfile(dims.model.model) and dims.model.load_format == "dummy"  # resolved from the recipe's repo


def test_algorithm_defaults_and_overrides():
    g = TrainConfig.from_dict({"task": "arithmetic"}).validate()
    assert (g.algorithm.clip_eps_high, g.algorithm.loss_agg, g.algorithm.overlong_buffer,
            g.algorithm.dynamic_sampling) == (0.2, "seq-mean-token-mean", 0, False)
    d = TrainConfig.from_dict({"task": "arithmetic", "algorithm": {"algorithm": "dapo", "max_response_tokens": 100}})
    d = d.validate()
    assert (d.algorithm.clip_eps_high, d.algorithm.loss_agg, d.algorithm.overlong_buffer,
            d.algorithm.dynamic_sampling) == (0.28, "token-mean", 20, True)
    d2 = TrainConfig.from_dict({"task": "arithmetic", "algorithm": "dapo", "clip_eps_high": 0.3,
                                "dynamic_sampling": False}).validate()
    assert (d2.algorithm.clip_eps_high, d2.algorithm.dynamic_sampling) == (0.3, False)
    # flat and nested spellings, and string values from the command line
    c = TrainConfig.from_dict({"optim": {"lr": "3e-4"}, "group_size": "4", "shuffle": "false", "max_model_len": "none"})
    assert (c.optim.lr, c.algorithm.group_size, c.data.shuffle, c.model.max_model_len) == (3e-4, 4, False, None)


@pytest.mark.parametrize("bad,message", [
    ({"group_size": 1}, "group_size"),
    ({"temperature": 0.0}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"numerics": "exact"}, "numerics"),
    ({"algorithm": "ppo"}, "algorithm"),
    ({"lr": -1.0}, "lr"),
    ({"lr_schedule": "step"}, "lr_schedule"),
    ({"clip_eps_low": 1.5}, "clip_eps_low"),
    ({"updates_per_step": 9, "prompts_per_step": 4}, "updates_per_step"),
    ({"overlong_buffer": 100, "max_response_tokens": 10}, "overlong_buffer"),
    ({"tis_cap": 0.5}, "tis_cap"),
    ({"reward": "rouge"}, "reward"),
    ({"steps": 0}, "steps"),
    ({"data": "train.csv"}, "data"),
    ({"task": None, "data": None}, "no data"),
    ({"model": "cfg.json"}, "load_format"),
    ({"dtype": "float16"}, "no loss scaling"),
    ({"kl_coef": float("inf")}, "kl_coef: must be finite"),
    ({"weight_decay": float("inf")}, "weight_decay: must be finite"),
    ({"overlong_penalty": float("inf")}, "overlong_penalty: must be finite"),
    ({"adam_eps": float("inf")}, "adam_eps: must be finite"),
    ({"clip_eps_high": float("inf")}, "clip_eps_high: must be finite"),
    ({"max_grad_norm": float("nan")}, "max_grad_norm: must be finite"),
    ({"tis_cap": float("inf")}, "tis_cap"),
    ({"warmup_steps": 10, "lr_decay_steps": 5, "lr_schedule": "cosine"}, "must not exceed lr_decay_steps"),
    # unset, the decay's length is the run's steps (what a resume finds pinned)
    ({"warmup_steps": 10, "steps": 5, "lr_schedule": "cosine"}, r"lr_decay_steps \(5, the run steps\)"),
    ({"seed": -1}, "seed: must be >= 0"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1"),
    ({"tp_leaves": 3}, "tp_leaves must be a power of two"),
])
def test_bad_values_are_clear_errors(bad, message):
    cfg = TrainConfig.from_dict({"task": "arithmetic"})
    cfg.update(bad)
    with pytest.raises(ValueError, match=message):
        cfg.validate()


def test_bad_types_and_unknown_knobs(tmp_path):
    with pytest.raises(ValueError, match="group_size: expected an integer"):
        TrainConfig.from_dict({"group_size": "eight"})
    with pytest.raises(ValueError, match="shuffle: expected true or false"):
        TrainConfig.from_dict({"shuffle": "maybe"})
    with pytest.raises(ValueError, match="unknown knob or section 'grup_size'"):
        TrainConfig.from_dict({"grup_size": 4})
    with pytest.raises(ValueError, match="unknown knob 'lr' in section 'model'"):
        TrainConfig.from_dict({"model": {"lr": 1.0}})
    with pytest.raises(ValueError) as err:  # every problem in one error
        TrainConfig.from_dict({"group_size": "eight", "lr": "fast", "grup_size": 4})
    assert all(s in str(err.value) for s in ("group_size: expected an integer", "lr: expected a number",
                                             "'grup_size'"))
    r = tmp_path / "r.yaml"
    r.write_text("algorithm:\n  group_size: [1, 2]\n")
    with pytest.raises(ValueError, match="recipe .*group_size"):
        TrainConfig.from_yaml(str(r))
    r.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping"):
        TrainConfig.from_yaml(str(r))
    with pytest.raises(ValueError, match="does not exist"):
        TrainConfig.from_yaml(str(tmp_path / "missing.yaml"))


def _cli(tmp_path, tiny_qwen3, data, *extra):
    return main(["train", "--model", tiny_qwen3, "--device", "cpu", "--data", data, "--output-dir",
                 str(tmp_path / "out"), "--no-progress", *extra])


@pytest.mark.parametrize("rows,extra,message", [
    ([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}], (), "record 2 has no field 'answer'"),
    ([{"question": "1+1=", "answer": "2"}], (), "record 1 has no field 'prompt'"),
    ([{"question": "1+1=", "solution": "2"}], ("--prompt-field", "question"), "no field 'answer'.*solution"),
    ([{"prompt": 5, "answer": "2"}], (), "must be a non-empty string or chat messages"),
    ([{"prompt": [{"content": "hi"}], "answer": "2"}], (), "'role' and 'content'"),
    ([{"prompt": "1+1=", "answer": ["2"]}], (), "must be a string or a number"),
    ([{"prompt": "x " * 2000, "answer": "2"}], (), "the prompt has .* tokens"),
    ([{"prompt": "1+1=", "answer": "2"}], ("--reward", "no_such_mod_q:fn"), "cannot import"),
    ([{"prompt": "1+1=", "answer": "2"}], ("--group-size", "1"), "group_size"),
    ([{"prompt": "1+1=", "answer": "2"}], ("--resume",), "no checkpoint"),
    ([{"prompt": "1+1=", "answer": "2"}], ("--eval-interval", "2", "--eval-data", "nope.jsonl"), "does not exist"),
])
def test_cli_errors_before_any_compute(tmp_path, tiny_qwen3, capsys, no_engine, rows, extra, message):
    data = _write_jsonl(tmp_path / "d.jsonl", rows)
    assert _cli(tmp_path, tiny_qwen3, data, *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("vllm train: error:")
    import re
    assert re.search(message, err), err


def test_cli_data_file_errors(tmp_path, tiny_qwen3, capsys, no_engine):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n{not json}\n')
    assert _cli(tmp_path, tiny_qwen3, str(bad)) == 2
    assert "bad.jsonl:2: not valid JSON" in capsys.readouterr().err
    assert _cli(tmp_path, tiny_qwen3, str(tmp_path / "none.jsonl")) == 2
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert _cli(tmp_path, tiny_qwen3, str(empty)) == 2
    assert "no records" in capsys.readouterr().err


def test_cli_refuses_to_overwrite_a_run(tmp_path, tiny_qwen3, capsys, no_engine):
    data = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    os.makedirs(tmp_path / "out" / "checkpoints" / "step_000001")
    assert _cli(tmp_path, tiny_qwen3, data) == 2
    assert "--resume" in capsys.readouterr().err


def test_cli_output_dir_errors_come_before_any_compute(tmp_path, tiny_qwen3, capsys, no_engine):
    """An output directory that cannot hold the run's files (a path under a file, a
    `checkpoints` that is a file) is a one-line error before any model is loaded."""
    data = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    (tmp_path / "afile").write_text("x")
    assert main(["train", "--model", tiny_qwen3, "--data", data, "--output-dir", str(tmp_path / "afile" / "out"),
                 "--steps", "1"]) == 2
    assert "--output-dir" in capsys.readouterr().err
    (tmp_path / "out2").mkdir()
    (tmp_path / "out2" / "checkpoints").write_text("x")
    assert main(["train", "--model", tiny_qwen3, "--data", data, "--output-dir", str(tmp_path / "out2"),
                 "--steps", "1"]) == 2
    assert "checkpoints" in capsys.readouterr().err


def test_overwrite_keeps_the_earlier_run_until_the_engine_is_up(tmp_path, tiny_qwen3, no_engine):
    """--overwrite drops the earlier run's checkpoints only once the engine (or the rollout
    servers) is up: a refusal found while building it (here: no engine may be built) leaves
    them as they were."""
    from vllm.rl.trainer import Trainer
    data = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    old = tmp_path / "out" / "checkpoints" / "step_000003"
    old.mkdir(parents=True)
    (tmp_path / "out" / "checkpoints" / "latest").write_text("step_000003\n")
    cfg = TrainConfig()
    cfg.update({"model": tiny_qwen3, "data": data, "output_dir": str(tmp_path / "out"), "overwrite": True})
    with pytest.raises(AssertionError, match="engine was built"):
        Trainer(cfg)
    assert sorted(os.listdir(tmp_path / "out" / "checkpoints")) == ["latest", "step_000003"]


def test_overwrite_removes_the_earlier_runs_checkpoints(tmp_path, tiny_qwen3):
    """--overwrite starts afresh once the engine is up: the earlier run's checkpoints and its
    `latest` go, so a later --resume cannot continue the old run under the new config; so do
    its TensorBoard events and its W&B run id (the new run is a new W&B run)."""
    from vllm.rl.trainer import Trainer
    data = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    (tmp_path / "out" / "checkpoints" / "step_000003").mkdir(parents=True)
    (tmp_path / "out" / "checkpoints" / "latest").write_text("step_000003\n")
    (tmp_path / "out" / "tensorboard").mkdir()
    (tmp_path / "out" / "tensorboard" / "events.out.tfevents.1").write_text("old")
    (tmp_path / "out" / "wandb_run_id").write_text("abc123")
    cfg = TrainConfig()
    cfg.update({"model": tiny_qwen3, "data": data, "output_dir": str(tmp_path / "out"), "overwrite": True,
                "device": "cpu"})
    Trainer(cfg)
    assert os.listdir(tmp_path / "out" / "checkpoints") == []
    assert not (tmp_path / "out" / "tensorboard").exists() and not (tmp_path / "out" / "wandb_run_id").exists()


def test_output_dir_in_use_by_a_live_process_is_refused(tmp_path, tiny_qwen3, no_engine):
    """A second run into a directory another live process is training into is refused before
    anything is built (its metrics and checkpoints would interleave); the mark of a process
    that has ended is taken over."""
    import subprocess
    import sys
    from vllm.rl.trainer import Trainer
    data = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    out = tmp_path / "out"
    out.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / ".vllm-train.pid").write_text(f"{other.pid}\n")
        cfg = TrainConfig()
        cfg.update({"model": tiny_qwen3, "data": data, "output_dir": str(out)})
        with pytest.raises(ValueError, match="in use by another vllm train run"):
            Trainer(cfg)
    finally:
        other.kill()
        other.wait()
    with pytest.raises(AssertionError, match="engine was built"):   # the ended process's mark is taken over
        Trainer(cfg)
    assert (out / ".vllm-train.pid").read_text().strip() == str(os.getpid())


def test_print_config(tmp_path, capsys):
    assert main(["train", "--print-config", "--group-size", "16", "--algorithm", "dapo", "--no-shuffle"]) == 0
    import yaml
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["algorithm"]["group_size"] == 16 and cfg["algorithm"]["clip_eps_high"] == 0.28
    assert cfg["data"]["shuffle"] is False and cfg["data"]["task"] == "arithmetic"  # the default recipe


def test_recipe_paths_expand_home(tmp_path, monkeypatch):
    """A recipe's "~/..." paths are the user's home (YAML does not expand them; the shipped
    SmolLM2 recipe names its model that way)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data.jsonl").write_text("{}\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  model: ~/models/m\ndata:\n  data: ~/data.jsonl\n")
    cfg = TrainConfig.from_yaml(str(recipe))
    assert cfg.get("model") == str(tmp_path / "models" / "m")
    assert cfg.get("data") == str(tmp_path / "data.jsonl")
    smol = TrainConfig.from_yaml(os.path.join(REPO, "training", "smollm2_arithmetic_grpo.yaml"))
    assert smol.get("model") == str(tmp_path / ".cache" / "vllm-parity" / "smollm2-135m-instruct")


@pytest.mark.parametrize("with_checkpoint", [True, False])
def test_cli_interrupt_says_whether_there_is_a_checkpoint(tmp_path, tiny_qwen3, capsys, monkeypatch,
                                                          with_checkpoint):
    """Ctrl-C during a run: "continue with --resume latest" only where a checkpoint exists,
    else that there is nothing to resume (exit 130 either way)."""
    from vllm.rl import trainer as trainer_module
    data = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    out = tmp_path / "out"

    def interrupted(self):
        if with_checkpoint:
            (out / "checkpoints" / "step_000001").mkdir(parents=True)
            os.symlink("step_000001", out / "checkpoints" / "latest")
        raise KeyboardInterrupt
    monkeypatch.setattr(trainer_module.Trainer, "run", interrupted)
    assert main(["train", "--model", tiny_qwen3, "--data", data, "--output-dir", str(out), "--device", "cpu",
                 "--steps", "2"]) == 130
    err = capsys.readouterr().err
    assert ("--resume latest" in err) == with_checkpoint and ("nothing to resume" in err) != with_checkpoint


def test_cli_sigterm_stops_like_ctrl_c(tmp_path, tiny_qwen3, capsys, monkeypatch):
    """SIGTERM during a run unwinds it as Ctrl-C does (the trainer's cleanup runs), exits 143
    and says so; the earlier SIGTERM handler is back afterwards."""
    import signal
    import time

    from vllm.rl import trainer as trainer_module
    data = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    cleaned = []

    def run(self):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        finally:
            cleaned.append(True)
    monkeypatch.setattr(trainer_module.Trainer, "run", run)
    before = signal.getsignal(signal.SIGTERM)
    t0 = time.monotonic()
    assert main(["train", "--model", tiny_qwen3, "--data", data, "--output-dir", str(tmp_path / "out"),
                 "--device", "cpu", "--steps", "2"]) == 143
    assert time.monotonic() - t0 < 25 and cleaned == [True]
    assert "terminated (SIGTERM)" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before
