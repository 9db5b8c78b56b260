"""The OpenAI-compatible server on CPU with the embedded default model.

Most tests drive the FastAPI app in-process through httpx's ASGI transport
(one event loop per test, via asyncio.run); the engine-core loop behind it runs
on a thread for the whole module. Reference outputs come from a *separate* LLM:
the served engine belongs to that thread and must not be called from here.
The last tests run the real `vllm serve` CLI (engine in its own process) as a
subprocess on loopback.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from vllm import LLM, SamplingParams
from vllm.entrypoints.openai.api_server import build_app_from_llm
from vllm.testing.rollout_server import free_port, terminate_process, wait_until_healthy

PROMPT_IDS = [5, 6, 7, 8, 9, 10]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def served(request):
    # the async-scheduling loop (the default on CUDA) behind the same server: streaming,
    # aborts and concurrent requests with a step always in flight
    llm = LLM(device="cpu", async_scheduling=request.param)
    app = build_app_from_llm(llm)
    yield app, llm
    app.state.serving.llm.shutdown()


@pytest.fixture(scope="module")
def ref_llm():
    return LLM(device="cpu")


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver", timeout=60)


def _run(coro):
    return asyncio.run(coro)


async def _post(app, path: str, body: dict) -> httpx.Response:
    async with _client(app) as c:
        return await c.post(path, json=body)


async def _post_raw(app, path: str, body: bytes, headers: dict) -> httpx.Response:
    async with _client(app) as c:
        return await c.post(path, content=body, headers=headers)


def _sse_events(text: str) -> list:
    """Parse an SSE body into JSON events; the terminating [DONE] must be last."""
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-300:]
    return [json.loads(e) for e in events[:-1]]


def _ref(ref_llm, prompt, **kw):
    return ref_llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


# ---- schema -------------------------------------------------------------------------------

def test_health_and_models(served):
    app, _ = served

    async def go():
        async with _client(app) as c:
            return await c.get("/health"), await c.get("/v1/models")
    health, models = _run(go())
    assert health.status_code == 200
    body = models.json()
    assert body["object"] == "list" and body["data"][0]["id"] == "default"
    assert body["data"][0]["max_model_len"] == 4096


def test_completion_schema_and_greedy_matches_llm(served, ref_llm):
    app, _ = served
    r = _run(_post(app, "/v1/completions", {"model": "default", "prompt": PROMPT_IDS, "max_tokens": 10,
                                             "temperature": 0, "ignore_eos": True}))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "default"
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert set(choice) >= {"index", "text", "logprobs", "finish_reason", "token_ids", "prompt_token_ids"}
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": 10, "total_tokens": len(PROMPT_IDS) + 10}

    ref = _ref(ref_llm, {"prompt_token_ids": PROMPT_IDS}, temperature=0.0, max_tokens=10, ignore_eos=True).outputs[0]
    assert choice["prompt_token_ids"] == PROMPT_IDS
    assert choice["token_ids"] == ref.token_ids
    assert choice["text"] == ref.text


def test_completion_text_prompts_and_n(served, ref_llm):
    app, _ = served
    r = _run(_post(app, "/v1/completions", {"prompt": ["Hello there", "The quick brown fox"], "n": 2, "max_tokens": 4,
                                             "temperature": 0.8, "seed": 3, "ignore_eos": True}))
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    tok = ref_llm.get_tokenizer()
    ids0 = tok.encode("Hello there", add_special_tokens=True)
    ids1 = tok.encode("The quick brown fox", add_special_tokens=True)
    assert [c["prompt_token_ids"] for c in body["choices"]] == [ids0, ids0, ids1, ids1]
    assert body["usage"]["prompt_tokens"] == len(ids0) + len(ids1)   # each prompt counted once, as OpenAI does
    assert body["usage"]["completion_tokens"] == 16
    ref = _ref(ref_llm, "Hello there", n=2, temperature=0.8, seed=3, max_tokens=4, ignore_eos=True)
    assert [c["token_ids"] for c in body["choices"][:2]] == [o.token_ids for o in ref.outputs]


def test_chat_schema_and_matches_llm_chat(served, ref_llm):
    app, _ = served
    r = _run(_post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    ref = ref_llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert body["prompt_token_ids"] == ref.prompt_token_ids
    assert choice["token_ids"] == ref.outputs[0].token_ids
    assert choice["message"]["content"] == ref.outputs[0].text
    assert choice["finish_reason"] == ref.outputs[0].finish_reason
    n_gen = len(choice["token_ids"])
    assert body["usage"] == {"prompt_tokens": len(ref.prompt_token_ids), "completion_tokens": n_gen,
                             "total_tokens": len(ref.prompt_token_ids) + n_gen}


# ---- sampling -----------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible(served, ref_llm):
    app, _ = served
    body = {"prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "ignore_eos": True}

    async def go():
        return await asyncio.gather(*(_post(app, "/v1/completions", body) for _ in range(3)))
    rs = _run(go())
    ids = [r.json()["choices"][0]["token_ids"] for r in rs]
    assert ids[0] == ids[1] == ids[2]
    ref = _ref(ref_llm, {"prompt_token_ids": PROMPT_IDS}, temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    assert ids[0] == ref.outputs[0].token_ids
    other = _run(_post(app, "/v1/completions", {**body, "seed": 99})).json()["choices"][0]["token_ids"]
    assert other != ids[0]


def test_completion_logprobs_bitwise_equal_llm(served, ref_llm):
    app, _ = served
    r = _run(_post(app, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 0.7, "seed": 7,
                                             "logprobs": 3, "ignore_eos": True}))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    n = len(choice["token_ids"])
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert all(1 <= len(top) <= 4 for top in lp["top_logprobs"])   # the sampled token + the top 3
    ref = _ref(ref_llm, {"prompt_token_ids": PROMPT_IDS}, temperature=0.7, seed=7, max_tokens=6, logprobs=3,
               ignore_eos=True).outputs[0]
    assert choice["token_ids"] == ref.token_ids
    # JSON floats round-trip exactly: the server's logprobs are the engine's, bit for bit.
    assert lp["token_logprobs"] == [d[t].logprob for d, t in zip(ref.logprobs, ref.token_ids)]


def test_chat_logprobs(served):
    app, _ = served
    r = _run(_post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5, "temperature": 0,
                                                  "logprobs": True, "top_logprobs": 2, "ignore_eos": True}))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"]) == 5
    for item in content:
        assert set(item) >= {"token", "logprob", "bytes", "top_logprobs"}
        assert len(item["top_logprobs"]) == 2
        # Greedy: the sampled token is the most likely one.
        assert item["top_logprobs"][0]["logprob"] == item["logprob"]
    # `bytes` are each token's own: a token holding part of a character (the first byte of
    # "日", forced by logit_bias) gives that byte, not the bytes of the U+FFFD its decode shows
    tok = served[1].get_tokenizer()
    lead = tok.encode("日", add_special_tokens=False)[0]
    assert tok.decode([lead]) == "\ufffd"
    forced = _run(_post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "logprobs": True,
                                                       "logit_bias": {str(lead): 100}, "ignore_eos": True}))
    assert [item["bytes"] for item in forced.json()["choices"][0]["logprobs"]["content"]] == [[0xE6]] * 2
    no_lp = _run(_post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})).json()
    assert no_lp["choices"][0]["logprobs"] is None


# ---- streaming ----------------------------------------------------------------------------

def test_streaming_concatenates_to_full_text(served, ref_llm):
    app, _ = served
    # Seeded sampling past the end of turn: many tokens, some of them special (skipped).
    sampling = {"temperature": 1.0, "seed": 5, "max_tokens": 16, "ignore_eos": True}
    ref = _ref(ref_llm, {"prompt_token_ids": PROMPT_IDS}, **sampling).outputs[0]
    # A stop string taken from inside the text, completed before the last token (one the
    # last token completes ends by length, as offline): streaming must hold back the text
    # a stop string might be completing, or chunks would overshoot the cut.
    stop = ref.text[len(ref.text) // 3:len(ref.text) // 3 + 3]
    assert ref.text.index(stop) > 0
    for extra in ({}, {"stop": [stop]}, {"logprobs": 1}):
        body = {"prompt": PROMPT_IDS, **sampling, **extra}
        full = _run(_post(app, "/v1/completions", body)).json()["choices"][0]
        r = _run(_post(app, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}))
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r.text)
        chunks = [e for e in events if e["choices"]]
        assert all(e["object"] == "text_completion" for e in events)
        assert len(chunks) > 1
        assert "".join(c["choices"][0]["text"] for c in chunks) == full["text"]
        assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == full["token_ids"]
        assert chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT_IDS
        assert chunks[-1]["choices"][0]["finish_reason"] == full["finish_reason"]
        assert events[-1]["usage"]["completion_tokens"] == len(full["token_ids"])
        if "stop" in extra:
            assert full["finish_reason"] == "stop" and full["stop_reason"] == stop
            assert full["text"] == ref.text[:ref.text.index(stop)]
        if "logprobs" in extra:
            streamed = sum((c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks), [])
            assert streamed == full["logprobs"]["token_logprobs"]


def test_chat_streaming(served):
    app, _ = served
    body = {"messages": MESSAGES, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    full = _run(_post(app, "/v1/chat/completions", body)).json()
    events = _sse_events(_run(_post(app, "/v1/chat/completions", {**body, "stream": True})).text)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == full["choices"][0]["message"]["content"]
    assert sum((e["choices"][0]["token_ids"] for e in events), []) == full["choices"][0]["token_ids"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


# ---- concurrency and errors ---------------------------------------------------------------

def test_concurrent_requests_all_finish(served):
    app, _ = served

    async def go():
        async with _client(app) as c:
            reqs = [c.post("/v1/completions", json={"prompt": [5 + i] * (3 + i), "max_tokens": 8 + i, "temperature": 0.5,
                                                    "seed": i, "ignore_eos": True, "stream": i % 2 == 1}) for i in range(8)]
            reqs += [c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 6, "ignore_eos": True})]
            return await asyncio.gather(*reqs)
    rs = _run(go())
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
    for i, r in enumerate(rs[:8]):
        if i % 2:
            ids = sum((e["choices"][0]["token_ids"] for e in _sse_events(r.text) if e["choices"]), [])
        else:
            ids = r.json()["choices"][0]["token_ids"]
        assert len(ids) == 8 + i
    assert len(rs[8].json()["choices"][0]["token_ids"]) == 6


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": [5] * 4096, "max_tokens": 4}, "This model's maximum context length is 4096"),
    ("/v1/completions", {"prompt": [5] * 5000}, "This model's maximum context length is 4096"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 5000}]},
     "This model's maximum context length is 4096"),
    ("/v1/completions", {"prompt": [5, 4096]}, "vocabulary"),
    ("/v1/completions", {"prompt": [[5, 6], [7, -1]]}, "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"4096": 1.0}}, "logit_bias"),   # out of the vocabulary
    ("/v1/completions", {"prompt": [5] * 10, "max_tokens": 4090}, "maximum context length"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 1000}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "seed": 1 << 70}, "seed"),
    ("/v1/completions", {"prompt": []}, "empty"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "n": 0}, "n must be"),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 3}, "empty"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "role"),
]


def test_bad_requests_get_400_while_good_ones_succeed(served):
    app, _ = served

    async def go():
        async with _client(app) as c:
            good = [asyncio.ensure_future(c.post("/v1/completions", json={"prompt": PROMPT_IDS, "max_tokens": 24,
                                                                           "temperature": 0, "ignore_eos": True}))
                    for _ in range(3)]
            await asyncio.sleep(0.05)  # let the good ones start running before the bad ones arrive
            bad = await asyncio.gather(*(c.post(path, json=body) for path, body, _ in BAD_REQUESTS))
            raw = await c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
            missing = await c.get("/v1/nothing-here")
            unknown_model = await c.post("/v1/completions", json={"prompt": "hi", "model": "gpt-4"})
            return await asyncio.gather(*good), bad, raw, missing, unknown_model
    good, bad, raw, missing, unknown_model = _run(go())
    for r, (path, body, needle) in zip(bad, BAD_REQUESTS):
        assert r.status_code == 400, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == 400
        assert needle in err["message"], (needle, err["message"])
    assert raw.status_code == 400 and raw.json()["error"]["code"] == 400
    assert raw.json()["error"]["param"] is None and "not valid JSON" in raw.json()["error"]["message"]
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    # an unknown model is 404 (the openai client's NotFoundError), as upstream answers
    err = unknown_model.json()["error"]
    assert unknown_model.status_code == 404 and err["type"] == "not_found_error" and err["param"] == "model"
    assert "`gpt-4` does not exist" in err["message"]
    assert all(r.status_code == 200 for r in good)
    assert len({tuple(r.json()["choices"][0]["token_ids"]) for r in good}) == 1


def test_engine_failure_is_500_and_server_recovers(served, ref_llm):
    app, llm = served
    runner = llm.llm_engine.executor.worker
    real_launch = runner.launch  # both loops enqueue steps through launch()
    calls = {"n": 0}

    def flaky_launch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected kernel failure")
        return real_launch(*args, **kwargs)

    runner.launch = flaky_launch
    try:
        failed = _run(_post(app, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 4, "temperature": 0}))
        ok = _run(_post(app, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 4, "temperature": 0, "ignore_eos": True}))
    finally:
        runner.launch = real_launch
    assert failed.status_code == 500
    assert failed.json()["error"]["code"] == 500 and "injected kernel failure" in failed.json()["error"]["message"]
    assert ok.status_code == 200
    ref = _ref(ref_llm, {"prompt_token_ids": PROMPT_IDS}, temperature=0.0, max_tokens=4, ignore_eos=True)
    assert ok.json()["choices"][0]["token_ids"] == ref.outputs[0].token_ids
    assert _run(app.state.serving.llm.engine_stats())["has_unfinished"] is False


def test_abandoned_stream_is_aborted(served):
    """A consumer that stops reading (what a client disconnect does) frees its engine slot, and
    the request counts as finished by "abort" (/metrics' request_success)."""
    app, _ = served
    async_llm = app.state.serving.llm
    aborted = async_llm.finished_by_reason["abort"]

    async def go():
        seen = 0
        # aclosing: leaving the loop closes the generator now, not when it is collected.
        async with contextlib.aclosing(async_llm.generate({"prompt_token_ids": PROMPT_IDS},
                                                          SamplingParams(max_tokens=2000, ignore_eos=True), stream=True)) as gen:
            async for out in gen:
                seen += 1
                assert not out.finished
                if seen == 3:
                    break
        return (await async_llm.engine_stats())["has_unfinished"]
    assert _run(go()) is False
    assert async_llm.finished_by_reason["abort"] == aborted + 1

    async def invalid():
        async for _ in async_llm.generate("hi", SamplingParams(stop_token_ids=[10 ** 6])):
            pass
    with pytest.raises(ValueError, match="vocabulary"):
        _run(invalid())


# ---- the real CLI -------------------------------------------------------------------------

def test_vllm_serve_cli_subprocess():
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--device", "cpu",
                             "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        # trust_env=False: a proxy from the environment must never see loopback traffic.
        with httpx.Client(base_url=base, timeout=30, trust_env=False) as client:
            wait_until_healthy(client, proc, timeout_s=120)
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 5,
                                                     "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "tiny" and len(r.json()["choices"][0]["token_ids"]) == 5
            # A client that drops a stream midway must leave the server healthy.
            with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 500,
                                                                "ignore_eos": True, "stream": True}) as s:
                next(s.iter_lines())
            assert client.get("/health").status_code == 200
            assert client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3}).status_code == 200
    except BaseException:
        log.seek(0)
        print(log.read().decode(errors="replace")[-5000:])
        raise
    finally:
        stopped_in_time = terminate_process(proc, timeout_s=20)
        log.seek(0)
        output = log.read().decode(errors="replace")
        log.close()
    # SIGTERM shuts the server down gracefully (uvicorn's shutdown, then the engine thread)
    # and in time; uvicorn re-raises the signal once it is done, so -SIGTERM is a clean exit
    assert stopped_in_time and proc.returncode in (0, -signal.SIGTERM), (proc.returncode, output[-3000:])
    assert "Finished server process" in output, output[-3000:]


def test_top_alternatives_order_with_ties():
    """The sampled token's own slot among the top-k is recovered even when its rank ties."""
    from vllm.entrypoints.openai.serving import _top_alternatives
    from vllm.outputs import Logprob
    # Top-3 by (value desc, id asc): 7 (-1.0), 3 (-2.0), 9 (-2.0). Token 9 was sampled; its
    # true rank is 2 (tied with 3), its slot in the top list is 3.
    entry = {9: Logprob(-2.0, 2, "c"), 7: Logprob(-1.0, 1, "a"), 3: Logprob(-2.0, 2, "b")}
    assert [t for t, _ in _top_alternatives(entry, 9, 3)] == [7, 3, 9]
    # Sampled token outside the top 2 (tied with slot 2 but a higher id): not listed.
    entry = {9: Logprob(-2.0, 2, "c"), 7: Logprob(-1.0, 1, "a"), 3: Logprob(-2.0, 2, "b")}
    assert [t for t, _ in _top_alternatives(entry, 9, 2)] == [7, 3]
    # Sampled token first.
    entry = {7: Logprob(-1.0, 1, "a"), 3: Logprob(-2.0, 2, "b")}
    assert [t for t, _ in _top_alternatives(entry, 7, 2)] == [7, 3]


def test_echo_text_offsets_follow_the_prompt_tokens(served):
    """echo + logprobs with a prompt whose characters span several tokens: text_offset is the
    running total of the token strings over prompt and output alike (upstream's rule), so it
    never goes back where the generated tokens start."""
    app, _ = served
    r = _run(_post(app, "/v1/completions", {"prompt": "Q: 中文", "max_tokens": 3, "temperature": 0, "echo": True,
                                            "logprobs": 1}))
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    running = [0]
    for t in lp["tokens"][:-1]:
        running.append(running[-1] + len(t))
    assert lp["text_offset"] == running
    # streamed: the chunks' offsets concatenate to the same list
    r = _run(_post(app, "/v1/completions", {"prompt": "Q: 中文", "max_tokens": 3, "temperature": 0, "echo": True,
                                            "logprobs": 1, "stream": True}))
    streamed = [o for e in _sse_events(r.text) for c in e["choices"] if c.get("logprobs")
                for o in c["logprobs"]["text_offset"]]
    assert streamed == running


def test_a_body_that_is_not_json_is_refused_by_its_media_type(served):
    """curl -d sends a form content type: upstream's message names the media type, not the
    body's shape."""
    app, _ = served
    body = b'{"prompt": "hi", "max_tokens": 1}'
    for headers in ({"content-type": "application/x-www-form-urlencoded"}, {}):
        r = _run(_post_raw(app, "/v1/completions", body, headers))
        assert r.status_code == 400 and "Only 'application/json' is allowed" in r.json()["error"]["message"]
    r = _run(_post_raw(app, "/v1/completions", body, {"content-type": "application/json; charset=utf-8"}))
    assert r.status_code == 200


def test_prompts_are_rendered_and_tokenized_off_the_event_loop(served, monkeypatch):
    """A chat conversation's template and tokens, a completion's text this route tokenizes
    itself (add_special_tokens false, truncate_prompt_tokens) and /tokenize run on the prompt
    thread: a large prompt there does not stall the other streams."""
    import threading
    from vllm.entrypoints.openai import serving as serving_module
    app, _ = served
    seen = []
    real_chat, real_encode = serving_module.OpenAIServing.chat_prompt_ids, serving_module.encode_text

    def chat_prompt_ids(self, *a, **kw):
        seen.append(("chat", threading.current_thread().name))
        return real_chat(self, *a, **kw)

    def encode_text(*a, **kw):
        seen.append(("encode", threading.current_thread().name))
        return real_encode(*a, **kw)
    monkeypatch.setattr(serving_module.OpenAIServing, "chat_prompt_ids", chat_prompt_ids)
    monkeypatch.setattr(serving_module, "encode_text", encode_text)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert _run(_post(app, "/v1/chat/completions", chat)).status_code == 200
    assert _run(_post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "add_special_tokens": False})
                ).status_code == 200
    assert _run(_post(app, "/v1/completions", {"prompt": "hi there", "max_tokens": 1, "truncate_prompt_tokens": 1})
                ).status_code == 200
    assert _run(_post(app, "/tokenize", {"prompt": "hi"})).status_code == 200
    assert _run(_post(app, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})).status_code == 200
    assert {kind for kind, _ in seen} == {"chat", "encode"} and len(seen) >= 5
    assert all(name.startswith("prompt-prep") for _, name in seen), seen
