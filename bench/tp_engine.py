"""The continuous-batching engine over N tensor-parallel ranks vs one process: tokens/s.

    python bench/tp_engine.py                        # N = the visible GPUs (skipped below 2), Llama-3.2-1B's shape
    python bench/tp_engine.py --ranks 2 --shape tiny # on CPU: 2 gloo ranks, a tiny model (the control path's cost)

A random-weight Llama of the shape is saved once to a temporary directory; then the same job runs in one process
(``--ranks 1``) and under ``torchrun --nproc-per-node N`` with ``tp_plan="auto"``: rank 0 adds every request (random
prompts, greedy, no EOS) and waits for all of them. Printed: a table of N, seconds, generated tokens/s, steps, the
ratio to N = 1, and the share of requests whose tokens equal N = 1's (bf16 sums in another order may flip a near
tie; fp32 on CPU should give 1.00). ``--json PATH`` appends one object per N.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

SHAPES = {  # hidden, layers, q heads, kv heads, head_dim, intermediate, vocab
    "1b": (2048, 16, 32, 8, 64, 8192, 128256),
    "tiny": (64, 2, 4, 2, 16, 128, 256),
}


def save_model(shape: str, path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, head_dim, inter, vocab = SHAPES[shape]
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
                         max_position_embeddings=4096, eos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)


def worker(args) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hf_paged import BlockPool, init_continuous_batching

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    tp = "RANK" in os.environ
    if tp:
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo")
        model = AutoModelForCausalLM.from_pretrained(args.model, tp_plan="auto", dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to("cuda" if cuda else "cpu")
    model.eval()
    rank = dist.get_rank() if tp else 0
    ranks = dist.get_world_size() if tp else 1
    vocab = model.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(args.requests)]
    pool = BlockPool(block_size=16, num_blocks=args.blocks, prefix_caching=True)
    manager = init_continuous_batching(model, pool=pool, max_batch_tokens=args.batch_tokens, tp_timeout_s=300)
    with manager:
        if rank == 0:
            warm = manager.add_request(prompts[0][:8], max_new_tokens=2)  # first forward: allocations, graphs
            manager.get_result(warm)
            start = time.perf_counter()
            ids = [manager.add_request(p, max_new_tokens=args.new_tokens) for p in prompts]
            tokens = [list(manager.get_result(rid).generated_tokens) for rid in ids]
            seconds = time.perf_counter() - start
    if rank == 0:
        stats = manager.stats()
        row = dict(ranks=ranks, seconds=seconds, generated=sum(map(len, tokens)),
                   tokens_per_s=sum(map(len, tokens)) / seconds, steps=stats.steps, tokens=tokens,
                   kv_bytes_per_block=pool.memory_stats().bytes_per_block)
        with open(args.result, "w") as f:
            json.dump(row, f)
    if tp:
        dist.barrier()
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=None, help="N (default: the visible CUDA devices)")
    p.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=4096)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    ranks = args.ranks if args.ranks is not None else torch.cuda.device_count()
    if ranks < 2:
        print(f"skipped: tensor parallelism needs >= 2 ranks, {ranks} visible GPU(s) (--ranks 2 --shape tiny runs "
              "it on CPU)")
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model")
        save_model(args.shape, model)
        common = ["--worker", "--model", model, "--requests", str(args.requests), "--prompt", str(args.prompt),
                  "--new-tokens", str(args.new_tokens), "--batch-tokens", str(args.batch_tokens),
                  "--blocks", str(args.blocks)]
        for n in (1, ranks):
            result = os.path.join(tmp, f"result{n}.json")
            launcher = [sys.executable] if n == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                       f"--nproc-per-node={n}"]
            subprocess.run([*launcher, os.path.abspath(__file__), *common, "--result", result], check=True)
            rows.append(json.load(open(result)))
    base = rows[0]
    print(f"\nengine, {args.requests} requests x ({args.prompt} prompt + {args.new_tokens} new) tokens, "
          f"shape {args.shape}, {'CUDA' if torch.cuda.is_available() else 'CPU'}")
    print(f"{'ranks':>5} {'seconds':>8} {'tok/s':>9} {'steps':>6} {'x N=1':>6} {'KV B/block':>11} {'same tokens':>11}")
    for row in rows:
        same = sum(a == b for a, b in zip(row["tokens"], base["tokens"])) / len(base["tokens"])
        row["vs_1"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["same_tokens"] = same
        print(f"{row['ranks']:>5} {row['seconds']:>8.2f} {row['tokens_per_s']:>9.1f} {row['steps']:>6} "
              f"{row['vs_1']:>6.2f} {row['kv_bytes_per_block']:>11} {same:>11.2f}")
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps({k: v for k, v in row.items() if k != "tokens"} | {"shape": args.shape}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
