"""The server over two tensor-parallel gloo ranks on CPU: rank 0 serves HTTP, rank 1 follows.

A tiny Llama (two KV heads: one per rank) with the tiny byte-level BPE tokenizer of ``test_serve.py`` is saved to a
directory and served with ``--tp-plan auto``. Under torchrun, concurrent ``openai`` clients (one dropping its stream)
get ``generate()``'s greedy text, and SIGTERM on rank 0 during a stream lets it finish, then stops both ranks.
Launched by hand (the same environment torchrun gives, without its agent, which would itself tear the survivors
down), killing rank 1 makes rank 0's ``/health`` answer 503 and rank 0 exit with status 1 on its own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_distributed import _tp_unavailable
from test_serve import KEY, ROOT, greedy_reference, httpx, openai, tiny_lm, tiny_tokenizer

TP_TIMEOUT_S = 30
UP_S = 180
PROMPTS = ["What is the capital of France?", "Write a haiku about", "Explain the sky", "Three tips for",
           "clean Python code", "leaves in autumn"]
MAX_TOKENS = 12


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Output:
    """Collects a process's merged stdout/stderr lines in a thread (so the pipe never fills)."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc):
        for line in proc.stdout:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def pids(self) -> dict[int, int]:
        return {int(m.group(1)): int(m.group(2))
                for m in re.finditer(r"tensor-parallel rank (\d+)/\d+, pid (\d+)", self.text())}


def _wait_healthy(url: str, procs: list[subprocess.Popen], out: list[Output]) -> None:
    deadline = time.monotonic() + UP_S
    while True:
        for p, o in zip(procs, out):
            assert p.poll() is None, o.text()[-5000:]
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up:\n" + out[0].text()[-5000:]
        time.sleep(0.2)


def _serve_args(model_dir, port: int) -> list[str]:
    return ["-m", "hf_paged", "serve", "--model", str(model_dir), "--port", str(port), "--tp-plan", "auto",
            "--tp-timeout", str(TP_TIMEOUT_S), "--max-memory", "8MiB", "--drain-timeout", "30", "--threads", "1",
            "--dtype", "float32"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_PAGED_API_KEY": KEY, "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore"}


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory):
    reason = _tp_unavailable()
    if reason:
        pytest.skip(reason)
    tokenizer = tiny_tokenizer()
    model_dir = tmp_path_factory.mktemp("tp_serve") / "tiny-tp"
    lm = tiny_lm(tokenizer, seed=4)
    lm.generation_config.eos_token_id = None  # every completion runs to max_tokens
    lm.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, lm, tokenizer


def test_tp_server_answers_openai_clients_and_drains_on_sigterm(served_dir):
    model_dir, lm, tokenizer = served_dir
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--module",
           *_serve_args(model_dir, port)[1:]]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out = Output(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, [proc], [out])
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)

        def complete(i: int) -> str:
            time.sleep(0.05 * i)  # staggered: requests join steps already running
            r = client.completions.create(model="tiny-tp", prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0)
            return r.choices[0].text

        def dropped() -> str:
            with client.completions.with_streaming_response.create(model="tiny-tp", prompt=PROMPTS[0],
                                                                   max_tokens=200, temperature=0,
                                                                   stream=True) as response:
                return next(line for line in response.iter_lines() if line.startswith("data: {"))

        with ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
            drop = pool.submit(dropped)
            texts = list(pool.map(complete, range(len(PROMPTS))))
            assert drop.result()  # its client read one event and closed the stream
        for prompt, text in zip(PROMPTS, texts):
            ids = tokenizer(prompt)["input_ids"]
            assert text == greedy_reference(lm, tokenizer, ids, MAX_TOKENS)[0], prompt
        assert httpx.get(url + "/health", timeout=5).status_code == 200  # still healthy after the drop
        pids = out.pids()
        assert set(pids) == {0, 1}, out.text()[-3000:]
        os.kill(pids[1], signal.SIGTERM)  # a follower ignores it: only rank 0 decides
        time.sleep(0.5)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        # SIGTERM on rank 0 during a stream: the stream finishes, then the stop reaches rank 1
        with client.completions.with_streaming_response.create(model="tiny-tp", prompt=PROMPTS[1], max_tokens=48,
                                                               temperature=0, stream=True) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            os.kill(pids[0], signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"error"' not in "".join([first, *rest])
        finishes = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in [first, *rest[:-1]]]
        assert finishes[-1] == "length"  # all 48 tokens came after the signal
        proc.wait(timeout=90)
        assert proc.returncode == 0, out.text()[-5000:]
        assert "Application shutdown complete" in out.text()
    finally:
        _kill([proc])


@pytest.mark.parametrize("victim", [1, 0])
def test_tp_server_lost_rank_stops_the_other_with_an_error(served_dir, victim):
    """Kill one rank: the other exits with status 1 and the reason, by itself, within the collective timeout (rank 0
    answering /health with 503 meanwhile)."""
    model_dir, _, _ = served_dir
    port, master = _free_port(), _free_port()
    procs, outs = [], []
    try:
        for rank in range(2):
            env = {**_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)}
            p = subprocess.Popen([sys.executable, *_serve_args(model_dir, port)], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
            procs.append(p)
            outs.append(Output(p))
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, procs, outs)
        survivor = procs[1 - victim]
        procs[victim].kill()
        procs[victim].wait()
        killed = time.monotonic()
        seen_503 = None
        while survivor.poll() is None and time.monotonic() - killed < TP_TIMEOUT_S + 30:
            if victim == 1:
                try:
                    r = httpx.get(url + "/health", timeout=2)
                    if r.status_code == 503:
                        seen_503 = r.json()
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        survivor.wait(timeout=5)
        text = outs[1 - victim].text()
        assert survivor.returncode == 1, text[-5000:]
        assert "the tensor-parallel engine stopped" in text, text[-5000:]
        if victim == 1:
            assert seen_503 is not None and "engine" in str(seen_503), seen_503
    finally:
        _kill(procs)
