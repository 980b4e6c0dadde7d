"""The server's LoRA adapters, with the real ``openai`` client on loopback: ``python -m hf_paged serve --lora-modules
name=path ...`` serves each adapter under its name (``model`` chooses it, vLLM's convention), concurrent requests of
several adapters and the base model each give the text of the PeftModel with that adapter generating alone;
``/v1/models`` lists the adapters with the base as ``parent``; an unknown model is a 404 naming what is served;
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` work only with ``--enable-lora-loading``."""

from __future__ import annotations

import shutil
import socket
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

pytest.importorskip("peft")

from test_serve import KEY, Server, tiny_lm, tiny_tokenizer  # noqa: E402

from helpers.engine_oracle import reference  # noqa: E402
from helpers.engine_shadow import one_thread  # noqa: E402
from helpers.lora import peft_model, save_adapters  # noqa: E402
from helpers.servers import ThreadedServer  # noqa: E402
from hf_paged.serve import cli  # noqa: E402

BASE = "tiny-base"
PROMPTS = ["What is the capital of France?", "Write a haiku about", "Explain the sky", "Three tips for"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()


class AppServer:
    """uvicorn serving ``app`` in a background thread on a loopback socket."""

    def __init__(self, app):
        served = ThreadedServer(app)
        self.url, self.server, self.thread = served.url, served.server, served.thread

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_lora")
    tokenizer = tiny_tokenizer()

    def make():
        return tiny_lm(tokenizer, seed=5)

    make().save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    paths = save_adapters(make, root / "adapters")
    args = cli.parser().parse_args([
        "--model", str(root / "model"), "--served-model-name", BASE, "--device", "cpu", "--dtype", "float32", "--api-key", KEY,
        "--max-memory", "64MiB", "--enable-lora-loading", "--lora-root", str(root / "adapters"), "--lora-modules", *(f"{n}={p}" for n, p in paths.items())])
    app, _ = cli.build(args)
    server = AppServer(app)
    yield server, tokenizer, make, paths
    server.close()


def expected_text(tokenizer, make, paths, adapter, prompt: str, n: int) -> str:
    model = make().eval() if adapter is None else peft_model(make, paths, adapter)
    ids = tokenizer(prompt)["input_ids"]
    return tokenizer.decode(reference(model, ids, n).tokens, skip_special_tokens=True)


def test_models_lists_adapters_with_parent(setup):
    server, _, _, paths = setup
    models = {m.id: m for m in server.client().models.list().data}
    assert set(models) == {BASE, *paths}
    assert models[BASE].model_extra["parent"] is None
    for name, path in paths.items():
        assert models[name].model_extra["parent"] == BASE
        assert models[name].model_extra["root"] == str(path)


def test_model_field_routes_to_the_adapter(setup):
    """Concurrent completions naming the base and each adapter: each equals its PeftModel alone."""
    server, tokenizer, make, paths = setup
    client = server.client()
    jobs = [(model, prompt) for prompt in PROMPTS for model in (BASE, *paths)]

    def ask(job):
        model, prompt = job
        out = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
        return out.model, out.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, jobs))
    texts = set()
    for (model, prompt), (answered_model, text) in zip(jobs, answers):
        assert answered_model == model
        adapter = None if model == BASE else model
        assert text == expected_text(tokenizer, make, paths, adapter, prompt, 6), (model, prompt)
        texts.add((prompt, text))
    assert len(texts) > len(PROMPTS)  # the adapters changed some outputs


def test_unknown_model_is_404_naming_the_loaded(setup):
    server, *_ = setup
    with pytest.raises(openai.NotFoundError) as err:
        server.client().completions.create(model="nope", prompt="hi", max_tokens=2)
    message = str(err.value)
    assert "'nope'" in message and BASE in message and "'a'" in message and "'c'" in message


def test_load_and_unload_endpoints(setup):
    """vLLM's endpoints: a new name loads and serves (equal to its PeftModel), unloads, then 404s."""
    server, tokenizer, make, paths = setup
    client = server.client()
    r = client.post("/load_lora_adapter", body={"lora_name": "again", "lora_path": str(paths["b"])}, cast_to=str)
    assert "again" in r
    assert "again" in {m.id for m in client.models.list().data}
    out = client.completions.create(model="again", prompt=PROMPTS[0], max_tokens=6, temperature=0)
    assert out.choices[0].text == expected_text(tokenizer, make, paths, "b", PROMPTS[0], 6)
    with pytest.raises(openai.BadRequestError, match="could not load"):
        client.post("/load_lora_adapter", body={"lora_name": "bad", "lora_path": "no/such/dir"}, cast_to=str)
    client.post("/unload_lora_adapter", body={"lora_name": "again"}, cast_to=str)
    assert "again" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="again", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.post("/unload_lora_adapter", body={"lora_name": "again"}, cast_to=str)


def test_loading_endpoints_off_by_default():
    tokenizer = tiny_tokenizer()
    server = Server(tiny_lm(tokenizer, seed=5), tokenizer, num_blocks=32)
    try:
        r = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"})
        assert r.status_code == 404 and "--enable-lora-loading" in r.text
    finally:
        server.close()


def test_run_time_loads_are_confined_pinned_and_capped(setup, tmp_path):
    """``--lora-root``: a lora_path outside it (absolute, ``..``, a symlink out), missing, or not an adapter gets one
    and the same message (nothing about the server's files leaks); ``--max-lora-rank`` refuses a higher rank by
    name; the ``--lora-modules`` adapters are pinned (not replaced, not unloaded, not evicted when the slots fill:
    the oldest run-time adapter makes room)."""
    _, tokenizer, make, paths = setup
    root = paths["a"].parent
    model_dir = root.parent / "model"
    outside = tmp_path / "outside"
    shutil.copytree(paths["c"], outside)
    (root / "escape").symlink_to(outside, target_is_directory=True)
    args = cli.parser().parse_args([
        "--model", str(model_dir), "--served-model-name", BASE, "--device", "cpu", "--api-key", KEY,
        "--max-memory", "32MiB", "--enable-lora-loading", "--lora-root", str(root), "--max-loras", "3",
        "--max-lora-rank", "6", "--lora-modules", f"a={paths['a']}", f"c={paths['c']}"])
    server = AppServer(cli.build(args)[0])
    client = server.client()

    def load(lora, path):
        return client.post("/load_lora_adapter", body={"lora_name": lora, "lora_path": path}, cast_to=str)

    try:
        messages = set()
        for path in ("/etc", "/no/such/dir", "../model", "escape", str(model_dir), "missing", str(outside)):
            with pytest.raises(openai.BadRequestError) as info:
                load("x", path)
            messages.add(info.value.body["message"])
        assert len(messages) == 1 and "--lora-root" in messages.pop()
        with pytest.raises(openai.BadRequestError, match="rank is 8.*--max-lora-rank"):
            load("x", "b")
        for call in (lambda: load("a", "c"), lambda: client.post("/unload_lora_adapter", body={"lora_name": "c"},
                                                                 cast_to=str)):
            with pytest.raises(openai.ConflictError, match="pinned"):
                call()
        load("x", "c")  # the third slot
        load("y", str(paths["a"]))  # full: x (run-time, idle) makes room, never a or c
        assert {m.id for m in client.models.list().data} == {BASE, "a", "c", "y"}
        out = client.completions.create(model="y", prompt=PROMPTS[1], max_tokens=5, temperature=0)
        assert out.choices[0].text == expected_text(tokenizer, make, paths, "a", PROMPTS[1], 5)
    finally:
        server.close()
        (root / "escape").unlink()


def test_lora_loading_needs_a_root_and_no_replicas():
    """--enable-lora-loading without --lora-root stops at start naming the flag; with --replicas it is refused (a
    load would reach one replica of several), naming --lora-modules as the way."""
    with pytest.raises(SystemExit, match="--lora-root"):
        cli.build(cli.parser().parse_args(["--enable-lora-loading"]))
    pytest.importorskip("ray")
    from hf_paged.serve import replicas

    with pytest.raises(SystemExit, match="--lora-modules"):
        replicas.check_flags(cli.parser().parse_args(["--replicas", "2", "--enable-lora-loading", "--lora-root",
                                                      "/tmp"]))
