"""Many LoRA adapters on one base model in one engine: per-request adapters in one packed step.

Contract (the engine's adapter stage):

* :class:`AdapterSet` owns the loaded adapters: ``load(name, source)`` (a directory PEFT saved, a ``PeftModel``'s
  adapter, or a peft config + state dict), ``unload(name)``, an LRU cap of ``max_loras`` (idle adapters are unloaded
  to make room), their bytes. Each adapter has an index in every targeted linear layer's stacked weights
  (``hf_paged.ops.lora``'s layout) and a content digest (of its tensors and scales, not its name); a request of
  adapter ``a`` gets ``cache_root = adapter_root(digest)``, so KV computed under one adapter is never reused by
  another, by a changed reload of it (in this engine or another on the same pool), or by the base model (prefix
  caching keys every block by its chain root, which also holds the weights fingerprint: ``engine/kv.py``). The same
  adapter content loaded under two names, or in two engines, shares its KV.
* The manager asks ``hold(name)`` when a request names an adapter (``AdapterNotLoadedError`` naming the loaded ones
  when it is not loaded), then ``attach`` marks the request as a user (a used adapter is never evicted or unloaded).
* The runner lays a step's chunks out adapter by adapter (``grouped``), asks ``token_map(chunks)`` for the
  step's token -> adapter map, and runs its forward inside ``applied(map)``: the targeted linear layers (wrapped
  once, at the first load) then add ``B_a(A_a x) * scale_a`` for the tokens of adapter ``a`` only (two matmuls on
  the adapter's slice in torch; the Triton shrink / expand kernels with the engine's Triton backend, i.e. on
  CUDA). Outside ``applied`` a wrapped layer runs as before.

The base weights are never changed. Scaling is PEFT's: ``lora_alpha / r`` (``alpha_pattern`` / ``rank_pattern`` per
module), ``lora_alpha / sqrt(r)`` with ``use_rslora``; no dropout at inference. On a ``PeftModel`` (or a model PEFT
injected layers into) the engine's requests run the base weights unless they name an adapter: PEFT's own layers are
bypassed inside ``applied`` once an adapter is loaded (before that, PEFT's active adapters run); whether they are is
part of every key's root (:attr:`AdapterSet.peft_bypassed`), and PEFT's switches (active set, disabled, merged) are
part of the weights fingerprint, so KV made with PEFT's adapter on is never served to a request running without.

Example::

    manager = hf_paged.init_continuous_batching(base_model, max_loras=4)
    manager.load_adapter("sql", "adapters/sql")            # a directory saved by peft's save_pretrained
    with manager:
        a = manager.add_request(prompt_ids, max_new_tokens=32, adapter="sql")
        b = manager.add_request(prompt_ids, max_new_tokens=32)  # the base model, in the same steps
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..ops.lora import LoraGroup, add_lora_kernel, add_lora_torch, lora_groups
from ..patches import state_mixers

DEFAULT_MAX_LORAS = 8
_WRAPPED = "_hf_paged_lora"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
# PEFT features the batched path does not compute: refused by name at load
_UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "LoRA bias", "layer_replication": "layer replication",
                "alora_invocation_tokens": "aLoRA", "target_parameters": "target_parameters",
                "trainable_token_indices": "trainable tokens"}


class AdapterNotLoadedError(ValueError):
    """A request named an adapter that is not loaded (the message names the loaded ones)."""


@dataclass
class ModuleLora:
    """One targeted linear layer's adapters, stacked by index (layout of ``hf_paged.ops.lora``)."""

    lora_a: torch.Tensor  # [N, R, in]
    lora_b: torch.Tensor  # [N, R, out] (B transposed)
    ranks: list[int]  # [N]: 0 where the index's adapter does not target this layer
    scales: list[float]  # [N]
    scales_tensor: torch.Tensor  # [N] float32 on the layer's device (the Triton path)

    @property
    def nbytes(self) -> int:
        return self.lora_a.nbytes + self.lora_b.nbytes


@dataclass(eq=False)
class LoadedAdapter:
    """An adapter in the engine: its index in every targeted layer, its load generation, who uses it."""

    name: str
    index: int
    generation: int
    digest: bytes  # of its content (adapter_digest): its KV's key root
    modules: list[str]
    ranks: dict[str, int]
    nbytes: int  # its own weights (A and B of every targeted layer, unpadded)
    last_used: int = 0
    pending: int = 0  # requests being queued right now (held, not attached yet)
    users: list = field(default_factory=list)  # Request objects that named it (pruned once finished)
    _prune_at: int = 16  # users' length at which finished ones are dropped (doubles with the live ones: amortised)

    @property
    def cache_root(self) -> bytes:
        return self.digest

    def busy(self) -> bool:
        self.prune()
        return bool(self.users) or self.pending > 0

    def add_user(self, request) -> None:
        self.users.append(request)
        if len(self.users) > self._prune_at:
            self.prune()

    def prune(self) -> None:
        self.users = [r for r in self.users if not r.is_finished]
        self._prune_at = max(16, 2 * len(self.users))


@dataclass
class StepAdapters:
    """A step's token -> adapter map: the index of each of its ``T`` tokens (padding: -1), grouped by index."""

    token_adapters: list[int]
    groups: list[LoraGroup]
    _adapters_tensor: torch.Tensor | None = None

    def adapters_tensor(self, num_rows: int, device) -> torch.Tensor:
        """``[num_rows]`` int32 on ``device``: the map, padded with -1 (the Triton path)."""
        if self._adapters_tensor is None or self._adapters_tensor.shape[0] != num_rows:
            indices = self.token_adapters + [-1] * (num_rows - len(self.token_adapters))
            self._adapters_tensor = torch.tensor(indices, dtype=torch.int32).to(device)
        return self._adapters_tensor


def read_adapter(source, adapter_name: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(peft config as a dict, state dict)`` of an adapter from ``source``: a directory PEFT saved
    (``adapter_config.json`` + ``adapter_model.safetensors`` / ``.bin``), a ``PeftModel`` (its adapter
    ``adapter_name``, default its only or active one), or a ``(config, state_dict)`` pair (config: a peft
    ``LoraConfig`` or its dict)."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        config_file = path / "adapter_config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{path} holds no adapter_config.json: pass a directory saved by peft's "
                                    "save_pretrained (or a PeftModel, or (LoraConfig, state_dict)).")
        config = json.loads(config_file.read_text())
        if (path / "adapter_model.safetensors").is_file():
            state = load_file(str(path / "adapter_model.safetensors"))
        elif (path / "adapter_model.bin").is_file():
            state = torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
        else:
            raise FileNotFoundError(f"{path} holds no adapter_model.safetensors or adapter_model.bin.")
        return config, state
    if hasattr(source, "peft_config") and hasattr(source, "base_model"):  # a PeftModel
        names = list(source.peft_config)
        if adapter_name is None:
            active = getattr(source, "active_adapter", None)
            adapter_name = names[0] if len(names) == 1 else active
        if adapter_name not in source.peft_config:
            raise KeyError(f"the PeftModel has no adapter {adapter_name!r}; it has {names}.")
        config = source.peft_config[adapter_name].to_dict()
        state = {}
        for module_name, module in _base_module(source).named_modules():
            for which in ("A", "B"):
                layers = getattr(module, f"lora_{which}", None)
                if isinstance(layers, torch.nn.ModuleDict) and adapter_name in layers:
                    state[f"{module_name}.lora_{which}.weight"] = layers[adapter_name].weight.detach()
        return config, state
    if isinstance(source, tuple) and len(source) == 2:
        config, state = source
        return (config.to_dict() if hasattr(config, "to_dict") else dict(config)), dict(state)
    raise TypeError(f"an adapter source is a directory saved by peft, a PeftModel or (LoraConfig, state_dict); got "
                    f"{type(source).__name__}.")


def adapter_digest(weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> bytes:
    """A 16-byte digest of a parsed adapter's content (from :func:`parse_adapter`: each targeted module's name, A, B
    and scale, their dtypes, shapes and bytes), not of its name or where it was read from."""
    h = hashlib.blake2b(b"lora-adapter", digest_size=16)
    for module_name in sorted(weights):
        a, b, scale = weights[module_name]
        h.update(json.dumps([module_name, float(scale)]).encode())
        for t in (a, b):
            t = t.detach().to("cpu").contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.view(-1).view(torch.uint8).numpy())
    return h.digest()


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the module name's end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def parse_adapter(config: dict, state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{module name: (A [r, in], B [out, r], scale)}`` from a PEFT LoRA config and state dict; ``ValueError`` for
    what the batched path does not compute."""
    kind = str(config.get("peft_type", "LORA")).upper().replace("PEFTTYPE.", "")
    if kind != "LORA":
        raise ValueError(f"only LoRA adapters can be served per request, this one is {kind}.")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"this adapter uses {what} ({key}={config[key]!r}), which per-request serving does not "
                             "compute; merge it into the weights (peft's merge_and_unload) and serve that model.")
    if config.get("modules_to_save"):
        raise ValueError(f"this adapter also trains whole modules (modules_to_save={config['modules_to_save']}), "
                         "which per-request serving does not swap; merge it into the weights and serve that model.")
    if config.get("bias", "none") != "none":
        raise ValueError(f"this adapter trains biases (bias={config['bias']!r}), which per-request serving does not "
                         "swap; merge it into the weights and serve that model.")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"the adapter holds {key!r}, which is not a LoRA linear weight (lora_A / lora_B): "
                             "embedding or other adapters are not served per request.")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    out = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"the adapter's {module} has lora_{next(iter(ab))} but not its pair.")
        a, b = ab["A"], ab["B"]  # [r, in], [out, r]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise ValueError(f"the adapter's {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                             "[r, in] and [out, r].")
        alpha = _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8))
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        out[module] = (a, b, float(scale))
    if not out:
        raise ValueError("the adapter holds no LoRA weights.")
    return out


def _base_module(model):
    """The transformers model under a ``PeftModel`` (module names as PEFT keys them), else ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model


def _base_linear(module):
    """The ``nn.Linear`` a targeted module computes with (a PEFT layer's ``base_layer``)."""
    return module.base_layer if hasattr(module, "lora_A") and hasattr(module, "base_layer") else module


class AdapterSet:
    """The adapters loaded into one engine's model (see the module docstring).

    Thread-safety: ``load`` / ``unload`` / ``hold`` come from user threads, ``token_map`` / ``applied`` from the
    engine thread. ``lock`` guards the bookkeeping (which adapters, their users) and is held briefly, so queueing a
    request never waits for a forward; ``weights_lock`` is held through each forward and while a load or unload
    writes the stacked weights, so those wait for the step that is running (taken before ``lock`` when both are)."""

    def __init__(self, model, max_loras: int = DEFAULT_MAX_LORAS, backend: str = "torch"):
        if not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"max_loras must be a positive int, got {max_loras!r}.")
        if backend not in ("torch", "triton"):
            raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}.")
        self.model = model
        self.backend = backend  # the engine's resolved backend: Triton's shrink / expand kernels, or torch matmuls
        self.max_loras = max_loras
        self.lock = threading.RLock()
        self.weights_lock = threading.RLock()
        self.adapters: dict[str, LoadedAdapter] = {}
        self.layers: dict[str, ModuleLora] = {}  # targeted layer name -> its stacked adapters
        self.current: StepAdapters | None = None  # set only inside applied(): the running forward's map
        self._generation = 0
        self._clock = 0
        self._modules = dict(_base_module(model).named_modules())
        # hybrid models: the state mixers run per group of requests (engine/states.py), their layers on a subset of
        # the step's tokens, which the token -> adapter map does not describe
        mixers = {id(m) for m in state_mixers(_base_module(model)).values()}
        self._in_mixers = tuple(f"{n}." for n, m in self._modules.items() if id(m) in mixers)
        self._peft_wrapped = False
        self.peft_bypassed = False  # the engine's forwards run PEFT layers' base layers only (a key root part)

    # ------------------------------------------------------------ adapters
    @property
    def names(self) -> list[str]:
        with self.lock:
            return list(self.adapters)

    def load(self, name: str, source, adapter_name: str | None = None) -> LoadedAdapter:
        """Load (or replace) adapter ``name`` from ``source`` (see :func:`read_adapter`). Past ``max_loras`` the
        least recently used idle adapter is unloaded; ``RuntimeError`` when every loaded one is in use."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter name is a non-empty string, got {name!r}.")
        weights = parse_adapter(*read_adapter(source, adapter_name))
        digest = adapter_digest(weights)
        targets = {}
        for module_name, (a, b, _) in weights.items():
            module = self._modules.get(module_name)
            if module is None:
                near = [n for n in self._modules if n.endswith(module_name.rsplit(".", 1)[-1])][:3]
                raise ValueError(f"the adapter targets {module_name!r}, which this model does not have (e.g. "
                                 f"{near}); was it trained on another base model?")
            if module_name.startswith(self._in_mixers):
                raise ValueError(f"the adapter targets {module_name!r}, inside a state layer's mixer (which runs per "
                                 "group of requests): only attention and MLP layers are served per request; merge "
                                 "this adapter into the weights (peft's merge_and_unload) instead.")
            linear = _base_linear(module)
            if not isinstance(linear, torch.nn.Linear):
                raise ValueError(f"the adapter targets {module_name!r}, a {type(linear).__name__}: only nn.Linear "
                                 "layers are served per request.")
            if a.shape[1] != linear.in_features or b.shape[0] != linear.out_features:
                raise ValueError(f"the adapter's {module_name} is [{b.shape[0]} x {a.shape[1]}] but the layer is "
                                 f"[{linear.out_features} x {linear.in_features}]: another base model?")
            targets[module_name] = (module, linear)
        with self.weights_lock, self.lock:
            if name in self.adapters:
                self.unload(name)
            index = self._free_index(name)
            self._generation += 1
            self._clock += 1
            ranks = {}
            nbytes = 0
            count = max([index, *(a.index for a in self.adapters.values())]) + 1
            for layer in self.layers.values():  # every stacked layer holds every index in use (zeros: not targeted)
                _grow(layer, count, 0)
            for module_name, (a, b, scale) in weights.items():
                module, linear = targets[module_name]
                layer = self._layer(module_name, module, linear, a.shape[0], count)
                r = a.shape[0]
                layer.lora_a[index].zero_()
                layer.lora_b[index].zero_()
                layer.lora_a[index, :r].copy_(a)
                layer.lora_b[index, :r].copy_(b.T)
                layer.ranks[index], layer.scales[index] = r, scale
                layer.scales_tensor[index] = scale
                ranks[module_name] = r
                nbytes += (a.numel() + b.numel()) * layer.lora_a.element_size()
            adapter = LoadedAdapter(name, index, self._generation, digest, sorted(weights), ranks, nbytes,
                                    last_used=self._clock)
            self.adapters[name] = adapter
            self._wrap_peft_layers()
            return adapter

    def unload(self, name: str) -> None:
        """Unload adapter ``name``: ``AdapterNotLoadedError`` if it is not loaded, ``RuntimeError`` while requests
        use it (cancel them or wait for them)."""
        with self.weights_lock, self.lock:
            adapter = self._get(name)
            if adapter.busy():
                raise RuntimeError(f"adapter {name!r} is used by {len(adapter.users) + adapter.pending} live "
                                   "request(s); wait for them to end (or cancel them) before unloading it.")
            for layer in self.layers.values():
                if layer.ranks[adapter.index]:
                    layer.ranks[adapter.index], layer.scales[adapter.index] = 0, 0.0
                    layer.scales_tensor[adapter.index] = 0.0
                    layer.lora_a[adapter.index].zero_()
                    layer.lora_b[adapter.index].zero_()
            del self.adapters[name]

    def _get(self, name: str) -> LoadedAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            loaded = sorted(self.adapters)
            raise AdapterNotLoadedError(f"no adapter {name!r} is loaded; loaded: {loaded or 'none'}. Load it with "
                                        "manager.load_adapter(name, path) (the server: --lora-modules name=path).")
        return adapter

    def _free_index(self, name: str) -> int:
        used = {a.index for a in self.adapters.values()}
        if len(used) >= self.max_loras:
            idle = [a for a in self.adapters.values() if not a.busy()]
            if not idle:
                raise RuntimeError(f"cannot load adapter {name!r}: all {self.max_loras} adapters (max_loras) "
                                   "hold adapters in use by live requests. Wait for them, or raise max_loras.")
            victim = min(idle, key=lambda a: a.last_used)
            self.unload(victim.name)
            used.discard(victim.index)
        return min(set(range(self.max_loras)) - used)

    def _layer(self, module_name: str, module, linear, rank: int, count: int) -> ModuleLora:
        """The stacked weights of a targeted layer, made (and the layer wrapped) at its first adapter, with room for
        ``count`` adapters of rank ``rank``."""
        layer = self.layers.get(module_name)
        if layer is None:
            weight = linear.weight
            s = self.max_loras
            layer = ModuleLora(
                torch.zeros(0, rank, linear.in_features, dtype=weight.dtype, device=weight.device),
                torch.zeros(0, rank, linear.out_features, dtype=weight.dtype, device=weight.device),
                [0] * s, [0.0] * s, torch.zeros(s, dtype=torch.float32, device=weight.device))
            self.layers[module_name] = layer
            self._wrap(module_name, module, linear)
        _grow(layer, count, rank)
        return layer

    def _wrap(self, module_name: str, module, linear) -> None:
        """Wrap the layer's forward once per model; every engine on the model registers its adapter set with it."""
        hook = getattr(module, _WRAPPED, None)
        if hook is None:
            hook = _LayerHook()
            module.forward = _lora_forward(hook, module_name, module.forward, linear.forward)
            setattr(module, _WRAPPED, hook)
        hook.owners.add(self)

    def _wrap_peft_layers(self) -> None:
        """PEFT layers of the model run their base layer only inside the engine's forwards (once)."""
        if self._peft_wrapped:
            return
        self._peft_wrapped = True
        for module_name, module in self._modules.items():
            if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
                self._wrap(module_name, module, module.base_layer)
                self.peft_bypassed = True

    # ------------------------------------------------------------ requests
    def hold(self, name: str) -> LoadedAdapter:
        """The adapter a request being queued names (``AdapterNotLoadedError`` if none); held from eviction until
        :meth:`release` (the manager attaches its requests in between)."""
        with self.lock:
            adapter = self._get(name)
            adapter.pending += 1
            return adapter

    def attach(self, adapter: LoadedAdapter, request) -> None:
        """``request`` (and its forks) runs with ``adapter``: its KV chain is rooted at the adapter."""
        with self.lock:
            for r in (request, *request.children):
                r.adapter = adapter
                r.cache_root = adapter.cache_root
                adapter.add_user(r)

    def release(self, adapter: LoadedAdapter) -> None:
        with self.lock:
            adapter.pending -= 1

    # --------------------------------------------------------------- steps
    def grouped(self, batch):
        """``(batch laid out adapter by adapter, logits row order back to batch order)``: the chunks sorted (stably)
        by adapter index, so each adapter's tokens are one contiguous slice of the packed row; ``None`` when the
        order is unchanged. The runner packs the laid-out batch and indexes its ``[k + m]`` logits (k sampling
        chunks, then each chunk's prompt positions) with the returned rows."""
        chunks = batch.chunks
        if not self.adapters:  # nothing loaded: no request has an adapter
            return batch, None
        indices = [c.request.adapter.index if getattr(c.request, "adapter", None) is not None else -1 for c in chunks]
        order = sorted(range(len(chunks)), key=indices.__getitem__)
        if order == list(range(len(order))):
            return batch, None
        sampled_at, prompt_at, row = {}, {}, 0
        for i in order:  # a sampling chunk's logits: its last token's, or its 1 + m verified positions (speculation)
            if chunks[i].sample:
                n = chunks[i].num_logits
                sampled_at[i], row = range(row, row + n), row + n
        for i in order:
            n = len(chunks[i].prompt_positions)
            prompt_at[i], row = range(row, row + n), row + n
        back = [r for i in range(len(chunks)) if chunks[i].sample for r in sampled_at[i]]
        back += [r for i in range(len(chunks)) for r in prompt_at[i]]
        return dataclasses.replace(batch, chunks=[chunks[i] for i in order]), back

    def token_map(self, chunks) -> StepAdapters | None:
        """The step's token -> adapter map (chunks in ``runner.pack``'s order); None when no token has an adapter."""
        if not self.adapters:
            return None
        indices: list[int] = []
        any_adapter = False
        self._clock += 1
        for chunk in chunks:
            adapter = getattr(chunk.request, "adapter", None)
            if adapter is None:
                indices.extend([-1] * chunk.num_tokens)
                continue
            any_adapter = True
            adapter.last_used = self._clock
            indices.extend([adapter.index] * chunk.num_tokens)
        if not any_adapter:
            return None
        return StepAdapters(indices, [])

    @property
    def wraps_nothing(self) -> bool:
        """No layer is wrapped yet (no adapter was ever loaded, no PEFT layer bypassed): the model runs as built."""
        return not self.layers and not self._peft_wrapped

    @contextmanager
    def applied(self, step: StepAdapters | None, device):
        """The scope of one forward: the wrapped layers add the step's adapters (``step`` None: base weights only).
        Holds ``weights_lock``, so no load or unload changes the weights mid-forward."""
        if step is None and self.wraps_nothing:  # nothing to scope
            yield
            return
        with self.weights_lock:
            if step is not None:
                step.groups = lora_groups(step.token_adapters, [1] * self.max_loras, device)
            self.current = step if step is not None else StepAdapters([], [])
            try:
                yield
            finally:
                self.current = None

    def add(self, module_name: str, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y`` (a wrapped layer's base output ``[..., out]``) plus the current step's adapters on input ``x``."""
        step, layer = self.current, self.layers.get(module_name)
        if step is None or layer is None or not step.groups:
            return y
        x2 = x.reshape(-1, x.shape[-1])  # [T + P, in]
        y2 = y.view(-1, y.shape[-1])  # [T + P, out]
        if x2.shape[0] < len(step.token_adapters):
            raise RuntimeError(f"{module_name} got {x2.shape[0]} tokens but the step has {len(step.token_adapters)}: "
                               "LoRA applies to layers that see every token of the step once.")
        if self.backend == "triton":
            add_lora_kernel(y2, x2, layer.lora_a, layer.lora_b, layer.scales_tensor,
                            step.adapters_tensor(x2.shape[0], x2.device))
        else:
            groups = [LoraGroup(g.index, layer.ranks[g.index], g.rows, g.num_tokens) for g in step.groups
                      if layer.ranks[g.index]]
            add_lora_torch(y2, x2, layer.lora_a, layer.lora_b, layer.scales, groups)
        return y

    # ------------------------------------------------------------- figures
    @property
    def nbytes(self) -> int:
        """Bytes of the loaded adapters' own weights (A and B at their ranks)."""
        with self.lock:
            return sum(a.nbytes for a in self.adapters.values())

    @property
    def bytes_reserved(self) -> int:
        """Bytes of the stacked adapter tensors (an index per adapter loaded so far, up to ``max_loras``; ranks
        padded)."""
        with self.lock:
            return sum(layer.nbytes for layer in self.layers.values())


def _grow(layer: ModuleLora, count: int, rank: int) -> None:
    """Widen a layer's stacked weights (zero-padded) to at least ``count`` adapters and rank ``rank``: room is made as
    adapters arrive, not ``max_loras`` at once."""
    have_count, have_rank = layer.lora_a.shape[:2]
    if have_count >= count and have_rank >= rank:
        return
    pad_count, pad_rank = max(0, count - have_count), max(0, rank - have_rank)
    layer.lora_a = torch.nn.functional.pad(layer.lora_a, (0, 0, 0, pad_rank, 0, pad_count))
    layer.lora_b = torch.nn.functional.pad(layer.lora_b, (0, 0, 0, pad_rank, 0, pad_count))


class _LayerHook:
    """What a wrapped layer consults: the adapter sets of the engines built on its model (weakly held: an engine
    dropped leaves no trace), of which the one inside ``applied`` runs the forward."""

    def __init__(self):
        self.owners: weakref.WeakSet = weakref.WeakSet()

    def running(self) -> AdapterSet | None:
        found = [owner for owner in list(self.owners) if owner.current is not None]
        if len(found) > 1:
            raise RuntimeError("two engines with LoRA adapters run forwards on one model object at once; give each "
                               "engine its own copy of the model.")
        return found[0] if found else None


def _lora_forward(hook: _LayerHook, module_name: str, original, base):
    """A targeted layer's forward: as before outside the engines' forwards; inside, its base layer plus the step's
    adapters (a PEFT layer's own adapters are bypassed)."""

    def forward(x, *args, **kwargs):
        adapters = hook.running()
        if adapters is None:
            return original(x, *args, **kwargs)
        return adapters.add(module_name, base(x, *args, **kwargs), x)

    return forward
