"""Checkpoints that resume bit-exactly.

OUTPUT_DIR/checkpoints/step_000010/
    model/                 HF format (config, safetensors with HF names, tokenizer): loads in
                           transformers and in our engine; also the weights a resume restores
    training_state.pt      optimizer state, float32 master weights, frozen KL reference
    rng.pt                 python / numpy / torch (CPU and CUDA) generator states
    trainer_state.json     step, weight version, data position, rollout seed scheme
    config.yaml            the run's configuration
    contract.json          the engine's execution contract (a resume on other numerics is refused)
OUTPUT_DIR/checkpoints/latest   name of the newest complete checkpoint

A checkpoint is written to a temporary directory and renamed when complete, so an
interrupted save never leaves a half checkpoint behind `latest`.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass

import numpy as np
import torch

STATE_FILE = "trainer_state.json"


def checkpoint_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, "checkpoints", f"step_{step:06d}")


def rng_state() -> dict:
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str, *, trainer_state: dict, policy, optimizer: torch.optim.Optimizer,
                    master_weights: list[torch.Tensor] | None, reference: dict | None, config_yaml: str,
                    contract_json: str) -> str:
    tmp = path + ".tmp"
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    policy.save_pretrained(os.path.join(tmp, "model"))
    torch.save({"optimizer": optimizer.state_dict(),
                "master_weights": [m.detach().cpu() for m in master_weights] if master_weights is not None else None,
                "reference": {k: v.detach().cpu() for k, v in reference.items()} if reference is not None else None},
               os.path.join(tmp, "training_state.pt"))
    torch.save(rng_state(), os.path.join(tmp, "rng.pt"))
    with open(os.path.join(tmp, STATE_FILE), "w") as f:
        json.dump(trainer_state, f, indent=2)
    with open(os.path.join(tmp, "config.yaml"), "w") as f:
        f.write(config_yaml)
    with open(os.path.join(tmp, "contract.json"), "w") as f:
        f.write(contract_json)
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.replace(tmp, path)
    latest = os.path.join(os.path.dirname(path), "latest")
    with open(latest + ".tmp", "w") as f:
        f.write(os.path.basename(path) + "\n")
    os.replace(latest + ".tmp", latest)
    return path


def find_checkpoint(resume: str, output_dir: str) -> str:
    """'latest' (in output_dir), a checkpoint directory, or a run's output directory."""
    def latest_in(run_dir: str) -> str | None:
        marker = os.path.join(run_dir, "checkpoints", "latest")
        if os.path.isfile(marker):
            with open(marker) as f:
                cand = os.path.join(run_dir, "checkpoints", f.read().strip())
            if os.path.isfile(os.path.join(cand, STATE_FILE)):
                return cand
        return None
    if resume == "latest":
        found = latest_in(output_dir)
        if found is None:
            raise ValueError(f"--resume: no checkpoint in {output_dir!r} (expected {output_dir}/checkpoints/latest)")
        return found
    if os.path.isfile(os.path.join(resume, STATE_FILE)):
        return resume
    found = latest_in(resume)
    if found is None:
        raise ValueError(f"--resume {resume!r}: neither a checkpoint directory (with {STATE_FILE}) nor a run "
                         "directory with checkpoints/latest")
    return found


@dataclass
class Checkpoint:
    path: str
    trainer_state: dict
    config_yaml: str
    contract_json: str

    @classmethod
    def open(cls, path: str) -> "Checkpoint":
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
        with open(os.path.join(path, "config.yaml")) as f:
            cfg = f.read()
        with open(os.path.join(path, "contract.json")) as f:
            contract = f.read()
        return cls(path, state, cfg, contract)

    def hf_weights(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        model_dir = os.path.join(self.path, "model")
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
        out = {}
        for name in files:
            out.update(load_file(os.path.join(model_dir, name)))
        return out

    def training_state(self) -> dict:
        return torch.load(os.path.join(self.path, "training_state.pt"), map_location="cpu", weights_only=True)

    def rng_state(self) -> dict:
        return torch.load(os.path.join(self.path, "rng.pt"), map_location="cpu", weights_only=True)
