"""Feeding a model's output to the chat tool-call stream parser in random pieces, as the
server does step by step, to compare with the one-shot parse (tests)."""
from __future__ import annotations

import json
import random

from vllm.entrypoints.openai.tool_calls import ToolCallStream, ToolPlan

# two tools the tests' chat requests offer: `add` with an enum and a boolean, `noop` without
# parameters
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"enum": [1, 2, 3]}, "b": {"type": "boolean"}},
    "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
                                                                     "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def stream_in_pieces(plan: ToolPlan, text: str, seed: int, max_piece: int = 5):
    """Feed `text` in random pieces of 0..max_piece characters, then finish. Returns
    (content or None, [(name, parsed arguments)], has_calls). Checks what every stream must
    keep: a call's first piece carries its fresh id (9 letters and digits with the mistral
    parser, else call_...) and name with no arguments, ids are distinct, indices run 0, 1, ..."""
    rng, parser, pieces, i = random.Random(seed), ToolCallStream(plan), [], 0
    while i < len(text):
        j = min(len(text), i + rng.randint(0, max_piece))
        pieces += parser.feed(text[i:j], False)
        i = j
    pieces += parser.feed("", True)
    calls: dict[int, list] = {}
    for p in pieces:
        if p.index is not None:
            if p.id is not None:
                assert p.index not in calls and p.name and p.arguments == ""   # the call's first piece
                assert p.id == p.id.strip() and all(p.id != q[2] for q in calls.values())
                if plan.parser == "mistral":
                    assert len(p.id) == 9 and p.id.isalnum() and p.id.isascii(), p.id
                else:
                    assert p.id.startswith("call_"), p.id
                calls[p.index] = [p.name, "", p.id]
            calls[p.index][1] += p.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    content = "".join(p.content for p in pieces if p.content is not None)
    return content or None, [(n, json.loads(a)) for n, a, _ in calls.values()], parser.has_calls()
