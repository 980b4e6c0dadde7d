"""What the weights fingerprint (hf_paged.weights) costs, against a decode step at batch 8.

One question: per admitting step the engine reads the fingerprint without a walk (version counters + the strided
sample); per generate() call / engine session it walks the modules and reads every value (the full checksum). Is
the per-step read under 1% of a step at batch 8?

Models: the embedded model (hf_paged.embedded_model_dir()) and a random model of Llama-3.2-1B's shape (no download).
The step is one forward of 8 rows x 1 token with a 64-token cache (a decode step at batch 8, attention context
short: a lower bound of a real step, so the ratio is an upper bound).

    PYTHONPATH=. python -P bench/weights_fingerprint.py [--device cuda] [--dtype bfloat16] [--skip-1b]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_paged
from hf_paged.weights import WeightsFingerprint

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                max_position_embeddings=4096, rope_theta=500000.0)


def random_1b(dtype, device) -> torch.nn.Module:
    config = LlamaConfig(**LLAMA_1B)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g)
        model.model.rotary_emb.inv_freq.copy_(1.0 / (500000.0 ** (torch.arange(0, 64, 2, device=device)
                                                                         .float() / 64)))
    return model.eval()


def timed(fn, repeat: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def step_time(model, device, sync, repeat: int) -> float:
    ids = torch.randint(3, model.config.vocab_size, (8, 64), device=device)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache, use_cache=True)
        nxt = ids[:, -1:]

        def step():
            model(nxt, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # back to the 64 tokens

        return timed(step, repeat, sync)


def measure(name, model, device, repeat: int) -> dict:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fp = WeightsFingerprint()
    fp.root(model)
    per_step = timed(lambda: fp.root(model, rewalk=False), repeat * 4, sync)
    per_walk = timed(lambda: fp.root(model, rewalk=True), max(2, repeat // 2), sync)
    step = step_time(model, device, sync, repeat)
    tensors = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    params = sum(p.numel() for p in model.parameters())
    return dict(model=name, params=params, tensors=tensors, sampled=fp.sampled_elements, per_step=per_step,
                per_walk=per_walk, step=step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--skip-1b", action="store_true")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    embedded = AutoModelForCausalLM.from_pretrained(hf_paged.embedded_model_dir(), dtype=dtype).to(args.device).eval()
    rows.append(measure("embedded", embedded, args.device, args.repeat))
    del embedded
    if not args.skip_1b:
        rows.append(measure("Llama-3.2-1B shape (random)", random_1b(dtype, args.device), args.device, args.repeat))
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"# weights fingerprint vs a decode step at batch 8 ({args.dtype}, {args.device}: {where}; torch "
          f"{torch.__version__})")
    print("| model | params | tensors | sampled elements | per admitting step (no walk) | per call (walk + full) "
          "| decode step, batch 8 | per-step share |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['params'] / 1e6:,.1f} M | {r['tensors']} | {r['sampled']:,} | "
              f"{r['per_step'] * 1e3:.3f} ms | {r['per_walk'] * 1e3:.1f} ms | {r['step'] * 1e3:.1f} ms | "
              f"{100 * r['per_step'] / r['step']:.2f}% |")


if __name__ == "__main__":
    main()
