"""A server on 127.0.0.1 for tests and examples: a `vllm serve` subprocess (started on a free
port, waited for (GET /health), stopped with its process group), or an app served by uvicorn
in a thread of this process (`serve_in_thread`)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def cpu_server(model: str, *args: str, env: dict) -> Iterator["ServerProcess"]:
    """A ServerProcess serving `model` on CPU (`args` go to `vllm serve`), stopped on exit. `env`:
    the caller's environment (the package reads none itself), to which this adds what makes the
    server import the vllm this process imports (its parent folder on PYTHONPATH) and run one
    OpenMP thread, so that it does not contend for the cores with the tests driving it."""
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    srv = ServerProcess(model, "--device", "cpu", *args,
                        env={**env, "PYTHONPATH": checkout, "OMP_NUM_THREADS": "1"})
    try:
        yield srv
    finally:
        srv.stop()


def wait_until_healthy(client, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll GET /health through the httpx `client` until it answers 200, asserting all the while
    that the `vllm serve` process `proc` is alive and `timeout_s` has not run out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, "vllm serve exited early"
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "vllm serve did not become healthy in time"
        time.sleep(0.25)


def terminate_process(proc: subprocess.Popen, timeout_s: float) -> bool:
    """SIGTERM `proc` and wait up to `timeout_s` for it, then SIGKILL it; whether it stopped on SIGTERM in time."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        return False


@contextlib.contextmanager
def serve_in_thread(app, startup_timeout_s: float = 30.0) -> Iterator[str]:
    """Serve the ASGI `app` on a free port from a daemon thread; yields its base URL and
    stops the server on exit."""
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not srv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(30)


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
