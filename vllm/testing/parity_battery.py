"""The invariance battery: the same requests through every execution layout that
must not change bits, compared by bit pattern.

Each check returns a `CheckResult(name, comparisons, differing, detail)`. In
`invariant` mode every `differing` must be 0 (tests assert it); in `fast` mode
on a GPU the counts show the problem the invariant mode removes
(`benchmarks/parity_battery.py` prints both).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

from vllm.sampling_params import SamplingParams


@dataclass
class CheckResult:
    name: str
    comparisons: int
    differing: int
    detail: str = ""


def _bits(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float32).view(torch.int32).item())


def signature(completion) -> tuple:
    """Token ids plus the bit pattern of each sampled token's float32 logprob."""
    lps = tuple(_bits(completion.logprobs[i][t].logprob) for i, t in enumerate(completion.token_ids)) if completion.logprobs else ()
    return tuple(completion.token_ids), lps


def _prompt(rng: random.Random, vocab: int, n: int) -> dict:
    return {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]}


class Battery:
    """`make_llm(**overrides)` builds an LLM of the model under test with engine overrides."""

    def __init__(self, make_llm: Callable, vocab: int, seed: int = 0, max_tokens: int = 8,
                 batch_sizes=(2, 5), long_len: int = 40):
        self.make_llm = make_llm
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.max_tokens = max_tokens
        self.batch_sizes = batch_sizes
        self.long_len = long_len
        self._base = None

    @property
    def base(self):
        if self._base is None:
            self._base = self.make_llm()
        return self._base

    def params(self, **kw) -> SamplingParams:
        d = dict(temperature=1.0, max_tokens=self.max_tokens, seed=1234, logprobs=0, ignore_eos=True)
        d.update(kw)
        return SamplingParams(**d)

    # 1. a request alone vs at every slot of batches mixed with random others
    def batch_slots(self) -> CheckResult:
        target = _prompt(self.rng, self.vocab, 13)
        ref = signature(self.base.generate(target, self.params(), use_tqdm=False)[0].outputs[0])
        comps = diff = 0
        for b in self.batch_sizes:
            for slot in range(b):
                others = [_prompt(self.rng, self.vocab, self.rng.randrange(1, self.long_len)) for _ in range(b - 1)]
                batch = others[:slot] + [target] + others[slot:]
                params = [self.params(seed=self.rng.randrange(1 << 30)) for _ in batch]
                params[slot] = self.params()
                out = self.base.generate(batch, params, use_tqdm=False)[slot].outputs[0]
                comps += 1
                diff += signature(out) != ref
        return CheckResult("alone vs every slot of mixed batches", comps, diff)

    # 2. full prefill vs token-by-token decode of the same sequence
    def prefill_vs_decode(self) -> CheckResult:
        prompt = _prompt(self.rng, self.vocab, 21)["prompt_token_ids"]
        out = self.base.generate({"prompt_token_ids": prompt}, self.params(temperature=0.0), use_tqdm=False)[0].outputs[0]
        comps = diff = 0
        for i in range(1, len(out.token_ids)):
            # the prompt now contains i generated tokens: they are prefilled, not decoded
            again = self.base.generate({"prompt_token_ids": prompt + out.token_ids[:i]},
                                       self.params(temperature=0.0, max_tokens=1), use_tqdm=False)[0].outputs[0]
            comps += 1
            tok = again.token_ids[0]
            diff += not (tok == out.token_ids[i] and _bits(again.logprobs[0][tok].logprob) == _bits(out.logprobs[i][tok].logprob))
        return CheckResult("decode vs prefill of the same prefix", comps, diff)

    # 3. chunked prefill with several chunk sizes (chunks ending mid-block)
    def chunked_prefill(self, budgets=(5, 16, 37)) -> CheckResult:
        prompts = [_prompt(self.rng, self.vocab, n) for n in (self.long_len, self.long_len // 2 + 3, 7)]
        ref = [signature(o.outputs[0]) for o in self.base.generate(prompts, self.params(), use_tqdm=False)]
        comps = diff = 0
        for budget in budgets:
            llm = self.make_llm(max_num_batched_tokens=budget)
            outs = [signature(o.outputs[0]) for o in llm.generate(prompts, self.params(), use_tqdm=False)]
            comps += len(outs)
            diff += sum(a != b for a, b in zip(outs, ref))
            del llm
        return CheckResult("chunked prefill (budgets %s) vs whole" % (budgets,), comps, diff)

    # 4. prefix cache cold vs warm
    def prefix_cache(self) -> CheckResult:
        shared = _prompt(self.rng, self.vocab, self.long_len)["prompt_token_ids"]
        tails = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
        llm = self.make_llm()  # fresh cache
        cold = [signature(llm.generate({"prompt_token_ids": shared + t}, self.params(), use_tqdm=False)[0].outputs[0]) for t in tails]
        comps = diff = hits = 0
        for t, c in zip(tails, cold):
            o = llm.generate({"prompt_token_ids": shared + t}, self.params(), use_tqdm=False)[0]
            hits += o.num_cached_tokens > 0
            comps += 1
            diff += signature(o.outputs[0]) != c
        nocache = self.make_llm(enable_prefix_caching=False)
        for t, c in zip(tails, cold):
            comps += 1
            diff += signature(nocache.generate({"prompt_token_ids": shared + t}, self.params(), use_tqdm=False)[0].outputs[0]) != c
        return CheckResult("prefix cache warm vs cold vs disabled", comps, diff, f"{hits} warm hits")

    # 5. CUDA graph replay (with bucket padding) vs eager
    def cuda_graph_vs_eager(self) -> CheckResult:
        prompts = [_prompt(self.rng, self.vocab, self.rng.randrange(3, self.long_len)) for _ in range(11)]
        eager = self.make_llm(enforce_eager=True)
        a = [signature(o.outputs[0]) for o in eager.generate(prompts, self.params(), use_tqdm=False)]
        del eager
        graph = self.make_llm(enforce_eager=False, cuda_graph_batch_sizes=[1, 2, 4, 8, 16])
        b = [signature(o.outputs[0]) for o in graph.generate(prompts, self.params(), use_tqdm=False)]
        return CheckResult("CUDA graph (padded buckets) vs eager", len(a), sum(x != y for x, y in zip(a, b)))

    # 6. forced preemption and recompute
    def preemption(self, num_blocks: int | None = None) -> CheckResult:
        prompts = [_prompt(self.rng, self.vocab, n) for n in (30, 25, 35, 20, 28, 33)]
        if num_blocks is None:
            # room for about two and a half of the longest requests at once
            bs = self.base.config.cache.block_size
            num_blocks = 1 + -(-(5 * (35 + 16)) // (2 * bs))
        ref = [signature(o.outputs[0]) for o in self.base.generate(prompts, self.params(max_tokens=16), use_tqdm=False)]
        small = self.make_llm(num_gpu_blocks_override=num_blocks, max_num_batched_tokens=64)
        outs = [signature(o.outputs[0]) for o in small.generate(prompts, self.params(max_tokens=16), use_tqdm=False)]
        pre = small.llm_engine.scheduler.num_preemptions
        return CheckResult("preemption + recompute vs none", len(outs), sum(a != b for a, b in zip(outs, ref)), f"{pre} preemptions")

    # 7. many identical requests
    def identical_requests(self, n: int = 200, n_seeds: int = 10) -> CheckResult:
        prompt = _prompt(self.rng, self.vocab, 9)
        greedy = self.base.generate([prompt] * n, self.params(temperature=0.0), use_tqdm=False)
        distinct = len({signature(o.outputs[0]) for o in greedy})
        params = [self.params(seed=i % n_seeds) for i in range(n)]
        outs = self.base.generate([prompt] * n, params, use_tqdm=False)
        by_seed: dict[int, set] = {}
        for i, o in enumerate(outs):
            by_seed.setdefault(i % n_seeds, set()).add(signature(o.outputs[0]))
        # another layout: the seeds in another order, fewer sequences per step
        other = self.make_llm(max_num_seqs=7)
        order = list(range(n))
        self.rng.shuffle(order)
        outs2 = other.generate([prompt] * n, [params[i] for i in order], use_tqdm=False)
        for j, o in enumerate(outs2):
            by_seed[order[j] % n_seeds].add(signature(o.outputs[0]))
        diff = (distinct - 1) + sum(len(s) - 1 for s in by_seed.values())
        return CheckResult(f"{n} identical requests (T=0 distinct={distinct}; T=1 per-seed)", 1 + n_seeds, diff)

    def run_all(self, gpu: bool = False) -> list[CheckResult]:
        checks = [self.batch_slots, self.prefill_vs_decode, self.chunked_prefill, self.prefix_cache, self.preemption,
                  self.identical_requests]
        if gpu:
            checks.append(self.cuda_graph_vs_eager)
        return [c() for c in checks]


def cpu_battery(path: str, **engine_options) -> "Battery":
    """The battery on CPU invariant engines of a tiny checkpoint (float32, 4-token blocks)."""
    from vllm import LLM

    def make(**kw):
        opts = dict(device="cpu", dtype="float32", numerics="invariant", block_size=4, max_num_batched_tokens=512)
        opts.update(engine_options)
        opts.update(kw)
        return LLM(path, **opts)
    return Battery(make, vocab=512, max_tokens=5, batch_sizes=(2, 4), long_len=30)


BATTERY_CHECKS = ("batch_slots", "prefill_vs_decode", "chunked_prefill", "prefix_cache", "preemption")


def battery_check_params(n_identical: int, n_seeds: int) -> list:
    """pytest parameters (check, options): every BATTERY_CHECKS check, then identical_requests
    with `n_identical` requests and `n_seeds` seeds."""
    import pytest

    return [*(pytest.param(c, {}, id=c) for c in BATTERY_CHECKS),
            pytest.param("identical_requests", dict(n=n_identical, n_seeds=n_seeds), id="identical_requests")]


def run_zero_check(battery: "Battery", check: str, **check_options):
    """One battery check, asserting it compared something and no bits differed; its result."""
    res = getattr(battery, check)(**check_options)
    assert res.comparisons > 0
    assert res.differing == 0, f"{res.name}: {res.differing}/{res.comparisons} differ ({res.detail})"
    return res


def run_exercised_check(battery: "Battery", check: str, **check_options):
    """run_zero_check, also asserting the check exercised what it compares: every one of the
    prefix-cache check's 3 tails hit the warm cache, and the preemption check preempted."""
    res = run_zero_check(battery, check, **check_options)
    if check == "prefix_cache":
        assert res.detail.startswith("3 ")
    if check == "preemption":
        assert not res.detail.startswith("0 ")
    return res
