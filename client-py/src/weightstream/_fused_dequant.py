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
the CPU too, by Triton's interpreter (``tests/python/torch/test_fused_dequant.py``: float16 and
float32 only, as the interpreter does not round to bfloat16 as the GPU does).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

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
            args = (q, scale, out, n_scales, block, per_program)
            if _start_compiled(compiled, grid, q.device.index, args):
                return
            _compiled = key = None  # the JIT's dispatch from now on
    compiled = blocks[grid](q, scale, out, n_scales, BLOCK=block, BLOCKS=per_program)
    if key is not None and _compiled is not None:
        _compiled[key] = compiled


def _start_compiled(compiled, grid: tuple, device_index: int, args: tuple) -> bool:
    """Starts a kernel as Triton compiled it (all its arguments, constants included, in
    order) on the current stream of the device; False where this Triton's compiled kernels do
    not start so (its JIT's dispatch is then the way)."""
    stream = _kernel()[0].runtime.driver.active.get_current_stream(device_index)
    try:
        compiled[grid](*args, stream=stream)
        return True
    except (AttributeError, TypeError):
        return False


#: Offsets a group launch needs to be multiples of, in elements: 16 bytes for the 8-bit data,
#: the scales (fp32) and the output (any of ``_OUT_DTYPES``), so that each program's loads and
#: stores stay as wide as the single-weight kernel's (``tl.multiple_of``).
_GROUP_ALIGN = 16


@functools.cache
def _group_kernel():
    """The kernel of ``launch_group``: the block kernel over several weights in one launch.
    A table row per weight (its first program, the offsets of its data, scales and output
    from the first weight's, its number of scale blocks) tells each program which weight it
    works on, by a scan over the rows (a group holds a few tens of weights at most). None
    where the single-weight kernels are off."""
    if _kernel() is None:
        return None
    import triton.language as tl

    triton = _kernel()[0]

    @triton.jit
    def group(
        q_ptr, s_ptr, out_ptr, table_ptr, N: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr
    ):
        pid = tl.program_id(0)
        t = 0
        for i in tl.static_range(1, N):
            t += (pid >= tl.load(table_ptr + i * 5)).to(tl.int32)
        row = table_ptr + t * 5
        first = tl.load(row)
        q_off = tl.multiple_of(tl.load(row + 1), 16)
        s_off = tl.multiple_of(tl.load(row + 2), 4)
        o_off = tl.multiple_of(tl.load(row + 3), 16)
        n_blocks = tl.load(row + 4)
        b = (pid - first).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        live = b < n_blocks
        s = tl.load(s_ptr + s_off + b, mask=live, other=1.0)
        offs = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        q = tl.load(q_ptr + q_off + offs, mask=live[:, None], other=0.0).to(tl.float32)
        w = (q * s[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + o_off + offs, w, mask=live[:, None])

    return group


def launch_group(weights: list, dtype: torch.dtype) -> list | None:
    """The dequantizations of several 8-bit weights ``[(q, scale), ...]`` on one device
    (``dequantize``'s formula, same bits) in one launch on its current stream (or, under
    Triton's interpreter, on the CPU), each a view of one new tensor in ``dtype``; None where
    one launch cannot do them all (``plan_group``). ``plan_group``, then its ``run``: for the
    same weights at every call, keep the plan (``quantize.GroupDequantizer``)."""
    plan = plan_group(weights, dtype)
    return None if plan is None else plan.run(weights[0], weights[-1])


def _contiguous_strides(shape: torch.Size) -> tuple:
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= size
    return tuple(reversed(strides))


@dataclass(eq=False)
class GroupLaunch:
    """What a group launch (``launch_group``) needs besides the first weight's data and
    scales: the checks passed, the table on the device, the outputs' places. A group's weights
    keep their places relative to each other in every ticket, so a trainer makes it once per
    group and output dtype (``plan_group``), and ``run`` costs the CPU an allocation, a launch
    and a view per weight: FLUX's steps are bound by the CPU's issuing."""

    device: torch.device
    dtype: torch.dtype
    #: One row per weight (its first program, the offsets of its data, scales and output from
    #: the first weight's, its number of scale blocks), on the device.
    table: torch.Tensor
    programs: int
    out_len: int
    #: Per weight, its output's (shape, contiguous strides, offset) in the one new tensor.
    outs: tuple
    #: The last weight's data and scales, in bytes from the first weight's: ``run`` checks
    #: them (weights laid out otherwise than planned are refused).
    last: tuple
    #: The kernel's compile-time constants: the number of weights, the scale block, blocks
    #: per program.
    consts: tuple
    #: The kernel as Triton compiled it for these constants, from the first launch whose
    #: pointers were 16-byte aligned (``launch``'s reasoning); None until then, or once a
    #: direct start failed.
    compiled: object = None
    direct: bool = True

    def run(self, first: tuple, last: tuple) -> list | None:
        """The planned weights dequantized in one launch on the current stream of their
        device, given the first and the last as ``(q, scale)``; None where they are not laid
        out as planned (the last placed otherwise relative to the first, or another device)."""
        (q0, s0), (qn, sn) = first, last
        if (
            q0.device != self.device
            or (qn.data_ptr() - q0.data_ptr(), sn.data_ptr() - s0.data_ptr()) != self.last
        ):
            return None
        out = torch.empty(self.out_len, dtype=self.dtype, device=self.device)
        if self.device.type != "cuda" or torch.cuda.current_device() == self.device.index:
            self._start(q0, s0, out)
        else:
            with torch.cuda.device(self.device):
                self._start(q0, s0, out)
        return [out.as_strided(shape, strides, at) for shape, strides, at in self.outs]

    def _start(self, q0, s0, out):
        n, block, per_program = self.consts
        aligned = self.device.type == "cuda" and (q0.data_ptr() | s0.data_ptr()) % 16 == 0
        if aligned and self.direct and self.compiled is not None:
            args = (q0, s0, out, self.table, n, block, per_program)
            if _start_compiled(self.compiled, (self.programs, 1, 1), self.device.index, args):
                return
            self.direct, self.compiled = False, None  # the JIT's dispatch from now on
        compiled = _group_kernel()[(self.programs,)](
            q0, s0, out, self.table, N=n, BLOCK=block, BLOCKS=per_program
        )
        if aligned and self.direct:
            self.compiled = compiled


def plan_group(weights: list, dtype: torch.dtype) -> GroupLaunch | None:
    """The ``GroupLaunch`` of weights ``[(q, scale), ...]`` laid out as these are; None where
    Triton is missing or off, the weights are not all fp8 with fp32 scales on one device, the
    scale block is not a power of two up to a program's chunk or not the same for all, or an
    offset between them is not a multiple of 16 bytes."""
    kernel = _group_kernel()
    if kernel is None or not weights or dtype not in _OUT_DTYPES:
        return None
    q0, s0 = weights[0]
    device = q0.device
    block = q0.numel() // max(s0.numel(), 1)
    if block <= 0 or block & (block - 1) or block > _CHUNK:
        return None
    per_program = _CHUNK // block
    rows, outs, first, out_len = [], [], 0, 0
    for q, scale in weights:
        if not (
            q.device == device
            and scale.device == device
            and q.dtype == torch.float8_e4m3fn
            and scale.dtype == torch.float32
            and q.is_contiguous()
            and scale.is_contiguous()
            and q.numel() > 0
            and q.numel() == scale.numel() * block
        ):
            return None
        q_off = q.data_ptr() - q0.data_ptr()
        s_off, s_rem = divmod(scale.data_ptr() - s0.data_ptr(), 4)
        if q_off % _GROUP_ALIGN or s_rem or s_off % (_GROUP_ALIGN // 4):
            return None
        n_blocks = scale.numel()
        rows.append((first, q_off, s_off, out_len, n_blocks))
        outs.append((q.shape, _contiguous_strides(q.shape), out_len))
        first += -(-n_blocks // per_program)
        out_len += -(-q.numel() // _GROUP_ALIGN) * _GROUP_ALIGN
    qn, sn = weights[-1]
    return GroupLaunch(
        device=device,
        dtype=dtype,
        table=torch.tensor(rows, dtype=torch.int64).to(device),
        programs=first,
        out_len=out_len,
        outs=tuple(outs),
        last=(qn.data_ptr() - q0.data_ptr(), sn.data_ptr() - s0.data_ptr()),
        consts=(len(rows), block, per_program),
    )
