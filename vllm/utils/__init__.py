"""Helpers under upstream vLLM's module names (`network_utils.get_ip`, imported by TRL's client;
`get_open_port`, which older code imports from `vllm.utils` itself)."""
from vllm.utils.network_utils import get_ip, get_open_port

__all__ = ["get_ip", "get_open_port"]
