"""Tokenizer loading and incremental detokenization."""
from __future__ import annotations

import os


def encode_text(tokenizer, text: str, add_special_tokens: bool, where: str = "prompt") -> list[int]:
    """tokenizer.encode of user text; text that is not valid Unicode (an unpaired surrogate,
    which JSON's "\\ud800" escape can carry) is a ValueError naming `where`, not the
    tokenizer's TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{where} is not valid Unicode text ({err.reason} at position {err.start})") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def truncation_length(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """SamplingParams.truncate_prompt_tokens as a token count (None: no truncation): -1 is the
    last max_model_len - 1, the most that leaves room for one generated token, as the server's
    truncate_prompt_tokens. A k above max_model_len is upstream's ValueError."""
    k = truncate_prompt_tokens
    if k is None:
        return None
    if k == -1:
        return max_model_len - 1
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({max_model_len}). "
                         "Please, select a smaller truncation size.")
    return k


def truncate_text_ids(tokenizer, text: str, ids: list[int], k: int, add_special_tokens: bool,
                      side: str = "left") -> list[int]:
    """`ids` (encode_text(tokenizer, text, add_special_tokens)) cut to k tokens as upstream's
    tokenizer call with truncation=True, max_length=k cuts them: the special tokens the
    tokenizer adds (a BOS, an EOS) are kept and the text's own tokens are cut to fit, the
    first ones with side "left" (upstream's default), the last with "right". Where k cannot
    hold the special tokens and one text token, the plain last (first) k ids."""
    if len(ids) <= k:
        return list(ids)

    def cut(seq: list[int], n: int) -> list[int]:
        return list(seq[-n:]) if side == "left" else list(seq[:n])

    if add_special_tokens:
        body = tokenizer.encode(text, add_special_tokens=False)
        extra = len(ids) - len(body)
        if 0 < extra < k:
            # the special tokens sit around the text's tokens: find where, so they are put back
            # where the tokenizer put them (a template may add some before and some after)
            for start in range(extra + 1):
                if list(ids[start:start + len(body)]) == list(body):
                    return list(ids[:start]) + cut(body, k - extra) + list(ids[start + len(body):])
    return cut(ids, k)


def load_tokenizer(path: str):
    from vllm.config import resolve_model_dir
    path = resolve_model_dir(path)
    if not (os.path.isfile(os.path.join(path, "tokenizer.json")) or os.path.isfile(os.path.join(path, "tokenizer_config.json"))):
        raise ValueError(f"no tokenizer files (tokenizer.json / tokenizer_config.json) in {path!r}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def fast_decoder(tokenizer):
    """`tokenizer.decode`, or the Rust tokenizer's own decode where that is the same
    function: a transformers fast tokenizer without clean-up of tokenization spaces
    decodes with exactly that call, minus about 10 us of Python per call (two calls per
    generated token)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode") and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend.decode

    def decode(ids, **kwargs):
        # never the clean-up of tokenization spaces (transformers 4 applies it where the
        # tokenizer asks): on a window it drops the space before a punctuation mark, which
        # then falls out of the text taken by subtraction; upstream's detokenizer never applies it
        return tokenizer.decode(ids, clean_up_tokenization_spaces=False, **kwargs)
    return decode


WINDOW = 6            # prompt tokens decoded before the first output token, for its leading space
MAX_CHAR_BYTES = 4    # UTF-8: a character spans at most 4 byte tokens


class IncrementalDetokenizer:
    """Appends text as tokens arrive without re-decoding the whole output each step.

    Decodes a short window of tokens before the new ones and keeps only the new
    suffix, which handles byte-level BPE tokens that only form a character
    together (an incomplete UTF-8 sequence shows as U+FFFD and is held back).
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self._decode = fast_decoder(tokenizer)
        # the last WINDOW prompt tokens give the first output token its context; up to
        # MAX_CHAR_BYTES more so that neither end of that window cuts a character: a token-id
        # prompt may end inside one (an RL turn's ids cut at max_tokens), whose bytes then
        # belong to the output's first character (as upstream's detokenizer counts them), and a
        # window starting inside one would decode its bytes alone
        tail = list(prompt_ids[-(WINDOW + 2 * MAX_CHAR_BYTES):])
        token_bytes = token_bytes_of(tokenizer)
        if token_bytes.kind == "sentencepiece":
            # a byte-fallback decoder turns a whole run of byte tokens into U+FFFD when any of
            # its characters is cut, so where the window's text shows U+FFFD says nothing of
            # which end is cut: the ends are found from the tokens' bytes instead
            start, read = _character_ends(tail, token_bytes)
        else:
            read = len(tail)
            while read > 0 and len(tail) - read < MAX_CHAR_BYTES and \
                    self._text(tail[max(0, read - WINDOW):read]).endswith("\ufffd"):
                read -= 1
            start = max(0, read - WINDOW)
            while start > 0 and max(0, read - WINDOW) - start < MAX_CHAR_BYTES and \
                    self._text(tail[start:read]).startswith("\ufffd"):
                start -= 1
        self.ids: list[int] = tail[start:]
        self.prefix_offset = 0
        self.read_offset = read - start
        self.text = ""

    def _text(self, ids: list[int]) -> str:
        return self._decode(ids, skip_special_tokens=self.skip)

    def append(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = self._decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += new
            return new
        return ""


def _character_ends(tail: list[int], token_bytes) -> tuple[int, int]:
    """(start, read) in `tail` for IncrementalDetokenizer from the tokens' own UTF-8 bytes:
    `read` the last position (at most MAX_CHAR_BYTES back from the end) where the bytes before
    end a whole character, `start` the last such position at or before `read - WINDOW`."""
    stream = bytearray()
    offsets = [0]
    for t in tail:
        stream += bytes(token_bytes(t))
        offsets.append(len(stream))

    def ends_a_character(i: int) -> bool:
        o = offsets[i]
        if o < len(stream):
            return (stream[o] & 0xC0) != 0x80     # the next byte starts a character
        j = len(stream) - 1                        # the end: is the last character whole?
        while j > 0 and (stream[j] & 0xC0) == 0x80:
            j -= 1
        lead = stream[j] if stream else 0
        size = 1 if lead < 0xC0 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
        return j + size <= len(stream)

    n = len(tail)
    read = next((i for i in range(n, max(0, n - MAX_CHAR_BYTES) - 1, -1) if ends_a_character(i)), n)
    first = max(0, read - WINDOW)
    start = next((i for i in range(first, max(0, first - MAX_CHAR_BYTES) - 1, -1) if ends_a_character(i)), first)
    return start, read


def token_bytes_of(tokenizer) -> "TokenBytes":
    """The tokenizer's TokenBytes, made once (it caches per token id)."""
    got = tokenizer.__dict__.get("_vllm_token_bytes")
    if got is None:
        got = tokenizer.__dict__["_vllm_token_bytes"] = TokenBytes(tokenizer)
    return got


def find_stop_string(text: str, before: int, stops: list[str]) -> tuple[int, str] | None:
    """The first stop string, in the list's order, that ends in the new part of `text`
    (`text[before:]`), as (position, stop string), or None (upstream's rule: a stop string may
    start up to its length - 1 characters before the new text, and the list order decides
    between two that end in it)."""
    for s in stops:
        pos = text.find(s, max(0, before - len(s) + 1))
        if pos >= 0:
            return pos, s
    return None


def _byte_level_alphabet() -> dict[str, int]:
    """The printable characters byte-level BPE (GPT-2's scheme, which ByteLevel pre-tokenizers
    apply) writes for the 256 byte values, mapped back to the bytes: printable Latin-1 bytes
    stand for themselves, the others for 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    shown = set(printable)
    out = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in shown:
            out[chr(256 + extra)] = b
            extra += 1
    return out


class TokenBytes:
    """A token id's own UTF-8 bytes, as OpenAI's logprobs `bytes` give them: for a token that
    holds part of a character, its bytes, not those of the U+FFFD its lone decode shows (a
    client joins the bytes of consecutive tokens to rebuild the character). Byte-level BPE
    tokens map back through the byte alphabet; SentencePiece tokens read their byte-fallback
    pieces (<0xNN>) and the word-boundary mark (a space); added tokens and other tokenizers
    give their text's bytes. Cached per id."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        decoder = repr(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None))
        self._kind = "byte_level" if "ByteLevel" in decoder else \
            "sentencepiece" if ("ByteFallback" in decoder or "Metaspace" in decoder or "\u2581" in decoder) else "text"
        self._alphabet = _byte_level_alphabet() if self._kind == "byte_level" else None
        self._added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}) or {}}
        self._cache: dict[int, list[int]] = {}

    @property
    def kind(self) -> str:
        """"byte_level", "sentencepiece" or "text" (a token's bytes are its text's)."""
        return self._kind

    def __call__(self, token_id: int, decoded: str | None = None) -> list[int]:
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = list(self._bytes(token_id, decoded))
        return got

    def _bytes(self, token_id: int, decoded: str | None) -> bytes:
        piece = self._tok.convert_ids_to_tokens(token_id) if self._kind != "text" else None
        if piece is None or token_id in self._added:
            return (decoded if decoded is not None else self._tok.decode([token_id])).encode("utf-8")
        if self._kind == "byte_level":
            if all(ch in self._alphabet for ch in piece):
                return bytes(self._alphabet[ch] for ch in piece)
            return piece.encode("utf-8")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")
