"""What upstream vLLM's clients send that the OpenAI schema alone does not say: JSON null as a
field's default, upstream's lax integers, max_completion_tokens over max_tokens, and /tokenize
rendering a conversation as chat completions does.

The app runs in-process on the embedded model (as tests/test_server.py drives it)."""
from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

MESSAGES = [{"role": "user", "content": "What is 47 + 58?"}]
GREEDY = {"temperature": 0, "ignore_eos": True}


# ---- through the app ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def serving():
    from vllm import LLM
    from vllm.entrypoints.openai.api_server import build_app_from_llm
    app = build_app_from_llm(LLM(device="cpu"))
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
    return _app(serving)


def test_null_is_the_default(app):
    chat = _call(app, "POST", "/v1/chat/completions",
                 {"messages": MESSAGES, "max_tokens": 3, "n": None, "logprobs": None, "stream": None,
                  "top_logprobs": None, "temperature": None, "top_p": None, "stop": None, "seed": None,
                  "stream_options": None, "presence_penalty": None, "frequency_penalty": None,
                  "return_tokens_as_token_ids": None, "tools": None, "tool_choice": None, **GREEDY})
    assert chat.status_code == 200, chat.text
    choice = chat.json()["choices"]
    assert len(choice) == 1 and choice[0]["logprobs"] is None and chat.json()["usage"]["completion_tokens"] == 3
    comp = _call(app, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": None, "echo": None, "stream": None,
                                                  "n": None, "logprobs": None, **GREEDY})
    assert comp.status_code == 200, comp.text
    assert comp.json()["usage"]["completion_tokens"] == 16          # null max_tokens: 16, as upstream
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

