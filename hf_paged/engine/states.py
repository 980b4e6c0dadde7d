"""State layers in the engine's packed forward.

The engine runs a step as one packed row of every request's new tokens (``runner.py``). Attention layers read each
request's history through the block tables; a state layer's mixer (Gated DeltaNet, Mamba2, short convolution) would
instead run its convolution and recurrence straight across the packed tokens, one request's into the next. So each
state layer's mixer is wrapped (:func:`install`): in a packed forward it runs once per group of requests with the
same number of new tokens and the same start (first chunk or not), on a ``[R, n, hidden]`` batch of their tokens,
with the requests' own states (:class:`~hf_paged.states.StateView` on their state cells): a decode step's requests
form one group, a chunk of prefill its own. Outside a packed forward (``generate()`` with a ``PagedCache``) the mixer
runs as transformers wrote it.

Each request's row holds a state cell from its admission to its end or preemption (``rows.py``); a request that
continues (a later prefill chunk, a decode step) reads the states its earlier chunks left; a first chunk (also after a
preemption, which recomputes) starts from none.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..patches import state_mixers
from ..rows import Row
from ..states import OutOfStateMemoryError, StateView

_WRAPPED = "_hf_paged_state_mixer"


@dataclass(frozen=True)
class Segment:
    """One request's new tokens in a packed forward."""

    row: Row
    offset: int  # its first token's column in the packed row
    num_tokens: int
    continues: bool  # it holds states from earlier forwards (not its first chunk)


def segments(chunks) -> list[Segment]:
    """The packed forward's segments, in the order ``runner.pack`` lays out the chunks."""
    out, offset = [], 0
    for chunk in chunks:
        out.append(Segment(chunk.request.row, offset, chunk.num_tokens, chunk.start > 0))
        offset += chunk.num_tokens
    return out


class PackedStates:
    """What a packed forward's state mixers read: its segments and the pool holding the rows' state cells."""

    def __init__(self, pool, segments: list[Segment], state_layers):
        self.pool, self.segments, self.state_layers = pool, segments, frozenset(state_layers)


class _GroupCache:
    """The cache a mixer is handed for one group of requests: the state contract of their state cells."""

    def __init__(self, view: StateView):
        self.view = view
        self.get_conv_state, self.get_recurrent_state = view.get_conv_state, view.get_recurrent_state
        self.update_recurrent_state, self.has_previous_state = view.update_recurrent_state, view.has_previous_state
        # transformers 5.25's mixers also ask these (a group's view never records: the engine does not roll back)
        self.get_recurrent_states_to_keep, self.increase_count = view.get_recurrent_states_to_keep, view.increase_count

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, conv_kernel_size=None, **kwargs):
        return self.view.update_conv_state(conv_states, layer_idx, state_idx, conv_kernel_size)

    def is_recording_past(self, layer_idx: int = 0) -> bool:
        return self.view.is_recording_past(layer_idx)


def install(model) -> None:
    """Wrap every state layer's mixer of ``model`` (once) so a packed forward runs it per group of requests."""
    for mixer in state_mixers(model).values():
        if getattr(mixer, _WRAPPED, False):
            continue
        mixer.forward = _per_group(mixer.forward)
        setattr(mixer, _WRAPPED, True)


def _per_group(forward):
    def wrapped(hidden_states, cache=None, attention_mask=None, **kwargs):
        packed = getattr(cache, "packed_states", None)
        if packed is None:
            return forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        return run_groups(forward, hidden_states, packed)

    return wrapped


def run_groups(forward, hidden_states: torch.Tensor, packed: PackedStates) -> torch.Tensor:
    """``forward`` over ``hidden_states [1, T, H]`` one group of segments at a time; columns of no segment (the
    runner's padding) come out as zeros."""
    groups: dict[tuple[int, bool], list[Segment]] = {}
    for seg in packed.segments:
        groups.setdefault((seg.num_tokens, seg.continues), []).append(seg)
    out = None
    for (n, continues), segs in groups.items():
        x = torch.stack([hidden_states[0, s.offset: s.offset + n] for s in segs])  # [R, n, H]
        written = {(layer, 0) for layer in packed.state_layers} if continues else set()
        view = StateView(packed.pool, [s.row.state for s in segs], written, packed.state_layers)
        y = forward(x, cache=_GroupCache(view), attention_mask=None)
        view.sync()
        if out is None:
            out = hidden_states.new_zeros((*hidden_states.shape[:2], *y.shape[2:]), dtype=y.dtype)
        for i, s in enumerate(segs):
            out[0, s.offset: s.offset + n] = y[i]
    return out


class StateCheckpoints:
    """Prefix caching for hybrid models: the states of a token prefix ending at a block boundary, kept in state cells of
    the store and keyed by that prefix's last block key (the allocator's chained hash of every token before it).

    A state is a function of the prefix's tokens alone, so a checkpoint never goes stale: a request whose prompt starts
    with cached K/V blocks restores the checkpoint of the longest of those prefixes that has one and computes only the
    rest. At most ``max_entries`` are kept (least recently used first out); their state cells count in the store's
    figures.
    """

    def __init__(self, pool, max_entries: int):
        self.pool, self.max_entries = pool, max_entries
        self.cells: OrderedDict[bytes, int] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.cells

    def __len__(self) -> int:
        return len(self.cells)

    def save(self, key: bytes, cell: int) -> None:
        """Keep a copy of ``cell``'s states as the checkpoint of ``key`` (no-op if kept already or no room)."""
        if key in self.cells:
            self.cells.move_to_end(key)
            return
        try:
            (held,) = self.pool.take_state_cells(1)
        except OutOfStateMemoryError:
            return
        self.pool.states.copy([held], [cell])
        self.cells[key] = held
        while len(self.cells) > self.max_entries:
            _, old = self.cells.popitem(last=False)
            self.pool.give_back_state_cells([old])

    def restore(self, key: bytes, cell: int) -> None:
        """``cell`` takes the states of the checkpoint ``key``."""
        self.cells.move_to_end(key)
        self.pool.states.copy([cell], [self.cells[key]])

    def evict(self, keep: bytes | None = None) -> None:
        """Give back the least recently used checkpoint (not ``keep``, the one about to be restored)."""
        for key in self.cells:
            if key != keep:
                self.pool.give_back_state_cells([self.cells.pop(key)])
                return
        raise OutOfStateMemoryError("no state checkpoint to give up")

    def clear(self) -> None:
        cells, self.cells = list(self.cells.values()), OrderedDict()
        self.pool.give_back_state_cells(cells)
