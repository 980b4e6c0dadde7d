"""Serving a hybrid (Qwen3.5-shaped) model on CPU: the engine against padded generate() + DynamicCache.

A small random-weight model of Qwen3.5's shape (three Gated DeltaNet linear-attention layers per full-attention one;
fp32 recurrent states) serves N requests (random prompt and output lengths, greedy, no EOS), all submitted at once:

* ``engine``: ``hf_paged.init_continuous_batching`` (state cells per request, attention paged, state mixers run per
  group of requests);
* ``generate() + DynamicCache``: left-padded batches of ``--batch-size`` in arrival order, ``max_new_tokens`` = the
  batch's largest (each request keeps its own).

Reported: wall time and tokens/s, how many requests' tokens equal the request alone through ``generate()`` with a
DynamicCache (the engine's oracle; the padded batches are compared too: their padding runs through the linear
layers, masked), and memory: state bytes per sequence, K/V bytes per token, each contender's peak (the engine's:
state cells plus blocks in use, every request at once; the padded run's: its largest batch's states plus its K/V),
and how many of these requests fit a given budget at once either way.

    python bench/hybrid.py                  # 16 requests: a few minutes on a 2-core VM
    python bench/hybrid.py --requests 32 --budget-mib 64
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hf_paged import BlockPool, compat, init_continuous_batching  # noqa: E402
from hf_paged.report import cpu_name, format_table  # noqa: E402

BLOCK = 16
VOCAB = 1024
QWEN35_LIKE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_value_heads=8,
                   linear_num_key_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                   max_position_embeddings=4096, pad_token_id=0, eos_token_id=None, bos_token_id=None)


def build_model(seed: int = 0):
    config = AutoConfig.for_model("qwen3_5_text", **QWEN35_LIKE)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def workload(n: int, max_prompt: int, max_output: int, seed: int):
    rng = random.Random(seed)
    return [([rng.randrange(3, VOCAB) for _ in range(rng.randint(max_prompt // 4, max_prompt))],
             rng.randint(max_output // 3, max_output)) for _ in range(n)]


def alone(model, prompt, new):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                             **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)})
    return out[0, len(prompt):].tolist()


def run_engine(model, requests, budget_blocks: int):
    pool = BlockPool(block_size=BLOCK, num_blocks=budget_blocks)
    t0 = time.perf_counter()
    with init_continuous_batching(model, pool=pool) as manager:
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in requests]
        results = [manager.get_result(i, timeout=3600) for i in ids]
    wall = time.perf_counter() - t0
    stats = pool.memory_stats()
    peak = pool.allocator.peak_blocks_in_use * pool.bytes_per_block_id() + \
        pool.states.peak_in_use * pool.states.bytes_per_cell()
    return [r.generated_tokens for r in results], wall, peak, pool.states.bytes_per_cell(), stats


def run_padded(model, requests, batch_size: int):
    outs, peak, t0 = [], 0, time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start: start + batch_size]
        width = max(len(p) for p, _ in batch)
        new = max(n for _, n in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, _) in enumerate(batch):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                 **{compat.GENERATE_CACHE_KWARG: cache})
        peak = max(peak, cache_bytes(cache))
        outs += [out[r, width: width + n].tolist() for r, (_, n) in enumerate(batch)]
    return outs, time.perf_counter() - t0, peak


def cache_bytes(cache: DynamicCache) -> int:
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            total += sum(t.numel() * t.element_size() for t in states.values() if t is not None)
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--max-output", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=8, help="padded generate() batches")
    parser.add_argument("--budget-mib", type=float, default=32.0, help="memory budget for the 'fit' figures")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {cpu_name()}, {platform.python_implementation()} {platform.python_version()}, "
          f"torch {torch.__version__}, {args.threads} thread(s)")
    model = build_model()
    requests = workload(args.requests, args.max_prompt, args.max_output, seed=1)
    total_new = sum(n for _, n in requests)
    layers = model.config.layer_types
    print(f"model: qwen3_5-like, {len(layers)} layers ({layers.count('linear_attention')} linear attention), "
          f"hidden {QWEN35_LIKE['hidden_size']}, fp32; {len(requests)} requests, prompts "
          f"{min(len(p) for p, _ in requests)}-{max(len(p) for p, _ in requests)} tokens, "
          f"{total_new} new tokens in all")

    kv_per_token = sum(2 * QWEN35_LIKE["num_key_value_heads"] * QWEN35_LIKE["head_dim"] * 4
                       for t in layers if t == "full_attention")
    longest = max(len(p) + n for p, n in requests)
    budget_blocks = args.requests * -(-longest // BLOCK)  # room for every request at once: no preemption
    expected = [alone(model, p, n) for p, n in requests]
    run_engine(model, requests[:2], budget_blocks)  # warm-up
    got_e, wall_e, peak_e, state_bytes, _ = run_engine(model, requests, budget_blocks)
    got_p, wall_p, peak_p = run_padded(model, requests, args.batch_size)
    rows = [["engine", f"{wall_e:.1f}", f"{total_new / wall_e:.1f}", f"{peak_e / 2**20:.2f}",
             f"{sum(g == e for g, e in zip(got_e, expected))}/{len(requests)}"],
            ["generate() + DynamicCache", f"{wall_p:.1f}", f"{total_new / wall_p:.1f}", f"{peak_p / 2**20:.2f}",
             f"{sum(g == e for g, e in zip(got_p, expected))}/{len(requests)}"]]
    print(format_table(["contender", "wall s", "tokens/s", "peak cache MiB", "equal alone"], rows))
    print(f"engine / padded generate(): {wall_p / wall_e:.2f}x the throughput")

    budget = int(args.budget_mib * 2**20)
    paged_need = [state_bytes + -(-(len(p) + n) // BLOCK) * BLOCK * kv_per_token for p, n in requests]
    padded_row = state_bytes + longest * kv_per_token  # a padded batch gives every row the longest's K/V
    fit_paged, used = 0, 0
    while used + paged_need[fit_paged % len(paged_need)] <= budget:  # the workload's requests over and over
        used += paged_need[fit_paged % len(paged_need)]
        fit_paged += 1
    print(f"\nper sequence: {state_bytes:,} state bytes (fixed) = {state_bytes / kv_per_token:.0f} tokens of K/V "
          f"({kv_per_token:,} bytes per token, paged)")
    print(f"requests of this workload (repeated) that fit {args.budget_mib:g} MiB at once: paged (states fixed, K/V "
          f"by the block) {fit_paged}, padded to the longest ({longest} tokens) {budget // padded_row}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
