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
interrupted save never leaves a half checkpoint behind `latest`. Saving is two steps:
`snapshot_checkpoint` copies everything to host memory at the step boundary (that is what a
resume restores, bit for bit), and `CheckpointSnapshot.write` puts it on disk, after checking
that the disk has room for it (an OSError naming the directory and the bytes needed, before
anything is written). `CheckpointWriter` runs the writes in a background thread, one at a
time, so training goes on while the last checkpoint is written.
"""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import threading
from dataclasses import dataclass, field

import numpy as np
import torch
import yaml

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


def _host_copy(obj):
    """A copy of obj with every tensor copied to host memory (never a view of a live tensor:
    training goes on while the copy is written)."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v) for v in obj)
    return obj


def _tensor_bytes(obj) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


# besides the tensors: json, yaml, the tokenizer files and the formats' own overhead
_SLACK_BYTES = 64 << 20


@dataclass
class CheckpointSnapshot:
    """Everything a checkpoint holds, in host memory."""
    model_config: dict
    model_files: list[str]  # files copied from the model's source directory (tokenizer, ...)
    hf_tensors: dict[str, torch.Tensor]
    training_state: dict
    rng: dict
    trainer_state: dict
    config_yaml: str
    contract_json: str
    extra_files: dict[str, str] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes the checkpoint needs on disk, roughly (tensors plus a fixed slack)."""
        files = sum(os.path.getsize(f) for f in self.model_files if os.path.isfile(f))
        return _tensor_bytes(self.hf_tensors) + _tensor_bytes(self.training_state) + files + _SLACK_BYTES

    def write(self, path: str) -> str:
        """Write to path + '.tmp', rename to path, then point `latest` at it. Refused with an
        OSError (ENOSPC) naming the directory and the bytes needed when the disk lacks room;
        a failure while writing removes the partial directory and says where it happened."""
        from safetensors.torch import save_file

        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        tmp = path + ".tmp"
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        need, free = self.nbytes(), shutil.disk_usage(parent).free
        if free < need:
            raise OSError(errno.ENOSPC, f"checkpoint {path}: needs about {need / 2 ** 30:.2f} GiB "
                                        f"({need} bytes), {parent} has {free / 2 ** 30:.2f} GiB free")
        try:
            model_dir = os.path.join(tmp, "model")
            os.makedirs(model_dir)
            with open(os.path.join(model_dir, "config.json"), "w") as f:
                json.dump(self.model_config, f, indent=2)
            save_file(self.hf_tensors, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
            for src in self.model_files:
                shutil.copy(src, os.path.join(model_dir, os.path.basename(src)))
            torch.save(self.training_state, os.path.join(tmp, "training_state.pt"))
            torch.save(self.rng, os.path.join(tmp, "rng.pt"))
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump(self.trainer_state, f, indent=2)
            texts = {"config.yaml": self.config_yaml, "contract.json": self.contract_json, **self.extra_files}
            for name, text in texts.items():
                with open(os.path.join(tmp, name), "w") as f:
                    f.write(text)
        except (OSError, RuntimeError) as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise OSError(getattr(err, "errno", None) or errno.EIO,
                          f"checkpoint {path}: writing failed ({type(err).__name__}: {err}); "
                          f"{free / 2 ** 30:.2f} GiB were free in {parent}, about {need / 2 ** 30:.2f} GiB needed") from err
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
        latest = os.path.join(parent, "latest")
        with open(latest + ".tmp", "w") as f:
            f.write(os.path.basename(path) + "\n")
        os.replace(latest + ".tmp", latest)
        return path


def snapshot_checkpoint(*, trainer_state: dict, policy, optimizer: torch.optim.Optimizer,
                        master_weights: list[torch.Tensor] | None, reference: dict | None, config_yaml: str,
                        contract_json: str) -> CheckpointSnapshot:
    """Copy the state a resume needs to host memory, now (the step boundary)."""
    files = policy.companion_files()
    training_state = {"optimizer": _host_copy(optimizer.state_dict()),
                      "master_weights": _host_copy(list(master_weights)) if master_weights is not None else None,
                      "reference": _host_copy(dict(reference)) if reference is not None else None}
    hf = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in policy.model.hf_state_dict().items()}
    return CheckpointSnapshot(policy.hf_config(), files, hf, training_state, rng_state(), json.loads(json.dumps(trainer_state)),
                              config_yaml, contract_json)


class CheckpointWriter:
    """Writes snapshots in a background thread, one at a time. `submit` first waits for the
    previous write; an error of a background write is raised by the next `submit` or by
    `wait`, so it can never pass unseen. `background=False` writes in the caller's thread."""

    def __init__(self, background: bool = True):
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_path: str | None = None

    def submit(self, snapshot: CheckpointSnapshot, path: str) -> str:
        self.wait()
        if not self.background:
            self.last_path = snapshot.write(path)
            return path

        def run():
            try:
                self.last_path = snapshot.write(path)
            except BaseException as err:  # noqa: BLE001 -- handed to the training thread by wait()
                self._error = err
        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=False)
        self._thread.start()
        return path

    def wait(self) -> None:
        """Block until the pending write is on disk; raise its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err


def find_checkpoint(resume: str, output_dir: str) -> str:
    """'latest' (in output_dir), a checkpoint directory, a run's output directory, or a run's
    checkpoints/latest marker file."""
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
    if os.path.basename(resume) == "latest" and os.path.isfile(resume):
        resume = os.path.dirname(os.path.dirname(os.path.abspath(resume)))   # <run>/checkpoints/latest
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
        """The checkpoint at `path`, its files checked before anything is restored: a missing,
        empty or unreadable part (a copy cut short, a disk that filled) is a ValueError naming
        it, so a resume never starts on half a checkpoint."""
        def text(name: str) -> str:
            try:
                with open(os.path.join(path, name)) as f:
                    return f.read()
            except OSError as err:
                raise _broken(path, name, err) from None

        try:
            state = json.loads(text(STATE_FILE))
        except json.JSONDecodeError as err:
            raise _broken(path, STATE_FILE, err) from None
        missing = [k for k in TRAINER_STATE_KEYS if not isinstance(state, dict) or k not in state]
        if missing:
            raise _broken(path, STATE_FILE, f"it lacks {missing}")
        cfg, contract = text("config.yaml"), text("contract.json")
        try:
            settings = yaml.safe_load(cfg)
        except yaml.YAMLError as err:
            raise _broken(path, "config.yaml", err) from None
        if not isinstance(settings, dict) or not settings:
            raise _broken(path, "config.yaml", "it holds no settings")
        for name in ("training_state.pt", "rng.pt"):
            if not os.path.isfile(os.path.join(path, name)):
                raise _broken(path, name, "it is missing")
        model_dir = os.path.join(path, "model")
        if not os.path.isdir(model_dir) or not any(f.endswith(".safetensors") for f in os.listdir(model_dir)):
            raise _broken(path, "model/", "it holds no .safetensors weights")
        return cls(path, state, cfg, contract)

    def hf_weights(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        model_dir = os.path.join(self.path, "model")
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
        out = {}
        for name in files:
            try:
                out.update(load_file(os.path.join(model_dir, name)))
            except Exception as err:  # noqa: BLE001 -- safetensors' own error types
                raise _broken(self.path, f"model/{name}", err) from None
        return out

    def training_state(self) -> dict:
        return self._torch_file("training_state.pt")

    def rng_state(self) -> dict:
        return self._torch_file("rng.pt")

    def _torch_file(self, name: str) -> dict:
        try:
            return torch.load(os.path.join(self.path, name), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 -- a truncated zip, a missing file, an unpickling error
            raise _broken(self.path, name, err) from None


# what every trainer_state.json holds (Trainer.save writes them; a resume reads them)
TRAINER_STATE_KEYS = ("step", "weight_version", "data", "seed")


def _broken(path: str, name: str, why) -> ValueError:
    why = f"{type(why).__name__}: {why}" if isinstance(why, BaseException) else why
    return ValueError(f"--resume: the checkpoint {path!r} is incomplete or damaged: {name} ({why}); resume from "
                      "an earlier checkpoint (checkpoints/step_*) or start a new run")
