"""What the user sees: a progress bar, one line per step, OUTPUT_DIR/metrics.jsonl,
TensorBoard scalars (if tensorboard is installed) and PNG plots at the end (if
matplotlib is installed). The optional parts say what they skipped and why."""
from __future__ import annotations

import json
import math
import os
import sys
import uuid
from statistics import fmean

# Keys every training-step record carries (tests and plots rely on them).
STEP_KEYS = ("step", "reward_mean", "response_length_mean", "logprob_diff_max", "logprob_diff_mean",
             "logprob_diff_std", "k3_kl", "clip_fraction", "entropy", "grad_norm", "time_generate_s", "time_train_s",
             "time_sync_s", "tokens_per_s")


def _g(v, spec: str = ".3g") -> str:
    if isinstance(v, float) and v == 0.0:
        return "0"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def format_line(r: dict, total_steps: int) -> str:
    if r.get("kind") == "eval":
        return f"eval  @ step {r['step']}: reward {r['eval_reward_mean']:.3f} over {r['eval_problems']} problems, " \
               f"response length {r['eval_response_length_mean']:.1f}"
    parts = [
        f"step {r['step']}/{total_steps}",
        f"reward {r['reward_mean']:.3f}",
        f"len {r['response_length_mean']:.1f}",
        f"diff max {_g(r['logprob_diff_max'])} mean {_g(r['logprob_diff_mean'])} std {_g(r['logprob_diff_std'])}",
        f"k3 {_g(r['k3_kl'])}",
        f"clip {r['clip_fraction']:.3f}",
        *([f"ent {r['entropy']:.3f}"] if r.get("entropy") is not None else []),
        f"gnorm {_g(r['grad_norm'])}",
        f"gen {r['time_generate_s']:.2f}s train {r['time_train_s']:.2f}s sync {r['time_sync_s']:.2f}s",
        f"{r['tokens_per_s']:.0f} tok/s",
    ]
    if r.get("groups_kept") is not None and r.get("dynamic_sampling"):
        parts.insert(3, f"groups {r['groups_kept']}/{r['groups_sampled']}")
    if r.get("ref_kl") is not None:
        parts.insert(-3, f"ref_kl {_g(r['ref_kl'])}")
    return " | ".join(parts)


def summary_line(records: list[dict], seconds: float | None = None, window: int = 5) -> str | None:
    """The run in one line: mean reward of the first and last `window` steps, greedy eval
    reward before and after, the largest logprob difference of any step, the time."""
    steps = [r for r in records if r.get("kind") != "eval"]
    if not steps:
        return None
    first, last = steps[:window], steps[-window:]
    parts = [f"reward {fmean([r['reward_mean'] for r in first]):.3f} (first {len(first)} steps) -> "
             f"{fmean([r['reward_mean'] for r in last]):.3f} (last {len(last)})"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if len(evals) >= 2:
        parts.append(f"eval {evals[0]['eval_reward_mean']:.3f} @ step {evals[0]['step']} -> "
                     f"{evals[-1]['eval_reward_mean']:.3f} @ step {evals[-1]['step']}")
    parts.append(f"logprob diff max {_g(max(r['logprob_diff_max'] for r in steps))} over {len(steps)} steps")
    if seconds is not None:
        parts.append(f"{seconds:.0f} s")
    return "done: " + " | ".join(parts)


def read_metrics(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


WANDB_ID_FILE = "wandb_run_id"


def _wandb_run(output_dir: str, project: str, config: dict, skipped: list):
    """A wandb run for this output directory: its id is kept in OUTPUT_DIR/wandb_run_id, so a
    resumed run logs into the same wandb run (wandb keeps the values first logged for a step,
    so the steps a resumed run repeats after its checkpoint keep the first run's values; they
    are equal bit for bit in invariant mode). None, with a note, without the package."""
    try:
        import wandb
    except ImportError:
        skipped.append("Weights & Biases logs (pip install wandb)")
        return None
    id_path = os.path.join(output_dir, WANDB_ID_FILE)
    run_id = open(id_path).read().strip() if os.path.isfile(id_path) else uuid.uuid4().hex[:12]
    with open(id_path, "w") as f:
        f.write(run_id)
    return wandb.init(project=project, id=run_id, resume="allow", dir=output_dir, config=config,
                      name=os.path.basename(os.path.abspath(output_dir)))


class MetricsLogger:
    def __init__(self, output_dir: str, total_steps: int, start_step: int = 0, tensorboard: bool = True,
                 progress: bool = True, stream=None, wandb_project: str | None = None,
                 wandb_config: dict | None = None):
        os.makedirs(output_dir, exist_ok=True)
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self.skipped: list[str] = []
        # a resumed run rewrites the steps after its checkpoint
        kept = [r for r in read_metrics(self.path) if r["step"] <= start_step] if start_step > 0 else []
        with open(self.path, "w") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"),
                                        purge_step=start_step + 1 if start_step > 0 else None)
            except ImportError:
                self.skipped.append("TensorBoard logs (pip install tensorboard)")
        self.wandb = None
        if wandb_project:
            self.wandb = _wandb_run(output_dir, wandb_project, wandb_config or {}, self.skipped)
        self.bar = None
        if progress:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, desc="vllm train", unit="step",
                            dynamic_ncols=True, file=sys.stderr)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def log(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            prefix = "eval/" if record.get("kind") == "eval" else "train/"
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tb.add_scalar(prefix + k, v, record["step"])
            self.tb.flush()
        if self.wandb is not None:
            prefix = "eval/" if record.get("kind") == "eval" else "train/"
            self.wandb.log({prefix + k: v for k, v in record.items() if k not in ("step", "kind")
                            and isinstance(v, (int, float))}, step=record["step"])
        self.write(format_line(record, self.total_steps))
        if self.bar is not None and record.get("kind") != "eval":
            self.bar.update(1)

    def close(self, plots: bool = True) -> list[str]:
        """Finish the bar and the logs, draw the plots; returns the files written."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        written = []
        if plots:
            try:
                written = make_plots(self.path, self.output_dir)
            except ImportError:
                self.skipped.append("PNG plots (pip install matplotlib)")
        for what in self.skipped:
            print(f"skipped: {what}", file=self.stream)
        return written


def make_plots(metrics_path: str, out_dir: str) -> list[str]:
    """reward.png (train reward, eval reward) and mismatch.png (rollout vs trainer logprob
    difference and k3 KL per step)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [r for r in rows if r.get("kind") != "eval"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    if not train:
        return []
    steps = [r["step"] for r in train]

    def save(fig, ax, ylabel: str, name: str) -> str:
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.legend()
        ax.grid(alpha=0.3)
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    out = []
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward_mean"] for r in train], label="train reward (mean over rollouts)")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_reward_mean"] for r in evals], "o-", label="eval reward (greedy)")
    out.append(save(fig, ax, "reward", "reward.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("logprob_diff_max", "|logp_train - logp_rollout| max"),
                       ("logprob_diff_mean", "|logp_train - logp_rollout| mean"), ("k3_kl", "k3 KL(rollout || train)")):
        ax.plot(steps, [r[key] for r in train], label=label)
    if all(r["logprob_diff_max"] == 0.0 for r in train):
        ax.set_title("rollout vs trainer logprobs: identical bits at every step")
    out.append(save(fig, ax, "mismatch", "mismatch.png"))
    return out
