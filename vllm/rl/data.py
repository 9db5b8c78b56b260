"""Prompts and reference answers: loading, checking, rendering to token ids, and a
seeded order that a checkpoint can restore from one integer.

Records come from a .jsonl/.parquet file or from a built-in task module
(`vllm.rl.tasks.<name>.generate_problems(n, seed, split) -> list[dict]`). The prompt
field is a string or a list of chat messages ({"role", "content"}); the answer field a
string (numbers are converted). Every record is checked when the data is loaded, so a
missing field is reported with its line before any model is built.
"""
from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Example:
    index: int                        # position in the loaded data
    prompt: str | list[dict]          # text, or chat messages
    answer: str
    record: dict                      # the whole record (custom rewards may read other fields)


def read_records(path: str) -> list[dict]:
    """Rows of a .jsonl (one JSON object per line; a .json file may also hold a list) or .parquet file."""
    if not os.path.isfile(path):
        raise ValueError(f"data file {path!r} does not exist")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"reading {path!r} needs pyarrow: pip install pyarrow (or convert it to .jsonl)") from None
        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
    else:
        rows = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(rows[-1], dict):
                raise ValueError(f"{path}:{lineno}: each line must be a JSON object, got {type(rows[-1]).__name__}")
    if not rows:
        raise ValueError(f"data file {path!r} holds no records")
    return rows


def _check_messages(msgs: list, where: str) -> None:
    if not msgs:
        raise ValueError(f"{where}: the chat messages are empty")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"{where}: message {j} must be an object with 'role' and 'content', got {m!r:.80}")


def to_examples(rows: list[dict], prompt_field: str, answer_field: str, source: str) -> list[Example]:
    """Check every record and convert it; ValueError names the record and the fields it has."""
    out = []
    for i, row in enumerate(rows):
        where = f"{source}: record {i + 1}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object, got {type(row).__name__}")
        for name, what in ((prompt_field, "prompt_field"), (answer_field, "answer_field")):
            if name not in row:
                raise ValueError(f"{where} has no field {name!r} (--{what.replace('_', '-')}); "
                                 f"its fields: {sorted(row)}")
        prompt = row[prompt_field]
        if isinstance(prompt, list):
            _check_messages(prompt, where)
        elif not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: field {prompt_field!r} must be a non-empty string or chat messages, "
                             f"got {prompt!r:.80}")
        answer = row[answer_field]
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{where}: field {answer_field!r} must be a string or a number, got {answer!r:.80}")
        out.append(Example(i, prompt, str(answer), row))
    return out


def task_records(task: str, n: int, seed: int, split: str) -> list[dict]:
    """Records from `vllm.rl.tasks.<task>.generate_problems(n, seed, split)` (imported lazily)."""
    try:
        mod = importlib.import_module(f"vllm.rl.tasks.{task}")
    except ModuleNotFoundError as err:
        if err.name is not None and err.name.startswith("vllm.rl.tasks"):
            raise ValueError(f"task {task!r} is not available (no module vllm.rl.tasks.{task}); "
                             "give --data FILE instead") from None
        raise
    rows = mod.generate_problems(n, seed, split=split)
    if not rows:
        raise ValueError(f"task {task!r} generated no {split} problems")
    return list(rows)


def load_examples(path: str | None, task: str | None, *, prompt_field: str, answer_field: str, size: int,
                  seed: int, split: str) -> list[Example]:
    """`path` wins over `task`; with a task, `size` problems are generated for `split`."""
    if path is not None:
        rows = read_records(path)
        if split != "train":
            rows = rows[:size]
        return to_examples(rows, prompt_field, answer_field, path)
    if task is None:
        raise ValueError("no data: give a data file or a task")
    rows = task_records(task, size, seed, split)
    # a task's records use its own field names unless they were renamed
    return to_examples(rows, prompt_field, answer_field, f"task {task!r} ({split})")


class PromptRenderer:
    """Prompt -> token ids, as the engine will see them."""

    def __init__(self, tokenizer, chat_template: str = "auto", system_prompt: str | None = None):
        self.tok = tokenizer
        self.mode = chat_template
        self.system_prompt = system_prompt

    def uses_template(self, prompt) -> bool:
        if self.mode == "never":
            return False
        return isinstance(prompt, list) or self.mode == "always"

    def __call__(self, prompt: str | list[dict]) -> list[int]:
        if not self.uses_template(prompt):
            if isinstance(prompt, list):
                raise ValueError("chat messages need the chat template (chat_template is 'never')")
            return list(self.tok.encode(prompt, add_special_tokens=True))
        if getattr(self.tok, "chat_template", None) is None:
            raise ValueError("the prompts need a chat template but this model's tokenizer has none "
                             "(use plain-string prompts with chat_template: never)")
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt is not None and not (msgs and msgs[0].get("role") == "system"):
            msgs = [{"role": "system", "content": self.system_prompt}] + msgs
        ids = self.tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)


class PromptSampler:
    """The training order: epoch e is a permutation seeded by (seed, e). Its whole state
    is the number of examples handed out, so a checkpoint restores it exactly."""

    def __init__(self, num_examples: int, seed: int, shuffle: bool = True):
        if num_examples < 1:
            raise ValueError("no training examples")
        self.n = num_examples
        self.seed = seed
        self.shuffle = shuffle
        self.consumed = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            else:
                self._perm = np.arange(self.n)
            self._perm_epoch = epoch
        return self._perm

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            epoch, pos = divmod(self.consumed, self.n)
            out.append(int(self._order(epoch)[pos]))
            self.consumed += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "num_examples": self.n, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        if state["num_examples"] != self.n or state["seed"] != self.seed or state["shuffle"] != self.shuffle:
            raise ValueError(f"the checkpoint's data order ({state['num_examples']} examples, seed {state['seed']}, "
                             f"shuffle {state['shuffle']}) differs from this run's ({self.n}, {self.seed}, "
                             f"{self.shuffle}): resuming would not continue the same run")
        self.consumed = int(state["consumed"])
