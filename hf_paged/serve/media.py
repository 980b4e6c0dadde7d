"""Images in chat requests: ``image_url`` content parts turned into one prompt's processor outputs.

A chat message's content may hold ``{"type": "image_url", "image_url": {"url": ...}}`` parts (``protocol.py`` keeps
them as ``{"type": "image", "url": ...}`` beside the text parts). Here each URL is read under a :class:`MediaPolicy`:

* ``data:image/{png,jpeg,webp,gif};base64,...``: always;
* ``http(s)://host/...``: only when ``host`` (or a parent domain) is in ``allowed_domains``; the name is resolved
  once, every address it resolves to must be public (loopback, private, link-local, multicast and reserved addresses
  are refused unless ``allowed_networks`` names them), and the connection goes to that resolved address (pinned: a
  second lookup cannot swap it). Redirects (at most ``max_redirects``) are checked again in full; no proxy from the
  environment is used. A fetch stops at ``max_bytes`` (a ``Content-Length`` over it is refused before the body is
  read) and at ``timeout_s`` for the whole fetch, a slow sender included;
* ``file:///path``: only under ``file_root``;

with at most ``max_images`` images and ``max_pixels`` pixels (width x height, summed) per request. Each image is
opened header-first (``Image.open`` with PNG / JPEG / WebP / GIF only, then its size checked against what is left of
the pixel budget) and decoded (``load()``) only after. Errors name what was refused and why, never an exception's
text. Fetching and decoding run on a :class:`MediaLoader`'s own bounded thread pool, not on the request-parsing
thread, with a cap on the fetches in flight and on remote fetches per second (429 beyond). The images then go
through the model's processor with its chat template (``processor.apply_chat_template``), which gives ``input_ids``
with the image placeholders and the image tensors the engine takes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import http.client
import io
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from .errors import APIError

try:  # the 'multimodal' extra
    from PIL import Image, UnidentifiedImageError
except ImportError:  # pragma: no cover - checked where an image arrives
    Image = UnidentifiedImageError = None

DEFAULT_MAX_IMAGES = 8
DEFAULT_MAX_PIXELS = 20_000_000  # per request, all images together (about two 10-megapixel photos)
FETCH_TIMEOUT_S = 10.0
MAX_FETCH_BYTES = 16 << 20
MAX_REDIRECTS = 3
FETCH_WORKERS = 4
MAX_PENDING = 64  # requests with images queued or loading at once; more get 429
FETCHES_PER_S = 16.0  # remote image fetches per second, over all requests (a burst of as many is allowed)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
DATA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")
_READ = 64 << 10
_USER_AGENT = "hf_paged-media/1"


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from, how many, how large, and how fetching is bounded (the CLI's
    ``--allowed-media-domains``, ``--allowed-media-networks``, ``--media-root``, ``--max-images``,
    ``--max-image-pixels``, ``--max-image-bytes``, ``--media-fetch-timeout``).

    ``allowed_networks``: CIDRs a remote image's address may be in although not public (e.g. a private image store
    at ``10.1.2.0/24``); default none: only public addresses are fetched.
    """

    allowed_domains: tuple[str, ...] = ()
    file_root: Path | None = None
    max_images: int = DEFAULT_MAX_IMAGES
    max_pixels: int = DEFAULT_MAX_PIXELS
    allowed_networks: tuple[str, ...] = ()
    max_bytes: int = MAX_FETCH_BYTES
    timeout_s: float = FETCH_TIMEOUT_S
    max_redirects: int = MAX_REDIRECTS
    fetch_workers: int = FETCH_WORKERS
    max_pending: int = MAX_PENDING
    fetches_per_s: float = FETCHES_PER_S

    def networks(self) -> tuple:
        return tuple(ipaddress.ip_network(n, strict=False) for n in self.allowed_networks)


def has_images(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and any(p.get("type") == "image" for p in m["content"])
               for m in messages)


def _refused(message: str) -> APIError:
    return APIError(400, message, param="messages")


def _domain_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in (a.lower().lstrip(".") for a in allowed) if d)


def address_refused(address: str, networks: tuple = ()) -> bool:
    """Whether a remote image may not be fetched from ``address`` (an IP): anything but a public unicast address,
    unless one of ``networks`` holds it."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if any(ip in net for net in networks if net.version == ip.version):
        return False
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return address_refused(str(ip.ipv4_mapped), networks)
    return not ip.is_global or ip.is_multicast


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to ``host`` made to the already checked address ``ip`` (no second name lookup)."""

    def __init__(self, host: str, port: int, ip: str, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self._ip = ip

    def connect(self):
        self.sock = socket.create_connection((self._ip, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to the checked address ``ip``, the certificate verified against ``host``."""

    def __init__(self, host: str, port: int, ip: str, timeout: float):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._ip = ip

    def connect(self):
        sock = socket.create_connection((self._ip, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def resolve(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to (tests replace this with a stub: they never query a real resolver)."""
    return [info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


def fetch(url: str, policy: MediaPolicy) -> bytes:
    """The bytes of the remote image at ``url`` under ``policy`` (the module's rules); :class:`APIError` 400 naming
    what was refused."""
    networks = policy.networks()
    deadline = time.monotonic() + policy.timeout_s
    for hop in range(policy.max_redirects + 1):
        parts = urllib.parse.urlsplit(url)
        scheme, host = parts.scheme.lower(), (parts.hostname or "")
        if scheme not in ("http", "https"):
            raise _refused(f"an image URL redirected to a {scheme or 'relative'!r} URL; only http(s) is followed.")
        if not host or not _domain_allowed(host, policy.allowed_domains):
            raise _refused(f"remote image URLs are not allowed on this server for host {host!r}; send the image as a "
                           "data: URL (base64), or start the server with --allowed-media-domains "
                           f"{host or 'HOST'}" + (" (it was a redirect's target)." if hop else "."))
        try:
            port = parts.port or (443 if scheme == "https" else 80)
        except ValueError:
            raise _refused(f"the image URL for host {host!r} has an invalid port.") from None
        try:
            addresses = resolve(host, port)
        except (OSError, UnicodeError):
            raise _refused(f"the image host {host!r} does not resolve.") from None
        if not addresses or any(address_refused(a, networks) for a in addresses):
            raise _refused(f"the image host {host!r} resolves to an address this server does not fetch from "
                           "(loopback, private, link-local or reserved); --allowed-media-networks CIDR allows a "
                           "private network.")
        left = deadline - time.monotonic()
        if left <= 0:
            raise _refused(f"fetching the image from {host!r} took over {policy.timeout_s:g} s.")
        conn = (_PinnedHTTPS if scheme == "https" else _PinnedHTTP)(host, port, addresses[0], left)
        try:
            target = parts.path or "/"
            if parts.query:
                target += "?" + parts.query
            conn.request("GET", target, headers={"User-Agent": _USER_AGENT, "Accept": "image/*"})
            response = conn.getresponse()
            if response.status in (301, 302, 303, 307, 308):
                location = response.getheader("Location")
                if not location:
                    raise _refused(f"the image host {host!r} answered a redirect without a Location.")
                url = urllib.parse.urljoin(url, location)
                continue
            if response.status != 200:
                raise _refused(f"the image host {host!r} answered HTTP {response.status}.")
            return _read_capped(response, conn, host, policy, deadline)
        except APIError:
            raise
        except (TimeoutError, socket.timeout):
            raise _refused(f"fetching the image from {host!r} took over {policy.timeout_s:g} s.") from None
        except (OSError, http.client.HTTPException):
            raise _refused(f"could not fetch the image from {host!r} (the connection failed).") from None
        finally:
            conn.close()
    raise _refused(f"the image URL redirected more than {policy.max_redirects} times.")


def _read_capped(response, conn, host: str, policy: MediaPolicy, deadline: float) -> bytes:
    length = response.getheader("Content-Length")
    too_big = f"the image at {host!r} is larger than this server's limit of {policy.max_bytes:,} bytes."
    if length is not None and length.strip().isdigit() and int(length) > policy.max_bytes:
        raise _refused(too_big)
    chunks, size = [], 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _refused(f"fetching the image from {host!r} took over {policy.timeout_s:g} s.")
        if conn.sock is not None:
            conn.sock.settimeout(left)
        chunk = response.read1(_READ)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > policy.max_bytes:
            raise _refused(too_big)
        chunks.append(chunk)


def read_image_bytes(url: str, policy: MediaPolicy) -> bytes:
    """The bytes ``url`` names, under ``policy`` (:class:`APIError` 400 naming what is refused)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        head, _, payload = url.partition(",")
        kind = head[len("data:"):].split(";", 1)[0].lower()
        if kind not in DATA_TYPES or ";base64" not in head.lower():
            raise _refused("an image data URL must be 'data:image/png;base64,...' (or image/jpeg, image/webp, "
                           "image/gif).")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise _refused("the image data URL's base64 payload does not decode.") from None
    if scheme in ("http", "https"):
        return fetch(url, policy)
    if scheme == "file":
        if policy.file_root is None:
            raise _refused("file: image URLs are not allowed on this server; send a data: URL, or start it with "
                           "--media-root DIR.")
        root = Path(policy.file_root).resolve()
        nope = "a file: image URL must name a readable image file under the server's media root."
        try:
            path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()
            if not path.is_relative_to(root) or not path.is_file():
                raise _refused(nope)
            if path.stat().st_size > policy.max_bytes:
                raise _refused(f"the image file is larger than this server's limit of {policy.max_bytes:,} bytes.")
            return path.read_bytes()
        except OSError:
            raise _refused(nope) from None
    raise _refused(f"unsupported image URL scheme {scheme!r}: send a data: URL (base64 PNG, JPEG, WebP or GIF)"
                   + (" or an http(s) URL of an allowed domain." if policy.allowed_domains else "."))


def decode_image(data: bytes, pixels_left: int, max_pixels: int):
    """An RGB image from ``data``: PNG, JPEG, WebP or GIF (first frame) only, its header's size checked against
    ``pixels_left`` before anything is decoded."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError, SyntaxError):
        raise _refused("an image_url does not hold a PNG, JPEG, WebP or GIF image.") from None
    if image.width * image.height > pixels_left:
        raise _refused(f"the request's images hold more than {max_pixels:,} pixels (--max-image-pixels); send "
                       "smaller images.")
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError):
        raise _refused("an image_url's image does not decode (truncated or corrupt).") from None


def load_images(messages: list[dict], policy: MediaPolicy, fetched=None) -> list[dict]:
    """``messages`` with every ``{"type": "image", "url"}`` part's image decoded (a PIL image under ``"image"``),
    checked against ``policy``'s count and pixel limits. ``fetched()`` is called before each remote fetch (the
    loader's rate limit)."""
    if Image is None:
        raise _refused("this server cannot read images: pillow is not installed (pip install "
                       "'hf_paged[multimodal]').")
    count = sum(1 for m in messages if isinstance(m.get("content"), list)
                for p in m["content"] if p.get("type") == "image")
    if count > policy.max_images:
        raise _refused(f"the request holds {count} images; this server takes at most {policy.max_images} per request "
                       "(--max-images).")
    pixels, out = 0, []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            if part.get("type") != "image":
                parts.append(part)
                continue
            if fetched is not None and part["url"].split(":", 1)[0].lower() in ("http", "https"):
                fetched()
            image = decode_image(read_image_bytes(part["url"], policy), policy.max_pixels - pixels,
                                 policy.max_pixels)
            pixels += image.width * image.height
            parts.append({"type": "image", "image": image})
        out.append({**message, "content": parts})
    return out


class MediaLoader:
    """Fetches and decodes a request's images on its own bounded thread pool (``policy.fetch_workers`` threads), off
    the request-parsing thread; at most ``policy.max_pending`` requests wait or load at once and at most
    ``policy.fetches_per_s`` remote fetches start per second (a 429 with Retry-After beyond either).

    Example::

        loader = MediaLoader(MediaPolicy(allowed_domains=("images.example",)))
        messages = await loader.load(messages)   # image parts now hold PIL images
    """

    def __init__(self, policy: MediaPolicy):
        self.policy = policy
        self._pool = ThreadPoolExecutor(max(1, policy.fetch_workers), thread_name_prefix="hf_paged-media")
        self._pending = 0
        self._lock = threading.Lock()
        self._tokens = float(max(1.0, policy.fetches_per_s))
        self._refilled = time.monotonic()

    def _take_fetch(self) -> None:
        rate = self.policy.fetches_per_s
        with self._lock:
            now = time.monotonic()
            self._tokens = min(max(1.0, rate), self._tokens + (now - self._refilled) * rate)
            self._refilled = now
            if self._tokens < 1:
                raise APIError(429, f"this server fetches at most {rate:g} remote images per second; retry in 1 s.",
                               code="rate_limit_exceeded", headers={"Retry-After": "1"})
            self._tokens -= 1

    async def load(self, messages: list[dict]) -> list[dict]:
        with self._lock:
            if self._pending >= self.policy.max_pending:
                raise APIError(429, f"{self._pending} requests' images are loading; retry in 1 s.",
                               code="queue_full", headers={"Retry-After": "1"})
            self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, load_images, messages, self.policy,
                                                                    self._take_fetch)
        finally:
            with self._lock:
                self._pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def processor_inputs(processor, messages: list[dict], add_generation_prompt: bool = True,
                     template_kwargs: dict | None = None):
    """One prompt's processor outputs (batch 1: ``input_ids`` and the image tensors) for ``messages`` (images already
    loaded), through the processor's chat template (with the request's ``chat_template_kwargs``)."""
    if not getattr(processor, "chat_template", None):
        raise APIError(400, "this model's processor has no chat template; images need one.")
    return processor.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                         return_dict=True, return_tensors="pt", **(template_kwargs or {}))


def load_vision_model(path, dtype):
    """``(model, processor)`` of a local vision-language model directory (a config with a ``vision_config``, saved
    with its processor); None for any other model."""
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "vision_config", None) is None:
        return None
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    processor = AutoProcessor.from_pretrained(path)
    if getattr(processor, "tokenizer", None) is None:
        raise ValueError(f"{path}: its processor has no tokenizer; save the model with its processor "
                         "(processor.save_pretrained).")
    return model, processor
