"""Replicas of the server on Ray Serve: ``python -m hf_paged serve --replicas N`` (the ``replicas`` extra).

Two deployments make one application:

- ``EngineReplica`` (N of them, or autoscaled between bounds): each loads the model and builds the very app
  ``python -m hf_paged serve`` runs (``cli.build``: the model, the pool, one engine, the FastAPI routes and
  middleware), and answers requests by calling that app in-process (``asgi.py``). With ``--replica-tp T`` a replica
  is T tensor-parallel ranks: its own process is rank 0, ranks 1..T-1 its children (``serve/distributed.py``). Each response carries the header
  ``x-hf-paged-replica`` (the replica's id), and each request's log line names the replica.
- ``Ingress`` (the HTTP entry, behind Ray Serve's proxy): reads the body, renders the prompt text a request is routed by
  and hands the request to one engine replica through a deployment handle, whose request router
  (:class:`~hf_paged.serve.prefix_router.PrefixAffinityRouter` by default, or Ray's power of two choices) picks the
  replica. The proxy cannot route by prefix itself: it forwards a request before reading its body.

Faults: a replica that dies before any byte of its response reached the client is retried on another replica (up
to ``retries`` times); one that dies mid-stream ends the stream with an error event naming the replica (the client
retries). Ray starts a new replica in its place and the router forgets the dead one. An engine whose thread
stopped fails Ray's health check, so Ray replaces that replica too. Shutdown drains: each replica stops taking new
requests and finishes its running ones (up to ``--drain-timeout`` seconds) before its engine stops.

``/health`` and ``/metrics`` are aggregated over the replicas: ``/health`` answers 200 while one replica's engine
runs (listing each replica's state), ``/metrics`` is every replica's Prometheus text with a ``replica`` label, plus
the ingress's retry counter.
"""

# No ``from __future__ import annotations`` here: Ray Serve's ingress re-signs the route methods, and FastAPI must see
# ``Request`` itself, not its name, to hand the request in.
import argparse
import asyncio
import json
import logging
import math
import multiprocessing
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from . import asgi
from .distributed import init_process_group, tp_loader
from .distributed import serve as serve_distributed
from .errors import error_body
from .metrics import CONTENT_TYPE, PREFIX
from .middleware import DEFAULT_MAX_BODY_BYTES, UNAUTHORIZED, authorized, is_open
from .prefix_router import PrefixAffinityRouter

log = logging.getLogger("hf_paged.serve")

APP_NAME = "hf_paged"
REPLICA_HEADER = "x-hf-paged-replica"
RETRIES = 2  # other replicas a request is retried on when its replica dies before answering
MAX_ONGOING = 256  # requests in flight per engine replica (Ray's default, 5, would starve continuous batching)
FANOUT_TIMEOUT_S = 10.0
RETRY_PAUSE_S = 0.2
# not passed back: the ingress sets its own framing, and Ray's proxy its own x-request-id (the same id)
_HOP_HEADERS = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"x-request-id"}


@dataclass
class Forwarded:
    """One HTTP request as the ingress hands it to an engine replica. ``prompt`` is the text the router matches
    prefixes on (:func:`routing_text`); the replica answers from ``method``, ``path``, ``headers`` and ``body``."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    prompt: str = ""


def routing_text(path: str, body: bytes) -> str:
    """The prompt text a request's prefix is matched on: chat messages as ``role\\ncontent\\n`` lines, a completion's
    prompt (the first one of a batch; token ids as space-separated numbers); ``""`` when there is none (no prefix
    to follow: routed by load). Never raises: a malformed body is the replica's to refuse.

    Example::

        >>> routing_text("/v1/chat/completions", b'{"messages": [{"role": "system", "content": "Be brief."}]}')
        'system\\nBe brief.\\n'
    """
    if not path.startswith("/v1/") or not body:
        return ""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(data, dict):
        return ""
    messages = data.get("messages")
    if isinstance(messages, list):
        lines = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts: their text
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            lines.append(f"{m.get('role', '')}\n{content if isinstance(content, str) else ''}\n")
        return "".join(lines)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts: routed by its first
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def merge_metrics(scrapes: dict[str, bytes]) -> bytes:
    """Prometheus text of several replicas as one exposition, each sample labelled ``replica="<id>"``."""
    families: dict[str, object] = {}
    for replica, text in sorted(scrapes.items()):
        for family in text_string_to_metric_families(text.decode()):
            family.samples = [type(s)(s.name, {**s.labels, "replica": replica}, *s[2:]) for s in family.samples]
            merged = families.setdefault(family.name, family)
            if merged is not family:
                merged.samples.extend(family.samples)

    class _Families:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families())
    return generate_latest(registry)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tp_follower(args: argparse.Namespace, build, rank: int, env: dict) -> None:
    """Rank ``rank`` > 0 of a tensor-parallel replica: the follower of ``python -m hf_paged serve --tp-plan`` (it
    runs the steps the replica's rank 0 announces, and leaves when rank 0 stops or is gone)."""
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    serve_distributed(args, build)


class EngineReplica:
    """One replica: the model, one engine and the app of ``python -m hf_paged serve`` (``build(args)``), called
    in-process. ``args``: the CLI's parsed flags; ``build``: ``hf_paged.serve.cli.build``. With ``--replica-tp N``
    the replica spans N devices: this process is rank 0 (it serves), and starts ranks 1..N-1 as its children, each
    on its own device of the replica's (Ray gives the replica N GPUs)."""

    async def __init__(self, args: argparse.Namespace, build):
        self.replica = serve.get_replica_context().replica_id.unique_id
        _log_with_replica(self.replica, args.log_level)
        self.followers, load = [], None
        if args.replica_tp and args.replica_tp > 1:
            args.tp_plan = args.tp_plan or "auto"  # this replica's own copy of the flags
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(args.replica_tp)}
            spawn = multiprocessing.get_context("spawn")
            self.followers = [spawn.Process(target=_tp_follower, args=(args, build, rank, env), daemon=True,
                                            name=f"hf_paged-tp-rank{rank}") for rank in range(1, args.replica_tp)]
            for follower in self.followers:
                follower.start()
            os.environ.update(env, RANK="0", LOCAL_RANK="0")
            init_process_group(args.tp_timeout)
            load = tp_loader(args.tp_plan)
        self.app, what = build(args, load=load)
        self.engine = self.app.state.engine
        self.lifespan = asgi.Lifespan(self.app)
        await self.lifespan.start()
        log.info("replica %s serving %s", self.replica, what)

    async def forward(self, request: Forwarded):
        """The app's answer to ``request``: first ``(status, headers)``, then the body's chunks (bytes), streamed."""
        async for message in asgi.request(self.app, request.method, request.path, request.query_string,
                                          request.headers, request.body):
            if message["type"] == "http.response.start":
                out = [(k, v) for k, v in message.get("headers", []) if k.lower() not in _HOP_HEADERS]
                yield message["status"], [*out, (REPLICA_HEADER.encode(), self.replica.encode())]
            elif message["type"] == "http.response.body" and message.get("body"):
                yield message["body"]

    async def _get(self, path: str) -> tuple[int, bytes]:
        status, body = 500, b""
        async for message in asgi.request(self.app, "GET", path):
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                body += message.get("body", b"")
        return status, body

    async def health(self) -> dict:
        """``{"replica", "status", "body", "ranks"}``: this replica's ``/health`` and its tensor-parallel ranks."""
        status, body = await self._get("/health")
        return {"replica": self.replica, "status": status, "body": json.loads(body or b"null"),
                "ranks": 1 + sum(f.is_alive() for f in self.followers)}

    async def metrics(self) -> tuple[str, bytes]:
        """``(replica id, Prometheus text)``: this replica's ``/metrics``."""
        return self.replica, (await self._get("/metrics"))[1]

    def check_health(self) -> None:
        """Ray Serve's health check: an engine whose thread stopped makes Ray replace this replica."""
        if not self.engine.manager.is_running():
            raise RuntimeError(f"replica {self.replica}: the engine thread is not running "
                               f"({getattr(self.engine.manager, 'error', None)})")

    async def __del__(self):
        # Ray Serve calls this after the replica stopped taking requests and its running ones finished (or
        # graceful_shutdown_timeout_s passed): the app's shutdown stops the engine (and, tensor-parallel, every rank).
        await self.lifespan.stop()
        for follower in self.followers:
            await asyncio.to_thread(follower.join, 30)
            if follower.is_alive():
                follower.kill()


def _log_with_replica(replica: str, level: str) -> None:
    """Every ``hf_paged.serve`` line of this process (each request's line included) names the replica."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s hf_paged.serve replica={replica}: "
                                           "%(message)s"))
    logger = logging.getLogger("hf_paged.serve")
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


async def _next_or_none(stream):
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else 'no details'}"


def _respond(status: int, headers: list, first: bytes | None, stream) -> StreamingResponse:
    """The replica's response, streamed on; a replica lost mid-stream ends it with an error event (event streams)."""
    sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
    replica = next((v.decode() for k, v in headers if k.lower() == REPLICA_HEADER.encode()), "?")

    async def body():
        try:
            if first is not None:
                yield first
            async for chunk in stream:
                yield chunk
        except RayActorError as exc:
            log.warning("replica %s died mid-response: %s", replica, _why(exc))
            if not sse:
                raise
            message = (f"replica {replica} died mid-stream ({_why(exc)}); the text so far is incomplete: retry "
                       "the request.")
            yield b"data: " + json.dumps(error_body(503, message)).encode() + b"\n\ndata: [DONE]\n\n"
        finally:
            stream.cancel()

    out = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k.lower() != b"content-type"}
    media = next((v.decode("latin-1") for k, v in headers if k.lower() == b"content-type"), None)
    return StreamingResponse(body(), status_code=status, headers=out, media_type=media)


async def _limited_body(request: Request, limit: int) -> bytes | None:
    """The request's body, or None once it is over ``limit`` bytes (declared or read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


# serve.ingress copies the class when it decorates it: what its methods use is defined above it.
ingress_app = FastAPI(title="hf_paged replicas", docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(ingress_app)
class Ingress:
    """The HTTP entry: aggregated ``/health`` and ``/metrics``; every other request goes to one engine replica,
    chosen by the engine deployment's request router, and is retried on another when its replica dies before
    answering (``retries`` times)."""

    def __init__(self, engine: DeploymentHandle, retries: int = RETRIES, api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.engine = engine
        self.retries = retries
        self.retried = 0  # requests sent again after their replica died
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    @ingress_app.get("/health")
    async def health(self):
        results = await self.engine.broadcast("health").results_async(timeout_s=FANOUT_TIMEOUT_S,
                                                                       return_exceptions=True)
        replicas, up = {}, 0
        for r in results:
            if isinstance(r, BaseException):
                continue  # a replica that died meanwhile: Ray replaces it
            replicas[r["replica"]] = {"status": "ok" if r["status"] == 200 else r["body"], "ranks": r["ranks"]}
            up += r["status"] == 200
        if not up:
            return JSONResponse({**error_body(503, "no engine replica is running; Ray restarts failed replicas "
                                                   "(see the replicas' logs)"), "replicas": replicas},
                                status_code=503)
        return {"status": "ok", "replicas": replicas}

    @ingress_app.get("/metrics")
    async def metrics(self):
        results = await self.engine.broadcast("metrics").results_async(timeout_s=FANOUT_TIMEOUT_S,
                                                                        return_exceptions=True)
        body = merge_metrics({r[0]: r[1] for r in results if not isinstance(r, BaseException)})
        body += (f"# HELP {PREFIX}_replica_retries_total Requests sent again after their replica died before "
                 f"answering\n# TYPE {PREFIX}_replica_retries_total counter\n"
                 f"{PREFIX}_replica_retries_total {self.retried}\n").encode()
        return Response(body, media_type=CONTENT_TYPE)

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(self, path: str, request: Request):
        path = "/" + path
        # the replica's middleware checks again; here nothing of the body is read (or parsed, or hashed for routing)
        # for a caller without the key, nor past the body limit
        if self.api_key is not None and not is_open(path) and not authorized(request.headers.raw, self.api_key):
            return JSONResponse(error_body(401, UNAUTHORIZED), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        body = await _limited_body(request, self.max_body_bytes)
        if body is None:
            return JSONResponse(error_body(413, f"the request body is over this server's limit of "
                                                f"{self.max_body_bytes:,} bytes; send a shorter prompt or start the "
                                                "server with a larger --max-body-bytes."), status_code=413)
        forwarded = Forwarded(request.method, path, request.url.query.encode(), list(request.headers.raw), body,
                              routing_text(path, body))
        lost = []
        for attempt in range(self.retries + 1):
            stream = self.engine.options(stream=True).forward.remote(forwarded)
            try:
                status, headers = await stream.__anext__()
                first = await _next_or_none(stream)  # held back: until a byte is sent, a lost replica is retried
            except (RayActorError, StopAsyncIteration) as exc:
                stream.cancel()
                lost.append(_why(exc))
                if attempt < self.retries:
                    self.retried += 1
                    log.warning("a replica died before answering %s %s (%s); retrying on another", request.method,
                                path, lost[-1])
                    await asyncio.sleep(RETRY_PAUSE_S * (attempt + 1))  # the router learns of the death meanwhile
                continue
            return _respond(status, headers, first, stream)
        return JSONResponse(error_body(503, f"the replicas serving this request died before answering "
                                            f"({'; '.join(lost)}); retry the request."), status_code=503)


# -- deployment -------------------------------------------------------------------------------------------------------
def application(args: argparse.Namespace, build) -> serve.Application:
    """The Ray Serve application for the CLI's parsed ``args`` (``--replicas``, ``--max-replicas``,
    ``--replica-cpus``, ``--replica-gpus``, ``--routing``, and every flag of ``python -m hf_paged serve``);
    ``build``: ``hf_paged.serve.cli.build``.

    Example::

        args = cli.parser().parse_args(["--model", "/models/m", "--replicas", "2", "--replica-gpus", "1"])
        serve.run(application(args, cli.build), name="hf_paged", route_prefix="/")
    """
    check_flags(args)
    gpus = replica_gpus(args)
    if args.max_replicas and args.max_replicas > args.replicas:
        scaling = {"autoscaling_config": AutoscalingConfig(
            min_replicas=args.min_replicas if args.min_replicas is not None else args.replicas,
            initial_replicas=args.replicas, max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing)}
    else:
        scaling = {"num_replicas": args.replicas}
    # pow2: Ray's default router (power of two choices)
    router = RequestRouterConfig(request_router_class=PrefixAffinityRouter) if args.routing == "prefix" \
        else RequestRouterConfig()
    engine = serve.deployment(EngineReplica).options(
        name="EngineReplica", **scaling, max_ongoing_requests=MAX_ONGOING,
        ray_actor_options={"num_cpus": args.replica_cpus if args.replica_cpus is not None else 1.0,
                           "num_gpus": gpus},
        request_router_config=router,
        graceful_shutdown_timeout_s=args.drain_timeout, graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=5.0, health_check_timeout_s=30.0)
    ingress = serve.deployment(Ingress).options(name="Ingress", max_ongoing_requests=4 * MAX_ONGOING,
                                                ray_actor_options={"num_cpus": args.ingress_cpus})
    return ingress.bind(engine.bind(args, build), RETRIES, args.api_key,
                        args.max_body_bytes or DEFAULT_MAX_BODY_BYTES)


def check_flags(args: argparse.Namespace) -> None:
    """Refuse (naming why and what to do) flags that do not combine with replicas."""
    if getattr(args, "enable_lora_loading", False):
        raise SystemExit("--enable-lora-loading with --replicas: a run-time load would reach only the replica that "
                         "answers it, so replicas would serve different adapters under one name; load the adapters "
                         "at start on every replica with --lora-modules NAME=PATH.")


def fit_cpus(args: argparse.Namespace) -> None:
    """``--replica-cpus`` when not given: 1 per replica where the Ray instance has that many (beside the
    ingress's), else an equal share of what it has, so ``--replicas 2`` starts on a 2-CPU machine (Ray's CPUs are a
    reservation for placement, not a thread count: ``--threads`` sets a replica's torch threads)."""
    if args.replica_cpus is not None:
        return
    have = ray.cluster_resources().get("CPU", 0)
    replicas = args.min_replicas if args.max_replicas and args.min_replicas is not None else args.replicas
    share = (have - args.ingress_cpus) / max(replicas, 1)
    args.replica_cpus = 1.0 if share >= 1.0 else max(0.01, math.floor(share * 100 + 1e-6) / 100)


def replica_gpus(args: argparse.Namespace) -> float:
    """GPUs per replica: ``--replica-gpus``, else one per tensor-parallel rank (``--replica-tp``, default 1) where
    the (running) cluster has GPUs, else 0."""
    if args.replica_gpus is not None:
        return args.replica_gpus
    return (args.replica_tp or 1) if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) else 0


def check_resources(args: argparse.Namespace) -> None:
    """Refuse (naming the fix) replicas this Ray instance cannot place: Ray Serve would wait for them forever."""
    have = ray.cluster_resources()
    replicas = args.min_replicas if args.max_replicas and args.min_replicas is not None else args.replicas
    fit_cpus(args)
    cpus = replicas * args.replica_cpus + args.ingress_cpus
    if cpus > have.get("CPU", 0) + 1e-9:
        fit = max(0.01, (have.get("CPU", 0) - args.ingress_cpus) / max(replicas, 1))
        raise SystemExit(f"{replicas} replicas x {args.replica_cpus} CPU + {args.ingress_cpus} for the ingress = "
                         f"{cpus:g} CPUs, but this Ray instance has {have.get('CPU', 0):g}: pass --replica-cpus "
                         f"{fit:.2g} or fewer --replicas (Ray's CPUs are a reservation, not a thread count; "
                         "--threads sets a replica's torch threads).")
    gpus = replicas * replica_gpus(args)
    if gpus > have.get("GPU", 0) + 1e-9:
        raise SystemExit(f"{replicas} replicas x {replica_gpus(args)} GPU need {gpus:g} GPUs, but this Ray instance "
                         f"has {have.get('GPU', 0):g}: pass fewer --replicas or --replica-gpus 0 (CPU replicas).")


def start_ray(address: str | None) -> None:
    """Join ``address``, or start a light local Ray instance (no dashboard; usage stats off unless
    ``RAY_USAGE_STATS_ENABLED`` says otherwise)."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(include_dashboard=False, log_to_driver=True)


def serve_replicas(args: argparse.Namespace, build) -> int:
    """``python -m hf_paged serve --replicas N ...``: deploy, serve until SIGTERM / Ctrl-C, then drain and stop."""
    if args.tp_plan and not args.replica_tp:
        raise SystemExit("--tp-plan with --replicas: say how many devices each replica spans with --replica-tp N "
                         "(torchrun is not used: each replica starts its own ranks).")
    check_flags(args)
    start_ray(args.ray_address)
    stop = threading.Event()  # set by SIGTERM / Ctrl-C (installed after ray.init, whose own handler would abort)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if not args.ray_address:  # a cluster may grow (Ray's autoscaler); a local instance will not
            check_resources(args)
        elif args.replica_cpus is None:
            args.replica_cpus = 1.0
        serve.start(http_options={"host": args.host, "port": args.port})
        started = time.perf_counter()
        serve.run(application(args, build), name=APP_NAME, route_prefix="/", blocking=False)
        print(f"serving {args.replicas} replicas ({args.routing} routing) at http://{args.host}:{args.port}/v1 "
              f"(ready in {time.perf_counter() - started:.0f} s; SIGTERM or Ctrl-C drains and stops)", flush=True)
        while not stop.wait(1.0):
            pass
        print("draining the replicas ...", flush=True)
        serve.delete(APP_NAME)  # each replica stops taking requests, finishes its running ones, stops its engine
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0
