"""Code written for upstream vLLM's offline API: prompt types, SamplingParams' normal form and
fields set after construction, upstream engine arguments that change nothing here, and the
generation_config defaults of `generate` without SamplingParams."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from vllm import LLM, SamplingParams
from vllm.config import default_model_path
from vllm.inputs import TokensPrompt


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", trust_remote_code=True, disable_log_stats=True, load_format="auto",
               distributed_executor_backend="external_launcher")


def test_sampling_params_normal_form():
    sp = SamplingParams(stop="x", seed=-1)
    assert sp.stop == ["x"] and sp.stop_token_ids == [] and sp.seed is None  # upstream's forms
    sp.stop = ["y", "z"]  # set after construction, as RL frameworks do per batch
    assert sp.stop_strings == ["y", "z"]
    assert sp.clone() == sp and sp.clone() is not sp
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["a"], detokenize=False)


def test_stop_set_after_construction_takes_effect(llm):
    ids = [5, 6, 7, 8, 9, 10]
    free = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(temperature=0, max_tokens=12,
                                                                              ignore_eos=True), use_tqdm=False)
    text = free[0].outputs[0].text
    assert len(text) > 2
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sp.stop = [text[1:3]]
    cut = llm.generate([{"prompt_token_ids": np.array(ids)}], sp, use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == text[1:3] and text.startswith(cut.text)
    assert len(cut.text) < len(text)


def test_numpy_token_ids(llm):
    a = llm.generate([{"prompt_token_ids": [np.int64(5), np.int64(6)]}], SamplingParams(temperature=0, max_tokens=3),
                     use_tqdm=False)[0]
    b = llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert a.prompt_token_ids == [5, 6] and a.outputs[0].token_ids == b.outputs[0].token_ids


def test_generate_takes_upstream_keywords(llm):
    sp = SamplingParams(temperature=0, max_tokens=2)
    a = llm.generate(["hi"], sp, use_tqdm=False, lora_request=None, priority=[0])[0]
    assert a.outputs[0].token_ids == llm.generate(["hi"], sp, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="LoRA"):
        llm.generate(["hi"], sp, use_tqdm=False, lora_request=object())


def test_upstream_engine_args():
    with pytest.raises(ValueError, match="enable_lora=True"):
        LLM(device="cpu", enable_lora=True)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        LLM(device="cpu", pipeline_parallel_size=2)
    with pytest.raises(TypeError, match="not_an_arg"):
        LLM(device="cpu", not_an_arg=1)


def test_generate_without_params_uses_generation_config(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(default_model_path(), d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen.update(temperature=0.0, max_new_tokens=3)
    (d / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(d), device="cpu")
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.max_tokens) == (0.0, 3)
    out = llm.generate(["What is 2 + 2?"], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 3
    assert LLM(str(d), device="cpu", generation_config="vllm").get_default_sampling_params() == SamplingParams()
