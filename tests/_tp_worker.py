"""One rank of the tensor-parallel check in ``test_distributed.py``, which launches it under torchrun.

    torchrun --standalone --nproc-per-node 2 tests/_tp_worker.py WORK_DIR

``WORK_DIR/job.pt`` names the saved models (sub-directories of WORK_DIR) and holds the prompts and settings; each
rank loads every model with ``tp_plan="auto"``, generates with a PagedCache on the paged attention path, and
writes what it saw to ``WORK_DIR/rank{rank}.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from hf_paged import MemoryStats, PagedCache, compat, enable_paged_attention
from hf_paged.distributed import sum_over_ranks

warnings.filterwarnings("ignore", category=FutureWarning)


def run_model(path: str, job: dict) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, block_size=job["block_size"], release_finished=False)
    with torch.no_grad():
        out = model.generate(input_ids=job["input_ids"], attention_mask=job["attention_mask"], do_sample=False,
                             max_new_tokens=job["max_new_tokens"], **{compat.GENERATE_CACHE_KWARG: cache})
    attn = [layer.self_attn for layer in model.model.layers]
    allocator = cache.pool.allocator
    return {
        "tokens": out.tolist(),
        "k_proj_heads": [_local(a.k_proj.weight).shape[0] // a.head_dim for a in attn],
        "pool_shapes": [list(cache.pool.key_caches[i].shape) for i in range(len(attn))],
        "block_tables": [allocator.block_table(seq) for seq in allocator.sequences],
        "stats": cache.memory_stats().as_dict(),
        "all_ranks": cache.memory_stats(all_ranks=True).as_dict(),
    }


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if hasattr(weight, "to_local") else weight


def differing_counts_rejected(stats: dict) -> bool:
    """sum_over_ranks must refuse ranks whose block counts differ (and refuse on every rank, so none hangs)."""
    skewed = dataclasses.replace(MemoryStats(**stats), blocks_in_use=dist.get_rank())
    try:
        sum_over_ranks(skewed)
    except ValueError:
        return True
    return False


def main(work_dir: str) -> None:
    job = torch.load(os.path.join(work_dir, "job.pt"))
    result = {name: run_model(os.path.join(work_dir, name), job) for name in job["models"]}
    first = next(iter(result.values()))
    result["_meta"] = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "differing_counts_rejected": differing_counts_rejected(first["stats"]),
    }
    tmp = os.path.join(work_dir, f"rank{dist.get_rank()}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, tmp[: -len(".tmp")])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
