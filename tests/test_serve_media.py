"""The media fetcher (``hf_paged/serve/media.py``) against local HTTP servers on loopback: a fetch that succeeds, a
redirect re-checked against the allow list, names that resolve to private / link-local addresses refused before any
socket opens, byte and time caps, a pixel bomb refused from its header, formats other than PNG / JPEG / WebP / GIF
refused, errors without internals, and the loader's bounded pool and fetch rate.

Nothing here reaches past loopback, even if the code under test were wrong: the module's resolver is a stub (names
map to fixed addresses), ``socket.getaddrinfo`` refuses every name that is not a loopback literal, and
``socket.socket.connect`` refuses (and records) any address that is not loopback; each test fails if one was tried.
"""

from __future__ import annotations

import asyncio
import http.server
import io
import ipaddress
import socket
import struct
import threading
import time
import zlib

import pytest

Image = pytest.importorskip("PIL.Image")
from PIL import ImageFile  # noqa: E402

from hf_paged.serve import media  # noqa: E402
from hf_paged.serve.errors import APIError  # noqa: E402
from hf_paged.serve.media import MediaLoader, MediaPolicy  # noqa: E402

NAMES = {"media.test": ["127.0.0.1"], "other.test": ["127.0.0.2"], "meta.test": ["169.254.169.254"],
         "private.test": ["10.0.0.7"], "mixed.test": ["127.0.0.1", "10.0.0.7"], "v6meta.test": ["::ffff:169.254.1.1"]}


def _loopback(host) -> bool:
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """Every outbound connection and name lookup of the test stays on loopback; any other is refused and fails it."""
    tried: list = []
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
            tried.append(address)
            raise OSError("test guard: connection outside loopback refused")
        return real_connect(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if not _loopback(host) and host not in (None, "localhost"):
            tried.append(("lookup", host))
            raise socket.gaierror("test guard: no name lookups")
        return real_getaddrinfo(host, *args, **kwargs)

    def resolve(host, port):
        if host in NAMES:
            return NAMES[host]
        try:
            return [str(ipaddress.ip_address(host))]  # a literal address resolves to itself, as getaddrinfo does
        except ValueError:
            pass
        tried.append(("resolve", host))
        raise OSError("test guard: unknown name")

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(media, "resolve", resolve)
    yield tried
    assert tried == [], f"the test tried to reach past loopback: {tried}"


def png_bytes(size=(20, 24), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buf, format=fmt)
    return buf.getvalue()


def bomb_png(width: int, height: int) -> bytes:
    """A valid grey PNG of ``width x height`` zero pixels, a few KB compressed (decoding it takes width x height
    bytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    squeeze = zlib.compressobj(9)
    row = b"\0" * (width + 1)
    body = b"".join(squeeze.compress(row) for _ in range(height)) + squeeze.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", body) + chunk(b"IEND", b""))


class ImageServer:
    """An HTTP server on ``host`` (a loopback address) answering the paths of ``Handler``; ``other``: the port of
    the second server (redirect targets)."""

    other_port = 0

    def __init__(self, host: str):
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def send(self, status, body=b"", headers=()):
                self.send_response(status)
                for key, value in headers:
                    self.send_header(key, value)
                if not any(k == "Content-Length" for k, _ in headers):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                owner.hits.append(self.path)
                port = owner.port
                if self.path == "/img.png":
                    self.send(200, png_bytes(), [("Content-Type", "image/png")])
                elif self.path == "/img.webp":
                    self.send(200, png_bytes(fmt="WEBP"))
                elif self.path == "/img.gif":
                    self.send(200, png_bytes(fmt="GIF"))
                elif self.path == "/redirect-same":
                    self.send(302, headers=[("Location", f"http://media.test:{port}/img.png")])
                elif self.path == "/redirect-relative":
                    self.send(301, headers=[("Location", "/img.png")])
                elif self.path == "/redirect-other":
                    self.send(302, headers=[("Location", f"http://127.0.0.2:{ImageServer.other_port}/img.png")])
                elif self.path == "/redirect-meta":
                    self.send(302, headers=[("Location", f"http://meta.test:{port}/latest/meta-data/")])
                elif self.path == "/redirect-file":
                    self.send(302, headers=[("Location", "file:///etc/passwd")])
                elif self.path == "/redirect-loop":
                    self.send(302, headers=[("Location", "/redirect-loop")])
                elif self.path == "/big":
                    self.send(200, b"", [("Content-Length", str(64 << 20))])
                elif self.path == "/big-unsized":
                    self.send_response(200)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    for _ in range(64):
                        self.wfile.write(b"\0" * (64 << 10))
                elif self.path == "/slow":
                    self.send_response(200)
                    self.send_header("Content-Length", "100")
                    self.end_headers()
                    for _ in range(100):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(0.1)
                elif self.path == "/bomb.png":
                    self.send(200, owner.bomb)
                elif self.path == "/img.bmp":
                    self.send(200, png_bytes(fmt="BMP"))
                elif self.path == "/img.eps":
                    self.send(200, b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n")
                else:
                    self.send(404, b"nope")

        self.hits: list[str] = []
        self.bomb = bomb_png(6000, 6000)
        self.server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda *args: None  # a client that hung up on /slow or /big-unsized
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def servers():
    a, b = ImageServer("127.0.0.1"), ImageServer("127.0.0.2")
    ImageServer.other_port = b.port
    yield a, b
    a.close()
    b.close()


def policy(**kwargs) -> MediaPolicy:
    """Fetches from media.test (the loopback server, whose address is allowed explicitly), meta.test and
    private.test (allowed names whose addresses must still be refused)."""
    base = dict(allowed_domains=("media.test", "meta.test", "private.test", "mixed.test", "v6meta.test"),
                allowed_networks=("127.0.0.1/32",), timeout_s=2.0, max_bytes=1 << 20, max_pixels=40_000)
    return MediaPolicy(**{**base, **kwargs})


def refused(url: str, **kwargs) -> str:
    with pytest.raises(APIError) as info:
        media.load_images([{"role": "user", "content": [{"type": "image", "url": url}]}], policy(**kwargs))
    assert info.value.status == 400
    return info.value.body()["error"]["message"]


def loaded(url: str, **kwargs):
    out = media.load_images([{"role": "user", "content": [{"type": "image", "url": url}]}], policy(**kwargs))
    return out[0]["content"][0]["image"]


def test_fetch_from_an_allowed_host_and_formats(servers):
    """An allowed host's PNG, WebP and GIF are fetched and decoded (RGB); a redirect to the same allowed host,
    absolute or relative, is followed."""
    a, _ = servers
    for path in ("/img.png", "/img.webp", "/img.gif", "/redirect-same", "/redirect-relative"):
        image = loaded(f"http://media.test:{a.port}{path}")
        assert image.size == (20, 24) and image.mode == "RGB"
    assert "/redirect-same" in a.hits and a.hits.count("/img.png") >= 3


def test_redirects_are_checked_again(servers):
    """A redirect to a host outside the allow list (another loopback server), to an allowed name that resolves to
    the link-local metadata address, to a file: URL, or in a loop is refused, and the refused target is never
    contacted."""
    a, b = servers
    before = list(b.hits)
    message = refused(f"http://media.test:{a.port}/redirect-other")
    assert "'127.0.0.2'" in message and "redirect" in message
    assert b.hits == before  # the second server never saw a request
    assert "resolves to an address" in refused(f"http://media.test:{a.port}/redirect-meta")
    assert "'file'" in refused(f"http://media.test:{a.port}/redirect-file")
    assert "more than 3 times" in refused(f"http://media.test:{a.port}/redirect-loop")


def test_private_and_link_local_refused_before_connecting(loopback_only):
    """Names in the allow list that resolve to 10.x, 169.254.x (also as an IPv4-mapped IPv6 address), or to a mix
    of a public-looking and a private address, and literal loopback / private addresses, are refused from the
    resolution alone: the socket guard records no connection attempt."""
    for url in ("http://meta.test/latest/meta-data/", "http://private.test/a.png", "http://v6meta.test/a.png",
                "http://mixed.test/a.png"):
        assert "resolves to an address this server does not fetch from" in refused(url, allowed_networks=())
    for host in ("127.0.0.1", "10.0.0.7", "169.254.169.254", "[::1]"):
        assert "resolves to an address" in refused(f"http://{host}/a.png", allowed_networks=(),
                                                   allowed_domains=(host.strip("[]"),))
    assert loopback_only == []


def test_byte_and_time_caps(servers):
    """A declared length over the cap is refused before the body is read; an unsized body is cut at the cap; a
    sender that drips bytes is cut at the time cap for the whole fetch."""
    a, _ = servers
    assert "1,048,576 bytes" in refused(f"http://media.test:{a.port}/big")
    assert "1,048,576 bytes" in refused(f"http://media.test:{a.port}/big-unsized")
    start = time.monotonic()
    assert "took over 1 s" in refused(f"http://media.test:{a.port}/slow", timeout_s=1.0)
    assert time.monotonic() - start < 3


def test_pixel_bomb_refused_from_its_header(servers, monkeypatch):
    """A small PNG that declares 6000 x 6000 pixels is refused from its header: no image is ever decoded."""
    a, _ = servers
    decoded = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self.size) or real_load(self))
    assert len(a.bomb) < 200_000
    assert "40,000 pixels" in refused(f"http://media.test:{a.port}/bomb.png")
    assert decoded == []


def test_only_png_jpeg_webp_gif(servers):
    """BMP and EPS bytes (EPS would run Ghostscript where it is installed) are refused as formats, fetched or in a
    data: URL; a data: URL of another media type is refused by its type."""
    a, _ = servers
    for path in ("/img.bmp", "/img.eps"):
        assert "PNG, JPEG, WebP or GIF" in refused(f"http://media.test:{a.port}{path}")
    bmp = "data:image/png;base64," + __import__("base64").b64encode(png_bytes(fmt="BMP")).decode()
    assert "PNG, JPEG, WebP or GIF" in refused(bmp)
    assert "data URL must be" in refused("data:application/postscript;base64,JSFQUw==")


def test_errors_do_not_echo_internals(servers):
    """A refused connection, an HTTP error and an unknown scheme say what failed without an exception's text."""
    a, _ = servers
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    for url, expected in ((f"http://media.test:{closed}/a.png", "connection failed"),
                          (f"http://media.test:{a.port}/missing", "HTTP 404"),
                          ("gopher://media.test/a", "unsupported image URL scheme")):
        message = refused(url)
        assert expected in message
        assert "Errno" not in message and "Traceback" not in message and "[" not in message


def test_loader_is_bounded_and_off_the_caller_thread(servers):
    """The loader fetches on its own threads (the event loop stays free while a slow fetch runs), refuses requests
    past ``max_pending`` and remote fetches past ``fetches_per_s`` with 429."""
    a, _ = servers
    slow = [{"role": "user", "content": [{"type": "image", "url": f"http://media.test:{a.port}/slow"}]}]
    fast = [{"role": "user", "content": [{"type": "image", "url": f"http://media.test:{a.port}/img.png"}]}]

    async def run():
        loader = MediaLoader(policy(timeout_s=1.5, max_pending=1, fetches_per_s=2))
        pending = asyncio.ensure_future(loader.load(slow))
        await asyncio.sleep(0.2)
        tick = time.monotonic()
        await asyncio.sleep(0.05)  # the loop is not blocked by the fetch
        assert time.monotonic() - tick < 0.5
        with pytest.raises(APIError) as info:
            await loader.load(fast)
        assert info.value.status == 429 and "loading" in info.value.body()["error"]["message"]
        with pytest.raises(APIError):
            await pending
        statuses = []
        for _ in range(4):
            try:
                await loader.load(fast)
                statuses.append(200)
            except APIError as exc:
                statuses.append(exc.status)
        loader.close()
        return statuses

    statuses = asyncio.run(run())
    assert 429 in statuses and statuses[0] == 200
