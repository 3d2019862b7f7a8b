"""torchao's quantized weights, streamed as torchao holds them (torchao 0.18).

Two layouts stream, each as a format of the daemon (``weightstream.quantize``):

- ``Float8Tensor`` of ``Float8WeightOnlyConfig()`` (its default granularity ``PerRow()``):
  ``qdata`` float8_e4m3fn [out, in], ``scale`` float32 [out, 1], ``block_size`` [1, in], no
  activation quantization: ``torchao_float8_rowwise``.
- ``Int8Tensor`` of ``Int8WeightOnlyConfig()`` (granularity ``PerRow()``, symmetric):
  ``qdata`` int8 [out, in], ``scale`` float32 [out, 1], ``block_size`` [1, in], zero points
  absent or all 0, no activation quantization nor pre-scale: ``torchao_int8_rowwise``.

Each on an ``nn.Linear`` whose forward is Linear's own, frozen. The client uploads ``qdata`` and
``scale`` as they are (one byte per weight and four per row in the daemon, no float round trip),
and the streamed layer computes what torchao's own ``F.linear`` computes with that tensor
(``quantize.linear_as``), so outputs and gradients equal those of the quantized layer in place.
Every other torchao tensor (another granularity or block size, float8 e5m2, a dynamic-activation
config, ``Int4Tensor`` and the other packed layouts, sparse layouts) is refused by ``refusal``,
which says what to use instead; ``NF4Tensor`` and ``IntxUnpackedToInt8Tensor`` stream as packed
layers, their inner tensors as they are (``packed``).

Types are recognised without importing torchao (``policy.quantizer_of`` tells torchao's tensors
by their module): a torchao tensor exists only where torchao was imported, and then its classes
are in ``sys.modules``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from weightstream import quantize
from weightstream.torch import packed

#: The streamed types, by the module torchao exports them from, and their formats.
STREAMED = {
    "Float8Tensor": quantize.TORCHAO_FLOAT8_ROWWISE,
    "Int8Tensor": quantize.TORCHAO_INT8_ROWWISE,
}
_EXPORTED_FROM = "torchao.quantization"
_CONFIG = {
    quantize.TORCHAO_FLOAT8_ROWWISE: "Float8WeightOnlyConfig()",
    quantize.TORCHAO_INT8_ROWWISE: "Int8WeightOnlyConfig()",
}
DATA_DTYPE = {
    quantize.TORCHAO_FLOAT8_ROWWISE: torch.float8_e4m3fn,
    quantize.TORCHAO_INT8_ROWWISE: torch.int8,
}
#: What to do instead, at the end of each refusal.
INSTEAD = (
    "quantize the layer with Float8WeightOnlyConfig() or Int8WeightOnlyConfig() (granularity "
    "PerRow(), their default), load it unquantized (quantize='fp8' streams it in 8 bits), or "
    "keep it on the device (ignore=[{name!r}])"
)


def format_of(t) -> str | None:
    """The daemon's format for ``t`` if its type is one of torchao's streamed types (the real
    classes, not lookalikes), else None. Its layout is ``refusal``'s to check."""
    module = sys.modules.get(_EXPORTED_FROM)
    for type_name, fmt in STREAMED.items():
        cls = getattr(module, type_name, None)
        if isinstance(cls, type) and type(t) is cls:
            return fmt
    return None


def refusal(name: str, m: nn.Module, t: torch.Tensor) -> str | None:
    """Why layer ``name`` (``m``) cannot stream its torchao weight ``t`` as it is, as the words
    after "its weight is a <type> made by torchao, " and ending with what to do; None when it
    streams."""
    fmt = format_of(t)
    instead = INSTEAD.format(name=name)
    if fmt is None:
        streamed = " and ".join(f"{k} ({_CONFIG[v]})" for k, v in STREAMED.items())
        return (
            f"a layout weightstream does not stream (it streams {streamed} in 8 bits, and "
            f"{packed.torchao_names()} as packed layers): {instead}"
        )
    if not (isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward):
        return (
            f"on a {type(m).__name__}: torchao weights stream on nn.Linear layers (torchao's "
            f"{_CONFIG[fmt]} quantizes those); keep the layer on the device "
            f"(ignore=[{name!r}])"
        )
    if t.requires_grad:
        return (
            "which requires grad: a quantized base weight is frozen (torchao makes it with "
            "requires_grad=False); freeze it (module.weight.requires_grad_(False)) or keep the "
            f"layer on the device (ignore=[{name!r}])"
        )
    why = _layout_refusal(t, fmt)
    return None if why is None else f"{why}: {instead}"


def _layout_refusal(t, fmt: str) -> str | None:
    """The first rule of ``fmt``'s layout that ``t`` breaks, in words; None if none."""
    qdata, scale = t.qdata, t.scale
    shape = list(t.shape)
    if getattr(t, "act_quant_kwargs", None) is not None:
        return (
            "with activation quantization (a dynamic-activation config): its linear is a "
            "quantized matmul, not the weight's; weightstream streams the weight-only "
            f"{_CONFIG[fmt]}"
        )
    for extra in ("act_pre_scale", "act_quant_scale", "act_quant_zero_point"):
        if getattr(t, extra, None) is not None:
            return (
                f"with {extra} (activations scaled or quantized by the layer); weightstream "
                f"streams the weight-only {_CONFIG[fmt]}"
            )
    if qdata.dtype != DATA_DTYPE[fmt]:
        return f"of {qdata.dtype} qdata; {_CONFIG[fmt]} makes {DATA_DTYPE[fmt]}"
    if qdata.dim() != 2 or list(qdata.shape) != shape:
        return f"of qdata shape {list(qdata.shape)}; weightstream streams 2-D weights"
    block = list(getattr(t, "block_size", None) or [])
    if block != [1, shape[1]]:
        return (
            f"with block_size {block}; weightstream streams one scale per row (block_size "
            f"[1, {shape[1]}], granularity PerRow())"
        )
    if scale.dtype != torch.float32 or list(scale.shape) != [shape[0], 1]:
        return (
            f"with a {scale.dtype} scale of shape {list(scale.shape)}; {_CONFIG[fmt]} makes "
            f"one torch.float32 scale per row, shape [{shape[0]}, 1]"
        )
    zero_point = getattr(t, "zero_point", None)
    if zero_point is not None and bool(zero_point.ne(0).any()):
        return (
            "with nonzero zero points (asymmetric quantization); weightstream streams the "
            "symmetric Int8WeightOnlyConfig()"
        )
    if t.dtype not in quantize.QUANTIZABLE:
        return f"of dtype {t.dtype}; weightstream streams bfloat16, float16 and float32 layers"
    return None


@dataclass(frozen=True)
class Rebuild:
    """Makes a torchao weight again from streamed ``qdata`` and ``scale`` (``Handle.detach``):
    its type and its attributes as ``__tensor_flatten__`` gave them, without holding its
    data."""

    cls: type
    attributes: dict
    size: torch.Size
    #: (shape, dtype) of the all-zero ``zero_point`` the tensor had, else None.
    zero_point: tuple | None

    @classmethod
    def of(cls, t) -> Rebuild:
        names, attributes = t.__tensor_flatten__()
        zp = getattr(t, "zero_point", None) if "zero_point" in names else None
        zero_point = None if zp is None else (zp.shape, zp.dtype)
        return cls(type(t), attributes, t.shape, zero_point)

    def __call__(self, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        inner = {"qdata": qdata, "scale": scale}
        if self.zero_point is not None:
            shape, dtype = self.zero_point
            inner["zero_point"] = torch.zeros(shape, dtype=dtype, device=qdata.device)
        stride = torch.empty(self.size, device="meta").stride()
        return self.cls.__tensor_unflatten__(inner, dict(self.attributes), self.size, stride)


def upload_form(t) -> quantize.Fp8Weight:
    """What the client writes for a torchao weight that ``refusal`` lets stream: its ``qdata``
    and ``scale`` as they are, in its format (``format_of``)."""
    return quantize.Fp8Weight(t.qdata.detach(), t.scale.detach(), format_of(t), t.dtype)
