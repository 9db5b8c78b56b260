#!/usr/bin/env python
"""Produce ``vllm/default_model/``: a small Qwen3 model trained on arithmetic with our own Policy.

Steps (all local, nothing downloaded):

1. A random-weight Qwen3 checkpoint and the project's byte-level BPE tokenizer
   (vllm.testing.tiny_models.make_tiny_checkpoint; the tokenizer is trained on
   ``vllm/testing/data/corpus.txt`` and splits digits one by one).
2. Supervised fine-tuning with ``vllm.training.Policy`` (the engine's model class under
   autograd, float32 on the CPU; ``--numerics fast`` by default, about 5x quicker than
   invariant on the CPU): each example is a problem of the
   ``arithmetic`` task's TRAIN split (vllm/rl/tasks/arithmetic.py), rendered with the
   chat template exactly as ``vllm train`` renders its prompts, followed by the answer and
   ``<|im_end|>``; the loss is the mean negative logprob of those response tokens.
   AdamW, linear warmup then cosine decay.
3. The weights are written as bfloat16 safetensors with HF names, loadable by
   transformers and by our engine.
4. Greedy accuracy of the shipped (bf16) model on the task's TEST split, measured with the
   engine (``LLM.chat``), goes into the model's README.md.

The training budget is deliberately short: the shipped model answers in the right
format and gets part of the problems right, which leaves room for ``vllm train`` (RL)
to improve it.

Deterministic: the data and the initial weights are functions of --seed, and the CPU
kernels run in a fixed order for a fixed thread count (--threads, default 2), so a
re-run rewrites the same weights (for the same torch / transformers / tokenizers
versions).

Usage:
    python scripts/make_default_model.py            # writes vllm/default_model/ (about 10 min on one core)
    python scripts/make_default_model.py --out DIR --steps 50   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from vllm.testing.tiny_models import (  # noqa: E402
    EOS_TOKEN,
    PAD_TOKEN,
    make_tiny_checkpoint,
    special_token_ids,
)

DEFAULT_OUT = os.path.join(REPO_ROOT, "vllm", "default_model")
MAX_TOTAL_BYTES = 8 * 1024 * 1024  # the directory is committed: keep it small

# The default model's shape: a narrow Qwen3 (trainable in minutes on two CPU cores).
DEFAULT_MODEL_KWARGS = dict(
    arch="qwen3",
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=512,
    tokenizer_vocab_size=4096,
    vocab_size=4096,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    init_std=0.02,
)

# SFT settings (the defaults of the flags below)
SFT_DEFAULTS = dict(steps=2000, batch=128, lr=3e-3, warmup=20, min_lr_ratio=0.1, weight_decay=0.0,
                    max_grad_norm=1.0, seed=0, eval_size=400)

README_TEMPLATE = """\
# vllm-parity default model

The small model embedded in the `vllm` package: what `vllm generate`, `vllm serve` and
`vllm train` use when no model is given. It is trained, by a script in this repository
and with this project's own trainer, to answer arithmetic questions; nothing here is
downloaded. Every file is produced by

    python scripts/make_default_model.py

## What it does

Asked in chat format (ChatML) a question of the `arithmetic` task
(`vllm/rl/tasks/arithmetic.py`), such as `What is 47 + 58?` or `What is 61 - 9?`
(operands of 1 or 2 digits, + or -, never a negative result), it answers with the
number and ends its turn:

    <|im_start|>user
    What is 47 + 58?<|im_end|>
    <|im_start|>assistant
    105<|im_end|>

Greedy accuracy on {eval_size} problems of the task's held-out test split (seed 0),
measured with our engine on CPU (the bf16 weights upcast to float32):
**{accuracy:.1%}** ({correct} of {eval_size}); {well_formed:.1%} of the answers are a
bare number ending the turn. By operand size (the longer operand's digit count):
{by_digits}.
It is not perfect (a 1.5M-parameter model trained for about 40 minutes of CPU), so
`vllm train` (GRPO on the same task) has room to improve it.

## How it was made

1. Qwen3 architecture with random weights (seed {seed}), the project's byte-level
   BPE tokenizer.
2. Supervised fine-tuning with `vllm.training.Policy` (the engine's own model class
   under autograd, `numerics="{numerics}"`, float32 on CPU): {steps} steps of
   {batch} problems from the task's train split, rendered with the chat template as
   `vllm train` renders its prompts, loss = mean negative logprob of the answer tokens
   and `<|im_end|>`; AdamW, lr {lr:g} (linear warmup {warmup} steps, cosine decay to
   {min_lr_ratio:g} x), gradient norm clipped at {max_grad_norm:g}. Final training loss
   {final_loss:.3f}; {train_seconds:.0f} s on a shared 2-core CPU machine.
3. Weights rounded to bfloat16 and saved as safetensors with HF names.

## What it is

* Architecture: `Qwen3ForCausalLM`, HuggingFace format (`config.json`,
  `model.safetensors`, `generation_config.json`, `tokenizer.json`,
  `tokenizer_config.json`); loads with `transformers.AutoModelForCausalLM`.
* Shape: hidden_size {hidden_size}, {num_hidden_layers} layers,
  {num_attention_heads} attention heads, {num_key_value_heads} KV heads,
  head_dim {head_dim}, intermediate_size {intermediate_size},
  vocab_size {vocab_size}, tied input/output embeddings,
  rope_theta {rope_theta:g}, max_position_embeddings {max_position_embeddings}.
* Size: {num_params:,} parameters stored in bfloat16
  ({weights_bytes:,} bytes of weights).
* Tokenizer: byte-level BPE ({tokenizer_vocab_size} tokens, Qwen2
  pre-tokenization regex, digits split one by one), trained deterministically
  with the `tokenizers` library on the corpus in `vllm/testing/data/corpus.txt`.
  Special tokens: `<|endoftext|>` = {endoftext_id} (pad),
  `<|im_start|>` = {im_start_id}, `<|im_end|>` = {im_end_id} (eos).
  ChatML (Qwen-style) chat template in `tokenizer_config.json`.

## Reproducing

The script is deterministic (seeded data and initial weights, one CPU thread): a re-run
writes the same weights for the same torch / transformers / tokenizers versions.
Do not edit these files by hand; change `scripts/make_default_model.py` and re-run.
"""


def dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def render(tok, record: dict) -> tuple[list[int], list[int]]:
    """(prompt ids as `vllm train` renders them, answer ids ending in <|im_end|>)."""
    ids = tok.apply_chat_template(record["prompt"], tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids), list(tok.encode(record["answer"] + EOS_TOKEN, add_special_tokens=False))


def lr_at(step: int, a) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    progress = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def sft(init_dir: str, a) -> tuple:
    """Train the checkpoint in `init_dir` with our Policy; returns (policy, final loss, seconds)."""
    from vllm.rl.tasks.arithmetic import MAX_DIGITS, generate_problems
    from vllm.training import Policy

    policy = Policy.from_pretrained(init_dir, dtype=torch.float32, device="cpu", numerics=a.numerics)
    tok = policy.tokenizer
    # distinct problems per epoch-sized chunk (a small task has fewer problems than the run needs)
    problems, chunk = [], 0
    while len(problems) < a.steps * a.batch:
        problems += generate_problems(min(a.chunk, a.steps * a.batch - len(problems)), a.seed * 1000 + chunk, "train",
                                      max_digits=a.max_digits or MAX_DIGITS)
        chunk += 1
    examples = [render(tok, p) for p in problems]
    params = [p for p in policy.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.98), eps=1e-8)
    t0 = time.perf_counter()
    recent: list[float] = []
    for step in range(a.steps):
        batch = examples[step * a.batch:(step + 1) * a.batch]
        seqs = [p + r for p, r in batch]
        plens = [len(p) for p, _ in batch]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a)
        lps = policy.token_logprobs(seqs, plens)
        loss = -torch.cat(lps).mean()
        loss.backward()
        if a.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [float(loss.detach())])[-20:]
        if (step + 1) % a.log_every == 0 or step + 1 == a.steps:
            print(f"sft step {step + 1}/{a.steps}  loss {sum(recent) / len(recent):.4f}  lr {lr_at(step, a):.2e}  "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    return policy, sum(recent) / len(recent), time.perf_counter() - t0


def write_bf16(policy, init_dir: str, out: str) -> None:
    """The trained weights as a bf16 HF checkpoint (config, safetensors, tokenizer files)."""
    from safetensors.torch import save_file

    for name in os.listdir(init_dir):
        if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copy(os.path.join(init_dir, name), os.path.join(out, name))
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    for key in ("torch_dtype", "dtype"):
        if key in cfg:
            cfg[key] = "bfloat16"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous()
               for k, v in sorted(policy.model.hf_state_dict().items())}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def evaluate(model_dir: str, n: int) -> dict:
    """Greedy accuracy of `model_dir` on `n` test problems of the arithmetic task (our engine)."""
    from vllm import LLM, SamplingParams
    from vllm.rl.rewards import build_reward
    from vllm.rl.tasks.arithmetic import generate_problems

    problems = generate_problems(n, 0, "test")
    llm = LLM(model_dir, device="cpu")
    outs = llm.chat([p["prompt"] for p in problems], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    reward = build_reward("math", 1.0, 0.0)
    texts = [o.outputs[0].text for o in outs]
    right = [reward(t, p["answer"], p) > 0 for t, p in zip(texts, problems)]
    well_formed = [t.strip().isdigit() and o.outputs[0].finish_reason == "stop" for t, o in zip(texts, outs)]
    by: dict[int, list[bool]] = {}
    for p, r in zip(problems, right):
        by.setdefault(max(len(str(p["a"])), len(str(p["b"]))), []).append(r)
    for p, t, r in list(zip(problems, texts, right))[:8]:
        print(f"  {p['prompt'][-1]['content']:<22} -> {t!r:<8} {'right' if r else 'wrong (' + p['answer'] + ')'}")
    return {"eval_size": n, "correct": sum(right), "accuracy": sum(right) / n,
            "well_formed": sum(well_formed) / n,
            "by_digits": ", ".join(f"{d} digit{'s' if d > 1 else ''} {sum(v) / len(v):.0%} of {len(v)}"
                                   for d, v in sorted(by.items()))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT, help="output directory (default: vllm/default_model)")
    for k, v in SFT_DEFAULTS.items():
        parser.add_argument("--" + k.replace("_", "-"), type=type(v), default=v, help=f"(default: {v})")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--max-digits", type=int, default=None, help="(default: the task's MAX_DIGITS)")
    parser.add_argument("--chunk", type=int, default=4096, help="distinct problems per data chunk")
    parser.add_argument("--numerics", default="fast", choices=["fast", "invariant"],
                        help="the Policy's kernels for SFT (fast: ~5x quicker on CPU; the RL runs use invariant)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (the bits depend on it)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    out = os.path.abspath(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        init_dir = os.path.join(tmp, "init")
        make_tiny_checkpoint(init_dir, seed=args.seed, dtype=torch.float32, **DEFAULT_MODEL_KWARGS)
        torch.manual_seed(args.seed)
        policy, final_loss, seconds = sft(init_dir, args)
        # start from an empty directory so no stale file survives
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.makedirs(out)
        write_bf16(policy, init_dir, out)
    del policy

    result = evaluate(out, args.eval_size)
    print(json.dumps(result))
    from safetensors import safe_open

    num_params = 0
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            num_params += math.prod(f.get_slice(name).get_shape())
    ids = special_token_ids()
    readme = README_TEMPLATE.format(
        num_params=num_params, weights_bytes=os.path.getsize(os.path.join(out, "model.safetensors")),
        endoftext_id=ids[PAD_TOKEN], im_start_id=ids["<|im_start|>"], im_end_id=ids[EOS_TOKEN],
        final_loss=final_loss, train_seconds=seconds, **result, **DEFAULT_MODEL_KWARGS,
        numerics=args.numerics, **{k: getattr(args, k) for k in SFT_DEFAULTS if k != "eval_size"})
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write(readme)

    for fn in os.listdir(out):  # safetensors writes 0600; make the files world-readable
        os.chmod(os.path.join(out, fn), 0o644)
    total = dir_size(out)
    for fn in sorted(os.listdir(out)):
        print(f"{os.path.getsize(os.path.join(out, fn)):>10,}  {fn}")
    print(f"{total:>10,}  total ({num_params:,} parameters) -> {out}")
    if total >= MAX_TOTAL_BYTES:
        print(f"ERROR: {out} is {total} bytes, over the {MAX_TOTAL_BYTES} byte budget", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
