"""Weight-sync edge paths on CPU: tied weights over the write-through (group) transports,
a torn engine repaired by a complete checkpoint from a path, a refused bucket inside the
four-phase API, malformed IPC messages and contracts, and contracts on every entry point."""
from __future__ import annotations

import time
from multiprocessing import shared_memory

import pytest
import torch

from vllm import LLM, SamplingParams


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


class _InProcessGroup:
    """A stand-in for WeightGroup at rank 1: each broadcast fills the receive buffer with the
    trainer's next packed bucket (what NCCL / gloo deliver)."""

    def __init__(self, named, bucket_bytes):
        from vllm.weight_sync.bucket import pack
        self.rank, self.device = 1, torch.device("cpu")
        self.buckets = pack(named, bucket_bytes, device="cpu")
        self.i = 0

    def flag(self, value, src):
        return value if value is not None else 1

    def broadcast(self, tensor, src):
        tensor.copy_(self.buckets[self.i].buffer[:tensor.numel()])
        self.i += 1
        return tensor


@pytest.mark.parametrize("only_alias", [False, True])
def test_tied_weights_over_a_reused_receive_buffer(tiny_llama, tiny_models_root, only_alias):
    """The group receivers write each bucket through from one reused buffer; the tied pair
    (lm_head / embed_tokens) is resolved at finish, after later buckets overwrote that
    buffer. Both a full HF state dict (both tied names) and the alias alone must land as
    the single-bucket path lands them."""
    from vllm.testing.tiny_models import make_tiny_checkpoint
    from vllm.weight_sync.bucket import manifest_of
    from vllm.weight_sync.group import receive_update

    other = make_tiny_checkpoint(tiny_models_root / "llama_tied_other", "llama", tie_word_embeddings=True, seed=9)
    new = LLM(other, device="cpu").llm_engine.executor.model
    sd = dict(new.hf_state_dict())
    emb = sd["model.embed_tokens.weight"]
    named = [(n, t) for n, t in sd.items() if n != "model.embed_tokens.weight"]
    named = [("lm_head.weight", emb)] + named if only_alias else [("model.embed_tokens.weight", emb)] + named + \
        [("lm_head.weight", emb.clone())]
    bucket_bytes = max(emb.nbytes + 4096, 1 << 14)     # several buckets, the embedding in the first
    llm = LLM(tiny_llama, device="cpu")
    eng = llm.llm_engine
    group = _InProcessGroup(named, bucket_bytes)
    assert len(group.buckets) > 2
    version = receive_update(eng, group, [[n, d, list(s)] for n, d, s in manifest_of(named)], bucket_bytes,
                             require_complete=True)
    assert version == 1
    got = eng.executor.model.model.embed_tokens.weight
    assert torch.equal(_bytes(got), _bytes(emb))
    ref = LLM(tiny_llama, device="cpu")
    ref.update_weights(dict(named), require_complete=True)
    for (n, a), (_, b) in zip(eng.executor.model.named_parameters(), ref.llm_engine.executor.model.named_parameters()):
        assert torch.equal(_bytes(a), _bytes(b)), n


def test_torn_engine_is_repaired_by_a_complete_checkpoint_from_a_path(tiny_qwen3, new_weights):
    """A failed backup="none" update tears the weights; POST /v1/weights/update with a whole
    checkpoint (staged off the loop, written by load_planned) lifts that, as a complete
    update_weights does, and a refusal meanwhile does not claim the old weights are kept."""
    from vllm.engine.core import EngineCore
    from vllm.engine.core_messages import UtilityCall

    llm = LLM(tiny_qwen3, device="cpu")
    eng = llm.llm_engine
    sd = LLM(new_weights, device="cpu").llm_engine.executor.model.hf_state_dict()
    items = list(sd.items())
    with pytest.raises(ValueError, match="non-finite"):
        with llm.weight_update(backup="none") as u:
            u.load(dict(items[:5]), retain=False)
            u.load({items[6][0]: torch.full_like(items[6][1], float("nan"))}, retain=False)
    assert eng.weights_torn
    with pytest.raises(ValueError, match="incomplete update"):
        llm.update_weights(dict(items[:3]))
    assert eng.weights_torn and "still torn" in eng.weight_error
    core = EngineCore(eng)
    core.handle(UtilityCall(1, "update_weights_from_path", (new_weights,)))
    for _ in range(2000):
        core._settle_staging()
        if core._staging is None:
            break
        time.sleep(0.01)
    results = core.take_outputs().utility_results
    assert [r.ok for r in results] == [True], results
    assert not eng.weights_torn
    for n, p in eng.executor.model.hf_state_dict().items():
        assert torch.equal(_bytes(p), _bytes(sd[n])), n
    assert not eng.paused and eng.weight_error is None


def test_refused_bucket_in_the_four_phase_api_resumes_the_engine(tiny_qwen3):
    """start_weight_update, then a bucket update_weights refuses: the update ends (as any
    refusal does), the old weights keep serving and generate works without an abort."""
    llm = LLM(tiny_qwen3, device="cpu")
    sp = SamplingParams(max_tokens=3, temperature=0)
    prompt = [{"prompt_token_ids": list(range(10, 20))}]
    before = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    llm.start_weight_update()
    with pytest.raises(ValueError, match="shape"):
        llm.update_weights({"model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)})
    assert not llm.llm_engine.paused and llm.llm_engine.weight_update is None
    assert llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == before
    with pytest.raises(ValueError, match="aborted"):
        llm.finish_weight_update()


def test_malformed_ipc_layouts_and_handles_are_value_errors(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu")
    name = "model.layers.0.self_attn.q_proj.weight"
    shm = shared_memory.SharedMemory(create=True, size=16)
    try:
        too_small = [{"layout": {"entries": [[name, "float32", [128, 64], 0]], "nbytes": 16},
                      "handle": {"kind": "shm", "name": shm.name, "nbytes": 16}}]
        with pytest.raises(ValueError, match="lies outside its bucket"):
            llm.update_weights_from_ipc(too_small)
        with pytest.raises(ValueError, match="needs 'name'"):
            llm.update_weights_from_ipc([{"layout": too_small[0]["layout"], "handle": {"kind": "shm"}}])
    finally:
        shm.close()
        shm.unlink()
    assert not llm.llm_engine.paused and llm.weight_version == 0


@pytest.mark.parametrize("bad", [{"semantic": [], "numerical": {}, "deployment": {}}, ["not", "a", "dict"]])
def test_malformed_contracts_are_value_errors(tiny_qwen3, bad):
    from vllm.engine.core import _contract_of
    llm = LLM(tiny_qwen3, device="cpu")
    sd = llm.llm_engine.executor.model.hf_state_dict()
    with pytest.raises(ValueError):
        llm.update_weights(sd, contract=bad)
    with pytest.raises(ValueError):
        _contract_of(bad)
    assert llm.weight_version == 0 and not llm.llm_engine.paused


def test_contracts_on_ipc_and_path_updates(tiny_qwen3, new_weights):
    """update_weights_from_ipc and the update from a path take the sender's contract and
    refuse an incompatible one before anything is read."""
    from vllm.engine.core import EngineCore
    from vllm.engine.core_messages import UtilityCall
    from vllm.weight_sync.ipc import IpcExport

    llm = LLM(tiny_qwen3, device="cpu")
    fast = LLM(tiny_qwen3, device="cpu", numerics="fast").execution_contract()
    ours = llm.execution_contract()
    sd = LLM(new_weights, device="cpu").llm_engine.executor.model.hf_state_dict()
    export = IpcExport(list(sd.items()))
    try:
        with pytest.raises(ValueError, match="incompatible"):
            llm.update_weights_from_ipc(export.message(), contract=fast)
        assert llm.weight_version == 0
        assert llm.update_weights_from_ipc(export.message(), contract=ours, require_complete=True) == 1
    finally:
        export.release()
    core = EngineCore(llm.llm_engine)
    with pytest.raises(ValueError, match="incompatible"):
        core.utility_update_weights_from_path(new_weights, "host", fast.to_dict())
    assert core._staging is None
    core.handle(UtilityCall(2, "update_weights_from_path", (tiny_qwen3, "host", ours.to_dict())))
    for _ in range(2000):
        core._settle_staging()
        if core._staging is None:
            break
        time.sleep(0.01)
    assert [r.ok for r in core.take_outputs().utility_results] == [True]
    assert llm.weight_version == 2


def test_malformed_shapes_and_offsets_are_value_errors(tiny_qwen3):
    """A wire layout or manifest with a negative or fractional dimension, or an entry at an
    offset its dtype cannot start at, is a ValueError (not a RuntimeError, a 500 on the
    server) and changes nothing."""
    from vllm.weight_sync.bucket import plan_buckets
    llm = LLM(tiny_qwen3, device="cpu")
    name = "model.norm.weight"
    for shape in ([-64], [64.7], [True], "64"):
        with pytest.raises(ValueError, match="non-negative integers"):
            plan_buckets([(name, "float32", shape)])
    shm = shared_memory.SharedMemory(create=True, size=1024)
    try:
        handle = {"kind": "shm", "name": shm.name, "nbytes": 1024}
        for entry, match in (([name, "float32", [-64], 0], "non-negative integers"),
                             ([name, "float32", [64], 1], "not a multiple"),
                             ([name, "float32", [64], -4], "offset")):
            with pytest.raises(ValueError, match=match):
                llm.update_weights_from_ipc([{"layout": {"entries": [entry], "nbytes": 1024}, "handle": handle}])
    finally:
        shm.close()
        shm.unlink()
    assert not llm.llm_engine.paused and llm.weight_version == 0


def test_transfer_refusals_end_the_started_update(tiny_qwen3):
    """upstream's four-phase transfer: update_weights without a group, or a group init with a
    bad timeout, is a ValueError; a started update it refuses ends (the engine resumes)."""
    from vllm.weight_sync.transfer import _timeout
    llm = LLM(tiny_qwen3, device="cpu")
    llm.start_weight_update()
    info = {"update_info": {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]]}}
    with pytest.raises(ValueError, match="no weight transfer group"):
        llm.update_weights(info)
    assert not llm.llm_engine.paused and llm.llm_engine.weight_update is None
    assert _timeout(None) == 300.0 and _timeout(5) == 5.0
    for bad in ("5", 0, -1, float("nan"), True):
        with pytest.raises(ValueError, match="timeout_s"):
            _timeout(bad)
    with pytest.raises(ValueError, match="timeout_s"):
        llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": 1,
                                                       "rank_offset": 1, "world_size": 2, "timeout_s": "x"}})


def test_trl_tensor_after_its_update_closed_is_reported(tiny_qwen3, monkeypatch):
    """TRL's per-tensor route: a request settling the implicit update between a tensor's
    check and its broadcast leaves that tensor unwritten; the next call says so (it was
    dropped without a word)."""
    from vllm.weight_sync import transfer as tr

    class FakeGroup:   # the broadcast's data: ones (the trainer's tensor)
        device = torch.device("cpu")
        store = None
        spec = type("Spec", (), {"world_size": 2, "timeout_s": 5.0})()

        def broadcast(self, buf, src):
            buf.fill_(0)

        def close(self):
            pass
    monkeypatch.setattr(tr, "store_barrier", lambda *a: None)
    llm = LLM(tiny_qwen3, device="cpu")
    t = tr.transfer_of(llm.llm_engine)
    t.group, t.protocol, t.trainer_rank = FakeGroup(), "trl", 1
    name = "model.norm.weight"
    shape = list(llm.llm_engine.executor.model.hf_state_dict()[name].shape)
    assert t.check_trl(name, "float32", shape) == {"ready": True}
    assert t.receive_trl(name, "float32", shape) == {"received": True}
    assert t.check_trl(name, "float32", shape) == {"ready": True}
    v = t.settle()["weight_version"]            # a /generate/ came between the check and the broadcast
    assert t.receive_trl(name, "float32", shape) == {"received": False}
    with pytest.raises(ValueError, match="arrived after its update was closed"):
        t.check_trl(name, "float32", shape)
    assert t.check_trl(name, "float32", shape) == {"ready": True}   # reported once
    assert llm.weight_version == v


def test_a_group_that_breaks_under_a_collective_is_left(tiny_qwen3, monkeypatch):
    """A group failing inside a collective (the trainer gone, a timeout closing its pairs)
    is a ValueError saying to join again, not a RuntimeError; the group is left and the
    started update ends with the previous weights."""
    from vllm.weight_sync import transfer as tr

    class FakeGroup:
        device, rank = torch.device("cpu"), 1
        closed = False

        def close(self):
            self.closed = True

    def broken(*a, **k):
        raise RuntimeError("Application timeout caused pair closure")
    monkeypatch.setattr(tr, "receive_buckets", broken)
    llm = LLM(tiny_qwen3, device="cpu")
    t = tr.transfer_of(llm.llm_engine)
    group = FakeGroup()
    t.group, t.protocol = group, "vllm"
    llm.start_weight_update()
    info = {"update_info": {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]]}}
    with pytest.raises(ValueError, match="group failed.*join it again"):
        llm.update_weights(info)
    assert group.closed and t.group is None and not llm.llm_engine.paused and llm.weight_version == 0
    with pytest.raises(ValueError, match="no weight transfer group"):
        llm.update_weights(info)
