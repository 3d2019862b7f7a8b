"""The 8-bit weight formats, in torch (no daemon): ``fp8_e4m3_block64``, and the others a
placement may name (``FORMATS``).

A weight of shape S (rank >= 2; rows = S[0], cols = prod(S[1:])) is kept as ``q``, float8_e4m3fn
in shape S, and ``scale``, float32 [rows, cols / 64] (one per 64 inputs of a row), or [rows, 1]
when cols is not a multiple of 64 (one per row). scale = amax / 448 of its block (1 where that is
0), q = e4m3(clamp(w / scale, -448, 448)); the weight a layer computes with is
``w_hat = (q.float() * scale).to(compute dtype)``.

The daemon makes two more formats the same way (a load's ``quantize``, or an upload's tensor
declared in one), with one block per row whatever its width, scale float32 [rows, 1]:
``fp8_e4m3_row`` (e4m3fn, scale = amax / 448) and ``int8_row`` (int8, scale = amax / 127, q =
round half to even of clamp(w / scale, -127, 127)): the rows 8-bit compute multiplies, bit for
bit ``weightstream.torch.compute8.quantize_rows_reference`` of the weight viewed as [rows,
cols]. Their w_hat is the same formula.

Pre-quantized files read as published (``fp8_scaled_musubi``, ``fp8_scaled_comfy``) and torchao's
weights uploaded as torchao holds them (``torchao_float8_rowwise``, ``torchao_int8_rowwise``:
``weightstream.torch.torchao_weights``) share the slice layout but keep their own scale shapes
and formulas: ``dequantize_as``, and for the formats whose library does not compute its linear
layer from the dequantized weight, ``linear_as``.

The daemon quantizes in Rust (``daemon/src/store/quantize.rs``), byte for byte as
``quantize_fp8_block64`` here (``daemon/e2e/tests/data/fp8_vectors.safetensors``, written by
``tests/python/client/gen_fp8_vectors.py`` from this module, pins both; the row formats it pins
against ``compute8.quantize_rows_reference``). The exactness contract
of 8-bit streaming: a model streamed in this format equals, bit for bit, the same model with
each streamed weight replaced in place by its w_hat (``to_fp8_resident``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch import nn

from weightstream import _fused_dequant

#: The format's name on the wire (``TensorPlacement.quantization``).
FP8_E4M3_BLOCK64 = "fp8_e4m3_block64"
#: Names a caller may use for it.
ALIASES = {"fp8": FP8_E4M3_BLOCK64, FP8_E4M3_BLOCK64: FP8_E4M3_BLOCK64}
#: The daemon's per-row formats (a load's ``quantize``): e4m3fn or int8 data, one float32
#: scale per row ([rows, 1]).
FP8_E4M3_ROW = "fp8_e4m3_row"
INT8_ROW = "int8_row"
#: The formats the daemon makes itself from float weights, and the dtype of their data.
DAEMON_FORMATS = {
    FP8_E4M3_BLOCK64: torch.float8_e4m3fn,
    FP8_E4M3_ROW: torch.float8_e4m3fn,
    INT8_ROW: torch.int8,
}
BLOCK = 64
E4M3_MAX = 448.0
#: The weight dtypes the format quantizes.
QUANTIZABLE = (torch.bfloat16, torch.float16, torch.float32)


#: Pre-quantized files read as published (LoadModel with quantization none of such a file; the
#: daemon never makes them): musubi-tuner ``--fp8_scaled`` and ComfyUI scaled-fp8 weights. Their
#: dequantization formulas are in ``dequantize_as``.
FP8_SCALED_MUSUBI = "fp8_scaled_musubi"
FP8_SCALED_COMFY = "fp8_scaled_comfy"
#: torchao's weights, uploaded as torchao holds them (never made by the daemon): a
#: ``Float8Tensor`` (``Float8WeightOnlyConfig()``) and an ``Int8Tensor``
#: (``Int8WeightOnlyConfig()``), both quantized per row: ``qdata`` [out, in] (float8_e4m3fn,
#: int8) and a float32 ``scale`` [out, 1].
TORCHAO_FLOAT8_ROWWISE = "torchao_float8_rowwise"
TORCHAO_INT8_ROWWISE = "torchao_int8_rowwise"
#: The formats whose library's linear layer is not ``F.linear`` of the dequantized weight: a
#: layer streaming one computes ``linear_as``.
OWN_LINEAR = (TORCHAO_FLOAT8_ROWWISE, TORCHAO_INT8_ROWWISE)
#: Every 8-bit format a placement may name.
FORMATS = (
    FP8_E4M3_BLOCK64,
    FP8_SCALED_MUSUBI,
    FP8_SCALED_COMFY,
    *OWN_LINEAR,
    FP8_E4M3_ROW,
    INT8_ROW,
)


class Fp8Weight(NamedTuple):
    """An 8-bit weight: ``data`` in the weight's shape (float8_e4m3fn; int8 for
    ``torchao_int8_rowwise`` and ``int8_row``), ``scale`` float32 (of ``fp8_e4m3_block64``:
    [rows, blocks per row]; of ``fp8_e4m3_row``, ``int8_row`` and torchao's: [rows, 1]; of a
    pre-quantized format: the file's scale shape),
    ``format`` one of ``FORMATS``; ``dtype``: for a format of ``OWN_LINEAR``, the dtype its
    library dequantizes it to (the torchao tensor's ``dtype``), set by the layer that streams
    it."""

    data: torch.Tensor
    scale: torch.Tensor
    format: str = FP8_E4M3_BLOCK64
    dtype: torch.dtype | None = None


def format_name(quantize: str | None) -> str | None:
    """The wire name of ``quantize`` ("fp8" or "fp8_e4m3_block64"); None for None."""
    if quantize is None:
        return None
    try:
        return ALIASES[quantize]
    except (KeyError, TypeError):
        raise ValueError(
            f"quantize={quantize!r}: expected None or 'fp8' (fp8_e4m3_block64)"
        ) from None


def scale_shape(shape) -> tuple[int, int]:
    """[rows, blocks per row] of a weight of ``shape``."""
    rows = shape[0]
    cols = 1
    for n in shape[1:]:
        cols *= n
    return rows, (cols // BLOCK if cols % BLOCK == 0 else 1)


def fp8_nbytes(shape) -> int:
    """Bytes of a quantized tensor in the daemon's store: data, zeros up to 16 bytes, scales."""
    rows, blocks = scale_shape(shape)
    return scale_offset(shape) + 4 * rows * blocks


def scale_offset(shape) -> int:
    """Where the scales of an 8-bit weight of ``shape`` start in its slice of the store: after
    its data (one byte per element), rounded up to 16 bytes."""
    data = 1
    for n in shape:
        data *= n
    return -(-data // 16) * 16


def rowwise_nbytes(shape) -> int:
    """Bytes of a weight of ``shape`` [out, in] held in a format with one float32 scale per row
    (torchao's): data, zeros up to 16 bytes, scales."""
    return scale_offset(shape) + 4 * shape[0]


def check_quantizable(name: str, w: torch.Tensor):
    """Raises ``ValueError`` naming ``name`` unless ``w`` is a float weight of rank >= 2."""
    if w.dtype not in QUANTIZABLE:
        raise ValueError(
            f"cannot quantize {name!r} to fp8: its weight is {w.dtype} (fp8_e4m3_block64 takes "
            "bfloat16, float16 or float32 weights); keep the layer out of quantization "
            f"(ignore=[{name!r}] keeps it on the device)"
        )
    if w.dim() < 2:
        raise ValueError(f"cannot quantize {name!r} to fp8: its weight has rank {w.dim()}")


def quantize_fp8_block64(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented quantization: (q, float8_e4m3fn in w's shape; scale, float32)."""
    rows = w.shape[0]
    cols = w.numel() // rows
    block = BLOCK if cols % BLOCK == 0 else cols
    x = w.float().reshape(rows, cols // block, block)
    amax = x.abs().amax(dim=-1, keepdim=True)
    # A tensor divisor, not the Python scalar: CUDA divides by a CPU scalar as a multiplication
    # by its reciprocal (torch's BinaryDivTrueKernel), which differs from amax / 448 in the last
    # bit of some scales; a tensor divisor is a true division on every device (found on the
    # H200: the 8-bit resident reference quantized on the GPU missed the daemon's bytes).
    scale = amax / torch.full_like(amax, E4M3_MAX)
    # All zeros, or an amax so small that amax / 448 underflows: scale 1 (never 0/0).
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(w.shape), scale.reshape(rows, cols // block)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w_hat = (q.float() * scale).to(dtype), in q's shape, on q's device. On a CUDA device
    with Triton, one fused kernel (``_fused_dequant``: same bits, no float32 copy); else three
    torch kernels that hold one float32 copy of the weight while they run (the product is
    formed in place in it)."""
    if _fused_dequant.applies(q, scale, dtype):
        return _fused_dequant.dequantize(q, scale, dtype)
    rows, blocks = scale.shape
    x = q.float()
    x.view(rows, blocks, -1).mul_(scale.view(rows, blocks, 1))
    return x.to(dtype)


def dequantize_as(
    fmt: str, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """w_hat of an 8-bit weight in format ``fmt``, in ``dtype``, with that format's own formula.

    - ``fp8_e4m3_block64``, ``fp8_e4m3_row``, ``int8_row``: ``dequantize`` (``(q.float() *
      scale).to(dtype)``).
    - ``fp8_scaled_musubi``: musubi-tuner's ``fp8_linear_forward_patch`` (non-scaled_mm branch,
      ``src/musubi_tuner/modules/fp8_optimization_utils.py``): ``q.to(D) * scale`` with the
      weight viewed as [out, blocks, in / blocks] for a per-block scale [out, blocks, 1], where
      musubi's D is the scale's dtype in the file (its ``original_dtype``). The daemon holds the
      scale as fp32 (exact), so here ``scale.to(dtype)`` restores it: with ``dtype`` the file's
      scale dtype this is musubi's result bit for bit.
    - ``fp8_scaled_comfy``: ComfyUI's ``scaled_fp8_ops`` (``comfy/ops.py``:
      ``weight * self.scale_weight.to(device=weight.device, dtype=weight.dtype)`` after
      ``cast_bias_weight`` made ``weight = s.weight.to(dtype)``): ``q.to(D) * scale.to(D)``, D
      the compute dtype; the scale is rounded to D before the product. The same is ComfyUI's
      mixed-precision ``TensorCoreFP8Layout.dequantize`` (``comfy/quant_ops.py``) as it runs
      on the GPU, where the 0-d fp32 ``weight_scale`` is cast to D (on the CPU torch would keep
      a 0-d CPU tensor in fp32: see the README's pre-quantized files).
    - ``torchao_float8_rowwise``: torchao's ``Float8Tensor.dequantize()``
      (``_dequantize_affine_float8`` in ``torchao/quantization/quant_primitives.py``, 0.18):
      ``(q.to(float32) * scale).to(dtype)``, ``dtype`` the tensor's: ``dequantize``'s formula.
    - ``torchao_int8_rowwise``: torchao's ``Int8Tensor.dequantize()``
      (``_dequantize_affine_no_dtype_check``): ``q.to(dtype)``, less its zero points (all 0:
      torchao's symmetric quantization; ``torchao_weights`` refuses others), times the float32
      scale, which promotes the product to float32, then ``.to(dtype)``: int8 values are exact
      in every float dtype, so this too is ``(q.to(float32) * scale).to(dtype)``."""
    if fmt in DAEMON_FORMATS or fmt in OWN_LINEAR:
        return dequantize(q, scale, dtype)
    if fmt == FP8_SCALED_MUSUBI:
        s = scale.to(dtype)
        if s.ndim < 3:
            return q.to(dtype) * s
        out_features, num_blocks, _ = s.shape
        w = q.to(dtype).contiguous().view(out_features, num_blocks, -1)
        return (w * s).view(q.shape)
    if fmt == FP8_SCALED_COMFY:
        w = q.to(dtype)
        return w * scale.to(device=w.device, dtype=w.dtype)
    raise ValueError(f"unknown 8-bit format {fmt!r}: expected one of {', '.join(FORMATS)}")


def dequantize_weight(w: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_as(w.format, w.data, w.scale, dtype)


def dequantize_group(weights: list[Fp8Weight], dtype: torch.dtype) -> list[torch.Tensor]:
    """``dequantize_weight`` of each weight, in ``dtype``: for weights all in
    ``fp8_e4m3_block64`` on a CUDA device with Triton, one launch of the fused kernel into one
    new tensor (``_fused_dequant.launch_group``), else one by one. Same bits either way. For the
    same weights at every call (a group's), ``GroupDequantizer`` plans the launch once."""
    return GroupDequantizer(dtype)(weights)


class GroupDequantizer:
    """``dequantize_group`` into ``dtype`` of weights that, at every call, keep their shapes,
    formats and places relative to each other (a group's 8-bit weights in each of its tickets):
    the fused launch is planned at the first call (``_fused_dequant.GroupLaunch``) and run as
    planned after, planned again where the weights moved; weights it cannot take are
    dequantized one by one from then on."""

    __slots__ = ("dtype", "launch", "fused")

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.launch: _fused_dequant.GroupLaunch | None = None
        self.fused = True

    def __call__(self, weights: list[Fp8Weight]) -> list[torch.Tensor]:
        if self.fused and weights:
            first, last = weights[0], weights[-1]
            first, last = (first.data, first.scale), (last.data, last.scale)
            launch = self.launch
            out = None if launch is None else launch.run(first, last)
            if out is None:
                launch = self.launch = self._plan(weights)
                out = None if launch is None else launch.run(first, last)
            if out is not None:
                return out
            self.fused = False
        return [dequantize_weight(w, self.dtype) for w in weights]

    def _plan(self, weights: list[Fp8Weight]) -> _fused_dequant.GroupLaunch | None:
        if weights[0].data.is_cuda and all(w.format == FP8_E4M3_BLOCK64 for w in weights):
            return _fused_dequant.plan_group([(w.data, w.scale) for w in weights], self.dtype)
        return None


def linear_as(w: Fp8Weight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The linear layer of ``x`` with weight ``w`` (a format of ``OWN_LINEAR``) and ``bias``,
    op for op as the format's library computes it (torchao 0.18's weight-only branches; the
    streamed layer computes this in place of ``F.linear``):

    - ``torchao_float8_rowwise``: ``Float8Tensor``'s ``F.linear`` is ``_float8_addmm_impl(x,
      w.t(), bias)``, which for an unquantized input runs ``torch.matmul(x,
      w.t().dequantize())`` and then ``+ bias``: the dequantized weight (``dequantize_as``, in
      ``w.dtype``) transposed, a matmul, and the bias added after it, where ``F.linear`` would
      fuse it into ``addmm`` (another rounding).
    - ``torchao_int8_rowwise``: ``Int8Tensor``'s ``F.linear`` (per-row weight-only branch)
      never dequantizes: ``torch.mm`` of ``x`` flattened to 2-D and ``q.t()`` cast to
      ``x.dtype``, then times ``scale`` cast to that dtype (rounded first), reshaped, ``+=
      bias``, ``.to(x.dtype)``."""
    if w.format == TORCHAO_FLOAT8_ROWWISE:
        out = torch.matmul(x, dequantize(w.data, w.scale, w.dtype).t())
        return out + bias if bias is not None else out
    if w.format == TORCHAO_INT8_ROWWISE:
        out_dtype = x.dtype
        m = torch.mm(x.reshape(-1, x.shape[-1]), w.data.t().to(out_dtype))
        y = m * w.scale.to(m.dtype).flatten()
        y = y.reshape(*x.shape[:-1], w.data.shape[0])
        if bias is not None:
            y += bias
        return y.to(out_dtype)
    raise ValueError(
        f"linear_as: {w.format!r} computes F.linear of its dequantization; the formats with a "
        f"linear of their own are {', '.join(OWN_LINEAR)}"
    )


def w_hat(w: torch.Tensor) -> torch.Tensor:
    """The weight a layer computes with when ``w`` is streamed in 8 bits (w's dtype)."""
    return dequantize(*quantize_fp8_block64(w), w.dtype)


def to_fp8_resident(
    model: nn.Module, names_or_predicate: Iterable[str] | Callable[[str, nn.Module], bool]
) -> list[str]:
    """The 8-bit resident reference: replaces, in place, the ``weight`` of each module named
    (or of each for which ``predicate(name, module)`` is true) by its w_hat, same dtype and
    device. Returns the names of the modules changed, in the model's order."""
    modules = dict(model.named_modules())
    if callable(names_or_predicate):
        names = [n for n, m in modules.items() if names_or_predicate(n, m)]
    else:
        names = list(names_or_predicate)
        missing = [n for n in names if n not in modules]
        if missing:
            raise KeyError(f"to_fp8_resident: no module named {missing[0]!r}")
        wanted = set(names)
        names = [n for n in modules if n in wanted]
    for name in names:
        weight = getattr(modules[name], "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"to_fp8_resident: {name!r} has no weight")
        check_quantizable(name, weight)
        with torch.no_grad():
            weight.copy_(w_hat(weight.detach()))
    return names


def sqnr_db(w: torch.Tensor, w_hat_: torch.Tensor) -> float:
    """Signal to quantization noise of ``w_hat_`` against ``w``, in dB (inf when equal)."""
    x = w.double()
    noise = (x - w_hat_.double()).pow(2).sum()
    signal = x.pow(2).sum()
    if float(noise) == 0:
        return float("inf")
    return float(10 * torch.log10(signal / noise))
