"""upstream vLLM's prompt types (`from vllm.inputs import TokensPrompt`): typed dicts, which
`LLM.generate` takes as they are."""
from __future__ import annotations

from typing import Any, TypedDict, Union


class _PromptOptions(TypedDict, total=False):
    # prefix-cache blocks are shared only among requests of the same salt: a tenant's prompts
    # cannot be probed through another tenant's cache hits (check_cache_salt has the rules)
    cache_salt: str


class TextPrompt(_PromptOptions):
    prompt: str


class _TokensPromptRequired(_PromptOptions):
    prompt_token_ids: list[int]


class TokensPrompt(_TokensPromptRequired, total=False):
    prompt: str   # the text, kept for the output's `prompt` (not tokenized again)


PromptType = Union[str, TextPrompt, TokensPrompt]

# upstream's limits on a salt (its external KV-cache backends put it in their keys): a salt
# accepted here is accepted there
MAX_CACHE_SALT_LENGTH = 128
_CACHE_SALT_FORBIDDEN_CHARS = frozenset("@/\\\x00")


def check_cache_salt(cache_salt: Any) -> str | None:
    """A prompt's cache salt: None, or a non-empty string of at most 128 characters without
    '@', '/', '\\' or NUL (upstream's rules); anything else is a ValueError."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt must be a non-empty string if given, got {cache_salt!r}")
    if len(cache_salt) > MAX_CACHE_SALT_LENGTH or any(c in _CACHE_SALT_FORBIDDEN_CHARS for c in cache_salt):
        raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT_LENGTH} characters and must not contain "
                         "'@', '/', '\\' or NUL")
    return cache_salt


def prompt_cache_salt(prompt: Any) -> str | None:
    """The checked `cache_salt` of a prompt dict (None for a plain string or a dict without one)."""
    return check_cache_salt(prompt.get("cache_salt")) if isinstance(prompt, dict) else None
