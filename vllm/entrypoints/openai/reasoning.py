"""Reasoning text apart from the answer (`vllm serve --reasoning-parser`, upstream's names):
a chat choice's `<think> ... </think>` goes to the message's `reasoning` (and, for older
clients, `reasoning_content`), the rest to `content`, where tool calls are then parsed.

- `qwen3`: the output opens its reasoning with `<think>` (Qwen3's template with thinking on);
  without `</think>` an output that opened one is all reasoning (cut by max_tokens); an output
  that does not open with `<think>` is all content (thinking off: `enable_thinking=False`).
  Behind a prompt that itself ends in `<think>` (the templates of Qwen3's "Thinking" releases
  and Qwen3-Next-Thinking) the output starts inside the reasoning: it is read as `deepseek_r1`
  reads it (`prompt_opens_thinking`).
- `deepseek_r1`: the template opens `<think>` in the prompt, so the output starts inside the
  reasoning (a leading `<think>` is dropped); without `</think>` it is all reasoning.

Either way a prompt that itself ends in `</think>` (thinking off) leaves no reasoning to split:
the output is all content. Under a grammar (response_format, structured outputs, a forced tool
call) the model still reasons first, as upstream has it: the grammar constrains only the
output after `</think>` (structured_outputs.after_token_ids), which is the content; behind a
prompt that closed the reasoning (thinking off) it constrains from the first token.

Only the response is split: the token ids, logprobs and the text the engine produced are
unchanged (an RL client reads `token_ids`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


def check_reasoning_parser(name: str | None) -> str | None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    return name


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt (its tail is enough) leaves the output inside `<think>`."""
    return prompt_tail.rstrip().endswith(THINK_START)


def prompt_closes_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt (its tail) has already closed the reasoning, as Qwen3's template
    does with thinking off (`<think>\n\n</think>\n\n`): the output is all answer."""
    return prompt_tail.rstrip().endswith(THINK_END)


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; None for a part that is absent."""
    starts = text.lstrip().startswith(THINK_START)
    if parser == "qwen3" and not starts:
        return None, text
    body = text.lstrip()[len(THINK_START):] if starts else text
    end = body.find(THINK_END)
    if end < 0:
        return body or None, None
    return body[:end] or None, body[end + len(THINK_END):] or None


@dataclass
class ReasoningStream:
    """The same split over a stream of text deltas: `feed` returns (kind, text) pieces, kind
    "reasoning" or "content", holding back a tail that may be the start of a tag until the
    next delta (or the end) says."""
    parser: str
    _buf: str = ""
    _state: str = "start"   # start -> reasoning -> content; qwen3 without <think>: start -> content
    _out: list = field(default_factory=list)

    def feed(self, text: str, final: bool) -> list[tuple[str, str]]:
        self._buf += text
        self._out = []
        while True:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(THINK_START):
                    self._buf, self._state = head[len(THINK_START):], "reasoning"
                    continue
                if not final and (THINK_START.startswith(head) or not head):
                    break  # may still become "<think>"
                self._state = "reasoning" if self.parser == "deepseek_r1" else "content"
                continue
            if self._state == "reasoning":
                end = self._buf.find(THINK_END)
                if end >= 0:
                    self._emit("reasoning", self._buf[:end])
                    self._buf, self._state = self._buf[end + len(THINK_END):], "content"
                    continue
                keep = 0 if final else _tag_prefix_len(self._buf, THINK_END)
                self._emit("reasoning", self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            self._emit("content", self._buf)
            self._buf = ""
            break
        return self._out

    def _emit(self, kind: str, text: str) -> None:
        if text:
            self._out.append((kind, text))


def _tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
