"""Scale-out: tensor-parallel ranks hold only their KV heads, and device-mapped layers keep their pools on their device.

Tensor parallelism runs two gloo ranks on CPU under torchrun (``tests/_tp_worker.py``), loading tiny random models
saved here with ``tp_plan="auto"``, and compares them with one process: same tokens as ``DynamicCache``, half the
KV bytes per rank, and ``memory_stats(all_ranks=True)`` equal to the single-process figure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from helpers import dynamic, generate, left_padded, tiny_model
from hf_paged import PagedCache, enable_paged_attention
from hf_paged.ops import AttentionMetadata
from hf_paged.step import GroupStep, Step, StepBuffers
from hf_paged.distributed import gather_stats, sum_over_ranks

WORKER = Path(__file__).with_name("_tp_worker.py")
WORLD_SIZE = 2
BLOCK_SIZE = 4
LENGTHS = [3, 9, 6]
MAX_NEW_TOKENS = 8
MODELS = {
    # 4 query heads, 2 KV heads: each of the two ranks gets one KV head.
    "llama": dict(seed=0),
    "mistral": dict(seed=1, sliding_window=6),
}
LAUNCH_TIMEOUT_S = 180


def _tp_unavailable() -> str | None:
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return "torch.distributed has no gloo backend, which the CPU tensor-parallel run needs"
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
    except OSError as e:
        return f"cannot open a local socket for the process group rendezvous: {e}"
    return None


def _single_process(path: Path, inputs: dict) -> dict:
    """What one process computes: DynamicCache tokens, and the PagedCache's tokens and memory figures."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = generate(model, inputs, dynamic(model), max_new_tokens=MAX_NEW_TOKENS)
    enable_paged_attention(model, backend="torch")
    cache = PagedCache(model.config, block_size=BLOCK_SIZE, release_finished=False)
    paged = generate(model, inputs, cache, max_new_tokens=MAX_NEW_TOKENS)
    allocator = cache.pool.allocator
    return {
        "tokens": expected.tolist(),
        "paged_tokens": paged.tolist(),
        "num_kv_heads": model.config.num_key_value_heads,
        "block_tables": [allocator.block_table(seq) for seq in allocator.sequences],
        "stats": cache.memory_stats().as_dict(),
    }


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """Save the tiny models, compute the single-process figures, then run both models on two ranks."""
    reason = _tp_unavailable()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("tp")
    inputs = left_padded(LENGTHS)
    single = {}
    for kind, kw in MODELS.items():
        tiny_model(kind, **kw).save_pretrained(work / kind)
        single[kind] = _single_process(work / kind, inputs)
    torch.save({"models": list(MODELS), "block_size": BLOCK_SIZE, "max_new_tokens": MAX_NEW_TOKENS, **inputs},
               work / "job.pt")

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}",
           str(WORKER), str(work)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: a hung rank can be killed with it
    try:
        stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun did not finish in {LAUNCH_TIMEOUT_S} s: {' '.join(cmd)}\n{stderr[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"torchrun exited with {proc.returncode}: {' '.join(cmd)}\n"
                    f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-6000:]}")
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    return single, ranks


@pytest.mark.parametrize("kind", list(MODELS))
def test_tp_tokens_match_single_process_dynamic_cache(tp_run, kind):
    single, ranks = tp_run
    assert single[kind]["paged_tokens"] == single[kind]["tokens"]
    for rank in ranks:
        assert rank[kind]["tokens"] == single[kind]["tokens"], f"rank {rank['_meta']['rank']}"


@pytest.mark.parametrize("kind", list(MODELS))
def test_tp_rank_holds_only_its_kv_heads(tp_run, kind):
    single, ranks = tp_run
    local_heads = single[kind]["num_kv_heads"] // WORLD_SIZE
    whole = single[kind]["stats"]
    for rank in ranks:
        mine = rank[kind]
        assert mine["k_proj_heads"] == [local_heads] * len(mine["k_proj_heads"])
        assert [shape[2] for shape in mine["pool_shapes"]] == mine["k_proj_heads"]  # [num_blocks, bs, Hkv, D]
        assert mine["stats"]["bytes_in_use"] * WORLD_SIZE == whole["bytes_in_use"]
        assert mine["stats"]["bytes_reserved"] * WORLD_SIZE == whole["bytes_reserved"]
        assert mine["stats"]["bytes_per_block"] * WORLD_SIZE == whole["bytes_per_block"]
        # The allocator is deterministic: every rank, and the single process, lay the blocks out the same way.
        assert mine["block_tables"] == single[kind]["block_tables"]
        counts = {k: v for k, v in mine["stats"].items() if not k.startswith("bytes")}
        assert counts == {k: v for k, v in whole.items() if not k.startswith("bytes")}


@pytest.mark.parametrize("kind", list(MODELS))
def test_tp_all_ranks_sum_equals_single_process(tp_run, kind):
    single, ranks = tp_run
    for rank in ranks:
        assert rank[kind]["all_ranks"] == single[kind]["stats"]
        assert rank["_meta"]["world_size"] == WORLD_SIZE and "gloo" in rank["_meta"]["backend"]


def test_tp_sum_refuses_ranks_with_different_counts(tp_run):
    _, ranks = tp_run
    assert all(rank["_meta"]["differing_counts_rejected"] for rank in ranks)


def test_sum_over_ranks_without_process_group_is_identity(llama):
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized in this pytest process")
    enable_paged_attention(llama, backend="torch")
    cache = PagedCache(llama.config, block_size=BLOCK_SIZE)
    generate(llama, left_padded([5]), cache, max_new_tokens=3)
    stats = cache.memory_stats()
    assert stats.bytes_in_use > 0
    assert gather_stats(stats) == [stats]
    assert sum_over_ranks(stats) is stats
    assert cache.memory_stats(all_ranks=True) == stats


# ---------------------------------------------------------------------------------------------------------------------
# device_map: each layer's pool on that layer's device and dtype
# ---------------------------------------------------------------------------------------------------------------------

NUM_LAYERS = 4


def _cast_floats(obj, dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    return obj


def _run_in_dtype(layer: torch.nn.Module, dtype: torch.dtype, outer: torch.dtype) -> None:
    """Cast ``layer`` to ``dtype``; its inputs are cast in and its output back out, as accelerate does for devices."""
    layer.to(dtype)
    layer.register_forward_pre_hook(
        lambda m, args, kwargs: (_cast_floats(args, dtype), {k: _cast_floats(v, dtype) for k, v in kwargs.items()}),
        with_kwargs=True,
    )
    layer.register_forward_hook(lambda m, args, output: _cast_floats(output, outer))


def _placements():
    cpu = {i: ("cpu", torch.bfloat16 if i in (1, 2) else torch.float32) for i in range(NUM_LAYERS)}
    yield pytest.param(cpu, id="cpu-mixed-dtype")
    gpus = torch.cuda.device_count()
    spread = {i: (f"cuda:{i * gpus // NUM_LAYERS}", torch.float32) for i in range(NUM_LAYERS)}
    yield pytest.param(spread, id="cuda-multi-device", marks=pytest.mark.skipif(
        gpus < 2, reason=f"needs >= 2 CUDA devices to span a device_map across them, found {gpus}"))


@pytest.mark.parametrize("placement", _placements())
def test_device_map_pool_follows_each_layer(tmp_path, placement):
    tiny_model("llama", seed=2, num_hidden_layers=NUM_LAYERS).save_pretrained(tmp_path)
    first, last = placement[0][0], placement[NUM_LAYERS - 1][0]
    device_map = {"model.embed_tokens": first, "model.rotary_emb": first, "model.norm": last, "lm_head": last,
                  **{f"model.layers.{i}": device for i, (device, _) in placement.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device_map, dtype=torch.float32).eval()
    for i, (_, dtype) in placement.items():
        if dtype != torch.float32:
            _run_in_dtype(model.model.layers[i], dtype, torch.float32)
    inputs = {k: v.to(first) for k, v in left_padded([4, 11, 7]).items()}

    expected = generate(model, inputs, dynamic(model), max_new_tokens=10)
    enable_paged_attention(model)
    cache = PagedCache(model.config, block_size=BLOCK_SIZE, release_finished=False)
    out = generate(model, inputs, cache, max_new_tokens=10)
    assert torch.equal(out.cpu(), expected.cpu())

    pool = cache.pool
    expected_bytes_per_block = 0
    layer_devices = set()
    for i, layer in enumerate(model.model.layers):
        weight = layer.self_attn.k_proj.weight
        for kv in (pool.key_caches[i], pool.value_caches[i]):
            assert (kv.device, kv.dtype) == (weight.device, weight.dtype), f"layer {i}"
            assert kv.shape[1:] == (BLOCK_SIZE, model.config.num_key_value_heads, layer.self_attn.head_dim)
        expected_bytes_per_block += 2 * BLOCK_SIZE * model.config.num_key_value_heads * \
            layer.self_attn.head_dim * weight.element_size()
        layer_devices.add(weight.device)
    assert cache.memory_stats().bytes_per_block == expected_bytes_per_block
    assert {k.dtype for k in pool.key_caches.values()} == {dtype for _, dtype in placement.values()}
    # The last step's tensors were built on the host and copied once to each device, whatever the layer count.
    step = cache.last_step
    assert {device for _, device in step._on_device} == layer_devices
    assert len(step._on_device) == len(layer_devices)  # one group


def test_step_moves_once_per_device():
    group = GroupStep(slot_mapping=torch.tensor([5, 9]), attention=AttentionMetadata(
        block_tables=torch.tensor([[1, 0], [2, 3]], dtype=torch.int32), seq_lens=torch.tensor([2, 6], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32), max_query_len=1, max_seq_len=4))
    step = Step(batch_size=2, query_len=1, max_query_len=1, no_history=False, token_index=None, write_index=None,
                groups=[group], backend="torch", static=True)  # a compiled decode step
    buffers = StepBuffers()
    meta = torch.device("meta")  # stands in for a second device on a CPU-only machine
    moved, packing = step.device_view(0, meta, buffers)
    assert step.device_view(0, meta, buffers)[0] is moved  # every layer on that device gets the one copy
    assert moved.slot_mapping.device == meta and moved.attention.block_tables.device == meta
    assert moved.attention.seq_lens.device == meta
    assert packing == (None, None)
    on_cpu, _ = step.device_view(0, torch.device("cpu"), buffers)
    assert torch.equal(on_cpu.attention.block_tables, group.attention.block_tables)
    # A compiled decode step stages its tensors in buffers that the next one with the same shapes reuses in place;
    # an eager step just moves them.
    groups = [GroupStep(group.slot_mapping + 1, dataclasses.replace(group.attention,
                                                                    seq_lens=group.attention.seq_lens + 1))]
    again = Step(batch_size=2, query_len=1, max_query_len=1, no_history=False, token_index=None, write_index=None,
                 groups=groups, backend="torch", static=True)
    staged, _ = again.device_view(0, torch.device("cpu"), buffers)
    assert staged.attention.seq_lens.data_ptr() == on_cpu.attention.seq_lens.data_ptr() and staged.attention.seq_lens.tolist() == [3, 7]
    eager = Step(batch_size=2, query_len=1, max_query_len=1, no_history=False, token_index=None, write_index=None,
                 groups=groups, backend="torch")
    moved_only, _ = eager.device_view(0, torch.device("cpu"), buffers)
    assert moved_only.attention.seq_lens.data_ptr() != on_cpu.attention.seq_lens.data_ptr()
    assert moved_only.attention.seq_lens.tolist() == [3, 7]
