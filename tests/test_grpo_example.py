"""The example RL loop runs on CPU and its importance ratios are exactly 1."""
import importlib.util
import os


def test_grpo_example_ratio_exactly_one():
    path = os.path.join(os.path.dirname(__file__), "..", "training", "grpo_example.py")
    spec = importlib.util.spec_from_file_location("grpo_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    hist = mod.main(["--device", "cpu", "--steps", "2", "--group", "2", "--max-tokens", "6"])
    assert hist["max_abs_logratio"] == [0.0, 0.0]
