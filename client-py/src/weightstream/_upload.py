"""Writing an upload's tensors by tensor copies into the mapped region, for tensors that live on
a CUDA device: the region the daemon hands out (its pages already allocated by the daemon) is
mapped here and page-locked one window at a time (``cudaHostRegister``), so each tensor goes
device → shared memory by the GPU's copy engine at link speed. (The native client's memcpy path
needs the bytes in host memory first: a pageable device-to-host copy per tensor, the whole model
held twice on the host, ~0.5 GB/s for FLUX.2.)

Registering costs far more than copying: the driver locks and maps every 4 KiB page (~2 GB/s on
one thread, against ~50 GB/s for the copies), so the windows are registered on several threads,
ahead of the copies, and unregistered behind them, at most ``2 × threads`` windows locked at
once. The region cannot stay locked for the daemon to reuse: it seals the region against writes
at commit, which the kernel refuses while any of its pages is pinned (a pin could be a device
that writes on after the seal).
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from weightstream.quantize import Fp8Weight, scale_offset

#: Bytes page-locked at once by one registration: large enough that registering costs little per
#: call, small enough that the windows in flight stay a few GB.
WINDOW = 1 << 30
#: Threads that register windows at most (``write_by_copy(threads=)``; the cores, up to this).
THREADS = 8
PAGE = mmap.PAGESIZE
#: ``cudaHostRegisterPortable``: pinned for every device's context, for tensors on several.
_PORTABLE = 1


@dataclass
class WriteTimings:
    """Where a ``write_by_copy`` spent its time, in seconds: ``wall`` all of it; ``register`` and
    ``unregister`` summed over the threads that ran them (they overlap the copies and each
    other); ``wait_register`` the copying thread waiting for a window's registration; ``copy``
    issuing the copies (they complete while later windows register)."""

    wall: float = 0.0
    register: float = 0.0
    wait_register: float = 0.0
    copy: float = 0.0
    unregister: float = 0.0
    bytes: int = 0
    windows: int = 0
    threads: int = 0

    def as_dict(self) -> dict:
        out = {f"{k}_s": round(v, 4) for k, v in vars(self).items() if isinstance(v, float)}
        out.update(bytes=self.bytes, windows=self.windows, threads=self.threads)
        return out


def _register(ptr: int, size: int, flags: int):
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, flags)
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


def _span(placements: Sequence, run: list[int], size: int) -> tuple[int, int]:
    """The pages a run covers: (start, end) in the region."""
    first, last = placements[run[0]], placements[run[-1]]
    lo = first.offset - first.offset % PAGE
    hi = min(size, -(-(last.offset + last.nbytes) // PAGE) * PAGE)
    return lo, hi


def _disjoint(runs: list[list[int]], spans: list[tuple[int, int]]):
    """Runs merged where their pages overlap (pages larger than the daemon's 4 KiB tensor
    alignment), so that no page is in two windows locked at once."""
    out_runs, out_spans = [], []
    for run, (lo, hi) in zip(runs, spans, strict=True):
        if out_spans and lo < out_spans[-1][1]:
            out_runs[-1] = out_runs[-1] + run
            out_spans[-1] = (out_spans[-1][0], max(hi, out_spans[-1][1]))
        else:
            out_runs.append(run)
            out_spans.append((lo, hi))
    return out_runs, out_spans


def default_threads() -> int:
    return max(1, min(THREADS, os.cpu_count() or 1))


def write_by_copy(
    fd: int,
    size: int,
    placements: Sequence,
    tensors: Sequence[torch.Tensor],
    *,
    pin: bool,
    progress: Callable[[int, int], None] | None = None,
    threads: int | None = None,
    window: int = WINDOW,
) -> WriteTimings:
    """Writes ``tensors[i]`` at ``placements[i].offset`` of the region behind ``fd`` (closed
    here) in windows of about ``window`` bytes, page-locking each first when ``pin`` (on
    ``threads`` threads, default ``default_threads()``); the region is unmapped on return.
    Returns where the time went."""
    started = time.monotonic()
    timings = WriteTimings(bytes=sum(p.nbytes for p in placements))
    located = [t.data if isinstance(t, Fp8Weight) else t for t in tensors]
    devices = sorted({t.device for t in located if t.device.type == "cuda"}, key=str)
    try:
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    region = None
    try:
        region = torch.frombuffer(mapped, dtype=torch.uint8)
        runs = windows(placements, window)
        timings.windows = len(runs)
        copy = _Copier(region, placements, tensors, pin, timings.bytes, progress)
        if pin:
            _copy_pinned(copy, runs, size, devices, threads or default_threads(), timings)
        else:
            for run in runs:
                copy.run(run)
    finally:
        for device in devices if pin else ():
            torch.cuda.synchronize(device)  # no copy may land in the region once it is unmapped
        del region
        mapped.close()
    timings.wall = time.monotonic() - started
    return timings


class _Copier:
    """Copies runs of tensors into the region and reports progress."""

    def __init__(self, region, placements, tensors, non_blocking, total, progress):
        self.region, self.placements, self.tensors = region, placements, tensors
        self.non_blocking, self.total, self.progress = non_blocking, total, progress
        self.done = 0

    def run(self, run: list[int]):
        for i in run:
            p = self.placements[i]
            pieces = _pieces(self.tensors[i])
            end = pieces[-1][0] + pieces[-1][1].numel()
            if end != p.nbytes:
                raise ValueError(f"tensor {p.name!r}: {end} bytes, the upload declared {p.nbytes}")
            for at, src in pieces:
                start = p.offset + at
                self.region[start : start + src.numel()].copy_(src, non_blocking=self.non_blocking)
            self.done += p.nbytes
        if self.progress is not None:
            self.progress(self.done, self.total)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _pieces(t) -> list[tuple[int, torch.Tensor]]:
    """(offset in the tensor's slice, bytes) of what an upload writes for ``t``: its bytes; for
    a pre-quantized weight (``quantize.Fp8Weight``), its data, zeros up to the scales' offset
    (16-byte aligned) and its scales, the store's layout."""
    if not isinstance(t, Fp8Weight):
        return [(0, _bytes(t))]
    data, scales = _bytes(t.data), _bytes(t.scale)
    offset = scale_offset(t.data.shape)
    zeros = torch.zeros(offset - data.numel(), dtype=torch.uint8, device=data.device)
    return [(0, data), (data.numel(), zeros), (offset, scales)]


def _copy_pinned(copy: _Copier, runs, size: int, devices, threads: int, timings: WriteTimings):
    """The pipeline: windows registered ``threads`` ahead of the copies on a pool, copied in
    order here, each unregistered on the pool once events after its copies (on each device's
    current stream, where torch ran them) have passed."""
    base = copy.region.data_ptr()
    runs, spans = _disjoint(runs, [_span(copy.placements, run, size) for run in runs])
    timings.windows = len(runs)
    flags = _PORTABLE if len(devices) > 1 else 0
    device = devices[0] if devices else None
    lock = threading.Lock()

    def add(field: str, since: float):
        with lock:
            setattr(timings, field, getattr(timings, field) + time.monotonic() - since)

    def register(k: int):
        t = time.monotonic()
        lo, hi = spans[k]
        _register(base + lo, hi - lo, flags)
        add("register", t)

    def unregister(k: int, events: list[torch.cuda.Event]):
        for event in events:
            event.synchronize()
        t = time.monotonic()
        _unregister(base + spans[k][0])
        add("unregister", t)

    def on_device():
        if device is not None:
            torch.cuda.set_device(device)  # the current context is the copies' device

    timings.threads = threads
    ahead: dict[int, Future] = {}
    behind: list[Future] = []
    with ThreadPoolExecutor(threads, "weightstream-upload", initializer=on_device) as pool:
        try:
            for k in range(min(threads, len(runs))):
                ahead[k] = pool.submit(register, k)
            for k, run in enumerate(runs):
                t = time.monotonic()
                ahead.pop(k).result()
                timings.wait_register += time.monotonic() - t
                t = time.monotonic()
                try:
                    copy.run(run)
                finally:
                    events = [torch.cuda.Event() for _ in devices]
                    for event, d in zip(events, devices, strict=True):
                        event.record(torch.cuda.current_stream(d))
                    behind.append(pool.submit(unregister, k, events))
                timings.copy += time.monotonic() - t
                if k + threads < len(runs):
                    ahead[k + threads] = pool.submit(register, k + threads)
        finally:
            # A failure: the windows registered but not copied are unregistered too.
            for k, registered in ahead.items():
                if registered.exception() is None:
                    behind.append(pool.submit(unregister, k, []))
            errors = [f.exception() for f in behind if f.exception() is not None]
    if errors:
        raise errors[0]


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
