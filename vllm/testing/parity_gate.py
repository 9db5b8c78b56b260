"""The real-dims parity gate's machinery (benchmarks/parity_gate.py is its command line;
tests/test_parity_gate.py runs it on the CPU and, at real dims, on the GPU).

For each axis (an engine configuration or an event in an engine's life) and numerics mode,
`Gate.run` generates the same requests in several batch layouts and recomputes their
logprobs with the engine's colocated trainer, and counts by bit pattern:

- layouts: the same requests in other batch layouts (reversed order, sub-batches of 7, or
  the layout the axis names) against the whole batch: token ids and every logprob's bits;
- trainer: `llm.policy().token_logprobs` on the rollout's sequences against the rollout's
  logprobs, per sequence.

Axes:
  bf16          the dense model, model-dtype cache and linears
  kv-fp8        kv_cache_dtype="fp8"
  q-fp8         quantization="fp8"
  kv+q-fp8      both
  graphs        an eager engine (enforce_eager) against the CUDA-graph engine's rollout
  prefix-cache  the batch again with every prompt's blocks cached (warm) vs after a reset (cold)
  sleep-wake    sleep(), wake_up(), the batch again vs before (CUDA)
  update        after an in-place update_weights (new weights): layouts and trainer on them
  moe           the MoE model
  moe-ep2       the MoE model with experts in 2 in-process partitions (eager) vs EP=1
  tp2, tp4      the dense model with tensor_parallel_size 2 / 4 in one process vs TP=1, all with
                the K-leaf tree of 8 leaves (tp_leaves=8; docs/parallelism.md)
  moe-tp2, moe-tp4  the same for the MoE model (experts' intermediate dim sharded)
  gdn           the Gated DeltaNet hybrid (Qwen3-Next dims: 3 GDN layers to 1 gated attention)
  gdn-chunked   the hybrid with a 97-token step budget (prefills cut off the chunk grid) vs gdn
  gdn-prefix-cache  the hybrid's batch again warm (state snapshots restored) vs cold
  gdn-graphs    the hybrid eager vs with CUDA graphs (CUDA)
  gdn-preempt   the hybrid with a KV cache small enough to preempt and recompute vs gdn
  gdn-sleep-wake, gdn-update  as for the dense model, on the hybrid
  nemotron      the Mamba-2 hybrid (Nemotron-H's Mamba-2 dims: 128 heads of 64, d_state 128, 8
                groups, chunk 128; with attention and relu^2 MLP layers)
  nemotron-chunked  the Mamba-2 hybrid with a 97-token step budget (prefills cut off the chunk
                grid) vs nemotron
  nemotron-prefix-cache  the Mamba-2 hybrid's batch again warm (state snapshots restored) vs cold
"""
from __future__ import annotations

import gc
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass

import torch

from vllm import LLM, SamplingParams
from vllm.testing.parity_battery import signature
from vllm.testing.rollouts import sequences_and_logprobs

GDN_AXES = ("gdn", "gdn-chunked", "gdn-prefix-cache", "gdn-graphs", "gdn-preempt", "gdn-sleep-wake", "gdn-update")
NEMOTRON_AXES = ("nemotron", "nemotron-chunked", "nemotron-prefix-cache")
TP_AXES = ("tp2", "tp4", "moe-tp2", "moe-tp4")
AXES = ("bf16", "kv-fp8", "q-fp8", "kv+q-fp8", "graphs", "prefix-cache", "sleep-wake", "update", "moe", "moe-ep2",
        *TP_AXES, *GDN_AXES, *NEMOTRON_AXES)


@dataclass
class Row:
    axis: str
    mode: str
    layouts_differ: int
    layouts_total: int
    trainer_differ: int
    trainer_total: int
    trainer_max_abs_diff: float
    seconds: float
    detail: str = ""


def make_model_dir(config: dict) -> str:
    from vllm.testing.tiny_models import build_tokenizer

    d = tempfile.mkdtemp(prefix="parity_gate_")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    build_tokenizer(d)
    return d


# Qwen3-1.7B (dense) and the Qwen3-30B-A3B expert shapes (MoE), random weights at load
QWEN3_1_7B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645}
QWEN3_MOE = {
    **QWEN3_1_7B, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_attention_heads": 32,
    "num_key_value_heads": 4, "num_hidden_layers": 4, "tie_word_embeddings": False, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "router_aux_loss_coef": 0.001}
# Qwen3-Next's layer shapes (hidden 2048, GDN heads 16 key / 32 value of 128, gated attention
# 16 x 256 with 2 kv heads, partial rope 0.25) with a dense MLP and 8 layers (6 GDN, 2 attention)
QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4, "num_experts": 0,
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645}
# Nemotron-H-8B's layer shapes (hidden 4096, Mamba-2 128 heads of 64, d_state 128, 8 groups, chunk
# 128, attention 32 x 128 with 8 kv heads, relu^2 MLP of 21504) in 9 layers: 4 Mamba-2, 1
# attention, 4 MLP. The vocabulary is the dense model's, so the gate's prompts are valid ids.
NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 21504, "hybrid_override_pattern": "M-M-M*-M-", "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8,
    "ssm_state_size": 128, "conv_kernel": 4, "chunk_size": 128, "use_conv_bias": True, "time_step_min": 0.001,
    "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "layer_norm_epsilon": 1e-05,
    "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 2}
# small models of the same architectures for the CPU: head_dim 32, 128-multiple linears (the FP8 block)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, max_position_embeddings=2048, eos_token_id=2, bos_token_id=0)


def model_configs(tiny: bool = False, dense_layers: int | None = None, moe_layers: int | None = None) -> tuple[dict, dict]:
    dense, moe = dict(QWEN3_1_7B), dict(QWEN3_MOE)
    if tiny:
        dense.update(TINY, num_hidden_layers=2)
        moe.update(TINY, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
    if dense_layers:
        dense["num_hidden_layers"] = dense_layers
    if moe_layers:
        moe["num_hidden_layers"] = moe_layers
    return dense, moe


def gdn_config(tiny: bool = False) -> dict:
    cfg = dict(QWEN3_NEXT)
    if tiny:
        cfg.update(TINY, head_dim=32, num_hidden_layers=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4)
    return cfg


def nemotron_config(tiny: bool = False) -> dict:
    cfg = dict(NEMOTRON_H)
    if tiny:
        cfg.update(TINY, hybrid_override_pattern="M-M*-M", mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
                   ssm_state_size=16, chunk_size=16)
    return cfg


def make_requests(n: int, vocab: int, max_prompt: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """n prompts of 1..max_prompt tokens; every third shares a prefix of an earlier one."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for i in range(n):
        length = rng.randint(1, max_prompt)
        if i % 3 == 2 and prompts:
            base = prompts[rng.randrange(len(prompts))]
            cut = rng.randint(1, len(base))
            prompts.append(base[:cut] + [rng.randrange(3, vocab) for _ in range(max(1, length - cut))])
        else:
            prompts.append([rng.randrange(3, vocab) for _ in range(length)])
    seeds = [rng.randrange(1 << 30) for _ in range(n)]
    return prompts, seeds


@dataclass
class GateOptions:
    num_requests: int = 100
    max_prompt_len: int = 1000
    max_tokens: int = 64
    seed: int = 0
    device: str = "cuda"
    gpu_memory_utilization: float = 0.45
    trainer_micro_batch: int = 8192  # tokens per trainer micro-batch (bounds the [tokens, vocab] logits)


class Gate:
    """`dense_dir` / `moe_dir`: model directories (config + tokenizer; weights drawn at load)."""

    def __init__(self, args: GateOptions, dense_dir: str, moe_dir: str, vocab: int, gdn_dir: str | None = None,
                 nemotron_dir: str | None = None):
        self.args = args
        self.dirs = {"dense": dense_dir, "moe": moe_dir, "gdn": gdn_dir, "nemotron": nemotron_dir}
        self.prompts, self.seeds = make_requests(args.num_requests, vocab, args.max_prompt_len, args.seed)
        self.refs: dict[tuple[str, str], list] = {}  # (model, mode) -> the whole-batch signatures

    # ---- engines and rollouts ----------------------------------------------------------
    def make(self, model: str, mode: str, **kw) -> LLM:
        a = self.args
        opts = dict(device=a.device, numerics=mode, load_format="dummy", max_model_len=a.max_prompt_len + a.max_tokens + 16)
        if a.device == "cuda":
            opts.update(dtype="bfloat16", gpu_memory_utilization=a.gpu_memory_utilization)
        else:
            opts.update(dtype="float32", block_size=4, max_num_batched_tokens=512)
        opts.update(kw)
        return LLM(self.dirs[model], **opts)

    def params(self, idx: list[int]) -> list[SamplingParams]:
        return [SamplingParams(temperature=1.0, max_tokens=self.args.max_tokens, seed=self.seeds[i], logprobs=0,
                               ignore_eos=True) for i in idx]

    def roll(self, llm: LLM, order: list[int] | None = None, sub_batch: int | None = None,
             reset: bool = True) -> list:
        """Outputs in request order, generated in `order`, `sub_batch` requests per call."""
        order = list(range(len(self.prompts))) if order is None else order
        step = sub_batch or len(order)
        outs: dict[int, object] = {}
        for s in range(0, len(order), step):
            idx = order[s:s + step]
            if reset:
                llm.reset_prefix_cache()  # each layout computes its own prefixes unless told otherwise
            got = llm.generate([{"prompt_token_ids": self.prompts[i]} for i in idx], self.params(idx), use_tqdm=False)
            outs.update(zip(idx, got))
        return [outs[i] for i in range(len(self.prompts))]

    @staticmethod
    def sigs(outs) -> list:
        return [signature(o.outputs[0]) for o in outs]

    def layouts(self, llm: LLM, ref_sigs: list) -> tuple[int, int]:
        """Reversed order and sub-batches of 7 against the whole batch."""
        n = len(self.prompts)
        diff = total = 0
        for outs in (self.roll(llm, order=list(range(n))[::-1]), self.roll(llm, sub_batch=7)):
            diff += sum(a != b for a, b in zip(self.sigs(outs), ref_sigs))
            total += n
        return diff, total

    def trainer(self, llm: LLM, outs) -> tuple[int, int, float]:
        seqs, lps = sequences_and_logprobs(self.prompts, outs)
        policy = llm.policy()
        with torch.no_grad():
            got = policy.token_logprobs(seqs, [len(p) for p in self.prompts], temperature=1.0,
                                        max_tokens_per_micro_batch=self.args.trainer_micro_batch)
        diff, worst = 0, 0.0
        for a, b in zip(got, lps):
            a = a.detach().float().cpu()
            if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                diff += 1
                worst = max(worst, (a.double() - b.double()).abs().max().item())
        return diff, len(seqs), worst

    # ---- axes --------------------------------------------------------------------------
    def standard(self, axis: str, model: str, mode: str, **kw) -> Row:
        t0 = time.perf_counter()
        llm = self.make(model, mode, **kw)
        outs = self.roll(llm)
        ref = self.sigs(outs)
        if kw == {}:
            self.refs[(model, mode)] = ref
        ld, lt = self.layouts(llm, ref)
        td, tt, worst = self.trainer(llm, outs)
        free(llm)
        return Row(axis, mode, ld, lt, td, tt, worst, time.perf_counter() - t0)

    def life(self, mode: str, wanted: list[str], model: str = "dense") -> list[Row]:
        """The model's own axis (bf16 for the dense model), prefix-cache, sleep-wake and update
        on one engine (sleep mode on), in order. Axes of a model other than the dense one carry
        its name as a prefix (gdn-prefix-cache)."""
        prefix = "" if model == "dense" else f"{model}-"
        wanted = [w.removeprefix(prefix) for w in wanted]
        rows = []
        t0 = time.perf_counter()
        # a recurrent model's prefix hits need a state snapshot per prompt: with fewer (LRU),
        # a batch resent in the same order evicts each snapshot before its prompt comes back
        snapshots = {} if model == "dense" else {"num_state_snapshots": len(self.prompts)}
        llm = self.make(model, mode, enable_sleep_mode=self.args.device == "cuda", **snapshots)
        outs = self.roll(llm)
        ref = self.sigs(outs)
        self.refs[(model, mode)] = ref
        if "bf16" in wanted or model in wanted:
            ld, lt = self.layouts(llm, ref)
            td, tt, worst = self.trainer(llm, outs)
            rows.append(Row("bf16" if model == "dense" else model, mode, ld, lt, td, tt, worst, time.perf_counter() - t0))
        if "prefix-cache" in wanted:
            t0 = time.perf_counter()
            cold = self.roll(llm)  # after a reset: only hits between requests of the batch
            warm = self.roll(llm, reset=False)  # every prompt's full blocks cached
            hits = sum(o.num_cached_tokens for o in warm)
            ld = sum(a != b for a, b in zip(self.sigs(warm), self.sigs(cold)))
            td, tt, worst = self.trainer(llm, warm)
            rows.append(Row(prefix + "prefix-cache", mode, ld, len(warm), td, tt, worst, time.perf_counter() - t0,
                            f"{hits} cached prompt tokens when warm"))
        if "sleep-wake" in wanted and self.args.device == "cuda":
            t0 = time.perf_counter()
            freed = llm.sleep()
            llm.wake_up()
            after = self.roll(llm)
            ld = sum(a != b for a, b in zip(self.sigs(after), ref))
            td, tt, worst = self.trainer(llm, after)
            rows.append(Row(prefix + "sleep-wake", mode, ld, len(after), td, tt, worst, time.perf_counter() - t0,
                            f"{freed / 2 ** 30:.1f} GiB released"))
        if "update" in wanted:
            t0 = time.perf_counter()
            g = torch.Generator(device=llm.llm_engine.executor.info.device).manual_seed(7)
            state = llm.llm_engine.executor.model.hf_state_dict()
            new = {k: (v.float() * (1 + 0.05 * torch.randn(v.shape, generator=g, device=v.device))).to(v.dtype)
                   for k, v in state.items()}
            version = llm.update_weights(new)
            del new, state
            outs2 = self.roll(llm)
            ref2 = self.sigs(outs2)
            changed = sum(a != b for a, b in zip(ref2, ref))
            ld, lt = self.layouts(llm, ref2)
            td, tt, worst = self.trainer(llm, outs2)
            rows.append(Row(prefix + "update", mode, ld, lt, td, tt, worst, time.perf_counter() - t0,
                            f"weight version {version}; {changed}/{len(ref2)} rollouts changed by the update"))
        free(llm)
        return rows

    def preempt_blocks(self) -> int:
        """KV blocks for a quarter of the requests at their longest: the batch runs, with preemptions."""
        block = 16 if self.args.device == "cuda" else 4
        return max(2, self.args.num_requests // 4) * -(-(self.args.max_prompt_len + self.args.max_tokens) // block) + 1

    def reference(self, model: str, mode: str) -> list:
        """The whole-batch signatures of the default engine of `model` (made if no axis did)."""
        if (model, mode) not in self.refs:
            llm = self.make(model, mode)
            self.refs[(model, mode)] = self.sigs(self.roll(llm))
            free(llm)
        return self.refs[(model, mode)]

    def against_reference(self, axis: str, model: str, mode: str, detail: str, **kw) -> Row:
        """An engine configured by `kw` against the model's default engine's whole batch."""
        t0 = time.perf_counter()
        ref = self.reference(model, mode)
        llm = self.make(model, mode, **kw)
        outs = self.roll(llm)
        ld = sum(a != b for a, b in zip(self.sigs(outs), ref))
        td, tt, worst = self.trainer(llm, outs)
        stats = llm.llm_engine.scheduler.num_preemptions
        free(llm)
        if "preempt" in axis:
            detail += f" ({stats} preemptions)"
        return Row(axis, mode, ld, len(outs), td, tt, worst, time.perf_counter() - t0, detail)

    def graphs(self, mode: str, model: str = "dense") -> Row:
        return self.against_reference("graphs" if model == "dense" else f"{model}-graphs", model, mode,
                                      "eager vs CUDA graphs", enforce_eager=True)

    def moe_ep2(self, mode: str) -> Row:
        from vllm.parallel.expert_parallel import apply_expert_parallel

        t0 = time.perf_counter()
        ref = self.reference("moe", mode)
        # expert-parallel steps run eagerly (the dispatch reads counts on the host)
        llm = self.make("moe", mode, enforce_eager=True)
        apply_expert_parallel(llm.llm_engine.executor.model, 2)
        outs = self.roll(llm)
        ld = sum(a != b for a, b in zip(self.sigs(outs), ref))
        rev = self.roll(llm, order=list(range(len(self.prompts)))[::-1])
        ld += sum(a != b for a, b in zip(self.sigs(rev), ref))
        td, tt, worst = self.trainer(llm, outs)
        free(llm)
        return Row("moe-ep2", mode, ld, 2 * len(outs), td, tt, worst, time.perf_counter() - t0,
                   "EP=2 (batch, reversed) vs EP=1")

    def tensor_parallel(self, mode: str, model: str, size: int) -> Row:
        """TP=size in one process against TP=1, both with the 8-leaf tree (the default engine
        runs no tree, so it is not the reference here)."""
        t0 = time.perf_counter()
        key = (f"{model}-tree8", mode)
        if key not in self.refs:
            llm = self.make(model, mode, tp_leaves=8)
            self.refs[key] = self.sigs(self.roll(llm))
            free(llm)
        llm = self.make(model, mode, tensor_parallel_size=size, tp_leaves=8)
        outs = self.roll(llm)
        ld = sum(a != b for a, b in zip(self.sigs(outs), self.refs[key]))
        td, tt, worst = self.trainer(llm, outs)
        free(llm)
        axis = f"tp{size}" if model == "dense" else f"{model}-tp{size}"
        return Row(axis, mode, ld, len(outs), td, tt, worst, time.perf_counter() - t0,
                   f"TP={size} vs TP=1, tp_leaves=8, in one process")

    def run(self, mode: str, axes: list[str]) -> list[Row]:
        rows: list[Row] = []
        life = [a for a in ("bf16", "prefix-cache", "sleep-wake", "update") if a in axes]
        if life:
            rows += self.life(mode, life)
        for axis, kw in (("kv-fp8", dict(kv_cache_dtype="fp8")), ("q-fp8", dict(quantization="fp8")),
                         ("kv+q-fp8", dict(kv_cache_dtype="fp8", quantization="fp8"))):
            if axis in axes:
                rows.append(self.standard(axis, "dense", mode, **kw))
        if "graphs" in axes and self.args.device == "cuda":
            rows.append(self.graphs(mode))
        if "moe" in axes:
            rows.append(self.standard("moe", "moe", mode))
        if "moe-ep2" in axes:
            rows.append(self.moe_ep2(mode))
        for axis in TP_AXES:
            if axis in axes:
                model, _, size = axis.rpartition("tp")
                rows.append(self.tensor_parallel(mode, model.rstrip("-") or "dense", int(size)))
        gdn_life = [a for a in ("gdn", "gdn-prefix-cache", "gdn-sleep-wake", "gdn-update") if a in axes]
        if gdn_life:
            rows += self.life(mode, gdn_life, model="gdn")
        if "gdn-chunked" in axes:
            rows.append(self.against_reference("gdn-chunked", "gdn", mode, "97-token steps vs the default budget",
                                               max_num_batched_tokens=97))
        if "gdn-graphs" in axes and self.args.device == "cuda":
            rows.append(self.graphs(mode, "gdn"))
        if "gdn-preempt" in axes:
            rows.append(self.against_reference("gdn-preempt", "gdn", mode, "a KV cache for a quarter of the batch",
                                               num_gpu_blocks_override=self.preempt_blocks()))
        nemotron_life = [a for a in ("nemotron", "nemotron-prefix-cache") if a in axes]
        if nemotron_life:
            rows += self.life(mode, nemotron_life, model="nemotron")
        if "nemotron-chunked" in axes:
            rows.append(self.against_reference("nemotron-chunked", "nemotron", mode,
                                               "97-token steps vs the default budget", max_num_batched_tokens=97))
        for r in rows:
            print(f"[{mode}] {r.axis}: layouts {r.layouts_differ}/{r.layouts_total}, trainer {r.trainer_differ}/"
                  f"{r.trainer_total} (max |diff| {r.trainer_max_abs_diff:.3g}), {r.seconds:.0f} s {r.detail}", flush=True)
        return rows


def free(llm: LLM) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def format_table(rows: list[Row], modes: list[str]) -> str:
    by = {(r.axis, r.mode): r for r in rows}
    axes = list(dict.fromkeys(r.axis for r in rows))
    width = max([14] + [len(a) + 1 for a in axes])
    head = f"{'axis':<{width}}" + "".join(f"{m + ' layouts':>20}{m + ' trainer':>20}" for m in modes)
    lines = [head]
    for a in axes:
        cells = ""
        for m in modes:
            r = by.get((a, m))
            cells += (f"{f'{r.layouts_differ}/{r.layouts_total}':>20}{f'{r.trainer_differ}/{r.trainer_total}':>20}"
                      if r else f"{'-':>20}{'-':>20}")
        lines.append(f"{a:<{width}}{cells}")
    return "\n".join(lines)


def gate_passes(rows: list[Row]) -> bool:
    return all(r.layouts_differ == 0 and r.trainer_differ == 0 for r in rows if r.mode == "invariant")
