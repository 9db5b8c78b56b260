"""The server's RL and operator surface, in-process on a tiny model (engine-core loop on a
thread), driven by the official `openai` client where it covers the endpoint:
weight updates from a checkpoint (equal to a fresh engine loaded from it; a bad one
changes nothing), pause/resume, weight versions in responses, penalties, token ids,
/metrics, /tokenize, /detokenize, /version, API and admin keys, a full queue (429).
"""
from __future__ import annotations

import asyncio

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from vllm import LLM, SamplingParams
from vllm.entrypoints.openai.api_server import build_app_from_llm

API_KEY, ADMIN_KEY = "sk-test", "admin-test"
PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def app(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu", max_num_seqs=4)
    app = build_app_from_llm(llm, ["tiny"], max_queued_requests=2, api_key=API_KEY, admin_key=ADMIN_KEY)
    yield app
    app.state.serving.llm.shutdown()


def _http(app, key=API_KEY) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver", timeout=60,
                             headers=headers)


def _openai(http: httpx.AsyncClient) -> "openai.AsyncOpenAI":
    return openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=API_KEY, http_client=http, max_retries=0)


def _run(coro):
    return asyncio.run(coro)


def _greedy(client, **kw):
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True, **kw})


def test_weight_update_from_path_equals_fresh_engine(app, new_weights, tiny_qwen3, tmp_path):
    ref_new = LLM(new_weights, device="cpu").generate({"prompt_token_ids": PROMPT},
                                                      SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                                      use_tqdm=False)[0].outputs[0].token_ids

    async def go():
        async with _http(app) as http:
            client = _openai(http)
            before = await _greedy(client)
            v0 = (await http.get("/v1/weights/version")).json()["weight_version"]
            # without the admin key: refused, nothing changes
            denied = await http.post("/v1/weights/update", json={"path": new_weights})
            async with _http(app, ADMIN_KEY) as admin:
                bad = await admin.post("/v1/weights/update", json={"path": str(tmp_path)})   # no weights there
                after_bad = await _greedy(client)
                ok = await admin.post("/v1/weights/update", json={"path": new_weights})
            after = await _greedy(client)
            v1 = (await http.get("/v1/weights/version")).json()["weight_version"]
            return before, v0, denied, bad, after_bad, ok, after, v1
    before, v0, denied, bad, after_bad, ok, after, v1 = _run(go())
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    assert bad.status_code == 400 and "safetensors" in bad.json()["error"]["message"]
    assert after_bad.choices[0].token_ids == before.choices[0].token_ids        # the old weights still serve
    assert ok.status_code == 200, ok.text
    assert ok.json()["weight_version"] == v1 == v0 + 1
    assert after.choices[0].token_ids == ref_new                                 # == a fresh engine on the checkpoint
    assert before.weight_version == v0 and after.weight_version == v1
    assert after.choices[0].weight_versions == [v1]


def test_weight_update_stages_while_serving(tiny_qwen3, new_weights, tmp_path):
    """The checkpoint is staged while requests run (a hook holds the staging thread until a
    whole completion has been served); a second update meanwhile is a 400; a non-finite
    checkpoint is a 400 with the old weights serving; the answer times stage and pause."""
    import os
    import threading

    from safetensors.torch import load_file, save_file

    llm = LLM(tiny_qwen3, device="cpu", max_num_seqs=4)
    own = build_app_from_llm(llm, ["tiny"], admin_key=ADMIN_KEY)
    entered, gate = threading.Event(), threading.Event()

    def hold(staging, name):
        entered.set()
        while not gate.wait(0.01) and not staging.cancelled:
            pass
    own.state.serving.llm.client.core.staging_hook = hold
    tensors = load_file(os.path.join(new_weights, "model.safetensors"))
    tensors["model.norm.weight"][0] = float("inf")
    os.makedirs(tmp_path / "inf")
    save_file(tensors, str(tmp_path / "inf" / "model.safetensors"))

    async def go():
        async with _http(own, None) as http, _http(own, ADMIN_KEY) as admin:
            client = _openai(http)
            before = await _greedy(client)
            update = asyncio.ensure_future(admin.post("/v1/weights/update", json={"path": new_weights}))
            assert await asyncio.to_thread(entered.wait, 60)
            during = await asyncio.wait_for(_greedy(client), 60)      # served while the update stages
            second = await admin.post("/v1/weights/update", json={"path": new_weights})
            staging_done = update.done()
            gate.set()
            ok = await asyncio.wait_for(update, 60)
            after = await _greedy(client)
            bad = await admin.post("/v1/weights/update", json={"path": str(tmp_path / "inf")})
            after_bad = await _greedy(client)
            return before, during, second, staging_done, ok, after, bad, after_bad
    try:
        before, during, second, staging_done, ok, after, bad, after_bad = _run(go())
    finally:
        gate.set()
        own.state.serving.llm.shutdown()
    assert during.choices[0].token_ids == before.choices[0].token_ids and during.weight_version == 0
    assert not staging_done
    assert second.status_code == 400 and "already being staged" in second.json()["error"]["message"]
    assert ok.status_code == 200, ok.text
    body = ok.json()
    assert body["weight_version"] == 1 and body["staging"] == "host"
    assert body["stage_s"] > 0 and 0 <= body["copy_s"] <= body["pause_s"]
    assert after.weight_version == 1 and after.choices[0].token_ids != before.choices[0].token_ids
    assert bad.status_code == 400 and "non-finite" in bad.json()["error"]["message"]
    assert after_bad.choices[0].token_ids == after.choices[0].token_ids and after_bad.weight_version == 1


def test_pause_holds_requests_until_resume(app):
    async def go():
        async with _http(app) as http, _http(app, ADMIN_KEY) as admin:
            client = _openai(http)
            assert (await admin.post("/v1/pause")).json()["paused"] is True
            task = asyncio.ensure_future(_greedy(client))
            await asyncio.sleep(0.5)
            waiting = not task.done()
            stats = await app.state.serving.llm.engine_stats()
            assert (await admin.post("/v1/resume")).json()["paused"] is False
            return waiting, stats, await asyncio.wait_for(task, 60)
    waiting, stats, res = _run(go())
    assert waiting and stats["paused"] and stats["num_unfinished"] == 1
    assert len(res.choices[0].token_ids) == 6


def test_group_endpoints_refuse_bad_bodies_with_400(app):
    """Malformed bodies are 400s naming the problem (the working transport:
    tests/test_weight_sync_transports.py)."""
    async def go():
        async with _http(app, ADMIN_KEY) as admin:
            return (await admin.post("/v1/weights/init_group", json={"master_address": "127.0.0.1"}),
                    await admin.post("/v1/weights/update_from_group", json={}),
                    await admin.post("/v1/weights/update_from_ipc", json={"buckets": "x"}))
    init, update, ipc = _run(go())
    assert init.status_code == 400 and "invalid request body" in init.json()["error"]["message"]
    assert update.status_code == 400 and "init_group" in update.json()["error"]["message"]
    assert ipc.status_code == 400 and "buckets" in ipc.json()["error"]["message"]


def test_penalties_and_token_ids_match_offline(app, tiny_qwen3, new_weights):
    pen = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)

    async def go():
        async with _http(app) as http:
            client = _openai(http)
            r = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                                frequency_penalty=1.5, presence_penalty=0.5,
                                                extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
            plain = await _greedy(client)
            no_ids = (await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2,
                                                               "return_token_ids": False})).json()
            return r, plain, no_ids
    r, plain, no_ids = _run(go())
    # the offline reference runs the weights the server holds (another test updates them once)
    ckpt = {0: tiny_qwen3, 1: new_weights}[r.weight_version]
    ref = LLM(ckpt, device="cpu").generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0, **pen),
        use_tqdm=False)[0].outputs[0]
    assert r.choices[0].token_ids == ref.token_ids
    assert r.choices[0].logprobs.token_logprobs == [d[t].logprob for d, t in zip(ref.logprobs, ref.token_ids)]
    assert r.choices[0].token_ids != plain.choices[0].token_ids
    assert no_ids["choices"][0]["token_ids"] is None and no_ids["choices"][0]["prompt_token_ids"] is None


def test_chat_with_openai_client_streaming(app):
    async def go():
        async with _http(app) as http:
            client = _openai(http)
            full = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
            stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=5, temperature=0, stream=True,
                                                          extra_body={"ignore_eos": True})
            chunks = [c async for c in stream]
            return full, chunks
    full, chunks = _run(go())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert sum((c.choices[0].token_ids or [] for c in chunks if c.choices), []) == full.choices[0].token_ids
    assert full.weight_version is not None and chunks[-1].choices[0].weight_versions


def test_full_queue_is_429(app):
    """4 running + 2 queued: two requests of 6 samples at once, the second finds the queue
    full (429, retry); one of 8 could never fit (400, not a 429 to retry forever)."""
    async def go():
        async with _http(app) as http:
            body = {"prompt": PROMPT, "n": 6, "max_tokens": 32, "ignore_eos": True}
            both = await asyncio.gather(http.post("/v1/completions", json=body),
                                        http.post("/v1/completions", json=body))
            return both, await http.post("/v1/completions", json={"prompt": PROMPT, "n": 8, "max_tokens": 2})
    both, never = _run(go())
    full = [r for r in both if r.status_code != 200]
    assert sorted(r.status_code for r in both) == [200, 429]
    assert full[0].json()["error"]["type"] == "rate_limit_error" and full[0].headers["retry-after"] == "1"
    assert never.status_code == 400 and "queues at most 2" in never.json()["error"]["message"]


def test_keys_tokenize_detokenize_version_metrics(app):
    async def go():
        async with _http(app, key=None) as anon, _http(app) as http:
            return (await anon.get("/v1/models"), await anon.get("/health"), await http.get("/v1/models"),
                    await http.post("/tokenize", json={"prompt": "Hello world"}),
                    await http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}),
                    await http.post("/detokenize", json={"tokens": [5, 6, 7]}),
                    await http.post("/detokenize", json={"tokens": [10 ** 6]}),
                    await http.get("/version"), await http.get("/metrics"), await http.get("/load"))
    (anon_models, anon_health, models, tok, tok_chat, detok, bad_detok, version, metrics, load) = _run(go())
    assert load.status_code == 200 and load.json() == {"server_load": 0}   # idle
    assert anon_models.status_code == 401 and anon_health.status_code == 200 and models.status_code == 200
    tokenizer = app.state.serving.llm.tokenizer
    assert tok.json()["tokens"] == tokenizer.encode("Hello world") and tok.json()["count"] == len(tok.json()["tokens"])
    assert tok_chat.json()["count"] > 0
    assert detok.json()["prompt"] == tokenizer.decode([5, 6, 7])
    assert bad_detok.status_code == 400
    assert version.json()["version"]
    text = metrics.text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:weight_version", "vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_sum", "vllm:e2e_request_latency_seconds_count",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:gpu_cache_usage_perc",
                 "vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total", "vllm:cache_config_info{",
                 "vllm:time_per_output_token_seconds_bucket", "vllm:request_queue_time_seconds_count",
                 "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
                 "vllm:request_inference_time_seconds_count", "vllm:request_time_per_output_token_seconds_count"):
        assert name in text, name
    for reason in ("stop", "length", "abort"):     # every reason's series, at 0 until it occurs
        assert f'finished_reason="{reason}"' in text, reason
    card = models.json()["data"][0]
    assert card["owned_by"] == "vllm" and card["parent"] is None and card["permission"][0]["allow_sampling"]


def test_fast_decoder_equals_tokenizer_decode(tokenizer_dir):
    import random

    from vllm.tokenizer import fast_decoder, load_tokenizer
    tok = load_tokenizer(tokenizer_dir)
    dec = fast_decoder(tok)
    assert dec is not tok.decode  # the fast path is taken for this tokenizer
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert dec(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.gpu
def test_gpu_engine_process_logprob_bits_equal_offline(gpu_model):
    """On the GPU: the engine core process (invariant numerics, async scheduling, CUDA
    graphs) serves 32 concurrent requests whose token ids and logprob bits equal the
    offline engine's, penalties included."""
    from vllm.entrypoints.openai.api_server import _serving, build_app
    from vllm.entrypoints.openai.async_engine import AsyncLLM

    kw = dict(model=gpu_model, device="cuda", numerics="invariant", seed=0, gpu_memory_utilization=0.3)
    prompts = [[5 + i, 6 + i, 7 + i, 8 + i] * (1 + i % 5) for i in range(32)]
    bodies = [dict(prompt=p, max_tokens=16, temperature=1.0, seed=i, logprobs=1, ignore_eos=True,
                   **({"frequency_penalty": 0.5} if i % 3 == 0 else {})) for i, p in enumerate(prompts)]
    llm = LLM(**kw)
    refs = [llm.generate({"prompt_token_ids": b["prompt"]},
                         SamplingParams(max_tokens=16, temperature=1.0, seed=b["seed"], logprobs=1, ignore_eos=True,
                                        frequency_penalty=b.get("frequency_penalty", 0.0)), use_tqdm=False)[0].outputs[0]
            for b in bodies]
    del llm
    import torch
    torch.cuda.empty_cache()
    async_llm = AsyncLLM.from_engine_args(kw, startup_timeout=600)
    app = build_app(_serving(async_llm, ["gpu"], "vllm", max_logprobs=20), shutdown_engine_on_exit=False)
    try:
        async def go():
            async with _http(app, key=None) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))
        rs = _run(go())
    finally:
        async_llm.shutdown()
    for r, ref in zip(rs, refs):
        c = r.json()["choices"][0]
        assert c["token_ids"] == ref.token_ids
        assert c["logprobs"]["token_logprobs"] == [d[t].logprob for d, t in zip(ref.logprobs, ref.token_ids)]


def _long(http, max_tokens=900):
    return http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens,
                                              "temperature": 0, "ignore_eos": True})


async def _until_generating(app, before: int) -> None:
    """Until the server has received tokens beyond `before` (a request is mid-generation)."""
    llm = app.state.serving.llm
    for _ in range(600):
        if llm.num_generation_tokens > before:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no token was generated")


def test_upstream_pause_modes_abort_wait_keep(app):
    """upstream vLLM's /pause?mode=...: abort ends the request in flight with what it has
    (finish_reason "abort"), wait returns only once it finished and holds new requests
    until /resume, keep freezes it; /is_paused and /get_world_size answer; a bad mode is 400."""
    async def go():
        async with _http(app) as http, _http(app, ADMIN_KEY) as admin:
            res = {}
            # abort
            before = app.state.serving.llm.num_generation_tokens
            task = asyncio.ensure_future(_long(http))
            await _until_generating(app, before)
            r = await admin.post("/pause", params={"mode": "abort"})
            res["abort_pause"] = r.json()
            res["abort_paused"] = (await admin.get("/is_paused")).json()
            res["abort_out"] = (await asyncio.wait_for(task, 60)).json()
            await admin.post("/resume")
            # wait: the request in flight finishes first; one sent meanwhile waits for /resume.
            # The first is generating before the pause is sent, and the engine has taken the
            # pause (a utility call after it returned: the engine answers them in order) before
            # the late one is sent, whatever the machine's load.
            before = app.state.serving.llm.num_generation_tokens
            task = asyncio.ensure_future(_long(http, 40))
            await _until_generating(app, before)
            # upstream's older form of mode=wait
            pause = asyncio.ensure_future(admin.post("/pause", params={"wait_for_inflight_requests": "true",
                                                                      "clear_cache": "false"}))
            await asyncio.sleep(0.1)
            await admin.get("/is_paused")
            late = asyncio.ensure_future(_long(http, 5))
            res["wait_pause"] = (await asyncio.wait_for(pause, 60)).json()
            # every token of the first request was generated (and counted) before the answer;
            # its HTTP response may still be on its way to this client
            res["wait_tokens_before_pause"] = app.state.serving.llm.num_generation_tokens - before
            res["wait_out"] = (await asyncio.wait_for(task, 60)).json()
            await asyncio.sleep(0.3)
            res["late_waiting"] = not late.done()
            await admin.post("/resume")
            res["late_out"] = (await asyncio.wait_for(late, 60)).json()
            res["bad"] = await admin.post("/pause", params={"mode": "freeze"})
            res["disagree"] = await admin.post("/pause", params={"mode": "abort", "wait_for_inflight_requests": "true"})
            res["world"] = (await admin.get("/get_world_size")).json()
            res["unauthorized"] = (await http.post("/pause", params={"mode": "keep"})).status_code
            res["paused_after"] = (await admin.get("/is_paused")).json()
            return res
    r = _run(go())
    assert r["abort_pause"]["paused"] is True and r["abort_paused"] == {"is_paused": True}
    choice = r["abort_out"]["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < r["abort_out"]["usage"]["completion_tokens"] < 900
    assert r["wait_pause"]["paused"] is True and r["wait_tokens_before_pause"] == 40
    assert r["wait_out"]["choices"][0]["finish_reason"] == "length" and r["wait_out"]["usage"]["completion_tokens"] == 40
    assert r["late_waiting"] and r["late_out"]["usage"]["completion_tokens"] == 5
    assert r["bad"].status_code == 400 and "pause mode" in r["bad"].json()["error"]["message"]
    assert r["disagree"].status_code == 400 and "disagree" in r["disagree"].json()["error"]["message"]
    assert r["world"] == {"world_size": 1} and r["unauthorized"] == 401
    assert r["paused_after"] == {"is_paused": False}


def test_abort_requests_without_pausing(app):
    async def go():
        async with _http(app) as http, _http(app, ADMIN_KEY) as admin:
            before = app.state.serving.llm.num_generation_tokens
            task = asyncio.ensure_future(_long(http))
            await _until_generating(app, before)
            aborted = (await admin.post("/abort_requests", json={})).json()
            out = (await asyncio.wait_for(task, 60)).json()
            paused = (await admin.get("/is_paused")).json()
            after = (await _long(http, 3)).json()
            bad = await admin.post("/abort_requests", json={"request_ids": "all"})
            return aborted, out, paused, after, bad
    aborted, out, paused, after, bad = _run(go())
    assert len(aborted["aborted"]) == 1 and out["choices"][0]["finish_reason"] == "abort"
    assert paused == {"is_paused": False} and after["usage"]["completion_tokens"] == 3
    assert bad.status_code == 400
