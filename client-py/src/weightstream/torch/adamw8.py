"""An AdamW step with 8-bit block-wise quantized moments, for fp32 master weights kept in host
memory: ``native_step`` runs the extension's CPU kernel (parallel, the GIL released),
``reference_step`` computes the same formula with torch operations, bit for bit (the
specification the kernel is tested against, and a fallback on any device).

Per parameter the state is 2 bytes (``m`` as int8, ``sqrt(v)`` as uint8) plus two float32
scales per block of 256 parameters: 6 bytes per parameter with the master, against 12 for
fp32 AdamW. ``new_state(n)`` makes the zero state of an ``n``-element parameter.

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
shorter); block ``b`` holds ``qm[i]`` (int8, in [-127, 127]), ``qv[i]`` (uint8), ``sm[b]`` (the
absolute maximum of its ``m``) and ``sv[b]`` (the maximum of its ``sqrt(v)``). The codes are
square roots: ``qm[i]`` stands for ``m = qm * |qm| / 127^2 * sm[b]``, ``qv[i]`` for
``sqrt(v) = qv^2 / 255^2 * sv[b]``, which keeps small moments (down to about 1e-5 of the
block's maximum) apart from 0 where a linear code loses everything below 1/254 of it. For each
element ``i`` of block ``b``::

    g  = f32(grad[i]) * gs                     (bf16 to f32 is exact)
    m  = f32(qm[i] * |qm[i]|) * (sm[b] / 16129)   (the integer products are exact; sm[b] / 16129
    r  = f32(qv[i] * qv[i]) * (sv[b] / 65025)      and sv[b] / 65025: once per block)
    v  = r * r
    m  = m * b1 + g * c1
    v  = v * b2 + (g * g) * c2
    r  = sqrt(v)
    p  = p[i] * decay
    p  = p - (m / (r * inv_bc2 + eps)) * step_size

then, over the block, ``sm' = max |m|`` and ``sv' = max r``; ``km = 16129 / sm'`` and
``kv = 65025 / sv'`` (once per block; 0 where the maximum is 0 or not finite), and::

    qm[i] = sign(m) * q(sqrt(|m| * km), 127)
    qv[i] = max(q(sqrt(r * kv), 255), 1 if qm[i] != 0 else 0)
    q(x, hi) = 0 if x is NaN, else round_half_even(min(x, hi))
    w[i]  = bf16(p)                            (round to nearest-even: .to(torch.bfloat16))

and ``p``, ``sm[b] = sm'``, ``sv[b] = sv'`` (NaN where not finite, below) are stored. This is
``torch.optim.AdamW``'s step (decoupled weight decay first, bias corrections, ``eps`` added to
the corrected ``sqrt(v)``) with the moments read from and written to their 8-bit form, and the
correction of ``v`` applied as a product with its reciprocal. The floor of ``qv`` keeps a
nonzero ``m`` from meeting a zero ``sqrt(v)`` (an update of ``m / eps``).

NaN and infinity: a non-finite gradient is not skipped (check for overflow and skip the step,
as ``torch.amp.GradScaler`` does). A block whose new ``m`` (or ``r``) holds a NaN or an infinity
stores ``sm' = NaN`` (or ``sv' = NaN``) and codes 0 (``qv``: 0 or its floor): later steps read
NaN moments for the block and its parameters become NaN, as a NaN gradient makes them in fp32
AdamW. A NaN parameter gives a NaN ``w`` (of unspecified bits). A block whose maximum is
finite but below about 4.7e-35 (``m``) or 1.9e-34 (``sqrt(v)``) has an infinite ``km``
(``kv``): its nonzero elements get the largest code, its zeros 0.

torch: ``reference_step`` avoids the operations whose CPU kernels may fuse a multiply and an
add (``lerp``, ``addcmul``, ``addcdiv``, ``add`` with ``alpha`` other than 1) and ``scalar /
tensor`` (torch computes it as ``tensor.reciprocal() * scalar``, two roundings), and takes the
float32 square root as float64's rounded (torch's float32 ``sqrt`` on the CPU may be 1 ulp
off: it uses MKL's vector function). Its
bit-exactness is tested on the CPU; on a GPU it computes the same formula, not necessarily the
same bits.

Threads: ``native_step`` runs on the extension's rayon pool (``RAYON_NUM_THREADS`` sets its
size), which a forked child does not have: call it in the process that trains, not in
DataLoader workers. It writes through the tensors' addresses: autograd's version counters do
not see the change (master weights and optimizer state are outside any graph).
"""

from __future__ import annotations

import math
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
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (1 for the first step), got {step!r}")
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


def _check(p, g, qm, qv, sm, sv, w_out) -> int:
    """The element count, after checking the tensors' types, sizes, layout and device."""
    n = p.numel()
    nb = blocks(n)
    expected = [
        ("p", p, (torch.float32,), n),
        ("g", g, (torch.bfloat16, torch.float32), n),
        ("qm", qm, (torch.int8,), n),
        ("qv", qv, (torch.uint8,), n),
        ("sm", sm, (torch.float32,), nb),
        ("sv", sv, (torch.float32,), nb),
    ]
    if w_out is not None:
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
    """One step of the module's formula, in place, with torch operations: ``p`` (float32),
    ``qm``, ``qv``, ``sm``, ``sv`` (the state from ``new_state``) and, unless None, ``w_out``
    (bfloat16, the new ``p`` rounded) are written; ``g`` (bfloat16 or float32) is read. All
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

    def sqrt(x: torch.Tensor) -> torch.Tensor:
        # torch's float32 sqrt on the CPU is not always correctly rounded (MKL's vector sqrt is
        # within 1 ulp); float64's, rounded to float32, is (a float32's square root is never
        # near enough to a float32 rounding boundary for float64's error to cross it).
        return torch.sqrt(x.double()).float()

    f32 = torch.float32
    gf = padded(g, f32) * c.gs
    code_m = padded(qm, f32)
    code_v = padded(qv, f32)
    m = (code_m * code_m.abs()) * (sm.reshape(-1) / 16129.0)[:, None]
    r = (code_v * code_v) * (sv.reshape(-1) / 65025.0)[:, None]
    v = r * r
    m = m * c.b1 + gf * c.c1
    v = v * c.b2 + (gf * gf) * c.c2
    r = sqrt(v)
    pp = padded(p, f32) * c.decay
    pp = pp - (m / (r * c.inv_bc2 + c.eps)) * c.step_size

    def inverse(top: torch.Tensor, square: float) -> tuple[torch.Tensor, torch.Tensor]:
        # square / top as a tensor division (a Python scalar divided by a tensor is computed as
        # a reciprocal and a product); 0 where the maximum is 0 or not finite.
        finite = torch.isfinite(top)
        k = torch.where(finite & (top > 0), torch.full_like(top, square) / top, 0.0)
        return k[:, None], torch.where(finite, top, math.nan)

    def code(x: torch.Tensor, hi: float) -> torch.Tensor:
        x = torch.where(torch.isnan(x), 0.0, x)
        return torch.round(torch.clamp(x, 0.0, hi))

    km, sm_new = inverse(m.abs().amax(dim=1), 16129.0)
    kv, sv_new = inverse(r.amax(dim=1), 65025.0)
    mag = code(sqrt(m.abs() * km), 127.0)
    qm_new = torch.where(m < 0, -mag, mag).to(torch.int8)
    qv_new = torch.maximum(code(sqrt(r * kv), 255.0), (qm_new != 0).to(f32)).to(torch.uint8)

    p_new = pp.reshape(-1)[:n]
    p.view(-1).copy_(p_new)
    qm.view(-1).copy_(qm_new.reshape(-1)[:n])
    qv.view(-1).copy_(qv_new.reshape(-1)[:n])
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
    )
