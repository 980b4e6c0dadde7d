"""End to end on a real model: what do tokens/s and KV memory look like with PagedCache in generate()?

1. Greedy batch: DynamicCache (model not patched), PagedCache (torch backend; Triton on CUDA) and transformers' own
   continuous batching (a persistent manager) on the same chat prompts, runs alternated in one process. Tokens/s,
   token equality with DynamicCache, and the KV each cache held.
2. Sharing: beam search and parallel sampling (num_return_sequences) with DynamicCache vs PagedCache: equal tokens,
   KV bytes, and blocks in use vs the blocks the same rows would take unshared.
3. Compiled decoding: StaticCache + torch.compile vs PagedCache (fixed pool) + torch.compile, with DynamicCache and
   PagedCache eager beside them, alternated; first-call (compile) time reported apart from steady-state tokens/s.
   ``--static-on-paged``: also StaticCache compiled on the enabled model (what enabling must leave unchanged).
4. Prefix reuse: a request whose long system prompt is in the pool's prefix cache vs the same request on a cold
   pool: time to first token and prompt tokens the model computed.

Default model: the embedded SmolLM2-135M-Instruct (fp32). Tokens/s count each row's generated tokens up to and
including its end-of-sequence token.

    python bench/generate.py                     # 8 prompts x 64 new tokens, 2 rounds
    python bench/generate.py --quick             # smoke run, under a minute on 2 cores
    python bench/generate.py --plots bench/out   # + kv_over_steps.png (KV bytes per decoding step)
    python bench/generate.py --json out.json     # + JSON (stdout without a path)
    python bench/generate.py --sections compiled,prefix   # only some sections
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
import time
from pathlib import Path

import torch
from transformers import DynamicCache, StaticCache, StoppingCriteria

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import transformers  # noqa: E402

from hf_paged import compat, embedded  # noqa: E402
from hf_paged import disable_paged_attention, enable_paged_attention  # noqa: E402
from hf_paged.cache import PagedCache  # noqa: E402
from hf_paged.pool import BlockPool  # noqa: E402
from hf_paged.progress import GenerationProgress  # noqa: E402
from hf_paged.report import (cpu_name, dynamic_cache_bytes, format_table, kv_bytes_per_token, mb,  # noqa: E402
                             real_kv_bytes, real_kv_tokens, row_token_counts)

DYNAMIC, CB = "DynamicCache", "continuous batching"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
VLLM_SAVINGS = {"beam search": "37-66%", "parallel sampling": "6-30%"}  # Kwon et al., SOSP 2023


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def paged_name(backend: str) -> str:
    return f"PagedCache ({backend})"


def machine() -> str:
    cpu = cpu_name()
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"
    return (f"{cpu} ({platform.processor() or platform.machine()}), torch threads {torch.get_num_threads()}{gpu}; "
            f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")


class KVTrace(StoppingCriteria):
    """Never stops; after every decoding step records the KV bytes the cache holds (and advances a progress bar)."""

    def __init__(self, cache, total: int, desc: str):
        self.cache = cache
        self.bytes: list[int] = []
        self.progress = GenerationProgress(total, desc)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        if isinstance(self.cache, PagedCache):
            self.bytes.append(self.cache.memory_stats().bytes_in_use)
        else:
            self.bytes.append(dynamic_cache_bytes(self.cache))
        return self.progress(input_ids, scores)

    def close(self) -> None:
        self.progress.close()


def generated_lengths(sequences: torch.Tensor, prompt_columns: int, eos_token_id) -> list[int]:
    """Per row: generated tokens up to and including the first end-of-sequence token."""
    eos = torch.tensor(eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])
    lengths = []
    for row in sequences[:, prompt_columns:].cpu():
        hits = torch.isin(row, eos).nonzero()
        lengths.append(int(hits[0]) + 1 if len(hits) else row.shape[0])
    return lengths


def row_kv_tokens(sequences, prompt_mask, eos_token_id) -> list[int]:
    """Per row: the KV tokens a cache must keep after generate() (see ``report.real_kv_tokens``)."""
    return [real_kv_tokens(sequences[i:i + 1].cpu(), prompt_mask[i:i + 1].cpu(), eos_token_id)
            for i in range(sequences.shape[0])]


def run_generate(model, inputs, cache, max_new_tokens: int, label: str, **gen_kwargs):
    """One generate() call; returns (sequences, seconds, KV trace)."""
    trace = KVTrace(cache, max_new_tokens, label)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(**inputs, **{compat.GENERATE_CACHE_KWARG: cache}, max_new_tokens=max_new_tokens,
                         stopping_criteria=[trace], **gen_kwargs)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    trace.close()
    return out, elapsed, trace.bytes


# --------------------------------------------------------------------------------------------------- contenders
def first_calls(names: list[str], call) -> dict[str, str]:
    """``call(name)`` once per contender, untimed; returns the failures by name (those contenders sit out)."""
    errors = {}
    for name in names:
        try:
            call(name)
        except Exception as err:
            errors[name] = f"{type(err).__name__}: {err}"
            print(f"{name} failed: {errors[name]}", flush=True)
    return errors


def set_contender(model, name: str) -> None:
    """Put the model in the state a contender runs in: unpatched, or paged with the named backend."""
    if name.startswith("PagedCache"):
        enable_paged_attention(model, backend=name[len("PagedCache ("):-1])
    else:
        disable_paged_attention(model)


def new_cache(model, name: str, block_size: int):
    return DynamicCache(config=model.config) if name == DYNAMIC else PagedCache(model.config, block_size=block_size)


class ContinuousBatching:
    """A persistent ``init_continuous_batching`` manager, sized for the workload (its CPU defaults build a
    multi-GB attention mask), pages the same size as PagedCache's blocks, no prefix sharing between rounds."""

    def __init__(self, model, prompts: list[list[int]], max_new_tokens: int, page_size: int):
        from transformers.generation import ContinuousBatchingConfig

        blocks_per_request = math.ceil((max(map(len, prompts)) + max_new_tokens) / page_size)
        wanted = dict(
            page_size=page_size,
            num_blocks=len(prompts) * (blocks_per_request + 1),
            max_batch_tokens=max(sum(map(len, prompts)), 64),
            allow_block_sharing=False,
            auto_switch_to_flash=False,  # keep the model on sdpa, as the generate() runs are
        )
        fields = inspect.signature(ContinuousBatchingConfig).parameters
        if "page_size" not in fields:  # before 5.17 the page was called block_size
            wanted["block_size"] = wanted.pop("page_size")
        self.config = ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in fields})
        self.num_blocks = wanted["num_blocks"]
        generation_config = copy.deepcopy(model.generation_config)
        generation_config.do_sample = False
        generation_config.max_new_tokens = max_new_tokens
        self.manager = model.init_continuous_batching(generation_config=generation_config,
                                                      continuous_batching_config=self.config)
        if model.device.type == "cuda" and hasattr(self.manager, "warmup"):  # CUDA graphs, as generate_batch does
            self.manager.warmup()
        self.manager.start()

    def run(self, prompts: list[list[int]], max_new_tokens: int, label: str):
        """Returns (generated token lists in prompt order, seconds)."""
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts), desc=label, unit="req", leave=False)
        start = time.perf_counter()
        ids = self.manager.add_requests(prompts, max_new_tokens=max_new_tokens)
        results = {}
        while len(results) < len(ids):
            result = self.manager.get_result(timeout=1)
            if result is None:
                if not self.manager.is_running():
                    raise RuntimeError("the continuous batching thread stopped before all requests finished.")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"continuous batching request {result.request_id} failed: {result.error}")
                results[result.request_id] = result
                bar.update(1)
        elapsed = time.perf_counter() - start
        bar.close()
        return [list(results[i].generated_tokens) for i in ids], elapsed

    def kv_reserved(self) -> int | None:
        cache = getattr(self.manager.batch_processor, "cache", None)
        tensor = getattr(cache, "cache_tensor", None)
        return tensor.numel() * tensor.element_size() if tensor is not None else None

    def stop(self) -> None:
        self.manager.stop(block=True, timeout=30)
        self.manager.destroy()


# ----------------------------------------------------------------------------------------------------- section 1
def section_greedy(model, tokenizer, args, backends: list[str]) -> dict:
    inputs = embedded.chat_batch(tokenizer, args.batch_size).to(model.device)
    mask = inputs["attention_mask"]
    prompt_columns = inputs["input_ids"].shape[1]
    prompts = [ids[m.bool()].tolist() for ids, m in zip(inputs["input_ids"], mask)]
    eos = model.generation_config.eos_token_id
    per_token = kv_bytes_per_token(model.config, model.dtype)
    print(f"\n== 1. Greedy batch: {plural(args.batch_size, 'chat prompt')} ({int(mask.sum())} real tokens padded to "
          f"{prompt_columns} columns) x {args.max_new_tokens} new tokens, {model.dtype}, block size "
          f"{args.block_size}, {plural(args.repeats, 'round')} alternated ==", flush=True)

    contenders = [DYNAMIC] + [paged_name(b) for b in backends] + [CB]
    try:
        cb = ContinuousBatching(model, prompts, args.max_new_tokens, args.block_size)
    except Exception as err:  # report it, measure the rest
        print(f"continuous batching unavailable: {type(err).__name__}: {err}")
        cb, contenders = None, contenders[:-1]

    def one_run(name: str, max_new_tokens: int, label: str):
        set_contender(model, name)
        if name == CB:
            tokens, seconds = cb.run(prompts, max_new_tokens, label)
            return {"tokens": tokens, "seconds": seconds, "generated": sum(map(len, tokens))}
        cache = new_cache(model, name, args.block_size)
        out, seconds, trace = run_generate(model, inputs, cache, max_new_tokens, label, do_sample=False)
        return {"out": out, "seconds": seconds, "trace": trace, "cache": cache,
                "generated": sum(generated_lengths(out, prompt_columns, eos))}

    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    # untimed: first-call costs (allocator growth, Triton compiles, CB's cache)
    errors = first_calls(contenders, lambda name: one_run(name, 2, f"warm-up {name}"))
    for round_ in range(args.repeats):
        shift = round_ % len(contenders)  # each round starts with another contender: none always runs after one
        for name in contenders[shift:] + contenders[:shift]:
            if name in errors:
                continue
            try:
                runs[name].append(one_run(name, args.max_new_tokens, f"round {round_ + 1}/{args.repeats} {name}"))
            except Exception as err:
                errors[name] = f"{type(err).__name__}: {err}"
                print(f"{name} failed: {errors[name]}", flush=True)
    disable_paged_attention(model)
    cb_reserved = cb.kv_reserved() if cb is not None else None
    if cb is not None:
        cb.stop()

    reference = runs[DYNAMIC][-1]["out"]
    equal: dict[str, str] = {}
    for name in contenders:
        if name in errors:
            equal[name] = "failed"
        elif name == DYNAMIC:
            equal[name] = "reference"
        elif name == CB:
            expected = [row[prompt_columns:prompt_columns + n].tolist()
                        for row, n in zip(reference, generated_lengths(reference, prompt_columns, eos))]
            same = [sum(e == got for e, got in zip(expected, r["tokens"])) for r in runs[name]]
            equal[name] = f"{min(same)}/{len(prompts)} rows"
        else:
            same = all(torch.equal(r["out"], reference) for r in runs[name])
            equal[name] = "yes" if same else "NO"

    median_s = {n: statistics.median(r["seconds"] for r in runs[n]) for n in contenders if runs[n]}
    best_s = {n: min(r["seconds"] for r in runs[n]) for n in median_s}
    tok_s = {n: statistics.median(r["generated"] / r["seconds"] for r in runs[n]) for n in median_s}
    speed_rows = [[n, " ".join(f"{r['seconds']:.1f}" for r in runs[n]), median_s[n], tok_s[n],
                   f"{tok_s[n] / tok_s[DYNAMIC]:.2f}x", f"{best_s[DYNAMIC] / best_s[n]:.2f}x", equal[n]]
                  for n in median_s]
    print(format_table(["contender", "runs (s)", "median s", "tokens/s", "vs DynamicCache", "best vs best",
                        "tokens equal"], speed_rows))
    print(f"tokens/s: median over rounds of generated tokens up to EOS ({runs[DYNAMIC][-1]['generated']}) / "
          "seconds; contenders alternated, each round starting one later (D P CB, P CB D, ...); best vs best: fastest "
          "runs' time ratio.")
    for name, err in errors.items():
        print(f"{name}: FAILED ({err})")

    # KV figures, from the last round
    real = real_kv_tokens(reference.cpu(), mask.cpu(), eos)
    real_bytes = real_kv_bytes(model.config, model.dtype, row_token_counts(reference, mask, eos))  # windows counted
    dyn_bytes = dynamic_cache_bytes(runs[DYNAMIC][-1]["cache"])
    kv_rows = [[DYNAMIC, mb(dyn_bytes), mb(dyn_bytes), mb(dyn_bytes), f"{real_bytes / dyn_bytes:.0%}"]]
    kv = {DYNAMIC: {"peak_bytes": dyn_bytes, "end_bytes": dyn_bytes, "reserved_bytes": dyn_bytes}}
    for name in contenders:
        if name.startswith("PagedCache") and runs[name]:
            stats = runs[name][-1]["cache"].memory_stats()
            kv_rows.append([name, mb(stats.peak_bytes_in_use), mb(stats.bytes_in_use), mb(stats.bytes_reserved),
                            f"{stats.utilization:.0%}"])
            kv[name] = {"peak_bytes": stats.peak_bytes_in_use, "end_bytes": stats.bytes_in_use,
                        "reserved_bytes": stats.bytes_reserved, "peak_blocks_in_use": stats.peak_blocks_in_use,
                        "tokens_stored_at_end": stats.tokens_stored, "utilization_at_end": stats.utilization}
    if cb_reserved is not None:
        kv_rows.append([CB, "-", "-", mb(cb_reserved), "-"])
        kv[CB] = {"reserved_bytes": cb_reserved}
    print()
    print(format_table(["cache", "KV peak", "KV at end", "KV reserved", "used at end"], kv_rows))
    print(f"real KV tokens at the end, finished rows included: {real:,} ({mb(real_bytes)}; sliding-window layers count only their window). DynamicCache keeps "
          "padding and finished rows; PagedCache gives finished rows' blocks back (used: tokens stored / block slots "
          "in use; DynamicCache: real tokens / tokens held). Continuous batching: a pool of "
          f"{cb.num_blocks if cb else '-'} pages x {args.block_size} tokens, sized by this script.")

    result = {
        "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "block_size": args.block_size,
        "prompt_tokens": int(mask.sum()), "prompt_columns": prompt_columns, "repeats": args.repeats,
        "seconds": {n: [r["seconds"] for r in runs[n]] for n in contenders},
        "tokens_per_s": tok_s, "ratio_to_dynamic": {n: tok_s[n] / tok_s[DYNAMIC] for n in tok_s},
        "tokens_equal": equal, "errors": errors, "kv": kv,
        "real_kv_tokens": real, "real_kv_bytes": real_bytes, "kv_bytes_per_token": per_token,
        "traces": {n: runs[n][-1]["trace"] for n in contenders if n != CB and runs[n]},
        "real_trace": real_kv_trace(reference, mask, eos, len(runs[DYNAMIC][-1]["trace"]), per_token),
    }
    result["paged_equal"] = all(equal[n] == "yes" for n in contenders if n.startswith("PagedCache"))
    return result


def real_kv_trace(sequences, prompt_mask, eos_token_id, steps: int, per_token: int) -> dict[str, list[int]]:
    """Bytes of real tokens at each decoding step i (from 0: the cache then holds the prompt and i generated
    tokens): of all rows, and of the rows still generating (a row whose EOS came at step i leaves after it)."""
    prompt = prompt_mask.sum(1).tolist()
    used = generated_lengths(sequences, prompt_mask.shape[1], eos_token_id)
    rows = list(zip(prompt, used))
    return {"all rows": [per_token * sum(p + min(i, u) for p, u in rows) for i in range(steps)],
            "unfinished rows": [per_token * sum(p + i for p, u in rows if i < u) for i in range(steps)]}


# ----------------------------------------------------------------------------------------------------- section 2
def section_sharing(model, tokenizer, args, backends: list[str]) -> dict:
    inputs = embedded.chat_batch(tokenizer, args.sharing_prompts).to(model.device)
    mask = inputs["attention_mask"]
    prompt_columns = inputs["input_ids"].shape[1]
    eos = model.generation_config.eos_token_id
    bs = args.block_size
    print(f"\n== 2. Sharing: {plural(args.sharing_prompts, 'chat prompt')} x {args.sharing_tokens} new tokens, "
          f"4 beams / 4 samples per prompt (seed {args.seed}), {plural(args.repeats, 'round')} alternated; "
          "PagedCache shares prompt blocks between a prompt's rows ==", flush=True)
    modes = {
        "beam search": dict(num_beams=4, do_sample=False),
        "parallel sampling": dict(num_return_sequences=4, do_sample=True),
    }
    rows, result = [], {}
    names = [DYNAMIC] + [paged_name(b) for b in backends]
    for mode, gen_kwargs in modes.items():
        outs: dict[str, tuple | str] = {}
        for round_ in range(-1, args.repeats):  # round -1: untimed warm-up, 2 tokens
            for name in names:
                if isinstance(outs.get(name), str):
                    continue
                set_contender(model, name)
                tokens = 2 if round_ < 0 else args.sharing_tokens
                try:
                    cache = new_cache(model, name, bs)
                    torch.manual_seed(args.seed)
                    out, seconds, _ = run_generate(model, inputs, cache, tokens, f"{mode} {name}", **gen_kwargs)
                except Exception as err:  # the table says so; section 1 already decides the exit status
                    if name == DYNAMIC:
                        raise
                    outs[name] = f"{type(err).__name__}: {err}"
                    print(f"{mode} with {name} failed: {outs[name]}", flush=True)
                    continue
                if round_ >= 0:
                    previous = outs.get(name)
                    same_runs = previous is None or (previous[3] and torch.equal(previous[0], out))
                    seconds_list = (previous[1] if previous else []) + [seconds]
                    outs[name] = (out if same_runs else previous[0], seconds_list, cache, same_runs)
        disable_paged_attention(model)

        reference, _, dyn_cache, _ = outs[DYNAMIC]
        dyn_bytes = dynamic_cache_bytes(dyn_cache)
        if mode == "beam search":  # every beam holds the same number of columns
            columns = dyn_cache.get_seq_length() - prompt_columns
            lens = [p + columns for p in mask.sum(1).tolist() for _ in range(4)]
        else:
            expanded = mask.repeat_interleave(4, dim=0)
            lens = row_kv_tokens(reference, expanded, eos)
        unshared_blocks = sum(math.ceil(n / bs) for n in lens)
        result[mode] = {"dynamic_bytes": dyn_bytes, "unshared_blocks": unshared_blocks, "row_kv_tokens": lens}
        for name in names:
            outcome = outs[name]
            if isinstance(outcome, str):
                rows.append([mode, name, "FAILED", "-", "-", "-", "-", "-"])
                result[mode][name] = {"error": outcome}
                continue
            out, seconds_list, cache, same_runs = outcome
            seconds = statistics.median(seconds_list)
            if name == DYNAMIC:
                rows.append([mode, name, "reference", mb(dyn_bytes), "1.00", "-", "-", f"{seconds:.1f}"])
                result[mode]["dynamic_seconds"] = seconds_list
                continue
            stats = cache.memory_stats()
            same = same_runs and out.shape == reference.shape and torch.equal(out, reference)
            saving = 1 - stats.peak_blocks_in_use / unshared_blocks
            rows.append([mode, name, "yes" if same else "NO", mb(stats.peak_bytes_in_use),
                         f"{stats.peak_bytes_in_use / dyn_bytes:.2f}",
                         f"{stats.peak_blocks_in_use}/{unshared_blocks}", f"{saving:.0%}", f"{seconds:.1f}"])
            result[mode][name] = {"tokens_equal": same, "peak_bytes": stats.peak_bytes_in_use,
                                  "peak_blocks_in_use": stats.peak_blocks_in_use, "saving_vs_unshared": saving,
                                  "seconds": seconds_list}
    print(format_table(["workload", "cache", "tokens equal", "KV peak", "vs DynamicCache", "blocks / unshared",
                        "saved by sharing", "median s"], rows))
    print("DynamicCache: bytes held at the end (its peak). Unshared: sum over rows of ceil(row KV tokens / "
          f"{bs}), what a paged cache without sharing needs. vLLM paper's sharing savings: "
          + ", ".join(f"{k} {v}" for k, v in VLLM_SAVINGS.items()) + " (longer outputs, so prompts weigh less there).")
    return result


# ----------------------------------------------------------------------------------------------------- section 3
STATIC_C, PAGED_C, PAGED_E = "StaticCache compiled", "PagedCache compiled", "PagedCache eager"
STATIC_ON_PAGED = "StaticCache compiled, model enabled"  # enable_paged_attention() leaves other caches as they were


def compile_config(device: torch.device, mode: str | None):
    from transformers.generation import CompileConfig

    config = CompileConfig(fullgraph=True, mode=mode or ("reduce-overhead" if device.type == "cuda" else "default"))
    config._compile_all_devices = True  # transformers compiles on its own only on CUDA
    return config


def section_compiled(model, tokenizer, args, backends: list[str]) -> dict:
    inputs = embedded.chat_batch(tokenizer, args.batch_size).to(model.device)
    columns = inputs["input_ids"].shape[1]
    eos = model.generation_config.eos_token_id
    max_len = columns + args.max_new_tokens
    blocks = args.batch_size * math.ceil(max_len / args.block_size) + 8
    cc = compile_config(model.device, args.compile_mode)
    print(f"\n== 3. Compiled decoding: {plural(args.batch_size, 'chat prompt')} x {args.max_new_tokens} new tokens, "
          f"greedy, {model.dtype}; compile mode {cc.mode!r}; StaticCache sized to {max_len} positions per row, "
          f"PagedCache pool fixed at {blocks} blocks of {args.block_size}; {plural(args.repeats, 'round')} "
          "alternated after a first (compiling) call ==", flush=True)
    backend = backends[-1]
    # The paged contenders run a twin of the model (same weights, copied), patched once: switching one model's
    # attention back and forth would change what its compiled graphs were built for and recompile them every round.
    disable_paged_attention(model)
    paged_model = enable_paged_attention(copy.deepcopy(model), backend=backend)

    def run(name: str, label: str):
        if name == DYNAMIC:
            cache, extra = DynamicCache(config=model.config), {}
        elif name in (STATIC_C, STATIC_ON_PAGED):
            cache, extra = StaticCache(config=model.config, max_cache_len=max_len), {"compile_config": cc}
        else:
            cache = PagedCache(model.config, block_size=args.block_size, num_blocks=blocks)
            extra = {"compile_config": cc} if name == PAGED_C else {"disable_compile": True}
        target = paged_model if name in (PAGED_C, PAGED_E, STATIC_ON_PAGED) else model
        out, seconds, _ = run_generate(target, inputs, cache, args.max_new_tokens, label, do_sample=False, **extra)
        return out, seconds, cache

    names = [DYNAMIC, PAGED_E, STATIC_C, PAGED_C] + ([STATIC_ON_PAGED] if args.static_on_paged else [])
    first, seconds, outs = {}, {n: [] for n in names}, {}

    def first_call(name: str) -> None:
        first[name] = run(name, f"first call {name}")[1]

    errors = first_calls(names, first_call)
    for round_ in range(args.repeats):
        for name in names:
            if name in errors:
                continue
            out, secs, cache = run(name, f"round {round_ + 1}/{args.repeats} {name}")
            seconds[name].append(secs)
            outs[name] = out
    del paged_model
    generated = sum(generated_lengths(outs[DYNAMIC], columns, eos))
    tok_s = {n: generated / statistics.median(seconds[n]) for n in names if seconds[n]}
    rows = [[n, f"{first.get(n, float('nan')):.1f}", " ".join(f"{s:.1f}" for s in seconds[n]), tok_s[n],
             f"{tok_s[n] / tok_s[DYNAMIC]:.2f}x",
             f"{tok_s[n] / tok_s[STATIC_C]:.2f}x" if STATIC_C in tok_s else "-",
             "reference" if n == DYNAMIC else ("yes" if torch.equal(outs[n], outs[DYNAMIC]) else "NO")]
            for n in names if n in tok_s]
    print(format_table(["contender", "first call s", "runs (s)", "tokens/s", "vs DynamicCache",
                        "vs StaticCache compiled", "tokens equal"], rows))
    print(f"tokens/s: {generated} generated tokens (up to EOS) / median seconds of the timed runs; the first call "
          "includes compilation (transformers compiles the decoding forward; the prefill runs eagerly).")
    for name, err in errors.items():
        print(f"{name}: FAILED ({err})")
    return {"first_call_seconds": first, "seconds": seconds, "tokens_per_s": tok_s, "errors": errors,
            "compile_mode": cc.mode, "pool_blocks": blocks,
            "tokens_equal": {n: bool(torch.equal(outs[n], outs[DYNAMIC])) for n in outs}}


# ----------------------------------------------------------------------------------------------------- section 4
def section_prefix(model, tokenizer, args, backends: list[str]) -> dict:
    system = " ".join(embedded.SYSTEM_PARAGRAPH for _ in range(args.prefix_repeat))
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": q}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)
               for q in ("What is a KV cache?", "Name three uses of a block table.")]
    new_tokens = 8
    print(f"\n== 4. Prefix reuse: a {prompts[0]['input_ids'].shape[1]}-token chat prompt whose system prompt is "
          f"cached in the pool vs a cold pool; {new_tokens} new tokens, batch of one, {plural(args.repeats, 'round')} ==",
          flush=True)
    enable_paged_attention(model, backend=backends[-1])
    computed: list[int] = []
    hook = model.model.register_forward_pre_hook(
        lambda module, a, kw: computed.append(kw["input_ids"].shape[1]), with_kwargs=True)
    rows, result = [], {"cold": [], "warm": []}
    try:
        for _ in range(args.repeats):
            for label in ("cold", "warm"):
                pool = BlockPool(block_size=args.block_size, prefix_caching=True)
                if label == "warm":  # another request with the same system prompt ran before
                    run_generate(model, prompts[0].to(model.device), PagedCache(model.config, pool=pool), 2,
                                 "warm-up")
                computed.clear()
                inputs = prompts[1].to(model.device)
                start = time.perf_counter()
                model.generate(**inputs, **{compat.GENERATE_CACHE_KWARG: PagedCache(model.config, pool=pool)},
                               max_new_tokens=1, do_sample=False)
                ttft = time.perf_counter() - start
                result[label].append({"ttft_s": ttft, "prompt_tokens_computed": computed[0],
                                      "prompt_tokens": inputs["input_ids"].shape[1]})
    finally:
        hook.remove()
        disable_paged_attention(model)
    for label in ("cold", "warm"):
        runs = result[label]
        rows.append([label, runs[0]["prompt_tokens"], runs[0]["prompt_tokens_computed"],
                     " ".join(f"{r['ttft_s']:.2f}" for r in runs), statistics.median(r["ttft_s"] for r in runs)])
    cold = statistics.median(r["ttft_s"] for r in result["cold"])
    warm = statistics.median(r["ttft_s"] for r in result["warm"])
    print(format_table(["pool", "prompt tokens", "computed by the model", "TTFT runs (s)", "median TTFT s"], rows))
    print(f"time to first token, warm / cold: {warm / cold:.2f}x; tokens computed, warm / cold: "
          f"{result['warm'][0]['prompt_tokens_computed'] / result['cold'][0]['prompt_tokens_computed']:.2f}x")
    result["ttft_ratio"] = warm / cold
    return result


# --------------------------------------------------------------------------------------------------------- plots
def plot_traces(greedy: dict, directory: str, args) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, trace in greedy["traces"].items():
        ax.plot(range(len(trace)), [b / 1e6 for b in trace], label=name)
    for (rows, trace), style in zip(greedy["real_trace"].items(), ("k--", "k:")):
        ax.plot(range(len(trace)), [b / 1e6 for b in trace], style, linewidth=1, label=f"real tokens, {rows}")
    ax.set_xlabel("decoding step")
    ax.set_ylabel("KV bytes held (MB)")
    ax.set_title(f"KV memory in generate(): {args.batch_size} prompts x {args.max_new_tokens} new tokens, greedy")
    ax.legend()
    ax.grid(alpha=0.3)
    path = Path(directory) / "kv_over_steps.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local model directory (default: the embedded SmolLM2)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="rounds of alternated runs in section 1")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sharing-prompts", type=int, default=2)
    p.add_argument("--sharing-tokens", type=int, default=None, help="new tokens in section 2 (default: half)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backends", default=None,
                   help="PagedCache backends, comma separated (default: torch, plus triton when CUDA is available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="model dtype (default fp32)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 prompts x 16 tokens, 1 round")
    p.add_argument("--sections", default="greedy,sharing,compiled,prefix",
                   help="comma-separated sections to run (greedy, sharing, compiled, prefix)")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode (default: reduce-overhead on CUDA, "
                   "default on CPU)")
    p.add_argument("--prefix-repeat", type=int, default=6, help="system prompt length, in paragraphs (section 4)")
    p.add_argument("--static-on-paged", action="store_true",
                   help="section 3: also StaticCache compiled on the paged (enabled) model, which must be unchanged")
    p.add_argument("--plots", metavar="DIR", default=None, help="write DIR/kv_over_steps.png")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="also write the results as JSON to PATH (stdout without PATH)")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_size, args.max_new_tokens, args.repeats = 2, 16, 1
        args.sharing_prompts, args.sharing_tokens = 1, 8
    if args.sharing_tokens is None:
        args.sharing_tokens = max(8, args.max_new_tokens // 2)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backends = args.backends.split(",") if args.backends else ["torch"] + (["triton"] if device.type == "cuda" else [])
    print(f"machine: {machine()}")
    print(f"model: {args.model or 'embedded SmolLM2-135M-Instruct'} on {device}; PagedCache backends: "
          f"{', '.join(backends)}", flush=True)
    model, tokenizer = embedded.load(args.model, dtype=DTYPES[args.dtype])
    model.to(device)

    sections = set(args.sections.split(","))
    results = {}
    for name, section in (("greedy", section_greedy), ("sharing", section_sharing), ("compiled", section_compiled),
                          ("prefix", section_prefix)):
        if name in sections:
            results[name] = section(model, tokenizer, args, backends)
    greedy = results.get("greedy", {"paged_equal": True, "traces": {}, "real_trace": {}})
    if args.plots and "greedy" in results:
        print(f"\nplot: {plot_traces(greedy, args.plots, args)}")
    total = time.perf_counter() - started
    print(f"\ntotal {total:.0f} s")
    if not greedy["paged_equal"]:
        bad = {n: e for n, e in greedy["tokens_equal"].items() if n.startswith("PagedCache") and e != "yes"}
        why = {n: "run failed" if e == "failed" else "tokens differ from DynamicCache" for n, e in bad.items()}
        print("FAIL (section 1): " + "; ".join(f"{n}: {w}" for n, w in why.items()))

    if args.json:
        result = {"machine": machine(), "device": str(device), "backends": backends, "seconds_total": total,
                  **results}
        text = json.dumps(result, indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(text)
    return 0 if greedy["paged_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
