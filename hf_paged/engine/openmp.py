"""The engine thread's CPU parallelism: the OpenMP worker threads of the thread that starts it are let go.

PyTorch's CPU builds run their parallel ops on OpenMP (libgomp), which keeps a pool of worker threads for every
thread that has run a parallel region. When the workers of all pools outnumber the CPUs, libgomp's workers spin only
briefly (its "throttled" spin count) before sleeping, and each of a decode step's few hundred short parallel regions
pays a wake-up. The user's thread has nearly always run torch before it starts the engine (loading the model), so its
pool exists, idle, beside the engine thread's: measured on a 2-core VM, the embedded SmolLM2's 8-row decode step took
55.8 ms on the engine thread with that pool alive and 41.0 ms without it (a loop of ``torch.add``: 2x). Letting the
caller's pool go (``omp_pause_resource_all``, OpenMP 5.0) before the engine thread starts removes the penalty; the
caller's pool comes back the next time that thread runs a parallel op (a later ``start`` lets it go again).
"""

from __future__ import annotations

import ctypes
import functools

import torch

_OMP_PAUSE_SOFT = 1


@functools.lru_cache(maxsize=None)
def _runtime():
    """The OpenMP runtime torch runs on (libgomp: already loaded with torch), or None."""
    if not torch.backends.openmp.is_available():
        return None
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=ctypes.RTLD_GLOBAL | getattr(ctypes, "RTLD_NOLOAD", 0))
    except OSError:  # another runtime (LLVM's libomp, Intel's), or none loaded: nothing to let go
        return None
    fn = getattr(lib, "omp_pause_resource_all", None)
    if fn is None:
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def release_caller_threads() -> bool:
    """Let the calling thread's idle OpenMP workers go (soft pause); True when the runtime did. Never call it from
    inside a parallel region (OpenMP forbids it; the engine calls it from the thread that starts it)."""
    pause = _runtime()
    return pause is not None and pause(_OMP_PAUSE_SOFT) == 0
