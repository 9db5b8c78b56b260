"""upstream vLLM's request fields that eval and RL tools send, through the app on the embedded
model (in-process, httpx's ASGI transport): stream_options.continuous_usage_stats, chat echo,
truncation_side, request_id, include_reasoning, reasoning_effort and documents."""
from __future__ import annotations

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}]
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture(scope="module")
def app():
    from vllm import LLM
    from vllm.entrypoints.openai.api_server import build_app_from_llm
    app = build_app_from_llm(LLM(device="cpu"))
    yield app
    app.state.serving.llm.shutdown()


def _post(app, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            return await c.post(path, json=body, headers=headers)
    return asyncio.run(go())


def _events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    data = [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]", r.text[-300:]
    return [json.loads(d) for d in data[:-1]]


def _error(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"]


# ---- stream_options.continuous_usage_stats --------------------------------------------------

def test_completion_stream_carries_usage_on_every_chunk(app):
    body = {"prompt": ["Hello there", "The quick brown fox"], "n": 2, "max_tokens": 5, "temperature": 0.8,
            "seed": 1, "ignore_eos": True}
    full = _post(app, "/v1/completions", body).json()
    prompt_len = {c["index"]: len(c["prompt_token_ids"]) for c in full["choices"]}
    events = _events(_post(app, "/v1/completions", {**body, "stream": True, "stream_options": CONTINUOUS}))
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] == full["usage"]
    sent: dict[int, int] = {}
    for chunk in chunks:
        # one choice per chunk, so the chunk's usage is that choice's: its prompt, its tokens so far
        (choice,) = chunk["choices"]
        j = choice["index"]
        sent[j] = sent.get(j, 0) + len(choice["token_ids"])
        assert chunk["usage"] == {"prompt_tokens": prompt_len[j], "completion_tokens": sent[j],
                                  "total_tokens": prompt_len[j] + sent[j]}
    assert sent == {c["index"]: len(c["token_ids"]) for c in full["choices"]} == {0: 5, 1: 5, 2: 5, 3: 5}
    # include_usage alone: the usage arrives once, at the end
    plain = _events(_post(app, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}))
    assert all(e.get("usage") is None for e in plain[:-1]) and plain[-1]["usage"] == full["usage"]
    assert all("usage" in e for e in plain)   # null on every chunk but the last, as the spec and chat


def test_completion_scoring_stream_reports_no_completion_tokens(app):
    body = {"prompt": "the quick brown fox", "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True,
            "stream_options": CONTINUOUS}
    *chunks, last = _events(_post(app, "/v1/completions", body))
    assert len(chunks) == 2 and chunks[0]["choices"][0]["text"] == "the quick brown fox"
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 0] and last["usage"]["completion_tokens"] == 0
    assert chunks[0]["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] > 0


def test_chat_stream_carries_usage_on_every_chunk(app):
    body = {"messages": MESSAGES, "n": 2, "max_tokens": 6, "temperature": 0.8, "seed": 2, "ignore_eos": True}
    full = _post(app, "/v1/chat/completions", body).json()
    n_prompt = full["usage"]["prompt_tokens"]
    first, *chunks, last = _events(_post(app, "/v1/chat/completions",
                                         {**body, "stream": True, "stream_options": CONTINUOUS}))
    assert first["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt}
    assert last["choices"] == [] and last["usage"] == full["usage"]
    sent = {0: 0, 1: 0}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        sent[choice["index"]] += len(choice["token_ids"])
        assert chunk["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": sent[choice["index"]],
                                  "total_tokens": n_prompt + sent[choice["index"]]}
    assert sent == {c["index"]: len(c["token_ids"]) for c in full["choices"]} == {0: 6, 1: 6}
    plain = _events(_post(app, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}))
    assert all(e["usage"] is None for e in plain[:-1]) and plain[-1]["usage"] == full["usage"]


def test_continuous_usage_needs_include_usage(app):
    """As upstream: continuous_usage_stats alone sends no usage, on any chunk."""
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        events = _events(_post(app, path, {**body, "max_tokens": 2, "stream": True,
                                           "stream_options": {"continuous_usage_stats": True}}))
        assert events and all(e.get("usage") is None for e in events)
        r = _post(app, path, {**body, "max_tokens": 2, "stream_options": CONTINUOUS})
        assert "only allowed when stream is true" in _error(r)


# ---- chat echo ------------------------------------------------------------------------------

PREFILL = "The answer is"
CONTINUED = MESSAGES + [{"role": "assistant", "content": PREFILL}]
GREEDY = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}


def test_chat_echo_opens_the_continued_message(app):
    body = {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True, **GREEDY}
    plain = _post(app, "/v1/chat/completions", body).json()
    echoed = _post(app, "/v1/chat/completions", {**body, "echo": True}).json()
    (p,), (e,) = plain["choices"], echoed["choices"]
    assert e["message"]["role"] == "assistant" and e["message"]["content"] == PREFILL + p["message"]["content"]
    assert e["token_ids"] == p["token_ids"] and echoed["usage"] == plain["usage"]   # nothing more generated
    # streamed: the role, then the echoed text, then the generated text; a chunk per choice
    role0, role1, echo0, echo1, *rest = _events(_post(app, "/v1/chat/completions", {**body, "echo": True, "n": 2,
                                                                                    "stream": True}))
    assert [(c["index"], c["delta"]) for e in (role0, role1) for c in e["choices"]] == \
        [(0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""})]
    assert [(c["index"], c["delta"], c["token_ids"]) for e in (echo0, echo1) for c in e["choices"]] == \
        [(0, {"content": PREFILL}, []), (1, {"content": PREFILL}, [])]
    for j in (0, 1):
        text = PREFILL + "".join(c["delta"].get("content", "") for e in rest for c in e["choices"] if c["index"] == j)
        assert text == e["message"]["content"]


def test_chat_echo_needs_the_same_role(app):
    # the generation prompt opens an assistant turn: a user message last is not echoed
    body = {"messages": MESSAGES, **GREEDY}
    plain = _post(app, "/v1/chat/completions", body).json()["choices"][0]["message"]
    echoed = _post(app, "/v1/chat/completions", {**body, "echo": True}).json()["choices"][0]["message"]
    assert echoed == plain and echoed["role"] == "assistant"
    events = _events(_post(app, "/v1/chat/completions", {**body, "echo": True, "stream": True}))
    assert "".join(c["delta"].get("content", "") for e in events for c in e["choices"]) == plain["content"]
    # without a generation prompt the response goes on with the last message, in its role
    body = {"messages": MESSAGES, "add_generation_prompt": False, "echo": True, **GREEDY}
    msg = _post(app, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert msg["role"] == "user" and msg["content"].startswith(MESSAGES[-1]["content"])
    first, echo_chunk, *_ = _events(_post(app, "/v1/chat/completions", {**body, "stream": True}))
    assert first["choices"][0]["delta"]["role"] == "user"
    assert echo_chunk["choices"][0]["delta"] == {"content": MESSAGES[-1]["content"]}


def test_chat_echo_with_continuous_usage(app):
    body = {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True, "echo": True,
            "stream": True, "stream_options": CONTINUOUS, **GREEDY}
    first, echo_chunk, *_ = _events(_post(app, "/v1/chat/completions", body))
    assert echo_chunk["usage"]["completion_tokens"] == 0 == first["usage"]["completion_tokens"]


# ---- more of upstream's fields ----------------------------------------------------------------

def test_truncation_side():
    from vllm.entrypoints.openai.protocol import CompletionRequest
    right = CompletionRequest(prompt="x", truncate_prompt_tokens=3, truncation_side="right")
    assert right.truncate_prompt([1, 2, 3, 4, 5], 100) == [1, 2, 3]
    assert CompletionRequest(prompt="x", truncate_prompt_tokens=3, truncation_side="left"
                             ).truncate_prompt([1, 2, 3, 4, 5], 100) == [3, 4, 5]
    assert CompletionRequest(prompt="x", truncate_prompt_tokens=-1, truncation_side="right"
                             ).truncate_prompt(list(range(10)), 4) == [0, 1, 2]


def test_truncate_prompt_tokens_keeps_a_text_prompts_bos(tiny_qwen3_bos):
    """A text prompt is cut as upstream's tokenizer cuts it (truncation=True, max_length=k):
    the BOS stays, on either truncation_side, through the app and through AsyncLLM's own
    SamplingParams.truncate_prompt_tokens."""
    from vllm import LLM, SamplingParams
    from vllm.entrypoints.openai.api_server import build_app_from_llm
    app = build_app_from_llm(LLM(tiny_qwen3_bos, device="cpu"))
    async_llm = app.state.serving.llm
    try:
        text = "a b c d e f g h"
        full = async_llm.tokenizer.encode(text)
        body = {"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 4}
        left = _post(app, "/v1/completions", body).json()["choices"][0]["prompt_token_ids"]
        right = _post(app, "/v1/completions", {**body, "truncation_side": "right"}).json()["choices"][0]
        assert left == [full[0]] + full[-3:] and right["prompt_token_ids"] == full[:4]

        async def direct():
            sp = SamplingParams(max_tokens=1, truncate_prompt_tokens=4)
            return [out async for out in async_llm.generate(text, sp, "direct")][-1]
        assert asyncio.run(direct()).prompt_token_ids == left
    finally:
        async_llm.shutdown()


def test_truncation_side_through_the_app(app):
    body = {"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 1, "truncate_prompt_tokens": 3}
    left = _post(app, "/v1/completions", body).json()["choices"][0]
    right = _post(app, "/v1/completions", {**body, "truncation_side": "right"}).json()["choices"][0]
    assert (left["prompt_token_ids"], right["prompt_token_ids"]) == ([8, 9, 10], [5, 6, 7])
    assert "truncation_side" in _error(_post(app, "/v1/completions", {**body, "truncation_side": "middle"}))


def test_request_id_names_the_response(app):
    r = _post(app, "/v1/completions", {"prompt": "x", "max_tokens": 1, "request_id": "eval-7"}).json()
    assert r["id"] == "cmpl-eval-7"
    events = _events(_post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "stream": True,
                                                         "request_id": "rollout-3"}))
    assert {e["id"] for e in events} == {"chatcmpl-rollout-3"}
    # the X-Request-Id header wins, as upstream
    r = _post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "request_id": "body"},
              headers={"X-Request-Id": "hdr-1"}).json()
    assert r["id"] == "chatcmpl-hdr-1"
    assert "request_id" in _error(_post(app, "/v1/completions", {"prompt": "x", "request_id": ""}))


def test_concurrent_requests_may_share_an_id(app):
    """A proxy passing one trace id to a fan-out: every request runs and answers under the
    id, as upstream's server takes them (not a 400 for the second)."""
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "t-1"})
                                          for _ in range(3)))
    rs = asyncio.run(go())
    assert [r.status_code for r in rs] == [200] * 3, [r.text for r in rs]
    assert {r.json()["id"] for r in rs} == {"chatcmpl-t-1"}
    assert len({tuple(r.json()["choices"][0]["token_ids"]) for r in rs}) == 1


def test_include_reasoning_false_leaves_the_reasoning_out(app, monkeypatch):
    # the embedded model never closes a <think>: under deepseek_r1 all of its output is reasoning
    monkeypatch.setattr(app.state.serving, "reasoning_parser", "deepseek_r1")
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert _post(app, "/v1/chat/completions", body).json()["choices"][0]["message"]["reasoning"]
    choice = _post(app, "/v1/chat/completions", {**body, "include_reasoning": False}).json()["choices"][0]
    assert "reasoning" not in choice["message"] and "reasoning_content" not in choice["message"]
    assert choice["message"]["content"] is None and len(choice["token_ids"]) == 4
    events = _events(_post(app, "/v1/chat/completions", {**body, "include_reasoning": False, "stream": True}))
    assert not any("reasoning" in c["delta"] for e in events for c in e["choices"])
    assert sum(len(c["token_ids"]) for e in events for c in e["choices"]) == 4


def test_reasoning_effort_and_documents_reach_the_template(app, monkeypatch):
    serving = app.state.serving
    monkeypatch.setattr(serving, "chat_template", "{{ reasoning_effort }}|{{ enable_thinking }}|"
                        "{% for d in documents or [] %}{{ d.title }};{% endfor %}|{{ messages[-1].content }}")

    def rendered(**fields) -> str:
        r = _post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, **fields})
        assert r.status_code == 200, r.text
        return serving.llm.tokenizer.decode(r.json()["prompt_token_ids"])
    docs = [{"title": "A", "text": "a"}, {"title": "B", "text": "b"}]
    assert rendered(reasoning_effort="high", documents=docs) == "high|True|A;B;|Name a prime number."
    assert rendered(reasoning_effort="none").startswith("none|False|")
    assert rendered(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}).startswith("none|True|")
    assert rendered().startswith("||")
    assert "reasoning_effort" in _error(_post(app, "/v1/chat/completions", {"messages": MESSAGES,
                                                                            "reasoning_effort": "ultra"}))


# ---- vllm serve --logprobs-mode -------------------------------------------------------------

def test_the_engine_logprobs_mode_is_the_default_of_served_requests():
    """LLM(logprobs_mode=...) (vllm serve --logprobs-mode): a request without logprobs_mode
    reports the engine's mode; one that sets it gets its own."""
    from vllm import LLM
    from vllm.entrypoints.openai.api_server import build_app_from_llm
    raw_app = build_app_from_llm(LLM(device="cpu", logprobs_mode="raw_logprobs"))
    try:
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0.5, "seed": 2, "logprobs": 0,
                "ignore_eos": True}

        def served(**mode):
            (choice,) = _post(raw_app, "/v1/completions", {**body, **mode}).json()["choices"]
            return choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]
        unset = served()
        assert unset == served(logprobs_mode="raw_logprobs")
        tempered = served(logprobs_mode="tempered_logprobs")
        assert tempered[0] == unset[0] and tempered[1] != unset[1]
    finally:
        raw_app.state.serving.llm.shutdown()


def test_trl_generate_fields_of_every_trl_version():
    """TRL's /generate/ and /chat/ bodies: `guided_decoding_regex` (its earlier name of
    structured_outputs_regex) constrains like the new name, `truncate_prompt_tokens` cuts the
    prompt, both regex names at once are refused."""
    from vllm.entrypoints.openai.protocol import TrlGenerateRequest

    old = TrlGenerateRequest(prompts=["x"], guided_decoding_regex="(yes|no)", truncate_prompt_tokens=3)
    params = old.to_sampling_params(20)
    assert params.structured_outputs.regex == "(yes|no)" and params.truncate_prompt_tokens == 3
    new = TrlGenerateRequest(prompts=["x"], structured_outputs_regex="a+").to_sampling_params(20)
    assert new.structured_outputs.regex == "a+" and new.truncate_prompt_tokens is None
    both = TrlGenerateRequest(prompts=["x"], structured_outputs_regex="a", guided_decoding_regex="b")
    with pytest.raises(ValueError, match="earlier name"):
        both.to_sampling_params(20)
    kw = TrlGenerateRequest(prompts=["x"], truncate_prompt_tokens=3, generation_kwargs={"truncate_prompt_tokens": 5})
    assert kw.to_sampling_params(20).truncate_prompt_tokens == 5   # generation_kwargs override the fields
    assert TrlGenerateRequest(prompts=["x"], foo=1).ignored_fields() == ["foo"]


def test_an_llm_served_by_an_app_refuses_its_own_entry_points():
    """Once build_app_from_llm owns the engine, LLM.generate would race its loop for the
    outputs (a bare KeyError before): a ValueError saying why."""
    from vllm import LLM, SamplingParams
    from vllm.entrypoints.openai.api_server import build_app_from_llm
    llm = LLM(device="cpu")
    app = build_app_from_llm(llm)
    try:
        with pytest.raises(ValueError, match="driven by the app"):
            llm.generate(["hi"], SamplingParams(max_tokens=1), use_tqdm=False)
        with pytest.raises(ValueError, match="driven by the app"):
            llm.update_weights({})
        with pytest.raises(ValueError, match="driven by the app"):
            llm.weight_update()
        with pytest.raises(ValueError, match="driven by the app"):
            llm.collective_rpc(lambda worker: 1)
        with pytest.raises(ValueError, match="driven by the app"):
            llm.policy()
    finally:
        app.state.serving.llm.shutdown()


def test_malformed_bodies_and_impossible_requests_are_400s():
    """A malformed /abort_requests body is refused instead of aborting every request; text
    with an unpaired surrogate is a 400, not the tokenizer's 500; deeply nested JSON on a
    raw-body route is a 400; a request larger than running + queued can ever hold is a 400,
    not a 429 to retry forever; TRL's routes cap prompts x n like /v1/completions."""
    from vllm import LLM, SamplingParams
    from vllm.entrypoints.openai.api_server import build_app_from_llm
    app = build_app_from_llm(LLM(device="cpu"), max_queued_requests=4)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            cases = [("/v1/completions", '{"model":"default","prompt":"a\\ud800b","max_tokens":1}', "valid Unicode"),
                     ("/tokenize", '{"prompt":"a\\ud800"}', "valid Unicode"),
                     ("/v1/completions", '{"model":"default","prompt":"hi","max_tokens":1,"n":300}', "queues at most"),
                     ("/abort_requests", '{"request_ids": ""}', "list of request id strings"),
                     ("/abort_requests", '{"request_ids": false}', "list of request id strings"),
                     ("/abort_requests", '{"request_id": ["x"]}', "unknown fields"),
                     ("/abort_requests", "[" * 100000, "not valid JSON"),
                     ("/generate/", '{"prompts": ["a", "b"], "n": 1000, "max_tokens": 1}', "prompts x n"),
                     ("/generate/", '{"prompts": ["a"], "generation_kwargs": {"skip_special_tokens": "x"}}',
                      "true or false")]
            for path, body, message in cases:
                r = await c.post(path, content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400 and message in r.json()["error"]["message"], (path, body, r.text)
    try:
        asyncio.run(go())
    finally:
        app.state.serving.llm.shutdown()
    with pytest.raises(ValueError, match="true or false"):
        SamplingParams(ignore_eos="yes")


def test_text_prompts_are_tokenized_off_the_event_loop():
    """A multi-megabyte prompt takes seconds to tokenize: on the event loop it stalled every
    stream and /health meanwhile. Text prompts go through the prompt thread's own tokenizer."""
    import threading
    from vllm import LLM
    from vllm.entrypoints.openai.api_server import build_app_from_llm
    app = build_app_from_llm(LLM(device="cpu"))
    llm = app.state.serving.llm
    seen = []

    class Recording:
        def __init__(self, tok):
            self.tok = tok

        def encode(self, *args, **kwargs):
            seen.append(threading.current_thread().name)
            return self.tok.encode(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.tok, name)
    llm._prep_tokenizer = Recording(llm._prep_tokenizer)
    try:
        r = _post(app, "/v1/completions", {"model": "default", "prompt": "Hello there", "max_tokens": 1})
        assert r.status_code == 200
    finally:
        llm.shutdown()
    assert seen and all(name.startswith("prompt-prep") for name in seen)
