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


def test_tiny_temperatures_and_seeds_out_of_range(llm):
    """Upstream's floor: a positive temperature below 0.01 is raised to it, with a warning
    (logits / 1e-40 overflow: NaN logprobs, a draw that is not the greedy token). A seed
    beyond int64 is refused at construction instead of failing the whole batch's step."""
    with pytest.warns(UserWarning, match="raised"):
        sp = SamplingParams(temperature=1e-40, max_tokens=2, logprobs=0, seed=1)
    assert sp.temperature == 0.01
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], sp, use_tqdm=False)[0].outputs[0]
    greedy = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=2),
                          use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy.token_ids
    assert all(np.isfinite(lp[t].logprob) for lp, t in zip(out.logprobs, out.token_ids))
    for seed in (2 ** 63, -2 ** 63 - 1, True):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)


def test_the_tokenizers_eos_stops_beside_the_configs(tmp_path):
    """A generation_config naming another EOS (a fine-tune's stale one) adds to the
    tokenizer's EOS, as upstream: both stop a request, the other with its id as stop_reason."""
    d = tmp_path / "m"
    shutil.copytree(default_model_path(), d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [7]
    (d / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(d), device="cpu")
    tok_eos = llm.get_tokenizer().eos_token_id
    assert tok_eos is not None and tok_eos != 7
    assert llm.llm_engine.eos_token_ids == [tok_eos, 7]   # the tokenizer's is the main one


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


# ---- edge cases a demanding user hits (each once lost or hung requests) -----------------------

def test_a_cache_smaller_than_the_context_caps_it():
    """A sequence longer than the whole KV cache could never be scheduled and failed every
    request with it: the engine serves the context its cache holds."""
    small = LLM(device="cpu", num_gpu_blocks_override=5, block_size=16)   # 4 usable blocks: 64 tokens
    assert small.llm_engine.config.model.max_model_len == 64
    with pytest.raises(ValueError, match="more than the KV cache holds"):   # asked for: an error, as upstream
        LLM(device="cpu", num_gpu_blocks_override=5, block_size=16, max_model_len=128)
    with pytest.raises(ValueError, match="context"):
        small.generate([{"prompt_token_ids": [5] * 64}], SamplingParams(max_tokens=4), use_tqdm=False)
    outs = small.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7] * 50}],
                          SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 40
    assert len(outs[1].outputs[0].token_ids) == 14 and outs[1].outputs[0].finish_reason == "length"


def test_request_ids_and_params_checked_before_anything_is_queued(llm):
    eng = llm.llm_engine
    eng.add_request("x", {"prompt_token_ids": [5, 6]}, SamplingParams(n=2, max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("x#0", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2))
    while eng.has_unfinished_requests():
        eng.step()
    assert not eng._groups  # "x" finished, nothing stuck
    sp = SamplingParams(max_tokens=4)
    sp.n = 0  # set after construction: checked when used
    with pytest.raises(ValueError, match="n must be"):
        llm.generate(["hi"], sp, use_tqdm=False)
    assert not eng.has_unfinished_requests() and not eng._groups


def test_stop_strings_min_tokens_and_the_stopping_token(llm):
    prompt, base = "1 2 3 4", dict(temperature=0, max_tokens=8, ignore_eos=True)
    tok = llm.get_tokenizer()
    free = llm.generate([prompt], SamplingParams(**base), use_tqdm=False)[0].outputs[0]
    toks = free.token_ids
    assert free.text == "92238700"  # the embedded model's greedy digits after this prompt

    def run(**kw):
        return llm.generate([prompt], SamplingParams(**{**base, **kw}), use_tqdm=False)[0].outputs[0]
    assert run(stop=["2"]).text == "9"
    # min_tokens: stop strings wait past the first 3 tokens; the 4th may complete one that
    # started in their text (upstream's window: a stop string's length - 1 characters back)
    o = run(stop=["2"], min_tokens=3)
    assert (o.text, o.finish_reason) == ("92238700", "length")
    o = run(stop=["3"], min_tokens=3)
    assert (o.text, o.stop_reason) == ("922", "3")
    o = run(stop=["23"], min_tokens=3)
    assert (o.text, o.stop_reason) == ("92", "23")
    # two stop strings ending in the same token: the list's order decides, as upstream
    assert (run(stop=["3", "23"]).text, run(stop=["23", "3"]).text) == ("922", "92")
    # a stop string completed by the last allowed token: "stop", as upstream reports it
    o = run(stop=["3"], max_tokens=4)
    assert (o.text, o.finish_reason, o.stop_reason) == ("922", "stop", "3")
    # a stop token's text stays out of the output, unless include_stop_str_in_output
    o = run(stop_token_ids=[toks[4]])
    assert (o.token_ids, o.text, o.stop_reason) == (toks[:5], "9223", toks[4])
    assert run(stop_token_ids=[toks[4]], include_stop_str_in_output=True).text == "92238"
    assert tok.decode(toks[:5]) == "92238"


def test_generate_from_two_threads(llm):
    import threading
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(["a", "b", "c"], sp, use_tqdm=False)]
    got, errors = {}, []

    def run(k):
        try:
            got[k] = [o.outputs[0].token_ids for o in llm.generate(["a", "b", "c"], sp, use_tqdm=False)]
        except Exception as err:  # noqa: BLE001
            errors.append(err)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got[0] == got[1] == want


def _sampled_and_prompt_logprobs(llm, **mode):
    sp = SamplingParams(temperature=0.5, seed=3, max_tokens=4, logprobs=0, prompt_logprobs=0, ignore_eos=True,
                        **mode)
    out = llm.generate([{"prompt_token_ids": [5, 17, 3, 99, 41]}], sp, use_tqdm=False)[0]
    c = out.outputs[0]
    return (list(c.token_ids), [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)],
            [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]])


def test_engine_logprobs_mode_is_the_default_of_requests_that_leave_it_unset(tiny_qwen3):
    """upstream's engine argument: LLM(logprobs_mode=...) is what a request without its own
    reports (sampled and prompt logprobs); a request's own mode still wins; the sampled
    tokens do not change; the caller's SamplingParams are not written."""
    llm = LLM(tiny_qwen3, device="cpu", logprobs_mode="raw_logprobs")
    assert llm.config.logprobs_mode == "raw_logprobs"
    unset = _sampled_and_prompt_logprobs(llm)
    assert unset == _sampled_and_prompt_logprobs(llm, logprobs_mode="raw_logprobs")
    tempered = _sampled_and_prompt_logprobs(llm, logprobs_mode="tempered_logprobs")
    assert tempered[0] == unset[0] and tempered[1] != unset[1] and tempered[2] != unset[2]
    sp = SamplingParams(max_tokens=2, logprobs=0)
    llm.generate([{"prompt_token_ids": [5, 6]}], sp, use_tqdm=False)
    assert sp.logprobs_mode is None
    # an engine given no mode reports tempered_logprobs, as before the setting existed
    assert _sampled_and_prompt_logprobs(LLM(tiny_qwen3, device="cpu")) == tempered


def test_an_unknown_engine_logprobs_mode_is_refused_naming_the_valid_ones(tmp_path):
    from vllm.sampling_params import LOGPROBS_MODES
    # refused before the model is read: the missing checkpoint is not what it reports
    with pytest.raises(ValueError, match="logprobs_mode must be one of") as err:
        LLM(str(tmp_path / "nonexistent"), device="cpu", logprobs_mode="logits")
    assert all(mode in str(err.value) for mode in LOGPROBS_MODES) and "'logits'" in str(err.value)
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        SamplingParams(logprobs_mode="logits")
