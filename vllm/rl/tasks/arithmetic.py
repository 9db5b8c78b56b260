"""Multi-digit addition and subtraction, asked in chat format: the default RL task.

A problem is one user turn, "What is 47 + 58?", and its answer the result as a
decimal integer ("105"). Each operand has 1 to `MAX_DIGITS` digits (the digit count
drawn uniformly, then the value uniformly among numbers of that many digits), the
operator is + or -, and a subtraction never goes below zero (the larger operand comes
first), so every answer is a non-negative integer the math verifier
(vllm/rl/rewards.py) checks exactly.

Splits: a problem belongs to "test" when a hash of its text falls in 1/`TEST_EVERY`
of the hash range, otherwise to "train", so the two splits are disjoint whatever the
seed or size. Within one call every problem is distinct. The output depends only on
(n, seed, split): the draws come from `random.Random` seeded with a string.
"""
from __future__ import annotations

import hashlib
import random

MAX_DIGITS = 2
OPERATORS = ("+", "-")
TEST_EVERY = 16  # 1/16 of all problems are held out for evaluation
QUESTION = "What is {a} {op} {b}?"
SPLITS = ("train", "test")


def question(a: int, op: str, b: int) -> str:
    return QUESTION.format(a=a, op=op, b=b)


def solve(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    raise ValueError(f"unknown operator {op!r}")


def split_of(a: int, op: str, b: int) -> str:
    """The split a problem belongs to: a fixed function of the problem alone."""
    h = int.from_bytes(hashlib.sha256(f"{a}{op}{b}".encode()).digest()[:8], "little")
    return "test" if h % TEST_EVERY == 0 else "train"


def _operand(rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(1, max_digits)
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(lo, 10 ** digits - 1)


def _space(max_digits: int, split: str) -> int:
    """Half the expected number of distinct problems of a split (the size check: rejection
    sampling stays quick below it)."""
    n = 10 ** max_digits
    total = n * n + n * (n + 1) // 2  # a + b ordered, a - b with a >= b
    return total // TEST_EVERY // 2 if split == "test" else total // 2


def problem(a: int, op: str, b: int) -> dict:
    """One record: {"prompt": [user message], "answer": str, "a", "op", "b"}."""
    return {"prompt": [{"role": "user", "content": question(a, op, b)}], "answer": str(solve(a, op, b)),
            "a": a, "op": op, "b": b}


def generate_problems(n: int, seed: int = 0, split: str = "train", max_digits: int = MAX_DIGITS) -> list[dict]:
    """`n` distinct problems of `split` ("train" | "test"), a fixed function of (n, seed, split)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if max_digits < 1:
        raise ValueError(f"max_digits must be >= 1, got {max_digits}")
    if n > _space(max_digits, split):
        raise ValueError(f"asked for {n} {split} problems; with operands of at most {max_digits} digits there are "
                         f"fewer than {_space(max_digits, split)}")
    rng = random.Random(f"arithmetic:{seed}:{split}:{max_digits}")
    seen: set[tuple[int, str, int]] = set()
    out = []
    while len(out) < n:
        a, b = _operand(rng, max_digits), _operand(rng, max_digits)
        op = OPERATORS[rng.randrange(len(OPERATORS))]
        if op == "-" and b > a:
            a, b = b, a
        key = (a, op, b)
        if key in seen or split_of(a, op, b) != split:
            continue
        seen.add(key)
        out.append(problem(a, op, b))
    return out


__all__ = ["generate_problems", "problem", "question", "solve", "split_of", "MAX_DIGITS", "OPERATORS"]
