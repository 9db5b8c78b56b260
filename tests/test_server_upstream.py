"""What upstream vLLM's clients and launch scripts do that the OpenAI schema alone does not say:
`vllm serve` flags RL / eval launchers pass (verl, OpenRLHF, SkyRL, prime-rl), /ping and
/tokenizer_info, JSON null as a field's default, upstream's lax integers, max_completion_tokens
over max_tokens, and /tokenize rendering a conversation as chat completions does.

The app runs in-process on the embedded model (as tests/test_server.py drives it)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from vllm.entrypoints.cli import main as cli  # noqa: E402

MESSAGES = [{"role": "user", "content": "What is 47 + 58?"}]
GREEDY = {"temperature": 0, "ignore_eos": True}


def _serve_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser("serve")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


# ---- the command line ---------------------------------------------------------------------------

# what RL and eval launchers pass to upstream's `vllm serve`, at values that run here
LAUNCH_LINE = ["/ckpt", "--served-model-name", "policy", "--enable-tokenizer-info-endpoint", "--enable-sleep-mode",
               "--disable-log-stats", "--enable-log-requests", "--max-log-len", "200", "--disable-uvicorn-access-log",
               "--response-role", "assistant", "--allowed-origins", '["*"]', "--allowed-methods", '["GET", "POST"]',
               "--allowed-headers", '["*"]', "--allow-credentials", "--root-path", "/llm", "--disable-fastapi-docs",
               "--enable-request-id-headers",
               "--model-impl", "vllm", "--swap-space", "16", "--distributed-executor-backend", "mp",
               "--tokenizer-mode", "auto", "--data-parallel-size", "1", "-pp", "1", "--revision", "main",
               "--chat-template-content-format", "string", "--hf-overrides", "{}",
               "--override-generation-config", '{"temperature": 0.6, "max_new_tokens": 64}', "--api-server-count", "1",
               "-tp", "1", "--trust-remote-code", "--enable-auto-tool-choice", "--logprobs-mode", "processed_logprobs",
               "-O", "3", "--compilation-config", '{"cudagraph_capture_sizes": [1, 2]}', "--max-seq-len-to-capture",
               "8192", "--cuda-graph-sizes", "1", "2", "4", "--disable-cascade-attn", "--limit-mm-per-prompt",
               '{"image": 0}', "--disable-mm-preprocessor-cache", "-ep", "--task", "generate", "--runner", "auto",
               "--download-dir", "/tmp/models", "--disable-frontend-multiprocessing", "--disable-custom-all-reduce",
               "--enable-log-outputs", "--cpu-offload-gb", "0", "--guided-decoding-backend", "xgrammar",
               "--structured-outputs-config", '{"backend": "auto"}', "--speculative-config", "{}"]


@pytest.mark.parametrize("argv, needle", [(["--enable-lora"], "--enable-lora"),
                                          (["--cpu-offload-gb", "4"], "--cpu-offload-gb 4"),
                                          (["--guided-decoding-backend", "outlines"], "--guided-decoding-backend outlines"),
                                          (["--speculative-config", '{"method": "ngram"}'], "--speculative-config")])
def test_upstream_flags_at_values_not_honoured_are_refused_by_name(argv, needle):
    from vllm.entrypoints.cli.serve import check_upstream_flags
    with pytest.raises(ValueError, match=re.escape(needle) + ".*not supported here"):
        check_upstream_flags(_serve_parser().parse_args(argv))


def test_upstream_launch_flags_parse_and_reach_the_server(monkeypatch):
    """Every flag parses (upstream's spellings), and the ones with a meaning here reach the
    server (run_server's keywords) and the engine (enable_sleep_mode)."""
    from vllm.entrypoints.openai import api_server
    seen = {}

    def fake_run_server(engine_kwargs, **kwargs):
        seen.update(kwargs, engine_kwargs=engine_kwargs)
        return "stopped"
    monkeypatch.setattr(api_server, "run_server", fake_run_server)
    assert cli.main(["serve", *LAUNCH_LINE]) == 0
    assert seen["engine_kwargs"]["enable_sleep_mode"] is True
    assert seen["engine_kwargs"]["logprobs_mode"] == "processed_logprobs"
    assert seen["enable_tokenizer_info_endpoint"] and seen["disable_fastapi_docs"] and seen["enable_log_requests"]
    assert seen["enable_request_id_headers"]
    assert (seen["max_log_len"], seen["root_path"], seen["response_role"]) == (200, "/llm", "assistant")
    assert seen["access_log"] is False
    assert seen["cors"] == {"allow_origins": ["*"], "allow_methods": ["GET", "POST"], "allow_headers": ["*"],
                            "allow_credentials": True}
    assert seen["override_generation_config"] == {"temperature": 0.6, "max_new_tokens": 64}
    assert seen["chat_template_content_format"] == "string"
    assert seen["log_stats_interval"] is None       # --disable-log-stats
    assert cli.main(["serve", "/ckpt"]) == 0
    assert seen["log_stats_interval"] == 10.0       # upstream's period, on by default
    defaults = _serve_parser().parse_args([])
    assert defaults.response_role == "assistant" and not defaults.enable_tokenizer_info_endpoint
    assert defaults.allowed_origins is None and defaults.enable_sleep_mode is False


@pytest.mark.parametrize("argv, needle", [
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2: not supported here"),
    (["-dp", "4"], "--data-parallel-size 4: not supported here"),
    (["--tokenizer-mode", "slow"], "--tokenizer-mode slow: not supported here"),
    (["--model-impl", "transformers"], "--model-impl transformers: not supported here"),
    (["--revision", "v2"], "--revision v2: not supported here"),
    (["--hf-overrides", '{"rope_theta": 1}'], "--hf-overrides"),
    (["--api-server-count", "2"], "--api-server-count 2: not supported here"),
    (["--allow-credentials"], "CORS is off unless --allowed-origins"),
    (["--allowed-methods", '["GET"]'], "--allowed-methods"),
    (["--task", "embed"], "--task embed: not supported here"),
    (["--limit-mm-per-prompt", "[1]"], "--limit-mm-per-prompt"),
])
def test_upstream_flags_at_other_values_are_one_line_errors(argv, needle, capsys):
    rc = cli.main(["serve", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and needle in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_worker_extension_cls_is_refused_as_llm_refuses_it(capsys):
    from vllm.entrypoints.llm import refuse_worker_extension
    with pytest.raises(ValueError) as offline:
        refuse_worker_extension("my.Extension")
    assert cli.main(["serve", "--worker-extension-cls", "my.Extension"]) == 1
    assert capsys.readouterr().err.strip() == f"error: {offline.value}"


def test_json_flags_say_what_they_take(capsys):
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(["--allowed-origins", "*"])
    assert "--allowed-origins takes JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(["--override-generation-config", "[1]"])
    assert "takes a JSON object" in capsys.readouterr().err


def test_generation_defaults_with_overrides():
    """upstream's get_diff_sampling_param: the override over generation_config.json's values, under
    --generation-config vllm too; max_new_tokens is max_tokens; other keys set nothing."""
    from vllm.entrypoints.openai.api_server import generation_defaults
    model = {"temperature": 0.7, "top_p": 0.8}
    assert generation_defaults(model, "auto", {"temperature": 0.1, "max_new_tokens": 5, "do_sample": True}) == \
        {"temperature": 0.1, "top_p": 0.8, "max_tokens": 5}
    assert generation_defaults(model, "vllm", {"top_k": 20}) == {"top_k": 20}
    assert generation_defaults(model, "vllm") == {} and generation_defaults(model) == model


# ---- through the app ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def serving():
    from vllm import LLM
    from vllm.entrypoints.openai.api_server import build_app_from_llm
    app = build_app_from_llm(LLM(device="cpu"), enable_tokenizer_info_endpoint=True)
    yield app.state.serving
    app.state.serving.llm.shutdown()


def _app(serving, **options):
    """Another app over the same engine, with build_app's options."""
    from vllm.entrypoints.openai.api_server import build_app
    return build_app(serving, shutdown_engine_on_exit=False, **options)


def _call(app, method: str, path: str, body=None, headers=None):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            return await c.request(method, path, json=body, headers=headers)
    return asyncio.run(go())


@pytest.fixture(scope="module")
def app(serving):
    return _app(serving, enable_tokenizer_info_endpoint=True)


def test_ping_is_health(app):
    for method in ("GET", "POST"):
        r = _call(app, method, "/ping")
        assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text


def test_tokenizer_info_only_when_enabled(app, serving):
    assert _call(_app(serving), "GET", "/tokenizer_info").status_code == 404
    r = _call(app, "GET", "/tokenizer_info")
    assert r.status_code == 200, r.text
    info, tok = r.json(), serving.llm.tokenizer
    assert info["eos_token"] == tok.eos_token and info["pad_token"] == tok.pad_token
    assert "bos_token" in info and info["bos_token"] == tok.bos_token
    assert info["chat_template"] == tok.chat_template and info["tokenizer_class"] == type(tok).__name__
    assert info["model_max_length"] == tok.model_max_length
    assert "vocab_file" not in info and "merges_file" not in info
    # the server's --chat-template is the one reported: the one requests are rendered with
    serving.chat_template, saved = "{{ messages[0].content }}", serving.chat_template
    try:
        assert _call(app, "GET", "/tokenizer_info").json()["chat_template"] == "{{ messages[0].content }}"
    finally:
        serving.chat_template = saved


def test_null_is_the_default(app, serving):
    chat = _call(app, "POST", "/v1/chat/completions",
                 {"messages": MESSAGES, "max_tokens": 3, "n": None, "logprobs": None, "stream": None,
                  "top_logprobs": None, "temperature": None, "top_p": None, "stop": None, "seed": None,
                  "stream_options": None, "presence_penalty": None, "frequency_penalty": None,
                  "return_tokens_as_token_ids": None, "tools": None, "tool_choice": None, **GREEDY})
    assert chat.status_code == 200, chat.text
    choice = chat.json()["choices"]
    assert len(choice) == 1 and choice[0]["logprobs"] is None and chat.json()["usage"]["completion_tokens"] == 3
    context = serving.llm.max_model_len
    comp = _call(app, "POST", "/v1/completions", {"prompt": [5] * (context - 5), "max_tokens": None, "echo": None,
                                                  "stream": None, "n": None, "logprobs": None, **GREEDY})
    assert comp.status_code == 200, comp.text
    assert comp.json()["usage"]["completion_tokens"] == 5    # null max_tokens: until the context is full, as upstream
    absent = _call(app, "POST", "/v1/completions", {"prompt": "hi", **GREEDY})
    assert absent.json()["usage"]["completion_tokens"] == 16   # absent: OpenAI's default
    assert not comp.json()["choices"][0]["text"].startswith("hi")  # null echo: no echo
    streamed = _call(app, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True,
                                                      "stream_options": {"include_usage": None}, **GREEDY})
    events = [json.loads(e[len("data: "):]) for e in streamed.text.split("\n\n") if e.startswith("data: {")]
    assert streamed.status_code == 200 and events and not any(e.get("usage") for e in events)  # null: no usage
    # fields upstream does not make Optional still refuse null
    assert _call(app, "POST", "/v1/completions", {"prompt": "hi", "priority": None}).status_code == 400


def test_integers_as_upstream_reads_them(app):
    """upstream's plain int (pydantic's lax mode): 3.0, "3" and true are integers; 3.5 is not;
    logprobs / top_logprobs / prompt_logprobs refuse strings, as upstream; token ids stay strict."""
    ok = _call(app, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4.0, "n": "1", "seed": "7",
                                                "logprobs": 2.0, "top_k": "5", "min_tokens": True, "temperature": 1})
    assert ok.status_code == 200, ok.text
    choice = ok.json()["choices"][0]
    assert len(choice["token_ids"]) <= 4 and choice["logprobs"]["top_logprobs"]
    as_one = _call(app, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": True, **GREEDY})
    assert as_one.status_code == 200 and len(as_one.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 1
    chat = _call(app, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": "2",
                                                       "logprobs": True, "top_logprobs": 1.0, **GREEDY})
    assert chat.status_code == 200 and len(chat.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 1
    for path, body, param in [("/v1/completions", {"prompt": "hi", "n": 1.5}, "n"),
                              ("/v1/completions", {"prompt": "hi", "max_tokens": "four"}, "max_tokens"),
                              ("/v1/completions", {"prompt": "hi", "logprobs": "2"}, "logprobs"),
                              ("/v1/completions", {"prompt": "hi", "prompt_logprobs": "2"}, "prompt_logprobs"),
                              ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": "2"},
                               "top_logprobs"),
                              ("/v1/completions", {"prompt": "hi", "stop_token_ids": ["5"]}, "stop_token_ids"),
                              ("/v1/completions", {"prompt": [5.0, 6.0]}, "prompt")]:
        r = _call(app, "POST", path, body)
        assert r.status_code == 400 and (r.json()["error"]["param"] or "").startswith(param), (body, r.text)


def test_max_completion_tokens_wins_over_max_tokens(app):
    r = _call(app, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 7, "max_completion_tokens": 3,
                                                    **GREEDY})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    r = _call(app, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0, **GREEDY})
    assert r.status_code == 400 and "max_completion_tokens must be >= 1" in r.json()["error"]["message"]


TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
# a template that renders the tools, as tool-calling models' templates do
TOOL_TEMPLATE = ("{% if tools %}tools:{% for t in tools %}{{ t.function.name }}={{ t.function.parameters | tojson }};"
                 "{% endfor %}\n{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def test_tokenize_renders_a_conversation_as_chat_does(app, serving, monkeypatch):
    monkeypatch.setattr(serving, "chat_template", TOOL_TEMPLATE)
    chat = _call(app, "POST", "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 1, **GREEDY})
    assert chat.status_code == 200, chat.text
    tok = _call(app, "POST", "/tokenize", {"messages": MESSAGES, "tools": TOOLS})
    assert tok.status_code == 200, tok.text
    assert tok.json()["tokens"] == chat.json()["prompt_token_ids"]
    assert tok.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    without = _call(app, "POST", "/tokenize", {"messages": MESSAGES}).json()
    assert without["count"] < tok.json()["count"]
    # the other chat fields: the same prompt as chat's with them
    body = {"messages": [*MESSAGES, {"role": "assistant", "content": "1"}], "add_generation_prompt": False,
            "continue_final_message": True, "tools": TOOLS, "return_token_strs": True}
    chat = _call(app, "POST", "/v1/chat/completions", {**body, "max_tokens": 1, **GREEDY}).json()
    tok = _call(app, "POST", "/tokenize", body).json()
    assert tok["tokens"] == chat["prompt_token_ids"] and len(tok["token_strs"]) == tok["count"]
    # a prompt keeps upstream's default add_special_tokens=true; a bad tool is chat's 400
    bad = _call(app, "POST", "/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]})
    assert bad.status_code == 400 and "tools[0]" in bad.json()["error"]["message"]
    mm = _call(app, "POST", "/tokenize", {"messages": MESSAGES, "mm_processor_kwargs": {"fps": 2}})
    assert mm.status_code == 400 and "mm_processor_kwargs" in mm.json()["error"]["message"]


def test_response_role(app, serving, monkeypatch):
    monkeypatch.setattr(serving, "response_role", "bot")
    body = {"messages": MESSAGES, "max_tokens": 2, **GREEDY}
    assert _call(app, "POST", "/v1/chat/completions", body).json()["choices"][0]["message"]["role"] == "bot"
    first = _call(app, "POST", "/v1/chat/completions", {**body, "stream": True}).text.split("\n\n")[0]
    assert json.loads(first[len("data: "):])["choices"][0]["delta"]["role"] == "bot"
    # without the generation prompt the response goes on with the last message: its role
    cont = {"messages": [*MESSAGES, {"role": "assistant", "content": "1"}], "add_generation_prompt": False,
            "continue_final_message": True, "max_tokens": 1, **GREEDY}
    assert _call(app, "POST", "/v1/chat/completions", cont).json()["choices"][0]["message"]["role"] == "assistant"


def test_override_generation_config_sets_request_defaults(serving):
    from vllm.entrypoints.openai.api_server import _serving
    s = _serving(serving.llm, None, "vllm", {"max_new_tokens": 2, "temperature": 0.0})
    assert s.defaults == {"max_tokens": 2, "temperature": 0.0}
    r = _call(_app(s), "POST", "/v1/chat/completions", {"messages": MESSAGES, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_root_path_docs_and_keys(serving):
    """--root-path: routes answer with and without the prefix, and the prefixed path needs the key
    as the plain one does; --disable-fastapi-docs: no schema."""
    app = _app(serving, root_path="/llm", api_key="k")
    for path in ("/v1/models", "/llm/v1/models"):
        assert _call(app, "GET", path).status_code == 401, path
        assert _call(app, "GET", path, headers={"Authorization": "Bearer k"}).status_code == 200, path
    assert _call(app, "GET", "/llm/ping").status_code == 200
    assert _call(_app(serving), "GET", "/openapi.json").status_code == 200
    quiet = _app(serving, disable_fastapi_docs=True)
    assert all(_call(quiet, "GET", p).status_code == 404 for p in ("/openapi.json", "/docs", "/redoc"))


def test_request_id_headers_only_when_enabled(serving):
    """--enable-request-id-headers: every answer (a 401 and a stream included) carries
    X-Request-Id, the request's own or a new uuid4 hex; without it none does."""
    plain = _call(_app(serving), "GET", "/v1/models")
    assert "x-request-id" not in plain.headers
    app = _app(serving, enable_request_id_headers=True, api_key="k")
    given = _call(app, "GET", "/v1/models", headers={"Authorization": "Bearer k", "X-Request-Id": "abc-1"})
    assert given.status_code == 200 and given.headers["x-request-id"] == "abc-1"
    fresh = _call(app, "GET", "/v1/models")
    assert fresh.status_code == 401 and len(fresh.headers["x-request-id"]) == 32
    streamed = _call(app, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True},
                     headers={"Authorization": "Bearer k", "X-Request-Id": "s-2"})
    assert streamed.status_code == 200 and streamed.headers["x-request-id"] == "s-2"
    assert streamed.headers.get_list("x-request-id") == ["s-2"]


def test_a_non_ascii_key_matches_its_utf8_header(serving):
    """HTTP carries a header's bytes as the client sent them: a key with non-ASCII characters
    matches the UTF-8 bytes a client sends for it (and nothing else)."""
    app = _app(serving, api_key="clé-ключ")
    good = {"Authorization": "Bearer clé-ключ".encode()}
    assert _call(app, "GET", "/v1/models", headers=good).status_code == 200
    assert _call(app, "GET", "/v1/models", headers={"Authorization": "Bearer cl-x"}).status_code == 401
    assert _call(app, "GET", "/v1/models", headers={"Authorization": b"bearer  cl\xc3\xa9-\xd0\xba\xd0\xbb\xd1\x8e\xd1\x87"}
                 ).status_code == 200


def test_cors_only_with_allowed_origins(serving):
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type, authorization"}
    off = _call(_app(serving, api_key="k"), "OPTIONS", "/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in off.headers
    cors = dict(allow_origins=["http://ui.example"], allow_methods=["*"], allow_headers=["*"], allow_credentials=False)
    app = _app(serving, api_key="k", cors=cors)
    on = _call(app, "OPTIONS", "/v1/chat/completions", headers=preflight)
    assert on.status_code == 200 and on.headers["access-control-allow-origin"] == "http://ui.example"
    denied = _call(app, "GET", "/v1/models", headers={"Origin": "http://ui.example"})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "http://ui.example"
    other = _call(app, "OPTIONS", "/v1/models", headers={**preflight, "Origin": "http://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_enable_log_requests(serving, app, monkeypatch, caplog):
    monkeypatch.setattr(serving, "enable_log_requests", True)
    monkeypatch.setattr(serving, "max_log_len", 3)
    with caplog.at_level(logging.INFO, logger="vllm.entrypoints.openai.serving"):
        _call(app, "POST", "/v1/completions", {"prompt": "hello there", "max_tokens": 1, "request_id": "r1"})
    lines = [r.getMessage() for r in caplog.records if "received request" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("received request cmpl-r1-0: prompt 'hel', params ")


def test_stats_line_over_an_interval_and_silent_when_idle():
    from vllm.engine.core_messages import EngineStats
    from vllm.entrypoints.openai.stats_logger import StatsLogger

    class Counters:
        stats = EngineStats(0, 0, 0.0, 10, 0, 0, False)
        num_prompt_tokens = num_generation_tokens = 0
    llm, now = Counters(), [0.0]
    stats = StatsLogger(llm, 10.0, clock=lambda: now[0])
    now[0] = 10.0
    assert stats.line() is None                     # idle from the start: nothing to say
    llm.num_prompt_tokens, llm.num_generation_tokens = 200, 50
    llm.stats = EngineStats(3, 1, 0.25, 5, 0, 7, False, 200, 150)
    now[0] = 20.0
    assert stats.line() == ("Engine 000: Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
                            "Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: 25.0%, "
                            "Prefix cache hit rate: 75.0%")
    llm.stats = EngineStats(0, 0, 0.0, 10, 0, 9, False, 200, 150)
    now[0] = 30.0
    line = stats.line()                             # going idle: one more line (the rate since the start)
    assert line.startswith("Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
                           "Running: 0 reqs") and line.endswith("Prefix cache hit rate: 75.0%")
    now[0] = 40.0
    assert stats.line() is None
    with pytest.raises(ValueError, match="positive"):
        StatsLogger(llm, 0)


def test_stats_lines_while_the_app_runs(serving, caplog):
    app = _app(serving, log_stats_interval=0.05)

    async def go():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
                r = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200
            await asyncio.sleep(0.3)
    with caplog.at_level(logging.INFO, logger="vllm.stats"):
        asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.stats"]
    assert lines and all(line.startswith("Engine 000: Avg prompt throughput: ") for line in lines)
    assert any(not line.startswith("Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0")
               for line in lines)
    assert serving.llm.stats.prefix_cache_queries > 0   # the engine's prefix-cache counts reach the server


def test_a_request_that_cannot_be_sent_leaves_nothing_taken(serving, app, monkeypatch):
    """A failure between registering a request and the engine receiving it (here the send
    raising) gives its id and its slots back: the server is not left at capacity."""
    llm = serving.llm
    before = llm._outstanding

    def broken_send(msgs):
        raise RuntimeError("cannot send")
    monkeypatch.setattr(llm.client, "send", broken_send)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 3, "request_id": "taken-once"}
    assert _call(app, "POST", "/v1/chat/completions", body).status_code == 500
    assert llm._outstanding == before and "taken-once" not in llm._engine_ids
    monkeypatch.undo()
    assert _call(app, "POST", "/v1/chat/completions", body).status_code == 200


def test_a_schema_nested_too_deep_is_a_400(app):
    pytest.importorskip("xgrammar")
    schema = {"type": "integer"}
    for _ in range(700):
        schema = {"type": "array", "items": schema}
    r = _call(app, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                                     "response_format": {"type": "json_schema",
                                                                         "json_schema": {"name": "deep", "schema": schema}}})
    assert r.status_code == 400 and "nests deeper than 128 levels" in r.json()["error"]["message"]


def test_sampling_params_are_built_off_the_event_loop(app, monkeypatch):
    """A schema or grammar is parsed while SamplingParams are built: that runs on a worker thread,
    so a slow parse stalls no other stream."""
    import threading

    from vllm.entrypoints.openai import protocol
    seen = []
    for cls in (protocol.ChatCompletionRequest, protocol.CompletionRequest):
        real = cls.to_sampling_params

        def spy(self, *args, _real=real, **kw):
            seen.append(threading.current_thread() is threading.main_thread())
            return _real(self, *args, **kw)
        monkeypatch.setattr(cls, "to_sampling_params", spy)
    assert _call(app, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 200
    assert _call(app, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 1}).status_code == 200
    assert seen == [False, False]


PARTS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for p in m['content'] %}{{ p['text'] }}"
                  "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template", [None, PARTS_TEMPLATE], ids=["tokenizer's", "loops-over-parts"])
def test_content_parts_render_as_llm_chat_renders_them(serving, app, monkeypatch, template):
    """A message's list of text parts reaches the template as LLM.chat passes it (content format
    "auto": a template that loops over the parts gets them; one that does not, one string), so
    the server's prompt is LLM.chat's; input_text parts are text, as upstream reads them."""
    from vllm import LLM
    monkeypatch.setattr(serving, "chat_template", template)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is 1"},
                                             {"type": "input_text", "text": " + 2?"}]}]
    r = _call(app, "POST", "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    from vllm import SamplingParams
    want = LLM(device="cpu").chat(messages, SamplingParams(max_tokens=1), use_tqdm=False,
                                  chat_template=template)[0].prompt_token_ids
    assert r.json()["tokens"] == want
    if template is not None:   # the parts' text is in the prompt, not dropped
        assert "What is 1 + 2?" in serving.llm.tokenizer.decode(want)


def test_a_template_in_chat_template_kwargs_needs_the_servers_trust(serving, app, monkeypatch):
    """chat_template_kwargs may carry the template itself: it takes the same trust check as the
    request's chat_template field (else any request would render with a template of its own)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"chat_template": "X {{ 1 }}"}}
    r = _call(app, "POST", "/tokenize", body)
    assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]
    monkeypatch.setattr(serving, "trust_request_chat_template", True)
    r = _call(app, "POST", "/tokenize", body)
    assert r.status_code == 200 and r.json()["tokens"] == serving.llm.tokenizer.encode("X 1", add_special_tokens=False)


def test_chat_echo_of_a_list_content(app):
    body = {"messages": [{"role": "user", "content": "What is 1 + 2?"},
                         {"role": "assistant", "content": [{"type": "text", "text": "The"}, {"type": "text", "text": "sum"}]}],
            "add_generation_prompt": False, "continue_final_message": True, "echo": True, "max_tokens": 2,
            "temperature": 0}
    r = _call(app, "POST", "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("The\nsum")
    r = _call(app, "POST", "/v1/chat/completions", dict(body, stream=True))
    assert r.status_code == 200 and '"content":"The\\nsum"' in r.text


def test_empty_keys_refused_and_explicit_empty_cors_lists_kept():
    """`--api-key ""` would turn the check off without a word; `--allowed-methods '[]'` means
    none, not every method."""
    from vllm.entrypoints.cli.serve import _cors, check_upstream_flags
    for flag in ("--api-key", "--admin-key"):
        with pytest.raises(ValueError, match=f"{flag} is empty"):
            check_upstream_flags(_serve_parser().parse_args([flag, " "]))
    args = _serve_parser().parse_args(["--allowed-origins", '["http://ui"]', "--allowed-methods", "[]"])
    cors = _cors(args)
    assert cors["allow_methods"] == [] and cors["allow_headers"] == ["*"]


# ---- `vllm serve` start-up and stop -------------------------------------------------------------

def _fake_run_server(monkeypatch) -> dict:
    from vllm.entrypoints.openai import api_server
    seen = {}

    def fake_run_server(engine_kwargs, **kwargs):
        seen.update(kwargs, engine_kwargs=engine_kwargs)
        return "stopped"
    monkeypatch.setattr(api_server, "run_server", fake_run_server)
    return seen


def _thread_engine(monkeypatch, model_path):
    """run_server's engine: the model on a thread of this process instead of its own process."""
    from vllm import LLM
    from vllm.entrypoints.openai.async_engine import AsyncLLM

    def from_engine_args(engine_kwargs, **kw):
        return AsyncLLM.from_engine(LLM(model_path, device="cpu", cpu_kv_cache_bytes=4 << 20).llm_engine, **kw)
    monkeypatch.setattr(AsyncLLM, "from_engine_args", staticmethod(from_engine_args))


def test_a_clean_stop_exits_0_and_an_engine_death_1(monkeypatch, tiny_qwen3):
    """After a stop (SIGINT/SIGTERM: uvicorn's should_exit, then the lifespan hook shuts the
    engine down) run_server reports "stopped" and `vllm serve` exits 0, without the
    KeyboardInterrupt uvicorn re-raises; "engine_dead" only when the engine died by itself."""
    import signal

    import uvicorn

    from vllm.entrypoints.openai import api_server
    _thread_engine(monkeypatch, tiny_qwen3)

    async def stop_at_once(self, counter):   # a clean stop, once started up
        return True
    monkeypatch.setattr(uvicorn.Server, "on_tick", stop_at_once)
    assert cli.main(["serve", "--port", "0", "--disable-log-stats", "--disable-uvicorn-access-log"]) == 0

    async def ctrl_c(self, counter):   # Ctrl-C: uvicorn shuts down, then re-raises the SIGINT
        if counter == 0:
            signal.raise_signal(signal.SIGINT)
        return self.should_exit
    monkeypatch.setattr(uvicorn.Server, "on_tick", ctrl_c)
    handler = signal.getsignal(signal.SIGINT)
    assert cli.main(["serve", "--port", "0", "--disable-log-stats", "--disable-uvicorn-access-log"]) == 0
    assert signal.getsignal(signal.SIGINT) is handler

    async def kill_the_engine(self, counter):
        def crash(msg):
            raise RuntimeError("the engine loop crashed")
        llm = self.config.app.state.serving.llm
        if counter == 0:
            llm.client.core.handle = crash     # the next command kills the engine loop
            llm.client.utility("engine_stats")
        return self.should_exit
    monkeypatch.setattr(uvicorn.Server, "on_tick", kill_the_engine)
    assert api_server.run_server({}, host="127.0.0.1", port=0, access_log=False) == "engine_dead"


def test_a_busy_port_fails_before_the_engine_starts(monkeypatch, capsys):
    import socket

    from vllm.entrypoints.openai.async_engine import AsyncLLM

    def from_engine_args(*a, **kw):
        raise AssertionError("the engine was started before the port was bound")
    monkeypatch.setattr(AsyncLLM, "from_engine_args", staticmethod(from_engine_args))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}") and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("text, value", [("2048", 2048), ("1k", 1000), ("1K", 1024), ("25.6k", 25600),
                                         ("1m", 1000000), ("1M", 1 << 20), (" 32k ", 32000)])
def test_token_counts_as_upstream_reads_them(text, value):
    args = _serve_parser().parse_args(["--max-model-len", text, "--max-num-batched-tokens", text])
    assert (args.max_model_len, args.max_num_batched_tokens) == (value, value)
    assert type(args.max_model_len) is int


@pytest.mark.parametrize("argv, needle", [
    (["--max-model-len", "auto"], "auto: not supported here (the context length is taken from the model config"),
    (["--max-model-len=-1"], "-1: not supported here (the context length is taken from the model config"),
    (["--max-model-len", "0"], "0: must be a positive number of tokens (the context length is taken"),
    (["--max-model-len", "1.5K"], "decimals are not allowed with the binary suffix K (did you mean 1.5k?)"),
    (["--max-model-len", "0.0001k"], "is not a whole number"),
    (["--max-num-batched-tokens", "lots"], "invalid integer 'lots'"),
    (["--port", "65536"], "port 65536 is out of range: 0..65535"),
    (["--port=-1"], "port -1 is out of range"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--generation-config", "/no/such/dir"], "auto, vllm, or a folder holding generation_config.json"),
])
def test_bad_values_are_argparse_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and needle in err.strip().splitlines()[-1] and "Traceback" not in err, err


def test_dtype_choices_are_the_engines():
    from vllm.config import _DTYPES
    from vllm.entrypoints.cli.engine_args import DTYPE_CHOICES
    assert set(DTYPE_CHOICES) == {"auto", *_DTYPES}


def test_generation_config_folder(tmp_path, monkeypatch, capsys):
    """--generation-config FOLDER: its generation_config.json's sampling defaults, read as the
    checkpoint's own are read, in place of the checkpoint's; a folder without one is refused."""
    from vllm.entrypoints.openai.api_server import generation_defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.3, "top_k": 7, "max_new_tokens": 99, "do_sample": True}))
    folder = str(tmp_path)
    assert _serve_parser().parse_args(["--generation-config", folder]).generation_config == folder
    assert generation_defaults({"temperature": 0.7, "top_p": 0.8}, folder, {"top_p": 0.5}) == \
        {"temperature": 0.3, "top_k": 7, "max_tokens": 99, "top_p": 0.5}
    seen = _fake_run_server(monkeypatch)
    assert cli.main(["serve", "--generation-config", folder]) == 0 and seen["generation_config"] == folder
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(["--generation-config", str(empty)])
    assert f"folder {str(empty)!r} has no generation_config.json" in capsys.readouterr().err
    (tmp_path / "generation_config.json").write_text("[1]")
    assert cli.main(["serve", "--generation-config", folder]) == 1
    err = capsys.readouterr().err.strip()
    assert "is not a JSON object" in err and len(err.splitlines()) == 1, err


def test_engine_input_errors_at_start_up_are_one_line(monkeypatch):
    """A ValueError / NotImplementedError building the engine (a wrong flag value, a missing
    model) reaches the API server as its message alone; anything else with its traceback."""
    import multiprocessing
    import os
    import pickle
    import signal

    import vllm
    from vllm.engine import core
    monkeypatch.setattr(core, "_set_parent_death_signal", lambda: None)
    monkeypatch.setattr(signal, "signal", lambda *a: None)   # the engine process ignores SIGINT; not pytest
    for err, traceback_sent in ((ValueError("max_num_seqs must be >= 1"), False),
                                (NotImplementedError("tensor_parallel_size 3"), False),
                                (RuntimeError("CUDA error"), True)):
        def fail(**kw):
            raise err
        monkeypatch.setattr(vllm, "LLM", fail, raising=False)
        r, w = multiprocessing.Pipe(duplex=False)
        core.run_engine_core_process({}, None, w, os.getppid())
        kind, message = pickle.loads(r.recv_bytes())
        assert kind == "error" and message.startswith(f"{type(err).__name__}: {err}")
        assert ("Traceback" in message) is traceback_sent, message


def test_config_file(tmp_path, monkeypatch, capsys):
    """--config FILE.yaml (upstream's): long-form keys, hyphens or underscores; the command line
    wins over the file, the file over the defaults; true switches a flag on; lists fill
    nargs='+' options; the command line's MODEL wins over the file's model."""
    seen = _fake_run_server(monkeypatch)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: /ckpt\nmax-model-len: 1k\nmax_num_batched_tokens: 4K\nport: 8001\nhost: 0.0.0.0\n"
                   "served-model-name: [a, b]\nenable-sleep-mode: true\nenable_prefix_caching: false\n"
                   "trust-remote-code: false\ndisable-log-stats: false\nallowed-origins: ['*']\n"
                   "override-generation-config: {temperature: 0.5}\n")
    assert cli.main(["serve", "--config", str(cfg), "--port", "9000"]) == 0
    kw = seen["engine_kwargs"]
    assert (kw["model"], kw["max_model_len"], kw["max_num_batched_tokens"]) == ("/ckpt", 1000, 4096)
    assert kw["enable_sleep_mode"] is True and kw["enable_prefix_caching"] is False
    assert (seen["port"], seen["host"], seen["served_model_names"]) == (9000, "0.0.0.0", ["a", "b"])
    assert seen["log_stats_interval"] == 10.0 and seen["cors"]["allow_origins"] == ["*"]
    assert seen["override_generation_config"] == {"temperature": 0.5}
    assert cli.main(["serve", "/other", f"--config={cfg}", "--max-model-len", "2k"]) == 0
    assert (seen["engine_kwargs"]["model"], seen["engine_kwargs"]["max_model_len"]) == ("/other", 2000)
    assert seen["port"] == 8001 and seen["served_model_names"] == ["a", "b"]
    for text, needle in (("max-model-lenn: 5\n", "unknown key 'max-model-lenn'"),
                         ("- port\n", "must be a mapping"),
                         ("port: [1, 2]\n", "port takes one value"),
                         ("enable-sleep-mode: yes please\n", "is a switch"),
                         ("port: [\n", "not valid YAML")):
        cfg.write_text(text)
        assert cli.main(["serve", "--config", str(cfg)]) == 1
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    assert cli.main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 1
    err = capsys.readouterr().err.strip()
    assert "cannot read it" in err and len(err.splitlines()) == 1, err


def test_no_trust_remote_code_and_served_model_name_help(monkeypatch):
    seen = _fake_run_server(monkeypatch)
    assert cli.main(["serve", "--no-trust-remote-code"]) == 0 and seen
    assert _serve_parser().parse_args(["--no-trust-remote-code"]).trust_remote_code is False
    help_text = _serve_parser().format_help()
    assert "echoes the name its request" in " ".join(help_text.split())
