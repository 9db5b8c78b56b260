"""Engine flags shared by every subcommand that builds an engine."""
from __future__ import annotations

import argparse
import re
from decimal import Decimal, InvalidOperation

from vllm.sampling_params import DEFAULT_LOGPROBS_MODE, LOGPROBS_MODES


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already says what the
    default is (in words, where None means "decided later") or the option is a switch
    (store_true / store_false / --x/--no-x), whose default the help's wording implies:
    each default is printed once."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.nargs == 0 or action.default is None
                or action.default is argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


# the values vllm.config.resolve_dtype takes (its _DTYPES keys, and "auto"), spelled out here
# because importing vllm.config imports torch, and building the parser must not
# (tests/test_server_upstream.py checks the two agree)
DTYPE_CHOICES = ("auto", "float32", "fp32", "float", "bfloat16", "bf16", "float16", "fp16", "half")

# upstream's human_readable_int suffixes: lowercase decimal (k = 1000), uppercase binary (K = 1024)
_DECIMAL_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY_SUFFIX = {"K": 2**10, "M": 2**20, "G": 2**30}


def human_readable_int(text: str) -> int:
    """An integer as upstream's token-count flags take it: 2048, 1k (1000), 1K (1024),
    25.6k (25600), 1m, 1M. Decimals only with a lowercase (decimal) suffix, and only where
    they give a whole number."""
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG])", text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid integer {text!r} (e.g. 2048, 1k = 1000, 1K = 1024, 25.6k)") from None
    number, suffix = match.groups()
    if suffix in _BINARY_SUFFIX:
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r}: decimals are not allowed with the binary suffix {suffix} "
                                             f"(did you mean {number}{suffix.lower()}?)")
        return int(number) * _BINARY_SUFFIX[suffix]
    try:
        # Decimal, not float: 25.6k is 25600 exactly, and a fraction of a token is refused
        value = Decimal(number) * _DECIMAL_SUFFIX[suffix]
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number ({value})")
    return int(value)


def _positive_tokens(flag: str, *, auto_note: str | None = None):
    """human_readable_int, > 0. `auto_note`: why upstream's `auto` / -1 (fit the context to the
    memory) is not taken here; without it they are just invalid."""
    def parse(text: str) -> int:
        if auto_note is not None and text.strip().lower() in ("auto", "-1"):
            raise argparse.ArgumentTypeError(f"{text.strip()}: not supported here ({auto_note})")
        value = human_readable_int(text)
        if value <= 0:
            note = f" ({auto_note})" if auto_note is not None else ""
            raise argparse.ArgumentTypeError(f"{text.strip()}: must be a positive number of tokens{note}")
        return value
    parse.__name__ = "integer"   # argparse's "invalid integer value" for other errors
    return parse


# why --max-model-len auto / -1 / 0 are refused
_MAX_MODEL_LEN_NOTE = ("the context length is taken from the model config's max_position_embeddings when the flag "
                       "is left out, or set explicitly, e.g. 32768 or 32k; it is not fitted to the memory")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF checkpoint directory (default: the embedded model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the --model directory)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="auto | float32 | bfloat16 | float16 (fp32, float, bf16, fp16, half: aliases); auto: the checkpoint's dtype on CUDA, float32 on CPU")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler's counter-based randomness")
    p.add_argument("--numerics", default="invariant", choices=["fast", "invariant"],
                   help="invariant: logprobs match the trainer's (llm.policy()) bit for bit, whatever the batch; "
                        "fast: the plain-speed baseline, batch-dependent bits (docs/numerics.md)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences scheduled in one step")
    p.add_argument("--max-num-batched-tokens", type=_positive_tokens("--max-num-batched-tokens"), default=None,
                   help="most tokens scheduled in one step; 8k = 8000, 8K = 8192 (default: 8192 on CUDA, 2048 "
                        "on CPU)")
    p.add_argument("--max-model-len", type=_positive_tokens("--max-model-len", auto_note=_MAX_MODEL_LEN_NOTE),
                   default=None,
                   help="longest prompt + output in tokens; 32k = 32000, 32K = 32768, 25.6k = 25600 (default: the "
                        "model's max_position_embeddings; upstream's auto / -1 are not taken)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory the engine may use (weights, activations and KV cache)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the cached KV blocks of shared prompt prefixes (--no-enable-prefix-caching "
                        "recomputes them)")
    p.add_argument("--num-state-snapshots", type=int, default=None,
                   help="models with recurrent layers (Gated DeltaNet, Mamba-2): prefix-cache snapshots of their "
                        "states, one per cached prompt, least recently used replaced first (default: max-num-seqs // 4; "
                        "a batch of more distinct prompts than this, resent in the same order, hits none)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts across steps (--no-enable-chunked-prefill prefills each prompt in "
                        "one step)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: requests are admitted in arrival order, and a request's priority must be 0; priority: "
                        "by the request's priority (lower first, ties by arrival), and when KV blocks run out the "
                        "running request with the largest (priority, arrival) is preempted; the tokens are the same")
    p.add_argument("--enforce-eager", action="store_true", help="run decode eagerly, without CUDA graphs")
    p.add_argument("--cuda-graph-batch-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes to capture CUDA graphs at (a step runs the graph of the smallest size "
                        "that holds its batch, a larger batch runs eagerly; default: 1, 2, 4, 8, then multiples of 16 up "
                        "to 256 and of 32 up to 1024, up to --max-num-seqs)")
    p.add_argument("--load-format", default="safetensors", choices=["safetensors", "auto", "dummy"],
                   help="dummy: random weights of the config's shapes (benchmarks; no checkpoint files needed); "
                        "auto (upstream's default): safetensors")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="enqueue step N+1 before waiting for step N's tokens (overlaps host and GPU work; "
                        "default: on for CUDA, off for CPU)")
    p.add_argument("--gemm-cublaslt", action=argparse.BooleanOptionalAction, default=True,
                   help="invariant GEMMs on CUDA: run the M buckets the tuned table assigns to cuBLASLt there, with "
                        "split-K forbidden (same bits as the Triton kernel, checked at start-up; the execution "
                        "contract names cuBLASLt's version); --no-gemm-cublaslt runs them in Triton")
    p.add_argument("--fused-gumbel", action=argparse.BooleanOptionalAction, default=True,
                   help="sampling on CUDA: one fused noise + argmax kernel for batches without top-k/top-p/min-p "
                        "(same bits as the unfused path)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="auto: K/V in the model dtype; fp8: float8_e4m3fn with a float32 scale per token per kv head "
                        "(about half the bytes; the trainer's logprobs use the same round trip, docs/fp8.md)")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: block-scaled FP8 linear layers (activations per token x 128, weights per 128x128; "
                        "FP8 checkpoints load as they are, others are quantized at load; docs/fp8.md)")
    p.add_argument("--keep-master-weights", action=argparse.BooleanOptionalAction, default=True,
                   help="with --quantization fp8: keep the model-dtype master weights next to the fp8 copy (needed "
                        "to train over this engine); --no-keep-master-weights keeps only the fp8 copy, leaving the "
                        "memory to the KV cache (rollout servers; weight sync quantizes what it receives)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks sharing every layer (today all in this process on its one device: TP=C's bits); "
                        "invariant bits do not depend on it (docs/parallelism.md)")
    p.add_argument("--tp-leaves", type=int, default=None,
                   help="K leaves G of the row-parallel GEMMs' fixed float32 tree (power of two, a multiple of "
                        "--tensor-parallel-size; default: none at TP=1, 8 at TP>1); a TP=1 trainer matching a TP>1 "
                        "engine sets the engine's G")
    p.add_argument("--logprobs-mode", default=DEFAULT_LOGPROBS_MODE, choices=LOGPROBS_MODES,
                   help="what logprobs report for requests that do not set logprobs_mode: tempered_logprobs "
                        "(this engine's default): log_softmax(logits / T) over the full vocabulary, what the trainer "
                        "recomputes; raw_logprobs (upstream's default) / raw_logits: the model's, before penalties, "
                        "grammar masks, temperature and truncation; processed_logprobs / processed_logits: after all "
                        "of them, top-k/top-p/min-p included (docs/sampling.md)")
    p.add_argument("--step-profile", action="store_true",
                   help="synchronise at every step phase and accumulate wall time per phase (diagnostics; costs "
                        "throughput)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device, seed=args.seed,
                numerics=args.numerics, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, block_size=args.block_size,
                gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=args.enable_prefix_caching,
                enable_chunked_prefill=args.enable_chunked_prefill, enforce_eager=args.enforce_eager,
                cuda_graph_batch_sizes=getattr(args, "cuda_graph_batch_sizes", None),
                load_format={"auto": "safetensors"}.get(getattr(args, "load_format", "safetensors"),
                                                        getattr(args, "load_format", "safetensors")),
                async_scheduling=getattr(args, "async_scheduling", None), gemm_cublaslt=args.gemm_cublaslt,
                fused_gumbel=args.fused_gumbel, step_profile=args.step_profile,
                kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"), quantization=getattr(args, "quantization", None),
                keep_master_weights=getattr(args, "keep_master_weights", True),
                tensor_parallel_size=getattr(args, "tensor_parallel_size", 1), tp_leaves=getattr(args, "tp_leaves", None),
                num_state_snapshots=getattr(args, "num_state_snapshots", None),
                scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
                enable_sleep_mode=getattr(args, "enable_sleep_mode", False),
                logprobs_mode=getattr(args, "logprobs_mode", DEFAULT_LOGPROBS_MODE))
