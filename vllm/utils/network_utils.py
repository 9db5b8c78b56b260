"""upstream vLLM's `get_ip` (the address a trainer advertises to the engines it syncs) and
`get_open_port` (a free port for a weight-transfer group; TRL's and OpenRLHF's launchers
import it)."""
from __future__ import annotations

import socket


def get_ip() -> str:
    """The address of the interface that routes outward (no packet is sent), else loopback.
    Upstream also reads VLLM_HOST_IP; behaviour here is never chosen by environment
    variables, so a trainer on another interface passes its host to the engine explicitly."""
    for family, probe in ((socket.AF_INET, ("8.8.8.8", 80)), (socket.AF_INET6, ("2001:4860:4860::8888", 80))):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(probe)
                return s.getsockname()[0]
        except OSError:
            continue
    return "127.0.0.1"


def get_open_port() -> int:
    """A TCP port free on this host now (the OS picks it; another process may take it before
    it is bound again, as with upstream's). Upstream also reads VLLM_PORT; behaviour here is
    never chosen by environment variables."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
