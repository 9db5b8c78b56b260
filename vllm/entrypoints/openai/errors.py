"""OpenAI-style error bodies and the HTTP status each failure maps to (docs/serving.md, "Errors")."""
from __future__ import annotations

import json
import logging

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from vllm.entrypoints.openai.async_engine import EngineDeadError, EngineError, QueueFullError
from vllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class ModelNotFoundError(LookupError):
    """A request named a model this server does not serve: 404, as upstream vLLM and OpenAI
    answer (the openai client raises NotFoundError)."""


class PromptNotScoredError(RuntimeError):
    """A request that asked for prompt logprobs ended (aborted by pause_generation or
    /abort_requests) before every prompt position was scored: a partial answer would read as
    a complete one, so the request fails and can be sent again."""


def require_scored_prompts(outputs, asked: bool = True) -> None:
    """Raise PromptNotScoredError unless every output's prompt logprobs cover every position
    after the first (the first has none by definition). `asked`: the request asked for them,
    so none at all (aborted before its first step) fails too."""
    for out in outputs:
        lps = out.prompt_logprobs
        if lps is None and asked and len(out.prompt_token_ids) > 1:
            raise PromptNotScoredError(f"request {out.request_id} ended before its prompt was scored; send it again")
        if lps is not None and any(entry is None for entry in lps[1:]):
            done = sum(entry is not None for entry in lps[1:])
            raise PromptNotScoredError(
                f"request {out.request_id} ended ({out.outputs[0].finish_reason if out.outputs else 'aborted'}) after "
                f"{done} of its {len(lps) - 1} prompt positions were scored; send it again")


def error_response(message: str, status: int = 400, err_type: str | None = None, param: str | None = None) -> JSONResponse:
    if err_type is None:
        err_type = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    429: "rate_limit_error", 501: "not_implemented", 503: "service_unavailable"}.get(
            status, "internal_server_error" if status >= 500 else "invalid_request_error")
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


async def await_or_error(coro):
    """What `coro` returns, or, when it raises, the error response for the exception."""
    try:
        return await coro
    except Exception as err:  # noqa: BLE001
        return exception_response(err)


def call_or_error(fn, *args):
    """What `fn(*args)` returns, or, when it raises, the error response for the exception."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001
        return exception_response(err)


def health_response(llm):
    """GET /health: ok while the engine runs, else 503 with the reason it died."""
    if llm.is_running:
        return {"status": "ok"}
    return error_response(f"the engine is not running: {llm.client.dead_reason}", 503)


def exception_response(err: BaseException) -> JSONResponse:
    """The one place that maps an exception from stages 1-3 to an HTTP error."""
    if isinstance(err, ModelNotFoundError):
        return error_response(str(err), 404, param="model")
    if isinstance(err, ValueError):
        return error_response(str(err), 400)
    if isinstance(err, QueueFullError):
        resp = error_response(str(err), 429)
        resp.headers["Retry-After"] = "1"
        return resp
    if isinstance(err, NotImplementedError):
        return error_response(str(err), 501)
    if isinstance(err, PromptNotScoredError):
        return error_response(str(err), 409, "conflict_error")
    if isinstance(err, EngineDeadError):
        return error_response(str(err), 503)
    if isinstance(err, EngineError):
        return error_response(str(err), 500)
    logger.exception("unexpected error while serving a request", exc_info=err)
    return error_response(f"internal error: {type(err).__name__}: {err}", 500)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
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


def exception_response_body(err: BaseException) -> dict:
    return json.loads(exception_response(err).body)
