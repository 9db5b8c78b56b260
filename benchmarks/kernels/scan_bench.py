"""What the per-layer benchmarks of the chunked recurrences (gdn.py, mamba2.py) share: the
optional native baseline, timing, the steps' metadata, the decode-rows bit check, the
report (invariant mode, fast mode and the baseline per case) and the tunable sweeps' configs
(gdn_forward_sweep.py, mamba2_output_sweep.py)."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
from types import ModuleType
from typing import Callable, Iterator

import numpy as np
import torch
import triton

from vllm.forward_context import StateMetadata
from vllm.testing.chunked_scan import step_metadata

DEV = "cuda"


def optional_baseline(*paths: str) -> tuple:
    """The functions at `paths` ("package.module.name") of an optional native baseline, or None
    for each where it does not import (the native column is then our fast mode)."""
    try:
        return tuple(getattr(importlib.import_module(p.rsplit(".", 1)[0]), p.rsplit(".", 1)[1]) for p in paths)
    except Exception as err:  # noqa: BLE001 -- an optional baseline
        print(f"{paths[0].split('.')[0]} not available ({type(err).__name__}: {err}); the native column is our "
              f"fast mode")
        return (None,) * len(paths)


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e3


def metadata(start_pos, q_lens, slots=None, host=True) -> StateMetadata:
    return step_metadata(start_pos, q_lens, slots, host, device=DEV)


def prefill_metadata(n: int, length: int) -> StateMetadata:
    """n sequences of `length` tokens from position 0, in slots 1..n."""
    return metadata([0] * n, [length] * n, list(range(1, n + 1)))


def decode_metadata(n: int, chunk: int) -> StateMetadata:
    """n sequences of one token in slots 1..n, at positions past 2048 that put every offset
    within a chunk of `chunk` rows."""
    rng = np.random.default_rng(0)
    pos = (2048 + rng.integers(0, 4 * chunk, n)).tolist()
    return metadata(pos, [1] * n, list(range(1, n + 1)), host=False)


def decode_rows_differing(step: Callable, state: Callable, T: int = 300, prefill: int = 100) -> dict:
    """Per mode, how many rows of a `prefill`-token prefill followed by one decode step per token
    differ from one T-token prefill's. step(aligned, lo, hi, md, st) runs the benchmark
    sequence's tokens lo:hi as one step of that mode (the op that mode takes for the step);
    state(aligned) is a fresh cache of two slots (the sequence in slot 1)."""
    res = {}
    for name, aligned in (("invariant", True), ("fast", False)):
        whole = step(aligned, 0, T, metadata([0], [T], [1]), state(aligned))
        st = state(aligned)
        rows = [step(aligned, 0, prefill, metadata([0], [prefill], [1]), st)]
        for p in range(prefill, T):
            rows.append(step(aligned, p, p + 1, metadata([p], [1], [1], host=False), st))
        dec = torch.cat(rows)
        res[name] = int((whole.view(torch.int16) != dec.view(torch.int16)).flatten(1).any(1).sum())
    return res


def main(doc: str, title: str, cases: dict[str, Callable], bits_check: Callable, baseline: str) -> None:
    """Run the cases (the first is the train case: it also times the forward alone as
    `<mode>_fwd`) and bits_check, print the table (the ratio column is invariant / native:
    `baseline` where it ran, else our fast mode) and with --json-out write the numbers."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--cases", default=None, help="comma-separated first words of the cases to run "
                    "(e.g. train,prefill; default all)")
    ap.add_argument("--processes", type=int, default=1, help="run the cases in this many processes and keep "
                    "each column's best time: a native baseline that autotunes picks its configs once per "
                    "process, and its times move between processes far more than ours")
    args = ap.parse_args()
    if args.cases:
        cases = {k: v for k, v in cases.items() if k.split()[0] in args.cases.split(",")}
    results = {}
    for name, case in cases.items():  # each case as it ends: a run cut short keeps what it measured
        results[name] = case()
        print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in results[name].items()), flush=True)
    for _ in range(args.processes - 1):
        results = best_of(results, _another_process(args.cases))
    b = bits_check()
    title = title.replace("{device}", torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU")
    print(f"\n== {title}" + (f"; each column the best of {args.processes} processes" if args.processes > 1 else ""))
    print(f"{'case':<24}{'invariant':>12}{'fast':>12}{baseline:>12}{'inv/native':>12}{'inv/fast':>10}")
    for case, r in results.items():
        native = r.get(baseline, r["fast"])
        ref = f"{r[baseline]:.1f}" if baseline in r else "-"
        print(f"{case:<24}{r['invariant']:>12.1f}{r['fast']:>12.1f}{ref:>12}{r['invariant'] / native:>12.2f}"
              f"{r['invariant'] / r['fast']:>10.2f}")
    t = next((r for r in results.values() if "invariant_fwd" in r), None)
    if t is not None:
        fwd_ref = f", {baseline} {t[baseline + '_fwd']:.1f}" if baseline + "_fwd" in t else ""
        print(f"train forward alone: invariant {t['invariant_fwd']:.1f}, fast {t['fast_fwd']:.1f}{fwd_ref} us")
    print(f"decode rows after a 100-token prefill vs one 300-token prefill, rows differing of 200: "
          f"invariant {b['invariant']}, fast {b['fast']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"results": results, "bits": b}, f, indent=1)


def _another_process(case_words: str | None) -> dict:
    """The cases' results from a fresh run of this script (its own autotuning), {} if it failed."""
    import os
    import subprocess
    import sys
    import tempfile
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, sys.argv[0], "--json-out", path] + (["--cases", case_words] if case_words else [])
    try:
        if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:
            print("another process failed: its times are left out", flush=True)
            return {}
        with open(path) as f:
            results = json.load(f)["results"]
    finally:
        os.unlink(path)
    for name, r in results.items():
        print(f"{name} (another process): " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()), flush=True)
    return results


def best_of(a: dict, b: dict) -> dict:
    """Per case and column, the lower time of two runs' results (a column only one run has is kept)."""
    return {case: {k: min(v, b.get(case, {}).get(k, v)) for k, v in r.items()} for case, r in a.items()}


def kernel_times(fn, calls: int = 20) -> dict[str, float]:
    """GPU time per call of each kernel fn launches (torch profiler, mean over `calls`), us."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            out[e.name[:40]] += t / calls
    return dict(out)


def report(label: str, times: dict[str, float]) -> None:
    total = sum(times.values())
    parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(times.items(), key=lambda kv: -kv[1]) if v >= 1.0)
    print(f"{label:<34} total {total:8.1f} us | {parts}")


def precision_variant(prec: str):
    """A context in which the training backwards' dots take `prec` (vllm.kernels.training_tiles
    .dot_precision patched): for a side-by-side measure of what a cheaper precision would buy."""
    import contextlib

    from vllm.kernels import training_tiles

    @contextlib.contextmanager
    def ctx():
        saved = training_tiles.dot_precision
        training_tiles.dot_precision = lambda x: prec
        try:
            yield
        finally:
            training_tiles.dot_precision = saved
    return ctx()


def backward_report(T: int, ref_step: Callable, fused: Callable, exact: tuple, names: list[str],
                    variants: dict[str, Callable] | None = None) -> None:
    """The training backward at T tokens: autograd of the reference (ref_step) against the
    fused kernels (fused), their time, the fused kernels' GPU time per kernel, at the dots'
    precision for bfloat16 inputs (bf16 operands, the trainer's) beside 3xTF32 (float32
    inputs'), and each one's distance from `exact` (float64 autograd), one relative error per
    input gradient. variants: name -> a context manager factory under which the fused kernels
    run another way (timed and checked beside the default, same inputs)."""
    import contextlib
    def errors(name, got):  # printed as each row is measured: a later variant's failure loses nothing
        errs = [((a.double() - b.double()).norm() / max(b.double().norm(), 1e-30)).item() for a, b in zip(got, exact)]
        print(f"  {name} vs float64: " + ", ".join(f"d{n} {e:.1e}" for n, e in zip(names, errs)), flush=True)

    t_ref = bench(ref_step)
    rows = [("reference autograd (float32)", ref_step(), t_ref)]
    errors(*rows[0][:2])
    for variant, ctx in {"": contextlib.nullcontext, **(variants or {})}.items():
        for prec in ("bf16", "tf32x3"):
            label = f"{prec}{', ' + variant if variant else ''}"
            try:
                with precision_variant(prec), ctx():
                    got, t = fused(), bench(fused)
                    report(f"backward kernels (fused, {label})", kernel_times(fused))
            except triton.runtime.errors.OutOfResources as e:  # a launch config that does not fit
                print(f"fused kernels ({label}): does not fit ({str(e)[:90]})")
                continue
            rows.append((f"fused kernels ({label})", got, t))
            print(f"fused kernels ({label}) {t:.1f} us", flush=True)
            errors(*rows[-1][:2])
    print(f"backward 1x{T}: " + ", ".join(f"{name} {t:.1f} us" for name, _, t in rows)
          + "".join(f" ({name} {t_ref / t:.2f}x faster than the reference)" for name, _, t in rows[1:2]))


def sweep_configs(module: ModuleType, text: str) -> list[dict]:
    """`;`-separated configs of space-separated NAME=INT over `module`'s tunables (the first is a
    sweep's bits reference; "" = the module's defaults), each value of the tunable's type (an int
    where the default is None)."""
    configs = []
    for cfg in text.split(";"):
        out = {}
        for item in cfg.split():
            name, _, value = item.partition("=")
            if not hasattr(module, name) or not value.isdigit():
                raise ValueError(f"{item!r} is not NAME=INT for a tunable of {module.__name__}")
            current = getattr(module, name)
            out[name] = int(value) if current is None else type(current)(int(value))
        configs.append(out)
    return configs


@contextlib.contextmanager
def swept(module: ModuleType, configs: list[dict]) -> Iterator[Callable[[dict], str]]:
    """Yields apply(cfg): sets `module`'s tunables to cfg over its defaults and returns the
    config's label; the defaults are restored on exit."""
    saved = {k: getattr(module, k) for cfg in configs for k in cfg}

    def apply(cfg: dict) -> str:
        for k, v in saved.items():
            setattr(module, k, cfg.get(k, v))
        return " ".join(f"{k}={v}" for k, v in cfg.items()) or "defaults"
    try:
        yield apply
    finally:
        for k, v in saved.items():
            setattr(module, k, v)
