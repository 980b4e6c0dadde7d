"""CPU linear layers that stream their weights at the memory's speed: prepacked oneDNN weights, or int8 weight-only.

A CPU decode step is a weight-streaming problem: a step of a few rows multiplies each weight once, and ``F.linear``
on an unpacked bf16 weight reorders it for oneDNN on every call (SmolLM2-135M, 8 rows: 72% of the step in
``aten::mm``, ~7 GB/s). Inductor's freezing pass fixes this by reordering each weight once
(``mkldnn._reorder_linear_weight``) and calling ``mkldnn._linear_pointwise`` on the packed copy; this module does the
same in eager mode, so every step shape (decode, mixed, prefill, padded or not) gets it without a compile, and the
outputs are bit-identical to ``F.linear``'s (each shape is checked against ``F.linear`` when its layer is packed; one
that differs, or a CPU whose oneDNN cannot run the dtype, stays unpacked).

``prepare_cpu_linears(model, "packed" | "int8" | "eager" | "auto")`` swaps the class of the model's ``nn.Linear``
layers in place (they stay ``nn.Linear``: their ``weight`` parameter, tied embeddings, LoRA and state dicts are
untouched):

- :class:`PackedLinear` (bf16 / fp16 weights): the oneDNN-packed copy is made at the first call and remade when
  the weight changes in place (a weight sync bumps its version) or is replaced; a call that needs gradients runs
  ``F.linear``. Costs a second copy of each weight in memory.
- :class:`Int8Linear`: symmetric per-output-channel int8 weights, the activations in the model's dtype: half the
  bytes of bf16 per step, but not the same function (greedy tokens can differ). A step of up to
  ``cpu_kernels.INT8_MAX_ROWS`` rows runs the C kernel ``ops/int8_linear.c`` (torch's ``_weight_int8pack_mm``
  without a C compiler); more rows (a prefill) multiply a copy of the weights in x's dtype made for the call.

``"auto"``: ``"packed"`` for a CPU model with bf16 / fp16 weights, nothing otherwise (fp32 runs MKL's own GEMM, which
packing does not speed up bit-identically).

:func:`native_dtype` is the dtype a CPU computes natively: bf16 where it has ``avx512_bf16`` or AMX (oneDNN's bf16
GEMM there streams half of fp32's bytes at about twice its speed), fp32 elsewhere (bf16 would be emulated).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import cpu_kernels

MODES = ("auto", "packed", "int8", "eager", "keep")  # keep: the layers as they are
PACKED_DTYPES = (torch.bfloat16, torch.float16)


def cpu_flags() -> frozenset:
    """The CPU's feature flags (Linux's ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bf16 on a GPU, and on a CPU with native bf16 arithmetic (``avx512_bf16`` or ``amx_bf16``, with ATen's AVX-512
    kernels not held back by ``ATEN_CPU_CAPABILITY``); fp32 on any other CPU."""
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    capability = torch.backends.cpu.get_cpu_capability()
    native = {"avx512_bf16", "amx_bf16"} & cpu_flags()
    return torch.bfloat16 if native and capability.startswith(("AVX512", "AMX")) else torch.float32


def _packable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available()
            and torch.backends.mkldnn.enabled)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(1, x.shape[-1])


class _DerivedWeights:
    """Copies and pickles without the derived weights (remade from ``weight`` at the next call): a packed copy is an
    opaque oneDNN tensor that ``copy.deepcopy`` (TRL's reference model, transformers' own code) cannot copy."""

    _DERIVED: tuple = ()

    def __getstate__(self):
        state = super().__getstate__()
        return {k: v for k, v in state.items() if k not in self._DERIVED}


class PackedLinear(_DerivedWeights, nn.Linear):
    """An ``nn.Linear`` computing with a oneDNN-packed copy of its weight (see the module docstring)."""

    _DERIVED = ("_packed", "_packed_key")
    _packed: torch.Tensor | None = None
    _packed_key: tuple | None = None

    def _pack(self, rows: int) -> torch.Tensor | None:
        """The packed weight for the current weight (None: this layer stays on ``F.linear``), checked once against
        ``F.linear`` on a few rows."""
        weight = self.weight.detach()
        packed = None
        try:
            candidate = torch.ops.mkldnn._reorder_linear_weight(weight, max(1, rows))
            probe = torch.randn(3, self.in_features, generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            bias = None if self.bias is None else self.bias.detach()
            if torch.equal(torch.ops.mkldnn._linear_pointwise(probe, candidate, bias, "none", [], ""),
                           F.linear(probe, weight, bias)):
                packed = candidate
        except RuntimeError:  # oneDNN has no primitive for this dtype on this CPU (e.g. bf16 held to AVX2)
            packed = None
        self._packed = packed
        self._packed_key = (self.weight.data_ptr(), self.weight._version, self.weight.dtype)
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)) or x.dtype != weight.dtype \
                or x.device.type != "cpu":
            return F.linear(x, weight, self.bias)
        packed = self._packed
        if self._packed_key != (weight.data_ptr(), weight._version, weight.dtype):
            packed = self._pack(_rows(x))
        if packed is None:
            return F.linear(x, weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")


class Int8Linear(_DerivedWeights, nn.Linear):
    """An ``nn.Linear`` computing with int8 weights, one scale per output channel (see the module docstring)."""

    _DERIVED = ("_qweight", "_scales", "_quant_key")

    _qweight: torch.Tensor  # [out, in] int8
    _scales: torch.Tensor  # [out] fp32
    _quant_key: tuple | None = None

    def _quantize(self) -> None:
        weight = self.weight.detach().float()  # [out, in]
        scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
        self._qweight = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self._scales = scales.contiguous()
        self._quant_key = (self.weight.data_ptr(), self.weight._version)

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 weight ``[out, in]`` and its fp32 scales ``[out]`` for the current weight."""
        if self._quant_key != (self.weight.data_ptr(), self.weight._version):
            self._quantize()
        return self._qweight, self._scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)) or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        self.quantized()
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [rows, in]
        out = cpu_kernels.int8_linear(x2, self._qweight, self._scales, self.bias)  # a decode step's few rows
        if out is None and x2.shape[0] <= cpu_kernels.INT8_MAX_ROWS:  # no C compiler: torch's int8 matmul
            out = torch._weight_int8pack_mm(x2.contiguous(), self._qweight, self._scales.to(x.dtype))
            out = out if self.bias is None else out + self.bias
        elif out is None:  # a prefill's many rows: the products bound the time, so the weights go back to x's dtype
            weight = self._qweight.to(x.dtype).mul_(self._scales.to(x.dtype)[:, None])
            out = F.linear(x2, weight, self.bias)
        return out.reshape(*shape[:-1], self.out_features)


class FusedLinears:
    """Linear layers reading the same input (q/k/v, gate/up) run as one GEMM: ``fused(x) -> tuple`` of the layers'
    outputs, bit-identical to calling them one by one (a row's output column is the same dot product either way;
    checked on a probe when the fused weight is made).

    Fuses :class:`PackedLinear` layers (one oneDNN-packed weight of the concatenation) and :class:`Int8Linear` layers
    of up to ``cpu_kernels.INT8_MAX_ROWS`` rows (their int8 weights and scales concatenated, the C kernel); anything
    else (other layer classes, gradients, a dtype the layers do not compute in, a prefill's many int8 rows) calls the
    layers. The fused weight is remade when any layer's weight or bias changes (replaced, or written in place) or a
    layer changes class; it is held here, not on the model (copies and state dicts never see it)."""

    def __init__(self, layers: tuple[nn.Linear, ...]):
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        self._key: tuple | None = None
        self._weight = self._scales = self._bias = None  # packed (or int8) weight, int8 scales, bias: concatenated

    def _state(self) -> tuple:
        return tuple((type(layer), layer.weight.data_ptr(), layer.weight._version, layer.weight.dtype,
                      None if layer.bias is None else (layer.bias.data_ptr(), layer.bias._version))
                     for layer in self.layers)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        key = self._state()
        if key != self._key:
            self._fuse(key)
        out = None
        if self._weight is not None and x.device.type == "cpu" and not torch.is_grad_enabled():
            out = self._run(x)
        if out is None:
            return tuple(layer(x) for layer in self.layers)
        return out.split(self.sizes, -1)

    def _run(self, x: torch.Tensor) -> torch.Tensor | None:
        if self._scales is None:  # packed
            if x.dtype != self.layers[0].weight.dtype:
                return None
            return torch.ops.mkldnn._linear_pointwise(x, self._weight, self._bias, "none", [], "")
        if _rows(x) > cpu_kernels.INT8_MAX_ROWS:
            return None
        shape = x.shape
        out = cpu_kernels.int8_linear(x.reshape(-1, shape[-1]), self._weight, self._scales, self._bias)
        return None if out is None else out.reshape(*shape[:-1], out.shape[-1])

    @torch.no_grad()
    def _fuse(self, key: tuple) -> None:
        self._key, self._weight, self._scales, self._bias = key, None, None, None
        kinds = {type(layer) for layer in self.layers}
        if len(kinds) != 1 or kinds & {PackedLinear, Int8Linear} == set():
            return
        biases = [layer.bias for layer in self.layers]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            return
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        weight = self.layers[0].weight
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        if kinds == {PackedLinear}:
            if not _packable(weight):
                return
            try:
                joined = torch.cat([layer.weight.detach() for layer in self.layers])
                fused = torch.ops.mkldnn._reorder_linear_weight(joined, 8)
            except RuntimeError:
                return
            self._weight, self._bias = fused, bias
            expected = [F.linear(probe, layer.weight.detach(), layer.bias) for layer in self.layers]
        else:
            quantized = [layer.quantized() for layer in self.layers]
            self._weight = torch.cat([qweight for qweight, _ in quantized])
            self._scales = torch.cat([scales for _, scales in quantized])
            self._bias = bias
            expected = [cpu_kernels.int8_linear(probe, qweight, scales, layer.bias)
                        for (qweight, scales), layer in zip(quantized, self.layers)]
        got = self._run(probe)
        if got is None or any(e is None for e in expected) or not torch.equal(got, torch.cat(expected, -1)):
            self._weight = self._scales = self._bias = None


def resolve_mode(model: nn.Module, mode: str) -> str:
    """``mode`` with ``"auto"`` decided for ``model`` (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"cpu_linears must be one of {MODES}, got {mode!r}.")
    if mode != "auto":
        return mode
    param = next(model.parameters(), None)
    return "packed" if param is not None and _packable(param) else "eager"


def prepare_cpu_linears(model: nn.Module, mode: str = "auto") -> int:
    """Swap ``model``'s CPU ``nn.Linear`` layers to :class:`PackedLinear` (``"packed"``) or :class:`Int8Linear`
    (``"int8"``) in place; ``"eager"`` puts back plain ``nn.Linear``. Returns how many layers changed class.
    Layers on another device (or, for packing, in fp32) are left as they are.

    Example::

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        prepare_cpu_linears(model, "packed")  # every later forward: bit-identical logits, prepacked weights
    """
    if mode == "keep" or (mode == "auto" and resolve_mode(model, mode) == "eager"):
        return 0  # nothing packable: the layers stay as they are (a model int8-quantized before keeps it)
    mode = resolve_mode(model, mode)
    target = {"packed": PackedLinear, "int8": Int8Linear, "eager": nn.Linear}[mode]
    changed = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear) or type(module) is target:
            continue
        if type(module) not in (nn.Linear, PackedLinear, Int8Linear):
            continue  # a subclass of someone else's (a quantized or parallel linear): its forward is its own
        if target is not nn.Linear and (module.weight.device.type != "cpu"
                                        or type(module.weight.data) is not torch.Tensor):
            continue  # another device, or a sharded (DTensor) weight: its own matmul
        if target is PackedLinear and not _packable(module.weight):
            continue
        for name in PackedLinear._DERIVED + Int8Linear._DERIVED:  # the old class's derived weights: let go
            module.__dict__.pop(name, None)
        module.__class__ = target  # its packed copy starts empty (the class defaults below)
        changed += 1
    return changed


def linears_mode(model: nn.Module) -> str:
    """Which kind of linears ``model`` runs: ``"packed"``, ``"int8"``, ``"eager"`` or ``"mixed"``."""
    kinds = {type(m) for m in model.modules() if type(m) in (nn.Linear, PackedLinear, Int8Linear)}
    names = {PackedLinear: "packed", Int8Linear: "int8", nn.Linear: "eager"}
    return names[kinds.pop()] if len(kinds) == 1 else ("eager" if not kinds else "mixed")
