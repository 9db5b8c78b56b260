"""Bearer-key checks: the API key for /v1/ routes, the admin key for the routes that pause
the engine or change its weights."""
from __future__ import annotations

import hmac

from vllm.entrypoints.openai.errors import error_response


ADMIN_PATHS = ("/v1/pause", "/v1/resume", "/v1/weights/update", "/v1/weights/init_group", "/v1/weights/update_from_group",
               "/v1/weights/update_from_ipc", "/pause", "/resume", "/abort_requests",
               # upstream vLLM's weight transfer (rl.py)
               "/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
               "/abort_weight_update", "/update_weight_version", "/reset_prefix_cache",
               # TRL's server protocol (rl.py)
               "/init_communicator/", "/update_named_param/", "/close_communicator/", "/reset_prefix_cache/")
# generation routes outside /v1/ (TRL's server protocol): they need the API key like /v1/ ones
API_PATHS = ("/generate/", "/chat/", "/get_sequence_logprobs/")


class AuthMiddleware:
    """Bearer-key checks as plain ASGI (no per-chunk cost on streamed responses).
    Admin paths need the admin key when one is set, else the API key (when set); other /v1/
    paths and TRL's generation paths the API key."""

    def __init__(self, app, api_key: str | None, admin_key: str | None):
        self.app = app
        self.api_key = api_key
        self.admin_key = admin_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path = route_path(scope)
            need = None
            if self.admin_key and path in ADMIN_PATHS:
                need, what = self.admin_key, "the admin key"
            elif self.api_key and (path.startswith("/v1/") or path in API_PATHS or path in ADMIN_PATHS):
                need, what = self.api_key, "the API key"
            if need is not None and not _key_ok(_bearer(scope), need):
                resp = error_response(f"invalid or missing credentials: this endpoint needs {what} "
                                      "(Authorization: Bearer <key>)", 401)
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def route_path(scope) -> str:
    """The path the routes see: without the root_path prefix (--root-path) when the request
    carries it, as Starlette's router strips it, so "/prefix/v1/..." needs the key too."""
    path, root = scope["path"], scope.get("root_path") or ""
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):] or "/"
    return path


def _bearer(scope) -> bytes | None:
    """The bearer token's raw bytes: compared as bytes with the key's UTF-8, so a non-ASCII key
    matches the header a client sends for it (HTTP carries the UTF-8 bytes as they are)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return value[7:].strip() if value[:7].lower() == b"bearer " else None
    return None


def _key_ok(given: bytes | None, key: str) -> bool:
    return given is not None and hmac.compare_digest(given, key.encode())
