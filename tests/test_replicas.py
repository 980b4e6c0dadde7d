"""Replicas of the server on Ray Serve (``hf_paged/serve/replicas.py``), and the prefix hit every response reports.

The fast test pins ``usage.prompt_tokens_details.cached_tokens`` on the single-process server: the prompt tokens the
engine found in its prefix cache for that request (0 the first time, the prompt's full blocks the second time), the
same count the engine adds to its ``prefix_hit_tokens``, streamed or not.

The slow tests start a local Ray instance (no dashboard, half a CPU per replica) with two replicas of a tiny Llama
saved to a directory, behind one endpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from test_serve import BLOCK, KEY, MODEL, ROOT, Server, httpx, openai, tiny_lm, tiny_tokenizer


def _prefix_hits(server) -> int:
    return server.manager.stats().prefix_hit_tokens


def test_cached_tokens_report_each_requests_prefix_hit():
    """A repeated prompt reports its full blocks as cached (the engine's own count); a new one reports 0; the
    streamed usage chunk and the chat endpoint carry the same field."""
    tokenizer = tiny_tokenizer()
    server = Server(tiny_lm(tokenizer), tokenizer, num_blocks=64)
    try:
        client = server.client()
        prompt = "Explain why the sky is blue. " * 6
        ids = tokenizer(prompt)["input_ids"]
        assert len(ids) > 2 * BLOCK
        seen = []
        for _ in range(2):
            before = _prefix_hits(server)
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
            seen.append(r.usage.prompt_tokens_details.cached_tokens)
            assert seen[-1] == _prefix_hits(server) - before
        assert seen == [0, (len(ids) - 1) // BLOCK * BLOCK]

        other = client.completions.create(model=MODEL, prompt="Write a haiku about autumn leaves. " * 5, max_tokens=2)
        assert other.usage.prompt_tokens_details.cached_tokens == 0

        messages = [{"role": "system", "content": "You answer briefly and kindly. " * 6},
                    {"role": "user", "content": "Why is the sky blue?"}]
        first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        before = _prefix_hits(server)
        lines = server.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                                     "stream": True, "stream_options": {"include_usage": True}})
        chunks = [json.loads(line[len("data: "):]) for line in lines.text.splitlines()
                  if line.startswith("data: {")]
        cached = chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == _prefix_hits(server) - before
        assert cached == (first.usage.prompt_tokens - 1) // BLOCK * BLOCK > 0
    finally:
        server.close()


# -- two replicas on a local Ray instance (slow: Ray and three replica processes start) --------------------------------
APP = "hf_paged"
UP_S = 240  # Ray, its controller and proxy, two engine replicas and the ingress, on a shared 2-core VM
SYSTEMS = ["You are a terse assistant who answers questions about the weather in one line. " * 3,
           "You are a patient tutor who explains Python code step by step to beginners. " * 3]
QUESTIONS = ["Why is the sky blue?", "What is the capital of France?", "Write a haiku about", "Three tips for"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two engine replicas of a tiny Llama on Ray (half a CPU each), and the same model in a single-process server
    (the reference). Ray is shut down at the end, whatever happened."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from hf_paged.serve.cli import build, parser
    from hf_paged.serve.replicas import application

    tokenizer = tiny_tokenizer()
    lm = tiny_lm(tokenizer, seed=4)
    lm.generation_config.eos_token_id = None  # every completion runs to max_tokens
    model_dir = tmp_path_factory.mktemp("replicas") / "tiny"
    lm.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    reference = Server(lm, tokenizer, num_blocks=128)
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = parser().parse_args(["--model", str(model_dir), "--replicas", "2", "--replica-cpus", "0.5",
                                    "--ingress-cpus", "0.1", "--threads", "1", "--max-memory", "8MiB", "--dtype", "float32",
                                    "--api-key", KEY, "--drain-timeout", "10", "--log-level", "warning"])
        started = time.monotonic()
        serve.run(application(args, build), name=APP, route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        while len(_health(url).get("replicas", {})) < 2:
            assert time.monotonic() - started < UP_S, "the replicas did not come up"
            time.sleep(1)
        yield SimpleNamespace(url=url, reference=reference, tokenizer=tokenizer, ray=ray, model_dir=model_dir,
                              client=openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120))
    finally:
        reference.close()
        serve.shutdown()
        ray.shutdown()


def _health(url: str) -> dict:
    try:
        return httpx.get(url + "/health", timeout=10).json()
    except (httpx.TransportError, ValueError):
        return {}


def _replica_of(response) -> str:
    return response.headers["x-hf-paged-replica"]


def _stream_text(client, messages, max_tokens: int) -> tuple[str, str]:
    """(text, replica) of a streamed chat completion."""
    with client.chat.completions.with_streaming_response.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                                temperature=0, stream=True) as raw:
        replica = _replica_of(raw)
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    return text, replica


@pytest.mark.slow
def test_the_serve_command_with_replicas_answers_and_stops_on_sigterm(tmp_path):
    """``python -m hf_paged serve --replicas 2 --api-key K`` with no CPU flags starts a local Ray on this 2-CPU
    machine (each replica gets an equal share of the CPUs), answers the ``openai`` client (a second request with the
    same long prefix is a prefix hit on the replica that served the first), refuses a caller without the key at the
    ingress, and on SIGTERM drains (a stream under way runs to its end), stops Ray and exits 0, leaving no process of
    its session behind. (Runs before the module's own Ray instance starts.)"""
    pytest.importorskip("ray.serve")
    tokenizer = tiny_tokenizer()
    tiny_lm(tokenizer, seed=4).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "hf_paged", "serve", "--model", str(tmp_path), "--replicas", "2",
                             "--api-key", KEY, "--threads", "1", "--max-memory", "8MiB", "--port", str(port),
                             "--served-model-name", MODEL, "--log-level", "warning"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        while len(_health(url).get("replicas", {})) < 2:
            assert proc.poll() is None and time.monotonic() - started < UP_S, "".join(lines)[-4000:]
            time.sleep(1)
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
        assert r.status_code == 401
        prompt = SYSTEMS[0] + QUESTIONS[0]
        raws = [client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=4)
                for _ in range(2)]
        assert _replica_of(raws[0]) == _replica_of(raws[1])
        cached = [r.parse().usage.prompt_tokens_details.cached_tokens for r in raws]
        assert cached[0] == 0 and cached[1] == (raws[1].parse().usage.prompt_tokens - 1) // BLOCK * BLOCK
        # SIGTERM mid-stream: the stream still runs to its end (drain), then everything stops
        stream = client.completions.create(model=MODEL, prompt=QUESTIONS[1], max_tokens=200, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        chunks = [next(stream)]
        proc.send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert chunks[-1].usage.completion_tokens == 200
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert proc.wait(120) == 0, "".join(lines)[-4000:]
        deadline = time.monotonic() + 30
        while True:  # Ray's processes of this session go with it
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "processes of the server's session are left"
            time.sleep(0.5)
    finally:
        if proc.poll() is None or _session_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _session_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.slow
def test_replicas_answer_the_openai_client_as_one_server_does(replicas):
    """Chat, completions and a streamed chat through the Ray endpoint give the single-process server's greedy text;
    every response names the replica that served it."""
    ref = replicas.reference.client()
    seen = set()
    for q in QUESTIONS[:2]:
        raw = replicas.client.completions.with_raw_response.create(model=MODEL, prompt=q, max_tokens=12, temperature=0)
        got = raw.parse()
        assert got.choices[0].text == ref.completions.create(model=MODEL, prompt=q, max_tokens=12,
                                                              temperature=0).choices[0].text
        assert got.usage.completion_tokens == 12
        seen.add(_replica_of(raw))
        messages = [{"role": "user", "content": q}]
        raw = replicas.client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=10,
                                                                        temperature=0)
        want = ref.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                           temperature=0).choices[0].message.content
        assert raw.parse().choices[0].message.content == want
        text, replica = _stream_text(replicas.client, messages, 10)
        assert text == want
        seen |= {_replica_of(raw), replica}
    assert seen <= set(_health(replicas.url)["replicas"])


@pytest.mark.slow
def test_same_prefix_requests_go_to_the_replica_holding_it(replicas):
    """Requests sharing a system prompt go to one replica, where all but the first find the prefix cached
    (``usage.prompt_tokens_details.cached_tokens``); the aggregated /metrics labels each replica's figures."""
    placed = {}
    for s, system in enumerate(SYSTEMS):
        hits = []
        for q in QUESTIONS:
            raw = replicas.client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
                max_tokens=4, temperature=0)
            placed.setdefault(s, set()).add(_replica_of(raw))
            hits.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
        assert len(placed[s]) == 1, f"system prompt {s} was served by {placed[s]}"
        system_tokens = len(replicas.tokenizer(system)["input_ids"])
        assert all(h >= system_tokens - BLOCK for h in hits[1:]), hits
    metrics = httpx.get(replicas.url + "/metrics", timeout=30).text
    labelled = {line.split('replica="')[1].split('"')[0] for line in metrics.splitlines()
                if line.startswith("hf_paged_prefix_cache_hit_tokens_total{")}
    assert set().union(*placed.values()) <= labelled


@pytest.mark.slow
def test_a_replica_spanning_two_tensor_parallel_ranks(replicas, tmp_path):
    """``--replica-tp 2``: one replica runs its model over two gloo ranks (rank 0 in the replica, rank 1 its child),
    and answers with the single-process server's greedy text; deleting the application stops both ranks."""
    from test_distributed import _tp_unavailable

    reason = _tp_unavailable()
    if reason:
        pytest.skip(reason)
    from ray import serve

    from hf_paged.serve.cli import build, parser
    from hf_paged.serve.replicas import application

    args = parser().parse_args(["--model", str(replicas.model_dir), "--replicas", "1", "--replica-tp", "2",
                                "--replica-cpus", "0.5", "--ingress-cpus", "0.1", "--threads", "1",
                                "--max-memory", "8MiB", "--api-key", KEY, "--tp-timeout", "30",
                                "--log-level", "warning"])
    serve.run(application(args, build), name="tp", route_prefix="/tp", blocking=False)
    try:
        replica, = _health(replicas.url + "/tp")["replicas"].values()
        assert replica == {"status": "ok", "ranks": 2}
        client = openai.OpenAI(base_url=replicas.url + "/tp/v1", api_key=KEY, max_retries=0, timeout=120)
        ref = replicas.reference.client()
        for q in QUESTIONS[:2]:
            got = client.completions.create(model=MODEL, prompt=q, max_tokens=12, temperature=0)
            assert got.choices[0].text == ref.completions.create(model=MODEL, prompt=q, max_tokens=12,
                                                                  temperature=0).choices[0].text
        text, _ = _stream_text(client, [{"role": "user", "content": QUESTIONS[2]}], 10)
        assert text == ref.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[2]}],
                                                   max_tokens=10, temperature=0).choices[0].message.content
    finally:
        serve.delete("tp")


@pytest.mark.slow
def test_a_killed_replica_loses_no_request_that_had_not_started_streaming(replicas):
    """Under load on one replica (a shared prefix sends everything there), the replica is killed: every
    non-streamed request still completes with the right text (retried on the other replica), a stream cut
    mid-way ends with an error event, new requests are answered meanwhile, and Ray brings a second replica back."""
    ray = replicas.ray
    system = "You are a careful assistant who checks every answer twice before replying. " * 3
    prompts = [system + q for q in QUESTIONS] * 2
    ref = replicas.reference.client()
    want = {p: ref.completions.create(model=MODEL, prompt=p, max_tokens=120, temperature=0).choices[0].text
            for p in set(prompts)}
    before = set(_health(replicas.url)["replicas"])

    async def load():
        client = openai.AsyncOpenAI(base_url=replicas.url + "/v1", api_key=KEY, max_retries=0, timeout=180)
        first_token = asyncio.Event()
        victim = {}

        async def streamed():
            out = {"text": "", "error": None}
            async with client.completions.with_streaming_response.create(
                    model=MODEL, prompt=prompts[0], max_tokens=120, temperature=0, stream=True) as raw:
                victim.setdefault("id", _replica_of(raw))
                async for line in raw.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[len("data: "):])
                        if "error" in chunk:
                            out["error"] = chunk["error"]["message"]
                        else:
                            out["text"] += chunk["choices"][0]["text"]
                            first_token.set()
            return out

        async def whole(prompt):
            r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=120, temperature=0)
            return prompt, r.choices[0].text

        stream = asyncio.ensure_future(streamed())
        await asyncio.wait_for(first_token.wait(), 60)
        others = [asyncio.ensure_future(whole(p)) for p in prompts]
        await asyncio.sleep(0.2)
        actor = ray.get_actor(f"SERVE_REPLICA::{APP}#EngineReplica#{victim['id']}", namespace="serve")
        ray.kill(actor)
        fresh = await whole(QUESTIONS[0])  # answered while the killed replica is gone
        return victim["id"], await stream, await asyncio.gather(*others), fresh

    victim, streamed, done, fresh = asyncio.run(asyncio.wait_for(load(), 240))
    for prompt, text in done:
        assert text == want[prompt]
    metrics = httpx.get(replicas.url + "/metrics", timeout=30).text
    retried = next(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("hf_paged_replica_retries_total "))
    assert retried >= 1  # the requests in flight on the killed replica were sent again
    assert fresh[1] == ref.completions.create(model=MODEL, prompt=QUESTIONS[0], max_tokens=120,
                                              temperature=0).choices[0].text
    if streamed["error"] is not None:
        assert "died" in streamed["error"] and want[prompts[0]].startswith(streamed["text"])
    else:
        assert streamed["text"] == want[prompts[0]]
    deadline = time.monotonic() + UP_S
    while True:
        now = set(_health(replicas.url).get("replicas", {}))
        if len(now) == 2 and victim not in now:
            break
        assert time.monotonic() < deadline, f"Ray did not replace replica {victim}: {now} (before: {before})"
        time.sleep(1)


# -- the pieces of the replica layer, without Ray running ---------------------------------------------------------------
def test_prefix_table_matches_whole_leading_chunks_and_forgets_a_replica():
    """A replica holds a request's leading chunks only as far as their text is equal; a dropped replica holds
    nothing; the table keeps at most ``max_chunks`` keys, evicting the least recently used."""
    pytest.importorskip("ray.serve")
    from hf_paged.serve.prefix_router import PrefixTable, chunk_keys

    table = PrefixTable(chunk_chars=4, max_chunks=5)
    table.insert("abcdefghij", "r1")  # chunks abcd, efgh (ij is partial)
    table.insert("abcdxxxx", "r2")
    assert table.match("abcdefghzz", ["r1", "r2", "r3"]) == {"r1": 2, "r2": 1, "r3": 0}
    assert table.match("zbcdefgh", ["r1", "r2"]) == {"r1": 0, "r2": 0}  # same later chunk, different prefix
    assert table.sizes == {"r1": 2, "r2": 2}
    table.drop("r1")
    assert table.match("abcdefgh", ["r1", "r2"]) == {"r1": 0, "r2": 1} and "r1" not in table.sizes
    table.insert("0123456789abcdef", "r3")  # 4 more keys: 6 > 5, the least recently used (r2's "xxxx") goes
    assert len(table) == 5 and table.match("abcdxxxx", ["r2"]) == {"r2": 1} and table.sizes["r2"] == 1
    assert chunk_keys("abcdefgh", 4)[1] != chunk_keys("zzzzefgh", 4)[1]  # a key names its whole prefix


def test_routing_text_and_merged_metrics():
    """The text a request is routed by (chat roles and contents, a completion's prompt or ids; nothing for other
    paths), and /metrics of several replicas merged with a replica label, one family each."""
    pytest.importorskip("ray.serve")
    from prometheus_client.parser import text_string_to_metric_families

    from hf_paged.serve.ray_app import flags
    from hf_paged.serve.replicas import merge_metrics, routing_text

    chat = json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}).encode()
    assert routing_text("/v1/chat/completions", chat) == "system\nBe brief.\nuser\nHi\n"
    assert routing_text("/v1/completions", b'{"prompt": ["one", "two"]}') == "one"
    assert routing_text("/v1/completions", b'{"prompt": [5, 6, 7]}') == "5 6 7"
    assert routing_text("/v1/completions", b"not json") == "" == routing_text("/tokenize", b'{"prompt": "x"}')

    one = b"# HELP x_total things\n# TYPE x_total counter\nx_total{kind=\"a\"} 1.0\n"
    merged = merge_metrics({"r1": one, "r2": one.replace(b"1.0", b"2.0")}).decode()
    family, = text_string_to_metric_families(merged)
    assert {(s.labels["replica"], s.value) for s in family.samples if s.name == "x_total"} == {("r1", 1.0),
                                                                                               ("r2", 2.0)}
    assert flags({"replicas": "2", "no_prefix_caching": "true", "cors_origin": ["a", "b"], "api_key": None}) == [
        "--replicas", "2", "--no-prefix-caching", "--cors-origin", "a", "--cors-origin", "b"]


def test_replica_cpus_fit_the_machine_and_flags_that_cannot_combine(monkeypatch):
    """Without --replica-cpus, replicas get 1 CPU each where Ray has room beside the ingress, else an equal share
    (2 replicas on a 2-CPU instance: 0.95 each, which check_resources accepts); --enable-lora-loading is refused."""
    pytest.importorskip("ray.serve")
    from hf_paged.serve import replicas
    from hf_paged.serve.cli import parser

    for cpus, count, expected in ((2, 2, 0.95), (8, 2, 1.0), (2, 3, 0.63), (4, 4, 0.97)):
        monkeypatch.setattr(replicas.ray, "cluster_resources", lambda cpus=cpus: {"CPU": float(cpus)})
        args = parser().parse_args(["--replicas", str(count)])
        replicas.check_resources(args)
        assert args.replica_cpus == expected, (cpus, count)
    monkeypatch.setattr(replicas.ray, "cluster_resources", lambda: {"CPU": 2.0})
    args = parser().parse_args(["--replicas", "2", "--replica-cpus", "1.5"])
    with pytest.raises(SystemExit, match="--replica-cpus"):
        replicas.check_resources(args)  # what the user asked is kept, and refused by name
    with pytest.raises(SystemExit, match="--lora-modules"):
        replicas.check_flags(parser().parse_args(["--replicas", "2", "--enable-lora-loading"]))


def test_the_ingress_checks_the_key_before_reading_the_body():
    """The Ray ingress answers 401 to a caller without the key (413 past the body limit) without receiving one byte
    of the body, so no routing text is parsed or hashed for it; a caller with the key is forwarded."""
    pytest.importorskip("ray.serve")
    from starlette.requests import Request

    from hf_paged.serve.replicas import Ingress

    received = []

    def request(headers: dict, body: bytes = b'{"prompt": "hi"}'):
        async def receive():
            received.append(True)
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
                 "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
        return Request(scope, receive)

    class Stream:
        def __init__(self):
            self.items = iter([(200, [(b"content-type", b"application/json")]), b"{}"])

        async def __anext__(self):
            try:
                return next(self.items)
            except StopIteration:
                raise StopAsyncIteration from None

        def __aiter__(self):
            return self

        def cancel(self):
            pass

    class Handle:
        def options(self, **kwargs):
            return self

        @property
        def forward(self):
            return SimpleNamespace(remote=lambda forwarded: Stream())

    ingress = SimpleNamespace(api_key=KEY.encode(), max_body_bytes=100, engine=Handle(), retries=0, retried=0)
    r = asyncio.run(Ingress.forward(ingress, "v1/completions", request({})))
    assert r.status_code == 401 and received == []
    r = asyncio.run(Ingress.forward(ingress, "v1/completions", request({"Authorization": "Bearer wrong"})))
    assert r.status_code == 401 and received == []
    r = asyncio.run(Ingress.forward(ingress, "v1/completions", request({"Authorization": f"Bearer {KEY}",
                                                                        "Content-Length": "1000"})))
    assert r.status_code == 413 and received == []
    r = asyncio.run(Ingress.forward(ingress, "v1/completions", request({"Authorization": f"Bearer {KEY}"})))
    assert r.status_code == 200 and received
