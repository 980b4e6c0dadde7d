"""An app served on loopback for the server tests: uvicorn in a background thread on a free port."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


class ThreadedServer:
    """uvicorn serving ``app`` in a daemon thread on ``127.0.0.1`` (a free port); ``url``: its address."""

    def __init__(self, app, start_timeout_s: float = 60.0):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
