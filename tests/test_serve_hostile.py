"""The hostile-input run: ``python -m hf_paged serve --api-key K`` on a tiny vision-language model and on the embedded
SmolLM2, each sent requests a hostile or careless client sends. Every case is a 4xx naming the field (or the route's
guard), or is served; ``/health`` answers 200 after each; after one warm-up request (the first forward's one-time
allocations), the server's peak RSS grows by less than 256 MB over any one case; and no image fetch reaches a loopback or link-local address (a canary HTTP server on loopback, named by
``localhost``, ``127.0.0.1`` and ``[::1]`` in the allowed domains, must see no request; ``169.254.169.254`` is
allowed by name and must be refused from its address, before any connection).

Run alone: ``pytest -m slow tests/test_serve_hostile.py -s`` prints one line per case (status, field, RSS growth).
"""

from __future__ import annotations

import base64
import http.server
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
Image = pytest.importorskip("PIL.Image")

from helpers.vlm import save_tiny_llava  # noqa: E402
from test_serve_media import bomb_png  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEY = "hostile-key"
RSS_BUDGET = 256 << 20
AUTH = {"Authorization": f"Bearer {KEY}"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Canary:
    """A loopback HTTP server that records every request it gets (there must be none)."""

    def __init__(self):
        hits = self.hits = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                hits.append(self.path)
                self.send_response(302)
                self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _png(size=(20, 24), fmt="PNG") -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, (9, 99, 199)).save(buf, format=fmt)
    return f"data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}"


def _chat(*parts, **fields) -> dict:
    content = [{"type": "text", "text": "What is this?"}] + [{"type": "image_url", "image_url": {"url": u}}
                                                              for u in parts]
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 3, **fields}


def text_cases() -> list[tuple[str, str, str, object, dict, object]]:
    """``(name, method, path, body, headers, expected)``: expected is 200, or ``(status, field named)``."""
    msg = [{"role": "user", "content": "hi"}]
    cmpl = {"model": "m", "prompt": "Hello", "max_tokens": 3}
    return [
        ("no key: completions", "POST", "/v1/completions", cmpl, {}, (401, None)),
        ("no key: tokenize", "POST", "/tokenize", {"prompt": "hi"}, {}, (401, None)),
        ("no key: detokenize", "POST", "/detokenize", {"tokens": [1]}, {}, (401, None)),
        ("no key: models", "GET", "/v1/models", None, {}, (401, None)),
        ("no key: tokenizer_info", "GET", "/tokenizer_info", None, {}, (401, None)),
        ("body over 8 MiB", "POST", "/v1/completions", b"x" * (9 << 20), AUTH, (413, None)),
        ("tokenize body over 8 MiB", "POST", "/tokenize", b"x" * (9 << 20), AUTH, (413, None)),
        ("not JSON", "POST", "/v1/completions", b"{", AUTH, (400, None)),
        ("JSON nested 100k deep", "POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, AUTH, (400, None)),
        ("logit_bias 20k", "POST", "/v1/completions", {**cmpl, "logit_bias": {str(i): 1 for i in range(20_000)}},
         AUTH, (400, "logit_bias")),
        ("stop_token_ids 50k", "POST", "/v1/completions", {**cmpl, "stop_token_ids": list(range(50_000))}, AUTH,
         (400, "stop_token_ids")),
        ("bad_words 10k", "POST", "/v1/completions", {**cmpl, "bad_words": ["word"] * 10_000}, AUTH,
         (400, "bad_words")),
        ("bad word 100k chars", "POST", "/v1/completions", {**cmpl, "bad_words": ["w" * 100_000]}, AUTH,
         (400, "bad_words")),
        ("stop 1000", "POST", "/v1/completions", {**cmpl, "stop": ["a"] * 1000}, AUTH, (400, "stop")),
        ("n 1000", "POST", "/v1/completions", {**cmpl, "n": 1000}, AUTH, (400, "n")),
        ("max_tokens 1e9", "POST", "/v1/completions", {**cmpl, "max_tokens": 10**9}, AUTH, (400, "max_tokens")),
        ("prompt ids past vocab", "POST", "/v1/completions", {**cmpl, "prompt": [1, 10**9]}, AUTH, (400, "prompt")),
        ("1000 prompts", "POST", "/v1/completions", {**cmpl, "prompt": ["a"] * 1000}, AUTH, (400, "prompt")),
        ("5000 messages", "POST", "/v1/chat/completions", {"model": "m", "messages": msg * 5000}, AUTH,
         (400, "messages")),
        ("1000 tools", "POST", "/v1/chat/completions", {"model": "m", "messages": msg, "tools": [
            {"type": "function", "function": {"name": f"f{i}"}} for i in range(1000)]}, AUTH, (400, "tools")),
        ("template swap", "POST", "/v1/chat/completions", {"model": "m", "messages": msg, "chat_template_kwargs": {
            "chat_template": "{% for i in range(10**9) %}x{% endfor %}"}}, AUTH, (400, "chat_template_kwargs")),
        ("beams with temperature", "POST", "/v1/completions", {**cmpl, "use_beam_search": True, "n": 2,
                                                               "temperature": 0.7}, AUTH, (400, "temperature")),
        ("presence_penalty 5", "POST", "/v1/completions", {**cmpl, "presence_penalty": 5}, AUTH,
         (400, "presence_penalty")),
        ("unknown model", "POST", "/v1/completions", {**cmpl, "model": "../../etc/passwd"}, AUTH, (404, "model")),
        ("served: penalties", "POST", "/v1/completions", {**cmpl, "presence_penalty": 1, "frequency_penalty": 1},
         AUTH, 200),
        ("served: chat", "POST", "/v1/chat/completions", {"model": "m", "messages": msg, "max_tokens": 3}, AUTH, 200),
        ("served: tokenize", "POST", "/tokenize", {"prompt": "hi"}, AUTH, 200),
    ]


def image_cases(canary: int) -> list:
    bomb = "data:image/png;base64," + base64.b64encode(bomb_png(6000, 6000)).decode()
    eps = "data:image/png;base64," + base64.b64encode(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 9 9\n").decode()
    junk = "data:image/png;base64," + base64.b64encode(os.urandom(4 << 20)).decode()
    return [
        ("image: loopback by name", f"http://localhost:{canary}/a.png", (400, "messages")),
        ("image: loopback literal", f"http://127.0.0.1:{canary}/a.png", (400, "messages")),
        ("image: loopback v6", f"http://[::1]:{canary}/a.png", (400, "messages")),
        ("image: link-local metadata", "http://169.254.169.254/latest/meta-data/", (400, "messages")),
        ("image: not allowed", "https://example.com/a.png", (400, "messages")),
        ("image: file", "file:///etc/passwd", (400, "messages")),
        ("image: pixel bomb 6000x6000", bomb, (400, "messages")),
        ("image: EPS", eps, (400, "messages")),
        ("image: 4 MB of noise", junk, (400, "messages")),
        ("image: BMP", _png(fmt="BMP").replace("image/png", "image/bmp"), (400, "messages")),
        ("served: PNG", _png(), 200),
    ]


def _serve(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "hf_paged", "serve", "--api-key", KEY, "--port", str(port),
                             "--threads", "1", "--max-memory", "16MiB", "--served-model-name", "m",
                             "--log-level", "warning", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.5)


def _run(proc, url: str, cases: list) -> list[str]:
    """Each case once: its status (and named field) as expected, /health 200 after it, peak RSS growth bounded."""
    report, failures = [], []
    warm = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=120,  # the first forward's one-time setup
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert warm.status_code == 200, warm.text
    for name, method, path, body, headers, expected in cases:
        before = _peak_rss(proc.pid)
        content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        r = httpx.request(method, url + path, content=content, timeout=120,
                          headers={**headers, **({"Content-Type": "application/json"} if content else {})})
        grew = _peak_rss(proc.pid) - before
        param = None
        try:
            param = r.json().get("error", {}).get("param")
        except ValueError:
            pass
        healthy = httpx.get(url + "/health", timeout=30).status_code == 200
        want_status, want_param = (expected, None) if expected == 200 else expected
        ok = r.status_code == want_status and (want_param is None or param == want_param) and healthy \
            and grew < RSS_BUDGET
        report.append(f"{'ok ' if ok else 'BAD'} {name:32s} {r.status_code} param={param} "
                      f"rss+={grew / 2**20:.0f}MB healthy={healthy}")
        if not ok:
            failures.append(report[-1] + " " + r.text[:200])
    print("\n".join(report))
    assert not failures, failures
    return report


@pytest.mark.slow
def test_hostile_inputs_against_a_vision_model(tmp_path):
    """The text cases and the image cases against a tiny LLaVA served with loopback names allowed as media domains:
    every image URL naming loopback or link-local is refused, and the canary sees no request."""
    save_tiny_llava(tmp_path / "vlm")
    canary = Canary()
    proc, url = _serve(["--model", str(tmp_path / "vlm"), "--allowed-media-domains", "localhost", "127.0.0.1",
                        "::1", "169.254.169.254", "--max-image-pixels", "1000000"])
    try:
        cases = text_cases() + [(name, "POST", "/v1/chat/completions", _chat(u), AUTH, expected)
                                for name, u, expected in image_cases(canary.port)]
        cases.append(("image via /tokenize", "POST", "/tokenize", {"messages": _chat(
            f"http://localhost:{canary.port}/t.png")["messages"]}, AUTH, (400, "messages")))
        cases.append(("image via /tokenize, no key", "POST", "/tokenize", {"messages": _chat(
            f"http://localhost:{canary.port}/t.png")["messages"]}, {}, (401, None)))
        cases.append(("9 images", "POST", "/v1/chat/completions", _chat(*[_png()] * 9), AUTH, (400, "messages")))
        _run(proc, url, cases)
        assert canary.hits == [], f"the server fetched from loopback: {canary.hits}"
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
        canary.server.shutdown()


@pytest.mark.slow
def test_hostile_inputs_against_the_embedded_model():
    """The text cases against the embedded SmolLM2 (a real tokenizer and chat template); image parts to a text
    model are refused by name."""
    proc, url = _serve([])
    try:
        cases = text_cases() + [("image to a text model", "POST", "/v1/chat/completions",
                                 _chat("http://169.254.169.254/x.png"), AUTH, (400, "messages"))]
        _run(proc, url, cases)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
