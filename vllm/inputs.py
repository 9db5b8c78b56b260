"""upstream vLLM's prompt types (`from vllm.inputs import TokensPrompt`): typed dicts, which
`LLM.generate` takes as they are."""
from __future__ import annotations

from typing import TypedDict, Union


class TextPrompt(TypedDict):
    prompt: str


class _TokensPromptRequired(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokensPromptRequired, total=False):
    prompt: str   # the text, kept for the output's `prompt` (not tokenized again)


PromptType = Union[str, TextPrompt, TokensPrompt]
