"""Build every Triton kernel variant the dispatcher can choose, for real GPUs, on a machine without one.

    python -m hf_paged check-kernels                 # CI: defaults + the slice, sm_80 and sm_90; non-zero on a problem
    python -m hf_paged check-kernels --full          # the whole product (hours: see "What is built")
    python -m hf_paged check-kernels --only "prefill fp32"   # configurations whose label matches
    python -m hf_paged check-kernels --problems      # print only the builds that spill or fail
    python -m hf_paged check-kernels --kernels-module /tmp/try/triton_kernels.py --allow-spills   # explore a copy

How: each configuration (kernel x dtype x head_dim x GQA group x block_size x split-KV) is pushed through the real
launchers (``paged_attention_triton``, ``write_kv_triton``) on ``meta`` tensors, with the kernels swapped for
recorders; each recorded launch is specialised the way Triton's JIT would specialise it (ints equal to 1 become
constants, multiples of 16 and pointers get ``tt.divisibility``) and becomes a ``Variant``. Configurations that give
the same variant are built once. Each variant is compiled with ``triton.compile(ASTSource(...),
target=GPUTarget("cuda", arch, 32))`` in worker processes without ``TRITON_INTERPRET`` (under the interpreter
``@triton.jit`` functions are not compilable), with Triton's cache under ``~/.cache/hf_paged/triton``. Registers and
spill (``STACK``) bytes come from the wheel's ``cuobjdump -res-usage``; shared memory from the build metadata plus the
cubin's static shared memory; occupancy = warps resident per SM, limited by registers, shared memory and the SM's
warp and block limits.

Fails (exit 1) on: a build error; shared memory above the target's per-block limit; spills in a default variant
(``--allow-spills`` turns that into a warning, for exploring).

What is built. "Default" variants are those users get without opting in: block_size 16 (``PagedCache``'s
default) and KV in the model's dtype; a spill there fails the check. Opt-in variants (other block sizes, fp8 KV) are
checked for build errors and shared memory, and their spills are listed.
    * The CI set (the default run, ~210 builds): every dtype (fp16, bf16, fp32) x head dim (64, 80, 96, 128, 256) at
      block_size 16 through every kernel: decode, decode with split-KV and its merge (3 splits: SPLITS_P 4), prefill
      (a 512-query prompt), the KV write (8 KV heads). The GQA group is rotated over those 15 shapes (1, 2, ..., 8,
      1, ...), so every group meets every kernel: the group changes tile masks and head indices, not the tile shape
      (decode: 16 query heads for groups 1-8; prefill: 64 (query, head) entries of BLOCK_Q x GROUP_P). Plus the
      shapes of models users run (``MODEL_SHAPES``: Llama-3.2-1B, Llama-3.1-8B, Qwen2.5-7B, Gemma2 with soft-capping,
      gpt-oss with sinks, SmolLM2), and an opt-in slice at bf16, d128, group 4: fp8 KV, block sizes 8 and 128, 32 splits
      (SPLITS_P 32), a 4-query extend (a smaller BLOCK_Q). And MLA's latent attention (``hf_paged.ops.triton_mla``) at
      DeepSeek-V3's shape (rank 512, rope 64, 128 heads): decode (also split-KV with its merge) and a 512-query prefill
      in bf16 and fp16 (defaults), fp32 and an fp8 pool (opt-in). And batched LoRA's shrink / expand kernels
      (``hf_paged.ops.triton_lora``) at ranks 8, 16 and 64.
    * ``--full`` (~8,500 builds: hours on 2 cores): dtype x head dim x group 1-8 x block size 8-128 x {decode, split
      decode, prefill of 512 and of 4 queries}, fp8 KV for fp16/bf16, every merge width (SPLITS_P 2-32), KV writes for
      1-32 KV heads, soft-capping and sinks in every dtype.
    Argument values are those of a contiguous pool and queries (the JIT's specialisation: strides of 1 constant,
    head_dim multiples of 16 aligned); the block table is given an odd width, the less favourable case.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import itertools
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..allocator import cdiv
from ..ops.metadata import AttentionMetadata

# triton is imported inside the functions that use it: it is optional, and a worker must clear TRITON_INTERPRET
# (_worker_init) before triton is first imported, since triton picks interpreter or compiler at import.

KERNELS_MODULE = "hf_paged.ops.triton_kernels"
MLA_MODULE = "hf_paged.ops.triton_mla"  # MLA's latent attention: configurations of kind "mla_decode" / "mla_prefill"
LORA_MODULE = "hf_paged.ops.triton_lora"  # batched LoRA's shrink / expand: configurations of kind "lora"
LORA_SHAPE = (256, 4096, 4096)  # tokens, in_features, out_features of the checked launch (Llama-3.1-8B's q_proj)
# DeepSeek-V3's attention: kv_lora_rank 512 (Config.head_dim), qk_rope_head_dim 64, 128 heads (Config.group)
MLA_RANK, MLA_ROPE, MLA_HEADS = 512, 64, 128
DEFAULT_ARCHS = (80, 90)
DTYPES = ("fp16", "bf16", "fp32")
FP8_QUERY_DTYPES = ("fp16", "bf16")
HEAD_DIMS = (64, 80, 96, 128, 256)
GROUPS = tuple(range(1, 9))
BLOCK_SIZES = (8, 16, 32, 64, 128)
DEFAULT_BLOCK_SIZE = 16
DEFAULT_SPLITS = 3  # split-KV on: the merge kernel's SPLITS_P is 4
ALL_SPLITS = (2, 8, 16, 32)  # the other SPLITS_P (16 and 32 also give num_splits divisibility by 16)
PREFILL_QUERY_LEN = 512  # a prompt: the largest query tile
SHORT_QUERY_LEN = 4  # an extend / speculative verification: a smaller BLOCK_Q
DEFAULT_KV_HEADS = 8
KV_HEADS = (1, 2, 4, 8, 32)
CONTEXT_LEN = 4096
# (dtype, head_dim, group, features) of models users run: Llama-3.2-1B, Llama-3.1-8B / Mistral-7B, Qwen2.5-7B,
# Gemma2-9B (soft-capping), gpt-oss (sinks), SmolLM2-135M (the embedded model, fp32 on CPU but any dtype on a GPU).
MODEL_SHAPES = (
    ("bf16", 64, 4, ()), ("bf16", 128, 4, ()), ("bf16", 128, 7, ()), ("bf16", 256, 2, ("softcap",)),
    ("bf16", 64, 8, ("sinks",)), ("fp32", 64, 3, ()),
)


@dataclass(frozen=True)
class TargetLimits:
    """Per-SM resources of a CUDA target (NVIDIA's tuning guides; the same for sm_80 and sm_90 but shared memory)."""

    arch: int
    smem_per_sm: int
    smem_per_block: int  # opt-in maximum a block may use
    smem_reserved_per_block: int = 1024
    regs_per_sm: int = 65536
    reg_alloc_unit: int = 256  # registers are handed to warps in units of 256
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32


TARGETS = {
    80: TargetLimits(80, smem_per_sm=164 * 1024, smem_per_block=163 * 1024),
    90: TargetLimits(90, smem_per_sm=228 * 1024, smem_per_block=227 * 1024),
}


# --------------------------------------------------------------------------------------------------------------------
# What to build
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One input to the dispatcher. ``kind``: "decode" (``splits`` 1 = no split-KV), "prefill" or "write_kv"; or
    "mla_decode" / "mla_prefill" (``head_dim`` is then the latent's rank, ``group`` the number of heads, the rope
    width ``MLA_ROPE``).

    ``kv_dtype``: "same" (the pool holds ``dtype``) or "fp8" (e4m3 bits in uint8, bf16 scales per slot and KV head).
    ``default``: a configuration users get without opting in (spills there fail the check); the others are the explored
    slice.
    """

    kind: str
    dtype: str
    head_dim: int
    group: int = 1
    block_size: int = DEFAULT_BLOCK_SIZE
    splits: int = 1
    query_len: int = 1
    num_kv_heads: int = DEFAULT_KV_HEADS
    kv_dtype: str = "same"
    softcap: bool = False
    sinks: bool = False
    default: bool = field(default=True, compare=False)

    def label(self) -> str:
        if self.kind == "lora":  # head_dim holds the adapters' (padded) rank
            return f"lora {self.dtype} r{self.head_dim}"
        parts = [self.kind, self.dtype if self.kv_dtype == "same" else f"{self.dtype}/{self.kv_dtype}-kv",
                 f"d{self.head_dim}", f"kv{self.num_kv_heads}" if self.kind == "write_kv" else f"G{self.group}",
                 f"bs{self.block_size}"]
        if self.kind in ("decode", "mla_decode"):
            parts.append(f"split{self.splits}" if self.splits > 1 else "nosplit")
        if self.kind in ("prefill", "mla_prefill"):
            parts.append(f"q{self.query_len}")
        parts += ["softcap"] * self.softcap + ["sinks"] * self.sinks
        return " ".join(parts)


def _attention_configs(default: bool, **common) -> list[Config]:
    """Decode without and with split-KV, and a long prefill, for one shape."""
    return [Config("decode", splits=1, default=default, **common),
            Config("decode", splits=DEFAULT_SPLITS, default=default, **common),
            Config("prefill", query_len=PREFILL_QUERY_LEN, default=default, **common)]


def configurations(full: bool = False) -> list[Config]:
    """The dispatcher inputs to build (``full``: the whole product; see the module docstring for both sets)."""
    return _full_product() if full else _ci_set()


def _ci_set() -> list[Config]:
    configs = []
    for i, (dtype, head_dim) in enumerate(itertools.product(DTYPES, HEAD_DIMS)):
        group = GROUPS[i % len(GROUPS)]  # rotated: every group meets every kernel
        configs += _attention_configs(True, dtype=dtype, head_dim=head_dim, group=group)
        configs.append(Config("write_kv", dtype, head_dim))
    for dtype, head_dim, group, feature in MODEL_SHAPES:
        configs += _attention_configs(True, dtype=dtype, head_dim=head_dim, group=group, **{f: True for f in feature})
    configs += _attention_configs(False, dtype="bf16", head_dim=128, group=4, kv_dtype="fp8")
    configs.append(Config("write_kv", "bf16", 128, kv_dtype="fp8", default=False))
    for block_size in (8, 128):
        configs += _attention_configs(False, dtype="bf16", head_dim=128, group=4, block_size=block_size)
    configs.append(Config("decode", "bf16", 128, 4, splits=32, default=False))  # merge with SPLITS_P 32
    configs.append(Config("prefill", "bf16", 128, 4, query_len=SHORT_QUERY_LEN, default=False))
    return configs + _mla_configs() + _lora_configs()


def _lora_configs() -> list[Config]:
    """Batched LoRA (``hf_paged.ops.triton_lora``) at ranks 8, 16, 64 (``head_dim`` holds the rank): fp16 / bf16
    (default), fp32 (opt-in)."""
    return [Config("lora", dtype, rank, default=dtype != "fp32") for dtype in DTYPES for rank in (8, 16, 64)]


def _mla_configs() -> list[Config]:
    """MLA at DeepSeek-V3's shape: decode (without and with split-KV and its merge) and prefill in fp16/bf16
    (default), fp32 and fp8 pools (opt-in)."""
    configs = []
    for dtype, kv_dtype, default in (("bf16", "same", True), ("fp16", "same", True), ("fp32", "same", False),
                                     ("bf16", "fp8", False)):
        common = dict(dtype=dtype, head_dim=MLA_RANK, group=MLA_HEADS, kv_dtype=kv_dtype, default=default)
        configs += [Config("mla_decode", **common), Config("mla_decode", splits=DEFAULT_SPLITS, **common),
                    Config("mla_prefill", query_len=PREFILL_QUERY_LEN, **common)]
    return configs


def _full_product() -> list[Config]:
    configs = []
    for dtype, head_dim, group, block_size in itertools.product(DTYPES, HEAD_DIMS, GROUPS, BLOCK_SIZES):
        default = block_size == DEFAULT_BLOCK_SIZE
        common = dict(dtype=dtype, head_dim=head_dim, group=group, block_size=block_size)
        configs += _attention_configs(default, **common)
        configs.append(Config("prefill", query_len=SHORT_QUERY_LEN, default=default, **common))
        if dtype in FP8_QUERY_DTYPES:
            configs += _attention_configs(False, kv_dtype="fp8", **common)
    for dtype, head_dim, splits in itertools.product(DTYPES, HEAD_DIMS, ALL_SPLITS):
        configs.append(Config("decode", dtype, head_dim, 4, splits=splits))
    for dtype, head_dim, kv_heads, block_size in itertools.product(DTYPES, HEAD_DIMS, KV_HEADS, BLOCK_SIZES):
        default = block_size == DEFAULT_BLOCK_SIZE
        configs.append(Config("write_kv", dtype, head_dim, block_size=block_size, num_kv_heads=kv_heads,
                              default=default))
        if dtype in FP8_QUERY_DTYPES:
            configs.append(Config("write_kv", dtype, head_dim, block_size=block_size, num_kv_heads=kv_heads,
                                  kv_dtype="fp8", default=False))
    for dtype, (head_dim, group, feature) in itertools.product(DTYPES, [m[1:] for m in MODEL_SHAPES if m[3]]):
        configs += _attention_configs(True, dtype=dtype, head_dim=head_dim, group=group, **{f: True for f in feature})
    return configs


# --------------------------------------------------------------------------------------------------------------------
# Variants: what Triton would compile for a launch
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One compiled kernel: the kernel, its argument types, constexpr values, aligned args and launch options.

    ``kernel`` is ``"module:function"``; the module is a dotted name or a path to a ``.py`` file.
    """

    kernel: str
    signature: tuple  # ((arg name, triton type or "constexpr"), ...) in argument order
    constexprs: tuple  # ((arg name, value), ...)
    aligned: tuple = ()  # arg names Triton marks tt.divisibility=16
    num_warps: int = 4
    num_stages: int = 2

    def label(self) -> str:
        """Compact: kernel, input dtype, constexprs (flags only when on), scalars the JIT saw divisible by 16."""
        name = self.kernel.rsplit(":", 1)[1].strip("_").removesuffix("_kernel")
        types = dict(self.signature)
        dtype = next((t[1:] for t in types.values() if t.startswith("*")), "")
        kv = types.get("k_cache_ptr", "*")[1:]
        parts = [name, dtype if kv in ("", dtype) else f"{dtype}/{kv}"]
        consts = dict(self.constexprs)
        for k, v in self.constexprs:
            if k.startswith(("DOT_", "stride")) or v is False or (k == "FP8_NATIVE" and not consts.get("KV_FP8")):
                continue
            parts.append(_short(k) if v is True else f"{_short(k)}={v}")
        parts += [f"{a}%16" for a in self.aligned if types[a][0] != "*" and not a.startswith("stride")
                  and a not in ("sliding_window", "chunk")]
        return " ".join(parts + [f"w{self.num_warps}s{self.num_stages}"])


_SHORT = {"BLOCK_SIZE": "BS", "HEAD_DIM": "D", "HEAD_DIM_P": "DP", "SPLIT_KV": "SPLIT", "GROUP": "G", "GROUP_P": "GP",
          "BLOCK_M": "M", "BLOCK_Q": "BQ", "TILE_N": "N", "USE_SOFTCAP": "SOFTCAP", "USE_SINKS": "SINKS",
          "num_splits": "splits", "HEADS_P": "HP", "SPLITS_P": "SP"}


def _short(name: str) -> str:
    return _SHORT.get(name, name)


_TORCH_TO_TRITON = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "uint8": "u8", "int8": "i8",
                    "int32": "i32", "int64": "i64", "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}


def variant_from_launch(jit_fn, kernel_ref: str, args: tuple, kwargs: dict) -> Variant:
    """The ``Variant`` Triton's JIT would compile for ``jit_fn[grid](*args, **kwargs)`` (mirrors its specialisation)."""
    from triton.backends.compiler import BaseBackend

    from triton._C.libtriton import native_specialize_impl

    kwargs = dict(kwargs)
    num_warps = kwargs.pop("num_warps", 4)
    num_stages = kwargs.pop("num_stages", 3)
    bound = jit_fn.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs, aligned = [], [], []
    for param in jit_fn.params:
        value = bound.arguments[param.name]
        if param.is_constexpr:
            signature.append((param.name, "constexpr"))
            constexprs.append((param.name, value))
            continue
        if value is None:
            signature.append((param.name, "constexpr"))
            constexprs.append((param.name, None))
            continue
        if isinstance(value, float):
            signature.append((param.name, "fp32"))
            continue
        ty, attr = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                          not param.do_not_specialize_on_alignment)
        if ty == "constexpr":  # an int equal to 1
            signature.append((param.name, "constexpr"))
            constexprs.append((param.name, attr))
            continue
        signature.append((param.name, ty))
        if attr and "D" in attr:
            aligned.append(param.name)
    return Variant(kernel_ref, tuple(signature), tuple(constexprs), tuple(aligned), int(num_warps), int(num_stages))


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the launch; any other
    attribute is the kernel's own (launchers may inspect the kernel)."""

    def __init__(self, jit_fn, name: str, launches: list):
        self.jit_fn, self.name, self.launches = jit_fn, name, launches

    def __getattr__(self, attr):
        return getattr(self.jit_fn, attr)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.name, args, kwargs))

        return launch


def load_module(ref: str):
    """Import a module by dotted name, or from a ``.py`` path (for checking modified copies of the kernels)."""
    if ref.endswith(".py"):
        path = Path(ref).resolve()
        name = f"_kernel_check_{abs(hash(str(path)))}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(ref)


def _meta_inputs(config: Config) -> dict:
    """Meta tensors laid out like a real batch of ``config``: contiguous, as the model and the pool produce them."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[config.dtype]
    kv_dtype = torch.uint8 if config.kv_dtype == "fp8" else dtype
    num_seqs, num_kv_heads, head_dim = 4, config.num_kv_heads, config.head_dim
    num_q_heads = num_kv_heads * config.group
    blocks_per_seq = cdiv(CONTEXT_LEN, config.block_size) + 1  # an odd width: no divisibility on its stride
    num_tokens = num_seqs * config.query_len
    pool = (num_seqs * blocks_per_seq, config.block_size, num_kv_heads, head_dim)
    empty = lambda *shape, dtype: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    scales = dict(k_scale=empty(*pool[:3], dtype=torch.bfloat16),  # [num_blocks, block_size, num_kv_heads] scale caches
                  v_scale=empty(*pool[:3], dtype=torch.bfloat16))
    return dict(
        query=empty(num_tokens, num_q_heads, head_dim, dtype=dtype),  # [num_tokens, num_q_heads, head_dim]
        key=empty(num_tokens, num_kv_heads, head_dim, dtype=dtype),  # [num_tokens, num_kv_heads, head_dim]
        key_cache=empty(*pool, dtype=kv_dtype),  # [num_blocks, block_size, num_kv_heads, head_dim]
        block_tables=empty(num_seqs, blocks_per_seq, dtype=torch.int32),  # [num_seqs, max_blocks_per_seq]
        seq_lens=empty(num_seqs, dtype=torch.int32),
        query_start_loc=empty(num_seqs + 1, dtype=torch.int32),
        slot_mapping=empty(num_tokens, dtype=torch.int64),
        scales=scales if config.kv_dtype == "fp8" else {},
        sinks=empty(num_q_heads, dtype=torch.float32),  # [num_q_heads]
    )


def _launch(module, config: Config) -> None:
    """Run the module's launcher for ``config`` (its kernels are recorders by then)."""
    if config.kind.startswith("mla"):
        _launch_mla(module, config)
        return
    if config.kind == "lora":
        _launch_lora(module, config)
        return
    t = _meta_inputs(config)
    if config.kind == "write_kv":
        module.write_kv_triton(t["key"], t["key"], t["key_cache"], t["key_cache"], t["slot_mapping"], **t["scales"])
        return
    features = dict(t["scales"])
    if config.softcap:
        features["softcap"] = 30.0
    if config.sinks:
        features["sinks"] = t["sinks"]
    meta = AttentionMetadata(t["block_tables"], t["seq_lens"], t["query_start_loc"], config.query_len, CONTEXT_LEN)
    module.paged_attention_triton(t["query"], t["key_cache"], t["key_cache"], meta, config.head_dim**-0.5,
                                  num_kv_splits=config.splits if config.kind == "decode" else None, **features)


def _launch_mla(module, config: Config) -> None:
    """The MLA launcher on meta tensors: absorbed queries, a latent and a rope cache of one head, block tables."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[config.dtype]
    kv_dtype = torch.uint8 if config.kv_dtype == "fp8" else dtype
    num_seqs, heads, rank = 4, config.group, config.head_dim
    blocks_per_seq = cdiv(CONTEXT_LEN, config.block_size) + 1
    num_tokens = num_seqs * config.query_len
    num_blocks = num_seqs * blocks_per_seq
    empty = lambda *shape, dtype: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    scales = {}
    if config.kv_dtype == "fp8":
        scales = dict(latent_scale=empty(num_blocks, config.block_size, 1, dtype=torch.bfloat16),
                      rope_scale=empty(num_blocks, config.block_size, 1, dtype=torch.bfloat16))
    meta = AttentionMetadata(empty(num_seqs, blocks_per_seq, dtype=torch.int32), empty(num_seqs, dtype=torch.int32),
                             empty(num_seqs + 1, dtype=torch.int32), config.query_len, CONTEXT_LEN)
    module.mla_attention_triton(empty(num_tokens, heads, rank, dtype=dtype),  # q_lat [N, H, R]
                                empty(num_tokens, heads, MLA_ROPE, dtype=dtype),  # q_rot [N, H, P]
                                empty(num_blocks, config.block_size, 1, rank, dtype=kv_dtype),  # latent cache
                                empty(num_blocks, config.block_size, 1, MLA_ROPE, dtype=kv_dtype),  # rope cache
                                meta, (rank // 4 + MLA_ROPE) ** -0.5,
                                num_kv_splits=config.splits if config.kind == "mla_decode" else None, **scales)


def _launch_lora(module, config: Config) -> None:
    """The batched-LoRA launcher on meta tensors: 8 adapters of rank ``config.head_dim``."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[config.dtype]
    tokens, in_features, out_features = LORA_SHAPE
    empty = lambda *shape, dtype: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    module.add_lora_triton(empty(tokens, out_features, dtype=dtype), empty(tokens, in_features, dtype=dtype),
                           empty(8, config.head_dim, in_features, dtype=dtype),  # lora_a [N, R, in]
                           empty(8, config.head_dim, out_features, dtype=dtype),  # lora_b [N, R, out]
                           empty(8, dtype=torch.float32), empty(tokens, dtype=torch.int32))


@contextmanager
def _recording(module, arch: int):
    """Swap the module's ``@triton.jit`` kernels for recorders and pin its compute capability to ``arch``.

    Yields ``(kernels, launches)``: the real kernels by name, and the list each launch is appended to.
    """
    import triton

    if getattr(module, "_INTERPRETED", False):
        raise RuntimeError(f"{module.__name__} was imported under TRITON_INTERPRET=1: unset it to build for a GPU.")
    kernels = {n: v for n, v in vars(module).items() if isinstance(v, triton.runtime.jit.JITFunction)}
    launches: list = []
    stand_ins = {n: _Recorder(fn, n, launches) for n, fn in kernels.items()}
    stand_ins["_check_runnable"] = lambda *a, **k: None  # meta tensors stand in for CUDA ones
    stand_ins["_capability"] = lambda *a, **k: arch  # what launch_choices specialises on (fp8 conversion)
    saved = {n: getattr(module, n) for n in stand_ins if hasattr(module, n)}
    if hasattr(module, "launch_choices") and "_capability" not in saved:
        raise RuntimeError(f"{module.__name__} has launch_choices but no _capability(device): the check pins the "
                           "target's compute capability through it; update kernel_check._recording to the new name.")
    clear = getattr(module, "clear_launch_specs", lambda: None)  # cached launches hold the capability made for
    try:
        for name, value in stand_ins.items():
            if name in saved:
                setattr(module, name, value)
        clear()
        yield kernels, launches
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
        clear()


def capture_variants(module_ref: str, configs: list[Config], archs) -> list[tuple[Config, int, list[Variant]]]:
    """For each configuration and target, the variants its launch compiles. Run where ``TRITON_INTERPRET`` is off.

    The launchers (``paged_attention_triton``, ``write_kv_triton``) run on meta tensors with the kernels recorded,
    so what is built is what they launch: the tile sizes, warps and stages ``launch_choices`` picks, and the
    argument values the JIT specialises on.
    """
    by_module = [(module_ref, [c for c in configs if not c.kind.startswith(("mla", "lora"))]),
                 (MLA_MODULE, [c for c in configs if c.kind.startswith("mla")]),
                 (LORA_MODULE, [c for c in configs if c.kind == "lora"])]
    out = []
    for ref, chosen in by_module:
        if not chosen:
            continue
        module = load_module(ref)
        for arch in archs:
            with _recording(module, arch) as (kernels, launches):
                for config in chosen:
                    launches.clear()
                    try:
                        _launch(module, config)
                    except Exception as e:
                        raise RuntimeError(f"launching {config.label()} on meta tensors failed: {e}") from e
                    variants = [variant_from_launch(kernels[n], f"{ref}:{n}", a, k) for n, a, k in launches]
                    out.append((config, arch, variants))
    return out


# --------------------------------------------------------------------------------------------------------------------
# Building (in worker processes)
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Build:
    """What one variant costs on one target."""

    variant: Variant
    arch: int
    regs: int = 0
    spill_bytes: int = 0  # STACK from cuobjdump: > 0 means registers spilled to local memory
    smem: int = 0  # dynamic (Triton's metadata.shared) + static shared memory, bytes per block
    seconds: float = 0.0
    error: str | None = None
    default: bool = False
    configs: int = 0  # how many configurations share this variant

    @property
    def warps_per_sm(self) -> int:
        return occupancy(self.regs, self.smem, self.variant.num_warps, TARGETS[self.arch])


def occupancy(regs: int, smem: int, num_warps: int, limits: TargetLimits) -> int:
    """Warps resident per SM for a kernel of ``num_warps`` warps: limited by registers, shared memory, warps, blocks."""
    unit = limits.reg_alloc_unit
    regs_per_warp = cdiv(max(regs, 1) * 32, unit) * unit
    blocks_by_regs = (limits.regs_per_sm // regs_per_warp) // num_warps
    blocks_by_smem = limits.smem_per_sm // (smem + limits.smem_reserved_per_block)
    blocks_by_warps = limits.max_warps_per_sm // num_warps
    blocks = min(blocks_by_regs, blocks_by_smem, blocks_by_warps, limits.max_blocks_per_sm)
    return blocks * num_warps


def default_cache_dir() -> Path:
    root = Path(os.environ.get("HF_PAGED_CACHE", Path.home() / ".cache" / "hf_paged"))
    return root / "triton"


def _worker_init(cache_dir: str) -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # before any kernel module is imported: @jit decides at definition
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is its default
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@contextmanager
def _workers(jobs: int, cache_dir: Path):
    """A pool of ``jobs`` spawned worker processes that start outside Triton's interpreter mode.

    A spawned worker copies this process's environment when it starts and imports this module (and so hf_paged and
    transformers' modeling code, which imports triton) before its initializer runs: ``TRITON_INTERPRET`` (which the
    test suite sets) is therefore left out of the environment while the workers start, not only dropped in
    :func:`_worker_init`.
    """
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init, initargs=(str(cache_dir),)) as pool:
            yield pool
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def _cuobjdump() -> str:
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    found = str(bundled) if bundled.exists() else shutil.which("cuobjdump")
    if not found:
        raise RuntimeError("cuobjdump not found: it ships with the triton wheel (triton/backends/nvidia/bin); "
                           "reinstall triton or put CUDA's cuobjdump on PATH.")
    return found


def resource_usage(cubin: bytes) -> dict:
    """``{"regs", "stack", "shared"}`` of the (single) function in ``cubin``, from ``cuobjdump -res-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)", text)
    if not found:
        raise RuntimeError(f"could not read REG/STACK/SHARED from cuobjdump -res-usage:\n{text}")
    regs, stack, shared = map(int, found.groups())
    return dict(regs=regs, stack=stack, shared=shared)


def build_variant(variant: Variant, arch: int) -> Build:
    """Compile ``variant`` for ``sm_{arch}`` and read its resources. Errors are returned, not raised."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    result = Build(variant, arch)
    try:
        module_ref, name = variant.kernel.rsplit(":", 1)
        fn = getattr(load_module(module_ref), name)
        if not hasattr(fn, "params"):
            raise RuntimeError(f"{variant.kernel} is not a compilable @triton.jit function (TRITON_INTERPRET set?)")
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in variant.aligned}
        source = ASTSource(fn=fn, signature=dict(variant.signature), constexprs=dict(variant.constexprs), attrs=attrs)
        options = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
        usage = resource_usage(compiled.asm["cubin"])
        result.regs, result.spill_bytes = usage["regs"], usage["stack"]
        result.smem = compiled.metadata.shared + usage["shared"]
    except Exception as e:  # noqa: BLE001 - a build error is a result to report
        result.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:400]
    result.seconds = time.perf_counter() - start
    return result


# --------------------------------------------------------------------------------------------------------------------
# Checking
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Report:
    builds: list[Build]
    configs: int
    seconds: float
    allow_spills: bool = False

    def problems(self) -> list[str]:
        out = []
        for b in self.builds:
            where = f"{b.variant.label()} on sm_{b.arch}"
            if b.error:
                out.append(f"build error: {where}: {b.error}")
                continue
            limit = TARGETS[b.arch].smem_per_block
            if b.smem > limit:
                out.append(f"shared memory {b.smem} B > sm_{b.arch}'s {limit} B per block: {where}; "
                           "use smaller tiles or fewer num_stages")
            if b.spill_bytes and b.default and not self.allow_spills:
                out.append(f"spills {b.spill_bytes} B (regs {b.regs}) in a default variant: {where}; "
                           "use smaller tiles or more num_warps")
        return out


def build_list(captured: list[tuple[Config, int, list[Variant]]]) -> list[Build]:
    """The build list: one ``Build`` per distinct (variant, arch), marked default when any default configuration
    launches it."""
    seen: dict[tuple[Variant, int], Build] = {}
    for config, arch, variants in captured:
        for v in variants:
            b = seen.setdefault((v, arch), Build(v, arch))
            b.default |= config.default
            b.configs += 1
    return list(seen.values())


def _cost(build: Build) -> int:
    consts = dict(build.variant.constexprs)
    return -int(consts.get("HEAD_DIM_P", 0)) * (2 if "prefill" in build.variant.kernel else 1)


def run_builds(builds: list[Build], jobs: int, cache_dir: Path, progress=None) -> list[Build]:
    """Compile every build of the build list ``builds`` in ``jobs`` worker processes (spawned without
    ``TRITON_INTERPRET``)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    order = sorted(builds, key=_cost)  # biggest first: the pool ends evenly
    done = []
    with _workers(jobs, cache_dir) as pool:
        futures = {pool.submit(build_variant, b.variant, b.arch): b for b in order}
        for i, future in enumerate(as_completed(futures), 1):
            listed = futures[future]
            b = future.result()
            b.default, b.configs = listed.default, listed.configs
            done.append(b)
            if progress:
                progress(i, len(order), b)
    return sorted(done, key=lambda b: (b.variant.kernel, b.variant.label(), b.arch))


def capture_in_worker(module_ref: str, configs: list[Config], archs, cache_dir: Path):
    """``capture_variants`` in a fresh process without ``TRITON_INTERPRET`` (this one may have it on)."""
    with _workers(1, cache_dir) as pool:
        return pool.submit(capture_variants, module_ref, configs, tuple(archs)).result()


def check(captured, jobs: int = 2, cache_dir: Path | None = None, allow_spills: bool = False,
          progress=None) -> Report:
    """Build each distinct variant of ``captured`` (``[(Config, arch, [Variant, ...]), ...]``) once and judge it."""
    start = time.perf_counter()
    builds = run_builds(build_list(captured), jobs, cache_dir or default_cache_dir(), progress)
    return Report(builds, len({c for c, _, _ in captured}), time.perf_counter() - start, allow_spills)


def _worker_cpu_seconds() -> float:
    """CPU time of the finished worker processes and their ptxas runs (a load-independent cost of the check)."""
    import resource  # here, not at the top: a Unix-only module, and only this report needs it

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def format_table(builds: list[Build]) -> str:
    """One row per build: variant, target, registers, spill bytes, shared memory, occupancy, default or not."""
    width = max([len(b.variant.label()) for b in builds] + [7])
    header = (f"{'variant':<{width}} {'target':>6} {'regs':>4} {'spill B':>7} {'smem KiB':>8} {'warps/SM':>8} "
              f"{'occup.':>6} {'default':>7} {'configs':>7}")
    lines = [header, "-" * len(header)]
    for b in builds:
        target = f"sm_{b.arch}"
        if b.error:
            lines.append(f"{b.variant.label():<{width}} {target:>6} BUILD ERROR: {b.error}")
            continue
        warps = b.warps_per_sm
        lines.append(
            f"{b.variant.label():<{width}} {target:>6} {b.regs:>4} {b.spill_bytes:>7} {b.smem / 1024:>8.1f} "
            f"{warps:>8} {warps / TARGETS[b.arch].max_warps_per_sm:>6.0%} {'yes' if b.default else 'no':>7} "
            f"{b.configs:>7}"
        )
    return "\n".join(lines)


def _to_json(report: Report) -> dict:
    rows = []
    for b in report.builds:
        row = asdict(b)
        row["variant"] = b.variant.label()
        row["kernel"] = b.variant.kernel
        row["warps_per_sm"] = None if b.error else b.warps_per_sm
        rows.append(row)
    return dict(configs=report.configs, seconds=report.seconds, builds=rows, problems=report.problems())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hf_paged check-kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default=",".join(map(str, DEFAULT_ARCHS)), help="CUDA compute capabilities (80,90)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes (default 2)")
    p.add_argument("--full", action="store_true", help="the whole product (hours on 2 cores; see above)")
    p.add_argument("--kernels-module", default=KERNELS_MODULE,
                   help="module (dotted name or .py path) whose launchers and kernels to check")
    p.add_argument("--only", metavar="REGEX", default=None,
                   help="build only configurations whose label matches, e.g. 'prefill fp32' or 'decode bf16 d256'")
    p.add_argument("--allow-spills", action="store_true", help="report spills in default variants, do not fail")
    p.add_argument("--problems", action="store_true", help="print only variants that spill or fail")
    p.add_argument("--cache-dir", type=Path, default=None, help="Triton's cache (default ~/.cache/hf_paged/triton)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write every build as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    archs = [int(a) for a in args.arch.split(",") if a]
    unknown = [a for a in archs if a not in TARGETS]
    if unknown:
        print(f"unknown --arch {unknown}: known {sorted(TARGETS)}", file=sys.stderr)
        return 2
    configs = configurations(args.full)
    if args.only:
        configs = [c for c in configs if re.search(args.only, c.label())]
    cache_dir = args.cache_dir or default_cache_dir()
    started = time.perf_counter()
    captured = capture_in_worker(args.kernels_module, configs, archs, cache_dir)
    distinct = len({(v, a) for _, a, vs in captured for v in vs})
    print(f"check-kernels: {len(configs)} configurations x {len(archs)} targets "
          f"({', '.join(f'sm_{a}' for a in archs)}) -> {distinct} distinct builds; {args.jobs} jobs, "
          f"cache {cache_dir}", flush=True)

    def progress(i, n, b):
        if i % 50 == 0 or i == n:
            print(f"  built {i}/{n} ({time.perf_counter() - started:.0f} s)", flush=True)

    report = check(captured, args.jobs, cache_dir, args.allow_spills, progress)
    rows = report.builds
    if args.problems:
        rows = [b for b in rows if b.error or b.spill_bytes or b.smem > TARGETS[b.arch].smem_per_block]
    print(format_table(rows))
    spilling = [b for b in report.builds if b.spill_bytes]
    print(f"\n{len(report.builds)} builds in {time.perf_counter() - started:.0f} s wall, {_worker_cpu_seconds():.0f} "
          f"CPU-s in the workers; {sum(b.error is not None for b in report.builds)} errors, {len(spilling)} spill "
          f"({sum(b.default for b in spilling)} default)")
    if args.json:
        Path(args.json).write_text(json.dumps(_to_json(report), indent=1, default=str) + "\n")
    problems = report.problems()
    for line in problems:
        print("FAIL " + line)
    if args.allow_spills:
        for b in spilling:
            if b.default:
                print(f"warning: spills {b.spill_bytes} B in default variant {b.variant.label()} on sm_{b.arch}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
