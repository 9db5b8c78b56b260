"""Tool calls for /v1/chat/completions: which tool_choice constrains what, and parsing
the model's output into OpenAI `tool_calls` (docs/serving.md, "Tool calls").

* "none": the output is plain content, never parsed.
* "auto" (the default when tools are given): generation is free; the server's tool-call
  parser (tool_parsers.py; Hermes / Qwen ``<tool_call>`` blocks by default) reads the calls
  from the output, the rest is the content. Text that is not a call in that format stays
  in the content: nothing the model wrote is dropped.
* "required": generation is constrained to a JSON array of one or more
  ``{"name": <a tool's name>, "parameters": <that tool's parameters>}`` objects (exactly
  one with parallel_tool_calls=false); the tools' ``$defs`` / ``definitions`` move to the
  array schema's top level, where their ``#/$defs/...`` references find them. An output cut
  short (max_tokens, a stop string) gives its complete elements as calls and the text after
  the last of them as content, streamed or not.
* a named function (``{"type": "function", "function": {"name": ...}}``): generation is
  constrained to that function's parameters schema; the output, as generated, is its
  arguments.

Tool-call ids are ``call_`` and 24 hex digits, or 9 letters and digits with the mistral
parser (Mistral's chat templates refuse any other id when the call comes back).
"""
from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass

from vllm.entrypoints.openai.tool_parsers import (
    DEFAULT_TOOL_CALL_PARSER, HERMES_OPEN, MISTRAL_MARKER, XML_CALL_PARSERS, ParsedToolCall, check_tool_call_parser,
    could_be_calls, hermes_block, mistral_block, parse_marked, parse_tool_calls, xml_block,
)
from vllm.structured_outputs import StructuredOutputsParams, without_unenforced_keywords

_ANY_PARAMETERS = {"type": "object"}
# marked formats: (the marker that opens a block, the block's reader)
_MARKED = {"hermes": (HERMES_OPEN, hermes_block), "mistral": (MISTRAL_MARKER, mistral_block)}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools and tool_choice mean for generation and parsing."""
    mode: str                                   # "none" | "auto" | "required" | "named"
    function_names: tuple[str, ...] = ()
    named: str | None = None
    parameters: tuple = ()                      # per function (same order), its parameters schema
    parallel: bool = True                       # more than one call allowed ("required": by the grammar;
                                                # "auto": the first call kept, as upstream)
    parser: str = DEFAULT_TOOL_CALL_PARSER      # the server's --tool-call-parser: the format "auto"
                                                # reads (tool_parsers.py), and the ids' form

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar that "required" and a named function generate under (None: free)."""
        # compact JSON, as response_format's (protocol.py); a named call's arguments are the
        # generated text unchanged, a "required" call's re-serialised from the array. A tool's
        # parameters constrain its calls as far as the grammar backend enforces them (the
        # keywords it would not are left out, where a response_format using them is refused)
        params = [without_unenforced_keywords(p) for p in self.parameters]
        if self.mode == "named":
            return StructuredOutputsParams(json=params[self.function_names.index(self.named)],
                                           disable_any_whitespace=True)
        if self.mode == "required":
            params, defs = _hoist_defs(self.function_names, params)
            calls = [{"type": "object",
                      "properties": {"name": {"enum": [name]}, "parameters": p},
                      "required": ["name", "parameters"]}
                     for name, p in zip(self.function_names, params)]
            array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **defs}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=array, disable_any_whitespace=True)
        return None

    def schemas(self) -> dict:
        """function name -> its parameters schema (the XML formats type values by it)."""
        return dict(zip(self.function_names, self.parameters))

    def call_id(self) -> str:
        """A fresh id for one of this request's tool calls."""
        return new_tool_call_id(self.parser)

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, tool calls) of a finished output."""
        if self.mode == "named":
            return None, [ParsedToolCall(self.named, text)]   # the arguments as generated, as streamed
        if self.mode == "required":
            # the array's complete elements are calls, the text after the last is content (a
            # cut-short array): read as the stream reads it, so that the two agree
            return _joined(ToolCallStream(self).feed(text, True))
        if self.mode == "auto":
            content, calls = parse_tool_calls(self.parser, text, self.schemas())
            return content, calls if self.parallel else calls[:1]
        return text, []


def plan_tools(tools: list | None, tool_choice, parallel_tool_calls: bool | None = None,
               parser: str = DEFAULT_TOOL_CALL_PARSER) -> ToolPlan:
    """Check tools and tool_choice (ValueError naming what is wrong) and return the plan;
    `parser` is the format "auto" reads (the server's --tool-call-parser)."""
    check_tool_call_parser(parser)
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice other than 'none' or 'auto' needs tools")
        return ToolPlan("none")
    names, params = [], []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        p = fn.get("parameters")
        if p is not None and not isinstance(p, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(name)
        params.append(p or _ANY_PARAMETERS)
    if len(set(names)) != len(names):
        raise ValueError("tool function names must be unique")
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan("auto", tuple(names), parameters=tuple(params), parallel=parallel_tool_calls is not False,
                        parser=parser)
    if tool_choice in ("none", "required"):
        return ToolPlan(tool_choice, tuple(names), parameters=tuple(params), parallel=parallel_tool_calls is not False,
                        parser=parser)
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ValueError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}")
        if name not in names:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
        return ToolPlan("named", tuple(names), named=name, parameters=tuple(params), parser=parser)
    raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}")


def parse_tool_call_blocks(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """Hermes / Qwen style: every ``<tool_call>{json}</tool_call>`` block whose JSON is an
    object with a string "name" (and "arguments" or "parameters") is a call; the rest of
    the text, less the whitespace that ends it, is the content (None when empty)."""
    return parse_marked(text, HERMES_OPEN, hermes_block)


_DEFS_KEYS = ("$defs", "definitions")


def _hoist_defs(names, params) -> tuple[list, dict]:
    """The tools' parameters without their top-level ``$defs`` / ``definitions``, and those
    merged for the combined schema's top level (a ``#/$defs/X`` reference is resolved from
    the document's root). ValueError when two tools define one name differently."""
    out, merged, owner = [], {}, {}
    for name, p in zip(names, params):
        if not isinstance(p, dict) or not any(k in p for k in _DEFS_KEYS):
            out.append(p)
            continue
        p = dict(p)
        for key in _DEFS_KEYS:
            defs = p.pop(key, None)
            if defs is None:
                continue
            if not isinstance(defs, dict):
                raise ValueError(f"tool {name!r}: parameters.{key} must be an object")
            have = merged.setdefault(key, {})
            for k, v in defs.items():
                if k in have and have[k] != v:
                    raise ValueError(f"tools {owner[key, k]!r} and {name!r} both define {key}/{k}, differently: "
                                     f"tool_choice 'required' puts their definitions in one schema, "
                                     f"so rename one of them")
                have[k] = v
                owner.setdefault((key, k), name)
        out.append(p)
    return out, merged


def _joined(pieces: list[StreamPiece]) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, calls) of a whole stream's pieces."""
    content = "".join(p.content for p in pieces if p.content is not None)
    calls: dict[int, list[str]] = {}
    for p in pieces:
        if p.index is not None:
            calls.setdefault(p.index, [p.name, ""])[1] += p.arguments or ""
    return content or None, [ParsedToolCall(n, a) for n, a in (calls[i] for i in sorted(calls))]


_ID_CHARS = string.ascii_letters + string.digits


def new_tool_call_id(parser: str | None = None) -> str:
    """``call_`` and 24 hex digits; with the mistral parser 9 letters and digits, the only
    ids Mistral's chat templates accept."""
    if parser == "mistral":
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- streaming ----------------------------------------------------------------------------

@dataclass(frozen=True)
class StreamPiece:
    """One piece of a streamed chat message: content text, or part of tool call `index`
    (its first piece has id and name, with arguments ""; later pieces more arguments)."""
    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


class ToolCallStream:
    """ToolPlan.parse done incrementally on one choice's text deltas.

    The pieces fed so far, joined, give the parse of the finished text (the arguments
    as JSON values). "auto" with a marked format (hermes, mistral) sends a call once its
    block is complete (before then it may still turn out not to be a call, and then stays
    content) and holds back a trailing partial marker and whitespace at the end of the
    content (parse() drops the whitespace that ends the content when there are calls); with an unmarked one
    (llama3_json, pythonic) it holds the whole output while it may still be calls and
    sends it as content as soon as it cannot be, else decides at the end. "required"
    sends a call once its array element is complete (an array cut short: the text after
    the last complete element is content at the end); a named function's arguments
    stream as generated.
    """

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.buf = ""             # auto: text not yet sent; required: all the text so far
        self.in_block = False
        self.pos = 0              # required: where the next array element starts (-1: no more)
        self.cut = 0              # required: where the last element that was a call ends
        self.opened = False
        self.calls = 0
        self.held_ws = ""         # auto, marked: whitespace that ends the content so far
        self.marked = (HERMES_OPEN, xml_block(plan.schemas())) if plan.parser in XML_CALL_PARSERS \
            else _MARKED.get(plan.parser)
        self.passthrough = False  # auto, unmarked: the output is content, sent as it comes

    def has_calls(self) -> bool:
        """Whether the finished text holds calls (finish_reason "tool_calls")."""
        return self.calls > 0

    def feed(self, delta: str, finished: bool) -> list[StreamPiece]:
        out: list[StreamPiece] = []
        if self.plan.mode == "named":
            if self.calls == 0:
                out += self._call_pieces(ParsedToolCall(self.plan.named, ""))
            if delta:
                out.append(StreamPiece(index=0, arguments=delta))
        elif self.plan.mode == "required":
            self.buf += delta
            self._feed_array(out, finished)
            if finished and not self._whole_array():
                rest = self.buf[self.cut:] if self.calls else self.buf   # cut short: after the calls
                if rest:
                    out.append(StreamPiece(content=rest))
        elif self.plan.mode == "auto" and self.marked is not None:
            self.buf += delta
            self._feed_blocks(out, finished)
        elif self.plan.mode == "auto":
            self._feed_whole(delta, out, finished)
        elif delta or finished:
            out.append(StreamPiece(content=delta))
        return out

    def _call_pieces(self, call: ParsedToolCall) -> list[StreamPiece]:
        if self.calls and not self.plan.parallel:
            return []   # parallel_tool_calls false: the first call only (parse() keeps the same)
        i = self.calls
        self.calls += 1
        head = StreamPiece(index=i, id=self.plan.call_id(), name=call.name, arguments="")
        return [head, StreamPiece(index=i, arguments=call.arguments)] if call.arguments else [head]

    def _feed_blocks(self, out: list[StreamPiece], finished: bool) -> None:
        marker, block = self.marked
        while True:
            if not self.in_block:
                j = self.buf.find(marker)
                if j < 0:
                    keep = 0 if finished else _partial_tag(self.buf, marker)
                    self._content(self.buf[:len(self.buf) - keep], out)
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                self._content(self.buf[:j], out)
                self.buf, self.in_block = self.buf[j:], True
            decided = block(self.buf, finished)
            if decided is None:
                break
            end, calls = decided
            if calls is None:
                self._content(self.buf[:end], out)
            else:
                for call in calls:
                    out += self._call_pieces(call)
            self.buf, self.in_block = self.buf[end:], False
        if finished and self.held_ws and not self.calls:
            out.append(StreamPiece(content=self.held_ws))   # no calls: the content is not stripped
            self.held_ws = ""

    def _feed_whole(self, delta: str, out: list[StreamPiece], finished: bool) -> None:
        """An unmarked format: the output is all calls or all content, as it is sent."""
        if self.passthrough:
            if delta:
                out.append(StreamPiece(content=delta))
            return
        self.buf += delta
        if finished:
            content, calls = parse_tool_calls(self.plan.parser, self.buf)
            if content:
                out.append(StreamPiece(content=content))
            for call in calls:
                out += self._call_pieces(call)
            self.buf = ""
        elif not could_be_calls(self.plan.parser, self.buf):
            self.passthrough = True
            out.append(StreamPiece(content=self.buf))
            self.buf = ""

    def _content(self, text: str, out: list[StreamPiece]) -> None:
        """Send content, holding back trailing whitespace until more content follows (parse()
        drops the whitespace that ends the content when there are calls)."""
        if not text:
            return
        text = self.held_ws + text
        body = text.rstrip()
        self.held_ws = text[len(body):]
        if body:
            out.append(StreamPiece(content=body))

    def _feed_array(self, out: list[StreamPiece], finished: bool) -> None:
        # strict=False: a raw control character inside a string (a grammar may let one through)
        # still parses; the arguments are dumped again, escaped
        dec = json.JSONDecoder(strict=False)
        text = self.buf
        while self.pos >= 0:
            i = self.pos
            while i < len(text) and text[i] in " \t\n\r,":
                i += 1
            if i >= len(text):
                return
            if not self.opened:
                if text[i] != "[":
                    self.pos = -1
                    return
                self.opened, self.pos = True, i + 1
                continue
            if text[i] == "]":
                self.pos = -1
                return
            try:
                item, end = dec.raw_decode(text, i)
            except json.JSONDecodeError:
                return
            if end == len(text) and not finished and not isinstance(item, (dict, list)):
                return   # a number at the end may still grow
            self.pos = end
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                self.cut = end
                out += self._call_pieces(ParsedToolCall(item["name"], json.dumps(item.get("parameters", {}),
                                                                                  ensure_ascii=False)))

    def _whole_array(self) -> bool:
        try:
            return isinstance(json.loads(self.buf, strict=False), list)
        except json.JSONDecodeError:
            return False


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (a tag still arriving)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
