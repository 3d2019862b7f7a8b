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

A weight to be kept in 8 bits that lives on a CUDA device is quantized there as it is copied
(``QuantizeAtCopy``): the region holds the 8-bit layout (half the bytes of bf16) and the commit
has nothing to quantize. Each weight is quantized in chunks of rows right before their copies,
so the device holds one chunk's temporaries at a time, never the quantized model.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from weightstream import _cuda
from weightstream.quantize import (
    FP8_E4M3_BLOCK64,
    QUANTIZABLE,
    Fp8Weight,
    fp8_nbytes,
    quantize_fp8_block64,
    scale_offset,
    scale_shape,
)

#: Bytes page-locked at once by one registration: large enough that registering costs little per
#: call, small enough that the windows in flight stay a few GB.
WINDOW = 1 << 30
#: Threads that register windows at most (``write_by_copy(threads=)``; the cores, up to this).
THREADS = 8
PAGE = mmap.PAGESIZE
#: ``cudaHostRegisterPortable``: pinned for every device's context, for tensors on several.
_PORTABLE = 1
#: Whether uploads that page-lock their windows ask the daemon not to reserve the region's
#: pages (``begin_upload(client_reserves=True)``): each window is faulted in here, on the
#: registering threads, while earlier windows are copied, instead of the whole region before
#: the daemon answers (the largest part of a bf16 attach). A benchmark turns it off to compare.
CLIENT_RESERVES = True
#: Float32 bytes of one chunk of rows of a weight quantized at copy time (``QuantizeAtCopy``):
#: the quantizer's temporaries are a few of these. A row larger than this is a chunk of its own.
QUANTIZE_CHUNK = 64 << 20


@dataclass(frozen=True)
class QuantizeAtCopy:
    """A weight an upload writes in ``fp8_e4m3_block64``, quantized where it lives
    (``quantize_fp8_block64``, the daemon's bytes) right before its copy, in chunks of rows of
    at most ``chunk_bytes`` of float32 (blocks lie within rows: the bytes do not depend on
    the chunks). Declared at BeginUpload from its shape alone (``dtype``, ``shape``,
    ``scale_shape``, ``nbytes``), before any of it is quantized."""

    weight: torch.Tensor
    chunk_bytes: int = QUANTIZE_CHUNK

    format = FP8_E4M3_BLOCK64
    dtype = torch.float8_e4m3fn

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    @property
    def scale_shape(self) -> tuple[int, int]:
        return scale_shape(self.weight.shape)

    @property
    def nbytes(self) -> int:
        return fp8_nbytes(self.weight.shape)

    def rows_per_chunk(self) -> int:
        rows = self.weight.shape[0]
        cols = self.weight.numel() // rows if rows else 0
        return max(1, self.chunk_bytes // max(1, 4 * cols))


@dataclass
class WriteTimings:
    """Where a ``write_by_copy`` spent its time, in seconds: ``wall`` all of it; ``populate``
    (faulting a window's pages in before its registration, when the daemon left that to the
    writer), ``register`` and ``unregister`` summed over the threads that ran them (they
    overlap the copies and each other); ``wait_register`` the copying thread waiting for a
    window's registration; ``copy``
    issuing the copies (they complete while later windows register), within it ``quantize``
    issuing the quantization of the ``quantized`` weights written in 8 bits
    (``QuantizeAtCopy``; on the CPU, doing it), and ``quantize_device`` the time the devices
    spent quantizing (CUDA events around each chunk)."""

    wall: float = 0.0
    populate: float = 0.0
    register: float = 0.0
    wait_register: float = 0.0
    copy: float = 0.0
    unregister: float = 0.0
    quantize: float = 0.0
    quantize_device: float = 0.0
    bytes: int = 0
    windows: int = 0
    threads: int = 0
    quantized: int = 0
    #: (start, end) CUDA events around each chunk's quantization, summed into
    #: ``quantize_device`` once the copies are done.
    _events: list = field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        out = {f"{k}_s": round(v, 4) for k, v in vars(self).items() if isinstance(v, float)}
        out.update(
            bytes=self.bytes,
            windows=self.windows,
            threads=self.threads,
            quantized_tensors=self.quantized,
        )
        return out


#: Where ``Client.upload_model(quantize_on=)`` quantizes the weights it is asked to.
QUANTIZE_ON = ("auto", "client", "daemon")


def quantized_here(tensors, quantize, quantize_on: str) -> dict:
    """``tensors`` with those named in ``quantize`` that this process quantizes as it copies
    them wrapped in ``QuantizeAtCopy`` (chunks of ``QUANTIZE_CHUNK``): with ``"client"`` all,
    with ``"auto"`` those on a CUDA device, with ``"daemon"`` none. A tensor that cannot be
    quantized (dtype, rank) stays as it is, for the daemon to refuse with its own error."""
    if quantize_on not in QUANTIZE_ON:
        raise ValueError(f"quantize_on={quantize_on!r}: expected 'auto', 'client' or 'daemon'")
    names = set(quantize) if quantize_on != "daemon" else set()
    out = {}
    for n, t in tensors.items():
        if (
            n in names
            and isinstance(t, torch.Tensor)
            and t.dtype in QUANTIZABLE
            and t.dim() >= 2
            and (quantize_on == "client" or t.device.type == "cuda")
        ):
            t = QuantizeAtCopy(t.detach(), QUANTIZE_CHUNK)
        out[n] = t
    return out


def first_non_finite(tensors) -> str | None:
    """The daemon's refusal of the first weight among ``tensors`` quantized here
    (``QuantizeAtCopy``) that holds a non-finite value, in their order: ``"tensor 'NAME':
    NaN|+inf|-inf at index I: cannot quantize"``, I the value's index in the flattened weight
    (as ``daemon/src/store/quantize.rs`` says it); None when all are finite."""
    for n, t in tensors.items():
        if not isinstance(t, QuantizeAtCopy):
            continue
        flat = t.weight.detach().reshape(-1)
        bad = ~torch.isfinite(flat)
        if not bool(bad.any()):
            continue
        index = int(torch.argmax(bad.to(torch.uint8)))  # the first of the maxima
        value = float(flat[index])
        kind = "NaN" if math.isnan(value) else ("+inf" if value > 0 else "-inf")
        return f"tensor '{n}': {kind} at index {index}: cannot quantize"
    return None


#: The daemon's tensor alignment in a model's arena: ``TENSOR_ALIGN`` of daemon/src/store/mod.rs
#: (pinned by tests/python/client/test_client.py, against the source and a daemon's charge).
TENSOR_ALIGN = 4096


def upload_charge(label: str, tensors: list[tuple[str, int, int]]) -> int:
    """Host bytes the daemon charges for an upload of ``(name, rank, nbytes)`` tensors named
    ``label``: its arena (each tensor page-aligned, the end rounded up) and its description
    (per tensor the name, 8 bytes per dimension and 64; the model's name), as
    ``metadata_bytes`` (daemon/src/store/mod.rs) and ``begin_upload`` (daemon/src/store/upload.rs)
    count them: what the daemon charges is known only once the upload begins, and ``attach``
    checks it beside the trainable state before anything is uploaded."""
    end = 0
    for _, _, nbytes in tensors:
        end = -(-end // TENSOR_ALIGN) * TENSOR_ALIGN + nbytes
    arena = -(-end // TENSOR_ALIGN) * TENSOR_ALIGN
    description = sum(len(n.encode()) + 8 * rank + 64 for n, rank, _ in tensors)
    return arena + description + len(label.encode())


def _register(ptr: int, size: int, flags: int):
    err = _cuda.host_register(ptr, size, flags)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {size} bytes of the upload region failed: {err}")


_unregister = _cuda.host_unregister


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
    reserve: bool = False,
) -> WriteTimings:
    """Writes ``tensors[i]`` at ``placements[i].offset`` of the region behind ``fd`` (closed
    here) in windows of about ``window`` bytes, page-locking each first when ``pin`` (on
    ``threads`` threads, default ``default_threads()``), and faulting each in before it is
    page-locked when ``reserve`` (the daemon began the upload with ``client_reserves``, which
    only a page-locking writer asks for); the region is unmapped on return. Returns where the
    time went."""
    if reserve and not pin:
        raise ValueError("reserve: only a writer that page-locks its windows faults them in")
    started = time.monotonic()
    timings = WriteTimings(bytes=sum(p.nbytes for p in placements))
    devices = sorted({_located(t) for t in tensors if _located(t).type == "cuda"}, key=str)
    try:
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        # A process forked meanwhile must not inherit the writable mapping: the daemon's seal
        # at commit fails while one is alive.
        mapped.madvise(mmap.MADV_DONTFORK)
    finally:
        os.close(fd)
    region = None
    try:
        region = torch.frombuffer(mapped, dtype=torch.uint8)
        runs = windows(placements, window)
        timings.windows = len(runs)
        copy = _Copier(region, placements, tensors, pin, timings, progress)
        if pin:
            threads = threads or default_threads()
            _copy_pinned(copy, runs, size, devices, threads, timings, reserve)
        else:
            t = time.monotonic()
            for run in runs:
                copy.run(run)
            timings.copy += time.monotonic() - t
    finally:
        for device in devices if pin else ():
            torch.cuda.synchronize(device)  # no copy may land in the region once it is unmapped
        del region
        mapped.close()
    for begun, ended in timings._events:
        timings.quantize_device += begun.elapsed_time(ended) / 1e3
    timings._events.clear()
    timings.wall = time.monotonic() - started
    return timings


def _located(t) -> torch.device:
    """Where an upload entry's bytes are: a tensor's, an ``Fp8Weight``'s data's, or the weight's
    of a ``QuantizeAtCopy``."""
    if isinstance(t, QuantizeAtCopy):
        return t.weight.device
    return t.data.device if isinstance(t, Fp8Weight) else t.device


class _Copier:
    """Copies runs of tensors into the region and reports progress."""

    def __init__(self, region, placements, tensors, non_blocking, timings, progress):
        self.region, self.placements, self.tensors = region, placements, tensors
        self.non_blocking, self.timings, self.progress = non_blocking, timings, progress
        self.done = 0

    def run(self, run: list[int]):
        for i in run:
            p, t = self.placements[i], self.tensors[i]
            end = _extent(t)
            if end != p.nbytes:
                raise ValueError(f"tensor {p.name!r}: {end} bytes, the upload declared {p.nbytes}")
            if isinstance(t, QuantizeAtCopy):
                pieces = _quantized_pieces(t, self.timings)
                self.timings.quantized += 1
            else:
                pieces = _pieces(t)
            for at, src in pieces:
                start = p.offset + at
                self.region[start : start + src.numel()].copy_(src, non_blocking=self.non_blocking)
            self.done += p.nbytes
        if self.progress is not None:
            self.progress(self.done, self.timings.bytes)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, flat. A tensor torch calls contiguous may still have a size-1 dimension
    of any stride (one element of stride 64: torchao's NF4Tensor on CUDA), which a byte view
    refuses: such a one is copied to a dense tensor first."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = torch.empty_like(flat, memory_format=torch.contiguous_format).copy_(flat)
    return flat.view(torch.uint8)


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


def _extent(t) -> int:
    """Bytes an upload writes for ``t`` (``_pieces``, ``_quantized_pieces``)."""
    if isinstance(t, QuantizeAtCopy):
        return t.nbytes
    if isinstance(t, Fp8Weight):
        return scale_offset(t.data.shape) + t.scale.numel() * t.scale.element_size()
    return t.numel() * t.element_size()


def _quantized_pieces(
    t: QuantizeAtCopy, timings: WriteTimings
) -> Iterator[tuple[int, torch.Tensor]]:
    """``_pieces`` of ``t``'s weight quantized, one chunk of rows at a time: each chunk is
    quantized on the weight's device when its copies are about to be issued, and its bytes
    are dropped once they are (the caching allocator reuses them for later work on the same
    stream, which runs after those copies)."""
    w = t.weight.detach()
    rows = w.shape[0]
    if w.numel() == 0:
        return
    cols = w.numel() // rows
    blocks = t.scale_shape[1]
    scales_at = scale_offset(w.shape)
    step = t.rows_per_chunk()
    cuda = w.device.type == "cuda"
    for r in range(0, rows, step):
        began = time.monotonic()
        if cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record(torch.cuda.current_stream(w.device))
        q, scale = quantize_fp8_block64(w[r : r + step])
        if cuda:
            events[1].record(torch.cuda.current_stream(w.device))
            timings._events.append(events)
        timings.quantize += time.monotonic() - began
        yield r * cols, _bytes(q)
        yield scales_at + r * blocks * 4, _bytes(scale)
        del q, scale
    if scales_at > rows * cols:
        yield rows * cols, torch.zeros(scales_at - rows * cols, dtype=torch.uint8, device=w.device)


def _copy_pinned(
    copy: _Copier, runs, size: int, devices, threads: int, timings: WriteTimings, reserve: bool
):
    """The pipeline: windows registered ``threads`` ahead of the copies on a pool (each faulted
    in first when ``reserve``: the daemon left its pages to the writer), copied in order here,
    each unregistered on the pool once events after its copies (on each device's current
    stream, where torch ran them) have passed."""
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
        lo, hi = spans[k]
        if reserve:
            t = time.monotonic()
            _cuda.populate(base + lo, hi - lo)
            add("populate", t)
        t = time.monotonic()
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
    """A one-line progress report on stderr for uploads that take more than ``after`` s: the
    bytes written and their rate, then each phase that follows (the daemon's commit), then the
    whole time; each report overwrites the one before."""

    def __init__(self, label: str, after: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.label, self.after, self.clock = label, after, clock
        self.started = clock()
        self.shown = False
        self._width = 0

    def _elapsed(self) -> float:
        elapsed = self.clock() - self.started
        self.shown = self.shown or elapsed >= self.after
        return elapsed

    def _show(self, text: str, end: str = ""):
        line = f"{self.label}: {text}"
        pad = " " * max(0, self._width - len(line))  # what is left of a longer line before
        self._width = len(line)
        print(f"\r{line}{pad}", end=end, file=sys.stderr, flush=True)

    def __call__(self, done: int, total: int):
        elapsed = self._elapsed()
        if self.shown:
            rate = done / max(elapsed, 1e-9) / 1e9
            self._show(
                f"writing {done / 2**30:.1f}/{total / 2**30:.1f} GiB, {rate:.1f} GB/s, "
                f"{elapsed:.0f} s"
            )

    def phase(self, text: str):
        """The upload has moved on to ``text`` (shown once the report is)."""
        elapsed = self._elapsed()
        if self.shown:
            self._show(f"{text}, {elapsed:.0f} s")

    def end(self, ok: bool = True):
        """Ends the report's line: the whole time when ``ok``, else as it stands (the error
        follows on the next line)."""
        elapsed = self._elapsed()
        if self.shown:
            self._show(f"done in {elapsed:.1f} s" if ok else "failed", end="\n")
