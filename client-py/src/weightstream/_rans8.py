"""The decoder of the tensors the daemon stores entropy-coded (the proto's ``CODING_RANS8``):
interleaved rANS over bytes, order 0, as ``daemon/src/store/rans8.rs`` encodes it (and
``tests/bench/rans8.py`` measures it). A coded tensor of ``n`` bytes in ``lanes`` lanes is one
blob, little endian, at its place in a staged group: the decoder's table (``uint32[4096]``, an
entry a slot: its byte, the byte's frequency less 1 << 8, the slot's place in the byte's range
<< 20), each lane's initial state (``uint32[lanes]``), where each lane's words start
(``uint32[lanes + 1]``, the last the words' count), the words (``uint16``). Lane ``j`` decodes
bytes ``j, j + lanes, j + 2 * lanes, ...``: a step of every lane decodes ``lanes`` bytes.

On a CUDA device, ``decode_into`` decodes all the coded tensors of a call in one Triton launch
on the current stream, with no host synchronisation: a group holds a few to a few tens of them,
each of few lanes (the daemon gives a lane 512 bytes), so a launch each would leave the GPU
mostly idle. A descriptor row per tensor (the device addresses of its table, states, offsets and
words, its output's offset, n, lanes, first program, its blob's words) and each program's row
are made once per place (``plan_for``: the caller keeps the ``Plan``); a program decodes
``BLOCK`` lanes of one tensor (a thread a lane, a loop over the steps). The device cannot say
that a blob is corrupt without a synchronisation: its word loads stay inside the blob's words
(a lane reads none past its offsets' end, nor past the blob), so a corrupt blob gives wrong
bytes, never a fault. Triton is needed there (``decode_into`` says so where it is missing).

On the CPU (the daemon's host backend) a numpy decoder, all the lanes of a tensor a step at a
time, reads each blob through views of the region (never writing it: it may be a read-only
mapping) and refuses a corrupt one: each lane must read exactly its words and end in the state
it started encoding in. ``tests/python/torch/test_rans8.py`` checks both decoders, the kernel
under Triton's interpreter on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

#: Bytes of the decoder's table at the head of a blob (``uint32[4096]``).
HEADER_BYTES = 16384
#: The lower bound of a state: every lane starts encoding, and ends decoding, at it.
_L = 1 << 16
#: Lanes a program decodes (one a thread).
BLOCK = 128
#: The descriptor's columns: table, states, offsets, words (device addresses), dst, n, lanes,
#: first program, the blob's words.
_COLS = 9
_NEED_TRITON = (
    "weightstream: decoding coded weights on a GPU needs Triton (pip install triton), which "
    "cannot be imported here"
)


def blob_nbytes(lanes: int, words: int) -> int:
    """The bytes of the blob of a tensor coded in ``lanes`` lanes to ``words`` words."""
    return HEADER_BYTES + 4 * lanes + 4 * (lanes + 1) + 2 * words


@dataclass(frozen=True)
class CodedTensor:
    """One coded tensor of a group: its blob at ``region[src:src + stored]``, its ``n``
    decoded bytes to ``out[dst:dst + n]``."""

    src: int
    stored: int
    dst: int
    n: int
    lanes: int

    def words(self) -> int:
        """The words its blob holds (``check`` first)."""
        return (self.stored - blob_nbytes(self.lanes, 0)) // 2


def _what(t: CodedTensor) -> str:
    return f"weightstream: the coded tensor at out[{t.dst}:{t.dst + t.n}]"


def check(t: CodedTensor) -> None:
    """Refuses (ValueError) a coded tensor whose placement cannot be a blob's."""
    what = _what(t)
    if t.lanes < 1:
        raise ValueError(f"{what} has {t.lanes} lanes: a blob codes in at least 1")
    if t.n < 1:
        raise ValueError(f"{what} decodes to {t.n} bytes: a blob codes at least 1")
    if t.src < 0 or t.dst < 0:
        raise ValueError(f"{what} has its blob at {t.src}: offsets cannot be negative")
    rest = t.stored - blob_nbytes(t.lanes, 0)
    if rest < 0 or rest % 2:
        raise ValueError(
            f"{what} has a blob of {t.stored} bytes, which cannot hold {t.lanes} lanes: the "
            f"table, states and offsets ({blob_nbytes(t.lanes, 0)} bytes) and whole 16-bit words"
        )


@functools.cache
def _kernel():
    """The group decoder (compiled on first use), or None where Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def rans8_group(desc, programs, out, COLS: tl.constexpr, B: tl.constexpr):
        pid = tl.program_id(0)
        row = desc + tl.load(programs + pid).to(tl.int64) * COLS
        table = tl.load(row).to(tl.pointer_type(tl.int32))
        states = tl.load(row + 1).to(tl.pointer_type(tl.int32))
        offsets = tl.load(row + 2).to(tl.pointer_type(tl.int32))
        words = tl.load(row + 3).to(tl.pointer_type(tl.int16))
        n, lanes = tl.load(row + 5), tl.load(row + 6)
        lane = (pid - tl.load(row + 7)).to(tl.int64) * B + tl.arange(0, B)
        live = lane < lanes
        x = tl.load(states + lane, mask=live, other=65536).to(tl.uint32, bitcast=True)
        at = tl.load(offsets + lane, mask=live, other=0).to(tl.uint32, bitcast=True)
        end = tl.load(offsets + lane + 1, mask=live, other=0).to(tl.uint32, bitcast=True)
        at, end = at.to(tl.int64), tl.minimum(end.to(tl.int64), tl.load(row + 8))
        dst = out + tl.load(row + 4) + lane
        left = n  # bytes from this step's first on: one step while any are left
        while left > 0:
            e = tl.load(table + (x & 4095).to(tl.int32)).to(tl.uint32, bitcast=True)
            tl.store(dst, (e & 0xFF).to(tl.uint8), mask=live & (lane < left))
            x = (((e >> 8) & 0xFFF) + 1) * (x >> 12) + (e >> 20)
            need = live & (x < 65536)
            w = tl.load(words + at, mask=need & (at < end), other=0).to(tl.uint32) & 0xFFFF
            x = tl.where(need, (x << 16) | w, x)
            at += need.to(tl.int64)
            dst += lanes
            left -= lanes

    return triton, rans8_group


@dataclass(frozen=True, eq=False)
class Plan:
    """A group launch for coded tensors at fixed places of one region (``plan_for``)."""

    region_ptr: int
    #: ``int64[T, _COLS]`` on the device: a row a tensor.
    desc: torch.Tensor
    #: ``int32[programs]`` on the device: each program's row.
    programs: torch.Tensor
    #: The output bytes the tensors reach.
    out_end: int


def plan_for(region: torch.Tensor, tensors: Sequence[CodedTensor], device) -> Plan:
    """The ``Plan`` of decoding ``tensors`` from ``region`` (as ``decode_into``): the same for
    every call with this region's address and these tensors, so kept per staged place."""
    base, rows, programs = region.data_ptr(), [], []
    for i, t in enumerate(tensors):
        check(t)
        where = f"{_what(t)} has its blob at region[{t.src}:{t.src + t.stored}]"
        if t.src + t.stored > region.numel():
            raise ValueError(f"{where}, past the region's {region.numel()} bytes")
        table = base + t.src
        if table % 4:
            raise ValueError(f"{where}, not at a multiple of 4 bytes")
        states = table + HEADER_BYTES
        offsets = states + 4 * t.lanes
        words = offsets + 4 * (t.lanes + 1)
        blocks = -(-t.lanes // BLOCK)
        rows.append((table, states, offsets, words, t.dst, t.n, t.lanes, len(programs), t.words()))
        programs += [i] * blocks
    return Plan(
        region_ptr=base,
        desc=_to(torch.tensor(rows, dtype=torch.int64).reshape(-1, _COLS), device),
        programs=_to(torch.tensor(programs, dtype=torch.int32), device),
        out_end=max((t.dst + t.n for t in tensors), default=0),
    )


def _to(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``, copied to a CUDA device from pinned memory without waiting (a
    copy from pageable memory would synchronise the host with the stream)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def launch(plan: Plan, out: torch.Tensor) -> None:
    """Starts the plan's group decode into ``out`` on the current stream of its device (or,
    under Triton's interpreter, on the CPU)."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError(_NEED_TRITON)
    if not plan.programs.numel():
        return
    grid = (plan.programs.numel(),)
    if out.is_cuda and out.device.index != torch.cuda.current_device():
        with torch.cuda.device(out.device):
            kernel[1][grid](plan.desc, plan.programs, out, COLS=_COLS, B=BLOCK)
    else:
        kernel[1][grid](plan.desc, plan.programs, out, COLS=_COLS, B=BLOCK)


def decode_into(
    region: torch.Tensor,
    tensors: Sequence[CodedTensor],
    out: torch.Tensor,
    plan: Plan | None = None,
) -> None:
    """Decodes each of ``tensors`` from ``region`` (flat uint8: the mapped region) into
    ``out[dst:dst + n]`` (flat uint8, on the region's device). On a CUDA device, one launch on
    the current stream (``plan``: ``plan_for``'s, made here when not given); on the CPU, tensor
    by tensor, refusing (ValueError) a corrupt blob."""
    if region.dtype != torch.uint8 or out.dtype != torch.uint8 or region.device != out.device:
        raise ValueError("weightstream: decode_into takes uint8 region and out on one device")
    if region.dim() != 1 or out.dim() != 1 or not (region.is_contiguous() and out.is_contiguous()):
        raise ValueError("weightstream: decode_into takes flat contiguous region and out")
    if out.device.type != "cpu":
        if _kernel() is None:
            raise RuntimeError(_NEED_TRITON)
        if plan is None:
            plan = plan_for(region, tensors, out.device)
        elif plan.region_ptr != region.data_ptr() or plan.desc.device != out.device:
            raise ValueError("weightstream: decode_into's plan was made for another region")
        if plan.out_end > out.numel():
            raise ValueError(
                f"weightstream: the coded tensors reach out[{plan.out_end}], past its "
                f"{out.numel()} bytes"
            )
        launch(plan, out)
        return
    mem, dst = region.numpy(), out.numpy()
    for t in tensors:
        check(t)
        if t.src + t.stored > mem.size or t.dst + t.n > dst.size:
            raise ValueError(
                f"{_what(t)} (its blob at region[{t.src}:{t.src + t.stored}]) lies past the "
                "region or out"
            )
        _decode_cpu(mem[t.src : t.src + t.stored], t, dst[t.dst : t.dst + t.n])


def _decode_cpu(blob: np.ndarray, t: CodedTensor, out: np.ndarray) -> None:
    """``t`` decoded from its ``blob`` (uint8) into ``out`` (uint8[n]), all lanes a step at a
    time (``tests/bench/rans8.py``'s ``decode_numpy``)."""
    k, at = t.lanes, HEADER_BYTES + 4 * t.lanes

    def u32(begin: int, count: int) -> np.ndarray:
        return blob[begin : begin + 4 * count].view("<u4").astype(np.int64)

    table, x = u32(0, HEADER_BYTES // 4), u32(HEADER_BYTES, k)
    offsets = u32(at, k + 1)
    words = blob[at + 4 * (k + 1) :].view("<u2").astype(np.int64)
    total = words.size
    if not total:
        words = np.zeros(1, np.int64)  # a lane that reads one is refused below
    at = offsets[:-1].copy()
    for lo in range(0, t.n, k):
        e = table[x & 4095]
        out[lo : lo + k] = (e & 0xFF)[: t.n - lo]
        x = (((e >> 8) & 0xFFF) + 1) * (x >> 12) + (e >> 20)
        need = x < _L
        x = np.where(need, (x << 16) | words[np.minimum(at, words.size - 1)], x)
        at += need
    what = _what(t)
    if offsets[0] != 0 or offsets[-1] != total or not np.array_equal(at, offsets[1:]):
        raise ValueError(f"{what}: the lanes' words do not match their offsets")
    if not np.all(x == _L):
        raise ValueError(f"{what}: the lanes do not end in the state {_L}: the data is corrupt")
