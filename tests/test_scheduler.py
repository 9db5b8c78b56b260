"""Scheduler unit tests with the real block manager and a stand-in runner."""
from __future__ import annotations

from vllm.config import SchedulerConfig
from vllm.core.kv_cache_manager import KVCacheManager
from vllm.core.messages import ModelRunnerOutput, SampledToken
from vllm.core.request import Request, RequestStatus
from vllm.core.scheduler import Scheduler
from vllm.sampling_params import SamplingParams


def make(num_blocks=64, budget=32, max_seqs=8, chunked=True, block_size=4, caching=True):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked), kv), kv


def req(rid, n, max_tokens=4, leader=None, prompt=None, **kw):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)
    return Request(rid, prompt or list(range(100, 100 + n)), sp, seed=1, eos_token_ids=[2], max_model_len=1000, leader=leader)


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
    a, b = req("a", 14, max_tokens=6), req("b", 14, max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    seen_preempt = False
    for _ in range(40):
        if not s.has_unfinished():
            break
        out, _ = run_step(s)
        seen_preempt |= bool(out.preempted)
        if out.preempted:
            assert out.preempted == ["b"]  # the latest arrival goes first
            assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
        kv.check_invariants()
    assert seen_preempt and s.num_preemptions >= 1
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
        s.add_request(req(str(i), 6))
    out, _ = run_step(s)
    assert len(out.requests) == 3 and len(s.waiting) == 2
