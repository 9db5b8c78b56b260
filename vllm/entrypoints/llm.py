"""The offline API, with upstream vLLM's names: LLM, generate, chat."""
from __future__ import annotations

import dataclasses
import functools
import logging
import numbers
import threading
import warnings
from typing import Any, Callable, Sequence

import torch

from vllm.config import CacheConfig, EngineConfig, KernelConfig, SchedulerConfig, default_model_path
from vllm.core.request import check_priority
from vllm.engine.llm_engine import LLMEngine
from vllm.entrypoints.upstream_executor import upstream_executor
from vllm.inputs import prompt_cache_salt
from vllm.model_loader.build import read_model_config, resolve_numerics
from vllm.outputs import RequestOutput
from vllm.sampling_params import (DEFAULT_LOGPROBS_MODE, DEFAULT_MAX_LOGPROBS, RequestOutputKind, SamplingParams,
                                  check_logprobs_mode, check_max_logprobs)
from vllm.weight_sync.session import WeightUpdate

logger = logging.getLogger(__name__)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _holding_engine_lock(method):
    """Run an `LLM` method holding its engine lock: one thread at a time steps the engine
    or changes it (its weights, its KV cache, its weight-transfer session). Re-entrant, so
    such a method may call another (`chat` calls `generate`)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        _refuse_if_served(self, method.__name__)
        with self._engine_lock:
            return method(self, *args, **kwargs)
    return locked


def _refuse_if_served(llm, name: str) -> None:
    """Once an app serves this LLM (build_app_from_llm), its engine-core loop owns the engine:
    every entry point that would step or change it from another thread refuses."""
    if getattr(llm, "_served_by", None) is not None:
        raise ValueError(f"LLM.{name}: this LLM's engine is driven by the app of {llm._served_by}, whose engine "
                         "loop owns it; send requests (and weight updates) to the app instead")


def _not_supported_here(name: str, hint: str = "this engine runs generative (causal LM) models only"):
    """An LLM method of upstream's that this engine does not run: a ValueError naming it."""
    def method(self, *args, **kwargs):
        raise ValueError(f"LLM.{name} is not supported here: {hint}")
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"upstream's LLM.{name}: not supported here ({hint})."
    return method


class LLM:
    """Offline generation.

    >>> llm = LLM()                                  # the embedded default model
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, dtype: str | torch.dtype = "auto",
                 device: str | None = None, seed: int = 0, max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 enforce_eager: bool = False, gpu_memory_utilization: float = 0.9, block_size: int = 16,
                 num_gpu_blocks_override: int | None = None, numerics: str = "invariant", cuda_graph_batch_sizes: list[int] | None = None,
                 cpu_kv_cache_bytes: int = 512 << 20, long_prefill_token_threshold: int = 0,
                 load_format: str = "safetensors", async_scheduling: bool | None = None, enable_sleep_mode: bool = False,
                 gemm_cublaslt: bool = True, fused_gumbel: bool = True, step_profile: bool = False,
                 kv_cache_dtype: str = "auto", quantization: str | None = None, keep_master_weights: bool = True,
                 tensor_parallel_size: int = 1, tp_leaves: int | None = None, num_state_snapshots: int | None = None,
                 generation_config: str = "auto", scheduling_policy: str = "fcfs",
                 logprobs_mode: str = DEFAULT_LOGPROBS_MODE, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                 model_impl: str = "auto", **upstream_args):
        """upstream vLLM's `LLM` keywords. `generation_config`: "auto" (the checkpoint's
        generation_config.json sets what `generate` samples with when given no SamplingParams:
        `get_default_sampling_params`) or "vllm" (SamplingParams' defaults).
        `scheduling_policy`: "fcfs" (requests are admitted in arrival order) or "priority"
        (by `generate`'s `priority`, lower first, ties by arrival; under KV pressure the running
        request with the largest (priority, arrival) is preempted). `logprobs_mode`:
        what logprobs report for requests whose SamplingParams leave it unset, one of
        vllm.sampling_params.LOGPROBS_MODES (default "tempered_logprobs", the distribution the
        tokens are drawn from before truncation, which the trainer recomputes; upstream's
        default is "raw_logprobs"; docs/sampling.md). `max_logprobs`: the most logprobs /
        prompt_logprobs per token a request may ask for (upstream's default 20; -1: the whole
        vocabulary, which `logprobs=-1` asks for). `model_impl`: "auto" or "vllm" (this
        engine's own model classes; there is no transformers backend). `upstream_args`:
        upstream engine arguments that change nothing here, accepted at the values listed in
        UPSTREAM_NOOP_ARGS (anything else is a ValueError naming it)."""
        refuse_worker_extension(upstream_args.get("worker_extension_cls"))
        _check_upstream_args(upstream_args)
        if model_impl not in ("auto", "vllm"):
            raise ValueError(f"model_impl={model_impl!r}: not supported here. This engine runs its own implementation "
                             "of each architecture (vllm/models, batch-invariant kernels): model_impl='auto' or 'vllm' "
                             "(the same thing here); there is no transformers or other backend")
        # upstream's EngineArgs take None as "the default" for these (TRL passes max_num_seqs=None)
        if max_num_seqs is None:
            max_num_seqs = 256
        if enable_prefix_caching is None:
            enable_prefix_caching = True
        if enable_chunked_prefill is None:
            enable_chunked_prefill = True
        if gpu_memory_utilization is None:
            gpu_memory_utilization = 0.9
        if block_size is None:
            block_size = 16
        check_logprobs_mode(logprobs_mode)   # before the model is read
        if seed is None:    # upstream's "no seed": this engine's requests draw from per-request seeds anyway
            seed = 0
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        seed = int(seed)
        if generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' or 'vllm', got {generation_config!r}")
        if load_format == "auto":  # upstream's default: the checkpoint's safetensors here
            load_format = "safetensors"
        device = device or _default_device()
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")
        mc = read_model_config(model or default_model_path(), max_model_len=max_model_len)
        spec = resolve_numerics(mc, device, dtype=dtype, numerics=numerics,
                                kernels=KernelConfig(gemm_cublaslt=gemm_cublaslt, fused_gumbel=fused_gumbel),
                                kv_cache_dtype=kv_cache_dtype, quantization=quantization,
                                tensor_parallel_size=tensor_parallel_size, tp_leaves=tp_leaves)
        if isinstance(tensor_parallel_size, int) and tensor_parallel_size > 1:
            # upstream splits the weights over C devices; here the C ranks share one (the
            # multi-process executor is not built yet): a model must fit one device
            logger.warning("tensor_parallel_size=%d runs its %d ranks in this process on one device: TP=%d's "
                           "bits, not its memory split (docs/parallelism.md)", tensor_parallel_size,
                           tensor_parallel_size, tensor_parallel_size)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 8192 if device != "cpu" else 2048
        config = EngineConfig(
            model=mc,
            cache=CacheConfig(block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                              num_gpu_blocks=num_gpu_blocks_override, cpu_kv_cache_bytes=cpu_kv_cache_bytes,
                              enable_prefix_caching=enable_prefix_caching, enable_sleep_mode=enable_sleep_mode,
                              num_state_snapshots=num_state_snapshots),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      enable_chunked_prefill=enable_chunked_prefill,
                                      long_prefill_token_threshold=long_prefill_token_threshold,
                                      scheduling_policy=scheduling_policy),
            device=device, numerics_spec=spec, seed=seed, enforce_eager=enforce_eager,
            tokenizer=tokenizer, cuda_graph_batch_sizes=list(cuda_graph_batch_sizes or []), load_format=load_format,
            async_scheduling=async_scheduling, step_profile=step_profile, keep_master_weights=keep_master_weights,
            logprobs_mode=logprobs_mode, max_logprobs=max_logprobs)
        self.llm_engine = LLMEngine(config)
        # held by every method that steps or changes the engine: a sleep() or an update from
        # another thread waits for a running generate, and a generate waits for them
        self._engine_lock = threading.RLock()
        self._warned_fast_policy = False
        self._generation_config = generation_config
        # upstream's llm_engine.model_executor...model.load_weights, as this LLM's update_weights
        self.llm_engine.model_executor = upstream_executor(self.update_weights)

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no SamplingParams: the checkpoint's
        generation_config.json values (temperature, top_p, top_k, min_p, repetition_penalty;
        max_new_tokens as max_tokens) with generation_config="auto", as upstream does."""
        if self._generation_config == "vllm":
            return SamplingParams()
        return SamplingParams(**self.llm_engine.config.model.generation_defaults)

    @property
    def config(self) -> EngineConfig:
        return self.llm_engine.config

    def policy(self, activation_checkpointing: bool = False, logprob_chunk_rows: int | None = None):
        """The colocated training view of this engine's model: same parameter storage,
        so an optimizer step is immediately the engine's new weights. Its attached
        optimizers' steps hold this LLM's engine lock (`Policy.attach_optimizer`).
        `logprob_chunk_rows`: as Policy's (memory only)."""
        from vllm.training import Policy
        _refuse_if_served(self, "policy")
        if not self.config.keep_master_weights:
            raise ValueError("this engine keeps no master weights (keep_master_weights=False): a trainer needs them; "
                             "build the LLM with keep_master_weights=True to train over it")
        if self.config.numerics != "invariant" and not self._warned_fast_policy:
            self._warned_fast_policy = True
            warnings.warn(f"this engine runs numerics={self.config.numerics!r}: the Policy's logprobs will not match "
                          "the rollout's bit for bit; build the LLM with numerics='invariant' (the default) for parity",
                          stacklevel=2)
        executor = self.llm_engine.executor
        return Policy(executor.model, self.config.model, self.config.numerics_spec, executor.info.device,
                      self.llm_engine.tokenizer, engine=self.llm_engine, activation_checkpointing=activation_checkpointing,
                      block_size=self.config.cache.block_size, engine_lock=self._engine_lock,
                      logprob_chunk_rows=logprob_chunk_rows)

    @_holding_engine_lock
    def update_weights(self, weights, contract=None, require_complete: bool = False, check_finite: bool = True) -> int | None:
        """In-place weight sync from a trainer (HF names -> tensors of any float dtype, cast
        as loading casts); one bucket, validated whole before anything is written. A rejected
        update raises ValueError and leaves the old weights serving. Returns the new version.
        `check_finite=False` skips reading every byte for NaN/Inf (a trainer that checked its
        own weights; about a third of a same-GPU update's time).
        See vllm/weight_sync/session.py; `weight_update()` takes the weights in buckets.

        Between `start_weight_update()` and `finish_weight_update()` (upstream vLLM's names)
        it adds to the started update instead and returns None: upstream's request
        {"update_info": {names, dtype_names, shapes}} receives that manifest from the group of
        `init_weight_transfer_engine`; tensors are staged by reference (keep them unchanged
        until finish)."""
        from vllm.weight_sync.transfer import transfer_of
        transfer = transfer_of(self.llm_engine)
        info = _update_info(weights)
        if info is not None:
            transfer.receive(info)
            return None
        if transfer.update is not None:
            if contract is not None or require_complete:
                raise ValueError("contract and require_complete belong to the started update, not to one bucket")
            transfer.load(weights)
            return None
        from vllm.weight_sync import update_weights
        return update_weights(self.llm_engine, weights, contract=contract, require_complete=require_complete,
                              check_finite=check_finite)

    # upstream vLLM's four-phase weight transfer (vllm/weight_sync/transfer.py)
    @_holding_engine_lock
    def init_weight_transfer_engine(self, request) -> dict:
        """Join the trainer's broadcast group: `request` is {"init_info": {master_address,
        master_port, rank_offset, world_size}} (or the init_info itself; optional backend,
        timeout_s, contract). Blocks until the trainer joins, holding the engine lock: another
        thread's generate waits meanwhile."""
        from vllm.weight_sync.transfer import transfer_of
        return transfer_of(self.llm_engine).init(_unwrap(request, "init_info"))

    @_holding_engine_lock
    def start_weight_update(self) -> dict:
        """Open one update; `generate` refuses until `finish_weight_update()`. Each of the four
        phases holds the engine lock for its own call only: the update stays open across
        calls, which may come from different threads (a Ray actor's pool), so the lock cannot
        be held from start to finish the way `weight_update()` holds it for its block."""
        from vllm.weight_sync.transfer import transfer_of
        return transfer_of(self.llm_engine).start()

    @_holding_engine_lock
    def finish_weight_update(self, weight_version: str | None = None) -> int:
        """Close the started update: written, one new version (labelled `weight_version`).
        Returns the version number; a failed update raises ValueError, old weights kept."""
        from vllm.weight_sync.transfer import transfer_of
        return transfer_of(self.llm_engine).finish(weight_version)["weight_version"]

    @_holding_engine_lock
    def update_weight_version(self, new_version: str) -> None:
        """Label the weights serving now (upstream's string versions)."""
        from vllm.weight_sync.transfer import transfer_of
        transfer_of(self.llm_engine).set_label(new_version)

    def get_weight_version(self) -> str:
        """The label of the weights serving now (their version number when unlabelled)."""
        from vllm.weight_sync.transfer import transfer_of
        return transfer_of(self.llm_engine).label()

    @_holding_engine_lock
    def shutdown_weight_transfer_engine(self) -> None:
        """Leave the trainer's group (an update still open is aborted)."""
        from vllm.weight_sync.transfer import transfer_of
        transfer_of(self.llm_engine).close()

    def weight_update(self, contract=None, require_complete: bool = False, backup: str = "auto",
                      check_finite: bool = True):
        """Open a bucketed weight update (a context manager):

        >>> with llm.weight_update(contract=policy.execution_contract()) as u:
        ...     for bucket in buckets:     # dicts / (name, tensor) pairs / FlatBuckets
        ...         u.load(bucket)
        >>> # finished here: one new weight version; an exception aborts (old weights kept)

        Requests pause from here to finish. The update holds the engine lock from this call
        until it finishes or aborts: another thread's `generate`, `sleep` or update waits for
        the whole block (never a step between two buckets), while this thread keeps the lock
        re-entrantly (its `generate` inside the block raises ValueError, it does not wait).
        So the thread that opens the update closes it. See vllm/weight_sync/session.py."""
        _refuse_if_served(self, "weight_update")
        return _LockHoldingWeightUpdate(self._engine_lock, self.llm_engine, contract=contract,
                                        require_complete=require_complete, backup=backup, check_finite=check_finite)

    @_holding_engine_lock
    def update_weights_from_ipc(self, buckets, check_finite: bool = True, contract=None,
                                require_complete: bool = False) -> int:
        """Apply buckets exported by another process on this node (vllm.weight_sync.ipc:
        CUDA IPC handles, or shared memory on CPU) as one update; returns the new version.
        `contract` and `require_complete` as in `update_weights`."""
        from vllm.weight_sync.ipc import apply_ipc_update
        return apply_ipc_update(self.llm_engine, buckets, contract=contract, require_complete=require_complete,
                                check_finite=check_finite)

    @property
    def weight_error(self) -> str | None:
        """Why the last weight update failed (None after a successful one)."""
        return self.llm_engine.weight_error

    def check_graph_pointers(self) -> None:
        """Raise if a parameter or workspace the captured CUDA graphs read has moved."""
        self.llm_engine.executor.verify_graph_pointers()

    @property
    def weight_version(self) -> int:
        return self.llm_engine.weight_version

    def execution_contract(self):
        """The content-hashed description of every choice that can change bits (vllm/contract.py)."""
        return self.llm_engine.execution_contract()

    @_holding_engine_lock
    def sleep(self, level: int = 1) -> int:
        """Release the KV cache's memory while a colocated trainer runs (needs
        `enable_sleep_mode=True`); returns the bytes released. The weights stay: the
        trainer shares them. Captured CUDA graphs remain valid across sleep/wake_up."""
        return self.llm_engine.sleep(level)

    @_holding_engine_lock
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the KV cache's memory back; generation gives the same bits as before sleep."""
        self.llm_engine.wake_up(tags)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    # upstream's other entry points: pooling models, beam search, profiling and metrics objects.
    # This engine generates with causal LMs only: each says so by name rather than being
    # missing (an AttributeError reads like a version mismatch)
    beam_search = _not_supported_here("beam_search", "beam search is not implemented here; sample with n > 1 instead")
    encode = _not_supported_here("encode")
    embed = _not_supported_here("embed")
    score = _not_supported_here("score", "score completions with prompt_logprobs or Policy.token_logprobs")
    classify = _not_supported_here("classify")
    reward = _not_supported_here("reward")
    get_metrics = _not_supported_here("get_metrics", "vllm serve exports them at /metrics")
    start_profile = _not_supported_here("start_profile", "use torch.profiler around generate")
    stop_profile = _not_supported_here("stop_profile", "use torch.profiler around generate")

    @property
    def model_config(self):
        """upstream's `LLM.model_config`: the engine's ModelConfig."""
        return self.llm_engine.model_config

    @_holding_engine_lock
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix, so the next requests recompute their KV (benchmarks,
        or after changing weights by hand). Returns False, changing nothing, while
        requests are running, unless `reset_running_requests` (upstream's keyword): then the
        hashes go anyway and the running requests keep their blocks without registering
        more. `reset_connector`: upstream's KV connector; there is none here."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """upstream's call into every worker: one result per worker, in a list.

        `method`: a callable, called as `method(worker, *args, **kwargs)`, or a name. The
        worker is this engine's ModelRunner (`.model`, `.device`, `.config`), in this process:
        `LLM` runs its engine and its one worker in the caller's thread (a tensor-parallel
        engine's ranks are partitions inside that worker), so the list has one entry and
        nothing is pickled. Names: the worker's `get_model`, `kv_cache_bytes`,
        `verify_graph_pointers`, and upstream's worker names whose state lives in the engine
        here (`reset_prefix_cache`, `sleep`, `wake_up`: run as this LLM's methods, so the
        engine's record stays true; `reload_weights`: nothing to do, sleep keeps the weights);
        any other name is a ValueError. A function that writes
        parameters bypasses weight versions and the prefix-cache drop: change weights with
        `update_weights` / `weight_update` instead.

        Runs holding the engine lock, after any generate or update of another thread;
        `timeout` (seconds) bounds that wait (TimeoutError), not the call, which cannot be
        interrupted once it runs."""
        call = self.llm_engine.rpc_call(method, args, kwargs)
        _refuse_if_served(self, "collective_rpc")
        if not self._engine_lock.acquire(timeout=_lock_wait_s(timeout)):
            raise TimeoutError(f"collective_rpc: the engine stayed busy (another thread's generate or weight "
                               f"update) for {timeout} s")
        try:
            return call()
        finally:
            self._engine_lock.release()

    @_holding_engine_lock
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = True, lora_request=None,
                 priority: Sequence[int] | None = None, tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """upstream's signature. `lora_request`: None only (no adapters here). `priority`: one
        integer per prompt, lower admitted earlier (ties by arrival) on an LLM built with
        scheduling_policy="priority"; under "fcfs" any value but 0 is a ValueError, as upstream.
        Priorities only reorder the work: every token's bits are the same.
        `tokenization_kwargs`: None or empty only (SamplingParams' truncate_prompt_tokens cuts
        a prompt)."""
        _no_lora(lora_request)
        _no_tokenization_kwargs(tokenization_kwargs)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        try:
            prompts = list(prompts)
        except TypeError:
            raise ValueError(f"prompts must be a string, a prompt dict ({{'prompt_token_ids': [...]}}) or a list of "
                             f"them, got {type(prompts).__name__}") from None
        priorities = self._priorities(priority, len(prompts))
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            if isinstance(sampling_params, (dict, str)) or not hasattr(sampling_params, "__iter__"):
                raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                                 f"{type(sampling_params).__name__}" + (" (build SamplingParams(**params))"
                                                                         if isinstance(sampling_params, dict) else ""))
            params = list(sampling_params)
            if any(not isinstance(sp, SamplingParams) for sp in params):
                raise ValueError("sampling_params must be a SamplingParams or a list of them, got a list holding "
                                 f"{sorted({type(sp).__name__ for sp in params if not isinstance(sp, SamplingParams)})}")
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        # validated copies (fields set after construction are checked), before anything is queued
        params = [dataclasses.replace(sp) for sp in params]
        engine = self.llm_engine
        if engine.weight_update is not None:
            raise ValueError("a weight update is open (llm.weight_update() or start_weight_update()): "
                             "finish it before generating")
        pending = engine.get_num_unfinished_requests()
        if pending:
            # generate steps the engine until everything in it finishes, and returns only its
            # own requests: the others' outputs would be lost
            raise ValueError(f"{pending} request(s) added through llm.llm_engine are unfinished: step the engine "
                             "until they finish (llm.llm_engine.step()) or abort them before llm.generate")
        engine.count_unannounced_weight_change()
        # Validate everything before anything is queued: a bad prompt loses nothing.
        for p, sp in zip(prompts, params):
            _check_output_kind(sp)
            check_max_logprobs(sp, self.config.max_logprobs, self.config.model.vocab_size)
            _, ids = engine.tokenize(p, sp)
            engine.validate(ids, sp)
            prompt_cache_salt(p)
        ids = [engine.add_request(None, p, sp, priority=pr) for p, sp, pr in zip(prompts, params, priorities)]
        return self._run(ids, use_tqdm)

    def _priorities(self, priority: Sequence[int] | None, num_prompts: int) -> list[int]:
        """generate's `priority`, one checked integer per prompt (all 0 when None)."""
        if priority is None:
            return [0] * num_prompts
        if hasattr(priority, "tolist"):   # a numpy array or a tensor
            priority = priority.tolist()
        if not isinstance(priority, (list, tuple)):
            raise ValueError(f"priority must be a list of integers, one per prompt, got {type(priority).__name__}")
        if len(priority) != num_prompts:
            raise ValueError(f"got {len(priority)} priorities for {num_prompts} prompts")
        policy = self.config.scheduler.scheduling_policy
        return [check_priority(p, policy) for p in priority]

    def _run(self, ids: list[str], use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            # upstream's: a callable is the progress bar's factory (a tqdm subclass, tqdm.notebook's)
            if callable(use_tqdm):
                make_bar = use_tqdm
            else:
                from tqdm import tqdm as make_bar
            bar = make_bar(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                if engine.paused:
                    raise ValueError("the engine is paused (engine.pause() or an unfinished weight update): "
                                     "resume it before generating")
                for out in engine.step():
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in results:
                    engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[r] for r in ids]

    @_holding_engine_lock
    def chat(self, messages, sampling_params: SamplingParams | None = None,
             use_tqdm: bool | Callable[..., Any] = True, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """`messages`: one conversation (a list of {"role", "content"} dicts) or a list of them,
        rendered as the server's chat completions render them (vllm/entrypoints/chat_template.py).
        `chat_template`: a template (or a file holding one) instead of the tokenizer's.
        `chat_template_content_format` (upstream's): how a content given as a list of text parts
        reaches the template: "string" joins the parts' texts with newlines, "openai" passes the
        list of {"type": "text", "text"} parts (a string content becomes one such part), "auto"
        picks "openai" when the template loops over a message's content, else "string".
        Parameters in upstream's order; `chat_template_kwargs` may also set
        add_generation_prompt / continue_final_message, and win, as upstream merges them.
        `mm_processor_kwargs`: None or empty only (no multimodal inputs here)."""
        from vllm.entrypoints.chat_template import apply_content_format, chat_prompt_ids, load_chat_template

        _no_lora(lora_request)
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: the models served here take no multimodal inputs")
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        tok = self.get_tokenizer()
        template = load_chat_template(chat_template)
        messages = [apply_content_format(conv, chat_template_content_format,
                                         template if template is not None else getattr(tok, "chat_template", None))
                    for conv in messages]
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        prompts = [{"prompt_token_ids": chat_prompt_ids(tok, conv, add_generation_prompt=add_generation_prompt,
                                                         continue_final_message=continue_final_message,
                                                         chat_template=template, template_kwargs=kwargs)}
                   for conv in messages]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


class _LockHoldingWeightUpdate(WeightUpdate):
    """A WeightUpdate that holds `lock` while it is open: taken before it opens, given
    back once it has finished or aborted (however it closes: the block's end, `finish()`,
    `abort()`, or a bucket that fails and aborts it)."""

    def __init__(self, lock, engine, **options):
        lock.acquire()
        try:
            super().__init__(engine, **options)
        except BaseException:
            lock.release()
            raise
        self._held_lock = lock

    def finish(self) -> int:
        try:
            return super().finish()
        finally:
            self._release_once_closed()

    def abort(self, reason: str = "aborted") -> None:
        try:
            super().abort(reason)
        finally:
            self._release_once_closed()

    def _release_once_closed(self) -> None:
        # finish() closes through abort() when it fails: the lock is given back once
        if self.closed and self._held_lock is not None:
            lock, self._held_lock = self._held_lock, None
            lock.release()


# upstream worker methods that RL frameworks call through collective_rpc whose state lives
# in this engine, not in its worker: collective_rpc runs them as the LLM's own methods


def _lock_wait_s(timeout) -> float:
    """collective_rpc's `timeout` as Lock.acquire takes it (-1: as long as it takes)."""
    if timeout is None:
        return -1
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"collective_rpc: timeout must be None or a positive number of seconds, got {timeout!r}")
    return float(timeout)


def refuse_worker_extension(extension) -> None:
    """upstream's worker_extension_cls mixes a class into upstream's Worker; its methods reach
    that Worker's internals (model_runner, device communicators) and write weights behind
    the engine. Here the worker is a ModelRunner and weight writes must pass through the
    engine (versions, cached prefixes, graph pointers), so it is refused, naming the ways in."""
    if extension:
        raise ValueError(f"worker_extension_cls={extension!r}: not supported here (the worker is this engine's "
                         "ModelRunner, not upstream's Worker, and weights written by an extension would skip the "
                         "engine's versions and prefix-cache drop). Call llm.collective_rpc(fn) with a function "
                         "taking the worker; change weights through llm.update_weights, weight_update, "
                         "update_weights_from_ipc or init_weight_transfer_engine")


# upstream vLLM's engine arguments that do not apply to this engine, with the values at
# which they change nothing here (a callable: any value it accepts)
UPSTREAM_NOOP_ARGS = {
    "trust_remote_code": lambda v: isinstance(v, bool),        # architectures are implemented here
    "disable_log_stats": lambda v: isinstance(v, bool),
    "disable_custom_all_reduce": lambda v: isinstance(v, bool),
    "swap_space": lambda v: isinstance(v, (int, float)),       # preemption recomputes, nothing is swapped
    "distributed_executor_backend": lambda v: v in (None, "uni", "mp", "ray", "external_launcher"),
    "tokenizer_mode": lambda v: v in ("auto", "hf"),            # the checkpoint's HF tokenizer
    "model_impl": lambda v: v in ("auto", "vllm"),              # this engine's own implementations
    "revision": lambda v: v in (None, "main"),                 # local checkpoints only
    "tokenizer_revision": lambda v: v is None,
    "pipeline_parallel_size": lambda v: v == 1,
    "data_parallel_size": lambda v: v == 1,
    "enable_lora": lambda v: v is False,
    "cpu_offload_gb": lambda v: v == 0,
    "skip_tokenizer_init": lambda v: v is False,
    "hf_overrides": lambda v: not v,
    "worker_extension_cls": lambda v: not v,
    # text-only causal LMs: no multimodal inputs to preprocess or limit (a prompt with them is refused)
    "disable_mm_preprocessor_cache": lambda v: isinstance(v, bool),
    "limit_mm_per_prompt": lambda v: v is None or isinstance(v, dict),
    "mm_processor_cache_gb": lambda v: isinstance(v, (int, float)),
    # torch.compile and upstream's graph capture: this engine runs its own kernels and captures
    # its CUDA graphs at cuda_graph_batch_sizes; results do not depend on either
    "compilation_config": lambda v: v is None or isinstance(v, (int, dict)),
    "max_seq_len_to_capture": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "cuda_graph_sizes": lambda v: v is None or isinstance(v, (int, list)),
    "disable_cascade_attn": lambda v: isinstance(v, bool),
    "task": lambda v: v in ("auto", "generate"),
    "runner": lambda v: v in ("auto", "generate"),
    "served_model_name": lambda v: v is None or isinstance(v, (str, list)),   # offline: no served name
    "download_dir": lambda v: v is None or isinstance(v, str),                # local checkpoints only
    "max_lora_rank": lambda v: isinstance(v, int),                            # with enable_lora=False
    "max_loras": lambda v: isinstance(v, int),
    "max_cpu_loras": lambda v: v is None or isinstance(v, int),
    "override_generation_config": lambda v: not v,
    # experts over the tensor-parallel group (of one here): every expert on the one rank
    "enable_expert_parallel": lambda v: v is False or v is True,
    "enable_server_load_tracking": lambda v: isinstance(v, bool),       # GET /load is always tracked
    "speculative_config": lambda v: not v,                              # no speculative decoding here
    "disable_frontend_multiprocessing": lambda v: isinstance(v, bool),
    "enable_log_outputs": lambda v: isinstance(v, bool),
    "guided_decoding_backend": lambda v: v in ("auto", "xgrammar"),     # xgrammar enforces every constraint
    "structured_outputs_config": lambda v: v is None or (isinstance(v, dict) and v.get("backend", "auto") in
                                                         ("auto", "xgrammar")),
    "attention_backend": lambda v: v is None,                           # this engine's own attention kernels
    "enable_log_requests": lambda v: isinstance(v, bool),
    "disable_log_requests": lambda v: isinstance(v, bool),
    "calculate_kv_scales": lambda v: v is False,                        # FP8 KV scales: docs/fp8.md
}


def _check_output_kind(params: SamplingParams) -> None:
    """generate returns each request's final output once: what FINAL_ONLY asks for, and what
    CUMULATIVE (the default, everything so far) gives at the end. DELTA (only what is new)
    would be a different answer, so it is refused rather than ignored (upstream's LLM resets
    every request to FINAL_ONLY)."""
    if params.output_kind is RequestOutputKind.DELTA:
        raise ValueError("output_kind=RequestOutputKind.DELTA: LLM.generate returns each request's final output only "
                         "(no stream of deltas offline); use FINAL_ONLY or CUMULATIVE, or stream from the server")


def _no_tokenization_kwargs(kwargs) -> None:
    if kwargs:
        raise ValueError(f"tokenization_kwargs={kwargs!r}: not supported here (prompts are tokenized as the "
                         "checkpoint's tokenizer does; SamplingParams(truncate_prompt_tokens=k) cuts them)")


def _no_lora(lora_request) -> None:
    if lora_request is not None and not (isinstance(lora_request, (list, tuple)) and
                                         all(r is None for r in lora_request)):
        raise ValueError("lora_request: LoRA adapters are not supported here")


def _check_upstream_args(args: dict) -> None:
    unknown = sorted(k for k in args if k not in UPSTREAM_NOOP_ARGS)
    if unknown:
        raise TypeError(f"LLM() got unexpected keyword arguments {unknown}")
    bad = [f"{k}={v!r}" for k, v in args.items() if not UPSTREAM_NOOP_ARGS[k](v)]
    if bad:
        raise ValueError(f"LLM(): {', '.join(bad)}: not supported here (upstream vLLM engine arguments this engine "
                         "takes only at values that change nothing)")


def _unwrap(request, key: str):
    """upstream's request objects or dicts ({key: {...}}), or the inner dict itself."""
    if hasattr(request, key):
        return getattr(request, key)
    if isinstance(request, dict) and key in request:
        return request[key]
    return request


def _update_info(weights):
    """upstream's update request ({"update_info": {...}} or an object with .update_info), else None."""
    if hasattr(weights, "update_info"):
        return weights.update_info
    if isinstance(weights, dict) and set(weights) == {"update_info"}:
        return weights["update_info"]
    return None
