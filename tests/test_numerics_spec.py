"""NumericsSpec (vllm/config.py): one value for dtype, numerics mode, kernel options, KV cache
dtype, quantization and parallelism, canonicalised once and shared by engine and trainer."""
import dataclasses

import pytest
import torch

from vllm.config import KernelConfig, NumericsSpec, ParallelConfig
from vllm.model_loader.build import read_model_config, resolve_numerics


def test_defaults_and_canonical_names():
    spec = NumericsSpec(torch.bfloat16, kv_cache_dtype="fp8_e4m3")
    assert (spec.numerics, spec.kernels, spec.kv_cache_dtype, spec.quantization, spec.parallel) == (
        "invariant", KernelConfig(), "fp8", None, ParallelConfig())
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.numerics = "fast"


@pytest.mark.parametrize("kw, match", [
    ({"dtype": "bfloat16"}, "dtype"), ({"dtype": torch.int8}, "dtype"), ({"numerics": "exact"}, "numerics"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"), ({"quantization": "awq"}, "quantization"),
    ({"kernels": {"gemm_cublaslt": False}}, "KernelConfig"), ({"parallel": 2}, "ParallelConfig")])
def test_bad_input_is_a_clear_value_error(kw, match):
    with pytest.raises(ValueError, match=match):
        NumericsSpec(**{"dtype": torch.float32, **kw})


def test_resolved_against_the_checkpoint(tiny_qwen3):
    mc = read_model_config(tiny_qwen3)
    spec = resolve_numerics(mc, "cpu", numerics="fast", tp_leaves=4)
    assert spec.dtype == torch.float32 and spec.numerics == "fast" and spec.parallel.leaves == 4


def test_engine_and_colocated_trainer_share_one_spec(tiny_qwen3):
    from vllm import LLM
    llm = LLM(tiny_qwen3, device="cpu", kv_cache_dtype="fp8_e4m3", block_size=8)
    spec = llm.config.numerics_spec
    assert spec.kv_cache_dtype == "fp8" and llm.config.dtype is spec.dtype
    policy = llm.policy()
    assert policy.numerics_spec is spec and policy.kv_cache_dtype == "fp8"
    assert policy.execution_contract().digests["numerical"] == llm.llm_engine.execution_contract().digests["numerical"]
