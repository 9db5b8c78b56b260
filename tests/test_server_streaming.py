"""Streamed responses that carry more than generated text (tiny Qwen3, CPU, the real
`openai` client): /v1/completions with `echo` and `prompt_logprobs`, and chat tool calls.
Each stream, joined, equals the non-streamed response: text, token ids, logprobs (as
float32 bits), prompt_logprobs, tool calls (arguments as JSON values), finish_reason.
"""
from __future__ import annotations

import json

import pytest
import torch

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from vllm import LLM  # noqa: E402
from vllm.entrypoints.openai.api_server import build_app_from_llm  # noqa: E402
from vllm.entrypoints.openai.tool_calls import plan_tools  # noqa: E402
from vllm.testing.rollout_server import serve_in_thread  # noqa: E402
from vllm.testing.tool_call_stream import MESSAGES, TOOLS, stream_in_pieces  # noqa: E402



def bits(values) -> list[int]:
    return torch.tensor(values, dtype=torch.float32).view(torch.int32).tolist()


# ---- the incremental tool-call parser ---------------------------------------------------------

@pytest.mark.parametrize("text", [
    'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
    '<tool_call>{"name": "noop", "parameters": {}}</tool_call><tool_call>not json</tool_call>',
    "plain text with a <tool_ that never opens", "  leading and trailing whitespace  ",
    '<tool_call>{"name":"add","arguments":{}}</tool_call>\n\nDone.\n',
    'cut short <tool_call>{"name":"add"',
    '<tool_call>a <tool_call>{"name":"add"}</tool_call> z <tool_call',
    '[{"name":"add","parameters":{"a":12}},{"name":"noop","parameters":{}}]',
])
def test_tool_call_stream_matches_parse(text):
    for mode in ("auto", "required"):
        plan = plan_tools(TOOLS, mode)
        content, calls = plan.parse(text)
        want = ((content or None), [(c.name, json.loads(c.arguments)) for c in calls], bool(calls))
        for seed in range(12):
            assert stream_in_pieces(plan, text, seed, max_piece=5) == want, (mode, seed)
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert stream_in_pieces(plan, '{"a":1,"b":true}', 0, max_piece=5) == (None, [("add", {"a": 1, "b": True})], True)


def test_cut_short_required_array_keeps_its_text():
    text = '[{"name":"add","parameters":{"a":1,"b":true}},{"na'
    plan = plan_tools(TOOLS, "required")
    content, calls = plan.parse(text)
    # the completed element is a call (streamed as it completed); the text after it is content
    assert content == ',{"na' and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": True})]
    for seed in range(8):
        assert stream_in_pieces(plan, text, seed, max_piece=5) == (',{"na', [("add", {"a": 1, "b": True})], True)
    assert plan.parse('[{"na') == ('[{"na', [])


# ---- the server -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_qwen3):
    app = build_app_from_llm(LLM(tiny_qwen3, device="cpu", max_num_seqs=4, max_num_batched_tokens=16), ["tiny"])
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def _extra(obj, name):
    return (obj.model_extra or {}).get(name)


def _join_completion_stream(chunks) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            acc = out.setdefault(c.index, {"text": "", "token_ids": [], "finish_reason": None, "chunks": 0,
                                           "logprobs": None, "prompt_logprobs": None, "prompt_token_ids": None})
            assert acc["finish_reason"] is None, "nothing follows a choice's finish"
            acc["chunks"] += 1
            acc["text"] += c.text
            acc["token_ids"] += _extra(c, "token_ids") or []
            acc["finish_reason"] = c.finish_reason
            pl, pids = _extra(c, "prompt_logprobs"), _extra(c, "prompt_token_ids")
            if acc["chunks"] == 1:
                acc["prompt_logprobs"], acc["prompt_token_ids"] = pl, pids
            else:
                assert pl is None and pids is None, "the prompt side rides on the first chunk only"
            if c.logprobs is not None:
                lp = acc["logprobs"] = acc["logprobs"] or {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                          "text_offset": []}
                for name in lp:
                    lp[name] += getattr(c.logprobs, name)
    return out


def _check_same_logprobs(got: dict | None, want) -> None:
    if want is None:
        assert got is None
        return
    assert got["tokens"] == want.tokens and got["text_offset"] == want.text_offset
    assert got["top_logprobs"] == want.top_logprobs
    assert [v is None for v in got["token_logprobs"]] == [v is None for v in want.token_logprobs]
    assert bits([v for v in got["token_logprobs"] if v is not None]) == \
        bits([v for v in want.token_logprobs if v is not None])


COMPLETION_CASES = [
    dict(prompt=["the quick brown fox", "a b c d e"], max_tokens=5, temperature=0.0, echo=True, logprobs=2),
    dict(prompt="the quick brown fox", max_tokens=4, temperature=0.8, seed=3, n=2, echo=True),
    dict(prompt=[[5, 6, 7, 8, 9], [40, 41]], max_tokens=3, temperature=0.0, prompt_logprobs=2, logprobs=1),
    dict(prompt="the lazy dog", max_tokens=6, temperature=0.0, echo=True, logprobs=0, prompt_logprobs=1,
         stop=[" the", "zz"]),
    dict(prompt=[[5, 6, 7, 8]], max_tokens=3, temperature=0.0, echo=True, logprobs=1, return_tokens_as_token_ids=True),
    dict(prompt="no echo, only logprobs", max_tokens=5, temperature=0.0, logprobs=3, return_tokens_as_token_ids=True),
]


@pytest.mark.parametrize("case", COMPLETION_CASES)
def test_streamed_completion_equals_non_streamed(client, case):
    fields = ("prompt", "max_tokens", "temperature", "echo", "logprobs", "n", "seed", "stop")
    kw = {k: v for k, v in case.items() if k in fields}
    extra = {k: v for k, v in case.items() if k not in fields}
    full = client.completions.create(model="tiny", extra_body=extra, **kw)
    streamed = _join_completion_stream(client.completions.create(model="tiny", stream=True, extra_body=extra, **kw))
    assert sorted(streamed) == sorted(c.index for c in full.choices)
    for want in full.choices:
        got = streamed[want.index]
        assert got["text"] == want.text and got["finish_reason"] == want.finish_reason
        assert got["token_ids"] == _extra(want, "token_ids") and got["prompt_token_ids"] == _extra(want, "prompt_token_ids")
        assert got["prompt_logprobs"] == _extra(want, "prompt_logprobs")
        if got["prompt_logprobs"] is not None:
            assert bits([lp["logprob"] for e in got["prompt_logprobs"][1:] for lp in e.values()]) == \
                bits([lp["logprob"] for e in _extra(want, "prompt_logprobs")[1:] for lp in e.values()])
        _check_same_logprobs(got["logprobs"], want.logprobs)


def test_streamed_completion_sends_one_choice_per_chunk(client):
    """As upstream streams completions: every chunk holds one choice, so a client reading
    choices[0] (LangChain's, LiteLLM's) sees every choice's text."""
    chunks = list(client.completions.create(model="tiny", prompt=["a b c", "d e"], n=2, max_tokens=4,
                                            temperature=0.8, seed=5, stream=True))
    assert chunks and all(len(ch.choices) == 1 for ch in chunks)
    assert sorted({ch.choices[0].index for ch in chunks}) == [0, 1, 2, 3]


def test_streamed_echo_scoring_sends_the_prompt_then_the_finish(client, server):
    text = "the quick brown fox jumps over the lazy dog"
    kw = dict(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0.0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    first, finish = chunks[0].choices[0], chunks[1].choices[0]
    assert first.text == text and first.finish_reason is None and _extra(first, "token_ids") == []
    assert finish.text == "" and finish.finish_reason == full.choices[0].finish_reason and _extra(finish, "token_ids") == []
    assert chunks[-1].usage.completion_tokens == 0 == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    got = _join_completion_stream(chunks[:-1])[0]
    assert got["text"] == full.choices[0].text and got["chunks"] == 2
    _check_same_logprobs(got["logprobs"], full.choices[0].logprobs)


def test_bad_streamed_requests_are_still_400(server):
    bad = [("/v1/completions", {"prompt": "x", "echo": True, "stream": True, "prompt_logprobs": -1}),
           ("/v1/completions", {"prompt": "x", "max_tokens": 0, "stream": True}),        # max_tokens=0 needs echo
           ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 10 ** 6, "stream": True}),
           ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "stream": True,
                                     "response_format": {"type": "json_object"}}),
           ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "stream": True,
                                     "tool_choice": {"type": "function", "function": {"name": "other"}}}),
           ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 1, "stream": True})]
    for path, body in bad:
        r = requests.post(f"{server}{path}", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], (body, r.text)


# ---- chat tool calls ----------------------------------------------------------------------------

def _join_chat_stream(chunks) -> dict:
    acc = {"content": "", "calls": {}, "token_ids": [], "logprobs": [], "finish_reason": None}
    for chunk in chunks:
        for c in chunk.choices:
            assert acc["finish_reason"] is None
            acc["content"] += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                if t.id is not None:   # a call's first delta: index, id, type, name
                    assert t.index not in acc["calls"] and t.type == "function" and t.function.name
                    assert t.function.arguments == ""
                    acc["calls"][t.index] = [t.id, t.function.name, ""]
                else:
                    assert t.function.name is None
                acc["calls"][t.index][2] += t.function.arguments or ""
            acc["token_ids"] += _extra(c, "token_ids") or []
            if c.logprobs is not None:
                acc["logprobs"] += [t.logprob for t in c.logprobs.content]
            acc["finish_reason"] = c.finish_reason
    return acc


CHAT_CASES = [
    # auto, with a call forced by a regex (the tiny model would not write one): content and a block
    dict(tool_choice="auto", max_tokens=200, extra_body={"structured_outputs": {
        "regex": r'Sure\.\n<tool_call>\n\{"name": "add", "arguments": \{"a": [1-3], "b": (true|false)\}\}\n</tool_call>'}}),
    dict(tool_choice="auto", max_tokens=8),                                   # free text, no call
    dict(tool_choice="required", parallel_tool_calls=False, max_tokens=200),
    dict(tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=200),
]


@pytest.mark.parametrize("case", CHAT_CASES)
def test_streamed_tool_calls_equal_non_streamed(client, case):
    pytest.importorskip("xgrammar")
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0.0, logprobs=True, **case)
    full = client.chat.completions.create(**kw)
    got = _join_chat_stream(client.chat.completions.create(stream=True, **kw))
    want = full.choices[0]
    assert (got["content"] or None) == (want.message.content or None)
    want_calls = [(t.function.name, json.loads(t.function.arguments)) for t in want.message.tool_calls or []]
    assert [(name, json.loads(args)) for _, name, args in got["calls"].values()] == want_calls
    assert all(i.startswith("call_") for i, _, _ in got["calls"].values())
    assert got["finish_reason"] == want.finish_reason
    assert got["token_ids"] == _extra(want, "token_ids")
    assert bits(got["logprobs"]) == bits([t.logprob for t in want.logprobs.content])
    if case["tool_choice"] == "auto" and "extra_body" in case:
        assert want_calls and want.finish_reason == "tool_calls" and want.message.content == "Sure.", want
    if case["tool_choice"] == "required" and want.finish_reason != "length":
        assert len(want_calls) == 1 and want.finish_reason == "tool_calls"
    if isinstance(case["tool_choice"], dict) and want.finish_reason != "length":
        assert want_calls[0][0] == "add" and want.finish_reason == "stop"


def test_no_empty_chunks_while_a_parser_holds_text_back(client):
    """While the tool parser holds a <tool_call> block back, a step that carries nothing else
    (no token ids, logprobs, usage or finish) sends no chunk, as upstream; the stream still adds
    up to the non-streamed answer."""
    pytest.importorskip("xgrammar")
    case = dict(CHAT_CASES[0])
    case["extra_body"] = dict(case["extra_body"], return_token_ids=False)
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0.0, **case)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    body = [c.choices[0] for c in chunks[1:] if c.choices]     # after the role chunk
    assert all(c.delta.content or c.delta.tool_calls or c.finish_reason for c in body)
    got = _join_chat_stream(chunks)
    assert got["content"] == full.choices[0].message.content and got["finish_reason"] == "tool_calls"
    assert len(got["calls"]) == len(full.choices[0].message.tool_calls) == 1
