"""The trainer's side of a rollout server's weight endpoints (docs/serving.md, "Weight sync").

    client = WeightSyncClient("http://10.0.0.2:8000", admin_key=...)
    client.init_group(policy.execution_contract(), backend="nccl", host="10.0.0.1")
    version = client.push(policy.model.hf_state_dict())       # broadcast, bucketed
    version = client.update_from_path(checkpoint_dir)          # or: a checkpoint on shared disk

Both sides compare execution contracts before any sync: the client refuses a server
whose contract differs (naming the fields) before joining anything, and the server
checks the trainer's contract carried by init_group. Standard library only (urllib).
"""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from typing import Sequence

import torch

from vllm.weight_sync.bucket import DEFAULT_BUCKET_BYTES, manifest_of


class ServerError(RuntimeError):
    """The server answered with an error status (4xx are also ValueErrors: see raise_for)."""


class WeightSyncClient:
    def __init__(self, url: str, *, admin_key: str | None = None, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.admin_key = admin_key
        self.timeout_s = timeout_s
        self.group = None

    # ---- HTTP ---------------------------------------------------------------------------
    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.admin_key:
            req.add_header("Authorization", f"Bearer {self.admin_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            try:
                msg = json.loads(err.read())["error"]["message"]
            except Exception:  # noqa: BLE001
                msg = str(err)
            if 400 <= err.code < 500:
                raise ValueError(f"{method} {path}: {err.code} {msg}") from None
            raise ServerError(f"{method} {path}: {err.code} {msg}") from None

    def version(self) -> int:
        return int(self.request("GET", "/v1/weights/version")["weight_version"])

    def contract(self):
        from vllm.contract import ExecutionContract
        return ExecutionContract.from_dict(self.request("GET", "/v1/weights/contract"))

    def check_contract(self, local) -> None:
        """ValueError naming the fields that differ between the server's contract and `local`."""
        self.contract().check_compatible(local)

    def pause(self) -> dict:
        return self.request("POST", "/v1/pause")

    def resume(self) -> dict:
        return self.request("POST", "/v1/resume")

    # ---- transports ---------------------------------------------------------------------
    def update_from_path(self, path: str, staging: str = "host", contract=None) -> int:
        """The server loads a checkpoint directory it can read (shared disk) in place: staged
        in `staging` memory ("host" or "device") while it serves, then copied in a short pause.
        `contract` (the weights' ExecutionContract): the server refuses unless it matches its own."""
        body = {"path": path, "staging": staging}
        if contract is not None:
            body["contract"] = contract.to_dict() if hasattr(contract, "to_dict") else contract
        return int(self.request("POST", "/v1/weights/update", body)["weight_version"])

    def init_group(self, contract, *, backend: str = "nccl", host: str = "127.0.0.1", port: int = 0,
                   device: torch.device | str | None = None, timeout_s: float = 300.0) -> None:
        """Make a broadcast group with the server (this process rank 0, the server rank 1)."""
        from vllm.weight_sync.group import GroupSpec, WeightGroup, host_store

        self.check_contract(contract)          # refuse before anything is joined
        self.close()
        store = host_store(host, port, 2, timeout_s)
        spec = GroupSpec(host, store.port, 0, 2, backend, timeout_s).validate()
        body = {"host": host, "port": store.port, "backend": backend, "rank": 1, "world_size": 2,
                "timeout_s": timeout_s, "contract": contract.to_dict()}
        reply = self._in_thread("POST", "/v1/weights/init_group", body)
        try:
            group = _unless_refused(reply, lambda: WeightGroup(spec, device=device, store=store))
        except Exception:
            reply.join()
            reply.raise_if_failed()
            raise
        reply.join()
        reply.raise_if_failed()
        self.group = group

    def push(self, named, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, backup: str = "auto",
             require_complete: bool = True) -> int:
        """Broadcast HF-named tensors to the server as one update; returns its new version."""
        from vllm.weight_sync.group import send_update

        if self.group is None:
            raise ValueError("no weight group: call init_group first")
        named = list(named.items()) if isinstance(named, dict) else list(named)
        body = {"manifest": [[n, d, list(s)] for n, d, s in manifest_of(named)], "bucket_bytes": bucket_bytes,
                "backup": backup, "require_complete": require_complete}
        reply = self._in_thread("POST", "/v1/weights/update_from_group", body)
        try:
            ok = _unless_refused(reply, lambda: send_update(self.group, named, bucket_bytes))
        except BaseException:
            if reply.refused_early:  # the group waits on a collective the server never joined: unusable
                self.group = None
            raise
        reply.join()
        reply.raise_if_failed()
        if not ok:
            raise ServerError("the server reported a failed update but answered OK")
        return int(reply.result["weight_version"])

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def _in_thread(self, method: str, path: str, body: dict) -> "_Reply":
        r = _Reply(self, method, path, body)
        r.start()
        return r


def _unless_refused(reply: "_Reply", fn):
    """fn() (joining the group, or the collective of an update), unless the server refuses
    first: the server answers these calls only after the collective, so an answer before fn
    returns is a refusal (a wrong admin key, a bad request), raised at once rather than after
    the group's timeout. fn runs on a thread (abandoned on a refusal: it ends at that timeout)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 -- re-raised on the caller's thread
            box["error"] = err

    worker = threading.Thread(target=run, daemon=True, name="weight-sync-join")
    worker.start()
    while worker.is_alive():
        worker.join(0.05)
        if worker.is_alive() and not reply.is_alive() and reply.error is not None:
            reply.refused_early = True
            raise reply.error
    if "error" in box:
        raise box["error"]
    return box["value"]


class _Reply(threading.Thread):
    """An HTTP call on a thread: the server answers only after the collective it starts."""

    def __init__(self, client: WeightSyncClient, method: str, path: str, body: dict):
        super().__init__(daemon=True)
        self.args_ = (client, method, path, body)
        self.result = None
        self.error: BaseException | None = None
        self.refused_early = False

    def run(self) -> None:
        client, method, path, body = self.args_
        try:
            self.result = client.request(method, path, body)
        except BaseException as err:  # noqa: BLE001 -- re-raised on the caller's thread
            self.error = err

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error


def push_to_servers(clients: Sequence[WeightSyncClient], named, **kw) -> list[int]:
    """The same update to several servers, one after another (each has its own group)."""
    return [c.push(named, **kw) for c in clients]
