"""Policy: the engine's model class in training mode.

`token_logprobs` runs the rollout's forward kernels (through the op shim and a
private-cache attention backend) under autograd, so for the same weights and
token prefix it returns the logprobs the rollout reported, bit for bit, and is
differentiable w.r.t. the parameters.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Sequence

import torch

from vllm.config import KernelConfig, ModelConfig
from vllm.forward_context import ForwardContext, set_forward_context
from vllm.sample.sampler import tempered_logprobs
from vllm.training.attention import PackedAttentionBackend


class Policy:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 numerics: str = "invariant", tokenizer=None, engine=None, activation_checkpointing: bool = False,
                 block_size: int = 16, kernels: KernelConfig | None = None):
        self.model = model
        self.model_config = model_config
        self.dtype = dtype
        self.device = torch.device(device)
        self.numerics = numerics
        self.tokenizer = tokenizer
        self.engine = engine  # colocated: the LLMEngine sharing these parameters
        self.block_size = block_size
        self.kernels = kernels or KernelConfig()  # the engine's, when colocated
        self.activation_checkpointing = activation_checkpointing
        for p in self.model.parameters():
            p.requires_grad_(True)

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, *, dtype: str | torch.dtype = "auto", device: str | None = None,
                        numerics: str = "invariant", activation_checkpointing: bool = False) -> "Policy":
        """A standalone trainer's model, built by the engine's own path (vllm.model_loader.build)."""
        from vllm.model_loader.build import build_model, resolve_model
        from vllm.tokenizer import load_tokenizer

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        mc, dt = resolve_model(path, dtype=dtype, device=device)
        model, _ = build_model(mc, dt, device, numerics=numerics)
        try:
            tok = load_tokenizer(path)
        except ValueError:
            tok = None
        return cls(model, mc, dt, torch.device(device), numerics, tok, activation_checkpointing=activation_checkpointing)

    def parameters(self):
        return self.model.parameters()

    def named_parameters(self):
        return self.model.named_parameters()

    # ---- weights changed ---------------------------------------------------------------
    def notify_weights_updated(self) -> None:
        """Call after every optimizer step (attach_optimizer does it for you): a colocated
        engine bumps its weight version and drops prefix-cache entries computed with the
        old weights."""
        if self.engine is not None:
            self.engine.on_weights_updated()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_post_hook(lambda *_: self.notify_weights_updated())

    # ---- the trainer's logprobs -----------------------------------------------------------
    def _validate(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> None:
        if len(sequences) != len(prompt_lens):
            raise ValueError(f"got {len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
        vocab, ctx = self.model_config.vocab_size, self.model_config.max_model_len
        for i, (seq, pl) in enumerate(zip(sequences, prompt_lens)):
            if len(seq) > ctx:
                raise ValueError(f"sequence {i} has {len(seq)} tokens, longer than the model's context {ctx}")
            if not isinstance(pl, int) or pl < 1 or pl > len(seq):
                raise ValueError(f"sequence {i}: prompt_len {pl!r} out of range [1, {len(seq)}]")
            if pl == len(seq):
                raise ValueError(f"sequence {i} has an empty response (prompt_len == len(sequence) == {pl})")
            if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in seq):
                raise ValueError(f"sequence {i} has token ids outside the vocabulary [0, {vocab})")

    def token_logprobs(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float = 1.0,
                       max_tokens_per_micro_batch: int | None = None) -> list[torch.Tensor]:
        """One float32 1-D tensor per sequence: the logprob of each response token under
        log_softmax(logits / temperature) (temperature 0 -> 1, as the rollout reports),
        differentiable w.r.t. the parameters. Sequences are packed into micro-batches of at
        most `max_tokens_per_micro_batch` tokens (default: all in one); packing, order and
        micro-batch size do not change the bits."""
        sequences = [list(s) for s in sequences]
        prompt_lens = list(prompt_lens)
        self._validate(sequences, prompt_lens)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        budget = max_tokens_per_micro_batch or sum(len(s) for s in sequences)
        results: list[torch.Tensor | None] = [None] * len(sequences)
        batch: list[int] = []
        used = 0
        for i, s in enumerate(sequences):
            if batch and used + len(s) > budget:
                self._micro_batch(batch, sequences, prompt_lens, temperature, results)
                batch, used = [], 0
            batch.append(i)
            used += len(s)
        if batch:
            self._micro_batch(batch, sequences, prompt_lens, temperature, results)
        return results  # type: ignore[return-value]

    def _micro_batch(self, idx: list[int], sequences, prompt_lens, temperature: float, results) -> None:
        dev = self.device
        seqs = [sequences[i] for i in idx]
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(len(s)) for s in seqs]).to(dev)
        backend = PackedAttentionBackend([len(s) for s in seqs], dev, self.block_size)
        # rows whose next token is a response token: positions prompt_len-1 .. len-2
        rows, targets, offset = [], [], 0
        for i, s in zip(idx, seqs):
            pl = prompt_lens[i]
            rows.append(torch.arange(offset + pl - 1, offset + len(s) - 1))
            targets.extend(s[pl:])
            offset += len(s)
        rows_t = torch.cat(rows).to(dev)
        with set_forward_context(ForwardContext(backend, self.numerics, self.kernels)):
            hidden = self.model(ids, positions, activation_checkpointing=self.activation_checkpointing)
            logits = self.model.compute_logits(hidden.index_select(0, rows_t))
        temp = temperature if temperature > 0 else 1.0
        lp = tempered_logprobs(logits, temp)
        picked = lp.gather(1, torch.tensor(targets, device=dev)[:, None])[:, 0]
        start = 0
        for i, s in zip(idx, seqs):
            n = len(s) - prompt_lens[i]
            results[i] = picked[start:start + n]
            start += n

    # ---- checkpoints -------------------------------------------------------------------
    def save_pretrained(self, save_dir: str) -> None:
        """An HF-format checkpoint (config, safetensors with HF names, tokenizer) that
        transformers and upstream vLLM load."""
        from safetensors.torch import save_file

        os.makedirs(save_dir, exist_ok=True)
        src = self.model_config.path
        with open(os.path.join(src, "config.json")) as f:
            cfg = json.load(f)
        cfg["torch_dtype"] = cfg["dtype"] = str(self.dtype).replace("torch.", "")
        with open(os.path.join(save_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.model.hf_state_dict().items()}
        save_file(tensors, os.path.join(save_dir, "model.safetensors"), metadata={"format": "pt"})
        for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "vocab.json", "merges.txt"):
            if os.path.isfile(os.path.join(src, name)):
                shutil.copy(os.path.join(src, name), os.path.join(save_dir, name))

    def execution_contract(self):
        """The same contract as the engine's for the same model, dtype, numerics and device
        (deployment settings aside, which must not change bits)."""
        from vllm.contract import build_contract
        return build_contract(self.model, dtype=self.dtype, numerics=self.numerics, device=str(self.device),
                              deployment={"block_size": self.block_size, "max_model_len": self.model_config.max_model_len},
                              kernels=self.kernels)
