"""Rewards: a math answer verifier, exact match, and user functions.

Math verifier: the prediction is the content of the LAST \\boxed{...} (or \\fbox{...},
braces matched), else what follows the last "answer is" / "answer:" up to the end of its
clause (the first number there, or the first number after the marker when its line ends in
":"), else the
last number in the response; an equation given as the answer counts by its last side
("answer: 47 + 58 = 105" is 105, as Minerva's normalisation takes it). Prediction and
reference are equal when both parse as numbers (integers, decimals, thousands separators,
scientific notation with |exponent| <= 1000, a/b, \\frac{a}{b}, a trailing %) that are
equal exactly as rationals, or (unless both are integers) within a relative 1e-9 (a
rounded decimal of 1/3), compared as rationals, or when their normalised LaTeX strings are
identical.

A custom reward is given as `module:function` (or `path/to/file.py:function`) and is
called as

    fn(response: str, answer: str, record: dict) -> float

with the response text, the record's reference answer (a string) and the whole data
record; it must return a finite number.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
from fractions import Fraction
from typing import Callable

# ---- extraction -------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")
# numeric answers past these are not numbers: Fraction("1e1000000000") builds 10**N exactly
MAX_NUMBER_CHARS = 1000
MAX_EXPONENT = 1000
_ANSWER_RE = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*", re.IGNORECASE)
# a number: sign, digits (optionally grouped by commas), decimals, exponent, or a fraction a/b
_NUMBER_RE = re.compile(
    r"(?<![\w.])[-+\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?(?![\w])")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (braces matched), or of `\\boxed 5`."""
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    # each "{" and its matching "}", in one pass (rescanning per unbalanced box is quadratic)
    close: dict[int, int] = {}
    opened: list[int] = []
    for j, ch in enumerate(text):
        if ch == "{":
            opened.append(j)
        elif ch == "}" and opened:
            close[opened.pop()] = j
    for m in reversed(matches):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            if i in close:
                return text[i + 1:close[i]].strip()
            continue  # unbalanced: try an earlier box
        rest = re.match(r"[^\s$]+", text[i:])
        if rest and i > m.end():  # "\\boxed 5" (space then a token)
            return rest.group(0)
    return None


def _numbers(text: str) -> list[str]:
    return [m.group(0) for m in _NUMBER_RE.finditer(text) if re.search(r"\d", m.group(0))]


def extract_answer(response: str) -> str | None:
    """The predicted final answer of a response (None when it gives none)."""
    boxed = last_boxed(response)
    if boxed is not None:
        return _final_side(boxed)
    hits = list(_ANSWER_RE.finditer(response))
    if hits:
        after = response[hits[-1].end():]
        line, _, following = after.partition("\n")
        rest = _final_side(_answer_clause(line.strip()))
        nums = _numbers(rest)
        if nums:
            return nums[0]
        if rest and not rest.endswith(":"):
            return rest.rstrip(".")
        # "The answer is as follows:" / a bare marker: the first number after it
        nums = _numbers(following)
        if nums:
            return nums[0]
        if rest:
            return rest.rstrip(".")
    nums = _numbers(response)
    return nums[-1] if nums else None


# where the answer's own clause ends: "; ...", ", because ...", ". Check: ..." (a comma or
# period followed by a space, so "1,000" and "2.5" stay whole)
_CLAUSE_END_RE = re.compile(r";|[,.](?=\s)|\s(?:because|since|as|so|where|which|check|thus|hence)\b",
                            re.IGNORECASE)


def _answer_clause(line: str) -> str:
    """The answer itself from the rest of its line ("105, because 100 + 5 = 105" -> "105")."""
    m = _CLAUSE_END_RE.search(line)
    return line[:m.start()].strip() if m and m.start() > 0 else line


def _final_side(answer: str) -> str:
    """The last side of an equation given as the answer ("47 + 58 = 105" -> "105"), as
    Minerva's normalisation takes it (its appendix D: split on "=", keep the last part)."""
    return answer.rsplit("=", 1)[-1].strip() if "=" in answer else answer


# ---- equivalence ------------------------------------------------------------------------

def _strip_text_macros(s: str) -> str:
    # \text{abc} / \mathrm{abc} / \textbf{abc} -> abc
    return re.sub(r"\\(?:text|mathrm|textbf|mathbf|operatorname)\s*\{([^{}]*)\}", r"\1", s)


def normalize(s: str) -> str:
    """Canonical text of an answer: no $, spacing macros, \\left/\\right, units of degrees
    and percent, trailing period; \\dfrac/\\tfrac -> \\frac; \\sqrt3 -> \\sqrt{3}."""
    s = s.strip().replace("\u2212", "-")
    s = _strip_text_macros(s)
    for tok in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "^\\circ", "^{\\circ}", "\\%", "%",
                "\\displaystyle"):
        s = s.replace(tok, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    # "x=3" / "y = 3": the value
    if re.fullmatch(r"[a-zA-Z]\w*=[^=]+", s):
        s = s.split("=", 1)[1]
    return s


def to_number(s: str) -> Fraction | None:
    """The exact value of a numeric answer (None when it is not a number)."""
    s = normalize(s)
    neg = False
    if s.startswith("-"):
        neg, s = True, s[1:]
    elif s.startswith("+"):
        s = s[1:]
    m = re.fullmatch(r"\\frac\{([^{}]+)\}\{([^{}]+)\}", s)
    if m:
        a, b = to_number(m.group(1)), to_number(m.group(2))
        if a is None or b is None or b == 0:
            return None
        v = a / b
        return -v if neg else v
    if re.fullmatch(r"\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    m = re.fullmatch(r"(\d+(\.\d*)?|\.\d+)([eE]([-+]?\d+))?(/(\d+(\.\d*)?|\.\d+))?", s)
    if m:
        if len(s) > MAX_NUMBER_CHARS or (m.group(4) and abs(int(m.group(4))) > MAX_EXPONENT):
            return None   # exact 10**N for a huge N would take minutes and gigabytes
        try:
            num, _, den = s.partition("/")
            v = Fraction(num) / Fraction(den) if den else Fraction(num)
        except (ValueError, ZeroDivisionError):
            return None
        return -v if neg else v
    return None


def answers_match(pred: str | None, gold: str) -> bool:
    if pred is None:
        return False
    a, b = to_number(pred), to_number(gold)
    if a is not None and b is not None:
        if a == b:
            return True
        if a.denominator == 1 and b.denominator == 1:
            return False  # integers: exact (a tolerance would equate large neighbours)
        # in rationals: no float conversion, which overflows past 1e308
        return abs(a - b) <= Fraction(1, 10 ** 9) * abs(b)
    return normalize(pred) == normalize(gold) and normalize(gold) != ""


# ---- reward functions -------------------------------------------------------------------

RewardFn = Callable[[str, str, dict], float]


def math_reward(correct: float = 1.0, wrong: float = 0.0) -> RewardFn:
    def reward(response: str, answer: str, record: dict) -> float:
        return correct if answers_match(extract_answer(response), answer) else wrong
    return reward


def exact_match_reward(correct: float = 1.0, wrong: float = 0.0) -> RewardFn:
    def reward(response: str, answer: str, record: dict) -> float:
        return correct if response.strip() == answer.strip() else wrong
    return reward


def digit_fraction(response: str, answer: str, record: dict) -> float:
    """The fraction of the response's characters that are digits. For random-weight recipes
    (`reward: vllm.rl.rewards:digit_fraction`): such a model never answers, so `math` gives
    every response 0, every GRPO advantage is 0 and the weights never move; this reward
    varies within a group, so every step updates the weights and the rollout/trainer diff
    is checked on updated weights."""
    del answer, record
    return sum(c.isdigit() for c in response) / max(1, len(response))


def load_custom(spec: str) -> RewardFn:
    """`module:function` or `path/to/file.py:function`, checked to accept (response, answer, record)."""
    mod_name, _, fn_name = spec.rpartition(":")
    try:
        if mod_name.endswith(".py"):
            if not os.path.isfile(mod_name):
                raise ValueError(f"reward {spec!r}: file {mod_name!r} does not exist")
            loader_spec = importlib.util.spec_from_file_location(f"_reward_{abs(hash(mod_name))}", mod_name)
            mod = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(mod_name)
    except (ImportError, SyntaxError) as err:
        raise ValueError(f"reward {spec!r}: cannot import {mod_name!r} ({type(err).__name__}: {err})") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {mod_name!r} has no function {fn_name!r}")
    try:
        inspect.signature(fn).bind("response", "answer", {})
    except TypeError:
        raise ValueError(f"reward {spec!r}: must accept (response: str, answer: str, record: dict), "
                         f"its signature is {fn_name}{inspect.signature(fn)}") from None
    except ValueError:
        pass  # builtins without a signature: trust them

    def reward(response: str, answer: str, record: dict) -> float:
        value = fn(response, answer, record)
        # numbers.Real: numpy and other scalar floats too
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise InvalidReward(f"returned {value!r}; it must return a finite number")
        return float(value)
    return reward


class InvalidReward(ValueError):
    """A custom reward returned something other than a finite number."""


def build_reward(spec: str, correct: float = 1.0, wrong: float = 0.0) -> RewardFn:
    if spec == "math":
        return math_reward(correct, wrong)
    if spec == "exact":
        return exact_match_reward(correct, wrong)
    if ":" in spec:
        return load_custom(spec)
    raise ValueError(f"reward must be math | exact | module:function, got {spec!r}")
