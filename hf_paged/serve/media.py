"""Images in chat requests: ``image_url`` content parts turned into one prompt's processor outputs.

A chat message's content may hold ``{"type": "image_url", "image_url": {"url": ...}}`` parts (``protocol.py`` keeps
them as ``{"type": "image", "url": ...}`` beside the text parts). Here each URL is read under a :class:`MediaPolicy`:

* ``data:image/png;base64,...`` / ``data:image/jpeg;base64,...``: always;
* ``http(s)://host/...``: only when ``host`` (or a parent domain) is in ``allowed_domains`` (400 otherwise);
* ``file:///path``: only under ``file_root`` (400 otherwise);

with at most ``max_images`` images and ``max_pixels`` pixels (width x height, summed) per request (400 beyond). The
images then go through the model's processor with its chat template (``processor.apply_chat_template``), which
gives ``input_ids`` with the image placeholders and the image tensors the engine takes
(``ContinuousBatchingManager.add_request`` with a mapping).
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from .errors import APIError

DEFAULT_MAX_IMAGES = 8
DEFAULT_MAX_PIXELS = 50_000_000  # per request, all images together (about six 12-megapixel photos)
FETCH_TIMEOUT_S = 10.0
MAX_FETCH_BYTES = 32 << 20


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from, and how many / how large (the CLI's ``--allowed-media-domains``,
    ``--media-root``, ``--max-images``, ``--max-image-pixels``)."""

    allowed_domains: tuple[str, ...] = ()
    file_root: Path | None = None
    max_images: int = DEFAULT_MAX_IMAGES
    max_pixels: int = DEFAULT_MAX_PIXELS


def has_images(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and any(p.get("type") == "image" for p in m["content"])
               for m in messages)


def _domain_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in (a.lower().lstrip(".") for a in allowed))


def read_image_bytes(url: str, policy: MediaPolicy) -> bytes:
    """The bytes ``url`` names, under ``policy`` (:class:`APIError` 400 naming what is refused)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        head, _, payload = url.partition(",")
        if not head.startswith("data:image/") or ";base64" not in head:
            raise APIError(400, "an image data URL must be 'data:image/png;base64,...' or 'data:image/jpeg;base64,"
                                "...'.", param="messages")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(400, "the image data URL's base64 payload does not decode.", param="messages") from None
    if scheme in ("http", "https"):
        host = urllib.parse.urlsplit(url).hostname or ""
        if not _domain_allowed(host, policy.allowed_domains):
            raise APIError(400, f"remote image URLs are not allowed on this server (host {host!r}); send the image "
                                "as a data: URL (base64), or start the server with --allowed-media-domains "
                                f"{host or 'HOST'}.", param="messages")
        try:
            with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:  # noqa: S310 (allowed hosts only)
                data = response.read(MAX_FETCH_BYTES + 1)
        except OSError as exc:
            raise APIError(400, f"could not fetch the image at {url}: {exc}.", param="messages") from None
        if len(data) > MAX_FETCH_BYTES:
            raise APIError(400, f"the image at {url} is larger than {MAX_FETCH_BYTES:,} bytes.", param="messages")
        return data
    if scheme == "file":
        if policy.file_root is None:
            raise APIError(400, "file: image URLs are not allowed on this server; send a data: URL, or start it "
                                "with --media-root DIR.", param="messages")
        path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()
        root = Path(policy.file_root).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            raise APIError(400, f"the file {path} is not a file under the server's media root {root}.",
                           param="messages")
        return path.read_bytes()
    raise APIError(400, f"unsupported image URL scheme {scheme!r}: send a data: URL (base64 PNG or JPEG).",
                   param="messages")


def load_images(messages: list[dict], policy: MediaPolicy) -> list[dict]:
    """``messages`` with every ``{"type": "image", "url"}`` part's image decoded (a PIL image under ``"image"``),
    checked against ``policy``'s count and pixel limits."""
    try:
        from PIL import Image, UnidentifiedImageError  # the 'multimodal' extra
    except ImportError:
        raise APIError(400, "this server cannot read images: pillow is not installed (pip install "
                            "'hf_paged[multimodal]').", param="messages") from None

    count = sum(1 for m in messages if isinstance(m.get("content"), list)
                for p in m["content"] if p.get("type") == "image")
    if count > policy.max_images:
        raise APIError(400, f"the request holds {count} images; this server takes at most {policy.max_images} per "
                            "request (--max-images).", param="messages")
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
            try:
                image = Image.open(io.BytesIO(read_image_bytes(part["url"], policy)))
                image.load()
            except (UnidentifiedImageError, OSError, Image.DecompressionBombError):
                raise APIError(400, "an image_url does not hold a PNG or JPEG image that decodes.",
                               param="messages") from None
            pixels += image.width * image.height
            if pixels > policy.max_pixels:
                raise APIError(400, f"the request's images hold more than {policy.max_pixels:,} pixels "
                                    "(--max-image-pixels); send smaller images.", param="messages")
            parts.append({"type": "image", "image": image.convert("RGB")})
        out.append({**message, "content": parts})
    return out


def processor_inputs(processor, messages: list[dict]):
    """One prompt's processor outputs (batch 1: ``input_ids`` and the image tensors) for ``messages`` (images already
    loaded), through the processor's chat template."""
    if not getattr(processor, "chat_template", None):
        raise APIError(400, "this model's processor has no chat template; images need one.")
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt")


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
