"""Tensor-parallel generate() with a PagedCache: each rank keeps only its own KV heads in its pool.

    torchrun --nproc-per-node 2 examples/tp_generate.py [--max-new-tokens 16] [--block-size 4]

A tiny random Llama (4 query heads, 2 KV heads) is saved to a temporary directory by rank 0, since ``tp_plan``
works through ``from_pretrained``; every rank then loads it with ``tp_plan="auto"``, so each holds one KV head.
Runs on CPU with gloo, or on GPUs with nccl when CUDA is available. Prints the generated tokens (and whether they
equal DynamicCache's), each rank's KV memory and the sum over ranks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_paged import PagedCache, compat, enable_paged_attention
from hf_paged.distributed import gather_stats
from hf_paged.report import format_table

warnings.filterwarnings("ignore", category=FutureWarning)  # tp_plan= and past_key_values= renames


def init_distributed() -> torch.device:
    if "RANK" not in os.environ:
        sys.exit("run this under torchrun: torchrun --nproc-per-node 2 examples/tp_generate.py")
    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def save_tiny_llama(seed: int = 0) -> str:
    """Rank 0 saves a tiny random Llama; every rank gets its directory."""
    path = [None]
    if dist.get_rank() == 0:
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1)
        path[0] = tempfile.mkdtemp(prefix="hf_paged_tp_")
        LlamaForCausalLM(config).save_pretrained(path[0])
    dist.broadcast_object_list(path, src=0)
    return path[0]


def prompts(device: torch.device, lengths=(5, 12), seed: int = 0) -> dict:
    """Left-padded random prompts: ``input_ids``/``attention_mask`` ``[B, max(lengths)]``."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, n in enumerate(lengths):
        input_ids[row, width - n:] = torch.randint(2, 128, (n,), generator=g)
        attention_mask[row, width - n:] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=4)
    args = parser.parse_args()

    device = init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    path = save_tiny_llama()
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    if model.config.num_key_value_heads % world_size:
        sys.exit(f"{model.config.num_key_value_heads} KV heads do not split over {world_size} ranks.")
    inputs = prompts(device)

    def greedy(cache):
        return model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                              **{compat.GENERATE_CACHE_KWARG: cache})

    with torch.no_grad():
        expected = greedy(DynamicCache(config=model.config))
        enable_paged_attention(model)
        cache = PagedCache(model.config, block_size=args.block_size, release_finished=False)
        out = greedy(cache)

    per_rank = gather_stats(cache.memory_stats())  # collectives: every rank calls them
    total = cache.memory_stats(all_ranks=True)
    heads_per_rank = [None] * world_size
    local_heads = cache.pool.key_caches[0].shape[2]  # [num_blocks, block_size, num_kv_heads, head_dim]
    dist.all_gather_object(heads_per_rank, local_heads)

    if rank == 0:
        print(f"{world_size} ranks ({dist.get_backend()}), tiny Llama with {model.config.num_key_value_heads} KV "
              f"heads, {args.max_new_tokens} new tokens, block_size {args.block_size}")
        for row in out[:, inputs["input_ids"].shape[1]:].tolist():
            print("  generated:", row)
        print("  same tokens as DynamicCache:", torch.equal(out, expected), "\n")
        rows = [[f"rank {r}", heads_per_rank[r], s.blocks_in_use, s.tokens_stored, s.bytes_in_use, s.bytes_reserved]
                for r, s in enumerate(per_rank)]
        rows.append(["all ranks", sum(heads_per_rank), total.blocks_in_use, total.tokens_stored, total.bytes_in_use,
                     total.bytes_reserved])
        print(format_table(["", "KV heads", "blocks in use", "tokens", "bytes in use", "bytes reserved"], rows))
        print("\nBlock tables are the same on every rank (same requests, deterministic allocator); bytes split "
              "with the KV heads.")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
