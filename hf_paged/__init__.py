"""hf_paged: PagedAttention for Hugging Face transformers' ``generate()``.

    from hf_paged import PagedCache, enable_paged_attention
    enable_paged_attention(model)
    out = model.generate(**inputs, cache=PagedCache(model.config), max_new_tokens=256)
"""

from . import ops
from .allocator import BlockAllocator
from .attention import is_paged, paged_backend
from .enable import (
    attach_paged_attention, disable_paged_attention, enable_paged_attention, generate_batch, init_continuous_batching,
)
from .cache import PagedCache
from .embedded import local_model_dir as embedded_model_dir
from .engine import EngineStats, GenerationOutput, QueueFullError, RequestStatus, RequestTooLargeError
from .engine.manager import ContinuousBatchingManager
from .engine.transformers_api import engine_of, keep_engine
from .errors import CacheFileError, OutOfBlocksError
from .pool import BlockPool, parse_memory
from .stats import MemoryStats

__version__ = "0.1.0"

__all__ = [
    "BlockAllocator",
    "BlockPool",
    "CacheFileError",
    "ContinuousBatchingManager",
    "EngineStats",
    "GenerationOutput",
    "MemoryStats",
    "OutOfBlocksError",
    "PagedCache",
    "QueueFullError",
    "RequestStatus",
    "RequestTooLargeError",
    "attach_paged_attention",
    "disable_paged_attention",
    "embedded_model_dir",
    "engine_of",
    "enable_paged_attention",
    "generate_batch",
    "init_continuous_batching",
    "is_paged",
    "keep_engine",
    "ops",
    "paged_backend",
    "parse_memory",
]

