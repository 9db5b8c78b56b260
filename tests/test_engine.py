"""End-to-end engine tests on CPU against transformers' own model classes."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.forward_context import ForwardContext, set_forward_context
from vllm.testing.tiny_models import load_hf_model

ARCH_FIXTURES = ["tiny_qwen3", "tiny_qwen2", "tiny_llama"]


def _prompts(vocab: int, lengths=(3, 17, 40, 9)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """transformers' greedy decoding with its own KV cache, eos ignored (generate's
    min_new_tokens would mask eos logits instead, which is not ignore_eos)."""
    ids = torch.tensor([prompt])
    out, past = [], None
    with torch.no_grad():
        for _ in range(max_new):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]])
    return out


@pytest.fixture(scope="module")
def engines(request):
    cache = {}

    def get(path, **kw):
        key = (path, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = LLM(path, device="cpu", dtype="float32", **kw)
        return cache[key]
    return get


@pytest.mark.parametrize("arch", ARCH_FIXTURES)
def test_greedy_matches_transformers(arch, request, engines):
    path = request.getfixturevalue(arch)
    llm = engines(path, max_num_batched_tokens=32)  # small budget: prompts are chunked across steps
    hf = load_hf_model(path, torch.float32)
    vocab = llm.config.model.vocab_size
    prompts = _prompts(vocab)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.prompt_token_ids == p
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 12), f"{arch}: prompt of {len(p)} tokens diverged"
        assert o.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("arch", ARCH_FIXTURES)
def test_logits_close_to_transformers(arch, request, engines):
    path = request.getfixturevalue(arch)
    llm = engines(path, max_num_batched_tokens=32)
    hf = load_hf_model(path, torch.float32)
    runner = llm.llm_engine.executor.worker
    prompt = _prompts(llm.config.model.vocab_size, (23,))[0]

    class Dense:  # causal attention over the packed step, no cache: isolates the model class
        def forward(self, layer, q, k, v, scale):
            rep = q.shape[1] // k.shape[1]
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1), v.repeat_interleave(rep, 1).transpose(0, 1),
                is_causal=True, scale=scale)
            return o.transpose(0, 1)
    with torch.no_grad(), set_forward_context(ForwardContext(Dense())):
        ours = runner.model.compute_logits(runner.model(torch.tensor(prompt), torch.arange(len(prompt))))
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert torch.isfinite(ours).all()
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-5, err


def test_logprobs_are_tempered_full_vocab(tiny_qwen3, engines):
    llm = engines(tiny_qwen3)
    hf = load_hf_model(tiny_qwen3, torch.float32)
    prompt = _prompts(llm.config.model.vocab_size, (11,))[0]
    T = 0.7
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=T, max_tokens=6, logprobs=3, seed=7,
                                                                      top_k=5), use_tqdm=False)[0].outputs[0]
    seq = prompt + out.token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([seq])).logits[0].double()
    ref = torch.log_softmax(logits / T, dim=-1)
    for i, tok in enumerate(out.token_ids):
        pos = len(prompt) - 1 + i
        lp = out.logprobs[i]
        assert lp[tok].logprob == pytest.approx(ref[pos, tok].item(), abs=1e-4)
        assert len(lp) >= 3 and tok in lp
        top = sorted(lp.items(), key=lambda kv: kv[1].rank)
        assert abs(top[0][1].logprob - ref[pos].max().item()) < 1e-4


def test_preemption_and_resume(tiny_qwen3, engines):
    # 9 usable blocks of 16 tokens for 6 requests of ~60 tokens each: the scheduler must preempt.
    small = LLM(tiny_qwen3, device="cpu", dtype="float32", num_gpu_blocks_override=10, max_num_batched_tokens=64)
    big = engines(tiny_qwen3)
    prompts = [{"prompt_token_ids": p} for p in _prompts(small.config.model.vocab_size, (20, 33, 25, 41, 12, 30))]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    a = small.generate(prompts, sp, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    b = big.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    kv = small.llm_engine.kv
    assert kv.num_free_blocks == kv.num_blocks - 1
    kv.check_invariants()


def test_prefix_cache_hit_and_no_leak(tiny_qwen3, engines):
    llm = LLM(tiny_qwen3, device="cpu", dtype="float32")
    vocab = llm.config.model.vocab_size
    shared = _prompts(vocab, (48,))[0]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": shared + [11, 12]}, sp, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": shared + [13, 14, 15]}, sp, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48
    # a cache hit must not change the result
    cold = LLM(tiny_qwen3, device="cpu", dtype="float32", enable_prefix_caching=False)
    ref = cold.generate({"prompt_token_ids": shared + [13, 14, 15]}, sp, use_tqdm=False)[0]
    assert ref.outputs[0].token_ids == second.outputs[0].token_ids
    kv = llm.llm_engine.kv
    assert kv.num_free_blocks == kv.num_blocks - 1
    kv.check_invariants()
    # after reset_prefix_cache nothing is reused
    assert llm.reset_prefix_cache()
    third = llm.generate({"prompt_token_ids": shared + [13, 14, 15]}, sp, use_tqdm=False)[0]
    assert third.num_cached_tokens == 0 and third.outputs[0].token_ids == second.outputs[0].token_ids


def _logprob_bits(out) -> list[list[int]]:
    """Per generated token, its logprob entry's values (by token id) as float32 bits."""
    return [torch.tensor([lp.logprob for _, lp in sorted(entry.items())], dtype=torch.float32)
            .view(torch.int32).tolist() for entry in out.outputs[0].logprobs]


def test_cache_salt_isolates_the_prefix_cache_and_keeps_the_bits(tiny_qwen3, engines):
    from vllm.inputs import TextPrompt, TokensPrompt

    llm = LLM(tiny_qwen3, device="cpu", dtype="float32")
    prompt = _prompts(llm.config.model.vocab_size, (50,))[0]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)

    def run(p):
        return llm.generate(p, sp, use_tqdm=False)[0]

    assert run({"prompt_token_ids": prompt}).num_cached_tokens == 0
    assert run(TokensPrompt(prompt_token_ids=prompt)).num_cached_tokens == 48     # no salt: shared as ever
    # a salt finds nothing cached without it, then shares with its own requests only
    salted = [run(TokensPrompt(prompt_token_ids=prompt, cache_salt="tenant-a")) for _ in range(2)]
    assert [o.num_cached_tokens for o in salted] == [0, 48]
    assert run(TokensPrompt(prompt_token_ids=prompt, cache_salt="tenant-b")).num_cached_tokens == 0
    text = "the quick brown fox jumps over the lazy dog " * 4
    run(text)
    assert [run(TextPrompt(prompt=text, cache_salt="t")).num_cached_tokens > 0 for _ in range(2)] == [False, True]
    # a salted request served from its warm cache computes the bits of an unsalted cold one
    cold = engines(tiny_qwen3, enable_prefix_caching=False).generate({"prompt_token_ids": prompt}, sp,
                                                                      use_tqdm=False)[0]
    for out in salted:
        assert out.outputs[0].token_ids == cold.outputs[0].token_ids
        assert _logprob_bits(out) == _logprob_bits(cold)
    # a bad salt is refused before anything is queued
    for bad in ("", 7, "a/b", "x" * 129):
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt, "cache_salt": bad}], sp,
                         use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.kv.check_invariants()


def test_num_cached_tokens_is_the_first_samples(tiny_qwen3):
    # n > 1: the siblings wait for the first sample's prompt blocks and hit them; the prompt
    # was computed once, cold, and the request reports that
    llm = LLM(tiny_qwen3, device="cpu", dtype="float32")
    prompt = _prompts(llm.config.model.vocab_size, (50,))[0]
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=4, ignore_eos=True, n=3)
    assert llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].num_cached_tokens == 48


def test_n_samples_share_prompt_blocks(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu", dtype="float32")
    prompt = _prompts(llm.config.model.vocab_size, (64,))[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=3), use_tqdm=False)[0]
    assert len(out.outputs) == 4 and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    stats = llm.llm_engine.kv.stats()
    assert stats["prefix_cache_hits"] >= 3 * 48  # the three followers reuse the leader's full prompt blocks
    # seeded: the same request again gives the same samples
    again = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=3), use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_seeded_sampling_independent_of_batch(tiny_qwen3, engines):
    llm = engines(tiny_qwen3)
    vocab = llm.config.model.vocab_size
    prompts = [{"prompt_token_ids": p} for p in _prompts(vocab, (5, 9, 14, 30, 7))]
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=42, ignore_eos=True)
    alone = llm.generate(prompts[2], sp, use_tqdm=False)[0].outputs[0].token_ids
    together = llm.generate(prompts, sp, use_tqdm=False)[2].outputs[0].token_ids
    assert alone == together


def test_stop_strings_and_tokens(tiny_qwen3, engines):
    llm = engines(tiny_qwen3)
    tok = llm.get_tokenizer()
    base = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert base.text
    # stop at the text of the 5th generated token
    fifth = tok.decode(base.token_ids[4:5])
    if fifth.strip():
        o = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[fifth]), use_tqdm=False)[0].outputs[0]
        assert o.finish_reason == "stop" and o.stop_reason == fifth
        assert fifth not in o.text and base.text.startswith(o.text)
    o = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[base.token_ids[3]]), use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids[-1] == base.token_ids[3] and len(o.token_ids) <= 4


def test_bad_input_is_rejected_and_loses_nothing(tiny_qwen3, engines):
    llm = engines(tiny_qwen3)
    vocab = llm.config.model.vocab_size
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([good, {"prompt_token_ids": [vocab + 5]}], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="context"):
        llm.generate({"prompt_token_ids": [5] * (llm.config.model.max_model_len + 1)}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-3), dict(min_p=2.0), dict(max_tokens=0), dict(n=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(good, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_unsupported_architecture_and_missing_files(tmp_path, tiny_qwen3):
    import json
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(tiny_qwen3, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(bad), device="cpu")
    nofile = tmp_path / "nofile"
    shutil.copytree(tiny_qwen3, nofile)
    for f in nofile.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(nofile), device="cpu")
    with pytest.raises(ValueError, match="not a directory"):
        LLM(str(tmp_path / "missing"), device="cpu")


def test_chat_and_default_model():
    llm = LLM(device="cpu")
    out = llm.chat([{"role": "user", "content": "Say hi"}], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize("model,numerics", [("tiny_qwen3", "invariant"), ("tiny_qwen3", "fast"),
                                           ("tiny_qwen3_next", "invariant"), ("tiny_nemotron_h", "invariant")])
def test_dropped_engine_frees_its_caches_without_the_collector(request, model, numerics):
    """An LLM the user drops frees its model and caches at once, by reference counting alone: no
    reference cycle holds them until the garbage collector happens to run (on the GPU the next
    engine sizes its KV cache from the memory that is free, so a leaked one starves it). The
    same for a trainer's Policy after a forward and backward."""
    import gc
    import weakref

    from vllm.training.policy import Policy

    path = request.getfixturevalue(model)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        llm = LLM(path, device="cpu", numerics=numerics, enable_prefix_caching=True)
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 2, SamplingParams(max_tokens=3, temperature=1.0, seed=1),
                     use_tqdm=False)
        runner = llm.llm_engine.executor.worker
        refs = [weakref.ref(o) for o in (llm, runner, runner.kv_cache, runner.model, *runner.kv_cache.tensors()[:1])]
        del llm, runner
        assert [r() is None for r in refs] == [True] * len(refs)

        policy = Policy.from_pretrained(path, device="cpu", numerics=numerics)
        lp = policy.token_logprobs([[5, 6, 7, 8, 9]], [2])
        sum(x.sum() for x in lp).backward()
        refs = [weakref.ref(o) for o in (policy, policy.model, next(policy.model.parameters()))]
        del policy, lp
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        if was_enabled:
            gc.enable()


def _deltas_of(request_id: str, out) -> list:
    from vllm.engine.core_messages import RequestDelta
    return [d for d in map(RequestDelta._make, out.deltas if out else []) if d.request_id == request_id]


def _held_by_a_pause(mode_after: str):
    """An engine core with request "a" running, a pause(mode="wait") waiting for it, and "x"
    (no length limit) arriving meanwhile, held; then `mode_after` ends "x": "abort" (the client
    gives it up), "abort_all" (utility abort_requests) or "pause_abort" (pause(mode="abort")).
    Returns (the core, the deltas "x" got, the steps run after resume)."""
    from vllm.engine.core import EngineCore
    from vllm.engine.core_messages import AbortRequest, AddRequest, UtilityCall
    llm = LLM(device="cpu")
    core = EngineCore(llm.llm_engine)
    sp = SamplingParams(max_tokens=6, ignore_eos=True, detokenize=False)
    core.handle(AddRequest("a", [5, 6, 7, 8], sp))
    core.step()
    core.handle(UtilityCall(1, "pause", ("wait", False)))      # deferred: "a" is running
    core.handle(AddRequest("x", [9, 10, 11], SamplingParams(max_tokens=None, ignore_eos=True, detokenize=False)))
    assert [m.request_id for m in core._held] == ["x"]
    if mode_after == "abort":
        core.handle(AbortRequest("x"))
    elif mode_after == "abort_all":
        core.handle(UtilityCall(2, "abort_requests", (None,)))
    else:
        core.handle(UtilityCall(2, "pause", ("abort", False)))
    deltas = []
    while core.busy:
        core.step()
        core._settle_pause()
        out = core.take_outputs()
        deltas += _deltas_of("x", out)
    core._settle_pause()
    deltas += _deltas_of("x", core.take_outputs())
    core.handle(UtilityCall(3, "resume", ()))
    steps = 0
    while core.busy and steps < 50:
        core.step()
        steps += 1
    return core, deltas, steps


def test_waiting_count_moves_while_paused():
    """Requests that arrive while the engine is paused (no steps, so no stats with them) still
    reach the waiting gauge (/metrics' vllm:num_requests_waiting): each arrival sends the stats,
    and requests held by a pending pause(mode="wait") count as waiting too."""
    from vllm.engine.core import EngineCore
    from vllm.engine.core_messages import AddRequest, UtilityCall
    core = EngineCore(LLM(device="cpu").llm_engine)
    core.handle(UtilityCall(1, "pause", ("keep", False)))
    core.take_outputs()
    for i in range(3):
        core.handle(AddRequest(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=2, n=2 if i == 2 else 1,
                                                                   detokenize=False)))
    out = core.take_outputs()
    assert out is not None and out.stats.num_waiting == 4 and out.stats.num_running == 0
    core.handle(UtilityCall(2, "resume", ()))
    core.step()
    core.handle(UtilityCall(3, "pause", ("wait", False)))      # waits for the running requests
    core.handle(AddRequest("late", [5, 6], SamplingParams(max_tokens=2, detokenize=False)))
    assert core._held and core.take_outputs().stats.num_waiting >= 1


@pytest.mark.parametrize("order", ["keep_then_wait", "wait_then_keep"])
def test_pause_wait_and_keep_together_answer_at_once(order):
    """pause(mode="wait") on an engine paused with "keep" has nothing to wait for (its frozen
    requests never finish): it is answered at once, paused; a "keep" pause while a "wait" is
    waiting answers that one too. Either way resume then continues the request."""
    from vllm.engine.core import EngineCore
    from vllm.engine.core_messages import AddRequest, UtilityCall
    core = EngineCore(LLM(device="cpu").llm_engine)
    core.handle(AddRequest("a", [5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True, detokenize=False)))
    core.step()
    modes = ("keep", "wait") if order == "keep_then_wait" else ("wait", "keep")
    for call_id, mode in enumerate(modes, 1):
        core.handle(UtilityCall(call_id, "pause", (mode, False)))
    results = {r.call_id: r for r in core.take_outputs().utility_results}
    assert set(results) == {1, 2} and all(r.ok and r.value["paused"] for r in results.values())
    assert core.engine.paused and core.engine.has_unfinished_requests()
    core.handle(UtilityCall(3, "resume", ()))
    steps = 0
    while core.busy and steps < 50:
        core.step()
        steps += 1
    assert not core.engine.has_unfinished_requests() and 0 < steps < 50


@pytest.mark.parametrize("mode_after", ["abort", "abort_all", "pause_abort"])
def test_a_request_held_by_a_pause_is_aborted_with_the_others(mode_after):
    """A request that arrives during pause(mode="wait") waits for resume; aborting it (alone, all
    requests, or pause(mode="abort")) must end it there, not run it after resume (it held KV and a
    sequence slot for a client that had gone). Abort-all and pause(abort) end it with
    finish_reason "abort", as the requests in flight."""
    core, deltas, steps = _held_by_a_pause(mode_after)
    assert not core._held and steps == 0
    assert not core.engine.has_unfinished_requests()
    if mode_after != "abort":   # the client still waits on its stream: it ends
        assert [d.finish_reason for d in deltas][-1:] == ["abort"]


def test_allowed_tokens_all_banned_and_foreign_requests_are_refused():
    """allowed_token_ids whose every token a single-token bad word bans: a ValueError before
    anything is queued (no token could be sampled). llm.generate with requests added through
    llm.llm_engine still unfinished: a ValueError (generate would finish them and drop their
    outputs); once they finish, generate runs. A negative long_prefill_token_threshold is
    refused."""
    from vllm import LLM, SamplingParams
    from vllm.config import SchedulerConfig
    llm = LLM(device="cpu", max_model_len=128)
    a = llm.get_tokenizer().encode("a", add_special_tokens=False)
    with pytest.raises(ValueError, match="banned by bad_words"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                     SamplingParams(max_tokens=3, allowed_token_ids=a, bad_words=["a"]), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    eng = llm.llm_engine
    eng.add_request("mine", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    with pytest.raises(ValueError, match="added through llm.llm_engine are unfinished"):
        llm.generate([{"prompt_token_ids": [8, 9]}], SamplingParams(max_tokens=2), use_tqdm=False)
    finished = []
    while eng.has_unfinished_requests():
        finished += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in finished] == ["mine"] and len(finished[0].outputs[0].token_ids) == 4
    assert len(llm.generate([{"prompt_token_ids": [8, 9]}], SamplingParams(max_tokens=2), use_tqdm=False)) == 1
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)
