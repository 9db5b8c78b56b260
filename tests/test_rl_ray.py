"""`vllm train --backend ray` on a local Ray cluster (CPU): 1 trainer actor and 2 rollout-engine
actors run 3 steps of the default recipe (shortened). Every step's rollout tokens, rollout
logprobs and trainer logprobs equal the single-process run's with the same seeds, bit for
bit; the logprob difference is exactly 0 on every step; an engine actor killed in the
middle of a step costs no step (restarted by Ray, or its prompts go to the other engine);
`--resume` continues bit-exactly. Selected by `-m ray`; skipped without the ray package."""
from __future__ import annotations

import time

import pytest
import torch

from vllm.entrypoints.cli.main import main
from vllm.entrypoints.cli.train import DEFAULT_RECIPE, find_recipe
from vllm.rl.config import TrainConfig
from vllm.rl.metrics import read_metrics
from vllm.rl.trainer import Trainer

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

STEPS = 3
# the default recipe, shortened: 4 prompts x 8 responses x at most 8 tokens a step, no evaluation
SHORT = {"device": "cpu", "steps": STEPS, "prompts_per_step": 4, "eval_interval": 0, "progress": False,
         "tensorboard": False, "plots": False}
# timings and the memory sleep mode released differ between runs; everything else must not
UNTIMED = {"time_generate_s", "time_train_s", "time_sync_s", "time_step_s", "tokens_per_s", "kv_freed_gib"}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _config(out, **over) -> TrainConfig:
    cfg = TrainConfig.from_yaml(find_recipe(DEFAULT_RECIPE))
    cfg.update({**SHORT, "output_dir": str(out), **over})
    return cfg


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for the module: 4 logical CPUs (the 2-core CI machine runs the
    actors in turn: rollout, then training)."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run (engine and Policy in this process): 3 steps."""
    trainer = Trainer(_config(tmp_path_factory.mktemp("single")))
    return [trainer.step() for _ in range(STEPS)]


def _assert_same_step(got, want, step: int) -> None:
    assert got.metrics["logprob_diff_max"] == 0.0, f"step {step}: rollout and trainer logprobs differ"
    assert got.sequences == want.sequences and got.prompt_lens == want.prompt_lens, f"step {step}: other rollouts"
    assert len(got.rollout_logprobs) == len(want.rollout_logprobs)
    for name in ("rollout_logprobs", "train_logprobs"):
        for i, (a, b) in enumerate(zip(getattr(got, name), getattr(want, name))):
            assert torch.equal(bits(a.cpu()), bits(b.cpu())), f"step {step}: {name}[{i}] differs in some bit"
    mine = {k: v for k, v in got.metrics.items() if k not in UNTIMED}
    theirs = {k: v for k, v in want.metrics.items() if k not in UNTIMED}
    assert mine == theirs, f"step {step}: metrics differ"


def _run_job(cfg, faults, between_steps=None):
    from vllm.rl.ray.driver import RayTrainJob

    with RayTrainJob(cfg, faults=faults, engine_timeout_s=300) as job:
        results = []
        for step in range(1, STEPS + 1):
            results.append(job.step())
            if between_steps is not None:
                between_steps(job, step)
        events = job.events()
    return results, events


def _restart_idle_engine(job, engine: int) -> None:
    """Kill an engine actor between steps and wait until Ray has restarted it: it comes back
    with the checkpoint's weights, behind the trainer's."""
    ray.kill(job.engines[engine], no_restart=False)
    deadline = time.monotonic() + 300
    while True:
        # ray.kill returns before the actor is gone: a call made meanwhile can still reach the old
        # instance, so wait for an answer from the restarted one
        try:
            state = ray.get(job.engines[engine].describe.remote(), timeout=300)
            if state.restarted:
                break
        except ray.exceptions.RayActorError:
            pass
        assert time.monotonic() < deadline, "the killed engine did not come back"
        time.sleep(0.1)
    assert state.weights_version is None


def test_colocated_matches_single_process_and_restarts_killed_engines(cluster, reference, tmp_path):
    """Colocated: engine 0 shares the trainer's bundle (weights through shared memory), engine
    1 has its own (weights over a gloo broadcast group); the engines sleep while the trainer
    runs. Engine 1 exits in the middle of step 2: Ray restarts it, the trainer checks its
    contract, syncs it and sends its prompts again. Engine 0 is killed after step 2 and comes
    back with the checkpoint's weights: asked for step 3's rollouts at the trainer's weight
    version, it refuses (no mixed versions), is re-synced and asked again."""
    from vllm.rl.ray.messages import EngineFault

    cfg = _config(tmp_path / "ray", backend="ray", rollout_engines=2, placement="colocated", sleep_mode=True)
    results, events = _run_job(cfg, [EngineFault(engine=1, generate_call=2)],
                               between_steps=lambda job, step: step == 2 and _restart_idle_engine(job, 0))
    for step, (got, want) in enumerate(zip(results, reference), 1):
        _assert_same_step(got, want, step)
    assert [r.metrics["weight_version"] for r in results] == [1, 2, 3]
    assert [(e.engine, e.kind) for e in events] == [(1, "died"), (1, "restarted"), (0, "stale")], events


def test_disaggregated_sends_a_dead_engines_prompts_to_the_other(cluster, reference, tmp_path):
    """Disaggregated (every engine over its broadcast group), no restarts: engine 0 exits in
    the middle of step 2 and its prompts go to engine 1; the step's bits do not change."""
    from vllm.rl.ray.messages import EngineFault

    cfg = _config(tmp_path / "ray", backend="ray", rollout_engines=2, placement="disaggregated", engine_restarts=0)
    results, events = _run_job(cfg, [EngineFault(engine=0, generate_call=2)])
    for step, (got, want) in enumerate(zip(results, reference), 1):
        _assert_same_step(got, want, step)
    assert [(e.engine, e.kind) for e in events] == [(0, "died"), (0, "gone")], events
    assert "go to engines [1]" in events[-1].line()


def test_cli_backend_ray_and_resume_are_bit_exact(cluster, reference, tmp_path, capsys):
    """`vllm train --backend ray` for 2 steps, then `--resume` to step 3: the metrics of every
    step equal the single-process run's. One engine: the split over two is tested above, and
    each actor costs a process start."""
    out = tmp_path / "run"
    common = ["--device", "cpu", "--prompts-per-step", "4", "--eval-interval", "0", "--output-dir", str(out),
              "--no-progress", "--no-tensorboard", "--no-plots"]
    assert main(["train", "--backend", "ray", "--steps", "2", *common]) == 0
    assert main(["train", "--resume", "--steps", "3", *common]) == 0
    text = capsys.readouterr().out
    assert "backend ray, colocated, 1 rollout engine(s)" in text and "at step 2;" in text
    rows = [r for r in read_metrics(str(out / "metrics.jsonl")) if r.get("kind") != "eval"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for got, want in zip(rows, reference):
        assert {k: v for k, v in got.items() if k not in UNTIMED} == \
            {k: v for k, v in want.metrics.items() if k not in UNTIMED}
