"""Policy: the engine's model class in training mode.

`token_logprobs` runs the rollout's forward kernels (through the op shim and a
packed-sequence attention backend) under autograd, so for the same weights and
token prefix it returns the logprobs the rollout reported, bit for bit, and is
differentiable w.r.t. the parameters.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import pathlib
import threading
import types
from typing import Sequence

import numpy as np
import torch

from vllm.config import KernelConfig, ModelConfig, NumericsSpec, NumericsSpecFields
from vllm.forward_context import ForwardContext, set_forward_context
from vllm.host_copy import to_device
from vllm.sampling_params import MIN_TEMPERATURE
from vllm.training.attention import PackedAttentionBackend
from vllm.training.logprob_head import token_logprobs_head


def _lm_head(model: torch.nn.Module) -> torch.nn.Module:
    """The model's one LMHead: `compute_logits(h)` is `h @ weight.T` in float32
    (docs/architecture.md), which the fused logprob head differentiates by hand."""
    from vllm.layers.embedding import LMHead
    heads = [m for m in model.modules() if isinstance(m, LMHead)]
    if len(heads) != 1:
        raise ValueError(f"the trainer needs a model with exactly one LMHead (compute_logits), found {len(heads)}")
    return heads[0]


def remove_stale_weights(save_dir: str) -> None:
    """Delete the weight files of an earlier checkpoint in `save_dir` (a sharded one's index
    and shards, a single file): loaders follow an index before a single file, so a stale one
    would load the old weights beside the new."""
    for name in os.listdir(save_dir):
        if name in ("model.safetensors", "model.safetensors.index.json") or (
                name.startswith("model-") and name.endswith(".safetensors")):
            os.remove(os.path.join(save_dir, name))


def _as_int(value):
    """A numpy or torch integer scalar (np.array(prompt_lens), a tensor of lengths) as an int;
    anything else as it is (the checks name it)."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        return int(value)
    return value


class Policy(NumericsSpecFields):
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, numerics_spec: NumericsSpec,
                 device: torch.device, tokenizer=None, engine=None, activation_checkpointing: bool = False,
                 block_size: int = 16, logprob_chunk_rows: int | None = None, engine_lock=None):
        """`engine`: the LLMEngine sharing `model`'s parameters (colocated), or None.
        `engine_lock`: the lock every `LLM` method that steps or changes that engine holds
        (`LLM.policy()` passes its own), held by an attached optimizer's step and by
        `notify_weights_updated`; None: a lock of this policy's (an engine driven without
        an `LLM`). `numerics_spec`: how `model` computes (vllm.config.NumericsSpec), the rollout
        engine's when colocated: its kernel options travel in the forward context as in the
        engine, its kv_cache_dtype "fp8" runs K/V through the same FP8 round trip, its
        quantization was applied when the model was built and is recorded for the contract.
        `logprob_chunk_rows`: response rows whose float32 logits are formed at once by the
        logprob head (default: as many as fit 512 MiB; vllm/training/logprob_head.py). Memory
        only: it never changes a bit of the logprobs."""
        if not isinstance(numerics_spec, NumericsSpec):
            raise ValueError(f"Policy takes a NumericsSpec (vllm.config), got {type(numerics_spec).__name__}")
        if logprob_chunk_rows is not None and (isinstance(logprob_chunk_rows, bool)
                                               or not isinstance(logprob_chunk_rows, numbers.Integral)
                                               or logprob_chunk_rows < 1):
            raise ValueError(f"logprob_chunk_rows must be an integer >= 1, got {logprob_chunk_rows!r}")
        if not isinstance(activation_checkpointing, bool):
            raise ValueError(f"activation_checkpointing must be True or False, got {activation_checkpointing!r}")
        self.model = model
        self.model_config = model_config
        self.numerics_spec = numerics_spec
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.engine = engine  # colocated: the LLMEngine sharing these parameters
        self.engine_lock = engine_lock if engine_lock is not None else threading.RLock()
        self.block_size = block_size  # the engine's KV block size, for the contract's deployment part
        self.activation_checkpointing = activation_checkpointing
        self.logprob_chunk_rows = logprob_chunk_rows
        self._lm_head = _lm_head(model)
        # trainable once, when the model first gets a Policy: a later view of the same model
        # (another llm.policy(), a rollout client's) must not unfreeze what the user froze
        if not getattr(model, "_policy_made_trainable", False):
            for p in self.model.parameters():
                p.requires_grad_(True)
            model._policy_made_trainable = True

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, *, dtype: str | torch.dtype = "auto", device: str | None = None,
                        numerics: str = "invariant", activation_checkpointing: bool = False,
                        logprob_chunk_rows: int | None = None, kernels: KernelConfig | None = None,
                        kv_cache_dtype: str = "auto", quantization: str | None = None,
                        load_format: str = "safetensors", tensor_parallel_size: int = 1,
                        tp_leaves: int | None = None) -> "Policy":
        """A standalone trainer's model, built by the engine's own path (vllm.model_loader.build);
        `kernels`: the kernel options of the engine whose rollouts it scores; `load_format`
        "dummy": random weights of the config's dims (benchmarks). `tensor_parallel_size` /
        `tp_leaves`: as the engine's (vllm.config.ParallelConfig; all ranks in this process):
        a trainer at TP=1 matches a TP=C engine with the engine's `tp_leaves`."""
        from vllm.model_loader.build import build_model, read_model_config, resolve_numerics
        from vllm.tokenizer import load_tokenizer

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        mc = read_model_config(path)
        spec = resolve_numerics(mc, device, dtype=dtype, numerics=numerics, kernels=kernels,
                                kv_cache_dtype=kv_cache_dtype, quantization=quantization,
                                tensor_parallel_size=tensor_parallel_size, tp_leaves=tp_leaves)
        model, _ = build_model(mc, spec, device, load_format=load_format)
        try:
            tok = load_tokenizer(path)
        except ValueError:
            tok = None
        return cls(model, mc, spec, torch.device(device), tok, activation_checkpointing=activation_checkpointing,
                   logprob_chunk_rows=logprob_chunk_rows)

    @property
    def lm_head_weight(self) -> torch.nn.Parameter:
        """The LM head's weight as the model holds it now (a parameter replaced by the user,
        e.g. load_state_dict(assign=True), is the one the logprob head differentiates)."""
        return self._lm_head.weight

    def parameters(self):
        return self.model.parameters()

    def named_parameters(self):
        return self.model.named_parameters()

    # ---- weights changed ---------------------------------------------------------------
    def notify_weights_updated(self) -> None:
        """Call after every optimizer step (attach_optimizer does it for you): FP8 layers
        re-quantize their master weights (a fused optimizer, or a write through `.data`, leaves
        the parameters' version counters as they were, so the forward cannot notice), and a
        colocated engine bumps its weight version and drops prefix-cache entries computed with
        the old weights. Holds the engine lock: the bookkeeping never runs beside another
        thread's step of the engine."""
        if self.engine is not None:
            with self.engine_lock:
                self.engine.on_weights_updated()   # re-quantizes the FP8 layers too
        else:
            from vllm.layers.linear import fp8_linears
            for layer in fp8_linears(self.model):
                layer.requantize()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make every step of `optimizer` a weight change the colocated engine knows of. The
        step holds the engine lock from its check to its bookkeeping, so another thread's
        `generate`, `sleep` or weight update waits for the whole step (and the step waits
        for them): no engine step ever runs between the check and the write, nor on half
        written weights. Before writing, the step is refused while requests are running;
        after it, the engine counts the new version and drops its cached prefixes. Without an
        engine, a step of a Policy with FP8 layers re-quantizes them after it (what
        notify_weights_updated does).

        `optimizer.step` is wrapped rather than hooked: torch runs no step post hook when the
        step raises, so a lock taken in a pre hook would stay held. A step that raises may
        have written some parameters already: the version is counted and the prefixes
        dropped then too, and the lock is given back, before the error propagates."""
        attached = getattr(optimizer, "_vllm_policy_model", None)
        if attached is self.model:
            return   # already attached (a second wrap would count every step twice)
        if attached is not None:
            raise ValueError("this optimizer is attached to another Policy's model already")
        optimizer._vllm_policy_model = self.model
        step = optimizer.step   # bound, or an LR scheduler's wrapper when one came first
        policy = self
        if self.engine is None:
            from vllm.layers.linear import fp8_linears
            if not fp8_linears(self.model):
                return

            def requantizing_step(opt, *args, **kwargs):
                try:
                    return step(*args, **kwargs)
                finally:
                    policy.notify_weights_updated()
            optimizer.step = types.MethodType(requantizing_step, optimizer)
            return

        def locked_step(opt, *args, **kwargs):
            with policy.engine_lock:
                policy.engine.check_weights_can_change()   # nothing written yet
                try:
                    return step(*args, **kwargs)
                finally:
                    policy.notify_weights_updated()
        # a bound method, as optimizer.step is: torch's LR schedulers wrap `step.__func__`
        optimizer.step = types.MethodType(locked_step, optimizer)

    # ---- the trainer's logprobs -----------------------------------------------------------
    def _validate(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> list[np.ndarray]:
        """The sequences as int64 arrays (vectorised checks: no Python loop over tokens)."""
        if len(sequences) != len(prompt_lens):
            raise ValueError(f"got {len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
        vocab, ctx = self.model_config.vocab_size, self.model_config.max_model_len
        arrays = []
        for i, (seq, pl) in enumerate(zip(sequences, prompt_lens)):
            if isinstance(seq, torch.Tensor):
                seq = seq.tolist()
            try:
                arr = np.asarray(seq)
            except (ValueError, TypeError, OverflowError):
                arr = None
            if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
                what = "not a sequence" if arr is None or arr.ndim == 0 else \
                    (f"{arr.ndim}-D" if arr.ndim != 1 else f"of {arr.dtype} values")
                raise ValueError(f"sequence {i} must be a 1-D sequence of integer token ids, got {what}: "
                                 f"{str(seq)[:60]}")
            if len(arr) > ctx:
                raise ValueError(f"sequence {i} has {len(arr)} tokens, longer than the model's context {ctx}")
            if isinstance(pl, bool) or not isinstance(pl, int) or pl < 1 or pl > len(arr):
                raise ValueError(f"sequence {i}: prompt_len {pl!r} out of range [1, {len(arr)}]")
            if pl == len(arr):
                raise ValueError(f"sequence {i} has an empty response (prompt_len == len(sequence) == {pl})")
            if int(arr.min()) < 0 or int(arr.max()) >= vocab:
                raise ValueError(f"sequence {i} has token ids outside the vocabulary [0, {vocab})")
            arrays.append(arr.astype(np.int64, copy=False))
        return arrays

    def token_logprobs(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float = 1.0,
                       max_tokens_per_micro_batch: int | None = None, return_entropy: bool = False,
                       attention_mask=None):
        """One float32 1-D tensor per sequence: the logprob of each response token under
        log_softmax(logits / temperature) (temperature 0 -> 1, as the rollout reports),
        differentiable w.r.t. the parameters. Sequences are packed into micro-batches of at
        most `max_tokens_per_micro_batch` tokens (default: all in one), a longer sequence in
        one of its own (a sequence is never split); packing, order and micro-batch size do
        not change the bits. `return_entropy`: returns (logprobs, entropies), the second one
        float32 tensor per sequence of the entropy of each response position's tempered
        distribution (not differentiable; the logprobs' bits are the same either way).
        `attention_mask`: a padded batch (an RL framework's [B, L] input ids, left-padded
        prompts and right-padded responses): per row 1 / True on its tokens, which must be
        one run, 0 on padding. Each row is cut to its tokens first, and `prompt_lens` count
        a row's prompt tokens without its padding; the results are those of the unpadded
        sequences, bit for bit. Without it every position is a token: padding would be read
        as context."""
        if attention_mask is not None:
            sequences = _unpadded(sequences, attention_mask)
        if isinstance(sequences, (str, bytes)) or not hasattr(sequences, "__len__") \
                or isinstance(prompt_lens, (str, bytes)) or not hasattr(prompt_lens, "__len__"):
            raise ValueError("token_logprobs takes a list of token-id sequences and a list of prompt lengths")
        if len(sequences) and all(isinstance(t, numbers.Integral) for t in sequences):
            raise ValueError("token_logprobs takes a list of sequences (a list of token-id lists), got one flat list "
                             "of token ids: wrap it in a list")
        prompt_lens = [_as_int(p) for p in prompt_lens]
        arrays = self._validate(sequences, prompt_lens)
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
                or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if max_tokens_per_micro_batch is not None and (isinstance(max_tokens_per_micro_batch, bool) or not isinstance(
                max_tokens_per_micro_batch, numbers.Integral) or max_tokens_per_micro_batch < 1):
            raise ValueError(f"max_tokens_per_micro_batch must be an integer >= 1, got {max_tokens_per_micro_batch!r}")
        # the rollout's temperature: SamplingParams raises a positive one below its floor to it
        temp = max(float(temperature), MIN_TEMPERATURE) if temperature > 0 else 1.0
        # the sampler divides by a float32 device tensor (an exact IEEE division): the same
        # value, copied once per call without making the host wait for the GPU
        temp_t = to_device(np.float32(temp), torch.float32, self.device)
        budget = max_tokens_per_micro_batch or sum(len(a) for a in arrays)
        results: list[torch.Tensor | None] = [None] * len(arrays)
        entropies: list[torch.Tensor | None] | None = [None] * len(arrays) if return_entropy else None
        batch: list[int] = []
        used = 0
        for i, a in enumerate(arrays):
            if batch and used + len(a) > budget:
                self._micro_batch(batch, arrays, prompt_lens, temp, temp_t, results, entropies)
                batch, used = [], 0
            batch.append(i)
            used += len(a)
        if batch:
            self._micro_batch(batch, arrays, prompt_lens, temp, temp_t, results, entropies)
        return (results, entropies) if return_entropy else results  # type: ignore[return-value]

    def _micro_batch(self, idx: list[int], arrays: list[np.ndarray], prompt_lens, temp: float, temp_t: torch.Tensor,
                     results, entropies=None) -> None:
        lens = np.array([len(arrays[i]) for i in idx], dtype=np.int64)
        plens = np.array([prompt_lens[i] for i in idx], dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
        n_resp = lens - plens
        # rows whose next token is a response token: positions prompt_len-1 .. len-2 of each
        # sequence; their targets are the response tokens
        resp_seq = np.repeat(np.arange(len(idx)), n_resp)
        resp_off = np.arange(int(n_resp.sum())) - np.repeat(np.cumsum(n_resp) - n_resp, n_resp)
        rows = starts[resp_seq] + plens[resp_seq] - 1 + resp_off
        ids = np.concatenate([arrays[i] for i in idx])
        positions = np.arange(int(lens.sum())) - np.repeat(starts, lens)
        T, R = len(ids), len(rows)
        # one pinned, asynchronous host -> device copy for all of it
        dev = to_device(np.concatenate((ids, positions, rows, ids[rows + 1])), torch.int64, self.device)
        ids_t, pos_t, rows_t, targets_t = dev[:T], dev[T:2 * T], dev[2 * T:2 * T + R], dev[2 * T + R:]
        backend = PackedAttentionBackend(lens.tolist(), self.device, self.kv_cache_dtype)
        with set_forward_context(ForwardContext(backend, self.numerics, self.kernels, backend.state_backend())):
            hidden = self.model(ids_t, pos_t, activation_checkpointing=self.activation_checkpointing)
            # the model's own lm_head (the rollout's kernel) on chunks of rows, fused with the
            # sampler's tempered log-softmax at the target column: the same bits as
            # tempered_logprobs(compute_logits(rows)).gather(targets)
            picked = token_logprobs_head(hidden.index_select(0, rows_t), self.lm_head_weight, targets_t,
                                         temp_t, temp, self.model.compute_logits, self.logprob_chunk_rows,
                                         with_entropy=entropies is not None)
        if entropies is not None:
            picked, ent = picked
            for i, part in zip(idx, ent.split(n_resp.tolist())):
                entropies[i] = part
        # one split (one autograd node, a single concatenation in backward), not a slice per sequence
        for i, part in zip(idx, picked.split(n_resp.tolist())):
            results[i] = part

    # ---- checkpoints -------------------------------------------------------------------
    # files a saved checkpoint carries along: the tokenizer's (chat templates included, which
    # transformers 5 keeps in chat_template.jinja) and the source's generation config
    TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                       "added_tokens.json", "tokenizer.model", "chat_template.jinja", "chat_template.json")
    MODEL_FILES = ("generation_config.json",)

    def companion_files(self) -> list[str]:
        """The paths of the files a saved checkpoint carries besides config and weights: the
        tokenizer this policy uses (the engine's, when colocated with `LLM(..., tokenizer=)`)
        and the source checkpoint's generation config."""
        src = self.model_config.path
        tok_dir = getattr(self.tokenizer, "name_or_path", None)
        tok_dir = tok_dir if tok_dir and os.path.isdir(tok_dir) else src
        found = [os.path.join(tok_dir, n) for n in self.TOKENIZER_FILES]
        found += [os.path.join(src, n) for n in self.MODEL_FILES]
        return [f for f in found if os.path.isfile(f)]

    def hf_config(self) -> dict:
        """The source checkpoint's config.json with this policy's dtype (what a saved one holds).
        A quantized source's quantization_config is left out: the weights saved are the master
        weights in that dtype (an FP8 checkpoint's dequantized and trained), which a loader
        told they were FP8-serialized would misread; load the saved checkpoint with
        quantization="fp8" to quantize them again."""
        with open(os.path.join(self.model_config.path, "config.json")) as f:
            cfg = json.load(f)
        cfg["torch_dtype"] = cfg["dtype"] = str(self.dtype).replace("torch.", "")
        cfg.pop("quantization_config", None)
        return cfg

    def save_pretrained(self, save_dir: str) -> None:
        """An HF-format checkpoint (config, safetensors with HF names, tokenizer) that
        transformers and upstream vLLM load."""
        from safetensors.torch import save_file

        os.makedirs(save_dir, exist_ok=True)
        # read before anything in save_dir changes (it may be the source): the companion files
        # and the config (opening config.json for writing would empty the source's first)
        files = self.companion_files()
        contents = {os.path.basename(f): pathlib.Path(f).read_bytes() for f in files}
        config = self.hf_config()
        with open(os.path.join(save_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        remove_stale_weights(save_dir)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.model.hf_state_dict().items()}
        save_file(tensors, os.path.join(save_dir, "model.safetensors"), metadata={"format": "pt"})
        for name, data in contents.items():
            with open(os.path.join(save_dir, name), "wb") as f:
                f.write(data)

    def execution_contract(self):
        """The same contract as the engine's for the same model, dtype, numerics and device
        (deployment settings aside, which must not change bits)."""
        from vllm.contract import build_contract
        return build_contract(self.model, self.numerics_spec, device=str(self.device),
                              deployment={"block_size": self.block_size, "max_model_len": self.model_config.max_model_len})


def _unpadded(sequences, attention_mask) -> list[np.ndarray]:
    """Each row of a padded batch cut to the one run of positions its mask marks."""
    if isinstance(sequences, (str, bytes)) or not hasattr(sequences, "__len__"):
        raise ValueError("token_logprobs takes a list of token-id sequences (or a [B, L] batch with attention_mask)")
    if isinstance(attention_mask, torch.Tensor):
        attention_mask = attention_mask.detach().cpu()
    if not hasattr(attention_mask, "__len__") or len(attention_mask) != len(sequences):
        n = len(attention_mask) if hasattr(attention_mask, "__len__") else "no"
        raise ValueError(f"attention_mask must have a row per sequence: {len(sequences)} sequences, {n} rows")
    out = []
    for i, (seq, row) in enumerate(zip(sequences, attention_mask)):
        seq = np.asarray(seq.detach().cpu() if isinstance(seq, torch.Tensor) else seq)
        m = np.asarray(row)
        if m.ndim != 1 or len(m) != len(seq):
            raise ValueError(f"attention_mask row {i} must be 1-D and as long as sequence {i} ({len(seq)}), "
                             f"got shape {m.shape}")
        if m.size and not np.isin(m, (0, 1)).all():
            raise ValueError(f"attention_mask row {i} must hold only 0 / 1 (or booleans)")
        idx = np.flatnonzero(m)
        if idx.size == 0:
            raise ValueError(f"attention_mask row {i} marks no tokens")
        if idx[-1] - idx[0] + 1 != idx.size:
            raise ValueError(f"attention_mask row {i} must mark one run of tokens (padding before and after it "
                             f"only), got a gap at position {int(idx[np.flatnonzero(np.diff(idx) > 1)[0]]) + 1}")
        out.append(seq[idx[0]:idx[-1] + 1])
    return out
