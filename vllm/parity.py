"""Divergence finder: run the rollout path and the training path on the same
tokens, capture every module's output, and report the first op whose bits differ.

    vllm parity [--model DIR] [--numerics invariant] [--prompt-len 24] [--max-tokens 16]
    python -m vllm.parity ...

The rollout runs eagerly (forward hooks do not fire inside CUDA graph replays;
graph-vs-eager bits are covered by the parity battery), one request, so each
step's rows map to known absolute positions. The training path is the
colocated Policy's `token_logprobs` on the generated sequence.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch


@dataclass
class OpDiff:
    module: str
    op: str
    rows: int
    differing_rows: int
    max_abs_diff: float
    first_index: tuple | None


@dataclass
class ParityReport:
    ops: list[OpDiff] = field(default_factory=list)
    logprobs_equal: bool = True
    logprob_max_abs_diff: float = 0.0

    @property
    def first_divergence(self) -> OpDiff | None:
        return next((o for o in self.ops if o.differing_rows), None)

    def format(self) -> str:
        lines = [f"{'module':<44}{'op':<16}{'rows':>6}{'differ':>8}{'max |diff|':>13}  first index"]
        for o in self.ops:
            lines.append(f"{o.module[:43]:<44}{o.op[:15]:<16}{o.rows:>6}{o.differing_rows:>8}{o.max_abs_diff:>13.3e}  "
                         f"{o.first_index if o.first_index is not None else ''}")
        first = self.first_divergence
        lines.append("")
        lines.append("first divergence: " + (f"{first.module} ({first.op}) max |diff| {first.max_abs_diff:.3e} at "
                                             f"(position, element) {first.first_index}" if first else "none: every op is bit-identical"))
        lines.append(f"token logprobs bit-identical: {self.logprobs_equal} (max |diff| {self.logprob_max_abs_diff:.3e})")
        return "\n".join(lines)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
                   torch.float64: torch.int64}.get(t.dtype, t.dtype))


class _Recorder:
    """Forward hooks that store each module's output rows keyed by absolute position."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.positions: torch.Tensor | None = None
        self.row_positions: torch.Tensor | None = None  # positions of the lm_head rows
        self.store: dict[str, dict[int, torch.Tensor]] = {}
        self.order: list[str] = []
        self.kinds: dict[str, str] = {}
        self.handles = []

    def __enter__(self):
        self.handles.append(self.model.register_forward_pre_hook(self._pre, with_kwargs=False))
        for name, mod in self.model.named_modules():
            if name and len(list(mod.children())) == 0 or type(mod).__name__ in ("DecoderLayer", "SelfAttention", "MLP"):
                self.kinds[name] = type(mod).__name__
                self.handles.append(mod.register_forward_hook(self._make_hook(name)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _pre(self, module, args):
        self.positions = args[1].detach().to("cpu")

    def _make_hook(self, name):
        def hook(module, args, output):
            outs = output if isinstance(output, tuple) else (output,)
            for j, o in enumerate(outs):
                if not torch.is_tensor(o) or o.dim() == 0:
                    continue
                key = name if j == 0 else f"{name}[{j}]"
                if key not in self.store:
                    self.store[key] = {}
                    self.order.append(key)
                    self.kinds[key] = self.kinds.get(name, type(module).__name__)
                pos = self.row_positions if name.endswith("lm_head") else self.positions
                if pos is None or len(pos) != o.shape[0]:
                    continue
                rows = o.detach().to("cpu")
                for r, p in enumerate(pos.tolist()):
                    self.store[key].setdefault(int(p), rows[r].clone())
        return hook


def find_divergence(llm, prompt: list[int], max_tokens: int = 16, temperature: float = 1.0, seed: int = 0,
                    perturb_training=None) -> tuple[ParityReport, list[int]]:
    """`perturb_training(model)` may register hooks that alter the training path only
    (tests use it to inject a one-ulp change); it returns handles to remove."""
    from vllm.sampling_params import SamplingParams

    model = llm.llm_engine.executor.model
    # every position must be computed by the rollout: no prefix-cache hits
    llm.llm_engine.kv.reset_prefix_cache()
    if llm.llm_engine.executor.info.has_cuda_graphs:
        raise ValueError("the divergence finder needs an eager engine (LLM(..., enforce_eager=True))")
    roll = _Recorder(model)
    orig_logits = model.compute_logits

    def logits_with_positions(hidden):
        # one request: the sampled row of a step is its last position
        roll.row_positions = roll.positions[-1:] if roll.positions is not None else None
        return orig_logits(hidden)
    model.compute_logits = logits_with_positions
    try:
        with roll:
            # tempered_logprobs whatever the engine's logprobs_mode: the Policy's values they are compared with
            out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
                temperature=temperature, max_tokens=max_tokens, seed=seed, logprobs=0, ignore_eos=True,
                logprobs_mode="tempered_logprobs"), use_tqdm=False)[0]
    finally:
        del model.compute_logits
    comp = out.outputs[0]
    seq = list(prompt) + list(comp.token_ids)
    rollout_lps = torch.tensor([comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)], dtype=torch.float32)

    policy = llm.policy()
    train = _Recorder(model)
    handles = perturb_training(model) if perturb_training else []
    orig_logits = model.compute_logits
    try:
        def train_logits(hidden):
            train.row_positions = torch.arange(len(prompt) - 1, len(seq) - 1)
            return orig_logits(hidden)
        model.compute_logits = train_logits
        with train, torch.no_grad():
            lps = policy.token_logprobs([seq], [len(prompt)], temperature=temperature)[0]
    finally:
        del model.compute_logits
        for h in handles:
            h.remove()
        for p in model.parameters():
            p.requires_grad_(False)

    report = ParityReport()
    for key in train.order:
        a_rows, b_rows = roll.store.get(key, {}), train.store.get(key, {})
        common = sorted(set(a_rows) & set(b_rows))
        if not common:
            continue
        differing, max_diff, first = 0, 0.0, None
        for p in common:
            a, b = a_rows[p], b_rows[p]
            if a.shape != b.shape or not torch.equal(_bits(a), _bits(b)):
                differing += 1
                if a.shape == b.shape:
                    d = (a.double() - b.double()).abs()
                    max_diff = max(max_diff, d.max().item())
                    if first is None:
                        ne = (_bits(a) != _bits(b)).flatten().nonzero()
                        first = (p, int(ne[0])) if len(ne) else (p, None)
                elif first is None:
                    first = (p, "shape")
        report.ops.append(OpDiff(key, train.kinds.get(key, ""), len(common), differing, max_diff, first))
    lps = lps.detach().cpu()
    report.logprobs_equal = torch.equal(_bits(lps), _bits(rollout_lps))
    report.logprob_max_abs_diff = (lps.double() - rollout_lps.double()).abs().max().item() if len(lps) else 0.0
    return report, seq


def add_parser(sub) -> None:
    from vllm.entrypoints.cli.engine_args import HelpFormatter, add_engine_args
    p = sub.add_parser("parity", help="find the first op where rollout and training bits differ",
                       formatter_class=HelpFormatter)
    add_engine_args(p)
    p.add_argument("--prompt-len", type=int, default=24, help="tokens in the random prompt (drawn with --seed)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens the rollout generates before the comparison")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollout and the "
                                                                 "recomputed logprobs")


def run(args) -> int:
    from vllm import LLM
    from vllm.entrypoints.cli.engine_args import engine_kwargs

    kw = engine_kwargs(args)
    kw["enforce_eager"] = True
    llm = LLM(**kw)
    g = torch.Generator().manual_seed(args.seed)
    vocab = llm.config.model.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
    report, _ = find_divergence(llm, prompt, args.max_tokens, args.temperature, args.seed)
    print(report.format())
    return 0 if report.first_divergence is None and report.logprobs_equal else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm.parity")
    sub = ap.add_subparsers(dest="command")
    add_parser(sub)
    args = ap.parse_args(["parity", *(argv or __import__("sys").argv[1:])])
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
