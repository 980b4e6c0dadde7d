"""transformers' continuous-batching methods on a paged model, routed to hf_paged's engine.

Code written for transformers calls the *model's* methods: ``model.generate_batch(inputs, generation_config=...,
continuous_batching_config=..., progress_bar=False)`` (TRL's GRPO and RLOO trainers with
``use_transformers_continuous_batching=True``), ``model.init_continuous_batching(...)`` and
``model.continuous_batching_context_manager(...)``. :func:`install` (called by ``enable_paged_attention`` /
``attach_paged_attention``) puts methods of those names, with transformers 5.24's signatures, on the model instance;
:func:`uninstall` (``disable_paged_attention``) removes them, so the class's own come back.

A persistent manager (``persistent_manager=True``, ``manager.stop(keep_for_next_session=True)`` or
:func:`keep_engine`) is kept by the model's methods: every later call on the model runs on that one engine (its
pool, prefix cache and decode graphs) until ``model.destroy_cached_continuous_batching_manager()`` or
``disable_paged_attention``. Between calls the weights may change (a training step): block keys start from the
weights' fingerprint, so prefixes cached under other weights are never found (see ``hf_paged/weights.py``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from .factory import collect_results, init_continuous_batching as build_manager
from .manager import SAMPLING_KEYS, ContinuousBatchingManager
from .outputs import GenerationOutput, RequestStatus

METHOD_NAMES = ("init_continuous_batching", "continuous_batching_context_manager", "generate_batch",
                "destroy_cached_continuous_batching_manager")
# init_continuous_batching's keywords generate_batch passes on (hf_paged's, beyond transformers' signature)
ENGINE_KEYS = ("pool", "max_batch_tokens", "max_queue_size", "max_num_seqs", "max_unread_results", "watermark",
               "backend", "cuda_graphs", "speculative", "num_speculative_tokens", "speculative_max_tokens")


class TransformersMethods:
    """transformers' continuous-batching methods of one model (bound methods of this object are what
    :func:`install` puts on the model), and the persistent manager they share.

    Args:
        model: the paged model.
    """

    def __init__(self, model):
        self.model = model
        self.persistent: ContinuousBatchingManager | None = None
        self._next_id = 0  # request ids continue across the calls of a persistent manager, as transformers'

    # ------------------------------------------------------------ managers
    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None,
                                 **engine_options) -> ContinuousBatchingManager:
        """transformers' ``model.init_continuous_batching``: a :class:`ContinuousBatchingManager` on hf_paged's
        engine (not started), or the model's persistent manager when it has one (its settings stay; the arguments
        are then unused). ``workload_hints`` are accepted and unused (the pool grows on demand). ``engine_options``:
        those of :func:`hf_paged.init_continuous_batching` (``pool``, ``max_batch_tokens``, ...)."""
        if self.persistent is not None:
            return self.persistent
        manager = build_manager(self.model, generation_config, continuous_batching_config=continuous_batching_config,
                                **engine_options)
        manager.keeper = self.keep
        return manager

    def keep(self, manager: ContinuousBatchingManager) -> None:
        """Make ``manager`` the model's persistent manager (another one kept before is destroyed)."""
        if self.persistent is not None and self.persistent is not manager:
            self.persistent.destroy()
        self.persistent = manager

    def destroy_cached_continuous_batching_manager(self) -> None:
        """transformers' name: stop the persistent manager and let its engine (and pool) go."""
        manager, self.persistent = self.persistent, None
        if manager is not None:
            manager.keeper = None
            manager.destroy()

    @contextmanager
    def continuous_batching_context_manager(self, generation_config=None, block: bool = True,
                                            timeout: float | None = None, continuous_batching_config=None,
                                            persistent_manager: bool = False, warmup: bool = True,
                                            workload_hints=None, **engine_options):
        """transformers' ``model.continuous_batching_context_manager``: a started manager for the ``with`` block,
        stopped at its end (``block``, ``timeout``); with ``persistent_manager`` (or when the model has a persistent
        manager) it is kept for the next session. ``warmup`` is accepted (decode graphs are captured as they run)."""
        manager = self.init_continuous_batching(generation_config, continuous_batching_config, workload_hints,
                                                **engine_options)
        keep = persistent_manager or manager is self.persistent
        manager.start()
        try:
            yield manager
        except BaseException:
            manager.stop(block=block, timeout=timeout, drain=False, keep_for_next_session=keep)
            raise
        manager.stop(block=block, timeout=timeout, keep_for_next_session=keep)

    # ------------------------------------------------------------ generate
    @torch.no_grad()
    def generate_batch(self, inputs: list[list[int]], generation_config=None, continuous_batching_config=None,
                       record_timestamps: bool = False, progress_bar: bool = False, persistent_manager: bool = False,
                       warmup: bool = True, **kwargs) -> dict[str, GenerationOutput]:
        """transformers' ``model.generate_batch`` on hf_paged's engine: ``{request_id: GenerationOutput}`` with ids
        ``req_N`` (continuing across the calls of a persistent manager), the forks of ``num_return_sequences``
        (``req_N__child#i``) before their parent, as transformers orders them.

        ``kwargs``: ``max_new_tokens``; hf_paged's per-request settings (``do_sample``, ``temperature``, ``seed``,
        ``logprobs``, ... as :meth:`ContinuousBatchingManager.add_request`); engine options for a new engine
        (``pool``, ``max_batch_tokens``, ...). Other keywords raise ``TypeError``. ``record_timestamps`` and
        ``warmup`` are accepted (timestamps are always recorded). A prompt that can never fit gets a ``FAILED``
        result naming why.

        Example::

            hf_paged.enable_paged_attention(model)
            outputs = model.generate_batch([tok(p).input_ids for p in prompts], max_new_tokens=64)
            print(hf_paged.engine_of(model).stats())   # after persistent_manager=True: the engine that ran them
        """
        max_new_tokens = kwargs.pop("max_new_tokens", None)
        request_options = {k: kwargs.pop(k) for k in SAMPLING_KEYS if k in kwargs}
        engine_options = {k: kwargs.pop(k) for k in ENGINE_KEYS if k in kwargs}
        if kwargs:
            raise TypeError(f"generate_batch got unexpected keyword arguments {sorted(kwargs)}; it takes "
                            f"max_new_tokens, the per-request settings {list(SAMPLING_KEYS)} and the engine options "
                            f"{list(ENGINE_KEYS)}.")
        if not inputs:
            return {}
        config = generation_config if generation_config is not None else self.model.generation_config
        n = request_options.get("num_return_sequences") or getattr(config, "num_return_sequences", None) or 1
        if self.persistent is None:
            self._next_id = 0
        ids = [f"req_{self._next_id + i}" for i in range(len(inputs))]
        self._next_id += len(inputs)
        results: dict[str, GenerationOutput] = {}
        with self.continuous_batching_context_manager(generation_config, True, None, continuous_batching_config,
                                                      persistent_manager, warmup, None, **engine_options) as manager:
            for rid, prompt in zip(ids, inputs):
                try:
                    # the call's generation config for its requests: a persistent manager keeps its first one
                    manager.add_request(prompt, request_id=rid, max_new_tokens=max_new_tokens,
                                        generation_config=config, **request_options)
                except (ValueError, RuntimeError) as err:
                    results[rid] = _failed(rid, prompt, err)
            total = len(inputs) * n - (n - 1) * len(results)  # a refused prompt: one result, no forks
            collect_results(manager, results, total, f"Solving {total} requests", "request", progress_bar)
        order = [cid for rid in ids for cid in (*(f"{rid}__child#{j}" for j in range(n - 1)), rid)]
        return {rid: results[rid] for rid in order if rid in results}


def _failed(rid: str, prompt, err: Exception) -> GenerationOutput:
    prompt_ids = list(prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)
    now = time.perf_counter()
    return GenerationOutput(rid, prompt_ids=prompt_ids, status=RequestStatus.FAILED,
                            error=f"{type(err).__name__}: {err}", created_time=now, end_time=now)


# ------------------------------------------------------------------ on the model
def installed(model) -> TransformersMethods | None:
    """The :class:`TransformersMethods` whose methods are on ``model`` (None: transformers' own)."""
    method = model.__dict__.get("generate_batch")
    owner = getattr(method, "__self__", None)
    return owner if isinstance(owner, TransformersMethods) else None


def install(model) -> None:
    """Put transformers' continuous-batching methods, routed to hf_paged's engine, on ``model`` (no-op if there)."""
    if installed(model) is not None:
        return
    methods = TransformersMethods(model)
    for name in METHOD_NAMES:
        setattr(model, name, getattr(methods, name))


def uninstall(model) -> None:
    """Remove them (transformers' own come back); a persistent manager is stopped and let go."""
    methods = installed(model)
    if methods is None:
        return
    methods.destroy_cached_continuous_batching_manager()
    for name in METHOD_NAMES:
        model.__dict__.pop(name, None)


def keep_engine(model, generation_config=None, **options) -> ContinuousBatchingManager:
    """Build one engine for ``model`` and make it the persistent manager of its transformers methods: from now on
    ``model.generate_batch(...)`` (e.g. TRL's rollouts) runs on it, call after call, keeping its pool, prefix cache
    and decode graphs. ``options``: those of :func:`hf_paged.init_continuous_batching` (``pool``,
    ``max_batch_tokens``, ``continuous_batching_config``, ...). Returns the manager (stopped; each call starts a
    session): read its ``stats()``, ``sleep()`` it between rollouts. ``model`` must be paged
    (:func:`hf_paged.enable_paged_attention`). ``model.destroy_cached_continuous_batching_manager()`` lets it go.

    Example::

        hf_paged.enable_paged_attention(model)
        manager = hf_paged.keep_engine(model, max_batch_tokens=2048)
        trainer = GRPOTrainer(model=model, args=GRPOConfig(use_transformers_continuous_batching=True, ...), ...)
        trainer.train()
        print(manager.stats().prefix_hit_rate)
    """
    methods = installed(model)
    if methods is None:
        raise ValueError("keep_engine needs a paged model: call hf_paged.enable_paged_attention(model) first.")
    methods.destroy_cached_continuous_batching_manager()
    manager = methods.init_continuous_batching(generation_config, **options)
    manager.stop(keep_for_next_session=True)
    return manager


def engine_of(model) -> ContinuousBatchingManager | None:
    """The persistent manager ``model.generate_batch`` runs on (None: each call builds its own engine)."""
    methods = installed(model)
    return None if methods is None else methods.persistent
