"""Beam search: N requests with 4 beams through the engine vs one padded ``generate(num_beams=4)`` batch.

Both draw from a pool of the same size (``--num-blocks``, the same KV budget) and share blocks between beams: the
padded batch through ``PagedCache``'s fork / reorder, the engine through its rows (a beam request is a group of rows,
re-pointed by block table each step). The engine also runs the requests' beams beside each other without padding and
frees a request's rows when its search ends. Runs alternate (``--rounds``); reported: sequences/s, output tokens/s
(each returned sequence's own tokens, EOS included), peak blocks in use, and whether each prompt's best sequence is
the same in both.

    python bench/beams.py [--requests 8] [--max-new-tokens 32] [--num-beams 4] [--num-blocks 1024] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hf_paged import BlockPool, PagedCache, compat, embedded, enable_paged_attention, generate_batch  # noqa: E402
from hf_paged.report import cpu_name, format_table  # noqa: E402


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = embedded.CHAT_PROMPTS[i % len(embedded.CHAT_PROMPTS)]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def trim(tokens: list[int], eos: set[int], pad: int) -> list[int]:
    """A padded output row's own tokens: up to and including its first EOS."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    while tokens and tokens[-1] == pad:
        tokens = tokens[:-1]
    return tokens


def run_generate(model, tokenizer, batch, args) -> tuple[float, list[list[int]], int]:
    pool = BlockPool(16, num_blocks=args.num_blocks)
    width = max(len(p) for p in batch)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                         num_beams=args.num_beams, do_sample=False, pad_token_id=pad,
                         **{compat.GENERATE_CACHE_KWARG: PagedCache(model.config, pool=pool)})
    seconds = time.perf_counter() - start
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    return seconds, [trim(row[width:].tolist(), eos, pad) for row in out], pool.memory_stats().peak_blocks_in_use


def run_engine(model, batch, args) -> tuple[float, list[list[int]], int]:
    pool = BlockPool(16, num_blocks=args.num_blocks, prefix_caching=True)
    start = time.perf_counter()
    out = generate_batch(model, batch, max_new_tokens=args.max_new_tokens, num_beams=args.num_beams,
                         progress_bar=False, pool=pool)
    seconds = time.perf_counter() - start
    return seconds, [o.generated_tokens for o in out.values()], pool.memory_stats().peak_blocks_in_use


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--num-beams", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = embedded.load()
    enable_paged_attention(model)
    batch = prompts(tokenizer, args.requests)
    print(f"# {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; SmolLM2-135M fp32, {args.requests} requests x "
          f"{args.num_beams} beams, {args.max_new_tokens} new tokens, pool of {args.num_blocks} blocks of 16")
    best = {}
    for _ in range(args.rounds):
        for name in ("generate", "engine"):
            seconds, seqs, peak = run_generate(model, tokenizer, batch, args) if name == "generate" else \
                run_engine(model, batch, args)
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, seqs, peak)
    rows = []
    for name, (seconds, seqs, peak) in best.items():
        tokens = sum(len(s) for s in seqs)
        same = sum(a == b for a, b in zip(seqs, best["generate"][1]))
        rows.append([name, f"{len(seqs) / seconds:.2f}", f"{tokens / seconds:.1f}", peak,
                     f"{same}/{len(seqs)}"])
    print(format_table(["contender", "requests/s", "tokens/s", "peak blocks", "same best sequence"], rows))
    print(f"engine / generate requests/s: {best['generate'][0] / best['engine'][0]:.2f}x (best of {args.rounds})")


if __name__ == "__main__":
    main()
