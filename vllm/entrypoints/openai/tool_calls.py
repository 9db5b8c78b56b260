"""Tool calls for /v1/chat/completions: which tool_choice constrains what, and parsing
the model's output into OpenAI `tool_calls` (docs/serving.md, "Tool calls").

* "none": the output is plain content, never parsed.
* "auto" (the default when tools are given): generation is free; Hermes / Qwen style
  blocks ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the output become
  tool calls, the text outside them the content. A block that is not such a JSON object
  stays in the content: nothing the model wrote is dropped.
* "required": generation is constrained to a JSON array of one or more
  ``{"name": <a tool's name>, "parameters": <that tool's parameters>}`` objects (exactly
  one with parallel_tool_calls=false).
* a named function (``{"type": "function", "function": {"name": ...}}``): generation is
  constrained to that function's parameters schema; the output is its arguments.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from vllm.structured_outputs import StructuredOutputsParams

TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ANY_PARAMETERS = {"type": "object"}


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str          # JSON text, as OpenAI sends it


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools and tool_choice mean for generation and parsing."""
    mode: str                                   # "none" | "auto" | "required" | "named"
    function_names: tuple[str, ...] = ()
    named: str | None = None
    parameters: tuple = ()                      # per function (same order), its parameters schema
    parallel: bool = True                       # "required": more than one call allowed

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar that "required" and a named function generate under (None: free)."""
        # compact JSON, as response_format's (protocol.py): the arguments are re-serialised anyway
        if self.mode == "named":
            return StructuredOutputsParams(json=self.parameters[self.function_names.index(self.named)],
                                           disable_any_whitespace=True)
        if self.mode == "required":
            calls = [{"type": "object",
                      "properties": {"name": {"enum": [name]}, "parameters": params},
                      "required": ["name", "parameters"]}
                     for name, params in zip(self.function_names, self.parameters)]
            array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=array, disable_any_whitespace=True)
        return None

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, tool calls) of a finished output."""
        if self.mode == "named":
            return None, [ParsedToolCall(self.named, _arguments_text(text))]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []   # cut short (max_tokens, a stop string): report what there is
            return None, [ParsedToolCall(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False))
                          for i in items if isinstance(i, dict) and isinstance(i.get("name"), str)]
        if self.mode == "auto":
            return parse_tool_call_blocks(text)
        return text, []


def plan_tools(tools: list | None, tool_choice, parallel_tool_calls: bool | None = None) -> ToolPlan:
    """Check tools and tool_choice (ValueError naming what is wrong) and return the plan."""
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
        return ToolPlan("auto", tuple(names), parameters=tuple(params))
    if tool_choice in ("none", "required"):
        return ToolPlan(tool_choice, tuple(names), parameters=tuple(params), parallel=parallel_tool_calls is not False)
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ValueError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}")
        if name not in names:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
        return ToolPlan("named", tuple(names), named=name, parameters=tuple(params))
    raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}")


def parse_tool_call_blocks(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """Hermes / Qwen style: every ``<tool_call>{json}</tool_call>`` block whose JSON is an
    object with a string "name" (and "arguments" or "parameters") is a call; the rest of
    the text, stripped, is the content (None when empty)."""
    calls, kept, last = [], [], 0
    for m in TOOL_CALL_BLOCK.finditer(text):
        call = _call_of(m.group(1))
        if call is None:
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[last:])
    content = "".join(kept).strip()
    return content or None, calls


def _call_of(body: str) -> ParsedToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _arguments_text(text: str) -> str:
    """A named call's arguments as compact JSON when they parse, else as generated."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except json.JSONDecodeError:
        return text


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
