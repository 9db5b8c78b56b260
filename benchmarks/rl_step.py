"""The full RL step (rollout + score + logprob recompute + update + sync), fast vs
invariant numerics, or one process vs Ray, side by side in one run, with its split
(generate / train / sync).

    python benchmarks/rl_step.py                                  # Qwen3-4B dims, random weights, H200
    python benchmarks/rl_step.py --config benchmarks/configs/qwen3-8b.json --prompts 8
    python benchmarks/rl_step.py --modes invariant,invariant+ray  # `vllm train --backend ray`, colocated
    python benchmarks/rl_step.py --modes invariant,invariant+ray --device cpu \
        --config vllm/default_model/config.json --max-tokens 8    # plumbing check on CPU, not a measurement

Each mode runs in its own subprocess (a clean GPU for each), from the same recipe
(training/qwen3_dims_grpo.yaml) and the same prompts and seeds: `--warmup` untimed
steps (compilation, autotuning, graph capture), then `--steps` timed ones. Random
weights never emit EOS, so both modes generate exactly prompts x group x max-tokens
tokens per step. Prints per-mode medians, the mismatch each mode measured (fast:
non-zero, invariant: exactly 0), and the invariant / fast step-time ratio (target
<= 1.05). A mode `<numerics>+ray` runs the same steps on Ray (the trainer and one rollout
engine as actors in one bundle, colocated; docs/ray.md; needs the ray package): the
ray / local ratio (target <= 1.10) and whether every step's metrics other than timings
equal the one-process run's are printed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

from json_out import write_json_out

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TIMED = ("time_generate_s", "time_train_s", "time_sync_s", "time_step_s", "tokens_per_s", "kv_freed_gib")


def one_mode(args) -> None:
    """Child process: run warmup + timed steps in one mode (numerics, optionally +ray); print
    one JSON line."""
    import torch

    from vllm.rl.config import TrainConfig

    numerics, _, backend = args.mode.partition("+")
    cfg = TrainConfig.from_yaml(os.path.join(REPO, "training", "qwen3_dims_grpo.yaml"))
    cfg.update({"model": args.config, "numerics": numerics, "data": args.data, "task": None,
                "group_size": args.group_size, "prompts_per_step": args.prompts,
                "max_response_tokens": args.max_tokens, "steps": args.warmup + args.steps,
                "output_dir": os.path.join(args.work, args.mode), "overwrite": True, "progress": False,
                "tensorboard": False, "plots": False, "require_zero_mismatch": False,
                "micro_batch_tokens": args.micro_batch_tokens, "gpu_memory_utilization": args.gpu_memory_utilization,
                "device": args.device})
    if args.device == "cpu":  # a plumbing check with a tiny config, not a measurement
        cfg.update({"dtype": "float32", "sleep_mode": False, "activation_checkpointing": False})
    if backend == "ray":
        from vllm.rl.ray.driver import RayTrainJob
        cfg.update({"backend": "ray", "rollout_engines": 1, "placement": "colocated"})
        job = RayTrainJob(cfg, stream=sys.stderr)
        step, close = job.step, job.shutdown
    else:
        from vllm.rl.trainer import Trainer
        step, close = Trainer(cfg).step, (lambda: None)
    rows = []
    try:
        for i in range(args.warmup + args.steps):
            m = step().metrics
            m["warmup"] = i < args.warmup
            rows.append(m)
            print(f"[{args.mode}] step {m['step']}{' (warm-up)' if m['warmup'] else ''}: {m['time_step_s']:.2f} s = "
                  f"gen {m['time_generate_s']:.2f} + train {m['time_train_s']:.2f} + sync {m['time_sync_s']:.2f}; "
                  f"diff max {m['logprob_diff_max']:.3g}; KV released {m['kv_freed_gib']:.1f} GiB", file=sys.stderr,
                  flush=True)
    finally:
        close()
    out = {"mode": args.mode, "rows": rows,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(HERE, "configs", "qwen3-4b.json"), help="HF config.json (dims)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256, help="response tokens (always reached: random weights)")
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", default="fast,invariant")
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) | cpu (plumbing check, tiny config)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)   # child process
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode is not None:
        one_mode(args)
        return
    import importlib.util
    if "+ray" in args.modes and importlib.util.find_spec("ray") is None:
        raise SystemExit("a +ray mode needs the ray package: pip install -e '.[ray]'")

    work = tempfile.mkdtemp(prefix="rl_step_")
    data = os.path.join(work, "prompts.jsonl")
    r = random.Random(0)
    with open(data, "w") as f:
        for _ in range(4096):
            a, b = r.randint(100, 999), r.randint(100, 999)
            f.write(json.dumps({"prompt": f"What is {a} + {b}? Put the answer in \\boxed{{}}.", "answer": str(a + b)})
                    + "\n")
    results = {}
    for mode in args.modes.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--data", data, "--work", work,
               "--config", args.config, "--prompts", str(args.prompts), "--group-size", str(args.group_size),
               "--max-tokens", str(args.max_tokens), "--micro-batch-tokens", str(args.micro_batch_tokens),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--warmup", str(args.warmup),
               "--steps", str(args.steps), "--device", args.device]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"{mode}: the run failed (exit {proc.returncode})")
        results[mode] = json.loads(line[len("RESULT "):])

    def med(mode, key):
        return statistics.median(m[key] for m in results[mode]["rows"] if not m["warmup"])

    print(f"\nRL step, {os.path.basename(args.config)} dims (random weights), {args.prompts} prompts x "
          f"{args.group_size} responses x {args.max_tokens} tokens, on {next(iter(results.values()))['device']}; "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'mode':<14} {'step s':>8} {'generate':>9} {'train':>8} {'sync':>7} {'tok/s':>8} {'diff max':>10} "
          f"{'k3':>10} {'KV freed':>9} {'peak GiB':>9}")
    for mode in results:
        rows = [m for m in results[mode]["rows"] if not m["warmup"]]
        print(f"{mode:<14} {med(mode, 'time_step_s'):>8.2f} {med(mode, 'time_generate_s'):>9.2f} "
              f"{med(mode, 'time_train_s'):>8.2f} {med(mode, 'time_sync_s'):>7.2f} {med(mode, 'tokens_per_s'):>8.0f} "
              f"{max(m['logprob_diff_max'] for m in rows):>10.3g} {max(m['k3_kl'] for m in rows):>10.3g} "
              f"{rows[-1]['kv_freed_gib']:>8.1f}G {results[mode]['peak_gib']:>9.1f}")
    if "fast" in results and "invariant" in results:
        for key, label in (("time_step_s", "full step"), ("time_generate_s", "generate"), ("time_train_s", "train"),
                           ("time_sync_s", "sync")):
            f, i = med("fast", key), med("invariant", key)
            print(f"invariant / fast, {label:<9}: {i / f if f > 0 else float('nan'):.3f}")
        overhead = 100 * (med("invariant", "time_step_s") / med("fast", "time_step_s") - 1)
        print(f"overhead of invariant over fast (full step): {overhead:+.1f}%  (target <= +5%)")
    for local in [m for m in results if "+" not in m and m + "+ray" in results]:
        ray = local + "+ray"
        for key, label in (("time_step_s", "full step"), ("time_generate_s", "generate"), ("time_train_s", "train"),
                           ("time_sync_s", "sync")):
            lo, ra = med(local, key), med(ray, key)
            print(f"{ray} / {local}, {label:<9}: {ra / lo if lo > 0 else float('nan'):.3f}")
        same = all({k: v for k, v in a.items() if k not in TIMED} == {k: v for k, v in b.items() if k not in TIMED}
                   for a, b in zip(results[local]["rows"], results[ray]["rows"]))
        overhead = 100 * (med(ray, "time_step_s") / med(local, "time_step_s") - 1)
        print(f"overhead of ray over one process ({local}, full step): {overhead:+.1f}%  (target <= +10%); "
              f"metrics other than timings equal on every step: {'yes' if same else 'NO'}")
    write_json_out(args.json_out, results)


if __name__ == "__main__":
    main()
