"""``PagedCache``: a transformers ``Cache`` whose KV lives in blocks of a shared pool.

The data path of one forward: the step planner (``step.py``) runs before it, on the host; ``update()`` writes each
layer's new K/V into the pool through the step's slot mapping; the attention function (``attention.py``) reads the
pool through the step's block tables. Neither changes Python state, so the forward can be compiled.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import torch
from transformers.cache_utils import Cache

from . import compat
from .allocator import cdiv
from .cache_state import Contents, Forward, GenerateCall
from .distributed import sum_over_ranks
from .errors import OutOfBlocksError
from .groups import LayerGroups
from .ops import resolve_backend
from .patches import kv_geometry
from .persist import load_cache, save_cache
from .pool import BlockPool
from .rows import Rows
from .states import StateRecord, StateView
from .stats import MemoryStats
from .step import (LayerStep, Step, StepBuffers, StepOptions, build_layer_step, next_pow2, plan_generate_step,
                   reading_step, write_layer)

_log = logging.getLogger(__name__)
STEP_KWARG = "hf_paged_step"  # the attention kwarg through which update() hands a layer its LayerStep


class PagedCache(Cache):
    """A paged KV cache for ``model.generate()``.

    Keys and values live in fixed-size blocks (``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer); each
    row of the batch owns a block table mapping its logical blocks to physical ones anywhere in the pool. Blocks are
    taken as rows grow, shared between rows with the same prompt (beams, ``num_return_sequences``), given back when
    rows finish, and (with ``prefix_caching=True``) kept for later prompts that start the same way. Layers with
    different sliding windows keep separate block tables (one per group), drawing from the same pool.

    Args:
        config: the model's config (``model.config``); gives the layer count and each layer's window.
        block_size: tokens per block (default 16).
        num_blocks: cap on blocks in the pool (its tensors grow on demand up to the cap; a compiled call takes the
            cap's full size). Default: grow as needed.
        max_memory: cap in bytes, or a string like ``"2GiB"``; converted to blocks from the model's shape.
        pool: a :class:`BlockPool` to share with other caches (then sizing, prefix caching and kv_dtype come from it).
        release_finished: give back a row's blocks as soon as it finishes while other rows continue (default). Rows
            are kept anyway when ``generate()`` is asked for per-step outputs (scores, logits, attentions).
        prefix_caching: keep full blocks of finished rows for reuse by later calls on the same pool.
        kv_dtype: ``torch.float8_e4m3fn`` stores K/V in fp8 (a scale per token and KV head, written with it);
            default the model's dtype.

    Compiled decoding (``generate(..., compile_config=CompileConfig(...))``) needs a pool of fixed size
    (``num_blocks=`` or ``max_memory=``).

    ``copy.deepcopy(cache)`` and ``copy.copy(cache)`` both give an independent cache on the same pool that shares the
    blocks copy-on-write (transformers' prompt-reuse recipe); pickling is refused: use :meth:`save` / :meth:`load`.

    Example::

        from hf_paged import PagedCache, enable_paged_attention
        enable_paged_attention(model)
        cache = PagedCache(model.config)
        out = model.generate(**inputs, cache=cache, max_new_tokens=64)
        print(cache.memory_stats())
    """

    def __init__(
        self,
        config=None,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_memory: int | str | None = None,
        pool: BlockPool | None = None,
        release_finished: bool = True,
        prefix_caching: bool = False,
        kv_dtype: torch.dtype | None = None,
    ):
        compat.init_cache_base(self)
        if pool is not None and (num_blocks is not None or max_memory is not None or block_size != 16
                                 or prefix_caching or kv_dtype is not None):
            raise ValueError("pass sizing (block_size, num_blocks, max_memory), prefix_caching and kv_dtype to the "
                             "shared BlockPool, not to PagedCache, when pool= is given.")
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.config = text_config
        self.num_layers = getattr(text_config, "num_hidden_layers", None)
        geometry = kv_geometry(text_config) if text_config is not None else None
        self.groups = LayerGroups.from_geometry(geometry) if geometry is not None else LayerGroups.from_windows([])
        # layers keeping a per-row state (linear attention, Mamba, short convolutions): cells of the pool's store
        self.state_layers = frozenset(geometry.state_layers) if geometry is not None else frozenset()
        self._linear = [i in self.state_layers and not geometry[i].paged for i in range(len(geometry or ()))]
        self.pool = pool if pool is not None else BlockPool(block_size, num_blocks, max_memory, prefix_caching,
                                                            kv_dtype)
        self._own_pool = pool is None  # out-of-blocks advice names the constructor that sized the pool
        if text_config is not None and self.num_layers:
            self.pool.check_memory_fits_for(self._tensor_shapes())
        self.release_finished = release_finished
        if self.pool.prefix_caching and self.groups.num_groups > 1:
            _warn_once(f"prefix caching is off for {getattr(text_config, 'model_type', 'this model')}: its layers use "
                       f"different attention windows ({sorted(set(self.groups.windows), key=str)}), and a cached "
                       "prefix would need every window's blocks. Its rows still share blocks within a call.")
        self._buffers = self.pool.lend_step_buffers(self)  # a compiled decode step's tensors, at fixed addresses
        # The state, one object per lifetime (hf_paged/cache_state.py): until reset(), one generate() call, one
        # planned forward.
        self.rows = Rows(self.pool, self.groups, bool(self.state_layers))  # per batch row: its sequences, state
        # cell, tokens, released or not
        self._states: StateView | None = None  # the running forward's state handouts (models with state layers)
        self._contents = Contents()
        self._call: GenerateCall | None = None
        self._forward: Forward | None = None
        self.prefix_queries = 0  # prompt tokens this cache looked up in the pool's prefix cache (its own calls)
        self.prefix_hits = 0  # of which found
        self._warned_mismatch = False  # check_continues warns once per cache

    # ---------------------------------------------------------- Cache contract
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._contents.columns

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        query_len = compat.query_length(query_length)
        kv_length = self._contents.columns + query_len
        if query_len == 1 and self.is_compileable:
            # A compiled decode step: generate() builds a 4D mask outside the graph (the paged attention never reads
            # it); its width follows the block tables' bucket so the graph's input shapes stay fixed between buckets.
            bs = self.pool.block_size
            kv_length = next_pow2(cdiv(kv_length, bs)) * bs
        return kv_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._contents.columns

    @property
    def is_compileable(self) -> bool:
        """True inside a ``generate()`` of a paged model on a fixed-size pool: its decoding forward can be compiled.
        Not for models with KV-shared (``reuse``) layers: their attention finds its source layer's step through the
        running forward's cache (:func:`hf_paged.compat.running_cache`), which a compiled graph does not look up; nor
        for models with state layers (their states are handed out by Python bookkeeping at each forward)."""
        return (self._call is not None and self._call.compile and self.pool.fixed and not self.shares_kv
                and not self.state_layers)

    @property
    def shares_kv(self) -> bool:
        """Whether some layer reads another layer's K/V (Gemma 4's KV-shared layers)."""
        return any(source != i for i, source in enumerate(self.groups.sources))

    @property
    def batch_size(self) -> int:
        return len(self.rows) if len(self.rows) else -1

    @property
    def is_croppable(self) -> bool:
        """On models with state layers, only where transformers' mixers hand back the intermediate recurrent states
        a rollback needs (:data:`hf_paged.compat.STATE_ROLLBACK`)."""
        return not self.state_layers or compat.STATE_ROLLBACK

    @property
    def is_initialized(self) -> bool:
        return bool(len(self.rows))

    @property
    def is_sliding(self) -> list[bool]:
        return [self.groups.window_of(i) is not None for i in range(self.num_layers or 0)] or [False]

    @property
    def is_linear(self) -> list[bool]:
        """Per layer: keeps a state and no K/V (transformers' linear-attention layers; a hybrid layer is False)."""
        return list(self._linear) or [False] * (self.num_layers or 1)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * (self.num_layers or 1)

    def __len__(self) -> int:
        return self.num_layers or 0

    def __repr__(self) -> str:
        return f"PagedCache(rows={len(self.rows)}, columns={self._contents.columns}, block_size={self.pool.block_size})"

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None):
        """Keep what ``crop()`` needs to roll the cache back (assisted decoding): blocks that leave a window and, on
        models with state layers, the states before each new token (``recurrent_states_to_keep``: how many
        intermediate recurrent states a multi-token forward keeps, transformers 5.25 on)."""
        if self.state_layers:
            if not compat.STATE_ROLLBACK:
                raise ValueError(
                    f"this model keeps recurrent / convolution states (layers {sorted(self.state_layers)}), which a "
                    f"PagedCache can roll back only with transformers >= {compat.STATE_ROLLBACK_SINCE} (its mixers "
                    f"hand back the intermediate states; this is {compat.TRANSFORMERS_VERSION}): assisted decoding "
                    "(assistant_model=, prompt_lookup_num_tokens=) and other rollbacks are not supported here. Fix: "
                    "upgrade transformers, or generate without assistance.")
            self.forward_ran()
            self._contents.states_record = StateRecord(recurrent_states_to_keep or 0)
        self._contents.recording = True

    def is_recording_past(self, layer_idx: int = 0) -> bool:
        return self._contents.recording

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """How many intermediate recurrent states a state layer's multi-token forward keeps (0 unless recording)."""
        record = self._contents.states_record
        if record is None or (layer_idx is not None and layer_idx not in self.state_layers):
            return 0
        return record.keep

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """A mixer updated a conv state in place (transformers 5.25's decode path); the columns are counted per
        forward (``forward_ran``)."""

    # ------------------------------------------------------- state layers
    # transformers' linear-attention cache contract, on the rows' cells of the pool's state store: one StateView per
    # forward (states.py), made at its first state access, synced once it has ran (forward_ran).
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._state_view(layer_idx).get_conv_state(layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._state_view(layer_idx).get_recurrent_state(layer_idx, state_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        return self._state_view(layer_idx).update_conv_state(conv_states, layer_idx, state_idx, conv_kernel_size)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        return self._state_view(layer_idx).update_recurrent_state(recurrent_states, layer_idx, state_idx)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        if layer_idx is not None and layer_idx >= (self.num_layers or 0):
            return False
        if layer_idx is None:
            if not self.state_layers:
                raise ValueError("has_previous_state() is for state layers, and this model has none.")
            layer_idx = max(self.state_layers)
        self._check_state_layer(layer_idx)
        return (layer_idx, state_idx or 0) in self._contents.states_written

    def _check_state_layer(self, layer_idx: int) -> None:
        if layer_idx not in self.state_layers:
            raise ValueError(f"layer {layer_idx} keeps no recurrent / convolution state (the state layers of this "
                             f"model are {sorted(self.state_layers)}); build the cache from this model's config.")
        if not len(self.rows):
            raise ValueError("a state layer ran before this PagedCache planned its forward: models with state layers "
                             "need the paged path. Fix: call hf_paged.enable_paged_attention(model) before generate().")

    def _state_view(self, layer_idx: int) -> StateView:
        self._check_state_layer(layer_idx)
        if self._states is None:
            self._states = StateView(self.pool, self.rows.state_cells(), self._contents.states_written,
                                     self.state_layers, self._contents.states_record)
        return self._states

    def _sync_states(self) -> None:
        """Write back the gathered states the last forward was handed (to its rows still holding state cells)."""
        view, self._states = self._states, None
        if view is not None:
            view.sync(self.rows.state_cells())

    # ------------------------------------------------------------- the step
    @property
    def planned(self) -> bool:
        """Whether the coming forward was planned (by ``generate()`` or a model hook) and has not run yet."""
        return self._forward is not None and not self._forward.counted

    @property
    def last_step(self) -> Step | None:
        """The step of the last planned forward (what its layers read), for inspection."""
        return self._forward.step if self._forward is not None else None

    @property
    def step_buffers(self) -> StepBuffers:
        """The device tensors this cache's compiled decode steps read (written in place, one per shape)."""
        return self._buffers

    @property
    def reads_pool(self) -> bool:
        """Whether every layer of the planned forward reads its K/V through the block tables (not a first prefill,
        which the model's own attention serves): its attention mask then goes unused."""
        forward = self._forward
        return forward is not None and forward.paged and not forward.step.no_history

    def layer_step(self, layer_idx: int, query_len: int | None = None) -> LayerStep | None:
        """What layer ``layer_idx``'s attention reads in the running paged forward (None outside one): its own
        step, or a ``reuse`` layer's source's; ``query_len``: the query columns it got, when the model sliced them
        (:func:`~hf_paged.step.reading_step`)."""
        if self._forward is None or not self._forward.paged:
            return None
        step = self._forward.step
        return reading_step(step, self.groups, layer_idx, step.query_len if query_len is None else query_len,
                            self.pool.block_size)

    def begin_call(self, call: GenerateCall) -> None:
        """A ``generate()`` call starts on this cache (``call``: what it decided); it ends with :meth:`end_call`."""
        self._call = call

    @property
    def call(self) -> GenerateCall | None:
        """The running ``generate()`` call: what it decided and how far it got (None outside one)."""
        return self._call

    def end_call(self) -> None:
        """The ``generate()`` call ended (its last forward ran)."""
        self._call = None
        self.forward_ran()

    def plan(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, batch: int, query_len: int,
             backend: str = "auto", dtype: torch.dtype | None = None,
             spans: list[list[tuple[int, int]]] | None = None) -> None:
        """Plan the coming paged forward (called by the model hooks and ``generate()``, never inside a forward).

        ``dtype``: the model's, which sizes a ``max_memory`` pool before its first blocks are taken. ``spans``: per
        row, its bidirectional spans (:func:`hf_paged.step.bidirectional_spans`; Gemma 3's images)."""
        self._check_mode("paged")
        if dtype is not None:
            self._apply_memory_cap(dtype)
        self._check_call_start(batch)
        self.forward_ran()
        step = self._plan_rows(input_ids, attention_mask, batch, query_len, self._resolved_backend(backend, input_ids),
                               gathered=False, spans=spans)
        call = self._call
        if call is not None and not call.prompt_planned:
            call.prompt_end = self._contents.columns + query_len  # the columns once the call's prompt has run
        self._contents.mode = "paged"
        # Its columns are counted once it has run: get_seq_length() is read inside it.
        self._forward = Forward(step, query_len, paged=True)
        for layer in range(len(step.layers)):  # what a compiled forward reads, ready before it runs
            if layer in self.pool.layer_shapes:
                step.layers[layer] = build_layer_step(self.pool, self.groups, step, self._buffers, layer,
                                                      self.num_layers, None, None)

    def skip_cached_prefix(self, inputs: dict, sequence_len: int) -> dict:
        """``inputs`` of a call's first forward without the prompt columns its rows started from cached blocks
        (:meth:`start_from_prefix`). A plain ``generate()`` already slices them off (it reads
        :meth:`get_seq_length`), but assisted and prompt-lookup decoding feed their first forward the whole sequence,
        as they would an empty cache: its leading columns are the cached prefix, whose K/V the rows already hold.
        ``sequence_len``: the columns of the whole sequence generate() holds."""
        call = self._call
        if call is None or not call.prefix_tokens or call.prompt_planned:
            return inputs
        skip = call.prefix_tokens
        ids, embeds = inputs.get("input_ids"), inputs.get("inputs_embeds")
        width = (ids if ids is not None else embeds).shape[1] if ids is not None or embeds is not None else 0
        if width != sequence_len or width <= skip:
            return inputs  # already only the new columns
        trimmed = dict(inputs)
        for name in ("input_ids", "position_ids", "token_type_ids"):  # [..., S]
            value = inputs.get(name)
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[-1] == width:
                trimmed[name] = value[..., skip:]
        if embeds is not None:
            trimmed["inputs_embeds"] = embeds[:, skip:]  # [B, S, hidden]
        return trimmed

    def _plan_rows(self, input_ids, attention_mask, batch: int, query_len: int, backend: str, gathered: bool,
                   spans=None) -> Step:
        """The step planner over this cache's rows; a first forward creates them (and drops them if it fails)."""
        call = self._call
        # Rows created for this forward: by it, or from cached prefix blocks at the start of the call.
        first = not len(self.rows) or (call is not None and call.prefix_tokens > 0 and not call.prompt_planned)
        if not len(self.rows):
            self.rows.extend(batch)
        try:
            decode = query_len == 1
            options = StepOptions(backend, self.num_layers or 0, static=decode and self.is_compileable,
                                  decode_bucket=decode, release_windows=not gathered and not self._contents.recording,
                                  gathered=gathered)
            return plan_generate_step(self.rows, input_ids, attention_mask, batch, query_len, options, first=first,
                                      spans=spans)
        except OutOfBlocksError as err:
            advice = self._out_of_blocks_advice(err, query_len)
            if first:  # leave the cache as it was: empty
                self._drop_first_rows()
            raise advice from None
        except Exception:
            if first:
                self._drop_first_rows()
            raise

    def _drop_first_rows(self) -> None:
        """A failed first forward: give its rows back, the cache is empty again (what it was asked stays)."""
        self._states = None
        self._contents.states_written = set()
        self.rows.clear()
        self._contents.columns, self._contents.mode = 0, None

    def _out_of_blocks_advice(self, err: OutOfBlocksError, query_len: int) -> OutOfBlocksError:
        """``err`` with what the whole request would hold at the call's ``max_new_tokens`` and the one call (as
        this cache's pool was built) that fits it next to what other caches on the pool hold."""
        a, bs = self.pool.allocator, self.pool.block_size
        new = self._call.max_new_tokens if self._call is not None else None
        if new is None:
            return err
        # Tokens the rows still take: this step's, then one per new token but the last (never fed back); the
        # first new token came from the prompt's forward, each decode step written since made one more.
        written_steps = 0 if not self._call.prompt_planned else self._contents.columns - self._call.prompt_end
        still = query_len + max(0, new - 1 - written_steps)
        with self.pool.lock:
            mine = {b for row in self.rows.live for seq in row.seqs for b in a.block_table(seq) if b >= 0}
            others = a.blocks_in_use - len(mine)
            need = 0
            for row in self.rows.live:
                length = self.rows.length(row) + still
                for window, chunk in zip(self.groups.windows, self.groups.chunks):
                    limit = window if window is not None else chunk
                    need += cdiv(length if limit is None else min(length, limit + bs), bs)
        kept = "" if not mine else (f"This cache keeps the {len(mine)} blocks its rows hold so far (as a DynamicCache "
                                    "keeps its tensors) until cache.reset() gives them back or the cache is dropped. ")
        return OutOfBlocksError(err.needed, err.free, err.block_size, err.capacity, kept, request_needed=need,
                                max_new_tokens=new, fix=self.pool.sizing_call(need + others, cache=self._own_pool))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the new K/V ``[B, num_kv_heads, S, head_dim]`` of layer ``layer_idx``.

        On the paged attention path the attention reads the pool directly: the fresh K/V are returned as they came
        and this layer's :class:`~hf_paged.step.LayerStep` rides to the attention function in its kwargs. Otherwise
        the row's whole history is gathered to ``[B, num_kv_heads, kv_len, head_dim]``.
        """
        if self.num_layers is not None and layer_idx >= self.num_layers:
            raise ValueError(
                f"this PagedCache was built for a model with {self.num_layers} layers but layer {layer_idx} wrote to "
                "it. Build the cache from this model's config: PagedCache(model.config)."
            )
        if not self.planned and (layer_idx == 0 or self._forward is None):
            self._plan_gathered(key_states)
        forward = self._forward
        layer = write_layer(self.pool, self.groups, forward.step, self._buffers, layer_idx, self.num_layers,
                            key_states, value_states, None if forward.paged else "torch")
        if forward.paged:
            compat.attention_kwargs(kwargs)[STEP_KWARG] = layer
            return key_states, value_states
        return _gather(layer, layer.group.gather_slots), _gather(layer, layer.group.gather_slots, value=True)

    def forward_ran(self) -> None:
        """The planned forward has run: count its columns, once (the only place the count grows); the next forward
        needs a new plan. Called by the decoder's post-hook after an eager forward, by ``generate()``'s input
        preparation (a compiled forward runs no hooks), and by this cache before it changes or reports its rows."""
        if self._states is not None:
            self._sync_states()
        forward = self._forward
        if forward is not None and not forward.counted:
            self._contents.columns += forward.columns
            forward.counted = True

    def crop(self, max_length: int) -> None:
        """Drop tokens from the end: ``crop(-n)`` removes ``n`` (transformers' call); ``crop(n)`` with ``n > 0``
        keeps the first ``n`` (the older, absolute form)."""
        self.forward_ran()
        columns = self._contents.columns
        new_columns = columns + max_length if max_length <= 0 else min(max_length, columns)
        if new_columns < 0:
            raise ValueError(f"cannot crop {-max_length} tokens from a cache of {columns}.")
        drop = columns - new_columns
        record = self._contents.states_record
        if self.state_layers and drop > 0:
            if record is None:
                raise ValueError(
                    f"cannot crop {drop} tokens: this model keeps recurrent / convolution states (layers "
                    f"{sorted(self.state_layers)}), which roll back only what was recorded. Fix: call "
                    "cache.activate_past_recording(recurrent_states_to_keep=N) before the forwards a crop() undoes.")
            self._roll_states_back(record, drop)
        if record is not None:
            record.clear()
        if drop == 0:
            return
        self.rows.crop(drop)
        self._contents.columns = new_columns
        self._invalidate_step()

    def _roll_states_back(self, record: StateRecord, drop: int) -> None:
        """Write the states ``drop`` tokens back into the rows' cells."""
        if not record.conv and not record.recurrent:
            raise ValueError(f"cannot crop {drop} tokens: no state was recorded since activate_past_recording() (or "
                             "since this cache was copied), so the states cannot be rolled back.")
        store, cells = self.pool.states, self.rows.state_cells()
        live = [i for i, cell in enumerate(cells) if cell is not None]
        kernels = {key: store.get("conv", *key).shape[-1] for key in record.conv}
        for (kind, layer_idx, state_idx), states in record.rolled_back(drop, kernels).items():
            target = store.get(kind, layer_idx, state_idx)
            target[[cells[i] for i in live]] = states[live].to(target.dtype)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: re-point block tables; no KV is copied (states are: each row keeps its own)."""
        self.forward_ran()
        self.rows.reorder(beam_idx.tolist())
        self._contents.beams_reordered = True
        self._invalidate_step()

    def reset(self) -> None:
        """Give every block (and state cell) back to the pool; the cache can then start a new generation."""
        self._states = None
        self.rows.clear()
        self._contents = Contents()
        self._forward = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.forward_ran()
        self.rows.keep([i for i in range(len(self.rows)) for _ in range(repeats)])
        self._invalidate_step()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.rows.released:
            raise RuntimeError("batch_select_indices on a cache with released rows; use release_finished=False.")
        self.forward_ran()
        self.rows.keep(indices.tolist())
        self._invalidate_step()

    def __del__(self):
        try:
            self.rows.clear()
        except Exception:
            pass

    # --------------------------------------------------------------- copies
    def fork(self, batch_size: int = 1) -> "PagedCache":
        """A new cache on the same pool whose rows share this cache's blocks (no copy).

        ``batch_size`` copies of a single-row cache are made, e.g. one per prompt of a batch that all continue the
        same prefix. Writes into shared blocks copy them first, so neither cache sees the other's tokens.
        """
        num_rows = len(self.rows)
        if not num_rows:
            raise ValueError("fork() needs a cache that already holds tokens: run the prefix through the model first.")
        if self.rows.released:
            raise ValueError("fork() of a cache with released rows: those rows hold no KV anymore.")
        if num_rows != 1 and batch_size != num_rows and batch_size != 1:
            raise ValueError(f"fork(batch_size={batch_size}) of a {num_rows}-row cache: fork a 1-row cache, "
                             "or keep batch_size equal to the rows.")
        return self._clone([0] * batch_size if num_rows == 1 else list(range(num_rows)))

    def __deepcopy__(self, memo) -> "PagedCache":
        """An independent cache continuing from the same tokens, sharing blocks copy-on-write (the pool is shared)."""
        return self._clone(list(range(len(self.rows))))

    def __copy__(self) -> "PagedCache":
        """Same as :meth:`__deepcopy__`: a cache sharing bookkeeping with another would corrupt both."""
        return self._clone(list(range(len(self.rows))))

    def __reduce_ex__(self, protocol):
        raise TypeError("a PagedCache cannot be pickled (its KV lives in a pool shared with other caches): save it with "
                        "cache.save(path) and restore it with PagedCache.load(path, config).")

    def _clone(self, indices: list[int]) -> "PagedCache":
        self.forward_ran()  # its states written back before they are copied
        record = self._contents.states_record  # the copy records from here on, on its own
        child = PagedCache.__new__(PagedCache)
        child.__dict__.update(self.__dict__)  # the configuration (pool, groups, ...); the state is replaced below
        child._buffers = self.pool.lend_step_buffers(child)
        child._contents = dataclasses.replace(self._contents, columns=self._contents.columns + self._pending_columns(),
                                              states_written=set(self._contents.states_written),
                                              states_record=record and StateRecord(record.keep))
        child._call, child._forward, child._states = None, None, None
        child.rows = self.rows.select(indices)
        compat.init_cache_base(child)
        return child

    # --------------------------------------------------------------- weights
    def wants_weights_root(self) -> bool:
        """Whether a ``generate()`` on this cache needs the model's weights fingerprint: its pool caches prefixes
        (blocks are keyed under it), or its rows were made under a known one (a loaded file, an earlier call)."""
        return self.pool.prefix_caching or any(row.root for row in self.rows.live)

    def key_by_weights(self, root: bytes) -> None:
        """Before a ``generate()`` call: rows made from now on key their blocks under ``root`` (the model's weights
        fingerprint, ``BlockPool.weights_root``). ``ValueError`` when rows this cache holds were computed with other
        weights (the model's changed since, or the cache was loaded from a file another model's weights wrote):
        their K/V is not what this model would compute."""
        made = {row.root for row in self.rows.live if row.root}
        if made and made != {root}:
            raise ValueError(f"this cache's K/V was computed with other weights (fingerprint {_hex(made)}) than the "
                             f"model's now ({root.hex()[:16]}): continuing it would attend to K/V this model did not "
                             "compute. Start over with cache.reset() (or a new PagedCache), or continue with the "
                             "weights that made it.")
        self.rows.root = root

    # ----------------------------------------------------------- persistence
    def save(self, path, model=None) -> None:
        """Write this cache's rows (tokens and the K/V of every layer) to one safetensors file.

        :meth:`load` restores them on any pool serving a model of the same shape and dtype, in another process or
        on another machine; continuing from the loaded cache gives the same tokens as continuing from this one.
        The file names the weights that computed the K/V (their fingerprint) when the cache knows them (a
        ``generate()`` on a prefix-caching pool) or ``model`` is given (``ValueError`` if that model's weights are
        not the ones the rows were computed with); loading it against other weights is then refused.
        """
        self.forward_ran()
        if model is not None:
            self.key_by_weights(self.pool.weights_root(model))
            for row in self.rows.live:
                row.root = self.rows.root
        save_cache(self, path)

    @classmethod
    def load(cls, path, config, pool: BlockPool | None = None, trusted: bool = False, model=None,
             **kwargs) -> "PagedCache":
        """A cache holding the rows saved by :meth:`save`.

        The file is untrusted input: every field is checked against the file itself, the model and the pool before
        the pool is touched; a file that fails raises :class:`~hf_paged.CacheFileError` (a ``ValueError``) naming
        the file and the field. Its blocks serve the loaded rows only. ``trusted=True`` also publishes them to a
        prefix-caching pool (later prompts that start with the same tokens reuse them): use it only for files you
        wrote. (An fp8 file's scales belong to its own tokens, so they never change anyone else's blocks.)

        A file saved after a ``generate()`` on a prefix-caching pool names the weights that computed its K/V (their
        fingerprint, ``BlockPool.weights_root``): ``model=`` refuses it at load (``CacheFileError`` on field
        ``weights``) when the model's weights differ; without ``model``, the first ``generate()`` on the loaded cache
        refuses it (``ValueError``).
        """
        return load_cache(cls, path, config, pool, trusted=trusted, model=model, **kwargs)

    @property
    def columns(self) -> int:
        """Padded input columns the forwards so far consumed (what ``get_seq_length()`` reports)."""
        return self._contents.columns

    def restore(self, rows: Rows, columns: int, release_finished: bool, states_written=()) -> None:
        """Take ``rows`` (imported from a file, on this cache's pool) as this cache's rows (``load``);
        ``states_written``: the ``(layer, state_idx)`` whose states they hold (models with state layers)."""
        if len(self.rows):
            raise ValueError("restore() needs an empty cache.")
        self.rows, self.release_finished = rows, release_finished
        self._contents.columns, self._contents.mode = columns, "paged" if len(rows) else None
        self._contents.states_written = set(states_written)

    @property
    def states_written(self) -> frozenset:
        """``(layer, state_idx)`` whose states the rows hold (what ``has_previous_state`` reports)."""
        return frozenset(self._contents.states_written)

    # ------------------------------------------------------ finished rows
    def release_rows(self, rows) -> None:
        """Give back the blocks (and state cells) of finished ``rows``; they will take no KV and may not be
        continued."""
        self.forward_ran()
        for index in rows:
            self.rows.release(self.rows[index])
        self._invalidate_step()

    def mark_finished(self, done: torch.Tensor) -> None:
        """Called after each decoding step with the rows whose generation ended (``[B]`` bool)."""
        num_rows = len(self.rows)
        if not self.release_finished or self._contents.beams_reordered or num_rows < 2 or done.shape[0] != num_rows:
            return
        if self._call is not None and not self._call.release:
            return
        released = set(self.rows.released)
        done_rows = [r for r in done.nonzero().flatten().tolist() if r not in released]
        if done_rows and len(done_rows) + len(released) < num_rows:
            self.release_rows(done_rows)

    # ------------------------------------------------------------ reports
    def block_tables(self, group: int = 0) -> list[list[int] | None]:
        """Each batch row's block table in layer group ``group`` (physical block per logical block; -1: slid out of
        the window), or ``None`` for a row that finished and was released."""
        with self.pool.lock:
            return [None if row.released else list(self.rows.table(row, group)) for row in self.rows]

    def seq_lens(self) -> list[int | None]:
        """Tokens each batch row holds in the pool (its real tokens, padding excluded); ``None`` if released."""
        with self.pool.lock:
            return [None if row.released else self.rows.length(row) for row in self.rows]

    def memory_stats(self, all_ranks: bool = False) -> MemoryStats:
        """Figures for this cache's rows, with the pool's size and peak (see :class:`MemoryStats`).

        For models whose layers use different windows, ``groups`` holds the same figures per layer group (each
        with its ``window``); the totals count every group's blocks. Under tensor parallelism each rank holds only
        its KV heads; ``all_ranks=True`` sums the byte figures over the ranks of the default process group (a
        collective: call it on every rank).
        """
        if all_ranks:
            return sum_over_ranks(self.memory_stats())
        with self.pool.lock:
            stats = MemoryStats.for_rows(self.pool, [row.seqs for row in self.rows.live], self.groups.windows)
            if self.state_layers:
                stats = stats.with_states(self.pool.states, sum(row.state is not None for row in self.rows))
        return dataclasses.replace(stats, cache_prefix_query_tokens=self.prefix_queries,
                                   cache_prefix_hit_tokens=self.prefix_hits)

    # ------------------------------------------------------------- internals
    def _resolved_backend(self, backend: str, input_ids) -> str:
        devices = {s.device for s in self.pool.layer_shapes.values()}
        device = next(iter(devices)) if devices else (input_ids.device if input_ids is not None else torch.device("cpu"))
        return resolve_backend(backend, device)

    def _check_mode(self, mode: str) -> None:
        filled = self._contents.mode
        if filled is not None and filled != mode:
            raise RuntimeError(
                "this PagedCache was filled with paged attention "
                f"{'on' if filled == 'paged' else 'off'} and is now used with it "
                f"{'on' if mode == 'paged' else 'off'}. Call enable_paged_attention(model) before the first "
                "generate(), or reset() the cache."
            )

    def _check_call_start(self, batch: int) -> None:
        num_rows = len(self.rows)
        if num_rows and batch != num_rows:
            raise ValueError(
                f"this PagedCache holds {num_rows} rows but the model got a batch of {batch}. Use a new "
                "PagedCache (or cache.reset()) for a new batch."
            )
        released = self.rows.released
        if self._call is not None and not self._call.prompt_planned and released:
            raise RuntimeError(
                f"rows {released} of this PagedCache finished in an earlier generate() call and were "
                "released (their blocks went back to the pool), so they cannot be continued. Use "
                "PagedCache(config, release_finished=False) to continue finished rows later, or start a new cache."
            )

    def _plan_gathered(self, key: torch.Tensor) -> None:
        """A forward without enable_paged_attention: plan it here, at layer 0 (the model is not compiled)."""
        self._check_mode("gathered")
        if self._contents.mode is None:  # a new fill (Python's warning filter shows it once per calling line)
            warnings.warn(
                "PagedCache is used without enable_paged_attention(model): results are correct but the whole KV "
                "history is gathered for every layer and padding is stored. Call hf_paged.enable_paged_attention(model) "
                "for the paged fast path.",
                stacklevel=4,
            )
        self._check_call_start(key.shape[0])
        self.pool.apply_memory_cap_for(self._tensor_shapes() or [(key.shape[1], key.shape[3], key.shape[3])]
                                       * self._tensors_per_block(), key.dtype)
        # The gathered history reads no paged kernel: the torch backend writes it.
        step = self._plan_rows(None, None, key.shape[0], key.shape[2], "torch", gathered=True)
        self._contents.mode = "gathered"
        # Counted at once, at layer 0's write, as DynamicCache counts its tokens (no hook tells when it ran).
        self._forward = Forward(step, key.shape[2], paged=False)
        self.forward_ran()

    def _tensors_per_block(self) -> int:
        return self.groups.group_size if self.groups.layer_tensor else (self.num_layers or 1)

    def _apply_memory_cap(self, dtype: torch.dtype) -> None:
        """Size a ``max_memory`` pool from the config's K/V shape (per rank under tensor parallelism the real heads
        are fewer: the cap is then conservative)."""
        if self.pool.max_memory is None or self.pool.allocator.max_blocks is not None or self.config is None:
            return
        self.pool.apply_memory_cap_for(self._tensor_shapes(), dtype)

    def _tensor_shapes(self) -> list[tuple[int, int, int]]:
        """``(num_kv_heads, key_dim, value_dim)`` of each K/V tensor a block id stands for (the config's)."""
        return [shape for _, shape in self.groups.tensor_shapes]

    def _invalidate_step(self) -> None:
        """The rows changed: count the last forward (it ran) and drop its step."""
        self.forward_ran()
        self._forward = None

    def _pending_columns(self) -> int:
        return self._forward.pending_columns if self._forward is not None else 0

    def check_continues(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> None:
        """Before a ``generate()`` on a cache holding rows: ``ValueError`` when ``input_ids`` cannot continue them
        (no new column); a warning, once per cache, when their first columns are not the tokens the rows hold.

        As with ``DynamicCache``, generate() then continues from the cached K/V and feeds only the columns past
        them. The usual cause is a tokenization boundary: transformers' prompt-reuse recipe caches
        ``tok(prefix)`` and then passes ``tok(prefix + question)``, whose last prefix token may merge with the
        question's first characters."""
        columns = self._contents.columns + self._pending_columns()
        # generate() slices off the columns the cache holds (its mask, built when none is given, covers input_ids):
        # at least one column must be new.
        if input_ids is None or not columns or not len(self.rows) or input_ids.shape[0] != len(self.rows):
            return
        if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[1] != input_ids.shape[1]):
            return  # only the new tokens were passed, with the whole sequence's mask
        if input_ids.shape[1] <= columns:
            raise ValueError(
                f"this PagedCache holds {columns} columns but input_ids has {input_ids.shape[1]}: generate() continues "
                "a cache only from its own sequence plus new tokens (e.g. torch.cat([out, new_ids], 1)). For other "
                "prompts start over with cache.reset() or a new PagedCache.")
        if self._warned_mismatch:
            return
        ids = input_ids[:, :columns].to("cpu")
        real = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else \
            attention_mask[:, :columns].to("cpu", torch.bool)
        for r, row in enumerate(self.rows):
            if row.released or row.tokens is None or len(row.tokens) != int(real[r].sum()):
                continue
            given = ids[r][real[r]].tolist()
            differ = [i for i, (a, b) in enumerate(zip(given, row.tokens)) if a != b]
            if not differ:
                continue
            column = int(real[r].nonzero()[differ[0]])
            boundary = differ == [len(row.tokens) - 1]
            self._warned_mismatch = True
            warnings.warn(
                f"row {r} of this PagedCache holds other tokens than input_ids from column {column} on (of the "
                f"{columns} it holds): generate() continues from the cached K/V and feeds only the columns past "
                "them, as DynamicCache does. "
                + ("Only the last cached token differs, a tokenization boundary: the prefix's last token merges "
                   "with what follows when both are tokenized together. To continue exactly, tokenize the prefix "
                   "and the new text separately and concatenate the ids."
                   if boundary else
                   "To run another prompt, start over with cache.reset() or a new PagedCache; to continue, pass "
                   "the cache's own sequence with the new tokens appended (e.g. torch.cat([out, new_ids], 1))."),
                stacklevel=3)  # the caller of generate() (hf_paged's wrapper sits between)
            return

    def start_from_prefix(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> int:
        """Prefix caching, before the first forward of a ``generate()`` on an empty cache (with the batch the model
        will run: beams and returned sequences expanded): begin every row from the cached blocks its prompt starts
        with (the same number of whole blocks for every row, since ``generate()`` feeds all rows the same columns).
        Rows with the same prompt then share those blocks and one copy of the rest. Returns the prompt tokens
        skipped per row."""
        bs = self.pool.block_size
        if not self.pool.prefix_caching or len(self.rows) or self._contents.columns:
            return 0
        if self.state_layers:  # no state checkpoints in generate(): the rows' states at a prefix's end are not kept
            _log.debug("prefix cache lookup skipped: the model has state layers")
            return 0
        if self._call is None:
            raise RuntimeError("start_from_prefix() starts the rows of a generate() call: call it after "
                               "begin_call(), before the call's first forward.")
        if not self.rows.prefix_caching or input_ids is None:
            _log.debug("prefix cache lookup skipped: %s", "the model's layers use different windows"
                       if not self.rows.prefix_caching else "generate() got embeddings, not token ids")
            return 0
        batch, length = input_ids.shape
        limit = length - 1  # the last prompt token must run: its logits start the generation
        if attention_mask is not None and attention_mask.dim() == 2:
            padded = ~attention_mask[:, :limit].to("cpu", torch.bool)
            if bool(padded.any()):
                limit = int(padded.any(0).nonzero()[0])  # only columns every row holds a real token in
                _log.debug("prefix cache lookup limited to the first %d columns: rows are left-padded", limit)
        tokens = input_ids[:, :limit].to("cpu").tolist()
        matches = [self.rows.match_prefix(row, limit) for row in tokens]
        common = min(len(m) for m in matches)
        looked_up, hit = batch * (limit // bs) * bs, batch * common * bs
        self.pool.allocator.note_prefix_lookup(looked_up, hit)
        self.prefix_queries += looked_up
        self.prefix_hits += hit
        if common == 0:
            return 0
        for m, row in zip(matches, tokens):
            self.rows.new(m[:common], row[: common * bs])
        self._contents.columns, self._contents.mode = common * bs, "paged"
        self._call.prefix_tokens = common * bs  # the call's first plan then shares equal rows' blocks
        return common * bs


_WARNED: set[str] = set()


def _hex(roots) -> str:
    return ", ".join(sorted(r.hex()[:16] for r in roots))


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


class StepCache(Cache):
    """A transformers ``Cache`` for one forward over a planned :class:`~hf_paged.step.Step` (the engine's packed
    forward): ``update()`` writes each layer's K/V through the step's slot mapping and hands the layer its step in
    the attention kwargs, so every query reads the pool through the paged attention."""

    def __init__(self, rows: Rows, step: Step, num_layers: int, buffers: StepBuffers | None = None):
        compat.init_cache_base(self)
        self.pool, self.groups, self.step, self.num_layers = rows.pool, rows.groups, step, num_layers
        self._buffers = buffers if buffers is not None else StepBuffers()  # a compiled step's: lent by the pool

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = write_layer(self.pool, self.groups, self.step, self._buffers, layer_idx, self.num_layers,
                            key_states, value_states, None)
        compat.attention_kwargs(kwargs)[STEP_KWARG] = layer
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    # The decoder's hooks make this the running forward's cache (compat.running_cache): a KV-shared layer, which
    # writes nothing, finds its source layer's step here. Its forward still builds the model's masks (unread).
    reads_pool = False
    packed_states = None  # hybrid models: the requests' segments, which the state mixers run per group
    # (engine/states.py)

    def layer_step(self, layer_idx: int, query_len: int | None = None) -> LayerStep | None:
        """What layer ``layer_idx``'s attention reads (see :meth:`PagedCache.layer_step`)."""
        step = self.step
        return reading_step(step, self.groups, layer_idx, step.query_len if query_len is None else query_len,
                            self.pool.block_size)

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        return compat.query_length(query_length), 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [self.groups.window_of(i) is not None for i in range(self.num_layers)] or [False]

    def __len__(self) -> int:
        return self.num_layers


def _gather(layer: LayerStep, slots: torch.Tensor, value: bool = False) -> torch.Tensor:
    """``[B, L]`` slots -> ``[B, H, L, D]`` contiguous history (gathered mode; the pool is in the model's dtype)."""
    cache = layer.value_cache if value else layer.key_cache
    num_blocks, block_size, heads, dim = cache.shape
    flat = cache.view(num_blocks * block_size, heads, dim)
    return flat.index_select(0, slots.flatten()).view(*slots.shape, heads, dim).transpose(1, 2)
