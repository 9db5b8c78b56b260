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
    # never closed at the end (a stop string "</tool_call>", or EOS after the JSON): still a call
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n', None, [("add", {"a": 1})]),
    ("hermes", 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1}}', "Sure.", [("add", {"a": 1})]),
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


# the XML formats (Qwen3-Coder's): values typed by the tools' schemas (TOOLS: add's a is an
# enum of integers, b a boolean; w is no tool, so its values stay strings)
XML_CALLS = [
    ("qwen3_coder", "Let me check.\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n"
                    "true\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=noop>\n</function>\n"
                    "</tool_call> after", "Let me check.\n\n after", [("add", {"a": 1, "b": True}), ("noop", {})]),
    ("qwen3_xml", "<tool_call>\n<function=w>\n<parameter=city>\nParis\n</parameter>\n<parameter=note>\nline 1\n"
                  "line 2\n</parameter>\n</function>\n</tool_call>", None,
     [("w", {"city": "Paris", "note": "line 1\nline 2"})]),
    # never closed at the end (a stop string "</tool_call>", or EOS): a call when its function is whole
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n</function>\n", None,
     [("add", {"a": 2})]),
]
XML_CONTENT = [
    ("qwen3_coder", "<tool_call>no function</tool_call> tail"),
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</tool_call>"),  # unclosed function
    ("qwen3_xml", "cut <tool_call>\n<function=add>\n<parameter=a>\n1"),
    ("qwen3_coder", 'hermes style <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'),
]


@pytest.mark.parametrize("parser,text,content,calls", XML_CALLS)
def test_xml_calls_are_parsed_and_typed_by_the_schemas(parser, text, content, calls):
    got_content, got = plan_tools(TOOLS, "auto", parser=parser).parse(text)
    assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got] == calls
    # without schemas every value is the text itself
    _, untyped = parse_tool_calls(parser, text)
    assert all(isinstance(v, str) for c in untyped for v in json.loads(c.arguments).values())


@pytest.mark.parametrize("parser,text", XML_CONTENT)
def test_other_text_is_content_in_the_xml_formats(parser, text):
    assert plan_tools(TOOLS, "auto", parser=parser).parse(text) == (text, [])


def test_xml_values_follow_their_types():
    from vllm.entrypoints.openai.tool_parsers import _typed
    assert _typed("3", {"type": "integer"}) == 3 and _typed("3.0", {"type": "number"}) == 3.0
    assert _typed("7", {"type": "number"}) == 7 and _typed("x", {"type": "integer"}) == "x"
    assert _typed("False", {"type": "boolean"}) is False and _typed("null", {"type": ["string", "null"]}) is None
    assert _typed("null", {"type": "string"}) == "null" and _typed(" 12 ", {"type": "string"}) == " 12 "
    assert _typed('{"a": [1]}', {"type": "object"}) == {"a": [1]} and _typed("[1, 'x']", {"type": "array"}) == [1, "x"]
    assert _typed("not json", {"type": "object"}) == "not json"


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


@pytest.mark.parametrize("arguments,expected", [
    ('"{\\"a\\": 1}"', '{"a": 1}'),             # JSON text in a string: taken as it is
    ('"hello"', '"hello"'),                       # not JSON: encoded as a JSON string
    ('"{\\"a\\": 1"', '"{\\"a\\": 1"'),         # cut-short JSON in a string: a JSON string too
])
def test_string_arguments_are_always_json_text(arguments, expected):
    _, calls = parse_tool_calls("hermes", f'<tool_call>{{"name": "add", "arguments": {arguments}}}</tool_call>')
    assert [c.arguments for c in calls] == [expected]
    json.loads(calls[0].arguments)


@pytest.mark.parametrize("parser,text", CONTENT)
def test_other_text_is_content(parser, text):
    assert parse_tool_calls(parser, text) == (text, [])


def test_formats_are_per_parser():
    """Each parser reads its own format only: another family's calls are content."""
    for parser, text, _, _ in CALLS:
        for other in TOOL_CALL_PARSERS:
            if other != parser and text.strip().startswith(("{", "<|python_tag|>", "[TOOL_CALLS]", "[add", "[w", "[f")):
                assert parse_tool_calls(other, text) == (text, []), (parser, other, text)


@pytest.mark.parametrize("parser,text", [(p, t) for p, t, _, _ in CALLS + XML_CALLS] + CONTENT + XML_CONTENT)
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


# ---- streamed == non-streamed through the server's own functions ------------------------------

def _served(plan, text, finish="stop"):
    """(non-streamed, streamed) (content, [(id, name, arguments)], finish_reason) of one
    output, as serving.py builds the message and joins the deltas."""
    from vllm.entrypoints.openai.serving import _chat_finish, _chat_message
    from vllm.outputs import CompletionOutput
    c = CompletionOutput(index=0, text=text, token_ids=[], cumulative_logprob=None, logprobs=None,
                         finish_reason=finish)
    m = _chat_message(c, plan)
    full = (m.content, [(t.id, t.function.name, t.function.arguments) for t in m.tool_calls or []],
            _chat_finish(c, plan))
    stream, pieces = ToolCallStream(plan), []
    for k in range(0, len(text), 3):
        pieces += stream.feed(text[k:k + 3], k + 3 >= len(text))
    if not text:
        pieces += stream.feed("", True)
    calls: dict = {}
    for p in pieces:
        if p.index is not None:
            calls.setdefault(p.index, [p.id, p.name, ""])[2] += p.arguments or ""
    fin = "tool_calls" if finish == "stop" and plan.mode in ("auto", "required") and stream.has_calls() else finish
    streamed = ("".join(p.content for p in pieces if p.content is not None) or None,
                [tuple(calls[i]) for i in sorted(calls)], fin)
    return full, streamed


def _same(full, streamed):
    assert (full[0], [c[1:] for c in full[1]], full[2]) == (streamed[0], [c[1:] for c in streamed[1]], streamed[2])


@pytest.mark.parametrize("parser,text,content", [
    ("hermes", '\n\nSure, checking. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n',
     "\n\nSure, checking."),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n\n Done.  ', "\n\n Done."),
    ("hermes", '\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n', None),
    ("mistral", ' \nSure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]', " \nSure."),
])
def test_content_around_marked_calls_keeps_its_leading_whitespace(parser, text, content):
    """Text before a call may start with whitespace (after a </think>): the stream sends it
    before it knows a call follows, so the non-streamed content keeps it too; only the
    whitespace that ends the content is dropped when there are calls."""
    plan = plan_tools(TOOLS, "auto", parser=parser)
    assert plan.parse(text)[0] == content
    full, streamed = _served(plan, text)
    assert full[0] == content and [c[1] for c in full[1]] == ["add"] and full[2] == "tool_calls"
    _same(full, streamed)
    for seed in range(8):
        assert stream_in_pieces(plan, text, seed, max_piece=4) == (content, [("add", {"a": 1})], True)


@pytest.mark.parametrize("text", ['{"a": 1.50, "b": 1e3}', '{"a": 2, "b": "Z\\u00fcrich"}', '{ "a":1 }'])
def test_named_call_arguments_are_the_generated_text(text):
    """A named tool_choice's arguments are the output unchanged, streamed or not (no
    re-serialising: 1.50 stays 1.50, \\u00fc stays escaped)."""
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}})
    full, streamed = _served(plan, text)
    assert [c[1:] for c in full[1]] == [("add", text)] and full[0] is None and full[2] == "stop"
    _same(full, streamed)


@pytest.mark.parametrize("parser,text", [
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
               '<tool_call>{"name": "noop", "arguments": {}}</tool_call>'),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}}; {"name": "noop", "parameters": {}}'),
])
def test_auto_without_parallel_tool_calls_keeps_the_first_call(parser, text):
    """parallel_tool_calls false under "auto" (upstream's): the first call only, streamed or not."""
    plan = plan_tools(TOOLS, "auto", parallel_tool_calls=False, parser=parser)
    full, streamed = _served(plan, text)
    assert [c[1:] for c in full[1]] == [("add", '{"a": 1}')] and full[2] == "tool_calls"
    _same(full, streamed)
    both = plan_tools(TOOLS, "auto", parser=parser)
    assert len(_served(both, text)[0][1]) == 2


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_required_cut_short_gives_its_complete_calls(finish):
    """A "required" array cut short (max_tokens, a stop string): its complete elements are
    calls and the text after the last of them is content, streamed or not."""
    plan = plan_tools(TOOLS, "required")
    text = '[{"name": "add", "parameters": {"a": 1, "b": true}}, {"name": "noop", "parame'
    full, streamed = _served(plan, text, finish)
    assert [c[1:] for c in full[1]] == [("add", '{"a": 1, "b": true}')]
    assert full[0] == ', {"name": "noop", "parame'
    assert full[2] == ("tool_calls" if finish == "stop" else "length")
    _same(full, streamed)
    full, streamed = _served(plan, '[{"name": "ad', finish)     # nothing complete: all content
    assert full == (('[{"name": "ad', [], finish)) and streamed == full
    text = '[{"name": "add", "parameters": {"a": 2, "b": false}}]'
    full, streamed = _served(plan, text)
    assert full[0] is None and [c[1] for c in full[1]] == ["add"] and full[2] == "tool_calls"
    _same(full, streamed)


LOC = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _defs_tool(name, defs_key="$defs", loc=LOC):
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"loc": {"$ref": f"#/{defs_key}/Loc"}}, "required": ["loc"],
        defs_key: {"Loc": loc}}}}


def test_required_moves_the_tools_defs_to_the_top():
    """tool_choice "required" nests each tool's parameters in one array schema: their $defs
    (and definitions) move to its top level, where "#/$defs/..." references resolve."""
    tools = [_defs_tool("f"), _defs_tool("g"), _defs_tool("h", "definitions"), TOOLS[0]]
    schema = plan_tools(tools, "required").structured_outputs().json
    assert schema["$defs"] == {"Loc": LOC} and schema["definitions"] == {"Loc": LOC}
    for call in schema["items"]["anyOf"]:
        params = call["properties"]["parameters"]
        assert "$defs" not in params and "definitions" not in params
    assert tools[0]["function"]["parameters"]["$defs"] == {"Loc": LOC}     # the request is not changed
    other = dict(LOC, required=[])
    with pytest.raises(ValueError, match=r"'f' and 'g' both define \$defs/Loc"):
        plan_tools([_defs_tool("f"), _defs_tool("g", loc=other)], "required").structured_outputs()
    pytest.importorskip("xgrammar")
    from vllm.structured_outputs import grammar_of
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        grammar_of(plan_tools(tools, choice).structured_outputs())     # compiles: the refs resolve


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "add"}}])
def test_mistral_tool_call_ids_are_nine_letters_and_digits(choice):
    """Mistral's chat templates refuse a tool call id that is not 9 letters and digits when
    the call comes back in the next request: the mistral parser's ids are that, streamed
    or not, whatever the tool_choice; other parsers keep call_..."""
    text = {"auto": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "noop", "arguments": {}}]',
            "required": '[{"name": "add", "parameters": {"a": 1}}, {"name": "noop", "parameters": {}}]'}.get(
        choice if isinstance(choice, str) else "", '{"a": 1}')
    for parser in ("mistral", "hermes"):
        plan = plan_tools(TOOLS, choice, parser=parser)
        if choice == "auto" and parser == "hermes":
            text = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        full, streamed = _served(plan, text)
        ids = [c[0] for c in full[1] + streamed[1]]
        assert full[1] and len(set(ids)) == len(ids)
        for i in ids:
            if parser == "mistral":
                assert len(i) == 9 and i.isalnum() and i.isascii(), i
            else:
                assert i.startswith("call_") and len(i) == 29, i
        if parser == "mistral":
            _same(full, streamed)


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
    if parser == "mistral":    # Mistral's chat templates take 9 letters and digits only
        assert all(len(t.id) == 9 and t.id.isalnum() for t in full.message.tool_calls)
    else:
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


def test_required_array_with_a_raw_control_character_parses():
    """A "required" call whose arguments hold a raw control character (invalid JSON, which a
    grammar may let through) is still a call, its arguments dumped again, escaped."""
    import json
    plan = plan_tools(TOOLS, "required")
    text = '[{"name": "add", "parameters": {"a": "x\x05y"}}]'
    content, calls = plan.parse(text)
    assert content is None and [c.name for c in calls] == ["add"]
    assert json.loads(calls[0].arguments) == {"a": "x\x05y"}
