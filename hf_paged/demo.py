"""The main job: a batch of chat prompts through generate() with DynamicCache and with PagedCache.

Checks the outputs are identical and prints the KV memory each cache held, with tokens/s. Then serves a queue of
chat requests three ways (padded generate() batches, the continuous-batching engine, transformers' generate_batch)
and prints tokens/s and the KV each held.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from . import compat, embedded, ops
from .allocator import cdiv
from .engine.cpu_linears import native_dtype
from .engine.factory import init_continuous_batching
from .pool import BlockPool
from .enable import disable_paged_attention, enable_paged_attention
from .cache import PagedCache
from .progress import GenerationProgress
from .report import dynamic_cache_bytes, format_table, kv_bytes_per_token, mb, real_kv_bytes, row_token_counts


def _generate(model, inputs, cache, max_new_tokens: int, label: str):
    progress = GenerationProgress(max_new_tokens, label)
    start = time.perf_counter()
    out = model.generate(**inputs, **{compat.GENERATE_CACHE_KWARG: cache}, max_new_tokens=max_new_tokens, do_sample=False,
                         stopping_criteria=[progress])
    elapsed = time.perf_counter() - start
    progress.close()
    return out, elapsed


KV_DTYPES = {"model": None, "fp8": torch.float8_e4m3fn}
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}  # auto: native_dtype()


def run(model_path=None, batch_size: int = 8, max_new_tokens: int = 64, block_size: int = 16,
        backend: str = "auto", kv_dtype: str = "model", serve_requests: int = 16, pairs: int = 2,
        serve_rounds: int = 3, dtype: str = "auto") -> dict:
    print(f"loading {'the embedded SmolLM2-135M-Instruct' if model_path is None else model_path} ...", flush=True)
    model, tokenizer = embedded.load(model_path, dtype=DTYPES[dtype] or native_dtype("cpu"))
    inputs = embedded.chat_batch(tokenizer, batch_size)
    real_prompt = int(inputs["attention_mask"].sum())
    print(f"{batch_size} chat prompts, {real_prompt} real prompt tokens padded to {inputs['input_ids'].shape[1]} "
          f"columns, {max_new_tokens} new tokens, greedy, {next(model.parameters()).dtype}; timed in {pairs} "
          "alternated pairs after an untimed warm-up of each", flush=True)

    def one(is_paged: bool, new_tokens: int, label: str):
        if is_paged:
            enable_paged_attention(model, backend=backend)
            cache = PagedCache(model.config, block_size=block_size, kv_dtype=KV_DTYPES[kv_dtype])
        else:
            disable_paged_attention(model)
            cache = DynamicCache(config=model.config)
        out, seconds = _generate(model, inputs, cache, new_tokens, label)
        return out, seconds, cache

    paged_label = f"PagedCache ({kv_dtype} blocks)"
    one(False, 2, "warm-up DynamicCache")  # first calls pay one-time costs (kernels, allocator): time neither
    one(True, 2, f"warm-up {paged_label}")
    times = {False: [], True: []}
    for i in range(pairs):
        for is_paged in ((False, True) if i % 2 == 0 else (True, False)):
            label = f"{i + 1}/{pairs} {paged_label if is_paged else 'DynamicCache'}"
            out, seconds, cache = one(is_paged, max_new_tokens, label)
            times[is_paged].append(seconds)
            if is_paged:
                out_paged, paged = out, cache
            else:
                out_dynamic, dynamic = out, cache
    disable_paged_attention(model)
    t_dynamic, t_paged = statistics.median(times[False]), statistics.median(times[True])

    identical = torch.equal(out_dynamic, out_paged)
    same_rows = sum(torch.equal(a, b) for a, b in zip(out_dynamic, out_paged))
    parted = [] if identical or kv_dtype != "model" else near_ties(model, inputs, out_paged, out_dynamic)
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
    print(f"runs (s), alternated: DynamicCache {' '.join(f'{t:.1f}' for t in times[False])}, PagedCache "
          f"{' '.join(f'{t:.1f}' for t in times[True])}; speed ratio: DynamicCache's median time / PagedCache's "
          "(single runs vary with the machine's load)")
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
    if identical or kv_dtype != "model":
        print(f"outputs identical: {'yes' if identical else 'NO'}")
    else:  # another attention kernel rounds differently: a row may part at a near-tie, never at a clear margin
        ties = all(p["near_tie"] for p in parted)
        print(f"outputs identical: {same_rows}/{batch_size} rows; "
              f"{'each other row parts at a near-tie' if ties else 'NO: a row parts at a clear margin'} (the two "
              f"tokens' logits in DynamicCache's forward there, in units of {dtype}'s resolution: "
              + ", ".join(f"row {p['row']} at token {p['column']}: {p['ulps']:.1f}" for p in parted) + ")")
    texts = tokenizer.batch_decode(out_paged[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    for text in texts[:2]:
        print(f"  > {text.strip()[:100]!r}")
    served = serve_many(model, tokenizer, serve_requests, batch_size=batch_size, block_size=block_size,
                        rounds=serve_rounds) if serve_requests else None
    return {
        "serve": served,
        "identical": identical,
        "equal_but_near_ties": bool(parted) and all(p["near_tie"] for p in parted),
        "parted": parted,
        "dynamic_bytes": dyn_bytes,
        "paged_peak_bytes": stats.peak_bytes_in_use,
        "paged_reserved_bytes": stats.bytes_reserved,
        "real_bytes": real_bytes,
        "rows_identical": same_rows,
        "dynamic_tokens_per_s": batch_size * new_tokens / t_dynamic,
        "paged_tokens_per_s": batch_size * new_tokens / t_paged,
    }


def near_ties(model, inputs, ours: torch.Tensor, reference: torch.Tensor, ulps: float = 4.0) -> list[dict]:
    """Where two greedy runs of the same prompts part: for each row that differs, the first differing column, the
    two tokens, and the gap between their logits in ``reference``'s own forward (``model`` as it is, no cache) at that
    position, in units of the logits' dtype resolution there. A gap within ``ulps`` is a near-tie: two
    computations that round differently (another attention kernel, another summation order) may pick either token,
    and everything after differs. A greedy run that parts from ``reference`` at a clear margin is a wrong token."""
    width = inputs["input_ids"].shape[1]
    parted = []
    for r in range(ours.shape[0]):
        differ = (ours[r, width:] != reference[r, width:]).nonzero()
        if not len(differ):
            continue
        col = width + int(differ[0])
        keep = torch.cat([inputs["attention_mask"][r].bool(), torch.ones(col - width, dtype=torch.bool)])
        prefix = reference[r, :col][keep[:col]][None]  # [1, real tokens before the parting]
        with torch.no_grad():
            logits = model(prefix).logits[0, -1]
        a, b = int(ours[r, col]), int(reference[r, col])
        top = max(abs(float(logits[a])), abs(float(logits[b])))
        resolution = torch.finfo(logits.dtype).eps * 2 ** math.floor(math.log2(top)) if top > 0 else 0.0
        gap = abs(float(logits[a]) - float(logits[b]))
        parted.append({"row": r, "column": col - width, "ours": a, "reference": b, "gap": gap,
                       "ulps": gap / resolution if resolution else math.inf,
                       "near_tie": gap <= ulps * resolution})
    return parted


def _padded_runs(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int, eos: set[int]):
    """generate() with DynamicCache over padded batches of ``batch_size``: (tokens per request, seconds, KV peak)."""
    tokens, kv_peak = [], 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)  # [b, width]
        mask = torch.zeros_like(ids)  # [b, width]
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        cache = DynamicCache(config=model.config)
        progress = GenerationProgress(max_new_tokens, f"padded generate(), batch {i // batch_size + 1}")
        out = model.generate(input_ids=ids, attention_mask=mask, **{compat.GENERATE_CACHE_KWARG: cache},
                             max_new_tokens=max_new_tokens, do_sample=False, stopping_criteria=[progress])
        progress.close()
        for row in out[:, width:].tolist():
            tokens.append(_until_eos(row, eos))
        kv_peak = max(kv_peak, dynamic_cache_bytes(cache))
    return tokens, time.perf_counter() - start, kv_peak


def _until_eos(row: list[int], eos: set[int]) -> list[int]:
    for j, token in enumerate(row):
        if token in eos:
            return row[:j + 1]
    return row


def _transformers_generate_batch(model, prompts, max_new_tokens: int, num_blocks: int, block_size: int):
    """transformers' own continuous batching on a copy of ``model`` (not on the paged path; sdpa, pages of
    ``block_size``, ``num_blocks`` of them): (tokens per request, seconds, KV reserved bytes)."""
    model = copy.deepcopy(model)  # generate_batch switches the copy's attention to its own paged one
    config = compat.ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks, max_batch_tokens=512,
                                      auto_switch_to_flash=False)
    generation_config = copy.deepcopy(model.generation_config)
    generation_config.do_sample, generation_config.max_new_tokens = False, max_new_tokens
    start = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=generation_config, continuous_batching_config=config,
                                   progress_bar=True)
    seconds = time.perf_counter() - start
    reserved = num_blocks * block_size * kv_bytes_per_token(model.config, next(model.parameters()).dtype)
    return [list(out.generated_tokens) for out in outputs.values()], seconds, reserved


def serve_many(model, tokenizer, num_requests: int = 16, max_new_tokens: int = 32,
               batch_size: int = 8, block_size: int = 16, rounds: int = 3) -> dict:
    """``num_requests`` chat requests, all at once: padded generate(), the engine, transformers' generate_batch,
    each timed in ``rounds`` alternated rounds (the median counts)."""
    chats = embedded.CHAT_PROMPTS
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": chats[i % len(chats)]
                                               + ("" if i < len(chats) else " Answer in one sentence.")}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
               for i in range(num_requests)]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    eos_ids = model.generation_config.eos_token_id
    eos = set(eos_ids if isinstance(eos_ids, (list, tuple)) else [eos_ids])
    dtype = next(model.parameters()).dtype
    per_token = kv_bytes_per_token(model.config, dtype)
    widest = max(max(map(len, prompts[i:i + batch_size])) * len(prompts[i:i + batch_size])
                 for i in range(0, num_requests, batch_size))
    num_blocks = cdiv(widest + batch_size * max_new_tokens, block_size)  # what a padded batch needs at its end
    print(f"\nServing {num_requests} chat requests at once ({sum(map(len, prompts)):,} prompt tokens, up to "
          f"{max_new_tokens} new tokens each, greedy), every contender with {num_blocks} blocks x {block_size} tokens "
          f"({mb(num_blocks * block_size * per_token)}) of KV:", flush=True)

    def engine_run():
        disable_paged_attention(model)
        pool = BlockPool(block_size=block_size, num_blocks=num_blocks, prefix_caching=True)
        with init_continuous_batching(model, pool=pool, max_batch_tokens=512) as manager:
            start = time.perf_counter()
            ids = manager.add_requests(prompts, max_new_tokens=max_new_tokens, do_sample=False)
            results = [manager.get_result(rid) for rid in ids]
            seconds = time.perf_counter() - start
            engine_stats.append(manager.stats())
        disable_paged_attention(model)
        engine_peaks.append(pool.memory_stats().peak_bytes_in_use)
        return [list(r.generated_tokens) for r in results], seconds, None

    def padded_run():
        disable_paged_attention(model)
        return _padded_runs(model, tokenizer, prompts, max_new_tokens, batch_size, eos)

    def generate_batch_run():
        return _transformers_generate_batch(model, prompts, max_new_tokens, num_blocks, block_size)

    engine_stats, engine_peaks = [], []
    contenders = {"padded": padded_run, "engine": engine_run, "generate_batch": generate_batch_run}
    times = {name: [] for name in contenders}
    outputs = {}
    for r in range(rounds):  # alternated: each round starts with the next contender, so load drifts hit all alike
        names = list(contenders)[r % len(contenders):] + list(contenders)[:r % len(contenders)]
        for name in names:
            if name == "generate_batch" and outputs.get(name, ()) is None:
                continue
            try:
                tokens, seconds, kv = contenders[name]()
            except Exception as err:  # transformers' generate_batch: report it, show the rest
                print(f"transformers' generate_batch failed: {type(err).__name__}: {err}")
                outputs[name] = None
                continue
            times[name].append(seconds)
            outputs[name] = (tokens, kv)
    padded_tokens, kv_padded = outputs["padded"]
    engine_tokens = outputs["engine"][0]
    t_padded, t_engine = statistics.median(times["padded"]), statistics.median(times["engine"])
    cb_tokens = cb_reserved = t_cb = None
    if outputs.get("generate_batch") is not None:
        cb_tokens, cb_reserved = outputs["generate_batch"]
        t_cb = statistics.median(times["generate_batch"])
    stats, engine_peak = engine_stats[-1], max(engine_peaks)

    def row(name, tokens, seconds, reserved, peak):
        generated = sum(map(len, tokens))
        same = sum(a == b for a, b in zip(tokens, padded_tokens))
        return [name, f"{seconds:.1f}", generated, generated / seconds, f"{t_padded / seconds:.2f}x", reserved, peak,
                f"{same}/{num_requests}"]

    reserved = mb(num_blocks * block_size * per_token)
    rows = [row(f"generate(), padded batches of {batch_size}", padded_tokens, t_padded, mb(kv_padded),
                mb(kv_padded)),
            row("hf_paged engine (init_continuous_batching)", engine_tokens, t_engine, reserved, mb(engine_peak))]
    if cb_tokens is not None:
        rows.append(row("transformers generate_batch", cb_tokens, t_cb, mb(cb_reserved), "-"))
    print(format_table(["contender", "seconds (median)", "tokens", "tokens/s", "speed ratio", "KV reserved",
                        "KV peak", "tokens = padded"], rows))
    runs = ", ".join(f"{name} {' '.join(f'{t:.1f}' for t in ts)}" for name, ts in times.items() if ts)
    print(f"runs (s), alternated over {rounds} round(s): {runs}; speed ratio: padded generate()'s median time / the "
          "contender's")
    print(f"engine: {stats.steps} forwards (prefill chunks and decode tokens packed together), {stats.preemptions} "
          f"preemptions, prefix hits {stats.prefix_hit_tokens} tokens. DynamicCache's KV: its largest batch's cache "
          "(padding and finished rows included); generate_batch reserves its pages up front.")
    return {
        "engine_tokens_per_s": sum(map(len, engine_tokens)) / t_engine,
        "padded_tokens_per_s": sum(map(len, padded_tokens)) / t_padded,
        "generate_batch_tokens_per_s": sum(map(len, cb_tokens)) / t_cb if cb_tokens is not None else None,
        "engine_kv_peak_bytes": engine_peak, "padded_kv_peak_bytes": kv_padded,
        "engine_equal_to_padded": sum(a == b for a, b in zip(engine_tokens, padded_tokens)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_paged demo", description=__doc__)
    parser.add_argument("--model", default=None, help="a local model directory (default: the embedded SmolLM2)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--dtype", default="auto", choices=sorted(DTYPES),
                        help="weights' dtype (default auto: bfloat16 where the CPU computes it natively, avx512_bf16 "
                             "or AMX, else float32). In bfloat16 PagedCache's attention rounds differently from "
                             "DynamicCache's SDPA, so a row may part at a near-tie: the check then reports the gap of "
                             "the two tokens' logits and passes only if every parting is a near-tie")
    parser.add_argument("--kv-dtype", default="model", choices=sorted(KV_DTYPES),
                        help="PagedCache block dtype: the model's, or fp8 (e4m3, a scale per token and KV head)")
    parser.add_argument("--serve-requests", type=int, default=16,
                        help="requests served at once after the main job (0: skip that part)")
    parser.add_argument("--pairs", type=int, default=2,
                        help="timed DynamicCache / PagedCache pairs, alternated (the speed ratio is of the medians)")
    parser.add_argument("--serve-rounds", type=int, default=3,
                        help="rounds of the serving comparison, each contender once per round, alternated (medians)")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args(argv)
    result = run(args.model, args.batch_size, args.max_new_tokens, args.block_size, args.backend, args.kv_dtype,
                 args.serve_requests, max(1, args.pairs), max(1, args.serve_rounds), args.dtype)
    if args.json:
        print(json.dumps(result))
    return 0 if result["identical"] or result["equal_but_near_ties"] or args.kv_dtype != "model" else 1


if __name__ == "__main__":
    sys.exit(main())
