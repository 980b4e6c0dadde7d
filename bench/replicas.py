"""Replicas on Ray Serve: 1 vs 2 replicas, and prefix-aware routing vs Ray's default (power of two choices), on a
serving mix where several system prompts are each shared by many requests.

    python bench/replicas.py                                   # embedded SmolLM2, CPU: 1 replica, 2 pow2, 2 prefix
    python bench/replicas.py --replicas 1,2,4 --replica-gpus 1 --systems 16 --per-system 32 --concurrency 32 \\
        --max-tokens 64 --max-memory 4GiB --replica-cpus 4         # a multi-GPU machine: one GPU per replica

Each request is a streamed chat completion (temperature 0): one of --systems system prompts (about --system-words
words each) and a short question, in a seeded random order, sent by --concurrency clients (httpx, one endpoint).
Per configuration: prefix-hit tokens (the sum of ``usage.prompt_tokens_details.cached_tokens`` over prompt tokens),
time to first token p50 / p99 (from sending to the first text chunk), output tokens/s over the wall time, and how
many requests each replica served. Each configuration deploys fresh replicas (empty caches) on one Ray instance and
warms each replica with one short request first. A small --max-memory makes the point of routing: a replica whose
pool cannot hold every system prompt evicts under random routing and keeps its share under prefix routing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402
from ray import serve  # noqa: E402

from hf_paged.embedded import SYSTEM_PARAGRAPH  # noqa: E402
from hf_paged.serve.cli import build, parser  # noqa: E402
from hf_paged.serve.replicas import APP_NAME, application  # noqa: E402

TOPICS = ["the weather", "Python code", "cooking", "astronomy", "gardening", "music theory", "chess", "history",
          "cycling", "photography", "databases", "poetry", "sailing", "geology", "statistics", "linguistics"]
QUESTIONS = ["What should I know first?", "Give me one tip.", "What is a common mistake?", "Explain it simply.",
             "What is a good next step?", "Name one good book.", "What tools help?", "Why does it matter?"]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    load = os.getloadavg()[0]
    return (f"{cpu}, {os.cpu_count()} cores{', ' + str(len(gpus)) + ' x ' + gpus[0] if gpus else ''}, torch "
            f"{torch.__version__}, ray {ray.__version__}, load average {load:.1f} at start")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def workload(systems: int, per_system: int, words: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    base = SYSTEM_PARAGRAPH.split()
    prompts = []
    for s in range(systems):
        text = " ".join((base * (words // len(base) + 1))[:words])
        prompts.append(f"You are an assistant for questions about {TOPICS[s % len(TOPICS)]} (desk {s}). {text}")
    requests = [[{"role": "system", "content": prompts[s]}, {"role": "user", "content": rng.choice(QUESTIONS)}]
                for s in range(systems) for _ in range(per_system)]
    rng.shuffle(requests)
    return requests


async def one(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    out = {"ttft": None, "usage": None, "replica": None, "error": None}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        out["replica"] = r.headers.get("x-hf-paged-replica")
        if r.status_code != 200:
            out["error"] = f"HTTP {r.status_code}"
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                out["error"] = chunk["error"]["message"]
            elif chunk.get("usage"):
                out["usage"] = chunk["usage"]
            elif out["ttft"] is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                out["ttft"] = time.perf_counter() - start
    return out


async def drive(url: str, requests: list[list[dict]], concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def gated(messages):
            async with gate:
                return await one(client, url, messages, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(gated(m) for m in requests))
        return results, time.perf_counter() - start


def wait_replicas(url: str, n: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if len(httpx.get(url + "/health", timeout=10).json().get("replicas", {})) >= n:
                return
        except (httpx.TransportError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{n} replicas did not come up in {timeout_s:.0f} s")
        time.sleep(1)


def run(n: int, routing: str, opts, url: str, requests) -> dict:
    flags = ["--replicas", str(n), "--routing", routing, "--replica-cpus", str(opts.replica_cpus), "--max-memory",
             opts.max_memory, "--log-level", "warning", "--drain-timeout", "5"]
    if opts.model:
        flags += ["--model", opts.model]
    if opts.replica_gpus is not None:
        flags += ["--replica-gpus", str(opts.replica_gpus)]
    if opts.threads:
        flags += ["--threads", str(opts.threads)]
    serve.run(application(parser().parse_args(flags), build), name=APP_NAME, route_prefix="/", blocking=False)
    wait_replicas(url, n)
    warm = [[{"role": "user", "content": f"Hello number {i}."}] for i in range(2 * n)]
    asyncio.run(drive(url, warm, n, 2))
    results, wall = asyncio.run(drive(url, requests, opts.concurrency, opts.max_tokens))
    serve.delete(APP_NAME)
    ok = [r for r in results if r["error"] is None and r["usage"]]
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in ok)
    out_tokens = sum(r["usage"]["completion_tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    per = {}
    for r in ok:
        per[r["replica"]] = per.get(r["replica"], 0) + 1
    return {"replicas": n, "routing": routing, "hit": cached / prompt if prompt else 0.0, "cached": cached,
            "prompt": prompt, "ttft50": statistics.median(ttft) if ttft else float("nan"), "ttft99": pct(ttft, 0.99),
            "tps": out_tokens / wall, "wall": wall, "failed": len(results) - len(ok),
            "spread": "/".join(str(v) for v in sorted(per.values(), reverse=True))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--replicas", default="1,2", help="replica counts; 1 runs once, the others with both routers")
    p.add_argument("--routers", default="pow2,prefix")
    p.add_argument("--systems", type=int, default=6, help="distinct system prompts")
    p.add_argument("--per-system", type=int, default=6, help="requests per system prompt")
    p.add_argument("--system-words", type=int, default=160, help="words per system prompt")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-memory", default="64MiB", help="KV pool per replica")
    p.add_argument("--replica-cpus", type=float, default=0.5)
    p.add_argument("--replica-gpus", type=float, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica (0: torch's default)")
    p.add_argument("--ray-address", default=None)
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(opts.threads or os.cpu_count())}
    if opts.ray_address:
        ray.init(address=opts.ray_address, runtime_env={"env_vars": env}, log_to_driver=False)
    else:
        ray.init(include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    requests = workload(opts.systems, opts.per_system, opts.system_words, opts.seed)
    print(f"machine: {machine()}")
    print(f"workload: {len(requests)} streamed chat requests, {opts.systems} system prompts x {opts.per_system}, "
          f"~{opts.system_words} words each, max_tokens {opts.max_tokens}, concurrency {opts.concurrency}, "
          f"KV pool {opts.max_memory} per replica, {opts.replica_cpus} CPU / {opts.replica_gpus or 0} GPU per "
          f"replica, {opts.threads or 'default'} torch threads")
    configs = []
    for n in (int(x) for x in opts.replicas.split(",")):
        configs += [(n, "prefix")] if n == 1 else [(n, r) for r in opts.routers.split(",")]
    rows = []
    try:
        for n, routing in configs:
            started = time.perf_counter()
            rows.append(run(n, routing, opts, url, requests))
            print(f"  ran {n} x {routing} in {time.perf_counter() - started:.0f} s", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print()
    print("| replicas | routing | prefix-hit tokens | TTFT p50 | TTFT p99 | output tok/s | wall | requests per replica "
          "| failed |")
    print("|---:|---|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['replicas']} | {r['routing'] if r['replicas'] > 1 else '-'} | {r['hit']:.0%} "
              f"({r['cached']:,} / {r['prompt']:,}) | {r['ttft50']:.2f} s | {r['ttft99']:.2f} s | {r['tps']:.1f} | "
              f"{r['wall']:.1f} s | {r['spread']} | {r['failed']} |")
    by = {(r["replicas"], r["routing"]): r for r in rows}
    for n in sorted({r["replicas"] for r in rows if r["replicas"] > 1}):
        a, b = by.get((n, "prefix")), by.get((n, "pow2"))
        if a and b:
            print(f"\n{n} replicas, prefix vs pow2: prefix hits {a['hit']:.0%} vs {b['hit']:.0%}, TTFT p50 "
                  f"{b['ttft50'] / a['ttft50']:.2f}x lower, p99 {b['ttft99'] / a['ttft99']:.2f}x lower, "
                  f"tokens/s {a['tps'] / b['tps']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
