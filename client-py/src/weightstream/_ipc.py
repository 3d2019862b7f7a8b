"""Mapping the daemon's regions into this process: shared memory (host backend, an fd from
the handoff socket) or CUDA IPC handles opened with ctypes on the driver library (CUDA
backend), wrapped as uint8 tensors."""

from __future__ import annotations

import ctypes
import mmap
import os
import warnings

import torch

_cuda = None


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def _driver():
    global _cuda
    if _cuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuIpcOpenMemHandle_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            _IpcMemHandle,
            ctypes.c_uint,
        ]
        lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        _cuda = lib
    return _cuda


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
        raw = _IpcMemHandle()
        ctypes.memmove(ctypes.addressof(raw), handle, 64)
        ptr = ctypes.c_uint64()
        res = _driver().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), raw, 1)
        if res != 0:
            raise RuntimeError(f"cuIpcOpenMemHandle failed with CUDA error {res}")
        self.ptr = ptr.value
        self.bytes = torch.as_tensor(_DevicePointer(self.ptr, size), device=device)

    def close(self):
        self.bytes = None
        if self.ptr:
            _driver().cuIpcCloseMemHandle(self.ptr)
            self.ptr = 0
