"""The engine's settings: defaults for this machine, transformers' ``ContinuousBatchingConfig`` mapped onto them, the
default pool, and the model's context limit."""

from __future__ import annotations

import dataclasses
import os

import torch

from ..pool import BlockPool
from . import features

CPU_BATCH_TOKENS = 512
CUDA_BATCH_TOKENS = 2048
CPU_POOL_FRACTION = 0.2  # of the available RAM, at most CPU_POOL_CAP
CPU_POOL_CAP = 2 * 2**30
CUDA_POOL_FRACTION = 0.8  # of the free device memory once the model is loaded
DEFAULT_WATERMARK = 0.01
DEFAULT_ARRIVAL_WINDOW_S = 0.01  # CPU: an idle engine's wait for requests that come together (factory docstring)

# ContinuousBatchingConfig fields and the engine setting each becomes.
CB_MAPPED = {
    "page_size": "block_size", "block_size": "block_size", "num_blocks": "num_blocks",
    "max_batch_tokens": "max_batch_tokens", "max_memory_percent": "memory_fraction",
    "max_requests_per_batch": "max_num_seqs", "allow_block_sharing": "prefix_caching",
    "max_queue_size": "max_queue_size", "safety_margin": "watermark", "return_logprobs": "logprobs",
}
# Fields about transformers' own machinery (attention switching, NCCL, flash decode tables, deprecated knobs) and its
# processor switches (this engine always applies every processor per request, on the request's own ids, and refuses
# by name what it cannot apply rather than dropping it): no value changes what the engine computes.
CB_IRRELEVANT = {
    "auto_switch_to_flash", "disable_nccl_graph_mixing", "cpu_group_timeout", "per_request_processors",
    "drop_unsupported_processors", "max_blocks_per_request", "use_default_compile_configs", "max_cached_graphs",
    "cpu_offload_space_safety_threshold",
}
_CB_REFUSED_WHY = features.UNSERVED_ENGINE_SETTINGS  # refused ContinuousBatchingConfig fields (features.py)


def from_continuous_batching_config(config) -> dict:
    """The engine settings a transformers ``ContinuousBatchingConfig`` asks for.

    Mapped: ``page_size`` -> block size, ``num_blocks``, ``max_batch_tokens``, ``max_memory_percent`` (share of free
    memory for the default pool), ``max_requests_per_batch`` -> ``max_num_seqs``, ``allow_block_sharing`` -> prefix
    caching, ``max_queue_size`` (0: unlimited), ``safety_margin`` -> admission watermark, ``return_logprobs`` ->
    logprobs of the sampled tokens by default, ``use_cuda_graph`` -> ``cuda_graphs`` (a bool, or ``(varlen, decode)``
    with varlen False: steps with prefill chunks always run eagerly here). Fields about transformers' own machinery
    are ignored (they change nothing here); any other field set to a value other than its default raises
    ``ValueError`` naming it.
    """
    if config is None:
        return {}
    if not dataclasses.is_dataclass(config):
        raise ValueError(f"continuous_batching_config must be a transformers ContinuousBatchingConfig, got "
                         f"{type(config).__name__}.")
    defaults = type(config)()
    out, refused = {}, []
    for f in dataclasses.fields(config):
        value, default = getattr(config, f.name), getattr(defaults, f.name)
        if f.name in CB_MAPPED:
            if value is None or (f.name == "return_logprobs" and not value):
                continue
            if f.name == "page_size" and value == default and config.block_size is None:
                continue  # transformers' default page of 256 tokens is far too coarse here: keep the pool's 16
            out[CB_MAPPED[f.name]] = value
        elif f.name in CB_IRRELEVANT or _same(value, default):
            continue
        elif f.name == "use_cuda_graph" and (isinstance(value, bool) or (
                isinstance(value, tuple) and len(value) == 2 and not value[0])):
            out["cuda_graphs"] = value if isinstance(value, bool) else bool(value[1])  # (varlen, decode)
        else:
            refused.append(f"{f.name}={value!r} ({_CB_REFUSED_WHY.get(f.name, 'not supported by this engine')})")
    if refused:
        raise ValueError("continuous_batching_config sets what this engine cannot honour: " + "; ".join(refused)
                         + ". Leave these at their defaults.")
    if out.get("max_queue_size") == 0:  # transformers' "unlimited"
        del out["max_queue_size"]
    if out.get("memory_fraction") is not None and not 0 < out["memory_fraction"] <= 1:
        raise ValueError(f"max_memory_percent must be in (0, 1], got {out['memory_fraction']}.")
    if out.get("logprobs"):
        out["logprobs"] = 0
    if out.get("prefix_caching", True) is True:
        out.pop("prefix_caching", None)  # allowed, not forced: the default (on where the model allows it) stands
    return out


def _same(value, default) -> bool:
    try:
        return bool(value == default)
    except Exception:
        return False


def default_batch_tokens(device: torch.device) -> int:
    return CUDA_BATCH_TOKENS if device.type == "cuda" else CPU_BATCH_TOKENS


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV pool on ``device`` (CUDA: free device memory; CPU: available RAM)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def default_pool(device: torch.device, *, block_size: int | None = None, num_blocks: int | None = None,
                 memory_fraction: float | None = None, prefix_caching: bool = True,
                 kv_dtype: torch.dtype | None = None) -> BlockPool:
    """A capped pool for the engine: ``num_blocks`` if given, else a share of the memory free on ``device`` (CUDA: 80%
    of free memory; CPU: 20% of available RAM, at most 2 GiB)."""
    block_size = block_size or 16
    if num_blocks is not None:
        return BlockPool(block_size, num_blocks=num_blocks, prefix_caching=prefix_caching, kv_dtype=kv_dtype)
    free = available_memory(device)
    if device.type == "cuda":
        budget = int(free * (memory_fraction or CUDA_POOL_FRACTION))
    else:
        budget = int(free * memory_fraction) if memory_fraction else min(int(free * CPU_POOL_FRACTION), CPU_POOL_CAP)
    return BlockPool(block_size, max_memory=budget, prefix_caching=prefix_caching, kv_dtype=kv_dtype)


def context_limit(config) -> tuple[int | None, str]:
    """The most tokens (prompt + generated) one request may hold, and what sets it.

    ``max_position_embeddings``; lower for rotary embeddings whose frequencies depend on the largest position in the
    forward (LongRoPE switches to its long factors past ``original_max_position_embeddings``; dynamic NTK rescales
    past ``max_position_embeddings``): in a packed batch that position is another request's, so requests stay below
    the switch, where every request computes exactly what it computes alone.
    """
    limit = getattr(config, "max_position_embeddings", None)
    reason = "max_position_embeddings"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope and not any(isinstance(v, dict) for v in rope.values()):
        rope = {"default": rope}
    for params in (rope.values() if isinstance(rope, dict) else ()):
        if not isinstance(params, dict):
            continue
        kind = params.get("rope_type", params.get("type"))
        if kind == "longrope":
            original = params.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None)
            if original is not None and (limit is None or original < limit):
                limit, reason = int(original), ("original_max_position_embeddings (LongRoPE switches to its long "
                                                "factors past it, for the whole packed batch)")
    return limit, reason
