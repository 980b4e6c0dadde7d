"""Memory figures across the ranks of a tensor-parallel model.

Under tensor parallelism (``from_pretrained(..., tp_plan="auto")`` under ``torchrun``) every rank runs the same
``generate()`` over the same tokens but holds only its own KV heads: ``k_proj``/``v_proj`` are split by heads, so the
key tensor a rank's :class:`~hf_paged.PagedCache` receives is ``[B, num_kv_heads / world_size, S, head_dim]`` and
its pool is sized from that. The allocator sees the same requests in the same order on every rank, so block tables,
block counts and token counts are identical across ranks; only the bytes differ (each rank holds its share).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from .stats import MemoryStats

BYTE_FIELDS = ("bytes_per_block", "bytes_reserved", "bytes_in_use")
# The scalar figures (per-group figures stay per rank: memory_stats() on each rank gives them).
_FIELDS = tuple(f.name for f in dataclasses.fields(MemoryStats) if f.name != "groups")


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _collective_device(group) -> torch.device:
    """Where the process group's collectives take their tensors: CPU for gloo, the current accelerator otherwise."""
    backend = str(dist.get_backend(group))  # "gloo", "nccl", or a per-device map like "cpu:gloo,cuda:nccl"
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return torch.device(accelerator.current_accelerator().type)  # no index: the device this rank is bound to
    return torch.device("cuda")


def gather_stats(stats: MemoryStats, group=None) -> list[MemoryStats]:
    """Every rank's ``stats``, in rank order (a collective: call it on every rank of ``group``).

    Without an initialized process group this is ``[stats]``. ``group`` defaults to the default process group.

    Example (under ``torchrun --nproc-per-node 2``)::

        per_rank = gather_stats(cache.memory_stats())
        if torch.distributed.get_rank() == 0:
            for rank, s in enumerate(per_rank):
                print(rank, s.bytes_in_use)
    """
    if not _initialized():
        return [stats]
    # float64 holds every integer below 2**53 exactly (byte counts up to 8 PiB); NaN stands for None (max_blocks).
    row = torch.tensor([math.nan if getattr(stats, n) is None else float(getattr(stats, n)) for n in _FIELDS],
                       dtype=torch.float64, device=_collective_device(group))  # [num_fields]
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    out = []
    for values in rows:
        fields = {}
        for name, value in zip(_FIELDS, values.tolist()):
            if math.isnan(value):
                fields[name] = None
            elif isinstance(getattr(stats, name), float):
                fields[name] = value
            else:
                fields[name] = int(value)
        out.append(MemoryStats(**fields))
    return out


def sum_over_ranks(stats: MemoryStats, group=None) -> MemoryStats:
    """``stats`` with its byte figures summed over the ranks of ``group`` (a collective: call it on every rank).

    The byte fields (``bytes_per_block``, ``bytes_reserved``, ``bytes_in_use``, hence ``peak_bytes_in_use``) are
    summed: under tensor parallelism each rank holds its share of the KV heads, so the sum is what the whole model's
    cache takes, the figure a single process would report. Block and token counts (``num_blocks``,
    ``blocks_in_use``, ``tokens_stored``, ...) are the same on every rank and are returned as they are; if they
    differ (ranks running different requests, as in data parallelism) a ``ValueError`` says which, since one count
    could not describe them all. Without an initialized process group ``stats`` is returned unchanged.

    This is what ``PagedCache.memory_stats(all_ranks=True)`` returns. ``group`` defaults to the default process
    group; gloo (CPU) and nccl (CUDA) groups both work.

    Example (under ``torchrun --nproc-per-node 2``, a model loaded with ``tp_plan="auto"``)::

        mine = cache.memory_stats()                 # this rank's KV heads only
        total = cache.memory_stats(all_ranks=True)  # == sum_over_ranks(mine)
        assert total.bytes_in_use == 2 * mine.bytes_in_use  # two ranks, KV heads split evenly
    """
    per_rank = gather_stats(stats, group)
    if len(per_rank) == 1:
        return stats
    differing = {name: [getattr(s, name) for s in per_rank] for name in _FIELDS
                 if name not in BYTE_FIELDS and len({getattr(s, name) for s in per_rank}) > 1}
    if differing:
        detail = "; ".join(f"{name} per rank {values}" for name, values in differing.items())
        raise ValueError(
            f"memory_stats(all_ranks=True) sums the KV bytes of tensor-parallel ranks, which hold the same blocks, "
            f"but the ranks' block and token counts differ: {detail}. Ranks that run different requests (data "
            "parallelism) need memory_stats() on each rank (or hf_paged.distributed.gather_stats) instead."
        )
    return dataclasses.replace(stats, **{name: sum(getattr(s, name) for s in per_rank) for name in BYTE_FIELDS})
