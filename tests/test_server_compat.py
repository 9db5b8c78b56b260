"""What clients of upstream vLLM send, beyond the OpenAI schema: tool-call history, chat
templates, special tokens, prompt truncation, guided_* fields, the upstream fields refused
by name, generation_config defaults, and the command-line flags upstream launch scripts pass.

The rendering and request parts run without a server (fast); the last tests drive the app
in-process on the embedded model, as tests/test_server.py does."""
from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest

pytest.importorskip("pydantic")  # the request models (a GPU machine may lack the server's packages)

from vllm.entrypoints.chat_template import chat_prompt_ids, load_chat_template, template_messages  # noqa: E402
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402

TOOL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                    {"id": "c2", "type": "function", "function": {"name": "now", "arguments": ""}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
]

# the tool-use convention of Llama 3.1's and Qwen 2.5's templates: arguments | tojson
TOJSON_TEMPLATE = ("{% for m in messages %}{{ m.role }}:"
                   "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name }}"
                   "{{ c.function.arguments | tojson }};{% endfor %}{% else %}{{ m.content }}{% endif %}\n"
                   "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


class _RecordingTokenizer:
    """apply_chat_template through transformers' Jinja environment, returning the text's
    characters as ids (enough to read back what the template saw)."""
    chat_template = TOJSON_TEMPLATE
    bos = 1

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, chat_template=None,
                            **kwargs):
        from transformers.utils.chat_template_utils import render_jinja_template
        rendered, _ = render_jinja_template(conversations=[messages], chat_template=chat_template or self.chat_template,
                                            add_generation_prompt=add_generation_prompt, **kwargs)
        text = rendered[0]
        return [ord(ch) for ch in text] if tokenize else text

    def encode(self, text, add_special_tokens=True):
        return ([self.bos] if add_special_tokens else []) + [ord(ch) for ch in text]


def _text(ids) -> str:
    return "".join(chr(i) for i in ids)


def test_tool_call_arguments_reach_the_template_parsed():
    msgs = template_messages(TOOL_HISTORY)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[1]["tool_calls"][1]["function"]["arguments"] == {}
    # the caller's messages stay as sent
    assert TOOL_HISTORY[1]["tool_calls"][0]["function"]["arguments"] == "{\"city\": \"Paris\"}"
    text = _text(chat_prompt_ids(_RecordingTokenizer(), TOOL_HISTORY))
    assert 'get_weather{"city": "Paris"};' in text and "now{};" in text, text
    assert "\\\"" not in text  # no JSON inside a JSON string
    # a malformed call in the history (a model's own, an earlier turn) renders with {} as upstream
    # renders it: refusing it would fail every later turn of the conversation
    bad = [dict(TOOL_HISTORY[1], tool_calls=[{"function": {"name": "f", "arguments": "{not json"}},
                                             {"function": {"name": "g", "arguments": "[1, 2]"}}])]
    assert [c["function"]["arguments"] for c in template_messages(bad)[0]["tool_calls"]] == [{}, {}]
    # an empty tool_calls list is dropped; null content is empty
    msgs = template_messages([{"role": "assistant", "content": "hi", "tool_calls": []}])
    assert "tool_calls" not in msgs[0]


def test_chat_ids_are_transformers_and_tokenization_arguments_are_inert():
    """The prompt ids are transformers' apply_chat_template(tokenize=True) ids; the
    tokenization arguments transformers takes (truncation, padding, return_tensors, ...) given
    as chat_template_kwargs change nothing, as upstream renders to text and tokenizes after;
    a null content (OpenAI clients send it beside tool_calls) renders as empty."""
    from vllm import LLM
    tok = LLM(device="cpu").get_tokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3 + 3?"}]
    want = list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False))
    assert chat_prompt_ids(tok, msgs) == want
    for kwargs in ({"truncation": True, "max_length": 4}, {"padding": "max_length", "max_length": 200},
                   {"return_tensors": "pt"}, {"return_dict": True}):
        assert chat_prompt_ids(tok, msgs, template_kwargs=kwargs) == want, kwargs
    from vllm.entrypoints.chat_template import apply_content_format
    nulls = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]},
             {"role": "assistant"}, {"role": "tool", "content": [{"type": "text", "text": "a"}, "b"]}]
    got = apply_content_format(nulls, "string", tok.chat_template)
    assert [m["content"] for m in got] == ["", "", "a\nb"]
    got = apply_content_format(nulls, "openai", tok.chat_template)
    assert [m["content"] for m in got] == [[], [], "a\nb"]     # a tool message's parts joined in either format


def test_chat_template_override_and_special_tokens(tmp_path):
    tok = _RecordingTokenizer()
    msgs = [{"role": "user", "content": "hi"}]
    assert _text(chat_prompt_ids(tok, msgs, chat_template="[{{ messages[0].content }}]")) == "[hi]"
    path = tmp_path / "t.jinja"
    path.write_text("<{{ messages[0].content }}>")
    assert load_chat_template(str(path)) == "<{{ messages[0].content }}>"
    assert load_chat_template("{{ x }}") == "{{ x }}" and load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with_bos = chat_prompt_ids(tok, msgs, add_special_tokens=True)
    assert with_bos[0] == tok.bos and with_bos[1:] == chat_prompt_ids(tok, msgs)
    with pytest.raises(ValueError, match="cannot both be true"):
        chat_prompt_ids(tok, msgs, continue_final_message=True)


def _params(req):
    return req.to_sampling_params({}, 20)


def test_guided_fields_map_to_structured_outputs():
    so = _params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                       guided_choice=["yes", "no"])).structured_outputs
    assert so is not None and so.choice == ["yes", "no"]
    so = _params(CompletionRequest(prompt="x", guided_regex="[0-9]+", guided_decoding_backend="outlines")
                 ).structured_outputs
    assert so.regex == "[0-9]+"
    with pytest.raises(ValueError, match="give one guided_"):
        _params(CompletionRequest(prompt="x", guided_regex="a", guided_choice=["a"]))
    with pytest.raises(ValueError, match="give one of response_format, structured_outputs and guided_"):
        _params(CompletionRequest(prompt="x", guided_regex="a", structured_outputs={"regex": "b"}))


@pytest.mark.parametrize("field, value", [("bad_words", ["2"]), ("allowed_token_ids", [1, 2]),
                                          ("use_beam_search", True), ("length_penalty", 2.0),
                                          ("logits_processors", ["x"]), ("watermarking", True),
                                          ("logprob_token_ids", [3, 4]), ("thinking_token_budget", 8),
                                          ("repetition_detection", {"max_pattern_size": 4}),
                                          ("media_io_kwargs", {"image": {"x": 1}})])
def test_upstream_fields_that_change_sampling_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        _params(CompletionRequest(prompt="x", **{field: value}))
    # at their no-op values they are accepted, and never reported as ignored
    noop = {"bad_words": [], "allowed_token_ids": None, "use_beam_search": False, "length_penalty": 1.0,
            "logits_processors": [], "watermarking": False, "logprob_token_ids": None, "thinking_token_budget": -1,
            "repetition_detection": None, "media_io_kwargs": {}}[field]
    req = CompletionRequest(prompt="x", **{field: noop})
    _params(req)
    assert field not in req.ignored_fields()


def test_top_logprobs_zero_and_truncation():
    _params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=0))
    with pytest.raises(ValueError, match="top_logprobs requires logprobs"):
        _params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=1))
    req = CompletionRequest(prompt="x", truncate_prompt_tokens=3)
    assert req.truncate_prompt([1, 2, 3, 4, 5], 100) == [3, 4, 5]
    assert req.truncate_prompt([1, 2], 100) == [1, 2]
    assert CompletionRequest(prompt="x", truncate_prompt_tokens=-1).truncate_prompt(list(range(10)), 4) == [7, 8, 9]
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens value \(5\) is greater than max_model_len \(4\)"):
        CompletionRequest(prompt="x", truncate_prompt_tokens=5).truncate_prompt([1, 2], 4)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        _params(CompletionRequest(prompt="x", truncate_prompt_tokens=0))


def test_generation_config_repetition_penalty_and_max_new_tokens(tmp_path):
    from vllm.config import ModelConfig
    from vllm.entrypoints.llm import default_model_path

    d = tmp_path / "m"
    shutil.copytree(default_model_path(), d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen.update(repetition_penalty=1.05, max_new_tokens=7, temperature=0.6)
    (d / "generation_config.json").write_text(json.dumps(gen))
    defaults = ModelConfig.from_pretrained(str(d)).generation_defaults
    assert defaults == {"temperature": 0.6, "repetition_penalty": 1.05, "max_tokens": 7}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    p = chat.to_sampling_params(defaults, 20)  # max_new_tokens applies at the server, within the context
    assert (p.max_tokens, p.repetition_penalty, p.temperature) == (None, 1.05, 0.6)
    p = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=3,
                              repetition_penalty=1.0).to_sampling_params(defaults, 20)
    assert (p.max_tokens, p.repetition_penalty) == (3, 1.0)


def test_serve_accepts_upstream_flags():
    import argparse

    from vllm.entrypoints.cli import serve
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "m", "--enable-prefix-caching", "--enable-chunked-prefill",
                              "--trust-remote-code", "--disable-log-requests", "--chat-template", "{{ x }}",
                              "--trust-request-chat-template", "--return-tokens-as-token-ids"])
    assert args.enable_prefix_caching and args.enable_chunked_prefill and args.trust_request_chat_template
    args = parser.parse_args(["serve", "--no-enable-prefix-caching", "--no-enable-chunked-prefill"])
    assert not args.enable_prefix_caching and not args.enable_chunked_prefill
    for name in ("qwen3", "deepseek_r1", "nemotron_v3"):
        assert parser.parse_args(["serve", "m", "--reasoning-parser", name]).reasoning_parser == name
    with pytest.raises(SystemExit):   # argparse refuses a name outside the choices
        parser.parse_args(["serve", "m", "--reasoning-parser", "nemotron_v2"])


REASONING_CASES = [  # (parser, text, reasoning, content)
    ("qwen3", "<think>\nadd the units\n</think>\n\n105", "\nadd the units\n", "\n\n105"),
    ("qwen3", "105", None, "105"),                                  # thinking off
    ("qwen3", "<think>still thinking", "still thinking", None),      # cut by max_tokens
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "a</think>b", None, "a</think>b"),                     # no <think> opened: thinking off
    ("deepseek_r1", "add the units</think>105", "add the units", "105"),
    ("deepseek_r1", "<think>x</think>y", "x", "y"),
    ("deepseek_r1", "no end yet", "no end yet", None),
    ("deepseek_r1", "</think>105", None, "105"),
    # nemotron_v3 splits as deepseek_r1 does (its swap needs chat_template_kwargs, below)
    ("nemotron_v3", "add the units</think>105", "add the units", "105"),
    ("nemotron_v3", "<think>x</think>y", "x", "y"),
    ("nemotron_v3", "no end yet", "no end yet", None),
    ("nemotron_v3", "</think>105", None, "105"),
]


def _stream_split(parser: str, text: str, step: int, chat_template_kwargs=None) -> list[tuple[str, str]]:
    """The pieces ReasoningStream gives for `text` fed in deltas of `step` characters."""
    from vllm.entrypoints.openai.reasoning import ReasoningStream
    stream = ReasoningStream(parser, chat_template_kwargs)
    chunks = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    return [p for i, chunk in enumerate(chunks) for p in stream.feed(chunk, i == len(chunks) - 1)]


OFF, FORCE = {"enable_thinking": False}, {"force_nonempty_content": True}
NEMOTRON_SWAP_CASES = [  # (chat_template_kwargs, text, reasoning, content) under nemotron_v3
    (OFF, "The answer is 105", None, "The answer is 105"),           # no </think>: swapped
    (FORCE, "<think>cut by max_tokens", None, "cut by max_tokens"),
    ({**OFF, **FORCE}, "all</think>", None, "all"),                   # nothing after </think>
    (FORCE, "thought</think>\n\n", "\n\n", "thought"),               # whitespace only: a plain swap
    (FORCE, "thought</think>105", "thought", "105"),                  # an answer came: no swap
    (OFF, "thought</think>105", "thought", "105"),
    ({"enable_thinking": True}, "no end yet", "no end yet", None),    # the rule is off
    ({"force_nonempty_content": False}, "no end yet", "no end yet", None),
    ({"enable_thinking": 0}, "no end yet", "no end yet", None),       # only false itself, as upstream
    ({}, "no end yet", "no end yet", None),
    (None, "no end yet", "no end yet", None),
    (FORCE, "", None, None),                                           # nothing to swap
]


@pytest.mark.parametrize("kwargs, text, reasoning, content", NEMOTRON_SWAP_CASES)
def test_nemotron_v3_swaps_reasoning_into_an_empty_content(kwargs, text, reasoning, content):
    from vllm.entrypoints.openai.reasoning import split_reasoning
    assert split_reasoning("nemotron_v3", text, kwargs) == (reasoning, content)
    # the rule is nemotron_v3's own: the other parsers read the same kwargs as nothing
    assert split_reasoning("deepseek_r1", text, kwargs) == split_reasoning("deepseek_r1", text)


@pytest.mark.parametrize("kwargs", [OFF, FORCE, None])
@pytest.mark.parametrize("text", ["The answer is 105", "<think>cut by max_tokens", "a</think>b", "a</think>",
                                  "a</think>\n", ""])
def test_nemotron_v3_stream_repeats_unterminated_reasoning_as_content(kwargs, text):
    """A stream cannot take back the reasoning it sent: under the rule an output that ends
    without </think> gets the whole reasoning once more as content, in the last pieces (as
    upstream's stream); one that closed its reasoning streams as deepseek_r1's does."""
    from vllm.entrypoints.openai.reasoning import split_reasoning
    plain = split_reasoning("deepseek_r1", text)
    forced = kwargs is not None and "</think>" not in text and plain[0] is not None
    for step in (1, 2, 3, 5, max(len(text), 1)):
        pieces = _stream_split("nemotron_v3", text, step, kwargs)
        got = tuple("".join(t for kind, t in pieces if kind == k) or None for k in ("reasoning", "content"))
        assert got == ((plain[0], plain[0]) if forced else plain), (step, pieces)
        if forced:   # the repeat is the last piece, after every reasoning piece
            assert pieces[-1] == ("content", plain[0]) and all(k == "reasoning" for k, _ in pieces[:-1])
        assert pieces == _stream_split("deepseek_r1", text, step, kwargs) or forced


@pytest.mark.parametrize("parser, text, reasoning, content", REASONING_CASES)
def test_reasoning_split_whole_and_streamed(parser, text, reasoning, content):
    from vllm.entrypoints.openai.reasoning import ReasoningStream, split_reasoning
    assert split_reasoning(parser, text) == (reasoning, content)
    for step in (1, 2, 3, 5, len(text)):  # every way of cutting the text into deltas
        stream = ReasoningStream(parser)
        got = {"reasoning": "", "content": ""}
        chunks = [text[i:i + step] for i in range(0, len(text), step)]
        for i, chunk in enumerate(chunks):
            for kind, piece in stream.feed(chunk, i == len(chunks) - 1):
                got[kind] += piece
        assert (got["reasoning"] or None, got["content"] or None) == (reasoning, content), (step, got)


def test_reasoning_apart_from_tool_calls():
    from types import SimpleNamespace

    from vllm.entrypoints.openai.serving import _chat_finish, _chat_message
    from vllm.entrypoints.openai.tool_calls import plan_tools
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    plan = plan_tools(tools, "auto", None, "hermes")
    c = SimpleNamespace(text='<think>I need add</think><tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
                        finish_reason="stop")
    msg = _chat_message(c, plan, "qwen3")
    assert msg.reasoning == msg.reasoning_content == "I need add"
    assert [t.function.name for t in msg.tool_calls] == ["add"] and not msg.content
    assert _chat_finish(c, plan, "qwen3") == "tool_calls"
    # nemotron_v3 (Nemotron 3 calls tools in qwen3_xml's format): a call the swap moves out of an
    # unterminated reasoning is parsed from the content, as any content's (an argument the schema
    # does not name stays a string)
    xml = plan_tools(tools, "auto", None, "qwen3_xml")
    c = SimpleNamespace(text="I need add\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
                             "</function>\n</tool_call>", finish_reason="stop")
    msg = _chat_message(c, xml, "nemotron_v3", chat_template_kwargs={"force_nonempty_content": True})
    assert msg.reasoning is None and msg.content.strip() == "I need add"
    assert [(t.function.name, t.function.arguments) for t in msg.tool_calls] == [("add", '{"a": "1"}')]
    assert _chat_finish(c, xml, "nemotron_v3", {"force_nonempty_content": True}) == "tool_calls"
    assert _chat_finish(c, xml, "nemotron_v3") == "stop" and not _chat_message(c, xml, "nemotron_v3").tool_calls
    # without a parser the message is the text, and no reasoning key is sent
    plain = _chat_message(SimpleNamespace(text="105", finish_reason="stop"), plan_tools(None, None, None, "hermes"))
    assert plain.model_dump() == {"role": "assistant", "content": "105", "tool_calls": None}


# ---- through the app ------------------------------------------------------------------------

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def app():
    from vllm import LLM
    from vllm.entrypoints.openai.api_server import build_app_from_llm
    app = build_app_from_llm(LLM(device="cpu"))
    yield app
    app.state.serving.llm.shutdown()


def _post(app, path: str, body: dict):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            return await c.post(path, json=body)
    return asyncio.run(go())


def test_completion_prompt_options_through_the_app(app):
    tok = app.state.serving.llm.tokenizer
    text = "What is 47 + 58?"
    body = {"prompt": text, "max_tokens": 2, "temperature": 0, "echo": True}
    plain = _post(app, "/v1/completions", body).json()["choices"][0]
    assert plain["prompt_token_ids"] == list(tok.encode(text, add_special_tokens=True))
    no_special = _post(app, "/v1/completions", dict(body, add_special_tokens=False)).json()["choices"][0]
    assert no_special["prompt_token_ids"] == list(tok.encode(text, add_special_tokens=False))
    assert no_special["text"].startswith(text)  # nothing cut: echo keeps the text as given
    cut = _post(app, "/v1/completions", dict(body, truncate_prompt_tokens=3)).json()["choices"][0]
    assert cut["prompt_token_ids"] == plain["prompt_token_ids"][-3:]
    assert cut["text"].startswith(tok.decode(plain["prompt_token_ids"][-3:]))


def test_chat_template_in_a_request_needs_the_server_s_trust(app):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template": "{{ 'x' }}"}
    r = _post(app, "/v1/chat/completions", body)
    assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]
    serving = app.state.serving
    serving.trust_request_chat_template = True
    try:
        r = _post(app, "/tokenize", {"messages": body["messages"], "chat_template": "{{ messages[0].content }}!"})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == list(serving.llm.tokenizer.encode("hi!", add_special_tokens=False))
    finally:
        serving.trust_request_chat_template = False
    r = _post(app, "/tokenize", {"prompt": "hi there", "return_token_strs": True}).json()
    assert r["token_strs"] == serving.llm.tokenizer.convert_ids_to_tokens(r["tokens"])
    r = _post(app, "/v1/completions", {"prompt": "hi", "bad_words": ["2"]})
    assert r.status_code == 400 and "bad_words" in r.json()["error"]["message"]


def test_tokenize_with_tool_history_parses_arguments(app, monkeypatch):
    serving = app.state.serving
    monkeypatch.setattr(serving, "chat_template", TOJSON_TEMPLATE)
    r = _post(app, "/tokenize", {"messages": TOOL_HISTORY, "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    text = serving.llm.tokenizer.decode(r.json()["tokens"])
    assert 'get_weather{"city": "Paris"};' in text, text


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([os.path.abspath(__file__), "-q"]))


def test_constrained_output_behind_closed_thinking_and_max_new_tokens_is_a_soft_cap(app, monkeypatch):
    """Behind a prompt that closed the reasoning (thinking off) a constrained output is all
    answer, constrained from its first token, whatever the reasoning parser."""
    serving = app.state.serving
    monkeypatch.setattr(serving, "reasoning_parser", "deepseek_r1")
    body = {"messages": [{"role": "user", "content": "What is 47 + 58?"},
                         {"role": "assistant", "content": "<think>\n\n</think>\n\n"}],
            "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 6, "temperature": 0,
            "guided_choice": ["105", "106"]}
    msg = _post(app, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert msg["content"] in ("105", "106") and "reasoning" not in msg
    body["messages"] = body["messages"][:1]
    # generation_config's max_new_tokens beyond the context left: capped, not a 400
    monkeypatch.setitem(serving.defaults, "max_tokens", 10 ** 6)
    monkeypatch.setattr(serving, "reasoning_parser", None)
    r = _post(app, "/v1/chat/completions", {"messages": body["messages"], "temperature": 0})
    assert r.status_code == 200, r.text
    monkeypatch.setitem(serving.defaults, "max_tokens", 2)
    r = _post(app, "/v1/chat/completions", {"messages": body["messages"], "temperature": 0, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 2
    # completions too, for a text and a token-id prompt (max_tokens unset or null), as upstream
    # completions too (max_tokens null; left out, it is the OpenAI default 16), for a text and a
    # token-id prompt, as upstream
    for prompt in ("hello", [5, 6, 7]):
        for extra, want in (({"max_tokens": None}, 2), ({}, 16)):
            r = _post(app, "/v1/completions", {"prompt": prompt, "temperature": 0, "ignore_eos": True, **extra})
            assert r.json()["usage"]["completion_tokens"] == want, r.text


def test_echo_keeps_an_explicit_smaller_prompt_logprobs(app):
    """echo + logprobs=3 + prompt_logprobs=1: the prompt positions report 1 alternative (the
    request's own prompt_logprobs), as upstream; without prompt_logprobs they report 3."""
    body = {"prompt": "hello there", "max_tokens": 1, "echo": True, "logprobs": 3, "temperature": 0}
    def prompt_positions(extra):
        choice = _post(app, "/v1/completions", dict(body, **extra)).json()["choices"][0]
        return [len(d) for d in choice["logprobs"]["top_logprobs"][1:-1]]   # echoed prompt tokens, not the first
    assert prompt_positions({"prompt_logprobs": 1}) == [2, 2, 2]   # the token's own entry and 1 alternative
    assert prompt_positions({}) == [4, 4, 4]


def test_reasoning_parser_through_the_app(app):
    """The embedded model never thinks: qwen3 gives all content, deepseek_r1 (the reasoning
    opened by the prompt) all reasoning; streamed deltas add up to the same."""
    serving = app.state.serving
    body = {"messages": [{"role": "user", "content": "What is 47 + 58?"}], "max_tokens": 4, "temperature": 0}
    try:
        for parser in ("qwen3", "deepseek_r1"):
            serving.reasoning_parser = parser
            msg = _post(app, "/v1/chat/completions", body).json()["choices"][0]["message"]
            text = msg["content"] if parser == "qwen3" else msg["reasoning"]
            assert text and msg.get("reasoning_content") == msg.get("reasoning")
            assert (msg.get("reasoning"), msg["content"]) == ((None, text) if parser == "qwen3" else (text, None))
            events = _post(app, "/v1/chat/completions", dict(body, stream=True)).text
            deltas = [json.loads(e[6:])["choices"] for e in events.split("\n\n") if e.startswith("data: {")]
            key = "content" if parser == "qwen3" else "reasoning"
            assert "".join(c[0]["delta"].get(key, "") for c in deltas if c) == text
    finally:
        serving.reasoning_parser = None


def _chat_both_ways(app, body: dict) -> tuple[dict, list[dict]]:
    """The message of a chat request, and the deltas of the same request streamed."""
    msg = _post(app, "/v1/chat/completions", body).json()["choices"][0]["message"]
    events = _post(app, "/v1/chat/completions", dict(body, stream=True)).text
    chunks = [json.loads(e[6:])["choices"] for e in events.split("\n\n") if e.startswith("data: {")]
    return msg, [c[0]["delta"] for c in chunks if c]


def test_nemotron_v3_through_the_app(app):
    """The embedded model never closes a reasoning it is put in: under nemotron_v3 its output is
    all reasoning, as deepseek_r1's, unless chat_template_kwargs turn thinking off or ask for a
    non-empty content: then the message's content is that text and it has no reasoning, and the
    stream sends the reasoning and then the same text once more as content, in its last delta."""
    serving = app.state.serving
    body = {"messages": [{"role": "user", "content": "What is 47 + 58?"}], "max_tokens": 4, "temperature": 0}
    try:
        serving.reasoning_parser = "nemotron_v3"
        msg, deltas = _chat_both_ways(app, body)
        text = msg["reasoning"]
        assert text and msg["content"] is None and msg["reasoning_content"] == text
        assert "".join(d.get("reasoning", "") for d in deltas) == text
        assert not any(d.get("content") for d in deltas)
        for kwargs in ({"enable_thinking": False}, {"force_nonempty_content": True}):
            msg, deltas = _chat_both_ways(app, dict(body, chat_template_kwargs=kwargs))
            assert msg["content"] == text and "reasoning" not in msg and "reasoning_content" not in msg, kwargs
            assert "".join(d.get("reasoning", "") for d in deltas) == text
            assert [d["content"] for d in deltas if d.get("content")] == [text]
            assert deltas[-1].get("content") == text
            # without the reasoning in the response the content still comes, whole and streamed
            msg, deltas = _chat_both_ways(app, dict(body, chat_template_kwargs=kwargs, include_reasoning=False))
            assert msg["content"] == text and "reasoning" not in msg
            assert "".join(d.get("content") or "" for d in deltas) == text
            assert not any("reasoning" in d for d in deltas)
        # behind a prompt that closed the reasoning (thinking off) the output is all content,
        # as deepseek_r1's, with or without the kwargs
        closed = dict(body, messages=body["messages"] + [{"role": "assistant", "content": "<think>\n\n</think>\n\n"}],
                      add_generation_prompt=False, continue_final_message=True)
        for kwargs in (None, {"force_nonempty_content": True}):
            msg, deltas = _chat_both_ways(app, dict(closed, chat_template_kwargs=kwargs))
            assert msg["content"] and "reasoning" not in msg
            assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
            assert not any("reasoning" in d for d in deltas)
    finally:
        serving.reasoning_parser = None


def test_named_tool_choice_behind_reasoning_streams_what_the_message_holds(app):
    """A named tool_choice under a reasoning parser: while the output is all reasoning there is
    no call, streamed or not (the stream sent a call head with empty arguments mid-reasoning)."""
    serving = app.state.serving
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 5, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "add"}}}
    try:
        serving.reasoning_parser = "deepseek_r1"
        msg = _post(app, "/v1/chat/completions", body).json()["choices"][0]["message"]
        events = _post(app, "/v1/chat/completions", dict(body, stream=True)).text
        deltas = [json.loads(e[6:])["choices"] for e in events.split("\n\n") if e.startswith("data: {")]
        streamed_calls = [t for c in deltas if c for t in c[0]["delta"].get("tool_calls") or []]
        assert msg["reasoning"] and not msg.get("tool_calls") and not streamed_calls
    finally:
        serving.reasoning_parser = None


def test_qwen3_parser_behind_a_prompt_that_opens_think(app):
    """A template that ends the prompt in <think> (Qwen3's Thinking releases) leaves the output
    inside the reasoning: qwen3 reads it as deepseek_r1 does, whole and streamed (here the
    prompt opens it through continue_final_message)."""
    serving = app.state.serving
    body = {"messages": [{"role": "user", "content": "What is 47 + 58?"}, {"role": "assistant", "content": "<think>\n"}],
            "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 4, "temperature": 0}
    try:
        serving.reasoning_parser = "qwen3"
        msg = _post(app, "/v1/chat/completions", body).json()["choices"][0]["message"]
        assert msg["reasoning"] and msg["content"] is None
        events = _post(app, "/v1/chat/completions", dict(body, stream=True)).text
        deltas = [json.loads(e[6:])["choices"] for e in events.split("\n\n") if e.startswith("data: {")]
        assert "".join(c[0]["delta"].get("reasoning", "") for c in deltas if c) == msg["reasoning"]
        assert not any(c[0]["delta"].get("content") for c in deltas if c)
    finally:
        serving.reasoning_parser = None


def test_latency_histograms():
    from vllm.entrypoints.openai.latency import Histogram, LatencyStats, RequestTimes
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)] and h.sum == pytest.approx(3.65)
    lat = LatencyStats()
    t = RequestTimes(arrival=10.0)
    lat.tokens(t, 0, 1, 10.5)     # first token: TTFT 0.5
    lat.tokens(t, 0, 2, 10.9)     # two tokens 0.4 s later: two gaps of 0.2
    lat.tokens(t, 1, 1, 11.0)     # another sample's first token: no gap, no second TTFT
    lat.finished(t, 11.0)
    assert lat.ttft.sum == 0.5 and sum(lat.ttft.counts) == 1
    assert sum(lat.itl.counts) == 2 and lat.itl.sum == pytest.approx(0.4)
    assert lat.e2e.sum == 1.0
    assert t.scheduled is None and all(sum(h.counts) == 0 for h in (lat.queue, lat.prefill, lat.decode,
                                                                       lat.inference, lat.tpot))


def test_latency_phases():
    """Queue, prefill, decode, inference and per-output-token times of finished requests, from
    the engine core's first scheduling of each sample (the earliest of a request's samples')."""
    from vllm.entrypoints.openai.latency import LatencyStats, RequestTimes
    lat = LatencyStats()
    t = RequestTimes(arrival=10.0)
    lat.tokens(t, 1, 0, 10.3, scheduled=10.25)   # a sample's first delta may carry no token
    lat.tokens(t, 0, 1, 10.5, scheduled=10.2)    # first token; sample 0 was scheduled earlier
    lat.tokens(t, 1, 1, 10.6)
    lat.tokens(t, 0, 4, 11.0)
    lat.finished(t, 11.0, max_generated=5)
    assert t.scheduled == 10.2
    assert (lat.queue.sum, lat.prefill.sum, lat.decode.sum, lat.inference.sum, lat.tpot.sum) == pytest.approx(
        (0.2, 0.3, 0.5, 0.8, 0.5 / 4))
    assert all(sum(h.counts) == 1 for h in (lat.queue, lat.prefill, lat.decode, lat.inference, lat.tpot))
    # one token: no time per output token; no token (ended while prefilling): queue time only;
    # never scheduled (ended while waiting): none of the phases
    one, none, waiting = RequestTimes(20.0), RequestTimes(30.0), RequestTimes(40.0)
    lat.tokens(one, 0, 1, 20.5, scheduled=20.1)
    lat.finished(one, 20.5, max_generated=1)
    lat.tokens(none, 0, 0, 30.4, scheduled=30.1)
    lat.finished(none, 30.4)
    lat.finished(waiting, 40.4)
    assert [sum(h.counts) for h in (lat.queue, lat.prefill, lat.decode, lat.inference, lat.tpot, lat.e2e)] == [
        3, 2, 2, 2, 1, 4]
    assert lat.queue.sum == pytest.approx(0.2 + 0.1 + 0.1) and lat.decode.sum == pytest.approx(0.5)


def _series(text: str, suffix: str) -> dict[str, float]:
    """{metric name: value} of the exposition's `<name>_<suffix>{...} value` lines."""
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("vllm:") and f"_{suffix}{{" in line}


PHASE_HISTOGRAMS = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                    "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                    "vllm:request_time_per_output_token_seconds")


def _scrape(app) -> str:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.get("/metrics")).text
    return asyncio.run(go())


def test_latency_metrics_through_the_app(app):
    pytest.importorskip("prometheus_client")
    _post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    text = _scrape(app)
    counts = _series(text, "count")
    assert counts["vllm:time_to_first_token_seconds_count"] >= 1
    assert counts["vllm:e2e_request_latency_seconds_count"] >= 1
    assert counts["vllm:inter_token_latency_seconds_count"] >= 2
    model = app.state.serving.names[0]
    for name in (*PHASE_HISTOGRAMS, "vllm:time_per_output_token_seconds"):
        assert counts[f"{name}_count"] >= 1, name
        for suffix in ('_bucket{le="+Inf",', "_sum{", "_count{"):
            assert f'{name}{suffix}model_name="{model}"}}' in text, (name, suffix)
    sums = _series(text, "sum")
    # a request of n = 2 samples of 3 tokens each: per sample prompt and generation counts, per
    # request n, max_tokens, its longest sample and its phases
    _post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 0.5, "seed": 1, "n": 2,
                                   "ignore_eos": True})
    text = _scrape(app)
    moved = {k: v - counts[k] for k, v in _series(text, "count").items() if k.startswith("vllm:request_")}
    assert moved == {"vllm:request_prompt_tokens_count": 2, "vllm:request_generation_tokens_count": 2,
                     "vllm:request_max_num_generation_tokens_count": 1, "vllm:request_params_n_count": 1,
                     "vllm:request_params_max_tokens_count": 1, **{f"{name}_count": 1 for name in PHASE_HISTOGRAMS}}
    after = _series(text, "sum")
    assert after["vllm:request_generation_tokens_sum"] - sums["vllm:request_generation_tokens_sum"] == 6
    assert after["vllm:request_params_n_sum"] - sums["vllm:request_params_n_sum"] == 2
    queue, prefill, decode, inference, per_token = (after[f"{name}_sum"] - sums[f"{name}_sum"]
                                                    for name in PHASE_HISTOGRAMS)
    # one clock: arrival before the first scheduling before the first token; the inference
    # time is the prefill's and the decode's (the engine core's stamp and the API server's
    # clock read the same system-wide monotonic clock)
    assert queue >= 0 and prefill > 0 and decode > 0
    assert inference == pytest.approx(prefill + decode, abs=1e-6)
    assert per_token == pytest.approx(decode / 2, abs=1e-6)   # its longest sample: 3 tokens, 2 after the first
    # the older name reads the inter-token latency histogram itself
    def lines(prefix):   # each series line after the name: suffix, labels and value
        return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]
    itl = lines("vllm:inter_token_latency_seconds")
    assert lines("vllm:time_per_output_token_seconds") == itl and len(itl) > 3


def test_deltas_without_scheduled_time_still_parse(app):
    """A delta tuple built without its scheduled time (the layout before that field; and
    without prompt_logprobs) parses: the request runs as it does with the field, and counts
    in no phase histogram, having no scheduled time."""
    from vllm.engine.core_messages import RequestDelta
    d = RequestDelta(*("r", 0, [5], None, None, None, [0], 0))
    assert d.prompt_logprobs is None and d.scheduled_time is None
    body = {"prompt": "hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    ref = _post(app, "/v1/completions", body).json()["choices"][0]["text"]
    llm = app.state.serving.llm
    lat, client = llm.latency, llm.client
    before = [sum(h.counts) for h in (lat.e2e, lat.queue, lat.prefill, lat.decode, lat.tpot)]
    on_outputs = client.on_outputs
    n_fields = len(RequestDelta._fields) - 1
    client.on_outputs = lambda out: on_outputs(out._replace(deltas=[t[:n_fields] for t in out.deltas]))


    async def post():   # bounded: a batch the receiver cannot parse is dropped, and its request never ends
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await asyncio.wait_for(c.post("/v1/completions", json=body), 30)
    try:
        got = asyncio.run(post()).json()["choices"][0]["text"]
    finally:
        client.on_outputs = on_outputs
    assert got == ref
    moved = [sum(h.counts) - b for h, b in zip((lat.e2e, lat.queue, lat.prefill, lat.decode, lat.tpot), before)]
    assert moved == [1, 0, 0, 0, 0]


def test_async_llm_request_ids_after_abort_and_within_a_batch():
    """A request id reused right after an abort gets only its own tokens (the aborted one's
    last step may still report: each add has an engine id of its own); one id named twice in
    a batch and beside a running request runs each on its own, and an abort by it ends all."""
    from vllm import LLM, SamplingParams
    from vllm.entrypoints.openai.async_engine import AsyncLLM
    llm = AsyncLLM.from_engine(LLM(device="cpu").llm_engine)
    sent, send = [], llm.client.send

    def spy(msgs):
        sent.extend(m.request_id for m in msgs if type(m).__name__ == "AddRequest")
        return send(msgs)
    llm.client.send = spy
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def go():
        ref = [out async for out in llm.generate({"prompt_token_ids": [7, 8, 9]}, short, "ref")][-1]
        got = []
        for trial in range(8):
            background = [asyncio.ensure_future(_drain(llm, f"bg{trial}-{k}", short)) for k in range(4)]
            (a,) = await llm.add_requests([("x", {"prompt_token_ids": [5, 6]}, long)], stream=True)
            n = 0
            async for _ in a:
                n += 1
                if n == 2:
                    break
            a.abort()
            got.append([out async for out in llm.generate({"prompt_token_ids": [7, 8, 9]}, short, "x")][-1])
            await asyncio.gather(*background)
        # one id twice, in one call and beside a running one: each runs on its own (as upstream)
        running = asyncio.ensure_future(_drain(llm, "d", short))
        d1, d2 = await llm.add_requests([("d", {"prompt_token_ids": [7, 8, 9]}, short),
                                         ("d", {"prompt_token_ids": [7, 8, 9]}, short)])
        dups = [[o async for o in s][-1] for s in (d1, d2)] + [await running]
        assert all(o.request_id == "d" and o.outputs[0].finish_reason == "length" for o in dups)
        assert all(o.outputs[0].token_ids == ref.outputs[0].token_ids for o in dups[:2])
        # an abort by a shared id ends every request running under it
        e1, e2 = await llm.add_requests([("e", {"prompt_token_ids": [5, 6]}, long),
                                         ("e", {"prompt_token_ids": [5, 6]}, long)], stream=True)
        llm.abort("e")
        ended = [[o async for o in s] for s in (e1, e2)]
        assert all(not outs or outs[-1].outputs[0].finish_reason != "length" for outs in ended)
        assert "e" not in llm._engine_ids
        return ref, got, llm._outstanding
    try:
        ref, got, outstanding = asyncio.run(go())
    finally:
        llm.shutdown()
    assert all(o.outputs[0].token_ids == ref.outputs[0].token_ids for o in got)
    assert all(o.request_id == "x" for o in got)
    x_ids = [r for r in sent if r.startswith("x@")]
    assert len(x_ids) == 16 and len(set(x_ids)) == 16  # every add of "x" had an engine id of its own
    assert outstanding == 0


async def _drain(llm, rid, params):
    return [out async for out in llm.generate({"prompt_token_ids": [3, 4]}, params, rid)][-1]


def test_async_llm_stream_abort_and_params_copies():
    """A finished stream cancelled late aborts nothing of a newer request reusing its id; a
    batch with params made invalid after construction registers nothing; abort_requests of
    ids not running aborts nothing."""
    from vllm import LLM, SamplingParams
    from vllm.entrypoints.openai.async_engine import AsyncLLM
    llm = AsyncLLM.from_engine(LLM(device="cpu").llm_engine)
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def go():
        (a,) = await llm.add_requests([("x", {"prompt_token_ids": [5, 6]}, short)])
        while "x" in llm._engine_ids:   # finished in the receiver thread, not read yet
            await asyncio.sleep(0.01)
        (b,) = await llm.add_requests([("x", {"prompt_token_ids": [5, 6]}, short)])
        a.abort()                        # the old stream's consumer gives up late
        got_b = [out async for out in b][-1]
        bad = SamplingParams(max_tokens=2)
        bad.top_p = 0.0
        with pytest.raises(ValueError, match="top_p"):
            await llm.add_requests([("y", "hi", short), ("z", "hi", bad)])
        none = await llm.abort_requests(["not-running", "x@0"])
        return got_b, dict(llm._engine_ids), none
    try:
        got_b, ids, none = asyncio.run(go())
    finally:
        llm.shutdown()
    assert got_b.finished and len(got_b.outputs[0].token_ids) == 3
    assert ids == {} and none == {"aborted": []}


def test_async_llm_output_kinds():
    """AsyncLLM honours SamplingParams.output_kind as upstream's does: CUMULATIVE outputs hold
    everything so far, DELTA only what is new (text, token ids and logprobs add up to the final
    cumulative output, sample by sample), FINAL_ONLY one output, the final one, even streamed."""
    from vllm import LLM, SamplingParams
    from vllm.entrypoints.openai.async_engine import AsyncLLM
    from vllm.sampling_params import RequestOutputKind
    llm = AsyncLLM.from_engine(LLM(device="cpu").llm_engine)

    async def run(kind):
        params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, n=2, logprobs=1, ignore_eos=True,
                                output_kind=kind)
        return [out async for out in llm.generate("Count: 1, 2,", params, stream=True)]
    try:
        cumulative = asyncio.run(run(RequestOutputKind.CUMULATIVE))
        delta = asyncio.run(run(RequestOutputKind.DELTA))
        final = asyncio.run(run(RequestOutputKind.FINAL_ONLY))
    finally:
        llm.shutdown()
    want = {c.index: c for c in cumulative[-1].outputs}
    assert len(final) == 1 and final[0].finished
    assert [(c.index, c.text, c.token_ids) for c in final[0].outputs] == [(i, c.text, c.token_ids) for i, c in want.items()]
    assert len(delta) > 2 and delta[-1].finished and not any(o.finished for o in delta[:-1])
    for i, c in want.items():
        pieces = [p for o in delta for p in o.outputs if p.index == i]
        assert "".join(p.text for p in pieces) == c.text
        assert [t for p in pieces for t in p.token_ids] == c.token_ids
        assert [lp for p in pieces for lp in p.logprobs] == c.logprobs
        assert [p.finish_reason for p in pieces][-1] == "length" and all(p.finish_reason is None for p in pieces[:-1])


def test_async_llm_tail_streams():
    """add_requests(tail=True) (the server's streamed responses): each output carries every
    sample's text, token ids and logprobs since the previous one, whatever the output_kind; they
    add up to the cumulative final output, prompt fields on every output. DELTA without stream
    gives its one output whole."""
    from vllm import LLM, SamplingParams
    from vllm.entrypoints.openai.async_engine import AsyncLLM
    from vllm.sampling_params import RequestOutputKind
    llm = AsyncLLM.from_engine(LLM(device="cpu").llm_engine)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=7, n=2, logprobs=1, ignore_eos=True)

    async def run(tail, stream=True, p=params):
        (s,) = await llm.add_requests([("t", "Count: 1, 2,", p)], stream=stream, tail=tail)
        return [out async for out in s]
    try:
        cumulative = asyncio.run(run(False))
        tails = asyncio.run(run(True))
        one = asyncio.run(run(False, False, SamplingParams(temperature=0.8, seed=5, max_tokens=7, n=2, logprobs=1,
                                                           ignore_eos=True, output_kind=RequestOutputKind.DELTA)))
    finally:
        llm.shutdown()
    want = {c.index: c for c in cumulative[-1].outputs}
    assert tails[-1].finished and not any(o.finished for o in tails[:-1])
    assert all(o.prompt_token_ids == cumulative[-1].prompt_token_ids and len(o.outputs) == 2 for o in tails)
    for i, c in want.items():
        pieces = [p for o in tails for p in o.outputs if p.index == i]
        assert "".join(p.text for p in pieces) == c.text
        assert [t for p in pieces for t in p.token_ids] == c.token_ids
        assert [lp for p in pieces for lp in p.logprobs] == c.logprobs
    assert sum(len(p.token_ids) for o in tails for p in o.outputs) == 14
    assert len(one) == 1 and [(c.index, c.text, c.token_ids) for c in one[0].outputs] == \
        [(i, c.text, c.token_ids) for i, c in want.items()]


def _worker_device(worker, suffix=""):
    """A module-level function: it can travel to the engine's process."""
    return str(worker.device) + suffix


def test_async_llm_upstream_rl_calls():
    """upstream's AsyncLLM calls RL frameworks make between rollouts (verl's and SkyRL's async
    engines): sleep / is_sleeping / wake_up (the KV cache released and taken back, the same
    tokens after), reset_prefix_cache, collective_rpc by name, with a module-level function
    (its args and kwargs) and sleep by name, a lambda refused by name before it is sent,
    pause_generation's older wait_for_inflight_requests keyword; and upstream's import paths,
    vllm.v1.engine.async_llm.AsyncLLM and vllm.engine.arg_utils.AsyncEngineArgs."""
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.entrypoints.openai.async_engine import AsyncLLM as Ours
    from vllm.v1.engine.async_llm import AsyncLLM
    assert AsyncLLM is Ours
    args = AsyncEngineArgs(model="m", enable_sleep_mode=True)
    args.gpu_memory_utilization = 0.5
    assert isinstance(args, EngineArgs) and args.to_kwargs() == {"model": "m", "enable_sleep_mode": True,
                                                                  "gpu_memory_utilization": 0.5}
    with pytest.raises(AttributeError, match="no 'seed' set"):
        args.seed
    with pytest.raises(ValueError, match="unknown keyword arguments"):
        AsyncLLM.from_engine_args({}, no_such_flag=1)
    llm = AsyncLLM.from_engine(LLM(device="cpu", enable_sleep_mode=True).llm_engine)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def go():
        first = [o async for o in llm.generate("Count: 1, 2,", params)][-1].outputs[0].token_ids
        assert await llm.reset_prefix_cache() is True
        with pytest.raises(ValueError, match="must be bools"):   # checked in the engine's process
            await llm.reset_prefix_cache(reset_running_requests="yes")
        kv = await llm.collective_rpc("kv_cache_bytes")
        assert len(kv) == 1 and kv[0] > 0
        assert await llm.collective_rpc(_worker_device, args=("!",)) == ["cpu!"]
        assert await llm.collective_rpc(_worker_device, kwargs={"suffix": "?"}, timeout=30) == ["cpu?"]
        with pytest.raises(ValueError, match="cannot travel"):
            await llm.collective_rpc(lambda w: 1)
        with pytest.raises(ValueError, match="no method 'nope'"):
            await llm.collective_rpc("nope")
        with pytest.raises(ValueError, match="method must be"):
            await llm.collective_rpc(3)
        assert not await llm.is_sleeping()
        freed = await llm.sleep(1)
        assert freed > 0 and await llm.is_sleeping()
        await llm.wake_up(["kv_cache"])
        assert not await llm.is_sleeping()
        assert (await llm.collective_rpc("sleep", args=(2,)))[0] > 0 and await llm.is_sleeping()
        await llm.wake_up()
        again = [o async for o in llm.generate("Count: 1, 2,", params)][-1].outputs[0].token_ids
        paused = await llm.pause_generation(wait_for_inflight_requests=True)
        assert await llm.is_paused()
        await llm.resume_generation()
        with pytest.raises(ValueError, match="disagree"):
            await llm.pause_generation("abort", wait_for_inflight_requests=True)
        return first, again, paused
    try:
        first, again, paused = asyncio.run(go())
    finally:
        llm.shutdown()
    assert first == again and len(first) == 5 and isinstance(paused, dict)


def test_async_llm_survives_a_caller_giving_up_on_a_utility_call():
    """A utility call whose caller gives up (a timeout cancels the awaiting task, and with it the
    call's future) must not take the engine down: the answer arriving later is dropped, the
    request in flight finishes and the next one runs."""
    from vllm import LLM, SamplingParams
    from vllm.entrypoints.openai.async_engine import AsyncLLM
    llm = AsyncLLM.from_engine(LLM(device="cpu").llm_engine)
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)

    async def go():
        slow = asyncio.ensure_future(_drain(llm, "slow", long))
        await asyncio.sleep(0.1)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(llm.pause("wait"), 0.01)   # answered once "slow" is done
        finished = await slow
        await asyncio.sleep(0.2)                               # the late answer has arrived
        await llm.resume()
        after = await _drain(llm, "after", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        return finished, after
    try:
        finished, after = asyncio.run(go())
        assert llm.client.dead_reason is None
    finally:
        llm.shutdown()
    assert finished.outputs[0].finish_reason == "length" and len(after.outputs[0].token_ids) == 3


@pytest.mark.parametrize("how", ["abort", "abort_requests"])
def test_async_llm_abort_racing_its_add_never_runs_the_request(how):
    """An abort from another thread between add_requests' registration and its send (abort(),
    or abort_requests naming the request) must follow the AddRequest to the engine, not
    overtake it: the engine would ignore the unknown id, then run the request for nobody
    until max_tokens."""
    import threading
    import time

    from vllm import LLM, SamplingParams
    from vllm.engine.core_messages import AbortRequest, AddRequest, UtilityCall
    from vllm.entrypoints.openai.async_engine import AsyncLLM
    llm = AsyncLLM.from_engine(LLM(device="cpu").llm_engine)
    order, send, result = [], llm.client.send, {}

    def slow_send(msgs):
        if any(isinstance(m, AddRequest) for m in msgs):
            time.sleep(0.3)   # the window another thread's abort can land in
        order.extend(type(m).__name__ for m in msgs if isinstance(m, (AddRequest, AbortRequest, UtilityCall)))
        return send(msgs)
    llm.client.send = slow_send

    def abort():
        if how == "abort":
            llm.abort("victim")
        else:
            result["r"] = asyncio.run(llm.abort_requests(["victim"]))

    async def go():
        timer = threading.Timer(0.1, abort)
        timer.start()
        (s,) = await llm.add_requests([("victim", {"prompt_token_ids": [5, 6, 7]},
                                        SamplingParams(max_tokens=2000, ignore_eos=True))], stream=True)
        outs = [o async for o in s]
        timer.join()
        await asyncio.sleep(0.3)
        return outs, await llm.engine_stats()
    try:
        outs, stats = asyncio.run(go())
    finally:
        llm.shutdown()
    assert order[:2] == ["AddRequest", "AbortRequest"]
    assert result.get("r", {"aborted": ["victim"]}) == {"aborted": ["victim"]}
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert llm._outstanding == 0 and not llm._requests and not outs


def test_a_request_whose_output_fails_to_apply_ends_alone():
    """A delta the receiver cannot apply (a bug, a detokenizer's exception) ends its own request
    with an EngineError and aborts it in the engine; the other requests of the same batch
    finish with every token, and nothing is left outstanding."""
    from vllm import LLM, SamplingParams
    from vllm.engine.output_processor import RequestState
    from vllm.entrypoints.openai.async_engine import AsyncLLM, EngineError
    llm = AsyncLLM.from_engine(LLM(device="cpu").llm_engine)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    real = RequestState.apply

    def apply(state, d):
        if d.request_id.startswith("bad") and len(state.token_ids[d.index]) >= 2:
            raise RuntimeError("cannot apply")
        return real(state, d)

    async def go():
        ref = [o async for o in llm.generate({"prompt_token_ids": [7, 8, 9]}, params, "ref")][-1]
        RequestState.apply = apply
        try:
            streams = await llm.add_requests([(name, {"prompt_token_ids": [7, 8, 9]}, params)
                                              for name in ("good0", "bad", "good1")])
            results = []
            for s in streams:
                try:
                    results.append([o async for o in s][-1])
                except EngineError as err:
                    results.append(err)
        finally:
            RequestState.apply = real
        after = [o async for o in llm.generate({"prompt_token_ids": [7, 8, 9]}, params, "after")][-1]
        return ref, results, after, llm._outstanding, dict(llm._requests)
    try:
        # bounded: without the per-request handling the whole batch is dropped and nothing ends
        ref, (good0, bad, good1), after, outstanding, left = asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        llm.shutdown()
    assert isinstance(bad, EngineError) and "cannot apply" in str(bad)
    for o in (good0, good1, after):
        assert o.outputs[0].token_ids == ref.outputs[0].token_ids and o.outputs[0].finish_reason == "length"
    assert outstanding == 0 and not left
