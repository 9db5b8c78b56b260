"""Pydantic models of the OpenAI-compatible API: requests in, responses out.

Requests are checked in two layers. Pydantic checks *types* (a non-integer
token id, a string temperature, NaN); SamplingParams checks *values* (a
negative temperature, top_p outside (0, 1]) so the server and the offline API
share one set of rules and one set of messages. Both failures become HTTP 400.

OpenAI and upstream fields this engine does not implement are accepted only at
their no-op default: silently ignoring one (say `bad_words`) would sample from a
different distribution than the caller asked for, which is exactly what an RL
framework must never get without knowing.

Extensions over the OpenAI schema (documented in docs/serving.md):
`token_ids` per choice, `prompt_token_ids` (per choice for completions, top
level for chat), `stop_reason`, `weight_version` / `weight_versions`, and the
vLLM sampling fields top_k, min_p, min_tokens, stop_token_ids, ignore_eos,
include_stop_str_in_output, skip_special_tokens, logprobs_mode,
repetition_penalty, return_token_ids, prompt_logprobs, structured_outputs (upstream
vLLM's), and upstream's scheduling field priority (--scheduling-policy priority).
"""
from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, FiniteFloat, StrictInt, field_validator,
                      model_serializer)

from vllm.entrypoints.chat_template import text_parts
from vllm.inputs import check_cache_salt
from vllm.sampling_params import SamplingParams
from vllm.structured_outputs import StructuredOutputsParams
from vllm.tokenizer import truncate_text_ids, truncation_length

# Seeds reach the sampler as int64: anything wider would crash a whole batch
# inside step(), so it is rejected here, per request.
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

# One request may not ask for more than this many completions (prompts x n):
# each is a scheduler entry, and an absurd n would stall the engine thread.
MAX_CHOICES_PER_REQUEST = 1024

# upstream vLLM request fields that change the prompt or what is sampled and are not
# implemented here, with their no-op values: a request that sets one to anything else is
# refused (400), never silently served without it.
REFUSED_UPSTREAM_FIELDS = {
    "bad_words": (None, []), "allowed_token_ids": (None, []), "logits_processors": (None, []),
    "use_beam_search": (None, False), "length_penalty": (None, 1.0), "prompt_embeds": (None,),
    "guided_whitespace_pattern": (None, ""), "mm_processor_kwargs": (None, {}), "media_io_kwargs": (None, {}),
    "watermarking": (None, False), "logprob_token_ids": (None,), "repetition_detection": (None,),
    "thinking_token_budget": (None, -1),
}


# JSON has no infinities; a -inf logprob (a token masked by top-k/top-p in a
# processed mode) is reported as this value, as upstream vLLM does.
NEG_INF_LOGPROB = -9999.0


def json_logprob(x: float) -> float:
    """A logprob as a JSON-safe float (finite values pass through bit for bit)."""
    if math.isnan(x):
        return NEG_INF_LOGPROB
    return x if math.isfinite(x) else (NEG_INF_LOGPROB if x < 0 else float(x))


def check_max_logprobs(k: Optional[int], max_logprobs: int, name: str = "logprobs") -> None:
    """The server's cap on top-k logprobs per token (--max-logprobs; -1: no cap). k = -1 asks
    for the whole vocabulary, which only --max-logprobs -1 allows."""
    if k == -1 and max_logprobs != -1:
        raise ValueError(f"{name}=-1 asks for every token of the vocabulary: the server allows at most {max_logprobs} "
                         "per token (start it with --max-logprobs -1)")
    if k is not None and 0 <= max_logprobs < k:
        raise ValueError(f"at most {max_logprobs} {name} per token may be requested (server --max-logprobs), got {k}")


def _not_a_string(value: Any) -> Any:
    if isinstance(value, str):
        raise ValueError("must be an integer (a JSON number), not a string")
    return value


# Integer request fields read as upstream's plain `int` reads them (pydantic's lax mode): 3,
# 3.0, "3" and true (1) are integers, 3.5 and "three" are not. Token-id lists stay StrictInt:
# a tokenizer produced them, and reading a float or a boolean there as a token id would serve
# another prompt than the one sent.
LaxInt = int
# upstream refuses strings for these (logprobs, top_logprobs, prompt_logprobs: "must be an
# integer"), numbers as above
NumericInt = Annotated[int, BeforeValidator(_not_a_string)]


def _null_means_default(*fields: str):
    """A validator mapping JSON null in `fields` to their default, as upstream's Optional
    fields take it (`"stream": null` is `"stream": false`)."""
    def to_default(cls, value, info):
        return cls.model_fields[info.field_name].get_default(call_default_factory=True) if value is None else value
    return field_validator(*fields, mode="before")(classmethod(to_default))


class OpenAIBaseModel(BaseModel):
    # Unknown fields are kept (not rejected) so clients that send vendor fields such
    # as `user` or `metadata` still work; the server logs the names it ignored.
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        """Unknown fields (the ones refused by name, REFUSED_UPSTREAM_FIELDS, are not ignored)."""
        return sorted(k for k in (self.model_extra or {}) if k not in REFUSED_UPSTREAM_FIELDS)


class StreamOptions(OpenAIBaseModel):
    # a last chunk with empty choices carrying the request's usage
    include_usage: bool = False
    # upstream's: every chunk also carries its prompt's usage so far (its choice's tokens
    # until then); only together with include_usage, as upstream
    continuous_usage_stats: bool = False

    _nulls = _null_means_default("include_usage", "continuous_usage_stats")


class JsonSchemaFormat(OpenAIBaseModel):
    name: str
    description: Optional[str] = None
    # "schema" shadows a BaseModel attribute: the field is schema_, the JSON key "schema"
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format: "text" (free), "json_object" (any JSON object) or
    "json_schema" (a JSON matching json_schema.schema), enforced by grammar masks."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    def structured_outputs(self) -> Optional[StructuredOutputsParams]:
        if self.type == "text":
            return None
        # Compact JSON (whitespace only inside the separators): whitespace carries nothing,
        # and a grammar that allows any amount of it lets a model emit it until max_tokens.
        # The structured_outputs extension field can ask for any whitespace.
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise ValueError("response_format json_schema needs json_schema.schema")
        # strict or not, the output is constrained to the schema: a grammar mask cannot be
        # "mostly" enforced
        return StructuredOutputsParams(json=self.json_schema.schema_, disable_any_whitespace=True)


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: Optional[str] = None
    n: LaxInt = 1
    # None means "not given": the model's generation_config.json default applies
    # (when the server runs with --generation-config auto), else SamplingParams'.
    temperature: Optional[FiniteFloat] = None
    top_p: Optional[FiniteFloat] = None
    top_k: Optional[LaxInt] = None
    min_p: Optional[FiniteFloat] = None
    seed: Optional[LaxInt] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: bool = False
    min_tokens: LaxInt = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs_mode: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[FiniteFloat] = None
    frequency_penalty: Optional[FiniteFloat] = None
    repetition_penalty: Optional[FiniteFloat] = None
    # None: the token ids are returned (this server's default, for RL); false: left out.
    return_token_ids: Optional[bool] = None
    # upstream's: logprob tokens as "token_id:<id>" instead of their text (TRL's client asks for it)
    return_tokens_as_token_ids: bool = False
    response_format: Optional[ResponseFormat] = None
    # upstream's: {json | regex | choice | grammar | json_object, disable_any_whitespace}
    structured_outputs: Optional[dict[str, Any]] = None
    # upstream's: keep only the last k prompt tokens (-1: the last max_model_len - 1)
    truncate_prompt_tokens: Optional[LaxInt] = None
    # upstream's: the side truncate_prompt_tokens cuts; "right" keeps the first k (None: left)
    truncation_side: Optional[Literal["left", "right"]] = None
    # upstream's: the response's id is "cmpl-<request_id>" / "chatcmpl-<request_id>", as are the
    # engine's ids that /abort_requests takes (a header X-Request-Id wins, as upstream)
    request_id: Optional[str] = None
    # upstream's older spelling of structured_outputs (guided_json / _regex / _choice / _grammar)
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None   # which library enforces it: xgrammar here, whatever is asked
    # upstream's: prefix-cache blocks are shared only among requests of the same salt (none: the
    # unsalted requests'), so one tenant cannot probe another's prompts through cache hits
    cache_salt: Optional[str] = None
    # upstream's: lower is admitted earlier (ties by arrival) on a server run with
    # --scheduling-policy priority; anything but 0 is a 400 under fcfs, as upstream
    priority: LaxInt = 0
    # OpenAI's: {token id: bias}, clamped to [-100, 100] (docs/sampling.md)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None

    # null is the default where upstream's field is Optional (the others refuse null, as upstream)
    _nulls = _null_means_default("n", "stream", "return_tokens_as_token_ids")

    @field_validator("cache_salt")
    @classmethod
    def _valid_cache_salt(cls, salt: Optional[str]) -> Optional[str]:
        return check_cache_salt(salt)   # upstream's rules: non-empty, at most 128 characters, ...

    def with_cache_salt(self, prompt: Union[str, dict]) -> Union[str, dict]:
        """An engine prompt (a string or a prompt dict) carrying the request's cache_salt."""
        if self.cache_salt is None:
            return prompt
        return {**(prompt if isinstance(prompt, dict) else {"prompt": prompt}), "cache_salt": self.cache_salt}

    def _check_unsupported(self) -> None:
        extra = self.model_extra or {}
        refused = [name for name, noop in REFUSED_UPSTREAM_FIELDS.items() if name in extra and not any(
                   extra[name] == v and isinstance(extra[name], bool) == isinstance(v, bool) for v in noop)]
        if refused:
            raise ValueError(f"{', '.join(refused)}: upstream vLLM fields that change the prompt or what is sampled, "
                             "not implemented here (refused rather than ignored)")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1 \
                and self.truncate_prompt_tokens < 1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {self.truncate_prompt_tokens}")
        if self.request_id is not None and not self.request_id:
            raise ValueError("request_id must not be empty")
        if self.seed is not None and not _INT64_MIN <= self.seed <= _INT64_MAX:
            raise ValueError("seed must fit in a signed 64-bit integer")
        if self.top_k is not None and self.top_k > _INT64_MAX:
            raise ValueError("top_k must fit in a signed 64-bit integer (any value >= the vocabulary size disables it)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")

    @property
    def want_token_ids(self) -> bool:
        return self.return_token_ids is not False

    @property
    def usage_at_end(self) -> bool:
        """A stream ends with a usage-only chunk (stream_options.include_usage)."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def usage_on_every_chunk(self) -> bool:
        """Every chunk of a stream carries the usage so far (stream_options.continuous_usage_stats,
        as upstream only together with include_usage: alone it sends no usage)."""
        return self.usage_at_end and self.stream_options.continuous_usage_stats

    def _structured_outputs(self) -> Optional[StructuredOutputsParams]:
        """The output constraint of response_format, structured_outputs or the guided_* fields
        (one of them at most)."""
        guided = {key: getattr(self, "guided_" + key) for key in ("json", "regex", "choice", "grammar")
                  if getattr(self, "guided_" + key) is not None}
        given = [name for name, on in (("response_format", self.response_format is not None
                                        and self.response_format.type != "text"),
                                       ("structured_outputs", self.structured_outputs is not None),
                                       ("guided_*", bool(guided))) if on]
        if len(given) > 1:
            raise ValueError(f"give one of response_format, structured_outputs and guided_*, not {' and '.join(given)}")
        if self.structured_outputs is not None:
            return StructuredOutputsParams.of(self.structured_outputs)
        if guided:
            if len(guided) > 1:
                raise ValueError(f"give one guided_* field, got {sorted('guided_' + k for k in guided)}")
            return StructuredOutputsParams.of(guided)
        return self.response_format.structured_outputs() if self.response_format is not None else None

    def truncate_prompt(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last truncate_prompt_tokens ids, or its first with truncation_side "right"
        (token ids as given; text goes through truncate_text)."""
        k = truncation_length(self.truncate_prompt_tokens, max_model_len)   # upstream's check and message
        if k is None or len(ids) <= k:
            return ids
        return ids[:k] if self.truncation_side == "right" else ids[-k:]

    def truncate_text(self, tokenizer, text: str, ids: list[int], max_model_len: int,
                      add_special_tokens: bool) -> list[int]:
        """`ids` (`text` tokenized with or without the tokenizer's special tokens) cut as upstream
        tokenizes text with truncation: the special tokens stay, the text is cut to fit."""
        k = truncation_length(self.truncate_prompt_tokens, max_model_len)
        if k is None:
            return ids
        return truncate_text_ids(tokenizer, text, ids, k, add_special_tokens, self.truncation_side or "left")

    def _sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int], defaults: dict[str, Any],
                         max_logprobs: int, prompt_logprobs: Optional[int] = None,
                         structured_outputs: Optional[StructuredOutputsParams] = None) -> SamplingParams:
        self._check_unsupported()
        check_max_logprobs(logprobs, max_logprobs)
        check_max_logprobs(prompt_logprobs, max_logprobs, "prompt_logprobs")
        keys = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
        given = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        kw = {**{k: v for k, v in defaults.items() if k in keys}, **given}
        # SamplingParams raises ValueError with a readable message for every bad value.
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, seed=self.seed, stop=self.stop,
            stop_token_ids=list(self.stop_token_ids) if self.stop_token_ids else None,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            logit_bias=self.logit_bias,   # token id strings -> ints, biases clamped to [-100, 100]
            structured_outputs=structured_outputs if structured_outputs is not None else self._structured_outputs(),
            **({"logprobs_mode": self.logprobs_mode} if self.logprobs_mode is not None else {}),
            **kw)


PromptType = Union[str, list[str], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptType
    # absent: OpenAI's default for completions, 16; null: until the context is full, as
    # upstream's completions take it; 0 only with echo (scoring the prompt: the engine samples
    # one token, which the response leaves out)
    max_tokens: Optional[LaxInt] = 16
    logprobs: Optional[NumericInt] = None     # k: the sampled token's logprob plus the top-k alternatives
    # the prompt before the completion in `text`; with logprobs, the prompt tokens' logprobs
    # first (None for the first token)
    echo: bool = False
    best_of: Optional[LaxInt] = None
    suffix: Optional[str] = None
    prompt_logprobs: Optional[NumericInt] = None   # upstream's: per prompt token its logprob and the top-k
    add_special_tokens: bool = True   # upstream's: false for text already holding them (a client-side template)

    _completion_nulls = _null_means_default("echo")

    def prompts(self) -> list[Union[str, dict]]:
        """The prompts as engine inputs: strings stay strings, token ids become dicts."""
        p = self.prompt
        if isinstance(p, str):
            out: list = [p]
        elif len(p) == 0:
            raise ValueError("prompt is empty")
        elif all(isinstance(x, str) for x in p):
            out = list(p)
        elif all(isinstance(x, int) for x in p):
            out = [{"prompt_token_ids": list(p)}]
        else:
            out = [{"prompt_token_ids": list(x)} for x in p]
        if len(out) * max(self.n, 1) > MAX_CHOICES_PER_REQUEST:
            raise ValueError(f"a request may ask for at most {MAX_CHOICES_PER_REQUEST} completions (prompts x n)")
        return out

    @property
    def scores_prompt_only(self) -> bool:
        """max_tokens=0 with echo: the response holds the prompt only."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, defaults: dict[str, Any], max_logprobs: int) -> SamplingParams:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (must be unset or equal to n)")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise ValueError(f"prompt_logprobs must be >= 0 or -1 (every token), got {self.prompt_logprobs}")
        if self.logprobs is not None and self.logprobs < 0:   # upstream's completions take no -1 here
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        max_tokens = self.max_tokens
        if max_tokens == 0:
            if not self.echo:
                raise ValueError("max_tokens=0 is allowed only with echo=true (scoring the prompt)")
            max_tokens = 1
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_logprobs is None:
            # echo's prompt positions report `logprobs` alternatives, unless the request names its
            # own prompt_logprobs (as upstream)
            prompt_logprobs = self.logprobs
        return self._sampling_params(max_tokens, self.logprobs, defaults, max_logprobs, prompt_logprobs)


class ChatContentPart(OpenAIBaseModel):
    type: str
    text: Optional[str] = None
    refusal: Optional[str] = None


class ChatMessage(OpenAIBaseModel):
    # Extra keys (name, tool_calls, tool_call_id, ...) are kept and handed to the
    # chat template, which decides what to do with them.
    role: str
    content: Optional[Union[str, list[ChatContentPart]]] = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message for the chat template; a list content stays a list of text parts, which
        the server's content format (chat_template.apply_content_format) joins or keeps."""
        d = self.model_dump(exclude_none=False)
        if isinstance(self.content, list):
            d["content"] = text_parts([p.model_dump(exclude_none=True) for p in self.content], "content")
        return d


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: Optional[LaxInt] = None       # None: until the context is full (OpenAI's chat default)
    # upstream's replacement of max_tokens: when both are given it wins, as upstream
    max_completion_tokens: Optional[LaxInt] = None
    logprobs: bool = False
    top_logprobs: Optional[NumericInt] = None
    prompt_logprobs: Optional[NumericInt] = None   # upstream's: per prompt token its logprob and the top-k
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # upstream's: a template of the request's own (only where the server trusts them)
    chat_template: Optional[str] = None
    # upstream's: the tokenizer's special tokens around the rendered template (the template
    # writes BOS itself, so false is upstream's default too)
    add_special_tokens: bool = False
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None     # false: tool_choice "required" makes exactly one call
    # upstream's: the response's content opens with the last message's when the response goes
    # on with that message (the same role, see response_role); streamed as the first content
    echo: bool = False
    # upstream's: false leaves the reasoning (--reasoning-parser) out of the response
    include_reasoning: bool = True
    # upstream's: template variables: reasoning_effort (and enable_thinking = effort != "none",
    # unless chat_template_kwargs sets it), documents (for templates that take RAG documents)
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None
    documents: Optional[list[dict[str, Any]]] = None

    _chat_nulls = _null_means_default("logprobs")

    def template_messages(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise ValueError("messages is empty")
        return [m.to_template_dict() for m in self.messages]

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs with the variables the request's own fields set."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.documents is not None:
            kwargs["documents"] = self.documents
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs

    def response_role(self, generation_role: str = "assistant") -> str:
        """The response's role, upstream's rule: the generation prompt opens a turn of
        `generation_role` (the server's --response-role); without it the model goes on with the
        last message, so the response takes its role."""
        return generation_role if self.add_generation_prompt or not self.messages else self.messages[-1].role

    def echoed_text(self, generation_role: str = "assistant") -> str:
        """echo's prefix: the last message's text when its role is the response's, else ""."""
        if not self.echo or not self.messages or self.messages[-1].role != self.response_role(generation_role):
            return ""
        content = self.messages[-1].to_template_dict()["content"] or ""
        return content if isinstance(content, str) else "\n".join(p["text"] for p in content)

    def to_sampling_params(self, defaults: dict[str, Any], max_logprobs: int) -> SamplingParams:
        if self.n > MAX_CHOICES_PER_REQUEST:
            raise ValueError(f"n must be <= {MAX_CHOICES_PER_REQUEST}")
        if self.top_logprobs and not self.logprobs:   # 0 asks for nothing (upstream accepts it)
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.top_logprobs is not None and self.top_logprobs < -1:
            raise ValueError(f"top_logprobs must be >= 0 or -1 (every token), got {self.top_logprobs}")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        plan = self.tool_plan()
        structured = self._structured_outputs()
        tool_grammar = plan.structured_outputs()
        if tool_grammar is not None:
            if structured is not None:
                raise ValueError("tool_choice 'required' or a named function constrains the output itself: "
                                 "it cannot be combined with response_format or structured_outputs")
            structured = tool_grammar
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise ValueError(f"max_completion_tokens must be >= 1, got {self.max_completion_tokens}")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not supported with stream=true")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise ValueError(f"prompt_logprobs must be >= 0 or -1 (every token), got {self.prompt_logprobs}")
        return self._sampling_params(max_tokens, logprobs, defaults, max_logprobs, self.prompt_logprobs, structured)

    def tool_plan(self, parser: str = "hermes"):
        """What tools and tool_choice mean; `parser`: the server's --tool-call-parser."""
        from vllm.entrypoints.openai.tool_calls import plan_tools
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls, parser)


# ---- responses ---------------------------------------------------------------------------

class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int        # prompt tokens whose KV came from the prefix cache


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # --enable-prompt-tokens-details, on a request's final usage when the prefix cache served
    # some of its prompt (upstream's rule); left out of the JSON otherwise
    prompt_tokens_details: Optional[PromptTokenUsageInfo] = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: Optional[int] = None) -> "UsageInfo":
        """`cached_tokens`: the prompt tokens served from the prefix cache, reported when given and
        non-zero (None: the server does not report them)."""
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached_tokens) if cached_tokens else None)

    @model_serializer(mode="wrap")
    def _without_unset_details(self, handler) -> dict[str, Any]:
        d = handler(self)
        if self.prompt_tokens_details is None:
            d.pop("prompt_tokens_details", None)
        return d


class CompletionLogprobs(OpenAIBaseModel):
    """OpenAI's legacy completions logprobs, one entry per generated token."""
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    # upstream's: None for the first prompt token, then {token id: PromptLogprob} holding the
    # prompt token and the top-k alternatives
    prompt_logprobs: Optional[list[Optional[dict[int, PromptLogprob]]]] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None                          # extension
    prompt_token_ids: Optional[list[int]] = None                   # extension
    weight_versions: Optional[list[int]] = None                    # extension


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    weight_version: Optional[int] = None                           # extension


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    weight_version: Optional[int] = None                           # extension


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprobToken(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: Optional[list[ChatLogprobToken]] = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str                   # JSON text


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    # --reasoning-parser: the <think> part (upstream's `reasoning`; `reasoning_content`, its
    # older name, carries the same text for older clients)
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _without_reasoning_when_off(self, handler) -> dict[str, Any]:
        d = handler(self)
        if self.reasoning is None:
            d.pop("reasoning", None)
            d.pop("reasoning_content", None)
        return d


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None                          # extension
    weight_versions: Optional[list[int]] = None                    # extension


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: Optional[list[int]] = None                   # extension
    weight_version: Optional[int] = None                           # extension
    prompt_logprobs: Optional[list[Optional[dict[int, PromptLogprob]]]] = None   # upstream's, as completions'


class DeltaFunctionCall(OpenAIBaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None      # JSON text: appended to what the call's earlier deltas sent

    @model_serializer(mode="plain")
    def _drop_unset(self) -> dict[str, Any]:
        return {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}


class DeltaToolCall(OpenAIBaseModel):
    """One streamed piece of a tool call: its first carries id, type and name, later ones
    more of its arguments (OpenAI's shape; clients join the pieces by index)."""
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: DeltaFunctionCall

    @model_serializer(mode="plain")
    def _drop_unset(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            d["id"] = self.id
        if self.type is not None:
            d["type"] = self.type
        d["function"] = self.function._drop_unset()
        return d


class DeltaMessage(OpenAIBaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None
    reasoning: Optional[str] = None   # --reasoning-parser (sent under both names, as the message's)

    @model_serializer(mode="plain")
    def _drop_unset(self) -> dict[str, Any]:
        # OpenAI deltas carry only what changed: `role` on a choice's first chunk only.
        d: dict[str, Any] = {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}
        if self.reasoning is not None:
            d["reasoning"] = d["reasoning_content"] = self.reasoning
        if self.tool_calls is not None:
            d["tool_calls"] = [t._drop_unset() for t in self.tool_calls]
        return d


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None                          # extension: this chunk's new token ids
    weight_versions: Optional[list[int]] = None                    # extension: on a choice's last chunk


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None
    prompt_token_ids: Optional[list[int]] = None                   # extension: on the first chunk only
    weight_version: Optional[int] = None                           # extension


class ModelPermission(OpenAIBaseModel):
    """upstream's model permission entry (every client reads it as "allowed")."""
    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: Optional[str] = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    """upstream's model card: tools that recognise a vLLM server by `owned_by` read "vllm"."""
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- tokenizer and admin endpoints ----------------------------------------------------------

class TokenizeRequest(OpenAIBaseModel):
    """upstream's two forms in one model: {"prompt"} (its TokenizeCompletionRequest) or
    {"messages"} with the chat fields of its TokenizeChatRequest, rendered as chat completions
    render them."""
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    # None: true for a prompt, false for messages (the template writes its own), as upstream
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    chat_template: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None   # handed to the template, as chat's
    return_token_strs: Optional[bool] = False   # upstream's: each id's token string too

    def check_chat_fields(self) -> None:
        """upstream's multimodal fields are refused unless empty (no processor here), as chat's."""
        extra = self.model_extra or {}
        refused = [k for k in ("mm_processor_kwargs", "media_io_kwargs") if extra.get(k)]
        if refused:
            raise ValueError(f"{', '.join(refused)}: upstream vLLM fields for multimodal processors, not "
                             "implemented here (refused rather than ignored)")


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None   # with return_token_strs


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    tokens: list[StrictInt]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class WeightsUpdateRequest(OpenAIBaseModel):
    path: str
    # where the checkpoint is staged before the pause: "host" or "device" (docs/serving.md)
    staging: str = "host"
    # the trainer's ExecutionContract.to_dict(): refused (400 naming the fields) unless compatible
    contract: Optional[dict[str, Any]] = None


class WeightsVersionResponse(OpenAIBaseModel):
    weight_version: int


# ---- upstream vLLM's RL routes (docs/serving.md, "upstream vLLM's RL API") -------------------

class WeightTransferInitRequest(OpenAIBaseModel):
    """POST /init_weight_transfer_engine: {master_address, master_port, rank_offset, world_size}
    (optional backend "nccl"|"gloo", timeout_s, contract, backup), checked by the engine."""
    init_info: dict[str, Any]


class StartWeightUpdateRequest(OpenAIBaseModel):
    # names are always HF checkpoint names here (the model's own mapping places them)
    is_checkpoint_format: bool = True


class WeightTransferUpdateRequest(OpenAIBaseModel):
    """POST /update_weights: {names, dtype_names, shapes} (optional packed,
    packed_buffer_size_bytes), received over the group while the request is open."""
    update_info: dict[str, Any]


class FinishWeightUpdateRequest(OpenAIBaseModel):
    weight_version: Optional[str] = None      # a label for the new version


class UpdateWeightVersionRequest(OpenAIBaseModel):
    new_version: str


class MessageResponse(OpenAIBaseModel):
    message: str
    weight_version: Optional[int] = None


# ---- TRL's server protocol (trl vllm-serve: routes with trailing slashes) ---------------------

class TrlSamplingFields(OpenAIBaseModel):
    """The sampling fields /generate/ and /chat/ share; `generation_kwargs` are more
    SamplingParams fields and override these."""
    n: StrictInt = 1
    repetition_penalty: FiniteFloat = 1.0
    temperature: FiniteFloat = 1.0
    top_p: FiniteFloat = 1.0
    top_k: StrictInt = -1
    min_p: FiniteFloat = 0.0
    max_tokens: StrictInt = 16
    logprobs: Optional[StrictInt] = 0
    structured_outputs_regex: Optional[str] = None
    guided_decoding_regex: Optional[str] = None          # TRL's earlier name of the same field
    truncate_prompt_tokens: Optional[StrictInt] = None
    generation_kwargs: dict[str, Any] = Field(default_factory=dict)

    def to_sampling_params(self, max_logprobs: int) -> SamplingParams:
        kw: dict[str, Any] = dict(n=self.n, repetition_penalty=self.repetition_penalty, temperature=self.temperature,
                                  top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, max_tokens=self.max_tokens,
                                  logprobs=self.logprobs)
        if self.truncate_prompt_tokens is not None:
            kw["truncate_prompt_tokens"] = self.truncate_prompt_tokens
        kw.update(self.generation_kwargs)
        if self.guided_decoding_regex is not None and self.structured_outputs_regex is not None:
            raise ValueError("give either structured_outputs_regex or guided_decoding_regex (its earlier name)")
        regex = self.structured_outputs_regex if self.structured_outputs_regex is not None \
            else self.guided_decoding_regex
        if regex is not None:
            # TRL's server turns the regex into upstream's StructuredOutputsParams(regex=...)
            if kw.get("structured_outputs") is not None:
                raise ValueError("give either structured_outputs_regex or generation_kwargs.structured_outputs")
            kw["structured_outputs"] = StructuredOutputsParams(regex=regex)
        for name in ("n", "logprobs", "prompt_logprobs"):   # generation_kwargs come unvalidated
            value = kw.get(name)
            if (value is not None or name == "n") and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"generation_kwargs: {name} must be an integer, got {value!r}")
        check_max_logprobs(kw.get("logprobs"), max_logprobs)
        check_max_logprobs(kw.get("prompt_logprobs"), max_logprobs, "prompt_logprobs")
        if not 1 <= kw["n"] <= MAX_CHOICES_PER_REQUEST:
            raise ValueError(f"n must be in 1..{MAX_CHOICES_PER_REQUEST}, got {kw['n']}")
        try:
            return SamplingParams(**kw)
        except TypeError as err:  # an unknown generation_kwargs key
            raise ValueError(f"generation_kwargs: {err}") from None


class TrlGenerateRequest(TrlSamplingFields):
    prompts: Union[list[str], list[list[StrictInt]]]
    images: Optional[list[Optional[list[str]]]] = None


class TrlChatRequest(TrlSamplingFields):
    messages: list[list[ChatMessage]]
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    chat_template: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None


class TrlGenerateResponse(OpenAIBaseModel):
    """Per prompt its ids; per sample (prompt-major, n per prompt) its ids and, per token,
    the logprobs best first with their token ids (the sampled token always among them)."""
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: Optional[list[list[list[Optional[float]]]]] = None
    logprob_token_ids: Optional[list[list[list[int]]]] = None
    weight_version: Optional[int] = None                           # extension


class TrlSequenceLogprobsRequest(OpenAIBaseModel):
    """POST /get_sequence_logprobs/: score whole sequences (prompt + completion) without
    generating; per completion position the top-k logprobs under log_softmax(logits / T)."""
    sequences: list[list[StrictInt]]
    prompt_lengths: list[StrictInt]
    top_logprobs: StrictInt = 100
    temperature: FiniteFloat = 1.0
    response_format: Literal["json", "binary"] = "json"

    def validate_sequences(self, max_logprobs: int) -> None:
        if not self.sequences:
            raise ValueError("sequences is empty")
        if len(self.sequences) != len(self.prompt_lengths):
            raise ValueError(f"got {len(self.sequences)} sequences but {len(self.prompt_lengths)} prompt_lengths")
        for i, (seq, pl) in enumerate(zip(self.sequences, self.prompt_lengths)):
            if not 0 <= pl <= len(seq):
                raise ValueError(f"sequence {i}: prompt_length {pl} is out of range [0, {len(seq)}]")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        check_max_logprobs(self.top_logprobs, max_logprobs, "top_logprobs")
        if len(self.sequences) > MAX_CHOICES_PER_REQUEST:
            raise ValueError(f"a request may score at most {MAX_CHOICES_PER_REQUEST} sequences")


class TrlSequenceLogprobsResponse(OpenAIBaseModel):
    """Per sequence, per completion position: the logprobs best first (the top-k, then the
    sequence's own token when it ranks below them) and their token ids."""
    logprobs: list[list[list[Optional[float]]]]
    logprob_token_ids: list[list[list[int]]]


class TrlSequenceLogprobsBinaryResponse(OpenAIBaseModel):
    """response_format "binary": little-endian float32 / int32 arrays, base64: the top-k
    [batch, max completion length, top_logprobs] padded with -inf / 0, and each position's
    own token [batch, max completion length, 1] (-inf when missing)."""
    logprobs_b64: str
    token_ids_b64: str
    actual_logprobs_b64: str
    actual_token_ids_b64: str
    shape: list[int]
    completion_lengths: list[int]


class TrlInitCommunicatorRequest(OpenAIBaseModel):
    host: str
    port: StrictInt
    world_size: StrictInt
    client_device_uuid: Optional[str] = None
    contract: Optional[dict[str, Any]] = None                      # extension: checked when given


class TrlUpdateNamedParamRequest(OpenAIBaseModel):
    name: str
    dtype: str                                                     # "torch.float32" or "float32"
    shape: list[StrictInt]
