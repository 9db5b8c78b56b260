"""Continuous-batching scheduler: one token budget per step shared by decodes and
(chunked) prefills, preemption by recompute when KV blocks run out.

Each step every request asks to compute the tokens it has but whose KV is not
in the cache yet (a whole prompt, a chunk of it, or the one token sampled last
step). Running requests are served first, in the order they were admitted; when
the cache is full a running request is preempted: its blocks are freed (cached
blocks stay reusable by hash) and it waits to be recomputed. Waiting requests
are admitted next, in the waiting queue's order (vllm/core/waiting_queue.py).

The scheduling policy (SchedulerConfig.scheduling_policy, upstream's) decides the
two orders: "fcfs" admits by arrival and preempts the latest arrival; "priority"
admits by (priority, arrival), lower first, and preempts the running request with
the largest (priority, arrival), as upstream's v1 scheduler does. Either only
reorders work: every token's bits are the same (the engine is batch invariant).
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Iterable

import numpy as np

from vllm.config import SchedulerConfig
from vllm.core.kv_cache_manager import KVCacheManager
from vllm.core.messages import ModelRunnerOutput, PromptLogprobsSlice, ScheduledRequest, SchedulerOutput
from vllm.core.request import PLACEHOLDER, Request, RequestStatus, check_priority
from vllm.core.waiting_queue import make_waiting_queue

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.priority_policy = config.scheduling_policy == "priority"
        self.waiting = make_waiting_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._arrivals = itertools.count()   # Request.arrival_order: ties of equal priority by arrival

    # ---- bookkeeping ------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        req.priority = check_priority(req.priority, self.config.scheduling_policy)
        req.arrival_order = next(self._arrivals)
        self.requests[req.req_id] = req
        self.waiting.add(req)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        done = []
        for rid in req_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                try:
                    self.waiting.remove(req)
                except ValueError:
                    pass
            req.status = status
            self.kv.free(rid)
            done.append(req)
        return done

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ---------------------------------------------------------------------
    def _chunk(self, req: Request, budget: int) -> int:
        n = req.num_tokens - req.num_computed_tokens
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return self._snapshot_cut(req, req.num_computed_tokens, min(n, budget))

    def _snapshot_points(self, req: Request) -> tuple[int, ...]:
        """Where a prompt's recurrent states are snapshotted for the prefix cache, ascending:
        the last multiple of the states' grid within the cached KV prefix it was admitted
        with, when no snapshot lies there yet (where it leaves another prompt: a shared
        system prompt's end, so later prompts sharing it hit), and its last multiple of the
        grid before the prompt's last token."""
        grid = self.kv.state_grid
        if grid is None or not self.kv.enable_prefix_caching or not self.kv.state.num_snapshots:
            return ()
        last = (req.num_prompt_tokens - 1) // grid * grid
        if req.snapshot_branch:
            return (req.snapshot_branch, last)
        return (last,) if last else ()

    def _snapshot_cut(self, req: Request, start: int, n: int) -> int:
        """Stop a prefill step at the next snapshot point, so that the state there is in the
        slot after the step. The states' bits do not depend on where a prefill is cut."""
        if start >= req.num_prompt_tokens:   # decoding: no point left
            return n
        for point in self._snapshot_points(req):
            if start < point < start + n:
                return point - start
        return n

    def _snapshot_branch(self, req: Request, num_cached: int, kv_tokens: int) -> int:
        """The grid point past the hit (`num_cached`) that the cached KV prefix (`kv_tokens`)
        reaches (0: none): the hit stops short of it for want of a snapshot. None with fewer
        than two snapshot slots, where the prompt's own last-point snapshot would evict it."""
        grid = self.kv.state_grid
        if grid is None or kv_tokens - num_cached < grid or self.kv.state.num_snapshots < 2:
            return 0
        point = kv_tokens // grid * grid
        return point if num_cached < point < (req.num_prompt_tokens - 1) // grid * grid else 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.req_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.put_back(req)

    def _preemption_victim(self) -> tuple[Request, int]:
        """The running request to preempt when KV blocks run out, and its index in `running`. fcfs:
        the latest admitted. priority: the one with the largest (priority, arrival), i.e. the
        lowest priority and, among equals, the latest arrival, as upstream's v1 scheduler picks."""
        if not self.priority_policy:
            return self.running[-1], len(self.running) - 1
        at = max(range(len(self.running)), key=lambda k: self.running[k].scheduling_key)
        return self.running[at], at

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []
        state_loads: dict[str, int] = {}  # new requests starting from a state snapshot

        # 1) running requests, in the order they were admitted
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            # a constrained request whose last token is still on the device sits this step
            # out: its next token's grammar mask (or bad words' bans) needs that token
            # (docs/serving.md)
            n = 0 if req.finishing or req.awaiting_last_token else self._chunk(req, budget)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req.req_id, req.num_computed_tokens + n):
                victim, at = self._preemption_victim()
                if at < i:
                    # passed earlier this step (only the priority policy reaches back): a slice
                    # it was given is dropped and its tokens go back to the budget
                    i -= 1
                    budget += self._unschedule(scheduled, victim)
                self._preempt(victim)
                preempted.append(victim.req_id)
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                i += 1
            # req itself preempted: the next request now sits at index i. Under fcfs req was the
            # last one; under priority the ones after it sort before it and may still fit.

        # 2) waiting requests, in the waiting queue's order, unless this step had to preempt
        if not preempted:
            skipped: list[Request] = []
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting.first()
                if (req.leader is not None and not self._leader_ready(req.leader)) or req.awaiting_last_token:
                    skipped.append(self.waiting.pop_first())
                    continue
                # counted once, on admission: a request waiting for room looks up again next step
                computed_blocks, num_cached, kv_tokens = self.kv.lookup_prefix(req.all_token_ids, req.cache_salt,
                                                                               record=False)
                if num_cached > req.num_prompt_logprob_rows and req.prompt_logprobs_pending:
                    # a cached prefix has no logits: the prompt positions whose logprobs are
                    # still missing are recomputed (upstream skips the cache the same way)
                    computed_blocks, num_cached, kv_tokens = [], 0, 0
                if not req.prompt_logprobs_pending and self.kv.waits_for_pending(
                        req.req_id, req.all_token_ids, req.cache_salt, num_cached):
                    # its next prefix block is being computed by a running request: admitted
                    # once that block is cached, it reuses it rather than computing it again
                    skipped.append(self.waiting.pop_first())
                    continue
                remaining = req.num_tokens - num_cached
                if not self.config.enable_chunked_prefill and remaining > budget:
                    break
                n = min(remaining, budget)
                if self.config.long_prefill_token_threshold > 0:
                    n = min(n, self.config.long_prefill_token_threshold)
                req.snapshot_branch = self._snapshot_branch(req, num_cached, kv_tokens)
                n = self._snapshot_cut(req, num_cached, n)
                if not self.kv.allocate_slots(req.req_id, num_cached + n, computed_blocks, req.cache_salt):
                    break
                self.waiting.pop_first()
                self.kv.record_prefix_query(req.num_tokens, num_cached)
                self.kv.mark_pending(req.req_id, req.all_token_ids, req.cache_salt, num_cached, req.num_prompt_tokens)
                req.num_computed_tokens = num_cached
                state_loads[req.req_id] = self.kv.state_snapshot(computed_blocks) if num_cached else -1
                if req.num_cached_tokens < 0:   # its first admission, not a re-admission after preemption
                    req.num_cached_tokens = num_cached
                    req.scheduled_time = time.monotonic()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                scheduled.append((req, n))
                budget -= n
            for req in reversed(skipped):
                self.waiting.put_back(req)

        out = []
        prompt_lp_indices = []
        get_table = self.kv.get_block_table
        recurrent = self.kv.state is not None
        saving: set[int] = set()   # the snapshot slots this step saves into: one save each
        for req, n in scheduled:
            start = req.num_computed_tokens
            p = req.params
            slot = load = save = -1
            if recurrent:
                slot = self.kv.state_slot(req.req_id)
                load = state_loads.get(req.req_id, -1)
                if start < req.num_prompt_tokens and start + n in self._snapshot_points(req):
                    save = self.kv.take_state_snapshot(req.req_id, start + n, saving, token_ids=req.prompt_token_ids,
                                                       cache_salt=req.cache_salt)
                    if save >= 0:
                        saving.add(save)
            # positional construction: this loop runs for every request every step
            out.append(ScheduledRequest(
                req.req_id, req.all_token_ids[start:start + n], start, get_table(req.req_id),
                start + n == req.num_tokens, p.temperature, p.top_k, p.top_p, p.min_p, req.seed,
                len(req.output_token_ids), -1 if p.logprobs is None else p.logprobs, p.logprobs_mode,
                req.banned_token_ids() if req.has_bans else (),
                (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, req.prompt_token_ids,
                 req.output_token_ids) if p.has_penalties else None, max(slot, 0), load, save))
            if start + n == req.num_tokens and (req.grammar is not None or req.controls is not None):
                self._token_controls(req, out[-1])
            if req.prompt_logprobs is not None and req.prompt_logprobs_pending:
                out[-1].prompt_logprobs = self._prompt_logprobs_slice(req, start, n)
                if out[-1].prompt_logprobs is not None:
                    prompt_lp_indices.append(len(out) - 1)
        return SchedulerOutput(requests=out, num_batched_tokens=self.config.max_num_batched_tokens - budget,
                               preempted=preempted, owners=[req for req, _ in scheduled],
                               prompt_logprob_indices=prompt_lp_indices)

    @staticmethod
    def _token_controls(req: Request, sr: ScheduledRequest) -> None:
        """The sampled token's mask (its grammar's, ANDed with allowed_token_ids') and logit_bias."""
        mask = req.grammar.next_bitmask() if req.grammar is not None and req.grammar_after is None else None
        controls = req.controls
        if controls is not None:
            allowed = controls.allowed_bitmask
            if allowed is not None:
                mask = allowed if mask is None else np.bitwise_and(mask, allowed)
            sr.logit_bias = controls.logit_bias
        sr.grammar_bitmask = mask

    @staticmethod
    def _unschedule(scheduled: list[tuple[Request, int]], req: Request) -> int:
        """Take `req`'s slice out of this step's `scheduled`; returns its token count (0: it had
        none, sitting this step out)."""
        for k, (r, _) in enumerate(scheduled):
            if r is req:
                return scheduled.pop(k)[1]
        return 0

    @staticmethod
    def _prompt_logprobs_slice(req: Request, start: int, n: int) -> PromptLogprobsSlice | None:
        """The prompt positions of [start, start + n) whose logprob rows are still missing:
        position q's row predicts prompt token q + 1."""
        first = max(start, req.num_prompt_logprob_rows)
        last = min(start + n, len(req.prompt_logprobs))
        if first >= last:
            return None
        p = req.params
        return PromptLogprobsSlice(first - start, first, req.prompt_token_ids[first + 1:last + 1], p.prompt_logprobs,
                                   p.temperature, p.logprobs_mode)

    def _leader_ready(self, leader: Request) -> bool:
        if not self.kv.enable_prefix_caching or leader.status.finished or leader.req_id not in self.requests:
            return True
        return leader.num_computed_tokens >= leader.num_prompt_tokens

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> tuple[list[Request], list[Request]]:
        """Advance progress; returns (requests that got a new token, requests finished by token rules)."""
        self.advance(sched)
        return self.finalize(sched, result)

    def _live(self, sched: SchedulerOutput):
        """(scheduled slice, Request) pairs whose request is still the one that was scheduled."""
        owners = sched.owners or [self.requests.get(sr.req_id) for sr in sched.requests]
        for sr, req in zip(sched.requests, owners):
            if req is not None and self.requests.get(sr.req_id) is req:
                yield sr, req

    def advance(self, sched: SchedulerOutput) -> None:
        """The step's effect that does not depend on sampled values: KV progress, prefix-cache
        registration of blocks now full of real tokens, and one PLACEHOLDER output token per
        sampling request. With async scheduling the next step is scheduled right after this,
        while the GPU still computes the tokens."""
        for sr, req in self._live(sched):
            req.num_computed_tokens += sr.num_new
            if sr.prompt_logprobs is not None:
                pl = sr.prompt_logprobs
                req.num_prompt_logprob_rows = max(req.num_prompt_logprob_rows, pl.first_position + len(pl.targets))
            self.kv.cache_blocks(req.req_id, req.all_token_ids, min(req.num_computed_tokens, self._real_prefix(req)))
            if sr.sample:
                req.append_output(PLACEHOLDER)
                # a length stop is known now: do not schedule past it
                req.finishing = len(req.output_token_ids) >= req.max_output_tokens

    def finalize(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> tuple[list[Request], list[Request]]:
        """Replace placeholders with the sampled tokens and apply the stop rules."""
        updated, finished = [], []
        for sr, req in self._live(sched):
            if sr.prompt_logprobs is not None:
                chunk = result.prompt_logprobs.get(sr.req_id)
                if chunk is not None:
                    a = chunk.first_target - 1
                    req.prompt_logprobs[a:a + len(chunk.entries)] = chunk.entries
            tok = result.sampled.get(sr.req_id) if sr.sample else None
            if tok is None:
                continue
            if req.output_token_ids and req.output_token_ids[-1] == PLACEHOLDER:
                req.output_token_ids[-1] = tok.token_id
                req.all_token_ids[-1] = tok.token_id
            if tok.logprob is not None:
                req.logprobs.append((tok.logprob, tok.rank, tok.top or []))
                req.cumulative_logprob += tok.logprob
            updated.append(req)
            status = req.check_token_stop()
            if req.grammar is not None and status is None:
                if req.grammar_after is None:
                    status = self._advance_grammar(req, tok.token_id)
                elif tuple(req.output_token_ids[-len(req.grammar_after):]) == req.grammar_after:
                    req.grammar_after = None   # the grammar constrains the tokens from the next on
            if status is not None:
                finished.extend(self.finish_requests([req.req_id], status))
        return updated, finished

    @staticmethod
    def _advance_grammar(req: Request, token_id: int) -> RequestStatus | None:
        """Feed the sampled token to the request's matcher; a grammar that has accepted its
        stop token (eos also under ignore_eos) ends the request. A token the grammar rejects
        can only come from a row the mask left empty: the request stops there."""
        if not req.grammar.accept(token_id):
            logger.warning("request %s: token %d is not allowed by its grammar; stopping it", req.req_id, token_id)
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if req.grammar.terminated:
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        return None

    @staticmethod
    def _real_prefix(req: Request) -> int:
        """Tokens before the first placeholder: only those may be hashed into the cache."""
        if req.output_token_ids and req.output_token_ids[-1] == PLACEHOLDER:
            return req.num_tokens - 1
        return req.num_tokens
