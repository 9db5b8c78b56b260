"""The RL step on Ray (`vllm train --backend ray`, colocated: trainer and one engine in one GPU
bundle) against the single-process `vllm train` step, side by side, same recipe, prompts and
seeds (docs/ray.md; target: Ray's step time within 10% of the single-process one).

    python benchmarks/rl_ray_step.py                          # Qwen3-4B dims, random weights, one GPU
    python benchmarks/rl_ray_step.py --device cpu --config vllm/default_model/config.json --max-tokens 8
                                                              # plumbing check on CPU, not a measurement

Each backend runs in its own subprocess (a clean GPU for each) from training/qwen3_dims_grpo.yaml:
`--warmup` untimed steps, then `--steps` timed ones. Prints per-backend medians with the split
(generate / train / sync), the ratio ray / local, and whether every step's metrics other than
timings (rewards, logprob differences, loss, gradient norm: float bits) are equal between the
two. Needs the ray package (pip install -e '.[ray]').
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

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BACKENDS = ("local", "ray")
TIMED = ("time_generate_s", "time_train_s", "time_sync_s", "time_step_s", "tokens_per_s", "kv_freed_gib")


def _config(args, backend: str):
    from vllm.rl.config import TrainConfig

    cfg = TrainConfig.from_yaml(os.path.join(REPO, "training", "qwen3_dims_grpo.yaml"))
    cfg.update({"model": args.config, "data": args.data, "task": None, "group_size": args.group_size,
                "prompts_per_step": args.prompts, "max_response_tokens": args.max_tokens,
                "steps": args.warmup + args.steps, "output_dir": os.path.join(args.work, backend), "overwrite": True,
                "progress": False, "tensorboard": False, "plots": False, "micro_batch_tokens": args.micro_batch_tokens,
                "gpu_memory_utilization": args.gpu_memory_utilization, "device": args.device})
    if args.device == "cpu":
        cfg.update({"dtype": "float32", "sleep_mode": False, "activation_checkpointing": False})
    if backend == "ray":
        cfg.update({"backend": "ray", "rollout_engines": 1, "placement": "colocated"})
    return cfg


def one_backend(args) -> None:
    """Child process: warm-up + timed steps on one backend; prints one JSON line."""
    import torch

    cfg = _config(args, args.backend)
    if args.backend == "ray":
        from vllm.rl.ray.driver import RayTrainJob
        job = RayTrainJob(cfg, stream=sys.stderr)
        step, close = job.step, job.shutdown
    else:
        from vllm.rl.trainer import Trainer
        trainer = Trainer(cfg)
        step, close = trainer.step, (lambda: None)
    rows = []
    try:
        for i in range(args.warmup + args.steps):
            m = step().metrics
            m["warmup"] = i < args.warmup
            rows.append(m)
            print(f"[{args.backend}] step {m['step']}{' (warm-up)' if m['warmup'] else ''}: {m['time_step_s']:.2f} s "
                  f"= gen {m['time_generate_s']:.2f} + train {m['time_train_s']:.2f} + sync {m['time_sync_s']:.2f}; "
                  f"diff max {m['logprob_diff_max']:.3g}", file=sys.stderr, flush=True)
    finally:
        close()
    out = {"backend": args.backend, "rows": rows,
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
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) | cpu (plumbing check)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--backend", default=None, help=argparse.SUPPRESS)   # child process
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.backend is not None:
        one_backend(args)
        return
    import importlib.util
    if importlib.util.find_spec("ray") is None:
        raise SystemExit("rl_ray_step.py needs the ray package: pip install -e '.[ray]'")

    work = tempfile.mkdtemp(prefix="rl_ray_step_")
    data = os.path.join(work, "prompts.jsonl")
    r = random.Random(0)
    with open(data, "w") as f:
        for _ in range(4096):
            a, b = r.randint(100, 999), r.randint(100, 999)
            f.write(json.dumps({"prompt": f"What is {a} + {b}? Put the answer in \\boxed{{}}.", "answer": str(a + b)})
                    + "\n")
    results = {}
    for backend in BACKENDS:
        cmd = [sys.executable, os.path.abspath(__file__), "--backend", backend, "--data", data, "--work", work,
               "--config", args.config, "--prompts", str(args.prompts), "--group-size", str(args.group_size),
               "--max-tokens", str(args.max_tokens), "--micro-batch-tokens", str(args.micro_batch_tokens),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--warmup", str(args.warmup),
               "--steps", str(args.steps), "--device", args.device]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"{backend}: the run failed (exit {proc.returncode})")
        results[backend] = json.loads(line[len("RESULT "):])

    def med(backend, key):
        return statistics.median(m[key] for m in results[backend]["rows"] if not m["warmup"])

    print(f"\nRL step on Ray vs in one process, {os.path.basename(args.config)} dims (random weights), {args.prompts} "
          f"prompts x {args.group_size} responses x {args.max_tokens} tokens, on {results['local']['device']}; "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'backend':<8} {'step s':>8} {'generate':>9} {'train':>8} {'sync':>7} {'tok/s':>8} {'diff max':>10}")
    for b in BACKENDS:
        rows = [m for m in results[b]["rows"] if not m["warmup"]]
        print(f"{b:<8} {med(b, 'time_step_s'):>8.2f} {med(b, 'time_generate_s'):>9.2f} {med(b, 'time_train_s'):>8.2f} "
              f"{med(b, 'time_sync_s'):>7.2f} {med(b, 'tokens_per_s'):>8.0f} "
              f"{max(m['logprob_diff_max'] for m in rows):>10.3g}")
    for key, label in (("time_step_s", "full step"), ("time_generate_s", "generate"), ("time_train_s", "train"),
                       ("time_sync_s", "sync")):
        lo, ra = med("local", key), med("ray", key)
        print(f"ray / local, {label:<9}: {ra / lo if lo > 0 else float('nan'):.3f}")
    same = all({k: v for k, v in a.items() if k not in TIMED} == {k: v for k, v in b.items() if k not in TIMED}
               for a, b in zip(results["local"]["rows"], results["ray"]["rows"]))
    overhead = 100 * (med("ray", "time_step_s") / med("local", "time_step_s") - 1)
    print(f"overhead of ray over local (full step): {overhead:+.1f}%  (target <= +10%); "
          f"metrics other than timings equal on every step: {'yes' if same else 'NO'}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
