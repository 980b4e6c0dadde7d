"""Calling an ASGI app in-process: its lifespan (startup, shutdown) and one HTTP request as a stream of messages.

A Ray Serve replica (``replicas.py``) holds the same FastAPI app ``python -m hf_paged serve`` runs under uvicorn, and
drives it with these two pieces instead of a socket: the app's routes, middleware, errors and drain stay one code path.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

ASGI = {"version": "3.0", "spec_version": "2.3"}
CANCEL_GRACE_S = 5.0  # after a disconnect, how long the app may take to finish its response before it is cancelled


class Lifespan:
    """Runs an ASGI app's lifespan protocol: :meth:`start` sends ``lifespan.startup`` and waits for the app's answer
    (raising if startup failed), :meth:`stop` sends ``lifespan.shutdown`` and waits for it to finish.

    Example::

        lifespan = Lifespan(app)
        await lifespan.start()   # the app's engine thread is running
        ...
        await lifespan.stop()    # the engine is stopped
    """

    def __init__(self, app):
        self.app = app
        self._to_app: asyncio.Queue = asyncio.Queue()
        self._from_app: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def _answer(self) -> dict:
        reply = asyncio.ensure_future(self._from_app.get())
        await asyncio.wait({reply, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if reply.done():
            return reply.result()
        reply.cancel()
        self._task.result()  # raises the app's error
        raise RuntimeError("the app's lifespan ended without answering")

    async def start(self) -> None:
        scope = {"type": "lifespan", "asgi": ASGI, "state": {}}
        self._task = asyncio.ensure_future(self.app(scope, self._to_app.get, self._from_app.put))
        await self._to_app.put({"type": "lifespan.startup"})
        message = await self._answer()
        if message["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app did not start: {message.get('message', message['type'])}")

    async def stop(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._to_app.put({"type": "lifespan.shutdown"})
        await self._answer()
        await self._task


async def request(app, method: str, path: str, query_string: bytes = b"", headers=(), body: bytes = b"",
                  client: tuple[str, int] = ("127.0.0.1", 0)) -> AsyncIterator[dict]:
    """The ASGI messages ``app`` sends for one HTTP request (``http.response.start``, then ``http.response.body``
    chunks), as they come. ``headers``: ``(name, value)`` byte pairs. Closing the iterator early (the caller went
    away) tells the app the client disconnected, gives it :data:`CANCEL_GRACE_S` seconds to wind down (a streamed
    response cancels its engine requests), then cancels it.

    Example::

        async for message in request(app, "POST", "/v1/completions", body=b'{"prompt": "Hi", "max_tokens": 4}',
                                     headers=[(b"content-type", b"application/json")]):
            print(message["type"], message.get("status"), message.get("body"))
    """
    scope = {"type": "http", "asgi": ASGI, "http_version": "1.1", "method": method, "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": query_string, "root_path": "", "headers": list(headers),
             "client": client, "server": ("127.0.0.1", 0), "state": {}}
    sent: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    pending_body = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if pending_body:
            return pending_body.pop()
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(scope, receive, sent.put)
        finally:
            sent.put_nowait(None)

    task = asyncio.ensure_future(run())
    try:
        while (message := await sent.get()) is not None:
            yield message
        await task  # the app's own error, if it raised after its last message
    finally:
        if not task.done():
            disconnected.set()
            await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
            task.cancel()
