"""How far do bf16's greedy tokens follow fp32's? The demo's chat prompts (``make demo``: 8 prompts, 64 new tokens)
through ``generate()`` with a DynamicCache, the embedded model in fp32 and in bf16 (and, with ``--int8``, bf16 with
int8 weight-only linears); per prompt, the tokens generated before the first difference from fp32.

    python bench/dtype_agreement.py            # 8 prompts x 64 tokens
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the checkout, not bench/ (its kernels.py would shadow a package)

from hf_paged import embedded  # noqa: E402
from hf_paged.engine.cpu_linears import prepare_cpu_linears  # noqa: E402
from hf_paged.report import cpu_name, format_table  # noqa: E402


def greedy(model, inputs, max_new_tokens: int) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    width = inputs["input_ids"].shape[1]
    return [row[width:].tolist() for row in out]


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[int, int, int]:
    """(prompts identical, tokens before each prompt's first difference summed, tokens compared)."""
    same = before = total = 0
    for a, b in zip(reference, other):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += a == b
        before += n
        total += len(a)
    return same, before, total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--int8", action="store_true", help="also bf16 with int8 weight-only linears")
    args = p.parse_args(argv)
    print(f"machine: {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    model, tokenizer = embedded.load(dtype=torch.float32)
    inputs = embedded.chat_batch(tokenizer, args.batch_size)
    fp32 = greedy(model, inputs, args.max_new_tokens)
    contenders = {"bfloat16": ("auto", torch.bfloat16)}
    if args.int8:
        contenders["int8 weights (bf16)"] = ("int8", torch.bfloat16)
    rows = []
    for name, (linears, dtype) in contenders.items():
        model, _ = embedded.load(dtype=dtype)
        prepare_cpu_linears(model, linears)
        same, before, total = agreement(fp32, greedy(model, inputs, args.max_new_tokens))
        rows.append([name, f"{same}/{len(fp32)}", f"{before}/{total} ({before / total:.0%})"])
    print(format_table(["vs fp32", "prompts identical", "tokens before the first difference"], rows))
    print(f"{args.batch_size} demo chat prompts, {args.max_new_tokens} new tokens, greedy, generate() + DynamicCache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
