"""Serving under load: N concurrent streaming chat clients against `python -m hf_paged serve`, side by side with
`transformers serve --continuous-batching` on the same local model, and the engine's own tokens/s on the same
requests without HTTP.

    python bench/serve_load.py                               # embedded SmolLM2, concurrency 1, 4, 16, 32
    python bench/serve_load.py --concurrency 1,4 --requests 1 --skip-transformers

Each client sends --requests chat completions one after another (stream, temperature 0, max_tokens --max-tokens,
the embedded chat prompts in turn) with the `openai` async client (max_retries=0). Per concurrency: output tokens/s
over the wall time, time to first token and inter-token gap (p50 / p99, from the streamed chunks as they arrive),
failures, and output tokens per CPU-second of the server process (all its threads). Contenders alternate per
concurrency level; both servers run as subprocesses, so the clients never share their interpreter. The engine row
runs the same requests at the top concurrency through `add_request` / `get_result` in threads: the server's overhead
is the ratio of the two (wall-clock tokens/s, and tokens per CPU-second, which other jobs on a shared machine do not
move).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu}, {os.cpu_count()} cores, load average {load:.1f} at start"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


class Subprocess:
    """A server started as a subprocess, ready once GET /health (or /v1/models) answers 200."""

    def __init__(self, name: str, cmd: list[str], port: int, model_id: str, startup_s: float, env: dict):
        import httpx

        self.name, self.port, self.model_id = name, port, model_id
        self.url = f"http://127.0.0.1:{port}"
        logs = ROOT / "bench" / "out"
        logs.mkdir(parents=True, exist_ok=True)
        self.log = open(logs / f"{name.split()[0]}_serve.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + startup_s
        self.error = None
        while True:
            if self.proc.poll() is not None:
                self.error = f"exited with {self.proc.returncode} (log: {self.log.name})"
                return
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.error = f"not up after {startup_s:.0f} s (log: {self.log.name})"
                self.stop()
                return
            time.sleep(0.5)

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server process so far, all its threads (Linux /proc)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


async def run_clients(url: str, model_id: str, prompts: list[str], concurrency: int, requests: int,
                      max_tokens: int, timeout_s: float) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=timeout_s)
    ttft, gaps, tokens, failures = [], [], [], []

    async def one(i: int, k: int):
        prompt = prompts[(i * requests + k) % len(prompts)]
        start = time.perf_counter()
        last, count, usage = None, 0, None
        try:
            stream = await client.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                if not chunk.choices or not chunk.choices[0].delta.content:
                    continue
                now = time.perf_counter()
                if last is None:
                    ttft.append(now - start)
                else:
                    gaps.append(now - last)
                last, count = now, count + 1
            tokens.append(usage if usage is not None else count)
        except Exception as exc:  # noqa: BLE001 - counted and shown
            failures.append(f"{type(exc).__name__}: {exc}"[:200])

    async def worker(i: int):
        for k in range(requests):
            await one(i, k)

    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return {"tokens": sum(tokens), "wall_s": wall, "tokens_per_s": sum(tokens) / wall, "ttft": ttft, "gaps": gaps,
            "failures": failures, "requests": concurrency * requests}


def engine_alone(args, prompts: list[str], concurrency: int) -> dict:
    """The same requests straight into the engine (closed loop, ``concurrency`` threads), no HTTP."""
    import torch

    import hf_paged
    from hf_paged import embedded

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = embedded.load(args.model, dtype=torch.float32)
    pool = hf_paged.BlockPool(block_size=args.block_size, max_memory=args.max_memory, prefix_caching=True)
    manager = hf_paged.init_continuous_batching(model, pool=pool, max_batch_tokens=args.max_batch_tokens)
    ids = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                   add_generation_prompt=True), add_special_tokens=False)["input_ids"]
           for p in prompts]
    tokens = []
    with manager:
        warm = manager.add_request(ids[0], max_new_tokens=2)
        manager.get_result(warm)

        def worker(i: int):
            for k in range(args.requests):
                rid = manager.add_request(ids[(i * args.requests + k) % len(ids)], max_new_tokens=args.max_tokens,
                                          do_sample=False)
                tokens.append(len(manager.get_result(rid).generated_tokens))

        start, cpu = time.perf_counter(), time.process_time()
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"tokens": sum(tokens), "wall_s": wall, "tokens_per_s": sum(tokens) / wall, "cpu_s": cpu}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local model directory (default: the embedded SmolLM2)")
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-memory", default="512MiB", help="the KV pool of hf_paged's server and engine")
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--level-timeout", type=float, default=900, help="seconds one contender may take per level")
    p.add_argument("--skip-transformers", action="store_true", help="no `transformers serve` contender")
    p.add_argument("--skip-engine", action="store_true", help="no engine-alone row")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process, servers and engine alike "
                   "(0: torch's default; on the shared 2-core VM two threads per process ran ~6x slower than one)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)

    from hf_paged import embedded

    args.model = str(args.model or embedded.local_model_dir())
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = list(embedded.CHAT_PROMPTS)
    print(f"machine: {machine()}")
    print(f"model: {args.model}; {args.requests} chat request(s) per client, max_tokens {args.max_tokens}, "
          f"greedy, streamed; concurrency {levels}; torch threads per process: {args.threads or 'default'}",
          flush=True)

    py = sys.executable
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    contenders = [Subprocess("hf_paged serve", [py, "-m", "hf_paged", "serve", "--model", args.model, "--port",
                                                str(port), "--threads", str(args.threads), "--block-size",
                                                str(args.block_size), "--max-memory",
                                                args.max_memory, "--max-batch-tokens", str(args.max_batch_tokens),
                                                "--log-level", "warning"], port, Path(args.model).name, 300, env)]
    skipped = {}
    if not args.skip_transformers:
        exe = shutil.which("transformers") or str(Path(py).parent / "transformers")
        port2 = free_port()
        blocks = max(64, 2 * levels[-1] * (args.max_tokens + 600) // args.block_size)
        ts = Subprocess("transformers serve --continuous-batching",
                        [exe, "serve", args.model, "--continuous-batching", "--port", str(port2), "--host",
                         "127.0.0.1", "--device", "cpu", "--dtype", "float32", "--cb-block-size",
                         str(args.block_size), "--cb-num-blocks", str(blocks), "--cb-max-batch-tokens",
                         str(args.max_batch_tokens)], port2, args.model, 300, env)
        if ts.error:
            skipped[ts.name] = ts.error
        else:
            contenders.append(ts)
    if contenders[0].error:
        print(f"hf_paged serve did not start: {contenders[0].error}")
        return 1

    results: dict[str, dict[int, dict]] = {c.name: {} for c in contenders}
    try:
        for c in contenders:  # one short request each: model loads / first-call costs stay out of the figures
            asyncio.run(run_clients(c.url, c.model_id, prompts, 1, 1, 2, args.level_timeout))
        for level in levels:
            for c in contenders:
                if c.name in skipped:
                    continue
                cpu = c.cpu_seconds()
                try:
                    r = asyncio.run(asyncio.wait_for(run_clients(c.url, c.model_id, prompts, level, args.requests,
                                                                 args.max_tokens, args.level_timeout),
                                                     args.level_timeout))
                except asyncio.TimeoutError:
                    skipped[c.name] = f"concurrency {level} took over {args.level_timeout:.0f} s; later levels skipped"
                    continue
                r["cpu_s"] = c.cpu_seconds() - cpu
                results[c.name][level] = r
                print(f"  {c.name:42s} c={level:<3d} {r['tokens_per_s']:7.1f} tok/s  "
                      f"ttft p50 {pct(r['ttft'], 50):.2f}s  itl p50 {pct(r['gaps'], 50) * 1e3:.0f}ms  "
                      f"failures {len(r['failures'])}", flush=True)
    finally:
        for c in contenders:
            c.stop()

    engine = None
    if not args.skip_engine:
        engine = engine_alone(args, prompts, levels[-1])

    print()
    print(f"{'server':42s} {'conc':>4s} {'req':>4s} {'fail':>4s} {'tok/s':>7s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
          f"{'ITL p50':>8s} {'ITL p99':>8s} {'tok/CPU-s':>9s}")
    for name, by_level in results.items():
        for level, r in by_level.items():
            print(f"{name:42s} {level:4d} {r['requests']:4d} {len(r['failures']):4d} {r['tokens_per_s']:7.1f} "
                  f"{pct(r['ttft'], 50):8.2f}s {pct(r['ttft'], 99):8.2f}s {pct(r['gaps'], 50) * 1e3:6.0f}ms "
                  f"{pct(r['gaps'], 99) * 1e3:6.0f}ms {r['tokens'] / r['cpu_s']:9.1f}")
    ours = results["hf_paged serve"]
    for name, why in skipped.items():
        print(f"{name}: {why}")
    if engine is not None:
        top = levels[-1]
        print(f"\nengine alone (add_request/get_result, {top} threads, same requests): {engine['tokens_per_s']:.1f} "
              f"tok/s, {engine['tokens'] / engine['cpu_s']:.1f} tok/CPU-s ({engine['tokens']} tokens in "
              f"{engine['wall_s']:.1f} s, {engine['cpu_s']:.1f} CPU-s)")
        if top in ours:
            mine = ours[top]
            print(f"server / engine at concurrency {top}: {mine['tokens_per_s'] / engine['tokens_per_s']:.2f}x "
                  f"tokens/s, {(mine['tokens'] / mine['cpu_s']) / (engine['tokens'] / engine['cpu_s']):.2f}x "
                  "tokens per CPU-second (the load-independent figure on a shared machine)")
    other = next((n for n in results if n != "hf_paged serve"), None)
    if other:
        for level in levels:
            if level in ours and level in results[other]:
                print(f"hf_paged serve / {other} at concurrency {level}: "
                      f"{ours[level]['tokens_per_s'] / results[other][level]['tokens_per_s']:.2f}x tokens/s")
    failures = [f for by_level in results.values() for r in by_level.values() for f in r["failures"]]
    for f in failures[:5]:
        print("failure:", f)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "results": {
            n: {lvl: {k: v for k, v in r.items() if k not in ("ttft", "gaps")} | {
                "ttft_p50": pct(r["ttft"], 50), "ttft_p99": pct(r["ttft"], 99), "itl_p50": pct(r["gaps"], 50),
                "itl_p99": pct(r["gaps"], 99)} for lvl, r in by_level.items()} for n, by_level in results.items()},
            "engine": engine, "skipped": skipped}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
