"""Triton kernels of 8-bit compute (``weightstream.torch.compute8``): the per-row quantization of
activations (and of output gradients, with a per-column pre-scale) in one kernel, and the
scale epilogue of an int8 matmul, each bit for bit the torch formula ``compute8`` documents.

- ``quantize_rows``: per row, amax = max |v| (v = x in fp32, times the column scale where one
  is given), scale = amax / qmax (a correctly rounded division, ``tl.div_rn``: Triton's ``/``
  is an approximate one on NVIDIA GPUs), 1 where that is 0, q = cast(clamp(v / scale, -qmax,
  qmax)) with the division correctly rounded too, then rounded half to even by adding and
  subtracting 1.5 * 2^23 times the grid's spacing at v (int8: 1; e4m3: from v's exponent); the
  e4m3 code's bits are then assembled from that exact value with integer operations. One pass
  over the row for amax, one for the cast: about 5 bytes of traffic per bf16 element in place
  of the ~20 of torch's abs/amax/div/clamp/cast chain.
- ``scale_int32``: y = ((acc * row_scale) * col_scale) + bias in fp32, cast to the output
  dtype, with fused multiply-adds off (``enable_fp_fusion=False``): the torch formula's
  roundings, one by one.

Triton is optional: where it cannot be imported, or the tensors are not on a CUDA device, the
torch formulas run. ``WEIGHTSTREAM_FUSED_QUANT8=0`` turns the kernels off. The kernels run on
the CPU under Triton's interpreter (``TRITON_INTERPRET=1``), which
``tests/python/test_compute8.py`` uses to compare them with the torch formulas bit for bit.
"""

from __future__ import annotations

import functools
import os

import torch

#: Elements of a row one step of a program takes. The row's length is a compile-time constant
#: of the quantizer (a model has a few widths): its loops are then unrolled to known bounds.
_CHUNK = 1024
#: 1.5 * 2^23: v + this - this rounds v (|v| < 2^22) to an integer, half to even.
ROUNDER = 12582912.0


@functools.cache
def _kernels():
    """(triton, quantize_rows, scale_int32), compiled on first use; None where Triton is
    missing or turned off."""
    if os.environ.get("WEIGHTSTREAM_FUSED_QUANT8", "1") == "0":
        return None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def quantize_rows(
        x_ptr,
        c_ptr,
        q_ptr,
        s_ptr,
        stride_x,
        K: tl.constexpr,
        QMAX: tl.constexpr,
        INT8: tl.constexpr,
        COLSCALE: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        row = x_ptr + r * stride_x
        peak = tl.zeros([CHUNK], dtype=tl.float32)
        for k0 in range(0, K, CHUNK):
            c = k0 + tl.arange(0, CHUNK)
            live = c < K
            v = tl.load(row + c, mask=live, other=0.0).to(tl.float32)
            if COLSCALE:
                v = v * tl.load(c_ptr + c, mask=live, other=0.0)
            peak = tl.maximum(peak, tl.abs(v))
        amax = tl.max(peak, axis=0)
        qmax = tl.full([], QMAX, dtype=tl.float32)
        scale = tl.div_rn(amax, qmax)
        scale = tl.where(scale == 0.0, 1.0, scale)
        tl.store(s_ptr + r, scale)
        for k0 in range(0, K, CHUNK):
            c = k0 + tl.arange(0, CHUNK)
            live = c < K
            v = tl.load(row + c, mask=live, other=0.0).to(tl.float32)
            if COLSCALE:
                v = v * tl.load(c_ptr + c, mask=live, other=0.0)
            v = tl.div_rn(v, tl.zeros_like(v) + scale)
            v = tl.minimum(tl.maximum(v, -qmax), qmax)
            if INT8:
                v = (v + 12582912.0) - 12582912.0
            else:
                # Round |v| to its e4m3 grid point (3 mantissa bits; subnormal spacing 2^-9
                # below 2^-6) by the same add-and-subtract, with the constant 1.5 * 2^23 *
                # spacing built from |v|'s exponent, then write the code's bits from that
                # exact value, the sign of v (of -0 too) on top: no conversion instruction
                # rounds (nor the interpreter's, which carries and signs zeros wrongly).
                a = tl.abs(v)
                e = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 121) - 3
                big = (((e + 23) << 23) | 4194304).to(tl.float32, bitcast=True)
                a = (a + big) - big
                ab = a.to(tl.int32, bitcast=True)
                normal = (((ab >> 23) - 120) << 3) | ((ab >> 20) & 7)
                code = tl.where(a >= 0.015625, normal, (a * 512.0).to(tl.int32))
                v = tl.where(v.to(tl.int32, bitcast=True) < 0, code | 128, code)
            tl.store(q_ptr + r * K + c, v.to(q_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def scale_int32(
        acc_ptr,
        rs_ptr,
        cs_ptr,
        b_ptr,
        out_ptr,
        N,
        HAS_COL: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        live = c < N
        y = tl.load(acc_ptr + r * N + c, mask=live, other=0).to(tl.float32)
        y = y * tl.load(rs_ptr + r)
        if HAS_COL:
            y = y * tl.load(cs_ptr + c, mask=live, other=0.0)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + c, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * N + c, y.to(out_ptr.dtype.element_ty), mask=live)

    return triton, quantize_rows, scale_int32


def available() -> bool:
    return _kernels() is not None


def _on_device(t: torch.Tensor) -> bool:
    """Whether the kernels run for ``t``: on a CUDA device, or anywhere under the interpreter
    (how the tests run them on the CPU)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def quantize_rows_applies(x: torch.Tensor) -> bool:
    return (
        _on_device(x)
        and x.dim() == 2
        and x.stride(1) == 1
        and x.shape[0] > 0
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and _kernels() is not None
    )


def quantize_rows(
    x: torch.Tensor, qdtype: torch.dtype, qmax: float, col_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] of ``qdtype``, scale [M] float32) of the rows of ``x`` [M, K] (unit column
    stride), each column first multiplied by ``col_scale`` [K] (float32) where given; call
    only where ``quantize_rows_applies``."""
    triton, kernel, _ = _kernels()
    m, k = x.shape
    q = torch.empty((m, k), dtype=qdtype, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    # e4m3's codes are written as bytes (the kernel makes them from exact values).
    qout = q if qdtype == torch.int8 else q.view(torch.uint8)
    cs = col_scale if col_scale is not None else scale  # unread where COLSCALE is off
    kernel[(m,)](
        x,
        cs,
        qout,
        scale,
        x.stride(0),
        K=k,
        QMAX=qmax,
        INT8=qdtype == torch.int8,
        COLSCALE=col_scale is not None,
        CHUNK=_CHUNK,
    )
    return q, scale


def scale_int32_applies(acc: torch.Tensor) -> bool:
    return _on_device(acc) and acc.is_contiguous() and acc.numel() > 0 and available()


def scale_int32(
    acc: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """((acc * row_scale[:, None]) * col_scale[None, :] + bias) in float32, cast to
    ``out_dtype``; call only where ``scale_int32_applies``."""
    triton, _, kernel = _kernels()
    m, n = acc.shape
    out = torch.empty((m, n), dtype=out_dtype, device=acc.device)
    cs = col_scale if col_scale is not None else row_scale
    b = bias if bias is not None else row_scale
    kernel[(m, triton.cdiv(n, _CHUNK))](
        acc,
        row_scale,
        cs,
        b,
        out,
        n,
        HAS_COL=col_scale is not None,
        HAS_BIAS=bias is not None,
        CHUNK=_CHUNK,
        enable_fp_fusion=False,
    )
    return out
