"""The built-in arithmetic task (vllm/rl/tasks/arithmetic.py): deterministic, disjoint
train/test splits, correct answers that the math reward accepts."""
from __future__ import annotations

import pytest

from vllm.rl.rewards import build_reward
from vllm.rl.tasks import arithmetic
from vllm.rl.tasks.arithmetic import generate_problems


def _key(p: dict) -> tuple:
    return p["a"], p["op"], p["b"]


def test_deterministic_and_seeded():
    a = generate_problems(300, 0, "train")
    assert a == generate_problems(300, 0, "train")
    assert a != generate_problems(300, 1, "train")
    # a longer list starts with the shorter one (the eval set of size n is a prefix)
    assert generate_problems(50, 0, "test") == generate_problems(200, 0, "test")[:50]


def test_splits_are_disjoint_and_problems_distinct():
    train = [_key(p) for seed in (0, 1) for p in generate_problems(3000, seed, "train")]
    test = [_key(p) for p in generate_problems(400, 0, "test")]
    assert not set(train) & set(test)
    assert len(set(test)) == len(test)
    assert len(set(train[:3000])) == 3000
    assert all(arithmetic.split_of(*k) == "test" for k in test)


def test_answers_are_right_and_well_formed():
    reward = build_reward("math", 1.0, 0.0)
    problems = generate_problems(500, 3, "train")
    ops = {p["op"] for p in problems}
    assert ops == {"+", "-"}
    digits = {len(str(max(p["a"], p["b"]))) for p in problems}
    assert digits == set(range(1, arithmetic.MAX_DIGITS + 1))
    for p in problems:
        a, op, b = _key(p)
        assert p["answer"] == str(a + b if op == "+" else a - b) and int(p["answer"]) >= 0
        assert p["prompt"] == [{"role": "user", "content": f"What is {a} {op} {b}?"}]
        assert reward(p["answer"], p["answer"], p) == 1.0
        assert reward(str(int(p["answer"]) + 1), p["answer"], p) == 0.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        generate_problems(3, 0, "validation")
    with pytest.raises(ValueError, match="fewer than"):
        generate_problems(10_000, 0, "test", max_digits=1)
    assert generate_problems(0, 0, "train") == []


def test_the_default_recipe_uses_it():
    from vllm.entrypoints.cli.train import DEFAULT_RECIPE, find_recipe
    from vllm.rl.config import TrainConfig
    from vllm.rl.data import load_examples

    cfg = TrainConfig.from_yaml(find_recipe(DEFAULT_RECIPE)).validate()
    assert cfg.data.task == "arithmetic" and cfg.data.data is None
    ex = load_examples(None, "arithmetic", prompt_field="prompt", answer_field="answer", size=5, seed=0,
                       split="test")
    assert [e.answer for e in ex] == [p["answer"] for p in generate_problems(5, 0, "test")]
