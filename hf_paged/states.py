"""The state store: per-sequence fixed-size states of state layers, in state cells.

Linear-attention (Gated DeltaNet), Mamba / Mamba2 and short-convolution layers keep, per sequence, a convolution
state ``[..., kernel]`` and (most of them) a recurrent state, whatever the sequence's length. They cannot be paged:
they are rewritten whole at every token. The store keeps them in *state cells*: cell ``c`` (index ``c`` of every
state tensor's first dimension) belongs to one row (:class:`~hf_paged.rows.Row` ``state``), taken when the row is
created and given back when it is released, as a row owns its blocks. One store per :class:`~hf_paged.BlockPool`, shared by the caches (and the engine) on it.

Tensors: one per ``(layer, "conv" | "recurrent", state_idx)``, ``[capacity, *state shape]``, created at the first
write of that state with the dtype and device of what the model wrote (an fp32 recurrent state stays fp32). The
capacity grows by doubling when more cells are taken (the existing cells copied); a capped pool (``max_memory``)
counts the store's bytes against the same cap as its blocks.

A cell's contents are meaningful only after its row's first write (``has_previous_state``): a new cell may hold a
finished row's leftovers, which no reader sees (the model's prefill overwrites a state without reading it).
"""

from __future__ import annotations

import threading

import torch

class OutOfStateMemoryError(RuntimeError):
    """The state store would grow past the bytes a capped pool leaves beside its blocks."""


class StateStore:
    """State cells of per-sequence states (see the module docstring). Not thread-safe on its own: callers hold the pool's
    lock around :meth:`take` / :meth:`give_back` (the rows do)."""

    def __init__(self):
        self.capacity = 0
        self._free: list[int] = []  # cells nobody holds, ascending
        self.tensors: dict[tuple[str, int, int], torch.Tensor] = {}  # (kind, layer, state_idx) -> [capacity, ...]
        self.peak_in_use = 0
        self.limit_bytes = None  # a capped pool's callable: the bytes its max_memory leaves beside its blocks
        self._lock = threading.RLock()

    # ----------------------------------------------------------------- queries
    @property
    def in_use(self) -> int:
        """Cells some row holds."""
        return self.capacity - len(self._free)

    def bytes_per_cell(self) -> int:
        """Bytes one cell stands for: one row's states over every state tensor written so far."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values())

    def bytes_reserved(self) -> int:
        """Bytes of the state tensors as allocated now (every cell, held or not)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def bytes_in_use(self) -> int:
        return self.in_use * self.bytes_per_cell()

    def get(self, kind: str, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The ``[capacity, ...]`` tensor of a state, or None before its first write."""
        return self.tensors.get((kind, layer_idx, state_idx))

    # ------------------------------------------------------------ cells
    def take(self, count: int) -> list[int]:
        """``count`` cells, consecutive and ascending where possible (a batch's rows then read one view of each
        state tensor, with no gather); the store grows when it has too few free."""
        if count <= 0:
            return []
        with self._lock:
            run = _free_run(self._free, count)
            if run is None:
                self._grow(count)
                run = _free_run(self._free, count)
                if run is None:  # fragmented: any free cells
                    run = self._free[:count]
            taken = set(run)
            self._free = [s for s in self._free if s not in taken]
            self.peak_in_use = max(self.peak_in_use, self.in_use)
            return list(run)

    def give_back(self, cells: list[int]) -> None:
        with self._lock:
            held = set(self._free)
            for cell in cells:
                if cell in held or not 0 <= cell < self.capacity:
                    raise RuntimeError(f"state cell {cell} given back twice or never taken")
                held.add(cell)
            self._free = sorted(held)

    def copy(self, dst: list[int], src: list[int]) -> None:
        """Cells ``dst`` take the states of cells ``src`` (pairwise; a source may repeat, and may be a destination:
        every source is read before any destination is written)."""
        if not dst:
            return
        for t in self.tensors.values():
            index = torch.tensor(src, device=t.device)
            t[torch.tensor(dst, device=t.device)] = t.index_select(0, index)

    # ------------------------------------------------------------ tensors
    def ensure(self, kind: str, layer_idx: int, state_idx: int, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """The tensor of a state, created at its first write (``shape``: one cell's) with zeros."""
        key = (kind, layer_idx, state_idx)
        t = self.tensors.get(key)
        if t is None:
            per_cell = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            self._check_budget(self.bytes_reserved() + per_cell * self.capacity, f"the {kind} state of layer "
                               f"{layer_idx} ({tuple(shape)}, {dtype})")
            t = torch.zeros((self.capacity, *shape), dtype=dtype, device=device)
            self.tensors[key] = t
        elif tuple(t.shape[1:]) != tuple(shape) or t.dtype != dtype:
            raise ValueError(f"the {kind} state of layer {layer_idx} was written as {tuple(t.shape[1:])} {t.dtype} "
                             f"and now as {tuple(shape)} {dtype}: one store serves one model; use a pool per model.")
        return t

    def _grow(self, count: int) -> None:
        """Room for ``count`` more cells: double (at least 4), or under a byte cap just enough when doubling is not."""
        per_cell = self.bytes_per_cell()
        new_capacity = max(self.capacity * 2, self.capacity + count, 4)
        if self.limit_bytes is not None and per_cell * new_capacity > self.limit_bytes():
            new_capacity = self.capacity + count
        self._check_budget(per_cell * new_capacity, f"{new_capacity} state cells")
        for key, t in self.tensors.items():
            grown = torch.zeros((new_capacity, *t.shape[1:]), dtype=t.dtype, device=t.device)
            grown[: self.capacity] = t
            self.tensors[key] = grown
        self._free = sorted(self._free + list(range(self.capacity, new_capacity)))
        self.capacity = new_capacity

    def _check_budget(self, total: int, what: str) -> None:
        if self.limit_bytes is not None and total > self.limit_bytes():
            raise OutOfStateMemoryError(
                f"the state store cannot hold {what}: states would take {total:,} bytes, over what the pool's "
                f"max_memory leaves beside its blocks ({self.limit_bytes():,}). Raise max_memory or run fewer rows "
                "at once.")


def _free_run(free: list[int], count: int) -> list[int] | None:
    """The first ``count`` consecutive cells of the ascending ``free``, or None."""
    start = 0
    for i in range(1, len(free) + 1):
        if i == len(free) or free[i] != free[i - 1] + 1:
            if i - start >= count:
                return free[start: start + count]
            start = i
    return None


class StateRecord:
    """What rolling a cache's states back needs, from ``activate_past_recording()`` to the next ``crop()``: per state
    ``(layer, state_idx)``, every conv column since (held state first), and the recurrent state before each token
    since, as far back as the mixers kept them (``keep``: transformers 5.25's ``recurrent_states_to_keep``, how many
    intermediate states a multi-token forward hands back). Tensors are per row of the forwards: ``[B, ...]``.
    """

    def __init__(self, keep: int):
        self.keep = keep
        self.conv: dict[tuple[int, int], torch.Tensor] = {}  # [B, C, kernel + tokens since]
        self.recurrent: dict[tuple[int, int], list[torch.Tensor]] = {}  # [B, ...] before each token, oldest first

    def clear(self) -> None:
        self.conv.clear()
        self.recurrent.clear()

    def rolled_back(self, drop: int, kernels: dict[tuple[int, int], int]) -> dict[tuple[str, int, int], torch.Tensor]:
        """The states ``drop`` tokens back, per ``(kind, layer, state_idx)``; ``kernels``: each conv state's width."""
        out = {}
        for key, columns in self.conv.items():
            end = columns.shape[-1] - drop
            kernel = kernels[key]
            if end < 0:
                raise ValueError(f"cannot roll the conv state of layer {key[0]} back {drop} tokens: only "
                                 f"{columns.shape[-1] - kernel} were recorded since activate_past_recording().")
            window = columns[..., max(0, end - kernel): end]
            out[("conv", *key)] = torch.nn.functional.pad(window, (kernel - window.shape[-1], 0))
        for key, history in self.recurrent.items():
            if drop > len(history):
                raise ValueError(
                    f"cannot roll the recurrent state of layer {key[0]} back {drop} tokens: the mixer kept "
                    f"{len(history)} (activate_past_recording(recurrent_states_to_keep={self.keep})). Fix: pass "
                    f"recurrent_states_to_keep >= the tokens a crop() may remove.")
            out[("recurrent", *key)] = history[-drop]
        return out


class StateView:
    """transformers' linear-attention cache contract (``cache_utils.LinearAttentionLayer``: ``get_conv_state``,
    ``update_conv_state``, ``get_recurrent_state``, ``update_recurrent_state``, ``has_previous_state``) for the rows
    of one forward, on their state cells of a pool's store.

    The model is handed ``[B, ...]`` tensors it may change in place (``causal_conv1d_update`` and Mamba2's
    ``selective_state_update`` do). When the rows' cells are consecutive and ascending that is a view of the store
    (the model's changes land in the cells); otherwise a gathered copy, written back to the rows' cells by
    :meth:`sync` once the forward has run. ``None`` in ``cells``: a row that holds no cell (released; its states
    read as zeros and are dropped).

    Args:
        pool: the :class:`~hf_paged.BlockPool` whose ``states`` store holds the cells.
        cells: per row of the forward, its state cell.
        written: ``(layer, state_idx)`` whose states the rows hold from earlier forwards (what
            ``has_previous_state`` reports); updated in place by the first conv write of a state.
        state_layers: the model's state layers (``has_previous_state()`` without a layer reads the last).
        record: where the states before this forward's tokens are kept for a rollback (a recording cache), or None.
    """

    def __init__(self, pool, cells: list[int | None], written: set, state_layers, record: StateRecord | None = None):
        self.pool, self.cells, self.written, self.state_layers = pool, list(cells), written, state_layers
        self.record = record
        self._held_before = frozenset(written)  # what the rows hold from earlier forwards (a conv write in this one
        # marks its state written before the mixer reads the recurrent state: transformers 5.25's Mamba2 order)
        self._handouts: dict = {}  # (kind, layer, state_idx) -> (tensor handed out, rows gathered or None: a view)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._handout("conv", layer_idx, state_idx) if (layer_idx, state_idx) in self._held_before else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        if (layer_idx, state_idx) not in self._held_before or self.pool.states.get("recurrent", layer_idx,
                                                                                    state_idx) is None:
            return None
        return self._handout("recurrent", layer_idx, state_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None) -> torch.Tensor:
        """Keep the last ``kernel`` columns of ``[B, C, S]`` (after the held state on later forwards); returns the
        columns the causal convolution reads: the new ones, left-padded to the kernel on a first write, else the
        held state followed by the new ones."""
        kernel = conv_kernel_size if conv_kernel_size is not None else conv_states.shape[-1]
        self._tensor("conv", layer_idx, state_idx, (*conv_states.shape[1:-1], kernel), conv_states)
        held = self._handout("conv", layer_idx, state_idx)
        key = (layer_idx, state_idx)
        if key not in self.written:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
            self.written.add(key)
        else:
            before = self.record.conv.get(key, held) if self.record is not None else held
            full = torch.cat([before, conv_states], dim=-1)
        if self.record is not None:
            self.record.conv[key] = full
        held.copy_(full[..., -held.shape[-1]:])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor | list[torch.Tensor], layer_idx: int,
                               state_idx: int = 0) -> torch.Tensor:
        """Keep the last state; ``recurrent_states`` may be the states after each of the forward's last tokens
        (transformers 5.25, while recording: ``get_recurrent_states_to_keep``), oldest first."""
        history, last = [], recurrent_states
        if not isinstance(recurrent_states, torch.Tensor):
            history, last = list(recurrent_states[:-1]), recurrent_states[-1]
        self._tensor("recurrent", layer_idx, state_idx, tuple(last.shape[1:]), last)
        held = self._handout("recurrent", layer_idx, state_idx)
        if self.record is not None:
            self.record.recurrent.setdefault((layer_idx, state_idx), []).extend([held.clone(), *history])
        held.copy_(last)
        return held

    def is_recording_past(self, layer_idx: int = 0) -> bool:
        return self.record is not None

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return self.record.keep if self.record is not None else 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """A mixer updated a conv state in place (transformers 5.25's decode path): nothing to count, the cache
        counts its columns per forward."""

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        if layer_idx is None:
            layer_idx = max(self.state_layers)
        return (layer_idx, state_idx or 0) in self.written

    def _tensor(self, kind: str, layer_idx: int, state_idx: int, shape, like: torch.Tensor) -> torch.Tensor:
        store = self.pool.states
        existing = store.get(kind, layer_idx, state_idx)
        if existing is not None and tuple(existing.shape[1:]) == tuple(shape):
            return existing
        with self.pool.lock:
            t = store.ensure(kind, layer_idx, state_idx, tuple(shape), like.dtype, like.device)
            self.pool.fit_blocks_to_states()
        return t

    def _handout(self, kind: str, layer_idx: int, state_idx: int) -> torch.Tensor:
        key = (kind, layer_idx, state_idx)
        held = self._handouts.get(key)
        if held is not None:
            return held[0]
        t = self.pool.states.get(kind, layer_idx, state_idx)
        cells = self.cells
        first = cells[0] if cells else None
        if first is not None and cells == list(range(first, first + len(cells))):
            out, live = t[first: first + len(cells)], None
        else:
            live = [i for i, c in enumerate(cells) if c is not None]
            out = t.new_zeros((len(cells), *t.shape[1:]))
            if live:
                out[live] = t[[cells[i] for i in live]]
        self._handouts[key] = (out, live)
        return out

    def sync(self, cells: list[int | None] | None = None) -> None:
        """Write the gathered states back to the rows' cells (``cells``: the rows' cells now, when some were released
        since: those rows are left out) and forget every handout."""
        handouts, self._handouts = self._handouts, {}
        cells = self.cells if cells is None else cells
        for (kind, layer_idx, state_idx), (out, live) in handouts.items():
            if live is None:
                continue
            keep = [i for i in live if i < len(cells) and cells[i] is not None]
            if keep:
                t = self.pool.states.get(kind, layer_idx, state_idx)
                t[[cells[i] for i in keep]] = out[keep]
