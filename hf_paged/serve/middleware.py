"""The ASGI layer in front of the routes: request id, API key, body size limit, and one log line per request.

The one guard of the server: every route that costs work (generation, tokenization, image fetches, adapter loads,
``/v1/models``, anything not named below) needs the API key and gets the body limit; only ``OPEN_ROUTES`` (cheap,
read-only, what a load balancer and a metrics scraper call) stay open. Pure ASGI (no ``BaseHTTPMiddleware``), so
streamed responses and client disconnects pass through untouched.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from dataclasses import dataclass

from .errors import error_bytes

log = logging.getLogger("hf_paged.serve")

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
# The routes reachable without the API key: the liveness probe and the Prometheus scrape (as vLLM leaves them open).
OPEN_ROUTES = frozenset({"/health", "/metrics"})


def is_open(path: str) -> bool:
    """Whether ``path`` is served without the API key (``OPEN_ROUTES``)."""
    return path in OPEN_ROUTES


@dataclass
class RequestRecord:
    """What the log line says about one request; the route fills the token counts (never any text)."""

    id: str
    method: str
    path: str
    start: float
    status: int | None = None
    generation: object = None  # the route's Generation: prompt / completion tokens, first token time
    outcome: str = "ok"  # ok / disconnected / error

    def line(self) -> str:
        total = time.perf_counter() - self.start
        gen = self.generation
        parts = [f"request {self.id} {self.method} {self.path} status={self.status}"]
        if gen is not None:
            ttft = f"{gen.first_token_time - self.start:.3f}s" if gen.first_token_time is not None else "-"
            parts.append(f"prompt_tokens={gen.prompt_tokens} output_tokens={gen.completion_tokens} ttft={ttft}")
        parts.append(f"total={total:.3f}s outcome={self.outcome}")
        return " ".join(parts)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def authorized(headers, api_key: bytes) -> bool:
    """Whether raw ASGI ``headers`` carry ``Authorization: Bearer <api_key>`` (compared in constant time)."""
    given = _header({"headers": headers}, b"authorization") or ""
    scheme, _, token = given.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key)


UNAUTHORIZED = ("a valid API key is needed: send the header 'Authorization: Bearer <key>' with the key the server "
                "was started with.")


class ServeMiddleware:
    """Wraps the app. For every path but ``OPEN_ROUTES``: a missing or wrong ``Authorization: Bearer`` key is a
    401 (compared in constant time, before any byte of the body is read), a body over ``max_body_bytes`` a 413
    (before the route sees it), and each request gets one log line when its response ends. Every response carries
    ``X-Request-Id`` (the client's, or a new one).

    ``on_done(record)`` is called once per guarded request (metrics).
    """

    def __init__(self, app, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 on_done=None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.on_done = on_done

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = (_header(scope, b"x-request-id") or uuid.uuid4().hex)[:128]
        record = RequestRecord(request_id, scope["method"], scope["path"], time.perf_counter())
        scope.setdefault("state", {})["record"] = record
        id_header = (b"x-request-id", request_id.encode("latin-1", "replace"))

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), id_header]}
            await send(message)

        if is_open(scope["path"]):
            return await self.app(scope, receive, send_with_id)
        try:
            if self.api_key is not None and not self._authorized(scope):
                record.outcome = "error"
                return await self._error(send_with_id, 401, UNAUTHORIZED, extra=[(b"www-authenticate", b"Bearer")])
            receive = await self._limited_body(scope, receive, send_with_id, record)
            if receive is None:
                return
            await self.app(scope, receive, send_with_id)
        except BaseException:
            record.outcome = "disconnected" if record.outcome == "ok" else record.outcome
            raise
        finally:
            if record.status is None:
                record.outcome = "disconnected"
            log.info(record.line())
            if self.on_done is not None:
                self.on_done(record)

    def _authorized(self, scope) -> bool:
        return authorized(scope.get("headers", ()), self.api_key)

    async def _error(self, send, status: int, message: str, extra=()):
        body = error_bytes(status, message)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), *extra]})
        await send({"type": "http.response.body", "body": body})

    async def _limited_body(self, scope, receive, send, record):
        """Reads the whole body (refusing it past the limit), then hands the route a receive that replays it."""
        limit = self.max_body_bytes
        declared = _header(scope, b"content-length")
        too_big = (f"the request body is over this server's limit of {limit:,} bytes; send a shorter prompt or "
                   "start the server with a larger --max-body-bytes.")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            record.outcome = "error"
            await self._error(send, 413, too_big.replace("is over", f"({int(declared):,} bytes) is over"))
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                record.outcome = "disconnected"
                return None
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                record.outcome = "error"
                await self._error(send, 413, too_big)
                return None
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replaying_receive():
            return replay.pop() if replay else await receive()

        return replaying_receive
