"""Shared measurements for the demo, the benchmarks and the notebooks: KV figures of each cache, tables."""

from __future__ import annotations

import platform

import torch

from .patches import kv_geometry


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """K+V bytes one token takes over all layers, each layer by its own shape in the KV geometry (MLA: the latent
    and the rotated key; layers that keep no K/V of their own, such as KV-shared or state layers: none)."""
    return kv_geometry(config).elements_per_token() * dtype.itemsize


def real_kv_tokens(sequences: torch.Tensor, prompt_mask: torch.Tensor, eos_token_id, pad_token_id=None) -> int:
    """Tokens whose KV a cache must keep after ``generate()``: real prompt tokens, then each row's generated
    tokens up to and including its end-of-sequence token (the final generated column never enters the cache)."""
    prompt_len = prompt_mask.shape[1]
    generated = sequences[:, prompt_len:]
    steps = generated.shape[1]
    eos = torch.tensor(eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])
    total = int(prompt_mask.sum())
    for row in generated:
        hits = torch.isin(row, eos).nonzero()
        used = int(hits[0]) + 1 if len(hits) else steps
        total += min(used, steps - 1)
    return total


def row_token_counts(sequences: torch.Tensor, prompt_mask: torch.Tensor, eos_token_id) -> list[int]:
    """Per row: the tokens whose KV a cache must keep after ``generate()`` (see :func:`real_kv_tokens`)."""
    return [real_kv_tokens(sequences[i:i + 1].cpu(), prompt_mask[i:i + 1].cpu(), eos_token_id)
            for i in range(sequences.shape[0])]


def real_kv_bytes(config, dtype: torch.dtype, row_tokens: list[int]) -> int:
    """Bytes of the KV the rows really need, layer by layer (each by its own shape): a sliding-window layer needs
    only its last ``window - 1`` tokens between steps (what transformers' DynamicCache keeps there), another layer
    that keeps K/V all of them."""
    total = 0
    for layer in kv_geometry(config).layers:
        per_token = layer.elements_per_token() * dtype.itemsize
        limit = layer.window - 1 if layer.kind == "sliding" else None
        total += sum(per_token * (n if limit is None else min(n, limit)) for n in row_tokens)
    return total


def dynamic_cache_bytes(cache) -> int:
    """Bytes a DynamicCache holds (its K/V tensors, padding and finished rows included)."""
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)


def format_table(headers: list[str], rows: list[list]) -> str:
    """A plain-text table with right-aligned numbers."""
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else _fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.2f} MB"


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
