"""The API server's cost per streamed chunk against the output's length: the cumulative
snapshot a chunk used to take (RequestState.output: every token id, logprob entry and the
text so far, copied) beside the tail a streamed response now takes (RequestState.output_tail:
what is new since the previous chunk), one new token a chunk, logprobs with 5 alternatives.

    python benchmarks/stream_chunks.py [--lengths 1024,8192,32768]
"""
from __future__ import annotations

import argparse
import os
import random
import time

import vllm
from vllm import SamplingParams
from vllm.engine.core_messages import RequestDelta
from vllm.engine.output_processor import RequestState, TokenTextCache
from vllm.tokenizer import load_tokenizer


def per_call_us(fn, reps: int = 50) -> float:
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,8192,32768")
    lengths = sorted(int(x) for x in ap.parse_args().lengths.split(","))
    tok = load_tokenizer(os.path.join(os.path.dirname(vllm.__file__), "default_model"))
    rng = random.Random(0)
    words = tok.encode(" the quick brown fox jumps over a lazy dog 0123456789", add_special_tokens=False)
    st = RequestState("r", None, tok.encode("Q:", add_special_tokens=False),
                      SamplingParams(max_tokens=max(lengths), logprobs=5), tok, TokenTextCache(tok))
    print(f"{'tokens':>8}{'cumulative us':>15}{'tail us':>10}{'ratio':>8}   (per chunk of one new token, logprobs=5)")
    n = 0
    for length in lengths:
        while n < length:
            t = rng.choice(words)
            st.apply(RequestDelta("r", 0, [t], [(-1.0, 1, [(w, -2.0) for w in words[:5]])], None, None, [0], 0))
            n += 1
        text_len = len(st.detoks[0].text)

        def tail():   # a chunk after the previous one: one token and its characters are new
            st.output_tail([[max(0, text_len - 4), n - 1]])
        full, new = per_call_us(st.output), per_call_us(tail)
        print(f"{length:>8}{full:>15.1f}{new:>10.1f}{full / new:>8.1f}x", flush=True)


if __name__ == "__main__":
    main()
