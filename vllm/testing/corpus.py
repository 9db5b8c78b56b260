"""The training corpus of the project's BPE tokenizer: `vllm/testing/data/corpus.txt`.

English prose, Python source, numbers / arithmetic and ChatML-formatted dialogues,
roughly what the engine's tests and the embedded default model see. Its exact bytes
are pinned by the repository (read as UTF-8 without newline translation): the tokenizer
trained on it must be byte-for-byte reproducible.

DO NOT casually edit the data file: every change alters the trained tokenizer and
therefore the token ids of every test checkpoint and of ``vllm/default_model``
(re-run ``scripts/make_default_model.py`` after any change).
"""
from __future__ import annotations

import functools
import os

CORPUS_PATH = os.path.join(os.path.dirname(__file__), "data", "corpus.txt")


@functools.lru_cache(maxsize=1)
def get_corpus() -> str:
    """The full tokenizer-training corpus (cached)."""
    with open(CORPUS_PATH, encoding="utf-8", newline="") as f:
        return f.read()
