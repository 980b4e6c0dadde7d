"""Decode-only steps replayed from CUDA graphs, one graph per (rows bucket, block-table widths).

A decode-only step (every request one token, each sampled) runs padded to the next bucket of rows (1, 2, 4, ... 512)
with released padding rows, planned as a static step: its tensors are staged into the runner's step buffers (one per
name and shape, so the same addresses every time), its block tables' width is a power of two of at least
``TABLE_WIDTH_FLOOR`` columns and attention reads that whole width (masked), so the graph's launches depend on
nothing but the bucket and the widths. The first step
of a key runs eagerly (kernels compile, layers bind), is captured, and its replay is checked against the eager
logits; a capture that fails or disagrees turns the graphs off with a warning and the engine goes on eagerly. Mixed
steps (any prefill chunk) always run eagerly.

On CPU, :class:`EmulatedGraph` stands in for ``torch.cuda.CUDAGraph``: its replay re-runs the captured forward with
the captured Python objects, so a step that reached the forward through anything but its staged buffers would
replay another step's values (the tests' check that replays read only the buffers), and its capture refuses what a
CUDA capture cannot do, reading a tensor's value on the host.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Graphed steps' block tables have at least this many columns (then powers of two): the Triton decode kernel reads
# only each row's own blocks, so a wider table costs a few bytes of copy, and every width fewer is a graph per bucket
# not captured (1,024 tokens at blocks of 16: prompts of up to ~1k tokens need one width).
TABLE_WIDTH_FLOOR = 64


class CudaGraph:
    """``torch.cuda.CUDAGraph`` with a shared memory pool (graphs never run at once; each keeps its own output)."""

    def __init__(self, pool):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    @staticmethod
    def new_pool(device: torch.device):
        return torch.cuda.graph_pool_handle()

    @staticmethod
    def warm(fn):
        """Run ``fn()`` once before its capture, on a side stream as PyTorch advises (libraries set up their
        per-stream state there, not inside the capture); returns its output."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            output = fn()
        torch.cuda.current_stream().wait_stream(stream)
        return output

    def capture(self, fn):
        """Record ``fn()`` (nothing runs); returns its output tensor, filled by each :meth:`replay`."""
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            output = fn()
        return output

    def replay(self) -> None:
        self.graph.replay()


class NoHostReads(TorchFunctionMode):
    """Raises on a tensor's value read on the host (``item``, ``tolist``, ``bool``, ``int``, ...): on CUDA each is a
    device sync, which a graph capture cannot contain."""

    READS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
                       torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            raise RuntimeError(f"{func.__name__}() reads a tensor on the host inside a captured forward")
        return func(*args, **(kwargs or {}))


class EmulatedGraph:
    """A CPU stand-in for :class:`CudaGraph`: ``capture`` runs the function once under :class:`NoHostReads`;
    ``replay`` calls it again and copies its result into the captured output, as a graph fills its output tensor in
    place."""

    def __init__(self, pool):
        self.fn = None
        self.output = None

    @staticmethod
    def new_pool(device: torch.device):
        return None

    @staticmethod
    def warm(fn):
        return fn()

    def capture(self, fn):
        self.fn = fn
        with NoHostReads():
            self.output = fn()
        return self.output

    def replay(self) -> None:
        self.output.copy_(self.fn())


def graph_type(device: torch.device):
    """The graph class for ``device`` (None: no graphs there)."""
    return CudaGraph if device.type == "cuda" else None


@dataclass
class _Entry:
    graph: object
    output: torch.Tensor  # [bucket, vocab]: filled by each replay


class DecodeGraphs:
    """The runner's graphs of decode-only steps.

    Args:
        device: the model's device.
        max_rows: the most requests a step runs; the largest bucket is the first at or above it (at most
            ``DECODE_BUCKETS[-1]``: larger decode steps run eagerly).
        graph: the graph class (:class:`CudaGraph`; :class:`EmulatedGraph` on CPU for tests).
    """

    def __init__(self, device: torch.device, max_rows: int, graph=CudaGraph):
        self.device = device
        largest = next((b for b in DECODE_BUCKETS if b >= max_rows), DECODE_BUCKETS[-1])
        self.buckets = [b for b in DECODE_BUCKETS if b <= largest]
        self.graph = graph
        self.min_width = TABLE_WIDTH_FLOOR  # block-table columns of every graphed step, at least
        self.enabled = True
        self.captured = 0  # graphs recorded
        self.replays = 0  # steps served by a replay
        self.capture_s = 0.0  # seconds spent capturing (with each capture's eager step and check replay)
        self.disabled_reason: str | None = None
        self._pool = graph.new_pool(device)
        self._entries: dict[tuple, _Entry] = {}

    @property
    def keys(self) -> list[tuple]:
        """The captured graphs' keys: ``(rows bucket, (block-table width of each layer group, ...))``."""
        return list(self._entries)

    def rows_for(self, chunks) -> int | None:
        """The bucket a step of ``chunks`` runs padded to, or None when it runs eagerly (a prefill chunk in it, more
        rows than the largest bucket, or graphs off)."""
        n = len(chunks)
        if not self.enabled or n == 0 or n > self.buckets[-1]:
            return None
        if any(c.num_tokens != 1 or not c.sample for c in chunks):
            return None
        return next(b for b in self.buckets if b >= n)

    def run(self, step, inputs, buffers, forward) -> torch.Tensor:
        """Logits ``[bucket, vocab]`` of ``step`` (planned static and full-width for a bucket of rows): staged into
        ``buffers`` (with ``inputs``, a :class:`~hf_paged.engine.runner.PackedInputs` on the host), then replayed,
        or run eagerly and captured the first time its key is seen. ``forward(step, inputs)`` runs the model."""
        for group in range(len(step.groups)):  # stage the step's tensors now, outside any graph
            step.device_view(group, self.device, buffers)
        staged = inputs.moved(lambda name, t: buffers.stage(("decode graph", name), t, self.device))
        key = (step.batch_size, tuple(g.attention.block_tables.shape[1] for g in step.groups))
        entry = self._entries.get(key)
        if entry is not None:
            entry.graph.replay()
            self.replays += 1
            return entry.output
        start = time.perf_counter()
        try:
            return self._capture(key, step, staged, forward)
        finally:
            self.capture_s += time.perf_counter() - start

    def _capture(self, key, step, staged, forward) -> torch.Tensor:
        eager = self.graph.warm(lambda: forward(step, staged))  # the step itself; kernels compile, layers bind
        graph = self.graph(self._pool)
        try:
            output = graph.capture(lambda: forward(step, staged))
            graph.replay()  # writes the same K/V again: the same values to the same slots
        except Exception as err:  # noqa: BLE001 - any capture failure turns graphs off; the eager result stands
            self._disable(f"capturing the {key[0]}-row decode step failed ({type(err).__name__}: {err})")
            return eager
        gap = float((output.float() - eager.float()).abs().max()) if output.numel() else 0.0
        if gap > 1e-2 * max(1.0, float(eager.float().abs().max())):
            self._disable(f"the replayed {key[0]}-row decode step's logits differ from the eager forward's by "
                          f"{gap:.3g}")
            return eager
        self._entries[key] = _Entry(graph, output)
        self.captured += 1
        return output

    def _disable(self, reason: str) -> None:
        self.enabled = False
        self.disabled_reason = reason
        self._entries.clear()
        warnings.warn(f"hf_paged engine: CUDA graphs turned off, decode steps run eagerly: {reason}.", RuntimeWarning,
                      stacklevel=3)

    def release(self) -> None:
        """Drop every captured graph and its memory (the pool's tensors are about to move, e.g. the engine sleeps);
        later decode steps capture again."""
        self._entries.clear()
        self._pool = self.graph.new_pool(self.device)
