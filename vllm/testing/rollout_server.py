"""A `vllm serve` subprocess on 127.0.0.1 for tests and examples: started on a free port,
waited for (GET /health), stopped with its process group."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, *args: str, env: dict | None = None, startup_timeout_s: float = 180.0):
        """`env`: the server's whole environment (None: this process's)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--uvicorn-log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.proc.stdout.read()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError("the server did not become healthy in time")
            time.sleep(0.3)

    def stop(self) -> str:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        return self.proc.stdout.read() if self.proc.stdout else ""
