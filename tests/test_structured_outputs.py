"""Structured outputs (xgrammar grammar masks in the sampler) and tool calls, on CPU with
the embedded default model: outputs match their grammar; a constrained request's token
ids and logprob bits do not depend on its neighbours, on preemption or on async
scheduling; bad grammars are a ValueError / HTTP 400 that loses nothing else; the
OpenAI client's response_format and tool calls; TRL's structured_outputs_regex."""
from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pytest
import torch

pytest.importorskip("xgrammar")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.sample.sampler import Sampler, SamplingBatch, TokenMask  # noqa: E402
from vllm.structured_outputs import StructuredOutputsParams as SO  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}
REGEX = r"[0-9]{1,3} (apples|pears)"
CHOICES = ["yes", "no", "maybe"]
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def _bits(values) -> list[int]:
    return torch.tensor(values, dtype=torch.float32).view(torch.int32).tolist()


def _sampled_lps(c) -> list[float]:
    return [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)]


# ---- params ---------------------------------------------------------------------------------

def test_params_are_checked_on_construction():
    sp = SamplingParams(structured_outputs={"regex": "[ab]+"})
    assert isinstance(sp.structured_outputs, SO) and sp.structured_outputs.kind == "regex"
    bad = [{}, {"regex": "a("}, {"json": "{not json"}, {"json": {"type": "nonsense"}}, {"choice": []},
           {"regex": "a", "json_object": True}, {"grammar": "root ::= "}, {"unknown_field": 1}]
    for spec in bad:
        with pytest.raises(ValueError):
            SamplingParams(structured_outputs=spec)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"choice": ["a"]})


def test_schemas_with_keywords_xgrammar_would_not_enforce_are_refused():
    """xgrammar drops some JSON-schema keywords (its log says "ignoring"), so the output could
    break the schema: such schemas are refused by name, wherever they sit; the keywords it
    enforces pass."""
    refused = [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}, "multipleOf"),
        ({"type": "string", "pattern": "[0-9]+", "maxLength": 2}, "maxLength"),
        ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties"),
        ({"anyOf": [{"type": "array", "contains": {"const": 1}}]}, "contains"),
        ({"$defs": {"a": {"not": {"type": "null"}}}, "$ref": "#/$defs/a"}, "not"),
    ]
    for schema, word in refused:
        with pytest.raises(ValueError, match=word):
            SamplingParams(structured_outputs={"json": schema})
        with pytest.raises(ValueError, match=word):
            SamplingParams(structured_outputs={"json": json.dumps(schema)})
    ok = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4},
                                            "a": {"type": "array", "items": {"type": "integer"}, "uniqueItems": False,
                                                  "minItems": 1},
                                            "n": {"type": "integer", "minimum": 0}}, "required": ["s"]}
    SamplingParams(structured_outputs={"json": ok})


def test_string_lengths_constrain_as_a_pattern_without_control_characters():
    """A string's bare minLength / maxLength compile as a pattern over the string's
    characters: xgrammar's own length rule lets raw control characters through (invalid
    JSON). The lengths count characters; control characters and over-long strings are
    refused."""
    from vllm.structured_outputs import grammar_of
    xgr = pytest.importorskip("xgrammar")
    accept = getattr(getattr(xgr, "testing", None), "_is_grammar_accept_string", None)
    if accept is None:
        pytest.skip("this xgrammar has no testing._is_grammar_accept_string")
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8},
                                               "t": {"type": "string", "minLength": 2}}, "required": ["s", "t"]}
    g = grammar_of(SO(json=schema))
    cases = {'{"s": "abc", "t": "xy"}': True, '{"s": "\u00e9", "t": "\u00e9\u00e9"}': True,
             '{"s": "12345678", "t": "xy"}': True, '{"s": "123456789", "t": "xy"}': False, '{"s": "a\x05b", "t": "xy"}': False,
             '{"s": "a\nb", "t": "xy"}': False, '{"s": "", "t": "x"}': False}
    for text, ok in cases.items():
        assert accept(g, text) is ok, text
    # the same through a tool's parameters (the named / required tool-call grammar)
    from vllm.entrypoints.openai.tool_calls import ToolPlan
    so = ToolPlan("named", ("f",), "f", ({"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}},
                                          "required": ["s"]},)).structured_outputs()
    assert not accept(grammar_of(so), '{"s": "\x01"}') and accept(grammar_of(so), '{"s": "ab"}')


def test_upstream_structured_output_fields():
    """upstream's other fields: disable_fallback and disable_additional_properties are taken
    (one backend; schemas compile strictly), whitespace_pattern and structural_tag refused;
    GuidedDecodingParams takes upstream's `backend` (TRL passes "outlines"), its
    "disable-any-whitespace" option too, and an unknown backend is a ValueError."""
    import warnings
    from vllm.sampling_params import GuidedDecodingParams
    SO(regex="a", disable_fallback=True, disable_additional_properties=True)
    for bad in ({"whitespace_pattern": " "}, {"structural_tag": "{}"}, {"disable_fallback": "yes"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SO(regex="a", **bad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        g = GuidedDecodingParams(backend="outlines", regex="a+")
        assert g.kind == "regex" and g.backend == "outlines"
        assert GuidedDecodingParams(backend="xgrammar:disable-any-whitespace", json_object=True).disable_any_whitespace
        sp = SamplingParams(guided_decoding={"backend": "guidance", "choice": ["x", "y"]})
        assert sp.structured_outputs.kind == "choice"
        with pytest.raises(ValueError, match="backend"):
            GuidedDecodingParams(backend="mine", regex="a")
    with pytest.raises(ValueError, match="backend"):
        SamplingParams(structured_outputs={"regex": "a", "backend": "outlines"})   # not a current field


def test_tool_parameters_constrain_as_far_as_the_backend_enforces():
    """A tool's parameters schema (the agent's, not a response format) keeps constraining
    required / named tool calls without the keywords xgrammar would drop."""
    from vllm.entrypoints.openai.tool_calls import ToolPlan
    params = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True},
                                               "mail": {"type": "string", "format": "email", "maxLength": 40}},
              "required": ["tags"]}
    for mode, named in (("required", None), ("named", "f")):
        so = ToolPlan(mode, ("f",), named, (params,)).structured_outputs()
        text = json.dumps(so.json)
        assert "uniqueItems" not in text and "maxLength" not in text and '"format": "email"' in text


# ---- the sampler ----------------------------------------------------------------------------

def _batch(rows, mode, num_logprobs, mask_of):
    """A SamplingBatch over `rows` (dicts of parameters) with the masks of those constrained."""
    b = SamplingBatch.from_lists([r["t"] for r in rows], [r["k"] for r in rows], [r["p"] for r in rows],
                                 [0.0] * len(rows), [r["seed"] for r in rows], [3] * len(rows), "cpu",
                                 max_num_logprobs=num_logprobs, logprobs_mode=mode)
    masked = [j for j, r in enumerate(rows) if r["id"] in mask_of]
    if masked:
        b.token_mask = TokenMask(torch.tensor(masked), torch.from_numpy(np.stack([mask_of[rows[j]["id"]] for j in masked])))
    return b


@pytest.mark.parametrize("mode", ["tempered_logprobs", "processed_logprobs", "raw_logprobs"])
def test_sampler_masks_are_batch_invariant(mode):
    vocab = 300
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=g) * 3
    rows = [dict(id=i, t=t, k=k, p=p, seed=10 + i)
            for i, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.7, 20, 1.0), (0.0, 0, 1.0), (1.3, 0, 0.9),
                                           (1.0, 0, 1.0), (0.9, 5, 0.8)])]
    rng = np.random.default_rng(1)
    mask_of = {}
    for i in (1, 2, 3, 5):
        words = rng.integers(-2**31, 2**31, size=(vocab + 31) // 32, dtype=np.int64).astype(np.int32)
        mask_of[i] = words
    sampler = Sampler()
    full = sampler(logits, _batch(rows, mode, 4, mask_of))
    free = sampler(logits, _batch(rows, mode, 4, {}))
    allowed = {i: np.unpackbits(m.view(np.uint8), bitorder="little")[:vocab].astype(bool) for i, m in mask_of.items()}
    for i, r in enumerate(rows):
        alone = sampler(logits[i:i + 1], _batch([r], mode, 4, mask_of))
        assert alone.token_ids.tolist() == full.token_ids[i:i + 1].tolist()
        assert _bits(alone.logprobs.tolist()) == _bits(full.logprobs[i:i + 1].tolist())
        assert alone.topk_ids.tolist() == full.topk_ids[i:i + 1].tolist()
        assert _bits(alone.topk_logprobs.flatten().tolist()) == _bits(full.topk_logprobs[i].tolist())
        if i in mask_of:
            assert allowed[i][int(full.token_ids[i])]
            if mode == "processed_logprobs":   # the mask shows: disallowed tokens are -inf
                assert all(allowed[i][t] or v == float("-inf")
                           for t, v in zip(full.topk_ids[i].tolist(), full.topk_logprobs[i].tolist()))
            else:   # tempered and raw modes ignore the mask, as they ignore truncation
                same = sampler(logits[i:i + 1], _batch([r], mode, 4, {}))
                assert _bits(same.topk_logprobs.flatten().tolist()) == _bits(full.topk_logprobs[i].tolist())
        else:   # unconstrained rows: as if no row were masked
            assert full.token_ids[i] == free.token_ids[i]
            assert _bits([full.logprobs[i].item()]) == _bits([free.logprobs[i].item()])


# ---- the engine -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu")


def _prompt(llm) -> str:
    return llm.get_tokenizer().apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def _gen(llm, specs, **kw):
    prompt = _prompt(llm)
    max_tokens = kw.pop("max_tokens", 40)
    params = [SamplingParams(max_tokens=max_tokens, structured_outputs=s, **kw) for s in specs]
    return llm.generate([prompt] * len(specs), params, use_tqdm=False)


def test_outputs_match_their_grammar(llm):
    specs = [SO(json=SCHEMA, disable_any_whitespace=True), SO(regex=REGEX), SO(choice=CHOICES),
             SO(grammar='root ::= "a" ("b" | "c")*')]
    for temperature in (0.0, 1.0):
        outs = _gen(llm, specs, temperature=temperature, seed=3, n=2)
        for out in outs:
            assert len(out.outputs) == 2
        js, rx, ch, gr = [[c for c in out.outputs] for out in outs]
        for c in js:
            assert c.finish_reason == "stop", c.text
            obj = json.loads(c.text)
            assert isinstance(obj["ok"], bool) and obj["color"] in ("red", "green", "blue")
        for c in rx:
            assert re.fullmatch(REGEX, c.text), c.text
        for c in ch:
            assert c.text in CHOICES
        for c in gr:
            assert re.fullmatch("a[bc]*", c.text), c.text


def test_a_grammar_after_its_token_ids(llm):
    """after_token_ids: every token is free until they have come, then the grammar constrains
    the rest (the server's reasoning then answer). Ids that never come leave the output free."""
    free = _gen(llm, [None], temperature=0.0, max_tokens=12, ignore_eos=True)[0].outputs[0]
    first = free.token_ids[0]
    after, never = _gen(llm, [SO(grammar='root ::= "a" ("b" | "c")*', after_token_ids=[first]),
                              SO(regex=REGEX, after_token_ids=[free.token_ids[-1] + 1, 0])],
                        temperature=0.0, max_tokens=12, ignore_eos=True)
    after, never = after.outputs[0], never.outputs[0]
    assert after.token_ids[0] == first
    tok = llm.get_tokenizer()
    assert re.fullmatch("a[bc]*", tok.decode(after.token_ids[1:], skip_special_tokens=True))
    assert never.token_ids == free.token_ids
    with pytest.raises(ValueError, match="after_token_ids"):
        SO(regex=REGEX, after_token_ids=[])


def _constrained_run(llm, neighbours, mode):
    target = SamplingParams(temperature=1.0, seed=7, max_tokens=30, logprobs=3, logprobs_mode=mode,
                            structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True))
    prompt = _prompt(llm)
    outs = llm.generate([prompt] * (1 + len(neighbours)), [target] + neighbours, use_tqdm=False)
    return outs[0].outputs[0], outs[1:]


@pytest.mark.parametrize("mode", ["tempered_logprobs", "processed_logprobs"])
def test_constrained_bits_do_not_depend_on_neighbours(llm, mode):
    alone, _ = _constrained_run(llm, [], mode)
    free = [SamplingParams(temperature=t, seed=11 + i, max_tokens=25, logprobs=2, logprobs_mode=mode)
            for i, t in enumerate((1.0, 0.0, 0.8))]
    others = [SamplingParams(temperature=1.0, seed=5, max_tokens=20, logprobs=1, logprobs_mode=mode,
                             structured_outputs=SO(regex=REGEX)),
              SamplingParams(temperature=0.9, seed=6, max_tokens=20, n=2, structured_outputs=SO(choice=CHOICES))]
    batched, outs = _constrained_run(llm, free + others, mode)
    assert batched.token_ids == alone.token_ids
    assert _bits(_sampled_lps(batched)) == _bits(_sampled_lps(alone))
    assert [sorted(e) for e in batched.logprobs] == [sorted(e) for e in alone.logprobs]
    # unconstrained neighbours are untouched by the masks next to them
    prompt = _prompt(llm)
    for params, out in zip(free, outs):
        ref = llm.generate([prompt], [params], use_tqdm=False)[0].outputs[0]
        assert out.outputs[0].token_ids == ref.token_ids
        assert _bits(_sampled_lps(out.outputs[0])) == _bits(_sampled_lps(ref))


def test_default_logprobs_are_the_unmasked_ones(llm):
    """tempered_logprobs (the default) ignore the grammar mask: a constrained sample's
    logprobs are those of its tokens scored without any mask (prompt logprobs, the
    trainer's head); processed_logprobs renormalise over the allowed tokens."""
    c, _ = _constrained_run(llm, [], "tempered_logprobs")
    prompt_ids = llm.get_tokenizer().apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
        prompt_ids = prompt_ids["input_ids"]
    seq = list(prompt_ids) + list(c.token_ids)
    scored = llm.generate([{"prompt_token_ids": seq}], SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)[0]
    n = len(prompt_ids)
    assert _bits([scored.prompt_logprobs[n + j][t].logprob for j, t in enumerate(c.token_ids)]) == \
        _bits(_sampled_lps(c))
    processed, _ = _constrained_run(llm, [], "processed_logprobs")
    assert processed.token_ids == c.token_ids
    # the mask leaves more mass to the allowed tokens: never below the unmasked logprob
    assert all(p >= t for p, t in zip(_sampled_lps(processed), _sampled_lps(c)))


def test_preemption_and_async_scheduling_keep_the_bits(llm):
    params = [SamplingParams(temperature=1.0, seed=20 + i, max_tokens=30, logprobs=0,
                             structured_outputs=s)
              for i, s in enumerate([SO(json=SCHEMA, disable_any_whitespace=True), SO(regex=REGEX), None,
                                     SO(json=SCHEMA, disable_any_whitespace=True), None, SO(choice=CHOICES)])]
    prompt = _prompt(llm)
    ref = [o.outputs[0] for o in llm.generate([prompt] * len(params), params, use_tqdm=False)]
    small = LLM(device="cpu", num_gpu_blocks_override=8, max_num_batched_tokens=32, enable_prefix_caching=False)
    async_llm = LLM(device="cpu", async_scheduling=True)
    for other in (small, async_llm):
        outs = [o.outputs[0] for o in other.generate([prompt] * len(params), params, use_tqdm=False)]
        for a, b in zip(outs, ref):
            assert a.token_ids == b.token_ids
            assert _bits(_sampled_lps(a)) == _bits(_sampled_lps(b))
    assert small.llm_engine.scheduler.num_preemptions > 0


def test_the_engine_core_compiles_grammars_off_its_loop():
    """The server's engine core compiles a constrained request's grammar on a thread
    (xgrammar releases the GIL), queueing it once compiled, so a large schema does not stall
    the other streams; an abort while it compiles drops it; its output is the grammar's."""
    import time

    from vllm.engine.core import EngineCore
    from vllm.engine.core_messages import AbortRequest, AddRequest
    llm = LLM(device="cpu")   # its own: the core takes over the engine's outputs
    core = EngineCore(llm.llm_engine)
    ids = llm.get_tokenizer().encode(_prompt(llm))
    params = SamplingParams(max_tokens=30, temperature=0, detokenize=False, structured_outputs={"choice": CHOICES})
    core.handle(AddRequest("c", ids, params))
    core.handle(AddRequest("gone", ids, params))
    core.handle(AbortRequest("gone"))
    assert [m.request_id for _, m in core._compiling] == ["c"] and not llm.llm_engine.has_unfinished_requests()
    tokens, deadline = [], time.monotonic() + 60
    while time.monotonic() < deadline and (core._compiling or core.busy):
        core._settle_compiles()
        if core.busy:
            core.step()
        out = core.take_outputs()
        for d in (out.deltas if out is not None else []):
            tokens += list(d[2])
    assert not core._compiling and "gone" not in llm.llm_engine._groups
    assert llm.get_tokenizer().decode(tokens, skip_special_tokens=True) in CHOICES
    # an abort of every request (and a pause) also finds the ones still compiling
    core.handle(AddRequest("late", ids, params))
    assert core.utility_abort_requests() == {"aborted": ["late"]} and not core._compiling


def test_bad_grammar_is_a_value_error_and_loses_nothing(llm):
    with pytest.raises(ValueError, match="regex"):
        _gen(llm, [SO(regex="a(")])
    with pytest.raises(ValueError):
        llm.generate([_prompt(llm)], SamplingParams(structured_outputs={"json": {"type": "nonsense"}}), use_tqdm=False)
    (out,) = _gen(llm, [SO(choice=CHOICES)], temperature=0.0)
    assert out.outputs[0].text in CHOICES


# ---- tool-call parsing ----------------------------------------------------------------------

def test_tool_call_blocks_are_parsed():
    from vllm.entrypoints.openai.tool_calls import parse_tool_call_blocks, plan_tools

    text = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "time", "parameters": {}}</tool_call><tool_call>not json</tool_call>')
    content, calls = parse_tool_call_blocks(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("weather", {"city": "Paris"}), ("time", {})]
    assert content == "Let me check.\n\n<tool_call>not json</tool_call>"
    assert parse_tool_call_blocks("no calls") == ("no calls", [])
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    assert plan_tools(tools, None).mode == "auto"
    for bad in ([{"type": "function"}], [{"function": {"name": ""}}]):
        with pytest.raises(ValueError):
            plan_tools(bad, "auto")
    with pytest.raises(ValueError, match="not in tools"):
        plan_tools(tools, {"type": "function", "function": {"name": "other"}})
    with pytest.raises(ValueError):
        plan_tools(None, "required")


# ---- the server -----------------------------------------------------------------------------

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"enum": [1, 2, 3]}, "b": {"type": "boolean"}},
    "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
                                                                     "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def app():
    from vllm.entrypoints.openai.api_server import build_app_from_llm

    app = build_app_from_llm(LLM(device="cpu"))
    yield app
    app.state.serving.llm.shutdown()


def _serve(app, fn):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver",
                                     timeout=120) as http:
            client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                                        max_retries=0)
            return await fn(http, client)
    return asyncio.run(go())


def test_openai_client_response_format(app):
    async def fn(http, client):
        r = await client.chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=40, temperature=0.0,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
        obj = json.loads(r.choices[0].message.content)
        assert r.choices[0].finish_reason == "stop" and obj["color"] in ("red", "green", "blue")
        r = await client.completions.create(model="default", prompt="What is 2 + 2?", max_tokens=8, temperature=0.0,
                                            extra_body={"response_format": {"type": "json_object"}})
        assert r.choices[0].text.startswith("{")
        r = await client.completions.create(model="default", prompt="What is 2 + 2?", max_tokens=8, temperature=0.0,
                                            extra_body={"structured_outputs": {"choice": CHOICES}})
        assert r.choices[0].text in CHOICES
    _serve(app, fn)


def test_server_bad_schema_is_400_and_others_finish(app):
    async def fn(http, client):
        good = {"messages": MESSAGES, "max_tokens": 10, "temperature": 0.0, "structured_outputs": {"regex": REGEX}}
        bads = [{"messages": MESSAGES, "response_format": {"type": "json_schema",
                                                           "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
                {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                {"messages": MESSAGES, "response_format": {"type": "xml"}},
                {"prompt": "hi", "structured_outputs": {"regex": "a("}},
                {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                 "response_format": {"type": "json_object"}},
                {"messages": MESSAGES, "tools": TOOLS, "stream": True, "tool_choice": "required",
                 "response_format": {"type": "json_object"}}]
        rs = await asyncio.gather(http.post("/v1/chat/completions", json=good),
                                  *[http.post("/v1/completions" if "prompt" in b else "/v1/chat/completions", json=b)
                                    for b in bads])
        assert rs[0].status_code == 200 and re.fullmatch(REGEX, rs[0].json()["choices"][0]["message"]["content"])
        for r in rs[1:]:
            assert r.status_code == 400, r.text
            assert r.json()["error"]["type"] == "invalid_request_error"
    _serve(app, fn)


def test_tool_calls(app):
    async def fn(http, client):
        r = await client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, max_tokens=40,
                                                 temperature=0.0, tool_choice={"type": "function",
                                                                               "function": {"name": "add"}})
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "add" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        assert args["a"] in (1, 2, 3) and isinstance(args["b"], bool)
        assert r.choices[0].message.content is None and r.choices[0].finish_reason == "stop"
        r = await client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, max_tokens=40,
                                                 temperature=0.0, tool_choice="required", parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name in ("add", "noop") and r.choices[0].finish_reason == "tool_calls"
        r = await client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                                 temperature=0.0)
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content   # free text, no block
    _serve(app, fn)


def test_trl_generate_structured_outputs(app):
    async def fn(http, client):
        r = await http.post("/generate/", json={"prompts": ["What is 2 + 2?"], "n": 2, "max_tokens": 12,
                                                "temperature": 1.0, "structured_outputs_regex": REGEX})
        assert r.status_code == 200, r.text
        tok = app.state.serving.llm.tokenizer
        for ids in r.json()["completion_ids"]:
            assert re.fullmatch(REGEX, tok.decode(ids, skip_special_tokens=True))
        r = await http.post("/generate/", json={"prompts": ["What is 2 + 2?"], "max_tokens": 5,
                                                "generation_kwargs": {"structured_outputs": {"choice": CHOICES}}})
        assert tok.decode(r.json()["completion_ids"][0], skip_special_tokens=True) in CHOICES
        r = await http.post("/generate/", json={"prompts": ["hi"], "structured_outputs_regex": "a("})
        assert r.status_code == 400
    _serve(app, fn)


@pytest.mark.parametrize("parser", ["deepseek_r1", "nemotron_v3"])
def test_reasoning_parser_lets_a_constrained_request_reason_first(app, parser):
    """With a reasoning parser a grammar constrains the answer only: the output after </think>.
    The embedded model never closes a reasoning it is put in (deepseek_r1, and nemotron_v3
    that reads the output as deepseek_r1 does), so its output is
    the unconstrained one, all reasoning; behind a prompt that closed the reasoning already
    (thinking off) the grammar applies from the first token and the output is all content."""
    serving = app.state.serving
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    closed = MESSAGES + [{"role": "assistant", "content": "<think>\nfine</think>\n"}]

    async def fn(http, client):
        free = await client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=12,
                                                    temperature=0.0)
        thinking = await client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=12,
                                                        temperature=0.0, response_format=fmt)
        answer = await client.chat.completions.create(
            model="default", messages=closed, max_tokens=40, temperature=0.0, response_format=fmt,
            extra_body={"add_generation_prompt": False, "continue_final_message": True})
        return free, thinking, answer
    try:
        serving.reasoning_parser = parser
        free, thinking, answer = _serve(app, fn)
    finally:
        serving.reasoning_parser = None
    free_msg, msg = free.choices[0].message, thinking.choices[0].message
    assert msg.content is None and getattr(msg, "reasoning", None) == getattr(free_msg, "reasoning", None)
    assert getattr(msg, "reasoning", None)
    obj = json.loads(answer.choices[0].message.content)
    assert obj["color"] in ("red", "green", "blue") and getattr(answer.choices[0].message, "reasoning", None) is None


def test_qwen3_reasoning_grammar_waits_for_the_end_of_thinking(app):
    """qwen3's parser: a model that opens <think> itself (thinking on) reasons before a grammar
    applies, as upstream has it: the grammar waits for </think>; behind a prompt that closed
    the thinking (thinking off) it applies from the first token."""
    serving = app.state.serving
    tok = serving.llm.tokenizer
    end = list(tok.encode("</think>", add_special_tokens=False))
    open_prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    closed_prompt = open_prompt + tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    try:
        serving.reasoning_parser = "qwen3"
        for ids, want in ((open_prompt, end), (closed_prompt, None)):
            params = SamplingParams(structured_outputs={"json": SCHEMA})
            serving._grammar_after_reasoning(params, ids)
            assert params.structured_outputs.after_token_ids == want
    finally:
        serving.reasoning_parser = None
    params = SamplingParams(structured_outputs={"json": SCHEMA})
    serving._grammar_after_reasoning(params, open_prompt)   # no parser: from the first token
    assert params.structured_outputs.after_token_ids is None
