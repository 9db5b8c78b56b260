"""Compiled ops from csrc/ (built only once csrc/ holds an op, and where nvcc + CUDA torch exist).

`HAS_C` says whether the extension `vllm._C` is loaded. No compiled op is in use:
csrc/module.cpp says when an op belongs in csrc/ and how to add one (each gets its
torch reference here and a bit-pattern test in tests/test_custom_ops.py).
"""
from __future__ import annotations

try:
    import vllm._C  # noqa: F401  (ops it defines register under torch.ops.vllm_parity)
    HAS_C = True
except ImportError:
    HAS_C = False
