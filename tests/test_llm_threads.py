"""LLM's engine lock: a method that steps or changes the engine, called from another thread
while a generate runs, waits for it (and a generate waits for them); a weight_update block
holds the lock for the whole block without deadlocking its own thread.

No test sleeps or measures time: a generate is held inside its first step on an event, and
the lock reports when another thread finds it held (`WatchedLock.contended`), so each
ordering is forced, not hoped for. Without the lock the second thread never contends: it
runs into the engine at once, and the test fails on that.
"""
from __future__ import annotations

import threading

import pytest

from vllm import LLM, SamplingParams
from vllm.model_loader.loader import checkpoint_files, iterate_weights

DEADLINE_S = 120  # only reached when something deadlocks
PROMPTS = [{"prompt_token_ids": [5, 17, 3, 99, 41]}, {"prompt_token_ids": [7, 8, 9]}]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


class WatchedLock:
    """The LLM's lock, setting `contended` when a thread finds it held and starts to wait."""

    def __init__(self, lock):
        self._lock = lock
        self.contended = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        self.contended.set()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Call(threading.Thread):
    """`fn()` on its own thread; `outcome()` joins it and returns its result or raises its error."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as err:  # noqa: BLE001 -- handed to the test thread by outcome()
            self.error = err

    def outcome(self):
        self.join(DEADLINE_S)
        assert not self.is_alive(), "deadlock: the call never returned"
        if self.error is not None:
            raise self.error
        return self.result


def watch_lock(llm) -> WatchedLock:
    llm._engine_lock = WatchedLock(llm._engine_lock)
    return llm._engine_lock


def waits_for_lock(lock: WatchedLock, call: Call) -> bool:
    """True once `call` waits for the lock; False if it returned without waiting for it."""
    call.start()
    while not lock.contended.wait(0.01):
        if not call.is_alive():
            return False
    return True


def hold_first_step(engine, events: list):
    """The engine's first step waits for `go`; `stepping` is set once it waits. Every step
    is recorded in `events`."""
    stepping, go = threading.Event(), threading.Event()
    step = engine.step

    def held_step():
        events.append("step")
        stepping.set()
        assert go.wait(DEADLINE_S)
        return step()
    engine.step = held_step
    return stepping, go


def hold_on_entry(obj, name: str, go: threading.Event) -> threading.Event:
    """`obj.name` waits for `go` on entry; the returned event is set once it waits."""
    inner, entered = getattr(obj, name), threading.Event()

    def held(*args, **kwargs):
        entered.set()
        assert go.wait(DEADLINE_S)
        return inner(*args, **kwargs)
    setattr(obj, name, held)
    return entered


def lock_is_free(llm) -> bool:
    """Another thread takes the engine lock at once (and gives it back)."""
    def take():
        if not llm._engine_lock.acquire(blocking=False):
            return False
        llm._engine_lock.release()
        return True
    taking = Call(take)
    taking.start()
    return taking.outcome()


@pytest.fixture(scope="module")
def new_state(new_weights):
    return dict(iterate_weights(checkpoint_files(new_weights)))


@pytest.fixture
def llm(tiny_qwen3):
    return LLM(tiny_qwen3, device="cpu", enable_sleep_mode=True, cpu_kv_cache_bytes=4 << 20, block_size=8)


def _generate(llm):
    return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


# what another thread calls while a generate runs, and what it answers once it waited for it
CHANGES = {
    "sleep": (lambda llm, state: llm.sleep(level=2), lambda r: r > 0),
    "wake_up": (lambda llm, state: llm.wake_up(), lambda r: r is None),
    "reset_prefix_cache": (lambda llm, state: llm.reset_prefix_cache(), lambda r: r is True),
    "update_weights": (lambda llm, state: llm.update_weights(state), lambda r: r == 1),
    "update_weights_from_ipc": (lambda llm, state: _ipc_update(llm, state), lambda r: r == 1),
    "weight_update": (lambda llm, state: _bucketed_update(llm, state), lambda r: r == 1),
    "start_weight_update": (lambda llm, state: _four_phase_update(llm, state), lambda r: r == 1),
    "collective_rpc": (lambda llm, state: llm.collective_rpc(lambda worker: llm.llm_engine.has_unfinished_requests()),
                       lambda r: r == [False]),
}


def _bucketed_update(llm, state):
    with llm.weight_update() as update:
        update.load(state)
    return llm.weight_version


def _four_phase_update(llm, state):
    llm.start_weight_update()
    llm.update_weights(state)
    return llm.finish_weight_update(weight_version="step-1")


def _ipc_update(llm, state):
    from vllm.weight_sync.ipc import IpcExport
    export = IpcExport(list(state.items()))
    try:
        return llm.update_weights_from_ipc(export.message())
    finally:
        export.release()


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_from_another_thread_waits_for_the_running_generate(llm, new_state, change):
    call, answered = CHANGES[change]
    events: list = []
    lock = watch_lock(llm)
    stepping, go = hold_first_step(llm.llm_engine, events)
    generating = Call(lambda: _generate(llm))
    generating.start()
    assert stepping.wait(DEADLINE_S)
    changing = Call(lambda: call(llm, new_state))
    assert waits_for_lock(lock, changing), f"{change} ran into the engine while a generate was stepping"
    go.set()
    outs = generating.outcome()
    assert answered(changing.outcome())
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    assert all(o.outputs[0].weight_versions == [0] for o in outs)   # no step ran under new weights


def test_a_generate_from_another_thread_waits_for_sleep(llm):
    lock = watch_lock(llm)
    go = threading.Event()
    entered = hold_on_entry(llm.llm_engine, "sleep", go)   # sleep stops in the engine, holding the lock
    sleeping = Call(llm.sleep)
    sleeping.start()
    assert entered.wait(DEADLINE_S)
    generating = Call(lambda: _generate(llm))
    assert waits_for_lock(lock, generating), "a generate stepped while another thread put the engine to sleep"
    go.set()
    assert sleeping.outcome() > 0
    with pytest.raises(ValueError, match="asleep"):   # it ran after sleep, not beside it
        generating.outcome()


def test_a_generate_from_another_thread_waits_for_update_weights(llm, new_state):
    lock = watch_lock(llm)
    go = threading.Event()
    # the update stops after writing, before its version counts, holding the lock
    entered = hold_on_entry(llm.llm_engine, "on_weights_updated", go)
    updating = Call(lambda: llm.update_weights(new_state))
    updating.start()
    assert entered.wait(DEADLINE_S)
    generating = Call(lambda: _generate(llm))
    assert waits_for_lock(lock, generating), "a generate stepped while another thread updated the weights"
    go.set()
    assert updating.outcome() == 1
    assert all(o.outputs[0].weight_versions == [1] for o in generating.outcome())


def test_weight_update_block_holds_the_lock_until_it_closes(llm, new_state):
    lock = watch_lock(llm)
    opened, go = threading.Event(), threading.Event()

    def bucketed():
        with llm.weight_update() as update:
            opened.set()
            assert go.wait(DEADLINE_S)
            update.load(new_state)
        return llm.weight_version
    updating = Call(bucketed)
    updating.start()
    assert opened.wait(DEADLINE_S)
    generating = Call(lambda: _generate(llm))
    # between two buckets another thread's generate waits (it used to be refused)
    assert waits_for_lock(lock, generating)
    go.set()
    assert updating.outcome() == 1
    assert all(o.outputs[0].weight_versions == [1] for o in generating.outcome())


def test_generate_inside_the_block_on_its_own_thread_is_refused_not_deadlocked(llm, new_state):
    def inside():
        with llm.weight_update() as update:
            update.load(new_state)
            with pytest.raises(ValueError, match="weight update is open"):
                _generate(llm)
        return _generate(llm)
    outs = Call(inside)
    outs.start()
    assert all(o.outputs[0].weight_versions == [1] for o in outs.outcome())


@pytest.mark.parametrize("close", ["finish", "abort", "failed_bucket"])
def test_weight_update_gives_the_lock_back_however_it_closes(llm, new_state, close):
    update = llm.weight_update()
    if close == "finish":
        update.load(new_state)
        assert update.finish() == 1
    elif close == "abort":
        update.abort()
    else:
        with pytest.raises(ValueError):
            update.load({"no.such.weight": next(iter(new_state.values()))})
    assert update.closed
    assert lock_is_free(llm)


def test_a_second_update_on_the_same_thread_is_refused_and_keeps_the_first_open(llm, new_state):
    with llm.weight_update() as update:
        with pytest.raises(ValueError, match="another weight update is open"):
            llm.weight_update()
        update.load(new_state)
    assert llm.weight_version == 1
    assert lock_is_free(llm)


def test_collective_rpc_timeout_bounds_the_wait_for_the_lock(llm):
    events: list = []
    stepping, go = hold_first_step(llm.llm_engine, events)
    generating = Call(lambda: _generate(llm))
    generating.start()
    assert stepping.wait(DEADLINE_S)
    with pytest.raises(TimeoutError, match="busy"):
        llm.collective_rpc("get_model", timeout=0.05)
    go.set()
    generating.outcome()
    assert llm.collective_rpc("get_model", timeout=DEADLINE_S) == [llm.llm_engine.executor.model]


def _attached_optimizer(llm):
    """An SGD over `llm.policy()`, attached, with a gradient on every parameter."""
    import torch
    policy = llm.policy()
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    policy.attach_optimizer(opt)
    for p in policy.parameters():
        p.grad = torch.full_like(p, 1e-3)
    return opt


def test_an_optimizer_step_from_another_thread_waits_for_the_running_generate(llm):
    """The step holds the engine lock: it waits for the generate instead of being refused
    because requests are running (or writing between two of its steps)."""
    lock = watch_lock(llm)
    opt = _attached_optimizer(llm)
    stepping, go = hold_first_step(llm.llm_engine, [])
    generating = Call(lambda: _generate(llm))
    generating.start()
    assert stepping.wait(DEADLINE_S)
    optimizing = Call(opt.step)
    assert waits_for_lock(lock, optimizing), "the optimizer step ran into the engine while a generate was stepping"
    go.set()
    assert all(o.outputs[0].weight_versions == [0] for o in generating.outcome())
    optimizing.outcome()
    assert llm.weight_version == 1


def test_a_generate_from_another_thread_waits_for_an_optimizer_step(llm):
    """From the step's check to its bookkeeping another thread's generate waits: it never
    steps on weights the optimizer is writing, nor under a version not yet counted."""
    lock = watch_lock(llm)
    opt = _attached_optimizer(llm)
    go, entered = threading.Event(), threading.Event()

    def held(*_):   # inside the step: after the engine's check, before any parameter is written
        entered.set()
        assert go.wait(DEADLINE_S)
    opt.register_step_pre_hook(held)
    optimizing = Call(opt.step)
    optimizing.start()
    assert entered.wait(DEADLINE_S)
    generating = Call(lambda: _generate(llm))
    assert waits_for_lock(lock, generating), "a generate stepped while another thread's optimizer step was writing"
    go.set()
    optimizing.outcome()
    assert all(o.outputs[0].weight_versions == [1] for o in generating.outcome())


def test_an_optimizer_step_that_raises_gives_the_lock_back_and_counts_a_version(llm):
    """torch runs no step post hook when the step raises; the wrapped step still gives the
    lock back, and counts a version (the step may have written some parameters)."""
    opt = _attached_optimizer(llm)

    def fails(*_):
        raise RuntimeError("from inside the step")
    opt.register_step_pre_hook(fails)
    with pytest.raises(RuntimeError, match="from inside the step"):
        opt.step()
    assert lock_is_free(llm)
    assert llm.weight_version == 1
    assert all(o.outputs[0].weight_versions == [1] for o in _generate(llm))


def test_policy_forward_beside_a_generate_on_another_thread(tiny_qwen3):
    """The forward context is per thread: a Policy's token_logprobs on this thread while
    another thread generates gives both their bits (one process-wide context was overwritten
    by the other call: 'no forward context is set', or an engine step read the trainer's
    metadata)."""
    import torch

    llm = LLM(tiny_qwen3, device="cpu", cpu_kv_cache_bytes=4 << 20, block_size=8)
    policy = llm.policy()
    seqs = [p["prompt_token_ids"] + [7, 8, 9, 10] for p in PROMPTS]
    plens = [len(p["prompt_token_ids"]) for p in PROMPTS]
    with torch.no_grad():
        ref = [t.view(torch.int32).clone() for t in policy.token_logprobs(seqs, plens)]
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    stop, errors, rollouts = threading.Event(), [], []

    def generate():
        try:
            while not stop.is_set():
                rollouts.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)])
        except Exception as err:  # noqa: BLE001 -- reported below
            errors.append(err)
    thread = threading.Thread(target=generate)
    thread.start()
    try:
        got = []
        for _ in range(4):
            with torch.no_grad():
                got.append([t.view(torch.int32) for t in policy.token_logprobs(seqs, plens)])
    finally:
        stop.set()
        thread.join(DEADLINE_S)
    assert not errors, errors
    assert rollouts and all(r == want for r in rollouts)
    assert all(torch.equal(a, b) for g in got for a, b in zip(g, ref))
