"""Training mode: the engine's model class under autograd (see docs/training.md)."""
from vllm.training.policy import Policy

__all__ = ["Policy"]
