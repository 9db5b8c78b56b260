"""The engine: requests in, RequestOutputs out, one scheduler step at a time.

add_request validates and tokenizes (so bad input fails before it can touch a
batch), the scheduler picks the step, the executor runs it on its workers, and the
output processor detokenizes, applies stop strings and builds RequestOutputs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import numbers
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from vllm.config import EngineConfig
from vllm.core.kv_cache_manager import KVCacheManager
from vllm.core.state_slots import StateSlots
from vllm.core.request import Request, RequestStatus, TokenControls, check_priority
from vllm.core.scheduler import Scheduler
from vllm.engine.core_messages import RequestDelta
from vllm.engine.output_processor import RequestState
from vllm.engine.rpc_names import ENGINE_RPC_METHODS, check_rpc_args, unknown_rpc_message
from vllm.executor import InProcessExecutor
from vllm.inputs import prompt_cache_salt
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.tokenizer import encode_text, load_tokenizer, truncate_text_ids, truncation_length

logger = logging.getLogger(__name__)


def derive_seed(seed: int, index: int) -> int:
    """Seed of the index-th sample of an n>1 request: a fixed function of (seed, index)."""
    if index == 0:
        return seed
    h = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 62) - 1)


@dataclass
class _Group:
    """All n samples of one user request."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    finish: list[str | None]
    # stream=True: step() also returns this group's unfinished outputs (text so far)
    # each step it advances, for servers that stream tokens as they are sampled.
    stream: bool = False
    # Per child, the weight versions its tokens (prompt KV included) were computed
    # under: one entry unless weights changed while it was running (paused update).
    weight_versions: list[list[int]] | None = None
    # Per child, the output tokens already turned into deltas (-1 once its finish was).
    sent: list[int] | None = None
    # Offline: the output side of the request (detokenization, stop strings, logprob
    # entries), the same RequestState a served request has in its API server.
    state: RequestState | None = None


# upstream's prompt-dict keys for what this engine does not run (multimodal inputs, embeddings as
# the prompt, token types): refused when set (empty values mean none, as upstream reads them),
# never ignored
UNSUPPORTED_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "prompt_embeds",
                           "token_type_ids")


def _is_given(value) -> bool:
    """A prompt field set: not None and not an empty dict / list / string (upstream reads those as
    none); a tensor (prompt_embeds) is given whatever its values."""
    if value is None:
        return False
    if isinstance(value, (dict, list, tuple, str)):
        return len(value) > 0
    return True


def tokenize_prompt(tokenizer, prompt) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt as `LLM.generate` and the server take it: a string, or
    a dict with "prompt_token_ids" (its "prompt" kept as the text) or "prompt"."""
    if isinstance(prompt, str):
        return prompt, encode_text(tokenizer, prompt, True)
    if isinstance(prompt, dict):
        given = [k for k in UNSUPPORTED_PROMPT_KEYS if _is_given(prompt.get(k))]
        if given:
            raise ValueError(f"prompt field {given[0]!r} is not supported: the models served here take text "
                             "(or token ids) only")
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if hasattr(ids, "tolist"):  # a numpy array or a tensor of ids
            ids = ids.tolist()
        if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, Iterable):
            raise ValueError(f"prompt_token_ids must be a list of token ids (ints), got {ids!r}")
        ids = list(ids)
        # a bool would pass as token 0 / 1; a float, None or a nested list is no token id
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if bad:
            raise ValueError(f"prompt_token_ids must be a list of integer token ids, got {bad[:5]} in it")
        # numpy / torch integer scalars as Python ints
        return prompt.get("prompt"), [int(t) for t in ids]
    if isinstance(prompt, dict) and "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"a prompt's 'prompt' is text, got {type(prompt['prompt']).__name__}")
        return prompt["prompt"], encode_text(tokenizer, prompt["prompt"], True)
    raise ValueError(f"a prompt is a string or a dict with 'prompt_token_ids' (or 'prompt'), got {type(prompt).__name__}")


def validate_prompt(token_ids: list[int], params: SamplingParams, vocab: int, max_len: int,
                    eos_token_ids=(), full_context_ok: bool = False) -> None:
    """Checks every request gets before it is queued (the engine's and the server's).
    `full_context_ok`: a prompt of exactly max_len tokens is accepted (the engine, as upstream's
    LLM: it samples one token and stops with "length"); the server refuses it, as upstream's."""
    if len(token_ids) == 0:
        raise ValueError("the prompt is empty")
    bad = [t for t in token_ids if not isinstance(t, int) or t < 0 or t >= vocab]
    if bad:
        raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    if len(token_ids) > max_len or (len(token_ids) == max_len and not full_context_ok):
        # upstream's words: clients (LiteLLM's context-window fallbacks, RL gyms ending a rollout)
        # recognise a context overflow by them
        raise ValueError(f"This model's maximum context length is {max_len} tokens. However, your request has "
                         f"{len(token_ids)} input tokens, which leaves no room to generate. Please reduce the length "
                         "of the input messages.")
    if params.stop_token_ids and any(t >= vocab for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids outside the vocabulary [0, {vocab})")
    if params.logprobs is not None and params.logprobs > vocab:
        raise ValueError(f"logprobs={params.logprobs} exceeds the vocabulary size {vocab}")
    if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
        raise ValueError(f"prompt_logprobs={params.prompt_logprobs} exceeds the vocabulary size {vocab}")
    # upstream's checks and messages
    if params.logit_bias:
        bad = [t for t in params.logit_bias if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab}")
    if params.allowed_token_ids:
        bad = [t for t in params.allowed_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"allowed_token_ids contains out-of-vocab token id(s) {bad[:5]}. Vocabulary size: {vocab}")
        # min_tokens bans EOS and the stop token ids until it is reached: with nothing else
        # allowed, every logit is masked and no token can be sampled
        banned = set(eos_token_ids) | set(params.stop_token_ids or ())
        if params.min_tokens > 0 and set(params.allowed_token_ids) <= banned:
            raise ValueError(f"allowed_token_ids {sorted(set(params.allowed_token_ids))[:5]} holds only EOS / stop "
                             f"token ids, which min_tokens={params.min_tokens} bans: no token could be sampled")


def truncate_prompt_ids(token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """SamplingParams.truncate_prompt_tokens applied to a token-id prompt: its last k token ids
    (upstream's rule for TokensPrompt). Text prompts go through tokenize_truncated, which keeps
    the tokenizer's special tokens."""
    k = truncation_length(truncate_prompt_tokens, max_model_len)
    if k is None:
        return token_ids
    return token_ids[-k:] if len(token_ids) > k else token_ids


def tokenize_truncated(tokenizer, prompt, truncate_prompt_tokens: int | None,
                       max_model_len: int) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt (tokenize_prompt) cut to truncate_prompt_tokens as upstream
    cuts it: a text prompt is tokenized with truncation, so the special tokens the tokenizer adds
    (BOS) stay and the text is cut to fit; token ids keep their last k."""
    text, ids = tokenize_prompt(tokenizer, prompt)
    k = truncation_length(truncate_prompt_tokens, max_model_len)
    if k is None or len(ids) <= k:
        return text, ids
    if isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt):
        return text, truncate_text_ids(tokenizer, text, ids, k, True)
    return text, ids[-k:]


def bad_words_token_ids(tokenizer, bad_words: list[str], vocab: int) -> tuple[tuple[int, ...], ...]:
    """The token sequences of `bad_words` as upstream tokenizes them: each word (leading
    spaces stripped) on its own, and with one leading space when that gives another first
    token and as many tokens (a word inside a text, for tokenizers that fold the space into
    the token). A word that tokenizes to nothing, or to ids outside the vocabulary, is a
    ValueError."""
    out: list[tuple[int, ...]] = []
    for word in bad_words:
        bare = tuple(encode_text(tokenizer, word.lstrip(), False, "a bad_words entry"))
        if not bare:
            raise ValueError(f"bad_words entries must tokenize to at least one token, got {word!r}")
        out.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    bad = [t for ids in out for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"The model vocabulary size is {vocab}, but the following tokens were specified as bad: "
                         f"{bad}. All token id values should be integers satisfying: 0 <= token_id < {vocab}.")
    return tuple(dict.fromkeys(out))


def token_controls(params: SamplingParams, tokenizer, vocab: int) -> TokenControls | None:
    """A request's logit_bias, allowed_token_ids and bad_words as its Request carries them
    (None when it sets none of them). ValueError for a bad word that cannot be banned."""
    if not params.has_token_controls:
        return None
    bias = None
    if params.logit_bias:
        bias = (tuple(params.logit_bias), tuple(params.logit_bias.values()))
    allowed = None
    if params.allowed_token_ids:
        bits = np.zeros(((vocab + 31) // 32) * 32, dtype=np.uint8)
        bits[np.asarray(params.allowed_token_ids, dtype=np.int64)] = 1
        # bit j of word i allows token 32 i + j (the grammar masks' format)
        allowed = np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)
    words = bad_words_token_ids(tokenizer, params.bad_words, vocab) if params.bad_words else ()
    check_allowed_not_all_banned(params, words)
    return TokenControls(logit_bias=bias, allowed_bitmask=allowed, bad_words=words)


def check_allowed_not_all_banned(params: SamplingParams, bad_words: tuple[tuple[int, ...], ...]) -> None:
    """Single-token bad words are banned at every step: with every token of allowed_token_ids
    among them no token could be sampled (the whole logits row masked)."""
    if params.allowed_token_ids:
        single = {w[0] for w in bad_words if len(w) == 1}
        if set(params.allowed_token_ids) <= single:
            raise ValueError(f"every token of allowed_token_ids {sorted(set(params.allowed_token_ids))[:5]} is "
                             "banned by bad_words: no token could be sampled")


def check_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """A max_tokens that cannot fit in the context left is an error, as upstream's server
    answers it (400). The offline LLM does not call this: there a request stops at the
    context length with finish_reason "length", as upstream's LLM does."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                         f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in "
                         f"the completion). Please reduce the length of the prompt or of max_tokens.")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer or config.model.path)
        # the workers behind a typed seam (vllm/executor): one in-process worker
        self.executor = InProcessExecutor(config)
        info = self.executor.info
        capacity = (info.num_blocks - 1) * config.cache.block_size   # block 0 is the null block
        if capacity < config.model.max_model_len:
            # a sequence longer than the whole cache could never be scheduled, and would fail
            # every request in flight with it: an asked-for context that does not fit is an
            # error (as upstream's); the model's default context is cut to what the cache holds
            if config.model.max_model_len_given:
                raise ValueError(f"max_model_len={config.model.max_model_len} is more than the KV cache holds "
                                 f"({info.num_blocks - 1} blocks x {config.cache.block_size} = {capacity} tokens): "
                                 "raise gpu_memory_utilization / cpu_kv_cache_bytes, lower max_num_seqs, or ask "
                                 f"for max_model_len <= {capacity}")
            logger.warning("max_model_len %d is more than the KV cache holds (%d blocks x %d = %d tokens): "
                           "serving a context of %d tokens (raise gpu_memory_utilization / cpu_kv_cache_bytes or "
                           "lower max_num_seqs for more)", config.model.max_model_len, info.num_blocks - 1,
                           config.cache.block_size, capacity, capacity)
            config.model.max_model_len = capacity
        state = None
        if info.num_state_slots:
            state = StateSlots(info.num_state_slots, info.num_state_snapshots, info.state_chunk_size)
        self.kv = KVCacheManager(info.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching, state)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self._rng = random.Random(config.seed)
        self._groups: dict[str, _Group] = {}
        self._child_to_group: dict[str, str] = {}
        self._counter = itertools.count()
        # the tokenizer's EOS first (the main one, stop_reason None), then generation_config's /
        # config's other ids, all stopping as upstream (theirs report their id as stop_reason):
        # a fine-tune whose config still names the base model's EOS stops on its tokenizer's too
        tokenizer_eos = self.tokenizer.eos_token_id
        self.eos_token_ids = [tokenizer_eos] if tokenizer_eos is not None else []
        self.eos_token_ids += [t for t in config.model.eos_token_ids if t not in self.eos_token_ids]
        self.step_count = 0
        self.weight_version = 0
        # the parameters' version counters as of the last counted weight version: a write that
        # went around on_weights_updated (an optimizer step without attach_optimizer) shows
        self._parameter_versions = self.parameter_versions()
        self._warned_unannounced = False
        # pause(): step() runs nothing until resume(); requests stay queued with their KV
        # (a weight update in between continues them under the new weights).
        self.paused = False
        # weight sync (vllm/weight_sync/session.py): the open update, the last failure's
        # message, and whether a failed update left parameters it could not restore (then
        # nothing runs until a complete update finishes)
        self.weight_update = None
        self.weight_error: str | None = None
        self.weights_torn = False
        # (group, finished) -> output object; None builds RequestOutputs. The engine core
        # process sets it to emit token-id deltas (its client detokenizes).
        self.output_builder = None
        self._sleeping = False
        self._inflight = None   # async scheduling: (SchedulerOutput, StepHandle) of the step on the GPU
        self._grammars = None   # structured outputs: the GrammarCompiler, made on first use

    # ---- upstream's names --------------------------------------------------------------
    # code written for upstream reads its engine's configuration through these: they are this
    # engine's own config objects (vllm/config.py), with upstream's attribute names where ours
    # have them (docs/architecture.md)
    @property
    def vllm_config(self) -> EngineConfig:
        return self.config

    @property
    def model_config(self):
        return self.config.model

    @property
    def cache_config(self):
        return self.config.cache

    @property
    def scheduler_config(self):
        return self.config.scheduler

    def get_tokenizer(self):
        return self.tokenizer

    def __getattr__(self, name: str):
        # only reached for attributes the engine does not have
        if name in ("model_executor", "engine_core"):
            raise AttributeError(
                f"LLMEngine has no {name!r}: this engine's workers are behind its executor, and weights are not "
                "loaded through the model's load_weights. Change them with llm.update_weights(weights) (HF names "
                "-> tensors; versioned and checked), llm.weight_update() for buckets, update_weights_from_ipc or "
                "init_weight_transfer_engine; llm.collective_rpc(fn) runs a function on the worker "
                "(docs/architecture.md)")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---- input ------------------------------------------------------------------------
    def tokenize(self, prompt, params: SamplingParams | None = None) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; with `params`, cut to its truncate_prompt_tokens."""
        if params is None:
            return tokenize_prompt(self.tokenizer, prompt)
        return tokenize_truncated(self.tokenizer, prompt, params.truncate_prompt_tokens, self.config.model.max_model_len)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(token_ids, params, self.config.model.vocab_size, self.config.model.max_model_len,
                        self.eos_token_ids, full_context_ok=True)
        if params.bad_words:   # a word that cannot be banned is refused before anything is queued
            words = bad_words_token_ids(self.tokenizer, params.bad_words, self.config.model.vocab_size)
            check_allowed_not_all_banned(params, words)

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request=None, tokenization_kwargs: dict | None = None,
                    trace_headers=None, *, stream: bool = False, compiled_grammar=None, priority: int = 0) -> str:
        """Validate and queue one request; `stream=True` makes step() also report its progress.
        `compiled_grammar`: its structured output's grammar, compiled already (the engine core
        compiles off its loop: grammar_compiler()); else it is compiled here. `priority`: lower
        is admitted earlier under scheduling_policy="priority"; any other value than 0 is a
        ValueError under "fcfs" (as upstream). Every sample of the request takes it.
        `arrival_time`, `lora_request`, `tokenization_kwargs`, `trace_headers`: upstream's
        positional arguments; the arrival is stamped here, and the others must be None / empty
        (no adapters, the checkpoint's tokenizer as it is, no tracing)."""
        if lora_request is not None or tokenization_kwargs or trace_headers:
            raise ValueError("add_request: lora_request, tokenization_kwargs and trace_headers are not supported "
                             "here (None / empty only)")
        if arrival_time is not None and (isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float))):
            raise ValueError(f"add_request: arrival_time must be a number of seconds or None, got {arrival_time!r}")
        # a validated copy: fields set on the caller's object after construction are checked
        # here, and later changes to it do not reach a queued request
        params = dataclasses.replace(params) if params is not None else SamplingParams()
        if params.logprobs_mode is None:   # the request leaves it to the engine
            params.logprobs_mode = self.config.logprobs_mode
        vocab = self.config.model.vocab_size
        # -1 (upstream's): every token of the vocabulary
        if params.logprobs == -1:
            params.logprobs = vocab
        if params.prompt_logprobs == -1:
            params.prompt_logprobs = vocab
        if self.weights_torn:
            raise ValueError(f"the engine is not serving: {self.weight_error}")
        if self._sleeping:
            raise ValueError("the engine is asleep (its KV cache is released): call wake_up() first")
        text, ids = self.tokenize(prompt, params)
        validate_prompt(ids, params, vocab, self.config.model.max_model_len, self.eos_token_ids, full_context_ok=True)
        controls = token_controls(params, self.tokenizer, vocab)
        priority = check_priority(priority, self.config.scheduler.scheduling_policy)
        cache_salt = prompt_cache_salt(prompt)
        request_id = request_id if request_id is not None else str(next(self._counter))
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        if request_id in self._groups or any(c in self._child_to_group for c in child_ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        # ValueError before anything is queued
        compiled = compiled_grammar if compiled_grammar is not None else self._compile_grammar(params)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        children, leader = [], None
        for i, rid in enumerate(child_ids):
            req = Request(rid, ids, params, derive_seed(base_seed, i), self.eos_token_ids,
                          self.config.model.max_model_len, leader=leader, parent_id=request_id, index=i,
                          cache_salt=cache_salt, priority=priority, controls=controls)
            if compiled is not None:
                req.grammar = self._grammars.state(compiled)   # one matcher per sample
                after = params.structured_outputs.after_token_ids
                req.grammar_after = tuple(after) if after else None
            leader = leader or req
            children.append(req)
        group = _Group(request_id, text, ids, params, children, [None for _ in children], stream=stream,
                       weight_versions=[[self.weight_version] for _ in children], sent=[0 for _ in children])
        if self.output_builder is None:
            group.state = RequestState(request_id, text, ids, params, self.tokenizer, self._decode_one)
        self._groups[request_id] = group
        for req in children:
            self._child_to_group[req.req_id] = request_id
            self.scheduler.add_request(req)
        return request_id

    def _compile_grammar(self, params: SamplingParams):
        """The compiled grammar of a constrained request (None: unconstrained)."""
        if params.structured_outputs is None:
            return None
        return self.grammar_compiler().compile(params.structured_outputs)

    def grammar_compiler(self):
        """The GrammarCompiler of this engine's tokenizer, made on first use
        (vllm/structured_outputs.py)."""
        if self._grammars is None:
            from vllm.structured_outputs import GrammarCompiler
            self._grammars = GrammarCompiler(self.tokenizer, self.config.model.vocab_size, self.eos_token_ids)
        return self._grammars

    @property
    def requests_running(self) -> bool:
        """Requests are in flight and the engine is not paused: the next step computes KV
        with the weights serving now."""
        return self.has_unfinished_requests() and not self.paused

    def check_weights_can_change(self) -> None:
        """The one check before anything writes weights (a weight update, a colocated
        optimizer's step): ValueError while requests are running, since their KV would mix
        two weight versions. A caller asking at the wrong time is refused like bad input,
        before anything is written."""
        if self.requests_running:
            raise ValueError("weights may not change while requests are running: their KV would mix two weight "
                             "versions; change weights between generate calls, or pause() first")

    def parameter_versions(self) -> int:
        """The sum of the parameters' version counters. Every in-place write autograd can see
        moves it: a for-loop or foreach optimizer step, a weight sync's writes. A fused
        optimizer's step and writes through `.data` do not."""
        return sum(p._version for p in self.executor.model.parameters())

    def record_parameter_versions(self) -> None:
        """The parameters as they are now are the counted weights (after a failed update put
        the old weights back)."""
        self._parameter_versions = self.parameter_versions()

    def count_unannounced_weight_change(self) -> bool:
        """Before a generate call: if the parameters were written since the last counted
        version without anyone saying so (an optimizer step on a colocated Policy without
        attach_optimizer or notify_weights_updated), count it now as on_weights_updated
        would have, so no request reuses prefix KV of the old weights, and warn once.
        Returns whether it did."""
        if self.parameter_versions() == self._parameter_versions:
            return False
        if not self._warned_unannounced:
            self._warned_unannounced = True
            logger.warning("the parameters changed since the last weight version (an optimizer step without "
                           "policy.attach_optimizer(opt) or policy.notify_weights_updated()?): counted now as a "
                           "new version and the prefix cache dropped. Attach the optimizer: a fused optimizer's "
                           "step leaves no trace to notice")
        self.on_weights_updated()
        return True

    def on_weights_updated(self) -> None:
        """The parameters changed in place (colocated trainer step or weight sync):
        count the version and drop cached prefixes computed with the old weights. Changed
        while requests were running (not paused), the bookkeeping is still done (no later
        request may reuse KV of the old weights) and then a RuntimeError says so: unlike
        check_weights_can_change's refusal, the change has already happened."""
        mixed = self.requests_running
        self.weight_version += 1
        self._parameter_versions = self.parameter_versions()
        # FP8 linear layers: quantized once per weight version, here (in place, so captured
        # CUDA graphs multiply the new fp8 weights)
        if getattr(self, "_fp8_linears", None) is None:   # the layers are fixed once the model is built
            from vllm.layers.linear import fp8_linears
            self._fp8_linears = fp8_linears(self.executor.model)
        for layer in self._fp8_linears:
            layer.requantize()
        self.executor.weights_changed()  # the next graph replay first checks the captured pointers
        # Cached prefixes hold KV of the old weights: no later request may reuse them. A paused
        # request keeps its own KV (it continues under the new weights and reports both versions).
        self.kv.reset_prefix_cache(allow_in_use=self.paused or mixed)
        for group in self._groups.values():
            for req, versions in zip(group.children, group.weight_versions):
                if req.status.finished:
                    continue
                if req.num_computed_tokens == 0 and not req.output_token_ids:
                    versions[:] = [self.weight_version]   # nothing computed yet: all of it is new
                elif versions[-1] != self.weight_version:
                    versions.append(self.weight_version)
        if mixed:
            raise RuntimeError("weights were updated while requests were running: their KV mixes two weight "
                               "versions (the new version is counted and the prefix cache dropped); update "
                               "weights between generate calls, or pause() first")

    def pause(self) -> list[RequestOutput]:
        """Stop stepping, keeping every request and its KV; finishes the step still on the GPU
        (async scheduling) and returns its outputs. resume() continues where it stopped."""
        self.paused = True
        return self._finish_inflight()

    def resume(self) -> None:
        if self.weights_torn:
            raise ValueError(f"cannot resume: {self.weight_error}")
        if self.weight_update is not None:
            raise ValueError("cannot resume while a weight update is open: finish or abort it")
        self.paused = False

    def _finish_inflight(self) -> list[RequestOutput]:
        if self._inflight is None:
            return []
        sched, handle = self._inflight
        self._inflight = None
        self.scheduler.advance(sched)
        outs = self._process(*self.scheduler.finalize(sched, self.executor.collect(handle)))
        self.step_count += 1
        return outs

    def stop_child(self, request_id: str, index: int, stop_reason: str) -> None:
        """Finish one sample of a request as stopped (a stop string found by a frontend that
        detokenizes outside the engine); the request ends when all its samples have."""
        group = self._groups.get(request_id)
        if group is None:
            return
        req = group.children[index]
        if not req.status.finished:
            req.stop_reason = stop_reason
            self.scheduler.finish_requests([req.req_id], RequestStatus.FINISHED_STOPPED)
        if group.finish[index] is None:
            group.finish[index] = RequestStatus.FINISHED_STOPPED.value
        if all(f is not None for f in group.finish):
            self.abort_request(request_id)

    def execution_contract(self):
        """This engine's ExecutionContract (vllm/contract.py): its model, numerics, and the
        settings that must not change bits."""
        from vllm.contract import build_contract
        c = self.config
        deployment = {
            "max_num_seqs": c.scheduler.max_num_seqs, "max_num_batched_tokens": c.scheduler.max_num_batched_tokens,
            "enable_chunked_prefill": c.scheduler.enable_chunked_prefill, "block_size": c.cache.block_size,
            "scheduling_policy": c.scheduler.scheduling_policy,
            "gpu_memory_utilization": c.cache.gpu_memory_utilization,
            "enable_prefix_caching": c.cache.enable_prefix_caching, "enforce_eager": c.enforce_eager,
            "enable_sleep_mode": c.cache.enable_sleep_mode,
            "cuda_graph_batch_sizes": c.cuda_graph_batch_sizes, "max_model_len": c.model.max_model_len,
            "seed": c.seed, "fused_gumbel": c.kernels.fused_gumbel, "keep_master_weights": c.keep_master_weights,
            # what a request that leaves logprobs_mode unset reports (a request may name another:
            # only the default can be named here); the trainer's logprobs are "tempered_logprobs"
            "logprobs_mode": c.logprobs_mode,
        }
        return build_contract(self.executor.model, c.numerics_spec, device=c.device, deployment=deployment)

    # ---- sleep mode ---------------------------------------------------------------------
    def sleep(self, level: int = 1) -> int:
        """Release the KV cache's memory. Both of upstream's levels release it and keep the
        weights where they are: a colocated trainer computes with the very same parameters,
        and a caller of level 2 (which upstream uses to discard the weights, e.g. TRL's
        colocate mode) loads new weights after waking, which simply overwrites them here.
        Returns the bytes released. Refused while requests are running."""
        if not self.config.cache.enable_sleep_mode:
            raise ValueError("sleep mode is off: build the engine with enable_sleep_mode=True")
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self.drain()
        if self.has_unfinished_requests():
            raise ValueError("cannot sleep while requests are running")
        if self._sleeping:
            return 0
        # the cached prefixes' KV is about to be lost
        if not self.kv.reset_prefix_cache():
            raise ValueError("cannot sleep while KV blocks are in use")
        freed = self.executor.sleep()
        self._sleeping = True
        logger.info("sleep: released %.2f GiB of KV cache", freed / 2**30)
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the KV cache's memory back. `tags` (upstream's names) may list "kv_cache"
        and "weights"; the weights are never released, so only "kv_cache" does anything."""
        if isinstance(tags, str):   # one tag given bare
            tags = [tags]
        if tags is not None and not isinstance(tags, (list, tuple, set)):
            raise ValueError(f"wake_up tags must be a list of 'kv_cache' / 'weights', got {tags!r}")
        unknown = set(tags or []) - {"kv_cache", "weights"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; choose from ['kv_cache', 'weights']")
        if tags is not None and "kv_cache" not in tags:
            return
        if self._sleeping:
            self.executor.wake_up()
            self._sleeping = False

    def is_sleeping(self) -> bool:
        return self._sleeping

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Drop a request (or several: upstream's v1 engine takes a list of ids) without
        reporting it; unknown ids are ignored."""
        for rid in ([request_id] if isinstance(request_id, str) else list(request_id)):
            group = self._groups.get(rid)
            if group is None:
                continue
            self.scheduler.finish_requests([c.req_id for c in group.children], RequestStatus.FINISHED_ABORTED)
            for c in group.children:
                self._child_to_group.pop(c.req_id, None)
            del self._groups[rid]
        if not self.scheduler.has_unfinished():
            self.drain()  # nothing left to run: do not leave a step in flight

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """upstream's engine method: forget every cached prefix. Returns False, changing
        nothing, while requests are running, unless `reset_running_requests` (upstream's
        keyword): then the hashes go anyway and the running requests keep their blocks without
        registering more. `reset_connector`: upstream's KV connector; there is none here."""
        if not isinstance(reset_running_requests, bool) or not isinstance(reset_connector, bool):
            raise ValueError("reset_prefix_cache: reset_running_requests and reset_connector must be bools")
        return self.kv.reset_prefix_cache(allow_in_use=reset_running_requests)

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """upstream's LLMEngine.collective_rpc: one result per worker (one here). The
        caller's thread owns this engine, so `timeout` has nothing to wait for (LLM's
        collective_rpc bounds its wait for the engine lock with it). See rpc_call."""
        return self.rpc_call(method, args, kwargs)()

    def rpc_call(self, method, args, kwargs) -> Callable[[], list]:
        """collective_rpc's call, checked (bad input refused before anything runs): `method`
        a function called as fn(worker, *args, **kwargs), or a name: the worker's RPC_METHODS,
        or upstream's worker names whose state lives in the engine here (reset_prefix_cache,
        sleep, wake_up: run as this engine's methods, so its record stays true;
        reload_weights: nothing to do, sleep keeps the weights)."""
        args, kwargs = check_rpc_args(args, kwargs)
        if isinstance(method, str):
            if method == "reload_weights":
                # upstream's worker reloads the checkpoint that sleep(level=2) discarded (TRL calls
                # it after wake_up(tags=["weights"]), then loads its own weights on top): sleep
                # keeps the weights here, so there is nothing to reload
                return lambda: [None]
            if method in ENGINE_RPC_METHODS:
                engine_method = getattr(self, method)
                return lambda: [engine_method(*args, **kwargs)]
            # the one check of a name: the executor takes the function it names
            worker_methods = self.executor.rpc_methods
            if method not in worker_methods:
                raise ValueError(unknown_rpc_message(method, worker_methods))
            method = worker_methods[method]
        elif not callable(method):
            raise ValueError(f"collective_rpc: method must be a worker method's name or a callable taking the "
                             f"worker, got {type(method).__name__}")
        return lambda: self.executor.collective_rpc(method, args, kwargs)

    def get_num_unfinished_requests(self) -> int:
        """Requests added and not yet finished (a request with n samples counts once)."""
        return sum(1 for g in self._groups.values() if any(not c.status.finished for c in g.children))

    def abort_requests(self, request_ids: list[str] | None = None) -> list[RequestOutput]:
        """Abort requests (None: every request in the engine) and report each with what it
        generated so far, its unfinished samples with finish_reason "abort" (offline: the
        returned outputs; served: the final deltas, through the output builder)."""
        outs = self.drain()
        ids = list(self._groups) if request_ids is None else [r for r in request_ids if r in self._groups]
        aborted = []
        for rid in ids:
            group = self._groups[rid]
            live = [c for c in group.children if not c.status.finished]
            self.scheduler.finish_requests([c.req_id for c in live], RequestStatus.FINISHED_ABORTED)
            aborted += group.children
        return outs + self._process([], aborted)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- one step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step. Returns the outputs of the requests that finished in it,
        plus (finished=False) the outputs so far of stream=True requests it advanced."""
        if self.paused:
            return []
        if self.config.async_scheduling:
            return self._step_async()
        prof = self.executor.step_timings
        t0 = time.perf_counter() if prof is not None else 0.0
        sched = self.scheduler.schedule()
        if prof is not None:
            prof["schedule"] += time.perf_counter() - t0
        if not sched.requests:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not schedule any request: the KV cache is too small for one request")
            return []
        result = self.executor.execute(sched)
        t1 = time.perf_counter() if prof else 0.0
        updated, finished = self.scheduler.update(sched, result)
        self.step_count += 1
        outs = self._process(updated, finished)
        if prof is not None:
            prof["update+output"] += time.perf_counter() - t1
        return outs

    def _step_async(self) -> list[RequestOutput]:
        """Async scheduling: step N+1 is scheduled, packed and enqueued on the GPU before
        the host waits for step N's tokens, so host work overlaps GPU work. Tokens of N
        enter N+1 as placeholders filled on the device; a request that N's tokens end
        (eos, stop string) has computed one extra token in N+1, which is dropped. The
        tokens, their logprobs and the RNG positions are those of the synchronous loop."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self.scheduler.advance(prev[0])
        sched = self.scheduler.schedule()
        try:
            handle = self.executor.launch(sched, prev[1] if prev is not None else None) if sched.requests else None
        except BaseException:
            # keep the scheduler consistent (no placeholder left behind) before re-raising
            if prev is not None:
                self.scheduler.finalize(prev[0], self.executor.collect(prev[1]))
            raise
        self._inflight = (sched, handle) if handle is not None else None
        if prev is None:
            if handle is None and self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not schedule any request: the KV cache is too small for one request")
            return []
        result = self.executor.collect(prev[1])
        updated, finished = self.scheduler.finalize(prev[0], result)
        self.step_count += 1
        return self._process(updated, finished)

    def drain(self) -> list[RequestOutput]:
        """Async scheduling: finish the step still on the GPU (if any) and process it."""
        outs = []
        while self._inflight is not None and not self.scheduler.has_unfinished():
            sched, handle = self._inflight
            self._inflight = None
            self.scheduler.advance(sched)
            outs += self._process(*self.scheduler.finalize(sched, self.executor.collect(handle)))
        return outs

    def _process(self, updated: list[Request], finished: list[Request]) -> list[RequestOutput]:
        """Turn the step's progress into deltas per sample and, offline, feed them to each
        request's RequestState (detokenization, stop strings, outputs of finished or
        streamed groups); a served engine hands the deltas to its output builder."""
        touched: dict[str, _Group] = {}
        for req in finished + updated:
            gid = self._child_to_group[req.req_id]
            group = self._groups[gid]
            touched[gid] = group
            if req.status.finished and group.finish[req.index] is None:
                group.finish[req.index] = req.status.value
        outs = []
        for gid, group in touched.items():
            if group.state is not None:
                self._apply_deltas(group)
            done = all(f is not None for f in group.finish)
            if self.output_builder is not None:
                self.output_builder(group, done)
            elif done or group.stream:
                outs.append(group.state.output())
            if done:
                del self._groups[gid]
                for c in group.children:
                    self._child_to_group.pop(c.req_id, None)
        return outs

    def deltas(self, group: _Group) -> list[tuple]:
        """What each sample of `group` gained since its last delta, as RequestDelta field
        tuples (vllm/engine/core_messages.py); a finished sample's last delta carries its
        finish reason, and nothing follows it."""
        out = []
        for i, req in enumerate(group.children):
            n = len(req.output_token_ids)
            fin = group.finish[i]
            start = group.sent[i]
            if start < 0 or (n == start and fin is None):
                continue  # its finish was already reported, or nothing new
            lps = req.logprobs[start:n] if group.params.logprobs is not None else None
            first = start == 0   # the sample's first delta: what is sent once
            out.append((group.request_id, i, req.output_token_ids[start:n], lps, fin,
                        req.stop_reason if fin is not None else None, list(group.weight_versions[i]),
                        max(0, req.num_cached_tokens), req.prompt_logprobs if first else None,
                        req.scheduled_time if first else None))
            group.sent[i] = -1 if fin is not None else n
        return out

    def _apply_deltas(self, group: _Group) -> None:
        """Offline: the group's deltas into its RequestState; a stop string it finds ends
        that sample here and now (a served request's ends by StopChild)."""
        for t in self.deltas(group):
            d = RequestDelta._make(t)
            stop = group.state.apply(d)
            if stop is None:
                continue
            req = group.children[d.index]
            if not req.status.finished:
                req.stop_reason = stop
                self.scheduler.finish_requests([req.req_id], RequestStatus.FINISHED_STOPPED)
            group.finish[d.index] = RequestStatus.FINISHED_STOPPED.value
            group.sent[d.index] = -1

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
