"""The OpenAI-compatible HTTP server (FastAPI) in front of an AsyncLLM: the routes.

Endpoints (docs/serving.md has the schema and extensions): GET /health (and
GET|POST /ping), /version, /metrics, /v1/models, /tokenizer_info (when enabled); POST
/v1/completions, /v1/chat/completions, /tokenize, /detokenize; admin: POST /v1/pause, /v1/resume, /v1/weights/update,
/v1/weights/init_group, /v1/weights/update_from_group, /v1/weights/update_from_ipc,
GET /v1/weights/version, GET /v1/weights/contract; upstream vLLM's RL routes: POST
/pause, /resume, /abort_requests, GET /is_paused, /get_world_size, and (rl.py) its
four-phase weight transfer and TRL's server protocol.

The work behind the routes lives by concern: serving.py (completions, chat, SSE,
tokenize), errors.py (error bodies and statuses), auth.py (API and admin keys),
metrics.py (/metrics).

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
import json
import logging
import os
import signal
import socket
import threading
from contextlib import asynccontextmanager
from typing import Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm.config import default_model_path, load_generation_defaults
from vllm.entrypoints.openai.async_engine import AsyncLLM
from vllm.entrypoints.openai.auth import AuthMiddleware
from vllm.entrypoints.openai.errors import (
    await_or_error, call_or_error, error_response, exception_response, health_response, validation_message,
)
from vllm.entrypoints.openai.metrics import metrics_registry
from vllm.entrypoints.openai.stats_logger import StatsLogger
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, WeightsUpdateRequest,
    WeightsVersionResponse,
)
from vllm.entrypoints.openai.request_id import RequestIdHeaderMiddleware
from vllm.entrypoints.openai.serving import OpenAIServing

logger = logging.getLogger(__name__)



async def json_body_only(request: Request) -> None:
    """A body sent as another media type (curl -d's form encoding), or with none, is refused
    in upstream's words, rather than with a validation error about the body's shape."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise RequestValidationError([{"loc": ("header", "content-type"), "type": "value_error",
                                       "msg": "Unsupported Media Type: Only 'application/json' is allowed"}])

def build_app(serving: OpenAIServing, *, shutdown_engine_on_exit: bool = True, api_key: str | None = None,
              admin_key: str | None = None, enable_tokenizer_info_endpoint: bool = False,
              root_path: str | None = None, disable_fastapi_docs: bool = False,
              cors: dict | None = None, log_stats_interval: float | None = None,
              enable_request_id_headers: bool = False) -> FastAPI:
    """The FastAPI app. Tests drive it in-process; `vllm serve` runs it under uvicorn.

    api_key: every /v1/ endpoint requires `Authorization: Bearer <api_key>`.
    admin_key: pause/resume and weight updates require it (else they need the api key, if any).
    enable_tokenizer_info_endpoint: serve GET /tokenizer_info (404 without it, as upstream).
    root_path: the path prefix a proxy serves the app under (FastAPI's root_path).
    disable_fastapi_docs: no /docs, /redoc or /openapi.json.
    cors: CORSMiddleware's keywords (allow_origins, allow_methods, allow_headers,
    allow_credentials); None: no CORS headers (browsers on other origins cannot read answers).
    log_stats_interval: log the stats line (stats_logger.StatsLogger) every this many seconds
    while the app runs; None: never (`vllm serve` logs every 10 s unless --disable-log-stats).
    enable_request_id_headers: every answer carries X-Request-Id, the request's own header's
    value or a new uuid4 hex (upstream's --enable-request-id-headers).
    """
    stats_logger = StatsLogger(serving.llm, log_stats_interval) if log_stats_interval is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stats_task = asyncio.create_task(stats_logger.run()) if stats_logger is not None else None
        yield
        if stats_task is not None:
            stats_task.cancel()
        if shutdown_engine_on_exit:
            # Blocking join of the engine: off the event loop.
            await asyncio.get_running_loop().run_in_executor(None, serving.llm.shutdown)

    docs = {} if not disable_fastapi_docs else dict(openapi_url=None, docs_url=None, redoc_url=None)
    app = FastAPI(title="vllm-parity OpenAI-compatible server", lifespan=lifespan, **docs)
    if root_path:
        app.root_path = root_path   # as upstream sets it: requests carry it as their scope's root_path
    app.state.serving = serving
    llm = serving.llm

    if api_key or admin_key:
        app.add_middleware(AuthMiddleware, api_key=api_key, admin_key=admin_key)
    if enable_request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    if cors is not None:
        # added last, so it runs first: it answers browsers' preflight requests (which carry
        # no key) and puts its headers on every answer, a 401 included
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, **cors)

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(_request: Request, exc: RequestValidationError):
        # OpenAI clients expect 400 + an error object, not FastAPI's 422 + "detail".
        message, param = validation_message(exc)
        return error_response(message, 400, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(_request: Request, exc: StarletteHTTPException):
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _on_unexpected(_request: Request, exc: Exception):
        return exception_response(exc)

    @app.get("/health")
    async def health():
        return health_response(llm)

    # upstream's /ping (SageMaker's health check): /health's answer, GET or POST
    @app.get("/ping")
    async def ping():
        return health_response(llm)

    @app.post("/ping")
    async def ping_post():
        return health_response(llm)

    if enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info():
            return call_or_error(serving.tokenizer_info)

    @app.get("/version")
    async def version():
        from vllm import __version__
        return {"version": __version__}

    @app.get("/load")
    async def load():
        # upstream's load signal for routers: here always tracked (a counter the server keeps
        # anyway), the sequences accepted and not finished
        return {"server_load": serving.llm.num_in_flight}

    try:
        registry = metrics_registry(serving)
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

    @app.post("/v1/completions", dependencies=[Depends(json_body_only)])
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions", dependencies=[Depends(json_body_only)])
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    @app.post("/tokenize", dependencies=[Depends(json_body_only)])
    async def tokenize(req: TokenizeRequest):
        return await await_or_error(serving.tokenize_off_loop(req))

    @app.post("/detokenize", dependencies=[Depends(json_body_only)])
    async def detokenize(req: DetokenizeRequest):
        return call_or_error(serving.detokenize, req)

    @app.get("/v1/weights/version")
    async def weights_version():
        return WeightsVersionResponse(weight_version=llm.weight_version)

    @app.get("/v1/weights/contract")
    async def weights_contract():
        # the engine's execution contract: a trainer compares it with its own before any sync
        return await await_or_error(llm.utility("execution_contract"))

    @app.post("/v1/weights/update_from_ipc")
    async def weights_update_from_ipc(raw: Request):
        return await await_or_error(_utility_with_body(llm, "update_weights_from_ipc", raw))

    @app.post("/v1/weights/update")
    async def weights_update(req: WeightsUpdateRequest):
        return await await_or_error(llm.update_weights_from_path(req.path, req.staging, req.contract))

    @app.post("/v1/weights/init_group")
    async def weights_init_group(raw: Request):
        return await await_or_error(_utility_with_body(llm, "init_weight_group", raw))

    @app.post("/v1/weights/update_from_group")
    async def weights_update_from_group(raw: Request):
        return await await_or_error(_utility_with_body(llm, "update_weights_from_group", raw))

    @app.post("/v1/pause")
    async def pause():
        return await await_or_error(llm.pause())

    @app.post("/v1/resume")
    async def resume():
        return await await_or_error(llm.resume())

    # upstream vLLM's RL routes: POST /pause?mode=abort|wait|keep&clear_cache=..., POST /resume,
    # GET /is_paused, POST /abort_requests {"request_ids": [...]}, GET /get_world_size
    @app.post("/pause")
    async def pause_generation(mode: str | None = None, clear_cache: bool = True,
                               wait_for_inflight_requests: bool | None = None):
        # upstream's older form: wait_for_inflight_requests=true is mode "wait", false "abort"
        if mode is None:
            mode = "wait" if wait_for_inflight_requests else "abort"
        elif wait_for_inflight_requests is not None and (mode == "wait") != wait_for_inflight_requests:
            return error_response(f"mode={mode!r} and wait_for_inflight_requests={wait_for_inflight_requests} "
                                  "disagree", 400)
        return await await_or_error(_with_status("paused", llm.pause_generation(mode, clear_cache)))

    @app.post("/resume")
    async def resume_generation():
        return await await_or_error(_with_status("resumed", llm.resume_generation()))

    @app.get("/is_paused")
    async def is_paused():
        return await await_or_error(_is_paused(llm))

    @app.post("/abort_requests")
    async def abort_requests(raw: Request):
        return await await_or_error(_abort_requests(llm, raw))

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = True):
        # one engine of tensor-parallel size 1, no data parallelism
        return {"world_size": 1}

    # upstream vLLM's weight transfer routes and TRL's server protocol (rl.py)
    from vllm.entrypoints.openai.rl import register_rl_routes
    app.state.trl = register_rl_routes(app, serving)

    return app


async def _with_status(status: str, coro) -> dict:
    """upstream's {"status": ...} next to our fields."""
    return {"status": status, **await coro}


async def _is_paused(llm: AsyncLLM) -> dict:
    return {"is_paused": await llm.is_paused()}


async def _abort_requests(llm: AsyncLLM, raw: Request) -> dict:
    body = await raw.body()
    try:
        spec = json.loads(body) if body else {}
    except (ValueError, RecursionError) as err:
        raise ValueError(f"the request body is not valid JSON: {type(err).__name__}") from None
    if not isinstance(spec, dict):
        raise ValueError("the request body must be a JSON object")
    unknown = sorted(set(spec) - {"request_ids"})
    if unknown:   # a misspelled key must not read as "every request"
        raise ValueError(f"unknown fields {unknown}: the body is {{\"request_ids\": [...]}}")
    return {"status": "aborted", **await llm.abort_requests(spec.get("request_ids"))}


async def _utility_with_body(llm: AsyncLLM, method: str, raw: Request):
    """Forward a JSON object body to EngineCore.utility_<method>(body)."""
    try:
        body = await raw.json()
    except (ValueError, RecursionError) as err:
        raise ValueError(f"the request body is not valid JSON: {type(err).__name__}") from None
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    result = await llm.utility(method, body)
    if isinstance(result, dict) and "weight_version" in result:
        llm.weight_version = max(llm.weight_version, result["weight_version"])
    return result


# build_app's keywords among the options build_app_from_llm and run_server take (the rest are
# OpenAIServing's)
APP_OPTIONS = ("enable_tokenizer_info_endpoint", "root_path", "disable_fastapi_docs", "cors", "log_stats_interval",
               "enable_request_id_headers")


def _split_options(options: dict) -> tuple[dict, dict]:
    """(build_app's keywords, OpenAIServing's) of build_app_from_llm's / run_server's options."""
    return ({k: v for k, v in options.items() if k in APP_OPTIONS},
            {k: v for k, v in options.items() if k not in APP_OPTIONS})


# the generation_config.json keys that set sampling defaults, as upstream reads them (its
# ModelConfig.get_diff_sampling_param): max_new_tokens is the server's max_tokens
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def generation_defaults(model_defaults: dict, generation_config: str = "auto",
                        override_generation_config: dict | None = None) -> dict:
    """The sampling defaults of requests that leave a field unset: the checkpoint's
    generation_config.json values ("auto"), those of FOLDER/generation_config.json (a folder,
    read as the checkpoint's own is read), or none ("vllm"); then `override_generation_config`
    (upstream's --override-generation-config, applied under any of them) over them. Its keys are
    generation_config.json's; those that set no sampling default are ignored, as upstream
    ignores them (logged)."""
    if generation_config == "auto":
        defaults = dict(model_defaults)
    elif generation_config == "vllm":
        defaults = {}
    else:
        defaults = load_generation_defaults(generation_config)
    override = dict(override_generation_config or {})
    ignored = sorted(k for k in override if k not in GENERATION_CONFIG_KEYS)
    if ignored:
        logger.warning("--override-generation-config: %s set no sampling default (only %s do): ignored",
                       ", ".join(ignored), ", ".join(GENERATION_CONFIG_KEYS))
    for key in GENERATION_CONFIG_KEYS:
        if override.get(key) is not None:
            defaults["max_tokens" if key == "max_new_tokens" else key] = override[key]
    return defaults


def _serving(async_llm: AsyncLLM, served_model_names: Sequence[str] | None, generation_config: str = "auto",
             override_generation_config: dict | None = None, **options) -> OpenAIServing:
    """`options`: OpenAIServing's (max_logprobs, tool_call_parser, chat_template,
    trust_request_chat_template, return_tokens_as_token_ids, reasoning_parser,
    enable_prompt_tokens_details, enable_force_include_usage, response_role,
    enable_log_requests, max_log_len)."""
    info = async_llm.info
    names = list(served_model_names or [default_served_name(info.model_path)])
    return OpenAIServing(async_llm, names,
                         generation_defaults=generation_defaults(info.generation_defaults, generation_config,
                                                                 override_generation_config),
                         model_path=info.model_path, max_model_len=info.max_model_len, **options)


def build_app_from_llm(llm, served_model_names: Sequence[str] | None = None, *, generation_config: str = "auto",
                       max_queued_requests: int | None = None, api_key: str | None = None,
                       admin_key: str | None = None, override_generation_config: dict | None = None,
                       **options) -> FastAPI:
    """An app serving an existing `vllm.LLM`, its engine driven by the engine-core loop on a
    thread of this process (tests, notebooks). Once the app runs, only that thread may touch
    `llm.llm_engine`. `vllm serve` runs the engine in its own process instead. `options`:
    build_app's (APP_OPTIONS) and OpenAIServing's (max_logprobs, tool_call_parser, chat_template, ...)."""
    app_options, serving_options = _split_options(options)
    async_llm = AsyncLLM.from_engine(llm.llm_engine, max_queued_requests=max_queued_requests)
    llm._served_by = "build_app_from_llm"   # the LLM's own entry points now refuse (ValueError)
    return build_app(_serving(async_llm, served_model_names, generation_config, override_generation_config,
                              **serving_options),
                     api_key=api_key, admin_key=admin_key, **app_options)


def default_served_name(model_path: str) -> str:
    """The name a model is served under without --served-model-name: its path, as upstream does,
    except the embedded default model, whose path is an install location, is 'default'."""
    if os.path.abspath(model_path) == os.path.abspath(default_model_path()):
        return "default"
    return model_path


def run_server(engine_kwargs: dict, *, host: str, port: int, served_model_names: Sequence[str] | None = None,
               generation_config: str = "auto", log_level: str = "info", max_queued_requests: int | None = None,
               api_key: str | None = None, admin_key: str | None = None, keep_alive_on_engine_death: bool = False,
               override_generation_config: dict | None = None, access_log: bool = True, **options) -> str:
    """Start the engine core process, then serve until SIGINT/SIGTERM; uvicorn's graceful
    shutdown then stops the engine process (which also exits by itself if this one dies).
    If the engine process dies the server shuts down too (requests in flight got 503), unless
    `keep_alive_on_engine_death`. Returns "engine_dead" or "stopped". `access_log`: uvicorn's
    line per HTTP request. `options`: build_app's (APP_OPTIONS) and OpenAIServing's
    (max_logprobs, tool_call_parser, chat_template, ...)."""
    import uvicorn

    app_options, serving_options = _split_options(options)
    # The port first: a busy one fails now, not after minutes of loading the model.
    sock = bind_socket(host, port)
    try:
        async_llm = AsyncLLM.from_engine_args(engine_kwargs, max_queued_requests=max_queued_requests)
    except BaseException:
        sock.close()
        raise
    # Set only by the engine-death callback: after a clean stop (SIGINT/SIGTERM) the lifespan
    # hook has shut the engine down itself, so "not running" alone does not mean it died.
    died: list[str] = []
    try:
        app = build_app(_serving(async_llm, served_model_names, generation_config, override_generation_config,
                                 **serving_options),
                        api_key=api_key, admin_key=admin_key, **app_options)
        names = app.state.serving.names
        bound_port = sock.getsockname()[1]   # --port 0: the one the kernel picked
        logger.info("serving %s on http://%s:%d", ", ".join(names), host, bound_port)
        # Bounded graceful shutdown: an open stream must not keep the process alive forever.
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=bound_port, log_level=log_level,
                                               timeout_graceful_shutdown=5, access_log=access_log))
        async_llm.on_engine_death(died.append)
        if not keep_alive_on_engine_death:
            stop_server_on_engine_death(async_llm, server)
        # A stop signal sent to the whole process group (SIGTERM to a container's group) also
        # kills the engine process: a death that came with a requested stop is that stop.
        signalled = _run_until_stopped(server, sock)
        return "engine_dead" if died and not signalled else "stopped"
    finally:
        sock.close()
        async_llm.shutdown()


class _StopSignal(Exception):
    """SIGINT / SIGTERM, re-raised by uvicorn once its graceful shutdown is done."""


def _raise_stop(signum, _frame) -> None:
    raise _StopSignal(signum)


def _run_until_stopped(server, sock: socket.socket) -> bool:
    """server.run on `sock` until SIGINT / SIGTERM (or should_exit). uvicorn takes both signals
    while it serves, shuts down gracefully, then re-raises the signal to the handler it found:
    a KeyboardInterrupt traceback for SIGINT, a kill for SIGTERM. The handler found here ends
    the run instead, so that a requested stop is a normal return (`vllm serve` exits 0).
    Returns whether a signal stopped it."""
    if threading.current_thread() is not threading.main_thread():   # signals reach the main thread only
        server.run(sockets=[sock])
        return False
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
        return False
    except _StopSignal:
        return True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port), as uvicorn would bind it (SO_REUSEADDR, so a
    restart does not wait out TIME_WAIT); ValueError, one line, when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)   # uvicorn's default backlog
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def stop_server_on_engine_death(async_llm: AsyncLLM, server) -> None:
    """Once the engine stops by itself, tell `server` (uvicorn's Server: its main loop reads
    should_exit every tick) to shut down, as upstream's API server exits when its engine
    dies, so a restart policy can start a fresh one. Told by the AsyncLLM's output receiver
    the moment it finds the engine's pipe closed (AsyncLLM.on_engine_death): no thread
    polls the engine."""
    def stop(reason: str) -> None:
        logger.error("the engine process died (%s): shutting the API server down", reason)
        server.should_exit = True
    async_llm.on_engine_death(stop)
