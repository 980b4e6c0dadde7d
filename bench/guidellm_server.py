"""guidellm's synthetic benchmark against the server, with fixed output lengths (guidellm 0.8's `run` CLI).

One question: does guidellm run end to end against `python -m hf_paged serve` with its fixed output lengths honoured
(it sends `ignore_eos: true`)? The server's own `/metrics` counts the tokens generated: with every request asking for
`--output-tokens`, the count must be requests x output tokens. Prints guidellm's exit status, the requests it
completed, and the server's token count against the expected one.

guidellm needs its own environment:

    python -m venv /tmp/evalvenv && /tmp/evalvenv/bin/pip install torch==2.13.0 guidellm
    python bench/guidellm_server.py --guidellm /tmp/evalvenv/bin/guidellm
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_paged import embedded  # noqa: E402


def counter(url: str, name: str, labels: dict | None = None) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guidellm", default="/tmp/evalvenv/bin/guidellm")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    root = Path(tempfile.mkdtemp(prefix="hfp_guidellm_"))
    server = subprocess.Popen([sys.executable, "-m", "hf_paged", "serve", "--port", str(port), "--log-level",
                               "warning"], stdout=open(root / "server.log", "w"), stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        before = counter(url, "hf_paged_generation_tokens_total")
        cmd = [args.guidellm, "run", "--backend", f"kind=openai_http,target={url}",
               "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={args.requests}",
               "--tokenizer", f"kind=hf_auto,model={embedded.local_model_dir()}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
               "--output", f"kind=json,path={root / 'guidellm.json'}", "--disable-progress"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        t0 = time.perf_counter()
        with open(root / "guidellm.log", "w") as f:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        seconds = time.perf_counter() - t0
        generated = counter(url, "hf_paged_generation_tokens_total") - before
        ok = counter(url, "hf_paged_http_requests_total", {"status": "200"})
    finally:
        server.terminate()
        server.wait(60)
    print(f"# guidellm synchronous, {args.requests} requests of {args.prompt_tokens} prompt / {args.output_tokens} "
          f"output tokens, embedded SmolLM2, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; files in {root}")
    print(f"guidellm exit status {done.returncode} after {seconds:.0f} s; HTTP 200 responses: {ok:.0f}")
    print(f"tokens generated: {generated:.0f} (requests x output tokens = {args.requests * args.output_tokens})")
    if done.returncode:
        print("\n".join((root / "guidellm.log").read_text().splitlines()[-20:]))


if __name__ == "__main__":
    main()
