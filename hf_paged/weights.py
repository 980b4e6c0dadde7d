"""Which weights a model holds now: a fingerprint of their values, for keying K/V by the weights that made it.

A prefix cache's promise is that a hit returns the K/V the request would have computed, so every block key's chain
root names the weights (and adapters) that made it (``allocator.chain_root``). The *weights fingerprint* of a model
is a 16-byte digest of its parameters' and buffers' **values** (with their shapes and dtypes, the model's class and
PEFT's adapter switches): two models holding the same values share K/V on one pool, in one process or, through a
saved prompt cache, in the next; a value written any way gives another fingerprint.

How a value change is seen, per check (:meth:`WeightsFingerprint.root`):

* **Sample** (every check): each tensor's bits, read as integers, at ``SAMPLE_PER_TENSOR`` (64) elements spread
  evenly over it — one stride through its flat elements, coprime with its row length, so the elements fall in
  distinct rows and distinct columns where the tensor has that many — gathered in one copy per device and dtype
  (numpy on the host, then blake2b of the bytes; ``torch.cat`` on an accelerator, folded there into one
  position-weighted 64-bit sum). A write that changes a share ``f`` of a tensor's values — an optimizer step,
  ``p.data.copy_`` of new weights, a LoRA merge — leaves all 64 sampled elements of that tensor unchanged with odds
  of at most ``(1 - f) ** 64`` (about 10^-3 at ``f = 0.1``), and of every tensor it touched together far less. The
  sample reads a fixed number of elements however large the model (17,500 for SmolLM2, 9,500 for a 1B Llama): a
  sample of every row instead costs one memory access per row, several percent of a decode step on a CPU.
* **Full checksum** (the coarser cadence): every element's bits summed per row (32-bit wrapping sums), rows weighted
  by position, at each *walk* of the modules (each ``generate()`` call on a prefix-caching pool, each engine session
  start) and whenever a version counter or a storage address moved since the last check. So a write that moves a
  version counter (``p.add_`` under no_grad, ``load_state_dict``, optimizer steps, ``p[i, j] = x``) is seen exactly
  at the next check, and any write at all is seen at the next walk; only a write that bumps no counter, changes no
  sampled element and happens inside one engine session (a sparse ``.data`` write mid-session, such as
  ``p.data[i] = x`` for a few rows) waits for the next walk.
* **Fast path**: torch's version counters and storage addresses (about 0.1-0.2 µs per tensor, no data read) decide
  whether the full checksum is recomputed; the digest decides the key. ``p.data`` is a separate tensor with its own
  version counter, so ``p.data.copy_`` / ``p.data += d`` (PEFT's ``merge_adapter``, bitsandbytes' 8-bit optimizers,
  weight syncs in RL code) move no counter of ``p``: the sample sees them. Fused optimizer steps (``AdamW(fused=True)``)
  are made to bump the counters by a post-step hook (registered once, by the first fingerprint).

Not distinguished (collisions): two value sets with equal digests (blake2b for a host sample; about ``2**-64`` for a
device sample's sum and ``2**-32`` per row for the full checksum, for unrelated writes), and values permuted within
one row that move no sampled element.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import math
import struct

import numpy
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

_fused_hook = None  # the handle of the hook below, once registered
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ROW = 1024  # a 1-D tensor is checksummed as rows of this many elements
SAMPLE_PER_TENSOR = 64  # elements of each tensor read at every check
_MIX = 0x5851F42D4C957F2D  # weights of positions: a multiplicative hash of the index, made odd (a changed value shows)


def model_tensors(model: nn.Module) -> list:
    """Every parameter and buffer of ``model``, in module order (a walk of the module tree: the costly part); a
    tensor-parallel (DTensor) one as this rank's shard, the values this rank computes with."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in itertools.chain(model.parameters(), model.buffers())]


def weights_version(tensors) -> tuple:
    """``(storage address, version counter)`` of each tensor (from :func:`model_tensors`)."""
    out = []
    for t in tensors:
        try:
            version = t._version
        except RuntimeError:  # an inference tensor: no version counter
            version = -1
        out.append((t.data_ptr(), version))
    return tuple(out)


def _bump_after_fused_step(optimizer, args, kwargs) -> None:
    """After a fused optimizer step, bump its parameters' version counters as an unfused step would have."""
    if any(group.get("fused") for group in optimizer.param_groups):
        torch.autograd.graph.increment_version([p for group in optimizer.param_groups for p in group["params"]])


def watch_fused_steps() -> None:
    """Register :func:`_bump_after_fused_step` on every optimizer of the process, once."""
    global _fused_hook
    if _fused_hook is None:
        _fused_hook = register_optimizer_step_post_hook(_bump_after_fused_step)


def peft_switches(model: nn.Module) -> tuple:
    """What PEFT's layers of ``model`` apply besides their weights: each distinct (active adapters, disabled, merged
    adapters) of its tuner layers (``set_adapter``, ``disable_adapter()``, ``merge_adapter``); ``()`` for a model
    without PEFT layers."""
    return tuple(sorted({_switches(m) for m in model.modules() if _is_peft_layer(m)}))


def _is_peft_layer(module) -> bool:
    return hasattr(module, "active_adapters") and hasattr(module, "disable_adapters") and hasattr(module,
                                                                                                 "merged_adapters")


def _switches(layer) -> tuple:
    active = layer.active_adapters
    return (tuple(active) if isinstance(active, (list, tuple)) else (str(active),), bool(layer.disable_adapters),
            tuple(layer.merged_adapters))


def _rows_columns(t: torch.Tensor) -> tuple[int, int]:
    """The ``[rows, columns]`` a tensor is sampled as."""
    n = t.numel()
    if t.dim() >= 2 and t.shape[0] > 1:
        return t.shape[0], n // t.shape[0]
    return math.ceil(n / _ROW), min(n, _ROW)


def sample_stride(numel: int, columns: int, count: int = SAMPLE_PER_TENSOR) -> int:
    """The stride over a tensor's ``numel`` flat elements (rows of ``columns``) whose walk from 0 reads about
    ``count`` elements spread over the whole tensor: ``numel // count``, moved to the nearest value coprime with
    ``columns`` (so the walk's elements fall in distinct columns) on the side that keeps its relation to the row
    length: at least a row (distinct rows) or at most one (every row)."""
    d = max(1, numel // max(1, count))
    step = 1 if d >= columns else -1
    while d > 1 and math.gcd(d, columns) != 1:
        d += step
    return d


def _int_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s bits as a same-width integer tensor (a view; None for element sizes without one)."""
    t = t.detach()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    kind = _INT_OF_SIZE.get(t.element_size())
    if kind is None or t.is_complex():
        return None
    return t if t.dtype == kind else t.view(kind)


def _positions(n: int, device) -> torch.Tensor:
    """``[n]`` int64 odd weights of positions ``0..n-1`` (a multiplicative hash, wrapping)."""
    return (torch.arange(n, dtype=torch.int64, device=device) * _MIX) | 1


class _HostGather:
    """The sampled bytes of host tensors, read in one numpy gather: each sampled element's address is fixed while its
    tensor keeps its storage (the plan is rebuilt when a storage address moves, and holds the views, so no sampled
    storage is freed under it), so the bytes are indexed straight out of the address range the tensors span —
    one call for every tensor, where a copy per tensor costs about a microsecond each."""

    def __init__(self, views: list[torch.Tensor]):
        self.views = views  # [n] strided integer views: held, so their storages stay where the addresses point
        addresses = [v.data_ptr() + numpy.arange(v.numel(), dtype=numpy.int64) * (v.stride(0) * v.element_size())
                     for v in views]
        sizes = [numpy.full(v.numel(), v.element_size(), dtype=numpy.int64) for v in views]
        first, size = numpy.concatenate(addresses), numpy.concatenate(sizes)
        low = int(first.min())
        span = int((first + size).max()) - low
        # every byte of every sampled element, as offsets from ``low``
        self.offsets = numpy.repeat(first - low, size) + _ranks_within(size)
        self.memory = numpy.frombuffer((ctypes.c_uint8 * span).from_address(low), dtype=numpy.uint8)

    def bytes(self) -> bytes:
        return self.memory[self.offsets].tobytes()


def _ranks_within(sizes: numpy.ndarray) -> numpy.ndarray:
    """``0..s-1`` for each ``s`` of ``sizes``, back to back."""
    ends = numpy.cumsum(sizes)
    return numpy.arange(int(ends[-1]), dtype=numpy.int64) - numpy.repeat(ends - sizes, sizes)


class _Plan:
    """The sample of one walk's tensors: their strided views. Host tensors are read by one gather of bytes
    (:class:`_HostGather`), then blake2b; an accelerator's are gathered by one ``torch.cat`` per dtype and folded on
    the device into a position-weighted 64-bit sum (one copy to the host per device)."""

    def __init__(self, tensors: list[torch.Tensor]):
        host: list[torch.Tensor] = []
        groups: dict[tuple, list[torch.Tensor]] = {}  # an accelerator's views by (device, dtype)
        self.odd: list[torch.Tensor] = []  # tensors with no integer view or no plain layout: checked whole each time
        for t in tensors:
            if t.numel() == 0 or t.device.type == "meta":
                continue
            u = _int_view(t)
            if u is None or not t.is_contiguous():
                self.odd.append(t)
                continue
            d = sample_stride(u.numel(), _rows_columns(u)[1])
            n = (u.numel() - 1) // d + 1
            view = u.as_strided((n,), (d,), u.storage_offset())  # [n]
            if u.device.type == "cpu":
                host.append(view)
            else:
                groups.setdefault((u.device, u.dtype), []).append(view)
        self.host = _HostGather(host) if host else None
        self.device = list(groups.values())
        self.weights = [_positions(sum(v.numel() for v in views), views[0].device) for views in self.device]
        self.elements = sum(v.numel() for v in host) + sum(v.numel() for views in self.device for v in views)

    def digest(self) -> bytes:
        """A digest of every sampled element's bits (and the full checksum of the odd tensors)."""
        h = hashlib.blake2b(digest_size=16)
        if self.host is not None:
            h.update(self.host.bytes())
        sums = [(torch.cat(views).to(torch.int64) * w).sum() for views, w in zip(self.device, self.weights)]
        by_device: dict = {}
        for s in sums:  # one copy to the host per device
            by_device.setdefault(s.device, []).append(s)
        for group in by_device.values():
            values = torch.stack(group).tolist()
            h.update(struct.pack(f"<{len(values)}Q", *(v & 0xFFFFFFFFFFFFFFFF for v in values)))
        odd = [full_checksum(t) & 0xFFFFFFFFFFFFFFFF for t in self.odd]
        h.update(struct.pack(f"<{len(odd)}Q", *odd))
        return h.digest()


def full_checksum(t: torch.Tensor) -> int:
    """Every element's bits of ``t``: 32-bit wrapping sums per row, rows weighted by position (an int)."""
    if t.numel() == 0 or t.device.type == "meta":
        return 0
    u = _int_view(t)
    if u is None:  # complex or odd-sized elements: their bytes
        u = t.detach().contiguous().view(-1).view(torch.uint8)
    u = u.contiguous()
    rows, columns = _rows_columns(u)
    flat = u.reshape(-1)
    if flat.numel() != rows * columns:  # a ragged last row (1-D tensors): pad it with zeros
        flat = torch.nn.functional.pad(flat, (0, rows * columns - flat.numel()))
    if u.element_size() < 4 and (columns * u.element_size()) % 4 == 0:  # whole 32-bit words: read as int32
        flat = flat.view(torch.int32)
        columns = columns * u.element_size() // 4
    row_sums = flat.view(rows, columns).sum(1, dtype=torch.int32 if flat.dtype == torch.int32 else torch.int64)
    return int((row_sums.to(torch.int64) * _positions(rows, row_sums.device)).sum())


class WeightsFingerprint:
    """The weights fingerprint of one model, kept up to date cheaply (see the module docstring).

    Example::

        fp = WeightsFingerprint()
        before = fp.root(model)
        with torch.no_grad():
            model.lm_head.weight.data.mul_(2)   # bumps no version counter of the parameter
        fp.root(model, rewalk=False) != before  # True: the sample saw it
    """

    def __init__(self):
        watch_fused_steps()
        self._tensors: list = []
        self._peft_layers: list = []
        self._layout: list | None = None  # (storage address, shape, dtype) of each tensor at the last check
        self._versions: list | None = None  # and its version counter
        self._plan: _Plan | None = None
        self._full: bytes = b""  # the digest of the last full checksum
        self._structure: bytes = b""
        self.last_root: bytes | None = None
        self.full_checks = 0  # full checksums computed so far (for tests and the bench)

    def root(self, model: nn.Module, rewalk: bool = True) -> bytes:
        """The fingerprint of ``model``'s weights now (16 bytes). ``rewalk=True`` walks the modules again (finding
        replaced tensors) and recomputes the full checksum; ``rewalk=False`` reads the tensors the last walk found
        (replaced tensors are seen at the next walk) and recomputes the full checksum only when a version counter or
        storage address moved."""
        walked = rewalk or self._plan is None
        if walked:
            self._tensors = model_tensors(model)
            self._peft_layers = [m for m in model.modules() if _is_peft_layer(m)]
        tensors = self._tensors
        layout = [(t.data_ptr(), t.shape, t.dtype) for t in tensors]
        try:
            versions = [t._version for t in tensors]
        except RuntimeError:  # an inference tensor among them (no version counter): -1 for those
            versions = [version for _, version in weights_version(tensors)]
        with torch.no_grad():
            if layout != self._layout or self._plan is None:
                self._plan = _Plan(tensors)
                h = hashlib.blake2b(type(model).__name__.encode(), digest_size=16)
                for _, shape, dtype in layout:
                    h.update(f"{tuple(shape)}{dtype};".encode())
                self._structure = h.digest()
            if walked or layout != self._layout or versions != self._versions:
                self._full = self._full_digest(tensors)
            sample = self._plan.digest()
        self._layout, self._versions = layout, versions
        h = hashlib.blake2b(self._structure, digest_size=16)
        h.update(self._full)
        h.update(sample)
        h.update(repr(sorted({_switches(m) for m in self._peft_layers})).encode())
        self.last_root = h.digest()
        return self.last_root

    def _full_digest(self, tensors) -> bytes:
        self.full_checks += 1
        sums = [full_checksum(t) & 0xFFFFFFFFFFFFFFFF for t in tensors]
        return hashlib.blake2b(struct.pack(f"<{len(sums)}Q", *sums), digest_size=16).digest()

    @property
    def sampled_elements(self) -> int:
        """Elements the per-check sample reads (after a first :meth:`root`)."""
        return self._plan.elements if self._plan is not None else 0


class WeightsWatch:
    """Remembers the weights fingerprint of the model it last saw.

    Example::

        watch = WeightsWatch()
        watch.changed(model)     # False: first sight
        optimizer.step()
        watch.changed(model)     # True: parameters changed since
    """

    def __init__(self):
        self._fingerprint = WeightsFingerprint()
        self._model_id: int | None = None
        self._root: bytes | None = None

    def changed(self, model: nn.Module, rewalk: bool = True) -> bool:
        """Whether ``model`` (or another model) holds other weights than at the last call; the first call is False.
        ``rewalk=False`` reads the tensors found by the last walk of the same model (misses a parameter replaced by
        another object, e.g. ``load_state_dict(assign=True)``, until the next walk)."""
        same_model = id(model) == self._model_id
        if not same_model:
            self._fingerprint = WeightsFingerprint()
        root = self._fingerprint.root(model, rewalk or not same_model)
        changed = self._root is not None and root != self._root
        self._model_id, self._root = id(model), root
        return changed
