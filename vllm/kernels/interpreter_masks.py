"""Boolean masks for Triton's CPU interpreter (TRITON_INTERPRET=1, the tests' path).

The interpreter labels a comparison's result with its operands' type, not int1, so a scalar
comparison (`has_state != 0`) splats to an int32 array, and `(rows < n) & (has_state != 0)`
is int32 data. Triton 3.8's native load / store / atomic helpers took such masks; 3.9's refuse
them ("mask has unsupported dtype"). The GPU compiler types the same expressions int1, so the
kernels are right as written: the interpreter's masked memory ops get their mask as bool here.
Nothing changes on the GPU, and on 3.8 the masks select the same elements as before.
"""
from __future__ import annotations

import numpy as np

_PATCHED = "_vllm_bool_masks"


def _as_bool(mask):
    """A TensorHandle mask with bool data; anything else (None, or the raw arrays a tensor
    descriptor's own bounds mask comes as) unchanged."""
    data = getattr(mask, "data", None)
    if not isinstance(data, np.ndarray) or data.dtype == np.bool_:
        return mask
    return type(mask)(data.astype(np.bool_), mask.dtype)


def install() -> None:
    """Wrap the interpreter's masked load, store and atomic read-modify-write once per
    process (imported by vllm.kernels when TRITON_INTERPRET=1)."""
    try:
        from triton.runtime.interpreter import InterpreterBuilder
    except ImportError:  # no triton: nothing to interpret
        return
    if getattr(InterpreterBuilder, _PATCHED, False):
        return
    load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store
    rmw = getattr(InterpreterBuilder, "create_atomic_rmw", None)

    def create_masked_load(self, ptrs, mask, other, *args, **kwargs):
        return load(self, ptrs, _as_bool(mask), other, *args, **kwargs)

    def create_masked_store(self, ptrs, value, mask, *args, **kwargs):
        return store(self, ptrs, value, _as_bool(mask), *args, **kwargs)

    InterpreterBuilder.create_masked_load = create_masked_load
    InterpreterBuilder.create_masked_store = create_masked_store
    if rmw is not None:
        def create_atomic_rmw(self, rmw_op, ptr, val, mask, *args, **kwargs):
            return rmw(self, rmw_op, ptr, val, _as_bool(mask), *args, **kwargs)
        InterpreterBuilder.create_atomic_rmw = create_atomic_rmw
    setattr(InterpreterBuilder, _PATCHED, True)
