"""Memory at scale, by simulation: serve a workload with the engine's own scheduler and compare KV schemes.

No model runs here and no K/V tensor is made: requests are served by the engine's real
:class:`~hf_paged.engine.scheduler.Scheduler` over a :class:`~hf_paged.engine.kv.RequestKV` on a real
:class:`~hf_paged.BlockPool` (whose tensors are never made), and each scheduled chunk "runs" by taking its blocks in
the pool's allocator; a chunk that reaches the end of its request's known tokens produces a fake token. A request
``(prompt_len, output_len)`` ends after ``output_len`` tokens. Three ways to hold the KV of the same requests in one
fixed budget of token slots:

* **reservation** (``StaticCache``-style): each running request owns ``max_len`` slots. A slot is refilled as soon as
  its request finishes (Orca-"max" style), the kindest case for reservation. It is simulated as the engine on a pool
  whose block size is ``max_len``: one block per request, no watermark.
* **padded** (``DynamicCache`` in a batched ``generate()``): requests run in static batches of ``batch_size``; every
  row is left-padded to the batch's longest prompt and grows by one column per step until the batch's longest output
  ends, so finished rows stay held. A batch is admitted when the final size of every running batch, its own
  included, fits the budget (an oracle that knows output lengths: the kindest case for padding).
* **paged** (``PagedCache``): the engine's continuous batching on a pool of ``budget // block_size`` blocks, with
  its policy as :mod:`hf_paged.engine.scheduler` has it (first come first served, chunked prefill within
  ``max_batch_tokens``, a 1% watermark at admission, preemption of the most recently admitted request by recompute,
  prefix caching as the engine's default pool has it). Finished requests give their blocks back at once.

Conventions, as in the engine: a step is one forward; a request's prompt runs in its first step(s), which give its
first token, and each later step runs the token before to give the next, so a request of prompt ``p`` holds
``p + g - 1`` tokens in the step that gives its ``g``-th token (the last token's K/V is never computed). Each step is
measured after its chunks took their blocks and before finished requests are released.

* **held**: slots set aside for running work: blocks in use x block size (paged, reservation), batch rows x columns
  (padded, finished rows included).
* **real**: tokens whose K/V running requests hold. Everything held and not real is waste.
* **waste** = ``1 - sum_t real(t) / sum_t held(t)``: the time-averaged unused fraction of held KV.
* **capacity**: mean number of running requests over the steps where a request was left waiting (the budget, not
  the workload, limited the batch); ``None`` when the budget never bound. The *ideal* is the paged scheme at
  block size 1, where every held slot holds a real token.

Example::

    from hf_paged.tools.simulate import SHAREGPT, SMOLLM2_135M, sample_workload, simulate_workload, format_table

    requests = sample_workload(SHAREGPT, 1000, seed=0)
    budget = (2 << 30) // SMOLLM2_135M.bytes_per_token        # 2 GiB of fp16 KV, in token slots
    result = simulate_workload(requests, budget)
    print(format_table(result, SMOLLM2_135M))
    print(result.paged[16].waste)                           # ~0.02
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from ..allocator import BlockAllocator, cdiv
from ..engine.kv import RequestKV
from ..engine.options import CUDA_BATCH_TOKENS, DEFAULT_WATERMARK
from ..engine.outputs import RequestStatus
from ..engine.request import Request as EngineRequest
from ..engine.scheduler import Batch, Scheduler
from ..groups import LayerGroups
from ..patches import kv_shape
from ..pool import BlockPool

Request = tuple[int, int]  # (prompt_len, output_len)


# ------------------------------------------------------------------------------------------------ workloads
@dataclass(frozen=True)
class LengthModel:
    """Prompt and output lengths drawn from lognormals, clipped to ``max_len``, with their means calibrated.

    Prompts are ``clip(round(exp(mu_p + prompt_sigma * z)), 1, max_len - 1)`` and outputs
    ``clip(round(exp(mu_o + output_sigma * z')), 1, max_len - prompt)``; ``mu_p`` and ``mu_o`` are solved per sample
    so that the *clipped* sample means equal ``prompt_mean`` and ``output_mean``.
    """

    name: str
    prompt_mean: float
    output_mean: float
    prompt_sigma: float
    output_sigma: float
    max_len: int = 2048

    def describe(self) -> str:
        return (f"{self.name}: prompt mean {self.prompt_mean:g} / output mean {self.output_mean:g} tokens, lognormal "
                f"sigma {self.prompt_sigma:g} / {self.output_sigma:g}, prompt+output clipped to {self.max_len}")


# Means from the vLLM paper (Kwon et al. 2023, Fig. 11); the sigmas are our choice of a long tail.
SHAREGPT = LengthModel("ShareGPT-like", 161.31, 337.99, prompt_sigma=1.0, output_sigma=0.9)
ALPACA = LengthModel("Alpaca-like", 19.31, 58.45, prompt_sigma=0.6, output_sigma=0.8)


def sample_workload(model: LengthModel, num_requests: int, seed: int = 0) -> list[Request]:
    """``num_requests`` ``(prompt_len, output_len)`` pairs from ``model``, deterministic in ``seed``."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}.")
    rng = np.random.default_rng(seed)
    z_prompt = rng.standard_normal(num_requests)
    z_output = rng.standard_normal(num_requests)
    prompt = _calibrated(z_prompt, model.prompt_sigma, model.prompt_mean, np.full(num_requests, model.max_len - 1))
    output = _calibrated(z_output, model.output_sigma, model.output_mean, model.max_len - prompt)
    return [(int(p), int(o)) for p, o in zip(prompt, output)]


def _calibrated(z: np.ndarray, sigma: float, mean: float, high: np.ndarray) -> np.ndarray:
    def lengths(mu: float) -> np.ndarray:
        return np.clip(np.rint(np.exp(mu + sigma * z)), 1, high).astype(np.int64)

    lo, hi = -5.0, math.log(float(high.max())) + 10 * sigma
    if not lengths(lo).mean() <= mean <= lengths(hi).mean():
        raise ValueError(f"a mean of {mean} tokens is out of reach with lengths clipped to {int(high.max())}.")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if lengths(mid).mean() < mean else (lo, mid)
    return lengths(hi)


@dataclass(frozen=True)
class ModelShape:
    """What one token of KV costs: ``2 (K and V) * num_layers * num_kv_heads * head_dim * dtype_bytes`` bytes."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def dtype_name(self) -> str:
        return {1: "int8/fp8", 2: "fp16", 4: "fp32"}.get(self.dtype_bytes, f"{self.dtype_bytes}-byte")

    @classmethod
    def from_config(cls, config, dtype_bytes: int = 2) -> "ModelShape":
        """The shape of a transformers config (``model.config``)."""
        kv_heads, head_dim = kv_shape(config)
        return cls(getattr(config, "name_or_path", "") or type(config).__name__, config.num_hidden_layers,
                   kv_heads, head_dim, dtype_bytes)


SMOLLM2_135M = ModelShape("SmolLM2-135M", num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=2)


# ------------------------------------------------------------------------------------------------ runs
@dataclass
class Run:
    """Per-step figures of one scheme over one workload, in token slots (see the module docstring)."""

    label: str
    budget_tokens: int
    held: np.ndarray  # [steps] slots held for running work
    real: np.ndarray  # [steps] tokens whose K/V running requests hold
    live: np.ndarray  # [steps] running requests
    waiting: np.ndarray  # [steps] bool, a request was left waiting
    preemptions: int = 0
    recomputed_tokens: int = 0  # tokens computed again after a preemption (not found in the prefix cache)
    error: str | None = None

    @property
    def steps(self) -> int:
        return len(self.held)

    @property
    def waste(self) -> float:
        held = float(self.held.sum())
        return 1.0 - float(self.real.sum()) / held if held else float("nan")

    @property
    def held_over_real(self) -> float:
        """KV held relative to the ideal that holds only real tokens (1 / (1 - waste))."""
        real = float(self.real.sum())
        return float(self.held.sum()) / real if real else float("nan")

    @property
    def capacity(self) -> float | None:
        return float(self.live[self.waiting].mean()) if self.waiting.any() else None

    @property
    def peak_held(self) -> int:
        return int(self.held.max())

    def summary(self, ideal: "Run | None" = None) -> dict:
        if self.error:
            return {"label": self.label, "error": self.error}
        ideal_cap = ideal.capacity if ideal is not None else None
        cap = self.capacity
        return {
            "label": self.label,
            "waste": self.waste,
            "held_over_ideal": self.held_over_real,
            "capacity": cap,
            "capacity_over_ideal": cap / ideal_cap if cap is not None and ideal_cap else None,
            "peak_held_tokens": self.peak_held,
            "preemptions": self.preemptions,
            "recomputed_tokens": self.recomputed_tokens,
            "steps": self.steps,
        }

    @classmethod
    def failed(cls, label: str, budget_tokens: int, error: str) -> "Run":
        empty = np.zeros(0, dtype=np.int64)
        return cls(label, budget_tokens, empty, empty, empty, empty.astype(bool), error=error)


def fake_prompt(index: int, prompt_len: int) -> list[int]:
    """The token ids request ``index`` of a simulation is served with: ``prompt_len`` times ``index`` (its
    generated tokens are ``index`` too), so no two requests share a prefix block."""
    return [index] * prompt_len


@dataclass
class StepFigures:
    """One step of a simulation, in token slots, measured before its finished requests are released."""

    held: int  # blocks in use x block size
    real: int  # tokens whose K/V running requests hold
    live: int  # running requests
    waiting: bool  # a request was left waiting


class EngineSimulation:
    """The engine's scheduling of ``requests`` on a pool of ``num_blocks`` blocks, without a model.

    The engine's :class:`~hf_paged.engine.scheduler.Scheduler` decides every step (admission, chunked prefill,
    preemption, prefix hits) over a :class:`~hf_paged.engine.kv.RequestKV` on a :class:`~hf_paged.BlockPool` with
    one full-attention layer group; the pool never makes a K/V tensor. :meth:`step` stands in for the engine's step:
    the schedule's chunks take their blocks in the pool's allocator as the step planner takes them, their blocks are
    published, the scheduler records what ran, and each chunk that reaches the end of its request's tokens gives a
    fake token (:func:`fake_prompt`); a request ends with ``output_len`` tokens.

    Args:
        requests: ``(prompt_len, output_len)`` pairs, all waiting at the start, in this order.
        block_size: tokens per block.
        num_blocks: blocks in the pool; together they must hold the longest request.
        max_batch_tokens: tokens per step (decode tokens and prefill chunks together); default the engine's on CUDA.
        max_num_seqs: the most requests running at once (default ``max_batch_tokens``, as the engine's).
        watermark: share of the pool kept free when admitting while other requests run (the engine's 1%).
        prefix_caching: keep finished and preempted requests' full blocks for later (the engine's default pool
            does); here it lets a preempted request find its prompt's blocks again.
        keep_schedules: record each step's schedule in :attr:`schedules`.
        record_slots: record in :attr:`slot_request` / :attr:`slot_position` which request (index + 1) and position
            each slot last received, through the blocks the allocator handed out (:func:`block_map_snapshot`).
    """

    def __init__(self, requests: list[Request], block_size: int, num_blocks: int, *,
                 max_batch_tokens: int = CUDA_BATCH_TOKENS, max_num_seqs: int | None = None,
                 watermark: float = DEFAULT_WATERMARK, prefix_caching: bool = True, keep_schedules: bool = False,
                 record_slots: bool = False):
        longest = max(p + o for p, o in requests)
        if num_blocks * block_size < longest:
            raise ValueError(f"a pool of {num_blocks} blocks x {block_size} tokens cannot hold the longest request "
                             f"({longest} tokens); give it at least {cdiv(longest, block_size)} blocks.")
        self.pool = BlockPool(block_size, num_blocks, prefix_caching=prefix_caching)
        self.allocator = self.pool.allocator
        self.kv = RequestKV(self.pool, LayerGroups.from_windows([None]), max_batch_tokens)
        self.scheduler = Scheduler(self.kv, max_batch_tokens, max_num_seqs=max_num_seqs, watermark=watermark)
        self.requests = [EngineRequest(request_id=str(i), tokens=fake_prompt(i, p), num_prompt=p, max_new_tokens=o,
                                       max_length=p + o) for i, (p, o) in enumerate(requests)]
        for req in self.requests:
            self.scheduler.add(req)
        self.steps = 0
        self.schedules: list[list[tuple[int, int, int]]] | None = [] if keep_schedules else None
        self.slot_request = np.zeros(num_blocks * block_size, dtype=np.int64) if record_slots else None
        self.slot_position = np.zeros(num_blocks * block_size, dtype=np.int64) if record_slots else None

    @property
    def done(self) -> bool:
        return not self.scheduler.has_work

    @property
    def preemptions(self) -> int:
        return self.scheduler.counters.preemptions

    def step(self) -> StepFigures:
        """Schedule one step, run it without a model, and measure it (see the module docstring)."""
        batch = self.scheduler.schedule()
        if not batch.chunks:
            raise RuntimeError(f"the scheduler ran nothing at step {self.steps} with {len(self.scheduler.waiting)} "
                               f"requests waiting and {len(self.scheduler.running)} running.")
        if self.schedules is not None:
            self.schedules.append([(int(c.request.request_id), c.start, c.num_tokens) for c in batch.chunks])
        self._take_blocks(batch)
        self.scheduler.advance(batch)
        running = self.scheduler.running
        figures = StepFigures(self.allocator.blocks_in_use * self.allocator.block_size,
                              sum(req.num_computed for req in running), len(running), bool(self.scheduler.waiting))
        for chunk in batch.chunks:
            req = chunk.request
            if chunk.sample:
                req.append(int(req.request_id), float(self.steps))
                if req.finish_reason is not None:
                    self.scheduler.finish(req, RequestStatus.FINISHED)
        self.steps += 1
        return figures

    def _take_blocks(self, batch: Batch) -> None:
        """What the engine's step planner does to the pool for ``batch`` (one layer group, no window, no fork), then
        the runner's publishing of the written blocks."""
        a, pool = self.allocator, self.pool
        with pool.lock:
            appended = a.append([(c.request.row.seqs[0], c.num_tokens) for c in batch.chunks],
                                [c.tokens for c in batch.chunks])
        if self.slot_request is not None:
            for chunk, slots in zip(batch.chunks, appended.slots):
                self.slot_request[slots] = int(chunk.request.request_id) + 1
                self.slot_position[slots] = np.arange(chunk.start, chunk.start + chunk.num_tokens)
        self.kv.publish([c.request.row for c in batch.chunks])

    def run(self) -> list[StepFigures]:
        """Steps until every request has ended."""
        figures = []
        while not self.done:
            figures.append(self.step())
        return figures


def simulate_paged(requests: list[Request], block_size: int, budget_tokens: int, *,
                   watermark: float = DEFAULT_WATERMARK, max_batch_tokens: int = CUDA_BATCH_TOKENS,
                   prefix_caching: bool = True, label: str | None = None) -> Run:
    """Serve ``requests`` with the engine's scheduler from a pool of ``budget_tokens // block_size`` blocks."""
    label = label or f"paged bs={block_size}"
    try:
        sim = EngineSimulation(requests, block_size, budget_tokens // block_size, max_batch_tokens=max_batch_tokens,
                               watermark=watermark, prefix_caching=prefix_caching)
    except ValueError as e:
        return Run.failed(label, budget_tokens, str(e))
    figures = sim.run()
    held, real, live, waiting = (np.array([getattr(f, name) for f in figures])
                                 for name in ("held", "real", "live", "waiting"))
    return Run(label, budget_tokens, held, real, live, waiting.astype(bool), preemptions=sim.preemptions,
               recomputed_tokens=sim.scheduler.counters.recomputed_tokens)


def simulate_reservation(requests: list[Request], max_len: int, budget_tokens: int, *,
                         max_batch_tokens: int = CUDA_BATCH_TOKENS) -> Run:
    """``StaticCache``-style: every running request reserves ``max_len`` slots (a block of ``max_len`` tokens)."""
    return simulate_paged(requests, max_len, budget_tokens, watermark=0.0, max_batch_tokens=max_batch_tokens,
                          label=f"reserve {max_len}")


def simulate_padded(requests: list[Request], batch_size: int, budget_tokens: int) -> Run:
    """Static padded batches of ``batch_size`` (``DynamicCache`` in a batched ``generate()``), several at once."""
    label = f"padded B={batch_size}"
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    widths = [max(p for p, _ in b) for b in batches]
    lengths = [max(o for _, o in b) for b in batches]
    peaks = [len(b) * (w + n) for b, w, n in zip(batches, widths, lengths)]
    for k, peak in enumerate(peaks):
        if peak > budget_tokens:
            return Run.failed(label, budget_tokens,
                              f"batch {k} alone grows to {peak} slots, over the budget of {budget_tokens}")

    starts, ends, reserved, nxt, step = [], [], 0, 0, 0  # admission by events: batches end at start + length
    while nxt < len(batches):
        while nxt < len(batches) and reserved + peaks[nxt] <= budget_tokens:
            heapq.heappush(ends, (step + lengths[nxt], nxt))
            starts.append(step)
            reserved += peaks[nxt]
            nxt += 1
        if nxt < len(batches):
            step, k = heapq.heappop(ends)
            reserved -= peaks[k]
            while ends and ends[0][0] == step:
                reserved -= peaks[heapq.heappop(ends)[1]]
    total = max(s + n for s, n in zip(starts, lengths))
    held, real, live = (np.zeros(total, dtype=np.int64) for _ in range(3))
    admitted = np.zeros(total, dtype=np.int64)
    for b, start, width, length in zip(batches, starts, widths, lengths):
        t = np.arange(1, length + 1)  # [length] local step: the t-th token; the cache holds t - 1 of them
        prompt = np.array([p for p, _ in b])
        output = np.array([o for _, o in b])
        running = output[None, :] >= t[:, None]  # [length, batch]
        held[start:start + length] += len(b) * (width + t - 1)
        live[start:start + length] += running.sum(1)
        real[start:start + length] += (running * (prompt[None, :] + t[:, None] - 1)).sum(1)
        admitted[start:] += 1
    return Run(label, budget_tokens, held, real, live, admitted < len(batches))


# ------------------------------------------------------------------------------------------------ sweeps
@dataclass
class WorkloadResult:
    """Every scheme over one workload in one budget; ``paged`` and ``padded`` are keyed by block / batch size."""

    name: str
    requests: list[Request]
    budget_tokens: int
    max_len: int
    ideal: Run
    reservation: Run
    padded: dict[int, Run] = field(default_factory=dict)
    paged: dict[int, Run] = field(default_factory=dict)

    def runs(self) -> list[Run]:
        return [self.ideal, self.reservation, *self.padded.values(), *self.paged.values()]

    def summaries(self) -> list[dict]:
        return [run.summary(self.ideal) for run in self.runs()]


def simulate_workload(requests: list[Request], budget_tokens: int, *, block_sizes=(8, 16, 32, 64, 128),
                      batch_sizes=(8, 32), max_len: int = 2048, watermark: float = DEFAULT_WATERMARK,
                      max_batch_tokens: int = CUDA_BATCH_TOKENS, prefix_caching: bool = True, name: str = "workload",
                      progress: bool = False) -> WorkloadResult:
    """Run the ideal, reservation, padded and paged schemes over ``requests`` in ``budget_tokens`` KV slots
    (``watermark``, ``max_batch_tokens`` and ``prefix_caching``: the engine's settings for the paged schemes)."""
    longest = max(p + o for p, o in requests)
    if longest > max_len:
        raise ValueError(f"a request of {longest} tokens exceeds max_len={max_len}; clip lengths to the context.")
    if budget_tokens < max_len:
        raise ValueError(f"a budget of {budget_tokens} tokens holds no full-context sequence of {max_len}; raise it.")
    engine = dict(max_batch_tokens=max_batch_tokens)
    paged = dict(engine, watermark=watermark, prefix_caching=prefix_caching)
    jobs = [("ideal", lambda: simulate_paged(requests, 1, budget_tokens, label="ideal (bs=1)", **paged)),
            ("reserve", lambda: simulate_reservation(requests, max_len, budget_tokens, **engine))]
    jobs += [(("padded", b), lambda b=b: simulate_padded(requests, b, budget_tokens)) for b in batch_sizes]
    jobs += [(("paged", bs), lambda bs=bs: simulate_paged(requests, bs, budget_tokens, **paged))
             for bs in block_sizes]
    if progress:
        jobs = tqdm(jobs, desc=name, leave=False)
    out = {key: job() for key, job in jobs}
    return WorkloadResult(
        name, requests, budget_tokens, max_len, ideal=out["ideal"], reservation=out["reserve"],
        padded={b: out["padded", b] for b in batch_sizes}, paged={bs: out["paged", bs] for bs in block_sizes},
    )


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def format_table(result: WorkloadResult, shape: ModelShape | None = None) -> str:
    """A readable table of :meth:`WorkloadResult.summaries`, peak KV in bytes when ``shape`` is given."""
    lens = np.array(result.requests)
    lines = [
        f"{result.name}: {len(lens)} requests, mean prompt {lens[:, 0].mean():.1f} / output {lens[:, 1].mean():.1f} "
        f"tokens (max {lens[:, 0].max()} / {lens[:, 1].max()}), budget {result.budget_tokens:,} token slots"
        + (f" = {format_bytes(result.budget_tokens * shape.bytes_per_token)} of {shape.dtype_name} KV for "
           f"{shape.name}" if shape else ""),
        f"{'scheme':<14}{'waste':>8}{'held/ideal':>12}{'capacity':>10}{'cap/ideal':>11}{'peak KV':>11}"
        f"{'preempt':>9}{'steps':>8}",
    ]
    for s in result.summaries():
        if "error" in s:
            lines.append(f"{s['label']:<14}  does not fit: {s['error']}")
            continue
        cap = f"{s['capacity']:.1f}" if s["capacity"] is not None else "-"
        ratio = f"{s['capacity_over_ideal']:.3f}" if s["capacity_over_ideal"] is not None else "-"
        peak = format_bytes(s["peak_held_tokens"] * shape.bytes_per_token) if shape else f"{s['peak_held_tokens']}"
        lines.append(f"{s['label']:<14}{s['waste']:>8.1%}{s['held_over_ideal']:>11.2f}x{cap:>10}{ratio:>11}"
                     f"{peak:>11}{s['preemptions']:>9}{s['steps']:>8}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ one batch
@dataclass
class BatchTrace:
    """KV slots held at each step of one batched generation, per cache (index ``t``: the step that gives the
    ``t + 1``-th new token, the caches holding the prompts and ``t`` new tokens)."""

    requests: list[Request]
    block_size: int
    max_len: int
    static: np.ndarray  # [steps] StaticCache: batch x max_len, flat
    dynamic: np.ndarray  # [steps] DynamicCache: batch x (longest prompt + t), finished rows held
    paged: np.ndarray  # [steps] PagedCache: blocks in use x block_size, finished rows released
    real: np.ndarray  # [steps] tokens of rows still generating


def batch_memory_trace(requests: list[Request], block_size: int = 16, max_len: int = 2048) -> BatchTrace:
    """One ``generate()`` over ``requests`` as one batch, replayed through a real :class:`BlockAllocator`."""
    a = BlockAllocator(block_size)
    seqs = [a.new_sequence() for _ in requests]
    a.append([(s, p) for s, (p, _) in zip(seqs, requests)])
    width, steps = max(p for p, _ in requests), max(o for _, o in requests)
    paged, real = [], []
    alive = set(range(len(requests)))
    for t in range(1, steps + 1):
        if t > 1:  # step 1 runs the prompts
            a.append([(seqs[i], 1) for i in sorted(alive)])
        paged.append(a.blocks_in_use * block_size)
        real.append(sum(requests[i][0] + t - 1 for i in alive))
        for i in [i for i in alive if requests[i][1] == t]:
            a.free(seqs[i])
            alive.remove(i)
    t = np.arange(1, steps + 1)
    return BatchTrace(requests, block_size, max_len, static=np.full(steps, len(requests) * max_len),
                      dynamic=len(requests) * (width + t - 1), paged=np.array(paged), real=np.array(real))


# ------------------------------------------------------------------------------------------------ block map
@dataclass
class BlockMap:
    """A snapshot of a pool: which request owns each physical block, and each request's block table."""

    num_blocks: int
    block_size: int
    tables: dict[int, list[int]]  # request index -> physical block ids, in logical order
    lens: dict[int, int]  # request index -> tokens held
    step: int
    finished: int  # requests done by the snapshot
    slot_request: np.ndarray  # [num_blocks * block_size] request index + 1 of the token each slot received (0: none)
    slot_position: np.ndarray  # [num_blocks * block_size] that token's position in its request

    def owners(self) -> np.ndarray:
        """``[num_blocks]`` owning request index, -1 for a free block."""
        owner = np.full(self.num_blocks, -1)
        for r, table in self.tables.items():
            owner[table] = r
        return owner

    def gather(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """Request ``r``'s tokens read back through its block table: ``([len] request index + 1, [len] position)``."""
        pos = np.arange(self.lens[r])
        slots = np.array(self.tables[r])[pos // self.block_size] * self.block_size + pos % self.block_size
        return self.slot_request[slots], self.slot_position[slots]


def block_map_snapshot(requests: list[Request], block_size: int = 16, num_blocks: int = 128, step: int = 70,
                       watermark: float = DEFAULT_WATERMARK, max_batch_tokens: int = CUDA_BATCH_TOKENS) -> BlockMap:
    """Serve ``requests`` with the engine's scheduler on a pool of ``num_blocks`` for ``step`` steps and take a
    :class:`BlockMap`.

    Run long enough for some requests to finish and others to take their freed blocks, the tables are scattered.
    """
    sim = EngineSimulation(requests, block_size, num_blocks, watermark=watermark, max_batch_tokens=max_batch_tokens,
                           record_slots=True)
    for _ in range(step):
        if sim.done:
            break
        sim.step()
    a = sim.allocator
    running = sim.scheduler.running
    return BlockMap(
        num_blocks=num_blocks, block_size=block_size,
        tables={int(req.request_id): list(a.block_table(req.row.seqs[0])) for req in running},
        lens={int(req.request_id): sim.kv.length(req.row) for req in running},
        step=sim.steps, finished=sum(1 for req in sim.requests if req.status == RequestStatus.FINISHED),
        slot_request=sim.slot_request, slot_position=sim.slot_position,
    )
