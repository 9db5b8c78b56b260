"""The real Scheduler and KVCacheManager against a simulated runner whose KV carries the
whole prefix: the KV of position p is H(KV of p - 1, token p), written to and read back
from the paged cache through the block table, and the next token is a function of the
last KV. So a wrong prefix-cache hit, a block overwritten while in use or a wrong slot
changes the tokens that follow. Random block sizes, tight block pools (preemption),
chunked prefill with long-prefill thresholds, n > 1 groups, aborts, eos, both policies,
synchronous and async scheduling, `reset_prefix_cache(allow_in_use=True)` mid-run and
colliding block hashes; the tokens must equal the reference chain's and every block must
come back."""
from __future__ import annotations

import hashlib
import random

import pytest

from vllm.config import SchedulerConfig
from vllm.core import kv_cache_manager
from vllm.core.kv_cache_manager import KVCacheManager
from vllm.core.messages import ModelRunnerOutput, SampledToken
from vllm.core.request import PLACEHOLDER, Request, RequestStatus
from vllm.core.scheduler import Scheduler
from vllm.sampling_params import SamplingParams

VOCAB, EOS = 50, 2


def _h(prev, tok) -> int:
    return int.from_bytes(hashlib.blake2b(f"{prev}:{tok}".encode(), digest_size=8).digest(), "little")


def _next_token(kv: int, seed: int, index: int) -> int:
    return 3 + _h(kv, (seed, index)) % (VOCAB - 3) if _h(kv, "eos") % 23 else EOS


def _reference(prompt, seed, max_tokens, ignore_eos, max_len) -> list[int]:
    kv = 0
    for t in prompt:
        kv = _h(kv, t)
    out = []
    while True:
        t = _next_token(kv, seed, len(out))
        out.append(t)
        if (t == EOS and not ignore_eos) or len(out) >= min(max_tokens, max_len - len(prompt)):
            return out
        kv = _h(kv, t)


class _Runner:
    """Writes each scheduled token's KV into its slot and samples from the last one. With
    recurrent states, a request's state slot carries the same chain value: loaded from a
    snapshot slot before the step (checked against the prompt's chain there), advanced by
    the step's tokens (checked against the KV), saved into a snapshot slot after it."""

    def __init__(self, block_size: int, prompts: dict[str, list[int]]):
        self.cache: dict[int, int] = {}
        self.bs = block_size
        self.prompts = prompts
        self.states: dict[int, int] = {}
        self.loads = 0

    def launch(self, out, placeholders: dict[str, int], recurrent: bool = False) -> dict[str, int]:
        if recurrent:   # every load of the step before any save, as the model runner orders them
            for sr in out.requests:
                if sr.state_load >= 0:
                    ref = 0
                    for t in self.prompts[sr.req_id][:sr.num_computed]:
                        ref = _h(ref, t)
                    assert self.states[sr.state_load] == ref, (sr.req_id, sr.num_computed)
                    self.states[sr.state_slot] = self.states[sr.state_load]
                    self.loads += 1
                elif sr.num_computed == 0:
                    self.states[sr.state_slot] = 0
        sampled = {}
        for sr in out.requests:
            toks = list(sr.token_ids)
            if toks and toks[-1] == PLACEHOLDER:
                toks[-1] = placeholders[sr.req_id]
            assert PLACEHOLDER not in toks

            def slot(p, sr=sr):
                return sr.block_table[p // self.bs] * self.bs + p % self.bs
            kv = self.cache[slot(sr.num_computed - 1)] if sr.num_computed > 0 else 0
            if recurrent:
                assert self.states[sr.state_slot] == kv, sr.req_id
            for j, t in enumerate(toks):
                kv = _h(kv, t)
                self.cache[slot(sr.num_computed + j)] = kv
            if recurrent:
                self.states[sr.state_slot] = kv
            if sr.sample:
                sampled[sr.req_id] = _next_token(kv, sr.seed, sr.output_index)
        if recurrent:
            for sr in out.requests:
                if sr.state_save >= 0:
                    self.states[sr.state_save] = self.states[sr.state_slot]
        return sampled


def _run(seed: int, async_mode: bool, policy: str, resets: bool, recurrent: bool = False) -> int:
    from vllm.core.state_slots import StateSlots

    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    max_len = rng.choice([16, 40, 64])
    per_seq = -(-max_len // bs)
    max_seqs = rng.randint(1, 6)
    state = StateSlots(max_seqs + 1, rng.choice([0, 1, 2, 4]), rng.choice([2, 4, 8])) if recurrent else None
    kv = KVCacheManager(rng.randint(per_seq + 1, 3 * per_seq + 2), bs, enable_prefix_caching=rng.random() < 0.8,
                        state=state)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, enable_chunked_prefill=True, scheduling_policy=policy,
                          max_num_batched_tokens=rng.choice([max_len, max_len + 7, 2 * max_len]))
    if rng.random() < 0.3:
        cfg.long_prefill_token_threshold = rng.randint(1, 9)
    prompts: dict[str, list[int]] = {}
    sched, runner = Scheduler(cfg, kv), _Runner(bs, prompts)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, max_len))] for _ in range(3)]
    expected, reqs, aborted = {}, {}, set()
    inflight, added = None, 0

    def step():
        nonlocal inflight
        if not async_mode:
            out = sched.schedule()
            if out.requests:
                sampled = runner.launch(out, {}, recurrent)
                sched.update(out, ModelRunnerOutput({k: SampledToken(v) for k, v in sampled.items()}))
            return
        prev, inflight = inflight, None
        if prev is not None:
            sched.advance(prev[0])
        out = sched.schedule()
        if out.requests:
            inflight = (out, runner.launch(out, prev[1] if prev is not None else {}, recurrent))
        if prev is not None:
            sched.finalize(prev[0], ModelRunnerOutput({k: SampledToken(v) for k, v in prev[1].items()}))

    for _ in range(300):
        if rng.random() < 0.3 and added < 25:
            n_prompt = rng.randint(1, max_len - 1)
            prompt = (rng.choice(prefixes) + [rng.randrange(3, VOCAB) for _ in range(max_len)])[:n_prompt]
            if rng.random() < 0.3:
                prompt = prompt[:max(1, n_prompt // bs * bs)]   # whole blocks
            sp = SamplingParams(max_tokens=rng.randint(1, max_len), ignore_eos=rng.random() < 0.5,
                                n=rng.choice([1, 1, 1, 2, 3]))
            leader = None
            for i in range(sp.n):
                rid, s = f"r{added}#{i}", rng.randrange(1000)
                r = Request(rid, prompt, sp, seed=s, eos_token_ids=[EOS], max_model_len=max_len, leader=leader,
                            priority=rng.randint(-2, 2) if policy == "priority" else 0)
                leader = leader or r
                sched.add_request(r)
                reqs[rid] = r
                prompts[rid] = prompt
                expected[rid] = _reference(prompt, s, sp.max_tokens, sp.ignore_eos, max_len)
            added += 1
        if rng.random() < 0.05 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            aborted.add(rid)
        if resets and rng.random() < 0.03:
            kv.reset_prefix_cache(allow_in_use=True)
        step()
        kv.check_invariants()
    for _ in range(2000):
        if not sched.has_unfinished() and inflight is None:
            break
        step()
        kv.check_invariants()
    assert not sched.has_unfinished()
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"
    for rid, r in reqs.items():
        if rid not in aborted:
            assert r.output_token_ids == expected[rid], (seed, rid, r.num_preemptions)
    return runner.loads if recurrent else sched.num_preemptions


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_schedules_give_the_reference_tokens(async_mode, policy):
    assert sum(_run(seed, async_mode, policy, resets=seed % 2 == 1) for seed in range(16)) > 0  # preemption ran


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
def test_recurrent_state_snapshots_restore_the_prompts_chain(async_mode):
    """Hybrid models: snapshot slots (0, 1, 2 or 4 of them) saved at the grid points a prefill
    stops on (its last one, and where it leaves the cached KV it was admitted with) and
    restored by hits; every restored state equals the prompt's chain at that position."""
    loads = sum(_run(seed, async_mode, "fcfs", resets=seed % 3 == 2, recurrent=True) for seed in range(30))
    assert loads > 0


def test_colliding_block_hashes_never_hand_out_a_wrong_block(monkeypatch):
    """With five hash values for every block, lookups collide constantly: the stored
    tokens, the parent's serial and the salt must still refuse every wrong hit."""
    monkeypatch.setattr(kv_cache_manager, "hash_block_tokens", lambda parent, tokens: hash((parent, tokens)) % 5)
    monkeypatch.setattr(kv_cache_manager, "chain_root_hash", lambda salt: None if salt is None else 1)
    for seed in range(12):
        for async_mode in (False, True):
            _run(seed, async_mode, "fcfs", resets=False)
