"""Does attending in the latent space keep an MLA model's decode step flat as the context grows?

One decode step (one token, batch 1, eager, CPU) of a small DeepSeek-V3-shaped model at contexts 512 -> 8k, two ways:

* ``DynamicCache`` (transformers 5.24): the cache holds the latent, and every step re-expands the whole history
  through ``kv_b_proj`` into per-head keys and values (``L x kv_lora_rank x H x (qk_nope + v)`` multiply-adds per layer)
  before attending: its step grows with the context, steeply;
* ``PagedCache`` + ``enable_paged_attention``: the pool holds the same latent; the step absorbs ``kv_b_proj`` into the
  query and the output and attends over the latent itself (``L x H x (kv_lora_rank + rope)`` per layer).

The histories are written straight into each cache (random latents, the same for both; no prefill is timed or run).
Per context: the median of ``--steps`` steps after one warm-up, the ratio, and per token the KV bytes each cache
stores (both the latent) and the per-head K/V bytes the DynamicCache step materialises for every past token; the
largest difference between the two first steps' logits shows both read the same history.

    python bench/mla.py                        # contexts 512 1024 2048 4096 8192, one thread
    python bench/mla.py --contexts 512 4096 --threads 2 --steps 5

``--kernel`` (the GPU stage of bench/gpu.sh) times one layer's attention at DeepSeek-V3's shape instead (rank 512,
rope 64, nope 128, v 128, 128 heads, bf16, block 16) over batch x context on scrambled block tables: the Triton MLA
kernel and the torch path (both absorbed, reading the paged latent) against transformers' way (expand the whole
history through ``kv_b_proj``, then SDPA), with GB/s over the latent bytes read and the Triton result's largest
difference from the torch path; JSON to ``--json``. On CPU (``DRY=1``: the Triton interpreter) use tiny shapes:
``--kernel --heads 4 --rank 32 --rope 16 --nope 16 --v 16 --batches 2 --kernel-contexts 32``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_paged import PagedCache, compat, enable_paged_attention  # noqa: E402
from hf_paged.ops import AttentionMetadata, mla  # noqa: E402
from hf_paged.report import cpu_name  # noqa: E402

# Small DeepSeek-V3-shaped attention (the real one: rank 512, rope 64, nope 128, v 128, 128 heads, 61 layers).
SHAPE = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=8, kv_lora_rank=256, q_lora_rank=None, qk_rope_head_dim=32, qk_nope_head_dim=64,
             v_head_dim=64, first_k_dense_replace=2, max_position_embeddings=16384)


MAX_REL_DIFF = 2e-2  # --kernel: Triton vs torch path, relative to the output's largest value (bf16 on the GPU)


def build_model():
    torch.manual_seed(0)
    config = AutoConfig.for_model("deepseek_v3", **SHAPE)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).eval()


def fill(cache, config, context: int, paged: bool) -> None:
    """Write ``context`` random latents per layer into ``cache`` as one forward would (no attention runs)."""
    gen = torch.Generator().manual_seed(context)
    latents = [(torch.randn(1, 1, context, config.kv_lora_rank, generator=gen),
                torch.randn(1, 1, context, config.qk_rope_head_dim, generator=gen))
               for _ in range(config.num_hidden_layers)]
    if paged:
        cache.plan(torch.zeros(1, context, dtype=torch.long), None, 1, context, "torch", torch.float32)
    for layer, (latent, rope) in enumerate(latents):
        cache.update(latent, rope, layer, kwargs={})
    if paged:
        cache.forward_ran()


def step_times(model, cache, steps: int) -> tuple[list[float], torch.Tensor]:
    """Seconds of each of ``steps`` decode forwards (after one untimed), continuing ``cache``; the first step's
    logits."""
    token = torch.tensor([[5]])
    times, first = [], None
    with torch.no_grad():
        for i in range(steps + 1):
            start = time.perf_counter()
            logits = model(input_ids=token, **{compat.FORWARD_CACHE_KWARG: cache}).logits
            if i:
                times.append(time.perf_counter() - start)
            else:
                first = logits
    return times, first


def _timer(device: torch.device):
    """``fn -> ms``: triton.testing.do_bench on CUDA; one warm call then one timed call elsewhere (the interpreter)."""
    if device.type == "cuda":
        import triton

        return lambda fn: triton.testing.do_bench(fn, warmup=5, rep=20)

    def once(fn):
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return once


def kernel_bench(args) -> list[dict]:
    """One layer's decode attention at a real MLA shape: Triton and torch (absorbed, paged) vs expanded + SDPA."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, rank, rope, nope, v = args.heads, args.rank, args.rope, args.nope, args.v
    scale = (nope + rope) ** -0.5
    bench = _timer(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    weight = (torch.randn(heads * (nope + v), rank, generator=gen) * rank**-0.5).to(device, dtype)  # kv_b_proj
    rows = []
    for batch in args.batches:
        for context in args.kernel_contexts:
            bs = 16
            per_seq = -(-context // bs)
            blocks = torch.randperm(batch * per_seq + 1, generator=gen)[: batch * per_seq]
            tables = blocks.view(batch, per_seq).to(torch.int32).to(device)
            latent = torch.randn(batch * per_seq + 1, bs, 1, rank, generator=gen).to(device, dtype)
            rope_cache = torch.randn(batch * per_seq + 1, bs, 1, rope, generator=gen).to(device, dtype)
            meta = AttentionMetadata(tables, torch.full((batch,), context, dtype=torch.int32, device=device),
                                     torch.arange(batch + 1, dtype=torch.int32, device=device), 1, per_seq * bs)
            query = torch.randn(batch, heads, nope + rope, generator=gen).to(device, dtype)  # [N, H, Dn + P]

            def paged(backend):
                return mla.paged_mla(query, weight, None, nope, latent, rope_cache, meta, scale, backend)

            def expanded():  # transformers' way: the whole history through kv_b_proj, then attention per head
                c = latent.index_select(0, tables.flatten().long()).view(batch, -1, rank)[:, :context]  # [B, L, R]
                r = rope_cache.index_select(0, tables.flatten().long()).view(batch, -1, rope)[:, :context]
                kv = (c @ weight.T).view(batch, context, heads, nope + v).transpose(1, 2)  # [B, H, L, Dn + Dv]
                keys = torch.cat([kv[..., :nope], r[:, None].expand(-1, heads, -1, -1)], -1)
                return torch.nn.functional.scaled_dot_product_attention(
                    query[:, :, None], keys, kv[..., nope:], scale=scale)[:, :, 0]  # [B, H, Dv]

            with torch.no_grad():
                want = paged("torch")
                got = paged("triton")
                diff = float((got.float() - want.float()).abs().max() / want.float().abs().max())
                exp_diff = float((expanded().float() - want.float()).abs().max() / want.float().abs().max())
                t_triton, t_torch, t_expanded = bench(lambda: paged("triton")), bench(lambda: paged("torch")), \
                    bench(expanded)
            latent_bytes = batch * context * (rank + rope) * latent.element_size()
            rows.append(dict(batch=batch, context=context, triton_us=t_triton * 1e3, torch_us=t_torch * 1e3,
                             expanded_us=t_expanded * 1e3, triton_gbps=latent_bytes / (t_triton * 1e-3) / 1e9,
                             expanded_over_triton=t_expanded / t_triton, triton_vs_torch_rel=diff,
                             expanded_vs_torch_rel=exp_diff))
            r = rows[-1]
            print(f"{batch:>5} {context:>7} {r['triton_us']:>10.1f} {r['torch_us']:>10.1f} {r['expanded_us']:>12.1f} "
                  f"{r['triton_gbps']:>8.1f} {r['expanded_over_triton']:>10.1f}x {diff:>10.1e} {exp_diff:>10.1e}",
                  flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--steps", type=int, default=3, help="timed decode steps per context and cache (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--kernel", action="store_true", help="one layer's attention at a real shape (see above)")
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--rank", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--nope", type=int, default=128)
    p.add_argument("--v", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--kernel-contexts", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--json", default=None, help="--kernel: write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.kernel:
        where = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_name()
        print(f"MLA decode attention, one layer: {args.heads} heads, rank {args.rank}, rope {args.rope}, nope "
              f"{args.nope}, v {args.v}, block 16 ({where})")
        print(f"{'batch':>5} {'context':>7} {'triton us':>10} {'torch us':>10} {'expanded us':>12} {'GB/s':>8} "
              f"{'exp/triton':>11} {'|tri-tor|':>10} {'|exp-tor|':>10}")
        rows = kernel_bench(args)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(shape=vars(args), rows=rows), indent=1) + "\n")
        worst = max(r["triton_vs_torch_rel"] for r in rows)
        if worst > MAX_REL_DIFF:  # a broken kernel fails the stage; bf16 rounding stays far below this
            print(f"FAIL: the Triton result differs from the torch path by {worst:.1e} of its largest value "
                  f"(> {MAX_REL_DIFF})")
            return 1
        return 0
    model = build_model()
    config = model.config
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
    latent_bytes = layers * (rank + rope) * 4
    expanded_bytes = layers * heads * (config.qk_nope_head_dim + rope + config.v_head_dim) * 4
    print(f"bench/mla.py: {cpu_name()}, {args.threads} thread(s), torch {torch.__version__}, Python "
          f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"model: deepseek_v3 {layers} layers, {heads} heads, kv_lora_rank {rank}, rope {rope}, nope "
          f"{config.qk_nope_head_dim}, v {config.v_head_dim}, fp32; median of {args.steps} decode steps, batch 1")
    print(f"KV stored per token: {latent_bytes} B in both caches (the latent); the DynamicCache step also builds "
          f"{expanded_bytes} B of per-head K/V per past token ({expanded_bytes / latent_bytes:.1f}x)\n")
    header = (f"{'context':>8} {'DynamicCache ms':>16} {'PagedCache ms':>14} {'speed-up':>9} "
              f"{'expanded MiB/step':>18} {'max |logit diff|':>17}")
    print(header)
    print("-" * len(header))
    dynamic_model = build_model()  # the same weights, never patched
    paged_model = enable_paged_attention(build_model(), backend="torch")
    for context in args.contexts:
        dynamic = DynamicCache(config=config)
        fill(dynamic, config, context, paged=False)
        times, want = step_times(dynamic_model, dynamic, args.steps)
        t_dyn = statistics.median(times)
        del dynamic
        paged = PagedCache(paged_model.config)
        fill(paged, paged_model.config, context, paged=True)
        times, got = step_times(paged_model, paged, args.steps)
        t_paged = statistics.median(times)
        del paged
        print(f"{context:>8} {t_dyn * 1e3:>16.2f} {t_paged * 1e3:>14.2f} {t_dyn / t_paged:>8.1f}x "
              f"{context * expanded_bytes / 2**20:>18.1f} {float((got - want).abs().max()):>17.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
