"""Token ids -> text as clients read it (vllm/tokenizer.py IncrementalDetokenizer,
vllm/engine/output_processor.py RequestState), with the embedded default model's byte-level
tokenizer, whose non-ASCII characters are split over several byte tokens: a token-id prompt
that ends inside a character, streamed text with stop strings, a stop token whose text
completes a stop string."""
from __future__ import annotations

import pytest

from vllm import SamplingParams
from vllm.engine.core_messages import RequestDelta
from vllm.engine.output_processor import RequestState, TokenTextCache
from vllm.tokenizer import IncrementalDetokenizer, load_tokenizer

TEXT = "Q: 中文 é😀 end"


@pytest.fixture(scope="module")
def tok():
    import os

    import vllm
    return load_tokenizer(os.path.join(os.path.dirname(vllm.__file__), "default_model"))


@pytest.mark.parametrize("cut_bytes", [1, 2])
def test_a_prompt_ending_inside_a_character(tok, cut_bytes):
    """An RL turn's token ids cut inside a character: the character's bytes complete in the
    output, whose text then starts with the whole character (as upstream's detokenizer), and
    nothing after it is lost or garbled."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    first = tok.convert_ids_to_tokens(ids).index("ä")    # the first of 中's three byte tokens
    prompt, out = ids[:first + cut_bytes], ids[first + cut_bytes:]
    assert tok.decode(prompt).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.append(t) for t in out]
    assert "".join(deltas) == detok.text == TEXT[len("Q: "):]
    assert all("\ufffd" not in d for d in deltas)


def test_whole_prompts_keep_their_text(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    for cut in range(1, len(ids)):
        detok = IncrementalDetokenizer(tok, ids[:cut])
        for t in ids[cut:]:
            detok.append(t)
        if not tok.decode(ids[:cut]).endswith("\ufffd"):
            assert tok.decode(ids[:cut]) + detok.text == TEXT, cut


def _stream(tok, params: SamplingParams, out_ids: list[int], last_finish=None, last_stop_reason=None):
    prompt = tok.encode("Q:", add_special_tokens=False)
    st = RequestState("r", None, prompt, params, tok, TokenTextCache(tok))
    texts = []
    for k, t in enumerate(out_ids):
        last = k == len(out_ids) - 1
        st.apply(RequestDelta("r", 0, [t], None, last_finish if last else None, last_stop_reason if last else None,
                              [0], 0))
        texts.append(st.output().outputs[0].text)
        if st.finished:
            break
    return st, texts


@pytest.mark.parametrize("stop", ["STOP!", "STO"])
def test_streamed_text_only_grows_with_stop_strings(tok, stop):
    """A running sample's text leaves out what a stop string may be completing (upstream's stop
    buffer): read while streaming (AsyncLLM.generate, LLMEngine.step), it never shrinks."""
    out = tok.encode(" é😀 STOP now", add_special_tokens=False)
    st, texts = _stream(tok, SamplingParams(max_tokens=20, stop=[stop]), out, "length")
    final = texts[-1]
    assert final == (" é😀 STOP now" if stop == "STOP!" else " é😀 ")
    assert all(final.startswith(t) for t in texts)
    assert all(a == b[:len(a)] for a, b in zip(texts, texts[1:]))


@pytest.mark.parametrize("stop", [None, "STOP!", "STO"])
@pytest.mark.parametrize("every", [1, 3])
def test_tails_concatenate_to_the_cumulative_output(tok, stop, every):
    """RequestState.output_tail (a streamed response's chunks): read every `every` deltas, the
    tails' text, token ids and logprobs concatenate to output()'s, each tail holding only what
    is new (a chunk's cost does not grow with the output), stop strings held back as output()
    holds them back; the last tail carries the finish."""
    out = tok.encode(" é😀 STOP now and more text after it", add_special_tokens=False)
    params = SamplingParams(max_tokens=40, stop=[stop] if stop else None, logprobs=1)
    prompt = tok.encode("Q:", add_special_tokens=False)
    st = RequestState("r", None, prompt, params, tok, TokenTextCache(tok))
    marks = [[0, 0]]
    tails, cumulative = [], []
    for k, t in enumerate(out):
        last = k == len(out) - 1
        st.apply(RequestDelta("r", 0, [t], [(-0.5 - k, 1, [(t, -0.5 - k)])], "length" if last else None, None,
                              [0], 0))
        if (k + 1) % every == 0 or last or st.finished:
            c = st.output_tail(marks).outputs[0]
            tails.append(c)
            cumulative.append(st.output().outputs[0])
            assert len(c.token_ids) <= every and len(c.logprobs) == len(c.token_ids)
        if st.finished:
            break
    full = st.output().outputs[0]
    assert "".join(c.text for c in tails) == full.text
    assert [t for c in tails for t in c.token_ids] == full.token_ids
    assert [e for c in tails for e in c.logprobs] == full.logprobs
    assert all("".join(c.text for c in tails[:i + 1]) == cum.text for i, cum in enumerate(cumulative))
    assert tails[-1].finish_reason == full.finish_reason and all(c.finish_reason is None for c in tails[:-1])
    assert st.output_tail(marks).outputs[0].token_ids == [] and st.output_tail(marks).outputs[0].text == ""


def test_a_stop_token_completing_a_stop_string_reports_the_string(tok):
    """A stop token whose own text completes a stop string (kept in the output): the string is
    the stop reason, as upstream."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = tok.encode(" hello", add_special_tokens=False) + [end]
    params = SamplingParams(max_tokens=20, stop=["<|im_end|>"], stop_token_ids=[end], include_stop_str_in_output=True,
                            skip_special_tokens=False)
    st, texts = _stream(tok, params, out, "stop", end)
    c = st.output().outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (" hello<|im_end|>", "stop", "<|im_end|>")


def test_token_bytes_rebuild_the_text_of_byte_level_tokens(tok):
    """Logprobs' `bytes`: each token's own bytes (a token holding part of a character gives
    its bytes, not those of U+FFFD), so the bytes of consecutive tokens join to the text."""
    from vllm.tokenizer import TokenBytes
    tb = TokenBytes(tok)
    for text in ["é 日本", "hello world", " a\n\tb", "🙂!"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert bytes(b for i in ids for b in tb(i)) == text.encode("utf-8"), text
    partial = [i for i in tok.encode("日本", add_special_tokens=False) if tok.decode([i]) == "\ufffd"]
    assert partial and all(tb(i) != list("\ufffd".encode()) for i in partial)


def test_token_bytes_of_sentencepiece_tokens():
    """A SentencePiece-style tokenizer (a word-boundary mark, byte-fallback pieces <0xNN>):
    the mark is a space, a fallback piece its byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from vllm.tokenizer import TokenBytes
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "\u2581hi": 257, "\u2581": 258, "h": 259,
             "i": 260}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    sp = PreTrainedTokenizerFast(tokenizer_object=backend)
    tb = TokenBytes(sp)
    assert tb(257) == list(b" hi") and tb(1 + 0xE6) == [0xE6]
    ids = sp.encode("hi 日", add_special_tokens=False)
    assert bytes(b for i in ids for b in tb(i)).lstrip(b" ") == "hi 日".encode()


def _sentencepiece_tokenizer():
    """A Llama-2 / Mistral-style tokenizer: a word-boundary mark and byte-fallback pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "\u2581": 257}
    for c in "abcdefghijklmnopqrstuvwxyzHW":
        vocab[c] = len(vocab)
    for w in ("\u2581Hello", "\u2581Hi", "\u2581world"):
        vocab[w] = len(vocab)
    merges = []
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize("prompt, cut, want", [("Hello 🙂🙂", 0, " world"), ("🙂🙂🙂🙂", 0, " world"),
                                               ("Hi 🙂🙂", 2, "🙂 world"), ("Hi 日本", 1, "本 world"), ("Hi", 0, " world")])
def test_sentencepiece_byte_fallback_prompt_ends(prompt, cut, want):
    """A byte-fallback decoder shows a whole run of byte tokens as U+FFFD when any character
    in it is cut: the detokenizer finds the prompt's character ends from the tokens' bytes, so
    a prompt ending in emoji does not send its last one again as output text, and a token-id
    prompt cut inside a character gives that character to the output (as upstream counts it)."""
    tok = _sentencepiece_tokenizer()
    whole = tok.encode(prompt + " world", add_special_tokens=False)
    split = len(tok.encode(prompt, add_special_tokens=False)) - cut
    prompt_ids, out_ids = whole[:split], whole[split:]
    d = IncrementalDetokenizer(tok, prompt_ids)
    assert "".join(d.append(t) for t in out_ids) == want


def test_windows_are_never_cleaned_up():
    """Incremental decoding never asks for transformers' clean-up of tokenization spaces
    (transformers 4 applies it where a tokenizer's config asks): on a window it drops the
    space before punctuation, and the character falls out of the text taken by subtraction."""
    from vllm.tokenizer import fast_decoder

    class CleaningTokenizer:    # what transformers 4's decode does with the flag on
        clean_up_tokenization_spaces = True

        def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=True):
            text = "".join(["Hello", " ,", " world", " ."][i] for i in ids)
            return text.replace(" ,", ",").replace(" .", ".") if clean_up_tokenization_spaces else text
    decode = fast_decoder(CleaningTokenizer())
    assert decode([0, 1, 2, 3]) == "Hello , world ."
