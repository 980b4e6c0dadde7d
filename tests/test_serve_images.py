"""Images through the server: chat messages with ``image_url`` parts (data: URLs; remote and file: URLs only where
the server allows them), run through the model's processor and chat template into the engine; limits on count and
pixels; ``/v1/models`` says the model takes images. A tiny random LLaVA saved with a processor
(``helpers.vlm.save_tiny_llava``), served in-process (uvicorn in a thread) and by ``python -m hf_paged serve``."""

from __future__ import annotations

import base64
import io
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
Image = pytest.importorskip("PIL.Image")

from helpers.servers import ThreadedServer  # noqa: E402
from test_serve_media import loopback_only, servers  # noqa: E402,F401  (fixtures: loopback servers, the socket guard)
from helpers.vlm import save_tiny_llava  # noqa: E402
from transformers import AutoModelForImageTextToText, AutoProcessor  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged import BlockPool  # noqa: E402
from hf_paged.serve import ServeSettings, create_app  # noqa: E402
from hf_paged.serve.media import MediaPolicy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-llava"


def png_url(color=(200, 10, 10), size=(20, 24), fmt="PNG") -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def image_message(*urls, text="What is in this picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         *({"type": "image_url", "image_url": {"url": u}} for u in urls)]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vlm") / MODEL
    save_tiny_llava(path)
    return path


class Served:
    """The app over a real engine, in a uvicorn thread on a loopback socket."""

    def __init__(self, model_dir, policy: MediaPolicy):
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="sdpa").eval()
        self.processor = AutoProcessor.from_pretrained(model_dir)
        manager = hf_paged.init_continuous_batching(self.model, pool=BlockPool(num_blocks=64, block_size=8,
                                                                              prefix_caching=True))
        app = create_app(manager, self.processor.tokenizer, ServeSettings(model_name=MODEL, media=policy),
                         processor=self.processor)
        served = ThreadedServer(app)
        self.url, self.server, self.thread = served.url, served.server, served.thread
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def reference(self, color, max_new_tokens: int) -> str:
        """generate() alone on the same image (decoded the way the server decodes it)."""
        image = Image.open(io.BytesIO(base64.b64decode(png_url(color).split(",", 1)[1]))).convert("RGB")
        messages = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                                 {"type": "image", "image": image}]}]
        inputs = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True, return_tensors="pt")
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        return self.processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    Image.new("RGB", (16, 16), (0, 0, 255)).save(root / "blue.png")
    server = Served(model_dir, MediaPolicy(allowed_domains=("images.example",), file_root=root, max_images=2,
                                           max_pixels=40 * 40))
    server.root = root
    yield server
    server.close()


def status_of(served, messages) -> tuple[int, str]:
    with pytest.raises(openai.APIStatusError) as info:
        served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    return info.value.status_code, info.value.body["message"]


def test_chat_with_image_data_urls_equals_generate(served):
    """The openai client sends PNG and JPEG data URLs: each answer equals generate() alone on the same image, and two
    different images give their own answers."""
    for color in [(200, 10, 10), (10, 200, 10)]:
        out = served.client.chat.completions.create(model=MODEL, messages=image_message(png_url(color)),
                                                    max_tokens=8, temperature=0)
        assert out.choices[0].message.content == served.reference(color, 8)
        assert out.usage.prompt_tokens > 16  # the image's 16 placeholder tokens are in the prompt
    jpeg = served.client.chat.completions.create(model=MODEL, messages=image_message(png_url(fmt="JPEG")),
                                                 max_tokens=4, temperature=0)
    assert jpeg.choices[0].finish_reason in ("length", "stop")


def test_models_say_the_model_takes_images(served):
    """/v1/models lists the image modality; /tokenize counts a chat with an image as the engine will see it."""
    assert served.client.models.list().data[0].model_extra["input_modalities"] == ["text", "image"]
    body = {"model": MODEL, "messages": image_message(png_url())}
    out = httpx.post(served.url + "/tokenize", json=body, timeout=60).json()
    assert out["tokens"].count(served.model.config.image_token_id) == 16 and out["count"] > 16


def test_media_policy_and_limits(served):
    """Remote URLs outside the allowed domains, file: URLs outside the media root (one message whether the file
    exists or not), more images or pixels than the limits, and bad data URLs are 400s naming the problem; a file under
    the root is read. (Remote fetches: tests/test_serve_media.py, against loopback servers only.)"""
    status, message = status_of(served, image_message("https://elsewhere.example/cat.png"))
    assert status == 400 and "--allowed-media-domains" in message and "elsewhere.example" in message
    status, message = status_of(served, image_message("file:///etc/passwd"))
    assert status == 400 and "media root" in message and "passwd" not in message
    assert status_of(served, image_message("file:///no/such/file.png")) == (status, message)  # no existence leak
    out = served.client.chat.completions.create(model=MODEL, messages=image_message(
        (served.root / "blue.png").as_uri()), max_tokens=3)
    assert out.choices[0].finish_reason in ("length", "stop")
    status, message = status_of(served, image_message(png_url(), png_url(), png_url()))
    assert status == 400 and "at most 2" in message
    status, message = status_of(served, image_message(png_url(size=(60, 60))))
    assert status == 400 and "1,600 pixels" in message
    status, message = status_of(served, image_message("data:image/png;base64,not-base64!"))
    assert status == 400 and "base64" in message
    status, message = status_of(served, image_message("data:image/png;base64," + base64.b64encode(b"xx").decode()))
    assert status == 400 and "PNG, JPEG, WebP or GIF" in message


@pytest.mark.slow
def test_cli_serves_a_vision_model_directory(model_dir):
    """`python -m hf_paged serve --model DIR` on a VLM directory saved with its processor: the openai client's chat
    with a data: URL PNG answers; a remote URL is a 400."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "hf_paged", "serve", "--model", str(model_dir), "--port",
                             str(port), "--max-memory", "8MiB", "--threads", "1"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        assert client.models.list().data[0].model_extra["input_modalities"] == ["text", "image"]
        out = client.chat.completions.create(model=MODEL, messages=image_message(png_url()), max_tokens=6,
                                             temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop") and out.usage.prompt_tokens > 16
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=image_message("https://x.example/a.png"))
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


def test_remote_images_are_fetched_off_the_parsing_thread(model_dir, servers, loopback_only):
    """Through the app: an allowed host's image (a loopback server, its address allowed explicitly) gives the same
    answer as the same image in a data: URL; while one request's image drips in slowly, /tokenize and a data: URL
    chat answer at once (the fetch runs on the media pool, not the request-parsing thread), and the slow fetch ends
    at the time cap with a 400 saying so. No connection leaves loopback (``loopback_only``)."""
    a, _ = servers
    server = Served(model_dir, MediaPolicy(allowed_domains=("media.test",), allowed_networks=("127.0.0.1/32",),
                                           timeout_s=4.0))
    try:
        remote = server.client.chat.completions.create(
            model=MODEL, messages=image_message(f"http://media.test:{a.port}/img.png"), max_tokens=5, temperature=0)
        local = server.client.chat.completions.create(
            model=MODEL, messages=image_message(png_url()), max_tokens=5, temperature=0)
        assert remote.choices[0].message.content == local.choices[0].message.content

        def slow():
            return status_of(server, image_message(f"http://media.test:{a.port}/slow"))

        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(slow)
            time.sleep(0.5)
            start = time.monotonic()
            out = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "hello"}, timeout=30)
            server.client.chat.completions.create(model=MODEL, messages=image_message(png_url()), max_tokens=2)
            waited = time.monotonic() - start
            assert out.status_code == 200 and not pending.done()
            status, message = pending.result(timeout=30)
        assert waited < 2.5, f"other requests waited {waited:.1f} s behind a slow image fetch"
        assert status == 400 and "took over 4 s" in message
    finally:
        server.close()
