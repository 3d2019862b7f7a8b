"""An AdamW step with 8-bit block-wise quantized moments, for weights kept in host memory:
``native_step`` runs the extension's CPU kernel (parallel, the GIL released),
``reference_step`` computes the same formula with torch operations, bit for bit (the
specification the kernel is tested against, and a fallback on any device).

The parameter ``p`` is an fp32 master (its bf16 working copy ``w_out`` written beside it), or
the bf16 working weight itself, updated in place: read to float32, the same float32 formula,
the result rounded to nearest-even back to bf16 (as bitsandbytes' 8-bit AdamW updates a bf16
parameter). Per parameter the state is 2 bytes (``m`` as int8, ``sqrt(v)`` as uint8) plus two
float32 scales per block of 256 parameters: 6 bytes per parameter with an fp32 master, 4 with
a bf16 parameter, against 12 for fp32 AdamW. ``new_state(n)`` makes the zero state of an
``n``-element parameter.

The formula
-----------
Every operation is one IEEE-754 float32 operation (rounded to nearest-even), in this order,
with no fused multiply-add. The constants (``constants``) are computed in float64 from the
arguments, then rounded to float32 (``f32``), as torch rounds a Python scalar applied to a
float32 tensor::

    decay     = f32(1 - lr * weight_decay)
    b1, b2    = f32(beta1), f32(beta2)
    c1, c2    = f32(1 - beta1), f32(1 - beta2)
    step_size = f32(lr / (1 - beta1 ** step))            (** is the C library's pow)
    inv_bc2   = f32(1 / sqrt(1 - beta2 ** step))
    eps, gs   = f32(eps), f32(grad_scale)

The parameter (``n`` elements, in memory order) is cut into blocks of 256 (the last one may be
shorter); block ``b`` holds ``qm[i]`` (int8), ``qv[i]`` (uint8), ``sm[b]`` (the absolute maximum
of its ``m``) and ``sv[b]`` (the maximum of its ``sqrt(v)``). The codes are 8-bit floating-point
numbers scaled to the block's maximum, of 4 exponent bits and ``M`` mantissa bits, whose
relative precision does not fall with the magnitude (a linear code keeps 1 or 2 significant bits
of a moment 1/100 of its block's largest, and rounds it back to the same code step after
step)::

    F_M(c) = c * 2^-(14+M)                    for c < 2^M (evenly spaced below 2^-14)
           = 2^(e-15) * (1 + f / 2^M)         else, e = c >> M, f = c mod 2^M
    TOP_M  = F_M(2^(4+M) - 1) = 2 - 2^-M
    E_M(y) = the c whose F_M(c) is nearest to min(y, TOP_M) (ties: the even c), 0 for NaN

``m`` has ``M = 3`` and a sign (``qm = ±c``, in [-127, 127]; 6% precision, down to 4e-6 of the
block's maximum), ``sqrt(v)`` has ``M = 4`` (``qv = c``, in [0, 255]; 3%, down to 2e-6)
(``decode``, ``encode``). For each element ``i`` of block ``b``::

    g  = f32(grad[i]) * gs                     (bf16 to f32 is exact)
    m  = ±F_3(|qm[i]|) * (sm[b] / 1.875)       (qm[i]'s sign; sm[b] / 1.875 and sv[b] / 1.9375:
    r  = F_4(qv[i]) * (sv[b] / 1.9375)          once per block; F is exact)
    v  = r * r
    m  = m * b1 + g * c1
    v  = v * b2 + (g * g) * c2
    r  = sqrt(v)
    p  = f32(p[i]) * decay                     (a bf16 p[i]: exact)
    p  = p - (m / (r * inv_bc2 + eps)) * step_size

then, over the block, ``sm' = max |m|`` and ``sv' = max r``; ``km = 1.875 / sm'`` and
``kv = 1.9375 / sv'`` (once per block; 0 where the maximum is 0 or not finite), and::

    qm[i] = sign(m) * E_3(|m| * km)
    qv[i] = max(E_4(r * kv), 1 if qm[i] != 0 else 0)
    w[i]  = bf16(p)                            (round to nearest-even: .to(torch.bfloat16))

and ``p`` (a bf16 parameter: ``bf16(p)``, rounded as ``w``, and no ``w_out``), ``sm[b] = sm'``,
``sv[b] = sv'`` (NaN where not finite, below) are stored. This is
``torch.optim.AdamW``'s step (decoupled weight decay first, bias corrections, ``eps`` added to
the corrected ``sqrt(v)``) with the moments read from and written to their 8-bit form, and the
correction of ``v`` applied as a product with its reciprocal. The floor of ``qv`` keeps a
nonzero ``m`` from meeting a zero ``sqrt(v)`` (an update of ``m / eps``).

NaN and infinity: a non-finite gradient is not skipped (check for overflow and skip the step,
as ``torch.amp.GradScaler`` does). A block whose new ``m`` (or ``r``) holds a NaN or an infinity
stores ``sm' = NaN`` (or ``sv' = NaN``) and codes 0 (``qv``: 0 or its floor): later steps read
NaN moments for the block and its parameters become NaN, as a NaN gradient makes them in fp32
AdamW. A NaN parameter gives a NaN ``w`` (of unspecified bits). A block whose maximum is a
subnormal float32 below about 5.5e-39 has an infinite ``km`` (``kv``): its nonzero elements get
the largest code, its zeros 0. ``g * g`` overflows (to a non-finite block) for gradients above
about 1.8e19.

torch: ``reference_step`` avoids the operations whose CPU kernels may fuse a multiply and an
add (``lerp``, ``addcmul``, ``addcdiv``, ``add`` with ``alpha`` other than 1) and ``scalar /
tensor`` (torch computes it as ``tensor.reciprocal() * scalar``, two roundings), and takes the
float32 square root as float64's rounded (torch 2.11's float32 ``sqrt`` on the CPU is 1 ulp
off for about 0.7% of inputs, probably through MKL's vector math). Its bit-exactness is tested
on the CPU; on a GPU it computes the same formula, not necessarily the same bits.

Threads: ``native_step`` runs on the extension's rayon pool (``RAYON_NUM_THREADS`` sets its
size), which a forked child does not have: call it in the process that trains, not in
DataLoader workers. It writes through the tensors' addresses: autograd's version counters do
not see the change (master weights and optimizer state are outside any graph).
"""

from __future__ import annotations

import math
import operator
import struct
from typing import NamedTuple

import torch

from weightstream import _native

#: Parameters per block (each block has its own two scales).
BLOCK = 256


def blocks(n: int) -> int:
    """The number of blocks (and of each scale) of an ``n``-element parameter."""
    return -(-n // BLOCK)


def new_state(
    n: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The zero state of an ``n``-element parameter: ``(qm, qv, sm, sv)``, int8 and uint8 of
    ``n`` elements, float32 of ``blocks(n)`` (zero moments, as AdamW starts)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    nb = blocks(n)
    return (
        torch.zeros(n, dtype=torch.int8, device=device),
        torch.zeros(n, dtype=torch.uint8, device=device),
        torch.zeros(nb, dtype=torch.float32, device=device),
        torch.zeros(nb, dtype=torch.float32, device=device),
    )


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (to infinity beyond its range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


class Constants(NamedTuple):
    """The float32 constants of one step (each a Python float that is a float32 value)."""

    decay: float
    b1: float
    c1: float
    b2: float
    c2: float
    step_size: float
    inv_bc2: float
    eps: float
    gs: float


def constants(
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
) -> Constants:
    """The constants of the formula, after checking each argument's range (``ValueError``
    naming the argument and its limit; the native kernel checks the same)."""
    try:
        valid = operator.index(step) >= 1
    except TypeError:
        valid = False
    if not valid:
        raise ValueError(f"step must be an int >= 1 (1 for the first step), got {step!r}")
    step = operator.index(step)
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr must be finite and >= 0, got {lr}")
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0 <= beta < 1:
            raise ValueError(f"{name} must be in [0, 1), got {beta}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(
            f"eps must be finite and > 0 (8-bit sqrt(v) rounds small values to 0), got {eps}"
        )
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be finite and >= 0, got {weight_decay}")
    if not (math.isfinite(grad_scale) and grad_scale >= 0):
        raise ValueError(f"grad_scale must be finite and >= 0, got {grad_scale}")
    lr, beta1, beta2 = float(lr), float(beta1), float(beta2)
    c = Constants(
        decay=_f32(1.0 - lr * weight_decay),
        b1=_f32(beta1),
        c1=_f32(1.0 - beta1),
        b2=_f32(beta2),
        c2=_f32(1.0 - beta2),
        step_size=_f32(lr / (1.0 - beta1 ** float(step))),
        inv_bc2=_f32(1.0 / math.sqrt(1.0 - beta2 ** float(step))),
        eps=_f32(eps),
        gs=_f32(grad_scale),
    )
    for name, value in (
        ("1 - lr * weight_decay", c.decay),
        ("lr / (1 - beta1 ** step)", c.step_size),
        ("1 / sqrt(1 - beta2 ** step)", c.inv_bc2),
        ("eps", c.eps),
        ("grad_scale", c.gs),
    ):
        if not math.isfinite(value):
            raise ValueError(f"{name} overflows float32 (its limit is 3.4e38)")
    return c


#: Mantissa bits of the codes of ``m`` (with a sign) and of ``sqrt(v)``; both have 4 exponent
#: bits.
M_BITS = 3
V_BITS = 4
_MIN_NORMAL = 2.0**-14
_MIN_NORMAL_BITS = (127 - 14) << 23


def top(bits: int) -> float:
    """The largest value of the codes with ``bits`` mantissa bits, ``2 - 2^-bits``."""
    return 2.0 - 2.0**-bits


def decode(code: torch.Tensor, bits: int) -> torch.Tensor:
    """The float32 values of ``code`` (int32, each in [0, 2^(4 + bits))), exactly."""
    subnormal = code.float() * 2.0 ** -(14 + bits)
    normal = (((code - (1 << bits)) << (23 - bits)) + _MIN_NORMAL_BITS).view(torch.float32)
    return torch.where(code < (1 << bits), subnormal, normal)


def encode(y: torch.Tensor, bits: int) -> torch.Tensor:
    """The int32 codes of the values nearest to ``min(y, top(bits))`` (float32 ``y >= 0``), ties
    to the even code; 0 for a NaN."""
    y = torch.where(torch.isnan(y), 0.0, y).clamp(0.0, top(bits))
    subnormal = torch.round(y * 2.0 ** (14 + bits)).to(torch.int32)
    b = y.view(torch.int32)
    shift = 23 - bits
    rounded = b + ((1 << (shift - 1)) - 1) + ((b >> shift) & 1)
    normal = ((rounded - _MIN_NORMAL_BITS) >> shift) + (1 << bits)
    return torch.where(y < _MIN_NORMAL, subnormal, normal)


def _check(p, g, qm, qv, sm, sv, w_out) -> int:
    """The element count, after checking the tensors' types, sizes, layout and device."""
    n = p.numel()
    nb = blocks(n)
    expected = [
        ("p", p, (torch.float32, torch.bfloat16), n),
        ("g", g, (torch.bfloat16, torch.float32), n),
        ("qm", qm, (torch.int8,), n),
        ("qv", qv, (torch.uint8,), n),
        ("sm", sm, (torch.float32,), nb),
        ("sv", sv, (torch.float32,), nb),
    ]
    if w_out is not None:
        if isinstance(p, torch.Tensor) and p.dtype == torch.bfloat16:
            raise ValueError(
                "w_out must be None for a bfloat16 p: the parameter is the working weight, "
                "updated in place"
            )
        expected.append(("w_out", w_out, (torch.bfloat16,), n))
    if n < 1:
        raise ValueError("p must have at least 1 element")
    for name, t, dtypes, size in expected:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            names = " or ".join(str(d) for d in dtypes)
            raise ValueError(f"{name} must be {names}, got {t.dtype}")
        if t.numel() != size:
            raise ValueError(f"{name} must have {size} elements (for p's {n}), got {t.numel()}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.device != p.device:
            raise ValueError(f"{name} is on {t.device}, p on {p.device}: all on one device")
    return n


@torch.no_grad()
def reference_step(
    p: torch.Tensor,
    g: torch.Tensor,
    qm: torch.Tensor,
    qv: torch.Tensor,
    sm: torch.Tensor,
    sv: torch.Tensor,
    w_out: torch.Tensor | None,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
) -> None:
    """One step of the module's formula, in place, with torch operations: ``p`` (float32, or
    bfloat16: the working weight, its new value rounded to nearest-even), ``qm``, ``qv``,
    ``sm``, ``sv`` (the state from ``new_state``) and, unless None, ``w_out`` (bfloat16, the new
    float32 ``p`` rounded; None for a bfloat16 ``p``) are written; ``g`` (bfloat16 or float32)
    is read. All
    contiguous, on one device, of ``p``'s element count (``blocks(n)`` for ``sm``, ``sv``);
    ``step`` counts from 1. Bit for bit ``native_step`` on the CPU."""
    n = _check(p, g, qm, qv, sm, sv, w_out)
    c = constants(step, lr, beta1, beta2, eps, weight_decay, grad_scale)
    nb = blocks(n)

    def padded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # (nb, BLOCK) float32; the short last block padded with zeros (which leave its
        # maxima unchanged, and whose results are dropped).
        out = torch.zeros(nb * BLOCK, dtype=dtype, device=p.device)
        out[:n] = t.reshape(-1)
        return out.view(nb, BLOCK)

    f32 = torch.float32
    gf = padded(g, f32) * c.gs
    code_m = padded(qm, torch.int32)
    magnitude = decode(code_m.abs(), M_BITS)
    m = torch.where(code_m < 0, -magnitude, magnitude) * (sm.reshape(-1) / top(M_BITS))[:, None]
    r = decode(padded(qv, torch.int32), V_BITS) * (sv.reshape(-1) / top(V_BITS))[:, None]
    v = r * r
    m = m * c.b1 + gf * c.c1
    v = v * c.b2 + (gf * gf) * c.c2
    # torch's float32 sqrt on the CPU is not always correctly rounded (within 1 ulp); float64's,
    # rounded to float32, is (a float32's square root is never near enough to a float32
    # rounding boundary for float64's error to cross it).
    r = torch.sqrt(v.double()).float()
    pp = padded(p, f32) * c.decay
    pp = pp - (m / (r * c.inv_bc2 + c.eps)) * c.step_size

    def inverse(top_: float, maximum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # top / maximum as a tensor division (a Python scalar divided by a tensor is computed
        # as a reciprocal and a product); 0 where the maximum is 0 or not finite.
        finite = torch.isfinite(maximum)
        k = torch.where(finite & (maximum > 0), torch.full_like(maximum, top_) / maximum, 0.0)
        return k[:, None], torch.where(finite, maximum, math.nan)

    km, sm_new = inverse(top(M_BITS), m.abs().amax(dim=1))
    kv, sv_new = inverse(top(V_BITS), r.amax(dim=1))
    magnitude = encode(m.abs() * km, M_BITS)
    qm_new = torch.where(m < 0, -magnitude, magnitude)
    qv_new = torch.maximum(encode(r * kv, V_BITS), (qm_new != 0).to(torch.int32))

    p_new = pp.reshape(-1)[:n]
    p.view(-1).copy_(p_new)  # a bfloat16 p: rounded to nearest-even, as .to(torch.bfloat16)
    qm.view(-1).copy_(qm_new.reshape(-1)[:n].to(torch.int8))
    qv.view(-1).copy_(qv_new.reshape(-1)[:n].to(torch.uint8))
    sm.view(-1).copy_(sm_new)
    sv.view(-1).copy_(sv_new)
    if w_out is not None:
        w_out.view(-1).copy_(p_new.to(torch.bfloat16))


def native_step(
    p: torch.Tensor,
    g: torch.Tensor,
    qm: torch.Tensor,
    qv: torch.Tensor,
    sm: torch.Tensor,
    sv: torch.Tensor,
    w_out: torch.Tensor | None,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
) -> None:
    """``reference_step`` by the extension's CPU kernel: the same arguments, all on the CPU,
    and the same bits. Runs on all cores with the GIL released; the tensors must not be used
    by other threads meanwhile, and must not overlap in memory (``ValueError``)."""
    n = _check(p, g, qm, qv, sm, sv, w_out)
    if p.device.type != "cpu":
        raise ValueError(f"native_step runs on the CPU: p is on {p.device}")
    constants(step, lr, beta1, beta2, eps, weight_decay, grad_scale)
    _native.adamw8bit_step(
        p.data_ptr(),
        g.data_ptr(),
        "bf16" if g.dtype == torch.bfloat16 else "f32",
        qm.data_ptr(),
        qv.data_ptr(),
        sm.data_ptr(),
        sv.data_ptr(),
        0 if w_out is None else w_out.data_ptr(),
        n,
        step,
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        float(grad_scale),
        "bf16" if p.dtype == torch.bfloat16 else "f32",
    )
