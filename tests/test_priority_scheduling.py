"""scheduling_policy="priority" (upstream's) end to end: LLM.generate's `priority`, the
OpenAI field, `--scheduling-policy`. Priorities reorder the work and nothing else: every
token and logprob bit equals an fcfs run's, preemption and recompute included (the
scheduler's own order and victim tests are in tests/test_scheduler.py)."""
from __future__ import annotations

import argparse
import asyncio
import random

import pytest

from vllm import LLM, SamplingParams
from vllm.core.request import RequestStatus
from vllm.testing.parity_battery import signature

REFUSAL = "but Priority scheduling is not enabled"


def _prompts(lengths, seed=7, vocab=512) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]} for n in lengths]


def _params(n: int, max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
            for i in range(n)]


def _finish_order(llm: LLM) -> list[str]:
    """Record the request ids in the order `llm`'s engine reports them finished."""
    engine = llm.llm_engine
    order: list[str] = []
    step = engine.step

    def recording_step():
        outs = step()
        order.extend(o.request_id for o in outs if o.finished)
        return outs
    engine.step = recording_step
    return order


def _bits(outs) -> list:
    return [(signature(o.outputs[0]), o.outputs[0].cumulative_logprob, o.outputs[0].finish_reason) for o in outs]


@pytest.fixture(scope="module")
def fcfs_llm(tiny_qwen3):
    return LLM(tiny_qwen3, device="cpu", dtype="float32", max_num_seqs=1)


def test_generate_completes_in_priority_order_with_the_bits_of_fcfs(tiny_qwen3, fcfs_llm):
    prompts = _prompts((9, 14, 5, 11, 7))
    params = _params(len(prompts), max_tokens=6)
    priority = [3, 0, 2, 0, -1]
    llm = LLM(tiny_qwen3, device="cpu", dtype="float32", max_num_seqs=1, scheduling_policy="priority")
    order = _finish_order(llm)
    outs = llm.generate(prompts, params, use_tqdm=False, priority=priority)
    index = {o.request_id: i for i, o in enumerate(outs)}
    # one sequence at a time: each request finishes before the next is admitted, lowest priority
    # value first, ties (1 and 3) by arrival
    assert [index[r] for r in order] == [4, 1, 3, 2, 0]

    fcfs_order = _finish_order(fcfs_llm)
    ref = fcfs_llm.generate(prompts, params, use_tqdm=False, priority=[0] * len(prompts))
    fcfs_index = {o.request_id: i for i, o in enumerate(ref)}
    assert [fcfs_index[r] for r in fcfs_order] == [0, 1, 2, 3, 4]
    assert _bits(outs) == _bits(ref)
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref]


def test_generate_checks_priorities_before_queueing_anything(tiny_qwen3, fcfs_llm):
    prompts = _prompts((4, 6))
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=f"Got priority 1 {REFUSAL}"):
        fcfs_llm.generate(prompts, sp, use_tqdm=False, priority=[0, 1])
    assert not fcfs_llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        fcfs_llm.generate(prompts, sp, use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match="priority must be an integer"):
        fcfs_llm.generate(prompts, sp, use_tqdm=False, priority=[0, 0.5])
    with pytest.raises(ValueError, match="a list of integers"):
        fcfs_llm.generate(prompts, sp, use_tqdm=False, priority=3)
    with pytest.raises(ValueError, match=f"Got priority 2 {REFUSAL}"):
        fcfs_llm.llm_engine.add_request("x", prompts[0], sp, priority=2)
    assert not fcfs_llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        LLM(tiny_qwen3, device="cpu", scheduling_policy="sjf")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_qwen3_next"])
def test_priority_preemption_and_recompute_keep_the_bits(request, model, async_scheduling):
    """KV for about two of six requests: the priority scheduler preempts the lowest priorities
    (their blocks freed; hybrid models' recurrent states recomputed, or loaded from a prefix-cache
    snapshot) and resumes them, also while a victim's step is still in flight (async scheduling);
    every token and logprob bit equals an fcfs engine's with room for all. Two prompts share a
    prefix, so a recompute can hit the prefix cache."""
    path = request.getfixturevalue(model)
    opts = dict(device="cpu", dtype="float32", block_size=4)
    shared = _prompts((24,), seed=3)[0]["prompt_token_ids"]
    prompts = _prompts((30, 25, 35, 20), seed=5) + [{"prompt_token_ids": shared + [7, 8, 9]},
                                                     {"prompt_token_ids": shared + [10, 11]}]
    params = _params(len(prompts), max_tokens=12)
    ref = LLM(path, **opts).generate(prompts, params, use_tqdm=False)
    small = LLM(path, **opts, scheduling_policy="priority", num_gpu_blocks_override=1 + (35 + 12) * 2 // 4,
                max_num_batched_tokens=64, async_scheduling=async_scheduling)
    outs = small.generate(prompts, params, use_tqdm=False, priority=[2, 0, 1, 0, 2, 1])
    engine = small.llm_engine
    assert engine.scheduler.num_preemptions > 0
    assert _bits(outs) == _bits(ref)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks - 1
    engine.kv.check_invariants()


def test_scheduling_policy_flag_reaches_the_engine():
    from vllm.entrypoints.cli.engine_args import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args([]))["scheduling_policy"] == "fcfs"
    assert engine_kwargs(p.parse_args(["--scheduling-policy", "priority"]))["scheduling_policy"] == "priority"
    with pytest.raises(SystemExit):
        p.parse_args(["--scheduling-policy", "lifo"])


# ---- the OpenAI server ------------------------------------------------------------------------

BODY = {"prompt": "The quick brown fox", "max_tokens": 5, "temperature": 1.0, "seed": 11, "ignore_eos": True,
        "logprobs": 2}
MESSAGES = [{"role": "user", "content": "Name a prime number."}]


def _app(**engine_options):
    pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from vllm.entrypoints.openai.api_server import build_app_from_llm
    return build_app_from_llm(LLM(device="cpu", **engine_options))


@pytest.fixture(scope="module")
def fcfs_app():
    app = _app()
    yield app
    app.state.serving.llm.shutdown()


@pytest.fixture(scope="module")
def priority_app():
    app = _app(scheduling_policy="priority", max_num_seqs=1)
    yield app
    app.state.serving.llm.shutdown()


def _client(app):
    import httpx
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120)


def _post(app, path: str, body: dict):
    async def go():
        async with _client(app) as c:
            return await c.post(path, json=body)
    return asyncio.run(go())


def test_fcfs_server_answers_a_priority_with_400(fcfs_app):
    for path, body in (("/v1/completions", {**BODY, "priority": 1}),
                       ("/v1/completions", {**BODY, "priority": 1, "stream": True}),
                       ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "priority": -2})):
        r = _post(fcfs_app, path, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert REFUSAL in err["message"] and err["type"] == "invalid_request_error", err
    for bad in ("1", 1.5, None):
        assert _post(fcfs_app, "/v1/completions", {**BODY, "priority": bad}).status_code == 400
    assert _post(fcfs_app, "/v1/completions", {**BODY, "priority": 0}).status_code == 200
    assert _post(fcfs_app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "priority": 0}).status_code == 200


def test_priority_server_orders_requests_and_keeps_the_bits(priority_app, fcfs_app):
    """Requests queued while the engine is paused, then resumed with one sequence at a time:
    they finish in (priority, arrival) order, with the tokens and logprobs fcfs gives them."""
    engine = priority_app.state.serving.llm
    sched = engine.client.core.engine.scheduler
    finished: list[str] = []
    finish_requests = sched.finish_requests

    def recording_finish(ids, status):
        done = finish_requests(ids, status)
        if status != RequestStatus.FINISHED_ABORTED:
            finished.extend(r.req_id.split("@")[0] for r in done)
        return done
    sched.finish_requests = recording_finish

    priorities = {"a": 4, "b": 0, "c": 4, "d": -1}
    bodies = {rid: {**BODY, "seed": 20 + i, "request_id": rid, "priority": p}
              for i, (rid, p) in enumerate(priorities.items())}

    async def go():
        async with _client(priority_app) as c:
            assert (await c.post("/v1/pause")).status_code == 200
            tasks = {}
            for rid, body in bodies.items():   # one at a time: arrival order a, b, c, d
                tasks[rid] = asyncio.ensure_future(c.post("/v1/completions", json=body))
                while engine._outstanding < len(tasks):
                    await asyncio.sleep(0.01)
            # the resume travels the same pipe after the adds: the engine has every request queued
            assert (await c.post("/v1/resume")).status_code == 200
            return {rid: await t for rid, t in tasks.items()}
    responses = asyncio.run(go())
    assert finished == ["cmpl-d-0", "cmpl-b-0", "cmpl-a-0", "cmpl-c-0"]
    for rid, r in responses.items():
        assert r.status_code == 200, r.text
        ref = _post(fcfs_app, "/v1/completions", {**bodies[rid], "priority": 0})
        got, want = r.json()["choices"][0], ref.json()["choices"][0]
        assert (got["token_ids"], got["logprobs"], got["text"]) == (want["token_ids"], want["logprobs"], want["text"])
    chat = _post(priority_app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "priority": 7})
    assert chat.status_code == 200, chat.text
