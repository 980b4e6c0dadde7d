"""fp8 KV blocks on the embedded SmolLM2: perplexity, clamped values, bytes per token, the engine's greedy agreement.

    python bench/fp8.py                  # everything (~5 min on a 2-core CPU)
    python bench/fp8.py --only ppl       # perplexity and clamps only
    python bench/fp8.py --only engine    # the engine's greedy agreement only
    python bench/fp8.py --only ppl --scale-factor 1.1   # every scale x 1.1: how noisy the perplexity ratios are

Perplexity: a passage fed to a ``PagedCache`` in chunks of C tokens (C in 16, 64, 512 and the whole passage); every
chunk after the first attends to the earlier ones through the pool, so it reads fp8 blocks; the first chunk (and so a
passage fed whole) runs the model's own attention on the fresh K/V and never reads the pool. The ratio is fp8 over the
same run on a full-precision (fp32) pool. Clamped values: K/V values whose ``x / scale`` fell outside +-448 when they
were written (counted around ``reference.quantize_fp8``, the torch backend's write). Bytes per token: the pool's, over
all layers, scales included.

Quantization error (this code only): the K/V an fp32 pool holds after each passage (64-token chunks), all layers,
quantized by each token's own scales and by the previous policy (one scale per layer and KV head from the first
64-token chunk's amax x 2); the relative RMS error and the values clamped. Perplexity ratios of one passage move by
about a point when every scale is multiplied by 1.1 (a different rounding of every value, no better or worse): the
quantization error is the steadier comparison.

Engine: 16 chat requests (half after a shared system prompt) through ``generate_batch`` (prefix caching, 256-token
steps, greedy, 12 new tokens) on an fp32 and an fp8 pool: the share of positions equal up to each request's first
difference.

The script uses only what the previous scale policy (one scale per layer and KV head, fixed at its first write) also
had, so running it with that code on ``PYTHONPATH`` gives the "before" figures.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_paged import (  # noqa: E402
    BlockPool, PagedCache, compat, disable_paged_attention, embedded, enable_paged_attention,
)
from hf_paged.ops import reference  # noqa: E402
from hf_paged.report import cpu_name, format_table  # noqa: E402

FP8 = torch.float8_e4m3fn
CHUNKS = (16, 64, 512, None)  # None: the whole passage in one forward
LIGHTHOUSE = embedded.STORY  # the fp8 tests' passage
# Held out from the tests: technical prose with numbers and code-like words.
MEMORY = (
    "A key-value cache stores, for every layer and every token already processed, the key and value vectors that "
    "later tokens attend to. For a model with 30 layers, 3 key-value heads of 64 dimensions and 32-bit floats, "
    "each token costs 30 x 2 x 3 x 64 x 4 = 46,080 bytes, so a context of 8,192 tokens needs about 377 megabytes "
    "per sequence. Paged attention cuts that memory into fixed blocks of 16 tokens and keeps a table per sequence "
    "that maps logical blocks to physical ones, the way an operating system maps virtual pages to frames. A block "
    "is allocated only when a sequence needs it, freed when the sequence ends, and shared when two sequences start "
    "with the same tokens: a system prompt read by a thousand requests is stored once. Storing the blocks in eight "
    "bits instead of thirty-two divides the bytes by four again, at the cost of rounding every value to one of 256 "
    "codes. Whether that rounding matters depends on the scale each value is divided by before it is rounded: too "
    "large a scale wastes the codes on a range nobody uses, too small a scale clips the largest values. The safest "
    "scale is the one each token picks for itself, from its own largest value, and stores beside its block."
)
PASSAGES = {"lighthouse": LIGHTHOUSE, "kv-memory": MEMORY}
NEW_TOKENS = 12


class ClampCounter:
    """Counts values written to fp8 blocks whose ``x / scale`` falls outside +-448 (clamped by the quantizer)."""

    def __init__(self):
        self.clamped = self.written = 0
        self._original = reference.quantize_fp8

    def __enter__(self):
        def counting(x, scale):
            scaled = x.to(torch.float32) / scale.to(torch.float32)[..., None]  # [..., Hkv, D]
            self.clamped += int((scaled.abs() > reference.FP8_MAX).sum())
            self.written += scaled.numel()
            return self._original(x, scale)

        reference.quantize_fp8 = counting
        return self

    def __exit__(self, *exc):
        reference.quantize_fp8 = self._original


def perplexity(model, ids: torch.Tensor, kv_dtype, chunk: int | None) -> tuple[float, PagedCache]:
    """Perplexity of ``ids`` ``[1, L]`` fed in chunks of ``chunk`` tokens: each chunk's last position predicts the next
    chunk's first token, so every token but the first is predicted once."""
    cache = PagedCache(model.config, kv_dtype=kv_dtype)
    nll, count, carry = 0.0, 0, None  # carry: the previous chunk's last logits [1, 1, V]
    with torch.no_grad():
        for piece in ids.split(chunk or ids.shape[1], dim=1):
            logits = model(input_ids=piece, **{compat.FORWARD_CACHE_KWARG: cache}).logits.float()  # [1, n, V]
            predicting = logits[:, :-1] if carry is None else torch.cat([carry, logits[:, :-1]], 1)
            targets = piece[:, 1:] if carry is None else piece
            nll -= torch.log_softmax(predicting, -1).gather(-1, targets[..., None]).sum().item()
            count += targets.shape[1]
            carry = logits[:, -1:]
    return math.exp(nll / count), cache


def bytes_per_token(cache: PagedCache) -> float:
    stats = cache.memory_stats()
    return stats.bytes_per_block / stats.block_size


def quantization_error(model, tokenizer) -> None:
    """Relative RMS error of the K/V of each passage (fp32 pool, 64-token chunks) under both scale policies."""
    if not hasattr(reference, "FP8_SCALE_DTYPE"):
        print("\n(quantization error: needs per-token scales; skipped)")
        return
    enable_paged_attention(model, backend="torch")
    rows = []
    try:
        for name, text in PASSAGES.items():
            ids = tokenizer(text, return_tensors="pt").input_ids  # [1, L]
            _, cache = perplexity(model, ids, None, 64)
            bs, table = cache.pool.block_size, cache.block_tables()[0]
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ids.shape[1])])  # [L]
            err = {"per token": [0.0, 0.0, 0], "per head, first chunk x 2": [0.0, 0.0, 0]}
            for layer in range(model.config.num_hidden_layers):
                for t in cache.pool.layer_kv(layer):
                    x = t.view(-1, *t.shape[2:])[slots].float()  # [L, Hkv, D]
                    head = x[:64].abs().amax((0, 2)) * (2 / reference.FP8_MAX)  # [Hkv]
                    for policy, scale in (("per token", reference.fp8_scales(x).float()),
                                          ("per head, first chunk x 2", head.expand(x.shape[:2]))):
                        back = reference.dequantize_fp8(reference.quantize_fp8(x, scale), scale, torch.float32)
                        err[policy][0] += float(((back - x) ** 2).sum())
                        err[policy][1] += float((x**2).sum())
                        err[policy][2] += int(((x / scale[..., None]).abs() > reference.FP8_MAX).sum())
            for policy, (sq, norm, clamped) in err.items():
                rows.append([name, policy, f"{math.sqrt(sq / norm):.4f}", clamped])
    finally:
        disable_paged_attention(model)
    print("\nK/V quantization error, all layers (fp32 K/V of each passage, quantized both ways)")
    print(format_table(["passage", "scales", "relative RMS error", "clamped"], rows))


def run_perplexity(model, tokenizer) -> None:
    enable_paged_attention(model, backend="torch")
    rows, clamps, sizes = [], [], {}
    try:
        for name, text in PASSAGES.items():
            ids = tokenizer(text, return_tensors="pt").input_ids  # [1, L]
            for chunk in CHUNKS:
                full, full_cache = perplexity(model, ids, None, chunk)
                with ClampCounter() as counter:
                    fp8, fp8_cache = perplexity(model, ids, FP8, chunk)
                rows.append([name, ids.shape[1], chunk or "whole", full, fp8, fp8 / full, counter.clamped,
                             counter.written])
                sizes = {"fp32": bytes_per_token(full_cache), "fp8": bytes_per_token(fp8_cache)}
                print(f"  {name} chunk {chunk or 'whole'}: ratio {fp8 / full:.4f}", flush=True)
    finally:
        disable_paged_attention(model)
    print("\nPerplexity, fp8 pool over an fp32 pool (torch backend)")
    print(format_table(["passage", "tokens", "chunk", "ppl fp32", "ppl fp8", "ratio", "clamped", "values written"],
                       [[*r[:3], f"{r[3]:.3f}", f"{r[4]:.3f}", f"{r[5]:.5f}", r[6], r[7]] for r in rows]))
    worst = max(r[5] for r in rows)
    print(f"worst ratio {worst:.4f}; clamped values {sum(r[6] for r in rows)} of {sum(r[7] for r in rows)}")
    bf16 = sizes["fp32"] / 2
    print(f"\nBytes per token (30 layers, all K/V heads): fp32 {sizes['fp32']:.0f}, bf16 {bf16:.0f}, fp8 "
          f"{sizes['fp8']:.0f} = {sizes['fp8'] / sizes['fp32']:.4f}x fp32, {sizes['fp8'] / bf16:.4f}x bf16")


def chat_ids(tokenizer, prompt: str, system: str | None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)


def run_engine(model, tokenizer) -> None:
    from hf_paged import generate_batch

    prompts = [chat_ids(tokenizer, p, embedded.SYSTEM_PARAGRAPH if i % 2 else None)
               for i, p in enumerate((embedded.CHAT_PROMPTS * 2)[:16])]
    outs, tops = {}, None
    try:
        for kv_dtype in (None, FP8):
            pool = BlockPool(block_size=16, num_blocks=256, prefix_caching=True, kv_dtype=kv_dtype)
            start = time.perf_counter()
            results = generate_batch(model, prompts, max_new_tokens=NEW_TOKENS, pool=pool, max_batch_tokens=256,
                                     progress_bar=False, eos_token_id=tokenizer.eos_token_id, logprobs=2)
            outs[kv_dtype] = [r.generated_tokens for r in results.values()]
            if kv_dtype is None:
                tops = [r.top_logprobs for r in results.values()]  # per token: the two likeliest (id, logprob)
            print(f"  engine {'fp8' if kv_dtype else 'fp32'}: {time.perf_counter() - start:.1f} s", flush=True)
    finally:
        disable_paged_attention(model)
    agree = total = compared = identical = 0
    gaps = []  # fp32's top-2 logprob gap where fp8 first picks another token
    for a, b, top in zip(outs[None], outs[FP8], tops):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agree, total, identical = agree + first, total + len(a), identical + (a == b)
        compared += len(a) if a == b else min(first + 1, len(a))  # up to and including the first difference
        if first < min(len(a), len(b)) and top:
            gaps.append(top[first][0][1] - top[first][1][1])
    print(f"\nEngine, 16 chat requests x {NEW_TOKENS} greedy tokens: fp8 agrees with fp32 on {agree}/{total} = "
          f"{agree / total:.1%} of all positions (every position after a request's first difference counted as a "
          f"miss); {agree}/{compared} = {agree / compared:.1%} of the positions compared up to and including each "
          f"request's first difference; {identical}/16 requests identical")
    if gaps:
        print(f"fp32's gap between its two likeliest tokens where fp8 first differs (logprob): "
              f"{', '.join(f'{g:.3f}' for g in sorted(gaps))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["ppl", "engine"], help="run one part")
    parser.add_argument("--scale-factor", type=float, default=1.0,
                        help="multiply every per-token scale by this (a noise probe; per-token scales only)")
    args = parser.parse_args()
    if args.scale_factor != 1.0:
        def scaled(x, _original=reference.fp8_scales):  # the same rounding up, from amax x factor
            return _original(x * args.scale_factor)

        reference.fp8_scales = scaled
    torch.manual_seed(0)
    print(f"machine: {cpu_name()}, {torch.get_num_threads()} torch threads, {platform.python_version()}, "
          f"torch {torch.__version__}; hf_paged from {Path(sys.modules['hf_paged'].__file__).parent}")
    model, tokenizer = embedded.load()
    if args.only in (None, "ppl"):
        run_perplexity(model, tokenizer)
        quantization_error(model, tokenizer)
    if args.only in (None, "engine"):
        run_engine(model, tokenizer)


if __name__ == "__main__":
    main()
