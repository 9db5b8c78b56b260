"""Weight update from a checkpoint path, staged off the engine loop (vllm/weight_sync/staging.py,
EngineCore.utility_update_weights_from_path): requests keep producing tokens while the
checkpoint is read and validated, the update lands at a step boundary (a request spanning it
reports both versions), the result equals a fresh engine on the checkpoint, a bad checkpoint
changes nothing, a second update while one stages is refused, and abort / shutdown end the
staging thread.

The EngineCore is driven by hand (step, then settle) so nothing depends on timing: a hook
holds the staging thread before it reads a tensor until the test lets it go.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import threading
import time
from multiprocessing import Pipe

import glob

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm import LLM, SamplingParams
from vllm.engine.core import EngineCore
from vllm.engine.core_messages import AddRequest, UtilityCall

PROMPT = [5, 6, 7, 8, 9, 10]
GREEDY = dict(temperature=0, ignore_eos=True)


def greedy_ids(llm, n: int, prompt=PROMPT) -> list[int]:
    return llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=n, **GREEDY),
                        use_tqdm=False)[0].outputs[0].token_ids


def param_bits(llm) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in llm.llm_engine.executor.model.hf_state_dict().items()}


class Gate:
    """A staging hook that holds the thread before its first tensor until `open()` (or
    until the staging is cancelled)."""

    def __init__(self):
        self.entered, self.gate = threading.Event(), threading.Event()
        self.threads: list[threading.Thread] = []
        self.names: list[str] = []

    def __call__(self, staging, name: str) -> None:
        self.names.append(name)
        if not self.entered.is_set():
            self.threads.append(threading.current_thread())
        self.entered.set()
        deadline = time.monotonic() + 60
        while not self.gate.wait(0.01) and not staging.cancelled:
            if time.monotonic() > deadline:
                raise RuntimeError("the test never opened the gate")

    def open(self) -> None:
        self.gate.set()


class Driver:
    """Runs an EngineCore's loop body by hand and sorts what comes out."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.tokens: dict[str, list[int]] = {}
        self.versions: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.results: dict[int, tuple] = {}

    def once(self) -> None:
        core = self.core
        if core.busy:
            core.step()
        core._settle_pause()
        core._settle_staging()
        out = core.take_outputs()
        if out is None:
            return
        for d in out.deltas:
            rid, _, ids, _, finish, _, versions = d[:7]
            self.tokens.setdefault(rid, []).extend(ids)
            self.versions[rid] = list(versions)
            if finish is not None:
                self.finished.add(rid)
        for r in out.utility_results:
            self.results[r.call_id] = (r.ok, r.value)

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.once()

    def until(self, cond, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            self.once()
            if not self.core.busy:
                time.sleep(0.002)

    def call(self, call_id: int, method: str, *args):
        self.core.handle(UtilityCall(call_id, method, args))
        self.once()
        return self.results.get(call_id)

    def add(self, rid: str, max_tokens: int, prompt=PROMPT) -> None:
        self.core.handle(AddRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **GREEDY)))


@pytest.fixture(scope="module")
def old_llm(tiny_qwen3):
    """An engine that only sees refused updates: it keeps tiny_qwen3's weights. Its greedy
    reference is taken first: once an EngineCore drives it, it emits the core's deltas."""
    llm = LLM(tiny_qwen3, device="cpu", max_num_seqs=4)
    llm.ref_old = greedy_ids(llm, 16)
    return llm


def test_requests_run_while_checkpoint_stages(tiny_qwen3, new_weights):
    llm = LLM(tiny_qwen3, device="cpu", max_num_seqs=4)
    ref_old = greedy_ids(llm, 40)
    ref_new = greedy_ids(LLM(new_weights, device="cpu"), 8)
    gate = Gate()
    core = EngineCore(llm.llm_engine)
    core.staging_hook = gate
    drv = Driver(core)
    drv.add("a", 40)
    drv.steps(2)
    assert drv.call(1, "update_weights_from_path", new_weights) is None     # answered later
    assert gate.entered.wait(60)
    drv.steps(12)                                        # the staging thread is held: the engine steps on
    during = list(drv.tokens["a"])
    assert len(during) >= 12 and during == ref_old[:len(during)]            # the old weights serve meanwhile
    assert 1 not in drv.results and llm.llm_engine.weight_version == 0 and not llm.llm_engine.paused
    # a second update while one stages is refused at once
    ok, (kind, msg) = drv.call(2, "update_weights_from_path", new_weights)
    assert not ok and kind == "ValueError" and "already being staged" in msg
    gate.open()
    drv.until(lambda: 1 in drv.results)
    ok, res = drv.results[1]
    assert ok, res
    assert res["weight_version"] == 1 and llm.llm_engine.weight_version == 1
    assert set(res) >= {"weight_version", "stage_s", "pause_s", "copy_s"}
    assert res["stage_s"] > 0 and 0 <= res["copy_s"] <= res["pause_s"]
    assert res["host_bytes"] > 0 and res["device_bytes"] == 0
    assert not gate.threads[0].is_alive() and core._staging is None
    drv.until(lambda: "a" in drv.finished)
    assert len(drv.tokens["a"]) == 40 and drv.versions["a"] == [0, 1]     # never lost: continued on the new weights
    drv.add("b", 8)
    drv.until(lambda: "b" in drv.finished)
    assert drv.tokens["b"] == ref_new and drv.versions["b"] == [1]        # == a fresh engine on the checkpoint


def _bad_checkpoint(src: str, dst: str, kind: str) -> str:
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    if kind == "nan":
        tensors[name][3, 5] = float("nan")
    elif kind == "inf_after_cast":          # finite in float32, infinite once cast to bfloat16
        tensors[name][0, 0] = 3.4e38
    elif kind == "unknown":
        tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(4)
    elif kind == "shape":
        tensors[name] = tensors[name][:-1].contiguous()
    elif kind == "int":
        tensors[name] = torch.zeros_like(tensors[name], dtype=torch.int32)
    elif kind == "bool":
        tensors[name] = torch.ones_like(tensors[name], dtype=torch.bool)
    elif kind == "missing":                 # a tensor dropped (a lost shard's): part of the model would stay old
        del tensors[name]
    elif kind == "config":                  # the weights of a model with another rope theta
        with open(os.path.join(src, "config.json")) as f:
            cfg = json.load(f)
        cfg["rope_theta"] = float(cfg.get("rope_theta", 10000.0)) * 2
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    path = os.path.join(dst, "model.safetensors")
    save_file(tensors, path)
    if kind == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 100)
    if kind == "garbage":
        with open(path, "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    return dst


@pytest.mark.parametrize("kind, message", [
    ("nan", "non-finite"), ("unknown", "unknown weight"), ("shape", "shape"), ("int", "not a float dtype"),
    ("bool", "not a float dtype"), ("missing", "is incomplete"), ("config", "another model configuration"),
    ("truncated", "truncated"), ("garbage", "not a readable safetensors file"),
])
def test_bad_checkpoint_changes_nothing(old_llm, new_weights, tmp_path, kind, message):
    bad = _bad_checkpoint(new_weights, str(tmp_path / kind), kind)
    before = param_bits(old_llm)
    drv = Driver(EngineCore(old_llm.llm_engine))
    drv.add("a", 16)
    drv.once()
    drv.call(1, "update_weights_from_path", bad)
    drv.until(lambda: 1 in drv.results)
    ok, (err, msg) = drv.results[1]
    assert not ok and err == "ValueError" and message in msg, msg
    drv.until(lambda: "a" in drv.finished)
    assert drv.tokens["a"] == old_llm.ref_old and drv.versions["a"] == [0]   # in flight, untouched
    eng = old_llm.llm_engine
    assert eng.weight_version == 0 and not eng.paused and eng.weight_update is None
    after = param_bits(old_llm)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_a_file_rewritten_while_staged_is_refused(old_llm, new_weights, tmp_path):
    """A checkpoint file written again while the engine stages it would give one version made of
    two checkpoints: refused, nothing changed."""
    import shutil
    src = str(tmp_path / "rewritten")
    shutil.copytree(new_weights, src)
    before = param_bits(old_llm)
    core = EngineCore(old_llm.llm_engine)
    seen = []

    def rewrite_once(job, name):
        if not seen:
            seen.append(name)
            with open(os.path.join(src, "model.safetensors"), "r+b") as f:   # in place: same layout, other bytes
                f.seek(-4, os.SEEK_END)
                f.write(bytes(4))
    core.staging_hook = rewrite_once
    drv = Driver(core)
    drv.call(1, "update_weights_from_path", src)
    drv.until(lambda: 1 in drv.results)
    ok, (err, msg) = drv.results[1]
    assert not ok and err == "ValueError" and "changed while they were staged" in msg, msg
    after = param_bits(old_llm)
    assert old_llm.llm_engine.weight_version == 0 and all(torch.equal(before[n], after[n]) for n in before)


def test_overflow_on_cast_is_refused(tiny_qwen3, new_weights, tmp_path):
    """The load rule's cast is what is checked: 3.4e38 is finite in float32, not in bfloat16."""
    llm = LLM(tiny_qwen3, device="cpu", dtype="bfloat16", max_num_seqs=2)
    bad = _bad_checkpoint(new_weights, str(tmp_path / "big"), "inf_after_cast")
    drv = Driver(EngineCore(llm.llm_engine))
    drv.call(1, "update_weights_from_path", bad)
    drv.until(lambda: 1 in drv.results)
    ok, (err, msg) = drv.results[1]
    assert not ok and "non-finite" in msg and "up_proj" in msg
    assert llm.llm_engine.weight_version == 0


def test_tied_tensors_must_agree(tiny_llama, tmp_path):
    llm = LLM(tiny_llama, device="cpu", max_num_seqs=2)
    tensors = load_file(os.path.join(tiny_llama, "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    os.makedirs(tmp_path / "tied")
    save_file(tensors, str(tmp_path / "tied" / "model.safetensors"))
    drv = Driver(EngineCore(llm.llm_engine))
    drv.call(1, "update_weights_from_path", str(tmp_path / "tied"))
    drv.until(lambda: 1 in drv.results)
    ok, (err, msg) = drv.results[1]
    assert not ok and "tied" in msg, msg
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(tmp_path / "tied" / "model.safetensors"))
    drv.call(2, "update_weights_from_path", str(tmp_path / "tied"))
    drv.until(lambda: 2 in drv.results)
    assert drv.results[2][0] and drv.results[2][1]["weight_version"] == 1


@pytest.mark.parametrize("replan", [False, True])
def test_sharded_checkpoint_cast_equals_fresh_load(tiny_qwen2, monkeypatch, replan):
    """Several files + index, float32 -> bfloat16 by the load rule, staged in 100-byte chunks
    and 4 KiB buckets; `replan`: the parameters 'moved' since staging, so the staged tensors
    are placed again at the pause. Either way the bits equal a fresh bf16 load."""
    from vllm.weight_sync import staging

    if replan:
        monkeypatch.setattr(staging.StagedCheckpoint, "plan_for", lambda self, model: None)
    monkeypatch.setattr(staging, "CHUNK_BYTES", 100)
    init = staging.CheckpointStaging.__init__
    monkeypatch.setattr(staging.CheckpointStaging, "__init__",
                        lambda self, *a, **kw: init(self, *a, **{**kw, "chunk_bytes": 100, "bucket_bytes": 4096}))
    llm = LLM(tiny_qwen2, device="cpu", dtype="bfloat16", max_num_seqs=2, load_format="dummy")
    fresh = param_bits(LLM(tiny_qwen2, device="cpu", dtype="bfloat16"))
    drv = Driver(EngineCore(llm.llm_engine))
    drv.call(1, "update_weights_from_path", tiny_qwen2, "device")     # on CPU "device" is host memory
    drv.until(lambda: 1 in drv.results)
    assert drv.results[1][0], drv.results[1]
    after = param_bits(llm)
    assert after.keys() == fresh.keys()
    assert all(torch.equal(after[n].view(torch.int16), fresh[n].view(torch.int16)) for n in fresh)


def test_bad_arguments_answer_at_once(old_llm, tmp_path):
    drv = Driver(EngineCore(old_llm.llm_engine))
    ok, (_, msg) = drv.call(1, "update_weights_from_path", str(tmp_path))
    assert not ok and "safetensors" in msg
    ok, (_, msg) = drv.call(2, "update_weights_from_path", str(tmp_path / "missing"))
    assert not ok and "not a directory" in msg
    shutil.copy(__file__, tmp_path / "model.safetensors")
    ok, (_, msg) = drv.call(3, "update_weights_from_path", str(tmp_path), "gpu")
    assert not ok and "staging must be one of" in msg
    assert drv.core._staging is None


def test_abort_while_staging_ends_the_thread(old_llm, new_weights):
    gate = Gate()
    core = EngineCore(old_llm.llm_engine)
    core.staging_hook = gate
    drv = Driver(core)
    drv.add("a", 12)
    drv.call(1, "update_weights_from_path", new_weights)
    assert gate.entered.wait(60)
    ok, res = drv.call(2, "abort_weight_staging")       # the hook is still holding the thread
    assert ok and res["aborted"] is True
    ok, (_, msg) = drv.results[1]
    assert not ok and "cancelled while staging" in msg and "aborted by the caller" in msg
    assert not gate.threads[0].is_alive()
    assert drv.call(3, "abort_weight_staging") == (True, {"aborted": False, "weight_version": 0})
    drv.until(lambda: "a" in drv.finished)
    assert drv.versions["a"] == [0] and old_llm.llm_engine.weight_version == 0


def test_other_updates_wait_for_a_staging_checkpoint(old_llm, new_weights):
    """A checkpoint being staged is written when it ends, after any update that lands
    meanwhile, which it would overwrite: the IPC, group and four-phase updates (and TRL's
    per-tensor one) are refused while it stages, naming it; nothing changes."""
    from vllm.weight_sync.ipc import IpcExport
    gate = Gate()
    core = EngineCore(old_llm.llm_engine)
    core.staging_hook = gate
    drv = Driver(core)
    drv.call(1, "update_weights_from_path", new_weights)
    assert gate.entered.wait(60)
    tensors = dict(load_file(sorted(glob.glob(f"{new_weights}/*.safetensors"))[0]))
    ipc = IpcExport(list(tensors.items()))
    try:
        for call_id, (method, args) in enumerate([
                ("update_weights_from_ipc", ({"buckets": ipc.message()},)),
                ("weight_transfer", ("start",)),
                ("weight_transfer", ("check_trl", "model.norm.weight", "float32", [64]))], start=2):
            ok, (kind, msg) = drv.call(call_id, method, *args)
            assert not ok and kind == "ValueError" and "being staged" in msg and new_weights in msg, msg
    finally:
        ipc.release()
    assert old_llm.llm_engine.weight_version == 0 and old_llm.llm_engine.weight_update is None
    ok, res = drv.call(9, "abort_weight_staging")
    assert ok and res["aborted"] is True and old_llm.llm_engine.weight_version == 0


def test_shutdown_while_staging_ends_the_thread(old_llm, new_weights):
    gate = Gate()
    core = EngineCore(old_llm.llm_engine)
    core.staging_hook = gate
    cmd_r, cmd_w = Pipe(duplex=False)
    out_r, out_w = Pipe(duplex=False)
    loop = threading.Thread(target=core.run, args=(cmd_r, out_w), daemon=True)
    loop.start()
    cmd_w.send_bytes(pickle.dumps([UtilityCall(1, "update_weights_from_path", (new_weights,))]))
    assert gate.entered.wait(60)
    cmd_w.send_bytes(pickle.dumps([UtilityCall(2, "shutdown", ())]))
    loop.join(60)
    assert not loop.is_alive() and not gate.threads[0].is_alive()
    results = {}
    while out_r.poll(1):
        results.update({r.call_id: r for r in pickle.loads(out_r.recv_bytes()).utility_results})
    assert results[2].ok
    assert not results[1].ok and "engine shut down" in results[1].value[1]
    assert old_llm.llm_engine.weight_version == 0 and not old_llm.llm_engine.paused


def test_host_pool_pins_once_and_reuses():
    """Host staging memory is page-locked once per buffer and kept: the next update of the
    same layout takes the same buffers without pinning again; only the pool's own buffers
    are taken back, once each."""
    from vllm.weight_sync.staging import HostPool
    calls = []
    pool = HostPool(round_bytes=1 << 10, page_lock=lambda buf: calls.append(buf.numel()))
    a, b = pool.take(3000), pool.take(1 << 10)
    assert (a.numel(), b.numel()) == (3 << 10, 1 << 10)        # rounded up
    assert calls == [3 << 10, 1 << 10]
    pool.give([a, b, torch.empty(5, dtype=torch.uint8)])        # a stranger is not kept
    assert pool.free_bytes == 4 << 10
    assert pool.take(900).data_ptr() == b.data_ptr()             # the smallest that fits
    assert pool.take(3 << 10).data_ptr() == a.data_ptr()
    assert len(calls) == 2 and pool.free_bytes == 0              # no second pinning
    pool.give([a]); pool.give([a])                               # given twice: kept once
    assert pool.free_bytes == 3 << 10


def test_cancel_while_allocating_gives_host_buffers_back(monkeypatch):
    """A staging cancelled between two host-buffer allocations gives the page-locked buffers it
    already took back to the pool (registered memory is never freed: a buffer left out of the
    pool would stay pinned and unused for the life of the process)."""
    from vllm.weight_sync import staging as st
    pool = st.HostPool(round_bytes=1 << 10, page_lock=lambda buf: None)
    monkeypatch.setattr(st, "HOST_POOL", pool)
    layouts = st.plan_buckets([(f"w{i}", "bfloat16", (1024,)) for i in range(3)], 2048)
    assert len(layouts) == 3
    job = st.CheckpointStaging.__new__(st.CheckpointStaging)
    job.device, job.staging, job.chunk_bytes, job.device_bytes = torch.device("cuda"), "host", 1 << 20, 0
    job._cancel = threading.Event()
    take = pool.take

    def take_then_cancel(n):
        buf = take(n)
        if len(pool._all) == 2:
            job.cancel("aborted")
        return buf
    monkeypatch.setattr(pool, "take", take_then_cancel)
    with pytest.raises(st._Cancelled):
        job._allocate(layouts)
    assert len(pool._all) == 2 and pool.free_bytes == 2 * 2048     # both back, none stranded


def test_an_abort_or_a_stop_sends_the_new_stats_without_a_step(tiny_qwen3):
    """A request freed by an abort or by a client-found stop string ends without an engine
    step: the core still sends the new counts, so the server's /metrics gauges (running,
    KV usage) do not keep a phantom request on an idle server."""
    from vllm.engine.core_messages import AbortRequest, StopChild
    llm = LLM(tiny_qwen3, device="cpu", max_num_seqs=4)
    core = EngineCore(llm.llm_engine)
    for rid in ("a", "b"):
        core.handle(AddRequest(rid, [5, 6, 7, 8], SamplingParams(max_tokens=50, ignore_eos=True, detokenize=False)))
    core.step()
    assert core.take_outputs().stats.num_running == 2
    core.handle(AbortRequest("a"))
    out = core.take_outputs()
    assert out is not None and not out.deltas and out.stats.num_running == 1
    core.handle(StopChild("b", 0, "stop"))
    out = core.take_outputs()
    assert out is not None and out.stats.num_running == 0 and out.stats.kv_usage == 0.0
    assert core.take_outputs() is None   # nothing new: nothing sent
