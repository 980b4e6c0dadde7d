"""The ahead-of-time kernel build check (``python -m hf_paged check-kernels``) catches what it is there to catch.

Tiny kernels written to a temporary module are built for sm_90 in worker processes (no GPU needed, a few seconds
each): a good one passes; a compile error, a tile whose shared memory exceeds the target's limit, and a default
variant that spills each fail the check.
"""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

pytest.importorskip("triton")

from hf_paged.tools import kernel_check as kc  # noqa: E402

TINY_KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _spill_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)  # every element stays live until the sum is known
    tl.store(y_ptr + offs, x - tl.sum(x, 0))


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):  # pipelined over num_stages: one shared-memory buffer of A and B per stage
        a = tl.load(a_ptr + offs_m[:, None] * K + (k + offs_k)[None, :])
        b = tl.load(b_ptr + (k + offs_k)[:, None] * BLOCK_N + offs_n[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + offs_m[:, None] * BLOCK_N + offs_n[None, :], acc)
'''


def _copy(module: str, block: int) -> kc.Variant:
    signature = (("x_ptr", "*fp32"), ("y_ptr", "*fp32"), ("n", "i32"), ("BLOCK", "constexpr"))
    return kc.Variant(f"{module}:_copy_kernel", signature, (("BLOCK", block),), ("x_ptr", "y_ptr"))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One check over four tiny variants (one worker pool): built once, judged by each test."""
    root = tmp_path_factory.mktemp("kernel_check")
    module = root / "tiny_kernels.py"
    module.write_text(textwrap.dedent(TINY_KERNELS))
    m = str(module)
    spill = kc.Variant(f"{m}:_spill_kernel", (("x_ptr", "*fp32"), ("y_ptr", "*fp32"), ("BLOCK", "constexpr")),
                       (("BLOCK", 8192),), ("x_ptr", "y_ptr"), num_warps=1)
    matmul_sig = (("a_ptr", "*fp16"), ("b_ptr", "*fp16"), ("c_ptr", "*fp32"), ("K", "i32"),
                  ("BLOCK_M", "constexpr"), ("BLOCK_N", "constexpr"), ("BLOCK_K", "constexpr"))
    # 4 stages x (64x256 + 256x64) fp16 = 256 KiB of shared memory: over sm_90's 227 KiB per block.
    matmul = kc.Variant(f"{m}:_matmul_kernel", matmul_sig, (("BLOCK_M", 64), ("BLOCK_N", 64), ("BLOCK_K", 256)),
                        ("a_ptr", "b_ptr", "c_ptr", "K"), num_warps=4, num_stages=4)
    variants = dict(good=_copy(m, 1024), broken=_copy(m, 1000), spill=spill, smem=matmul)
    captured = [(kc.Config("decode", "fp32", 64), 90, list(variants.values()))]
    result = kc.check(captured, jobs=2, cache_dir=root / "triton-cache")
    by_name = {name: next(b for b in result.builds if b.variant == v) for name, v in variants.items()}
    return result, by_name


def _problems_of(build: kc.Build, **report_fields) -> list[str]:
    return kc.Report([build], configs=1, seconds=0.0, **report_fields).problems()


def test_good_kernel_passes_with_its_resources(report):
    _, builds = report
    good = builds["good"]
    assert good.error is None and good.spill_bytes == 0
    assert 0 < good.regs <= 255
    assert good.warps_per_sm == 64  # a small copy fills the SM
    assert _problems_of(good) == []


def test_compile_error_fails_and_names_the_variant(report):
    _, builds = report
    problems = _problems_of(builds["broken"])
    assert len(problems) == 1
    assert problems[0].startswith("build error") and "BLOCK=1000" in problems[0] and "sm_90" in problems[0]


def test_shared_memory_over_the_limit_fails(report):
    _, builds = report
    smem = builds["smem"]
    assert smem.error is None
    assert smem.smem > kc.TARGETS[90].smem_per_block
    assert smem.warps_per_sm == 0  # it cannot even launch
    assert any("shared memory" in p for p in _problems_of(smem))


def test_spills_fail_only_in_default_variants(report):
    _, builds = report
    spill = builds["spill"]
    assert spill.error is None and spill.spill_bytes > 0
    assert spill.default  # its configuration is a default one
    assert any(p.startswith("spills") for p in _problems_of(spill))
    assert _problems_of(spill, allow_spills=True) == []
    assert _problems_of(dataclasses.replace(spill, default=False)) == []


def test_whole_report_fails_when_any_build_does(report):
    result, _ = report
    assert len(result.builds) == 4
    assert len(result.problems()) == 3  # broken, shared memory, spill; the good copy adds none


def test_occupancy_is_limited_by_registers_and_shared_memory():
    sm90 = kc.TARGETS[90]
    assert kc.occupancy(32, 0, 4, sm90) == 64  # warp limit
    assert kc.occupancy(128, 0, 4, sm90) == 16  # 65536 / (128 * 32) = 16 warps
    assert kc.occupancy(255, 0, 8, sm90) == 8  # 255 rounds up to 256 registers: 8 warps, one block of 8
    assert kc.occupancy(32, 100 * 1024, 4, sm90) == 8  # 228 KiB / (100 + 1) KiB = 2 blocks
    assert kc.occupancy(32, 200 * 1024, 4, kc.TARGETS[80]) == 0  # over sm_80's 164 KiB


def test_capture_specialises_like_the_jit():
    """The launchers' own launches, recorded on meta tensors: what the GPU's JIT would compile."""
    configs = [kc.Config("decode", "bf16", 128, 4, splits=3), kc.Config("decode", "bf16", 128, 4)]
    captured = kc.capture_in_worker(kc.KERNELS_MODULE, configs, (90,), kc.default_cache_dir())
    (split_cfg, arch, split), (_, _, plain) = captured
    assert arch == 90
    assert [v.kernel.rsplit(":", 1)[1] for v in split] == ["_decode_kernel", "_merge_splits_kernel"]
    (decode,) = plain
    consts = dict(decode.constexprs)
    assert consts["stride_cd"] == 1  # a contiguous head_dim: the JIT turns the 1 into a constant
    assert consts["num_splits"] == 1 and consts["GROUP"] == 4 and consts["HEAD_DIM"] == 128
    assert {"query_ptr", "k_cache_ptr", "stride_ch"} <= set(decode.aligned)  # multiples of 16: tt.divisibility
    assert "stride_bt_seq" not in decode.aligned  # the block table's width is odd here
    assert len(kc.build_list(captured)) == 3


def test_check_kernels_ships_in_the_wheel_and_runs_from_main(capsys):
    """``hf_paged.tools`` is one of pyproject's packages (every package directory is), so ``python -m hf_paged
    check-kernels`` finds its module in an installed wheel; the command reaches it."""
    import tomllib
    from pathlib import Path

    from hf_paged.__main__ import main

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "hf_paged").rglob("__init__.py")
             if "patches" not in p.parts}
    assert "hf_paged.tools" in found and found <= listed
    with pytest.raises(SystemExit) as exit_info:
        main(["check-kernels", "--help"])
    assert exit_info.value.code == 0 and "check-kernels" in capsys.readouterr().out
