"""The shape of the house: a model owns its config parsing, its HF-name mapping and its
layer loop, so adding an architecture touches the model file and the registry only.

`ToyExpertsForCausalLM` below is an architecture the engine has never seen (its own
config fields, HF names unlike the Llama family's, a stacked per-expert weight whose
shards are not rows of a fused linear). Registered, it is served, trained, synced and
contract-checked by the unchanged engine, trainer and weight sync. The import checks
keep model-specific names out of the generic code."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import partial

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from vllm import LLM, SamplingParams
from vllm.forward_context import get_forward_context
from vllm.kernels import ops
from vllm.layers.attention import Attention
from vllm.layers.cache_spec import RecurrentStateSpec, StateTensor
from vllm.layers.embedding import LMHead, VocabEmbedding
from vllm.layers.linear import FusedLinear, Linear
from vllm.layers.norm import RMSNorm
from vllm.layers.rope_config import RopeScaling
from vllm.layers.rotary import RotaryEmbedding
from vllm.models.checkpointing import checkpointed
from vllm.models.weights import WeightMapping, WeightSlot
from vllm.training import Policy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- a new architecture, written the way docs/architecture.md says -----------------------
@dataclass
class ToyConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, hf: dict) -> "ToyConfig":
        return cls(hf["architectures"][0], hf["vocab_size"], hf["d_model"], hf["n_layers"], hf["n_heads"],
                   hf["n_kv_heads"], hf["d_model"] // hf["n_heads"], hf["n_experts"], hf["max_position_embeddings"])


class Experts(nn.Module):
    """Every expert applied and summed in index order (fixed order: batch invariant)."""

    def __init__(self, n: int, hidden: int, dtype):
        super().__init__()
        self.w = nn.Parameter(torch.empty(n, hidden, hidden, dtype=dtype), requires_grad=False)

    def forward(self, x):
        out = ops.linear(x, self.w[0], None)
        for e in range(1, self.w.shape[0]):
            out = out + ops.linear(x, self.w[e], None)
        return out


class Block(nn.Module):
    def __init__(self, cfg: ToyConfig, i: int, rotary, dtype):
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.sizes = [q, kv, kv]
        self.ln = RMSNorm(cfg.hidden_size, dtype=dtype)
        self.wqkv = FusedLinear(cfg.hidden_size, {"q": q, "k": kv, "v": kv}, dtype=dtype)
        self.wo = Linear(q, cfg.hidden_size, dtype=dtype)
        self.ln2 = RMSNorm(cfg.hidden_size, dtype=dtype)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, dtype)
        self.rotary = [rotary]
        self.attn = Attention(i, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)

    def forward(self, positions, x):
        c = self.cfg
        q, k, v = self.wqkv(self.ln(x)).split(self.sizes, dim=-1)
        q, k = self.rotary[0](positions, q.reshape(-1, c.num_attention_heads, c.head_dim),
                              k.reshape(-1, c.num_key_value_heads, c.head_dim))
        x = x + self.wo(self.attn(q, k, v.reshape(-1, c.num_key_value_heads, c.head_dim)).reshape(len(x), -1))
        return x + self.experts(self.ln2(x))


class ToyExpertsForCausalLM(nn.Module):
    config_class = ToyConfig

    def __init__(self, cfg: ToyConfig, dtype=torch.float32):
        super().__init__()
        self.config = cfg
        self.embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, 10000.0, RopeScaling())
        self.blocks = nn.ModuleList(Block(cfg, i, rotary, dtype) for i in range(cfg.num_hidden_layers))
        self.final_ln = RMSNorm(cfg.hidden_size, dtype=dtype)
        self.head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype)

    def forward(self, input_ids, positions, activation_checkpointing: bool = False):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = checkpointed(block, positions, x) if activation_checkpointing else block(positions, x)
        return self.final_ln(x)

    def compute_logits(self, hidden):
        return self.head(hidden)

    def weight_mapping(self) -> WeightMapping:
        slots = {"tok_embeddings.weight": WeightSlot("embed.weight"), "norm.weight": WeightSlot("final_ln.weight"),
                 "output.weight": WeightSlot("head.weight")}
        for i, b in enumerate(self.blocks):
            p = f"blocks.{i}"
            slots[f"layers.{i}.attention_norm.weight"] = WeightSlot(f"{p}.ln.weight")
            for sid in ("q", "k", "v"):
                slots[f"layers.{i}.attention.w{sid}.weight"] = WeightSlot(f"{p}.wqkv.weight", sid,
                                                                          partial(b.wqkv.shard, shard_id=sid))
            slots[f"layers.{i}.attention.wo.weight"] = WeightSlot(f"{p}.wo.weight")
            slots[f"layers.{i}.ffn_norm.weight"] = WeightSlot(f"{p}.ln2.weight")
            for e in range(self.config.num_experts):
                slots[f"layers.{i}.experts.{e}.weight"] = WeightSlot(f"{p}.experts.w", e, lambda t, e=e: t[e])
        return WeightMapping(self, slots)

    def hf_state_dict(self, grads: bool = False):
        return self.weight_mapping().state_dict(grads)


def write_toy_checkpoint(path, monkeypatch, cls, seed: int, init=None, **dims) -> str:
    """Register `cls` under its own name (for this test) and write a random-weight checkpoint
    of it to `path`; `init(model)` may set parameters after the random draw."""
    from vllm.model_loader.loader import init_dummy_weights
    from vllm.models import registry

    monkeypatch.setitem(registry._MODELS, cls.__name__, (__name__, cls.__name__))
    hf = {"architectures": [cls.__name__], "vocab_size": 512, "n_heads": 4, "n_kv_heads": 2,
          "max_position_embeddings": 256, "torch_dtype": "float32", **dims}
    (path / "config.json").write_text(json.dumps(hf))
    model = cls(ToyConfig.from_hf(hf))
    init_dummy_weights(model, seed=seed, std=0.1)
    if init is not None:
        init(model)
    save_file({k: v.contiguous() for k, v in model.hf_state_dict().items()}, str(path / "model.safetensors"))
    return str(path)


@pytest.fixture
def toy_checkpoint(tmp_path, tokenizer_dir, monkeypatch):
    return write_toy_checkpoint(tmp_path, monkeypatch, ToyExpertsForCausalLM, seed=4, d_model=64, n_layers=2,
                                n_experts=3)


def _bits(t):
    return t.detach().contiguous().view(torch.int32)


def test_new_architecture_needs_only_its_model_file_and_registry(toy_checkpoint, tokenizer_dir):
    prompts = [list(range(10, 30)), list(range(40, 47))]
    sp = SamplingParams(temperature=0.9, max_tokens=6, seed=3, logprobs=0, ignore_eos=True)

    def rollout(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
        return seqs, [torch.tensor([o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(o.outputs[0].token_ids)])
                      for o in outs]

    llm = LLM(toy_checkpoint, tokenizer=tokenizer_dir, device="cpu", numerics="invariant")
    contract = llm.execution_contract()
    assert contract.semantic["num_experts"] == 3 and contract.semantic["architecture"] == "ToyExpertsForCausalLM"
    seqs, lps = rollout(llm)
    # the standalone trainer: same bits, with and without activation checkpointing, same grads
    grads = []
    for ckpt in (False, True):
        policy = Policy.from_pretrained(toy_checkpoint, device="cpu", activation_checkpointing=ckpt)
        calls = []
        policy.model.blocks[1].register_forward_pre_hook(lambda *_: calls.append(1))
        got = policy.token_logprobs(seqs, [len(p) for p in prompts], temperature=0.9)
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, lps))
        sum(g.sum() for g in got).backward()
        assert len(calls) == (2 if ckpt else 1)  # checkpointed: run again in backward
        grads.append(policy.model.hf_state_dict(grads=True))
    assert grads[0].keys() == grads[1].keys() and "layers.1.experts.2.weight" in grads[0]
    assert all(torch.equal(_bits(grads[0][k]), _bits(grads[1][k])) for k in grads[0])
    # an optimizer step, synced into the engine (complete, contract-checked): parity again
    torch.optim.SGD(policy.parameters(), lr=0.5).step()
    llm.update_weights(policy.model.hf_state_dict(), contract=policy.execution_contract(), require_complete=True)
    seqs2, lps2 = rollout(llm)
    with torch.no_grad():
        got = policy.token_logprobs(seqs2, [len(p) for p in prompts], temperature=0.9)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, lps2))
    assert any(not torch.equal(a, b) for a, b in zip(lps, lps2))
    # one expert's shard alone is a valid partial update; a complete one needs every expert
    w = policy.model.hf_state_dict()["layers.0.experts.1.weight"]
    llm.update_weights({"layers.0.experts.1.weight": w})
    with pytest.raises(ValueError, match=r"incomplete update: missing \['blocks.0.experts.w\[1\]'\]"):
        llm.update_weights({k: v for k, v in policy.model.hf_state_dict().items() if k != "layers.0.experts.1.weight"},
                           require_complete=True)


# ---- a recurrent-state layer, the same way: its model file, its layer, its op ---------------
def toy_decay_scan(u, decay, md, cache):
    """The toy layer's op (its "kernel module"): h_t = decay * h_(t-1) + u_t per channel in
    float32, one sequence at a time; h starts at 0 for a sequence at position 0, else from
    its slot, and the slot keeps the state after the step's last token."""
    cu, starts = md.cu_seqlens.tolist(), md.start_pos.tolist()
    slots = md.slots.tolist() if md.slots is not None else None
    d = decay.float()
    out = []
    for s in range(len(starts)):
        h = (cache["h"][slots[s]].clone() if cache is not None and starts[s] > 0
             else torch.zeros(u.shape[1], dtype=torch.float32, device=u.device))
        for t in range(cu[s], cu[s + 1]):
            h = d * h + u[t].float()
            out.append(h)
        if cache is not None:
            cache["h"][slots[s]] = h
    return torch.stack(out).to(u.dtype)


class DecayScan(nn.Module):
    def __init__(self, cfg, state_idx: int, dtype):
        super().__init__()
        self.state_idx, self.dim = state_idx, cfg.hidden_size
        self.ln = RMSNorm(cfg.hidden_size, dtype=dtype)
        self.inp = Linear(cfg.hidden_size, cfg.hidden_size, dtype=dtype)
        self.out = Linear(cfg.hidden_size, cfg.hidden_size, dtype=dtype)
        self.decay = nn.Parameter(torch.full((cfg.hidden_size,), 0.9, dtype=dtype), requires_grad=False)

    def cache_spec(self, numerics: str) -> RecurrentStateSpec:
        return RecurrentStateSpec(self.state_idx, "toy_decay_scan", (StateTensor("h", (self.dim,), torch.float32),),
                                  chunk_size=8, snapshot=("h",))

    def forward(self, positions, x):
        st = get_forward_context().state
        h = toy_decay_scan(self.inp(self.ln(x)), self.decay, st.metadata, st.layer(self.state_idx))
        return x + self.out(h)


class ToyHybridForCausalLM(ToyExpertsForCausalLM):
    """Recurrent, attention, recurrent: the attention layer's cache is paged KV block 0 of
    the attention backend, the recurrent layers' states are slots 0 and 1 of the state backend."""

    def __init__(self, cfg: ToyConfig, dtype=torch.float32):
        nn.Module.__init__(self)
        self.config = cfg
        self.embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, 10000.0, RopeScaling())
        self.blocks = nn.ModuleList([DecayScan(cfg, 0, dtype), Block(cfg, 0, rotary, dtype), DecayScan(cfg, 1, dtype)])
        self.final_ln = RMSNorm(cfg.hidden_size, dtype=dtype)
        self.head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype)

    def weight_mapping(self) -> WeightMapping:
        slots = {"tok_embeddings.weight": WeightSlot("embed.weight"), "norm.weight": WeightSlot("final_ln.weight"),
                 "output.weight": WeightSlot("head.weight")}
        for name, _ in self.named_parameters():
            if name.startswith("blocks."):
                slots[name.replace("blocks.", "layers.")] = WeightSlot(name)
        return WeightMapping(self, slots)


@pytest.fixture
def toy_hybrid_checkpoint(tmp_path, tokenizer_dir, monkeypatch):
    def decays(model):
        for block in (model.blocks[0], model.blocks[2]):
            block.decay.data.uniform_(0.5, 0.99)
    return write_toy_checkpoint(tmp_path, monkeypatch, ToyHybridForCausalLM, seed=7, init=decays, d_model=32,
                                n_layers=3, n_experts=1)


def test_recurrent_state_layer_needs_only_its_model_file_layer_and_op(toy_hybrid_checkpoint, tokenizer_dir):
    """The engine sizes, assigns, snapshots and restores the toy layer's state slots from its
    declaration alone; the trainer recomputes the rollout's logprob bits; sync and contract
    see the new parameters and the state's declaration."""
    shared = list(range(30, 70))  # 40 tokens: a state snapshot at 32 (the grid: lcm(block 16, chunk 8))
    prompts = [shared + [5, 6, 7], list(range(100, 111)), shared + [9]]

    def rollout(llm, ps=prompts, n=1):
        sp = SamplingParams(temperature=0.9, max_tokens=12, seed=3, logprobs=0, ignore_eos=True, n=n)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        seqs = [p + c.token_ids for p, o in zip(ps, outs) for c in o.outputs]
        lps = [torch.tensor([c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]) for o in outs for c in o.outputs]
        return seqs, lps

    # chunked prefill (7-token steps) and a cold cache vs one engine whose second pass
    # starts from the prefix cache's state snapshot: the same tokens and logprob bits
    cold = LLM(toy_hybrid_checkpoint, tokenizer=tokenizer_dir, device="cpu", numerics="invariant",
               max_num_batched_tokens=7, enable_prefix_caching=False)
    seqs, lps = rollout(cold)
    warm = LLM(toy_hybrid_checkpoint, tokenizer=tokenizer_dir, device="cpu", numerics="invariant")
    rollout(warm, prompts[:1])
    kv = warm.llm_engine.kv
    assert kv.state is not None and kv.state.num_snapshots_held == 1
    seqs2, lps2 = rollout(warm)
    assert kv.stats()["prefix_cache_hits"] >= 2 * 32  # both shared-prefix prompts restored the snapshot
    assert seqs2 == seqs and all(torch.equal(_bits(a), _bits(b)) for a, b in zip(lps, lps2))
    contract = warm.execution_contract()
    assert contract.numerical["recurrent_states"] == {"toy_decay_scan": {"chunk_size": 8, "tensors": {"h": "float32"}}}
    # the trainer: no state cache, every sequence from position 0: the same bits, and grads
    policy = Policy.from_pretrained(toy_hybrid_checkpoint, device="cpu")
    got = policy.token_logprobs(seqs, [len(p) for p in prompts], temperature=0.9)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, lps))
    sum(g.sum() for g in got).backward()
    grads = policy.model.hf_state_dict(grads=True)
    assert grads["layers.2.decay"].abs().sum() > 0
    # an optimizer step, synced (contract-checked): the new decay is served, parity again
    torch.optim.SGD(policy.parameters(), lr=0.5).step()
    warm.update_weights(policy.model.hf_state_dict(), contract=policy.execution_contract(), require_complete=True)
    assert kv.state.num_snapshots_held == 0  # states of the old weights are never restored
    seqs3, lps3 = rollout(warm, n=2)
    with torch.no_grad():
        got = policy.token_logprobs(seqs3, [len(p) for p in prompts for _ in range(2)], temperature=0.9)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, lps3))
    assert any(not torch.equal(a, b) for a, b in zip(lps, lps3[::2]))


# ---- no model-specific knowledge outside models/ -------------------------------------------
# Generic modules: what they may import from vllm.models, and names they must not contain
# (identifiers and string constants; docstrings and comments are free to give examples).
GENERIC = ["vllm/config.py", "vllm/weight_sync/session.py", "vllm/weight_sync/bucket.py", "vllm/weight_sync/group.py", "vllm/weight_sync/ipc.py", "vllm/contract.py", "vllm/training/policy.py",
           "vllm/model_loader/build.py", "vllm/model_loader/loader.py"]
ALLOWED_MODEL_IMPORTS = {"vllm.models.registry"}
MODEL_SPECIFIC = re.compile(r"llama|qwen|embed_tokens|lm_head\.|(^|\.)layers(\.|$)|(q|k|v|o|qkv|gate|up|down)_proj|gate_up"
                            r"|intermediate_size|num_key_value_heads|num_attention_heads|head_dim|qk_norm|qkv_bias"
                            r"|rope_|tie_word|rms_norm")


def _imports(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _words(tree: ast.AST) -> set[str]:
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.arg):
            words.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.add(node.value)
    return words


@pytest.mark.parametrize("path", GENERIC)
def test_generic_code_has_no_model_specific_knowledge(path):
    tree = ast.parse(open(os.path.join(REPO, path)).read())
    model_imports = {m for m in _imports(tree) if m.startswith("vllm.models.")}
    assert model_imports <= ALLOWED_MODEL_IMPORTS | {f"{m}.model_class" for m in ALLOWED_MODEL_IMPORTS}, model_imports
    if path == "vllm/config.py":
        assert not {m for m in _imports(tree) if m.startswith(("vllm.models", "vllm.layers"))}
    leaks = sorted(w for w in _words(tree) if MODEL_SPECIFIC.search(w.lower()))
    assert not leaks, f"{path} names model-specific things: {leaks}"


def test_models_depend_only_on_layers_and_the_forward_context():
    folder = os.path.join(REPO, "vllm", "models")
    for fn in sorted(os.listdir(folder)):
        if fn.endswith(".py"):
            tree = ast.parse(open(os.path.join(folder, fn)).read())
            bad = {m for m in _imports(tree) if m.startswith("vllm") and not
                   m.startswith(("vllm.layers", "vllm.models", "vllm.forward_context"))}
            assert not bad, f"vllm/models/{fn} imports {sorted(bad)}"


def test_model_modules_are_imported_only_when_built():
    code = ("import sys, vllm.config, vllm.weight_sync, vllm.contract, vllm.training.policy, vllm.entrypoints.llm\n"
            "print(sorted(m for m in sys.modules if m.startswith('vllm.models.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": REPO}).stdout.strip()
    assert out == "['vllm.models.registry']"


def test_llama_family_layer_loop_checkpoints(tiny_qwen3):
    """The model's own loop recomputes each layer in backward when asked, only under autograd."""
    policy = Policy.from_pretrained(tiny_qwen3, device="cpu", activation_checkpointing=True)
    calls = []
    policy.model.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    lps = policy.token_logprobs([[5, 6, 7, 8]], [2])
    lps[0].sum().backward()
    assert len(calls) == 2
    with torch.no_grad():
        policy.token_logprobs([[5, 6, 7, 8]], [2])
    assert len(calls) == 3
