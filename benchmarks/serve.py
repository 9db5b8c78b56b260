"""`vllm serve` throughput vs the same engine offline, measured side by side in one run.

1. offline: `LLM.generate` on the workload (after a warm-up wave of other prompts);
2. the server: `vllm serve` started as a subprocess with the same engine flags, then
   N concurrent clients send /v1/completions, first streaming, then non-streaming,
   each mode one warm-up wave and `--waves` timed waves of fresh prompts.
Prints output tokens/s for each and the ratios to offline (target: >= 0.9).

H200 (Qwen3-8B dims, random weights):
    python benchmarks/serve.py --config benchmarks/configs/qwen3-8b.json --numerics invariant \\
        --no-enable-prefix-caching --num-clients 256 --input-len 512 --output-len 256
CPU smoke test (tiny model):
    python benchmarks/serve.py --model-size tiny --device cpu --num-clients 8 --input-len 16 --output-len 8 --waves 1

Clients run in `--client-procs` processes (asyncio + httpx each) so that the client
is not what limits the measurement; streaming clients ask for usage in the last
event and parse only that one.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time


def make_model_dir(args) -> str:
    from vllm.testing.tiny_models import build_tokenizer, make_tiny_checkpoint

    d = tempfile.mkdtemp(prefix="bench_serve_model_")
    if args.model_size == "tiny":
        return make_tiny_checkpoint(d, "qwen3", hidden_size=64, num_hidden_layers=2, max_position_embeddings=1024)
    shutil.copy(args.config, os.path.join(d, "config.json"))
    build_tokenizer(d)
    return d


def engine_flags(args, model: str) -> tuple[dict, list[str]]:
    """The same engine, as LLM kwargs (offline) and as `vllm serve` flags."""
    kw = dict(model=model, numerics=args.numerics, seed=0, max_num_seqs=args.max_num_seqs,
              max_model_len=args.input_len + args.output_len + 16, enable_prefix_caching=args.enable_prefix_caching,
              gpu_memory_utilization=args.gpu_memory_utilization)
    flags = ["--model", model, "--numerics", args.numerics, "--seed", "0", "--max-num-seqs", str(args.max_num_seqs),
             "--max-model-len", str(kw["max_model_len"]), "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.device:
        kw["device"] = args.device
        flags += ["--device", args.device]
    if args.model_size != "tiny":
        kw["load_format"] = "dummy"
        flags += ["--load-format", "dummy"]
    if not args.enable_prefix_caching:
        flags.append("--no-enable-prefix-caching")
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
        flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return kw, flags


def prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


# ---- offline ---------------------------------------------------------------------------------

def run_offline(args, kw: dict, vocab: int) -> dict:
    import torch

    from vllm import LLM, SamplingParams

    llm = LLM(**kw)
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=1.0)
    n = args.num_clients
    llm.generate([{"prompt_token_ids": p} for p in prompts(1, n, args.input_len, vocab)], sp, use_tqdm=False)
    total, t_all = 0, 0.0
    for w in range(args.waves):
        batch = [{"prompt_token_ids": p} for p in prompts(100 + w, n, args.input_len, vocab)]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        t_all += time.perf_counter() - t0
        total += sum(len(c.token_ids) for o in outs for c in o.outputs)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"tokens": total, "seconds": t_all, "tok_s": total / t_all}


# ---- clients ---------------------------------------------------------------------------------

async def _one_request(client, body: dict, stream: bool) -> int:
    if not stream:
        r = await client.post("/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]
    tail = b""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for chunk in r.aiter_raw():
            tail = (tail + chunk)[-4096:]
    # the last event before [DONE] carries usage (stream_options.include_usage)
    events = [e for e in tail.split(b"\n\n") if e.startswith(b"data: {")]
    return json.loads(events[-1][6:])["usage"]["completion_tokens"]


async def _client_wave(base_url: str, bodies: list[dict], stream: bool) -> tuple[int, float, float, int]:
    import httpx

    limits = httpx.Limits(max_connections=len(bodies) + 8, max_keepalive_connections=len(bodies) + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits, trust_env=False) as client:
        t0 = time.time()
        res = await asyncio.gather(*(_one_request(client, b, stream) for b in bodies), return_exceptions=True)
        t1 = time.time()
    errors = [r for r in res if isinstance(r, BaseException)]
    if errors:
        print(f"  client errors: {len(errors)}, first: {errors[0]!r}", file=sys.stderr, flush=True)
    return sum(r for r in res if isinstance(r, int)), t0, t1, len(errors)


def _client_proc(base_url: str, bodies: list[dict], stream: bool, start_at: float, q) -> None:
    time.sleep(max(0.0, start_at - time.time()))
    q.put(asyncio.run(_client_wave(base_url, bodies, stream)))


def run_wave(args, base_url: str, wave_seed: int, stream: bool, vocab: int) -> tuple[int, float, int]:
    bodies = [{"prompt": p, "max_tokens": args.output_len, "ignore_eos": True, "temperature": 1.0, "stream": stream,
               **({"stream_options": {"include_usage": True}} if stream else {})}
              for p in prompts(wave_seed, args.num_clients, args.input_len, vocab)]
    procs = max(1, min(args.client_procs, len(bodies)))
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    start_at = time.time() + 2.0  # every client process is up before the wave starts
    workers = [ctx.Process(target=_client_proc, args=(base_url, bodies[i::procs], stream, start_at, q))
               for i in range(procs)]
    for w in workers:
        w.start()
    results = [q.get() for _ in workers]
    for w in workers:
        w.join()
    tokens = sum(r[0] for r in results)
    seconds = max(r[2] for r in results) - min(r[1] for r in results)
    return tokens, seconds, sum(r[3] for r in results)


# ---- the server ------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str], port: int, log_path: str) -> subprocess.Popen:
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *flags, "--host", "127.0.0.1",
           "--port", str(port), "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    proc.log_path = log_path
    return proc


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-lines:])
    except OSError as err:
        return f"(no log: {err})"


def wait_healthy(proc: subprocess.Popen, base_url: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with code {proc.returncode} while starting; its log ends:\n"
                           + _tail(proc.log_path))
        try:
            if httpx.get(base_url + "/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    raise RuntimeError("vllm serve did not become healthy in time")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="benchmarks/configs/qwen3-8b.json", help="HF config.json (random weights)")
    ap.add_argument("--model-size", default="config", choices=["config", "tiny"],
                    help="tiny: a 2-layer random checkpoint (CPU smoke test) instead of --config")
    ap.add_argument("--device", default=None)
    ap.add_argument("--numerics", default="invariant", choices=["fast", "invariant"])
    ap.add_argument("--num-clients", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--waves", type=int, default=2, help="timed waves per mode (each of fresh prompts)")
    ap.add_argument("--client-procs", type=int, default=None, help="client processes (default: 4, or 1 below 64 clients)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--skip-offline", action="store_true")
    args = ap.parse_args()
    if args.client_procs is None:
        args.client_procs = 4 if args.num_clients >= 64 else 1

    model = make_model_dir(args)
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    kw, flags = engine_flags(args, model)
    print(f"workload: {args.num_clients} clients x {args.input_len} -> {args.output_len} tokens, {args.waves} wave(s), "
          f"numerics={args.numerics}, prefix caching {'on' if args.enable_prefix_caching else 'off'}", flush=True)

    results: dict = {}
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(tempfile.gettempdir(), f"bench_serve_{port}.log")
    t0 = time.perf_counter()
    proc = start_server(flags, port, log_path)
    try:
        wait_healthy(proc, base_url, args.startup_timeout)
        print(f"server up in {time.perf_counter() - t0:.1f} s (log: {log_path})", flush=True)
        for stream in (True, False):
            name = "streaming" if stream else "non-streaming"
            run_wave(args, base_url, 2 if stream else 3, stream, vocab)  # warm-up wave
            tokens, seconds, errors = 0, 0.0, 0
            for w in range(args.waves):
                tk, sec, err = run_wave(args, base_url, 1000 * (2 if stream else 3) + w, stream, vocab)
                tokens, seconds, errors = tokens + tk, seconds + sec, errors + err
            results[name] = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "errors": errors}
            expected = args.waves * args.num_clients * args.output_len
            note = "" if tokens == expected else f"  (expected {expected} tokens!)"
            print(f"server {name}: {tokens / seconds:,.0f} output tok/s, {errors} errors{note}", flush=True)
        import httpx
        metrics = httpx.get(base_url + "/metrics", timeout=10, trust_env=False).text
        results["server_free_blocks_line"] = next((l for l in metrics.splitlines() if l.startswith("vllm:kv_cache_free_blocks")), "")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    # offline after the server is gone: the GPU is then the offline engine's alone, as it
    # was the server's (the parent process holds no CUDA memory while the server runs)
    if not args.skip_offline:
        results["offline"] = run_offline(args, kw, vocab)
        print(f"offline LLM.generate: {results['offline']['tok_s']:,.0f} output tok/s", flush=True)
    if "offline" in results:
        off = results["offline"]["tok_s"]
        for name in ("streaming", "non-streaming"):
            results[name]["ratio_vs_offline"] = results[name]["tok_s"] / off
        print(f"ratios vs offline: streaming {results['streaming']['ratio_vs_offline']:.2f}x, "
              f"non-streaming {results['non-streaming']['ratio_vs_offline']:.2f}x (target >= 0.95x)")
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
