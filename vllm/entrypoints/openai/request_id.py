"""The X-Request-Id response header (`vllm serve --enable-request-id-headers`, as upstream)."""
from __future__ import annotations

import uuid


class RequestIdHeaderMiddleware:
    """Every HTTP answer carries X-Request-Id: the request's own X-Request-Id when it sent one
    (the id its engine requests run under, serving.request_id), else a new uuid4 hex. Plain
    ASGI: the header goes on the response start, so streamed answers cost nothing per chunk."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        value = given if given else uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
