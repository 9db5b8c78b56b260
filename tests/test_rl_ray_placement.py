"""The Ray backend's plain-data parts, without Ray: placement plans for clusters that are not
here (2 nodes x 8 GPUs, colocated and disaggregated), the plan and the commands docs/ray.md
shows, the deterministic prompt split, and the configuration's checks."""
from __future__ import annotations

import os
import sys

import pytest

from vllm.rl.config import TrainConfig
from vllm.rl.ray.messages import EngineFault, split_requests
from vllm.rl.ray.placement import plan_placement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "ray.md")


def _check_invariants(plan, gpus_per_node: int | None = None) -> None:
    """What every plan must satisfy: each actor in a bundle that exists, no bundle asked for
    more than it has, each engine's bundles on one node."""
    n = len(plan.bundles)
    used_cpu, used_gpu = [0.0] * n, [0.0] * n
    for s in (*plan.trainer, *plan.engines):
        assert all(0 <= b < n for b in s.bundles)
        used_cpu[s.bundle] += s.num_cpus
        used_gpu[s.bundle] += s.num_gpus
    for b, bundle in enumerate(plan.bundles):
        assert used_cpu[b] <= bundle.get("CPU", 0) + 1e-9 and used_gpu[b] <= bundle.get("GPU", 0) + 1e-9
    if gpus_per_node:
        for s in plan.engines:
            assert len({plan.node_of(b) for b in s.bundles}) == 1, s


def test_two_nodes_of_eight_gpus_disaggregated():
    plan = plan_placement(engines=8, placement="disaggregated", trainer_ranks=8, nodes=2, gpus_per_node=8)
    _check_invariants(plan, 8)
    assert plan.bundles == tuple({"GPU": 1, "CPU": 1} for _ in range(16)) and plan.strategy == "PACK"
    assert [plan.node_of(t.bundle) for t in plan.trainer] == [0] * 8
    assert [plan.node_of(e.bundle) for e in plan.engines] == [1] * 8
    assert {e.weight_route for e in plan.engines} == {"broadcast"}
    assert all(s.num_gpus == 1.0 for s in (*plan.trainer, *plan.engines))
    # tensor-parallel engines of 2 GPUs: 4 of them, each within node 1
    tp = plan_placement(engines=4, engine_gpus=2, placement="disaggregated", trainer_ranks=8, nodes=2,
                        gpus_per_node=8)
    _check_invariants(tp, 8)
    assert [e.bundles for e in tp.engines] == [(8, 9), (10, 11), (12, 13), (14, 15)]


def test_two_nodes_of_eight_gpus_colocated():
    plan = plan_placement(engines=16, placement="colocated", trainer_ranks=16, nodes=2, gpus_per_node=8)
    _check_invariants(plan, 8)
    assert len(plan.bundles) == 16 and plan.total_gpus == 16
    for b in range(16):
        assert [(s.role, s.index) for s in plan.actors_in(b)] == [("trainer", b), ("engine", b)]
        assert [s.num_gpus for s in plan.actors_in(b)] == [0.5, 0.5]
    assert {e.weight_route for e in plan.engines} == {"ipc"}
    # 8 engines of 2 GPUs under 16 trainer ranks: every GPU shared by a rank and an engine's share
    tp = plan_placement(engines=8, engine_gpus=2, placement="colocated", trainer_ranks=16, nodes=2, gpus_per_node=8)
    _check_invariants(tp, 8)
    assert [e.bundles for e in tp.engines][:2] == [(0, 1), (2, 3)]
    assert all(t.num_gpus == 0.5 for t in tp.trainer)
    assert [tp.node_of(e.bundle) for e in tp.engines] == [0] * 4 + [1] * 4


def test_one_trainer_rank_today():
    """What the driver runs: one trainer rank. Colocated, engine 0 shares its bundle (IPC)
    and the others have their own (broadcast); the CPU test's plan."""
    cpu = plan_placement(engines=2, placement="colocated", device="cpu")
    _check_invariants(cpu)
    assert cpu.bundles == ({"CPU": 1}, {"CPU": 1}) and cpu.total_cpus == 2
    assert [(e.bundle, e.weight_route, e.num_cpus, e.num_gpus) for e in cpu.engines] == \
        [(0, "ipc", 0.5, 0.0), (1, "broadcast", 1.0, 0.0)]
    assert (cpu.trainer[0].bundle, cpu.trainer[0].num_cpus) == (0, 0.5)
    dis = plan_placement(engines=2, placement="disaggregated", device="cpu", cpus_per_bundle=2)
    assert [s.bundle for s in (*dis.trainer, *dis.engines)] == [0, 1, 2] and dis.total_cpus == 6


@pytest.mark.parametrize("kw,message", [
    ({"engines": 16, "placement": "disaggregated", "trainer_ranks": 8, "nodes": 2, "gpus_per_node": 8}, "needs 24 GPUs"),
    ({"engines": 6, "engine_gpus": 2, "placement": "disaggregated", "trainer_ranks": 3, "nodes": 2,
      "gpus_per_node": 8}, "straddle two nodes"),
    ({"engines": 2, "placement": "spread"}, "placement must be one of"),
    ({"engines": 0}, "engines must be an int >= 1"),
    ({"engines": 2, "device": "cpu", "engine_gpus": 2}, "needs device cuda"),
    ({"engines": 2, "nodes": 2}, "together"),
    ({"engines": 2, "device": "tpu"}, "device must be one of"),
])
def test_bad_plans_are_clear_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        plan_placement(**kw)


def test_docs_show_the_plan_the_code_builds():
    """docs/ray.md's printed plan for 2 nodes x 8 GPUs is what plan_placement builds."""
    text = open(DOC).read()
    plan = plan_placement(engines=15, placement="disaggregated", device="cuda", nodes=2, gpus_per_node=8)
    _check_invariants(plan, 8)
    lines = plan.describe()
    shown = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("bundle ")]
    assert len(shown) >= 4 and all(ln in lines for ln in shown), shown
    assert "plan_placement(engines=15, placement=\"disaggregated\",\ndevice=\"cuda\", nodes=2, gpus_per_node=8)" \
        in text


def test_docs_commands_parse_and_validate():
    """Every `vllm train` command in docs/ray.md is accepted by the CLI's parser and config."""
    from vllm.entrypoints.cli.main import build_parser
    from vllm.entrypoints.cli.train import build_config

    cmds = [ln.strip() for ln in open(DOC).read().splitlines() if ln.startswith("    vllm train")]
    assert len(cmds) >= 4
    for cmd in cmds:
        args = build_parser("train").parse_args(cmd.split("#")[0].split()[1:])
        cfg = build_config(args).validate()
        assert cfg.cluster.backend == "ray", cmd


def test_split_is_contiguous_deterministic_and_complete():
    assert split_requests(5, [0, 1]) == {0: [0, 1, 2], 1: [3, 4]}
    assert split_requests(4, [1]) == {1: [0, 1, 2, 3]}
    assert split_requests(1, [0, 1, 2]) == {0: [0]}
    for n in range(0, 12):
        for engines in ([0], [0, 1], [2, 0, 1]):
            shares = split_requests(n, engines)
            assert sorted(i for idx in shares.values() for i in idx) == list(range(n))
            assert shares == split_requests(n, engines)
    with pytest.raises(ValueError, match="no rollout engine"):
        split_requests(3, [])
    with pytest.raises(ValueError, match="EngineFault"):
        EngineFault(engine=0, generate_call=0)


@pytest.mark.parametrize("over,message", [
    ({"rollout_engines": 0}, "rollout_engines"),
    ({"cpus_per_bundle": 0}, "cpus_per_bundle"),
    ({"engine_restarts": -1}, "engine_restarts"),
    ({"placement": "spread"}, "placement"),
    ({"backend": "slurm"}, "backend"),
    ({"backend": "ray", "rollout_url": "http://x:8000"}, "drop rollout_url"),
])
def test_cluster_knobs_are_checked(over, message):
    cfg = TrainConfig.from_dict({"task": "arithmetic", **over})
    with pytest.raises(ValueError, match=message):
        cfg.validate()


def test_ray_backend_needs_its_driver(monkeypatch, tmp_path):
    """A Trainer in this process refuses backend ray; the driver says how to install Ray."""
    from vllm.rl.trainer import Trainer

    cfg = TrainConfig.from_dict({"task": "arithmetic", "train_size": 8, "backend": "ray", "device": "cpu",
                                 "output_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="inside a Ray actor"):
        Trainer(cfg)
    from vllm.rl.ray import driver

    monkeypatch.setitem(sys.modules, "ray", None)   # import ray -> ImportError
    with pytest.raises(ValueError, match=r"pip install -e '\.\[ray\]'"):
        driver.RayTrainJob(cfg)


def test_recipe_section_and_flags_set_the_backend(tmp_path):
    """A recipe's `cluster:` section and the flags reach the same knobs."""
    from vllm.entrypoints.cli.main import build_parser
    from vllm.entrypoints.cli.train import build_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text("data: {task: arithmetic}\ncluster: {backend: ray, rollout_engines: 2, placement: disaggregated}\n")
    cfg = TrainConfig.from_yaml(str(recipe)).validate()
    assert (cfg.cluster.backend, cfg.cluster.rollout_engines, cfg.cluster.placement) == ("ray", 2, "disaggregated")
    args = build_parser("train").parse_args(["train", "--recipe", str(recipe), "--rollout-engines", "3",
                                             "--engine-restarts", "0"])
    cfg = build_config(args).validate()
    assert (cfg.cluster.rollout_engines, cfg.cluster.engine_restarts) == (3, 0)


def test_the_trainer_runs_the_engines_tp_tree(tiny_qwen3):
    """--tensor-parallel-size 2 without --tp-leaves: the engines resolve 8 leaves; the Ray
    trainer (TP=1) is given the same, so the contracts match (they differed in
    row_parallel_tree before)."""
    from vllm import LLM
    from vllm.rl.ray.messages import trainer_tp_leaves
    from vllm.training import Policy

    assert trainer_tp_leaves(1, None) is None and trainer_tp_leaves(2, None) == 8 and trainer_tp_leaves(4, 4) == 4
    engine = LLM(tiny_qwen3, device="cpu", tensor_parallel_size=2)
    trainer = Policy.from_pretrained(tiny_qwen3, device="cpu", tp_leaves=trainer_tp_leaves(2, None))
    trainer.execution_contract().check_compatible(engine.execution_contract())


def test_an_interrupted_job_kills_its_actors_without_waiting(monkeypatch):
    """Ctrl-C while the trainer actor runs: shutdown does not queue a close call behind the
    busy actor (it would wait out its 30 s timeout); the actors are killed at once."""
    ray = pytest.importorskip("ray")
    from vllm.rl.ray.driver import RayTrainJob

    calls = []

    class Actor:
        def __init__(self, name):
            self.name = name
            self.close = type("M", (), {"remote": lambda _self: calls.append(("close", name))})()

    def get(ref, timeout=None):
        if ref == "run":
            raise KeyboardInterrupt
        calls.append(("get", ref))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: calls.append(("kill", actor.name)))
    job = object.__new__(RayTrainJob)
    job.trainer, job.engines, job._pg, job._own_ray, job._interrupted = Actor("trainer"), [Actor("e0")], None, False, False
    with pytest.raises(KeyboardInterrupt):
        job._call("run")
    job.shutdown()
    assert calls == [("kill", "trainer"), ("kill", "e0")]
