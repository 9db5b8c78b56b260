"""The invariance battery in numerics='invariant' on CPU (tiny models): every
layout that must not change bits is compared by bit pattern, never allclose."""
from __future__ import annotations

import json

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.testing.parity_battery import Battery, battery_check_params, run_exercised_check


@pytest.fixture(scope="module")
def battery(tiny_qwen3):
    def make(**kw):
        opts = dict(device="cpu", dtype="float32", numerics="invariant", block_size=4, max_num_batched_tokens=512)
        opts.update(kw)
        return LLM(tiny_qwen3, **opts)
    b = Battery(make, vocab=512, max_tokens=6)
    return b


@pytest.mark.parametrize("check, options", battery_check_params(n_identical=60, n_seeds=6))
def test_invariant_battery(battery, check, options):
    run_exercised_check(battery, check, **options)


def test_invariant_mode_qwen2_bias_and_llama(tiny_qwen2, tiny_llama):
    for path in (tiny_qwen2, tiny_llama):
        llm = LLM(path, device="cpu", numerics="invariant")
        sp = SamplingParams(temperature=0.0, max_tokens=5, logprobs=0, ignore_eos=True)
        prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}, {"prompt_token_ids": list(range(20, 50))}]
        both = llm.generate(prompts, sp, use_tqdm=False)
        alone = llm.generate(prompts[1], sp, use_tqdm=False)[0]
        a = [alone.outputs[0].logprobs[i][t].logprob for i, t in enumerate(alone.outputs[0].token_ids)]
        b = [both[1].outputs[0].logprobs[i][t].logprob for i, t in enumerate(both[1].outputs[0].token_ids)]
        assert torch.equal(torch.tensor(a).view(torch.int32), torch.tensor(b).view(torch.int32))


def test_execution_contract(tiny_qwen3):
    from vllm.contract import ExecutionContract
    inv = LLM(tiny_qwen3, device="cpu", numerics="invariant").execution_contract()
    inv2 = LLM(tiny_qwen3, device="cpu", numerics="invariant", max_num_seqs=3, block_size=8).execution_contract()
    fast = LLM(tiny_qwen3, device="cpu", numerics="fast").execution_contract()
    assert inv.digests["semantic"] == inv2.digests["semantic"] == fast.digests["semantic"]
    assert inv.digests["numerical"] == inv2.digests["numerical"] != fast.digests["numerical"]
    assert inv.digests["deployment"] != inv2.digests["deployment"]
    inv.check_compatible(inv2)  # deployment differences are allowed
    with pytest.raises(ValueError, match="numerical"):
        inv.check_compatible(fast)
    round_trip = ExecutionContract.from_json(inv.to_json())
    assert round_trip.digests == inv.digests
    tampered = inv.to_dict()
    tampered["numerical"]["gemm"] = "something else"
    with pytest.raises(ValueError, match="digests"):
        ExecutionContract.from_dict(tampered)
    # a saved document without its digests, or without a part: ValueErrors, not KeyErrors
    undigested = inv.to_dict()
    del undigested["digests"]
    with pytest.raises(ValueError, match="no digests"):
        ExecutionContract.from_json(json.dumps(undigested))
    with pytest.raises(ValueError, match="no 'numerical' part"):
        ExecutionContract.from_json('{"semantic": {}, "digests": {}}')
    with pytest.raises(ValueError, match="JSON"):
        ExecutionContract.from_json("{not json")
    # a field differing only in its JSON type is refused and named (1 == 1.0 == True in Python)
    key = next(k for k, v in inv.numerical.items() if isinstance(v, (str, dict)))
    retyped = ExecutionContract(inv.semantic, {**inv.numerical, key: 1}, inv.deployment)
    other = ExecutionContract(inv.semantic, {**inv.numerical, key: 1.0}, inv.deployment)
    with pytest.raises(ValueError, match=f"numerical differs in \\['{key}'\\]"):
        retyped.check_compatible(other)


def test_contract_names_the_code_that_computes(tiny_qwen3, tmp_path):
    """The numerical part carries the source digests of the packages that compute a token: a
    peer from another build (here: other kernel sources) is refused, naming code_sha256."""
    import copy

    from vllm.contract import ExecutionContract, code_digests, source_digest
    from vllm.kernels.numerics_table import CODE_PACKAGES
    inv = LLM(tiny_qwen3, device="cpu", numerics="invariant").execution_contract()
    assert inv.numerical["code_sha256"] == code_digests()
    assert set(code_digests()) == set(CODE_PACKAGES)
    numerical = copy.deepcopy(inv.numerical)
    numerical["code_sha256"]["kernels"] = "0" * 64
    other = ExecutionContract(copy.deepcopy(inv.semantic), numerical, copy.deepcopy(inv.deployment))
    with pytest.raises(ValueError, match=r"numerical differs in \['code_sha256'\]"):
        inv.check_compatible(other)
    # the digest follows every byte of every .py file below the package, and their paths
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "k.py").write_text("x = 1\n")
    before = source_digest(tmp_path)
    (tmp_path / "sub" / "k.py").write_text("x = 1  # why\n")
    edited = source_digest(tmp_path)
    (tmp_path / "sub" / "k.py").rename(tmp_path / "k.py")
    assert len({before, edited, source_digest(tmp_path)}) == 3


def test_invariant_refuses_unverified_device():
    from vllm.kernels.selfcheck import check_supported
    with pytest.raises(ValueError):
        check_supported(torch.device("meta"), torch.float32)


def test_ops_refuse_an_unknown_numerics_mode():
    from vllm.forward_context import ForwardContext, set_forward_context
    from vllm.kernels import ops
    with set_forward_context(ForwardContext(None, "fastest")):
        with pytest.raises(ValueError, match="numerics must be one of"):
            ops.linear(torch.ones(2, 3), torch.ones(4, 3))


def test_n_samples_equal_separate_requests(tiny_qwen3):
    """Sample i of an n>1 request (sharing the leader's cached prompt blocks) has the bits of
    a separate request seeded with derive_seed(seed, i)."""
    from vllm.engine.llm_engine import derive_seed
    llm = LLM(tiny_qwen3, device="cpu", numerics="invariant", block_size=4)
    prompt = {"prompt_token_ids": list(range(30, 75))}
    group = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=6, logprobs=0, ignore_eos=True),
                         use_tqdm=False)[0]
    for i, c in enumerate(group.outputs):
        alone = LLM(tiny_qwen3, device="cpu", numerics="invariant", block_size=4).generate(
            prompt, SamplingParams(temperature=1.0, seed=derive_seed(9, i), max_tokens=6, logprobs=0, ignore_eos=True),
            use_tqdm=False)[0].outputs[0]
        assert c.token_ids == alone.token_ids
        a = torch.tensor([c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)])
        b = torch.tensor([alone.logprobs[j][t].logprob for j, t in enumerate(alone.token_ids)])
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
