"""Host memory for trainable state: ``HostStorage`` (regions of the daemon's session, or the
trainer's own, page-locked for the copy engine on CUDA), ``Carver`` (lays tensors out in one
region) and ``BounceRing`` (where gradients land when their slot cannot take them)."""

from __future__ import annotations

import collections
import math
import threading
import time

import torch

from weightstream import _cuda

#: Byte alignment of each tensor in a host region (a cache line, and fp32/bf16 vector loads).
ALIGN = 256


class TrainableError(ValueError):
    """A trainable layer or a request weightstream cannot stream: the message says which and
    what to do."""


# --- host memory --------------------------------------------------------------------------


class HostStorage:
    """Host memory for trainable state: regions handed out by ``alloc`` as uint8 CPU tensors,
    page-locked for the device's copy engine when the device is CUDA, freed by ``close``."""

    def __init__(self, device: torch.device, session=None):
        self.device = device
        self.session = session
        self._regions: list = []  # (region or None, tensor, registered pointer or None)

    def alloc(self, nbytes: int, label: str) -> torch.Tensor:
        if nbytes <= 0:
            return torch.empty(0, dtype=torch.uint8)
        if self.session is not None:
            region = self.session.alloc_state_region(nbytes, label)
            buf = torch.frombuffer(region.buffer, dtype=torch.uint8, count=nbytes)
            # Fault the pages in on all cores first: page-locking populated pages runs ~10x
            # faster than locking fresh ones (daemon/DESIGN.md, "Uploads of device tensors").
            buf.zero_()
        else:
            region = None
            buf = torch.zeros(nbytes, dtype=torch.uint8)
        ptr = None
        if self.device.type == "cuda":
            ptr = buf.data_ptr()
            err = _cuda.host_register(ptr, nbytes)
            if int(err) != 0:
                if region is not None:
                    region.close()
                raise RuntimeError(
                    f"page-locking {nbytes} bytes of trainable state failed ({err}): raise the "
                    "memlock limit (ulimit -l) of the trainer"
                )
        self._regions.append((region, buf, ptr))
        return buf

    @property
    def paces(self) -> bool:
        """Whether the daemon paces this storage's copies (``grant`` asks it)."""
        return self.session is not None and bool(self.session.paces_client_copies)

    def grant(self, nbytes: int, to_device: bool):
        """Waits until the daemon lets ``nbytes`` of trainable state cross the link (the
        session's ``grant``): the copies of the LoRA's working weights and gradients are paced
        with the daemon's copies of the base under a copy bandwidth limit or a share. Nothing
        to wait for without a session, or where the daemon does not pace them."""
        if self.paces:
            self.session.grant(nbytes, to_device)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for _, b, _ in self._regions)

    def close(self):
        regions, self._regions = self._regions, []
        for region, buf, ptr in regions:
            if ptr is not None:
                _cuda.host_unregister(ptr)
            del buf
            if region is not None:
                region.close()


class Carver:
    """Lays tensors out in one region: ``reserve`` while counting, then ``views`` in
    the same order once the region exists."""

    def __init__(self):
        self.size = 0
        self._specs: list[tuple[int, tuple, torch.dtype]] = []

    def reserve(self, shape, dtype: torch.dtype) -> int:
        offset = -(-self.size // ALIGN) * ALIGN
        n = 1
        for d in shape:
            n *= d
        self.size = offset + n * dtype.itemsize
        self._specs.append((offset, tuple(shape), dtype))
        return len(self._specs) - 1

    def views(self, region: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for offset, shape, dtype in self._specs:
            n = 1
            for d in shape:
                n *= d
            out.append(region[offset : offset + n * dtype.itemsize].view(dtype).view(shape))
        return out


class BounceRing:
    """Host memory the gradients land in when they cannot land in their slot's gradient: one
    region (``HostStorage.alloc``: the session's, page-locked on CUDA), handed out first in,
    first out, which is the order the worker gives the pieces back (the order gradients
    arrive). ``take`` waits while the ring has no room; a piece larger than the ring is a
    ``TrainableError`` (the ring is sized for the largest group's gradients)."""

    def __init__(self, region: torch.Tensor):
        self.region = region
        self.size = region.numel()
        self._given: collections.deque[tuple[int, int]] = collections.deque()  # oldest first
        self._head = 0  # the end of the newest piece
        self._cv = threading.Condition()

    def _room(self, n: int) -> int | None:
        """Where a piece of ``n`` bytes fits now, or None."""
        if not self._given:
            return 0
        tail = self._given[0][0]
        if self._head > tail:  # the pieces lie in [tail, head): room after them, else before
            if self._head + n <= self.size:
                return self._head
            return 0 if n <= tail else None
        return self._head if self._head + n <= tail else None  # wrapped: room in [head, tail)

    def take(self, shape, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
        """A piece for a tensor of ``shape`` and ``dtype``, and the seconds spent waiting for
        room."""
        nbytes = math.prod(shape) * dtype.itemsize
        n = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        if n > self.size:
            raise TrainableError(
                f"a gradient of {nbytes} bytes does not fit the {self.size}-byte bounce ring"
            )
        t = time.perf_counter()
        with self._cv:
            self._cv.wait_for(lambda: self._room(n) is not None)
            at = self._room(n)
            self._given.append((at, at + n))
            self._head = at + n
        piece = self.region[at : at + nbytes].view(dtype).view(shape)
        return piece, time.perf_counter() - t

    def give(self):
        """Gives the oldest piece back."""
        with self._cv:
            self._given.popleft()
            if not self._given:
                self._head = 0
            self._cv.notify_all()

    @property
    def in_use(self) -> int:
        """Pieces handed out and not given back."""
        with self._cv:
            return len(self._given)
