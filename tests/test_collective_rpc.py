"""LLM.collective_rpc (upstream's call into every worker) and upstream's worker_extension_cls.

The engine and its one worker (a ModelRunner) run in the caller's process: the call
crosses no process, a function gets the worker itself, and the answer is a list of one.
"""
from __future__ import annotations

import os
import threading

import pytest

from vllm import LLM, SamplingParams
from vllm.engine.rpc_names import ENGINE_RPC_METHODS

PROMPT = {"prompt_token_ids": list(range(20, 45))}
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(tiny_qwen3, device="cpu", enable_sleep_mode=True, cpu_kv_cache_bytes=4 << 20, block_size=8)


def test_a_function_gets_the_worker_in_this_process_and_thread(llm):
    def where(worker, tag, *, scale=1):
        return worker, os.getpid(), threading.get_ident(), tag * scale
    [(worker, pid, thread, tagged)] = llm.collective_rpc(where, args=("ab",), kwargs={"scale": 2})
    assert (pid, thread, tagged) == (os.getpid(), threading.get_ident(), "abab")
    assert worker.model is llm.llm_engine.executor.model is llm.policy().model
    assert worker.device.type == "cpu" and worker.config is llm.config


def test_the_workers_methods_by_name(llm):
    assert llm.collective_rpc("get_model") == [llm.llm_engine.executor.model]
    [nbytes] = llm.collective_rpc("kv_cache_bytes")
    assert nbytes > 0
    assert llm.collective_rpc("verify_graph_pointers") == [None]
    assert llm.collective_rpc("get_model", timeout=30, args=[], kwargs=None) == [llm.llm_engine.executor.model]


def test_engine_side_names_keep_the_engines_record_true(llm):
    llm.generate([PROMPT], GREEDY, use_tqdm=False)
    assert llm.llm_engine.kv.num_cached_blocks > 0
    assert llm.collective_rpc("reset_prefix_cache") == [True]
    assert llm.llm_engine.kv.num_cached_blocks == 0
    # upstream's worker sleep/wake_up: here the engine's, so it knows it is asleep
    [freed] = llm.collective_rpc("sleep", args=(2,))
    assert freed > 0 and llm.llm_engine.is_sleeping()
    with pytest.raises(ValueError, match="asleep"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    assert llm.collective_rpc("wake_up", kwargs={"tags": ["kv_cache"]}) == [None]
    assert not llm.llm_engine.is_sleeping()
    assert len(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_reload_weights_after_a_level_2_sleep_changes_nothing(llm):
    """TRL's colocated loop with sleep mode: sleep(2), wake_up(["weights"]), then
    collective_rpc("reload_weights") (catching only NotImplementedError). Sleep keeps the
    weights here: the call does nothing and the outputs stay the same."""
    before = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    version = llm.llm_engine.weight_version
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    assert llm.collective_rpc("reload_weights") == [None]
    llm.wake_up(tags=["kv_cache"])
    assert llm.llm_engine.weight_version == version
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before


@pytest.mark.parametrize("name", ["execute", "launch", "sleep_worker", "update_named_param", "init_communicator",
                                  "load_weights", "model"])
def test_unknown_names_are_refused_naming_what_to_use(llm, name):
    with pytest.raises(ValueError, match="no method") as err:
        llm.collective_rpc(name)
    message = str(err.value)
    assert repr(name) in message and "update_weights" in message
    assert all(known in message for known in [*ENGINE_RPC_METHODS, "get_model"])


@pytest.mark.parametrize("call, complaint", [
    ({"method": 3}, "method must be"),
    ({"method": "get_model", "args": "x"}, "args must be a tuple"),
    ({"method": "get_model", "kwargs": [("a", 1)]}, "kwargs must be a dict"),
    ({"method": "get_model", "timeout": 0}, "timeout must be"),
    ({"method": "get_model", "timeout": -1.0}, "timeout must be"),
    ({"method": "get_model", "timeout": True}, "timeout must be"),
    ({"method": "get_model", "timeout": "5"}, "timeout must be"),
])
def test_bad_arguments_are_value_errors(llm, call, complaint):
    with pytest.raises(ValueError, match=complaint):
        llm.collective_rpc(**call)


def test_bad_input_is_refused_without_waiting_for_a_busy_engine(llm):
    held, done = threading.Event(), threading.Event()

    def hold():
        with llm._engine_lock:
            held.set()
            done.wait(120)
    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert held.wait(120)
        with pytest.raises(ValueError, match="no method"):
            llm.collective_rpc("update_named_param")   # answered while the lock is held elsewhere
    finally:
        done.set()
        holder.join(120)


def test_a_failing_function_raises_and_gives_the_lock_back(llm):
    def fails(worker):
        raise RuntimeError("from the worker")
    with pytest.raises(RuntimeError, match="from the worker"):
        llm.collective_rpc(fails)
    taken = []

    def take():
        taken.append(llm._engine_lock.acquire(blocking=False))
        if taken[-1]:
            llm._engine_lock.release()
    thread = threading.Thread(target=take)
    thread.start()
    thread.join(120)
    assert taken == [True]


def test_tensor_parallel_is_still_one_worker(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant", tensor_parallel_size=2)
    assert llm.collective_rpc(lambda worker: worker.model is llm.llm_engine.executor.model) == [True]


@pytest.mark.parametrize("extension", ["trl.scripts.vllm_serve.WeightSyncWorkerExtension", type("Ext", (), {})])
def test_worker_extension_cls_is_refused_naming_what_to_use(tiny_qwen3, extension):
    with pytest.raises(ValueError, match="worker_extension_cls") as err:
        LLM(tiny_qwen3, device="cpu", worker_extension_cls=extension)
    assert "collective_rpc" in str(err.value) and "update_weights" in str(err.value)


def test_worker_extension_cls_unset_is_accepted(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu", worker_extension_cls=None)
    assert llm.collective_rpc("get_model") == [llm.llm_engine.executor.model]


def test_a_name_is_checked_once_by_the_llm_and_the_executor_takes_functions(llm):
    """LLM.collective_rpc resolves a name through the executor's rpc_methods (name ->
    function), the one place a name is checked; the executor calls the function it is
    handed, so no second check (with other words) stands behind the first."""
    executor = llm.llm_engine.executor
    assert "execute" not in executor.rpc_methods
    get_model = executor.rpc_methods["get_model"]
    assert callable(get_model) and executor.collective_rpc(get_model) == [executor.model]
    assert executor.collective_rpc(lambda worker, a, *, b: (a, b), args=(1,), kwargs={"b": 2}) == [(1, 2)]
