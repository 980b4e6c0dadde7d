"""Exceptions raised by hf_paged."""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """The block pool cannot hold what was asked of it.

    The cache and the pool are left exactly as they were before the request, so the caller can free sequences,
    ``reset()`` the cache, or retry with a larger pool.
    """

    def __init__(self, needed: int, free: int, block_size: int, capacity: int | None = None, detail: str = ""):
        self.needed, self.free, self.block_size, self.capacity = needed, free, block_size, capacity
        cap = f" of {capacity}" if capacity is not None else ""
        super().__init__(
            f"KV block pool exhausted: needed {needed} blocks of {block_size} tokens, {free}{cap} free. "
            f"{detail}Give the pool more room: PagedCache(config, num_blocks=N) or max_memory='4GiB' "
            "(None grows on demand), shorten max_new_tokens, use a smaller batch, or free other sequences "
            "sharing this pool."
        )


class CacheFileError(ValueError):
    """A cache file given to :meth:`~hf_paged.PagedCache.load` is malformed, corrupt, or does not fit the model or
    the pool. ``path`` and ``field`` (a metadata field or tensor name) say where; nothing was bound, sized or
    allocated in the pool."""

    def __init__(self, path, field: str, problem: str, hint: str | None = None):
        self.path, self.field = str(path), field
        hint = hint or ("Save it again with cache.save(path); a file that passed through other hands may have been "
                        "altered.")
        super().__init__(f"cache file {self.path}: {field}: {problem}. {hint}")
