"""Switch a model's attention to the paged path through transformers' attention-function interface.

``enable_paged_attention`` registers an attention function (and a mask function) under a name of its own and sets
the model to it. The function reads K/V through the block tables when the forward runs with a :class:`PagedCache`,
and otherwise calls the implementation the model had before, with the mask that implementation expects, so a
patched model computes exactly what it did without a ``PagedCache`` (plain forward, ``DynamicCache``, training).

Which cache a forward runs with is recorded by a hook on the decoder (a per-thread stack, so concurrent requests
in threads and nested models do not mix).
"""

from __future__ import annotations

import functools
import threading

import torch
from torch import nn
from transformers.generation.stopping_criteria import StoppingCriteriaList

from . import compat, ops
from .cache import PagedCache

_STATE = threading.local()
_PREFIX = "hf_paged_"


def _stack() -> list:
    if not hasattr(_STATE, "stack"):
        _STATE.stack = []
    return _STATE.stack


def active_cache() -> PagedCache | None:
    """The PagedCache of the forward running in this thread (None outside one, or with another cache)."""
    stack = _stack()
    return stack[-1] if stack else None


def _paged_forward(module, query, attention_mask, scaling, kwargs, cache: PagedCache) -> tuple[torch.Tensor, None]:
    step = cache._step.to(query.device)
    key_cache, value_cache = cache.pool.layer_kv(module.layer_idx)
    batch, num_q_heads, query_len, head_dim = query.shape
    q = query.transpose(1, 2).reshape(batch * query_len, num_q_heads, head_dim)  # [B*S, Hq, D]
    if step.token_index is not None:
        q = q.index_select(0, step.token_index)  # [num_tokens, Hq, D]
    window = kwargs.get("sliding_window")
    backend = ops.resolve_backend(cache._backend, query.device)
    out = ops.paged_attention_unchecked(
        q, key_cache, value_cache, step.block_tables, step.seq_lens, step.query_start_loc,
        float(scaling if scaling is not None else head_dim**-0.5), window, backend,
        step.max_query_len, step.max_seq_len,
        plan=step.torch_plan(key_cache.shape[1], q.shape[0], window) if backend == "torch" else None,
    )
    if step.token_index is not None:
        full = out.new_zeros(batch * query_len, num_q_heads, head_dim)
        out = full.index_copy_(0, step.token_index, out)
    return out.view(batch, query_len, num_q_heads, head_dim), None


def _make_attention(original: str):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        cache = active_cache()
        if cache is not None and cache._mode == "paged" and not cache._step.no_history:
            return _paged_forward(module, query, attention_mask, scaling, kwargs, cache)
        # No cache, another cache, or a first prefill (its K/V are already in the pool; nothing to read back).
        fallback = compat.attention_function(original, module._hf_paged_eager)
        return fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    return attention


def _make_mask(original: str):
    original_mask = compat.mask_function(original)

    def mask(*args, **kwargs):
        cache = active_cache()
        if cache is not None and cache.is_initialized:
            return None  # the paged path knows causality and padding from the block tables
        return original_mask(*args, **kwargs)

    return mask


def _pre_hook(module, args, kwargs):
    cache = compat.cache_from_kwargs(kwargs)
    paged = cache if isinstance(cache, PagedCache) else None
    if paged is not None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        paged._pending = {
            "attention_mask": kwargs.get("attention_mask", args[1] if len(args) > 1 else None),
            "input_ids": input_ids,
            "backend": module._hf_paged_backend,
        }
        _STATE.last_cache = paged
    _stack().append(paged)


def _post_hook(module, args, kwargs, output):
    stack = _stack()
    if stack:
        stack.pop()


class _ReleaseFinishedRows(StoppingCriteriaList):
    """Stopping criteria that also tell the PagedCache which rows finished, so their blocks go back at once."""

    def __call__(self, input_ids, scores, **kwargs):
        is_done = super().__call__(input_ids, scores, **kwargs)
        cache = getattr(_STATE, "last_cache", None)
        # Only rows whose later tokens generate() replaces with padding may stop taking KV.
        if cache is not None and any(hasattr(c, "eos_token_id") for c in self):
            cache.mark_finished(is_done)
        return is_done


def _wrap_generate(generate):
    @functools.wraps(generate)
    def wrapped(*args, **kwargs):
        cache = compat.cache_from_kwargs(kwargs)
        if isinstance(cache, PagedCache):
            cache._start_generate()
        return generate(*args, **kwargs)

    return wrapped


def enable_paged_attention(model: nn.Module, backend: str = "auto") -> nn.Module:
    """Put a Llama or Mistral model on the paged attention path; returns the model.

    With a :class:`PagedCache` the attention reads K/V straight from the pool's blocks (``backend="torch"``: the
    PyTorch path, ``"triton"``: the kernels, ``"auto"``: Triton on CUDA, torch otherwise). With any other cache, or
    none, the model computes exactly what it computed before. Calling it twice is harmless (the second call may change
    the backend); :func:`disable_paged_attention` undoes it.

    Example::

        model = enable_paged_attention(AutoModelForCausalLM.from_pretrained(path))
        out = model.generate(**inputs, past_key_values=PagedCache(model.config), max_new_tokens=64)
    """
    from hf_paged.patches import find_patch

    if backend not in ops.BACKENDS:
        raise ValueError(f"backend must be one of {ops.BACKENDS}, got {backend!r}.")
    if backend == "triton" and not ops.triton_available():
        raise ValueError("backend='triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU); "
                         "use backend='torch' or 'auto'.")
    patch = find_patch(model)
    decoder = patch.decoder(model)
    state = getattr(model, "_hf_paged_state", None)
    if state is None:
        original = model.config._attn_implementation or "eager"
        name = _PREFIX + original
        compat.register_attention(name, _make_attention(original), _make_mask(original))
        handles = (
            decoder.register_forward_pre_hook(_pre_hook, with_kwargs=True),
            decoder.register_forward_hook(_post_hook, with_kwargs=True, always_call=True),
        )
        for sub in model.modules():
            if hasattr(sub, "layer_idx") and hasattr(sub, "head_dim"):
                sub._hf_paged_eager = patch.eager_attention
        compat.set_attn_implementation(model, name)
        if hasattr(model, "_get_stopping_criteria"):
            unpatched = model._get_stopping_criteria
            model._get_stopping_criteria = lambda *a, **kw: _ReleaseFinishedRows(unpatched(*a, **kw))
        if hasattr(model, "generate"):
            model.generate = _wrap_generate(model.generate)
        state = model._hf_paged_state = {"original": original, "handles": handles, "decoder": decoder}
    decoder._hf_paged_backend = backend
    return model


def disable_paged_attention(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_paged_attention`: the original attention implementation, no hooks."""
    state = getattr(model, "_hf_paged_state", None)
    if state is None:
        return model
    for handle in state["handles"]:
        handle.remove()
    compat.set_attn_implementation(model, state["original"])
    model.__dict__.pop("_get_stopping_criteria", None)
    model.__dict__.pop("generate", None)
    for sub in model.modules():
        sub.__dict__.pop("_hf_paged_eager", None)
    state["decoder"].__dict__.pop("_hf_paged_backend", None)
    del model._hf_paged_state
    return model


def is_paged(model: nn.Module) -> bool:
    return getattr(model, "_hf_paged_state", None) is not None
