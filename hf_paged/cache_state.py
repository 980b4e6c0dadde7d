"""The state a :class:`~hf_paged.PagedCache` keeps besides its rows, one object per lifetime.

* :class:`Contents`: what the cache holds, from its construction or ``reset()`` to the next ``reset()`` (how its
  rows were filled, the padded-column count ``generate()`` reads, what transformers asked of it).
* :class:`GenerateCall`: one ``generate()`` call, from the start of the call to its end: what the call decided and
  what it has done so far. Set by the ``generate()`` wrapper (``attention.py``) through ``PagedCache.begin_call``.
* :class:`Forward`: the last planned forward, from its plan to the next plan or a change to the rows: its step (what
  ``update()`` and the attention read) and the columns it consumes, counted once it has run.

Only ``PagedCache`` changes these objects; other modules read them through its properties.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .states import StateRecord
from .step import Step


@dataclass
class Contents:
    """What a ``PagedCache`` holds between resets (``reset()`` starts a new one)."""

    mode: str | None = None  # "paged" (the attention reads the pool) or "gathered" (no enable_paged_attention: the
    # history is gathered for the model's own attention and padding is stored); None while nothing was written
    columns: int = 0  # padded input columns the counted forwards consumed (what get_seq_length() reports)
    recording: bool = False  # activate_past_recording(): keep blocks that leave a window, so crop() can roll back
    states_record: StateRecord | None = None  # while recording on a model with state layers: the states a crop()
    # rolls back to
    beams_reordered: bool = False  # reorder_cache() re-pointed the rows: a row's index no longer names its sequence
    # in the stopping criteria's view, so finished rows are kept
    states_written: set = field(default_factory=set)  # (layer, state_idx) whose conv state was written: what
    # transformers' has_previous_state reports (state layers)


@dataclass
class GenerateCall:
    """One ``generate()`` call on a ``PagedCache``: what it decided (set at its start) and how far it got.

    Example::

        cache.begin_call(GenerateCall(backend="torch", release=True, compile=False, max_new_tokens=8))
        ...  # the call's forwards
        cache.end_call()
    """

    backend: str  # the attention backend the model was enabled with ("auto", "torch", "triton")
    release: bool  # give back finished rows' blocks (off when per-step outputs are requested)
    compile: bool  # the decoding forward may be compiled (the pool has a fixed size)
    max_new_tokens: int | None = None  # what the call may generate per row (for out-of-blocks advice)
    # -- progress, written by the cache
    prefix_tokens: int = 0  # prompt tokens per row its rows started from, taken from the pool's prefix cache
    prompt_end: int | None = None  # the cache's columns once the call's prompt forward has run; None until the
    # call's first forward is planned

    @property
    def prompt_planned(self) -> bool:
        """Whether the call's first (prompt) forward was planned."""
        return self.prompt_end is not None


@dataclass
class Forward:
    """The last forward planned on a ``PagedCache``.

    ``columns`` are added to the cache's count once, when the forward has run (``PagedCache.forward_ran``); the
    step stays readable afterwards (``last_step``, a gathered forward's later layers) until the next plan or a
    change to the rows."""

    step: Step
    columns: int  # padded input columns it consumes (its query length)
    paged: bool  # planned for the paged attention (else: gathered, without enable_paged_attention)
    counted: bool = False  # its columns are in Contents.columns

    @property
    def pending_columns(self) -> int:
        """Columns planned but not yet counted."""
        return 0 if self.counted else self.columns
