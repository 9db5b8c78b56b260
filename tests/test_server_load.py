"""Load test of the production path: engine core in its own process, uvicorn on
127.0.0.1, the official `openai` client. Bounded in count (240 requests) and time.

Streaming and non-streaming requests run concurrently, some clients disconnect
at random points, and a weight update from a checkpoint directory lands in the
middle. Every surviving request must complete with all its tokens and report the
weight version(s) it ran under; afterwards the engine holds no request and its
free KV blocks are back to where they started. Finally the engine process is
killed: requests and /health then answer 503.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from vllm.entrypoints.openai.api_server import _serving, build_app
from vllm.entrypoints.openai.async_engine import AsyncLLM
from vllm.testing.rollout_server import serve_in_thread

NUM_REQUESTS = 240
DEADLINE_S = 240



@pytest.fixture(scope="module")
def server(tiny_qwen3):
    async_llm = AsyncLLM.from_engine_args(dict(model=tiny_qwen3, device="cpu", max_num_seqs=64), startup_timeout=300)
    app = build_app(_serving(async_llm, ["tiny"], "auto", max_logprobs=20), shutdown_engine_on_exit=False)
    with serve_in_thread(app) as url:
        yield url, async_llm
    async_llm.shutdown()


async def _stats(base: str) -> dict:
    return await asyncio.to_thread(lambda: _engine_stats_sync(base))


def _engine_stats_sync(base: str) -> dict:
    text = httpx.get(base + "/metrics", trust_env=False, timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and "{" in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            out[name] = value
    return out


def test_load_with_disconnects_and_weight_update(server, tmp_path_factory):
    from vllm.testing.tiny_models import make_tiny_checkpoint
    base, async_llm = server
    new_weights = make_tiny_checkpoint(tmp_path_factory.mktemp("load_new_weights"), "qwen3", head_dim=32,
                                       tie_word_embeddings=False, seed=9)
    rng = random.Random(0)

    async def one(client, i: int):
        stream = i % 2 == 0
        max_tokens = rng.randrange(4, 24)
        disconnect = rng.random() < 0.2
        prompt = [rng.randrange(5, 500) for _ in range(rng.randrange(3, 40))]
        kw = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=1.0, seed=i,
                  extra_body={"ignore_eos": True})
        await asyncio.sleep(rng.random() * 2.0)
        if stream:
            s = await client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
            ids, versions, usage = [], set(), None
            async for chunk in s:
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    ids += c.token_ids or []
                    versions.update(getattr(c, "weight_versions", None) or [])
                if disconnect and len(ids) >= max_tokens // 2:
                    await s.close()
                    return ("dropped", i)
            return ("stream", i, max_tokens, ids, versions, usage)
        task = asyncio.ensure_future(client.completions.create(**kw))
        if disconnect:
            await asyncio.sleep(rng.random() * 0.5)
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, openai.APIError):
                pass
            return ("dropped", i)
        r = await task
        return ("full", i, max_tokens, r.choices[0].token_ids, set(r.choices[0].weight_versions), r.usage)

    async def update_midway(admin):
        await asyncio.sleep(1.5)
        r = await admin.post("/v1/weights/update", json={"path": new_weights})
        assert r.status_code == 200, r.text
        return r.json()["weight_version"]

    async def go():
        start = await _stats(base)
        limits = httpx.Limits(max_connections=NUM_REQUESTS + 10)
        async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as http, \
                httpx.AsyncClient(base_url=base, timeout=120, trust_env=False) as admin:
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", http_client=http, max_retries=0)
            results = await asyncio.gather(update_midway(admin), *(one(client, i) for i in range(NUM_REQUESTS)))
        # every request gone from the engine, KV blocks back
        deadline = time.monotonic() + 30
        while True:
            st = await async_llm.engine_stats()
            if not st["has_unfinished"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        return start, results[0], results[1:], st

    start, new_version, results, end = asyncio.run(asyncio.wait_for(go(), DEADLINE_S))
    done = [r for r in results if r[0] != "dropped"]
    dropped = len(results) - len(done)
    assert dropped > 10 and len(done) > NUM_REQUESTS // 2
    seen_versions = set()
    for kind, i, max_tokens, ids, versions, usage in done:
        assert len(ids) == max_tokens, (kind, i)
        assert usage.completion_tokens == max_tokens
        assert versions and versions <= {0, new_version}, (i, versions)
        seen_versions |= versions
    assert seen_versions == {0, new_version}          # the update landed while requests ran
    assert end["has_unfinished"] is False and end["num_unfinished"] == 0
    assert end["num_free_blocks"] == start["vllm:kv_cache_free_blocks"]


def test_engine_death_is_503_and_unhealthy(server):
    base, async_llm = server
    proc = async_llm.client.process
    assert httpx.get(base + "/health", trust_env=False).status_code == 200
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while httpx.get(base + "/health", trust_env=False).status_code == 200:
        assert time.monotonic() < deadline, "/health still 200 after the engine died"
        time.sleep(0.1)
    assert httpx.get(base + "/health", trust_env=False).status_code == 503
    r = httpx.post(base + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, trust_env=False)
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
