"""Activation checkpointing for a model's layer loop.

The recomputation runs during backward, outside the `set_forward_context` block
of the forward, so it re-enters the context the layer first ran under: the same
attention backend and numerics mode, hence the same bits as the first pass. It is marked
`recomputing`, so what a layer records per call (router statistics) is recorded once.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.utils.checkpoint import checkpoint

from vllm.forward_context import get_forward_context, set_forward_context


def checkpointed(layer, *args):
    """`layer(*args)`, its activations recomputed in backward instead of kept; a plain
    call when autograd is off (inference, CUDA graph capture)."""
    if not torch.is_grad_enabled():
        return layer(*args)
    ctx = get_forward_context()
    again = dataclasses.replace(ctx, recomputing=True)
    return checkpoint(layer, *args, use_reentrant=False,
                      context_fn=lambda: (contextlib.nullcontext(), set_forward_context(again)))


def run_layers(layers, positions: torch.Tensor, x: torch.Tensor, activation_checkpointing: bool = False):
    """A pre-norm stack's layer loop: each layer maps (positions, x, residual) to (x, residual),
    the residual add left to the next norm (the first layer gets residual None). Returns the
    last layer's (x, residual) for the final norm."""
    residual = None
    for layer in layers:
        if activation_checkpointing:
            x, residual = checkpointed(layer, positions, x, residual)
        else:
            x, residual = layer(positions, x, residual)
    return x, residual
