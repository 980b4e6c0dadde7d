"""How close do the paged Triton kernels get to the GPU's limits, and what does paging cost against contiguous SDPA?

Decode: GB/s of K/V (and query/output) traffic and % of peak memory bandwidth over batch x context, next to
``torch.nn.functional.scaled_dot_product_attention`` on the same data laid out contiguously. Prefill: TFLOP/s of the
causal prefill kernel next to SDPA with ``is_causal=True``. Both on scrambled block tables, as in a real pool.

    python bench/kernels.py                          # H200 defaults: peak 4800 GB/s, bf16, 32 q / 8 kv heads, d=128
    python bench/kernels.py --batches 1,64 --contexts 1024,8192 --json results.json
    python bench/kernels.py --json                   # JSON on stdout after the tables

Needs a CUDA device; prints the device, torch and triton versions with the tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="device memory bandwidth, GB/s (H200: 4800)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batches", type=ints, default=[1, 8, 32, 128], help="decode batch sizes, comma separated")
    p.add_argument("--contexts", type=ints, default=[512, 2048, 8192, 32768], help="decode context lengths")
    p.add_argument("--prefill-lens", type=ints, default=[512, 2048, 8192], help="prefill prompt lengths")
    p.add_argument("--prefill-batch", type=int, default=4)
    p.add_argument("--max-kv-gib", type=float, default=24.0, help="skip decode shapes whose K+V exceed this")
    p.add_argument("--sliding-window", type=int, default=None)
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="also write the results as JSON to PATH (stdout without PATH)")
    return p.parse_args(argv)


def scrambled_pool(num_seqs: int, seq_len: int, args, device) -> dict:
    """``num_seqs`` sequences of ``seq_len`` tokens at random physical blocks, plus the same K/V contiguous."""
    dtype = DTYPES[args.dtype]
    bs, hkv, d = args.block_size, args.num_kv_heads, args.head_dim
    blocks_per_seq = -(-seq_len // bs)
    num_blocks = num_seqs * blocks_per_seq
    key_cache = torch.randn(num_blocks, bs, hkv, d, device=device, dtype=dtype)  # [num_blocks, block_size, Hkv, D]
    value_cache = torch.randn_like(key_cache)
    block_tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq).to(torch.int32)
    # contiguous copies for SDPA: [num_seqs, Hkv, seq_len, D]
    def contiguous(cache):
        return cache[block_tables.long()].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()

    return dict(
        key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
        seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
        k_contig=contiguous(key_cache), v_contig=contiguous(value_cache),
    )


def bench_decode(args, do_bench, choose_num_kv_splits, paged_attention_triton, device, num_sms) -> list[dict]:
    dtype = DTYPES[args.dtype]
    elem = torch.finfo(dtype).bits // 8
    hq, hkv, d = args.num_q_heads, args.num_kv_heads, args.head_dim
    rows = []
    for batch in args.batches:
        for ctx in args.contexts:
            kv_bytes = 2 * batch * ctx * hkv * d * elem
            if 2 * kv_bytes > args.max_kv_gib * 2**30:  # paged pool + contiguous copy
                print(f"  skip decode batch={batch} ctx={ctx}: {2 * kv_bytes / 2**30:.1f} GiB > --max-kv-gib")
                continue
            data = scrambled_pool(batch, ctx, args, device)
            query = torch.randn(batch, hq, d, device=device, dtype=dtype)  # [num_tokens, Hq, D]
            query_start_loc = torch.arange(batch + 1, device=device, dtype=torch.int32)
            scale = d**-0.5
            window = args.sliding_window

            def paged():
                return paged_attention_triton(
                    query, data["key_cache"], data["value_cache"], data["block_tables"], data["seq_lens"],
                    query_start_loc, scale, window, max_query_len=1, max_seq_len=ctx,
                )

            q4 = query[:, :, None]  # [B, Hq, 1, D]
            mask = None
            if window is not None:
                mask = (torch.arange(ctx, device=device) >= ctx - window)[None]  # [1, ctx], broadcast over q/heads

            def sdpa():
                return F.scaled_dot_product_attention(
                    q4, data["k_contig"], data["v_contig"], attn_mask=mask, scale=scale, enable_gqa=hq != hkv
                )

            max_diff = (paged().float() - sdpa()[:, :, 0].float()).abs().max().item()
            t_paged = do_bench(paged) * 1e-3
            t_sdpa = do_bench(sdpa) * 1e-3
            attended = ctx if window is None else min(ctx, window)
            moved = 2 * batch * attended * hkv * d * elem + 2 * batch * hq * d * elem  # K+V read, q read, out written
            rows.append(dict(
                kind="decode", batch=batch, context=ctx,
                splits=choose_num_kv_splits(batch, hkv, attended, num_sms),
                paged_us=t_paged * 1e6, sdpa_us=t_sdpa * 1e6,
                paged_gbps=moved / t_paged / 1e9, sdpa_gbps=moved / t_sdpa / 1e9,
                paged_pct_peak=100 * moved / t_paged / 1e9 / args.peak_gbps,
                paged_over_sdpa=t_paged / t_sdpa, max_abs_diff=max_diff,
            ))
            torch.cuda.empty_cache()
    return rows


def bench_prefill(args, do_bench, paged_attention_triton, device) -> list[dict]:
    dtype = DTYPES[args.dtype]
    hq, hkv, d = args.num_q_heads, args.num_kv_heads, args.head_dim
    batch = args.prefill_batch
    rows = []
    for length in args.prefill_lens:
        data = scrambled_pool(batch, length, args, device)
        query = torch.randn(batch * length, hq, d, device=device, dtype=dtype)  # [num_tokens, Hq, D]
        query_start_loc = torch.arange(0, batch * length + 1, length, device=device, dtype=torch.int32)
        scale = d**-0.5

        def paged():
            return paged_attention_triton(
                query, data["key_cache"], data["value_cache"], data["block_tables"], data["seq_lens"],
                query_start_loc, scale, None, max_query_len=length, max_seq_len=length,
            )

        q4 = query.view(batch, length, hq, d).transpose(1, 2)  # [B, Hq, L, D]

        def sdpa():
            return F.scaled_dot_product_attention(
                q4, data["k_contig"], data["v_contig"], is_causal=True, scale=scale, enable_gqa=hq != hkv
            )

        expected = sdpa().transpose(1, 2).reshape(batch * length, hq, d)
        max_diff = (paged().float() - expected.float()).abs().max().item()
        t_paged = do_bench(paged) * 1e-3
        t_sdpa = do_bench(sdpa) * 1e-3
        flops = 4 * batch * hq * d * length * (length + 1) / 2  # QK^T and PV over the causal half
        rows.append(dict(
            kind="prefill", batch=batch, length=length,
            paged_us=t_paged * 1e6, sdpa_us=t_sdpa * 1e6,
            paged_tflops=flops / t_paged / 1e12, sdpa_tflops=flops / t_sdpa / 1e12,
            paged_over_sdpa=t_paged / t_sdpa, max_abs_diff=max_diff,
        ))
        torch.cuda.empty_cache()
    return rows


def print_table(title: str, rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    print(f"\n{title}")
    header = "  ".join(f"{label:>{len(label) if len(label) > 9 else 9}}" for _, label, _ in columns)
    print(header)
    print("-" * len(header))
    for row in rows:
        cells = []
        for key, label, fmt in columns:
            width = len(label) if len(label) > 9 else 9
            cells.append(f"{format(row[key], fmt):>{width}}")
        print("  ".join(cells))


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU (the Triton kernels only run in the slow interpreter on CPU); "
              "no CUDA device is visible here.", file=sys.stderr)
        return 1
    from triton import __version__ as triton_version
    from triton.testing import do_bench

    from hf_paged.ops.triton_kernels import choose_num_kv_splits, paged_attention_triton

    device = torch.device("cuda")
    torch.manual_seed(0)
    machine = dict(
        device=torch.cuda.get_device_name(device), torch=torch.__version__, triton=triton_version,
        peak_gbps=args.peak_gbps, dtype=args.dtype, num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim, block_size=args.block_size, sliding_window=args.sliding_window,
    )
    print(" | ".join(f"{k}={v}" for k, v in machine.items()))

    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    decode = bench_decode(args, do_bench, choose_num_kv_splits, paged_attention_triton, device, num_sms)
    print_table("Decode (one query per sequence); GB/s of K/V + q/out traffic", decode, [
        ("batch", "batch", "d"), ("context", "context", "d"), ("splits", "splits", "d"),
        ("paged_us", "paged us", ".1f"), ("paged_gbps", "paged GB/s", ".0f"), ("paged_pct_peak", "% peak", ".1f"),
        ("sdpa_us", "sdpa us", ".1f"), ("sdpa_gbps", "sdpa GB/s", ".0f"), ("paged_over_sdpa", "paged/sdpa", ".2f"),
        ("max_abs_diff", "max|diff|", ".1e"),
    ])
    prefill = bench_prefill(args, do_bench, paged_attention_triton, device)
    print_table(f"Prefill (causal, no history, batch {args.prefill_batch})", prefill, [
        ("length", "length", "d"), ("paged_us", "paged us", ".1f"), ("paged_tflops", "paged TFLOP/s", ".1f"),
        ("sdpa_us", "sdpa us", ".1f"), ("sdpa_tflops", "sdpa TFLOP/s", ".1f"), ("paged_over_sdpa", "paged/sdpa", ".2f"),
        ("max_abs_diff", "max|diff|", ".1e"),
    ])

    if args.json is not None:
        payload = json.dumps(dict(machine=machine, decode=decode, prefill=prefill), indent=2)
        if args.json == "-":
            print(payload)
        else:
            Path(args.json).write_text(payload + "\n")
            print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
