"""Structured output on the embedded SmolLM2, through the server and the real `openai` client.

Two questions:
1. Validity: N prompts at temperature 1 sent with `chat.completions.parse(response_format=PydanticModel)`: how many
   come back as a valid object, for a model with bounded fields and one with free strings and lists?
2. Cost: output tokens/s of C concurrent JSON-schema requests vs C plain ones (same prompts, same max_tokens;
   the plain ones with ignore_eos run exactly max_tokens tokens, the JSON ones end when their object does,
   so the figure compared is tokens per second of wall time).

    python bench/structured.py [--prompts 20] [--concurrency 16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Annotated

import openai
import pydantic
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hf_paged  # noqa: E402
from hf_paged import BlockPool, embedded  # noqa: E402
from hf_paged.serve import ServeSettings, create_app  # noqa: E402

TOPICS = ["a baker", "a pilot", "a chess player", "a gardener", "a nurse", "a painter", "a student", "a farmer",
          "a chef", "a teacher", "a miner", "a sailor", "a poet", "a doctor", "a coder", "a singer", "a judge",
          "a runner", "a tailor", "a vet"]


class Bounded(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    age: int = pydantic.Field(ge=0, le=130)
    city: str = pydantic.Field(max_length=40)
    hobbies: list[Annotated[str, pydantic.Field(max_length=30)]] = pydantic.Field(max_length=3)
    employed: bool


class Free(pydantic.BaseModel):
    name: str
    age: int
    city: str
    hobbies: list[str]
    employed: bool


def ask(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with a JSON object describing a fictional person who is {topic}: "
                                        "their name, age, city, a list of two hobbies, and whether they are "
                                        "employed."}]


def serve(model, tokenizer):
    manager = hf_paged.init_continuous_batching(model, pool=BlockPool(block_size=16, num_blocks=2048))
    app = create_app(manager, tokenizer, ServeSettings(model_name="smollm2"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


async def validity(client, schema, n: int, max_tokens: int) -> tuple[int, int, list[str]]:
    async def one(i):
        try:
            r = await client.chat.completions.parse(model="smollm2", messages=ask(TOPICS[i % len(TOPICS)]),
                                                    response_format=schema, temperature=1.0, seed=1000 + i,
                                                    max_tokens=max_tokens)
            return r.choices[0].message.parsed is not None, r.usage.completion_tokens, ""
        except (openai.LengthFinishReasonError, pydantic.ValidationError) as exc:
            return False, max_tokens, type(exc).__name__

    results = await asyncio.gather(*(one(i) for i in range(n)))
    return sum(ok for ok, _, _ in results), sum(t for _, t, _ in results), [e for _, _, e in results if e]


async def throughput(client, concurrency: int, max_tokens: int, json_mode: bool) -> tuple[int, float]:
    async def one(i):
        kwargs = {"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": Bounded.model_json_schema(), "strict": True}}} if json_mode else {
            "extra_body": {"ignore_eos": True}}
        r = await client.chat.completions.create(model="smollm2", messages=ask(TOPICS[i % len(TOPICS)]),
                                                 temperature=1.0, seed=i, max_tokens=max_tokens, **kwargs)
        return r.usage.completion_tokens

    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(one(i) for i in range(concurrency)))
    return sum(tokens), time.perf_counter() - t0


async def validity_table(client, args) -> None:
    print(f"## 1. validity: {args.prompts} prompts, temperature 1, chat.completions.parse, max_tokens "
          f"{args.validity_max_tokens}")
    print(f"{'schema':10} {'valid':>7} {'tokens':>7}  failures")
    for name, schema in (("bounded", Bounded), ("free", Free)):
        ok, tokens, errors = await validity(client, schema, args.prompts, args.validity_max_tokens)
        print(f"{name:10} {ok:>3}/{args.prompts:<3} {tokens:>7}  {', '.join(errors) or '-'}")


async def main_async(args, url: str) -> None:
    client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=3600)
    if args.prompts:
        await validity_table(client, args)
    print(f"\n## 2. throughput: {args.concurrency} concurrent requests, max_tokens {args.max_tokens}")
    print(f"{'requests':10} {'tokens':>7} {'seconds':>8} {'tokens/s':>9}")
    rows = {}
    for label, json_mode in [("plain", False), ("json", True)] * args.rounds:
        tokens, seconds = await throughput(client, args.concurrency, args.max_tokens, json_mode)
        rows.setdefault(label, []).append(tokens / seconds)
        print(f"{label:10} {tokens:>7} {seconds:>8.1f} {tokens / seconds:>9.1f}")
    best = {k: max(v) for k, v in rows.items()}
    print(f"json / plain tokens/s (best of {args.rounds} each): {best['json'] / best['plain']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20, help="validity prompts (0: skip section 1)")
    parser.add_argument("--validity-max-tokens", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2, help="alternated plain / json rounds")
    args = parser.parse_args()
    model, tokenizer = embedded.load()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads "
          f"{__import__('torch').get_num_threads()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    server, thread, url = serve(model, tokenizer)
    try:
        asyncio.run(main_async(args, url))
    finally:
        server.should_exit = True
        thread.join(30)


if __name__ == "__main__":
    main()
