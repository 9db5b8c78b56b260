"""A sha256 of everything a fixed rollout produces (token ids, logprob bits, finish
reasons), to show that a change to the code left the engine's output untouched.

Uses only the public offline API, so the same script runs against any version of
the tree: make the checkpoint once, then point each tree at it.

    python benchmarks/rollout_digest.py --make-model /tmp/digest_model
    PYTHONPATH=OLD_TREE python benchmarks/rollout_digest.py --model /tmp/digest_model
    PYTHONPATH=NEW_TREE python benchmarks/rollout_digest.py --model /tmp/digest_model
"""
from __future__ import annotations

import argparse
import hashlib
import random
import struct

import torch


def make_model(path: str, device: str) -> None:
    from vllm.testing.tiny_models import make_tiny_checkpoint
    big = device.startswith("cuda")
    hidden = 1024 if big else 64
    make_tiny_checkpoint(path, "qwen3", hidden_size=hidden, num_hidden_layers=4 if big else 2,
                         num_attention_heads=max(2, hidden // 128), num_key_value_heads=max(1, hidden // 512),
                         head_dim=128 if big else 32, intermediate_size=3 * hidden,
                         dtype=torch.bfloat16 if big else torch.float32, max_position_embeddings=4096, init_std=0.05)


def digest(model: str, device: str, numerics: str, num_prompts: int, max_tokens: int) -> tuple[str, int]:
    from vllm import LLM, SamplingParams
    rng = random.Random(1234)
    llm = LLM(model, device=device, numerics=numerics, seed=0, **({"gpu_memory_utilization": 0.3} if device != "cpu" else {}))
    vocab = llm.llm_engine.config.model.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randrange(4, 300))]} for _ in range(num_prompts)]
    h = hashlib.sha256()
    n_tok = 0
    for temperature in (0.0, 0.8):
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, logprobs=1, ignore_eos=True)
                  for i in range(num_prompts)]
        for out in llm.generate(prompts, params, use_tqdm=False):
            for comp in out.outputs:
                h.update(struct.pack(f"<{len(comp.token_ids)}q", *comp.token_ids))
                for tok, lp in zip(comp.token_ids, comp.logprobs or []):
                    h.update(struct.pack("<d", lp[tok].logprob))
                h.update(str(comp.finish_reason).encode())
                n_tok += len(comp.token_ids)
    return h.hexdigest(), n_tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory to roll out")
    ap.add_argument("--make-model", metavar="DIR", help="write the random-weight Qwen3 checkpoint to DIR and exit")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    ap.add_argument("--modes", default="invariant,fast", help="comma-separated numerics modes to digest")
    ap.add_argument("--num-prompts", type=int, default=64, help="prompts per temperature (greedy and T=0.8)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    args = ap.parse_args()
    if args.make_model:
        make_model(args.make_model, args.device)
        print(f"wrote {args.make_model}")
        return
    if not args.model:
        ap.error("--model or --make-model is required")
    for mode in args.modes.split(","):
        d, n = digest(args.model, args.device, mode, args.num_prompts, args.max_tokens)
        print(f"digest {mode}: {d} ({n} tokens)", flush=True)


if __name__ == "__main__":
    main()
