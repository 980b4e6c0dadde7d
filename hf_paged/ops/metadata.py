"""What a batch of packed queries needs to read the pool: one object every paged-attention backend takes.

The step planner builds one :class:`AttentionMetadata` per layer group and step (the group's layers share it, on their
device); :func:`hf_paged.ops.paged_attention` builds one from its arguments. What differs per layer travels beside
it: the pool tensors, the softmax scale, soft-capping, sinks and the fp8 scale caches. Crossing the custom-op
boundary (``torch.ops.hf_paged.paged_attention``, whose schema takes only tensors and scalars) it is flattened by
:func:`hf_paged.ops.custom_ops.op_arguments` and rebuilt by :func:`hf_paged.ops.custom_ops.from_op_arguments`, nowhere
else. This module imports only the read layout (``layout``, plain data): the backends (``reference``,
``triton_kernels``) import it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .layout import ReadLayout


@dataclass
class AttentionMetadata:
    """Where each sequence's queries sit among the packed queries and where its KV sits in the pool.

    Query ``i`` of a sequence with ``q_len`` queries is at position ``seq_lens[s] - q_len + i`` and attends to the
    positions ``<=`` its own (the last ``sliding_window`` of them with a window; with ``chunk=C`` those from
    ``floor(p / C) * C`` on: chunked attention). With ``query_limits``, a query sees the positions ``<=`` its limit
    instead of its own (a bidirectional span: an image's tokens see each other); the window and the chunk still
    count back from its own position.
    """

    block_tables: torch.Tensor  # [num_seqs, W] int32, logical block -> physical block
    seq_lens: torch.Tensor  # [num_seqs] int32, tokens each sequence holds, its new ones included
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, each sequence's first query among the packed ones
    max_query_len: int | None = None  # host-side maxima (None: read from the tensors, a device sync)
    max_seq_len: int | None = None  # may be a bucketed bound above every seq_lens, up to W * block_size
    sliding_window: int | None = None
    plan: ReadLayout | None = None  # the torch backend's read layout (hf_paged.ops.layout), once per step
    chunk: int | None = None  # chunked attention: a query sees its own chunk of this many positions
    query_limits: torch.Tensor | None = None  # [num_tokens] int32, the last position each query sees (None: its own)

    def moved(self, put) -> "AttentionMetadata":
        """The same metadata with each tensor replaced by ``put(name, tensor)`` (moved to a device, or staged in a
        step buffer)."""
        layout = None if self.plan is None else self.plan.moved(lambda name, t: put("layout." + name, t))
        return replace(self, block_tables=put("block_tables", self.block_tables),
                       seq_lens=put("seq_lens", self.seq_lens),
                       query_start_loc=put("query_start_loc", self.query_start_loc), plan=layout,
                       query_limits=None if self.query_limits is None else put("query_limits", self.query_limits))
