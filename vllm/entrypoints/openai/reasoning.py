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
- `nemotron_v3` (NVIDIA Nemotron 3 Nano / Super, Nemotron-H hybrids): `deepseek_r1`'s split,
  plus one rule for a request whose `chat_template_kwargs` has `enable_thinking: false` or
  `force_nonempty_content: true` (`content_forced`). Such a client reads only `content`, so a
  message left without an answer (no `</think>`, or nothing but whitespace after it) has its
  reasoning and content swapped: the reasoning text becomes the content. A stream cannot take
  back the reasoning deltas it sent, and holding them back would stop it streaming; as upstream,
  when the output ends without `</think>` the stream's last delta repeats the whole reasoning as
  content (the reasoning stays streamed as well). After a `</think>` with no answer behind it the
  stream adds nothing, where the whole message swaps.

Whatever the parser, a prompt that itself ends in `</think>` (thinking off) leaves no reasoning
to split: the output is all content (`nemotron_v3`'s swap has nothing to do there). Under a
grammar (response_format, structured outputs, a forced tool call) the model still reasons
first, as upstream has it: the grammar constrains only the output after `</think>`
(structured_outputs.after_token_ids), which is the content; behind a prompt that closed the
reasoning (thinking off) it constrains from the first token. (A `nemotron_v3` swap under a
grammar gives unconstrained reasoning as the content: the grammar never started.)

Only the response is split: the token ids, logprobs and the text the engine produced are
unchanged (an RL client reads `token_ids`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REASONING_PARSERS = ("deepseek_r1", "nemotron_v3", "qwen3")
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


def content_forced(parser: str | None, chat_template_kwargs: dict[str, Any] | None) -> bool:
    """Whether `nemotron_v3` gives a request its reasoning as content when no answer came: the
    client turned thinking off (`enable_thinking` false) or asked for a non-empty content
    (`force_nonempty_content` true), in the request's chat_template_kwargs."""
    if parser != "nemotron_v3" or not chat_template_kwargs:
        return False
    return (chat_template_kwargs.get("enable_thinking") is False
            or chat_template_kwargs.get("force_nonempty_content") is True)


def split_reasoning(parser: str, text: str,
                    chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; None for a part that is absent.
    `chat_template_kwargs` (the request's) matter to `nemotron_v3` only (`content_forced`)."""
    starts = text.lstrip().startswith(THINK_START)
    if parser == "qwen3" and not starts:
        return None, text
    body = text.lstrip()[len(THINK_START):] if starts else text
    end = body.find(THINK_END)
    if end < 0:
        reasoning, content = body or None, None
    else:
        reasoning, content = body[:end] or None, body[end + len(THINK_END):] or None
    if content_forced(parser, chat_template_kwargs) and (content is None or not content.strip()):
        # a plain swap, as upstream's: whitespace that followed </think> becomes the reasoning
        reasoning, content = content, reasoning
    return reasoning, content


@dataclass
class ReasoningStream:
    """The same split over a stream of text deltas: `feed` returns (kind, text) pieces, kind
    "reasoning" or "content", holding back a tail that may be the start of a tag until the
    next delta (or the end) says. With `nemotron_v3`'s rule on (`content_forced`) an output that
    ends without `</think>` gets its whole reasoning once more as content, in the last pieces."""
    parser: str
    chat_template_kwargs: dict[str, Any] | None = None
    _buf: str = ""
    _state: str = "start"   # start -> reasoning -> content; qwen3 without <think>: start -> content
    _out: list = field(default_factory=list)
    _reasoning: list = field(default_factory=list)   # what went out as reasoning, kept only under that rule

    def __post_init__(self) -> None:
        self._force_content = content_forced(self.parser, self.chat_template_kwargs)

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
                self._state = "content" if self.parser == "qwen3" else "reasoning"
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
                if final and self._force_content:
                    self._emit("content", "".join(self._reasoning))
                break
            self._emit("content", self._buf)
            self._buf = ""
            break
        return self._out

    def _emit(self, kind: str, text: str) -> None:
        if text:
            self._out.append((kind, text))
            if kind == "reasoning" and self._force_content:
                self._reasoning.append(text)


def _tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
