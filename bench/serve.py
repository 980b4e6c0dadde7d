"""Serving a queue of requests on CPU: how much does continuous batching on the block pool buy?

Workload 1, a ShareGPT-like mix scaled to a CPU: N chat requests (lognormal prompt and output lengths, the shape of
``hf_paged.tools.simulate.SHAREGPT`` with the output mean scaled down; prompts <= 1,000 tokens, outputs <= 128), all
submitted at once, greedy, each with its own ``max_new_tokens``. Four contenders on the same requests and the same KV
budget (blocks of 16 tokens: what the padded batches of 8 need at their peak), alternated in one process, each on its
own copy of the model:

* ``engine``: ``hf_paged.init_continuous_batching`` on a ``BlockPool(num_blocks=budget)``.
* ``generate_batch``: transformers' continuous batching (sdpa, page size 16, ``num_blocks`` = the budget) at the best
  ``max_batch_tokens`` of a small sweep on a quarter of the requests (at least 8).
* ``generate() + DynamicCache``: padded batches of 8 in arrival order, ``max_new_tokens`` = the batch's largest, as a
  user would write it; each request keeps its own budget of tokens.
* ``generate() + PagedCache``: the same batches on a ``BlockPool(num_blocks=budget)``.

Reported per contender: tokens/s (generated tokens kept / wall time from submission to the last result), time to
first token and inter-token latency p50 / p99 (from each request's token timestamps), KV peak, and how many requests'
tokens equal the padded DynamicCache run's.

Workload 2, a shared system prompt: 16 requests whose prompts begin with the same ~500-token system prompt, followed
by 20-50-token questions, all submitted at once: prompt tokens the engine computed with prefix caching vs without.

    python bench/serve.py                 # 32 requests, a 3-point sweep: ~25 minutes on the shared 2-core VM
    python bench/serve.py --quick         # 16 requests of <= 400 + 48 tokens, no sweep: ~10 minutes there
    python bench/serve.py --json out.json
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache, GenerationConfig, StoppingCriteria

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import transformers  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged import BlockPool, PagedCache, disable_paged_attention, enable_paged_attention  # noqa: E402
from hf_paged import compat, embedded  # noqa: E402
from hf_paged.report import cpu_name, dynamic_cache_bytes, format_table, kv_bytes_per_token, mb  # noqa: E402
from hf_paged.tools.simulate import SHAREGPT, LengthModel, sample_workload  # noqa: E402

BLOCK = 16
ENGINE, CB, DYNAMIC, PAGED = "engine", "generate_batch", "generate() + DynamicCache", "generate() + PagedCache"
# stdlib modules whose documentation makes the prompts' reading material (deterministic, offline, plain English)
CORPUS_MODULES = ["collections", "itertools", "functools", "json", "re", "argparse", "logging", "threading",
                  "subprocess", "textwrap", "statistics", "decimal", "heapq", "bisect", "pathlib", "dataclasses",
                  "contextlib", "inspect", "typing", "unittest", "asyncio", "sqlite3", "csv", "datetime"]


def machine() -> str:
    return (f"{cpu_name()} ({platform.machine()}), {torch.get_num_threads()} torch threads, "
            f"{'GPU ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}; Python "
            f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")


# --------------------------------------------------------------------------------------------------- workloads
@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int


def corpus_ids(tokenizer) -> list[int]:
    import importlib

    texts = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        texts.append(inspect.getdoc(module) or "")
        for attr in sorted(vars(module)):
            doc = inspect.getdoc(getattr(module, attr)) if not attr.startswith("_") else None
            if doc and len(doc) > 200:
                texts.append(doc)
    return tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]


def chat_ids(tokenizer, user: str) -> tuple[list[int], list[int]]:
    """The chat template's ids around a user message: (before, after) the marker text."""
    marker = "@@MESSAGE@@"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    before, after = text.split(marker)
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return enc(before + user), enc(after)


def mix_shape(max_prompt: int, max_output: int, output_mean: float) -> LengthModel:
    """SHAREGPT's lognormals (prompt mean ~161 tokens, less for tiny caps) with the output mean ``output_mean``."""
    return LengthModel("ShareGPT-like, scaled", min(SHAREGPT.prompt_mean, 0.4 * max_prompt), output_mean,
                       SHAREGPT.prompt_sigma, SHAREGPT.output_sigma, max_len=max_prompt + max_output)


def mix_lengths(n: int, max_prompt: int, max_output: int, output_mean: float, seed: int = 0):
    """``n`` (prompt length, max_new_tokens) pairs of the mix, prompts <= ``max_prompt``, outputs <= ``max_output``."""
    shape = mix_shape(max_prompt, max_output, output_mean)
    return [(max(1, min(p, max_prompt)), max(1, min(o, max_output))) for p, o in sample_workload(shape, n, seed=seed)]


def mix_workload(tokenizer, n: int, max_prompt: int, max_output: int, output_mean: float, seed: int = 0):
    """``n`` requests of the mix: a reading excerpt (from the stdlib's documentation) and a question, in the chat
    template, cut to the drawn prompt length."""
    corpus = corpus_ids(tokenizer)
    requests = []
    for i, (prompt_len, output_len) in enumerate(mix_lengths(n, max_prompt, max_output, output_mean, seed)):
        question = embedded.CHAT_PROMPTS[i % len(embedded.CHAT_PROMPTS)]
        head, tail = chat_ids(tokenizer, "Read this, then answer.\n\n")
        question_ids = tokenizer("\n\nQuestion: " + question, add_special_tokens=False)["input_ids"]
        room = max(prompt_len - len(head) - len(tail) - len(question_ids), 0)
        start = (i * 7919) % max(len(corpus) - room, 1)
        prompt = head + corpus[start:start + room] + question_ids + tail
        requests.append(Request(prompt, output_len))
    return requests, mix_shape(max_prompt, max_output, output_mean)


def shared_prefix_workload(tokenizer, n: int, system_tokens: int, max_output: int, seed: int = 0):
    """``n`` requests sharing one ~``system_tokens``-token system prompt, then 20-50-token questions."""
    g = torch.Generator().manual_seed(seed)
    corpus = corpus_ids(tokenizer)
    paragraph = embedded.SYSTEM_PARAGRAPH
    system = " ".join([paragraph] * max(1, math.ceil(system_tokens / len(tokenizer(paragraph)["input_ids"]))))
    requests = []
    for i in range(n):
        question = embedded.CHAT_PROMPTS[i % len(embedded.CHAT_PROMPTS)]
        extra = int(torch.randint(0, 30, (1,), generator=g))
        start = (i * 104729) % (len(corpus) - extra)
        text = tokenizer.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": "@@Q@@"}], tokenize=False,
                                             add_generation_prompt=True)
        before, after = text.split("@@Q@@")
        ids = (tokenizer(before, add_special_tokens=False)["input_ids"]
               + tokenizer(question + " ", add_special_tokens=False)["input_ids"] + corpus[start:start + extra]
               + tokenizer(after, add_special_tokens=False)["input_ids"])
        requests.append(Request(ids, max_output))
    return requests


def kv_budget_blocks(requests: list[Request], batch_size: int) -> int:
    """Blocks of ``BLOCK`` tokens the padded batches of ``batch_size`` need at their peak (rows x (longest prompt +
    largest budget) of the worst batch, each row in whole blocks), plus the pool's scratch block."""
    worst = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        columns = max(len(r.prompt) for r in batch) + max(r.max_new_tokens for r in batch)
        worst = max(worst, len(batch) * math.ceil(columns / BLOCK))
    return worst + 1


# ------------------------------------------------------------------------------------------------- measurements
@dataclass
class Run:
    name: str
    seconds: float
    tokens: list[list[int]]  # kept generated tokens, in request order
    ttft: list[float]  # seconds from submission to each request's first token
    itl: list[float]  # every gap between consecutive tokens of a request
    kv_peak: int | None  # bytes
    kv_note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def generated(self) -> int:
        return sum(map(len, self.tokens))

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.seconds


def kept(tokens: list[int], budget: int, eos: set[int]) -> list[int]:
    """A request's tokens up to and including its first EOS, at most ``budget``."""
    out = []
    for token in tokens[:budget]:
        out.append(int(token))
        if token in eos:
            break
    return out


def gaps(timestamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(timestamps, timestamps[1:])]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def live_kv_peak(spans: list[tuple[float, int, list[float]]], per_token: int) -> int:
    """Peak KV of live requests from timestamps: (admitted, prompt length, token times) each; a request holds its
    prompt from admission and one more token per generated token, in whole blocks, until its last token."""
    events = sorted({t for start, _, times in spans for t in [start, *times]})
    peak = 0
    for t in events:
        blocks = 0
        for start, prompt, times in spans:
            if start <= t and times and t <= times[-1]:
                blocks += math.ceil((prompt + sum(1 for s in times if s <= t)) / BLOCK)
        peak = max(peak, blocks)
    return peak * BLOCK * per_token


def greedy_config(model, max_new_tokens: int) -> GenerationConfig:
    config = copy.deepcopy(model.generation_config)
    config.do_sample, config.max_new_tokens = False, max_new_tokens
    config.temperature = config.top_p = config.top_k = None
    return config


def run_engine(model, requests, budget: int, max_batch_tokens: int | None, prefix_caching: bool, eos, label: str):
    pool = BlockPool(block_size=BLOCK, num_blocks=budget, prefix_caching=prefix_caching)
    manager = hf_paged.init_continuous_batching(model, greedy_config(model, 16), pool=pool,
                                                max_batch_tokens=max_batch_tokens)
    manager.start()
    try:
        start = time.perf_counter()
        ids = [manager.add_request(r.prompt, max_new_tokens=r.max_new_tokens) for r in requests]
        results = [manager.get_result(rid) for rid in ids]
        seconds = time.perf_counter() - start
        stats = manager.stats()
    finally:
        manager.stop(block=True, timeout=60)
    failed = [r.request_id for r in results if r is None or r.error is not None]
    if failed:
        raise RuntimeError(f"{label}: {len(failed)} requests failed, e.g. {results[0].error}")
    tokens = [kept(r.generated_tokens, q.max_new_tokens, eos) for r, q in zip(results, requests)]
    return Run(label, seconds, tokens,
               ttft=[r.first_token_time - start for r in results],
               itl=[g for r in results for g in gaps(r.timestamps)],
               kv_peak=pool.memory_stats().peak_bytes_in_use, kv_note="pool peak in use",
               extra={"stats": stats, "max_batch_tokens": max_batch_tokens})


def cb_config(budget: int, max_batch_tokens: int):
    from transformers.generation import ContinuousBatchingConfig

    wanted = dict(page_size=BLOCK, num_blocks=budget, max_batch_tokens=max_batch_tokens, auto_switch_to_flash=False)
    fields = inspect.signature(ContinuousBatchingConfig).parameters
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in fields})


def collect_results(manager, count: int) -> dict:
    """The finished results of ``count`` requests from transformers' continuous-batching manager, by request id;
    ``RuntimeError`` if one failed or its thread stopped first."""
    results = {}
    while len(results) < count:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped before all requests ended")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            results[result.request_id] = result
    return results


def run_generate_batch(model, requests, budget: int, max_batch_tokens: int, eos, per_token: int, label: str):
    manager = model.init_continuous_batching(generation_config=greedy_config(model, 16),
                                             continuous_batching_config=cb_config(budget, max_batch_tokens))
    manager.start()
    try:
        start = time.perf_counter()
        ids = [manager.add_request(r.prompt, max_new_tokens=r.max_new_tokens, record_timestamps=True)
               for r in requests]
        results = collect_results(manager, len(ids))
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=60)
        if hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
    ordered = [results[i] for i in ids]
    tokens = [kept(r.generated_tokens, q.max_new_tokens, eos) for r, q in zip(ordered, requests)]
    times = [list(r.timestamps or [])[:len(t)] for r, t in zip(ordered, tokens)]
    spans = [(r.lifespan[0] if r.lifespan[0] > 0 else start, len(q.prompt), ts)
             for r, q, ts in zip(ordered, requests, times)]
    return Run(label, seconds, tokens, ttft=[ts[0] - start for ts in times if ts],
               itl=[g for ts in times for g in gaps(ts)], kv_peak=live_kv_peak(spans, per_token),
               kv_note="estimated from token timestamps", extra={"max_batch_tokens": max_batch_tokens})


class StepClock(StoppingCriteria):
    """Never stops; records the time of every decoding step (token j of every row is at ``times[j]``)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_padded(model, tokenizer, requests, batch_size: int, paged_pool: BlockPool | None, eos, label: str):
    """generate() over padded batches of ``batch_size`` in arrival order (DynamicCache, or PagedCache on a pool)."""
    if paged_pool is None:
        disable_paged_attention(model)
    else:
        enable_paged_attention(model)
    tokens, ttft, itl, kv_peak = [], [], [], 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)  # [b, width]
        mask = torch.zeros_like(ids)  # [b, width]
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt):] = 1
        cache = DynamicCache(config=model.config) if paged_pool is None else PagedCache(model.config, pool=paged_pool)
        clock = StepClock()
        out = model.generate(input_ids=ids, attention_mask=mask, **{compat.GENERATE_CACHE_KWARG: cache},
                             stopping_criteria=[clock],
                             generation_config=greedy_config(model, max(r.max_new_tokens for r in batch)))
        for row, r in enumerate(batch):
            row_tokens = kept(out[row, width:].tolist(), r.max_new_tokens, eos)
            tokens.append(row_tokens)
            ttft.append(clock.times[0] - start)
            itl.extend(gaps(clock.times[:len(row_tokens)]))
        if paged_pool is None:
            kv_peak = max(kv_peak, dynamic_cache_bytes(cache))
        del cache
    seconds = time.perf_counter() - start
    if paged_pool is not None:
        kv_peak = paged_pool.memory_stats().peak_bytes_in_use
        disable_paged_attention(model)
    return Run(label, seconds, tokens, ttft, itl, kv_peak,
               kv_note="largest batch's cache" if paged_pool is None else "pool peak in use")


# ------------------------------------------------------------------------------------------------------ report
def agreement(run: Run, reference: Run) -> str:
    same = sum(a == b for a, b in zip(run.tokens, reference.tokens))
    return f"{same}/{len(reference.tokens)}"


def first_difference(run: Run, reference: Run) -> str:
    diffs = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
             for a, b in zip(run.tokens, reference.tokens) if a != b]
    return f"first difference at token {min(diffs)} (median {statistics.median(diffs):.0f})" if diffs else ""


def mix_table(runs: dict[str, Run], budget_bytes: int) -> str:
    base_cb = runs.get(CB)
    base_padded = runs.get(DYNAMIC)
    rows = []
    for name, run in runs.items():
        rows.append([
            name + (f" (max_batch_tokens {run.extra['max_batch_tokens']})" if name == CB else ""),
            " ".join(f"{w:.1f}" for w in run.extra.get("walls", [run.seconds])), run.generated,
            f"{run.tokens_per_s:.1f}",
            f"{run.tokens_per_s / base_cb.tokens_per_s:.2f}x" if base_cb else "-",
            f"{run.tokens_per_s / base_padded.tokens_per_s:.2f}x" if base_padded else "-",
            f"{pct(run.ttft, 50):.1f} / {pct(run.ttft, 99):.1f}",
            f"{1e3 * pct(run.itl, 50):.0f} / {1e3 * pct(run.itl, 99):.0f}",
            ("~" if "estimated" in run.kv_note else "") + mb(run.kv_peak),
            agreement(run, base_padded) if base_padded else "-",
        ])
    return format_table(["contender", "runs (s)", "tokens", "tokens/s", "vs generate_batch", "vs padded generate()",
                         "TTFT p50 / p99 s", "ITL p50 / p99 ms", "KV peak", "tokens = padded DynamicCache"], rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 shorter requests, no sweep: a few minutes")
    parser.add_argument("--requests", type=int, default=None, help="workload 1's requests (default 32; quick 16)")
    parser.add_argument("--max-prompt", type=int, default=None, help="default 1000 (quick 400)")
    parser.add_argument("--max-output", type=int, default=None, help="default 128 (quick 48)")
    parser.add_argument("--output-mean", type=float, default=None, help="default 48 (quick 24) new tokens")
    parser.add_argument("--batch-size", type=int, default=8, help="padded generate() batches")
    parser.add_argument("--engine-batch-tokens", type=int, default=None, help="the engine's max_batch_tokens")
    parser.add_argument("--cb-sweep", default=None, help="generate_batch max_batch_tokens values, comma-separated "
                        "(default 512,1024,2048; quick: 2048 only, the best of the full sweep here)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of the four contenders (order reversed every "
                        "other round); the table shows each one's fastest")
    parser.add_argument("--shared", type=int, default=16, help="workload 2's requests (0: skip it)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: on a busy shared "
                        "CPU, OpenMP threads waiting on each other made every contender 3-10x slower)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    quick = args.quick
    n = args.requests or (16 if quick else 32)
    max_prompt = args.max_prompt or (400 if quick else 1000)
    max_output = args.max_output or (48 if quick else 128)
    output_mean = args.output_mean or (24 if quick else 48)
    sweep = [int(v) for v in (args.cb_sweep or ("2048" if quick else "512,1024,2048")).split(",")]

    print(f"machine: {machine()}", flush=True)
    print("loading the embedded SmolLM2-135M-Instruct (fp32), one copy per contender ...", flush=True)
    model_engine, tokenizer = embedded.load()
    model_cb, _ = embedded.load()
    model_gen, _ = embedded.load()
    eos_ids = model_gen.generation_config.eos_token_id
    eos = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
    per_token = kv_bytes_per_token(model_gen.config, torch.float32)

    requests, shape = mix_workload(tokenizer, n, max_prompt, max_output, output_mean)
    budget = kv_budget_blocks(requests, args.batch_size)
    prompt_lens = [len(r.prompt) for r in requests]
    outputs = [r.max_new_tokens for r in requests]
    print(f"\n== 1. {n} requests, {shape.describe()}; prompts {min(prompt_lens)}-{max(prompt_lens)} tokens "
          f"({sum(prompt_lens):,} in all), max_new_tokens {min(outputs)}-{max(outputs)} ({sum(outputs):,} in all), "
          f"greedy, all submitted at once", flush=True)
    print(f"KV budget: {budget} blocks x {BLOCK} tokens = {mb(budget * BLOCK * per_token)} (what padded batches of "
          f"{args.batch_size} need at their peak)", flush=True)

    warm = [Request(r.prompt[:40], 2) for r in requests[:2]]
    run_engine(model_engine, warm, budget, args.engine_batch_tokens, True, eos, "warm-up")
    run_generate_batch(model_cb, warm, budget, sweep[0], eos, per_token, "warm-up")
    run_padded(model_gen, tokenizer, warm, args.batch_size, None, eos, "warm-up")
    run_padded(model_gen, tokenizer, warm, args.batch_size, BlockPool(BLOCK, num_blocks=budget), eos, "warm-up")

    sweep_rows, best = [], sweep[0]
    if len(sweep) > 1:
        subset = requests[:max(8, n // 4)]
        print(f"generate_batch max_batch_tokens sweep on the first {len(subset)} requests ...", flush=True)
        speeds = {}
        for value in sweep:
            run = run_generate_batch(model_cb, subset, budget, value, eos, per_token, CB)
            speeds[value] = run.tokens_per_s
            sweep_rows.append([value, f"{run.seconds:.1f}", f"{run.tokens_per_s:.1f}"])
        best = max(speeds, key=speeds.get)
        print(format_table(["max_batch_tokens", "wall s", "tokens/s"], sweep_rows), flush=True)

    contenders = {
        ENGINE: lambda: run_engine(model_engine, requests, budget, args.engine_batch_tokens, True, eos, ENGINE),
        CB: lambda: run_generate_batch(model_cb, requests, budget, best, eos, per_token, CB),
        DYNAMIC: lambda: run_padded(model_gen, tokenizer, requests, args.batch_size, None, eos, DYNAMIC),
        PAGED: lambda: run_padded(model_gen, tokenizer, requests, args.batch_size,
                                  BlockPool(BLOCK, num_blocks=budget), eos, PAGED),
    }
    all_runs: dict[str, list[Run]] = {name: [] for name in contenders}
    for round_ in range(args.rounds):
        order = list(contenders) if round_ % 2 == 0 else list(reversed(contenders))
        print(f"round {round_ + 1}/{args.rounds}: {', '.join(order)} ...", flush=True)
        for name in order:
            all_runs[name].append(contenders[name]())
            print(f"  {name} {all_runs[name][-1].seconds:.1f} s", flush=True)
    runs = {name: min(done, key=lambda r: r.seconds) for name, done in all_runs.items()}  # each one's fastest
    for name, run in runs.items():
        run.extra["walls"] = [r.seconds for r in all_runs[name]]

    print()
    print(mix_table(runs, budget * BLOCK * per_token))
    stats = runs[ENGINE].extra["stats"]
    print(f"tokens/s: generated tokens kept (up to EOS, within each request's max_new_tokens) / wall seconds from "
          f"submission to the last result, each contender's fastest of {args.rounds} round(s) (order reversed every "
          f"other round); latencies from that run. TTFT from submission. KV budget {mb(budget * BLOCK * per_token)} for "
          f"every contender (DynamicCache grows as it needs); generate_batch's KV peak (~) is estimated from its "
          f"token timestamps (live requests' blocks).")
    print(f"engine: {stats.steps} steps, host {stats.host_time_s:.1f} s + forward {stats.forward_time_s:.1f} s, "
          f"{stats.preemptions} preemptions ({stats.recomputed_tokens} tokens recomputed), prompt tokens "
          f"{stats.prompt_tokens:,} of which computed {stats.prompt_tokens_computed:,} (prefix hits "
          f"{stats.prefix_hit_tokens:,}), max_batch_tokens {args.engine_batch_tokens or 'default'}")
    for name, run in runs.items():
        note = first_difference(run, runs[DYNAMIC])
        if note:
            print(f"{name}: {note}")

    result = {
        "machine": machine(), "requests": n, "prompt_tokens": sum(prompt_lens), "budget_blocks": budget,
        "generate_batch_sweep": {str(r[0]): float(r[2]) for r in sweep_rows}, "generate_batch_best": best,
        "mix": {name: {"seconds": r.seconds, "generated": r.generated, "tokens_per_s": r.tokens_per_s,
                       "ttft_p50": pct(r.ttft, 50), "ttft_p99": pct(r.ttft, 99), "itl_p50": pct(r.itl, 50),
                       "itl_p99": pct(r.itl, 99), "kv_peak_bytes": r.kv_peak, "kv_note": r.kv_note,
                       "equal_to_padded_dynamic": agreement(r, runs[DYNAMIC])} for name, r in runs.items()},
    }

    if args.shared:
        shared = shared_prefix_workload(tokenizer, args.shared, 500, 16 if quick else 32)
        lens = [len(r.prompt) for r in shared]
        print(f"\n== 2. {len(shared)} requests sharing a system prompt: prompts {min(lens)}-{max(lens)} tokens "
              f"({sum(lens):,} in all), {shared[0].max_new_tokens} new tokens each, all submitted at once", flush=True)
        shared_budget = math.ceil(sum(lens) / BLOCK) + len(shared) * math.ceil(shared[0].max_new_tokens / BLOCK + 1)
        runs2: dict[str, Run] = {}
        for round_ in range(args.rounds):
            for name, caching in (("engine, no prefix caching", False), ("engine, prefix caching", True)):
                run = run_engine(model_engine, shared, shared_budget, args.engine_batch_tokens, caching, eos, name)
                if name not in runs2 or run.seconds < runs2[name].seconds:
                    runs2[name] = run
        base = runs2["engine, no prefix caching"]
        rows = []
        for name, run in runs2.items():
            s = run.extra["stats"]
            rows.append([name, s.prompt_tokens, s.prompt_tokens_computed,
                         f"{s.prompt_tokens_computed / base.extra['stats'].prompt_tokens_computed:.2f}x",
                         s.prefix_hit_tokens, f"{run.seconds:.1f}", f"{run.tokens_per_s:.1f}",
                         f"{pct(run.ttft, 50):.2f} / {pct(run.ttft, 99):.2f}", agreement(run, base)])
        print(format_table(["contender", "prompt tokens", "computed", "vs no caching", "prefix hits", "wall s",
                            "tokens/s", "TTFT p50 / p99 s", "tokens = no caching"], rows))
        result["shared"] = {name: {"prompt_tokens": r.extra["stats"].prompt_tokens,
                                   "computed": r.extra["stats"].prompt_tokens_computed,
                                   "seconds": r.seconds, "tokens_per_s": r.tokens_per_s}
                            for name, r in runs2.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
