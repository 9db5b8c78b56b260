"""Where rollouts come from: the trainer talks to a `RolloutClient` only.

`ColocatedRollout` runs the engine in this process, sharing parameter storage with
the trainer's Policy (a weight sync is a version bump), and releases the engine's
KV cache while the trainer runs (sleep mode). A client for a separate server
implements the same methods (policy, generate with per-request seeds and logprobs,
sync_weights from a Policy, load_weights, release/resume memory, execution_contract);
the loop does not change.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass
class RolloutRequest:
    prompt_token_ids: list[int]
    n: int            # responses sampled for this prompt (one group)
    seed: int         # the group's sampling seed: a rollout is a function of (weights, prompt, seed)


@dataclass
class RolloutSettings:
    temperature: float
    top_p: float
    max_tokens: int


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: torch.Tensor         # float32 [len(token_ids)]: log_softmax(logits / T) of each sampled token
    finish_reason: str | None      # "stop" (eos) | "length"
    text: str


@dataclass
class RolloutGroup:
    prompt_token_ids: list[int]
    completions: list[Completion]
    weight_version: int


class RolloutClient(abc.ABC):
    @abc.abstractmethod
    def generate(self, requests: list[RolloutRequest], settings: RolloutSettings) -> list[RolloutGroup]:
        """One group per request, in request order, with the sampled tokens' logprobs."""

    @abc.abstractmethod
    def policy(self, activation_checkpointing: bool = False):
        """The trainer's Policy for this rollout (colocated: the engine's own parameters;
        for a separate server: a standalone Policy of the same checkpoint)."""

    @abc.abstractmethod
    def sync_weights(self, policy) -> int:
        """Make the rollout use the Policy's current weights; returns the rollout's weight version."""

    def load_weights(self, weights: dict[str, torch.Tensor], contract) -> None:
        """Restore HF-named weights (a checkpoint's) into the trainer's Policy and the rollout."""
        raise NotImplementedError(f"{type(self).__name__} cannot restore checkpoint weights")

    def release_memory(self) -> int:
        """Free memory the trainer can use (the KV cache) until resume_memory(); returns bytes freed."""
        return 0

    def resume_memory(self) -> None:
        """Undo release_memory (no-op when nothing was released)."""

    @abc.abstractmethod
    def execution_contract(self):
        """The rollout side's ExecutionContract (vllm/contract.py)."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        ...


class ColocatedRollout(RolloutClient):
    """The engine in this process; `llm.policy()` shares its parameters."""

    def __init__(self, llm, sleep: bool = False):
        self.llm = llm
        self.sleep = sleep
        self.last_freed = 0
        self._policy = None

    def policy(self, activation_checkpointing: bool = False):
        """The trainer's Policy: the engine's own parameters (`llm.policy()`)."""
        if self._policy is None:
            self._policy = self.llm.policy(activation_checkpointing=activation_checkpointing)
        return self._policy

    def generate(self, requests: list[RolloutRequest], settings: RolloutSettings) -> list[RolloutGroup]:
        from vllm import SamplingParams

        self.resume_memory()
        # tempered_logprobs whatever the engine's logprobs_mode: the trainer's Policy recomputes those
        params = [SamplingParams(n=r.n, temperature=settings.temperature, top_p=settings.top_p,
                                 max_tokens=settings.max_tokens, seed=r.seed, logprobs=0,
                                 logprobs_mode="tempered_logprobs") for r in requests]
        outs = self.llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params, use_tqdm=False)
        version = self.llm.weight_version
        groups = []
        for r, o in zip(requests, outs):
            comps = []
            for c in o.outputs:
                lps = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
                # python floats hold the float32 values exactly: this tensor has the rollout's bits
                comps.append(Completion(list(c.token_ids), torch.tensor(lps, dtype=torch.float32), c.finish_reason,
                                        c.text))
            groups.append(RolloutGroup(list(r.prompt_token_ids), comps, version))
        return groups

    def sync_weights(self, policy) -> int:
        if policy is not self._policy:
            # a Policy of its own (e.g. on another device): copy the exact bits it computes with
            self.llm.update_weights(policy.model.hf_state_dict(), contract=policy.execution_contract(),
                                    require_complete=True)
        else:
            policy.notify_weights_updated()  # same storage: bump the version, drop stale prefixes
        return self.llm.weight_version

    def load_weights(self, weights: dict[str, torch.Tensor], contract) -> None:
        # one storage: the engine's update (validated against the checkpoint's contract)
        # is the Policy's too
        self.llm.update_weights(weights, contract=contract, require_complete=True)

    def release_memory(self) -> int:
        if not self.sleep:
            return 0
        self.last_freed = self.llm.sleep()
        return self.last_freed

    def resume_memory(self) -> None:
        if self.sleep:
            self.llm.wake_up()

    def execution_contract(self):
        return self.llm.execution_contract()

    @property
    def weight_version(self) -> int:
        return self.llm.weight_version
