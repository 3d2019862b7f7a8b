"""8-bit compute for frozen linear layers (W8A8): the weight in 8 bits with one float32 scale per
output row, the activations quantized per token on the fly, an 8-bit tensor-core matmul with
its scales, bias and output dtype in one epilogue, and the input gradient (dY·W) in 8 bits too
or in the trainer's dtype. Pure functions on tensors; the layer (``W8A8Linear``) and the
in-place reference (``to_w8a8_resident``) are built from them, so a streamed layer that calls
the same functions on the same weight bytes equals the reference bit for bit.

Modes (``MODES``):

- ``fp8``: e4m3 weights, ``w ≈ data * scale[:, None]`` (a torchao ``Float8Tensor`` per row,
  ai-toolkit's ``qfloat8``, is taken as it is); activations e4m3 with scale = amax / 448 per
  row; ``torch._scaled_mm`` with row-wise scales, bias and bf16 output fused (row-wise scaling
  gives bf16 only: another output dtype is a cast of it). Ada (sm_89), Hopper, Blackwell.
- ``int8``: symmetric int8 weights, scale = amax / 127 per row; int8 activations likewise;
  ``torch._int_mm`` (exact int32 sums), then y = ((acc * sx) * sw + bias) in float32 cast to
  the output dtype (``_quant8.scale_int32``). Ampere (sm_80) and newer.
- ``rotation=b`` (either mode): the weight's input dimension and the activations are rotated by
  a block-diagonal normalized Hadamard matrix of block b (a power of two dividing K): x·Wᵀ =
  (xH)(WH)ᵀ since H·Hᵀ = I, and the rotation spreads an outlier channel over b channels before
  the per-row scale is taken (the ConvRot idea). H is symmetric and its own inverse.

The input gradient of ``y = x·Wᵀ`` is dY·W. W's scales sit on the output rows, which that
product sums over, so they are folded into dY before it is quantized per row: dY·W ≈
diag(s_g)·(q(dY·diag(s_w))·W_q). ``grad_compute="bf16"`` instead multiplies dY by the
dequantized weight in the trainer's dtype.

Where the arithmetic is exact: products of two 8-bit values are exact in float32; sums of
int8 products are exact in int32 (and in float64), so int8's matmul has one result on every
device, and the CPU reference (``gemm_reference``) equals the GPU's int8 bit for bit. fp8's
sums are float32 in an order the GPU's kernel picks: the CPU reference sums exactly (float64)
and rounds once, so it is the reference of the CPU path, and on the GPU the contract is
streamed == in place with the same kernel.

Shapes the kernels cannot take fall back to the dequantized weight in the trainer's dtype
(``F.linear``), counted in ``Stats.fallbacks`` with the layer and the reason: ``fp8`` needs K
and N multiples of 16, ``int8`` multiples of 8; ``_int_mm`` wants more than 16 rows, so fewer
rows are padded with zeros (exact: rows do not mix).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from weightstream import _quant8

MODES = ("fp8", "int8")
#: grad_compute values besides the mode itself.
GRAD_MODES = ("bf16",)
FP8_MAX = 448.0
INT8_MAX = 127.0
QDTYPE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
QMAX = {"fp8": FP8_MAX, "int8": INT8_MAX}
#: K and N must be multiples of this for the mode's kernel.
TILE = {"fp8": 16, "int8": 8}
#: The least compute capability each mode's instruction needs on an NVIDIA GPU.
CAPABILITY = {"fp8": (8, 9), "int8": (8, 0)}
ROTATIONS = (16, 32, 64, 128, 256, 512)
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class W8Weight(NamedTuple):
    """A frozen weight prepared for 8-bit compute: ``data`` [N, K] (float8_e4m3fn or int8;
    with ``rotation``, of W·H), ``scale`` float32 [N], ``w ≈ data * scale[:, None]``;
    ``fallback``: why the mode's kernel cannot take this shape (None when it can)."""

    data: torch.Tensor
    scale: torch.Tensor
    mode: str
    rotation: int = 0
    fallback: str | None = None


@dataclass
class Stats:
    """What the 8-bit layers ran: ``gemm8`` 8-bit matmuls (forward and input gradient), and
    ``fallbacks[(layer, reason)]`` calls computed on the dequantized weight instead."""

    gemm8: int = 0
    fallbacks: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {
            "gemm8": self.gemm8,
            "fallbacks": {f"{k[0]}: {k[1]}": v for k, v in sorted(self.fallbacks.items())},
        }


def check_mode(mode: str, where: str = "compute") -> str:
    if mode not in MODES:
        raise ValueError(
            f"{where}={mode!r}: expected one of {', '.join(map(repr, MODES))} (8-bit compute) "
            "or 'bf16' (the dequantized weight in the trainer's dtype)"
        )
    return mode


def check_grad_compute(mode: str, grad_compute: str | None) -> str:
    """The input gradient's mode: ``"bf16"`` (None means it: dY times the dequantized weight)
    or ``mode`` itself. bf16 is the default because the 8-bit input gradient needs the weight
    in the other major order: transposed per call it is slower than bf16 on an H100 (0.71-0.90 x
    at FLUX.2's shapes, tests/bench/results/compute8_gemm.md), and bf16 is also the exact one."""
    if grad_compute is None:
        return "bf16"
    if grad_compute == mode:
        return mode
    if grad_compute in GRAD_MODES:
        return grad_compute
    raise ValueError(
        f"grad_compute={grad_compute!r} with compute={mode!r}: expected {mode!r} (the same "
        "8-bit mode) or 'bf16' (dY times the dequantized weight in the trainer's dtype)"
    )


# --- devices --------------------------------------------------------------------------------


def supported_modes(device: torch.device | str) -> tuple[str, ...]:
    """The modes ``device`` runs: on the CPU both (the reference arithmetic); on an NVIDIA GPU
    those whose instruction its compute capability has."""
    device = torch.device(device)
    if device.type == "cpu":
        return MODES
    if device.type != "cuda":
        return ()
    cap = torch.cuda.get_device_capability(device)
    return tuple(m for m in MODES if cap >= CAPABILITY[m])


def check_device(mode: str, device: torch.device | str):
    """Raises ``ValueError`` naming the mode, the device and the modes that work there when
    ``device`` cannot run ``mode``."""
    check_mode(mode)
    device = torch.device(device)
    modes = supported_modes(device)
    if mode in modes:
        return
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        what = f"{torch.cuda.get_device_name(device)} (compute capability {cap[0]}.{cap[1]})"
    else:
        what = f"a {device.type} device"
    need = ".".join(map(str, CAPABILITY[mode]))
    works = " or ".join(f"compute={m!r}" for m in (*modes, "bf16"))
    raise ValueError(
        f"compute={mode!r} needs an NVIDIA GPU of compute capability {need} or newer; "
        f"{what} runs {works}"
    )


# --- rotation -------------------------------------------------------------------------------


@functools.cache
def _hadamard_cpu(b: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / b**0.5


def hadamard(b: int, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix of order ``b``: symmetric, H·H = I."""
    return _hadamard_cpu(b).to(device=device, dtype=dtype)


def check_rotation(rotation: int, k: int, name: str = "layer"):
    if rotation == 0:
        return
    if rotation not in ROTATIONS:
        raise ValueError(
            f"{name}: rotation={rotation!r}: expected 0 (none) or a block of "
            f"{', '.join(map(str, ROTATIONS))}"
        )
    if k % rotation:
        fits = [b for b in ROTATIONS if k % b == 0]
        use = f"use rotation={fits[-1]} or 0" if fits else "use rotation=0"
        raise ValueError(
            f"{name}: rotation={rotation} does not divide the layer's input width {k}; {use}"
        )


def rotate(x: torch.Tensor, b: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [.., K] times the block-diagonal H of block ``b`` along its last dimension, as one
    matmul in ``dtype`` (float32 for activations and gradients: a float32 matmul on the GPU
    unless the trainer allowed TF32; float64 for weights, whose sums of ±x/√b are then exact
    for any weight whose magnitudes span less than 2^29, so every device rounds them alike),
    returned in float32."""
    k = x.shape[-1]
    h = hadamard(b, x.device, dtype)
    y = x.to(dtype).reshape(-1, k // b, b) @ h
    return y.reshape(x.shape).float()


# --- weights --------------------------------------------------------------------------------


def quantize_rows_reference(
    x: torch.Tensor, mode: str, col_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) quantization of x [M, K] in torch: v = x in float32 (times
    ``col_scale`` [K]), scale = amax(|v|) / qmax per row (1 where 0), q = cast(clamp(v /
    scale, ±qmax)), int8 rounded half to even. The Triton kernel computes the same bits."""
    v = x.float()
    if col_scale is not None:
        v = v * col_scale
    amax = v.abs().amax(dim=1)
    qmax = QMAX[mode]
    # A tensor divisor: CUDA divides by a Python scalar as a product with its reciprocal.
    scale = amax / torch.full_like(amax, qmax)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    v = (v / scale[:, None]).clamp_(-qmax, qmax)
    if mode == "int8":
        v = v.round_()
    return v.to(QDTYPE[mode]), scale


def quantize_rows(
    x: torch.Tensor, mode: str, col_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_reference``'s result: the fused kernel on a CUDA device with Triton,
    else the torch formula."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if _quant8.quantize_rows_applies(x):
        return _quant8.quantize_rows(x, QDTYPE[mode], QMAX[mode], col_scale)
    return quantize_rows_reference(x, mode, col_scale)


def untileable(mode: str, n: int, k: int) -> str | None:
    """Why the mode's kernel cannot take a weight [N, K]; None when it can."""
    t = TILE[mode]
    if k % t or n % t:
        return f"{mode} needs in and out features that are multiples of {t}, not {k} -> {n}"
    return None


def prepare(
    weight, mode: str, *, rotation: int = 0, name: str = "layer", fmt: str | None = None
) -> W8Weight:
    """The ``W8Weight`` of a frozen linear weight [N, K] for ``mode``:

    - a bf16/f16/f32 tensor: quantized per row (with ``rotation``, of W·H);
    - a torchao ``Float8Tensor`` per row (fp8) or ``Int8Tensor`` per row (int8), or the same
      as a ``quantize.Fp8Weight`` of ``torchao_float8_rowwise``/``torchao_int8_rowwise``: its
      data and scales as they are, when the format is the mode's and there is no rotation;
    - any other 8-bit weight of ``weightstream.quantize`` (``fp8_e4m3_block64``, the
      pre-quantized files, torchao's in the other mode or rotated): dequantized to float32 by
      its format's formula, then quantized per row, once.
    """
    check_mode(mode)
    w, as_is = _unwrap(weight, mode, name, fmt)
    if w.dim() != 2:
        raise ValueError(
            f"{name}: 8-bit compute takes linear weights [out, in], not shape {list(w.shape)} "
            "(Conv2d layers keep the dequantized path)"
        )
    n, k = w.shape
    check_rotation(rotation, k, name)
    fallback = untileable(mode, n, k)
    if as_is is not None:
        data, scale = as_is
        if not rotation:
            return W8Weight(data, scale.reshape(n).float(), mode, 0, fallback)
        w = data.float() * scale.reshape(n, 1).float()  # torchao's dequantization
    if w.dtype not in ACT_DTYPES:
        raise ValueError(
            f"{name}: cannot quantize a {w.dtype} weight for compute={mode!r}: 8-bit compute "
            "takes bfloat16, float16 or float32 weights, torchao's per-row Float8Tensor or "
            "Int8Tensor, or weightstream's 8-bit formats"
        )
    v = rotate(w, rotation, torch.float64) if rotation else w
    data, scale = quantize_rows_reference(v, mode)
    return W8Weight(data, scale, mode, rotation, fallback)


def _unwrap(weight, mode: str, name: str, fmt: str | None):
    """(a float or 8-bit weight tensor, (data, scale) to take as they are or None)."""
    from weightstream import quantize

    if isinstance(weight, nn.Parameter):
        weight = weight.data
    if not isinstance(weight, quantize.Fp8Weight) and type(weight) is not torch.Tensor:
        from weightstream.torch import torchao_weights

        fmt_ = torchao_weights.format_of(weight)
        if fmt_ is None:
            raise ValueError(
                f"{name}: a weight of type {type(weight).__name__} cannot compute in 8 bits: "
                "8-bit compute takes bfloat16, float16 or float32 weights, torchao's per-row "
                "Float8Tensor (Float8WeightOnlyConfig()) or Int8Tensor (Int8WeightOnlyConfig())"
                ", or weightstream's 8-bit formats"
            )
        weight = torchao_weights.upload_form(weight)
    if isinstance(weight, quantize.Fp8Weight):
        native = {"fp8": quantize.TORCHAO_FLOAT8_ROWWISE, "int8": quantize.TORCHAO_INT8_ROWWISE}
        if weight.format == native[mode] and weight.scale.numel() == weight.data.shape[0]:
            return weight.data, (weight.data, weight.scale)
        if weight.format not in quantize.FORMATS:
            raise ValueError(
                f"{name}: unknown 8-bit format {weight.format!r}: expected one of "
                f"{', '.join(quantize.FORMATS)}"
            )
        return quantize.dequantize_weight(weight, torch.float32), None
    if fmt is not None:
        raise ValueError(f"{name}: fmt={fmt!r} names a format for a plain tensor weight")
    return weight.detach(), None


def dequantize(w: W8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight the 8-bit one stands for, in ``dtype``: data * scale, rotated back."""
    v = w.data.float() * w.scale[:, None]
    if w.rotation:
        v = rotate(v, w.rotation)
    return v.to(dtype)


# --- the matmul -----------------------------------------------------------------------------


def gemm_reference(
    a: torch.Tensor,
    sa: torch.Tensor,
    b: torch.Tensor,
    sb: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    mode: str,
) -> torch.Tensor:
    """What ``gemm`` computes, on any device: a [M, K] and b [N, K] 8-bit, ``sa`` [M], ``sb``
    [N] (None: ones); y = a·bᵀ scaled. The sum is exact (float64: products of 8-bit values
    are exact, and int8 sums stay far below 2^53), then int8: int32 -> float32 and
    ``_quant8.scale_int32``'s formula; fp8: rounded once to float32, scaled, plus the bias,
    rounded to bf16 (``_scaled_mm``'s row-wise output) and cast to ``out_dtype``."""
    acc = a.double() @ b.double().t()
    if mode == "int8":
        return _scale_int32_reference(acc.to(torch.int32), sa, sb, bias, out_dtype)
    y = acc.float() * sa[:, None]
    if sb is not None:
        y = y * sb[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16).to(out_dtype)


def _scale_int32_reference(acc, sa, sb, bias, out_dtype):
    y = acc.float() * sa[:, None]
    if sb is not None:
        y = y * sb[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def scale_int32(acc, sa, sb, bias, out_dtype):
    """((acc * sa) * sb + bias) in float32, cast to ``out_dtype``: one kernel where it applies."""
    if _quant8.scale_int32_applies(acc):
        return _quant8.scale_int32(acc, sa, sb, bias, out_dtype)
    return _scale_int32_reference(acc, sa, sb, bias, out_dtype)


def gemm(a, sa, b, sb, bias, out_dtype, mode, b_col_major=None) -> torch.Tensor:
    """a·bᵀ scaled (``gemm_reference``'s arithmetic) with the mode's kernel on a CUDA device,
    the reference elsewhere. ``b_col_major``: bᵀ as a column-major [K, N] (b itself, row-major
    [N, K], transposed: no copy), or given where b is a transposed view."""
    if not a.is_cuda:
        return gemm_reference(a, sa, b, sb, bias, out_dtype, mode)
    bt = b.t() if b_col_major is None else b_col_major
    if mode == "fp8":
        n = bt.shape[1]
        sb_ = sb if sb is not None else torch.ones(n, dtype=torch.float32, device=a.device)
        inner = torch.bfloat16  # row-wise scaling gives bf16 only
        y = torch._scaled_mm(
            a,
            bt,
            scale_a=sa.reshape(-1, 1),
            scale_b=sb_.reshape(1, -1),
            bias=None if bias is None else bias.to(inner),
            out_dtype=inner,
        )
        return y if inner == out_dtype else y.to(out_dtype)
    m = a.shape[0]
    if m <= 16:
        # _int_mm wants more than 16 rows; zero rows add nothing to the others' exact sums.
        a = torch.cat([a, a.new_zeros(17 - m, a.shape[1])])
        sa = torch.cat([sa, sa.new_ones(17 - m)])
    acc = torch._int_mm(a, bt)
    return scale_int32(acc, sa, sb, bias, out_dtype)[:m]


# --- forward and input gradient ------------------------------------------------------------


def forward(
    x: torch.Tensor, w: W8Weight, bias: torch.Tensor | None, out_dtype, stats=None, name=""
) -> torch.Tensor:
    """y = x·Wᵀ + bias in 8 bits (x [.., K]; out [.., N] in ``out_dtype``)."""
    n, k = w.data.shape
    if x.shape[-1] != k:
        raise ValueError(f"{name}: input of width {x.shape[-1]} for a layer of {k} inputs")
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"{name}: 8-bit compute takes float inputs, not {x.dtype}")
    lead = x.shape[:-1]
    if w.fallback is not None:
        if stats is not None:
            stats.fallbacks[(name, w.fallback)] += 1
        b = None if bias is None else bias.to(out_dtype)
        return F.linear(x.to(out_dtype), dequantize(w, out_dtype), b)
    x2 = x.reshape(-1, k)
    if w.rotation:
        x2 = rotate(x2, w.rotation)
    qx, sx = quantize_rows(x2, w.mode)
    y = gemm(qx, sx, w.data, w.scale, bias, out_dtype, w.mode)
    if stats is not None:
        stats.gemm8 += 1
    return y.reshape(*lead, n)


def input_grad(
    grad_out: torch.Tensor,
    w: W8Weight,
    grad_compute: str,
    x_dtype: torch.dtype,
    stats=None,
    name="",
    data_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """dY·W (grad_out [.., N] -> [.., K] in ``x_dtype``): in 8 bits (``grad_compute`` the
    weight's mode: dY·diag(s_w) quantized per row, times W's 8-bit data, scaled by dY's row
    scales) or in the trainer's dtype (``"bf16"``: dY times the dequantized weight).
    ``data_t``: W's data transposed and contiguous where the caller keeps one (the kernel
    wants it column-major; it is made per call otherwise)."""
    n, k = w.data.shape
    lead = grad_out.shape[:-1]
    g = grad_out.reshape(-1, n)
    if grad_compute == "bf16" or w.fallback is not None:
        if w.fallback is not None and stats is not None:
            stats.fallbacks[(name, w.fallback)] += 1
        dtype = grad_out.dtype if grad_out.dtype in ACT_DTYPES else x_dtype
        if w.rotation:
            wr = (w.data.float() * w.scale[:, None]).to(dtype)
            gx = rotate(g.to(dtype) @ wr, w.rotation).to(x_dtype)
        else:
            gx = (g.to(dtype) @ dequantize(w, dtype)).to(x_dtype)
        return gx.reshape(*lead, k)
    qg, sg = quantize_rows(g, w.mode, w.scale)
    inner = torch.float32 if w.rotation else x_dtype
    if grad_out.is_cuda:
        bt = (w.data.t().contiguous() if data_t is None else data_t).t()
        gx = gemm(qg, sg, None, None, None, inner, w.mode, b_col_major=bt)
    else:
        gx = gemm_reference(qg, sg, w.data.t(), None, None, inner, w.mode)
    if stats is not None:
        stats.gemm8 += 1
    if w.rotation:
        gx = rotate(gx, w.rotation).to(x_dtype)
    return gx.reshape(*lead, k)


class W8A8Linear(torch.autograd.Function):
    """y = x·Wᵀ + bias with W frozen in 8 bits (``forward``); backward: the input gradient
    (``input_grad`` in ``grad_compute``) and, where the bias requires grad, dY summed over
    the rows. Saves no activation: the input gradient needs only the weight."""

    @staticmethod
    def forward(ctx, x, bias, w: W8Weight, grad_compute: str, out_dtype, stats, name):
        ctx.w, ctx.grad_compute, ctx.stats, ctx.name = w, grad_compute, stats, name
        ctx.x_dtype = x.dtype
        return forward(x, w, bias, out_dtype, stats, name)

    @staticmethod
    def backward(ctx, grad_out):
        gx = gb = None
        if ctx.needs_input_grad[0]:
            gx = input_grad(grad_out, ctx.w, ctx.grad_compute, ctx.x_dtype, ctx.stats, ctx.name)
        if ctx.needs_input_grad[1]:
            gb = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return gx, gb, None, None, None, None, None


def linear(x, w: W8Weight, bias=None, grad_compute=None, stats=None, name="layer"):
    """The 8-bit linear layer of ``x``, recorded for autograd where it needs to be; the output
    dtype is autocast's where autocast is on for x's device, else x's."""
    grad_compute = check_grad_compute(w.mode, grad_compute)
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    needs = torch.is_grad_enabled() and (
        x.requires_grad or (bias is not None and bias.requires_grad)
    )
    if not needs:
        return forward(x, w, bias, out_dtype, stats, name)
    return W8A8Linear.apply(x, bias, w, grad_compute, out_dtype, stats, name)


# --- the in-place reference ---------------------------------------------------------------


def to_w8a8_resident(
    model: nn.Module,
    mode: str,
    names_or_predicate: Iterable[str] | Callable[[str, nn.Module], bool] | None = None,
    *,
    rotation: int = 0,
    grad_compute: str | None = None,
    stats: Stats | None = None,
) -> list[str]:
    """The W8A8 reference with the weights in place: each ``nn.Linear`` named (or for which
    ``predicate(name, module)`` is true; by default every ``nn.Linear``) computes through
    ``linear`` from its weight prepared once (``prepare``) on the weight's device, kept on the
    module as ``w8a8``; its ``weight`` stays (a LoRA wrapper reads its shape). ``stats``
    counts the 8-bit matmuls and the fallbacks. Returns the names changed, in model order."""
    check_mode(mode)
    grad_compute = check_grad_compute(mode, grad_compute)
    modules = dict(model.named_modules())
    if names_or_predicate is None:
        names = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
    elif callable(names_or_predicate):
        names = [n for n, m in modules.items() if names_or_predicate(n, m)]
    else:
        wanted = set(names_or_predicate)
        missing = sorted(wanted - set(modules))
        if missing:
            raise KeyError(f"to_w8a8_resident: no module named {missing[0]!r}")
        names = [n for n in modules if n in wanted]
    prepared = []
    for name in names:
        m = modules[name]
        if not isinstance(m, nn.Linear):
            raise ValueError(
                f"to_w8a8_resident: {name!r} is a {type(m).__name__}; 8-bit compute takes "
                "nn.Linear layers (others keep the dequantized path)"
            )
        check_device(mode, m.weight.device)
        prepared.append((m, prepare(m.weight, mode, rotation=rotation, name=name)))
    for (m, w), name in zip(prepared, names, strict=True):
        m.w8a8 = w
        m.forward = _resident_forward(m, w, grad_compute, stats, name)
    return names


def _resident_forward(m: nn.Linear, w: W8Weight, grad_compute, stats, name):
    def forward_(x):
        return linear(x, w, m.bias, grad_compute, stats, name)

    return forward_
