"""Structured outputs: grammars compiled by xgrammar, matched per request on the host.

xgrammar is an optional dependency (`pip install 'vllm-parity[structured]'`); nothing
here imports it until a request asks for structured outputs. The pieces:

* ``grammar_of(spec)`` parses a StructuredOutputsParams into an ``xgrammar.Grammar``
  without a tokenizer: SamplingParams calls it, so a bad schema, regex or EBNF is a
  ValueError when the params are built (HTTP 400 on the server), before anything runs.
* ``GrammarCompiler`` (one per engine) compiles a spec against the engine's tokenizer
  and vocabulary, caching compiled grammars by spec.
* ``GrammarState`` (one per sample: n > 1 gets n of them) wraps an xgrammar matcher. The
  scheduler asks it for the packed bitmask of the next token when a step samples the
  request, and feeds it each sampled token once that token is known on the host.

The bitmask is int32 words, bit ``j`` of word ``i`` allowing token ``32 * i + j``; the
sampler unpacks it on the device and fills the disallowed logits with -inf
(vllm/sample/sampler.py, docs/sampling.md).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """What a request's output must match (upstream vLLM's names): exactly one of a JSON
    schema (dict or JSON text), a regex, a list of choices, an EBNF grammar (its start
    rule is `root`), or json_object=True (any JSON object). Enforced by masking the
    sampler's logits (docs/sampling.md); needs the optional xgrammar package. Checked on
    construction: a bad schema, regex or grammar is a ValueError."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON schema / object: no whitespace between tokens beyond what the schema's
    # separators need (small models otherwise tend to emit whitespace for ever)
    disable_any_whitespace: bool = False
    # the grammar constrains only the output after these token ids first complete (the server
    # sets them to the reasoning parser's end marker, `</think>`, so a thinking model reasons
    # freely and its answer matches); None: from the first token
    after_token_ids: list[int] | None = None
    # upstream's other fields. xgrammar compiles schemas in strict mode: properties a schema
    # does not name are refused whether or not disable_additional_properties asks; there is
    # one backend, so nothing to fall back from. whitespace_pattern (outlines') and
    # structural_tag are refused: a constraint given and not enforced would be a silent lie
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        for flag in ("disable_any_whitespace", "disable_fallback", "disable_additional_properties"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"structured_outputs.{flag} must be a boolean, got {getattr(self, flag)!r}")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported here (it is outlines'; this "
                             "engine's grammars are xgrammar's): use disable_any_whitespace=True for compact JSON")
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported here: give a json schema, regex, "
                             "choice or grammar")
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; "
                             f"got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its JSON text), "
                             f"got {type(self.json).__name__}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured_outputs.grammar must be an EBNF string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or any(not isinstance(c, str) or c == "" for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object must be a boolean")
        if self.after_token_ids is not None and (
                not isinstance(self.after_token_ids, (list, tuple)) or not self.after_token_ids
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.after_token_ids)):
            raise ValueError("structured_outputs.after_token_ids must be a non-empty list of token ids")
        grammar_of(self)  # ValueError for a schema, regex or grammar xgrammar cannot parse

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def of(cls, value) -> "StructuredOutputsParams | None":
        """A StructuredOutputsParams from itself or its fields as a dict (JSON bodies)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(f"unknown structured_outputs fields {unknown}; known: "
                                 f"{sorted(cls.__dataclass_fields__)}")
            return cls(**value)
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(value).__name__}")


INSTALL_HINT = "structured outputs need the xgrammar package: pip install 'vllm-parity[structured]' (or xgrammar)"


def require_xgrammar():
    """The xgrammar module, or a ValueError saying how to install it (a request asking for
    what this install cannot do is refused, like any other unsupported request)."""
    try:
        import xgrammar
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    return xgrammar


# json_object: OpenAI's "JSON mode", any JSON object (xgrammar's builtin JSON grammar
# would also take a top-level array)
_ANY_OBJECT = '{"type": "object"}'


# a schema nested deeper than this is refused: it describes no output a model would write, and
# the request carrying it could not be pickled to the engine process (Python's recursion limit)
MAX_SCHEMA_DEPTH = 128


def check_schema_depth(schema) -> None:
    """ValueError if `schema` (parsed JSON) nests objects and arrays deeper than MAX_SCHEMA_DEPTH."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > MAX_SCHEMA_DEPTH:
                raise ValueError(f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels")
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))


def _schema_text(schema) -> str:
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as err:
            raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from None
        check_schema_depth(parsed)
        return json.dumps(_walk_unenforced(parsed, "$", drop=False))
    check_schema_depth(schema)
    return json.dumps(_walk_unenforced(schema, "$", drop=False))


# JSON-schema keywords xgrammar's converter drops without enforcing them (its log says
# "ignoring"): a schema using them would be accepted and its output break it, so it is
# refused (upstream falls back to another backend for these; this engine has only xgrammar)
UNENFORCED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains", "multipleOf", "patternProperties",
                       "propertyNames", "not", "if", "then", "else", "dependentSchemas", "dependentRequired",
                       "unevaluatedProperties", "unevaluatedItems")


def without_unenforced_keywords(schema):
    """A copy of `schema` without what refuse_unenforced_keywords would refuse (the lengths
    beside a pattern or format dropped, the pattern kept): for schemas the request did not
    write as a response format, such as a tool's parameters, which constrain a tool call's
    arguments as far as the backend can."""
    return _walk_unenforced(schema, "$", drop=True)


def refuse_unenforced_keywords(schema) -> None:
    """ValueError naming the first keyword of `schema` (walked through every subschema) that
    xgrammar would not enforce: UNENFORCED_KEYWORDS (uniqueItems only when true), and a
    string's minLength / maxLength beside a pattern or format (xgrammar keeps the pattern
    and drops the lengths)."""
    _walk_unenforced(schema, "$", drop=False)


# where a schema holds subschemas: by name, one, or a list (enum / const / default hold data)
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_ONES = ("items", "additionalProperties")
_SUBSCHEMA_LISTS = ("items", "prefixItems", "anyOf", "oneOf", "allOf")


def _walk_unenforced(schema, path: str, drop: bool):
    """`schema` with its unenforced keywords dropped (drop) or refused (ValueError naming the
    first), through every subschema."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in UNENFORCED_KEYWORDS and not (key == "uniqueItems" and value is False):
            if drop:
                continue
            raise ValueError(f"structured_outputs.json: {key!r} at {path} is not enforced by the grammar backend "
                             "(xgrammar); remove it or check the output yourself")
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            value = {name: _walk_unenforced(child, f"{path}.{key}.{name}", drop) for name, child in value.items()}
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            value = [_walk_unenforced(child, f"{path}.{key}[{i}]", drop) for i, child in enumerate(value)]
        elif key in _SUBSCHEMA_ONES:
            value = _walk_unenforced(value, f"{path}.{key}", drop)
        out[key] = value
    if ("pattern" in out or "format" in out) and ("minLength" in out or "maxLength" in out):
        if not drop:
            raise ValueError(f"structured_outputs.json: minLength / maxLength beside a pattern or format at {path} "
                             "is not enforced by the grammar backend (xgrammar); fold the length into the pattern")
        out.pop("minLength", None)
        out.pop("maxLength", None)
    elif out.get("type") == "string" and ("minLength" in out or "maxLength" in out):
        out = _lengths_as_pattern(out)
    return out


def _lengths_as_pattern(schema: dict) -> dict:
    """A string schema's minLength / maxLength as the pattern ^[\\s\\S]{min,max}$. xgrammar
    compiles bare lengths into a repeat of any character but a quote, a backslash or a line
    break, which lets the other control characters through, which JSON forbids (the output
    would not parse; its issue mlc-ai/xgrammar#800); a pattern it matches against the
    string's characters, control characters excluded. Either way the string holds no
    escapes. Lengths that are not non-negative integers are left for xgrammar to refuse."""
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in (lo, hi) if x is not None):
        return schema
    out = {k: v for k, v in schema.items() if k not in ("minLength", "maxLength")}
    out["pattern"] = "^[\\s\\S]{%d,%s}$" % (lo, "" if hi is None else hi)
    return out


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (JSON string escapes are valid
    EBNF string escapes in xgrammar)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_of(spec: "StructuredOutputsParams"):
    """The xgrammar Grammar of a spec, tokenizer-free; ValueError naming what is wrong."""
    xgr = require_xgrammar()
    kind = spec.kind
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(_schema_text(spec.json), any_whitespace=not spec.disable_any_whitespace)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(_ANY_OBJECT, any_whitespace=not spec.disable_any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 -- xgrammar reports parse errors as RuntimeError
        raise ValueError(f"invalid structured_outputs.{kind}: {_short(err)}") from None


def _short(err: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(err).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    # "/path/file.cc:94: message" -> "message"
    head, sep, rest = text.partition(": ")
    if sep and (".cc:" in head or ".h:" in head):
        text = rest
    return text.splitlines()[0] if text else type(err).__name__


class GrammarCompiler:
    """Compiles specs against one tokenizer and vocabulary (the model's logits width: ids
    past the tokenizer's vocabulary are never allowed). Stop tokens are the engine's eos
    ids: a grammar that is complete allows only them."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        xgr = require_xgrammar()
        self.vocab_size = int(vocab_size)
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        # one thread: the engine shares its host with the API server
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._xgr = xgr
        self.bitmask_words = (self.vocab_size + 31) // 32
        self._pool = None   # compile_in_background's one thread, made on first use

    def compile(self, spec: "StructuredOutputsParams"):
        kind = spec.kind
        c = self._compiler
        try:
            if kind == "json":
                return c.compile_json_schema(_schema_text(spec.json), any_whitespace=not spec.disable_any_whitespace)
            if kind == "json_object":
                return c.compile_json_schema(_ANY_OBJECT, any_whitespace=not spec.disable_any_whitespace)
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "choice":
                return c.compile_grammar(choice_ebnf(spec.choice))
            return c.compile_grammar(spec.grammar)
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001
            raise ValueError(f"invalid structured_outputs.{kind}: {_short(err)}") from None

    def compile_in_background(self, spec: "StructuredOutputsParams"):
        """compile(spec) on this compiler's thread: a concurrent.futures.Future of the compiled
        grammar (or of the ValueError). xgrammar releases the GIL while it compiles, so the
        caller's loop keeps stepping meanwhile (a large schema takes a fraction of a second
        with a small vocabulary, seconds with a 150k one)."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        return self._pool.submit(self.compile, spec)

    def close(self) -> None:
        """Stop the background compile thread (a compile running finishes; queued ones are dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def state(self, compiled) -> "GrammarState":
        return GrammarState(self._xgr, compiled, self.bitmask_words)


class GrammarState:
    """One sample's matcher. Its state always covers exactly the sample's output tokens
    known on the host (those after its after_token_ids, when it has them: the scheduler feeds
    it from there on): a preempted sample recomputes those same tokens, so nothing is
    rolled back; with async scheduling the scheduler does not sample a constrained
    request again until its last token is known (vllm/core/scheduler.py)."""

    def __init__(self, xgr, compiled, words: int):
        import torch

        self._matcher = xgr.GrammarMatcher(compiled)
        self._words = words
        self._torch = torch
        self.num_accepted = 0

    def next_bitmask(self) -> np.ndarray:
        """The packed mask of the next token: a fresh int32 [words] array (the runner may
        still be reading the previous one)."""
        buf = self._torch.zeros((1, self._words), dtype=self._torch.int32)
        self._matcher.fill_next_token_bitmask(buf)
        return buf.numpy()[0]

    def accept(self, token_id: int) -> bool:
        ok = bool(self._matcher.accept_token(int(token_id)))
        if ok:
            self.num_accepted += 1
        return ok

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: the sample is complete."""
        return bool(self._matcher.is_terminated())
