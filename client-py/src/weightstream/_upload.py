"""Writing an upload's tensors by tensor copies into the mapped region, for tensors that live on
a CUDA device: the region the daemon hands out is mapped here and page-locked one window at a
time (``cudaHostRegister``), so each tensor goes device → shared memory by the GPU's copy engine
at link speed. (The native client's memcpy path needs the bytes in host memory first: a pageable
device-to-host copy per tensor, the whole model held twice on the host, ~0.5 GB/s for FLUX.2.)
"""

from __future__ import annotations

import mmap
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch

#: Bytes page-locked at once: large enough that registering costs little per byte, small
#: enough that the process never holds the whole model locked twice over.
WINDOW = 2 << 30
PAGE = mmap.PAGESIZE


def _register(ptr: int, size: int):
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {size} bytes of the upload region failed: {err}")


def _unregister(ptr: int):
    torch.cuda.cudart().cudaHostUnregister(ptr)


def windows(placements: Sequence, limit: int = WINDOW) -> list[list[int]]:
    """Indices of ``placements`` (each with ``offset``/``nbytes``, in region order) cut into
    runs of at most ``limit`` bytes (a larger tensor is a run of its own)."""
    runs: list[list[int]] = []
    start = None
    for i in sorted(range(len(placements)), key=lambda i: placements[i].offset):
        p = placements[i]
        if not runs or p.offset + p.nbytes - start > limit:
            runs.append([])
            start = p.offset
        runs[-1].append(i)
    return runs


def write_by_copy(
    fd: int,
    size: int,
    placements: Sequence,
    tensors: Sequence[torch.Tensor],
    *,
    pin: bool,
    progress: Callable[[int, int], None] | None = None,
):
    """Writes ``tensors[i]`` at ``placements[i].offset`` of the region behind ``fd`` (closed
    here), page-locking each window first when ``pin``; the region is unmapped on return."""
    try:
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    region = None
    try:
        region = torch.frombuffer(mapped, dtype=torch.uint8)
        base = region.data_ptr()
        total = sum(p.nbytes for p in placements)
        done = 0
        for run in windows(placements):
            first, last = placements[run[0]], placements[run[-1]]
            lo = first.offset - first.offset % PAGE
            hi = min(size, -(-(last.offset + last.nbytes) // PAGE) * PAGE)
            if pin:
                _register(base + lo, hi - lo)
            try:
                for i in run:
                    p, t = placements[i], tensors[i]
                    src = t.detach().contiguous().reshape(-1).view(torch.uint8)
                    if src.numel() != p.nbytes:
                        raise ValueError(
                            f"tensor {p.name!r}: {src.numel()} bytes, the upload declared "
                            f"{p.nbytes}"
                        )
                    region[p.offset : p.offset + p.nbytes].copy_(src, non_blocking=pin)
                if pin:
                    torch.cuda.synchronize()
            finally:
                if pin:
                    _unregister(base + lo)
            done += sum(placements[i].nbytes for i in run)
            if progress is not None:
                progress(done, total)
    finally:
        del region
        mapped.close()


class ProgressLine:
    """A one-line progress report on stderr for uploads that take more than ``after`` s."""

    def __init__(self, label: str, after: float = 2.0):
        self.label, self.after = label, after
        self.started = time.monotonic()
        self.shown = False

    def __call__(self, done: int, total: int):
        elapsed = time.monotonic() - self.started
        if elapsed < self.after and done < total:
            return
        if elapsed >= self.after:
            self.shown = True
        if self.shown:
            rate = done / max(elapsed, 1e-9) / 1e9
            end = "\n" if done >= total else ""
            print(
                f"\r{self.label}: {done / 2**30:.1f}/{total / 2**30:.1f} GiB, "
                f"{rate:.1f} GB/s, {elapsed:.0f} s",
                end=end,
                file=sys.stderr,
                flush=True,
            )
