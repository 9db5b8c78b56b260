"""The tool-call formats that "auto" tool_choice reads from a chat model's output, one per
model family, picked with ``vllm serve --tool-call-parser NAME`` (upstream vLLM's names;
docs/serving.md, "Tool calls"). Each turns the finished text into (content, calls) and
leaves text it cannot read as content: nothing the model wrote is dropped.

* ``hermes`` (Hermes, Qwen): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks anywhere in the text.
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``.
* ``llama3_json`` (Llama 3.1 / 3.2): the whole output is (``<|python_tag|>`` then) one
  ``{"name": ..., "parameters": {...}}`` object, or several separated by ``;``.
* ``pythonic`` (Llama 3.2 / 4): the whole output is a Python list of calls,
  ``[f(a=1, b="x"), g()]``, with literal arguments.
* ``qwen3_coder`` and ``qwen3_xml`` (Qwen3-Coder, Qwen3.5, Nemotron 3; two upstream names, one
  format): ``<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>``,
  each value raw text typed by the tool's parameters schema (string, integer, number, boolean;
  JSON for objects and arrays; a parameter the schema does not name stays a string).

Hermes and Mistral mark their calls, so the text around them is content (as generated, less
the whitespace that ends it when there are calls); Llama's JSON and
pythonic formats have no marker, so an output is either all calls or all content.
"""
from __future__ import annotations

import ast
import io
import json
import math
import re
import tokenize
from dataclasses import dataclass

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "qwen3_xml")
# the formats of Qwen3-Coder's XML calls (upstream has two parsers of it)
XML_CALL_PARSERS = ("qwen3_coder", "qwen3_xml")
DEFAULT_TOOL_CALL_PARSER = "hermes"

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARKER = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
_JSON_WS = " \t\n\r"


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str          # JSON text, as OpenAI sends it


def check_tool_call_parser(name: str) -> str:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of: {', '.join(TOOL_CALL_PARSERS)}")
    return name


def parse_tool_calls(parser: str, text: str, schemas: dict | None = None) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, calls) of a finished output in `parser`'s format; content is None when
    the calls are all there is (marked formats drop the whitespace that ends the content
    when there are calls). `schemas`: function name -> parameters schema (the XML formats
    type their values by it)."""
    if parser == "hermes":
        return parse_marked(text, HERMES_OPEN, hermes_block)
    if parser in XML_CALL_PARSERS:
        return parse_marked(text, HERMES_OPEN, xml_block(schemas))
    if parser == "mistral":
        return parse_marked(text, MISTRAL_MARKER, mistral_block)
    if parser == "llama3_json":
        return _whole(text, llama3_json_scan(text, final=True))
    if parser == "pythonic":
        return _whole(text, parse_pythonic_list(text))
    raise ValueError(check_tool_call_parser(parser))


def could_be_calls(parser: str, prefix: str) -> bool:
    """Unmarked formats (llama3_json, pythonic): False once the output so far can no longer
    be all calls (it is content then); True while it still may be."""
    if parser == "llama3_json":
        return llama3_json_scan(prefix, final=False) is not False
    return _pythonic_prefix_ok(prefix)


def _whole(text: str, calls) -> tuple[str | None, list[ParsedToolCall]]:
    return (None, calls) if calls else (text, [])


# ---- marked formats: a marker opens a block, the text outside blocks is content ----------------

def parse_marked(text: str, marker: str, block) -> tuple[str | None, list[ParsedToolCall]]:
    """Every `marker` whose block (see hermes_block) holds calls gives them; the rest of the
    text, as generated but for the whitespace at its end, is the content (None when empty).
    Leading whitespace stays: a stream sends it before it knows whether a call follows."""
    calls: list[ParsedToolCall] = []
    kept, last, i = [], 0, text.find(marker)
    while i >= 0:
        end, got = block(text[i:], True)
        if got:
            kept.append(text[last:i])
            last = i + end
            calls += got
        i = text.find(marker, i + end)
    if not calls:
        return text, []
    kept.append(text[last:])
    content = "".join(kept).rstrip()
    return content or None, calls


def hermes_block(buf: str, finished: bool):
    """`buf` starts with ``<tool_call>``: None while undecided (only before the output
    finishes), else (length of the block, its calls or None when it is content)."""
    j = buf.find(HERMES_CLOSE, len(HERMES_OPEN))
    if j < 0:
        if not finished:
            return None
        # never closed, at the end of the output: a call if the rest is one whole call object (a
        # stop string "</tool_call>" or an EOS right after the JSON, as upstream's pattern
        # `<tool_call>(.*)` reads it), else content with all after it
        call = call_of_object(_loads(buf[len(HERMES_OPEN):].strip()))
        return len(buf), [call] if call else None
    call = call_of_object(_loads(buf[len(HERMES_OPEN):j]))
    return j + len(HERMES_CLOSE), [call] if call else None


def xml_block(schemas: dict | None):
    """The block reader of the XML formats (qwen3_coder, qwen3_xml) for these schemas."""
    def block(buf: str, finished: bool):
        return xml_call_block(buf, finished, schemas or {})
    return block


_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def xml_call_block(buf: str, finished: bool, schemas: dict):
    """As hermes_block for ``<tool_call>`` holding ``<function=NAME>`` blocks of
    ``<parameter=P>value</parameter>``. A block with no function, or one whose function
    never closes before ``</tool_call>``, is content. Never closed at the end of the output
    (a stop string or EOS right after the call, as upstream's pattern ``<tool_call>(.*)$``
    reads it), it is a call when its functions are whole."""
    j = buf.find(HERMES_CLOSE, len(HERMES_OPEN))
    if j < 0 and not finished:
        return None
    body = buf[len(HERMES_OPEN):j if j >= 0 else len(buf)]
    end = j + len(HERMES_CLOSE) if j >= 0 else len(buf)
    calls = []
    for m in _XML_FUNCTION.finditer(body):
        if not m.group(0).endswith("</function>"):
            return end, None
        name = m.group(1).strip()
        props = (schemas.get(name) or {}).get("properties") or {}
        args = {}
        for pm in _XML_PARAMETER.finditer(m.group(2)):
            key = pm.group(1).strip()
            args[key] = _typed(_strip_one_newline(pm.group(2)), (props.get(key) or {}))
        calls.append(ParsedToolCall(name, json.dumps(args, ensure_ascii=False)))
    return end, calls or None


def _strip_one_newline(value: str) -> str:
    """A parameter's value without the line break the format puts on each side of it."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _typed(value: str, schema: dict):
    """A raw parameter value as its schema's type says (upstream's qwen3_coder reading):
    "null" is None; strings stay; integers, numbers and booleans are parsed where they
    parse; objects, arrays and anything else are JSON (or a Python literal), else the text."""
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if value.strip().lower() == "null" and ("null" in kinds or "string" not in kinds):
        return None
    if "string" in kinds or kind is None and not schema:
        return value
    text = value.strip()
    if kinds[0] in ("integer", "int"):
        try:
            return int(text)
        except ValueError:
            return value
    if kinds[0] in ("number", "float"):
        try:
            f = float(text)
        except ValueError:
            return value
        return int(f) if f.is_integer() and "." not in text and "e" not in text.lower() else f
    if kinds[0] in ("boolean", "bool"):
        return {"true": True, "false": False}.get(text.lower(), value)
    parsed = _loads(text)
    if parsed is not None or text == "null":
        return parsed
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value


def mistral_block(buf: str, finished: bool):
    """As hermes_block for ``[TOOL_CALLS]`` and the JSON array (or one object) after it.
    JSON that does not decode leaves the marker as content (the text after it is scanned
    on); JSON that decodes but is not calls is content, marker and all."""
    i = _skip_ws(buf, len(MISTRAL_MARKER))
    if i == len(buf) or buf[i] in "[{":
        try:
            value, end = json.JSONDecoder().raw_decode(buf, i)
        except json.JSONDecodeError:
            # incomplete JSON cannot be told from bad JSON before the end
            return (len(MISTRAL_MARKER), None) if finished else None
        items = value if isinstance(value, list) else [value]
        calls = [call_of_object(o, strict=True) for o in items]
        return end, calls if calls and all(calls) else None
    return len(MISTRAL_MARKER), None


# ---- llama3_json ----------------------------------------------------------------------------

def llama3_json_scan(text: str, final: bool):
    """The calls of `text` as llama3_json (optional leading whitespace and ``<|python_tag|>``,
    then ``{"name": ..., "parameters"|"arguments": {...}}`` objects separated by ``;``, a
    trailing ``;`` allowed), or False when it is not that. With final=False `text` is an
    output so far, and None means it may still become calls."""
    body = text.lstrip()
    if not final and PYTHON_TAG.startswith(body):
        return None                                # nothing yet, or a tag still arriving
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):]
    dec, calls, i = json.JSONDecoder(), [], _skip_ws(body, 0)
    while i < len(body):
        if body[i] != "{":
            return False
        try:
            obj, i = dec.raw_decode(body, i)
        except json.JSONDecodeError:
            return False if final else None        # incomplete, or bad: decided at the end
        call = call_of_object(obj, strict=True, need_arguments=True)
        if call is None:
            return False
        calls.append(call)
        i = _skip_ws(body, i)
        if i < len(body):
            if body[i] != ";":
                return False
            i = _skip_ws(body, i + 1)
    if not final:
        return None
    return calls or False


# ---- pythonic -------------------------------------------------------------------------------

def parse_pythonic_list(text: str):
    """The calls of `text` as one Python list of calls with keyword arguments whose values
    are literals (numbers, strings, True/False/None, lists and dicts of them), or False."""
    source = text.strip()
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    if not isinstance(tree.body, ast.List) or not tree.body.elts or _has_comment(source):
        return False
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return False
        args: dict = {}
        for kw in node.keywords:
            if kw.arg is None or kw.arg in args:          # **kwargs, or a repeated name
                return False
            try:
                args[kw.arg] = _literal(kw.value)
            except (ValueError, RecursionError):
                return False
        calls.append(ParsedToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


def _literal(node):
    """A JSON value from a literal's syntax tree; ValueError for anything else."""
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v)):
            return v
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = node.operand.value if isinstance(node.operand, ast.Constant) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return -v if isinstance(node.op, ast.USub) else v
    elif isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str)) or k.value in out:
                raise ValueError("dict keys must be distinct strings")
            out[k.value] = _literal(v)
        return out
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")


def _has_comment(source: str) -> bool:
    # the syntax tree has no comments: a list with one would lose its text
    if "#" not in source:
        return False
    try:
        return any(t.type == tokenize.COMMENT for t in tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return True


_IDENT = re.compile(r"\w+")


def _pythonic_prefix_ok(prefix: str) -> bool:
    """Whether an output so far may still be a pythonic call list: ``[``, a name, ``(``
    (what follows is decided at the end)."""
    s = prefix.lstrip()
    if not s:
        return True
    if s[0] != "[":
        return False
    i = len(s) - len(s[1:].lstrip())
    if i == len(s):
        return True
    if not s[i].isidentifier():
        return False
    i = _IDENT.match(s, i).end()
    rest = s[i:].lstrip()
    return not rest or rest[0] == "("


# ---- shared -----------------------------------------------------------------------------------

def call_of_object(obj, strict: bool = False, need_arguments: bool = False) -> ParsedToolCall | None:
    """A call from ``{"name": str, "arguments"|"parameters": ...}``, or None. Arguments that
    are a string holding JSON are taken as that JSON text; any other string is encoded as a
    JSON string (`arguments` is always JSON text, as OpenAI's schema has it); strict: they
    must be an object (or absent, meaning {}, unless need_arguments)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    if key is None and need_arguments:
        return None
    args = obj[key] if key else {}
    if isinstance(args, str) and not strict:
        return ParsedToolCall(obj["name"], args if _loads(args) is not None or args.strip() == "null"
                              else json.dumps(args, ensure_ascii=False))
    if strict and not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _JSON_WS:
        i += 1
    return i
