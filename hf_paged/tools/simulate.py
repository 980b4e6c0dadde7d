"""Memory at scale, by simulation: replay a workload through the real :class:`BlockAllocator` and compare KV schemes.

No model runs here; sequences grow one token per step and only KV bookkeeping is simulated. Three ways to hold the
KV of the same requests in one fixed budget of token slots:

* **reservation** (``StaticCache``-style): each running sequence owns ``max_len`` slots. A slot is refilled as soon as
  its request finishes (Orca-"max" style), the kindest case for reservation. It is simulated as a paged pool whose
  block size is ``max_len``: one block per sequence.
* **padded** (``DynamicCache`` in a batched ``generate()``): requests run in static batches of ``batch_size``; every
  row is left-padded to the batch's longest prompt and grows by one column per step until the batch's longest output
  ends, so finished rows stay held. A batch is admitted when the final size of every running batch, its own
  included, fits the budget (an oracle that knows output lengths: the kindest case for padding).
* **paged** (``PagedCache``): continuous batching over a :class:`BlockAllocator` of ``budget // block_size`` blocks.
  A waiting request is admitted first-come-first-served when its prompt (plus one token) fits and a watermark of
  free blocks is left (1% of the pool, like vLLM's). When a step runs out of blocks, the newest sequence is preempted
  (freed and re-queued at the front, recomputed on return). Finished sequences free their blocks at once.

Conventions: a sequence admitted with prompt ``p`` holds ``p + g`` tokens after its ``g``-th step and finishes after
step ``output_len``; each step is measured after its appends and before finished sequences are released.

* **held**: slots set aside for running work: blocks in use x block size (paged, reservation), batch rows x columns
  (padded, finished rows included).
* **real**: tokens of sequences still generating. Everything held and not real is waste.
* **waste** = ``1 - sum_t real(t) / sum_t held(t)``: the time-averaged unused fraction of held KV.
* **capacity**: mean number of running sequences over the steps where a request was left waiting (the budget, not
  the workload, limited the batch); ``None`` when the budget never bound. The *ideal* is the paged scheduler at
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
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..allocator import BlockAllocator, cdiv
from ..errors import OutOfBlocksError

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
        from ..patches import kv_shape

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
    real: np.ndarray  # [steps] tokens of running sequences
    live: np.ndarray  # [steps] running sequences
    waiting: np.ndarray  # [steps] bool, a request was left waiting
    preemptions: int = 0
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
            "steps": self.steps,
        }

    @classmethod
    def failed(cls, label: str, budget_tokens: int, error: str) -> "Run":
        empty = np.zeros(0, dtype=np.int64)
        return cls(label, budget_tokens, empty, empty, empty, empty.astype(bool), error=error)


class PagedScheduler:
    """Continuous batching over a real :class:`BlockAllocator` (see the module docstring for the policy).

    Args:
        requests: ``(prompt_len, output_len)`` pairs, served first come first served.
        block_size: tokens per block.
        num_blocks: blocks in the pool; together they must hold the longest request.
        watermark: fraction of the pool kept free when admitting while other sequences run.
        store_kv: also keep a real :class:`BlockPool` (one layer, one head, ``head_dim`` 1) and write every token into
            it: K holds ``request index + 1``, V the token's position. ``self.pool`` is then set.
    """

    def __init__(self, requests: list[Request], block_size: int, num_blocks: int, *, watermark: float = 0.01,
                 store_kv: bool = False):
        longest = max(p + o for p, o in requests)
        if num_blocks * block_size < longest:
            raise ValueError(f"a pool of {num_blocks} blocks x {block_size} tokens cannot hold the longest request "
                             f"({longest} tokens); give it at least {cdiv(longest, block_size)} blocks.")
        self.pool = None
        if store_kv:
            import torch

            from ..pool import BlockPool

            self.pool = BlockPool(block_size, num_blocks)
            self.pool.bind_layer(0, 1, torch.zeros(1, 1, 1, 1))
            self.allocator = self.pool.allocator
        else:
            self.allocator = BlockAllocator(block_size, num_blocks)
        self.requests = requests
        self.keep_free = int(watermark * num_blocks)
        self.queue: deque[int] = deque(range(len(requests)))
        self.running: list[int] = []  # request indices, in admission order
        self.seq_of: dict[int, int] = {}  # request index -> allocator sequence
        self.generated = [0] * len(requests)
        self.real_tokens = 0
        self.preemptions = 0
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.queue and not self.running

    def step(self) -> tuple[int, int, int, bool]:
        """Admit, grow each running sequence by a token, release finished ones. Returns (held, real, live, waiting)."""
        a, bs = self.allocator, self.allocator.block_size
        while self.queue:
            r = self.queue[0]
            n = self.requests[r][0] + self.generated[r]  # prefill (a preempted request recomputes what it generated)
            spare = a.num_free - (self.keep_free if self.running else 0)
            if cdiv(n + 1, bs) > spare:
                break
            self.queue.popleft()
            self.seq_of[r] = seq = a.new_sequence()
            self._store(a.append([(seq, n)]), [r])
            self.running.append(r)
            self.real_tokens += n
        while True:
            try:
                plan = a.append([(self.seq_of[r], 1) for r in self.running])
                break
            except OutOfBlocksError:
                self._preempt(self.running.pop())
        self._store(plan, self.running)
        self.real_tokens += len(self.running)
        record = (a.blocks_in_use * bs, self.real_tokens, len(self.running), bool(self.queue))
        still = []
        for r in self.running:
            self.generated[r] += 1
            if self.generated[r] == self.requests[r][1]:
                a.free(self.seq_of.pop(r))
                self.real_tokens -= self.requests[r][0] + self.generated[r]
            else:
                still.append(r)
        self.running = still
        self.steps += 1
        return record

    def _preempt(self, r: int) -> None:
        self.allocator.free(self.seq_of.pop(r))
        self.real_tokens -= self.requests[r][0] + self.generated[r]
        self.queue.appendleft(r)
        self.preemptions += 1

    def _store(self, plan, reqs: list[int]) -> None:
        if self.pool is None:
            return
        import torch

        from .. import ops

        slots, owners, positions = [], [], []
        for r, row in zip(reqs, plan.slots):
            length = self.allocator.seq_len(self.seq_of[r])
            slots += row
            owners += [r + 1] * len(row)
            positions += range(length - len(row), length)
        if not slots:
            return
        k = torch.tensor(owners, dtype=torch.float32).view(-1, 1, 1)  # [num_tokens, 1, 1]
        v = torch.tensor(positions, dtype=torch.float32).view(-1, 1, 1)
        key_cache, value_cache = self.pool.layer_kv(0)  # [num_blocks, block_size, 1, 1]
        ops.write_kv(k, v, key_cache, value_cache, torch.tensor(slots, dtype=torch.long), backend="torch")


def simulate_paged(requests: list[Request], block_size: int, budget_tokens: int, *, watermark: float = 0.01,
                   label: str | None = None) -> Run:
    """Serve ``requests`` with continuous batching from a pool of ``budget_tokens // block_size`` blocks."""
    label = label or f"paged bs={block_size}"
    try:
        sched = PagedScheduler(requests, block_size, budget_tokens // block_size, watermark=watermark)
    except ValueError as e:
        return Run.failed(label, budget_tokens, str(e))
    records = []
    while not sched.done:
        records.append(sched.step())
    held, real, live, waiting = (np.array(col) for col in zip(*records))
    return Run(label, budget_tokens, held, real, live, waiting.astype(bool), preemptions=sched.preemptions)


def simulate_reservation(requests: list[Request], max_len: int, budget_tokens: int) -> Run:
    """``StaticCache``-style: every running sequence reserves ``max_len`` slots (a block of ``max_len`` tokens)."""
    return simulate_paged(requests, max_len, budget_tokens, watermark=0.0, label=f"reserve {max_len}")


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
        t = np.arange(1, length + 1)  # [length] local step
        prompt = np.array([p for p, _ in b])
        output = np.array([o for _, o in b])
        running = output[None, :] >= t[:, None]  # [length, rows]
        held[start:start + length] += len(b) * (width + t)
        live[start:start + length] += running.sum(1)
        real[start:start + length] += (running * (prompt[None, :] + t[:, None])).sum(1)
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
                      batch_sizes=(8, 32), max_len: int = 2048, watermark: float = 0.01, name: str = "workload",
                      progress: bool = False) -> WorkloadResult:
    """Run the ideal, reservation, padded and paged schemes over ``requests`` in ``budget_tokens`` KV slots."""
    longest = max(p + o for p, o in requests)
    if longest > max_len:
        raise ValueError(f"a request of {longest} tokens exceeds max_len={max_len}; clip lengths to the context.")
    if budget_tokens < max_len:
        raise ValueError(f"a budget of {budget_tokens} tokens holds no full-context sequence of {max_len}; raise it.")
    jobs = [("ideal", lambda: simulate_paged(requests, 1, budget_tokens, watermark=watermark, label="ideal (bs=1)")),
            ("reserve", lambda: simulate_reservation(requests, max_len, budget_tokens))]
    jobs += [(("padded", b), lambda b=b: simulate_padded(requests, b, budget_tokens)) for b in batch_sizes]
    jobs += [(("paged", bs), lambda bs=bs: simulate_paged(requests, bs, budget_tokens, watermark=watermark))
             for bs in block_sizes]
    if progress:
        from tqdm.auto import tqdm

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
    """KV slots held at each step of one batched generation, per cache (index ``t``: after ``t + 1`` new tokens)."""

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
        a.append([(seqs[i], 1) for i in sorted(alive)])
        paged.append(a.blocks_in_use * block_size)
        real.append(sum(requests[i][0] + t for i in alive))
        for i in [i for i in alive if requests[i][1] == t]:
            a.free(seqs[i])
            alive.remove(i)
    t = np.arange(1, steps + 1)
    return BatchTrace(requests, block_size, max_len, static=np.full(steps, len(requests) * max_len),
                      dynamic=len(requests) * (width + t), paged=np.array(paged), real=np.array(real))


# ------------------------------------------------------------------------------------------------ block map
@dataclass
class BlockMap:
    """A snapshot of a pool: which sequence owns each physical block, and each sequence's block table."""

    num_blocks: int
    block_size: int
    tables: dict[int, list[int]]  # request index -> physical block ids, in logical order
    lens: dict[int, int]  # request index -> tokens held
    step: int
    finished: int  # requests done by the snapshot
    key_cache: object = None  # [num_blocks, block_size, 1, 1] tensor: request index + 1 of the token in each slot
    value_cache: object = None  # [num_blocks, block_size, 1, 1] tensor: that token's position

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
        return (self.key_cache.view(-1)[slots].numpy(), self.value_cache.view(-1)[slots].numpy())


def block_map_snapshot(requests: list[Request], block_size: int = 16, num_blocks: int = 128, step: int = 70,
                       watermark: float = 0.01) -> BlockMap:
    """Serve ``requests`` from a small real :class:`BlockPool` for ``step`` steps and take a :class:`BlockMap`.

    Run long enough for some sequences to finish and others to take their freed blocks, the tables are scattered.
    """
    sched = PagedScheduler(requests, block_size, num_blocks, watermark=watermark, store_kv=True)
    for _ in range(step):
        if sched.done:
            break
        sched.step()
    a = sched.allocator
    key_cache, value_cache = sched.pool.layer_kv(0)
    return BlockMap(
        num_blocks=num_blocks, block_size=block_size,
        tables={r: list(a.block_table(s)) for r, s in sched.seq_of.items()},
        lens={r: a.seq_len(s) for r, s in sched.seq_of.items()},
        step=sched.steps, finished=sum(1 for r, g in enumerate(sched.generated) if g == requests[r][1]),
        key_cache=key_cache, value_cache=value_cache,
    )
