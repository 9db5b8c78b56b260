"""The embedded default model (vllm/default_model, made by scripts/make_default_model.py):
trained on the arithmetic task, it answers held-out problems well enough to be useful and
badly enough to leave RL room; transformers loads it and decodes what our engine decodes."""
from __future__ import annotations

import json
import os

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.rl.rewards import build_reward
from vllm.rl.tasks.arithmetic import generate_problems

EVAL_N = 64  # the default recipe's eval set: generate_problems(64, 0, "test")
# measured greedy accuracy on those 64 (CPU, float32 compute of the bf16 weights) is in
# vllm/default_model/README.md; the floor guards against a broken model or engine
ACCURACY_FLOOR = 0.15
ACCURACY_CEILING = 0.90  # the shipped model must leave RL something to learn


@pytest.fixture(scope="module")
def answers():
    problems = generate_problems(EVAL_N, 0, "test")
    llm = LLM(device="cpu")
    outs = llm.chat([p["prompt"] for p in problems], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return problems, outs, llm


def test_greedy_accuracy_is_partial(answers):
    problems, outs, _ = answers
    reward = build_reward("math", 1.0, 0.0)
    right = sum(reward(o.outputs[0].text, p["answer"], p) for p, o in zip(problems, outs))
    assert ACCURACY_FLOOR <= right / EVAL_N <= ACCURACY_CEILING, right
    # well-formed: a bare number, then the end of the turn
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop" and c.text.strip().isdigit(), (c.text, c.finish_reason)


def test_transformers_loads_it_and_decodes_the_same(answers, default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    problems, outs, llm = answers
    with open(os.path.join(default_model_dir, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3ForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    for p, o in list(zip(problems, outs))[:12]:
        ids = tok.apply_chat_template(p["prompt"], add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        assert ids[0].tolist() == list(o.prompt_token_ids)
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        assert gen[0, ids.shape[1]:].tolist() == list(o.outputs[0].token_ids), p
