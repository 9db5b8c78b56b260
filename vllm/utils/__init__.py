"""Helpers under upstream vLLM's module names (`network_utils.get_ip`, imported by TRL's client;
`get_open_port`, which older code imports from `vllm.utils` itself; `random_uuid`, which
OpenRLHF's engine module imports)."""
import uuid

from vllm.utils.network_utils import get_ip, get_open_port


def random_uuid() -> str:
    """A random 32-hex-digit id (request ids), as upstream's."""
    return uuid.uuid4().hex


__all__ = ["get_ip", "get_open_port", "random_uuid"]
