"""Checks of a model file against transformers on a tiny random-weight checkpoint, on the CPU,
shared by the model tests (tests/test_qwen3_next.py, tests/test_nemotron_h.py): config
refusals, the full-size build on the meta device, checkpoint names both ways, logits, greedy
tokens, and the gradients of token logprobs in float64.

`load_hf(path, dtype)` is how a test loads transformers' model for its architecture
(tiny_models.load_hf_model with that architecture's options)."""
from __future__ import annotations

import json
import os
import shutil
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm import LLM, SamplingParams
from vllm.forward_context import ForwardContext, set_forward_context
from vllm.config import NumericsSpec
from vllm.model_loader.build import build_model, read_model_config
from vllm.training import Policy
from vllm.training.attention import PackedAttentionBackend

# prompts of the greedy comparison
GREEDY_PROMPTS = [list(range(10, 30)), [7, 300, 12, 5]]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def cpu_model(path, numerics: str = "fast"):
    """Our model from a checkpoint, float32 on the CPU."""
    return build_model(read_model_config(path), NumericsSpec(torch.float32, numerics), "cpu")[0]


# ---- config --------------------------------------------------------------------------------------

def assert_config_refusals(from_hf: Callable, bad: list) -> None:
    """from_hf raises ValueError matching msg for each (config.json dict, msg) in `bad`."""
    for hf, msg in bad:
        with pytest.raises(ValueError, match=msg):
            from_hf(hf)


def assert_engine_refuses(path, tmp_path, config_edit: dict, match: str) -> None:
    """The engine refuses a copy of the checkpoint whose config.json has `config_edit` applied."""
    d = tmp_path / "bad"
    shutil.copytree(path, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(config_edit)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(str(d), device="cpu")


def build_on_meta(model_class, cfg, hf_model_class, hf_config_class, hub_config: dict):
    """Ours (bf16) and transformers' model for a full-size config.json on the meta device, their
    parameter counts equal. Returns (ours, theirs)."""
    with torch.device("meta"):
        ours = model_class(cfg, torch.bfloat16)
        theirs = hf_model_class(hf_config_class(**{k: v for k, v in hub_config.items()
                                                   if k not in ("architectures", "torch_dtype")}))
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    return ours, theirs


# ---- checkpoint names ----------------------------------------------------------------------------

def assert_checkpoint_round_trip(model, path) -> dict[str, torch.Tensor]:
    """hf_state_dict gives back the checkpoint's names and bits. Returns it."""
    ckpt = load_file(os.path.join(path, "model.safetensors"))
    ours = model.hf_state_dict()
    assert set(ours) == set(ckpt)
    for name, t in ckpt.items():
        assert torch.equal(bits(ours[name]), bits(t)), name
    return ours


def assert_loads_as_checkpoint(path, tmp_path, tensors: dict[str, torch.Tensor]) -> None:
    """`tensors` written as a copy of the checkpoint's weights load to the checkpoint's
    parameters, bit for bit."""
    d = tmp_path / "rewritten"
    shutil.copytree(path, d)
    os.remove(d / "model.safetensors")
    save_file(tensors, str(d / "model.safetensors"))
    a, b = cpu_model(str(d)), cpu_model(path)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(bits(pa), bits(pb)), na


# ---- against transformers --------------------------------------------------------------------------

def our_logits(path, numerics: str, ids: list[int]) -> torch.Tensor:
    """Logits of one packed sequence through our model (the trainer's packed backend)."""
    model = cpu_model(path, numerics)
    backend = PackedAttentionBackend([len(ids)], torch.device("cpu"))
    with torch.no_grad(), set_forward_context(ForwardContext(backend, numerics, state=backend.state_backend())):
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


def assert_logits_match(path, numerics: str, load_hf: Callable, num_tokens: int, tol: float = 1e-4) -> None:
    ids = torch.randint(3, 500, (num_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = our_logits(path, numerics, ids)
    with torch.no_grad():
        ref = load_hf(path, torch.float32)(torch.tensor([ids])).logits[0]
    assert ref.std() > 0.05  # not a degenerate model
    assert (ours - ref).abs().max().item() < tol


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """argmax decoding with transformers' forward, recomputed from the whole sequence each step."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def assert_greedy_match(path, load_hf: Callable, n: int, prompts: list = GREEDY_PROMPTS) -> None:
    """The engine's greedy tokens in both numerics modes are transformers' (hf_greedy)."""
    hf = load_hf(path, torch.float32)
    want = [hf_greedy(hf, p, n) for p in prompts]
    for numerics in ("invariant", "fast"):
        llm = LLM(path, device="cpu", numerics=numerics, block_size=4)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, numerics


def logprob_gradients(path, prompts: list, numerics: str, load_hf: Callable):
    """The backward of a weighted sum of token logprobs (three prompts, five completion tokens
    each, temperature 0.7) through our trainer (float32) and through transformers (float64):
    the logprobs agree to 1e-5 and both models hold their gradients. Returns (policy, hf) for
    the test to compare them (tiny_models.compare_grads)."""
    seqs = [p + [7, 8, 9, 10, 11] for p in prompts[:3]]
    plens = [len(p) for p in prompts[:3]]
    weights = [torch.linspace(-1, 1, len(s) - pl) for s, pl in zip(seqs, plens)]
    policy = Policy.from_pretrained(path, device="cpu", dtype="float32", numerics=numerics)
    lps = policy.token_logprobs(seqs, plens, temperature=0.7, max_tokens_per_micro_batch=64)
    sum((w * lp).sum() for w, lp in zip(weights, lps)).backward()
    hf = load_hf(path, torch.float64)
    ref = []
    for s, pl in zip(seqs, plens):
        lp = torch.log_softmax(hf(torch.tensor([s])).logits[0] / 0.7, dim=-1)
        ref.append(lp[pl - 1:len(s) - 1].gather(1, torch.tensor(s[pl:])[:, None])[:, 0])
    for a, b in zip(lps, ref):
        assert (a.double() - b).abs().max().item() < 1e-5
    sum((w.double() * lp).sum() for w, lp in zip(weights, ref)).backward()
    return policy, hf
