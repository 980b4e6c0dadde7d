"""The main job: a batch of chat prompts through generate() with DynamicCache and with PagedCache.

Checks the outputs are identical and prints the KV memory each cache held, with tokens/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import DynamicCache

from . import compat, embedded, ops
from .attention import disable_paged_attention, enable_paged_attention
from .cache import PagedCache
from .progress import GenerationProgress
from .report import dynamic_cache_bytes, format_table, mb, real_kv_bytes, row_token_counts


def _generate(model, inputs, cache, max_new_tokens: int, label: str):
    progress = GenerationProgress(max_new_tokens, label)
    start = time.perf_counter()
    out = model.generate(**inputs, **{compat.GENERATE_CACHE_KWARG: cache}, max_new_tokens=max_new_tokens, do_sample=False,
                         stopping_criteria=[progress])
    elapsed = time.perf_counter() - start
    progress.close()
    return out, elapsed


KV_DTYPES = {"model": None, "fp8": torch.float8_e4m3fn}


def run(model_path=None, batch_size: int = 8, max_new_tokens: int = 64, block_size: int = 16,
        backend: str = "auto", kv_dtype: str = "model") -> dict:
    print(f"loading {'the embedded SmolLM2-135M-Instruct' if model_path is None else model_path} ...", flush=True)
    model, tokenizer = embedded.load(model_path)
    inputs = embedded.chat_batch(tokenizer, batch_size)
    real_prompt = int(inputs["attention_mask"].sum())
    print(f"{batch_size} chat prompts, {real_prompt} real prompt tokens padded to {inputs['input_ids'].shape[1]} "
          f"columns, {max_new_tokens} new tokens, greedy, {next(model.parameters()).dtype}", flush=True)

    dynamic = DynamicCache(config=model.config)
    out_dynamic, t_dynamic = _generate(model, inputs, dynamic, max_new_tokens, "DynamicCache")

    enable_paged_attention(model, backend=backend)
    paged = PagedCache(model.config, block_size=block_size, kv_dtype=KV_DTYPES[kv_dtype])
    out_paged, t_paged = _generate(model, inputs, paged, max_new_tokens, f"PagedCache ({kv_dtype} blocks)")
    disable_paged_attention(model)

    identical = torch.equal(out_dynamic, out_paged)
    same_rows = sum(torch.equal(a, b) for a, b in zip(out_dynamic, out_paged))
    dtype = next(model.parameters()).dtype
    row_tokens = row_token_counts(out_dynamic, inputs["attention_mask"], model.generation_config.eos_token_id)
    real_bytes = real_kv_bytes(model.config, dtype, row_tokens)
    new_tokens = out_dynamic.shape[1] - inputs["input_ids"].shape[1]
    stats = paged.memory_stats()
    dyn_bytes = dynamic_cache_bytes(dynamic)
    name = f"PagedCache (block {block_size}, {ops.resolve_backend(backend, model.device)}, {kv_dtype} blocks)"
    rows = [
        ["DynamicCache", mb(dyn_bytes), mb(dyn_bytes), mb(dyn_bytes), f"{real_bytes / dyn_bytes:.0%}",
         batch_size * new_tokens / t_dynamic, 1.0],
        [name, mb(stats.bytes_reserved), mb(stats.peak_bytes_in_use), mb(stats.bytes_in_use),
         f"{stats.utilization:.0%}", batch_size * new_tokens / t_paged, t_dynamic / t_paged],
    ]
    print()
    print(format_table(["cache", "KV reserved", "KV peak", "KV at end", "used at end", "tokens/s", "speed ratio"],
                       rows))
    print(f"\nKV the rows really need at the end of DynamicCache's run: {sum(row_tokens):,} tokens, {mb(real_bytes)} "
          f"({dtype}; sliding-window layers count only their window), held in {mb(dyn_bytes)} (padding and "
          f"finished rows included). PagedCache ends holding {stats.tokens_stored:,} tokens in {stats.blocks_in_use} "
          "blocks: rows that finished early already gave their blocks back.")
    if kv_dtype != "model":
        per_token = stats.bytes_per_block / block_size
        full = real_kv_bytes(model.config, dtype, [1])
        print(f"{kv_dtype} blocks: {per_token:,.0f} bytes per token over all layers vs {full:,} in {dtype}: "
              f"{full / per_token:.1f}x the tokens in the same memory. Rows identical to full precision: "
              f"{same_rows}/{batch_size}.")
    print(f"outputs identical: {'yes' if identical else 'NO'}")
    texts = tokenizer.batch_decode(out_paged[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    for text in texts[:2]:
        print(f"  > {text.strip()[:100]!r}")
    return {
        "identical": identical,
        "dynamic_bytes": dyn_bytes,
        "paged_peak_bytes": stats.peak_bytes_in_use,
        "paged_reserved_bytes": stats.bytes_reserved,
        "real_bytes": real_bytes,
        "rows_identical": same_rows,
        "dynamic_tokens_per_s": batch_size * new_tokens / t_dynamic,
        "paged_tokens_per_s": batch_size * new_tokens / t_paged,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_paged demo", description=__doc__)
    parser.add_argument("--model", default=None, help="a local model directory (default: the embedded SmolLM2)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--kv-dtype", default="model", choices=sorted(KV_DTYPES),
                        help="PagedCache block dtype: the model's, or fp8 (e4m3, scaled per layer and KV head)")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args(argv)
    result = run(args.model, args.batch_size, args.max_new_tokens, args.block_size, args.backend, args.kv_dtype)
    if args.json:
        print(json.dumps(result))
    return 0 if result["identical"] or args.kv_dtype != "model" else 1


if __name__ == "__main__":
    sys.exit(main())
