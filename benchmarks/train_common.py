"""What benchmarks/train_step.py and benchmarks/profile_train_step.py share: the token
layouts, our model with random weights, transformers' own model holding the SAME weights
(copied through our `hf_state_dict`), and the training / logprob-only steps of both.

transformers' step is what a user would write with it: `Qwen3ForCausalLM` (any
architecture transformers knows), SDPA attention, logits for every position, the
response rows' full-vocab float32 log-softmax and a gather. Sequences of different
lengths are right-padded with an attention mask, or packed with position_ids on its
flash-attention-2 varlen path when the `flash_attn` package is installed.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Layout:
    name: str
    seqs: list[list[int]]
    prompt_lens: list[int]

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.seqs)

    @property
    def response_tokens(self) -> int:
        return sum(len(s) - p for s, p in zip(self.seqs, self.prompt_lens))


def make_layout(spec: str, vocab_size: int, prompt_len: int = 256, mix_tokens: int = 8192, seed: int = 0) -> Layout:
    """'4x1024' (4 sequences of 1024 tokens, `prompt_len` of them prompt), or 'mix': lengths
    drawn uniformly from 100-4000 until `mix_tokens` tokens, each with a quarter of prompt
    (an RL batch of varied lengths)."""
    rng = np.random.default_rng(seed)
    if spec == "mix":
        lens = []
        while sum(lens) < mix_tokens:
            lens.append(int(rng.integers(100, 4001)))
        plens = [max(1, n // 4) for n in lens]
    else:
        try:
            n, length = (int(v) for v in spec.lower().split("x"))
        except ValueError:
            raise ValueError(f"layout must be 'NxLEN' or 'mix', got {spec!r}") from None
        lens, plens = [length] * n, [min(prompt_len, length - 1)] * n
    seqs = [rng.integers(100, vocab_size - 100, size=n).tolist() for n in lens]
    return Layout(spec, seqs, plens)


def model_dir(config_path: str, num_hidden_layers: int | None = None) -> str:
    """A directory holding only this config.json (what resolve_model / AutoConfig read);
    `num_hidden_layers` overrides the depth (a large MoE's dims on one GPU)."""
    d = tempfile.mkdtemp(prefix="train_bench_")
    if num_hidden_layers is None:
        shutil.copy(config_path, os.path.join(d, "config.json"))
    else:
        with open(config_path) as f:
            cfg = json.load(f)
        cfg["num_hidden_layers"] = num_hidden_layers
        cfg.pop("mlp_only_layers", None)  # indices into the original depth
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
    return d


def build_ours(path: str, device: str, numerics: str = "invariant"):
    from vllm.config import NumericsSpec
    from vllm.model_loader.build import build_model, read_model_config
    mc = read_model_config(path)
    model, _ = build_model(mc, NumericsSpec(torch.bfloat16, numerics), device, load_format="dummy")
    for p in model.parameters():
        p.requires_grad_(True)
    return model, mc


def hf_weights_on_host(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.hf_state_dict().items()}


def restore_weights(model, weights: dict[str, torch.Tensor]) -> None:
    from vllm.model_loader.loader import load_weights
    load_weights(model, iter(weights.items()))


def fuse_experts_like(model, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint (per-expert) MoE names onto a transformers model that stores experts as 3-D
    `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I] (transformers >= 5);
    `from_pretrained` converts these names, `load_state_dict` does not."""
    import re
    want = set(model.state_dict())
    out, groups = {}, {}
    for name, t in weights.items():
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m and f"{m[1]}.gate_up_proj" in want:
            groups.setdefault(m[1], {})[(int(m[2]), m[3])] = t
        else:
            out[name] = t
    for prefix, g in groups.items():
        n = 1 + max(e for e, _ in g)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([g[(e, "gate_proj")], g[(e, "up_proj")]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([g[(e, "down_proj")] for e in range(n)])
    return out


def build_hf(path: str, weights: dict[str, torch.Tensor], device: str, varlen: bool):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(path)
    attn = "flash_attention_2" if varlen else "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=attn)
    missing, unexpected = model.load_state_dict(fuse_experts_like(model, weights), strict=False)
    tied = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"weights do not map onto transformers' model: missing {missing}, unexpected {unexpected}")
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def hf_varlen_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


class HFBatch:
    """transformers' inputs for a layout: padded [B, Lmax] + mask, or packed [1, T] +
    position_ids (varlen); plus the flat indices of the rows whose next token is scored."""

    def __init__(self, layout: Layout, device: str, varlen: bool):
        lens = [len(s) for s in layout.seqs]
        rows, targets = [], []
        if varlen:
            ids = np.concatenate([np.asarray(s) for s in layout.seqs])[None, :]
            pos = np.concatenate([np.arange(n) for n in lens])[None, :]
            off = 0
            for s, p in zip(layout.seqs, layout.prompt_lens):
                rows.extend(range(off + p - 1, off + len(s) - 1))
                targets.extend(s[p:])
                off += len(s)
            self.kwargs = {"input_ids": torch.tensor(ids, device=device), "position_ids": torch.tensor(pos, device=device)}
        else:
            width = max(lens)
            ids = np.zeros((len(lens), width), dtype=np.int64)
            mask = np.zeros((len(lens), width), dtype=np.int64)
            for b, (s, p) in enumerate(zip(layout.seqs, layout.prompt_lens)):
                ids[b, :len(s)] = s
                mask[b, :len(s)] = 1
                rows.extend(range(b * width + p - 1, b * width + len(s) - 1))
                targets.extend(s[p:])
            self.kwargs = {"input_ids": torch.tensor(ids, device=device)}
            if min(lens) != width:  # uniform lengths need no mask (SDPA's causal fast path)
                self.kwargs["attention_mask"] = torch.tensor(mask, device=device)
        self.rows = torch.tensor(rows, device=device)
        self.targets = torch.tensor(targets, device=device)


def hf_logprobs(model, batch: HFBatch) -> torch.Tensor:
    logits = model(**batch.kwargs).logits
    picked = logits.view(-1, logits.shape[-1]).index_select(0, batch.rows).float()
    return torch.log_softmax(picked, -1).gather(-1, batch.targets[:, None])[:, 0]


def hf_train_step(model, batch: HFBatch, opt) -> None:
    (-hf_logprobs(model, batch).sum()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def policy_train_step(policy, layout: Layout, opt) -> None:
    lps = policy.token_logprobs(layout.seqs, layout.prompt_lens)
    (-sum(lp.sum() for lp in lps)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def new_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-6, foreach=True)
