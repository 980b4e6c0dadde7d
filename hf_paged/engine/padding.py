"""CPU step padding, decided by measuring this model's matrix products on the machine it runs on.

Some CPU GEMM libraries take a slow path for a few rows: on a 2-core Xeon (MKL, one thread) a linear layer of
SmolLM2 costs 0.60 ms for 13-15 tokens and 0.38 ms for 16, its 49k-word head 62 ms for 15 rows and 26 ms for 16; on
an AMD EPYC (or MKL's AVX2 path) there is no such cliff and padding only adds work. So nothing is assumed: when the
engine starts on CPU, :func:`measure_padding` times the model's own linear layers (one decoder layer's, standing for
all of them) at 1-16 tokens and its output head (its first 4096 rows) at 1-16 rows, and a step (or its sampled
rows) is padded to 16 only for the sizes where 16 measured at least 25% faster (a range of at least 3 sizes ending
at 15: a slow path).
The rule is cached per model shape, dtype, thread count and CPU capability (one measurement per process for each);
it times about 100 small GEMMs of each kind (a second or two for SmolLM2 on one thread, more on a busy machine).

Padding tokens are a released row's (written to the pool's scratch block, their outputs dropped); padding logits
repeat the last ones (``hf_paged.engine.runner.pack``). GPUs need none of it (their CUDA graphs pad to their own
buckets).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

TARGET = 16  # the size a padded step (or its sampled rows) runs at
_ROUNDS = 5  # timings per size, taken in rounds over all sizes (a load change hits every size); the fastest counts
_TIMING = 0.002  # seconds one timing loops for
_MIN_RANGE = 3  # a slow path spans several sizes (the Xeon's: 4-15 rows, 7-15 tokens); fewer is a noisy timing
_MARGIN = 0.75  # padding must save a quarter of the unpadded time: timing noise on a busy machine never pads, a
# slow path (the Xeon's: 1.6x per layer, 2.4x for the head) does
HEAD_SLICE = 4096  # output rows of the head timed: its cost per row is flat, the slow path depends on the input rows
_RULES: dict[tuple, "PaddingRule"] = {}


@dataclass(frozen=True)
class PaddingRule:
    """Which step sizes run padded to :data:`TARGET`: ``tokens`` for a step's packed tokens, ``rows`` for its
    sampled rows (logits). Sizes not listed run as they are.

    Example::

        rule = PaddingRule(tokens=frozenset(range(7, 16)), rows=frozenset(range(4, 16)))  # the Xeon's cliff
        rule.step_tokens(9), rule.step_tokens(3), rule.logit_rows(15)  # -> 16, 3, 16
    """

    tokens: frozenset = frozenset()
    rows: frozenset = frozenset()
    source: str = "none"  # "measured", "fixed" (the former rule: 7-15 tokens, 4-15 rows) or "none"

    def step_tokens(self, n: int) -> int:
        return TARGET if n in self.tokens else n

    def logit_rows(self, n: int) -> int:
        return TARGET if n in self.rows else n

    @classmethod
    def fixed(cls) -> "PaddingRule":
        """The rule measured once on the 2-core Xeon and applied everywhere before (for comparison)."""
        return cls(frozenset(range(7, TARGET)), frozenset(range(4, TARGET)), "fixed")

    def describe(self) -> str:
        def spans(sizes):
            return ",".join(str(n) for n in sorted(sizes)) or "none"

        return f"{self.source}: tokens {spans(self.tokens)} -> {TARGET}; rows {spans(self.rows)} -> {TARGET}"


def _fastest_per_size(run, sizes, rounds: int = _ROUNDS) -> dict[int, float]:
    """Seconds per call of ``run(n)`` (a zero-argument call on inputs of size ``n``) for each ``n`` in ``sizes``:
    the fastest of ``rounds`` timings, taken round-robin over the sizes after an untimed round (first calls pick
    kernels and allocate), each timing a loop of about 2 ms (scheduler jitter then counts little)."""
    calls = {n: run(n) for n in sizes}
    loops = {}
    for n in sizes:  # untimed round, which also sizes the loops
        start = time.perf_counter()
        calls[n]()
        loops[n] = max(1, min(50, int(_TIMING / max(time.perf_counter() - start, 1e-6))))
    best = {n: float("inf") for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            call, count = calls[n], loops[n]
            start = time.perf_counter()
            for _ in range(count):
                call()
            best[n] = min(best[n], (time.perf_counter() - start) / count)
    return best


def _layer_linears(model: nn.Module, head: nn.Module | None) -> list[nn.Linear]:
    """The linear layers of the model's first decoder layer (or of the whole model when it has no ``layers``)."""
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            return [m for m in layers[0].modules() if isinstance(m, nn.Linear)]
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m is not head]


def padding_sizes(cost: dict[int, float]) -> frozenset:
    """From the cost of each size ``1 .. TARGET``, the sizes ``a .. TARGET - 1`` that run faster padded: the smallest
    ``a`` from which every size up to ``TARGET - 1`` costs more than ``TARGET`` by the margin (a slow path's range,
    at least ``_MIN_RANGE`` sizes); empty otherwise (a size measured slow on its own is noise).

    Example: ``padding_sizes({**{n: n for n in range(1, 7)}, **{n: 30 for n in range(7, 16)}, 16: 16})`` ->
    ``frozenset(range(7, 16))``.
    """
    sizes = set()
    for n in range(TARGET - 1, 0, -1):
        if not cost[TARGET] < _MARGIN * cost[n]:
            break
        sizes.add(n)
    return frozenset(sizes) if len(sizes) >= _MIN_RANGE else frozenset()


def _parts(model: nn.Module):
    """(the first decoder layer's linear layers, the output head or None, the model's dtype)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = head if isinstance(head, nn.Linear) else None
    param = next(model.parameters(), None)
    return _layer_linears(model, head), head, param.dtype if param is not None else torch.float32


@torch.no_grad()
def gemm_costs(model: nn.Module) -> tuple[dict[int, float] | None, dict[int, float] | None]:
    """Seconds per call at each size ``1 .. TARGET``: of the first decoder layer's linear layers together (None
    without any), and of the output head's first 4096 rows (None without a linear head)."""
    linears, head, dtype = _parts(model)

    def layer_call(n: int):
        inputs = {m.in_features: torch.randn(n, m.in_features, dtype=dtype) for m in linears}
        return lambda: [m(inputs[m.in_features]) for m in linears]

    def head_call(n: int):
        hidden = torch.randn(n, head.in_features, dtype=dtype)
        weight = head.weight[:HEAD_SLICE]  # [min(vocab, 4096), hidden], contiguous rows of the real weight
        return lambda: torch.nn.functional.linear(hidden, weight)

    sizes = range(1, TARGET + 1)
    return (_fastest_per_size(layer_call, sizes) if linears else None,
            _fastest_per_size(head_call, sizes) if head is not None else None)


def measure_padding(model: nn.Module) -> PaddingRule:
    """The :class:`PaddingRule` of ``model`` on this machine (CPU), measured once per model shape, dtype, thread
    count and CPU capability, then cached: the model's first decoder layer's linear layers are timed on 1-16 tokens
    (the step's cost but attention, which padding rows do not join), its output head on 1-16 rows
    (:func:`gemm_costs`), and :func:`padding_sizes` decides."""
    linears, head, dtype = _parts(model)
    key = (tuple(tuple(m.weight.shape) for m in linears), None if head is None else tuple(head.weight.shape), dtype,
           torch.get_num_threads(), torch.backends.cpu.get_cpu_capability())
    rule = _RULES.get(key)
    if rule is None:
        layer, head_cost = gemm_costs(model)
        rule = _RULES[key] = PaddingRule(padding_sizes(layer) if layer else frozenset(),
                                         padding_sizes(head_cost) if head_cost else frozenset(), "measured")
    return rule
