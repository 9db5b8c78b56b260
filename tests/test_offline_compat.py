"""Code written for upstream vLLM's offline API: prompt types, SamplingParams' normal form and
fields set after construction, upstream engine arguments that change nothing here, and the
generation_config defaults of `generate` without SamplingParams."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

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


def test_detokenize_false_decodes_nothing(llm):
    """detokenize=False (verl sets it with logprobs=0): no text, and every logprob entry's
    decoded_token None, prompt logprobs' too (as upstream, which then has no tokenizer for
    them); the numbers are the detokenized run's."""
    sp = dict(max_tokens=4, temperature=0, logprobs=1, prompt_logprobs=1)
    plain = llm.generate(["hello there"], SamplingParams(**sp), use_tqdm=False)[0]
    raw = llm.generate(["hello there"], SamplingParams(detokenize=False, **sp), use_tqdm=False)[0]
    out = raw.outputs[0]
    assert out.text == "" and out.token_ids == plain.outputs[0].token_ids
    assert all(lp.decoded_token is None for entry in out.logprobs for lp in entry.values())
    assert all(lp.decoded_token is None for entry in raw.prompt_logprobs[1:] for lp in entry.values())
    assert [{t: lp.logprob for t, lp in e.items()} for e in out.logprobs] == \
        [{t: lp.logprob for t, lp in e.items()} for e in plain.outputs[0].logprobs]


def test_bad_call_shapes_are_value_errors(llm):
    """Arguments of the wrong kind are ValueErrors naming what was expected (not a TypeError
    from deep inside); numpy integers are taken where upstream takes them."""
    for prompts in (5, None):
        with pytest.raises(ValueError, match="prompts must be"):
            llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"SamplingParams\(\*\*params\)"):
        llm.generate("hi", {"max_tokens": 2}, use_tqdm=False)
    with pytest.raises(ValueError, match="holding"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=1), {"max_tokens": 1}], use_tqdm=False)
    sp = SamplingParams(n=np.int64(2), seed=np.int64(3), logprobs=np.int32(1), prompt_logprobs=np.int64(0))
    assert (sp.n, sp.seed, sp.logprobs, sp.prompt_logprobs) == (2, 3, 1, 0) and type(sp.seed) is int
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=True)
    with pytest.raises(ValueError, match="seed must be an integer"):
        LLM(device="cpu", seed="x")


def test_upstream_module_names():
    """Older import paths RL code still uses: vllm.sequence.Logprob, vllm.utils.get_open_port."""
    import socket

    import vllm
    from vllm.sequence import Logprob
    from vllm.utils import get_ip, get_open_port
    assert Logprob is vllm.Logprob and isinstance(get_ip(), str)
    port = get_open_port()
    with socket.socket() as s:
        s.bind(("", port))     # free when asked


def test_sampling_params_upstream_conveniences():
    """logprobs=True / prompt_logprobs=True mean 1, False none; temperature 0 resets
    top_p, top_k and min_p (greedy); best_of may be None, 1 or n; upstream's number types stay
    accepted (numpy's included)."""
    sp = SamplingParams(logprobs=True, prompt_logprobs=True)
    assert (sp.logprobs, sp.prompt_logprobs) == (1, 1)
    sp = SamplingParams(logprobs=False, prompt_logprobs=False)
    assert (sp.logprobs, sp.prompt_logprobs) == (None, None)
    greedy = SamplingParams(temperature=0, top_p=0.5, top_k=2, min_p=0.3)
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert (SamplingParams(temperature=0.5, top_p=0.5, top_k=2, min_p=0.3).top_k) == 2
    assert SamplingParams(best_of=None).best_of is None and SamplingParams(best_of=1).best_of == 1
    assert SamplingParams(n=3, best_of=3).n == 3
    with pytest.raises(ValueError, match="best_of=2 is not supported"):
        SamplingParams(best_of=2)
    with pytest.raises(ValueError, match="best_of must be greater than or equal to n"):
        SamplingParams(n=2, best_of=1)
    sp = SamplingParams(temperature=np.float32(0.5), top_p=1, max_tokens=np.int64(5), min_tokens=np.int32(1),
                        stop_token_ids=np.array([3, 4]), stop=("a", "b"), bad_words="x")
    assert (sp.max_tokens, sp.min_tokens, sp.stop_token_ids, sp.stop, sp.bad_words) == (5, 1, [3, 4], ["a", "b"], ["x"])
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize("field, value", [
    ("temperature", None), ("temperature", "0.5"), ("top_p", None), ("top_p", True), ("min_p", "0"),
    ("presence_penalty", None), ("frequency_penalty", "1"), ("repetition_penalty", False),
    ("max_tokens", 2.5), ("max_tokens", "16"), ("max_tokens", True), ("min_tokens", None), ("min_tokens", 1.0),
    ("stop", 5), ("stop", [5]), ("stop_token_ids", 5), ("stop_token_ids", "12"), ("stop_token_ids", [True]),
    ("stop_token_ids", [1.0]), ("bad_words", 5), ("bad_words", [3])])
def test_sampling_params_fields_of_the_wrong_type_are_value_errors(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_guided_decoding_is_the_deprecated_name_of_structured_outputs(llm):
    pytest.importorskip("xgrammar")
    from vllm.sampling_params import GuidedDecodingParams
    from vllm.structured_outputs import StructuredOutputsParams
    with pytest.warns(DeprecationWarning):
        sp = SamplingParams(temperature=0, max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert sp.guided_decoding is None and sp.structured_outputs.choice == ["yes", "no"]
    assert llm.generate(["What is 2+3?"], sp, use_tqdm=False)[0].outputs[0].text in ("yes", "no")
    with pytest.warns(DeprecationWarning, match="guided_decoding"):
        as_dict = SamplingParams(guided_decoding={"regex": "[0-9]+"})
    assert as_dict.structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="not both"):
        SamplingParams(guided_decoding={"regex": "a"}, structured_outputs={"regex": "b"})


def test_use_tqdm_takes_a_progress_bar_factory(llm):
    from tqdm import tqdm
    made = []

    def factory(*args, **kw):
        made.append(kw.get("desc"))
        return tqdm(*args, disable=True, **kw)
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=factory)
    assert len(outs) == 2 and made == ["Processed prompts"]


@pytest.mark.parametrize("ids", [None, 5, "abc", [5, None], [[5, 6]], [5.0, 6], [True, 5]])
def test_prompt_token_ids_must_be_a_list_of_integers(llm, ids):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt": "hi", "prompt_token_ids": ids}],
                     SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests() and not llm.llm_engine._groups


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
    with pytest.raises(ValueError, match="override_generation_config"):
        LLM(device="cpu", override_generation_config={"temperature": 0.3})
    with pytest.raises(ValueError, match="task='embed'"):
        LLM(device="cpu", task="embed")


def test_engine_args_rl_frameworks_pass():
    """verl's, OpenRLHF's and TRL's LLM(...) keywords that change nothing here are taken."""
    llm = LLM(device="cpu", disable_mm_preprocessor_cache=True, limit_mm_per_prompt=None,
              compilation_config={"cudagraph_capture_sizes": [1, 2]}, max_seq_len_to_capture=8192,
              cuda_graph_sizes=[1, 2], disable_cascade_attn=True, task="generate", runner="auto",
              served_model_name="m", download_dir=None, max_lora_rank=64, enable_expert_parallel=False,
              override_generation_config=None)
    sp = SamplingParams(temperature=0, max_tokens=2)
    assert llm.generate(["hi"], sp, use_tqdm=False)[0].outputs[0].token_ids


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
        small.generate([{"prompt_token_ids": [5] * 65}], SamplingParams(max_tokens=4), use_tqdm=False)
    # a prompt that fills the context: one token, "length" (upstream's LLM; its server refuses it)
    full = small.generate([{"prompt_token_ids": [5] * 64}], SamplingParams(max_tokens=4, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert len(full.token_ids) == 1 and full.finish_reason == "length"
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


# ---- logit_bias, allowed_token_ids, bad_words, logprobs=-1 and the other upstream fields --------

@pytest.fixture(scope="module")
def tiny(tiny_qwen3):
    """tiny_qwen3 (random weights, vocabulary 512: any token may come) with no logprobs cap."""
    return LLM(tiny_qwen3, device="cpu", max_logprobs=-1)


def _tokens_and_bits(out):
    c = out.outputs[0]
    return list(c.token_ids), [[(tid, lp.rank, np.float32(lp.logprob).view(np.int32).item())
                                for tid, lp in sorted(d.items())] for d in c.logprobs]


def test_logit_bias_normal_form_and_checks(tiny):
    sp = SamplingParams(logit_bias={"7": 1e9, 9: -250, 11: 2})   # JSON keys are strings; OpenAI's range
    assert sp.logit_bias == {7: 100.0, 9: -100.0, 11: 2.0}
    assert SamplingParams.from_optional(logit_bias={"7": 1e9}, temperature=None, n=None).logit_bias == {7: 100.0}
    for bad in ({"x": 1.0}, {7: float("nan")}, {7: "big"}, {7: 1.0, "7": 2.0}, [7]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match=r"token_id\(s\) \[512\] in logit_bias contain out-of-vocab token ids. "
                                         "Vocabulary size: 512"):
        tiny.generate({"prompt_token_ids": [5, 6]}, SamplingParams(logit_bias={512: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="out-of-vocab"):
        tiny.generate({"prompt_token_ids": [5, 6]}, SamplingParams(logit_bias={-1: 1.0}), use_tqdm=False)


def test_logit_bias_is_batch_invariant_and_leaves_other_requests_bits(tiny):
    """A biased request's tokens and logprob bits are the same alone and in a batch (with
    unbiased, penalised and other biased requests), and an unbiased request's bits do not
    change next to biased ones. The bias does steer sampling: +100 forces its token."""
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    biased = SamplingParams(temperature=0.9, seed=7, max_tokens=6, logprobs=3, ignore_eos=True,
                            logit_bias={40: 4.0, 41: -3.0, 300: 6.0})
    forced = SamplingParams(temperature=1.0, seed=8, max_tokens=4, logprobs=0, ignore_eos=True, logit_bias={123: 100})
    plain = SamplingParams(temperature=0.9, seed=9, max_tokens=6, logprobs=3, ignore_eos=True)
    penalised = SamplingParams(temperature=0.8, seed=10, max_tokens=6, logprobs=3, ignore_eos=True,
                               repetition_penalty=1.4, logit_bias={40: 2.0})
    alone = {name: _tokens_and_bits(tiny.generate(prompt, sp, use_tqdm=False)[0])
             for name, sp in (("biased", biased), ("plain", plain), ("penalised", penalised))}
    batch = tiny.generate([prompt, {"prompt_token_ids": [9, 8, 7]}, prompt, prompt, prompt],
                          [plain, forced, biased, penalised, plain], use_tqdm=False)
    assert _tokens_and_bits(batch[2]) == alone["biased"]
    assert _tokens_and_bits(batch[3]) == alone["penalised"]
    assert _tokens_and_bits(batch[0]) == _tokens_and_bits(batch[4]) == alone["plain"]
    assert batch[1].outputs[0].token_ids == [123] * 4
    assert alone["biased"][0] != alone["plain"][0] or alone["biased"][1] != alone["plain"][1]


def test_logprobs_minus_one_and_max_logprobs(llm, tiny):
    """upstream's rules: -1 asks for every token of the vocabulary; max_logprobs (default 20;
    -1: the vocabulary) caps logprobs and prompt_logprobs, with upstream's message."""
    with pytest.raises(ValueError, match="Requested sample logprobs of 4096, which is greater than max allowed: 20"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(logprobs=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="Requested sample logprobs of 21, which is greater than max allowed: 20"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-2)
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(device="cpu", max_logprobs=-2)
    sp = SamplingParams(temperature=0.7, seed=2, max_tokens=3, logprobs=-1, ignore_eos=True)
    out = tiny.generate({"prompt_token_ids": [5, 6, 7]}, sp, use_tqdm=False)[0].outputs[0]
    assert sp.logprobs == -1   # the caller's object is not written
    assert all(len(d) == 512 for d in out.logprobs)
    one = tiny.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.7, seed=2, max_tokens=3, logprobs=0,
                                                                        ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == one.token_ids
    assert [d[t].logprob for d, t in zip(out.logprobs, out.token_ids)] == [d[t].logprob for d, t in
                                                                          zip(one.logprobs, one.token_ids)]


def test_allowed_token_ids(tiny):
    allowed = [17, 99, 300]
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=12, logprobs=2, ignore_eos=True, allowed_token_ids=allowed)
    out = tiny.generate({"prompt_token_ids": [5, 6, 7]}, sp, use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed) and len(set(out.token_ids)) > 1
    greedy = tiny.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                                           allowed_token_ids=[300]), use_tqdm=False)
    assert greedy[0].outputs[0].token_ids == [300] * 4
    with pytest.raises(ValueError, match="empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="allowed_token_ids contains out-of-vocab"):
        tiny.generate({"prompt_token_ids": [5, 6]}, SamplingParams(allowed_token_ids=[3, 512]), use_tqdm=False)


def test_bad_words(tiny):
    """upstream's rule: a bad word's last token is banned when the output so far ends with its
    other tokens (only output tokens count), for the word as given and, when it tokenizes to
    another first token of the same length, with a leading space. The ban is applied like a
    grammar mask: the default logprobs still report the banned token (the model's distribution)."""
    from vllm.engine.llm_engine import bad_words_token_ids
    tok = tiny.get_tokenizer()
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    base = dict(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    (i, word), greedy = _two_token_bad_word(tiny, prompt, SamplingParams(**base))   # the greedy output has it
    seqs = bad_words_token_ids(tok, [word], 512)
    out = tiny.generate(prompt, SamplingParams(**base, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:i + 1] == greedy[:i + 1] and out.token_ids[i + 1] != greedy[i + 1]
    assert not any(tuple(out.token_ids[j:j + len(s)]) == s for s in seqs for j in range(len(out.token_ids)))
    assert out.logprobs[i + 1][greedy[i + 1]].rank == 1   # banned, still reported at the top
    # a one-token word is banned from the start
    first = tok.decode(greedy[:1])
    if len(bad_words_token_ids(tok, [first], 512)[0]) == 1:
        assert tiny.generate(prompt, SamplingParams(**base, bad_words=[first]),
                             use_tqdm=False)[0].outputs[0].token_ids[0] != greedy[0]
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[""])


def test_token_controls_bad_word_rule():
    from vllm.core.request import TokenControls
    c = TokenControls(bad_words=((7,), (3, 4), (1, 2, 5)))
    assert c.needs_last_token
    assert c.bad_word_bans([]) == [7]
    assert c.bad_word_bans([9, 3]) == [7, 4]
    assert c.bad_word_bans([1, 2]) == [7, 5]
    assert c.bad_word_bans([2]) == [7]   # (1, 2) must both be in the output
    assert not TokenControls(bad_words=((7,),)).needs_last_token


def _two_token_bad_word(llm, prompt, params):
    """(index i, word): a word whose tokenization is tokens i, i + 1 of the greedy output."""
    from vllm.engine.llm_engine import bad_words_token_ids
    tok = llm.get_tokenizer()
    greedy = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    return next((i, tok.decode(greedy[i:i + 2])) for i in range(len(greedy) - 1)
                if tuple(greedy[i:i + 2]) in bad_words_token_ids(tok, [tok.decode(greedy[i:i + 2])], 512)), greedy


def test_token_controls_with_async_scheduling_equal_the_synchronous_loop(tiny_qwen3):
    """With async scheduling a request whose bad words need its last token sits a step out while
    that token is on the device (as a grammar's request does): tokens and bits are the
    synchronous loop's, for bad words, logit_bias and allowed_token_ids alike. The bad word is
    one the unconstrained greedy output contains, so its ban does act."""
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    base = dict(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    sync, run_async = LLM(tiny_qwen3, device="cpu"), LLM(tiny_qwen3, device="cpu", async_scheduling=True)
    (i, word), greedy = _two_token_bad_word(sync, prompt, SamplingParams(**base))
    params = [SamplingParams(**base, bad_words=[word]),
              SamplingParams(temperature=0.9, seed=3, max_tokens=10, logprobs=2, ignore_eos=True, bad_words=[word, "ay"]),
              SamplingParams(temperature=0.9, seed=4, max_tokens=10, logprobs=2, ignore_eos=True,
                             logit_bias={40: 3.0, 7: -5.0}, allowed_token_ids=list(range(0, 512, 3))),
              SamplingParams(temperature=0.9, seed=5, max_tokens=10, logprobs=2, ignore_eos=True)]
    runs = [[_tokens_and_bits(o) for o in llm.generate([prompt] * 4, params, use_tqdm=False)]
            for llm in (sync, run_async)]
    assert runs[0][0][0][:i + 1] == greedy[:i + 1] and runs[0][0][0][i + 1] != greedy[i + 1]   # the ban acted
    assert runs[0] == runs[1]


def test_truncate_prompt_tokens(tiny):
    ids = list(range(5, 25))
    sp = SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=6)
    cut = tiny.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-6:]
    assert cut.outputs[0].token_ids == tiny.generate({"prompt_token_ids": ids[-6:]}, SamplingParams(
        temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    text = tiny.generate("a b c d e f g h", sp, use_tqdm=False)[0]
    assert len(text.prompt_token_ids) == 6
    max_len = tiny.llm_engine.model_config.max_model_len
    long = tiny.generate({"prompt_token_ids": [5] * (max_len + 3)}, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1),
                         use_tqdm=False)[0]
    assert len(long.prompt_token_ids) == max_len - 1
    with pytest.raises(ValueError, match="greater than max_model_len"):
        tiny.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=max_len + 1), use_tqdm=False)
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_truncate_prompt_tokens_keeps_the_tokenizers_bos(tiny_qwen3_bos):
    """A text prompt is cut as upstream's tokenizer call (truncation=True, max_length=k, left
    side) cuts it: the BOS the tokenizer adds stays and the text's last tokens fill the rest.
    Token ids keep their plain last k, as upstream's TokensPrompt."""
    from transformers import AutoTokenizer
    llm = LLM(tiny_qwen3_bos, device="cpu")
    tok = llm.get_tokenizer()
    text = "a b c d e f g h"
    full = tok.encode(text)
    assert full[1:] == tok.encode(text, add_special_tokens=False)   # one BOS in front
    sp = SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=4)
    cut = llm.generate(text, sp, use_tqdm=False)[0]
    upstream = AutoTokenizer.from_pretrained(tiny_qwen3_bos, truncation_side="left")
    assert cut.prompt_token_ids == [full[0]] + full[-3:] == upstream(text, truncation=True, max_length=4).input_ids
    assert cut.prompt == text
    assert llm.generate({"prompt": text}, sp, use_tqdm=False)[0].prompt_token_ids == cut.prompt_token_ids
    assert llm.generate({"prompt_token_ids": full}, sp, use_tqdm=False)[0].prompt_token_ids == full[-4:]
    assert llm.generate("a b", sp, use_tqdm=False)[0].prompt_token_ids == tok.encode("a b")   # short: as it is


def test_truncate_text_ids_puts_the_special_tokens_back_where_they_were():
    from vllm.tokenizer import truncate_text_ids

    class Wrapping:   # a BOS (1) before and an EOS (2) after the text's tokens
        def encode(self, text, add_special_tokens=True):
            body = [ord(c) for c in text]
            return [1] + body + [2] if add_special_tokens else body
    tok, a, e, f = Wrapping(), ord("a"), ord("e"), ord("f")
    ids = tok.encode("abcdef")
    assert truncate_text_ids(tok, "abcdef", ids, 4, True) == [1, e, f, 2]
    assert truncate_text_ids(tok, "abcdef", ids, 4, True, side="right") == [1, a, ord("b"), 2]
    assert truncate_text_ids(tok, "abcdef", ids, 2, True) == [f, 2]   # no room for a text token: the plain cut
    assert truncate_text_ids(tok, "abcdef", ids, 8, True) == ids
    body = tok.encode("abcdef", add_special_tokens=False)
    assert truncate_text_ids(tok, "abcdef", body, 2, False) == [e, f]


def test_min_tokens_bans_eos_under_ignore_eos_too(tiny):
    """upstream's rule: min_tokens keeps EOS out of the first min_tokens tokens whatever
    ignore_eos says; ignore_eos only keeps EOS from ending the request."""
    eos = tiny.llm_engine.eos_token_ids[0]
    sp = SamplingParams(temperature=0, max_tokens=6, min_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})
    out = tiny.generate({"prompt_token_ids": [5, 6, 7]}, sp, use_tqdm=False)[0].outputs[0]
    assert eos not in out.token_ids[:3] and out.token_ids[3:] == [eos] * 3 and out.finish_reason == "length"


def test_min_tokens_with_only_banned_tokens_allowed_is_refused(tiny):
    """With min_tokens banning EOS (and the stop token ids), allowed_token_ids holding nothing
    else would leave every logit masked: refused before anything is queued."""
    eos = tiny.llm_engine.eos_token_ids[0]
    for kw in ({"allowed_token_ids": [eos]}, {"allowed_token_ids": [eos, 9], "stop_token_ids": [9]}):
        with pytest.raises(ValueError, match="min_tokens"):
            tiny.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, min_tokens=2, ignore_eos=True,
                                                                        **kw), use_tqdm=False)
    out = tiny.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, min_tokens=2, ignore_eos=True,
                                                                      allowed_token_ids=[eos, 9]), use_tqdm=False)
    assert out[0].outputs[0].token_ids[:2] == [9, 9]
    assert not tiny.llm_engine.has_unfinished_requests()


def test_stop_takes_any_iterable_of_strings():
    """upstream keeps a set of stop strings as given; any iterable of strings is a list here."""
    assert SamplingParams(stop={"a"}).stop == ["a"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    for bad in (5, b"a", {"a": 1}):
        with pytest.raises(ValueError, match="stop"):
            SamplingParams(stop=bad)


def test_greedy_processed_logprobs_do_not_depend_on_truncation(tiny):
    """temperature 0 resets top_p, top_k and min_p (upstream's): the processed logprobs of a
    greedy request are the same whatever truncation it names."""
    prompt = {"prompt_token_ids": [5, 6, 7]}
    outs = [tiny.generate(prompt, SamplingParams(temperature=0, max_tokens=2, logprobs=4,
                                                 logprobs_mode="processed_logprobs", **kw), use_tqdm=False)[0].outputs[0]
            for kw in ({}, {"top_k": 2}, {"top_p": 0.1, "min_p": 0.5})]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert outs[0].logprobs == outs[1].logprobs == outs[2].logprobs
    assert all(np.isfinite(v.logprob) for d in outs[1].logprobs for v in d.values())


def test_output_kind_extra_args_and_from_optional(llm):
    from vllm.sampling_params import RequestOutputKind
    prompt = {"prompt_token_ids": [5, 6, 7]}
    want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE   # upstream's default
    final = SamplingParams(temperature=0, max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY, extra_args={"x": [1]})
    assert llm.generate(prompt, final, use_tqdm=False)[0].outputs[0].token_ids == want
    assert final.clone().extra_args == {"x": [1]}
    with pytest.raises(ValueError, match="DELTA"):
        llm.generate(prompt, SamplingParams(output_kind=RequestOutputKind.DELTA), use_tqdm=False)
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args=[1])
    sp = SamplingParams.from_optional(n=None, temperature=None, top_p=None, presence_penalty=None,
                                      frequency_penalty=None, repetition_penalty=None, max_tokens=None, seed=3)
    assert sp == SamplingParams(max_tokens=None, seed=3)


def test_upstream_names_of_the_engine_and_the_package(llm):
    import vllm
    import vllm.logprobs
    import vllm.outputs
    from vllm import PromptType, TextPrompt, TokensPrompt  # noqa: F401
    assert vllm.Logprob is vllm.logprobs.Logprob is vllm.outputs.Logprob   # one class
    eng = llm.llm_engine
    assert eng.model_config is eng.vllm_config.model_config is llm.config.model
    assert eng.cache_config is llm.config.cache and eng.scheduler_config is llm.config.scheduler
    assert eng.get_tokenizer() is llm.get_tokenizer()
    mc = eng.model_config
    assert mc.max_model_len == 4096 and mc.model == default_model_path() and mc.get_vocab_size() == 4096
    assert mc.hf_config.vocab_size == mc.hf_config["vocab_size"] == 4096
    assert mc.dtype == llm.config.dtype and mc.quantization is None and eng.cache_config.cache_dtype == "auto"
    with pytest.raises(AttributeError, match="update_weights"):
        eng.model_executor.driver_worker.model_runner.model.named_parameters()
    with pytest.raises(AttributeError, match="update_weights"):
        eng.model_executor.collective_rpc
    with pytest.raises(ValueError, match="iterable of"):
        eng.model_executor.driver_worker.model_runner.model.load_weights(torch.zeros(3))
    with pytest.raises(AttributeError):
        mc.hf_config.no_such_key


def _same_greedy_bits_as_fresh(llm, new_weights, prompts, params):
    """llm's tokens and logprob bits equal a fresh engine's loaded from new_weights."""
    got = llm.generate(prompts, params)
    want = LLM(new_weights, device="cpu", max_model_len=128).generate(prompts, params)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = torch.tensor([next(iter(d.values())).logprob for d in a.outputs[0].logprobs])
        lb = torch.tensor([next(iter(d.values())).logprob for d in b.outputs[0].logprobs])
        assert torch.equal(la.view(torch.int32), lb.view(torch.int32))


def test_upstream_load_weights_path_is_a_weight_update(tiny_qwen3, new_weights):
    """`llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(pairs)`
    (TRL's colocated sync, once per parameter; verl's `driver_worker.worker...`; hand-written
    loops over a state dict) is a versioned weight update: after it the engine gives a fresh
    engine's bits with the new weights, and a bad tensor changes nothing."""
    from safetensors.torch import load_file
    import glob
    new = {}
    for f in sorted(glob.glob(f"{new_weights}/*.safetensors")):
        new.update(load_file(f))
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=0)
    prompts = ["the cat", "a dog sat on"]
    llm = LLM(tiny_qwen3, device="cpu", max_model_len=128, enable_prefix_caching=True)
    before = [o.outputs[0].logprobs for o in llm.generate(prompts, params)]   # a warm prefix cache
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    v0 = llm.llm_engine.weight_version
    name = next(iter(new))
    with pytest.raises(ValueError):
        model.load_weights([(name, new[name][:1])])     # wrong shape: refused, nothing written
    assert llm.llm_engine.weight_version == v0
    assert [o.outputs[0].logprobs for o in llm.generate(prompts, params)] == before
    for i, (n, t) in enumerate(new.items()):   # TRL's loop: one parameter a call
        worker = llm.llm_engine.model_executor.driver_worker
        runner = worker.worker.model_runner if i % 2 else worker.model_runner
        assert runner.model.load_weights([(n, t)]) == {n}
    assert llm.llm_engine.weight_version == v0 + len(new)
    _same_greedy_bits_as_fresh(llm, new_weights, prompts, params)


def test_upstream_load_weights_streams_a_generator(tiny_qwen3, new_weights, monkeypatch):
    """A generator on upstream's load_weights path (verl's FSDP sync yields each gathered
    tensor once) is one update written chunk by chunk as it yields: a tensor it yielded is
    not kept alive past its chunk, the result is a fresh engine's bits with the new weights
    and one new version; a bad tensor or an error in the generator midway puts back every
    chunk already written (the old bits, the old version); an empty one changes nothing."""
    import gc
    import glob
    import weakref

    from safetensors.torch import load_file

    from vllm.entrypoints import upstream_executor as ue
    monkeypatch.setattr(ue, "STREAM_CHUNK_BYTES", 1)   # a chunk per tensor
    new = {}
    for f in sorted(glob.glob(f"{new_weights}/*.safetensors")):
        new.update(load_file(f))
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=0)
    prompts = ["the cat", "a dog sat on"]
    llm = LLM(tiny_qwen3, device="cpu", max_model_len=128)
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    before = [o.outputs[0].logprobs for o in llm.generate(prompts, params)]
    v0 = llm.llm_engine.weight_version

    def failing(bad):
        for i, (n, t) in enumerate(new.items()):
            if i == 3:
                if bad == "shape":
                    yield n, t[:1]
                else:
                    raise RuntimeError("the trainer's gather failed")
            yield n, t.clone()
    for bad, err in (("shape", ValueError), ("raise", RuntimeError)):
        with pytest.raises(err):
            model.load_weights(failing(bad))
        assert llm.llm_engine.weight_version == v0
        assert [o.outputs[0].logprobs for o in llm.generate(prompts, params)] == before
    assert model.load_weights(iter(())) == set() and llm.llm_engine.weight_version == v0

    alive = []

    def gathered():
        for n, t in new.items():
            gc.collect()
            alive.append(sum(r() is not None for r in refs))
            full = t.clone()
            refs.append(weakref.ref(full))
            yield n, full
            del full
    refs: list = []
    assert model.load_weights(gathered()) == set(new)
    assert max(alive) <= 1   # the tensor yielded before may still be held until its chunk is loaded
    assert llm.llm_engine.weight_version == v0 + 1
    _same_greedy_bits_as_fresh(llm, new_weights, prompts, params)


def test_upstream_load_weights_skips_a_tied_lm_head(tiny_llama):
    """A tied model (tiny_llama) skips lm_head.weight on upstream's load_weights path, as
    upstream's loaders do: a trainer whose lm_head is its own tensor (PEFT's modules_to_save)
    does not overwrite the embedding; the embedding itself still loads."""
    llm = LLM(tiny_llama, device="cpu", max_model_len=64)
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    emb = llm.llm_engine.executor.model.model.embed_tokens.weight
    before = emb.detach().clone()
    v0 = llm.llm_engine.weight_version
    assert model.load_weights([("lm_head.weight", before * 2)]) == set()
    assert torch.equal(emb, before) and llm.llm_engine.weight_version == v0
    assert model.load_weights([("model.embed_tokens.weight", before * 3),
                               ("lm_head.weight", before)]) == {"model.embed_tokens.weight"}
    assert torch.equal(emb, before * 3)


def test_model_impl():
    assert LLM(device="cpu", model_impl="vllm").llm_engine is not None
    with pytest.raises(ValueError, match="model_impl='transformers'.*'auto' or 'vllm'"):
        LLM(device="cpu", model_impl="transformers")


def test_chat_template_content_format(tiny_qwen3):
    """upstream's chat_template_content_format: "string" joins text parts with newlines,
    "openai" hands the template lists of parts, "auto" picks by whether the template loops
    over a message's content."""
    from vllm.entrypoints.chat_template import apply_content_format, detect_content_format
    string_tpl = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    openai_tpl = ("{% for m in messages %}<{{ m.role }}>{% for part in m.content %}[{{ part['text'] }}]{% endfor %}"
                  "{% endfor %}")
    assert detect_content_format(string_tpl) == "string" and detect_content_format(openai_tpl) == "openai"
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "c"}]
    assert apply_content_format(msgs, "string", None)[0]["content"] == "a\nb"
    assert apply_content_format(msgs, "openai", None)[1]["content"] == [{"type": "text", "text": "c"}]
    assert apply_content_format(msgs, "auto", openai_tpl)[0]["content"] == msgs[0]["content"]
    with pytest.raises(ValueError, match="only text"):
        apply_content_format([{"role": "user", "content": [{"type": "image_url"}]}], "string", None)
    llm = LLM(tiny_qwen3, device="cpu")
    sp = SamplingParams(temperature=0, max_tokens=1)
    ids = {fmt: llm.chat(msgs[:1], sp, chat_template=tpl, chat_template_content_format=fmt,
                         add_generation_prompt=False, use_tqdm=False)[0].prompt_token_ids
           for fmt, tpl in (("auto", string_tpl), ("string", string_tpl))}
    tok = llm.get_tokenizer()
    assert ids["auto"] == ids["string"] and tok.decode(ids["string"]) == "<user>a\nb"
    as_parts = llm.chat(msgs[:1], sp, chat_template=openai_tpl, add_generation_prompt=False, use_tqdm=False)[0]
    assert tok.decode(as_parts.prompt_token_ids) == "<user>[a][b]"
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(msgs[:1], sp, chat_template=string_tpl, chat_template_content_format="json", use_tqdm=False)


@pytest.mark.parametrize("key", ["multi_modal_data", "mm_processor_kwargs", "prompt_embeds"])
def test_prompt_fields_for_what_is_not_run_are_refused(llm, key):
    """A prompt dict asking for multimodal inputs or embeddings as the prompt is refused, never
    generated from its text alone; None or empty (upstream's "none") is fine."""
    for prompt in ({"prompt": "hello", key: {"image": "x"}}, {"prompt_token_ids": [5, 6, 7], key: {"image": "x"}}):
        with pytest.raises(ValueError, match=f"prompt field '{key}' is not supported"):
            llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    import torch
    with pytest.raises(ValueError, match="prompt field 'prompt_embeds' is not supported"):
        llm.generate({"prompt_token_ids": [5, 6, 7], "prompt_embeds": torch.zeros(3, 4)}, SamplingParams(max_tokens=1),
                     use_tqdm=False)
    for empty in (None, {}):   # verl sends an empty multi_modal_data for text rows
        assert llm.generate({"prompt_token_ids": [5, 6, 7], key: empty}, SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.mark.parametrize("kw, needle", [(dict(max_model_len=-5), "max_model_len must be an integer >= 2"),
                                        (dict(max_model_len=0), "max_model_len must be an integer >= 2"),
                                        (dict(block_size=0), "block_size must be a positive integer"),
                                        (dict(num_gpu_blocks_override=1), "num_gpu_blocks_override must be an integer >= 2")])
def test_bad_context_and_block_settings_are_refused_at_construction(kw, needle):
    with pytest.raises(ValueError, match=needle):
        LLM(device="cpu", **kw)


def test_chat_takes_upstreams_argument_order_and_template_kwargs_win(llm):
    """LLM.chat's parameters in upstream's order (lora_request fourth), and chat_template_kwargs
    setting add_generation_prompt / continue_final_message, which win over the named ones as
    upstream merges them."""
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    msgs = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "The answer"}]
    named = llm.chat(msgs, sp, False, None, add_generation_prompt=False, continue_final_message=True)[0]
    merged = llm.chat(msgs, sp, use_tqdm=False,
                      chat_template_kwargs={"add_generation_prompt": False, "continue_final_message": True})[0]
    assert merged.prompt_token_ids == named.prompt_token_ids and merged.outputs[0].token_ids == named.outputs[0].token_ids
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        llm.chat(msgs[:1], sp, use_tqdm=False, mm_processor_kwargs={"x": 1})
    assert llm.chat(msgs[:1], sp, use_tqdm=False, mm_processor_kwargs=None)


def test_upstream_engine_methods_frameworks_call(llm):
    """What RL frameworks call on `llm.llm_engine` / `llm`: reset_prefix_cache(), abort_request
    with a list of ids (upstream's v1 signature) or one id, get_num_unfinished_requests(), and
    LLM.model_config."""
    eng = llm.llm_engine
    assert llm.model_config is eng.model_config
    assert eng.reset_prefix_cache() is True
    sp = SamplingParams(max_tokens=50, ignore_eos=True)
    for rid in ("a", "b", "c"):
        eng.add_request(rid, {"prompt_token_ids": [5, 6, 7]}, sp)
    assert eng.get_num_unfinished_requests() == 3
    eng.abort_request(["a", "b"])
    assert eng.get_num_unfinished_requests() == 1
    eng.abort_request("c")
    assert eng.get_num_unfinished_requests() == 0 and not eng.has_unfinished_requests()
    assert eng.kv.num_free_blocks == eng.kv.num_usable_blocks


def test_upstream_entry_points_not_run_here_say_so(llm):
    from vllm.lora.request import LoRARequest   # verl imports it at module level
    lora = LoRARequest("adapter", 1, "/tmp/adapter")
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        llm.generate("hi", SamplingParams(max_tokens=1), lora_request=lora, use_tqdm=False)
    for name in ("beam_search", "encode", "embed", "score", "classify", "reward"):
        with pytest.raises(ValueError, match=f"LLM.{name} is not supported here"):
            getattr(llm, name)(["hi"])
    for name in ("get_metrics", "start_profile", "stop_profile"):
        with pytest.raises(ValueError, match=f"LLM.{name} is not supported here"):
            getattr(llm, name)()


def test_outputs_build_in_upstreams_field_order():
    from vllm.outputs import CompletionOutput, RequestOutput
    c = CompletionOutput(0, "x", [5], None, None, "stop", None, None)
    r = RequestOutput("0", "p", [1, 2], None, [c], True)
    assert (r.outputs, r.finished, r.prompt_logprobs, r.metrics, r.lora_request, r.num_cached_tokens) == \
        ([c], True, None, None, None, 0)
    assert c.lora_request is None and c.finish_reason == "stop"


def test_upstream_helper_modules_that_frameworks_import():
    """OpenRLHF imports vllm.utils.random_uuid; verl and OpenRLHF call parallel_state's
    teardown before dropping an LLM (no global groups here: no-ops)."""
    from vllm.distributed import parallel_state
    from vllm.utils import random_uuid
    a, b = random_uuid(), random_uuid()
    assert len(a) == 32 and a != b and int(a, 16) >= 0
    assert parallel_state.destroy_model_parallel() is None
    assert parallel_state.destroy_distributed_environment() is None
    assert parallel_state.get_tensor_model_parallel_world_size() == 1


def test_upstream_keywords_none_and_noop(tmp_path):
    """upstream's None-means-default engine arguments (TRL passes max_num_seqs=None), its
    no-op arguments, and newer signatures: reset_prefix_cache(reset_running_requests=...),
    generate(tokenization_kwargs=None), llm_engine.add_request(..., arrival_time=None)."""
    llm = LLM(device="cpu", max_num_seqs=None, enable_prefix_caching=None, speculative_config=None,
              attention_backend=None, enable_log_requests=False, calculate_kv_scales=False)
    assert llm.llm_engine.config.scheduler.max_num_seqs == 256 and llm.llm_engine.kv.enable_prefix_caching
    assert llm.reset_prefix_cache(reset_running_requests=False) is True
    out = llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False, tokenization_kwargs=None)
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="tokenization_kwargs"):
        llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False, tokenization_kwargs={"truncation": True})
    eng = llm.llm_engine
    eng.add_request("r", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2), None)
    while eng.has_unfinished_requests():
        eng.step()
    with pytest.raises(ValueError, match="lora_request"):
        eng.add_request("r2", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2), None, object())
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(device="cpu", speculative_config={"method": "ngram"})


def test_a_hub_id_already_in_the_local_cache_loads(tmp_path, monkeypatch):
    """TRL builds LLM(model=model.name_or_path): a hub id whose snapshot transformers already
    put in the local Hugging Face cache resolves to that snapshot (nothing is downloaded); an
    id that is not cached is the usual ValueError."""
    snap = tmp_path / "hub" / "models--someorg--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(default_model_path(), snap)
    (tmp_path / "hub" / "models--someorg--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--someorg--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    llm = LLM("someorg/tiny", device="cpu")
    assert llm.llm_engine.config.model.path == str(snap)
    assert len(llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="nor a hub id in the local Hugging Face cache"):
        LLM("someorg/absent", device="cpu")
