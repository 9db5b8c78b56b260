"""Prompt logprobs and structured outputs on CUDA, as the engine runs by default there
(CUDA graphs for decode, async scheduling, pinned asynchronous copies): the CPU tests of
both features (test_prompt_logprobs.py, test_structured_outputs.py) cannot reach the
graph rows or the device-side masks. Bits compared as int patterns, never allclose."""
from __future__ import annotations

import json

import pytest
import torch

from vllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _bits(values) -> list[int]:
    return torch.tensor(values, dtype=torch.float32).view(torch.int32).tolist()


def _prompt_values(out, prompt) -> list[float]:
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(prompt) and pl[0] is None
    return [pl[i][prompt[i]].logprob for i in range(1, len(prompt))]


PROMPTS = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate((300, 47, 129, 1, 64, 200))]


@pytest.fixture(scope="module")
def llm(gpu_model):
    return LLM(gpu_model, device="cuda", gpu_memory_utilization=0.3, max_num_batched_tokens=128)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prompt_logprobs_equal_trainer_with_neighbours(llm, temperature):
    """Prompts cut over several 128-token steps, batched with requests that decode (graph
    rows) and ask for nothing: every prompt token's logprob has the trainer's bits."""
    params = [SamplingParams(max_tokens=4, temperature=temperature, seed=i, prompt_logprobs=1) for i in range(3)]
    params += [SamplingParams(max_tokens=40, temperature=1.0, seed=9 + i, logprobs=1) for i in range(3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    policy = llm.policy()
    asked = [p for p in PROMPTS[:3] if len(p) > 1]
    trainer = policy.token_logprobs(asked, [1] * len(asked), temperature=temperature)
    for out, prompt, ref in zip(outs[:3], PROMPTS[:3], trainer):
        assert _bits(_prompt_values(out, prompt)) == ref.detach().view(torch.int32).tolist()
    for out in outs[3:]:
        assert out.prompt_logprobs is None


def test_prompt_logprobs_alone_equal_batched(llm):
    p = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    alone = llm.generate([{"prompt_token_ids": PROMPTS[0]}], [p], use_tqdm=False)[0]
    others = [SamplingParams(max_tokens=30, temperature=1.0, seed=i) for i in range(5)]
    batched = llm.generate([{"prompt_token_ids": q} for q in PROMPTS], [p] + others, use_tqdm=False)[0]
    assert _bits(_prompt_values(alone, PROMPTS[0])) == _bits(_prompt_values(batched, PROMPTS[0]))
    for a, b in zip(alone.prompt_logprobs[1:], batched.prompt_logprobs[1:]):
        assert sorted(a) == sorted(b)


def test_structured_output_bits_do_not_depend_on_neighbours():
    pytest.importorskip("xgrammar")
    from vllm.structured_outputs import StructuredOutputsParams as SO

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}
    llm = LLM(device="cuda", gpu_memory_utilization=0.2)   # the embedded default model, graphs on
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Give me JSON."}], tokenize=False,
                                                     add_generation_prompt=True)
    target = SamplingParams(temperature=1.0, seed=7, max_tokens=30, logprobs=2,
                            structured_outputs=SO(json=schema, disable_any_whitespace=True))
    alone = llm.generate([prompt], [target], use_tqdm=False)[0].outputs[0]
    free = [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=25, logprobs=1) for i in range(6)]
    regex = [SamplingParams(temperature=0.9, seed=5, max_tokens=20, structured_outputs=SO(regex=r"[0-9]{1,3} (a|b)"))]
    outs = llm.generate([prompt] * 8, [target] + free + regex, use_tqdm=False)
    batched = outs[0].outputs[0]
    assert batched.token_ids == alone.token_ids
    lps = [[e[t].logprob for t, e in zip(c.token_ids, c.logprobs)] for c in (alone, batched)]
    assert _bits(lps[0]) == _bits(lps[1])
    if batched.finish_reason == "stop":   # an integer may run past max_tokens
        obj = json.loads(batched.text)
        assert isinstance(obj["ok"], bool) and isinstance(obj["n"], int)
