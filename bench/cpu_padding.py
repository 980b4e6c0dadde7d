"""Does the engine's CPU step padding pay on this machine? The engine serving the same chat requests with the rule
it measures at start (hf_paged/engine/padding.py), with no padding, and with the former fixed rule (7-15 tokens and
4-15 sampled rows padded to 16, tuned on one Xeon), alternated over rounds; medians and ratios to no padding.

Also prints what the measurement found (the sizes padded) and the per-size GEMM costs it decided from.

    python bench/cpu_padding.py                      # 12 requests x 24 new tokens, 3 rounds
    MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python bench/cpu_padding.py
                                                     # the float path of an AMD CPU (make test-avx2's settings)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hf_paged import embedded  # noqa: E402
from hf_paged import disable_paged_attention  # noqa: E402
from hf_paged.engine.factory import init_continuous_batching  # noqa: E402
from hf_paged.engine.padding import PaddingRule, gemm_costs, measure_padding  # noqa: E402
from hf_paged.pool import BlockPool  # noqa: E402
from hf_paged.report import cpu_name, format_table  # noqa: E402

ISA_ENV = ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def machine() -> str:
    isa = ", ".join(f"{k}={os.environ[k]}" for k in ISA_ENV if k in os.environ) or "default ISA"
    return (f"{cpu_name()} ({platform.machine()}), torch threads {torch.get_num_threads()}, CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()} ({isa}); torch {torch.__version__}")


def serve(model, prompts, max_new_tokens: int, rule: PaddingRule) -> tuple[float, list[list[int]], int]:
    """The engine serving ``prompts`` at once with ``rule``: (seconds, tokens per request, steps)."""
    disable_paged_attention(model)
    pool = BlockPool(block_size=16, num_blocks=512, prefix_caching=False)
    with init_continuous_batching(model, pool=pool, max_batch_tokens=512) as manager:
        manager._core.runner.padding = rule  # the rule under test, in place of the measured one
        start = time.perf_counter()
        ids = manager.add_requests(prompts, max_new_tokens=max_new_tokens, do_sample=False)
        results = [manager.get_result(rid) for rid in ids]
        seconds = time.perf_counter() - start
        steps = manager.stats().steps
    return seconds, [list(r.generated_tokens) for r in results], steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    print(f"machine: {machine()}", flush=True)
    model, tokenizer = embedded.load()
    chats = embedded.CHAT_PROMPTS
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": chats[i % len(chats)]}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False))
               for i in range(args.requests)]

    started = time.perf_counter()
    measured = measure_padding(model)
    print(f"measured in {time.perf_counter() - started:.1f} s: {measured.describe()}")
    layer_cost, head_cost = gemm_costs(model)
    shown = (1, 4, 7, 8, 12, 15, 16)
    print("GEMM ms per size (fastest of 5, this model): decoder layer's linears "
          + " ".join(f"{n}:{layer_cost[n] * 1e3:.2f}" for n in shown)
          + "; head (4096 rows) " + " ".join(f"{n}:{head_cost[n] * 1e3:.2f}" for n in shown), flush=True)

    rules = {"measured": measured, "none": PaddingRule(), "fixed (7-15 / 4-15 -> 16)": PaddingRule.fixed()}
    serve(model, prompts[:2], 4, PaddingRule())  # untimed warm-up
    seconds = {name: [] for name in rules}
    tokens, steps = {}, {}
    for r in range(args.rounds):
        names = list(rules)[r % len(rules):] + list(rules)[:r % len(rules)]  # alternated
        for name in names:
            secs, toks, n = serve(model, prompts, args.max_new_tokens, rules[name])
            seconds[name].append(secs)
            tokens[name], steps[name] = toks, n
            print(f"  round {r + 1}/{args.rounds} {name}: {secs:.2f} s", flush=True)
    generated = sum(map(len, tokens["none"]))
    base = statistics.median(seconds["none"])
    rows = [[name, rules[name].describe().split(": ", 1)[1], " ".join(f"{s:.2f}" for s in seconds[name]),
             f"{statistics.median(seconds[name]):.2f}", f"{generated / statistics.median(seconds[name]):.1f}",
             f"{base / statistics.median(seconds[name]):.3f}x", steps[name],
             "yes" if tokens[name] == tokens["none"] else "NO"] for name in rules]
    print(format_table(["rule", "sizes padded", "runs (s)", "median s", "tokens/s", "vs none", "steps",
                        "tokens = none"], rows))
    print(f"{args.requests} chat requests served at once, up to {args.max_new_tokens} new tokens each, greedy, "
          f"{generated} tokens; vs none: no padding's median time / the rule's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
