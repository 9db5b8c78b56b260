"""Scheduler unit tests with the real block manager and a stand-in runner."""
from __future__ import annotations

from vllm.config import SchedulerConfig
from vllm.core.kv_cache_manager import KVCacheManager
from vllm.core.messages import ModelRunnerOutput, SampledToken
import pytest

from vllm.core.request import Request, RequestStatus, check_priority
from vllm.core.scheduler import Scheduler
from vllm.sampling_params import SamplingParams


def make(num_blocks=64, budget=32, max_seqs=8, chunked=True, block_size=4, caching=True, policy="fcfs"):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                                     scheduling_policy=policy), kv), kv


def req(rid, n, max_tokens=4, leader=None, prompt=None, priority=0, **kw):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)
    return Request(rid, prompt or list(range(100, 100 + n)), sp, seed=1, eos_token_ids=[2], max_model_len=1000, leader=leader,
                   priority=priority)


def run_step(s, token=7):
    out = s.schedule()
    res = ModelRunnerOutput({r.req_id: SampledToken(token) for r in out.requests if r.sample})
    return out, s.update(out, res)


def test_chunked_prefill_spans_steps_and_shares_budget():
    s, kv = make(budget=10)
    a = req("a", 23)
    s.add_request(a)
    chunks = []
    for _ in range(3):
        out, _ = run_step(s)
        chunks.append([(r.req_id, r.num_computed, r.num_new, r.sample) for r in out.requests])
    assert chunks == [[("a", 0, 10, False)], [("a", 10, 10, False)], [("a", 20, 3, True)]]
    assert a.output_token_ids == [7]
    # a second request's prefill shares the budget with a's decode
    s.add_request(req("b", 30))
    out, _ = run_step(s)
    assert [(r.req_id, r.num_new) for r in out.requests] == [("a", 1), ("b", 9)]
    assert out.num_batched_tokens == 10


def test_no_chunking_waits_for_room():
    s, _ = make(budget=16, chunked=False)
    s.add_request(req("a", 12))
    s.add_request(req("b", 12))
    out, _ = run_step(s)
    assert [r.req_id for r in out.requests] == ["a"]  # b does not fit whole next to a


def test_preemption_by_recompute_frees_and_resumes():
    # 8 usable blocks of 4 tokens: two 14-token requests fit, their growth does not
    s, kv = make(num_blocks=9, budget=64)
    # different prompts: identical ones would share their blocks (b waits for a's, then reuses them)
    a, b = req("a", 14, max_tokens=6), req("b", 14, max_tokens=6, prompt=list(range(300, 314)))
    s.add_request(a)
    s.add_request(b)
    assert a.scheduled_time is None and b.scheduled_time is None
    seen_preempt = False
    first_scheduled = {}
    for _ in range(40):
        if not s.has_unfinished():
            break
        out, _ = run_step(s)
        seen_preempt |= bool(out.preempted)
        # the first admission's time, kept when a preempted request is admitted again
        for r in (a, b):
            if r.scheduled_time is not None:
                assert r.scheduled_time == first_scheduled.setdefault(r.req_id, r.scheduled_time) >= r.arrival_time
        if out.preempted:
            assert out.preempted == ["b"]  # the latest arrival goes first
            assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
        kv.check_invariants()
    assert seen_preempt and s.num_preemptions >= 1 and first_scheduled.keys() == {"a", "b"}
    assert len(a.output_token_ids) == 6 and len(b.output_token_ids) == 6
    assert kv.num_free_blocks == kv.num_blocks - 1


def test_n_samples_wait_for_leader_then_hit_cache():
    s, kv = make(budget=64)
    lead = req("p#0", 20)
    follow = req("p#1", 20, leader=lead)
    s.add_request(lead)
    s.add_request(follow)
    out, _ = run_step(s)
    assert [r.req_id for r in out.requests] == ["p#0"]  # follower waits for the leader's prompt
    out, _ = run_step(s)
    ids = {r.req_id: r for r in out.requests}
    assert ids["p#1"].num_computed == 16  # four full prompt blocks of the leader reused
    assert follow.num_cached_tokens == 16


def test_abort_frees_blocks_and_unknown_ids_are_ignored():
    s, kv = make()
    a = req("a", 10, max_tokens=100)
    s.add_request(a)
    run_step(s)
    assert kv.num_free_blocks < kv.num_blocks - 1
    done = s.finish_requests(["a", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.req_id for r in done] == ["a"] and a.status == RequestStatus.FINISHED_ABORTED
    assert kv.num_free_blocks == kv.num_blocks - 1 and not s.has_unfinished()


def test_other_eos_ids_report_themselves_as_stop_reason():
    """The main EOS (the first id: the tokenizer's) stops with stop_reason None; the other ids
    (generation_config's, e.g. Llama 3.1's <|eom_id|>) with their id, as upstream's stop tokens."""
    for token, reason in ((2, None), (7, 7)):
        r = Request("r", [1, 2, 3], SamplingParams(max_tokens=5), 1, [2, 7], 1000)
        r.output_token_ids.append(token)
        assert r.check_token_stop() == RequestStatus.FINISHED_STOPPED and r.stop_reason == reason


def test_token_stop_rules():
    s, _ = make()
    a = req("a", 5, max_tokens=10, stop_token_ids=[9])
    s.add_request(a)
    run_step(s, token=9)
    assert a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason == 9
    b = req("b", 5, max_tokens=2)
    s.add_request(b)
    run_step(s)
    run_step(s)
    assert b.status == RequestStatus.FINISHED_LENGTH and len(b.output_token_ids) == 2
    c = Request("c", [1, 2, 3], SamplingParams(max_tokens=5, min_tokens=2), 1, [2], 1000)
    s.add_request(c)
    out = s.schedule()
    assert out.requests[0].banned_token_ids == (2,)  # eos masked until min_tokens
    s.update(out, ModelRunnerOutput({"c": SampledToken(5)}))
    out = s.schedule()
    s.update(out, ModelRunnerOutput({"c": SampledToken(2)}))
    assert c.status == RequestStatus.FINISHED_STOPPED and len(c.output_token_ids) == 2


def test_max_num_seqs_caps_running():
    s, _ = make(max_seqs=3, budget=1000)
    for i in range(5):
        s.add_request(req(str(i), 6, prompt=list(range(200 + 10 * i, 206 + 10 * i))))
    out, _ = run_step(s)
    assert len(out.requests) == 3 and len(s.waiting) == 2


def test_a_prefix_being_computed_is_waited_for_then_reused():
    """Prompts sharing a prefix, admitted together: the first computes it; the others wait
    until its blocks are cached, then reuse them (not the same KV computed twice in one step).
    An unrelated prompt is admitted at once; without prefix caching nobody waits."""
    shared = list(range(500, 512))                       # 3 blocks of 4
    s, kv = make(budget=64)
    a, b, c = req("a", 0, prompt=shared + [1, 2, 3, 4, 5]), req("b", 0, prompt=shared + [9, 8, 7]), \
        req("c", 0, prompt=list(range(600, 610)))
    d = req("d", 0, prompt=shared[:8] + [42, 43, 44, 45, 46])   # shares 2 of the blocks
    for r in (a, b, c, d):
        s.add_request(r)
    out, _ = run_step(s)
    assert [(r.req_id, r.num_computed) for r in out.requests] == [("a", 0), ("c", 0)]
    out, _ = run_step(s)
    assert [(r.req_id, r.num_computed) for r in out.requests if r.req_id in "bd"] == [("b", 12), ("d", 8)]
    assert b.num_cached_tokens == 12 and d.num_cached_tokens == 8
    kv.check_invariants()

    # chunked: the waiting request is admitted once the shared blocks are cached, even though
    # the first one's prefill goes on
    s, kv = make(budget=8)
    a, b = req("a", 0, prompt=shared + [1, 2]), req("b", 0, prompt=shared[:8] + [1, 2])
    s.add_request(a)
    s.add_request(b)
    steps = [[(r.req_id, r.num_computed, r.num_new) for r in run_step(s)[0].requests] for _ in range(2)]
    assert steps == [[("a", 0, 8)], [("a", 8, 6), ("b", 8, 2)]]

    # the request computing the prefix goes (aborted / preempted): the other stops waiting
    s, kv = make(budget=64)
    a, b = req("a", 0, prompt=shared + [1, 2]), req("b", 0, prompt=shared + [3, 4])
    s.add_request(a)
    out = s.schedule()
    kv.free("a")
    s.add_request(b)
    assert "b" in [r.req_id for r in s.schedule().requests]

    s, _ = make(budget=64, caching=False)
    for r in (req("a", 0, prompt=shared + [1]), req("b", 0, prompt=shared + [2])):
        s.add_request(r)
    assert [r.req_id for r in run_step(s)[0].requests] == ["a", "b"]


# ---- scheduling_policy ------------------------------------------------------------------

def _admission_order(s, limit=50) -> list[str]:
    """The ids in the order the scheduler first gives each request a slice."""
    order: list[str] = []
    for _ in range(limit):
        if not s.has_unfinished():
            break
        out, _ = run_step(s)
        order += [r.req_id for r in out.requests if r.req_id not in order]
    assert not s.has_unfinished()
    return order


def test_priority_policy_admits_by_priority_then_arrival():
    prios = {"a": 0, "b": 2, "c": -1, "d": 2, "e": 0, "f": 1}
    s, kv = make(max_seqs=1, budget=64, policy="priority")
    for i, (rid, p) in enumerate(prios.items()):
        s.add_request(req(rid, 6, max_tokens=2, priority=p, prompt=list(range(200 + 10 * i, 206 + 10 * i))))
    assert [r.req_id for r in s.waiting] == ["c", "a", "e", "f", "b", "d"]
    # an abort takes a request out of the middle and keeps the others' order
    s.finish_requests(["f"], RequestStatus.FINISHED_ABORTED)
    assert [r.req_id for r in s.waiting] == ["c", "a", "e", "b", "d"]
    assert _admission_order(s) == ["c", "a", "e", "b", "d"]
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks - 1
    # fcfs: arrival order, whatever ran before
    s, _ = make(max_seqs=1, budget=64)
    for rid in "cbad":
        s.add_request(req(rid, 6, max_tokens=2))
    assert _admission_order(s) == ["c", "b", "a", "d"]


def test_priority_policy_orders_a_late_arrival_before_waiting_lower_priorities():
    s, _ = make(max_seqs=1, budget=64, policy="priority")
    s.add_request(req("low", 6, max_tokens=3, priority=5, prompt=list(range(200, 206))))
    s.add_request(req("mid", 6, max_tokens=3, priority=1, prompt=list(range(300, 306))))
    run_step(s)          # mid runs (the one seat); low waits
    s.add_request(req("high", 6, max_tokens=3, priority=0, prompt=list(range(400, 406))))
    assert [r.req_id for r in s.running] == ["mid"] and [r.req_id for r in s.waiting] == ["high", "low"]
    assert _admission_order(s) == ["mid", "high", "low"]


def _distinct(rid, start, n, priority=0, max_tokens=10):
    return req(rid, n, max_tokens=max_tokens, priority=priority, prompt=list(range(start, start + n)))


def test_priority_preemption_takes_the_largest_priority_even_if_it_already_has_a_slice():
    """5 usable blocks of 4 tokens: `a` (priority 1) is admitted alone, then b and c (priority 0);
    a step later b needs a block that is not there. fcfs preempts c, the latest admitted; priority
    preempts a, which was given its slice earlier in the same step: the slice is dropped, its token
    goes back to the budget, and a waits at its (priority, arrival) place, behind a later arrival of
    a smaller priority."""
    victims = {}
    for policy, a_priority in (("fcfs", 0), ("priority", 1)):
        s, kv = make(num_blocks=7, budget=64, policy=policy)
        a = _distinct("a", 200, 6, a_priority)
        s.add_request(a)
        run_step(s)
        s.add_request(_distinct("b", 300, 8))
        s.add_request(_distinct("c", 400, 8))
        run_step(s)
        assert [r.req_id for r in s.running] == ["a", "b", "c"] and kv.num_free_blocks == 0
        out, _ = run_step(s)
        victims[policy] = out.preempted
        kv.check_invariants()
        if policy == "priority":
            assert [r.req_id for r in out.requests] == ["b", "c"] and out.num_batched_tokens == 2
            assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0 and a.num_preemptions == 1
            s.add_request(_distinct("d", 500, 4, priority=0))
            assert [r.req_id for r in s.waiting] == ["d", "a"]   # fcfs would have put a back first
        else:
            assert [r.req_id for r in out.requests] == ["a", "b"]
        for _ in range(80):
            if not s.has_unfinished():
                break
            run_step(s)
            kv.check_invariants()
        assert not s.has_unfinished() and kv.num_free_blocks == kv.num_blocks - 1
    assert victims == {"fcfs": ["c"], "priority": ["a"]}


def test_priority_preemption_of_the_request_itself_still_serves_the_ones_after_it():
    """running = [x (0), y (5), z (0)], no free block, and y needs one: y is the lowest priority, so
    y itself is preempted, and z, which sorts before it, still gets its slice in the same step."""
    s, kv = make(num_blocks=6, budget=64, policy="priority")
    s.add_request(_distinct("x", 200, 4))
    s.add_request(y := _distinct("y", 300, 3, priority=5))
    run_step(s)
    s.add_request(_distinct("z", 400, 5))
    run_step(s)
    assert [r.req_id for r in s.running] == ["x", "y", "z"] and kv.num_free_blocks == 0
    assert [r.num_computed_tokens % 4 == 0 for r in s.running] == [False, True, False]   # only y needs a block
    out, _ = run_step(s)
    assert out.preempted == ["y"] and [r.req_id for r in out.requests] == ["x", "z"]
    assert y.status == RequestStatus.PREEMPTED
    kv.check_invariants()


def test_fcfs_refuses_a_nonzero_priority():
    s, _ = make()
    for p in (1, -3):
        with pytest.raises(ValueError, match=rf"Got priority {p} but Priority scheduling is not enabled"):
            s.add_request(req("a", 6, priority=p))
    assert not s.requests and not s.has_unfinished()
    s.add_request(req("a", 6, priority=0))
    assert [r.req_id for r in s.waiting] == ["a"]
    for bad in (True, 1.5, "1", None):
        with pytest.raises(ValueError, match="priority must be an integer"):
            check_priority(bad, "priority")
    assert check_priority(-7, "priority") == -7
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        SchedulerConfig(scheduling_policy="lifo")


def test_prefix_cache_stats_count_a_request_once_however_long_it_waits_for_room():
    # 6 usable blocks of 4 tokens, no chunking: b (12 tokens, 3 blocks) waits while a holds 4;
    # each step it waits looks the cache up again, which must not count again
    s, kv = make(num_blocks=7, budget=64, chunked=False)
    s.add_request(req("a", 14, max_tokens=6))
    run_step(s)
    s.add_request(req("b", 12, max_tokens=2, prompt=list(range(300, 312))))
    waited = 0
    for _ in range(20):
        out, _ = run_step(s)
        if any(r.req_id == "b" for r in out.requests):
            break
        waited += 1
    assert waited > 0, "b was meant to wait for a's blocks"
    stats = kv.stats()
    assert stats["prefix_cache_queries"] == 14 + 12
