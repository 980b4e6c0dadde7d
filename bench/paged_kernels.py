"""How close do the paged Triton kernels get to the GPU's limits, and what does paging cost against contiguous SDPA?

Decode: GB/s of K/V (and query/output) traffic and % of peak memory bandwidth over batch x context, next to
``torch.nn.functional.scaled_dot_product_attention`` on the same data laid out contiguously. Prefill: TFLOP/s of the
causal prefill kernel next to SDPA with ``is_causal=True``. Both on scrambled block tables, as in a real pool.

Host: ``--host`` prints the host microseconds of one ``paged_attention`` (decode and prefill) and ``write_kv`` call
with a fixed layer step: the launchers alone ("launcher"), the model path's eager call (``custom_ops.paged_attention``
/ ``write_kv``: "model"), and the ``torch.ops.hf_paged.*`` operators that compiled graphs call ("torch.ops"), next to
an empty operator of the same schema ("empty", subtracted in the last column). Without CUDA (any CPU, no
``TRITON_INTERPRET``) the kernels are recorded instead of launched, as ``python -m hf_paged check-kernels`` does, so
the figures are the Python launch path alone; on CUDA the kernels run (small shapes, so the GPU keeps up) and each
call is timed on the host.

    python bench/paged_kernels.py                          # H200 defaults: peak 4800 GB/s, bf16, 32 q / 8 kv heads, d=128
    python bench/paged_kernels.py --batches 1,64 --contexts 1024,8192 --json results.json
    python bench/paged_kernels.py --json                   # JSON on stdout after the tables
    python bench/paged_kernels.py --host                   # host us per call (CPU: kernels recorded; CUDA: real launches)

The kernel tables need a CUDA device; every table names the device, torch and triton versions.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    pairs = lambda s: [tuple(int(y) for y in x.split(":")) for x in s.split(",") if x]  # noqa: E731
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
    p.add_argument("--prefill-batches", type=ints, default=[1, 8], help="prefill batch sizes")
    p.add_argument("--extend", type=pairs, default=[(512, 2048)], metavar="NEW:HISTORY,...",
                   help="extend rows: NEW queries over HISTORY cached tokens, vs SDPA with a lower-right causal mask")
    p.add_argument("--mixed", type=ints, default=[512, 32, 2048], metavar="CHUNK,DECODES,CONTEXT",
                   help="a mixed step in one launch (a CHUNK-token prefill over CONTEXT, DECODES decode rows at "
                        "CONTEXT) vs its two kinds launched separately; empty: skip")
    p.add_argument("--max-kv-gib", type=float, default=24.0, help="skip decode shapes whose K+V exceed this")
    p.add_argument("--sliding-window", type=int, default=None)
    p.add_argument("--host", action="store_true", help="host us per call instead of the kernel tables")
    p.add_argument("--host-batch", type=int, default=32, help="--host: decode sequences")
    p.add_argument("--host-context", type=int, default=4096, help="--host: decode context (the table width)")
    p.add_argument("--host-prefill", type=int, default=512, help="--host: prefill chunk, one sequence")
    p.add_argument("--calls", type=int, default=None, help="--host: calls per row (default 10000 CUDA, 3000 CPU)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="also write the results as JSON to PATH (stdout without PATH)")
    return p.parse_args(argv)


def scrambled_pool(num_seqs: int, seq_len: int, args, device, contiguous: bool = True) -> dict:
    """``num_seqs`` sequences of ``seq_len`` tokens at random physical blocks, plus (``contiguous``) the same K/V
    laid out for SDPA."""
    dtype = DTYPES[args.dtype]
    bs, hkv, d = args.block_size, args.num_kv_heads, args.head_dim
    blocks_per_seq = -(-seq_len // bs)
    num_blocks = num_seqs * blocks_per_seq
    key_cache = torch.randn(num_blocks, bs, hkv, d, device=device, dtype=dtype)  # [num_blocks, block_size, Hkv, D]
    value_cache = torch.randn_like(key_cache)
    block_tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq).to(torch.int32)

    def contiguous_copy(cache):  # [num_seqs, Hkv, seq_len, D]
        return cache[block_tables.long()].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()

    data = dict(key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device))
    if contiguous:
        data.update(k_contig=contiguous_copy(key_cache), v_contig=contiguous_copy(value_cache))
    return data


def bench_decode(args, do_bench, choose_num_kv_splits, paged_attention_triton, device, num_sms) -> list[dict]:
    from hf_paged.ops.metadata import AttentionMetadata

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
                meta = AttentionMetadata(data["block_tables"], data["seq_lens"], query_start_loc, 1, ctx, window)
                return paged_attention_triton(query, data["key_cache"], data["value_cache"], meta, scale)

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


def sdpa_lower_right(q, k, v, scale: float):
    """SDPA of ``q`` ``[B, Hq, Q, D]`` over ``k``/``v`` ``[B, Hkv, L, D]`` (``Q <= L``), query ``i`` at position
    ``L - Q + i``: a lower-right causal mask (flash/efficient backends where torch supports it)."""
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[2], k.shape[2])
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    except (TypeError, RuntimeError):  # a torch without GQA through the causal bias: repeat the KV heads
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                              attn_mask=mask, scale=scale)


def bench_prefill(args, do_bench, paged_attention_triton, device) -> list[dict]:
    """Prefill without history (batch x length, vs SDPA ``is_causal``) and extend rows (new tokens over a cached
    history, vs SDPA with a lower-right causal mask)."""
    from hf_paged.ops.metadata import AttentionMetadata

    dtype = DTYPES[args.dtype]
    hq, hkv, d = args.num_q_heads, args.num_kv_heads, args.head_dim
    scale = d**-0.5
    shapes = [(b, n, 0) for b in args.prefill_batches for n in args.prefill_lens]
    shapes += [(b, n, h) for b in args.prefill_batches for n, h in args.extend]
    rows = []
    for batch, new, history in shapes:
        length = history + new
        data = scrambled_pool(batch, length, args, device)
        query = torch.randn(batch * new, hq, d, device=device, dtype=dtype)  # [num_tokens, Hq, D]
        query_start_loc = torch.arange(0, batch * new + 1, new, device=device, dtype=torch.int32)

        def paged():
            meta = AttentionMetadata(data["block_tables"], data["seq_lens"], query_start_loc, new, length)
            return paged_attention_triton(query, data["key_cache"], data["value_cache"], meta, scale)

        q4 = query.view(batch, new, hq, d).transpose(1, 2)  # [B, Hq, new, D]

        def sdpa():
            if history == 0:
                return F.scaled_dot_product_attention(q4, data["k_contig"], data["v_contig"], is_causal=True,
                                                      scale=scale, enable_gqa=hq != hkv)
            return sdpa_lower_right(q4, data["k_contig"], data["v_contig"], scale)

        expected = sdpa().transpose(1, 2).reshape(batch * new, hq, d)
        max_diff = (paged().float() - expected.float()).abs().max().item()
        t_paged = do_bench(paged) * 1e-3
        t_sdpa = do_bench(sdpa) * 1e-3
        flops = 4 * batch * hq * d * new * (history + (new + 1) / 2)  # QK^T and PV over the visible positions
        rows.append(dict(
            kind="prefill" if history == 0 else "extend", batch=batch, length=new, new=new, history=history,
            paged_us=t_paged * 1e6, sdpa_us=t_sdpa * 1e6,
            paged_tflops=flops / t_paged / 1e12, sdpa_tflops=flops / t_sdpa / 1e12,
            paged_over_sdpa=t_paged / t_sdpa, max_abs_diff=max_diff,
        ))
        del data
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_mixed(args, do_bench, paged_attention_triton, device) -> list[dict]:
    """One continuous-batching step, a prefill chunk plus decode rows, in one launch vs its two kinds launched
    separately (the prefill kernel on the chunk, the decode kernel on the decode rows)."""
    from hf_paged.ops.metadata import AttentionMetadata

    if len(args.mixed) != 3:
        return []
    chunk, decodes, context = args.mixed
    dtype = DTYPES[args.dtype]
    hq, d = args.num_q_heads, args.head_dim
    scale = d**-0.5
    data = scrambled_pool(1 + decodes, context + chunk, args, device, contiguous=False)
    seq_lens = data["seq_lens"].clone()
    seq_lens[1:] = context  # decode rows: context tokens, the last one new
    query = torch.randn(chunk + decodes, hq, d, device=device, dtype=dtype)  # [num_tokens, Hq, D]
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32, device=device),
                     torch.arange(chunk, chunk + decodes + 1, dtype=torch.int32, device=device)])
    k, v, tables, width = data["key_cache"], data["value_cache"], data["block_tables"], context + chunk
    decode_qsl = torch.arange(decodes + 1, dtype=torch.int32, device=device)
    prefill_qsl = qsl[:2].contiguous()

    def mixed():
        return paged_attention_triton(query, k, v, AttentionMetadata(tables, seq_lens, qsl, chunk, width), scale)

    def separate():
        first = paged_attention_triton(query[:chunk], k, v, AttentionMetadata(tables[:1], seq_lens[:1], prefill_qsl,
                                                                             chunk, width), scale)
        rest = paged_attention_triton(query[chunk:], k, v, AttentionMetadata(tables[1:], seq_lens[1:], decode_qsl, 1,
                                                                            width), scale)
        return torch.cat([first, rest])

    max_diff = (mixed().float() - separate().float()).abs().max().item()
    t_mixed, t_separate = do_bench(mixed) * 1e-3, do_bench(separate) * 1e-3
    return [dict(kind="mixed", chunk=chunk, decodes=decodes, context=context, mixed_us=t_mixed * 1e6,
                 separate_us=t_separate * 1e6, mixed_over_separate=t_mixed / t_separate, max_abs_diff=max_diff)]


# --------------------------------------------------------------------------------------------------------------------
# Host cost per call (--host)
# --------------------------------------------------------------------------------------------------------------------

_EMPTY_LIB = None


def empty_ops() -> dict:
    """``torch.ops.hf_paged_bench.<op>`` for each ``hf_paged`` op: the same schema, doing nothing (returning the first
    argument): what the dispatcher alone costs, to subtract from the real op."""
    global _EMPTY_LIB
    if _EMPTY_LIB is None:
        _EMPTY_LIB = torch.library.Library("hf_paged_bench", "DEF")
        for name in ("paged_attention", "write_kv"):
            schema = str(getattr(torch.ops.hf_paged, name).default._schema).split("::", 1)[1]
            _EMPTY_LIB.define(re.sub(r"\([a-z]!\)", "", schema))  # no mutation: nothing is written
            impl = (lambda *args: args[0]) if schema.endswith("-> Tensor") else (lambda *args: None)
            _EMPTY_LIB.impl(name, impl, "CompositeExplicitAutograd")
    return {"paged_attention": torch.ops.hf_paged_bench.paged_attention, "write_kv": torch.ops.hf_paged_bench.write_kv}


def host_cases(args, device) -> dict:
    """name -> zero-argument call, on tensors built once: decode, prefill and KV write through the launchers and
    through the custom ops with a fixed layer step (the Triton backend), and the empty op."""
    from hf_paged.ops import custom_ops, triton_kernels
    from hf_paged.ops.metadata import AttentionMetadata
    from hf_paged.step import GroupStep, LayerStep

    dtype = DTYPES[args.dtype]
    hq, hkv, d, bs = args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size
    batch, width = args.host_batch, -(-args.host_context // bs)
    pool = torch.zeros(4 * width, bs, hkv, d, dtype=dtype, device=device)  # [num_blocks, block_size, Hkv, D]
    table = torch.arange(batch * width, dtype=torch.int32, device=device).remainder(pool.shape[0])

    def step(num_seqs: int, q_len: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor, LayerStep]:
        q = torch.randn(num_seqs * q_len, hq, d, dtype=dtype, device=device)  # [num_tokens, Hq, D]
        kv = torch.randn(num_seqs * q_len, hkv, d, dtype=dtype, device=device)  # [num_tokens, Hkv, D]
        group = GroupStep(slot_mapping=torch.arange(num_seqs * q_len, device=device), attention=AttentionMetadata(
            block_tables=table[: num_seqs * blocks].view(num_seqs, blocks),
            seq_lens=torch.full((num_seqs,), blocks * bs, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32, device=device),
            max_query_len=q_len, max_seq_len=blocks * bs))
        layer = LayerStep(pool, pool.clone(), None, None, group, None, None, False, "triton")
        return q, kv, layer

    q_dec, kv_dec, dec = step(batch, 1, width)
    q_pre, kv_pre, pre = step(1, args.host_prefill, -(-args.host_prefill // bs))
    scale = d**-0.5
    empty = empty_ops()
    g = dec.group

    def launcher(q, layer):
        return lambda: triton_kernels.paged_attention_triton(q, layer.key_cache, layer.value_cache,
                                                             layer.group.attention, scale, reuse_partials=True)

    def op_args(q, layer):  # torch.ops.hf_paged.paged_attention's arguments, as custom_ops.paged_attention makes them
        tables, lens, qsl, layout, layout_ints, window, max_query_len, chunk, limits = custom_ops.op_arguments(
            layer.group.attention)
        return (q, layer.key_cache, layer.value_cache, tables, lens, qsl, layout, layout_ints, None, None, None, scale,
                window, 0.0, max_query_len, "triton", chunk, limits)

    write_args = (kv_dec, kv_dec, dec.key_cache, dec.value_cache, g.slot_mapping, None, None, "triton")
    dec_args, pre_args = op_args(q_dec, dec), op_args(q_pre, pre)
    kernels = len(triton_kernels.attention_spec(q_dec, pool, g.attention.block_tables, scale, None, 1,
                                                width * bs).launches)
    return {  # name -> (call, the empty op it is compared with)
        f"launcher  paged_attention decode ({batch} seqs, {kernels} kernels)": (launcher(q_dec, dec), None),
        f"launcher  paged_attention prefill ({args.host_prefill} tokens)": (launcher(q_pre, pre), None),
        f"launcher  write_kv ({batch} tokens)": (lambda: triton_kernels.write_kv_triton(*write_args[:5]), None),
        "model     paged_attention decode": (lambda: custom_ops.paged_attention(q_dec, dec, scale, None, None),
                                               None),
        "model     paged_attention prefill": (lambda: custom_ops.paged_attention(q_pre, pre, scale, None, None),
                                                None),
        "model     write_kv": (lambda: custom_ops.write_kv(*write_args), None),
        "torch.ops paged_attention decode": (lambda: torch.ops.hf_paged.paged_attention(*dec_args),
                                             "empty     paged_attention"),
        "torch.ops paged_attention prefill": (lambda: torch.ops.hf_paged.paged_attention(*pre_args),
                                              "empty     paged_attention"),
        "torch.ops write_kv": (lambda: torch.ops.hf_paged.write_kv(*write_args), "empty     write_kv"),
        "empty     paged_attention": (lambda: empty["paged_attention"](*dec_args), None),
        "empty     write_kv": (lambda: empty["write_kv"](*write_args), None),
    }


def time_host(fn, calls: int, chunk: int, sync, clock=time.perf_counter) -> float:
    """Median over chunks of ``chunk`` calls of the host microseconds per call (the device, if any, is synchronised
    between chunks, not inside them: a chunk measures what the host spends enqueuing). ``clock``: wall time, or
    ``time.thread_time`` (this thread's CPU time, which other processes on a shared CPU do not inflate)."""
    for _ in range(min(200, calls)):
        fn()
    per_call = []
    for _ in range(max(1, calls // chunk)):
        sync()
        start = clock()
        for _ in range(chunk):
            fn()
        per_call.append((clock() - start) / chunk * 1e6)
    return statistics.median(per_call)


def host_main(args) -> int:
    from hf_paged.ops import triton_kernels
    from hf_paged.report import cpu_name
    from hf_paged.tools import kernel_check

    cuda = torch.cuda.is_available()
    if not cuda and triton_kernels._INTERPRETED:
        print("--host records the kernels on CPU, which needs TRITON_INTERPRET unset: "
              "env -u TRITON_INTERPRET python bench/paged_kernels.py --host", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    calls = args.calls or (10000 if cuda else 3000)
    torch.manual_seed(0)
    with torch.inference_mode(), (nullcontext((None, [])) if cuda else kernel_check._recording(triton_kernels, 90)) \
            as (_, launches):
        cases = host_cases(args, device)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        clock = time.perf_counter if cuda else time.thread_time  # CPU: immune to a busy machine's other processes
        rows = []
        for name, (fn, baseline) in cases.items():
            if not cuda:  # a recorded launch keeps its arguments: let each call's go, as a real launch would
                fn = (lambda fn=fn: (fn(), launches.clear()))
            rows.append(dict(call=name, us=time_host(fn, calls, 100, sync, clock), baseline=baseline))
    us = {r["call"]: r["us"] for r in rows}
    for row in rows:
        if row.pop("baseline") is not None:
            row["minus_empty_op"] = row["us"] - us[cases[row["call"]][1]]
    from triton import __version__ as triton_version

    where = torch.cuda.get_device_name() if cuda else f"{cpu_name()}, kernels recorded (not launched)"
    machine = dict(host=cpu_name(), device=where, torch=torch.__version__, triton=triton_version, dtype=args.dtype,
                   num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                   block_size=args.block_size, context=args.host_context, calls=calls,
                   threads=torch.get_num_threads())
    print(" | ".join(f"{k}={v}" for k, v in machine.items()))
    clock_name = "wall time" if cuda else "this thread's CPU time"
    print(f"\nHost us per call ({clock_name}; median over chunks of 100 calls, {calls} calls a row)")
    width = max(len(r["call"]) for r in rows)
    print(f"{'call':<{width}}  {'us/call':>8}  {'minus empty op':>14}")
    print("-" * (width + 26))
    for r in rows:
        minus = f"{r['minus_empty_op']:.1f}" if "minus_empty_op" in r else ""
        print(f"{r['call']:<{width}}  {r['us']:>8.1f}  {minus:>14}")
    write_json(args.json, dict(machine=machine, host=rows))
    return 0


def write_json(path: str | None, figures: dict) -> None:
    """``--json``: the figures to ``path`` (``-``: stdout); nothing when None."""
    if path is None:
        return
    payload = json.dumps(figures, indent=2)
    if path == "-":
        print(payload)
    else:
        Path(path).write_text(payload + "\n")
        print(f"\nwrote {path}")


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
    if args.host:
        return host_main(args)
    if not torch.cuda.is_available():
        print("bench/paged_kernels.py needs a CUDA GPU (the Triton kernels only run in the slow interpreter on CPU); "
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
    print_table(f"Prefill (causal, no history) and extend (new tokens over a cached history, vs SDPA with a "
                f"lower-right causal mask)", prefill, [
        ("kind", "kind", "s"), ("batch", "batch", "d"), ("new", "new", "d"), ("history", "history", "d"),
        ("paged_us", "paged us", ".1f"), ("paged_tflops", "paged TFLOP/s", ".1f"), ("sdpa_us", "sdpa us", ".1f"),
        ("sdpa_tflops", "sdpa TFLOP/s", ".1f"), ("paged_over_sdpa", "paged/sdpa", ".2f"),
        ("max_abs_diff", "max|diff|", ".1e"),
    ])
    mixed = bench_mixed(args, do_bench, paged_attention_triton, device)
    if mixed:
        print_table("Mixed step: one launch vs prefill and decode launched separately", mixed, [
            ("chunk", "chunk", "d"), ("decodes", "decodes", "d"), ("context", "context", "d"),
            ("mixed_us", "one launch us", ".1f"), ("separate_us", "two launches us", ".1f"),
            ("mixed_over_separate", "one/two", ".2f"), ("max_abs_diff", "max|diff|", ".1e"),
        ])

    write_json(args.json, dict(machine=machine, decode=decode, prefill=prefill, mixed=mixed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
