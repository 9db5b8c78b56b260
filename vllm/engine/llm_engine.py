"""The engine: requests in, RequestOutputs out, one scheduler step at a time.

add_request validates and tokenizes (so bad input fails before it can touch a
batch), the scheduler picks the step, the model runner executes it, and the
output processor detokenizes, applies stop strings and builds RequestOutputs.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import random
import time
from dataclasses import dataclass

from vllm.config import EngineConfig
from vllm.core.kv_cache_manager import KVCacheManager
from vllm.core.request import Request, RequestStatus
from vllm.core.scheduler import Scheduler
from vllm.outputs import CompletionOutput, Logprob, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.tokenizer import IncrementalDetokenizer, load_tokenizer
from vllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def derive_seed(seed: int, index: int) -> int:
    """Seed of the index-th sample of an n>1 request: a fixed function of (seed, index)."""
    if index == 0:
        return seed
    h = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 62) - 1)


@dataclass
class _Group:
    """All n samples of one user request."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    detoks: list[IncrementalDetokenizer | None]
    texts: list[str]
    finish: list[str | None]
    # stream=True: step() also returns this group's unfinished outputs (text so far)
    # each step it advances, for servers that stream tokens as they are sampled.
    stream: bool = False
    # Per child, the logprob dicts already built: a streamed request's output is
    # rebuilt every step, and re-decoding every past token each time would be quadratic.
    lp_cache: list[list[dict[int, Logprob]]] | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer or config.model.path)
        self.runner = ModelRunner(config)
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self._rng = random.Random(config.seed)
        self._groups: dict[str, _Group] = {}
        self._child_to_group: dict[str, str] = {}
        self._counter = itertools.count()
        self.eos_token_ids = list(config.model.eos_token_ids)
        if not self.eos_token_ids and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = [self.tokenizer.eos_token_id]
        self.step_count = 0
        self.weight_version = 0
        self._inflight = None   # async scheduling: (SchedulerOutput, StepHandle) of the step on the GPU

    # ---- input ------------------------------------------------------------------------
    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"], add_special_tokens=True)
        raise ValueError(f"a prompt is a string or a dict with 'prompt_token_ids' (or 'prompt'), got {type(prompt).__name__}")

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        vocab = self.config.model.vocab_size
        if len(token_ids) == 0:
            raise ValueError("the prompt is empty")
        bad = [t for t in token_ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        max_len = self.config.model.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but the model's context is {max_len}: no room to generate")
        if params.stop_token_ids and any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids outside the vocabulary [0, {vocab})")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs={params.logprobs} exceeds the vocabulary size {vocab}")

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None, *,
                    stream: bool = False) -> str:
        """Validate and queue one request; `stream=True` makes step() also report its progress."""
        params = params or SamplingParams()
        text, ids = self.tokenize(prompt)
        self.validate(ids, params)
        request_id = request_id if request_id is not None else str(next(self._counter))
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        children, leader = [], None
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, ids, params, derive_seed(base_seed, i), self.eos_token_ids,
                          self.config.model.max_model_len, leader=leader, parent_id=request_id, index=i)
            leader = leader or req
            children.append(req)
        group = _Group(request_id, text, ids, params, children,
                       [IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens) if params.detokenize else None for _ in children],
                       ["" for _ in children], [None for _ in children], stream=stream,
                       lp_cache=[[] for _ in children])
        self._groups[request_id] = group
        for req in children:
            self._child_to_group[req.req_id] = request_id
            self.scheduler.add_request(req)
        return request_id

    def on_weights_updated(self) -> None:
        """The parameters changed in place (colocated trainer step or weight sync):
        count the version and drop cached prefixes computed with the old weights."""
        self.weight_version += 1
        if not self.kv.reset_prefix_cache():
            raise RuntimeError("weights were updated while requests were running: their KV mixes two weight "
                               "versions; update weights only between generate calls")

    def abort_request(self, request_id: str) -> None:
        group = self._groups.get(request_id)
        if group is None:
            return
        self.scheduler.finish_requests([c.req_id for c in group.children], RequestStatus.FINISHED_ABORTED)
        for c in group.children:
            self._child_to_group.pop(c.req_id, None)
        del self._groups[request_id]
        if not self.scheduler.has_unfinished():
            self.drain()  # nothing left to run: do not leave a step in flight

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- one step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step. Returns the outputs of the requests that finished in it,
        plus (finished=False) the outputs so far of stream=True requests it advanced."""
        if self.config.async_scheduling:
            return self._step_async()
        prof = self.runner.profile
        t0 = time.perf_counter() if prof else 0.0
        sched = self.scheduler.schedule()
        if prof:
            self.runner.timings["schedule"] += time.perf_counter() - t0
        if not sched.requests:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not schedule any request: the KV cache is too small for one request")
            return []
        result = self.runner.execute(sched)
        t1 = time.perf_counter() if prof else 0.0
        updated, finished = self.scheduler.update(sched, result)
        self.step_count += 1
        outs = self._process(updated, finished)
        if prof:
            self.runner.timings["update+output"] += time.perf_counter() - t1
        return outs

    def _step_async(self) -> list[RequestOutput]:
        """Async scheduling: step N+1 is scheduled, packed and enqueued on the GPU before
        the host waits for step N's tokens, so host work overlaps GPU work. Tokens of N
        enter N+1 as placeholders filled on the device; a request that N's tokens end
        (eos, stop string) has computed one extra token in N+1, which is dropped. The
        tokens, their logprobs and the RNG positions are those of the synchronous loop."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self.scheduler.advance(prev[0])
        sched = self.scheduler.schedule()
        try:
            handle = self.runner.launch(sched, prev[1] if prev is not None else None) if sched.requests else None
        except BaseException:
            # keep the scheduler consistent (no placeholder left behind) before re-raising
            if prev is not None:
                self.scheduler.finalize(prev[0], self.runner.collect(prev[1]))
            raise
        self._inflight = (sched, handle) if handle is not None else None
        if prev is None:
            if handle is None and self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not schedule any request: the KV cache is too small for one request")
            return []
        result = self.runner.collect(prev[1])
        updated, finished = self.scheduler.finalize(prev[0], result)
        self.step_count += 1
        return self._process(updated, finished)

    def drain(self) -> list[RequestOutput]:
        """Async scheduling: finish the step still on the GPU (if any) and process it."""
        outs = []
        while self._inflight is not None and not self.scheduler.has_unfinished():
            sched, handle = self._inflight
            self._inflight = None
            self.scheduler.advance(sched)
            outs += self._process(*self.scheduler.finalize(sched, self.runner.collect(handle)))
        return outs

    def _process(self, updated: list[Request], finished: list[Request]) -> list[RequestOutput]:
        """Detokenize, apply stop strings, and build the outputs of finished (or streamed) groups."""
        touched: dict[str, _Group] = {}
        for req in updated:
            gid = self._child_to_group[req.req_id]
            group = self._groups[gid]
            touched[gid] = group
            stop = self._detokenize(group, req)
            if stop is not None and not req.status.finished:
                req.stop_reason = stop
                self.scheduler.finish_requests([req.req_id], RequestStatus.FINISHED_STOPPED)
        for req in finished + [r for r in updated if r.status.finished]:
            gid = self._child_to_group[req.req_id]
            group = self._groups[gid]
            touched[gid] = group
            if group.finish[req.index] is None:
                group.finish[req.index] = req.status.value
        outs = []
        for gid, group in touched.items():
            done = all(f is not None for f in group.finish)
            if done:
                outs.append(self._make_output(group, True))
                del self._groups[gid]
                for c in group.children:
                    self._child_to_group.pop(c.req_id, None)
            elif group.stream:
                outs.append(self._make_output(group, False))
        return outs

    def _detokenize(self, group: _Group, req: Request) -> str | None:
        """Append the new token's text; returns the stop string hit, if any."""
        detok = group.detoks[req.index]
        if detok is None:
            return None
        before = len(detok.text)
        detok.append(req.output_token_ids[-1])
        stops = group.params.stop_strings
        if not stops:
            return None
        text = detok.text
        # Only a match that ends in the new text is new: start one stop-string length before it.
        window_start = max(0, before - max(len(s) for s in stops) + 1)
        hits = [(pos, s) for s in stops if (pos := text.find(s, window_start)) >= 0]
        if not hits:
            return None
        pos, s = min(hits)  # the earliest stop string in the text wins
        detok.text = text[:pos + len(s)] if group.params.include_stop_str_in_output else text[:pos]
        return s

    def _make_output(self, group: _Group, finished: bool) -> RequestOutput:
        outs = []
        for i, req in enumerate(group.children):
            lps = None
            if group.params.logprobs is not None:
                # Output tokens are append-only (preemption recomputes KV, not tokens), so
                # only the entries of tokens sampled since the last call need building.
                cache = group.lp_cache[i]
                for tok, (lp, rank, top) in zip(req.output_token_ids[len(cache):], req.logprobs[len(cache):]):
                    entry = {tok: Logprob(lp, rank, self._decode_one(tok))}
                    for r, (tid, tlp) in enumerate(top, start=1):
                        if tid not in entry:
                            entry[tid] = Logprob(tlp, r, self._decode_one(tid))
                    cache.append(entry)
                lps = list(cache)
            detok = group.detoks[i]
            outs.append(CompletionOutput(
                index=i, text=detok.text if detok is not None else "", token_ids=list(req.output_token_ids),
                cumulative_logprob=req.cumulative_logprob if group.params.logprobs is not None else None,
                logprobs=lps, finish_reason=group.finish[i], stop_reason=req.stop_reason))
        cached = max(0, group.children[0].num_cached_tokens)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, finished, num_cached_tokens=cached)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
