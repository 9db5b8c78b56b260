"""--tool-call-parser: the formats "auto" tool_choice reads (hermes, llama3_json, mistral,
pythonic), non-streamed and streamed, their flag, and each through the server (the
embedded default model, CPU, the real `openai` client) with the output forced by a regex."""
from __future__ import annotations

import json

import pytest

from vllm.entrypoints.openai.tool_calls import ToolCallStream, plan_tools
from vllm.entrypoints.openai.tool_parsers import (
    TOOL_CALL_PARSERS, check_tool_call_parser, could_be_calls, parse_tool_calls,
)
from vllm.testing.tool_call_stream import MESSAGES, TOOLS, stream_in_pieces


ARGS = {"city": "Paris", "n": [1, -2.5, None, True], "deep": {"k": {"z": []}}, "é": "ü"}

# (parser, text, content, [(name, arguments value)])
CALLS = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
               '<tool_call>{"name": "noop", "parameters": {}}</tool_call> after',
     "Let me check.\n\n after", [("add", {"a": 1}), ("noop", {})]),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": true}}', None, [("add", {"a": 1, "b": True})]),
    ("llama3_json", '<|python_tag|>{"name": "add", "arguments": {"a": 2}}', None, [("add", {"a": 2})]),
    ("llama3_json", f'\n {{"name": "w", "parameters": {json.dumps(ARGS)}}} ; {{"name": "noop", "parameters": {{}}}};\n',
     None, [("w", ARGS), ("noop", {})]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3, "b": false}}]', None,
     [("add", {"a": 3, "b": False})]),
    ("mistral", f'Sure.\n[TOOL_CALLS] [{{"name": "w", "arguments": {json.dumps(ARGS)}}}, {{"name": "noop"}}]\nDone.',
     "Sure.\n\nDone.", [("w", ARGS), ("noop", {})]),
    ("mistral", 'a [TOOL_CALLS] oops [TOOL_CALLS]{"name": "noop", "arguments": {}} b',
     "a [TOOL_CALLS] oops  b", [("noop", {})]),
    ("pythonic", '[add(a=1, b=True)]', None, [("add", {"a": 1, "b": True})]),
    ("pythonic", '  [w(city="Paris", n=[1, -2.5, None, True], deep={"k": {"z": []}}, é="ü"),\n noop()]\n', None,
     [("w", {"city": "Paris", "n": [1, -2.5, None, True], "deep": {"k": {"z": []}}, "é": "ü"}), ("noop", {})]),
    ("pythonic", "[f(s='it''s', x=+3, y=-0.5e3)]", None, [("f", {"s": "its", "x": 3, "y": -500.0})]),
]

# text that is not a call in the parser's format: all content, unchanged
CONTENT = [
    ("hermes", "<tool_call>not json</tool_call> and <tool_call>{\"name\": 1}</tool_call>"),
    ("hermes", 'cut short <tool_call>{"name":"add"'),
    ("llama3_json", "The answer is 4."),
    ("llama3_json", '{"name": "add"}'),                                     # no parameters: a JSON answer
    ("llama3_json", '{"name": "add", "parameters": [1]}'),
    ("llama3_json", 'Sure: {"name": "add", "parameters": {}}'),             # text before
    ("llama3_json", '{"name": "add", "parameters": {}} and more'),          # text after
    ("llama3_json", '{"name": "add", "parameters": {}}; {"name": "noop", "parameters": {}'),   # cut short
    ("llama3_json", '[{"name": "add", "parameters": {}}]'),
    ("llama3_json", "<|python_tag|>"),
    ("llama3_json", "<b>bold</b>"),
    ("llama3_json", ""),
    ("mistral", "no marker here [TOOL_"),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}'),    # cut short
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": 5}]'),
    ("mistral", "[TOOL_CALLS] []"),
    ("mistral", "[TOOL_CALLS] plain words"),
    ("pythonic", "The answer is 4."),
    ("pythonic", "[1] See the reference."),
    ("pythonic", "[Link](https://example.com)"),
    ("pythonic", "[add(a=1)] and more"),
    ("pythonic", "Sure: [add(a=1)]"),
    ("pythonic", "[add(a=x)]"),                      # a name, not a literal
    ("pythonic", "[add(1)]"),                        # positional
    ("pythonic", "[add(a=1, a=2)]"),
    ("pythonic", "[add(**kw)]"),
    ("pythonic", "[add(a={1, 2})]"),
    ("pythonic", "[add(a=(1, 2))]"),
    ("pythonic", "[add(a=b'x')]"),
    ("pythonic", "[add(a=1e999)]"),
    ("pythonic", "[add(a={1: 2})]"),
    ("pythonic", "[add(a=f'{x}')]"),
    ("pythonic", "[add(a=1) # why\n]"),              # a comment would be lost
    ("pythonic", "[obj.add(a=1)]"),
    ("pythonic", "[]"),
    ("pythonic", "[add(a=1"),
    ("pythonic", ""),
]


@pytest.mark.parametrize("parser,text,content,calls", CALLS)
def test_calls_are_parsed(parser, text, content, calls):
    got_content, got = parse_tool_calls(parser, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    for c, (_, args) in zip(got, calls):
        assert c.arguments == json.dumps(args, ensure_ascii=False)
    plan = plan_tools(TOOLS, "auto", parser=parser)
    assert plan.parse(text) == (got_content, got)
    assert plan_tools(TOOLS, "none", parser=parser).parse(text) == (text, [])


@pytest.mark.parametrize("parser,text", CONTENT)
def test_other_text_is_content(parser, text):
    assert parse_tool_calls(parser, text) == (text, [])


def test_formats_are_per_parser():
    """Each parser reads its own format only: another family's calls are content."""
    for parser, text, _, _ in CALLS:
        for other in TOOL_CALL_PARSERS:
            if other != parser and text.strip().startswith(("{", "<|python_tag|>", "[TOOL_CALLS]", "[add", "[w", "[f")):
                assert parse_tool_calls(other, text) == (text, []), (parser, other, text)


@pytest.mark.parametrize("parser,text", [(p, t) for p, t, _, _ in CALLS] + CONTENT)
def test_stream_matches_parse(parser, text):
    plan = plan_tools(TOOLS, "auto", parser=parser)
    content, calls = plan.parse(text)
    want = (content or None, [(c.name, json.loads(c.arguments)) for c in calls], bool(calls))
    for seed in range(16):
        assert stream_in_pieces(plan, text, seed, max_piece=4) == want, seed


@pytest.mark.parametrize("parser,text", [
    ("llama3_json", "The answer is 4."), ("llama3_json", '{"name": "add", "parameters": {}} and more'),
    ("pythonic", "The answer is 4."), ("pythonic", "[Link](https://example.com) and more"),
    ("mistral", "Plain words, then more."),
])
def test_content_streams_once_it_cannot_be_a_call(parser, text):
    """Unmarked formats hold the output only while it may still be calls: once it cannot,
    it streams as content, before the output finishes."""
    stream, sent = ToolCallStream(plan_tools(TOOLS, "auto", parser=parser)), ""
    for ch in text:
        sent += "".join(p.content or "" for p in stream.feed(ch, False))
    assert sent and text.startswith(sent) and len(sent) >= len(text) - 10, sent


@pytest.mark.parametrize("parser,text,_c,_k", CALLS)
def test_a_call_is_never_sent_as_content_early(parser, text, _c, _k):
    if parser in ("llama3_json", "pythonic"):
        assert all(could_be_calls(parser, text[:k]) for k in range(len(text) + 1))


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        check_tool_call_parser("llama3")
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        plan_tools(TOOLS, "auto", parser="xml")
    from vllm.entrypoints.openai.serving import OpenAIServing
    with pytest.raises(ValueError, match="pythonic"):
        OpenAIServing(None, ["m"], tool_call_parser="nope")


def test_cli_flag():
    import argparse

    from vllm.entrypoints.cli import main as cli

    parser = cli.build_parser("serve")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    assert sub.parse_args([]).tool_call_parser == "hermes"
    args = sub.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"])
    assert args.tool_call_parser == "pythonic" and args.enable_auto_tool_choice
    with pytest.raises(SystemExit):
        sub.parse_args(["--tool-call-parser", "llama3"])


# ---- the server ---------------------------------------------------------------------------------

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

SERVER_CASES = {
    "llama3_json": (r'\{"name": "add", "parameters": \{"a": [1-3], "b": (true|false)\}\}; '
                    r'\{"name": "noop", "parameters": \{\}\}', None, ["add", "noop"]),
    "mistral": (r'Sure\. \[TOOL_CALLS\]\[\{"name": "add", "arguments": \{"a": [1-3], "b": (true|false)\}\}\]',
                "Sure.", ["add"]),
    "pythonic": (r'\[add\(a=[1-3], b=(True|False)\), noop\(\)\]', None, ["add", "noop"]),
}


@pytest.fixture(scope="module")
def server():
    from vllm import LLM
    from vllm.entrypoints.openai.api_server import build_app_from_llm
    from vllm.testing.rollout_server import serve_in_thread

    app = build_app_from_llm(LLM(device="cpu", max_num_seqs=2), tool_call_parser="llama3_json")
    assert app.state.serving.tool_call_parser == "llama3_json"
    with serve_in_thread(app) as url:
        yield app, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    app.state.serving.llm.shutdown()


def _join_chat_stream(chunks) -> dict:
    acc = {"content": "", "calls": {}, "finish_reason": None}
    for chunk in chunks:
        for c in chunk.choices:
            acc["content"] += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                if t.id is not None:
                    assert t.index not in acc["calls"] and t.type == "function" and t.function.arguments == ""
                    acc["calls"][t.index] = [t.id, t.function.name, ""]
                acc["calls"][t.index][2] += t.function.arguments or ""
            acc["finish_reason"] = c.finish_reason or acc["finish_reason"]
    return acc


@pytest.mark.parametrize("parser", sorted(SERVER_CASES))
def test_server_parses_the_format(server, parser):
    pytest.importorskip("xgrammar")
    app, client = server
    regex, content, names = SERVER_CASES[parser]
    app.state.serving.tool_call_parser = parser      # one model for the three formats
    kw = dict(model="default", messages=MESSAGES, tools=TOOLS, temperature=0.0, max_tokens=200,
              extra_body={"structured_outputs": {"regex": regex}})
    full = client.chat.completions.create(**kw).choices[0]
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in full.message.tool_calls or []]
    assert [n for n, _ in calls] == names and full.finish_reason == "tool_calls", full
    assert full.message.content == content
    assert all(t.id.startswith("call_") for t in full.message.tool_calls)
    assert len({t.id for t in full.message.tool_calls}) == len(names)
    assert calls[0][1]["a"] in (1, 2, 3) and isinstance(calls[0][1]["b"], bool)
    got = _join_chat_stream(client.chat.completions.create(stream=True, **kw))
    assert (got["content"] or None) == content and got["finish_reason"] == "tool_calls"
    assert [(name, json.loads(args)) for _, name, args in got["calls"].values()] == calls
    # the same text under another parser is content
    app.state.serving.tool_call_parser = "hermes"
    other = client.chat.completions.create(**kw).choices[0]
    assert other.message.tool_calls is None and other.finish_reason == "stop" and other.message.content
