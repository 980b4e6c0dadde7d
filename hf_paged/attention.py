"""Switch a model's attention to the paged path through transformers' attention-function interface.

Two entry points, one on top of the other:

* ``attach_attention`` (public: ``hf_paged.attach_paged_attention``) puts the model on the paged path: it registers an attention function (and its mask
  builder) under a name of its own and sets the model to it (one call, ``compat.use_attention``), and hooks the
  decoder. A forward handed a planned step (the engine's ``StepCache``) reads K/V through the block tables; with any
  other cache, or none, the function calls the implementation the model had before, so the model computes exactly
  what it did (plain forward, ``DynamicCache``, training). That is all the continuous-batching engine needs.
* ``enable_generate`` (public: ``hf_paged.enable_paged_attention``) attaches and also wraps ``generate()``, its input preparation and its stopping criteria,
  which a :class:`PagedCache` needs. A model only attached refuses a ``PagedCache`` (``ValueError`` naming
  ``enable_paged_attention``) rather than run ``generate()`` without the call's planning.

Where state lives, one place each:

* The step of a forward is planned before it runs, on the host: by ``generate()``'s input preparation (wrapped
  here, so compiled decoding plans outside the compiled region) or, for a forward called directly, by a pre-hook
  on the decoder (a no-op while compiling).
* A layer's step tensors reach the attention function in the kwargs transformers hands it (``PagedCache.update``
  adds them): what it is handed tells its own forwards from another cache's (no step: the model's own attention), so
  a compiled ``StaticCache`` forward of an enabled model traces as before. Transformers releases without that path
  (before 5.24), and KV-shared layers (which never call ``update``: they read their source layer's step; the module
  says so), ask the cache of the running forward, from a context variable the decoder hooks set and clear around
  each forward (``compat.running_cache``), never while compiling (neither compiles with a ``PagedCache``). The mask
  builder registered with the attention asks the same cache whether its forward reads the pool (then no mask is
  built: the step carries the lengths and windows).
* The columns a forward consumed are counted once it has run (``PagedCache.forward_ran``: after the decoder's
  post-hook, or at ``generate()``'s next input preparation when a compiled forward ran no hooks).
* What a ``generate()`` call decided (release finished rows or not, compile or not) and how far it got live on the
  cache for the length of the call (``GenerateCall``, passed to ``PagedCache.begin_call``; the cache's state by
  lifetime is in ``cache_state.py``). The stopping criteria ``generate()`` builds inside the call find its cache in a
  context variable the ``generate()`` wrapper sets for the call (per thread and task). Nothing refers to a cache
  after its forward or call ends.
* What ``attach_paged_attention`` / ``enable_paged_attention`` did to a model (its original attention, hooks,
  backend, whether it takes a ``PagedCache``) is one ``PagedModel`` on the model that owns the attention layers and
  runs ``generate()`` (:func:`generating_model`: the model itself, or the inner model of a wrapper such as peft's
  ``PeftModel``), which the hooks and wrappers are bound to; each attention module also knows its family's eager
  attention (``_hf_paged_eager``), the fallback the shared attention function calls without a paged step.
"""

from __future__ import annotations

import contextvars
import functools
import sys
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from transformers.generation import GenerationMixin
from transformers.generation.stopping_criteria import StoppingCriteriaList

from . import compat, ops
from .cache import STEP_KWARG, PagedCache, StepCache
from .cache_state import GenerateCall
from .ops import custom_ops
from .patches import attention_modules, check_model, find_patch, kv_geometry
from .step import bidirectional_spans

_PREFIX = "hf_paged_"
# The PagedCache of the generate() call running in this thread/task (for the stopping criteria it builds).
_GENERATE_CACHE: contextvars.ContextVar = contextvars.ContextVar("hf_paged_generate_cache", default=None)
# Per-step outputs generate() returns for every row: finished rows must keep their history to match DynamicCache.
_PER_STEP_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
# Attention arguments the paged attention implements (softcap, s_aux: ops.paged_attention's options; sliding_window:
# the layer group's window, checked against it).
_IMPLEMENTED = frozenset({"softcap", "s_aux", "sliding_window"})
# Arguments transformers' attention functions (eager, sdpa, flash, flex; transformers 4.56 - 5.x) read that change
# what attention computes and the paged attention does not implement: a positional bias added to the scores (T5's
# position_bias, ALiBi slopes), packed (varlen) sequences told by cumulative lengths, and transformers' own paged
# cache. Everything else a forward hands
# the attention (generate()'s model kwargs such as tokenizer=, streamer=, a model's custom kwargs; position_ids,
# output_attentions, kernel options) is passed through untouched: it does not change the result.
REFUSED_ATTENTION_KWARGS = frozenset({"position_bias", "alibi_slopes", "cu_seq_lens_q", "cu_seq_lens_k",
                                      "max_length_q", "max_length_k", "block_table", "k_cache", "v_cache"})


def _check_kwargs(module, kwargs: dict, layer) -> None:
    """``ValueError`` naming the layer and the argument for an attention argument that changes attention and the
    paged path does not implement (:data:`REFUSED_ATTENTION_KWARGS`, ``is_causal=False``, a window other than the
    config's); every other argument is left alone."""
    for name, value in kwargs.items():
        if value is None:
            continue
        if name == "is_causal" and value is False:
            raise ValueError(f"layer {module.layer_idx} ({type(module).__name__}) asks for non-causal attention "
                             "(is_causal=False); paged attention is causal. Fix: use transformers' DynamicCache "
                             "for this model.")
        if name == "sliding_window" and value != layer.group.attention.sliding_window:
            raise ValueError(f"layer {module.layer_idx} ({type(module).__name__}) passes sliding_window={value} but "
                             f"its config describes window {layer.group.attention.sliding_window} "
                             "(hf_paged.patches.layer_windows). Fix: add a ModelPatch with this family's window rule "
                             "in patches/.")
        if name in REFUSED_ATTENTION_KWARGS:
            raise ValueError(f"layer {module.layer_idx} ({type(module).__name__}) passes the attention argument "
                             f"{name}={_short(value)}, which changes attention and hf_paged's paged attention does "
                             "not implement. Fix: use transformers' DynamicCache for this model (or PagedCache "
                             "without enable_paged_attention).")


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def paged_forward(module, query, scaling, kwargs, layer) -> torch.Tensor:
    """``query`` ``[B, Hq, S, D]`` attending through ``layer`` (a :class:`~hf_paged.step.LayerStep`): ``[B, S, Hq,
    Dv]``, as the attention function hands it back (also the lean forward's attention, ``patches/lean.py``)."""
    batch, num_q_heads, query_len, head_dim = query.shape
    q = query.squeeze(2) if query_len == 1 else query.transpose(1, 2).reshape(batch * query_len, num_q_heads,
                                                                              head_dim)  # [B*S, Hq, D]
    if layer.token_index is not None:
        q = q.index_select(0, layer.token_index)  # [num_tokens, Hq, D]
    scale = scaling if scaling is not None else head_dim**-0.5
    family = getattr(module, "_hf_paged_attention", None)  # the family's own (MLA: over the latent), from patches/
    if family is not None:
        out = family(module, q, layer, scale)  # [num_tokens, Hq, Dv]
    else:
        # The window is the layer group's, in its step's metadata (hf_paged.patches.layer_windows): what the model's
        # mask applies, also where its attention passes none (SmolLM3 with use_sliding_window=False slides through
        # its mask).
        out = custom_ops.paged_attention(q, layer, scale, kwargs.get("softcap"), kwargs.get("s_aux"))
    out_dim = out.shape[-1]
    if layer.token_index is not None:
        full = out.new_zeros(batch * query_len, num_q_heads, out_dim)
        out = full.index_copy_(0, layer.token_index, out)
    return out.view(batch, query_len, num_q_heads, out_dim)


def _layer_step(module, kwargs, query_len: int):
    """The layer's step, from what the attention is handed: in its kwargs when a cache of hf_paged's ran ``update``
    (``PagedCache`` / ``StepCache``); none there means another cache's forward (or none), the model's own attention.
    Two cases only find it through the running forward's cache: a KV-shared layer (the module says so:
    ``_hf_paged_reads_source``), which never calls ``update`` and reads its source layer's step (cut to the queries
    it got when the model sliced them), and every layer before transformers 5.24 (no step in the kwargs). Never while
    compiling: neither case compiles with a ``PagedCache`` (``PagedCache.is_compileable``), and a compiled forward of
    another cache (``StaticCache``) must not read a context variable."""
    layer = kwargs.pop(STEP_KWARG, None)
    if layer is not None or torch.compiler.is_compiling():
        return layer
    if compat.STEP_IN_ATTENTION_KWARGS and not getattr(module, "_hf_paged_reads_source", False):
        return None
    cache = compat.running_cache()
    return cache.layer_step(module.layer_idx, query_len) if cache is not None else None


@functools.lru_cache(maxsize=None)  # one builder per name, like the attention function
def _make_mask(original: str):
    # The original implementation's own mask builder; eager's where it registered none.
    build = compat.MASK_FUNCTIONS.get(original) or compat.MASK_FUNCTIONS["eager"]

    def mask(*args, **kwargs):
        # A forward whose every layer reads its K/V through the block tables never looks at the mask (its step
        # carries the lengths and windows): skip building it. A compiled forward builds it as traced.
        if not torch.compiler.is_compiling():  # (a trace never looks up the running cache)
            cache = compat.running_cache()
            if cache is not None and cache.reads_pool:
                return None
        return build(*args, **kwargs)

    return mask


@functools.lru_cache(maxsize=None)  # one function per name: re-enabling keeps compiled graphs valid
def _make_attention(original: str):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = _layer_step(module, kwargs, query.shape[2])
        if layer is not None:
            _check_kwargs(module, kwargs, layer)
        if layer is not None and not layer.no_history:
            return paged_forward(module, query, scaling, kwargs, layer), None
        # No cache, another cache, or a first prefill (its K/V are already in the pool; nothing to read back).
        fallback = _eager_of(module) if original == "eager" else compat.ATTENTION_FUNCTIONS[original]
        return fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    return attention


def _eager_of(module):
    """The module's own eager attention: set by :func:`attach_paged_attention`; for a module it never saw (a second
    model built on the same config object, whose attention name the call changed too) the one its modeling file
    defines."""
    eager = getattr(module, "_hf_paged_eager", None)
    if eager is None:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(
            f"{type(module).__name__} runs hf_paged's attention but enable_paged_attention() (or "
            "attach_paged_attention()) was never called on its model (it shares a config object with a model that "
            "was): build each model with its own config (copy.deepcopy(config)) or call enable_paged_attention() on "
            "this model too.")
    return eager


@dataclass
class PagedModel:
    """What :func:`attach_paged_attention` and :func:`enable_paged_attention` did to a model
    (``model._hf_paged_state``), to use and to undo."""

    original: str  # the attention implementation the model had
    decoder: nn.Module  # the module whose hooks plan and count forwards
    handles: tuple  # those hooks
    backend: str  # "auto", "torch" or "triton", as asked
    takes_paged_cache: bool = False  # enable_paged_attention ran: generate() wrapped, a PagedCache accepted


def _pre_hook(state: PagedModel, module, args, kwargs):
    if torch.compiler.is_compiling():
        return
    cache = compat.cache_from_kwargs(kwargs)
    if isinstance(cache, StepCache):  # the engine's planned forward: running, for its KV-shared layers
        compat.forward_begins(cache)
        return
    if not isinstance(cache, PagedCache):
        compat.forward_begins(None)
        return
    if not state.takes_paged_cache:
        raise ValueError(
            "this model was put on the paged path by attach_paged_attention(), which serves the continuous-batching "
            "engine: generate() (or a forward) with a PagedCache needs the generate() wrappers it leaves out. Fix: "
            "call hf_paged.enable_paged_attention(model) first (it keeps what attach installed and adds them).")
    if not cache.planned:  # a forward called directly (not through generate()): plan it here
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        batch, query_len = (input_ids if input_ids is not None else embeds).shape[:2]
        attention_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        cache.plan(input_ids, attention_mask, batch, query_len, state.backend, _dtype(module))
    compat.forward_begins(cache)


def _dtype(module) -> torch.dtype | None:
    param = next(module.parameters(), None)
    return param.dtype if param is not None else None


def _post_hook(module, args, kwargs, output):
    if torch.compiler.is_compiling():
        return
    compat.forward_ends()
    cache = compat.cache_from_kwargs(kwargs)
    if isinstance(cache, PagedCache):
        cache.forward_ran()


class _ReleaseFinishedRows(StoppingCriteriaList):
    """Stopping criteria that also tell the call's PagedCache which rows finished, so their blocks go back at once."""

    def __init__(self, criteria, cache: PagedCache | None):
        super().__init__(criteria)
        self.cache = cache

    def __call__(self, input_ids, scores, **kwargs):
        is_done = super().__call__(input_ids, scores, **kwargs)
        # Only rows whose later tokens generate() replaces with padding may stop taking KV.
        if self.cache is not None and any(hasattr(c, "eos_token_id") for c in self):
            self.cache.mark_finished(is_done)
        return is_done


def _generate_flag(model, kwargs, name):
    config = kwargs.get("generation_config") or model.generation_config
    return kwargs.get(name, getattr(config, name, None))


def _wrap_generate(model, generate, state: PagedModel):
    @functools.wraps(generate)
    def wrapped(*args, **kwargs):
        cache = compat.cache_from_kwargs(kwargs)
        if not isinstance(cache, PagedCache):
            return generate(*args, **kwargs)
        compat.rename_cache_kwarg(kwargs, stacklevel=2)
        per_step = bool(_generate_flag(model, kwargs, "return_dict_in_generate")) and any(
            _generate_flag(model, kwargs, n) for n in _PER_STEP_OUTPUTS)
        compile_config = _generate_flag(model, kwargs, "compile_config")
        if compile_config is not None and not compat.STEP_IN_ATTENTION_KWARGS:
            warnings.warn(
                f"compiled decoding with a PagedCache needs transformers >= 5.24 (this is "
                f"{compat.TRANSFORMERS_VERSION}), so this generate() runs eagerly.", stacklevel=2)
        elif compile_config is not None and cache.shares_kv:
            warnings.warn(
                "compiled decoding of a model with KV-shared layers (num_kv_shared_layers > 0) is not supported: "
                "their attention finds the source layer's step outside the graph, so this generate() runs eagerly.",
                stacklevel=2)
        elif compile_config is not None and not cache.pool.fixed:
            warnings.warn(
                "compiled decoding needs a KV pool of fixed size, so this generate() runs eagerly. Size the pool: "
                "PagedCache(model.config, num_blocks=N) or max_memory='4GiB' (or a BlockPool with either).",
                stacklevel=2)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        # Compileable only when transformers will compile this call: a compileable cache also makes generate()
        # build a 4D mask every step, which an eager run does not need.
        wanted = model.device.type in ("cuda", "xpu") or bool(getattr(compile_config, "_compile_all_devices", False))
        # Prefix caching starts the rows the model will run: generate() repeats each prompt for its beams or
        # returned sequences before the first forward, and slices off the columns the cache then holds.
        expand = max(_generate_flag(model, kwargs, "num_beams") or 1,
                     _generate_flag(model, kwargs, "num_return_sequences") or 1)
        mask = kwargs.get("attention_mask")
        if input_ids is not None and expand > 1:
            input_ids = input_ids.repeat_interleave(expand, dim=0)
            mask = mask.repeat_interleave(expand, dim=0) if mask is not None else None
        cache.check_continues(input_ids, mask)
        cache.begin_call(GenerateCall(backend=state.backend, release=not per_step,
                                      compile=compat.STEP_IN_ATTENTION_KWARGS and wanted
                                      and not _generate_flag(model, kwargs, "disable_compile"),
                                      max_new_tokens=_generate_flag(model, kwargs, "max_new_tokens")))
        token = _GENERATE_CACHE.set(cache)
        try:
            if cache.wants_weights_root():  # blocks keyed by the weights that made them: no stale K/V is reused
                cache.key_by_weights(cache.pool.weights_root(model))
            cache.start_from_prefix(input_ids, mask)
            if cache.is_compileable:
                cache.pool.preallocate()  # the compiled steps read the pool at fixed addresses
            return generate(*args, **kwargs)
        finally:
            _GENERATE_CACHE.reset(token)
            cache.end_call()

    return wrapped


def _wrap_prepare_inputs(prepare, model, bidirectional):
    """``bidirectional``: the family's marker of bidirectional tokens (``ModelPatch.bidirectional``) or None."""
    @functools.wraps(prepare)
    def wrapped(input_ids, *args, **kwargs):
        cache = compat.cache_from_kwargs(kwargs)
        if isinstance(cache, PagedCache) and cache.call is not None:
            cache.forward_ran()  # the last forward ran (a compiled one runs no hooks): count it before sizing masks
        inputs = prepare(input_ids, *args, **kwargs)
        cache = compat.cache_from_kwargs(inputs)
        if isinstance(cache, PagedCache) and cache.call is not None:
            inputs = cache.skip_cached_prefix(inputs, input_ids.shape[1] if input_ids is not None else 0)
            ids, embeds = inputs.get("input_ids"), inputs.get("inputs_embeds")
            batch, query_len = (ids if ids is not None else embeds).shape[:2]
            marks = bidirectional(inputs) if bidirectional is not None else None
            spans = bidirectional_spans(marks, kwargs.get("attention_mask")) if marks is not None else None
            cache.plan(ids, kwargs.get("attention_mask"), batch, query_len, cache.call.backend, model.dtype, spans)
        return inputs

    return wrapped


def _wrap_stopping_criteria(get_criteria):
    @functools.wraps(get_criteria)
    def wrapped(*args, **kwargs):
        return _ReleaseFinishedRows(get_criteria(*args, **kwargs), _GENERATE_CACHE.get())

    return wrapped


def generating_model(model: nn.Module) -> nn.Module:
    """The model that owns the attention layers and runs ``generate()``'s loop: ``model`` itself, or for a wrapper
    whose ``generate`` reaches an inner model's (peft's ``PeftModel`` -> ``LoraModel`` -> ``LlamaForCausalLM``) the
    first transformers generation model among its modules. What :func:`enable_paged_attention` hooks and wraps."""
    for sub in model.modules():
        if isinstance(sub, GenerationMixin):
            return sub
    return model


def attach_attention(model: nn.Module, backend: str = "auto") -> nn.Module:
    """The paged attention function (and its mask builder) registered through transformers' ``AttentionInterface``
    and set as the model's implementation, and the decoder hooks that tell the attention which step a forward runs:
    what the continuous-batching engine needs, and only that. The public entry points are
    :func:`hf_paged.attach_paged_attention` / :func:`hf_paged.enable_paged_attention` (``hf_paged/enable.py``), which
    also put transformers' continuous-batching methods on the model."""
    if backend not in ops.BACKENDS:
        raise ValueError(f"backend must be one of {ops.BACKENDS}, got {backend!r}.")
    if backend == "triton" and not ops.triton_available():
        raise ValueError("backend='triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU); "
                         "use backend='torch' or 'auto'.")
    _attach(generating_model(model), backend)
    return model


def _attach(model: nn.Module, backend: str) -> None:
    patch = find_patch(model)
    check_model(model)
    decoder = patch.decoder(model)
    state = getattr(model, "_hf_paged_state", None)
    if state is None:
        original = model.config._attn_implementation or "eager"
        state = PagedModel(original, decoder, (), backend)
        state.handles = (
            decoder.register_forward_pre_hook(functools.partial(_pre_hook, state), with_kwargs=True),
            decoder.register_forward_hook(_post_hook, with_kwargs=True, always_call=True),
        )
        for sub in model.modules():
            if hasattr(sub, "layer_idx") and hasattr(sub, "head_dim"):
                sub._hf_paged_eager = patch.eager_attention
        geometry = kv_geometry(model.config)
        for sub in attention_modules(model):  # KV-shared layers find their source's step through the forward's cache
            if sub.layer_idx < len(geometry.layers) and geometry.layers[sub.layer_idx].kind == "reuse":
                sub._hf_paged_reads_source = True
        if patch.attention is not None:  # a family whose pool holds something else than per-head K/V (MLA)
            for sub in attention_modules(model):
                sub._hf_paged_eager, sub._hf_paged_attention = patch.eager_attention, patch.attention
        compat.use_attention(model, _PREFIX + original, _make_attention(original), _make_mask(original))
        model._hf_paged_state = state
    state.backend = backend


def enable_generate(model: nn.Module, backend: str = "auto") -> nn.Module:
    """:func:`attach_attention` plus wrappers around the model's ``generate()``, its input preparation and its
    stopping criteria, which plan each step of a call with a :class:`PagedCache` on the host (outside a compiled
    region), start rows from cached prefixes and give finished rows' blocks back (public:
    :func:`hf_paged.enable_paged_attention`). A wrapper whose ``generate()`` calls an inner model's (a peft
    ``PeftModel``) is enabled on that inner model (:func:`generating_model`)."""
    attach_attention(model, backend)
    inner = generating_model(model)
    state = inner._hf_paged_state
    if not state.takes_paged_cache:
        state.takes_paged_cache = True
        if hasattr(inner, "generate"):
            inner.generate = _wrap_generate(inner, inner.generate, state)
            inner.prepare_inputs_for_generation = _wrap_prepare_inputs(inner.prepare_inputs_for_generation, inner,
                                                                       find_patch(inner).bidirectional)
            inner._get_stopping_criteria = _wrap_stopping_criteria(inner._get_stopping_criteria)
    return model


def detach(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_generate` or :func:`attach_attention`: the original attention implementation, no hooks,
    no wrappers (public: :func:`hf_paged.disable_paged_attention`)."""
    wrapper, model = model, generating_model(model)
    state = getattr(model, "_hf_paged_state", None)
    if state is None:
        return wrapper
    for handle in state.handles:
        handle.remove()
    compat.use_attention(model, state.original)
    for name in ("_get_stopping_criteria", "generate", "prepare_inputs_for_generation"):
        model.__dict__.pop(name, None)
    for sub in model.modules():
        sub.__dict__.pop("_hf_paged_eager", None)
        sub.__dict__.pop("_hf_paged_attention", None)
        sub.__dict__.pop("_hf_paged_reads_source", None)
    del model._hf_paged_state
    return wrapper


def is_paged(model: nn.Module) -> bool:
    """Whether ``model`` is on the paged path (:func:`attach_paged_attention` or :func:`enable_paged_attention`)."""
    return getattr(generating_model(model), "_hf_paged_state", None) is not None


def paged_backend(model: nn.Module) -> str:
    """The backend :func:`attach_paged_attention` or :func:`enable_paged_attention` set for ``model`` (``"auto"``,
    ``"torch"`` or ``"triton"``); ``ValueError`` if the model is not paged."""
    if not is_paged(model):
        raise ValueError("the model is not on the paged path: call hf_paged.enable_paged_attention(model) (or "
                         "attach_paged_attention(model) for the engine alone) first.")
    return generating_model(model)._hf_paged_state.backend
