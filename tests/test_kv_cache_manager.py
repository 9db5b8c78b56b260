"""Tests for the paged KV-cache manager (vllm/core/kv_cache_manager.py)."""

import random

import pytest

from vllm.core import kv_cache_manager as bm
from vllm.core.kv_cache_manager import KVCacheManager

BS = 4


def toks(*blocks, tail=()):
    """Token list from whole blocks (each an int seed -> BS distinct tokens) plus a tail."""
    out = []
    for b in blocks:
        out.extend(range(b * 100, b * 100 + BS))
    return out + list(tail)


def run_prefill(mgr, rid, prompt, cache_salt=None):
    """What the scheduler + runner do for a new request: lookup, allocate, compute, cache."""
    computed, n_computed = mgr.get_computed_blocks(prompt, cache_salt)
    ok = mgr.allocate_slots(rid, len(prompt), computed, cache_salt)
    if ok:
        mgr.cache_blocks(rid, prompt, len(prompt))
    return ok, computed, n_computed


# ------------------------------------------------------------------ basics

def test_constructor_validation():
    with pytest.raises(ValueError):
        KVCacheManager(1, BS)
    with pytest.raises(ValueError):
        KVCacheManager(8, 0)
    mgr = KVCacheManager(2, 1)
    assert mgr.num_free_blocks == 1
    assert (mgr.num_blocks, mgr.block_size, mgr.enable_prefix_caching) == (2, 1, True)


def test_allocate_and_free_no_leak():
    mgr = KVCacheManager(16, BS)
    assert mgr.num_free_blocks == 15 and mgr.usage == 0.0
    assert mgr.allocate_slots("a", 5)  # 2 blocks
    assert len(mgr.get_block_table("a")) == 2
    assert 0 not in mgr.get_block_table("a")  # null block never handed out
    assert mgr.allocate_slots("a", 8)  # still 2 blocks
    assert len(mgr.get_block_table("a")) == 2
    assert mgr.num_blocks_needed("a", 9) == 1
    assert mgr.allocate_slots("a", 9)
    assert len(mgr.get_block_table("a")) == 3
    assert mgr.allocate_slots("b", 1)
    assert mgr.num_free_blocks == 11
    assert mgr.usage == pytest.approx(4 / 15)
    mgr.check_invariants()
    mgr.free("a")
    mgr.free("b")
    mgr.free("unknown")  # no-op
    assert mgr.num_free_blocks == 15 and mgr.usage == 0.0
    assert mgr.get_block_table("a") == []
    mgr.check_invariants()


def test_all_or_nothing():
    mgr = KVCacheManager(5, BS)  # 4 usable
    assert mgr.allocate_slots("a", 3 * BS)
    before = (mgr.num_free_blocks, mgr.get_block_table("a"))
    assert not mgr.allocate_slots("a", 5 * BS)  # needs 2, only 1 free
    assert (mgr.num_free_blocks, mgr.get_block_table("a")) == before
    assert not mgr.allocate_slots("b", 2 * BS)
    assert not mgr.has_request("b") and mgr.get_block_table("b") == []
    mgr.check_invariants()
    assert mgr.allocate_slots("b", BS)
    assert mgr.num_free_blocks == 0
    mgr.check_invariants()


def test_all_or_nothing_counts_touched_blocks():
    mgr = KVCacheManager(5, BS)  # 4 usable
    p = toks(1, 2, tail=[7])
    run_prefill(mgr, "a", p)
    mgr.free("a")  # 2 cached blocks + 1 plain block, all ref 0
    assert mgr.allocate_slots("x", BS)  # takes one free block (the tail; not cached)
    computed, n = mgr.get_computed_blocks(p)
    assert n == 2 * BS
    # Needs 2 touches + 2 new = 4 > 3 free: must fail and leave the cached blocks alone.
    assert mgr.num_blocks_needed("b", 4 * BS, computed) == 4
    assert not mgr.allocate_slots("b", 4 * BS, computed)
    assert all(mgr.ref_count(b) == 0 for b in computed)
    assert mgr.get_computed_blocks(p)[0] == computed
    mgr.check_invariants()
    assert mgr.allocate_slots("b", 3 * BS, computed)
    assert mgr.get_block_table("b")[:2] == computed
    mgr.check_invariants()


def test_computed_blocks_only_on_first_call():
    mgr = KVCacheManager(8, BS)
    run_prefill(mgr, "a", toks(1, tail=[5]))
    computed, _ = mgr.get_computed_blocks(toks(1, tail=[6]))
    assert mgr.allocate_slots("b", BS + 1, computed)
    with pytest.raises(ValueError):
        mgr.allocate_slots("b", 3 * BS, computed)


# ----------------------------------------------------------- prefix caching

def test_prefix_hit_after_caching():
    mgr = KVCacheManager(16, BS)
    p1 = toks(1, 2, 3, tail=[9, 9])
    ok, computed, n = run_prefill(mgr, "a", p1)
    assert ok and computed == [] and n == 0
    table_a = mgr.get_block_table("a")
    assert mgr.num_cached_blocks == 3  # the partial tail block is not cached

    # Same 2-block prefix, different third block and tail.
    p2 = toks(1, 2, 4, tail=[8])
    computed, n = mgr.get_computed_blocks(p2)
    assert computed == table_a[:2] and n == 2 * BS
    assert mgr.allocate_slots("b", len(p2), computed)
    table_b = mgr.get_block_table("b")
    assert table_b[:2] == table_a[:2] and table_b[2] not in table_a
    mgr.cache_blocks("b", p2, len(p2))
    assert mgr.num_cached_blocks == 4

    # A different first block shares nothing, even if later blocks are equal.
    assert mgr.get_computed_blocks(toks(5, 2, 3, tail=[1])) == ([], 0)

    s = mgr.stats()
    assert s["prefix_cache_queries"] == len(p1) + len(p2) + 3 * BS + 1
    assert s["prefix_cache_hits"] == 2 * BS
    assert s["hit_rate"] == pytest.approx(2 * BS / s["prefix_cache_queries"])
    mgr.check_invariants()
    mgr.free("a")
    mgr.free("b")
    assert mgr.num_free_blocks == 15
    mgr.check_invariants()


def test_cache_blocks_incremental_decode():
    """Blocks filled during decode get cached as they become full and computed."""
    mgr = KVCacheManager(16, BS)
    seq = toks(1, tail=[1, 2])
    run_prefill(mgr, "a", seq)
    assert mgr.num_cached_blocks == 1
    for t in range(10):
        seq.append(1000 + t)
        assert mgr.allocate_slots("a", len(seq))
        # KV of the newly sampled token is written in the next step: computed = len-1.
        mgr.cache_blocks("a", seq, len(seq) - 1)
        assert mgr.num_cached_blocks == (len(seq) - 1) // BS
        mgr.check_invariants()
    computed, n = mgr.get_computed_blocks(seq + [5])
    assert computed == mgr.get_block_table("a")[: (len(seq) - 1) // BS]


def test_leave_at_least_one_token():
    mgr = KVCacheManager(16, BS)
    p = toks(1, 2, 3)  # exactly 3 full blocks
    run_prefill(mgr, "a", p)
    assert mgr.num_cached_blocks == 3
    computed, n = mgr.get_computed_blocks(p)
    assert len(computed) == 2 and n == 2 * BS  # last block dropped
    computed, n = mgr.get_computed_blocks(p + [7])
    assert len(computed) == 3 and n == 3 * BS
    assert mgr.get_computed_blocks(p[:BS]) == ([], 0)
    assert mgr.get_computed_blocks([]) == ([], 0)


def test_forced_hash_collision_is_verified(monkeypatch):
    # Every block hashes to the same value: only token verification keeps lookups correct.
    monkeypatch.setattr(bm, "hash_block_tokens", lambda parent, tokens: 42)
    mgr = KVCacheManager(16, BS)
    p1 = toks(1, 2, tail=[0])
    run_prefill(mgr, "a", p1)
    # Block 1 of "a" collides with block 0's entry and is not registered (no duplicate entries).
    assert mgr.num_cached_blocks == 1
    mgr.check_invariants()
    # A different first block hits the hash but fails verification.
    assert mgr.get_computed_blocks(toks(3, 2, tail=[0])) == ([], 0)
    # The true prefix is still found.
    computed, n = mgr.get_computed_blocks(p1)
    assert computed == mgr.get_block_table("a")[:1] and n == BS


def test_cache_salt_separates_prefixes():
    mgr = KVCacheManager(32, BS)
    p = toks(1, 2, 3, tail=[0])
    run_prefill(mgr, "plain", p)
    # a salted request finds nothing an unsalted one cached, and caches its own chain
    ok, computed, n = run_prefill(mgr, "s1", p, cache_salt="tenant-a")
    assert ok and (computed, n) == ([], 0)
    assert mgr.num_cached_blocks == 6
    # the same salt shares, another salt or none finds only its own chain
    salted = mgr.get_block_table("s1")[:3]
    assert mgr.get_computed_blocks(p, "tenant-a") == (salted, 3 * BS)
    assert mgr.get_computed_blocks(p, "tenant-b") == ([], 0)
    assert mgr.get_computed_blocks(p) == (mgr.get_block_table("plain")[:3], 3 * BS)
    ok, computed, n = run_prefill(mgr, "s2", p + [5], cache_salt="tenant-a")
    assert ok and computed == salted and n == 3 * BS
    mgr.check_invariants()
    for rid in ("plain", "s1", "s2"):
        mgr.free(rid)
    # freed blocks keep their salt: still found under it only
    assert mgr.get_computed_blocks(p, "tenant-a") == (salted, 3 * BS)
    assert mgr.get_computed_blocks(p, "tenant-b") == ([], 0)
    mgr.check_invariants()
    assert mgr.reset_prefix_cache() and mgr.get_computed_blocks(p, "tenant-a") == ([], 0)
    mgr.check_invariants()


def test_cache_salt_is_verified_on_hash_collision(monkeypatch):
    # Every block hashes to the same value, salted or not: the stored salt alone keeps a
    # request of another salt off the block.
    monkeypatch.setattr(bm, "hash_block_tokens", lambda parent, tokens: 42)
    mgr = KVCacheManager(16, BS)
    p = toks(1, tail=[0])
    run_prefill(mgr, "a", p, cache_salt="tenant-a")
    assert mgr.num_cached_blocks == 1
    assert mgr.get_computed_blocks(p, "tenant-a") == (mgr.get_block_table("a")[:1], BS)
    assert mgr.get_computed_blocks(p) == ([], 0)
    assert mgr.get_computed_blocks(p, "tenant-b") == ([], 0)
    # an unsalted request computing the same block keeps it private (a different entry owns
    # the hash) instead of chaining onto the salted one
    run_prefill(mgr, "b", p)
    assert mgr.num_cached_blocks == 1 and mgr.get_computed_blocks(p) == ([], 0)
    mgr.check_invariants()


def test_collision_with_evicted_parent_is_rejected(monkeypatch):
    """A block whose tokens match but whose registered parent differs must not be returned.

    The hash ignores each block's first token, so X=(100..) and W=(900..) collide.
    Y is cached as the child of X; X is evicted; W takes X's hash slot. Looking
    up [W, Y] must stop after W: Y's KV was computed after X, not after W.
    """
    monkeypatch.setattr(bm, "hash_block_tokens", lambda parent, tokens: hash((parent, tokens[1:])))
    mgr = KVCacheManager(6, BS)  # 5 usable: a2 takes 3, a1 takes 2
    X = list(range(100, 100 + BS))
    W = [900] + X[1:]
    Y = toks(2)
    # a1 = [X, r] caches X. a2 = [X, Y, t] computes X privately (looked up before
    # a1 cached, as when both are scheduled in one step) and caches Y as X's child.
    assert mgr.get_computed_blocks(X + Y + [0]) == ([], 0)
    assert mgr.allocate_slots("a2", 2 * BS + 1)
    run_prefill(mgr, "a1", X + [1])
    mgr.cache_blocks("a2", X + Y + [0], 2 * BS + 1)
    assert mgr.num_cached_blocks == 2  # X (from a1) and Y (from a2); a2's X is a duplicate
    x_block = mgr.get_block_table("a1")[0]
    y_block = mgr.get_block_table("a2")[1]
    assert mgr.get_computed_blocks(X + Y + [0])[0] == [x_block, y_block]
    mgr.check_invariants()

    mgr.free("a1")  # free queue head: a1's tail block, then X
    assert mgr.allocate_slots("evictor", 2 * BS)  # takes both, evicting X
    assert mgr.get_computed_blocks(X + Y + [0]) == ([], 0)
    mgr.free("evictor")
    run_prefill(mgr, "c", W + [3])  # W registers under X's old hash
    w_block = mgr.get_block_table("c")[0]
    computed, n = mgr.get_computed_blocks(W + Y + [0])
    assert computed == [w_block] and n == BS  # Y rejected: wrong parent
    mgr.check_invariants()


def test_sharing_ref_counts():
    mgr = KVCacheManager(16, BS)
    p = toks(1, 2, tail=[5])
    run_prefill(mgr, "s0", p)
    # n=2 sibling hits the cached prompt blocks.
    ok, computed, n = run_prefill(mgr, "s1", p)
    assert ok and n == 2 * BS
    t0, t1 = mgr.get_block_table("s0"), mgr.get_block_table("s1")
    assert t0[:2] == t1[:2] and t0[2] != t1[2]  # the partial block is private
    assert [mgr.ref_count(b) for b in t0[:2]] == [2, 2]
    mgr.check_invariants()
    mgr.free("s0")
    assert [mgr.ref_count(b) for b in t1[:2]] == [1, 1]
    assert t0[2] not in t1 and mgr.ref_count(t0[2]) == 0
    assert mgr.num_free_blocks == 15 - 3
    mgr.check_invariants()
    mgr.free("s1")
    assert mgr.num_free_blocks == 15
    mgr.check_invariants()


def test_duplicate_block_not_registered_twice():
    """Two siblings computing the same prompt in one step: the second keeps the first's entry."""
    mgr = KVCacheManager(16, BS)
    p = toks(1, 2, tail=[5])
    for rid in ("s0", "s1"):
        assert mgr.get_computed_blocks(p) == ([], 0)
        assert mgr.allocate_slots(rid, len(p))
    mgr.cache_blocks("s0", p, len(p))
    mgr.cache_blocks("s1", p, len(p))
    assert mgr.num_cached_blocks == 2
    assert mgr.get_computed_blocks(p)[0] == mgr.get_block_table("s0")[:2]
    # The duplicate chain still links: s1's later blocks become reachable through s0's entries.
    p1 = p + [6, 7, 8, 9]
    assert mgr.allocate_slots("s1", len(p1))
    mgr.cache_blocks("s1", p1, len(p1))
    computed, _ = mgr.get_computed_blocks(p1)
    assert computed == mgr.get_block_table("s0")[:2] + [mgr.get_block_table("s1")[2]]
    mgr.check_invariants()
    mgr.free("s0")
    mgr.free("s1")
    assert mgr.num_free_blocks == 15
    mgr.check_invariants()


# ---------------------------------------------------------------- eviction

def test_lru_eviction_order():
    mgr = KVCacheManager(7, BS)  # 6 usable
    pa, pb = toks(1, 2, 3, tail=[0]), toks(4, 5, tail=[0])
    run_prefill(mgr, "a", pa)  # 4 blocks, 3 cached
    a = mgr.get_block_table("a")
    run_prefill(mgr, "b", pb)  # needs 3 blocks, only 2 left: refused
    assert not mgr.has_request("b")
    pb = toks(4, tail=[0])
    run_prefill(mgr, "b", pb)  # 2 blocks, 1 cached
    b = mgr.get_block_table("b")
    assert mgr.num_free_blocks == 0
    mgr.free("a")  # a freed first -> least recently used
    mgr.free("b")
    # Free queue: a's blocks tail-first, then b's blocks tail-first.
    expected = [a[3], a[2], a[1], a[0], b[1], b[0]]
    got = []
    for i in range(6):
        assert mgr.allocate_slots(f"x{i}", 1)
        got.append(mgr.get_block_table(f"x{i}")[0])
        # Evicting a request's tail block first keeps its shared prefix findable longest.
        if i == 1:
            assert mgr.get_computed_blocks(pa)[0] == a[:2]
        if i == 2:
            assert mgr.get_computed_blocks(pa)[0] == a[:1]
    assert got == expected
    assert mgr.num_cached_blocks == 0
    mgr.check_invariants()


def test_touched_block_not_evicted():
    mgr = KVCacheManager(5, BS)  # 4 usable
    p = toks(1, tail=[0])
    run_prefill(mgr, "a", p)  # blocks [A0 cached, A1]
    a = mgr.get_block_table("a")
    mgr.free("a")
    assert mgr.allocate_slots("filler", 2 * BS)  # uses the 2 never-used blocks
    # Free queue now: a[1], a[0]. a[0] is cached with ref 0.
    computed, n = mgr.get_computed_blocks(p)
    assert computed == [a[0]]
    assert mgr.allocate_slots("b", len(p), computed)  # touches a[0] (0 -> 1), takes a[1]
    assert mgr.ref_count(a[0]) == 1
    assert mgr.num_free_blocks == 0
    assert not mgr.allocate_slots("c", 1)  # nothing left; a[0] must not be evicted
    assert mgr.get_computed_blocks(p)[0] == [a[0]]
    mgr.check_invariants()
    mgr.free("filler")
    assert mgr.allocate_slots("c", 2 * BS)  # evicts only plain free blocks
    assert mgr.get_computed_blocks(p)[0] == [a[0]]
    mgr.check_invariants()


def test_touch_moves_block_out_of_lru_position():
    """A cached block revived and freed again goes to the tail: it becomes most recent."""
    mgr = KVCacheManager(5, BS)  # 4 usable
    p1, p2 = toks(1, tail=[0]), toks(2, tail=[0])
    run_prefill(mgr, "a", p1)
    run_prefill(mgr, "b", p2)
    a, b = mgr.get_block_table("a"), mgr.get_block_table("b")
    mgr.free("a")
    mgr.free("b")  # queue: a1 a0 b1 b0
    ok, computed, _ = run_prefill(mgr, "c", p1)  # touches a0, takes a1 from the head
    assert ok and computed == [a[0]]
    mgr.free("c")  # queue: b1 b0 a1 a0
    assert mgr.allocate_slots("x", 2 * BS)
    assert mgr.get_block_table("x") == [b[1], b[0]]
    assert mgr.get_computed_blocks(p1)[0] == [a[0]]
    assert mgr.get_computed_blocks(p2) == ([], 0)
    mgr.check_invariants()


def test_evicted_computed_block_rejected():
    mgr = KVCacheManager(3, BS)  # 2 usable
    p = toks(1, tail=[0])
    run_prefill(mgr, "a", p)
    mgr.free("a")
    computed, _ = mgr.get_computed_blocks(p)
    assert mgr.allocate_slots("other", 2 * BS)  # evicts the cached block (misuse of the API)
    with pytest.raises(ValueError):
        mgr.allocate_slots("b", len(p), computed)


# ----------------------------------------------------------- misc / modes

def test_reset_prefix_cache():
    mgr = KVCacheManager(8, BS)
    p = toks(1, 2, tail=[0])
    run_prefill(mgr, "a", p)
    assert not mgr.reset_prefix_cache()  # blocks in use
    assert mgr.num_cached_blocks == 2
    mgr.free("a")
    assert mgr.reset_prefix_cache()
    assert mgr.num_cached_blocks == 0
    assert mgr.get_computed_blocks(p) == ([], 0)
    assert mgr.num_free_blocks == 7
    mgr.check_invariants()
    run_prefill(mgr, "b", p)  # caching works again afterwards
    assert mgr.get_computed_blocks(p)[1] == 2 * BS
    mgr.check_invariants()


def test_prefix_caching_disabled():
    mgr = KVCacheManager(8, BS, enable_prefix_caching=False)
    p = toks(1, 2, tail=[0])
    for rid in ("a", "b"):
        ok, computed, n = run_prefill(mgr, rid, p)
        assert ok and computed == [] and n == 0
    assert mgr.num_cached_blocks == 0
    assert set(mgr.get_block_table("a")).isdisjoint(mgr.get_block_table("b"))
    assert mgr.stats()["prefix_cache_queries"] == 0
    mgr.check_invariants()
    mgr.free("a")
    mgr.free("b")
    assert mgr.num_free_blocks == 7
    mgr.check_invariants()


def test_stats_keys():
    s = KVCacheManager(4, BS).stats()
    for k in ("prefix_cache_queries", "prefix_cache_hits", "hit_rate", "free_blocks", "used_blocks"):
        assert k in s
    assert s["hit_rate"] == 0.0 and s["free_blocks"] == 3 and s["used_blocks"] == 0


def test_check_invariants_detects_corruption():
    mgr = KVCacheManager(8, BS)
    run_prefill(mgr, "a", toks(1, tail=[0]))
    mgr._blocks[mgr.get_block_table("a")[0]].ref_cnt += 1
    with pytest.raises(AssertionError):
        mgr.check_invariants()


# -------------------------------------------------------------- stress

@pytest.mark.parametrize(
    "seed,prefix_caching,weak_hash",
    [(0, True, False), (1, True, False), (2, True, True), (3, False, False), (4, True, True)],
)
def test_randomized_stress(monkeypatch, seed, prefix_caching, weak_hash):
    """Engine-like random workload, checked against a shadow model of the KV contents.

    ``kv[block]`` records which token prefix the block's KV was computed for.
    Every prefix hit must return blocks whose recorded prefix equals the queried
    prefix: this is the end-to-end correctness property of prefix caching.
    A weak hash (few distinct values) forces many collisions.
    """
    if weak_hash:
        monkeypatch.setattr(bm, "hash_block_tokens", lambda parent, tokens: hash((parent, tokens)) % 5)
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    mgr = KVCacheManager(rng.randint(8, 40), bs, enable_prefix_caching=prefix_caching)
    kv: dict[int, tuple] = {}
    # Prompts share prefixes: drawn from a few stems plus random continuations.
    stems = [[rng.randrange(6) for _ in range(rng.randint(0, 12))] for _ in range(4)]
    running: dict[str, dict] = {}
    next_id = 0

    def write_kv(rid, seq, n_computed):
        table = mgr.get_block_table(rid)
        for k in range(n_computed // bs):
            content = tuple(seq[: (k + 1) * bs])
            if table[k] in kv and kv[table[k]] is not None:
                assert kv[table[k]] == content, "shared block holds a different prefix"
            kv[table[k]] = content

    for _ in range(1500):
        op = rng.random()
        if op < 0.35 or not running:
            prompt = list(rng.choice(stems)) + [rng.randrange(6) for _ in range(rng.randint(1, 10))]
            computed, n = mgr.get_computed_blocks(prompt)
            assert n == len(computed) * bs < len(prompt)
            for k, b in enumerate(computed):
                assert kv.get(b) == tuple(prompt[: (k + 1) * bs]), "prefix hit returned wrong KV"
            rid = f"r{next_id}"
            next_id += 1
            if mgr.allocate_slots(rid, len(prompt), computed):
                for b in mgr.get_block_table(rid)[len(computed):]:
                    kv[b] = None  # fresh block: old contents are garbage now
                write_kv(rid, prompt, len(prompt))
                mgr.cache_blocks(rid, prompt, len(prompt))
                running[rid] = {"seq": prompt}
            else:
                assert not mgr.has_request(rid)
        elif op < 0.75:
            rid = rng.choice(sorted(running))
            seq = running[rid]["seq"]
            old = len(mgr.get_block_table(rid))
            seq.append(rng.randrange(6))
            if mgr.allocate_slots(rid, len(seq)):
                for b in mgr.get_block_table(rid)[old:]:
                    kv[b] = None
                # KV of the just-sampled token is written in the next step.
                write_kv(rid, seq, len(seq) - 1)
                mgr.cache_blocks(rid, seq, len(seq) - 1)
            else:
                mgr.free(rid)  # preempt (recompute): drop everything
                del running[rid]
        elif op < 0.98:
            rid = rng.choice(sorted(running))
            mgr.free(rid)
            del running[rid]
        else:
            assert mgr.reset_prefix_cache() == (mgr.num_used_blocks == 0)
        mgr.check_invariants()

    for rid in list(running):
        mgr.free(rid)
    mgr.check_invariants()
    assert mgr.num_free_blocks == mgr.num_blocks - 1 and mgr.usage == 0.0
    if prefix_caching:
        assert mgr.stats()["prefix_cache_hits"] > 0


def test_state_snapshots_of_one_step_never_share_a_slot():
    """More prompts reaching their snapshot point in one step than there are snapshot slots:
    a slot the step saves into already is never evicted for another (the runner copies the
    step's saves with one index_copy_, whose result with repeated targets is undefined on the
    GPU); the prompt left over gets no snapshot. The same block asked twice in a step saves once."""
    from vllm.core.state_slots import StateSlots
    slots = StateSlots(num_slots=4, num_snapshots=2, chunk_size=64)
    saving: set[int] = set()
    for block in (10, 11, 12):
        slot = slots.take_snapshot(block, saving)
        if slot >= 0:
            saving.add(slot)
    assert sorted(saving) == [4, 5] and slots.num_snapshots_held == 2
    assert slots.take_snapshot(10, saving) == -1          # block 10's slot is saved this step already
    # the next step: the least recently used snapshot makes room again
    assert slots.take_snapshot(12, set()) in (4, 5) and slots.num_snapshots_held == 2
