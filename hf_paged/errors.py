"""Exceptions raised by hf_paged."""

from __future__ import annotations


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


class OutOfBlocksError(RuntimeError):
    """The block pool cannot hold what was asked of it.

    The cache and the pool are left exactly as they were before the request, so the caller can free sequences,
    ``reset()`` the cache, or retry with a larger pool.

    Attributes:
        needed: blocks this step needed (new blocks plus copy-on-write copies).
        free: blocks it could have had (free, evictable cached, and room the pool may still grow into).
        block_size: tokens per block.
        capacity: the pool's cap in blocks (``None``: unknown).
        request_needed: blocks the whole request would hold at ``max_new_tokens`` (``None``: not worked out).
        max_new_tokens: the request's ``max_new_tokens`` (``None``: not known), for the message.
        fix: the one call that would fit the request, as the raiser built the pool (e.g.
            ``"BlockPool(num_blocks=64)"``); ``None`` gives general advice instead.

    Example::

        cache = PagedCache(model.config, num_blocks=2)
        try:
            model.generate(**inputs, cache=cache, max_new_tokens=256)
        except OutOfBlocksError as err:
            print(err.needed, err.free, err.request_needed, err.fix)
    """

    def __init__(self, needed: int, free: int, block_size: int, capacity: int | None = None, detail: str = "", *,
                 request_needed: int | None = None, max_new_tokens: int | None = None, fix: str | None = None):
        self.needed, self.free, self.block_size, self.capacity = needed, free, block_size, capacity
        self.request_needed, self.max_new_tokens, self.fix = request_needed, max_new_tokens, fix
        cap = f" of {capacity}" if capacity is not None else ""
        message = (f"KV block pool exhausted: this step needed {_blocks(needed)} of {block_size} tokens, "
                   f"{free}{cap} free. ")
        if request_needed is not None:
            at = f"max_new_tokens={max_new_tokens}" if max_new_tokens is not None else "its max_new_tokens"
            message += f"The whole request holds up to {_blocks(request_needed)} at {at}. "
        message += detail
        if fix is not None:
            message += (f"To fit it: {fix}; or shorten max_new_tokens, use a smaller batch, or free other sequences "
                        "sharing this pool.")
        else:
            message += ("Give the pool more room where it is built (num_blocks=N or max_memory='4GiB'; None grows on "
                        "demand), shorten max_new_tokens, use a smaller batch, or free other sequences sharing this "
                        "pool.")
        super().__init__(message)


class CacheFileError(ValueError):
    """A cache file given to :meth:`~hf_paged.PagedCache.load` is malformed, corrupt, or does not fit the model or
    the pool. ``path`` and ``field`` (a metadata field or tensor name) say where; nothing was bound, sized or
    allocated in the pool."""

    def __init__(self, path, field: str, problem: str, hint: str | None = None):
        self.path, self.field = str(path), field
        hint = hint or ("Save it again with cache.save(path); a file that passed through other hands may have been "
                        "altered.")
        super().__init__(f"cache file {self.path}: {field}: {problem}. {hint}")
