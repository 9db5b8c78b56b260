"""Rollouts on running `vllm serve` servers (`vllm train --rollout-url URL [URL ...]`).

The trainer keeps a standalone Policy of the same checkpoint (built by the engine's own
path, so its forward is the servers' forward) and talks to the servers over HTTP only:

- rollouts: POST /v1/completions with the prompt's token ids, n, the group's seed,
  logprobs=0 and return_token_ids; groups are spread over the servers round-robin and
  sent concurrently. Every sampling knob is sent explicitly, so a server's
  generation_config defaults never change what is sampled. JSON floats carry the
  float32 logprobs exactly, so the parity check (trainer logprobs == rollout logprobs,
  bit for bit) holds across HTTP.
- weights: before any sync each server's execution contract is compared with the
  Policy's (refused, naming the fields, on mismatch); then a broadcast group per server
  (vllm/weight_sync/group.py: NCCL on GPUs, gloo on CPU), or `weight_sync="path"`: the
  Policy is saved as a checkpoint the servers read (shared disk). The first rollout
  syncs the Policy's weights, so the servers may start from any weights of that model.
"""
from __future__ import annotations

import json
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from vllm.rl.rollout import Completion, RolloutClient, RolloutGroup, RolloutRequest, RolloutSettings
from vllm.weight_sync.client import WeightSyncClient

WEIGHT_SYNC_MODES = ("group", "path")


class RolloutServerError(RuntimeError):
    """A rollout server stopped answering or its weight group broke (not a refusal)."""


class ServerRollout(RolloutClient):
    def __init__(self, urls: list[str], model_dir: str, *, dtype: str = "auto", device: str = "cpu",
                 numerics: str = "invariant", weight_sync: str = "group", backend: str | None = None,
                 sync_host: str = "127.0.0.1", admin_key: str | None = None, api_key: str | None = None,
                 checkpoint_dir: str | None = None, timeout_s: float = 600.0, tp_leaves: int | None = None,
                 kv_cache_dtype: str = "auto", quantization: str | None = None):
        if not urls:
            raise ValueError("rollout_url: give at least one server URL")
        if weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(f"weight_sync must be one of {WEIGHT_SYNC_MODES}, got {weight_sync!r}")
        self.urls = [u.rstrip("/") for u in urls]
        self.model_dir = model_dir
        self.dtype, self.device, self.numerics = dtype, device, numerics
        # the servers' FP8 options, for the Policy whose contract they are checked against
        self.kv_cache_dtype, self.quantization = kv_cache_dtype, quantization
        self.weight_sync = weight_sync
        self.backend = backend or ("nccl" if str(device).startswith("cuda") else "gloo")
        self.sync_host = sync_host
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.checkpoint_dir = checkpoint_dir
        self.tp_leaves = tp_leaves  # the servers' K-leaf tree: the trainer (TP=1) runs the same
        self.clients = [WeightSyncClient(u, admin_key=admin_key, timeout_s=timeout_s) for u in self.urls]
        self.models = [self._model_name(u) for u in self.urls]
        self._policy = None
        self._synced = False
        self._version = 0
        self._pool = ThreadPoolExecutor(max_workers=max(4, 8 * len(self.urls)), thread_name_prefix="rollout")

    # ---- HTTP -----------------------------------------------------------------------------
    def _post(self, url: str, path: str, body: dict) -> dict:
        req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"rollout server {url}: {err.code} {err.read()[:500]!r}") from None
        except OSError as err:   # refused, reset, timed out: the server is gone or stuck
            raise RolloutServerError(f"rollout server {url} stopped answering ({err})") from None

    def _model_name(self, url: str) -> str:
        req = urllib.request.Request(url + "/v1/models")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read())["data"][0]["id"]
        except OSError as err:
            raise ValueError(f"rollout server {url} is not reachable: {err}") from None

    # ---- RolloutClient ----------------------------------------------------------------------
    def policy(self, activation_checkpointing: bool = False):
        if self._policy is None:
            from vllm.training import Policy
            self._policy = Policy.from_pretrained(self.model_dir, dtype=self.dtype, device=self.device,
                                                  numerics=self.numerics, tp_leaves=self.tp_leaves,
                                                  kv_cache_dtype=self.kv_cache_dtype, quantization=self.quantization,
                                                  activation_checkpointing=activation_checkpointing)
            contract = self._policy.execution_contract()
            for c in self.clients:
                try:
                    c.check_contract(contract)
                except ValueError as err:
                    raise ValueError(f"rollout server {c.url}: {err}") from None
        return self._policy

    def generate(self, requests: list[RolloutRequest], settings: RolloutSettings) -> list[RolloutGroup]:
        if not self._synced:
            self.sync_weights(self.policy())
        jobs = [self._pool.submit(self._one, i % len(self.urls), r, settings) for i, r in enumerate(requests)]
        return [j.result() for j in jobs]

    def _one(self, server: int, r: RolloutRequest, s: RolloutSettings) -> RolloutGroup:
        body = {"model": self.models[server], "prompt": list(r.prompt_token_ids), "n": r.n,
                "temperature": s.temperature, "top_p": s.top_p, "top_k": 0, "min_p": 0.0,
                "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                "max_tokens": s.max_tokens, "seed": r.seed, "logprobs": 0, "return_token_ids": True,
                # whatever the server's --logprobs-mode: the trainer's Policy recomputes these
                "logprobs_mode": "tempered_logprobs"}
        out = self._post(self.urls[server], "/v1/completions", body)
        comps = []
        for c in sorted(out["choices"], key=lambda c: c["index"]):
            ids = list(c["token_ids"])
            lps = c["logprobs"]["token_logprobs"] if ids else []
            # JSON floats are the float32 values exactly: this tensor has the server's bits
            comps.append(Completion(ids, torch.tensor(lps, dtype=torch.float32), c.get("finish_reason"),
                                    c.get("text", "")))
        return RolloutGroup(list(r.prompt_token_ids), comps, int(out.get("weight_version", self._version)))

    def sync_weights(self, policy) -> int:
        contract = policy.execution_contract()
        if self.weight_sync == "path":
            path = os.path.join(self.checkpoint_dir or ".", "rollout_weights")
            policy.save_pretrained(path)
            versions = [c.update_from_path(os.path.abspath(path), contract=contract) for c in self.clients]
        else:
            named = policy.model.hf_state_dict()
            versions = []
            for c in self.clients:
                try:
                    if c.group is None:
                        c.init_group(contract, backend=self.backend, host=self.sync_host,
                                     device=policy.device if self.backend == "nccl" else None)
                    versions.append(c.push(named, require_complete=True))
                except ValueError:   # a refusal (contract, manifest, weights): the server is fine
                    raise
                except Exception as err:   # the group or the HTTP call broke: the server is gone
                    c.group = None
                    raise RolloutServerError(f"rollout server {c.url}: the weight update failed "
                                             f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
                                             ) from err
        self._synced = True
        self._version = max(versions)
        return self._version

    def load_weights(self, weights: dict[str, torch.Tensor], contract) -> None:
        from vllm.model_loader.loader import load_weights
        policy = self.policy()
        policy.execution_contract().check_compatible(contract)
        load_weights(policy.model, weights.items())
        self._synced = False      # the servers get them before the next rollout

    def execution_contract(self):
        return self.policy().execution_contract()

    @property
    def weight_version(self) -> int:
        return self._version

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self._pool.shutdown(wait=False)
