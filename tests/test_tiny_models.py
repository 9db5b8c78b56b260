"""Tests for the locally built test checkpoints, tokenizer and embedded default model."""

import copy
import hashlib
import json
import os

import pytest
import torch
from safetensors import safe_open

from vllm.testing.tiny_models import (
    ARCH_CONFIGS,
    CHATML_TEMPLATE,
    ENDOFTEXT,
    EOS_TOKEN,
    IM_END,
    IM_START,
    PAD_TOKEN,
    build_tokenizer,
    load_hf_model,
    make_tiny_checkpoint,
    special_token_ids,
)

MAX_DEFAULT_MODEL_BYTES = 8 * 1024 * 1024

ASCII_TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))\n",
    "12345 + 678 = 13023; pi ~ 3.14159",
    "tabs\tand\r\nwindows newlines\n",
    "Zebra QUIZ xylophone !@#$%^&*()_+-=[]{}|;':\",./<>?`~",
    "",
    " ",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def _load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _safetensors_files(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def _read_tensors(path):
    """All tensors of a checkpoint dir (single file or shards) as {name: tensor}."""
    out = {}
    for fn in _safetensors_files(path):
        with safe_open(os.path.join(path, fn), framework="pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# --------------------------------------------------------------------------- #
# Checkpoints                                                                 #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "fixture, arch",
    [("tiny_qwen3", "qwen3"), ("tiny_qwen2", "qwen2"), ("tiny_llama", "llama")],
)
def test_checkpoint_loads_and_generates(request, fixture, arch):
    path = request.getfixturevalue(fixture)
    model = load_hf_model(path, torch.float32)
    assert type(model).__name__ == ARCH_CONFIGS[arch]["hf_class"]
    assert not model.training
    assert model.config.vocab_size == 512

    tok = _load_tokenizer(path)
    input_ids = tok("The quick brown fox", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids).logits
        assert logits.shape == (1, input_ids.shape[1], 512)
        assert torch.isfinite(logits).all()
        out = model.generate(input_ids, max_new_tokens=6, do_sample=False)
    assert out.shape[0] == 1 and input_ids.shape[1] < out.shape[1] <= input_ids.shape[1] + 6
    assert torch.equal(out[0, : input_ids.shape[1]], input_ids[0])
    tok.decode(out[0])  # every generated id is decodable


def test_arch_specific_features(tiny_qwen3, tiny_qwen2, tiny_llama):
    # qwen3: q/k norm of size head_dim (32, not hidden/heads = 16), no biases, untied.
    q3 = _read_tensors(tiny_qwen3)
    assert q3["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert q3["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert q3["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 64)
    assert "lm_head.weight" in q3
    assert not any(k.endswith(".bias") for k in q3)

    # qwen2: q/k/v biases, no o_proj bias, no q/k norm.
    q2 = _read_tensors(tiny_qwen2)
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.0.self_attn.{proj}.bias" in q2
    assert "model.layers.0.self_attn.o_proj.bias" not in q2
    assert not any("q_norm" in k for k in q2)

    # llama: tied => no separate lm_head tensor stored; llama3 rope scaling.
    ll = _read_tensors(tiny_llama)
    assert "lm_head.weight" not in ll
    model = load_hf_model(tiny_llama)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert model.config.rope_parameters["rope_theta"] == 500000.0


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen2", "tiny_llama"])
def test_weights_are_non_degenerate(request, fixture):
    """Norm weights are not all 1.0 and biases not all 0.0, so loading bugs show up."""
    tensors = _read_tensors(request.getfixturevalue(fixture))
    norms = {k: v for k, v in tensors.items() if k.endswith("norm.weight")}
    biases = {k: v for k, v in tensors.items() if k.endswith(".bias")}
    assert norms
    for name, w in norms.items():
        assert (w - 1.0).abs().max() > 0.05, name
        assert (w - 1.0).abs().mean() < 0.5, name  # still close to 1 (a sane RMSNorm)
    for name, b in biases.items():
        assert b.abs().mean() > 0.01, name
    for name, t in tensors.items():
        assert torch.isfinite(t).all(), name


def test_sharded_checkpoint_has_index(tiny_qwen2):
    shards = _safetensors_files(tiny_qwen2)
    assert len(shards) > 1, shards
    index_path = os.path.join(tiny_qwen2, "model.safetensors.index.json")
    assert os.path.isfile(index_path)
    with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    assert set(weight_map.values()) == set(shards)
    assert set(weight_map) == set(_read_tensors(tiny_qwen2))


def test_config_and_generation_config(tiny_qwen3):
    with open(os.path.join(tiny_qwen3, "config.json")) as f:
        cfg = json.load(f)
    ids = special_token_ids()
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["head_dim"] == 32 and cfg["hidden_size"] == 64
    assert cfg["tie_word_embeddings"] is False
    assert cfg["eos_token_id"] == ids[EOS_TOKEN] == 2
    assert cfg["pad_token_id"] == ids[PAD_TOKEN] == 0
    assert cfg["torch_dtype"] == cfg["dtype"] == "float32"
    with open(os.path.join(tiny_qwen3, "generation_config.json")) as f:
        gen = json.load(f)
    assert gen["eos_token_id"] == 2 and gen["pad_token_id"] == 0


def test_rope_scaling_both_spellings(tiny_llama, tmp_path):
    """config.json carries 5.x `rope_parameters` and legacy `rope_theta`/`rope_scaling`; both load."""
    from transformers import AutoConfig

    with open(os.path.join(tiny_llama, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["rope_parameters"]["rope_type"] == "llama3"
    assert cfg["rope_parameters"]["rope_theta"] == cfg["rope_theta"] == 500000.0
    assert cfg["rope_scaling"] == {k: v for k, v in cfg["rope_parameters"].items() if k != "rope_theta"}
    expected = AutoConfig.from_pretrained(tiny_llama).rope_parameters

    # Legacy-only config.json (transformers 4.x spelling) => same rope_parameters.
    legacy = copy.deepcopy(cfg)
    del legacy["rope_parameters"]
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    assert AutoConfig.from_pretrained(tmp_path).rope_parameters == expected

    # Oldest spelling ("type" instead of "rope_type"): transformers keeps the extra
    # "type" key but otherwise reads the same parameters.
    legacy["rope_scaling"]["type"] = legacy["rope_scaling"].pop("rope_type")
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    oldest = AutoConfig.from_pretrained(tmp_path).rope_parameters
    assert {k: v for k, v in oldest.items() if k != "type"} == expected

    # make_tiny_checkpoint accepts the "type" key too and writes the same config.
    out = make_tiny_checkpoint(
        tmp_path / "legacy_arg", "llama", tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling=legacy["rope_scaling"], seed=2, with_tokenizer=False,
    )
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f) == cfg

    # No scaling: rope_scaling is null, rope_parameters is "default".
    out = make_tiny_checkpoint(tmp_path / "plain", "llama", with_tokenizer=False)
    with open(os.path.join(out, "config.json")) as f:
        plain = json.load(f)
    assert plain["rope_scaling"] is None
    assert plain["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}


def test_checkpoint_deterministic(tmp_path):
    rng_before = torch.random.get_rng_state()
    kw = dict(arch="qwen2", hidden_size=32, intermediate_size=64, seed=7, with_tokenizer=False)
    a = make_tiny_checkpoint(tmp_path / "a", **kw)
    b = make_tiny_checkpoint(tmp_path / "b", **kw)
    c = make_tiny_checkpoint(tmp_path / "c", **{**kw, "seed": 8})
    for fn in ("model.safetensors", "config.json", "generation_config.json"):
        assert _sha256(os.path.join(a, fn)) == _sha256(os.path.join(b, fn)), fn
    assert _sha256(os.path.join(a, "model.safetensors")) != _sha256(os.path.join(c, "model.safetensors"))
    # The caller's global RNG state is not disturbed.
    assert torch.equal(torch.random.get_rng_state(), rng_before)

    # A bf16 checkpoint is exactly the bf16 rounding of the fp32 one (same seed).
    d = make_tiny_checkpoint(tmp_path / "d", dtype=torch.bfloat16, **kw)
    fp32, bf16 = _read_tensors(a), _read_tensors(d)
    assert fp32.keys() == bf16.keys()
    for name in fp32:
        assert bf16[name].dtype == torch.bfloat16
        assert torch.equal(fp32[name].to(torch.bfloat16), bf16[name]), name


def test_rewrite_removes_stale_shards(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3", max_shard_size="100KB", with_tokenizer=False)
    assert len(_safetensors_files(path)) > 1
    make_tiny_checkpoint(path, "qwen3", with_tokenizer=False)
    assert _safetensors_files(path) == ["model.safetensors"]
    assert not os.path.exists(os.path.join(path, "model.safetensors.index.json"))


# --------------------------------------------------------------------------- #
# Tokenizer                                                                   #
# --------------------------------------------------------------------------- #
def test_tokenizer_roundtrip(tokenizer_dir):
    tok = _load_tokenizer(tokenizer_dir)
    assert len(tok) == 512
    assert tok.eos_token == IM_END and tok.eos_token_id == 2
    assert tok.pad_token == ENDOFTEXT and tok.pad_token_id == 0
    assert tok.convert_tokens_to_ids(IM_START) == 1
    assert tok.bos_token is None
    for text in ASCII_TEXTS:
        ids = tok.encode(text)
        assert all(0 <= i < 512 for i in ids)
        assert tok.decode(ids) == text, text
    # Special tokens are atomic and skippable; no BOS/EOS is added implicitly.
    assert tok.encode(f"{IM_START}{IM_END}{ENDOFTEXT}") == [1, 2, 0]
    assert tok.decode(tok.encode(f"{IM_START}hi{IM_END}"), skip_special_tokens=True) == "hi"
    # Non-ASCII text round-trips too (byte-level BPE).
    assert tok.decode(tok.encode("Ünïcödé ✓ 日本語")) == "Ünïcödé ✓ 日本語"


def test_chat_template(tokenizer_dir):
    tok = _load_tokenizer(tokenizer_dir)
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text[: -len("<|im_start|>assistant\n")]
    # Content given as a list of text parts renders the same.
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in msgs]
    assert tok.apply_chat_template(parts, tokenize=False, add_generation_prompt=True) == text
    # Tokenized form = encoding of the rendered text.
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert list(ids) == tok.encode(text)
    assert ids[0] == 1 and ids.count(2) == 2


def test_tokenizer_files_deterministic(tmp_path):
    import vllm.testing.tiny_models as tm

    build_tokenizer(tmp_path / "a")
    tm._trained_tokenizer_json.cache_clear()  # force a real second training run
    build_tokenizer(tmp_path / "b")
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / fn).read_bytes() == (tmp_path / "b" / fn).read_bytes(), fn
    cfg = json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["chat_template"] == CHATML_TEMPLATE


# --------------------------------------------------------------------------- #
# Embedded default model                                                      #
# --------------------------------------------------------------------------- #
def test_default_model(default_model_dir):
    files = sorted(os.listdir(default_model_dir))
    for fn in ("README.md", "config.json", "generation_config.json", "model.safetensors",
               "tokenizer.json", "tokenizer_config.json"):
        assert fn in files, fn
    total = sum(os.path.getsize(os.path.join(default_model_dir, f)) for f in files)
    assert total < MAX_DEFAULT_MODEL_BYTES, total

    model = load_hf_model(default_model_dir, torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    tok = _load_tokenizer(default_model_dir)
    assert len(tok) == model.config.vocab_size == 4096
    assert tok.eos_token_id == model.config.eos_token_id == 2

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hello!"}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > prompt.shape[1]
    for text in ASCII_TEXTS:
        assert tok.decode(tok.encode(text)) == text


def test_corpus_is_a_data_file_shipped_with_the_package():
    """The tokenizer corpus is read from vllm/testing/data/corpus.txt, which setup.py's
    package_data ships (a wheel without it could not build the test tokenizer)."""
    import ast
    import fnmatch

    from vllm.testing.corpus import CORPUS_PATH, get_corpus
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert os.path.relpath(CORPUS_PATH, root) == os.path.join("vllm", "testing", "data", "corpus.txt")
    assert len(get_corpus()) > 30000 and "<|im_start|>" in get_corpus()
    with open(os.path.join(root, "setup.py")) as f:
        tree = ast.parse(f.read())
    kw = next(k for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords if k.arg == "package_data")
    patterns = ast.literal_eval(kw.value)["vllm"]
    assert any(fnmatch.fnmatch("testing/data/corpus.txt", p) for p in patterns), patterns
