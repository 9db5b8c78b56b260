"""The OpenAI routes' work: requests -> SamplingParams -> the AsyncLLM -> responses, plain or
streamed as SSE, with client disconnects aborting their requests (api_server.py wires
the routes; docs/serving.md has the schema)."""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from vllm.tokenizer import TokenBytes, encode_text
from vllm.entrypoints.chat_template import CONTENT_FORMATS, apply_content_format, chat_prompt_ids, load_chat_template
from vllm.entrypoints.openai.async_engine import AsyncLLM, EngineError, RequestStream
from vllm.entrypoints.openai.errors import (ModelNotFoundError, exception_response, exception_response_body,
                                          require_scored_prompts)
from vllm.entrypoints.openai.protocol import (
    ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamResponse, ChatLogprobs,
    ChatLogprobToken, ChatResponseMessage, ChatStreamChoice, CompletionChoice, CompletionLogprobs,
    CompletionRequest, CompletionResponse, CompletionStreamResponse, DeltaFunctionCall,
    DeltaMessage, DeltaToolCall, DetokenizeRequest, DetokenizeResponse, FunctionCall, ModelCard, ModelList, OpenAIBaseModel, PromptLogprob, StreamOptions, TokenizeRequest,
    TokenizeResponse, ToolCall, TopLogprob, UsageInfo, json_logprob,
)
from vllm.entrypoints.openai.reasoning import (THINK_END, ReasoningStream, check_reasoning_parser,
                                               prompt_closes_thinking, prompt_opens_thinking, split_reasoning)
from vllm.entrypoints.openai.tool_calls import StreamPiece, ToolCallStream, ToolPlan, plan_tools
from vllm.entrypoints.openai.tool_parsers import DEFAULT_TOOL_CALL_PARSER, check_tool_call_parser
from vllm.outputs import CompletionOutput, Logprob, RequestOutput
from vllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read by the time a handler runs, so the next ASGI message
    # is http.disconnect: sent when the client goes away (or after the response).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, coro, streams: Sequence[RequestStream]) -> Any:
    """Run a non-streaming handler; cancel it and abort its requests if the client leaves first."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        for s in streams:  # also covers a handler cancelled before it ever ran
            s.abort()
        logger.info("client disconnected: request aborted")
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    return task.result()


class _SSEResponse(StreamingResponse):
    """A server-sent-events response that aborts its engine requests when it ends.

    However the response ends -- completed, client disconnected mid-stream, or
    before the first byte -- the requests are aborted right away (a no-op for
    finished ones) instead of whenever the abandoned generator is collected.
    """

    def __init__(self, content: AsyncIterator[str], streams: Sequence[RequestStream]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams = list(streams)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.abort()
            await self.body_iterator.aclose()


def _json(obj: OpenAIBaseModel) -> Response:
    # pydantic's own serializer: much faster than FastAPI's jsonable_encoder on
    # logprob-heavy responses, and its floats are shortest round-trip (bit-exact).
    return Response(content=obj.model_dump_json(), media_type="application/json")


def _sse(obj: OpenAIBaseModel | dict) -> str:
    data = obj.model_dump_json() if isinstance(obj, OpenAIBaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


_DONE_EVENT = "data: [DONE]\n\n"


async def _merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they arrive, as (request index, output).

    Ends when every stream has ended; raises the first engine error. Leaving early
    cancels the pumps, and a cancelled stream aborts its request in the engine.
    """
    if len(streams) == 1:  # the common case needs no tasks
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()  # no-op once finished
        return
    q: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except Exception as err:  # noqa: BLE001 -- handed to the consumer
            q.put_nowait((i, err))
        q.put_nowait((i, end))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()  # no-op for finished streams


async def _final_outputs(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in _merge(streams):
        if out.finished:
            finals[i] = out
    if any(f is None for f in finals):
        raise EngineError("the request was aborted before it finished")
    return finals  # type: ignore[return-value]


# ---- logprob conversion -------------------------------------------------------------------

def _top_alternatives(entry: dict[int, Logprob], sampled: int, k: int) -> list[tuple[int, Logprob]]:
    """The engine's top-k alternatives of one token, in the sampler's exact order.

    The engine's entry maps the sampled token (with its true rank) and the top-k
    alternatives (rank = position 1..k, best first) to their Logprobs; when the
    sampled token is one of the top k its alternative slot is folded into its own
    entry. Ordering by the stored rank alone would misplace it on ties (ties share
    the sampled token's rank), so its position is recovered as the missing slot.
    k = -1 (upstream's "every token"): all of them, the whole vocabulary.
    """
    if k < 0:
        k = len(entry)
    alts = {lp.rank: (tid, lp) for tid, lp in entry.items() if tid != sampled and lp.rank is not None}
    ordered = [alts[r] for r in sorted(alts)]
    if len(ordered) < k and sampled in entry:  # the sampled token is one of the top k
        gap = next((i for i, r in enumerate(sorted(alts)) if r != i + 1), len(ordered))
        ordered.insert(gap, (sampled, entry[sampled]))
    return ordered[:k]


def _token_text(tid: int, lp: Logprob, as_ids: bool) -> str:
    """A logprob entry's token: its decoded text, or "token_id:<id>" (return_tokens_as_token_ids)."""
    return f"token_id:{tid}" if as_ids else (lp.decoded_token or "")


def _completion_logprobs(token_ids: list[int], lps: list[dict[int, Logprob]], k: int, offset: int,
                         as_ids: bool = False) -> CompletionLogprobs:
    """OpenAI completions logprobs: per token the sampled token's logprob and a
    {token text: logprob} dict of the top-k alternatives plus the sampled token
    (so up to k + 1 entries; tokens that decode to the same text share a key)."""
    out = CompletionLogprobs()
    for tok, entry in zip(token_ids, lps):
        sampled = entry[tok]
        text = sampled.decoded_token or ""
        out.tokens.append(_token_text(tok, sampled, as_ids))
        out.token_logprobs.append(json_logprob(sampled.logprob))
        out.text_offset.append(offset)
        offset += len(text)
        top: dict[str, float] = {}
        for tid, lp in _top_alternatives(entry, tok, k) + [(tok, sampled)]:
            top.setdefault(_token_text(tid, lp, as_ids), json_logprob(lp.logprob))
        out.top_logprobs.append(top)
    return out


def _echo_logprobs(prompt_ids: list[int], prompt_lps: list, k: int, first_token_text: str,
                   as_ids: bool = False) -> CompletionLogprobs:
    """The prompt part of echo's logprobs (OpenAI's legacy shape): the first token has no
    logprob (None entries), every later one its prompt logprob and top-k alternatives."""
    out = _completion_logprobs(prompt_ids[1:], prompt_lps[1:], k, len(first_token_text), as_ids)
    out.tokens.insert(0, f"token_id:{prompt_ids[0]}" if as_ids else first_token_text)
    out.token_logprobs.insert(0, None)
    out.top_logprobs.insert(0, None)
    out.text_offset.insert(0, 0)
    return out


def _prompt_logprobs_json(prompt_lps: list | None) -> list | None:
    """RequestOutput.prompt_logprobs as the response field (JSON-safe logprobs)."""
    if prompt_lps is None:
        return None
    return [None if entry is None else
            {tid: PromptLogprob(logprob=json_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
             for tid, lp in entry.items()}
            for entry in prompt_lps]


def _prompt_logprobs_plain(prompt_lps: list | None) -> list | None:
    """_prompt_logprobs_json as plain JSON values (the streamed chunks are built as dicts)."""
    entries = _prompt_logprobs_json(prompt_lps)
    if entries is None:
        return None
    return [None if e is None else {tid: lp.model_dump() for tid, lp in e.items()} for e in entries]


def _chat_logprobs(token_ids: list[int], lps: list[dict[int, Logprob]], k: int, as_ids: bool = False,
                   token_bytes: TokenBytes | None = None) -> ChatLogprobs:
    """OpenAI chat logprobs: per token its logprob and the k most likely tokens, best first;
    `bytes` each token's own (TokenBytes; None: its decoded text's)."""
    def raw(tid: int, lp: Logprob) -> list[int]:
        return token_bytes(tid, lp.decoded_token) if token_bytes is not None \
            else list((lp.decoded_token or "").encode("utf-8"))
    content = []
    for tok, entry in zip(token_ids, lps):
        sampled = entry[tok]
        top = [TopLogprob(token=_token_text(tid, lp, as_ids), logprob=json_logprob(lp.logprob), bytes=raw(tid, lp))
               for tid, lp in _top_alternatives(entry, tok, k)]
        content.append(ChatLogprobToken(token=_token_text(tok, sampled, as_ids), logprob=json_logprob(sampled.logprob),
                                        bytes=raw(tok, sampled), top_logprobs=top))
    return ChatLogprobs(content=content)


def trl_logprobs(outputs: Sequence[RequestOutput], k: int | None) -> tuple[list | None, list | None]:
    """TRL's logprob arrays [sample][token][j], best first: the k most likely tokens and the
    sampled one (k + 1 at most), with their token ids; (None, None) without logprobs."""
    if k is None:
        return None, None
    values, ids = [], []
    for out in outputs:
        for c in out.outputs:
            if c.logprobs is None:
                return None, None
            seq_v, seq_i = [], []
            for tok, entry in zip(c.token_ids, c.logprobs):
                ranked = _top_alternatives(entry, tok, k)
                if all(tid != tok for tid, _ in ranked):
                    ranked.append((tok, entry[tok]))
                seq_i.append([tid for tid, _ in ranked])
                seq_v.append([None if math.isnan(lp.logprob) else json_logprob(lp.logprob) for _, lp in ranked])
            values.append(seq_v)
            ids.append(seq_i)
    return values, ids


# ---- streaming state ----------------------------------------------------------------------

@dataclass
class _ChoiceCursor:
    """How much of one choice has been sent."""
    text_offset: int = 0
    done: bool = False
    first: bool = True
    completion_tokens: int = 0    # the tokens its chunks have carried (its usage so far)


def _stream_delta(c: CompletionOutput, cur: _ChoiceCursor) -> tuple[str, list[int], list | None] | None:
    """A choice's part of a tail output (AsyncLLM.add_requests(tail=True): what is new since
    the previous output), or None when there is nothing to send.

    An unfinished choice's text leaves out the characters a stop string may be completing
    (RequestState.output_tail holds them back), so the chunks always concatenate to the
    non-streamed text.
    """
    finished = c.finish_reason is not None
    if not c.text and not c.token_ids and not finished:
        return None
    cur.done = finished
    return c.text, list(c.token_ids), c.logprobs


def _request_id(req: CompletionRequest | ChatCompletionRequest, raw: Request) -> str:
    """The id a response and its engine requests are known by: the X-Request-Id header, else
    the request's request_id, else a fresh one (upstream's order)."""
    return raw.headers.get("X-Request-Id") or req.request_id or uuid.uuid4().hex


# ---- the server ---------------------------------------------------------------------------

class OpenAIServing:
    """Request handlers; one instance per app, holding what every handler needs."""

    def __init__(self, async_llm: AsyncLLM, served_model_names: Sequence[str], *, max_logprobs: int = 20,
                 generation_defaults: dict[str, Any] | None = None, model_path: str | None = None,
                 max_model_len: int | None = None, tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER,
                 chat_template: str | None = None, trust_request_chat_template: bool = False,
                 return_tokens_as_token_ids: bool = False, reasoning_parser: str | None = None,
                 enable_prompt_tokens_details: bool = False, enable_force_include_usage: bool = False,
                 response_role: str = "assistant", enable_log_requests: bool = False, max_log_len: int | None = None,
                 chat_template_content_format: str = "auto"):
        if not served_model_names:
            raise ValueError("at least one served model name is needed")
        self.llm = async_llm
        self.names = list(served_model_names)
        self.max_logprobs = max_logprobs
        self.defaults = dict(generation_defaults or {})
        self.model_path = model_path
        self.max_model_len = max_model_len
        tokenizer = getattr(async_llm, "tokenizer", None)
        self.token_bytes = TokenBytes(tokenizer) if tokenizer is not None else None   # chat logprobs' `bytes`
        self.tool_call_parser = check_tool_call_parser(tool_call_parser)   # the format "auto" tool_choice reads
        self.chat_template = load_chat_template(chat_template)   # None: the tokenizer's own
        self.trust_request_chat_template = trust_request_chat_template
        # how a message's list of text parts reaches the template, as LLM.chat takes it (upstream's
        # --chat-template-content-format: "auto" detects a template that loops over the parts)
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, "
                             f"got {chat_template_content_format!r}")
        self.chat_template_content_format = chat_template_content_format
        self.return_tokens_as_token_ids = return_tokens_as_token_ids   # every request's, when set
        self.reasoning_parser = check_reasoning_parser(reasoning_parser)   # None: the text is all content
        # a request's final usage reports the prompt tokens the prefix cache served (upstream's flag)
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        # every stream carries usage, on each chunk and at its end, whatever its stream_options say
        # (upstream's flag)
        self.enable_force_include_usage = enable_force_include_usage
        # the role of a chat response that opens a turn (add_generation_prompt), upstream's flag
        self.response_role = response_role
        # log each request as it is added (its id, prompt, sampling params), the prompt cut to
        # max_log_len characters or ids (None: whole), as upstream's --enable-log-requests
        self.enable_log_requests = enable_log_requests
        self.max_log_len = max_log_len
        # awaited before a request is added (rl.py: commits TRL's per-tensor weight update first)
        self.before_generate = None

    def _model_name(self, requested: str | None) -> str:
        if requested is None or requested == "":
            return self.names[0]
        if requested not in self.names:
            raise ModelNotFoundError(f"The model `{requested}` does not exist; served here: {', '.join(self.names)}")
        return requested

    def _reasoning_parser_for(self, prompt_ids: Sequence[int]) -> str | None:
        """How a request's outputs are split: none behind a prompt that closed the reasoning
        itself (thinking off); `qwen3` behind a prompt that opens <think> itself reads the
        output as starting inside the reasoning, as `deepseek_r1` does."""
        if self.reasoning_parser is None:
            return None
        tail = self.llm.tokenizer.decode(list(prompt_ids[-16:]), skip_special_tokens=False)
        if prompt_closes_thinking(tail):
            return None
        if self.reasoning_parser == "qwen3" and prompt_opens_thinking(tail):
            return "deepseek_r1"
        return self.reasoning_parser

    def _grammar_after_reasoning(self, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        """With a reasoning parser, a grammar constrains only the answer: the output after the
        reasoning's end marker, as upstream applies structured outputs after the reasoning.
        Behind a prompt that closed the reasoning (thinking off) it constrains from the first
        token. (A qwen3 model that never closed its thinking would be unconstrained: Qwen3's
        models close it, an empty <think></think> when told not to think.)"""
        so = params.structured_outputs
        if so is None or so.after_token_ids is not None or self._reasoning_parser_for(prompt_ids) is None:
            return
        so.after_token_ids = list(self.llm.tokenizer.encode(THINK_END, add_special_tokens=False))

    def _accept(self, req: OpenAIBaseModel) -> None:
        """Log the fields the request sets that this server does not know, and apply the
        server-wide response options to it."""
        extra = req.ignored_fields()
        if extra:
            logger.warning("ignoring unknown request fields: %s", ", ".join(extra))
        if self.return_tokens_as_token_ids and hasattr(req, "return_tokens_as_token_ids"):
            req.return_tokens_as_token_ids = True
        if self.enable_force_include_usage and getattr(req, "stream", False):
            req.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)

    def _cached_tokens(self, outputs: Sequence[RequestOutput]) -> int | None:
        """The prompt tokens the prefix cache served, over a request's prompts (each prompt's
        count is its first sample's); None when the server does not report them."""
        return sum(out.num_cached_tokens for out in outputs) if self.enable_prompt_tokens_details else None

    def _log_request(self, request_id: str, prompt, params: SamplingParams) -> None:
        """--enable-log-requests: one line per prompt as it is added."""
        if not self.enable_log_requests:
            return
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if self.max_log_len is not None:
            prompt = prompt[:self.max_log_len]
        logger.info("received request %s: prompt %r, params %r", request_id, prompt, params)

    def tokenizer_info(self) -> dict[str, Any]:
        """GET /tokenizer_info (--enable-tokenizer-info-endpoint): the tokenizer's configuration as
        upstream reports it (its tokenizer_config.json keys, special tokens as their text, file
        paths left out, tokenizer_class) and the chat template requests are rendered with."""
        tok = self.llm.tokenizer
        info = {k: _plain_json(v) for k, v in dict(getattr(tok, "init_kwargs", None) or {}).items()
                if k not in ("vocab_file", "merges_file")}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            if info.get(key) is None:
                info[key] = _plain_json(getattr(tok, key, None))
        info["tokenizer_class"] = type(tok).__name__
        template = self.chat_template or getattr(tok, "chat_template", None)
        if template:
            info["chat_template"] = template
        return info

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=n, root=self.model_path, max_model_len=self.max_model_len) for n in self.names])

    async def _sampling_params(self, req) -> SamplingParams:
        """The request's SamplingParams, built on a worker thread: a schema, regex or grammar is
        parsed there (a large repetition bound takes seconds), never on the event loop every
        other stream runs on."""
        return await asyncio.to_thread(req.to_sampling_params, self.defaults, self.max_logprobs)

    # -- /v1/completions -------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request):
        try:
            self._accept(req)
            model = self._model_name(req.model)
            params = await self._sampling_params(req)
            raw_prompts = req.prompts()
            if any(isinstance(p, str) and not (req.add_special_tokens and req.truncate_prompt_tokens is None)
                   for p in raw_prompts):   # text this route tokenizes itself: off the event loop
                prompts = await self.llm.on_prompt_thread(
                    lambda tok: [req.with_cache_salt(self._completion_prompt(p, req, tok)) for p in raw_prompts])
            else:
                prompts = [req.with_cache_salt(self._completion_prompt(p, req)) for p in raw_prompts]
            if self.before_generate is not None:
                await self.before_generate()
            rid = f"cmpl-{_request_id(req, raw)}"
            for i, p in enumerate(prompts):
                self._log_request(f"{rid}-{i}", p, params)
            streams = await self.llm.add_requests(
                [(f"{rid}-{i}", p, params) for i, p in enumerate(prompts)], stream=req.stream, priority=req.priority,
                default_max_tokens=self.defaults.get("max_tokens"), tail=req.stream)
        except Exception as err:  # noqa: BLE001 -- mapped to 400/429/500/503
            return exception_response(err)
        created = int(time.time())
        if req.stream:
            return _SSEResponse(self._completion_events(streams, params, rid, model, created, req), streams)
        return await _unless_disconnected(raw, self._completion_full(streams, params, rid, model, created, req), streams)

    async def _completion_full(self, streams, params: SamplingParams, rid: str, model: str, created: int,
                               req: CompletionRequest):
        try:
            finals = await _final_outputs(streams)
            require_scored_prompts(finals, asked=params.prompt_logprobs is not None)
        except Exception as err:  # noqa: BLE001
            return exception_response(err)
        ids = req.want_token_ids
        k, as_ids = params.logprobs or 0, req.return_tokens_as_token_ids
        prompt_only = req.scores_prompt_only   # max_tokens=0 + echo: the sampled token is left out
        choices, n_prompt, n_gen, version = [], 0, 0, 0
        for i, out in enumerate(finals):
            n_prompt += len(out.prompt_token_ids)
            prompt_text = self._echo_text(out) if req.echo else ""
            prompt_lps = _prompt_logprobs_json(out.prompt_logprobs) if req.prompt_logprobs is not None else None
            for c in out.outputs:
                token_ids, lps, text = (([], [] if c.logprobs is not None else None, "") if prompt_only
                                        else (c.token_ids, c.logprobs, c.text))
                n_gen += len(token_ids)
                version = max([version, *c.weight_versions])
                logprobs = None
                if lps is not None:
                    if req.echo:
                        logprobs, prompt_end = self._echo_logprobs(out, k, as_ids)
                        gen = _completion_logprobs(token_ids, lps, k, prompt_end, as_ids)
                        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                            getattr(logprobs, name).extend(getattr(gen, name))
                    else:
                        logprobs = _completion_logprobs(token_ids, lps, k, 0, as_ids)
                choices.append(CompletionChoice(
                    index=i * params.n + c.index, text=prompt_text + text, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason, logprobs=logprobs, prompt_logprobs=prompt_lps,
                    token_ids=list(token_ids) if ids else None, prompt_token_ids=list(out.prompt_token_ids) if ids else None,
                    weight_versions=c.weight_versions))
        return _json(CompletionResponse(id=rid, created=created, model=model, choices=choices, weight_version=version,
                                        usage=UsageInfo.of(n_prompt, n_gen, self._cached_tokens(finals))))

    def _completion_prompt(self, prompt, req: CompletionRequest, tokenizer=None):
        """A prompt as the engine takes it, after add_special_tokens and truncate_prompt_tokens:
        text the engine tokenizes itself (with special tokens) where neither applies, else token
        ids (with the text kept for echo when nothing was cut). `tokenizer`: the prompt
        thread's, where text is tokenized here."""
        if isinstance(prompt, str):
            if req.add_special_tokens and req.truncate_prompt_tokens is None:
                return prompt
            tok = tokenizer if tokenizer is not None else self.llm.tokenizer
            ids = list(encode_text(tok, prompt, req.add_special_tokens))
            cut = req.truncate_text(tok, prompt, ids, self.llm.max_model_len, req.add_special_tokens)
            return {"prompt_token_ids": cut, **({"prompt": prompt} if len(cut) == len(ids) else {})}
        return {"prompt_token_ids": req.truncate_prompt(prompt["prompt_token_ids"], self.llm.max_model_len)}

    def _echo_text(self, out: RequestOutput) -> str:
        """echo's prompt text: the prompt as given, or its decoded token ids."""
        return out.prompt if out.prompt is not None else self.llm.tokenizer.decode(out.prompt_token_ids)

    def _echo_logprobs(self, out: RequestOutput, k: int, as_ids: bool) -> tuple[CompletionLogprobs, int]:
        """echo's prompt logprobs and where the generated tokens' text_offset continues: the
        running total of the prompt tokens' texts (upstream's rule for the whole list; a prompt
        token that is part of a character counts its U+FFFD, so this need not be the length
        of the prompt's text)."""
        first = self.llm.tokenizer.decode(out.prompt_token_ids[:1])
        lp = _echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, k, first, as_ids)
        end = len(first) + sum(len(e[t].decoded_token or "")
                               for t, e in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]))
        return lp, end

    async def _completion_events(self, streams, params: SamplingParams, rid: str, model: str, created: int,
                                 req: CompletionRequest) -> AsyncIterator[str]:
        cursors: dict[tuple[int, int], _ChoiceCursor] = {}
        n_prompt: dict[int, int] = {}
        latest: dict[int, RequestOutput] = {}   # each prompt's last output (its cached tokens)
        n_gen = 0
        want_ids = req.want_token_ids
        k, as_ids, prompt_only = params.logprobs or 0, req.return_tokens_as_token_ids, req.scores_prompt_only
        usage_per_chunk = req.usage_on_every_chunk
        # The chunk envelope is the same for every event: built once, choices spliced in.
        head = json.dumps({"id": rid, "object": "text_completion", "created": created, "model": model})[:-1]
        try:
            async for i, out in _merge(streams):
                n_prompt[i] = len(out.prompt_token_ids)
                latest[i] = out
                # max_tokens=0 + echo sends its prompt in a chunk of its own, before the finish;
                # each choice is kept with its completion tokens so far (its usage)
                prompt_chunks: list[tuple[dict, int]] = []
                choices: list[tuple[dict, int]] = []
                version = None
                for c in out.outputs:
                    cur = cursors.setdefault((i, c.index), _ChoiceCursor())
                    if cur.done:
                        continue
                    delta = _stream_delta(c, cur)
                    if delta is None:
                        continue
                    text, ids, lps = delta
                    if prompt_only:   # the sampled token is left out, as in the non-streamed response
                        text, ids, lps = "", [], ([] if lps is not None else None)
                    n_gen += len(ids)
                    cur.completion_tokens += len(ids)
                    choice = {"index": i * params.n + c.index, "text": text, "logprobs": None,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    echo_lp = None
                    if cur.first:
                        # a choice's first chunk carries the prompt side: echo's text and logprobs,
                        # prompt_logprobs, prompt_token_ids
                        if params.prompt_logprobs is not None:
                            require_scored_prompts([out])
                        prompt = self._echo_text(out) if req.echo else ""
                        cur.text_offset = 0
                        if req.echo and lps is not None:
                            # the generated tokens' offsets follow the prompt tokens'
                            echo_lp, cur.text_offset = self._echo_logprobs(out, k, as_ids)
                        first = {**choice, "finish_reason": None, "stop_reason": None} if prompt_only else choice
                        first["text"] = prompt + text
                        if req.prompt_logprobs is not None:
                            first["prompt_logprobs"] = _prompt_logprobs_plain(out.prompt_logprobs)
                        if want_ids:
                            first["token_ids"] = []
                            first["prompt_token_ids"] = out.prompt_token_ids
                        if prompt_only:
                            first["logprobs"] = echo_lp.model_dump() if echo_lp is not None else None
                            prompt_chunks.append((first, 0))
                            echo_lp = None
                    if lps is not None:
                        lp = _completion_logprobs(ids, lps, k, cur.text_offset, as_ids)
                        cur.text_offset += sum(len(e[t].decoded_token or "") for t, e in zip(ids, lps))
                        if echo_lp is not None:
                            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                                getattr(echo_lp, name).extend(getattr(lp, name))
                            lp = echo_lp
                        choice["logprobs"] = lp.model_dump()
                    if want_ids:
                        choice["token_ids"] = ids
                    if c.finish_reason is not None:
                        choice["weight_versions"] = c.weight_versions
                    cur.first = False
                    version = c.weight_versions[-1] if c.weight_versions else version
                    if not prompt_only or c.finish_reason is not None:
                        choices.append((choice, cur.completion_tokens))
                tail = f', "weight_version": {json.dumps(version)}}}\n\n'
                # one choice per chunk, as upstream streams completions: clients that read
                # choices[0] (LangChain's, LiteLLM's) would lose the others; upstream's continuous
                # usage is per choice too (its prompt, its tokens so far)
                for group in (prompt_chunks, choices):
                    for choice, sent in group:
                        if usage_per_chunk:
                            usage = UsageInfo.of(n_prompt[i], sent).model_dump_json()
                            yield f'data: {head}, "choices": [{json.dumps(choice)}], "usage": {usage}{tail}'
                        elif req.usage_at_end:   # the spec's null usage on every chunk but the last
                            yield f'data: {head}, "choices": [{json.dumps(choice)}], "usage": null{tail}'
                        else:
                            yield f'data: {head}, "choices": [{json.dumps(choice)}]{tail}'
            if req.usage_at_end:
                yield _sse(CompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                    usage=UsageInfo.of(sum(n_prompt.values()), n_gen,
                                                                       self._cached_tokens(list(latest.values())))))
        except Exception as err:  # noqa: BLE001 -- the 200 is already sent: report in-band
            yield _sse(exception_response_body(err))
        yield _DONE_EVENT

    # -- /v1/chat/completions --------------------------------------------------------------
    def chat_prompt_ids(self, messages: list[dict], template_kwargs: dict | None = None,
                        request_template: str | None = None, *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, tools=None,
                        add_special_tokens: bool = False, tokenizer=None) -> list[int]:
        """A conversation's prompt ids under the server's template (--chat-template, else the
        tokenizer's), or the request's own `chat_template` where the server trusts those.
        `tokenizer`: the prompt thread's (AsyncLLM.on_prompt_thread), else the server's."""
        tok = tokenizer if tokenizer is not None else self.llm.tokenizer
        template = self.chat_template
        kwargs = dict(template_kwargs or {})
        if kwargs.get("chat_template") is not None:   # a template of the request's own, however sent
            request_template = kwargs["chat_template"]
        kwargs.pop("chat_template", None)
        if request_template is not None:
            if not self.trust_request_chat_template:
                raise ValueError("chat_template in a request is refused unless the server runs with "
                                 "--trust-request-chat-template (--chat-template sets one for every request)")
            template = request_template
        if tools:
            kwargs["tools"] = tools
        messages = apply_content_format(messages, self.chat_template_content_format,
                                        template if template is not None else getattr(tok, "chat_template", None))
        return chat_prompt_ids(tok, messages, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, chat_template=template,
                               template_kwargs=kwargs, add_special_tokens=add_special_tokens)

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        try:
            self._accept(req)
            model = self._model_name(req.model)
            params = await self._sampling_params(req)
            messages = req.template_messages()
            # rendered and tokenized off the event loop: a long conversation would stall every stream
            prompt_ids = await self.llm.on_prompt_thread(lambda tok: req.truncate_prompt(self.chat_prompt_ids(
                messages, req.template_kwargs(), req.chat_template, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, tools=req.tools,
                add_special_tokens=req.add_special_tokens, tokenizer=tok), self.llm.max_model_len))
            if params.max_tokens is None and self.defaults.get("max_tokens"):
                # the checkpoint's max_new_tokens caps a request that leaves max_tokens unset, within
                # the context left (as upstream's get_max_tokens: never a reason for a 400)
                room = self.llm.max_model_len - len(prompt_ids)
                if room >= 1:
                    params.max_tokens = min(int(self.defaults["max_tokens"]), room)
            self._grammar_after_reasoning(params, prompt_ids)
            if self.before_generate is not None:
                await self.before_generate()
            rid = f"chatcmpl-{_request_id(req, raw)}"
            self._log_request(rid, prompt_ids, params)
            streams = await self.llm.add_requests([(rid, req.with_cache_salt({"prompt_token_ids": prompt_ids}), params)],
                                                  stream=req.stream, priority=req.priority, tail=req.stream)
        except Exception as err:  # noqa: BLE001
            return exception_response(err)
        created = int(time.time())
        if req.stream:
            return _SSEResponse(self._chat_events(streams[0], params, rid, model, created, req, prompt_ids), streams)
        return await _unless_disconnected(raw, self._chat_full(streams[0], params, rid, model, created, req), streams)

    async def _chat_full(self, stream, params: SamplingParams, rid: str, model: str, created: int, req: ChatCompletionRequest):
        try:
            (out,) = await _final_outputs([stream])
            require_scored_prompts([out], asked=params.prompt_logprobs is not None)
        except Exception as err:  # noqa: BLE001
            return exception_response(err)
        top_k = params.logprobs or 0
        ids = req.want_token_ids
        plan = req.tool_plan(self.tool_call_parser)
        thinking = self._reasoning_parser_for(out.prompt_token_ids)
        role, echoed = req.response_role(self.response_role), req.echoed_text(self.response_role)
        # nemotron_v3's swap reads the request's chat_template_kwargs, as upstream's parser does
        template_kwargs = req.chat_template_kwargs
        choices = [ChatChoice(index=c.index,
                              message=_chat_message(c, plan, thinking, role, echoed, req.include_reasoning,
                                                    template_kwargs),
                              finish_reason=_chat_finish(c, plan, thinking, template_kwargs),
                              stop_reason=c.stop_reason, token_ids=list(c.token_ids) if ids else None,
                              weight_versions=c.weight_versions,
                              logprobs=_chat_logprobs(c.token_ids, c.logprobs, top_k, req.return_tokens_as_token_ids,
                                                      self.token_bytes)
                              if req.logprobs and c.logprobs is not None else None)
                   for c in out.outputs]
        n_prompt, n_gen = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
        version = max(v for c in out.outputs for v in (c.weight_versions or [0]))
        return _json(ChatCompletionResponse(id=rid, created=created, model=model, choices=choices, weight_version=version,
                                            usage=UsageInfo.of(n_prompt, n_gen, self._cached_tokens([out])),
                                            prompt_token_ids=list(out.prompt_token_ids) if ids else None,
                                            prompt_logprobs=_prompt_logprobs_json(out.prompt_logprobs)
                                            if req.prompt_logprobs is not None else None))

    async def _chat_events(self, stream, params: SamplingParams, rid: str, model: str, created: int,
                           req: ChatCompletionRequest, prompt_ids: list[int]) -> AsyncIterator[str]:
        top_k = params.logprobs or 0
        cursors = [_ChoiceCursor() for _ in range(params.n)]
        plan = req.tool_plan(self.tool_call_parser)
        parsers = [ToolCallStream(plan) if plan.parses else None for _ in range(params.n)]
        parser_name = self._reasoning_parser_for(prompt_ids)
        thinking = [ReasoningStream(parser_name, req.chat_template_kwargs) if parser_name else None
                    for _ in range(params.n)]
        n_gen = 0
        want_ids = req.want_token_ids
        n_prompt = len(prompt_ids)

        def usage_so_far(cur: _ChoiceCursor | None) -> UsageInfo | None:
            """A chunk's usage with continuous_usage_stats: its choice's tokens so far."""
            if not req.usage_on_every_chunk:
                return None
            return UsageInfo.of(n_prompt, cur.completion_tokens if cur is not None else 0)

        # OpenAI opens every choice with a role-only delta, a chunk per choice as upstream sends
        # them; the prompt ids ride on the first chunk.
        role = req.response_role(self.response_role)
        for j in range(params.n):
            yield _sse(ChatCompletionStreamResponse(
                id=rid, created=created, model=model,
                prompt_token_ids=list(prompt_ids) if want_ids and j == 0 else None,
                weight_version=self.llm.weight_version, usage=usage_so_far(None),
                choices=[ChatStreamChoice(index=j, delta=DeltaMessage(role=role, content=""),
                                          token_ids=[] if want_ids else None)]))
        echoed = req.echoed_text(self.response_role)
        if echoed:   # echo: the continued message's text before anything generated
            for j in range(params.n):
                yield _sse(ChatCompletionStreamResponse(
                    id=rid, created=created, model=model, weight_version=self.llm.weight_version,
                    usage=usage_so_far(None),
                    choices=[ChatStreamChoice(index=j, delta=DeltaMessage(content=echoed),
                                              token_ids=[] if want_ids else None)]))
        latest: list[RequestOutput] = []   # the request's latest output (its cached tokens)
        try:
            async for _, out in _merge([stream]):
                latest[:] = [out]
                for c in out.outputs:
                    cur = cursors[c.index]
                    if cur.done:
                        continue
                    delta = _stream_delta(c, cur)
                    if delta is None:
                        continue
                    text, ids, lps = delta
                    n_gen += len(ids)
                    cur.completion_tokens += len(ids)
                    usage = usage_so_far(cur)
                    logprobs = _chat_logprobs(ids, lps, top_k, req.return_tokens_as_token_ids, self.token_bytes) \
                        if req.logprobs and lps is not None else None
                    version = c.weight_versions[-1] if c.weight_versions else None
                    parser, finish = parsers[c.index], c.finish_reason
                    pieces = [("content", text)] if thinking[c.index] is None else \
                        thinking[c.index].feed(text, finish is not None)
                    deltas = [DeltaMessage(reasoning=t) for kind, t in pieces
                              if kind == "reasoning" and req.include_reasoning]
                    content = "".join(t for kind, t in pieces if kind == "content")
                    if parser is None:
                        if content or thinking[c.index] is None:
                            deltas.append(DeltaMessage(content=content))
                    elif content or thinking[c.index] is None or plan.mode != "named":
                        # a named call starts with the content: while a reasoning parser has
                        # passed none, there is no call yet (none at all if no content comes, as
                        # the whole message has none)
                        deltas += [_delta_message(p) for p in parser.feed(content, finish is not None)]
                        if finish == "stop" and plan.mode in ("auto", "required") and parser.has_calls():
                            finish = "tool_calls"
                    if not deltas and finish is None and logprobs is None and not want_ids and usage is None:
                        continue   # the parsers hold the step's text back and nothing else rides: no chunk
                    deltas = deltas or [DeltaMessage()]
                    # one piece per chunk; the step's tokens, logprobs and finish ride on the last
                    for d in deltas[:-1]:
                        yield _sse(ChatCompletionStreamResponse(id=rid, created=created, model=model, weight_version=version,
                                                                choices=[ChatStreamChoice(index=c.index, delta=d)],
                                                                usage=usage))
                    choice = ChatStreamChoice(index=c.index, delta=deltas[-1], logprobs=logprobs,
                                              finish_reason=finish, stop_reason=c.stop_reason,
                                              token_ids=ids if want_ids else None,
                                              weight_versions=c.weight_versions if c.finish_reason is not None else None)
                    yield _sse(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[choice],
                                                            weight_version=version, usage=usage))
            if req.usage_at_end:
                yield _sse(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                        usage=UsageInfo.of(n_prompt, n_gen, self._cached_tokens(latest))))
        except Exception as err:  # noqa: BLE001
            yield _sse(exception_response_body(err))
        yield _DONE_EVENT

    # -- /tokenize, /detokenize ------------------------------------------------------------
    async def tokenize_off_loop(self, req: TokenizeRequest) -> TokenizeResponse:
        """/tokenize on the prompt thread (a large prompt or conversation leaves the event loop
        to the streams)."""
        return await self.llm.on_prompt_thread(lambda tok: self.tokenize(req, tok))

    def tokenize(self, req: TokenizeRequest, tokenizer=None) -> TokenizeResponse:
        self._model_name(req.model)
        tok = tokenizer if tokenizer is not None else self.llm.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        if req.prompt is not None:
            special = req.add_special_tokens is not False
            ids = list(encode_text(tok, req.prompt, special))
        else:
            # the chat route's rendering: the same template, variables, tools and special tokens
            req.check_chat_fields()
            plan_tools(req.tools, "none")   # the shape chat checks (400 naming the bad tool)
            ids = self.chat_prompt_ids([m.to_template_dict() for m in req.messages], req.chat_template_kwargs,
                                       req.chat_template, add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message, tools=req.tools,
                                       add_special_tokens=bool(req.add_special_tokens), tokenizer=tok)
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.llm.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self._model_name(req.model)
        vocab = self.llm.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return DetokenizeResponse(prompt=self.llm.tokenizer.decode(req.tokens))


def _plain_json(value: Any) -> Any:
    """A tokenizer config value as JSON: a special token (transformers' AddedToken) as its text,
    containers element-wise, anything else JSON cannot hold as its str."""
    if hasattr(value, "content") and not isinstance(value, (str, bytes, dict)):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_json(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)) or (isinstance(value, float) and math.isfinite(value)):
        return value
    return str(value)


def _split(c: CompletionOutput, reasoning_parser: str | None,
           chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str | None, str | None]:
    """(reasoning, the rest) of a choice's text; without a reasoning parser, (None, text)."""
    if reasoning_parser is None:
        return None, c.text
    return split_reasoning(reasoning_parser, c.text, chat_template_kwargs)


def _chat_message(c: CompletionOutput, plan: ToolPlan, reasoning_parser: str | None = None,
                  role: str = "assistant", echoed: str = "", include_reasoning: bool = True,
                  chat_template_kwargs: dict[str, Any] | None = None) -> ChatResponseMessage:
    """A choice's message: its text, or with tools its content and parsed tool calls; with a
    reasoning parser the <think> part apart (left out without include_reasoning), tool calls
    parsed from the rest (the request's chat_template_kwargs may move a reasoning into the
    rest: nemotron_v3). `echoed` (chat echo) goes before the content; the parsers never see it."""
    reasoning, text = _split(c, reasoning_parser, chat_template_kwargs)
    reasoning = reasoning if include_reasoning else None
    calls: list = []
    if plan.parses and text is not None:
        text, calls = plan.parse(text)
    content = echoed + (text or "") if echoed else text
    return ChatResponseMessage(role=role, content=content, reasoning=reasoning, reasoning_content=reasoning, tool_calls=[
        ToolCall(id=plan.call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
        for call in calls] or None)


def _delta_message(p: StreamPiece) -> DeltaMessage:
    if p.index is None:
        return DeltaMessage(content=p.content)
    return DeltaMessage(tool_calls=[DeltaToolCall(index=p.index, id=p.id, type="function" if p.id else None,
                                                  function=DeltaFunctionCall(name=p.name, arguments=p.arguments))])


def _chat_finish(c: CompletionOutput, plan: ToolPlan, reasoning_parser: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> str | None:
    """OpenAI's finish_reason "tool_calls" when the model chose to call tools (a forced
    named function finishes with "stop", as OpenAI's does)."""
    if c.finish_reason == "stop" and plan.mode in ("auto", "required"):
        text = _split(c, reasoning_parser, chat_template_kwargs)[1]
        if text is not None and plan.parse(text)[1]:
            return "tool_calls"
    return c.finish_reason
