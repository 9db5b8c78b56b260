"""The OpenAI-compatible HTTP server (FastAPI) in front of an AsyncLLM.

Endpoints (docs/serving.md has the schema and extensions): GET /health,
/version, /metrics, /v1/models; POST /v1/completions, /v1/chat/completions,
/tokenize, /detokenize; admin: POST /v1/pause, /v1/resume, /v1/weights/update,
/v1/weights/init_group, /v1/weights/update_from_group, /v1/weights/update_from_ipc,
GET /v1/weights/version, GET /v1/weights/contract.

Every request goes through the same three stages, and each stage maps its
failures to one HTTP status:
  1. parse + validate (pydantic types, SamplingParams values, model name)  -> 400
  2. add to the engine (prompt tokenization and validation in this process;
     a multi-prompt request is added atomically)                           -> 400
     (a full queue: 429; the engine process gone: 503)
  3. wait for outputs (non-streaming) or stream them as SSE                -> 500 if the engine fails
Errors use OpenAI's body: {"error": {"message", "type", "param", "code"}}.
A streamed response has already sent its 200 when stage 3 fails, so the
error then arrives as a final `data: {"error": ...}` event before [DONE].

When the client disconnects, its requests are aborted in the engine so they
stop taking batch slots and KV blocks.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm.config import default_model_path
from vllm.entrypoints.openai.async_engine import AsyncLLM, EngineDeadError, EngineError, QueueFullError, RequestStream
from vllm.entrypoints.openai.protocol import (
    ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamResponse, ChatLogprobs,
    ChatLogprobToken, ChatResponseMessage, ChatStreamChoice, CompletionChoice, CompletionLogprobs, CompletionRequest,
    CompletionResponse, CompletionStreamResponse, DeltaMessage, DetokenizeRequest, DetokenizeResponse, ErrorInfo,
    ErrorResponse, ModelCard, ModelList, OpenAIBaseModel, TokenizeRequest, TokenizeResponse, TopLogprob, UsageInfo,
    WeightsUpdateRequest, WeightsVersionResponse, json_logprob,
)
from vllm.outputs import CompletionOutput, Logprob, RequestOutput
from vllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# ---- errors -------------------------------------------------------------------------------

def error_response(message: str, status: int = 400, err_type: str | None = None, param: str | None = None) -> JSONResponse:
    if err_type is None:
        err_type = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    429: "rate_limit_error", 501: "not_implemented", 503: "service_unavailable"}.get(
            status, "internal_server_error" if status >= 500 else "invalid_request_error")
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def _exception_response(err: BaseException) -> JSONResponse:
    """The one place that maps an exception from stages 1-3 to an HTTP error."""
    if isinstance(err, ValueError):
        return error_response(str(err), 400)
    if isinstance(err, QueueFullError):
        resp = error_response(str(err), 429)
        resp.headers["Retry-After"] = "1"
        return resp
    if isinstance(err, NotImplementedError):
        return error_response(str(err), 501)
    if isinstance(err, EngineDeadError):
        return error_response(str(err), 503)
    if isinstance(err, EngineError):
        return error_response(str(err), 500)
    logger.exception("unexpected error while serving a request", exc_info=err)
    return error_response(f"internal error: {type(err).__name__}: {err}", 500)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for e in exc.errors():
        if e.get("type") == "json_invalid":
            # its loc is ("body", character offset): an offset, not a parameter
            pos = e.get("loc", (None, None))[-1]
            reason = (e.get("ctx") or {}).get("error", "invalid JSON")
            return f"the request body is not valid JSON: {reason} (at character {pos})", None
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if loc and param is None:
            param = ".".join(loc)
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid value')}")
    return "; ".join(parts) or "invalid request", param


# ---- disconnect handling ------------------------------------------------------------------

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
    """
    alts = {lp.rank: (tid, lp) for tid, lp in entry.items() if tid != sampled and lp.rank is not None}
    ordered = [alts[r] for r in sorted(alts)]
    if len(ordered) < k and sampled in entry:  # the sampled token is one of the top k
        gap = next((i for i, r in enumerate(sorted(alts)) if r != i + 1), len(ordered))
        ordered.insert(gap, (sampled, entry[sampled]))
    return ordered[:k]


def _completion_logprobs(token_ids: list[int], lps: list[dict[int, Logprob]], k: int, offset: int) -> CompletionLogprobs:
    """OpenAI completions logprobs: per token the sampled token's logprob and a
    {token text: logprob} dict of the top-k alternatives plus the sampled token
    (so up to k + 1 entries; tokens that decode to the same text share a key)."""
    out = CompletionLogprobs()
    for tok, entry in zip(token_ids, lps):
        sampled = entry[tok]
        text = sampled.decoded_token or ""
        out.tokens.append(text)
        out.token_logprobs.append(json_logprob(sampled.logprob))
        out.text_offset.append(offset)
        offset += len(text)
        top: dict[str, float] = {}
        for _, lp in _top_alternatives(entry, tok, k) + [(tok, sampled)]:
            top.setdefault(lp.decoded_token or "", json_logprob(lp.logprob))
        out.top_logprobs.append(top)
    return out


def _chat_logprobs(token_ids: list[int], lps: list[dict[int, Logprob]], k: int) -> ChatLogprobs:
    """OpenAI chat logprobs: per token its logprob and the k most likely tokens, best first."""
    content = []
    for tok, entry in zip(token_ids, lps):
        sampled = entry[tok]
        text = sampled.decoded_token or ""
        top = [TopLogprob(token=lp.decoded_token or "", logprob=json_logprob(lp.logprob),
                          bytes=list((lp.decoded_token or "").encode("utf-8")))
               for _, lp in _top_alternatives(entry, tok, k)]
        content.append(ChatLogprobToken(token=text, logprob=json_logprob(sampled.logprob),
                                        bytes=list(text.encode("utf-8")), top_logprobs=top))
    return ChatLogprobs(content=content)


# ---- streaming state ----------------------------------------------------------------------

@dataclass
class _ChoiceCursor:
    """How much of one choice has been sent."""
    text: int = 0
    tokens: int = 0
    text_offset: int = 0
    done: bool = False
    first: bool = True


def _stream_delta(c: CompletionOutput, cur: _ChoiceCursor, holdback: int) -> tuple[str, list[int], list | None] | None:
    """The not-yet-sent part of a choice, or None when there is nothing to send.

    With stop strings the last `holdback` characters stay unsent until the choice
    finishes: a stop string may be completing there, and the engine then cuts the
    text before it. So the chunks always concatenate to the non-streamed text.
    """
    finished = c.finish_reason is not None
    end = len(c.text) if finished else max(cur.text, len(c.text) - holdback)
    text = c.text[cur.text:end]
    ids = c.token_ids[cur.tokens:]
    lps = c.logprobs[cur.tokens:] if c.logprobs is not None else None
    if not text and not ids and not finished:
        return None
    cur.text = max(cur.text, end)
    cur.tokens = len(c.token_ids)
    cur.done = finished
    return text, ids, lps


# ---- the server ---------------------------------------------------------------------------

class OpenAIServing:
    """Request handlers; one instance per app, holding what every handler needs."""

    def __init__(self, async_llm: AsyncLLM, served_model_names: Sequence[str], *, max_logprobs: int = 20,
                 generation_defaults: dict[str, Any] | None = None, model_path: str | None = None,
                 max_model_len: int | None = None):
        if not served_model_names:
            raise ValueError("at least one served model name is needed")
        self.llm = async_llm
        self.names = list(served_model_names)
        self.max_logprobs = max_logprobs
        self.defaults = dict(generation_defaults or {})
        self.model_path = model_path
        self.max_model_len = max_model_len

    def _model_name(self, requested: str | None) -> str:
        if requested is None or requested == "":
            return self.names[0]
        if requested not in self.names:
            raise ValueError(f"the model {requested!r} is not served here; available: {', '.join(self.names)}")
        return requested

    @staticmethod
    def _log_ignored(req: OpenAIBaseModel) -> None:
        extra = req.ignored_fields()
        if extra:
            logger.warning("ignoring unknown request fields: %s", ", ".join(extra))

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=n, root=self.model_path, max_model_len=self.max_model_len) for n in self.names])

    # -- /v1/completions -------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request):
        try:
            self._log_ignored(req)
            model = self._model_name(req.model)
            params = req.to_sampling_params(self.defaults, self.max_logprobs)
            prompts = req.prompts()
            rid = f"cmpl-{uuid.uuid4().hex}"
            streams = await self.llm.add_requests(
                [(f"{rid}-{i}", p, params) for i, p in enumerate(prompts)], stream=req.stream)
        except Exception as err:  # noqa: BLE001 -- mapped to 400/429/500/503
            return _exception_response(err)
        created = int(time.time())
        if req.stream:
            return _SSEResponse(self._completion_events(streams, params, rid, model, created, req), streams)
        return await _unless_disconnected(raw, self._completion_full(streams, params, rid, model, created, req), streams)

    async def _completion_full(self, streams, params: SamplingParams, rid: str, model: str, created: int,
                               req: CompletionRequest):
        try:
            finals = await _final_outputs(streams)
        except Exception as err:  # noqa: BLE001
            return _exception_response(err)
        ids = req.want_token_ids
        choices, n_prompt, n_gen, version = [], 0, 0, 0
        for i, out in enumerate(finals):
            n_prompt += len(out.prompt_token_ids)
            for c in out.outputs:
                n_gen += len(c.token_ids)
                version = max([version, *c.weight_versions])
                choices.append(CompletionChoice(
                    index=i * params.n + c.index, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    logprobs=_completion_logprobs(c.token_ids, c.logprobs, params.logprobs or 0, 0) if c.logprobs is not None else None,
                    token_ids=list(c.token_ids) if ids else None, prompt_token_ids=list(out.prompt_token_ids) if ids else None,
                    weight_versions=c.weight_versions))
        return _json(CompletionResponse(id=rid, created=created, model=model, choices=choices, weight_version=version,
                                        usage=UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_gen, total_tokens=n_prompt + n_gen)))

    async def _completion_events(self, streams, params: SamplingParams, rid: str, model: str, created: int,
                                 req: CompletionRequest) -> AsyncIterator[str]:
        holdback = max((len(s) for s in params.stop_strings), default=1) - 1
        cursors: dict[tuple[int, int], _ChoiceCursor] = {}
        n_prompt: dict[int, int] = {}
        n_gen = 0
        want_ids = req.want_token_ids
        # The chunk envelope is the same for every event: built once, choices spliced in.
        head = json.dumps({"id": rid, "object": "text_completion", "created": created, "model": model})[:-1]
        try:
            async for i, out in _merge(streams):
                n_prompt[i] = len(out.prompt_token_ids)
                choices, version = [], None
                for c in out.outputs:
                    cur = cursors.setdefault((i, c.index), _ChoiceCursor())
                    if cur.done:
                        continue
                    delta = _stream_delta(c, cur, holdback)
                    if delta is None:
                        continue
                    text, ids, lps = delta
                    n_gen += len(ids)
                    choice = {"index": i * params.n + c.index, "text": text, "logprobs": None,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    if lps is not None:
                        lp = _completion_logprobs(ids, lps, params.logprobs or 0, cur.text_offset)
                        cur.text_offset += sum(len(t) for t in lp.tokens)
                        choice["logprobs"] = lp.model_dump()
                    if want_ids:
                        choice["token_ids"] = ids
                        if cur.first:
                            choice["prompt_token_ids"] = out.prompt_token_ids
                    if c.finish_reason is not None:
                        choice["weight_versions"] = c.weight_versions
                    cur.first = False
                    version = c.weight_versions[-1] if c.weight_versions else version
                    choices.append(choice)
                if choices:
                    yield f'data: {head}, "choices": {json.dumps(choices)}, "weight_version": {json.dumps(version)}}}\n\n'
            if req.stream_options is not None and req.stream_options.include_usage:
                p = sum(n_prompt.values())
                yield _sse(CompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                    usage=UsageInfo(prompt_tokens=p, completion_tokens=n_gen, total_tokens=p + n_gen)))
        except Exception as err:  # noqa: BLE001 -- the 200 is already sent: report in-band
            yield _sse(_exception_response_body(err))
        yield _DONE_EVENT

    # -- /v1/chat/completions --------------------------------------------------------------
    def _chat_prompt_ids(self, messages, add_generation_prompt: bool, continue_final_message: bool,
                         chat_template_kwargs: dict | None, tools=None) -> list[int]:
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        return apply_chat_template(self.llm.tokenizer, messages, add_generation_prompt, continue_final_message, kwargs)

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        try:
            self._log_ignored(req)
            model = self._model_name(req.model)
            params = req.to_sampling_params(self.defaults, self.max_logprobs)
            messages = req.template_messages()
            prompt_ids = self._chat_prompt_ids(messages, req.add_generation_prompt, req.continue_final_message,
                                               req.chat_template_kwargs, req.tools)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            streams = await self.llm.add_requests([(rid, {"prompt_token_ids": prompt_ids}, params)], stream=req.stream)
        except Exception as err:  # noqa: BLE001
            return _exception_response(err)
        created = int(time.time())
        if req.stream:
            return _SSEResponse(self._chat_events(streams[0], params, rid, model, created, req, prompt_ids), streams)
        return await _unless_disconnected(raw, self._chat_full(streams[0], params, rid, model, created, req), streams)

    async def _chat_full(self, stream, params: SamplingParams, rid: str, model: str, created: int, req: ChatCompletionRequest):
        try:
            (out,) = await _final_outputs([stream])
        except Exception as err:  # noqa: BLE001
            return _exception_response(err)
        top_k = params.logprobs or 0
        ids = req.want_token_ids
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text), finish_reason=c.finish_reason,
                              stop_reason=c.stop_reason, token_ids=list(c.token_ids) if ids else None,
                              weight_versions=c.weight_versions,
                              logprobs=_chat_logprobs(c.token_ids, c.logprobs, top_k) if req.logprobs and c.logprobs is not None else None)
                   for c in out.outputs]
        n_prompt, n_gen = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
        version = max(v for c in out.outputs for v in (c.weight_versions or [0]))
        return _json(ChatCompletionResponse(id=rid, created=created, model=model, choices=choices, weight_version=version,
                                            usage=UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_gen, total_tokens=n_prompt + n_gen),
                                            prompt_token_ids=list(out.prompt_token_ids) if ids else None))

    async def _chat_events(self, stream, params: SamplingParams, rid: str, model: str, created: int,
                           req: ChatCompletionRequest, prompt_ids: list[int]) -> AsyncIterator[str]:
        holdback = max((len(s) for s in params.stop_strings), default=1) - 1
        top_k = params.logprobs or 0
        cursors = [_ChoiceCursor() for _ in range(params.n)]
        n_gen = 0
        want_ids = req.want_token_ids
        # OpenAI opens every choice with a role-only delta; the prompt ids ride on the first chunk.
        yield _sse(ChatCompletionStreamResponse(
            id=rid, created=created, model=model, prompt_token_ids=list(prompt_ids) if want_ids else None,
            weight_version=self.llm.weight_version,
            choices=[ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content=""),
                                      token_ids=[] if want_ids else None) for j in range(params.n)]))
        try:
            async for _, out in _merge([stream]):
                for c in out.outputs:
                    cur = cursors[c.index]
                    if cur.done:
                        continue
                    delta = _stream_delta(c, cur, holdback)
                    if delta is None:
                        continue
                    text, ids, lps = delta
                    n_gen += len(ids)
                    logprobs = _chat_logprobs(ids, lps, top_k) if req.logprobs and lps is not None else None
                    choice = ChatStreamChoice(index=c.index, delta=DeltaMessage(content=text), logprobs=logprobs,
                                              finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                              token_ids=ids if want_ids else None,
                                              weight_versions=c.weight_versions if c.finish_reason is not None else None)
                    yield _sse(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[choice],
                                                            weight_version=c.weight_versions[-1] if c.weight_versions else None))
            if req.stream_options is not None and req.stream_options.include_usage:
                p = len(prompt_ids)
                yield _sse(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                        usage=UsageInfo(prompt_tokens=p, completion_tokens=n_gen, total_tokens=p + n_gen)))
        except Exception as err:  # noqa: BLE001
            yield _sse(_exception_response_body(err))
        yield _DONE_EVENT

    # -- /tokenize, /detokenize ------------------------------------------------------------
    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self._model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        if req.prompt is not None:
            ids = list(self.llm.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        else:
            if req.continue_final_message and req.add_generation_prompt:
                raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
            ids = self._chat_prompt_ids([m.to_template_dict() for m in req.messages], req.add_generation_prompt,
                                        req.continue_final_message, req.chat_template_kwargs)
        return TokenizeResponse(count=len(ids), max_model_len=self.llm.max_model_len, tokens=ids)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self._model_name(req.model)
        vocab = self.llm.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return DetokenizeResponse(prompt=self.llm.tokenizer.decode(req.tokens))


def _exception_response_body(err: BaseException) -> dict:
    return json.loads(_exception_response(err).body)


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                        kwargs: dict) -> list[int]:
    """Messages -> prompt token ids, exactly as LLM.chat does it (so server and offline agree)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template")
    if continue_final_message:
        kwargs = {**kwargs, "continue_final_message": True}
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as err:  # jinja errors (raise_exception in templates, bad roles), bad kwargs
        raise ValueError(f"could not apply the chat template: {err}") from err
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


# ---- auth ---------------------------------------------------------------------------------

ADMIN_PATHS = ("/v1/pause", "/v1/resume", "/v1/weights/update", "/v1/weights/init_group", "/v1/weights/update_from_group",
               "/v1/weights/update_from_ipc", "/pause", "/resume", "/abort_requests")


class _AuthMiddleware:
    """Bearer-key checks as plain ASGI (no per-chunk cost on streamed responses).
    Admin paths need the admin key when one is set; other /v1/ paths the API key."""

    def __init__(self, app, api_key: str | None, admin_key: str | None):
        self.app = app
        self.api_key = api_key
        self.admin_key = admin_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path = scope["path"]
            need = None
            if self.admin_key and path in ADMIN_PATHS:
                need, what = self.admin_key, "the admin key"
            elif self.api_key and path.startswith("/v1/"):
                need, what = self.api_key, "the API key"
            if need is not None and not _key_ok(_bearer(scope), need):
                resp = error_response(f"invalid or missing credentials: this endpoint needs {what} "
                                      "(Authorization: Bearer <key>)", 401)
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _bearer(scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            auth = value.decode("latin-1")
            return auth[7:].strip() if auth[:7].lower() == "bearer " else None
    return None


def _key_ok(given: str | None, key: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), key.encode())


# ---- metrics ------------------------------------------------------------------------------

def _metrics_registry(serving: OpenAIServing):
    """A Prometheus registry whose collector reads the AsyncLLM's counters at scrape time
    (nothing is counted on the hot path beyond plain integer additions)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    llm = serving.llm
    model = serving.names[0]

    class _Collector:
        def collect(self):
            st = llm.stats
            labels = ["model_name"]

            def gauge(name, doc, value):
                g = GaugeMetricFamily(name, doc, labels=labels)
                g.add_metric([model], value)
                return g

            def counter(name, doc, value):
                c = CounterMetricFamily(name, doc, labels=labels)
                c.add_metric([model], value)
                return c
            yield gauge("vllm:num_requests_running", "Sequences running in the engine (last step).", st.num_running)
            yield gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled (last step).", st.num_waiting)
            yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0-1).", st.kv_usage)
            yield gauge("vllm:kv_cache_free_blocks", "KV-cache blocks free to allocate.", st.num_free_blocks)
            yield gauge("vllm:weight_version", "Weight version the engine is serving.", llm.weight_version)
            yield gauge("vllm:engine_paused", "1 while generation is paused (POST /v1/pause).", int(st.paused))
            yield gauge("vllm:engine_alive", "1 while the engine process runs.", int(llm.is_running))
            yield counter("vllm:request_received", "Requests (prompts) accepted.", llm.num_requests_received)
            yield counter("vllm:prompt_tokens", "Prompt tokens of accepted requests.", llm.num_prompt_tokens)
            yield counter("vllm:generation_tokens", "Tokens generated.", llm.num_generation_tokens)
            yield counter("vllm:num_preemptions", "Sequences preempted (KV cache full).", st.num_preemptions)
            c = CounterMetricFamily("vllm:request_success", "Finished sequences by finish reason.",
                                    labels=["model_name", "finished_reason"])
            for reason, n in sorted(llm.finished_by_reason.items()):
                c.add_metric([model, reason], n)
            yield c

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return registry


# ---- the app ------------------------------------------------------------------------------

def build_app(serving: OpenAIServing, *, shutdown_engine_on_exit: bool = True, api_key: str | None = None,
              admin_key: str | None = None) -> FastAPI:
    """The FastAPI app. Tests drive it in-process; `vllm serve` runs it under uvicorn.

    api_key: every /v1/ endpoint requires `Authorization: Bearer <api_key>`.
    admin_key: pause/resume and weight updates require it (else they need the api key, if any).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if shutdown_engine_on_exit:
            # Blocking join of the engine: off the event loop.
            await asyncio.get_running_loop().run_in_executor(None, serving.llm.shutdown)

    app = FastAPI(title="vllm-parity OpenAI-compatible server", lifespan=lifespan)
    app.state.serving = serving
    llm = serving.llm

    if api_key or admin_key:
        app.add_middleware(_AuthMiddleware, api_key=api_key, admin_key=admin_key)

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(_request: Request, exc: RequestValidationError):
        # OpenAI clients expect 400 + an error object, not FastAPI's 422 + "detail".
        message, param = _validation_message(exc)
        return error_response(message, 400, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(_request: Request, exc: StarletteHTTPException):
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _on_unexpected(_request: Request, exc: Exception):
        return _exception_response(exc)

    @app.get("/health")
    async def health():
        if llm.is_running:
            return {"status": "ok"}
        return error_response(f"the engine is not running: {llm.client.dead_reason}", 503)

    @app.get("/version")
    async def version():
        from vllm import __version__
        return {"version": __version__}

    try:
        registry = _metrics_registry(serving)
    except ImportError:  # prometheus-client is in the [serve] extra
        registry = None

    @app.get("/metrics")
    async def metrics():
        if registry is None:
            return error_response("/metrics needs prometheus-client: pip install 'vllm-parity[serve]'", 501)
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return Response(content=generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        try:
            return serving.tokenize(req)
        except Exception as err:  # noqa: BLE001
            return _exception_response(err)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        try:
            return serving.detokenize(req)
        except Exception as err:  # noqa: BLE001
            return _exception_response(err)

    async def _admin(coro):
        try:
            return await coro
        except Exception as err:  # noqa: BLE001
            return _exception_response(err)

    @app.get("/v1/weights/version")
    async def weights_version():
        return WeightsVersionResponse(weight_version=llm.weight_version)

    @app.get("/v1/weights/contract")
    async def weights_contract():
        # the engine's execution contract: a trainer compares it with its own before any sync
        return await _admin(llm.utility("execution_contract"))

    @app.post("/v1/weights/update_from_ipc")
    async def weights_update_from_ipc(raw: Request):
        return await _admin(_utility_with_body(llm, "update_weights_from_ipc", raw))

    @app.post("/v1/weights/update")
    async def weights_update(req: WeightsUpdateRequest):
        return await _admin(llm.update_weights_from_path(req.path))

    @app.post("/v1/weights/init_group")
    async def weights_init_group(raw: Request):
        return await _admin(_utility_with_body(llm, "init_weight_group", raw))

    @app.post("/v1/weights/update_from_group")
    async def weights_update_from_group(raw: Request):
        return await _admin(_utility_with_body(llm, "update_weights_from_group", raw))

    @app.post("/v1/pause")
    async def pause():
        return await _admin(llm.pause())

    @app.post("/v1/resume")
    async def resume():
        return await _admin(llm.resume())

    # upstream vLLM's RL routes: POST /pause?mode=abort|wait|keep&clear_cache=..., POST /resume,
    # GET /is_paused, POST /abort_requests {"request_ids": [...]}, GET /get_world_size
    @app.post("/pause")
    async def pause_generation(mode: str = "abort", clear_cache: bool = True):
        return await _admin(llm.pause_generation(mode, clear_cache))

    @app.post("/resume")
    async def resume_generation():
        return await _admin(llm.resume_generation())

    @app.get("/is_paused")
    async def is_paused():
        return await _admin(_is_paused(llm))

    @app.post("/abort_requests")
    async def abort_requests(raw: Request):
        return await _admin(_abort_requests(llm, raw))

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = True):
        # one engine of tensor-parallel size 1, no data parallelism
        return {"world_size": 1}

    return app


async def _is_paused(llm: AsyncLLM) -> dict:
    return {"is_paused": await llm.is_paused()}


async def _abort_requests(llm: AsyncLLM, raw: Request) -> dict:
    body = await raw.body()
    try:
        spec = json.loads(body) if body else {}
    except ValueError as err:
        raise ValueError(f"the request body is not valid JSON: {err}") from err
    if not isinstance(spec, dict):
        raise ValueError("the request body must be a JSON object")
    return await llm.abort_requests(spec.get("request_ids"))


async def _utility_with_body(llm: AsyncLLM, method: str, raw: Request):
    """Forward a JSON object body to EngineCore.utility_<method>(body)."""
    try:
        body = await raw.json()
    except ValueError as err:
        raise ValueError(f"the request body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    result = await llm.utility(method, body)
    if isinstance(result, dict) and "weight_version" in result:
        llm.weight_version = max(llm.weight_version, result["weight_version"])
    return result


def _serving(async_llm: AsyncLLM, served_model_names: Sequence[str] | None, max_logprobs: int,
             generation_config: str) -> OpenAIServing:
    info = async_llm.info
    names = list(served_model_names or [default_served_name(info.model_path)])
    return OpenAIServing(async_llm, names, max_logprobs=max_logprobs,
                         generation_defaults=info.generation_defaults if generation_config == "auto" else {},
                         model_path=info.model_path, max_model_len=info.max_model_len)


def build_app_from_llm(llm, served_model_names: Sequence[str] | None = None, *, max_logprobs: int = 20,
                       generation_config: str = "auto", max_queued_requests: int | None = None,
                       api_key: str | None = None, admin_key: str | None = None) -> FastAPI:
    """An app serving an existing `vllm.LLM`, its engine driven by the engine-core loop on a
    thread of this process (tests, notebooks). Once the app runs, only that thread may touch
    `llm.llm_engine`. `vllm serve` runs the engine in its own process instead."""
    async_llm = AsyncLLM.from_engine(llm.llm_engine, max_queued_requests=max_queued_requests)
    return build_app(_serving(async_llm, served_model_names, max_logprobs, generation_config),
                     api_key=api_key, admin_key=admin_key)


def default_served_name(model_path: str) -> str:
    """The name a model is served under without --served-model-name: its path, as upstream does,
    except the embedded default model, whose path is an install location, is 'default'."""
    if os.path.abspath(model_path) == os.path.abspath(default_model_path()):
        return "default"
    return model_path


def run_server(engine_kwargs: dict, *, host: str, port: int, served_model_names: Sequence[str] | None = None,
               max_logprobs: int = 20, generation_config: str = "auto", log_level: str = "info",
               max_queued_requests: int | None = None, api_key: str | None = None, admin_key: str | None = None) -> None:
    """Start the engine core process, then serve until SIGINT/SIGTERM; uvicorn's graceful
    shutdown then stops the engine process (which also exits by itself if this one dies)."""
    import uvicorn

    async_llm = AsyncLLM.from_engine_args(engine_kwargs, max_queued_requests=max_queued_requests)
    try:
        app = build_app(_serving(async_llm, served_model_names, max_logprobs, generation_config),
                        api_key=api_key, admin_key=admin_key)
        names = app.state.serving.names
        logger.info("serving %s on http://%s:%d", ", ".join(names), host, port)
        # Bounded graceful shutdown: an open stream must not keep the process alive forever.
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        async_llm.shutdown()
