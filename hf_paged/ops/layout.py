"""The torch backend's *read layout*: how :func:`hf_paged.ops.reference.paged_attention_torch` reads one step's
batch (its rows split into :class:`AttentionPart` s), built once per step by
:func:`hf_paged.ops.reference.plan_torch_attention` and carried in :class:`hf_paged.ops.AttentionMetadata`'s ``plan``.
Plain data: it imports nothing of the package, so the metadata and the backends both import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionPart:
    """Rows of a step read together: one attention call over their blocks, no query padding.

    The rows have the same number of queries ``Q``. With one (decode), the query heads of each KV head become that
    head's queries (one call, no repeated K/V); with several, the call is causal over each row's history. ``mask``
    None: nothing to mask (decode rows whose contexts fill the part's whole blocks; rows whose queries are their first
    positions, a fresh prompt or chunk with no window cutting it, take SDPA's causal path). ``q_index`` None: the
    part's queries are the packed batch's ``q_start .. q_start + rows * Q - 1`` in order (a slice, nothing gathered).
    """

    tables: torch.Tensor  # [Sx * nb] int64, physical block of each context block
    num_rows: int  # Sx (-1 in a compiled step: the mask's shape tells)
    queries: int  # Q, per row (likewise)
    mask: torch.Tensor | None = None  # [Sx, 1, Q, L] bool: causal from each row's history, window
    q_index: torch.Tensor | None = None  # [Sx * Q] int64 into the packed queries
    q_start: int = 0
    run: int | None = None  # one row whose blocks are run .. run + nb - 1 (read as a view)
    kv_valid: torch.Tensor | None = None  # [Sx, L, 1, 1] bool, public entry only

    TENSORS = ("tables", "mask", "q_index", "kv_valid")

    def sizes(self) -> tuple[int, int]:
        """``(Sx, Q)``, from the mask's shape where there is one."""
        if self.mask is not None:
            return self.mask.shape[0], self.mask.shape[2]
        return self.num_rows, self.queries


@dataclass
class ReadLayout:
    """The torch backend's *read layout*: how :func:`~hf_paged.ops.reference.paged_attention_torch` reads one batch,
    built once per step (:func:`~hf_paged.ops.reference.plan_torch_attention`) and shared by its layers.

    Rows are split into :class:`AttentionPart` s so that no row is padded to another's query count, nor a decode row
    to a much longer context: the rows with one query by context (power-of-two ranges of blocks, see
    ``hf_paged.ops.reference.SPLIT_MIN_POSITIONS``), then one part per distinct larger query count, in order of first
    appearance (a continuous-batching step's chunks mostly one each; a ``generate()`` batch one part in all). A row
    with no query takes no part. Each part gathers its rows' blocks up to its own longest context, in whole blocks
    (``L = nb * block_size``), or reads them as a view of the pool when it is a single row whose blocks are
    consecutive (``run``). When the parts' queries, in order, are the packed batch itself (``ordered``), the output
    is their concatenation; otherwise each part has index tensors and its output is scattered.

    Every field is a tensor, an int or None (the step planner moves the tensors to the model's device, :meth:`moved`).
    A compiled step (``always_mask``) keeps one part per query count and carries every size the attention needs in a
    tensor's shape (a compiled graph sees no varying Python int): see :meth:`op_arguments` and
    :meth:`from_op_arguments`, through which the layout crosses the custom-op boundary.
    """

    parts: list[AttentionPart] = field(default_factory=list)
    ordered: bool = True

    def moved(self, put) -> "ReadLayout":
        """A copy whose tensors are ``put(name, tensor)`` (e.g. moved to a device or staged in a step buffer)."""
        def move(part, prefix):
            return AttentionPart(**{n: put(prefix + n, v) if isinstance(v, torch.Tensor) else v
                                    for n, v in vars(part).items()})

        return ReadLayout([move(part, f"parts.{i}.") for i, part in enumerate(self.parts)], self.ordered)

    @staticmethod
    def op_arguments(layout: "ReadLayout | None") -> tuple[list, list[int]]:
        """``(tensors, ints)`` for the op's schema: each part's tensors (``AttentionPart.TENSORS`` order); the ints
        ``[ordered, then per part: run, q_start, num_rows, queries]`` (-1: none). No layout (the Triton backend): two
        empty lists."""
        if layout is None:
            return [], []
        tensors, ints = [], [int(layout.ordered)]
        for part in layout.parts:
            tensors += [getattr(part, n) for n in AttentionPart.TENSORS]
            ints += [-1 if part.run is None else part.run, part.q_start, part.num_rows, part.queries]
        return tensors, ints

    @classmethod
    def from_op_arguments(cls, tensors, ints) -> "ReadLayout | None":
        if not ints:
            return None
        layout = cls(ordered=bool(ints[0]))
        width = len(AttentionPart.TENSORS)
        for i in range(len(tensors) // width):
            fields = dict(zip(AttentionPart.TENSORS, tensors[i * width: (i + 1) * width]))
            run, q_start, num_rows, queries = ints[1 + 4 * i: 5 + 4 * i]
            layout.parts.append(AttentionPart(**fields, num_rows=num_rows, queries=queries, q_start=q_start,
                                              run=None if run < 0 else run))
        return layout
