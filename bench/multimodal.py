"""Images through the engine on CPU: a SmolVLM-shaped vision-language model with random weights.

The model has SmolVLM-256M's towers (text: SmolLM2-135M's 30 layers x 576, 9 query / 3 KV heads, vocabulary 49,280;
vision: SigLIP's 12 layers x 768, patches of 16, pixel shuffle x4), with images of ``--image-size`` pixels (256: 16
image tokens each; SmolVLM's own 512-pixel tiles give 64). Nothing is downloaded: no small real VLM is installed
here. Two questions:

1. **Engine vs padded generate()**: N requests, each with its own image and a prompt of random length, greedy, no
   EOS: ``hf_paged.generate_batch`` against ``model.generate()`` with a DynamicCache over left-padded batches of
   ``--batch-size`` in arrival order, with the same KV budget (the engine's pool holds as many tokens as one padded
   batch of the longest request, so the engine preempts); the engine with its encoder cache and without it (a
   preempted request's images are encoded again).
2. **Many questions about one picture** (M requests, the same image and system text, different questions): the
   engine with no image-aware caching (no prefix caching, no encoder cache), with the encoder cache only, and with
   prefix caching (image-aware block keys) plus the encoder cache: tokens/s, mean time to first token, vision-encoder
   calls, prompt tokens served from the prefix cache.

    python bench/multimodal.py                 # a few minutes on a 2-core VM
    python bench/multimodal.py --requests 16 --questions 16 --image-size 512
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hf_paged import BlockPool, compat, init_continuous_batching  # noqa: E402
from hf_paged.report import cpu_name, format_table  # noqa: E402

BLOCK = 16
VOCAB = 49280
IMAGE_ID = 49190
TEXT = dict(model_type="llama", vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
            pad_token_id=0, eos_token_id=None, bos_token_id=1, tie_word_embeddings=True)
VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, patch_size=16)


def build_model(image_size: int, seed: int = 0):
    config = AutoConfig.for_model("smolvlm", text_config=TEXT, vision_config=dict(VISION, image_size=image_size),
                                  image_token_id=IMAGE_ID, scale_factor=4)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def image_tokens(image_size: int) -> int:
    return (image_size // VISION["patch_size"]) ** 2 // 16


def prompt(before: list[int], after: list[int], image_seed: int, image_size: int) -> dict:
    g = torch.Generator().manual_seed(image_seed)
    ids = before + [IMAGE_ID] * image_tokens(image_size) + after
    return {"input_ids": torch.tensor([ids]),
            "pixel_values": torch.randn(1, 1, 3, image_size, image_size, generator=g),
            "pixel_attention_mask": torch.ones(1, 1, image_size, image_size, dtype=torch.long)}


def counting_encoder(model) -> list[int]:
    calls, encode = [], model.get_image_features

    def counted(*args, **kwargs):
        calls.append(1)
        return encode(*args, **kwargs)

    counted.__wrapped__ = encode  # (the engine reads its signature)
    model.get_image_features = counted
    return calls


def run_engine(model, prompts, new: int, num_blocks: int, prefix_caching: bool, encoder_cache_bytes: int):
    calls = counting_encoder(model)
    pool = BlockPool(block_size=BLOCK, num_blocks=num_blocks, prefix_caching=prefix_caching)
    t0 = time.perf_counter()
    with init_continuous_batching(model, pool=pool, encoder_cache_bytes=encoder_cache_bytes) as manager:
        ids = [manager.add_request(p, max_new_tokens=new) for p in prompts]
        results = [manager.get_result(i, timeout=3600) for i in ids]
        stats = manager.stats()
    wall = time.perf_counter() - t0
    del model.get_image_features
    ttft = sum(r.first_token_time - r.created_time for r in results) / len(results)
    return [r.generated_tokens for r in results], wall, ttft, len(calls), stats


def run_padded(model, prompts, new: int, batch_size: int):
    outs, t0 = [], time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start: start + batch_size]
        width = max(p["input_ids"].shape[1] for p in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(batch):
            n = p["input_ids"].shape[1]
            ids[r, width - n:] = p["input_ids"][0]
            mask[r, width - n:] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                 pixel_values=torch.cat([p["pixel_values"] for p in batch]),
                                 pixel_attention_mask=torch.cat([p["pixel_attention_mask"] for p in batch]),
                                 **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)})
        outs += [out[r, width:].tolist() for r in range(len(batch))]
    return outs, time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8, help="part 1: requests, each with its own image")
    parser.add_argument("--questions", type=int, default=8, help="part 2: questions about one picture")
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--max-text", type=int, default=96, help="text tokens of a prompt at most")
    parser.add_argument("--new", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--batch-size", type=int, default=4, help="padded generate() batches")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {cpu_name()}, {platform.python_implementation()} {platform.python_version()}, "
          f"torch {torch.__version__}, {args.threads} thread(s)")
    model = build_model(args.image_size)
    n_img = image_tokens(args.image_size)
    print(f"model: SmolVLM-256M's towers, random weights, fp32; images {args.image_size} px = {n_img} image tokens")
    rng = random.Random(0)

    def text(lo, hi):
        return [rng.randrange(3, 49000) for _ in range(rng.randint(lo, hi))]

    # 1. engine vs padded generate(), the same KV budget
    prompts = [prompt(text(8, args.max_text // 2), text(4, args.max_text // 2), 100 + i, args.image_size)
               for i in range(args.requests)]
    longest = max(p["input_ids"].shape[1] for p in prompts) + args.new
    num_blocks = args.batch_size * -(-longest // BLOCK)
    total = args.requests * args.new
    print(f"\n1. {args.requests} requests, one image each, prompts "
          f"{min(p['input_ids'].shape[1] for p in prompts)}-{max(p['input_ids'].shape[1] for p in prompts)} tokens, "
          f"{args.new} new tokens each; KV budget {num_blocks} blocks of {BLOCK} = a padded batch of "
          f"{args.batch_size} x {longest} tokens")
    run_engine(model, prompts[:1], 2, num_blocks, False, 0)  # warm-up
    got_e, wall_e, ttft_e, calls_e, stats_e = run_engine(model, prompts, args.new, num_blocks, False, 256 << 20)
    got_r, wall_r, ttft_r, calls_r, stats_r = run_engine(model, prompts, args.new, num_blocks, False, 0)
    got_p, wall_p = run_padded(model, prompts, args.new, args.batch_size)
    same = sum(a == b == c for a, b, c in zip(got_e, got_r, got_p))
    print(format_table(["contender", "wall s", "tokens/s", "mean TTFT s", "preemptions", "encoder calls"],
                       [["engine, encoder cache 256 MiB", f"{wall_e:.1f}", f"{total / wall_e:.1f}", f"{ttft_e:.1f}",
                         stats_e.preemptions, calls_e],
                        ["engine, no encoder cache (re-encode)", f"{wall_r:.1f}", f"{total / wall_r:.1f}",
                         f"{ttft_r:.1f}", stats_r.preemptions, calls_r],
                        [f"generate() + DynamicCache, batches of {args.batch_size}", f"{wall_p:.1f}",
                         f"{total / wall_p:.1f}", "-", "-", f"{-(-args.requests // args.batch_size)} (batched)"]]))
    print(f"engine (encoder cache) / padded generate(): {wall_p / wall_e:.2f}x the throughput; "
          f"{same}/{args.requests} requests with the same tokens in all three")

    # 2. many questions about one picture
    system = text(48, 48)
    questions = [prompt(system, text(8, 24), 7, args.image_size) for _ in range(args.questions)]
    total = args.questions * args.new
    blocks = args.questions * -(-(max(q["input_ids"].shape[1] for q in questions) + args.new) // BLOCK)
    rows, ref = [], None
    for label, prefix, cache_bytes in [("no image-aware caching", False, 0), ("encoder cache", False, 256 << 20),
                                       ("prefix caching + encoder cache", True, 256 << 20)]:
        got, wall, ttft, calls, stats = run_engine(model, questions, args.new, blocks, prefix, cache_bytes)
        ref = got if ref is None else ref
        rows.append([label, f"{wall:.1f}", f"{total / wall:.1f}", f"{ttft:.2f}", calls, stats.prefix_hit_tokens,
                     "yes" if got == ref else "no"])
    print(f"\n2. {args.questions} questions about one picture ({len(system)} system tokens, the image, 8-24 "
          f"question tokens), {args.new} new tokens each")
    print(format_table(["engine", "wall s", "tokens/s", "mean TTFT s", "encoder calls", "prefix-hit tokens",
                        "same tokens"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
