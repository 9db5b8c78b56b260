"""The executor seam (vllm/executor): the engine and everything above it reach the workers
only through the Executor interface."""
from __future__ import annotations

import ast
import os

import pytest

from vllm import LLM, SamplingParams
from vllm.executor import Executor, InProcessExecutor

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm")


def test_only_the_executor_imports_the_worker():
    offenders = []
    for dirpath, _, files in os.walk(ROOT):
        rel = os.path.relpath(dirpath, ROOT)
        if rel.split(os.sep)[0] in ("executor", "worker"):
            continue
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            tree = ast.parse(open(path).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm.worker.model_runner"):
                    offenders.append(path)
                if isinstance(node, ast.Attribute) and node.attr == "runner":
                    offenders.append(f"{path}:{node.lineno}")
    assert not offenders, offenders


def test_every_method_is_part_of_the_interface():
    abstract = Executor.__abstractmethods__
    assert {"execute", "launch", "collect", "sleep", "wake_up", "model", "info",
            "weights_changed", "verify_graph_pointers", "rpc_methods", "collective_rpc"} <= abstract
    assert not InProcessExecutor.__abstractmethods__

    class Partial(Executor):
        def execute(self, sched):
            return None

    with pytest.raises(TypeError):
        Partial()


def test_engine_steps_go_through_the_executor(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant")
    eng = llm.llm_engine
    assert not hasattr(eng, "runner") and isinstance(eng.executor, Executor)
    calls = []
    for name in ("execute", "launch", "collect"):
        orig = getattr(eng.executor, name)

        def wrapped(*a, _orig=orig, _name=name, **kw):
            calls.append(_name)
            return _orig(*a, **kw)
        setattr(eng.executor, name, wrapped)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert calls  # every step ran through the seam
    assert eng.executor.info.num_blocks == eng.kv.num_blocks
    info = eng.executor.info
    assert eng.executor.step_timings is None and info.has_cuda_graphs is False and info.device.type == "cpu"
    assert info.kv_capacity_tokens == info.num_blocks * llm.config.cache.block_size
    assert llm.policy().model is eng.executor.model
