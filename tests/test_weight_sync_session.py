"""The weight-update session: the load-rule cast (an update from a checkpoint's tensors
equals a fresh engine loaded from it, bit for bit), buckets closed by finish, a failed
bucket leaving the previous weights (bits), zero-copy for shared storage, the request's
weight versions, the CUDA-graph pointer check."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.model_loader.loader import checkpoint_files, iterate_weights
from vllm.weight_sync import pack
from vllm.worker.graph_pointers import StaleGraphPointers


def checkpoint_tensors(path):
    return list(iterate_weights(checkpoint_files(path)))


def param_bits(llm):
    return {n: p.detach().clone().view(torch.int16 if p.element_size() == 2 else torch.int32)
            for n, p in llm.llm_engine.executor.model.named_parameters()}


def same_bits(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_float32_update_into_bf16_engine_equals_fresh_load(tiny_qwen3, new_weights):
    llm = LLM(tiny_qwen3, device="cpu", dtype="bfloat16", numerics="fast")
    tensors = checkpoint_tensors(new_weights)
    assert all(t.dtype == torch.float32 for _, t in tensors)
    ptrs = {n: p.data_ptr() for n, p in llm.llm_engine.executor.model.named_parameters()}
    assert llm.update_weights(tensors, require_complete=True) == 1
    fresh = LLM(new_weights, device="cpu", dtype="bfloat16", numerics="fast")
    assert same_bits(param_bits(llm), param_bits(fresh))
    assert {n: p.data_ptr() for n, p in llm.llm_engine.executor.model.named_parameters()} == ptrs
    # float64 too: cast by the same rule
    llm.update_weights([(n, t.double()) for n, t in tensors])
    assert same_bits(param_bits(llm), param_bits(fresh))


def test_buckets_then_finish_make_one_version(tiny_qwen3, new_weights):
    llm = LLM(tiny_qwen3, device="cpu")
    fresh = LLM(new_weights, device="cpu")
    tensors = checkpoint_tensors(new_weights)
    buckets = pack(tensors, bucket_bytes=64 << 10)
    assert len(buckets) > 3
    eng = llm.llm_engine
    with llm.weight_update(require_complete=True) as u:
        for b in buckets:
            u.load(b)
            assert eng.paused and llm.weight_version == 0   # nothing visible before finish
        with pytest.raises(ValueError, match="weight update is open"):
            llm.generate({"prompt_token_ids": [1, 2, 3]}, use_tqdm=False)
    assert llm.weight_version == 1 and not eng.paused and eng.weight_update is None
    assert same_bits(param_bits(llm), param_bits(fresh))
    # incomplete buckets are refused at finish, nothing written
    before = param_bits(llm)
    with pytest.raises(ValueError, match="incomplete"):
        with llm.weight_update(require_complete=True) as u:
            u.load(dict(tensors[:3]))
    assert llm.weight_version == 1 and same_bits(param_bits(llm), before)
    assert "incomplete" in llm.weight_error


@pytest.mark.parametrize("retain,backup", [(True, "device"), (False, "device"), (False, "host"), (False, "auto")])
def test_failing_middle_bucket_leaves_old_weights(tiny_qwen3, new_weights, retain, backup):
    llm = LLM(tiny_qwen3, device="cpu")
    before = param_bits(llm)
    out0 = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    tensors = checkpoint_tensors(new_weights)
    third = len(tensors) // 3
    bad = dict(tensors[third:2 * third])
    bad[next(iter(bad))] = torch.full_like(next(iter(bad.values())), float("nan"))
    u = llm.weight_update(backup=backup)
    u.load(dict(tensors[:third]), retain=retain)
    with pytest.raises(ValueError, match="non-finite"):
        # a retained bucket's finiteness is read at finish (no host sync per bucket), a
        # written-through one's before it is written
        u.load(bad, retain=retain)
        u.load(dict(tensors[2 * third:]), retain=retain)
        u.finish()
    assert u.closed and llm.weight_version == 0 and "non-finite" in llm.weight_error
    assert same_bits(param_bits(llm), before)
    out1 = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert out1[0].outputs[0].token_ids == out0[0].outputs[0].token_ids
    # the old weights written back are not a new version (generate counts unannounced writes)
    assert llm.weight_version == 0


def test_auto_backup_keeps_the_device_while_it_has_room(monkeypatch):
    """backup="auto" (the default): a written bucket's previous bytes stay on the device
    while its free memory (the driver's, plus what the allocator holds unused) has room for
    them and the headroom, else they go to host memory; "device" and "host" are as named."""
    import types

    from vllm.weight_sync import session
    u = session.WeightUpdate.__new__(session.WeightUpdate)
    u.engine = types.SimpleNamespace(executor=types.SimpleNamespace(info=types.SimpleNamespace(
        device=torch.device("cuda", 0))))
    plan = [(torch.empty(1 << 20, dtype=torch.bfloat16), None)]   # 2 MiB to back up
    free = {"driver": 0, "reserved": 0, "allocated": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (free["driver"], 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: free["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: free["allocated"])
    need = (2 << 20) + session.AUTO_BACKUP_HEADROOM_BYTES
    for backup, driver, spare, want in (("auto", need, 0, None), ("auto", need - 1, 0, "cpu"),
                                        ("auto", need - 4096, 4096, None), ("device", 0, 0, None),
                                        ("host", 1 << 40, 0, "cpu")):
        u.backup = backup
        free.update(driver=driver, reserved=spare + 100, allocated=100)
        assert u._backup_device(plan) == want, (backup, driver, spare)
    u.engine.executor.info.device = torch.device("cpu")
    u.backup = "auto"
    assert u._backup_device(plan) is None


def test_failure_without_backup_refuses_service(tiny_qwen3, new_weights):
    llm = LLM(tiny_qwen3, device="cpu")
    tensors = checkpoint_tensors(new_weights)
    u = llm.weight_update(backup="none")
    u.load(dict(tensors[:4]), retain=False)
    u.abort("the sender died")
    assert llm.llm_engine.weights_torn
    with pytest.raises(ValueError, match="not serving"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)
    # a partial update cannot lift it (it would serve a mix of two versions), even unasked for completeness
    with pytest.raises(ValueError, match="incomplete update"):
        llm.update_weights(dict(tensors[:1]))
    assert llm.llm_engine.weights_torn
    with pytest.raises(ValueError, match="not serving"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)
    llm.update_weights(tensors)   # a complete update brings service back
    assert not llm.llm_engine.weights_torn
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), use_tqdm=False)


def test_colocated_policy_update_is_zero_copy(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu")
    policy = llm.policy()
    calls = []
    import vllm.weight_sync.session as session
    orig = session.copy_all
    session.copy_all = lambda d, s: (calls.append(len(d)), orig(d, s))
    try:
        assert llm.update_weights(policy.model.hf_state_dict(), contract=policy.execution_contract()) == 1
    finally:
        session.copy_all = orig
    assert sum(calls) == 0
    # the engine's own parameters holding NaN (a diverged colocated step): refused, not counted;
    # the old weights are gone, so the engine stops serving until an update with finite weights
    p = next(policy.parameters())
    good = p.detach().view(-1)[0].clone()
    with torch.no_grad():
        p.view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match="non-finite values.*engine's own parameter"):
        llm.update_weights(policy.model.hf_state_dict())
    assert llm.weight_version == 1 and "non-finite" in llm.weight_error and "own parameters" in llm.weight_error
    assert llm.llm_engine.weights_torn and "previous weights kept" not in llm.weight_error
    with pytest.raises(ValueError, match="not serving"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)
    with torch.no_grad():
        p.view(-1)[0] = good          # the trainer restores finite weights and reports them
    assert llm.update_weights(policy.model.hf_state_dict()) > 1
    assert not llm.llm_engine.weights_torn
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), use_tqdm=False)


def test_paused_request_reports_both_versions(tiny_qwen3, new_weights):
    llm = LLM(tiny_qwen3, device="cpu")
    eng = llm.llm_engine
    eng.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=6, ignore_eos=True))
    eng.step()
    eng.pause()
    llm.update_weights(checkpoint_tensors(new_weights))
    eng.resume()
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].outputs[0].weight_versions == [0, 1]


def test_graph_pointer_check_fires_on_new_storage(tiny_qwen3):
    """On CPU there are no graphs: the pointer table is recorded by hand, as capture does."""
    llm = LLM(tiny_qwen3, device="cpu")
    runner = llm.llm_engine.executor.worker
    runner.record_graph_pointers()
    llm.check_graph_pointers()                      # nothing moved
    llm.update_weights(llm.policy().model.hf_state_dict())
    llm.check_graph_pointers()                      # in place: still the captured addresses
    p = next(runner.model.parameters())
    p.data = p.data.clone()                         # new storage behind the graphs' back
    with pytest.raises(StaleGraphPointers, match="moved since capture"):
        llm.check_graph_pointers()
    runner.weights_changed()
    assert runner.decode_graphs.pointers_unverified


@pytest.mark.gpu
def test_graph_pointer_check_fires_before_replay_on_gpu(gpu_model):
    llm = LLM(gpu_model, device="cuda", max_num_seqs=4, cuda_graph_batch_sizes=[1, 2, 4])
    sp = SamplingParams(temperature=0, max_tokens=4)
    ref = llm.generate({"prompt_token_ids": [5, 6, 7]}, sp, use_tqdm=False)[0].outputs[0].token_ids
    llm.update_weights(llm.policy().model.hf_state_dict())  # in place: graphs replay as before
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, sp, use_tqdm=False)[0].outputs[0].token_ids == ref
    p = next(llm.llm_engine.executor.model.parameters())
    p.data = p.data.clone()
    llm.llm_engine.on_weights_updated()
    with pytest.raises(StaleGraphPointers):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, sp, use_tqdm=False)


def test_non_finite_found_in_any_tensor(tiny_qwen3):
    """NaN, +Inf or -Inf in the largest or the smallest tensor is found and named, whatever
    the dtype mix of the update, and nothing is written."""
    from vllm.weight_sync import session
    llm = LLM(tiny_qwen3, device="cpu")
    model = llm.llm_engine.executor.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sd = {n: t.detach().clone() for n, t in model.hf_state_dict().items()}
    large = max(sd, key=lambda n: sd[n].numel())
    small = min(sd, key=lambda n: sd[n].numel())
    for name, value in ((large, float("nan")), (small, float("-inf")), (small, float("inf"))):
        for dtype in (None, torch.float32):     # the update's own dtype, or a float32 one cast by the load rule
            bad = {n: (t if dtype is None else t.to(dtype)) for n, t in sd.items()}
            bad[name] = bad[name].clone()
            bad[name].view(-1)[-1] = value
            with pytest.raises(ValueError, match=f"{name}.*non-finite"):
                llm.update_weights(bad)
    session.check_finite([(t, t) for t in sd.values()])   # all finite: no error
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert llm.weight_version == 0


def test_weight_mapping_cache_follows_parameter_objects(tiny_qwen3):
    """The mapping weight sync reuses is rebuilt when a parameter object is replaced."""
    from vllm.weight_sync.session import weight_mapping_of
    model = LLM(tiny_qwen3, device="cpu").llm_engine.executor.model
    m1 = weight_mapping_of(model)
    assert weight_mapping_of(model) is m1
    name, p = next(iter(model.named_parameters()))
    mod_name, attr = name.rsplit(".", 1)
    setattr(model.get_submodule(mod_name), attr, torch.nn.Parameter(p.detach().clone()))
    m2 = weight_mapping_of(model)
    assert m2 is not m1 and m2.params[name] is not p


def test_check_finite_off_writes_what_it_is_given(tiny_qwen3):
    """check_finite=False is the caller's promise: the bytes are written unchecked (and the
    default refuses the same update)."""
    llm = LLM(tiny_qwen3, device="cpu")
    sd = {n: t.detach().clone() for n, t in llm.llm_engine.executor.model.hf_state_dict().items()}
    name = next(iter(sd))
    sd[name] = torch.full_like(sd[name], float("inf"))
    with pytest.raises(ValueError, match="non-finite"):
        llm.update_weights(sd)
    assert llm.update_weights(sd, check_finite=False) == 1
    assert torch.isinf(llm.llm_engine.executor.model.hf_state_dict()[name]).all()


def test_a_contract_travels_as_its_dict(tiny_qwen3, new_weights):
    """The sender's contract as to_dict() gives it (JSON over a wire) is checked like the object;
    anything else is a ValueError that changes nothing."""
    llm = LLM(tiny_qwen3, device="cpu")
    tensors = checkpoint_tensors(new_weights)
    with pytest.raises(ValueError, match="not an execution contract"):
        llm.update_weights(tensors, contract={"semantic": {}})
    with pytest.raises(ValueError, match="ExecutionContract or its dict"):
        llm.update_weights(tensors, contract=42)
    assert llm.llm_engine.weight_version == 0 and llm.llm_engine.weight_update is None
    llm.update_weights(tensors, contract=llm.llm_engine.execution_contract().to_dict())
    assert llm.llm_engine.weight_version == 1


def test_a_non_finite_tied_alias_is_named(tiny_llama):
    """lm_head given alone on a tied model is written into the embedding: a NaN in it is refused
    naming lm_head.weight."""
    llm = LLM(tiny_llama, device="cpu")
    emb = llm.llm_engine.executor.model.state_dict()["model.embed_tokens.weight"]
    bad = emb.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="lm_head.weight"):
        llm.update_weights({"lm_head.weight": bad})
    assert llm.llm_engine.weight_version == 0
