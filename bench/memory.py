"""How much KV memory does each cache waste, and how many sequences fit in a fixed budget?

A simulation (no model runs): each workload is served step by step by the engine's own scheduler on a pool that makes
no K/V tensor, for reservation at the context length (StaticCache-style) and PagedCache at several block sizes, and
replayed as padded static batches (DynamicCache in a batched generate()). Definitions: ``hf_paged/tools/simulate.py``.

Workloads (lengths: lognormal, clipped so prompt + output <= 2048, means calibrated to the vLLM paper's figures):
  ShareGPT-like  prompt 161.31 / output 337.99 mean tokens, sigma 1.0 / 0.9; 1000 requests in 3 GiB
  Alpaca-like    prompt  19.31 / output  58.45 mean tokens, sigma 0.6 / 0.8; 2000 requests in 512 MiB
Budgets are chosen so the budget, not the request count, limits the batch, and a padded batch of 32 fits.
Bytes use SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64): 22.5 KiB per token in fp16.

    python bench/memory.py                      # table + PNGs in bench/out/
    python bench/memory.py --json --no-plots    # machine-readable
    python bench/memory.py --requests 4000 --budget 8GiB --dtype fp32
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_paged import parse_memory  # noqa: E402
from hf_paged.engine.options import CUDA_BATCH_TOKENS  # noqa: E402
from hf_paged.report import cpu_name  # noqa: E402
from hf_paged.tools.plots import plot_block_map, plot_memory_over_steps, plot_waste_vs_block_size  # noqa: E402
from hf_paged.tools.simulate import (  # noqa: E402
    ALPACA, SHAREGPT, SMOLLM2_135M, batch_memory_trace, block_map_snapshot, format_bytes, format_table,
    sample_workload, simulate_workload,
)

WORKLOADS = [(SHAREGPT, 1000, "3GiB"), (ALPACA, 2000, "512MiB")]  # (lengths, default requests, default budget)


def machine() -> str:
    cpu = cpu_name()
    return f"{cpu}, Python {platform.python_version()}"


DTYPE_BYTES = {"fp8": 1, "fp16": 2, "fp32": 4}  # fp8 leaves out its scales: +2 bytes per head_dim values (+3% at 64)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, help="requests per workload (default: 1000 ShareGPT-like, 2000 Alpaca-like)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", help="KV budget per workload, e.g. 2GiB (default: 3GiB ShareGPT-like, "
                   "512MiB Alpaca-like)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="fp16",
                   help="KV dtype for bytes (default fp16; fp8 = PagedCache(kv_dtype=torch.float8_e4m3fn))")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32], help="padded batch sizes (default 8 32)")
    p.add_argument("--max-batch-tokens", type=int, default=CUDA_BATCH_TOKENS,
                   help=f"the engine's tokens per step (default {CUDA_BATCH_TOKENS}, its default on CUDA)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--plots", default="bench/out", help="directory for PNGs (default bench/out)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    start = time.perf_counter()
    shape = replace(SMOLLM2_135M, dtype_bytes=DTYPE_BYTES[args.dtype])
    results, report = [], []
    for lengths, default_requests, default_budget in WORKLOADS:
        budget_bytes = parse_memory(args.budget or default_budget)
        budget_tokens = budget_bytes // shape.bytes_per_token
        requests = sample_workload(lengths, args.requests or default_requests, seed=args.seed)
        res = simulate_workload(requests, budget_tokens, block_sizes=tuple(args.block_sizes),
                                batch_sizes=tuple(args.batch_sizes), max_len=lengths.max_len,
                                max_batch_tokens=args.max_batch_tokens, name=lengths.name,
                                progress=not args.no_progress)
        results.append(res)
        report.append({"workload": asdict(lengths), "requests": len(requests), "budget_bytes": budget_bytes,
                       "budget_tokens": budget_tokens, "runs": res.summaries()})

    plots = []
    if not args.no_plots:
        out = Path(args.plots)
        out.mkdir(parents=True, exist_ok=True)
        plot_waste_vs_block_size(results, out / "waste_vs_block_size.png")
        batch = results[0].requests[:8]
        plot_memory_over_steps(batch_memory_trace(batch, block_size=16), shape, out / "memory_over_steps.png")
        small = sample_workload(ALPACA, 60, seed=args.seed)
        plot_block_map(block_map_snapshot(small, block_size=16, num_blocks=128, step=70), out / "block_map.png")
        plots = [str(out / n) for n in ("waste_vs_block_size.png", "memory_over_steps.png", "block_map.png")]
    elapsed = time.perf_counter() - start

    if args.json:
        print(json.dumps({"machine": machine(), "seed": args.seed, "shape": asdict(shape),
                          "bytes_per_token": shape.bytes_per_token, "workloads": report, "plots": plots,
                          "runtime_s": round(elapsed, 2)}, indent=2))
        return 0
    print(f"KV memory by simulation, seed {args.seed}, {shape.name} shape ({shape.num_layers} layers x "
          f"{shape.num_kv_heads} KV heads x head_dim {shape.head_dim}, {shape.dtype_name}: "
          f"{format_bytes(shape.bytes_per_token)}/token)")
    print("waste: time-averaged share of held KV not holding a token of a running request; held/ideal = 1/(1-waste)")
    print("capacity: mean running requests while others wait; ideal = paged at block size 1 (every slot real)")
    print("reserve: 2048 slots per request, refilled as requests end; padded B: static batches, finished rows held, "
          f"admitted when their final size fits; paged: the engine's scheduler, {args.max_batch_tokens} tokens per "
          "step; steps: forwards to serve all")
    for res, lengths in zip(results, [w[0] for w in WORKLOADS]):
        print()
        print(lengths.describe())
        print(format_table(res, shape))
    print()
    if plots:
        print("plots: " + ", ".join(plots))
    print(f"{elapsed:.1f} s on {machine()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
