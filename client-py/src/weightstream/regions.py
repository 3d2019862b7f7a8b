"""Every mapping of the daemon's memory into this process:

- ``HostRegion``: a session's region on the host backend, shared memory mapped read-only from
  the fd the handoff socket passed;
- ``CudaRegion``: a session's region on the CUDA backend, its IPC handle opened once per
  session (``weightstream._cuda``), wrapped as a uint8 tensor on the device;
- ``StateRegion``: host memory the daemon holds for one session, for a trainer's own state
  (LoRA master weights, optimizer moments) kept on the host, mapped read-write.

``Session.alloc_state_region(nbytes, label)`` asks the daemon for a region; the daemon makes a
shared-memory region (a memfd), charges it to this uid's host bytes (``quotas.per_uid_host_bytes``
and ``quotas.max_host_bytes``, refused up front with ``RequestRejected("RESOURCE_EXHAUSTED", …)``
naming the numbers when it does not fit) and hands this process its fd, which is mapped here
shared and read-write: ``region.buffer`` (an ``mmap``), or ``region.tensor(dtype)`` (a CPU
tensor over it, no copy). Page-lock the mapping yourself to copy to and from a GPU at link speed
(``torch.cuda.cudart().cudaHostRegister`` on ``region.address``, in large pieces).

A region is the session's: the daemon frees it with the session (closing it, the process
exiting or crashing) or at ``region.close()``. Memory this process still maps stays charged to
its uid until it is unmapped and its fd closed (``close()`` does both; a mapping with tensors
still over it goes when the last of them does).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import warnings
from collections.abc import Callable

import torch

from weightstream import _cuda
from weightstream.errors import DaemonUnavailable, RequestRejected


class _DevicePointer:
    """Lets torch wrap IPC-mapped device memory without a copy (it keeps this object alive)."""

    def __init__(self, ptr: int, size: int):
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


class HostRegion:
    """A shared-memory region, mapped read-only from the fd the daemon passed (closed here:
    the mapping keeps the memory)."""

    def __init__(self, fd: int, size: int):
        try:
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            # The mapping is read-only on purpose: streamed weights are frozen.
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def close(self):
        """Drops this region's references: the mapping goes when the last tensor over it does.
        Not ``mmap.close()``: ``torch.frombuffer`` keeps the mmap object alive but takes no
        buffer export, so the close would succeed and unmap the memory under live views (a
        later read of one of them is a segfault)."""
        self.bytes = None
        self._map = None


class CudaRegion:
    """Device memory exported by the daemon, opened once per session."""

    def __init__(self, handle: bytes, size: int, device: torch.device):
        if len(handle) != 64:
            raise ValueError(f"CUDA IPC handle of {len(handle)} bytes, expected 64")
        torch.zeros(1, device=device)  # the primary context must be current
        self.ptr = _cuda.ipc_open(handle)
        self.bytes = torch.as_tensor(_DevicePointer(self.ptr, size), device=device)

    def close(self):
        self.bytes = None
        if self.ptr:
            _cuda.ipc_close(self.ptr)
            self.ptr = 0


class StateRegion:
    """A state region of a session, mapped read-write (see the module's docstring)."""

    def __init__(
        self,
        free: Callable[[str, str], None],
        session_id: str,
        region_id: str,
        size: int,
        fd: int,
        label: str = "",
    ):
        #: Frees a region in the daemon (``Client.free_state_region``).
        self._free = free
        self.session_id = session_id
        self.region_id = region_id
        self.size = size
        self.label = label
        self.fd = fd
        try:
            self.buffer: mmap.mmap | None = mmap.mmap(
                fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            os.close(fd)
            self.fd = -1
            raise

    @property
    def address(self) -> int:
        """Where the mapping starts in this process (for page-locking it)."""
        if self.buffer is None:
            raise ValueError(f"state region {self.region_id} is closed")
        return ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))

    def tensor(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole region as a flat CPU tensor of ``dtype`` (default ``torch.uint8``) over the
        mapping (``torch.frombuffer``: no copy; writes go to the region)."""
        if self.buffer is None:
            raise ValueError(f"state region {self.region_id} is closed")
        return torch.frombuffer(self.buffer, dtype=dtype or torch.uint8)

    @property
    def closed(self) -> bool:
        return self.buffer is None and self.fd < 0

    def close(self):
        """Unmaps the region, closes its fd and frees it in the daemon; safe to call twice, after
        the session has ended (the daemon freed it then) and in a forked child (which only
        unmaps its copy: the session's own process frees it). A mapping that tensors (or other
        references to ``buffer``) still use goes when the last of them does, and stays charged
        to this uid until then."""
        if self.closed:
            return
        # Not ``mmap.close()``: a tensor over the mapping (``torch.frombuffer``) holds a
        # reference to the ``mmap`` but no buffer export, so closing it would unmap the memory
        # under the tensor. Dropped instead, the mapping goes with its last reference.
        self.buffer = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self._free(self.session_id, self.region_id)
        except RequestRejected as e:
            # NOT_FOUND: the session (or the region) has ended. PERMISSION_DENIED: another
            # connection's, as in a forked child: its owner frees it.
            if e.code not in ("NOT_FOUND", "PERMISSION_DENIED"):
                raise
        except DaemonUnavailable:
            # No daemon to free it in: it went with the daemon's sessions.
            pass

    def __enter__(self) -> StateRegion:
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # A region dropped unclosed: its fd is closed here, its mapping goes with the ``mmap``
        # (or the last tensor over it); the daemon frees it with the session.
        fd = getattr(self, "fd", -1)
        if fd >= 0:
            os.close(fd)

    def __repr__(self):
        return (
            f"StateRegion(region_id={self.region_id!r}, session_id={self.session_id!r}, "
            f"size={self.size}, label={self.label!r}, closed={self.closed})"
        )
