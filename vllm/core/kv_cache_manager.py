"""The KV-cache manager (`KVCacheManager`): paged blocks with automatic prefix caching.

The KV cache is a pool of ``num_blocks`` fixed-size blocks, each holding the
keys/values of ``block_size`` consecutive tokens of one sequence. A request owns
a *block table*: the list of block ids that hold its tokens in order. This
module only does the bookkeeping (which block belongs to whom, which blocks hold
reusable prefixes); the model runner does the actual KV writes.

Design summary (see docs/kv_cache.md for the long form):

* Block 0 is the *null block*. It is never handed out; the runner points the
  KV writes of padding rows at it so they cannot clobber real data.
* Every block is in exactly one of two states: *in use* (ref count > 0, owned by
  one or more requests) or *in the free queue* (ref count 0). A block in the
  free queue may still carry a prefix-cache hash: its KV is still valid and it
  can be revived ("touched") by a later request with the same prefix, until it
  reaches the head of the queue and is evicted on reallocation (LRU).
* Full blocks are registered in the prefix cache under a hash chain:
  ``h_k = hash_block_tokens(h_{k-1}, tokens of block k)``, rooted at
  ``h_{-1} = chain_root_hash(cache_salt)``. The hash is only an index; a hit is
  accepted only after verifying the stored tokens, the identity of the parent
  entry and the request's cache salt, so a hash collision can cost a cache hit
  but never return wrong KV, nor KV computed for a request of another salt.

Pure Python on purpose: it runs on the scheduler's CPU thread, every operation
is O(blocks touched), and it is trivially testable.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Collection, Optional, Sequence

from vllm.core.state_slots import StateSlots

__all__ = ["KVCacheManager", "chain_root_hash", "hash_block_tokens", "NULL_BLOCK_ID"]

# Block reserved for padding writes; never allocated, never cached, never freed.
NULL_BLOCK_ID = 0


def hash_block_tokens(parent_hash: Optional[int], token_ids: tuple[int, ...]) -> int:
    """Hash of one full block, chained on the hash of the block before it.

    Chaining makes the hash of block k depend on every token before it, which is
    what KV reuse requires (a block's keys/values depend on the whole prefix).
    Python's tuple hash is fast and deterministic for ints within a process; it
    is not collision resistant, which is fine because every hit is verified
    (see ``KVCacheManager.get_computed_blocks``). The manager looks this
    function up through the module on every call, so tests can monkeypatch it
    to force collisions.
    """
    return hash((parent_hash, token_ids))


def chain_root_hash(cache_salt: Optional[str]) -> Optional[int]:
    """The parent hash of a sequence's first block: None without a salt (unsalted hashes are
    unchanged), else a hash of the salt. Mixing the salt into the first block's hash makes
    every later hash of the chain differ too, so requests with different salts never index
    each other's blocks (and the stored salt is checked on every hit besides)."""
    return None if cache_salt is None else hash(("cache_salt", cache_salt))


@dataclass(slots=True)
class _Block:
    """Metadata of one physical KV block."""

    block_id: int
    ref_cnt: int = 0
    # Prefix-cache registration. All four are None unless this block is the
    # entry of ``block_hash`` in the hash table.
    block_hash: Optional[int] = None
    # The tokens this block holds, kept to verify hash hits.
    token_ids: Optional[tuple[int, ...]] = None
    # Unique, never-reused id of this cache entry, and the id of the entry that
    # held the previous block of the prefix when this one was registered. Block
    # ids are reused after eviction, serials are not, so "parent serial matches"
    # proves the whole prefix matches, not just this block's tokens.
    serial: Optional[int] = None
    parent_serial: Optional[int] = None
    # The cache salt of the request that registered it (None: unsalted). Only a request of
    # the same salt may take it.
    cache_salt: Optional[str] = None

    def clear_hash(self) -> None:
        self.block_hash = None
        self.token_ids = None
        self.serial = None
        self.parent_serial = None
        self.cache_salt = None


@dataclass(slots=True)
class _RequestState:
    """Per-request bookkeeping."""

    block_ids: list[int] = field(default_factory=list)
    # Number of leading blocks of ``block_ids`` already processed by
    # cache_blocks (registered, found as duplicates, or taken from the cache).
    num_cached_blocks: int = 0
    # Hash and cache-entry serial of the last processed block: the parent of the
    # next block to register (before the first: the salt's chain root and None).
    parent_hash: Optional[int] = None
    parent_serial: Optional[int] = None
    # The request's cache salt: it registers its blocks under it.
    cache_salt: Optional[str] = None
    # Set when one of this request's blocks could not be registered because a
    # *different* block already owns its hash (true collision). Its later blocks
    # would be unreachable through the chain, so we stop caching them.
    chain_broken: bool = False


class _Blocks(dict):
    """Block id -> _Block, made on first use: a pool of millions of blocks (a small model
    on a large GPU) costs nothing until its blocks are handed out."""

    def __missing__(self, block_id: int) -> _Block:
        blk = self[block_id] = _Block(block_id)
        return blk


class _FreeQueue:
    """The free queue (head = evicted first) as never-used blocks `[next, end)` in id order,
    then the returned ones in an OrderedDict (O(1) pop-head, append-tail and
    remove-from-middle). Returned blocks are appended after every never-used one, so this
    is the order of one queue that starts as all blocks in id order, without building it."""

    def __init__(self, start: int, end: int):
        self._next, self._end = start, end
        self._returned: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return self._end - self._next + len(self._returned)

    def __contains__(self, block_id: int) -> bool:
        return self._next <= block_id < self._end or block_id in self._returned

    def __iter__(self):
        yield from range(self._next, self._end)
        yield from self._returned

    def remove(self, block_id: int) -> None:
        """Take a returned block out of the middle (a cached block touched again)."""
        del self._returned[block_id]   # a never-used block carries no hash: it is never touched

    def append(self, block_id: int) -> None:
        self._returned[block_id] = None

    def pop_head(self) -> int:
        if self._next < self._end:
            self._next += 1
            return self._next - 1
        return self._returned.popitem(last=False)[0]


class KVCacheManager:
    """Allocates KV-cache blocks to requests and shares full blocks by prefix."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 state: StateSlots | None = None):
        """`state`: the recurrent-state slots of a model with recurrent layers (vllm/core/state_slots.py):
        every request holds one while it holds blocks, and a prefix-cache hit ends where a
        snapshot of the states was taken."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

        self._blocks = _Blocks()
        # Free queue: every usable block with ref count 0, in eviction order
        # (head = evicted first). Initially all usable blocks, in id order.
        self._free_queue = _FreeQueue(1, num_blocks)
        # Prefix cache index: block hash -> id of the block registered under it.
        self._hash_to_block: dict[int, int] = {}
        # Full prompt blocks a running request is yet to compute: hash -> that request. A new
        # request whose next uncached block is one of them waits until it is cached (the
        # scheduler) rather than computing the same KV beside it in the same step. Entries
        # go when the block is registered or the request's blocks are freed.
        self._pending: dict[int, str] = {}
        self._pending_of: dict[str, list[int]] = {}
        self._requests: dict[str, _RequestState] = {}
        self._serials = itertools.count()

        self.state = state
        # a prefix hit on a model with recurrent states ends on a multiple of this many tokens
        # (whole blocks on the states' grid)
        self.state_grid = math.lcm(block_size, state.chunk_size) if state is not None else None

        # Stats, in tokens.
        self._num_queried_tokens = 0
        self._num_hit_tokens = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: never-used/free blocks plus evictable cached ones."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or evictable)."""
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by at least one request."""
        return self.num_used_blocks / self.num_usable_blocks

    def get_block_table(self, request_id: str) -> list[int]:
        req = self._requests.get(request_id)
        return list(req.block_ids) if req is not None else []

    def ref_count(self, block_id: int) -> int:
        blk = self._blocks.get(block_id)
        return 0 if blk is None else blk.ref_cnt

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil division

    def num_blocks_needed(
        self, request_id: str, num_tokens: int, computed_blocks: Optional[list[int]] = None
    ) -> int:
        """Blocks ``allocate_slots`` would take out of the free queue.

        With ``computed_blocks`` (first call of a new request), cached blocks
        that are currently evictable (ref 0) count too: touching them removes
        them from the free queue just like a fresh allocation does.
        """
        req = self._requests.get(request_id)
        have = len(req.block_ids) if req is not None else 0
        computed = computed_blocks if (req is None and computed_blocks) else []
        num_new = max(0, self._blocks_for(num_tokens) - have - len(computed))
        num_touch = sum(1 for b in computed if self._blocks[b].ref_cnt == 0)
        return num_new + num_touch

    # ------------------------------------------------------------ prefix cache

    def _match_chain(self, token_ids: Sequence[int], cache_salt: Optional[str], max_blocks: int) -> list[int]:
        """The cached blocks holding the first full blocks of ``token_ids`` (at most
        ``max_blocks``), each verified against the chain (see get_computed_blocks)."""
        bs = self.block_size
        computed: list[int] = []
        parent_hash: Optional[int] = chain_root_hash(cache_salt)
        parent_serial: Optional[int] = None
        for k in range(max_blocks):
            tokens = tuple(token_ids[k * bs:(k + 1) * bs])
            block_hash = hash_block_tokens(parent_hash, tokens)
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            blk = self._blocks[block_id]
            # Verify: a hash hit only means "probably". The stored tokens must be
            # this block's tokens, the entry must have been registered as the
            # child of the entry we matched for the previous block -- which by
            # induction means the whole prefix is identical -- and by a request
            # of the same salt.
            if blk.token_ids != tokens or blk.parent_serial != parent_serial or blk.cache_salt != cache_salt:
                break
            computed.append(block_id)
            parent_hash = block_hash
            parent_serial = blk.serial
        return computed

    def _chain_hashes(self, token_ids: Sequence[int], cache_salt: Optional[str], num_blocks: int) -> list[int]:
        """The hash chain of the first ``num_blocks`` full blocks of ``token_ids``."""
        bs = self.block_size
        hashes: list[int] = []
        parent_hash: Optional[int] = chain_root_hash(cache_salt)
        for k in range(num_blocks):
            parent_hash = hash_block_tokens(parent_hash, tuple(token_ids[k * bs:(k + 1) * bs]))
            hashes.append(parent_hash)
        return hashes

    def mark_pending(self, request_id: str, token_ids: Sequence[int], cache_salt: Optional[str],
                     num_computed_tokens: int, num_prompt_tokens: int) -> None:
        """The request (just admitted with ``num_computed_tokens`` cached) will compute its full
        prompt blocks after those: index them as pending (see waits_for_pending). Not on a model
        with recurrent states: a hit there also needs a state snapshot at its end, which the
        other request's step may not take."""
        if not self.enable_prefix_caching or self.state is not None:
            return
        bs = self.block_size
        first, last = num_computed_tokens // bs, num_prompt_tokens // bs
        if last <= first:
            return
        own = [h for h in self._chain_hashes(token_ids, cache_salt, last)[first:]
               if h not in self._hash_to_block and self._pending.setdefault(h, request_id) == request_id]
        if own:
            self._pending_of[request_id] = own

    def _drop_pending(self, request_id: str) -> None:
        for h in self._pending_of.pop(request_id, ()):
            if self._pending.get(h) == request_id:
                del self._pending[h]

    def waits_for_pending(self, request_id: str, token_ids: Sequence[int], cache_salt: Optional[str],
                          num_cached_tokens: int) -> bool:
        """Whether the block after the request's cached prefix (``num_cached_tokens``, a
        lookup_prefix result) is one another running request is computing: admitted once it
        is cached, the request reuses it (and any later shared blocks) instead of computing the
        same KV in the same step."""
        if not self._pending:
            return False
        bs = self.block_size
        k = num_cached_tokens // bs
        if k >= max(0, (len(token_ids) - 1) // bs):   # no further block could be a hit
            return False
        h = self._chain_hashes(token_ids, cache_salt, k + 1)[k]
        owner = self._pending.get(h)
        return owner is not None and owner != request_id and h not in self._hash_to_block

    def get_computed_blocks(self, token_ids: Sequence[int], cache_salt: Optional[str] = None,
                            record: bool = True) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks of ``token_ids`` registered under
        ``cache_salt`` (None: by unsalted requests).

        Returns ``(block_ids, num_computed_tokens)``. Takes no references: the
        caller must pass the blocks to ``allocate_slots`` before anything else
        can allocate (and thereby evict them). ``record=False`` leaves the hit
        statistics to the caller (``record_prefix_query``): the scheduler counts a
        request once, when it is admitted, not at every step it waits for room.
        """
        computed, num_computed_tokens, _ = self.lookup_prefix(token_ids, cache_salt, record=record)
        return computed, num_computed_tokens

    def lookup_prefix(self, token_ids: Sequence[int], cache_salt: Optional[str] = None,
                      record: bool = True) -> tuple[list[int], int, int]:
        """get_computed_blocks' `(block_ids, num_computed_tokens)` and the tokens of the cached
        KV prefix before recurrent states cut it back to a snapshot (the same without them):
        past the hit, up to there, only the states are missing (Scheduler._snapshot_branch)."""
        if not self.enable_prefix_caching:
            return [], 0, 0
        num_tokens = len(token_ids)
        bs = self.block_size
        # At least one token must be left to compute, because the model needs
        # logits at the last prompt position. (n-1)//bs full blocks never cover
        # the final token; when n is a multiple of bs it drops the last block.
        max_blocks = max(0, (num_tokens - 1) // bs)
        computed = self._match_chain(token_ids, cache_salt, max_blocks)
        kv_tokens = len(computed) * bs
        if self.state is not None:
            # recurrent states are restored only from a snapshot on their grid
            per = self.state_grid // bs
            k = len(computed) // per * per
            while k > 0 and self.state.snapshot(computed[k - 1]) is None:
                k -= per
            computed = computed[:k]
        num_computed_tokens = len(computed) * bs
        if record:
            self.record_prefix_query(num_tokens, num_computed_tokens)
        return computed, num_computed_tokens, kv_tokens

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one prefix-cache lookup of ``num_tokens`` tokens that reused ``num_hit_tokens``
        (none without prefix caching)."""
        if not self.enable_prefix_caching:
            return
        self._num_queried_tokens += num_tokens
        self._num_hit_tokens += num_hit_tokens

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the request's newly full, computed blocks in the prefix cache.

        ``token_ids`` are all tokens of the request so far; KV has been written
        for ``[0, num_computed_tokens)``. Idempotent: blocks already processed
        are skipped, so calling it after every step is cheap.
        """
        if not self.enable_prefix_caching:
            return
        req = self._requests.get(request_id)
        if req is None or req.chain_broken:
            return
        bs = self.block_size
        num_full = min(min(num_computed_tokens, len(token_ids)) // bs, len(req.block_ids))
        for k in range(req.num_cached_blocks, num_full):
            tokens = tuple(token_ids[k * bs:(k + 1) * bs])
            block_hash = hash_block_tokens(req.parent_hash, tokens)
            block_id = req.block_ids[k]
            blk = self._blocks[block_id]
            if self._pending:
                self._pending.pop(block_hash, None)
            existing_id = self._hash_to_block.get(block_hash)
            if existing_id is None:
                # New entry. Our block was freshly allocated (hash cleared then),
                # so it cannot already be registered under another hash.
                assert blk.block_hash is None, "allocated block still carries a hash"
                blk.block_hash = block_hash
                blk.token_ids = tokens
                blk.serial = next(self._serials)
                blk.parent_serial = req.parent_serial
                blk.cache_salt = req.cache_salt
                self._hash_to_block[block_hash] = block_id
                serial = blk.serial
            else:
                existing = self._blocks[existing_id]
                if (existing.token_ids == tokens and existing.parent_serial == req.parent_serial
                        and existing.cache_salt == req.cache_salt):
                    # Same content already cached (e.g. a sibling request
                    # computed the same prompt in the same step). Keep the
                    # existing entry; our copy stays private and is plainly
                    # freed later. Chain our later blocks onto the existing
                    # entry so they are reachable by lookups.
                    serial = existing.serial
                else:
                    # True collision: a different prefix owns this hash. Our
                    # block can't be registered, and its descendants could
                    # never be found through the chain, so stop here.
                    req.chain_broken = True
                    self._drop_pending(request_id)
                    return
            req.parent_hash = block_hash
            req.parent_serial = serial
            req.num_cached_blocks = k + 1

    def reset_prefix_cache(self, allow_in_use: bool = False) -> bool:
        """Forget every cached prefix (e.g. after a weight update).

        Refused while any block is in use, unless ``allow_in_use``: then the
        requests holding blocks keep them (and their KV) but register nothing
        more, since their later blocks chain onto prefixes that are no longer
        cached (after a weight update their KV also mixes two weight versions,
        which no other request may reuse).
        """
        if self.num_used_blocks > 0:
            if not allow_in_use:
                return False
            for req in self._requests.values():
                req.chain_broken = True
        for block_id in self._hash_to_block.values():
            self._blocks[block_id].clear_hash()
        self._hash_to_block.clear()
        self._pending.clear()       # in-use requests register nothing more (chain_broken)
        self._pending_of.clear()
        if self.state is not None:
            self.state.clear_snapshots()
        return True

    # ------------------------------------------------------------ recurrent states

    def state_slot(self, request_id: str) -> int:
        """The request's recurrent-state slot (0 without recurrent layers)."""
        return 0 if self.state is None else self.state.slot(request_id)

    def state_snapshot(self, computed_blocks: Sequence[int]) -> int:
        """The snapshot a prefix hit of `computed_blocks` restores (-1: none, a cold start)."""
        if self.state is None or not computed_blocks:
            return -1
        slot = self.state.snapshot(computed_blocks[-1])
        return -1 if slot is None else slot

    def take_state_snapshot(self, request_id: str, num_tokens: int, keep: Collection[int] = (), *,
                            token_ids: Sequence[int] | None = None, cache_salt: Optional[str] = None) -> int:
        """A snapshot slot for the request's states after its first `num_tokens` tokens (a
        multiple of state_grid), keyed by the block ending there that lookups will find: the
        cached block already registered for those tokens (`token_ids`, `cache_salt`: another
        request's, whose KV this request recomputes only for the states), else the request's
        own, registered once computed. -1 when snapshots are off or every snapshot slot is in
        `keep` (the slots this step saves into already)."""
        if self.state is None or not self.enable_prefix_caching:
            return -1
        req = self._requests[request_id]
        if req.chain_broken:
            # its states may mix two weight versions (a reset while it ran): keyed by a block
            # registered since, they would be served as the new weights' prefix
            return -1
        n = num_tokens // self.block_size
        key = req.block_ids[n - 1]
        if token_ids is not None:
            chain = self._match_chain(token_ids, cache_salt, n)
            if len(chain) == n:
                key = chain[-1]
        return self.state.take_snapshot(key, keep)

    # --------------------------------------------------------------- allocation

    def allocate_slots(
        self, request_id: str, num_tokens: int, computed_blocks: Optional[list[int]] = None,
        cache_salt: Optional[str] = None,
    ) -> bool:
        """Grow the request's block table to cover ``num_tokens`` tokens.

        ``cache_salt`` (read on the request's first call, with ``computed_blocks``
        found under the same salt): the salt its blocks are registered under.
        All-or-nothing: returns False and changes nothing if the free queue
        cannot supply every block needed (new blocks plus touched cached ones).
        """
        req = self._requests.get(request_id)
        computed = list(computed_blocks) if computed_blocks else []
        if req is not None and computed:
            raise ValueError("computed_blocks may only be passed on a request's first allocate_slots call")
        if computed:
            self._validate_computed_blocks(computed)

        have = len(req.block_ids) if req is not None else 0
        num_new = max(0, self._blocks_for(num_tokens) - have - len(computed))
        # Cached blocks with ref 0 sit in the free queue; taking them consumes
        # free-queue capacity exactly like new blocks.
        num_touch = sum(1 for b in computed if self._blocks[b].ref_cnt == 0)
        if num_new + num_touch > len(self._free_queue):
            return False

        if req is None:
            req = _RequestState(cache_salt=cache_salt, parent_hash=chain_root_hash(cache_salt))
            self._requests[request_id] = req
            if self.state is not None:
                self.state.assign(request_id)
            if computed:
                # These blocks are already cached; cache_blocks must continue
                # the chain after them.
                last = self._blocks[computed[-1]]
                req.num_cached_blocks = len(computed)
                req.parent_hash = last.block_hash
                req.parent_serial = last.serial

        # Touch computed blocks before popping new ones, so a computed block
        # sitting at the head of the free queue is not evicted under us.
        for block_id in computed:
            blk = self._blocks[block_id]
            if blk.ref_cnt == 0:
                self._free_queue.remove(block_id)
            blk.ref_cnt += 1
            req.block_ids.append(block_id)

        for _ in range(num_new):
            block_id = self._free_queue.pop_head()
            blk = self._blocks[block_id]
            if self.state is not None:
                self.state.drop_snapshot(block_id)  # the block gets other tokens
            if blk.block_hash is not None:
                # LRU eviction: the block's old KV is about to be overwritten.
                del self._hash_to_block[blk.block_hash]
                blk.clear_hash()
            blk.ref_cnt = 1
            req.block_ids.append(block_id)
        return True

    def _validate_computed_blocks(self, computed: list[int]) -> None:
        # Computed blocks must still be cached: if something allocated between
        # get_computed_blocks and allocate_slots and evicted one, its KV is gone.
        if len(set(computed)) != len(computed):
            raise ValueError("computed_blocks contains duplicates")
        for block_id in computed:
            if not (NULL_BLOCK_ID < block_id < self.num_blocks):
                raise ValueError(f"invalid computed block id {block_id}")
            if self._blocks[block_id].block_hash is None:
                raise ValueError(
                    f"computed block {block_id} is no longer cached (evicted between "
                    "get_computed_blocks and allocate_slots)"
                )

    def free(self, request_id: str) -> None:
        """Release the request's blocks (finished, aborted or preempted)."""
        self._drop_pending(request_id)
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        if self.state is not None:
            self.state.release(request_id)
        # Reverse order: the request's last blocks reach the free-queue tail
        # first, so they are evicted before its first blocks. Prefix blocks are
        # the ones most likely to be shared by future requests.
        for block_id in reversed(req.block_ids):
            blk = self._blocks[block_id]
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self._free_queue.append(block_id)

    # -------------------------------------------------------------- diagnostics

    @property
    def prefix_cache_counts(self) -> tuple[int, int]:
        """(tokens looked up, tokens found cached) since the start."""
        return self._num_queried_tokens, self._num_hit_tokens

    def stats(self) -> dict:
        q, h = self.prefix_cache_counts
        return {
            "prefix_cache_queries": q,
            "prefix_cache_hits": h,
            "hit_rate": h / q if q else 0.0,
            "free_blocks": self.num_free_blocks,
            "used_blocks": self.num_used_blocks,
            "cached_blocks": self.num_cached_blocks,
            "usage": self.usage,
            "num_requests": len(self._requests),
            **({"state_snapshots": self.state.num_snapshots_held} if self.state is not None else {}),
        }

    def check_invariants(self) -> None:
        """Assert that all bookkeeping is mutually consistent. O(num_blocks)."""
        null = self._blocks[NULL_BLOCK_ID]
        assert null.ref_cnt == 0, "null block is referenced"
        assert NULL_BLOCK_ID not in self._free_queue, "null block is in the free queue"
        assert null.block_hash is None, "null block is cached"

        expected_refs = [0] * self.num_blocks
        for rid, req in self._requests.items():
            assert len(set(req.block_ids)) == len(req.block_ids), f"{rid}: duplicate block in table"
            assert 0 <= req.num_cached_blocks <= len(req.block_ids), f"{rid}: bad num_cached_blocks"
            for block_id in req.block_ids:
                assert NULL_BLOCK_ID < block_id < self.num_blocks, f"{rid}: bad block id {block_id}"
                expected_refs[block_id] += 1

        for block_id in range(1, self.num_blocks):
            blk = self._blocks.get(block_id) or _Block(block_id)
            assert blk.ref_cnt == expected_refs[blk.block_id], (
                f"block {blk.block_id}: ref_cnt {blk.ref_cnt} != {expected_refs[blk.block_id]} holders"
            )
            in_queue = blk.block_id in self._free_queue
            assert (blk.ref_cnt > 0) != in_queue, (
                f"block {blk.block_id}: ref_cnt={blk.ref_cnt}, in_free_queue={in_queue}"
            )
            if blk.block_hash is None:
                assert blk.token_ids is None and blk.serial is None and blk.parent_serial is None
                assert blk.cache_salt is None
            else:
                assert self._hash_to_block.get(blk.block_hash) == blk.block_id, (
                    f"block {blk.block_id} carries a hash the table maps elsewhere"
                )
                assert blk.token_ids is not None and len(blk.token_ids) == self.block_size
                assert blk.serial is not None

        for block_hash, block_id in self._hash_to_block.items():
            assert NULL_BLOCK_ID < block_id < self.num_blocks
            assert self._blocks[block_id].block_hash == block_hash, (
                f"hash table entry for block {block_id} does not match its metadata"
            )
        if not self.enable_prefix_caching:
            assert not self._hash_to_block, "prefix caching disabled but blocks are cached"
        assert all(NULL_BLOCK_ID < b < self.num_blocks for b in self._free_queue)
        in_use = sum(1 for i, b in self._blocks.items() if i != NULL_BLOCK_ID and b.ref_cnt > 0)
        assert len(self._free_queue) + in_use == self.num_usable_blocks
