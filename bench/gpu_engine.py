"""The engine against transformers' generate_batch on a GPU: tokens/s and time to first token on a request mix.

A random-weight Llama of Llama-3.2-1B's shape (bf16, built on the device; nothing downloaded), 256 requests of
bench/serve.py's mix (lognormal prompt and output lengths: prompts <= 1,000 tokens, outputs <= 128, random token
ids, no EOS so every request generates its own max_new_tokens), all submitted at once. Contenders, alternated after
an untimed warm-up each: ``hf_paged.init_continuous_batching`` with its defaults (decode-only steps replayed from
CUDA graphs) but a 12 GiB pool each (``ENGINE_POOL``), the same with ``cuda_graphs=False`` (every step eager: what
the graphs buy), and transformers' ``init_continuous_batching`` with its defaults (the persistent manager
``generate_batch`` uses, with its CUDA-graph warm-up), each on its own copy of the model; the engines' managers
persist from the warm-up to the timed run as transformers' does (graphs captured in the warm-up replay in the run;
those captured in the run count in its time). The dry run on CPU emulates the graphs
(``hf_paged.engine.graphs.EmulatedGraph``) so that their path runs too.

    python bench/gpu_engine.py                     # on the GPU machine (bench/gpu.sh runs it)
    DRY=1 python bench/gpu_engine.py               # CPU, tiny shapes, 8 short requests: checks the script runs
    python bench/gpu_engine.py --requests 64 --json out.json

Prints a table (and appends one JSON object per contender to $OUT/engine.jsonl when OUT is set).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import transformers  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged.report import format_table  # noqa: E402
from serve import collect_results, gaps, machine, mix_lengths, pct  # noqa: E402

SHAPES = {  # hidden, layers, q heads, kv heads, head_dim, intermediate, vocab
    "1b": (2048, 16, 32, 8, 64, 8192, 128256),
    "tiny": (64, 2, 4, 2, 16, 128, 256),
}
ENGINE, EAGER, CB = "hf_paged engine", "hf_paged engine, eager", "transformers generate_batch"


def build_model(shape: str, device: torch.device, dtype: torch.dtype):
    hidden, layers, heads, kv_heads, head_dim, inter, vocab = SHAPES[shape]
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
                         max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config = GenerationConfig(do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    return model


def workload(n: int, max_prompt: int, max_output: int, output_mean: float, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = mix_lengths(n, max_prompt, max_output, output_mean, seed)
    return [(torch.randint(2, vocab, (p,), generator=g).tolist(), o) for p, o in lengths]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


ENGINE_POOL = "12GiB"  # each engine's pool: ~2.5x what the 256 requests hold at once at the 1B shape


def start_engine(model, small: bool, graphs: bool):
    """A started engine manager with its defaults but the pool (``graphs=False``: ``cuda_graphs=False``), kept for
    the warm-up and the timed run as transformers' persistent manager is. The two engines live side by side, so each
    gets a pool of ``ENGINE_POOL`` with prefix caching (the default sizes itself from the memory free when it is made:
    the second would be sized from what the first has not taken yet); ``small`` (the CPU dry run): 64 blocks and 128
    tokens a step."""
    if small:
        options = dict(pool=hf_paged.BlockPool(block_size=16, num_blocks=64), max_batch_tokens=128)
    else:
        options = dict(pool=hf_paged.BlockPool(block_size=16, max_memory=ENGINE_POOL, prefix_caching=True))
    manager = hf_paged.init_continuous_batching(model, cuda_graphs=None if graphs else False, **options)
    manager.start()
    return manager


COUNTED = ("host_time_s", "forward_time_s", "steps", "preemptions", "graphs_captured", "graph_replays",
           "graph_capture_s")


def run_engine(manager, requests, device):
    """``requests`` through a started manager; its counters over this run only."""
    before = manager.stats()
    sync(device)
    start = time.perf_counter()
    ids = [manager.add_request(p, max_new_tokens=m) for p, m in requests]
    results = [manager.get_result(rid) for rid in ids]
    sync(device)
    seconds = time.perf_counter() - start
    after = manager.stats()
    errors = [r.error for r in results if r is None or r.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} engine requests failed, e.g. {errors[0]}")
    counted = {k: getattr(after, k) - getattr(before, k) for k in COUNTED}
    return dict(seconds=seconds, generated=sum(len(r.generated_tokens) for r in results),
                tokens=[list(r.generated_tokens) for r in results], ttft=[r.first_token_time - start for r in results],
                itl=[g for r in results for g in gaps(r.timestamps)],
                kv_reserved_bytes=manager.pool.memory_stats().bytes_reserved,
                host_s=counted["host_time_s"], forward_s=counted["forward_time_s"], steps=counted["steps"],
                preemptions=counted["preemptions"], graphs_captured=counted["graphs_captured"],
                graph_replays=counted["graph_replays"], graph_capture_s=counted["graph_capture_s"],
                graphs_off=after.graphs_off)


def run_cb(model, requests, device, warmup: bool, small: bool):
    """transformers' manager with its defaults; ``small`` (the CPU dry run): 64 pages of 16 and 128 tokens a step, as
    its CPU defaults take seconds per step on tiny models."""
    gen = copy.deepcopy(model.generation_config)
    config = None
    if small:
        from serve import cb_config

        config = cb_config(64, 128)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=config)
    if warmup and device.type == "cuda" and hasattr(manager, "warmup"):
        manager.warmup()
    manager.start()
    try:
        sync(device)
        start = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=m, record_timestamps=True) for p, m in requests]
        results = collect_results(manager, len(ids))
        sync(device)
        seconds = time.perf_counter() - start
        cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
        tensor = getattr(cache, "cache_tensor", None)
    finally:
        manager.stop(block=True, timeout=60)
        if hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
    ordered = [results[i] for i in ids]
    return dict(seconds=seconds, generated=sum(len(r.generated_tokens) for r in ordered),
                tokens=[list(r.generated_tokens) for r in ordered],
                ttft=[r.timestamps[0] - start for r in ordered if r.timestamps],
                itl=[g for r in ordered for g in gaps(list(r.timestamps or []))],
                kv_reserved_bytes=tensor.numel() * tensor.element_size() if tensor is not None else None)


def main(argv=None) -> int:
    dry = os.environ.get("DRY") == "1"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tiny" if dry else "1b", choices=sorted(SHAPES))
    parser.add_argument("--requests", type=int, default=8 if dry else 256)
    parser.add_argument("--max-prompt", type=int, default=48 if dry else 1000)
    parser.add_argument("--max-output", type=int, default=6 if dry else 128)
    parser.add_argument("--output-mean", type=float, default=4 if dry else 48)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not dry else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    if dry:  # CPU: the graph path runs with emulated graphs
        from hf_paged.engine import graphs

        graphs.graph_type = lambda device: graphs.EmulatedGraph
    print(f"machine: {machine()}", flush=True)
    models = {name: build_model(args.shape, device, dtype) for name in (ENGINE, EAGER, CB)}
    vocab = SHAPES[args.shape][-1]
    requests = workload(args.requests, args.max_prompt, args.max_output, args.output_mean, vocab)
    prompt_tokens = sum(len(p) for p, _ in requests)
    print(f"{args.shape} shape, {dtype}, {device}: {len(requests)} requests, {prompt_tokens:,} prompt tokens, "
          f"{sum(m for _, m in requests):,} new tokens (no EOS), all submitted at once", flush=True)

    warm = [(p[:32], 2) for p, _ in requests[:4]]
    warm_s = {}
    managers = {ENGINE: start_engine(models[ENGINE], dry, graphs=True),
                EAGER: start_engine(models[EAGER], dry, graphs=False)}
    calls = {ENGINE: lambda r: run_engine(managers[ENGINE], r, device),
             EAGER: lambda r: run_engine(managers[EAGER], r, device),
             CB: lambda r: run_cb(models[CB], r, device, warmup=True, small=dry)}
    for name, call in calls.items():
        start = time.perf_counter()
        call(warm)
        warm_s[name] = time.perf_counter() - start
    rows, out = [], []
    try:
        results = {ENGINE: calls[ENGINE](requests), EAGER: calls[EAGER](requests),
                   CB: run_cb(models[CB], requests, device, warmup=False, small=dry)}
    finally:
        for manager in managers.values():
            manager.stop(block=True, timeout=60)
    same = sum(a == b for a, b in zip(results[ENGINE]["tokens"], results[CB]["tokens"]))
    for name, r in results.items():
        tok_s = r["generated"] / r["seconds"]
        row = dict(contender=name, shape=args.shape, device=machine(), requests=len(requests),
                   prompt_tokens=prompt_tokens, generated=r["generated"], seconds=r["seconds"], tokens_per_s=tok_s,
                   ttft_p50=pct(r["ttft"], 50), ttft_p99=pct(r["ttft"], 99), itl_p50=pct(r["itl"], 50),
                   itl_p99=pct(r["itl"], 99), warmup_s=warm_s[name], kv_reserved_bytes=r["kv_reserved_bytes"],
                   requests_equal=same,
                   torch=torch.__version__, transformers=transformers.__version__,
                   **{k: r[k] for k in ("host_s", "forward_s", "steps", "preemptions", "graphs_captured",
                                        "graph_replays", "graph_capture_s", "graphs_off") if k in r})
        out.append(row)
        kv = r["kv_reserved_bytes"]
        rows.append([name, f"{r['seconds']:.1f}", r["generated"], f"{tok_s:.0f}",
                     f"{tok_s / (results[CB]['generated'] / results[CB]['seconds']):.2f}x",
                     f"{row['ttft_p50']:.2f} / {row['ttft_p99']:.2f}",
                     f"{1e3 * row['itl_p50']:.1f} / {1e3 * row['itl_p99']:.1f}",
                     "-" if kv is None else f"{kv / 2**30:.2f}", f"{warm_s[name]:.1f}"])
    print(format_table(["contender", "wall s", "tokens", "tokens/s", "vs generate_batch", "TTFT p50 / p99 s",
                        "ITL p50 / p99 ms", "KV GiB", "warm-up s"], rows))
    for name in (ENGINE, EAGER):
        r = results[name]
        print(f"{name}: {r['steps']} steps, host {r['host_s']:.1f} s + forward {r['forward_s']:.1f} s, "
              f"{r['preemptions']} preemptions, {r['graphs_captured']} graphs captured in this run "
              f"({r['graph_capture_s']:.1f} s), {r['graph_replays']} steps replayed"
              + ("" if r["graphs_off"] is None else f" (graphs turned off: {r['graphs_off']})"))
    print(f"requests with the same tokens in the engine and generate_batch: {same}/{len(requests)} (random weights in "
          f"{dtype}: near-ties flip greedy tokens)")
    lines = "".join(json.dumps(row) + "\n" for row in out)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "engine.jsonl"), "a") as f:
            f.write(lines)
    if args.json:
        Path(args.json).write_text(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
