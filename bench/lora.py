"""Many LoRA adapters on one base model: one engine with per-request adapters vs one engine per adapter vs generate().

    python bench/lora.py                        # 4 adapters x 16 requests on the embedded SmolLM2 (~10 min, 2-core CPU)
    python bench/lora.py --adapters 2 --requests 8 --new-tokens 16     # quicker

Workload: A adapters (peft LoRA from random init, B scaled so each changes the text; ranks 8/16/8/16 on q, k, v, o
and the MLP) x R chat requests each, arriving interleaved (request i names adapter i % A), greedy, N new tokens each
(EOS ignored, so every contender generates the same count). Contenders, run in alternation (``--rounds``, each
keeping its round of fewest CPU-seconds: the machine may be shared):

* mixed: one engine (``init_continuous_batching``, block 16, prefix caching) holding every adapter
  (``manager.load_adapter``); each request names its adapter; requests of every adapter share the steps (batched
  LoRA per targeted layer).
* by adapter: what one does without per-request adapters: one engine over a ``PeftModel`` per adapter
  (``set_adapter``, PEFT's own layers), its R requests, then the next adapter's.
* generate: ``PeftModel.generate()`` with ``set_adapter`` per batch: the R requests of an adapter left-padded into one
  batch (DynamicCache).

Tokens per CPU-second = generated tokens / the CPU seconds this process used (``time.process_time``: on a shared
machine other jobs inflate wall seconds, not these; with one torch thread they track the work done); wall seconds and
the wall ratio beside them. Forwards (steps) and the seconds spent in them (engines). Memory: KV at its peak (pool
blocks in use x bytes per block; a padded batch's DynamicCache) and the adapters' weights held (the mixed engine's
stacked adapter tensors; PEFT's adapter parameters).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_paged import BlockPool, embedded, init_continuous_batching  # noqa: E402
from hf_paged.report import cpu_name, dynamic_cache_bytes, format_table, mb  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
B_SCALE = 0.05


def make_adapters(model_dir, count: int, directory: Path) -> list[Path]:
    """``count`` peft LoRA adapters of SmolLM2 from random init (B non-zero), saved under ``directory``."""
    from peft import LoraConfig, get_peft_model

    paths = []
    for i in range(count):
        torch.manual_seed(1000 + i)
        model, _ = embedded.load(model_dir)
        peft_model = get_peft_model(model, LoraConfig(r=8 if i % 2 == 0 else 16, lora_alpha=16, target_modules=TARGETS,
                                                      init_lora_weights=False))
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.mul_(B_SCALE)
        paths.append(directory / f"adapter{i}")
        peft_model.save_pretrained(str(paths[-1]))
    return paths


def peft_model_with(model_dir, paths: list[Path]):
    from peft import PeftModel

    model, _ = embedded.load(model_dir)
    peft_model = PeftModel.from_pretrained(model, str(paths[0]), adapter_name="adapter0")
    for i, path in enumerate(paths[1:], 1):
        peft_model.load_adapter(str(path), adapter_name=f"adapter{i}")
    return peft_model.eval()


def peft_adapter_bytes(peft_model) -> int:
    return sum(p.numel() * p.element_size() for n, p in peft_model.named_parameters() if "lora_" in n)


def run_engine(model, prompts, names, new_tokens: int, loras: dict | None = None):
    """``(generated tokens, seconds, memory_stats, stats)`` of one engine over ``prompts`` (adapter ``names``)."""
    manager = init_continuous_batching(model, pool=BlockPool(block_size=16, max_memory="1GiB", prefix_caching=True),
                                       max_batch_tokens=512)
    for name, path in (loras or {}).items():
        manager.load_adapter(name, path)
    start, cpu = time.perf_counter(), time.process_time()
    with manager:
        ids = [manager.add_request(p, max_new_tokens=new_tokens, ignore_eos=True, adapter=n)
               for p, n in zip(prompts, names)]
        tokens = sum(len(manager.get_result(rid).generated_tokens) for rid in ids)
    return tokens, (time.perf_counter() - start, time.process_time() - cpu), manager.memory_stats(), manager.stats()


def mixed(base, prompts, names, new_tokens: int, loras: dict) -> list:
    """One engine, every adapter per request."""
    tokens, seconds, stats, es = run_engine(base, prompts, names, new_tokens, loras)
    return [tokens, seconds, stats.peak_bytes_in_use, stats.adapter_bytes_reserved, es.steps, es.forward_time_s]


def by_adapter(peft_model, prompts, names, args) -> list:
    """One engine over the PeftModel per adapter (``set_adapter``), in turn."""
    tokens = kv = steps = forward = 0
    seconds = (0.0, 0.0)
    for i in range(args.adapters):
        peft_model.set_adapter(f"adapter{i}")
        mine = [q for q, n in zip(prompts, names) if n == f"adapter{i}"]
        t, s, st, es = run_engine(peft_model, mine, [None] * len(mine), args.new_tokens)
        tokens, seconds, kv = tokens + t, (seconds[0] + s[0], seconds[1] + s[1]), max(kv, st.peak_bytes_in_use)
        steps, forward = steps + es.steps, forward + es.forward_time_s
    return [tokens, seconds, kv, peft_adapter_bytes(peft_model), steps, forward]


def padded_generate(peft_model, chat, names, tokenizer, args) -> list:
    """``PeftModel.generate()``: a left-padded batch per adapter, ``set_adapter`` between them."""
    tokens = kv = 0
    wall = cpu = 0.0
    for i in range(args.adapters):
        peft_model.set_adapter(f"adapter{i}")
        rows = [j for j, n in enumerate(names) if n == f"adapter{i}"]
        batch = {k: v[rows] for k, v in chat.items()}
        start, cpu_start = time.perf_counter(), time.process_time()
        out = peft_model.generate(**batch, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                  do_sample=False, return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
        wall, cpu = wall + time.perf_counter() - start, cpu + time.process_time() - cpu_start
        tokens += len(rows) * args.new_tokens
        kv = max(kv, dynamic_cache_bytes(out.past_key_values))
    return [tokens, (wall, cpu), kv, peft_adapter_bytes(peft_model), args.adapters * args.new_tokens, None]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--requests", type=int, default=16, help="requests per adapter")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="rounds of the alternating contenders (each keeps its best)")
    p.add_argument("--model", default=None, help="a local model directory (default: the embedded SmolLM2)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model or embedded.local_model_dir()
    base, tokenizer = embedded.load(model_dir)
    chat = embedded.chat_batch(tokenizer, args.adapters * args.requests)
    prompts = [row[mask.bool()].tolist() for row, mask in zip(chat["input_ids"], chat["attention_mask"])]
    names = [f"adapter{i % args.adapters}" for i in range(len(prompts))]
    print(f"machine: {cpu_name()}, {args.threads} thread(s), torch {torch.__version__}, Python "
          f"{platform.python_version()}")
    print(f"model: {model_dir.name if hasattr(model_dir, 'name') else model_dir} (fp32); {args.adapters} adapters x "
          f"{args.requests} requests, {args.new_tokens} new tokens each, prompts {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens")
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(model_dir, args.adapters, Path(tmp))
        loras = {f"adapter{i}": path for i, path in enumerate(paths)}
        peft_model = peft_model_with(model_dir, paths)
        contenders = [("mixed (one engine)", lambda: mixed(base, prompts, names, args.new_tokens, loras)),
                      ("by adapter (engine each)", lambda: by_adapter(peft_model, prompts, names, args)),
                      ("generate() per adapter", lambda: padded_generate(peft_model, chat, names, tokenizer, args))]
        best: dict[str, list] = {}
        with torch.no_grad():
            for round_ in range(args.rounds):  # contenders alternate; each keeps its fastest round
                for label, run in contenders:
                    row = [label, *run()]
                    print(f"  round {round_ + 1}: {label}: {row[2][0]:.1f} s wall, {row[2][1]:.1f} CPU-s", flush=True)
                    if label not in best or row[2][1] < best[label][2][1]:
                        best[label] = row
        rows = [best[label] for label, _ in contenders]
    mixed_wall, mixed_cpu = rows[0][1] / rows[0][2][0], rows[0][1] / rows[0][2][1]
    table = [[name, tokens, f"{wall:.1f}", f"{cpu:.1f}", f"{tokens / cpu:.1f}", f"{mixed_cpu / (tokens / cpu):.2f}x",
              f"{mixed_wall / (tokens / wall):.2f}x", mb(kv), mb(adapter), steps,
              "" if forward is None else f"{forward:.1f}"]
             for name, tokens, (wall, cpu), kv, adapter, steps, forward in rows]
    print(format_table(["contender", "tokens", "wall s", "CPU-s", "tokens/CPU-s", "mixed is (CPU)", "(wall)",
                        "KV peak", "adapters", "forwards", "forward s"], table))
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (CPU-seconds count this process's work only; wall "
          "seconds also count the other jobs on a shared machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
