"""CPU kernels in C beside their PyTorch references: the decode part of the torch backend's paged attention,
int8 weight-only linears for a decode step's few rows, and the engine's lean forward's bf16 rotary and RMSNorm.

``decode_attention.c`` (next to this file) reads each decode row's K/V straight from the pool's blocks through its
block table: no gather of the blocks into a copy and no SDPA call per part, which at 8 decode rows of ~270
positions cost ~0.35 ms a layer on a 2-core CPU (about a fifth of a SmolLM2 decode step); see docs/bench/cpu.md.
``int8_linear.c`` multiplies a few rows by int8 weights with one scale per output channel
(:class:`hf_paged.engine.cpu_linears.Int8Linear`): a decode step's linears read each weight once, so their time is
the weights' bytes, half of bf16's; torch's ``_weight_int8pack_mm`` took longer than the packed bf16 GEMM it was
to beat. ``rotary.c`` and ``rms_norm.c`` compute what transformers' rotate-half rotary and RMSNorm compute in
torch, bit for bit, in one call each (``patches/lean.py``). All are compiled once per machine with the system's C compiler (``$CC`` or ``cc``: ``-O3 -march=native -fopenmp``,
under ``$HF_PAGED_CACHE/kernels``, ~1 s) and called through ``ctypes``; without a compiler, or with
``HF_PAGED_CPU_KERNELS=0``, the PyTorch reference runs.

The decode attention is used for bf16 models (:data:`DTYPES`): fp32 keeps SDPA, whose roundings the fp32
token-equality tests pin. Its results, and the int8 linears', agree with their references to the output dtype's
rounding (fp32 accumulation, exact softmax), not bit for bit; the rotary and RMSNorm agree bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCES = tuple(HERE / f"{name}.c" for name in ("decode_attention", "int8_linear", "rotary", "rms_norm"))  # one library
HEADERS = (HERE / "cpu_vec.h",)
DTYPES = (torch.bfloat16,)  # where the engine and PagedCache use the kernel (it also computes fp32, for tests)
_ELEM = {torch.bfloat16: 2, torch.float32: 4}


def enabled() -> bool:
    """Whether the C kernels may run (``HF_PAGED_CPU_KERNELS=0`` turns them off)."""
    return os.environ.get("HF_PAGED_CPU_KERNELS", "1") != "0"


def _cache_dir() -> Path:
    root = os.environ.get("HF_PAGED_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_paged")
    return Path(root) / "kernels"


def _cpu_key() -> str:
    """What a ``-march=native`` build depends on: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The compiled kernels (built at the first call, then loaded from the cache); None where no C compiler builds
    them (a warning says why, once)."""
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256(source + _cpu_key().encode() + compiler.encode()).hexdigest()[:16]
    path = _cache_dir() / f"cpu_kernels-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(built),
                   *map(str, SOURCES)]
            try:
                subprocess.run(cmd, check=True, capture_output=True, timeout=120)
            except (OSError, subprocess.SubprocessError) as err:
                detail = getattr(err, "stderr", b"") or b""
                warnings.warn(f"hf_paged: the CPU kernels (decode attention, int8 linears, rotary, RMSNorm) did not build "
                              f"({' '.join(cmd[:1])}: {err}; {detail.decode(errors='replace')[-300:]}); the PyTorch "
                              "path runs instead (set CC to a C compiler with OpenMP to build it).", RuntimeWarning,
                              stacklevel=3)
                return None
            os.replace(built, path)  # atomic: another process may be building the same file
    lib = ctypes.CDLL(str(path))
    fn = lib.hf_paged_decode_attention
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    fn = lib.hf_paged_int8_linear
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int]
    fn = lib.hf_paged_rotary
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3
    fn = lib.hf_paged_rms_norm
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    return lib


MAX_HEAD_DIM, MAX_GROUP = 256, 8  # the kernel's register budget: head sizes a multiple of 16 up to this, GQA groups


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the model path hands these to :func:`decode_attention` (CPU tensors of one of :data:`DTYPES`, the
    cache contiguous, a head size that is a multiple of 16 up to 256, at most 8 query heads per KV head, the
    kernels on)."""
    head_dim, group = query.shape[-1], query.shape[-2] // key_cache.shape[2]
    return (enabled() and query.device.type == "cpu" and query.dtype in DTYPES and key_cache.dtype == query.dtype
            and key_cache.is_contiguous() and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM
            and group <= MAX_GROUP)


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, tables: torch.Tensor,
                     mask: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """Attention of one query per row over its blocks: ``query`` ``[S, Hq, D]``, caches ``[num_blocks, block, Hkv,
    D]``, ``tables`` ``[S * nb]`` int64 (each row's ``nb`` blocks), ``mask`` ``[S, 1, 1, nb * block]`` bool or None
    -> ``[S, Hq, D]``, as ``reference._decode_attention`` over the gathered blocks computes it. None when the kernel
    is not built (the caller runs the reference)."""
    lib = library()
    if lib is None:
        return None
    rows, num_q_heads, head_dim = query.shape
    _, block, num_kv_heads, _ = key_cache.shape
    nb = tables.numel() // max(1, rows)
    query = query.contiguous()
    tables = tables.to(torch.int64).contiguous()
    flat_mask = None if mask is None else mask.reshape(rows, nb * block).contiguous().view(torch.uint8)
    out = torch.empty_like(query)
    lib.hf_paged_decode_attention(query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(),
                                  None if flat_mask is None else flat_mask.data_ptr(), out.data_ptr(), rows,
                                  num_q_heads, num_kv_heads, head_dim, block, nb, float(scale),
                                  _ELEM[query.dtype], torch.get_num_threads())
    return out


INT8_MAX_ROWS = 32  # above this many rows the products, not the weights' bytes, bound the time: oneDNN's GEMM runs


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ (qweight * scales[:, None]).T + bias`` for ``x`` ``[rows, k]`` (bf16 or fp32, CPU), ``qweight`` ``[n, k]``
    int8, ``scales`` ``[n]`` fp32, ``bias`` ``[n]`` in x's dtype or None -> ``[rows, n]`` in x's dtype, as
    :func:`int8_linear_reference` computes it to the output's rounding. None where the kernel does not take it (more
    than :data:`INT8_MAX_ROWS` rows, ``k`` not a multiple of 16, another dtype or device, non-contiguous weights, the
    kernels off or not built): the caller runs torch's."""
    rows, k = x.shape
    if not (enabled() and 0 < rows <= INT8_MAX_ROWS and k % 16 == 0 and x.device.type == "cpu" and x.dtype in _ELEM
            and qweight.dtype == torch.int8 and qweight.is_contiguous() and scales.dtype == torch.float32):
        return None
    lib = library()
    if lib is None:
        return None
    x = x.contiguous()
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    out = torch.empty(rows, qweight.shape[0], dtype=x.dtype)
    lib.hf_paged_int8_linear(x.data_ptr(), qweight.data_ptr(), scales.data_ptr(),
                             None if bias is None else bias.data_ptr(), out.data_ptr(), rows, qweight.shape[0], k,
                             _ELEM[x.dtype], torch.get_num_threads())
    return out


def int8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """What :func:`int8_linear` computes, in float64, rounded once to x's dtype."""
    weight = qweight.double() * scales.double()[:, None]
    out = x.double() @ weight.T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotate-half rotary on the heads of ``x`` ``[T, H, D]`` (bf16; each token's heads back to back, tokens at any
    stride: a view of a fused q/k/v GEMM's output) with ``cos``/``sin`` ``[T, D]``: ``[T, H, D]`` contiguous, equal bit
    for bit to torch's ``(x * cos) + (rotate_half(x) * sin)``. None where the kernel does not take it (another
    dtype, ``D`` not a multiple of 32, the kernels off or not built)."""
    tokens, heads, dim = x.shape
    if not (enabled() and x.dtype == torch.bfloat16 and x.device.type == "cpu" and dim % 32 == 0
            and x.stride(2) == 1 and x.stride(1) == dim and cos.dtype == sin.dtype == x.dtype
            and cos.shape == sin.shape == (tokens, dim)):
        return None
    lib = library()
    if lib is None:
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(tokens, heads, dim, dtype=x.dtype)
    lib.hf_paged_rotary(x.data_ptr(), x.stride(0), tokens, heads, dim, cos.data_ptr(), sin.data_ptr(), out.data_ptr())
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Transformers' RMSNorm (Llama's and its descendants'), in torch's operations."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


_RMS_AGREES: dict[int, bool] = {}  # row width -> whether the kernel equals rms_norm_reference in this process


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """:func:`rms_norm_reference` of bf16 rows ``x`` ``[..., n]`` with a bf16 ``weight`` ``[n]`` in one call
    (``rms_norm.c``), bit for bit: the kernel sums the squares in ATen's order, which is checked once per row
    width against torch in this process. None where it does not take the call (another dtype, a strided row, a
    width whose check failed, the kernels off or not built)."""
    n = x.shape[-1]
    if not (enabled() and x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.is_contiguous() and weight.is_contiguous() and weight.shape == (n,)):
        return None
    lib = library()
    if lib is None:
        return None
    agrees = _RMS_AGREES.get(n)
    if agrees is None:
        gen = torch.Generator().manual_seed(n)
        probe = (torch.randn(5, n, generator=gen) * torch.exp2(torch.randint(-8, 8, (5, n), generator=gen))).to(x.dtype)
        probe_weight = torch.randn(n, generator=gen).to(x.dtype)
        got = _rms_norm_call(lib, probe, probe_weight, 1e-6)
        agrees = _RMS_AGREES[n] = torch.equal(got, rms_norm_reference(probe, probe_weight, 1e-6))
    return _rms_norm_call(lib, x, weight, eps) if agrees else None


def _rms_norm_call(lib, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    lib.hf_paged_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
                          float(eps))
    return out
