"""Plots of the simulation's results (matplotlib): waste by block size, memory over one batch, a pool's block map.

Each function returns the figure, and also writes it to ``path`` (PNG) and closes it when ``path`` is given::

    from hf_paged.tools.plots import plot_waste_vs_block_size
    from hf_paged.tools.simulate import SHAREGPT, sample_workload, simulate_workload

    result = simulate_workload(sample_workload(SHAREGPT, 500), budget_tokens=60_000, name="sharegpt")
    plot_waste_vs_block_size([result], path="waste.png")
"""

from __future__ import annotations

import numpy as np

from ..allocator import cdiv
from .simulate import BatchTrace, BlockMap, ModelShape, WorkloadResult


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install matplotlib (or hf_paged[bench]).") from e
    if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path):
    if path is not None:
        fig.savefig(path, dpi=130, bbox_inches="tight")
        _pyplot().close(fig)
    return fig


def plot_waste_vs_block_size(results: list[WorkloadResult], path=None):
    """Waste and capacity/ideal of paged caches by block size, with reservation and padded batches as lines."""
    plt = _pyplot()
    fig, (ax_w, ax_c) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = ["--", ":", "-."]
    for i, res in enumerate(results):
        color = f"C{i}"
        sizes = sorted(res.paged)
        ok = [bs for bs in sizes if not res.paged[bs].error]
        ax_w.plot(ok, [100 * res.paged[bs].waste for bs in ok], "o-", color=color, label=f"{res.name}: paged")
        caps = [(bs, res.paged[bs].capacity) for bs in ok if res.paged[bs].capacity and res.ideal.capacity]
        if caps:
            ax_c.plot([c[0] for c in caps], [c[1] / res.ideal.capacity for c in caps], "o-", color=color)
        refs = [res.reservation, *res.padded.values()]
        for run, style in zip(refs, styles * 3):
            if run.error:
                continue
            ax_w.axhline(100 * run.waste, color=color, ls=style, lw=1.2, label=f"{res.name}: {run.label}")
            if run.capacity and res.ideal.capacity:
                ax_c.axhline(run.capacity / res.ideal.capacity, color=color, ls=style, lw=1.2)
    sizes = sorted({bs for res in results for bs in res.paged})
    for ax in (ax_w, ax_c):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(bs) for bs in sizes])
        ax.minorticks_off()
        ax.set_xlabel("block size (tokens)")
        ax.grid(alpha=0.3)
    if not ax_c.lines:
        ax_c.text(0.5, 0.5, "the budget never bound: no request waited", transform=ax_c.transAxes, ha="center")
    ax_w.axhline(4, color="0.4", lw=0.8)
    ax_w.text(ax_w.get_xlim()[1], 4.5, "4%: vLLM's paged waste ", fontsize=7, color="0.3", ha="right", va="bottom")
    ax_w.set_ylabel("KV waste, time-averaged (% of held)")
    ax_w.set_ylim(0, 100)
    ax_w.set_title("KV held but not holding a live token")
    ax_c.set_ylabel("requests running / ideal")
    ax_c.set_ylim(0, 1.05)
    ax_c.set_title("Requests that fit in the budget (ideal = every slot a real token)")
    handles, labels = ax_w.get_legend_handles_labels()
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    return _save(fig, path)


def plot_memory_over_steps(trace: BatchTrace, shape: ModelShape | None = None, path=None):
    """KV memory at each step of one batched generation: StaticCache, DynamicCache, PagedCache and real tokens."""
    plt = _pyplot()
    scale, unit = (shape.bytes_per_token / 2**20, "MiB") if shape else (1, "token slots")
    t = np.arange(1, len(trace.real) + 1)
    fig, ax = plt.subplots(figsize=(9, 4.8))
    ax.plot(t, trace.static * scale, color="C3", label=f"StaticCache (reserve {trace.max_len} per row)")
    ax.plot(t, trace.dynamic * scale, color="C1", label="DynamicCache (padded to longest row, finished rows held)")
    ax.plot(t, trace.paged * scale, color="C0",
            label=f"PagedCache (block size {trace.block_size}, finished rows freed)")
    ax.fill_between(t, trace.real * scale, color="C2", alpha=0.25, label="real tokens of running rows")
    ends = sorted({o for _, o in trace.requests})
    for o in ends:
        ax.axvline(o, color="0.7", lw=0.6, ls=":")
    ax.set_xlabel("decoding step")
    ax.set_ylabel(f"KV memory ({unit})")
    title = f"One generate() over a batch of {len(trace.requests)}"
    if shape:
        title += f" ({shape.name} shape, {shape.dtype_name}); dotted lines: a row finishes"
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0, None)
    ax.legend(fontsize=8, loc="center right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_block_map(block_map: BlockMap, path=None, columns: int = 16):
    """The pool as a grid of physical blocks colored by owning request, next to the block tables that map to them.

    Each cell is filled up to the share of its slots holding tokens; the label is ``request:logical block``.
    """
    plt = _pyplot()
    from matplotlib.patches import Rectangle

    bm = block_map
    owner = bm.owners()
    logical = np.full(bm.num_blocks, -1)
    fill = np.zeros(bm.num_blocks)
    for r, table in bm.tables.items():
        for i, b in enumerate(table):
            logical[b] = i
            fill[b] = min(bm.block_size, bm.lens[r] - i * bm.block_size) / bm.block_size
    cmap = plt.get_cmap("tab20")
    order = sorted(bm.tables)
    color_of = {r: cmap(k % 20) for k, r in enumerate(order)}
    height = cdiv(bm.num_blocks, columns)
    longest = max((len(t) for t in bm.tables.values()), default=1)

    fig, (ax_p, ax_t) = plt.subplots(1, 2, figsize=(15, max(4.5, 0.28 * len(order) + 1)),
                                     gridspec_kw={"width_ratios": [columns, longest + 4]})
    for b in range(bm.num_blocks):
        x, y = b % columns, height - 1 - b // columns
        if owner[b] < 0:
            ax_p.add_patch(Rectangle((x, y), 0.95, 0.95, color="0.92"))
            ax_p.text(x + 0.47, y + 0.47, str(b), ha="center", va="center", fontsize=6, color="0.6")
            continue
        c = color_of[owner[b]]
        ax_p.add_patch(Rectangle((x, y), 0.95, 0.95, facecolor=c, alpha=0.3, edgecolor="none"))
        ax_p.add_patch(Rectangle((x, y), 0.95, 0.95 * fill[b], facecolor=c, edgecolor="none"))
        ax_p.text(x + 0.47, y + 0.47, f"{owner[b]}:{logical[b]}", ha="center", va="center", fontsize=6)
    ax_p.set_xlim(0, columns)
    ax_p.set_ylim(0, height)
    ax_p.set_aspect("equal")
    ax_p.axis("off")
    used = int((owner >= 0).sum())
    ax_p.set_title(f"Physical pool: {bm.num_blocks} blocks x {bm.block_size} tokens, {used} in use, step {bm.step} "
                   f"({bm.finished} requests finished)\nlabel request:logical block; shading = slots filled; "
                   "grey = free", fontsize=9)

    for k, r in enumerate(order):
        y = len(order) - 1 - k
        ax_t.text(-0.3, y + 0.45, f"req {r}  ({bm.lens[r]} tok)", ha="right", va="center", fontsize=7)
        for i, b in enumerate(bm.tables[r]):
            ax_t.add_patch(Rectangle((i, y), 0.95, 0.9, facecolor=color_of[r], edgecolor="none"))
            ax_t.text(i + 0.47, y + 0.45, str(b), ha="center", va="center", fontsize=6)
    ax_t.set_xlim(-4, longest + 0.5)
    ax_t.set_ylim(0, max(len(order), 1))
    ax_t.axis("off")
    ax_t.set_title("Block tables: logical block i -> physical block id", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)
