"""The fused dequantization of ``fp8_e4m3_block64`` on a CUDA device: one Triton kernel that
reads each fp8 element and its block's fp32 scale, multiplies in fp32 and rounds once to the
compute dtype (round to nearest even), 3 bytes of device memory traffic per element instead of
~15 for the three torch kernels it replaces (fp8 -> fp32 copy, the in-place product, the cast).

Bit for bit the same result as ``quantize.dequantize``'s torch path: the fp8 -> fp32 conversion
is exact, the product is one fp32 multiplication (no addition, so nothing for the compiler to
contract into a fused multiply-add), and Triton's fp32 -> bf16/fp16 cast rounds to nearest even
like torch's ``.to``. ``tests/gpu/torch_suite.py`` checks it against the torch path on random
and edge tensors; ``WEIGHTSTREAM_FUSED_DEQUANT=0`` turns it off (the torch path then runs).

Triton is optional: where it cannot be imported (CPU-only installs, the CI machine), or the
tensors are not on a CUDA device, ``quantize.dequantize`` keeps its torch path.
"""

from __future__ import annotations

import functools
import os

import torch

#: Elements per Triton program (a multiple of the 64-element block, so most programs read few
#: scales).
_PROGRAM = 4096
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _kernel():
    """The compiled-on-first-use kernel, or None where Triton is missing or turned off."""
    if os.environ.get("WEIGHTSTREAM_FUSED_DEQUANT", "1") == "0":
        return None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def dequant(q_ptr, s_ptr, out_ptr, n, block, PROGRAM: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * PROGRAM + tl.arange(0, PROGRAM)
        mask = offs < n
        q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + offs // block, mask=mask, other=1.0)
        tl.store(out_ptr + offs, (q * s).to(out_ptr.dtype.element_ty), mask=mask)

    return (triton, dequant)


def applies(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``dequantize`` of these tensors runs the fused kernel."""
    return (
        q.is_cuda
        and q.dtype == torch.float8_e4m3fn
        and scale.dtype == torch.float32
        and scale.device == q.device
        and dtype in _OUT_DTYPES
        and q.is_contiguous()
        and scale.is_contiguous()
        and q.numel() > 0
        and _kernel() is not None
    )


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(q.float() * scale).to(dtype)`` in one kernel; call only where ``applies`` is true.
    The scale of element i (row-major) is ``scale.flatten()[i // block]``, block = elements per
    scale (64, or a whole row when the row is not a multiple of 64)."""
    triton, kernel = _kernel()
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    n = q.numel()
    block = n // scale.numel()
    with torch.cuda.device(q.device):
        kernel[(triton.cdiv(n, _PROGRAM),)](q, scale, out, n, block, PROGRAM=_PROGRAM)
    return out
