"""upstream vLLM's prefix-cache and usage options of the server, through the app on the embedded
model (in-process, httpx's ASGI transport): the `cache_salt` request field,
usage.prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details) and
--enable-force-include-usage, and both flags on `vllm serve`."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

# 48 tokens of the embedded model: its full blocks of 16 come from the cache on a repeat
SHARED = "Count the apples in the basket and tell me how many there are. " * 3
GREEDY = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
STREAM = {"stream": True, "stream_options": {"include_usage": True}}


def _hit(prompt_tokens: int) -> int:
    """The tokens a repeated prompt takes from the cache: its full blocks of 16, the last token
    always computed."""
    return (prompt_tokens - 1) // 16 * 16


def _app(**options):
    from vllm import LLM
    from vllm.entrypoints.openai.api_server import build_app_from_llm
    return build_app_from_llm(LLM(device="cpu"), **options)


@pytest.fixture(scope="module")
def app():
    """The flags set: cached tokens reported, usage in every stream."""
    app = _app(enable_prompt_tokens_details=True, enable_force_include_usage=True)
    yield app
    app.state.serving.llm.shutdown()


@pytest.fixture(scope="module")
def plain_app():
    """The defaults: neither flag."""
    app = _app()
    yield app
    app.state.serving.llm.shutdown()


def _post(app, path: str, body: dict) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            return await c.post(path, json=body)
    return asyncio.run(go())


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    data = [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]", r.text[-300:]
    return [json.loads(d) for d in data[:-1]]


def _cached(usage: dict) -> int:
    """usage.prompt_tokens_details.cached_tokens; 0 where it is left out (nothing was cached)."""
    assert set(usage) <= {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
    return usage["prompt_tokens_details"]["cached_tokens"] if "prompt_tokens_details" in usage else 0


def _completion(app, prompt, **fields) -> dict:
    return _ok(_post(app, "/v1/completions", {"prompt": prompt, **GREEDY, **fields}))


def _chat(app, content: str, **fields) -> dict:
    return _ok(_post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                   **GREEDY, **fields}))


# ---- usage.prompt_tokens_details.cached_tokens -------------------------------------------------

def test_cached_tokens_in_usage(app):
    prompt = "First. " + SHARED
    cold = _completion(app, prompt)["usage"]
    assert "prompt_tokens_details" not in cold    # nothing from the cache: left out, as upstream
    warm = _completion(app, prompt)["usage"]
    assert warm["prompt_tokens_details"] == {"cached_tokens": _hit(cold["prompt_tokens"])}
    assert warm["prompt_tokens"] == cold["prompt_tokens"] and _hit(cold["prompt_tokens"]) >= 48
    # several prompts: counted as prompt_tokens is, over the prompts
    other = _completion(app, "Second. " + SHARED)["usage"]["prompt_tokens"]
    both = _completion(app, [prompt, "Second. " + SHARED])["usage"]
    assert _cached(both) == _hit(cold["prompt_tokens"]) + _hit(other)
    # streamed: on the final usage chunk only
    *chunks, last = _events(_post(app, "/v1/completions", {"prompt": prompt, **STREAM, **GREEDY}))
    assert last["choices"] == [] and last["usage"] == warm
    assert all("prompt_tokens_details" not in (c.get("usage") or {}) for c in chunks)
    chat = "Third. " + SHARED
    assert _cached(_chat(app, chat)["usage"]) == 0
    assert _cached(_chat(app, chat)["usage"]) > 0
    *_, last = _events(_post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": chat}],
                                                           **STREAM, **GREEDY}))
    assert _cached(last["usage"]) == _cached(_chat(app, chat)["usage"]) > 0


def test_cached_tokens_need_the_flag(plain_app):
    prompt = "Fourth. " + SHARED
    _completion(plain_app, prompt)
    assert set(_completion(plain_app, prompt)["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    _chat(plain_app, prompt)
    assert "prompt_tokens_details" not in _chat(plain_app, prompt)["usage"]


# ---- cache_salt ----------------------------------------------------------------------------

def test_cache_salt_scopes_the_prefix_cache(app):
    prompt = "Fifth. " + SHARED
    cold = _completion(app, prompt, logprobs=2)
    hit = _hit(cold["usage"]["prompt_tokens"])
    assert _cached(cold["usage"]) == 0 and hit >= 48
    assert _cached(_completion(app, prompt)["usage"]) == hit                   # no salt: shared as ever
    salted = [_completion(app, prompt, cache_salt="tenant-a", logprobs=2) for _ in range(2)]
    assert [_cached(r["usage"]) for r in salted] == [0, hit]                   # shared within the salt only
    assert _cached(_completion(app, prompt, cache_salt="tenant-b")["usage"]) == 0
    assert _cached(_completion(app, prompt)["usage"]) == hit
    # served from its warm cache or not, a salted request's tokens and logprobs are the cold ones
    for r in salted:
        assert r["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
        assert r["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]
    # token-id prompts and chat take it too
    ids = cold["choices"][0]["prompt_token_ids"]
    assert _cached(_completion(app, ids, cache_salt="tenant-a")["usage"]) == hit
    assert _cached(_completion(app, ids, cache_salt="tenant-c")["usage"]) == 0
    chat = "Sixth. " + SHARED
    _chat(app, chat)
    assert [_cached(_chat(app, chat, cache_salt="s")["usage"]) > 0 for _ in range(2)] == [False, True]
    *_, last = _events(_post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": chat}],
                                                           **STREAM, "cache_salt": "s2", **GREEDY}))
    assert _cached(last["usage"]) == 0


@pytest.mark.parametrize("salt", ["", "x" * 129, "a/b", "a@b", 7])
def test_bad_cache_salt_is_400(app, salt):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = _post(app, path, {**body, "max_tokens": 1, "cache_salt": salt})
        assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"], r.text


# ---- --enable-force-include-usage -------------------------------------------------------------

@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": ["Hello there", "The quick brown fox"], "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a prime."}], "n": 2}),
])
def test_force_include_usage(app, plain_app, path, body):
    body = {**body, "max_tokens": 4, "temperature": 0.8, "seed": 3, "ignore_eos": True}
    full = _ok(_post(app, path, body))
    # every stream carries usage: each chunk its own so far, then the request's, as if it had
    # asked for stream_options include_usage and continuous_usage_stats
    for options in ({}, {"stream_options": {"include_usage": False}},
                    {"stream_options": {"continuous_usage_stats": True}}):
        *chunks, last = _events(_post(app, path, {**body, "stream": True, **options}))
        assert last["choices"] == [] and last["usage"] == full["usage"]
        assert all(c["usage"]["prompt_tokens"] > 0 for c in chunks)
    # without the flag a stream carries none unless asked
    events = _events(_post(plain_app, path, {**body, "stream": True}))
    assert all(e.get("usage") is None for e in events) and events[-1]["choices"]


# ---- vllm serve -----------------------------------------------------------------------------

def test_serve_flags_reach_the_server(monkeypatch):
    import argparse

    from vllm.entrypoints.cli import serve
    from vllm.entrypoints.openai import api_server
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    seen = {}
    monkeypatch.setattr(api_server, "run_server", lambda engine_kwargs, **kw: seen.update(kw))
    for argv, on in ((["serve"], False),
                     (["serve", "--enable-prompt-tokens-details", "--enable-force-include-usage"], True)):
        assert serve.run(parser.parse_args(argv)) == 0
        assert seen["enable_prompt_tokens_details"] is on and seen["enable_force_include_usage"] is on


def test_serve_takes_vllm_api_key_and_exits_when_the_engine_dies(monkeypatch):
    """As upstream: VLLM_API_KEY is the --api-key default (a secret kept off the command
    line); `vllm serve` exits with status 1 once its engine process has died (run_server
    reports it), 0 after a normal stop, and --keep-alive-on-engine-death reaches the server."""
    import argparse

    from vllm.entrypoints.cli import serve
    from vllm.entrypoints.openai import api_server
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    seen = {}
    outcome = ["stopped"]
    monkeypatch.setattr(api_server, "run_server", lambda engine_kwargs, **kw: seen.update(kw) or outcome[0])
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert serve.run(parser.parse_args(["serve"])) == 0
    assert seen["api_key"] == "from-env" and seen["keep_alive_on_engine_death"] is False
    serve.run(parser.parse_args(["serve", "--api-key", "flag", "--keep-alive-on-engine-death"]))
    assert seen["api_key"] == "flag" and seen["keep_alive_on_engine_death"] is True
    monkeypatch.delenv("VLLM_API_KEY")
    outcome[0] = "engine_dead"
    assert serve.run(parser.parse_args(["serve"])) == 1 and seen["api_key"] is None


class _Server:
    """uvicorn's Server as far as the API server uses it: `should_exit`. Records the thread
    that set it, and an event to wait on instead of a sleep."""

    def __init__(self):
        self.told = threading.Event()
        self.by_thread = None

    @property
    def should_exit(self) -> bool:
        return self.told.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self.by_thread = threading.current_thread().name
            self.told.set()


def test_the_server_is_stopped_by_the_receiver_that_finds_the_engine_dead(tiny_qwen3):
    """No thread polls the engine: the AsyncLLM's output receiver, finding the engine's
    pipe closed, tells the server at once; a server registered after the death is told
    on the spot."""
    from vllm import LLM
    from vllm.entrypoints.openai.api_server import stop_server_on_engine_death
    from vllm.entrypoints.openai.async_engine import AsyncLLM

    class Crash(BaseException):
        pass

    def crash(msg):
        raise Crash("the engine loop crashed")

    async_llm = AsyncLLM.from_engine(LLM(tiny_qwen3, device="cpu", cpu_kv_cache_bytes=4 << 20).llm_engine)
    try:
        threads_before = set(threading.enumerate())
        server = _Server()
        stop_server_on_engine_death(async_llm, server)
        assert set(threading.enumerate()) == threads_before and not server.should_exit
        async_llm.client.core.handle = crash          # the next command kills the engine loop
        async_llm.client.utility("engine_stats")
        assert server.told.wait(60), "the server was not told the engine died"
        assert server.by_thread == "vllm-core-receiver" and not async_llm.is_running
        late = _Server()
        stop_server_on_engine_death(async_llm, late)  # the engine is gone already: told here
        assert late.should_exit and late.by_thread == threading.current_thread().name
    finally:
        async_llm.shutdown()


def test_a_shutdown_of_the_engine_does_not_stop_the_server_as_a_death(tiny_qwen3):
    from vllm import LLM
    from vllm.entrypoints.openai.api_server import stop_server_on_engine_death
    from vllm.entrypoints.openai.async_engine import AsyncLLM

    async_llm = AsyncLLM.from_engine(LLM(tiny_qwen3, device="cpu", cpu_kv_cache_bytes=4 << 20).llm_engine)
    server = _Server()
    stop_server_on_engine_death(async_llm, server)
    async_llm.shutdown()
    assert not async_llm.client._receiver.is_alive()   # the receiver has seen the pipe close
    assert not async_llm.is_running and not server.should_exit
    stop_server_on_engine_death(async_llm, server)
    assert not server.should_exit
