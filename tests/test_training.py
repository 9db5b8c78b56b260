"""Training mode: rollout == trainer logprobs by bits, gradients against transformers,
an optimizer step through save_pretrained, the divergence finder, bad input."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.testing.tiny_models import load_hf_model
from vllm.training import Policy
from vllm.testing.rollouts import sequences_and_logprobs


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _rollout(llm, prompts, temperature=0.8, max_tokens=8, seed=11, layout="together"):
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, logprobs=0, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    if layout == "together":
        outs = llm.generate(reqs, sp, use_tqdm=False)
    else:  # one at a time, reversed
        outs = [llm.generate(r, sp, use_tqdm=False)[0] for r in reversed(reqs)][::-1]
    return sequences_and_logprobs(prompts, outs)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 23, 40, 11)]


@pytest.mark.parametrize("arch", ["tiny_qwen3", "tiny_qwen2", "tiny_llama"])
def test_rollout_logprobs_equal_trainer_bits(arch, request, prompts):
    path = request.getfixturevalue(arch)
    llm = LLM(path, device="cpu", numerics="invariant", block_size=8)
    seqs, roll = _rollout(llm, prompts)
    seqs2, roll2 = _rollout(llm, prompts, layout="alone")
    assert seqs == seqs2 and all(torch.equal(bits(a), bits(b)) for a, b in zip(roll, roll2))
    policy = Policy.from_pretrained(path, device="cpu", numerics="invariant")
    plens = [len(p) for p in prompts]
    for budget, order in ((None, [0, 1, 2, 3]), (50, [3, 1, 0, 2]), (1, [2, 0, 3, 1])):
        got = policy.token_logprobs([seqs[i] for i in order], [plens[i] for i in order], temperature=0.8,
                                    max_tokens_per_micro_batch=budget)
        for j, i in enumerate(order):
            assert torch.equal(bits(got[j]), bits(roll[i])), f"{arch}: seq {i} budget {budget}"
    # the colocated view shares storage and gives the same bits
    colo = llm.policy()
    assert colo.model is llm.llm_engine.executor.model
    got = colo.token_logprobs(seqs, plens, temperature=0.8)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, roll))


def _hf_logprobs(hf, seqs, plens, temperature):
    out = []
    for s, pl in zip(seqs, plens):
        logits = hf(torch.tensor([s])).logits[0]
        lp = torch.log_softmax(logits / temperature, dim=-1)
        out.append(lp[pl - 1:len(s) - 1].gather(1, torch.tensor(s[pl:])[:, None])[:, 0])
    return out


@pytest.mark.parametrize("numerics", ["invariant", "fast"])
def test_gradients_match_transformers_float64(tiny_qwen3, prompts, numerics):
    seqs = [p + [7, 8, 9, 10, 11] for p in prompts]
    plens = [len(p) for p in prompts]
    weights = [torch.linspace(-1, 1, len(s) - pl) for s, pl in zip(seqs, plens)]
    policy = Policy.from_pretrained(tiny_qwen3, device="cpu", dtype="float32", numerics=numerics)
    lps = policy.token_logprobs(seqs, plens, temperature=0.7, max_tokens_per_micro_batch=64)
    sum((w * lp).sum() for w, lp in zip(weights, lps)).backward()
    ours = policy.model.hf_state_dict(grads=True)

    hf = load_hf_model(tiny_qwen3, torch.float64)
    ref_lps = _hf_logprobs(hf, seqs, plens, 0.7)
    for a, b in zip(lps, ref_lps):
        assert (a.double() - b).abs().max().item() < 1e-5
    sum((w.double() * lp).sum() for w, lp in zip(weights, ref_lps)).backward()
    checked = 0
    for name, p in hf.named_parameters():
        if p.grad is None or name not in ours:
            continue
        err = ((ours[name].double() - p.grad).norm() / p.grad.norm().clamp_min(1e-30)).item()
        assert err < 1e-4, f"{name}: relative gradient error {err:.2e}"
        checked += 1
    assert checked >= 20


def test_bf16_gradients_loosely_match(tiny_qwen3, prompts):
    seqs = [p + [7, 8, 9] for p in prompts]
    plens = [len(p) for p in prompts]
    policy = Policy.from_pretrained(tiny_qwen3, device="cpu", dtype="bfloat16", numerics="invariant")
    sum(lp.sum() for lp in policy.token_logprobs(seqs, plens)).backward()
    ours = policy.model.hf_state_dict(grads=True)
    hf = load_hf_model(tiny_qwen3, torch.float64)
    sum(lp.sum() for lp in _hf_logprobs(hf, seqs, plens, 1.0)).backward()
    for name, p in hf.named_parameters():
        if name in ours and p.grad is not None and p.grad.norm() > 0:
            err = ((ours[name].double() - p.grad).norm() / p.grad.norm()).item()
            assert err < 0.1, f"{name}: bf16 relative gradient error {err:.2e}"


def test_optimizer_step_through_save_pretrained(tiny_qwen3, prompts, tmp_path):
    seqs = [p + [21, 22, 23, 24] for p in prompts]
    plens = [len(p) for p in prompts]
    policy = Policy.from_pretrained(tiny_qwen3, device="cpu", dtype="float32", numerics="invariant")
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.01)
    loss = -sum(lp.sum() for lp in policy.token_logprobs(seqs, plens))
    loss.backward()
    opt.step()
    policy.save_pretrained(str(tmp_path / "step1"))

    hf = load_hf_model(tiny_qwen3, torch.float64)
    ref_opt = torch.optim.AdamW(hf.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.01)
    (-sum(lp.sum() for lp in _hf_logprobs(hf, seqs, plens, 1.0))).backward()
    ref_opt.step()
    saved = load_hf_model(str(tmp_path / "step1"), torch.float64)
    ref = dict(hf.named_parameters())
    for name, p in saved.named_parameters():
        err = ((p - ref[name]).norm() / ref[name].norm()).item()
        assert err < 1e-5, f"{name}: {err:.2e}"
    # the saved checkpoint also loads in our engine and reproduces the policy's logprobs
    llm = LLM(str(tmp_path / "step1"), device="cpu", numerics="invariant")
    s2, roll = _rollout(llm, prompts[:2])
    again = Policy.from_pretrained(str(tmp_path / "step1"), device="cpu", numerics="invariant")
    got = again.token_logprobs(s2, [len(p) for p in prompts[:2]], temperature=0.8)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, roll))


def test_colocated_step_updates_engine(tiny_qwen3, prompts):
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant")
    policy = llm.policy()
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    policy.attach_optimizer(opt)
    seqs, before = _rollout(llm, prompts[:2])
    assert llm.weight_version == 0
    loss = -sum(lp.sum() for lp in policy.token_logprobs(seqs, [len(p) for p in prompts[:2]], temperature=0.8))
    loss.backward()
    opt.step()
    opt.zero_grad()
    assert llm.weight_version == 1
    assert llm.llm_engine.kv.stats()["cached_blocks"] == 0  # stale prefixes dropped
    seqs2, after = _rollout(llm, prompts[:2])
    assert any(not torch.equal(bits(a), bits(b)) for a, b in zip(before, after)) or seqs != seqs2
    with torch.no_grad():
        got = policy.token_logprobs(seqs2, [len(p) for p in prompts[:2]], temperature=0.8)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, after))


def test_activation_checkpointing_same_bits_and_grads(tiny_qwen3, prompts):
    seqs = [p + [5, 6, 7] for p in prompts[:2]]
    plens = [len(p) for p in prompts[:2]]
    grads = []
    outs = []
    for ckpt in (False, True):
        pol = Policy.from_pretrained(tiny_qwen3, device="cpu", numerics="invariant", activation_checkpointing=ckpt)
        lps = pol.token_logprobs(seqs, plens)
        sum(lp.sum() for lp in lps).backward()
        outs.append(lps)
        grads.append(pol.model.hf_state_dict(grads=True))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(*outs))
    for k in grads[0]:
        assert torch.equal(bits(grads[0][k]), bits(grads[1][k])), k


def test_training_bad_input(tiny_qwen3):
    policy = Policy.from_pretrained(tiny_qwen3, device="cpu")
    ctx = policy.model_config.max_model_len
    with pytest.raises(ValueError, match="longer than the model's context"):
        policy.token_logprobs([[1] * (ctx + 1)], [3])
    with pytest.raises(ValueError, match="empty response"):
        policy.token_logprobs([[1, 2, 3]], [3])
    with pytest.raises(ValueError, match="out of range"):
        policy.token_logprobs([[1, 2, 3]], [0])
    with pytest.raises(ValueError, match="out of range"):
        policy.token_logprobs([[1, 2, 3]], [5])
    with pytest.raises(ValueError, match="vocabulary"):
        policy.token_logprobs([[1, 2, 10 ** 6]], [1])
    with pytest.raises(ValueError, match="prompt lengths"):
        policy.token_logprobs([[1, 2, 3]], [1, 2])
    # what is wrong is named: not a range error for a value that is no token id at all
    for bad in ([[1.5, 2.0, 3.0]], [["a", "b"]], [[[1, 2], [3, 4]]], [[True, False, True]]):
        with pytest.raises(ValueError, match="1-D sequence of integer token ids"):
            policy.token_logprobs(bad, [1])
    with pytest.raises(ValueError, match="flat list"):
        policy.token_logprobs([1, 2, 3], [1])
    for temperature in ("1.0", None, True):
        with pytest.raises(ValueError, match="temperature"):
            policy.token_logprobs([[1, 2, 3]], [1], temperature=temperature)
    for budget in ("3", 1.5, True, 0):
        with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
            policy.token_logprobs([[1, 2, 3]], [1], max_tokens_per_micro_batch=budget)
    with pytest.raises(ValueError, match="prompt lengths"):
        policy.token_logprobs([[1, 2, 3]], 1)


def test_a_padded_batch_with_its_attention_mask_gives_the_unpadded_bits(tiny_qwen3):
    """An RL framework's form: a [B, L] batch, prompts left-padded and responses right-padded,
    with its attention_mask: each row's logprobs and entropies are the unpadded sequence's,
    bit for bit (the padding is not context); a mask that does not mark one run of tokens, has
    another shape or marks nothing is refused by row."""
    policy = Policy.from_pretrained(tiny_qwen3, device="cpu", numerics="invariant")
    seqs = [[5, 9, 13, 2, 7], [3, 4, 8, 11, 6, 12, 14], [20, 21, 22, 23]]
    plens = [2, 4, 1]
    P, R, pad = 4, 4, 0
    ids = torch.full((3, P + R), pad, dtype=torch.int64)
    mask = torch.zeros((3, P + R), dtype=torch.int64)
    for i, (s, p) in enumerate(zip(seqs, plens)):
        ids[i, P - p:P] = torch.tensor(s[:p])
        ids[i, P:P + len(s) - p] = torch.tensor(s[p:])
        mask[i, P - p:P + len(s) - p] = 1
    want, want_ent = policy.token_logprobs(seqs, plens, temperature=0.7, return_entropy=True)
    got, got_ent = policy.token_logprobs(ids, plens, temperature=0.7, return_entropy=True, attention_mask=mask)
    for a, b in zip(got + got_ent, want + want_ent):
        assert torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32))
    got_bool = policy.token_logprobs(ids.tolist(), plens, attention_mask=mask.bool().numpy())
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(got_bool, policy.token_logprobs(seqs, plens)))
    gap = mask.clone()
    gap[1, P] = 0
    with pytest.raises(ValueError, match="row 1 must mark one run"):
        policy.token_logprobs(ids, plens, attention_mask=gap)
    with pytest.raises(ValueError, match="a row per sequence"):
        policy.token_logprobs(ids, plens, attention_mask=mask[:2])
    with pytest.raises(ValueError, match="row 0 must be 1-D and as long"):
        policy.token_logprobs(ids, plens, attention_mask=mask[:, :5])
    empty = mask.clone()
    empty[2] = 0
    with pytest.raises(ValueError, match="row 2 marks no tokens"):
        policy.token_logprobs(ids, plens, attention_mask=empty)
    with pytest.raises(ValueError, match="only 0 / 1"):
        policy.token_logprobs(ids, plens, attention_mask=mask * 2)


def test_divergence_finder_locates_injected_ulp(tiny_qwen3):
    from vllm.parity import find_divergence
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant", enforce_eager=True)
    prompt = list(range(10, 30))
    clean, _ = find_divergence(llm, prompt, max_tokens=5)
    assert clean.first_divergence is None and clean.logprobs_equal

    def perturb(model):
        target = model.model.layers[1].self_attn.o_proj

        def nudge(module, args, out):
            out = out.clone()
            flat = out.view(-1)
            flat[3] = torch.nextafter(flat[3], torch.tensor(float("inf"), dtype=flat.dtype))
            return out
        return [target.register_forward_hook(nudge)]
    report, _ = find_divergence(llm, prompt, max_tokens=5, perturb_training=perturb)
    first = report.first_divergence
    assert first is not None and first.module == "model.layers.1.self_attn.o_proj", report.format()
    assert first.first_index == (0, 3) and 0 < first.max_abs_diff < 1e-5
    # everything before it in execution order is bit-identical
    names = [o.module for o in report.ops]
    assert all(o.differing_rows == 0 for o in report.ops[:names.index(first.module)])


def test_default_engine_policy_matches_rollout_bits(tiny_qwen3, prompts):
    """Parity needs no opt-in: a default LLM's colocated Policy recomputes the rollout's
    logprobs bit for bit, with the sequences packed differently from the rollout's batch."""
    import warnings

    llm = LLM(tiny_qwen3, device="cpu")
    assert llm.config.numerics == "invariant"
    seqs, roll = _rollout(llm, prompts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default engine has nothing to warn about
        policy = llm.policy()
    plens = [len(p) for p in prompts]
    order = [2, 0, 3, 1]
    with torch.no_grad():
        got = policy.token_logprobs([seqs[i] for i in order], [plens[i] for i in order], temperature=0.8,
                                    max_tokens_per_micro_batch=40)
    for j, i in enumerate(order):
        assert torch.equal(bits(got[j]), bits(roll[i])), f"seq {i}"


def test_fast_engine_policy_warns_once(tiny_qwen3):
    import warnings

    llm = LLM(tiny_qwen3, device="cpu", numerics="fast")
    with pytest.warns(UserWarning, match="will not match the rollout's"):
        llm.policy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm.policy()
    assert not [w for w in caught if "will not match" in str(w.message)]


def test_min_tokens_ban_leaves_the_rollout_logprobs_the_trainers(tiny_qwen3):
    """While min_tokens holds back a stop token it is not sampled, yet the reported logprobs
    stay the model's distribution (the default tempered_logprobs): the trainer's bits. The
    stop token is the greedy first token, so the ban moves the first step's distribution."""
    from vllm.sampling_params import SamplingParams
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant")
    prompt = list(range(10, 30))
    first = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1),
                         use_tqdm=False)[0].outputs[0].token_ids[0]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=1.0, seed=3, max_tokens=3, min_tokens=3, stop_token_ids=[first],
                                      logprobs=5), use_tqdm=False)[0].outputs[0]
    assert first not in out.token_ids
    assert first in out.logprobs[0] and out.logprobs[0][first].rank == 1   # reported, at the top
    rollout = torch.tensor([out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids)], dtype=torch.float32)
    with torch.no_grad():
        trainer = llm.policy().token_logprobs([prompt + list(out.token_ids)], [len(prompt)], temperature=1.0)[0]
    assert torch.equal(trainer.detach().cpu().view(torch.int32), rollout.view(torch.int32))


@pytest.mark.parametrize("controls", [
    dict(logit_bias={40: 6.0, 41: 4.0, 90: -100.0}, allowed_token_ids=list(range(0, 512, 2)), bad_words=["ay"]),
    dict(logit_bias={40: 6.0, 41: 4.0}, allowed_token_ids=list(range(0, 512, 2)), repetition_penalty=1.3,
         frequency_penalty=0.4, presence_penalty=0.2),
], ids=["bias-masks", "bias-masks-penalties"])
def test_logit_bias_and_token_masks_leave_the_rollout_logprobs_the_trainers(tiny_qwen3, controls):
    """logit_bias, allowed_token_ids, bad_words and the penalties steer sampling, yet the
    default tempered_logprobs report the model's own distribution, as for a grammar mask: the
    trainer (which knows none of them) recomputes the rollout's bits. processed_logprobs report
    the biased, penalised, masked distribution the tokens were drawn from, which the trainer
    does not."""
    from vllm.sampling_params import SamplingParams
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant")
    prompt = list(range(10, 30))
    outs = {mode: llm.generate({"prompt_token_ids": prompt},
                               SamplingParams(temperature=0.9, seed=3, max_tokens=8, ignore_eos=True, logprobs=0,
                                              logprobs_mode=mode, **controls),
                               use_tqdm=False)[0].outputs[0]
            for mode in ("tempered_logprobs", "processed_logprobs")}
    out = outs["tempered_logprobs"]
    assert out.token_ids == outs["processed_logprobs"].token_ids
    assert all(t % 2 == 0 for t in out.token_ids) and out.token_ids.count(40) >= 2   # the controls acted
    rollout = torch.tensor([d[t].logprob for d, t in zip(out.logprobs, out.token_ids)], dtype=torch.float32)
    with torch.no_grad():
        trainer = llm.policy().token_logprobs([prompt + list(out.token_ids)], [len(prompt)], temperature=0.9)[0]
    assert torch.equal(trainer.detach().cpu().view(torch.int32), rollout.view(torch.int32))
    processed = torch.tensor([d[t].logprob for d, t in zip(outs["processed_logprobs"].logprobs, out.token_ids)])
    assert (processed != rollout).all()   # the biased, renormalised distribution: not the trainer's


def test_a_replaced_lm_head_parameter_is_the_one_differentiated(tiny_qwen3, prompts):
    """load_state_dict(assign=True) (or a new nn.Parameter) replaces the head's weight: the
    logprob head then differentiates that one, as the forward uses it (the gradient used to go
    to the old tensor, and every other gradient was computed with it)."""
    from vllm.training.policy import Policy
    seqs, plens = [p + [7, 8, 9] for p in prompts], [len(p) for p in prompts]
    a = Policy.from_pretrained(tiny_qwen3, device="cpu", numerics="invariant")
    b = Policy.from_pretrained(tiny_qwen3, device="cpu", numerics="invariant")
    with torch.no_grad():
        a.model.lm_head.weight.mul_(2)                                             # in place
    b.model.lm_head.weight = torch.nn.Parameter(b.model.lm_head.weight.detach() * 2)  # replaced
    for p in (a, b):
        sum(x.sum() for x in p.token_logprobs(seqs, plens)).backward()
    assert b.lm_head_weight is b.model.lm_head.weight
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(bits(pa.grad), bits(pb.grad)), name


def test_load_state_dict_with_assign_keeps_a_tied_head_tied(tiny_llama, tmp_path):
    """assign=True gives every loaded name its own Parameter: a tied head is re-tied to the
    embedding's (else the two would train apart and save_pretrained write a checkpoint whose
    config says tied and whose tensors differ); a state dict whose two differ is refused."""
    from vllm.training.policy import Policy
    p = Policy.from_pretrained(tiny_llama, device="cpu", numerics="invariant")
    m = p.model
    n_params = len(list(p.parameters()))
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    m.load_state_dict(sd, assign=True)
    assert m.lm_head.weight is m.model.embed_tokens.weight and len(list(p.parameters())) == n_params
    seq = [[5, 6, 7, 8, 9, 10]]
    opt = torch.optim.SGD(p.parameters(), lr=1.0)
    (-p.token_logprobs(seq, [2])[0].sum()).backward()
    opt.step()
    with torch.no_grad():
        trained = p.token_logprobs(seq, [2])[0]
    p.save_pretrained(str(tmp_path / "saved"))
    with torch.no_grad():
        reloaded = Policy.from_pretrained(str(tmp_path / "saved"), device="cpu").token_logprobs(seq, [2])[0]
    assert torch.equal(bits(trained), bits(reloaded))
    without_head = {k: v.clone() for k, v in sd.items() if k != "lm_head.weight"}   # an HF tied checkpoint
    m.load_state_dict(without_head, assign=True, strict=False)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="tied to"):
        m.load_state_dict(sd, assign=True)


@pytest.mark.parametrize("around", ["autocast", "matmul_precision"])
def test_callers_torch_numerics_settings_do_not_reach_the_invariant_forward(tiny_qwen3, prompts, around):
    """A trainer that calls token_logprobs under torch.autocast, or after lowering the float32
    matmul precision, still recomputes the rollout's bits: invariant forwards set both aside
    (and give the caller's setting back afterwards)."""
    import contextlib
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant")
    seqs, lps = _rollout(llm, prompts)
    plens = [len(p) for p in prompts]
    saved = torch.get_float32_matmul_precision()
    if around == "autocast":
        ctx = torch.autocast("cpu", dtype=torch.bfloat16)
    else:
        torch.set_float32_matmul_precision("medium")
        ctx = contextlib.nullcontext()
    try:
        with ctx, torch.no_grad():
            got = llm.policy().token_logprobs(seqs, plens, temperature=0.8)
        assert torch.get_float32_matmul_precision() == ("medium" if around != "autocast" else saved)
    finally:
        torch.set_float32_matmul_precision(saved)
    for a, b in zip(got, lps):
        assert torch.equal(bits(a.cpu()), bits(b))


def test_temperatures_as_the_rollout_takes_them(tiny_qwen3, prompts):
    """The trainer raises a positive temperature below 0.01 to it as SamplingParams does (so
    the rollout's T = 0.005 logprobs are its bits), and refuses NaN / infinity; numpy and
    torch integer prompt lengths are taken as ints."""
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant")
    with pytest.warns(UserWarning, match="raised"):
        seqs, lps = _rollout(llm, prompts, temperature=0.005)
    plens = [len(p) for p in prompts]
    with torch.no_grad():
        got = llm.policy().token_logprobs(seqs, np.array(plens), temperature=0.005)
        again = llm.policy().token_logprobs(seqs, torch.tensor(plens), temperature=0.005)
    for g, a, r in zip(got, again, lps):
        assert torch.equal(bits(g), bits(r)) and torch.equal(bits(a), bits(r))
    for t in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            llm.policy().token_logprobs(seqs, plens, temperature=t)


def test_an_optimizer_step_during_a_rollout_is_refused_before_it_writes(tiny_qwen3, prompts):
    """attach_optimizer: a step while requests run is refused before any parameter changes
    (the engine's KV would mix versions). A step the engine is told of only afterwards still
    counts the version and drops the prefix cache before it raises."""
    from vllm.sampling_params import SamplingParams
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant", enable_prefix_caching=True)
    policy = llm.policy()
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    policy.attach_optimizer(opt)
    seqs, plens = [p + [7, 8, 9] for p in prompts], [len(p) for p in prompts]
    (-sum(x.sum() for x in policy.token_logprobs(seqs, plens))).backward()
    engine = llm.llm_engine
    engine.add_request("r0", {"prompt_token_ids": prompts[1]}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()
    weight = next(policy.parameters())
    before = weight.detach().clone()
    with pytest.raises(ValueError, match="running") as refused_step:
        opt.step()
    assert torch.equal(weight.detach(), before) and llm.weight_version == 0
    # a weight sync meanwhile is refused by the same check, in the same words
    with pytest.raises(ValueError, match="running") as refused_sync:
        llm.update_weights(dict(policy.model.hf_state_dict()))
    assert str(refused_sync.value) == str(refused_step.value)
    assert torch.equal(weight.detach(), before) and llm.weight_version == 0
    with torch.no_grad():
        weight.add_(1e-3)          # changed behind the optimizer's back, then reported
    with pytest.raises(RuntimeError, match="prefix cache dropped"):
        policy.notify_weights_updated()
    assert llm.weight_version == 1 and not engine.kv._hash_to_block


@pytest.mark.parametrize("foreach", [False, True])
def test_an_unattached_optimizer_step_is_counted_at_the_next_generate(tiny_qwen3, prompts, foreach, caplog):
    """An optimizer step on a colocated Policy with neither attach_optimizer nor
    notify_weights_updated: the parameters' version counters moved, so the next generate
    counts a new weight version and drops the prefix cache first (once warned), and its
    rollout is the new weights' (the trainer's bits). A second generate counts nothing."""
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant", enable_prefix_caching=True)
    policy = llm.policy()
    opt = torch.optim.SGD(policy.parameters(), lr=0.5, foreach=foreach)
    seqs, _ = _rollout(llm, prompts[:2])
    assert llm.llm_engine.kv.stats()["cached_blocks"] > 0
    plens = [len(p) for p in prompts[:2]]
    (-sum(lp.sum() for lp in policy.token_logprobs(seqs, plens, temperature=0.8))).backward()
    opt.step()
    assert llm.weight_version == 0   # nothing said so yet
    with caplog.at_level("WARNING"):
        seqs2, after = _rollout(llm, prompts[:2])
    assert llm.weight_version == 1 and "attach the optimizer" in caplog.text.lower()
    with torch.no_grad():
        got = policy.token_logprobs(seqs2, plens, temperature=0.8)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, after))
    _rollout(llm, prompts[:2])
    assert llm.weight_version == 1


def test_save_pretrained_carries_the_tokenizer_and_replaces_a_sharded_checkpoint(tiny_qwen3, tmp_path):
    """The saved checkpoint carries the tokenizer's chat template (transformers 5 keeps it in
    chat_template.jinja) and, saved over a sharded checkpoint, leaves no stale index or
    shard for a loader to prefer over the new weights."""
    import shutil

    from vllm.tokenizer import load_tokenizer
    from vllm.training.policy import Policy
    src = tmp_path / "src"
    shutil.copytree(tiny_qwen3, src)
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    policy = Policy.from_pretrained(str(src), device="cpu")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    with torch.no_grad():
        policy.model.lm_head.weight.mul_(2)
    policy.save_pretrained(str(out))
    assert sorted(p.name for p in out.iterdir() if "safetensors" in p.name) == ["model.safetensors"]
    assert (out / "chat_template.jinja").read_text() == (src / "chat_template.jinja").read_text()
    assert load_tokenizer(str(out)).chat_template is not None
    again = Policy.from_pretrained(str(out), device="cpu")
    assert torch.equal(again.model.lm_head.weight, policy.model.lm_head.weight)
    # saved back into the directory it was loaded from: its config.json is read before it is
    # rewritten (opening it for writing first emptied it, and the checkpoint was lost)
    policy.save_pretrained(str(src))
    back = Policy.from_pretrained(str(src), device="cpu")
    assert torch.equal(back.model.lm_head.weight, policy.model.lm_head.weight)


def test_a_second_policy_view_keeps_frozen_parameters_and_attach_is_once(tiny_qwen3):
    """Another llm.policy() of the same model leaves the parameters the user froze frozen, and
    attaching an optimizer twice counts each step once."""
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant")
    policy = llm.policy()
    frozen = [n for n, p in policy.model.named_parameters() if "embed_tokens" in n]
    assert frozen and all(p.requires_grad for p in policy.parameters())
    for n, p in policy.model.named_parameters():
        if n in frozen:
            p.requires_grad_(False)
    again = llm.policy()
    assert all(p.requires_grad == (n not in frozen) for n, p in again.model.named_parameters())
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.1)
    policy.attach_optimizer(opt)
    again.attach_optimizer(opt)          # the same model: already attached
    for p in policy.parameters():
        p.grad = torch.full_like(p, 1e-3) if p.requires_grad else None
    opt.step()
    assert llm.weight_version == 1


def test_a_weight_update_between_forward_and_backward_raises(tiny_qwen3):
    """llm.update_weights writes the parameters in place through views that share their
    version counter: a backward through a graph built on the old values raises (torch's
    in-place check) instead of mixing old activations with new weights."""
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant")
    policy = llm.policy()
    weights = {k: v.clone() for k, v in policy.model.hf_state_dict().items()}
    lps = policy.token_logprobs([[5, 6, 7, 8, 9]], [2])
    llm.update_weights(weights)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        sum(t.sum() for t in lps).backward()


def test_attach_optimizer_composes_with_lr_schedulers(tiny_qwen3):
    """LR schedulers wrap `optimizer.step` too (through its `__func__`): one made before or
    after attach_optimizer keeps working, and every step counts one version."""
    import warnings
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant")
    policy = llm.policy()
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    before = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    policy.attach_optimizer(opt)
    after = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for p in policy.parameters():
        p.grad = torch.full_like(p, 1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # "lr_scheduler.step() before optimizer.step()" would raise
        for _ in range(2):
            opt.step()
            before.step()
            after.step()
    assert llm.weight_version == 2
