"""The fused dequantization of 8-bit weights on a CUDA device: one Triton kernel that reads each
fp8 element and its block's fp32 scale, multiplies in fp32 and rounds once to the compute dtype
(round to nearest even), 3 bytes of device memory traffic per element instead of ~15 for the
three torch kernels it replaces (fp8 -> fp32 copy, the in-place product, the cast).

Bit for bit the same result as ``quantize.dequantize``'s torch path: the fp8 -> fp32 conversion
is exact, the product is one fp32 multiplication (no addition, so nothing for the compiler to
contract into a fused multiply-add), and Triton's fp32 -> bf16/fp16 cast rounds to nearest even
like torch's ``.to``. ``tests/gpu/torch_suite.py`` checks it against the torch path on random
and edge tensors; ``WEIGHTSTREAM_FUSED_DEQUANT=0`` turns it off (the torch path then runs).

Triton is optional: where it cannot be imported (CPU-only installs), or the tensors are not on a
CUDA device, ``quantize.dequantize`` keeps its torch path. The kernels' indexing is tested on
the CPU too, by Triton's interpreter (``tests/python/test_fused_dequant.py``: float16 and
float32 only, as the interpreter does not round to bfloat16 as the GPU does).
"""

from __future__ import annotations

import functools
import os

import torch

#: Elements per program: whole scale blocks in the block kernel (64 blocks of 64), a row's
#: chunk in the row kernel (a longer row takes several programs).
_CHUNK = 4096
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _kernel():
    """The two compiled-on-first-use kernels, or None where Triton is missing or turned off.

    - ``blocks``: the scale's block is a power of two up to ``_CHUNK`` (``fp8_e4m3_block64``'s
      64): a program takes ``BLOCKS`` whole blocks, loads their scales once and broadcasts each
      over its block's elements, so no element's index is divided by a runtime divisor.
    - ``rows``: any other block (a whole row: torchao's per-row scales, or a row that is not a
      multiple of 64): a 2-D grid of (row, chunk of the row), one scale per program.
    """
    if os.environ.get("WEIGHTSTREAM_FUSED_DEQUANT", "1") == "0":
        return None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit(do_not_specialize=["n_blocks"])
    def blocks(q_ptr, s_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
        b = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        live = b < n_blocks
        s = tl.load(s_ptr + b, mask=live, other=1.0)
        offs = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        q = tl.load(q_ptr + offs, mask=live[:, None], other=0.0).to(tl.float32)
        w = (q * s[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, w, mask=live[:, None])

    @triton.jit
    def rows(q_ptr, s_ptr, out_ptr, row, CHUNK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        live = c < row
        s = tl.load(s_ptr + r)
        offs = r * row + c
        q = tl.load(q_ptr + offs, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (q * s).to(out_ptr.dtype.element_ty), mask=live)

    return (triton, blocks, rows)


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
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if torch.cuda.current_device() == q.device.index:
        launch(q, scale, out)
    else:
        with torch.cuda.device(q.device):
            launch(q, scale, out)
    return out


#: The block kernel as Triton compiled it, per (device, output dtype, BLOCK), from a first
#: launch whose three pointers were 16-byte aligned (what Triton specialised it for; the
#: element count is not specialised). Later launches with aligned pointers start it directly:
#: Triton's JIT dispatch (binding, specialising and hashing the arguments) took 12 of the 35 µs
#: a launch cost the CPU on the H200, where FLUX's steps are bound by the CPU's issuing. None
#: once a direct start failed (a Triton whose compiled kernels start otherwise).
_compiled: dict | None = {}


def launch(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor):
    """Writes ``(q.float() * scale).to(out.dtype)`` into ``out`` (contiguous, q's shape) with
    the kernel for the scale's block size, on the current device and stream."""
    global _compiled
    triton, blocks, rows = _kernel()
    n_scales = scale.numel()
    block = q.numel() // n_scales
    if block & (block - 1) or block > _CHUNK:
        rows[(n_scales, triton.cdiv(block, _CHUNK))](q, scale, out, block, CHUNK=_CHUNK)
        return
    per_program = _CHUNK // block
    grid = (triton.cdiv(n_scales, per_program), 1, 1)
    key = None
    if _compiled is not None and (q.data_ptr() | scale.data_ptr() | out.data_ptr()) % 16 == 0:
        key = (q.device.index, out.dtype, block)
        compiled = _compiled.get(key)
        if compiled is not None:
            stream = triton.runtime.driver.active.get_current_stream(q.device.index)
            try:
                compiled[grid](q, scale, out, n_scales, block, per_program, stream=stream)
                return
            except (AttributeError, TypeError):
                _compiled = key = None  # the JIT's dispatch from now on
    compiled = blocks[grid](q, scale, out, n_scales, BLOCK=block, BLOCKS=per_program)
    if key is not None and _compiled is not None:
        _compiled[key] = compiled
