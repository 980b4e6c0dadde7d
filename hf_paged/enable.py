"""The public switches of the paged path: :func:`attach_paged_attention` (what the engine needs),
:func:`enable_paged_attention` (also ``generate()`` with a :class:`~hf_paged.PagedCache`) and
:func:`disable_paged_attention`. Each is the attention path's own switch (``attention.py``) plus transformers'
continuous-batching methods on the model (``model.generate_batch`` & co., routed to hf_paged's engine:
``engine/transformers_api.py``), so code written for transformers' continuous batching (TRL's rollouts) runs on it.
"""

from __future__ import annotations

from torch import nn

import functools

from . import attention
from .engine import factory, transformers_api
from .engine.cpu_linears import prepare_cpu_linears


def attach_paged_attention(model: nn.Module, backend: str = "auto") -> nn.Module:
    """Put a supported model's attention on the paged path, without touching ``generate()``; returns the model.

    What the continuous-batching engine needs, and only that: the paged attention function (and its mask builder)
    registered through transformers' ``AttentionInterface`` and set as the model's implementation, and the decoder
    hooks that tell the attention which step a forward runs. A forward handed a planned step (the engine's) reads
    K/V straight from the pool's blocks (``backend="torch"``: the PyTorch path, ``"triton"``: the kernels,
    ``"auto"``: Triton on CUDA, torch otherwise); with any other cache, or none, the model computes exactly what it
    computed before. ``generate()`` with a :class:`PagedCache` needs :func:`enable_paged_attention` (a model only
    attached raises a ``ValueError`` saying so). Calling it twice is harmless (the second call may change the
    backend), as is calling it on a model already enabled (whose ``generate()`` wrappers stay);
    :func:`disable_paged_attention` undoes it.

    Example::

        model = attach_paged_attention(AutoModelForCausalLM.from_pretrained(path))
        outputs = hf_paged.generate_batch(model, [tokenizer(p).input_ids for p in prompts], max_new_tokens=64)
    """
    attention.attach_attention(model, backend)
    transformers_api.install(attention.generating_model(model))  # model.generate_batch & co. on hf_paged's engine
    return model


def enable_paged_attention(model: nn.Module, backend: str = "auto") -> nn.Module:
    """Put a supported model on the paged attention path for ``generate()`` with a :class:`PagedCache`; returns the
    model.

    :func:`attach_paged_attention` (the paged attention and the decoder hooks), plus wrappers around the model's
    ``generate()``, its input preparation and its stopping criteria: they plan each step of the call on the host
    (outside a compiled region), start rows from cached prefixes and give finished rows' blocks back. With a
    :class:`PagedCache` the attention reads K/V straight from the pool's blocks (``backend="torch"``: the PyTorch
    path, ``"triton"``: the kernels, ``"auto"``: Triton on CUDA, torch otherwise). With any other cache, or none, the
    model computes exactly what it computed before. Calling it twice is harmless (the second call may change the
    backend); on a model already attached it adds only the wrappers. :func:`disable_paged_attention` undoes it.
    ``python -m hf_paged models`` lists the supported model families; others raise a ``ValueError`` naming the
    missing feature. A wrapper whose ``generate()`` calls an inner model's (a peft ``PeftModel``) is enabled on that
    inner model (:func:`generating_model`): LoRA adapters, ``set_adapter`` and ``merge_and_unload`` keep paging.

    Example::

        model = enable_paged_attention(AutoModelForCausalLM.from_pretrained(path))
        out = model.generate(**inputs, cache=PagedCache(model.config), max_new_tokens=64)
    """
    attention.enable_generate(model, backend)
    transformers_api.install(attention.generating_model(model))
    return model


def disable_paged_attention(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_paged_attention` or :func:`attach_paged_attention`: the original attention
    implementation, no hooks, no wrappers, plain ``nn.Linear`` layers (the engine's prepacked CPU copies of the
    weights freed)."""
    if attention.is_paged(model):
        transformers_api.uninstall(attention.generating_model(model))  # transformers' own generate_batch & co.
        prepare_cpu_linears(model, "eager")
    return attention.detach(model)


def _attached_after(build):
    """``build`` (the engine's factory function), then transformers' continuous-batching methods on the model if the
    engine attached its attention: a model the engine put on the paged path is attached as
    :func:`attach_paged_attention` attaches it, so a later ``model.generate_batch(...)`` runs on hf_paged's engine
    rather than transformers' own refusing the paged attention."""

    @functools.wraps(build)
    def wrapper(model, *args, **kwargs):
        out = build(model, *args, **kwargs)
        if attention.is_paged(model):
            transformers_api.install(attention.generating_model(model))
        return out

    return wrapper


init_continuous_batching = _attached_after(factory.init_continuous_batching)
generate_batch = _attached_after(factory.generate_batch)
