"""The sampling side of a step: the sampler's batches built from the scheduled requests
(logit biases, penalties, grammar and allowed-token masks, EOS and bad-word bans, one call per
logprobs mode), prompt logprobs through
the same logprob head, the outputs' copies to the host started without waiting, and their
collection once the step's event fires."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch
from torch import nn

from vllm.config import EngineConfig
from vllm.core.messages import ModelRunnerOutput, PromptLogprobsChunk, SampledToken, SchedulerOutput
from vllm.core.request import PLACEHOLDER
from vllm.forward_context import ForwardContext, set_forward_context
from vllm.host_copy import to_device
from vllm.sample.sampler import (LogitBias, Penalties, Sampler, SamplerOutput, SamplingBatch, TokenBan, TokenMask,
                                  prompt_logprob_values, stable_topk)


@dataclass
class StepHandle:
    """A launched step: its sampled requests, the sampler outputs still on the device,
    and the sampled token ids as one device tensor (row_of: request id -> row)."""
    reqs: list
    groups: list
    token_ids: torch.Tensor | None
    row_of: dict
    event: object = None   # CUDA event recorded after the host copies were enqueued
    # prompt logprobs: (per request (id, slice, first row in the outputs), SamplerOutput
    # with token_ids = the targets), one per logprobs mode
    prompt_parts: list = field(default_factory=list)


class SamplingLauncher:
    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device,
                 mark: Callable[[str | None], None] = lambda phase: None):
        self.config, self.model, self.device, self._mark = config, model, device, mark
        self.sampler = Sampler(fused_gumbel=config.kernels.fused_gumbel)
        # with async scheduling on CUDA, outputs go to pinned host memory behind an event, so
        # that waiting for this step does not also wait for the step enqueued after it
        self.copy_async = self.device.type == "cuda" and config.async_scheduling

    def _h2d(self, values, dtype: torch.dtype | None = None) -> torch.Tensor:
        return to_device(values, dtype, self.device)  # never a host sync (vllm/host_copy.py)

    def _event(self):
        if not self.copy_async:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def prompt_only(self, prompt_parts: list | None) -> StepHandle:
        """The handle of a step that sampled nothing (its prompt logprobs, if any)."""
        handle = StepHandle([], [], None, {})
        if prompt_parts:
            handle.prompt_parts = prompt_parts
            handle.event = self._event()
        return handle

    # ---- prompt logprobs ------------------------------------------------------------------
    def prompt_logprobs(self, hidden: torch.Tensor, sched: SchedulerOutput, cu: np.ndarray) -> list:
        """Prompt logprobs of the step's rows at prompt positions (the requests that asked).

        The same logprob head as the sampled tokens: the model's compute_logits on the
        rows, then the sampler's operations on float32 logits (prompt_logprob_values), so
        a prompt token's logprob has the bits the sampler gives when it samples that token
        after the same prefix, and Policy.token_logprobs' bits. Rows go through the head
        in chunks of at most rows_per_chunk (the trainer's float32 logits budget): every
        op is per row, so the chunking changes no bit."""
        from vllm.training.logprob_head import rows_per_chunk
        by_mode: dict[str, list] = {}
        for i in sched.prompt_logprob_indices:
            r = sched.requests[i]
            by_mode.setdefault(r.prompt_logprobs.logprobs_mode, []).append((r.req_id, r.prompt_logprobs, int(cu[i])))
        chunk = rows_per_chunk(self.config.model.vocab_size)
        parts = []
        with set_forward_context(ForwardContext(None, self.config.numerics, self.config.kernels)):
            for mode, items in by_mode.items():
                counts = [len(pl.targets) for _, pl, _ in items]
                rows = np.concatenate([np.arange(base + pl.first_row, base + pl.first_row + len(pl.targets))
                                       for _, pl, base in items])
                rows_t = self._h2d(rows, torch.long)
                targets_t = self._h2d(list(itertools.chain.from_iterable(pl.targets for _, pl, _ in items)), torch.long)
                temps_t = self._h2d(np.repeat([pl.temperature for _, pl, _ in items], counts), torch.float32)
                num_top = max(pl.num_top for _, pl, _ in items)
                values, ranks, top_v, top_i = [], [], [], []
                for a in range(0, len(rows), chunk):
                    b = min(len(rows), a + chunk)
                    dist = prompt_logprob_values(self.model.compute_logits(hidden.index_select(0, rows_t[a:b])),
                                                 temps_t[a:b], mode)
                    v = dist.gather(1, targets_t[a:b, None])
                    values.append(v[:, 0])
                    ranks.append((dist > v).sum(dim=-1) + 1)   # an exact integer count, as the sampler's
                    if num_top > 0:
                        tv, ti = stable_topk(dist, num_top)
                        top_v.append(tv)
                        top_i.append(ti)
                    del dist
                out = SamplerOutput(token_ids=targets_t, logprobs=torch.cat(values), ranks=torch.cat(ranks),
                                    topk_ids=torch.cat(top_i) if num_top > 0 else None,
                                    topk_logprobs=torch.cat(top_v) if num_top > 0 else None)
                offsets = np.concatenate(([0], np.cumsum(counts)[:-1]))
                parts.append(([(rid, pl, int(o)) for (rid, pl, _), o in zip(items, offsets)], self._to_host_async(out)))
        self._mark("prompt_logprobs")
        return parts

    # ---- sampled tokens -------------------------------------------------------------------
    def _penalties(self, reqs, prev: StepHandle | None) -> Penalties | None:
        """The Penalties of a sampler call over `reqs` (None when none has any). An output
        token still on the device (PLACEHOLDER, async scheduling) is read from `prev`."""
        rows = [j for j, r in enumerate(reqs) if r.penalties is not None]
        if not rows:
            return None
        out_ids, out_slot, prompt_ids, prompt_slot, fill_slot, fill_src = [], [], [], [], [], []
        for slot, j in enumerate(rows):
            r = reqs[j]
            _, _, rep, prompt, output = r.penalties
            for t in output:
                if t == PLACEHOLDER:
                    fill_slot.append(slot)
                    fill_src.append(prev.row_of[r.req_id])
                else:
                    out_ids.append(t)
                    out_slot.append(slot)
            if rep != 1.0:
                prompt_ids += prompt
                prompt_slot += [slot] * len(prompt)
        ids, slots = self._h2d(out_ids, torch.long), self._h2d(out_slot, torch.long)
        if fill_slot:
            ids = torch.cat([ids, prev.token_ids[self._h2d(fill_src, torch.long)]])
            slots = torch.cat([slots, self._h2d(fill_slot, torch.long)])
        return Penalties(rows=self._h2d(rows, torch.long),
                         presence=self._h2d([reqs[j].penalties[0] for j in rows], torch.float32),
                         frequency=self._h2d([reqs[j].penalties[1] for j in rows], torch.float32),
                         repetition=self._h2d([reqs[j].penalties[2] for j in rows], torch.float32),
                         output_ids=ids, output_slot=slots,
                         prompt_ids=self._h2d(prompt_ids, torch.long), prompt_slot=self._h2d(prompt_slot, torch.long))

    def _logit_bias(self, reqs) -> LogitBias | None:
        """The logit biases of a sampler call over `reqs` (None when no row has one)."""
        rows = [j for j, r in enumerate(reqs) if r.logit_bias is not None]
        if not rows:
            return None
        return LogitBias(rows=self._h2d([j for j in rows for _ in reqs[j].logit_bias[0]], torch.long),
                         token_ids=self._h2d([t for j in rows for t in reqs[j].logit_bias[0]], torch.long),
                         values=self._h2d([v for j in rows for v in reqs[j].logit_bias[1]], torch.float32))

    def _token_mask(self, reqs) -> TokenMask | None:
        """The token masks of a sampler call over `reqs` (None when no row is constrained):
        the scheduler computed each from its request's own grammar matcher and
        allowed_token_ids."""
        rows = [j for j, r in enumerate(reqs) if r.grammar_bitmask is not None]
        if not rows:
            return None
        return TokenMask(rows=self._h2d(rows, torch.long),
                         bitmask=self._h2d(np.stack([reqs[j].grammar_bitmask for j in rows]), torch.int32))

    def _token_ban(self, reqs) -> TokenBan | None:
        """The tokens each row of a sampler call over `reqs` may not sample: EOS and stop
        tokens while min_tokens is not reached, bad words' bans (None when no row bans any).
        The sampler applies them as it applies grammar masks, so the reported logprobs
        (tempered, raw) keep the model's distribution, the one the trainer recomputes."""
        rows = [j for j, r in enumerate(reqs) for _ in r.banned_token_ids]
        if not rows:
            return None
        return TokenBan(rows=self._h2d(rows, torch.long),
                        token_ids=self._h2d([t for r in reqs for t in r.banned_token_ids], torch.long))

    def launch(self, logits: torch.Tensor, reqs, prev: StepHandle | None = None) -> StepHandle:
        # One sampler call per logprobs mode keeps every row's result its own.
        by_mode: dict = {}
        for i, r in enumerate(reqs):
            by_mode.setdefault(r.logprobs_mode if r.num_logprobs >= 0 else None, []).append(i)
        groups = []
        token_ids = torch.empty(len(reqs), dtype=torch.long, device=self.device)
        for mode, idx in by_mode.items():
            sub = [reqs[i] for i in idx]
            batch = SamplingBatch.from_lists(
                temperature=[r.temperature for r in sub], top_k=[r.top_k for r in sub], top_p=[r.top_p for r in sub],
                min_p=[r.min_p for r in sub], seeds=[r.seed for r in sub], positions=[r.output_index for r in sub],
                device=self.device, max_num_logprobs=max(r.num_logprobs for r in sub),
                logprobs_mode=mode or "tempered_logprobs")
            batch.logit_bias = self._logit_bias(sub)
            batch.penalties = self._penalties(sub, prev)
            batch.token_mask = self._token_mask(sub)
            batch.token_ban = self._token_ban(sub)
            so = self.sampler(logits if len(by_mode) == 1 else logits.index_select(0, self._h2d(idx, torch.long)), batch)
            if len(by_mode) == 1:
                token_ids = so.token_ids
            else:
                token_ids[self._h2d(idx, torch.long)] = so.token_ids
            groups.append((idx, self._to_host_async(so)))
        return StepHandle(reqs, groups, token_ids, {r.req_id: i for i, r in enumerate(reqs)}, self._event())

    def _to_host_async(self, so: SamplerOutput) -> SamplerOutput:
        """Start copying the sampler's outputs into pinned host memory (async scheduling)."""
        if not self.copy_async:
            return so  # synchronous loop: collect() reads the device tensors right away

        def host(t):
            if t is None:
                return None
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buf.copy_(t, non_blocking=True)
            return buf
        return replace(so, token_ids=host(so.token_ids), logprobs=host(so.logprobs), ranks=host(so.ranks),
                       topk_ids=host(so.topk_ids), topk_logprobs=host(so.topk_logprobs))

    # ---- collection -----------------------------------------------------------------------
    @staticmethod
    def collect(handle: StepHandle) -> ModelRunnerOutput:
        """Wait for the step and bring its sampled tokens (and logprobs) to the host."""
        result: dict[str, SampledToken] = {}
        if handle.event is not None:
            handle.event.synchronize()
        for idx, so in handle.groups:
            ids = so.token_ids.tolist()
            lps = so.logprobs.tolist() if so.logprobs is not None else None
            ranks = so.ranks.tolist() if so.ranks is not None else None
            top_ids = so.topk_ids.tolist() if so.topk_ids is not None else None
            top_lps = so.topk_logprobs.tolist() if so.topk_logprobs is not None else None
            for j, i in enumerate(idx):
                r = handle.reqs[i]
                tok = SampledToken(token_id=ids[j])
                if r.num_logprobs >= 0 and lps is not None:
                    tok.logprob, tok.rank = lps[j], ranks[j]
                    if r.num_logprobs > 0 and top_ids is not None:
                        tok.top = list(zip(top_ids[j][:r.num_logprobs], top_lps[j][:r.num_logprobs]))
                result[r.req_id] = tok
        prompt: dict[str, PromptLogprobsChunk] = {}
        for items, so in handle.prompt_parts:
            lps, ranks = so.logprobs.tolist(), so.ranks.tolist()
            top_ids = so.topk_ids.tolist() if so.topk_ids is not None else None
            top_lps = so.topk_logprobs.tolist() if so.topk_logprobs is not None else None
            for rid, pl, o in items:
                k = pl.num_top
                entries = [(lps[j], ranks[j], list(zip(top_ids[j][:k], top_lps[j][:k])) if k > 0 else [])
                           for j in range(o, o + len(pl.targets))]
                prompt[rid] = PromptLogprobsChunk(pl.first_position + 1, entries)
        return ModelRunnerOutput(sampled=result, prompt_logprobs=prompt)
