"""The engine's entry points: :func:`init_continuous_batching` builds a manager over a model (pool, scheduler, runner,
sampler, tensor-parallel channel), and :func:`generate_batch` runs a list of prompts through one."""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping

import torch
from tqdm.auto import tqdm

from .. import compat
from ..attention import attach_attention, is_paged, paged_backend
from ..groups import LayerGroups
from ..patches import check_engine_supported, check_model, kv_geometry
from . import features, graphs
from .core import EngineCore
from .cpu_linears import prepare_cpu_linears
from .distributed import AgreeingRunner, agree_on_pool, make_sync
from .kv import RequestKV
from .lora import DEFAULT_MAX_LORAS, AdapterSet
from .manager import DEFAULT_MAX_UNREAD, ContinuousBatchingManager, is_request_setting
from .multimodal import DEFAULT_ENCODER_CACHE_BYTES, MultimodalInputs, takes_images
from .options import (DEFAULT_ARRIVAL_WINDOW_S, DEFAULT_WATERMARK, context_limit, default_batch_tokens,
                      default_pool, from_continuous_batching_config)
from .outputs import GenerationOutput, RequestStatus
from .runner import ModelRunner
from .sampling import Sampler
from .scheduler import Scheduler
from .speculative import DEFAULT_NUM_TOKENS, Speculation, SpeculationPolicy
from .states import install as install_state_mixers


def init_continuous_batching(model, generation_config=None, *, pool=None, max_batch_tokens: int | None = None,
                             max_queue_size: int | None = None, continuous_batching_config=None,
                             max_num_seqs: int | None = None, max_unread_results: int = DEFAULT_MAX_UNREAD,
                             watermark: float | None = None, backend: str = "auto",
                             cuda_graphs: bool | None = None, tensor_parallel: bool | None = None,
                             tp_timeout_s: float = 60.0, tp_heartbeat_s: float = 1.0,
                             encoder_cache_bytes: int = DEFAULT_ENCODER_CACHE_BYTES, speculative=None,
                             num_speculative_tokens: int = DEFAULT_NUM_TOKENS,
                             speculative_max_tokens: int | None = None,
                             tokenizer=None, max_loras: int = DEFAULT_MAX_LORAS,
                             cpu_linears: str = "auto",
                             arrival_window_s: float | None = None) -> ContinuousBatchingManager:
    """A continuous-batching manager serving ``model`` from a shared block pool (start it, or use ``with``).

    Args:
        model: a causal LM of a family ``python -m hf_paged models`` lists; :func:`hf_paged.attach_paged_attention`
            is applied if it was not (the attention path only: for ``generate()`` with a ``PagedCache`` on the same
            model, call :func:`hf_paged.enable_paged_attention`).
        generation_config: the requests' default settings (default ``model.generation_config``).
        pool: a :class:`~hf_paged.BlockPool` (its block size, cap, ``prefix_caching`` and ``kv_dtype`` apply).
            Default: a pool with prefix caching, capped from the memory free on the model's device (CUDA: 80% of
            free memory, taken whole at the first forward while ``cuda_graphs`` is on; CPU: 20% of available RAM, at
            most 2 GiB, taken as blocks are needed).
        max_batch_tokens: tokens per forward, decode tokens and prefill chunks together (default 512 on CPU,
            2048 on CUDA).
        max_queue_size: waiting requests past which ``add_request`` raises ``QueueFullError`` (default: no limit).
        continuous_batching_config: transformers' ``ContinuousBatchingConfig``; ``page_size``, ``num_blocks``,
            ``max_batch_tokens``, ``max_memory_percent``, ``max_requests_per_batch``, ``allow_block_sharing``,
            ``max_queue_size``, ``safety_margin`` and ``return_logprobs`` are honoured, other fields refused by name
            when set. Explicit arguments win over it.
        max_num_seqs: the most requests running at once (default ``max_batch_tokens``).
        max_unread_results: finished results kept until read; past it the oldest unread are dropped.
        watermark: share of the pool kept free when admitting new requests (default 1%).
        backend: ``"auto"`` (Triton on CUDA, torch on CPU; a model already paged keeps its backend), ``"torch"`` or
            ``"triton"``.
        cuda_graphs: replay decode-only steps from CUDA graphs, one per bucket of rows (1, 2, 4, ... 512) and
            block-table width; steps with prefill chunks run eagerly. ``None`` (default): on where it applies (a CUDA
            model and a pool with a cap, which is then preallocated); ``True``: required (``ValueError`` where it
            cannot apply); ``False``: off.
        tensor_parallel: run as one rank of a tensor-parallel engine (see ``hf_paged/engine/distributed.py``):
            requests are added on rank 0, every rank runs the same steps. ``None`` (default): when the model was
            loaded with ``tp_plan`` under torchrun (``model.tp_size > 1``). Call this on every rank.
        tp_timeout_s: (tensor parallel) seconds a rank waits for the others before the engine stops with an error.
        tp_heartbeat_s: (tensor parallel) how often an idle rank 0 tells the others it is alive.
        encoder_cache_bytes: a vision-language model's encoder cache: image features kept by content (least recently
            used out), so a preempted request or another with the same images does not run the vision encoder again
            (0: keep features only while their request's image tokens are prefilled). See
            ``hf_paged/engine/multimodal.py``.
        tokenizer: the model's tokenizer, for requests with ``stop_strings`` (as ``generate(tokenizer=...)``);
            without it such requests are refused.
        speculative: speculative decoding for every request that does not choose (``prompt_lookup_num_tokens``):
            None (off), ``"ngram"`` (prompt lookup in each request's own tokens) or a draft model (a small causal LM
            with the same tokenizer; its K/V gets its own pool). A per-step policy runs drafts only where they pay
            (see ``hf_paged/engine/speculative.py``). Greedy requests get the tokens they get without it; sampled
            ones the same distribution.
        num_speculative_tokens: draft tokens per request and step.
        speculative_max_tokens: a step of more tokens than this never speculates (default: the policy decides from
            the step costs it measures).
        max_loras: LoRA adapters loaded at once (``manager.load_adapter``; requests name one with ``adapter=``);
            past it the least recently used idle one is unloaded. 0: no adapter support. Nothing is allocated until
            an adapter is loaded (see ``hf_paged/engine/lora.py``).
        cpu_linears: a CPU model's linear layers (``hf_paged/engine/cpu_linears.py``): ``"auto"`` (default:
            oneDNN-prepacked weights for bf16 / fp16, bit-identical to ``F.linear`` and faster at decode's few rows;
            fp32 as it is), ``"packed"``, ``"int8"`` (int8 weight-only, one scale per output channel: half of bf16's
            weight bytes, not the same function) or ``"eager"``. The layers change class in place (still
            ``nn.Linear``, same weights).
        arrival_window_s: an idle engine given requests waits until none has come for this many seconds (at most
            5 windows) before its first step, so requests a client sends together are prefilled together (one
            that misses the step is prefilled alone in the next while the others wait to decode). Default: 0.01
            on CPU, where a prefill step takes long; 0 (none) on CUDA.

    Requires transformers >= 5.24 (the attention plumbing the packed forward needs); ``generate()`` with a
    ``PagedCache`` works from 4.56.

    Example::

        manager = hf_paged.init_continuous_batching(model, max_batch_tokens=512)
        manager.start()
        rid = manager.add_request(tokenizer("Hello").input_ids, max_new_tokens=32)
        print(tokenizer.decode(manager.get_result(rid).generated_tokens))
        manager.stop()
    """
    if not compat.STEP_IN_ATTENTION_KWARGS:
        raise RuntimeError(f"the continuous-batching engine needs transformers >= 5.24 (this is "
                           f"{compat.TRANSFORMERS_VERSION}); generate() with a PagedCache works from 4.56.")
    options = from_continuous_batching_config(continuous_batching_config)
    if max_batch_tokens is not None:
        options["max_batch_tokens"] = max_batch_tokens
    if max_queue_size is not None:
        options["max_queue_size"] = max_queue_size
    if max_num_seqs is not None:
        options["max_num_seqs"] = max_num_seqs
    if watermark is not None:
        options["watermark"] = watermark
    check_model(model)
    check_engine_supported(model)
    if model.device.type == "cpu":
        prepare_cpu_linears(model, cpu_linears)
    if not is_paged(model) or backend != "auto":  # a model paged before keeps its backend unless one is asked
        attach_attention(model, backend=backend)
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    device = model.device
    groups = LayerGroups.from_geometry(kv_geometry(config))
    num_layers = config.num_hidden_layers
    pool_options = {k: options.pop(k) for k in ("block_size", "num_blocks", "memory_fraction", "prefix_caching")
                    if k in options}
    if pool is None:
        pool = default_pool(device, **pool_options)
    elif pool_options:
        raise ValueError(f"continuous_batching_config sets {sorted(pool_options)} but pool= was given: size the "
                         "BlockPool itself instead.")
    _cap_pool(pool, config, model.dtype, groups)
    sync = make_sync(model, tensor_parallel, tp_timeout_s, tp_heartbeat_s)
    if sync is not None:
        agree_on_pool(pool, sync)
    batch_tokens = options.pop("max_batch_tokens", None) or default_batch_tokens(device)
    state_layers = kv_geometry(config).state_layers
    if state_layers:  # hybrid models: their state mixers run per group of requests (engine/states.py)
        install_state_mixers(model)
    kv = RequestKV(pool, groups, batch_tokens, state_layers, model=model)  # model: stale-prefix check
    watermark = options.pop("watermark", None)
    scheduler = Scheduler(kv, batch_tokens, max_num_seqs=options.pop("max_num_seqs", None),
                          watermark=DEFAULT_WATERMARK if watermark is None else watermark)
    if cuda_graphs is not None:
        options["cuda_graphs"] = cuda_graphs
    wanted_graphs = options.pop("cuda_graphs", None)
    features.check(features.request_features(None, state_layers=bool(state_layers), cuda_graphs=bool(wanted_graphs)))
    media = MultimodalInputs(model, encoder_cache_bytes) if takes_images(model) and sync is None else None
    sharded = (getattr(model, "tp_size", None) or 1) > 1  # tensor-parallel weights (with or without a driver)
    runner = ModelRunner(model, kv, paged_backend(model), num_layers,
                         None if state_layers else _decode_graphs(wanted_graphs, device, pool, scheduler.max_num_seqs),
                         media=media, measured_padding=not sharded, lean=not sharded)
    adapters = AdapterSet(model, max_loras, runner.backend) if max_loras and not sharded else None
    runner.lora = adapters
    kv.adapters = adapters  # its PEFT bypass is part of every block key's root
    if sync is not None:
        runner = AgreeingRunner(runner, sync)
    limit, reason = context_limit(config)
    features.check(features.request_features(None, speculative=speculative is not None,
                                             state_layers=bool(state_layers), tensor_parallel=sync is not None))
    windows = [w for w in (*groups.windows, *groups.chunks) if w is not None]
    # a row is cut back after a rejection: not possible through a state, and not past a sliding window's edge
    max_draft = 0 if state_layers or sync is not None else (min(windows) - 1 if windows else None)
    speculation = Speculation(speculative, num_speculative_tokens, SpeculationPolicy(speculative_max_tokens),
                              max_draft=max_draft)
    core = EngineCore(scheduler, runner, Sampler(device=device, tokenizer=tokenizer), max_context=limit, context_reason=reason,
                      speculation=speculation)
    if arrival_window_s is None:
        arrival_window_s = DEFAULT_ARRIVAL_WINDOW_S if device.type == "cpu" else 0.0
    if not arrival_window_s >= 0:
        raise ValueError(f"arrival_window_s must be >= 0 seconds, got {arrival_window_s!r}.")
    core.arrival_window_s = float(arrival_window_s)
    defaults = {"logprobs": options.pop("logprobs")} if "logprobs" in options else {}
    return ContinuousBatchingManager(core, generation_config if generation_config is not None
                                     else model.generation_config, vocab_size=config.vocab_size,
                                     max_queue_size=options.pop("max_queue_size", None),
                                     max_unread_results=max_unread_results, default_options=defaults, sync=sync,
                                     media=media, adapters=adapters)


def _decode_graphs(wanted: bool | None, device, pool, max_rows: int):
    """The runner's :class:`~hf_paged.engine.graphs.DecodeGraphs` (None: every step eager); preallocates the pool,
    whose tensors a graph reads at fixed addresses."""
    kind = graphs.graph_type(device)
    if wanted is False:
        return None
    if wanted and kind is None:
        raise ValueError(f"cuda_graphs=True needs a CUDA model; this one is on {device}. Leave cuda_graphs unset "
                         "(graphs apply where they can) or move the model to a GPU.")
    if not pool.fixed:
        if wanted:
            raise ValueError("cuda_graphs=True needs a pool with a cap (the graphs read its tensors at fixed "
                             "addresses): pass pool=BlockPool(num_blocks=N) or BlockPool(max_memory='8GiB'), or "
                             "leave pool unset.")
        return None
    if kind is None:
        return None
    pool.preallocate()
    return graphs.DecodeGraphs(device, max_rows, kind)


def _cap_pool(pool, config, dtype, groups) -> None:
    """A ``max_memory`` pool gets its block cap now, from the model's per-layer K/V shapes (``groups.tensor_shapes``,
    from ``hf_paged.patches.kv_geometry``), before any block is taken."""
    if pool.max_memory is None or pool.allocator.max_blocks is not None:
        return
    pool.apply_memory_cap_for([shape for _, shape in groups.tensor_shapes], dtype)


def generate_batch(model, inputs, generation_config=None, *, progress_bar: bool = True,
                   max_new_tokens: int | None = None, adapters: list[str | None] | None = None,
                   lora_modules: dict | None = None, **options) -> dict[str, GenerationOutput]:
    """Generate for many prompts with continuous batching; returns ``{request_id: GenerationOutput}`` in input order.

    A drop-in for transformers' ``model.generate_batch(inputs, generation_config)``: ``inputs`` is a list of prompts
    (lists of token ids; for a vision-language model also one prompt's processor outputs, a mapping or
    ``BatchFeature`` of batch 1 with ``input_ids`` and its image tensors), ids are ``req_0``, ``req_1``, ... (forks of ``num_return_sequences`` follow their parent as
    ``req_0__child#0``, ...). A prompt that can never fit (too long for the pool or the context) or has a bad setting
    gets a ``FAILED`` result with the reason; the others run. ``progress_bar`` shows requests done and tokens/s.

    ``options``: those of :func:`init_continuous_batching` (``pool``, ``max_batch_tokens``, ``cuda_graphs``,
    ``continuous_batching_config``, ...) and per-request settings for every prompt (``do_sample``, ``temperature``,
    ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``seed``, ``eos_token_id``, ``stop_token_ids``,
    ``logprobs``, ``num_return_sequences``, ``ignore_eos``, ``min_tokens``, ``prompt_logprobs``, ``grammar``, any
    other ``GenerationConfig`` field such as ``no_repeat_ngram_size`` or ``stop_strings``, and ``logits_processor`` /
    ``stopping_criteria`` / ``prefix_allowed_tokens_fn``, ``num_beams``, ``length_penalty``,
    ``early_stopping``, ``prompt_lookup_num_tokens``; see :meth:`ContinuousBatchingManager.add_request`).
    ``tokenizer``: the model's tokenizer, needed for ``stop_strings``. ``assistant_model=``
    (generate()'s name) is ``speculative=``.

    ``adapters``: a LoRA adapter name (or None: the base model) per prompt, all run in the same steps;
    ``lora_modules``: ``{name: source}`` to load them from (a directory saved by peft, a ``PeftModel``, or
    ``(LoraConfig, state_dict)``). When ``model`` is a ``PeftModel``, names missing from ``lora_modules`` are
    loaded from its own adapters (and a prompt with None runs the base weights).

    Example::

        outputs = hf_paged.generate_batch(model, [tok(p).input_ids for p in prompts], max_new_tokens=64)
        mixed = hf_paged.generate_batch(base_model, [ids_a, ids_b, ids_c], max_new_tokens=64,
                                        adapters=["sql", None, "chat"],
                                        lora_modules={"sql": "adapters/sql", "chat": "adapters/chat"})
        for out in outputs.values():
            print(tok.decode(out.generated_tokens))
    """
    request_options = {k: options.pop(k) for k in list(options) if is_request_setting(k) and k not in _INIT_OPTIONS}
    for name in ("persistent_manager", "warmup", "record_timestamps"):  # transformers' options with no meaning here
        options.pop(name, None)
    if options.get("assistant_model") is not None:
        options["speculative"] = options.pop("assistant_model")
    options.pop("assistant_model", None)
    # Every rank of a tensor-parallel model calls generate_batch with the same prompts: each runs its own engine
    # (same events at the same steps, by construction), so no rank 0 driver is needed unless asked.
    options.setdefault("tensor_parallel", False)
    if not inputs:
        return {}
    if adapters is not None and len(adapters) != len(inputs):
        raise ValueError(f"adapters has {len(adapters)} entries for {len(inputs)} prompts: give one name (or None) "
                         "per prompt.")
    wanted = sorted({a for a in adapters or () if a is not None})
    if wanted:
        options.setdefault("max_loras", max(DEFAULT_MAX_LORAS, len(wanted)))
    manager = init_continuous_batching(model, generation_config, **options)
    for name in wanted:
        source = (lora_modules or {}).get(name)
        if source is None and hasattr(model, "peft_config") and name in model.peft_config:
            manager.load_adapter(name, model, adapter_name=name)
        elif source is None:
            raise ValueError(f"adapter {name!r} has no source: pass lora_modules={{{name!r}: path}} (a directory "
                             "saved by peft), or a PeftModel holding it.")
        else:
            manager.load_adapter(name, source)
    results: dict[str, GenerationOutput] = {}
    order: list[list[str]] = []
    # Every request is queued before the engine starts, so its first step sees them all: the ranks of a
    # tensor-parallel model, each running this with the same prompts, then take the same steps from the first.
    for i, prompt in enumerate(inputs):
        rid = f"req_{i}"
        try:
            manager.add_request(prompt, request_id=rid, max_new_tokens=max_new_tokens,
                                adapter=adapters[i] if adapters is not None else None, **request_options)
            n = request_options.get("num_return_sequences") or getattr(
                generation_config or model.generation_config, "num_return_sequences", None) or 1
            order.append([rid, *(f"{rid}__child#{j}" for j in range(n - 1))])
        except (ValueError, RuntimeError) as err:
            ids = prompt.get("input_ids", []) if isinstance(prompt, Mapping) else prompt  # (processor outputs)
            prompt_ids = list(ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else ids)
            now = time.perf_counter()
            results[rid] = GenerationOutput(rid, prompt_ids=prompt_ids, status=RequestStatus.FAILED,
                                            error=f"{type(err).__name__}: {err}", created_time=now, end_time=now)
            order.append([rid])
    with manager:
        collect_results(manager, results, sum(len(ids) for ids in order), "generate_batch", "req", progress_bar)
    return {rid: results[rid] for ids in order for rid in ids if rid in results}


def collect_results(manager: ContinuousBatchingManager, results: dict[str, GenerationOutput], total: int,
                    desc: str, unit: str, progress_bar: bool = True) -> None:
    """Take ``manager``'s results into ``results`` (request id -> output) until it holds ``total`` (or the engine
    stops), with a progress bar of requests and tokens/s."""
    start, tokens = time.perf_counter(), 0
    with tqdm(total=total, desc=desc, unit=unit, disable=not progress_bar, leave=False) as bar:
        bar.update(len(results))
        while len(results) < total:
            out = manager.get_result(timeout=1.0)
            if out is None:
                if not manager.is_running():
                    break
                continue
            results[out.request_id] = out
            tokens += len(out.generated_tokens)
            bar.update(1)
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):.1f} tok/s")


_INIT_OPTIONS = frozenset(inspect.signature(init_continuous_batching).parameters)
