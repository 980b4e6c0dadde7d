"""Every difference between supported transformers releases lives here.

Supported and tested: 4.56.0 (``MIN_TRANSFORMERS``) to 5.25 (``TESTED_LATEST``; pyproject declares ``<5.26``).
CI runs the end-to-end tests on 4.56.0 (``make test-oldest``), the newest release on the registry (``make
test-latest``), the main venv's and 5.24.0 (the hybrid and assisted-decoding files: ``scripts/test_transformers.sh``);
4.57.6, 5.0.0, 5.4.0 and 5.23.0 (and 4.55.4, which fails: see below) were run through the same tests by hand. A
release above the tested range runs with one warning naming the range (:func:`untested_version_warning`).
What changed inside that range, and where this module absorbs it:

- 4.56.0: ``Cache(layers=...)`` / ``DynamicCache(config=...)`` appear (4.55 built caches from ``layer_classes`` and
  created layer objects itself, which a cache with its own bookkeeping cannot satisfy: hence the floor).
- 5.4.0: ``cache_position`` leaves the model forwards; ``get_mask_sizes(cache_position)`` becomes
  ``get_mask_sizes(query_length)`` (:func:`query_length`); ``update()`` loses its positional ``cache_kwargs``.
- 5.14.0: generate() crops with ``crop(-n)`` (before: ``crop(new_length)``); ``PagedCache.crop`` takes both.
- 5.24.0: the cache argument is renamed ``past_key_values`` -> ``cache`` (:data:`GENERATE_CACHE_KWARG`);
  ``update()`` gets ``kwargs=``.
- 5.25.0: state mixers read ``get_recurrent_states_to_keep`` / ``is_recording_past`` / ``increase_count`` and hand
  back intermediate recurrent states; generate() passes ``activate_past_recording(recurrent_states_to_keep=)``
  (:data:`STATE_ROLLBACK`: hybrids' assisted decoding rolls the states back); transformers imports the Hub's
  ``kernels`` package when one is importable.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import warnings

import torch
import transformers
from packaging.version import Version
from transformers import GenerationConfig
from transformers.cache_utils import Cache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.models.auto.configuration_auto import model_type_to_module_name

try:  # 5.x: the cache layer types DynamicCache builds, KV sharing and MLP-only layers included
    from transformers.cache_utils import get_layer_types_and_kwargs
except ImportError:  # 4.x
    get_layer_types_and_kwargs = None
try:  # 5.x: the base of transformers' linear-attention (state) cache layers
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
except ImportError:  # 4.x
    LinearAttentionCacheLayerMixin = None
try:  # transformers' own continuous batching settings (the demo compares its generate_batch)
    from transformers.generation import ContinuousBatchingConfig
except ImportError:  # before ContinuousBatchingConfig
    ContinuousBatchingConfig = None
try:  # heterogeneous configs (Gemma 4's per_layer_config) refuse a per-layer attribute read globally
    from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError
except ImportError:  # before heterogeneous configs
    class AmbiguousGlobalPerLayerAttributeError(Exception):
        """Never raised by this transformers."""

TRANSFORMERS_VERSION = Version(transformers.__version__)
# Keep in step with pyproject.toml ("transformers>=4.56.0,<5.26") and the Makefile's test-oldest (which pins it).
MIN_TRANSFORMERS = Version("4.56.0")
# The newest minor release tested (every patch release of it): pyproject's upper bound is the next minor.
TESTED_LATEST = Version("5.25")
TESTED_RANGE = f"{MIN_TRANSFORMERS} to {TESTED_LATEST}.x"


def untested_version_warning(version: Version = TRANSFORMERS_VERSION) -> str | None:
    """The warning for a transformers above the tested range (None inside it): each minor release has changed the
    cache contract hf_paged implements, so an untested one may give other tokens without failing."""
    if version.release[:2] <= TESTED_LATEST.release[:2]:
        return None
    return (f"hf_paged is tested with transformers {TESTED_RANGE}; this is {version}, above the tested range: "
            "check its outputs against DynamicCache (or pin transformers<"
            f"{TESTED_LATEST.major}.{TESTED_LATEST.minor + 1}).")


if untested_version_warning() is not None:
    warnings.warn(untested_version_warning(), UserWarning, stacklevel=2)

# generate() and the model forwards took the cache as past_key_values until 5.24.0 renamed it cache (first in
# 5.24.0: 5.23.0's generate() rejects cache= as an unused model kwarg). The old name warns from 5.24.0 on and goes
# in 5.40.0 (forwards) / 6.0.0 (generate).
CACHE_RENAMED = TRANSFORMERS_VERSION >= Version("5.24.0")
GENERATE_CACHE_KWARG = "cache" if CACHE_RENAMED else "past_key_values"
FORWARD_CACHE_KWARG = GENERATE_CACHE_KWARG  # model(**inputs, **{FORWARD_CACHE_KWARG: cache})

# From 5.25.0 the state mixers (Mamba, Mamba2, Gated DeltaNet, ...) ask the cache how many intermediate recurrent
# states a multi-token forward should hand back (``get_recurrent_states_to_keep``) and generate() passes that number to
# ``activate_past_recording(recurrent_states_to_keep=)``: a cache can then roll a hybrid model's states back after
# rejected drafts. Before, a state layer's intermediate states were never handed out, so a rollback was impossible.
STATE_ROLLBACK_SINCE = Version("5.25.0")
STATE_ROLLBACK = LinearAttentionCacheLayerMixin is not None and "recurrent_states_to_keep" in inspect.signature(
    LinearAttentionCacheLayerMixin.activate_past_recording).parameters

# A model directory saved by transformers 5 (tokenizer_class "TokenizersBackend") does not load in 4.x: directories
# this package saves (the embedded model's conversion) get this suffix so the two majors never share one.
# The top-h warper (generate()'s ``top_h``) arrived after the oldest supported transformers: None where absent.
TopHLogitsWarper = getattr(transformers, "TopHLogitsWarper", None)

SAVED_DIR_SUFFIX = "" if TRANSFORMERS_VERSION.major >= 5 else "-transformers4"

# Names the decoder's forward has used for the cache argument, newest first.
CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")


def init_cache_base(cache: Cache) -> None:
    """Run ``Cache.__init__`` with no layers (``PagedCache`` keeps its own bookkeeping); same call 4.56 -> 5.x."""
    Cache.__init__(cache, layers=[])
    cache.layers = []


def query_length(arg) -> int:
    """``get_mask_sizes`` takes the query length (5.4.0 on) or a ``cache_position`` tensor (before)."""
    if isinstance(arg, torch.Tensor):
        return int(arg.shape[0])
    return int(arg)


# From 5.24.0 the attention modules call ``cache.update(k, v, layer_idx, kwargs=kwargs)`` with the very dict they
# then unpack into the attention function, so update() can hand the attention its step tensors. Before, update()
# got a separate ``cache_kwargs`` dict, and the attention finds the running forward's cache another way.
STEP_IN_ATTENTION_KWARGS = CACHE_RENAMED


# The cache of the running forward, in this thread/task: the decoder's hooks push it (or None for another cache)
# before the forward and pop it after. The mask builder asks it whether the forward needs a mask at all; before
# 5.24 the attention function also finds its layer's step through it, and KV-shared layers their source's on any.
_FORWARDS = contextvars.ContextVar("hf_paged_forwards", default=())


def forward_begins(cache) -> None:
    _FORWARDS.set(_FORWARDS.get() + (cache,))


def forward_ends() -> None:
    if _FORWARDS.get():
        _FORWARDS.set(_FORWARDS.get()[:-1])


def running_cache():
    """The cache of the forward running in this thread (None outside one, or for a cache hf_paged does not own)."""
    forwards = _FORWARDS.get()
    return forwards[-1] if forwards else None


def attention_kwargs(kwargs: dict) -> dict:
    """The dict ``update()`` can add entries to for the attention function (a throwaway dict where there is none)."""
    shared = kwargs.get("kwargs")
    return shared if isinstance(shared, dict) else {}


def rename_cache_kwarg(kwargs: dict, stacklevel: int) -> None:
    """A ``generate(past_key_values=...)`` call on 5.24+: warn at the caller's line (transformers' own warning would
    point into this package's wrapper) and pass the cache under its new name."""
    if CACHE_RENAMED and kwargs.get("past_key_values") is not None and kwargs.get("cache") is None:
        warnings.warn("`past_key_values` is deprecated for generate() (removed in transformers 6.0.0); pass the "
                      "cache as `cache=` instead.", FutureWarning, stacklevel=stacklevel + 1)
        kwargs["cache"] = kwargs.pop("past_key_values")


def cache_from_kwargs(kwargs: dict):
    for name in CACHE_KWARGS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


# transformers' attention and mask-builder registries (the same modules 4.56 -> 5.x), by implementation name: what a
# model's attention implementation names. Eager's attention is no entry: each modeling file has its own
# (``eager_attention_forward``); its mask builder is.
ATTENTION_FUNCTIONS = ALL_ATTENTION_FUNCTIONS
MASK_FUNCTIONS = ALL_MASK_ATTENTION_FUNCTIONS


def use_attention(model, name: str, attention=None, mask=None) -> None:
    """Set ``model``'s attention implementation to ``name``; with ``attention`` (an attention function) and ``mask``
    (its mask builder), first register both under ``name`` in transformers' interfaces. The one step that changes a
    model's attention: transformers then calls them, this module never does. A model without
    ``set_attn_implementation`` (not a ``PreTrainedModel``) gets the config attribute set."""
    if (attention is None) != (mask is None):
        raise ValueError("use_attention registers an attention function and its mask builder together: pass both or "
                         "neither.")
    if attention is not None:
        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, mask)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def config_dtype(config):
    """The dtype a config names (``dtype`` from 4.56's rename on; ``torch_dtype`` before), or None."""
    dtype = config.__dict__.get("dtype", None)
    if dtype is None:
        dtype = config.__dict__.get("torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def generation_defaults() -> dict:
    """The values ``generate()`` uses for unset generation settings (top_k=50, num_beams=1, ...); a new dict.

    From 5.x a fresh ``GenerationConfig`` leaves them None and ``generate()`` fills them from
    ``GenerationConfig._get_default_generation_params()``; before that they were the config's own defaults.
    """
    return dict(_generation_defaults())


@functools.lru_cache(maxsize=1)
def _generation_defaults() -> dict:
    defaults = dict(GenerationConfig().to_dict())
    filler = getattr(GenerationConfig, "_get_default_generation_params", None)
    if filler is not None:
        defaults.update({key: value for key, value in filler().items() if defaults.get(key) is None})
    return defaults


def cache_layer_types(config) -> list[str] | None:
    """Per decoder layer, the cache layer type transformers' own ``DynamicCache`` builds (``"full_attention"``,
    ``"sliding_attention"``, ``"chunked_attention"``, ``"dummy"`` for KV-sharing and MLP-only layers, ``"conv"``,
    ``"linear_attention"``, ``"hybrid"``, ...), from ``get_layer_types_and_kwargs`` where this transformers has it
    (5.x); ``config.layer_types`` (or None) before."""
    if get_layer_types_and_kwargs is None or getattr(config, "per_layer_config", None) is None:
        types = getattr(config, "layer_types", None)
        return list(types) if types is not None else None
    return list(get_layer_types_and_kwargs(config)[0])


def modeling_module_name(model_type: str) -> str:
    """The ``transformers.models.<name>`` package of a ``model_type`` (``"gemma3_text"`` -> ``"gemma3"``)."""
    return model_type_to_module_name(model_type)


def global_config_value(config, name: str):
    """``config.<name>``, or None where a heterogeneous config keeps it per layer (Gemma 4's ``num_key_value_heads``,
    ``head_dim``: read them from the KV geometry, ``hf_paged.patches.kv_geometry``)."""
    try:
        return getattr(config, name, None)
    except AmbiguousGlobalPerLayerAttributeError:
        return None
