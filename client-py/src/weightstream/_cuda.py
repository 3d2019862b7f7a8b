"""The client's thin layer over CUDA and the kernel for memory the device copies to and from:
opening and closing the daemon's CUDA IPC memory (ctypes on the driver library,
``libcuda.so.1``), page-locking host memory for the copy engine and giving it back, and faulting
shared memory in before it is page-locked (``madvise``). Nothing here owns memory: the owners
are ``weightstream.regions`` (the daemon's regions), ``weightstream._upload`` (an upload's
region) and ``weightstream.torch.host.storage`` (trainable state).

Page-locking goes through torch's CUDA runtime binding (``torch.cuda.cudart()``): the runtime
makes the device's primary context current on whichever thread registers (the upload registers
on worker threads), which the driver library would leave to the caller. Importing this module
loads neither library: each is opened at its first use, so CPU-only machines import it."""

from __future__ import annotations

import ctypes
import errno
import os

import torch

_driver_lib = None
_libc = None
#: ``MADV_POPULATE_WRITE`` (Linux 5.14): faults a range in writable, allocating its pages.
_MADV_POPULATE_WRITE = 23


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def _driver():
    global _driver_lib
    if _driver_lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuIpcOpenMemHandle_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            _IpcMemHandle,
            ctypes.c_uint,
        ]
        lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        _driver_lib = lib
    return _driver_lib


def ipc_open(handle: bytes) -> int:
    """The device pointer of the daemon's memory behind a 64-byte CUDA IPC handle, opened in the
    current context (``cuIpcOpenMemHandle``, lazy peer access)."""
    if len(handle) != 64:
        raise ValueError(f"CUDA IPC handle of {len(handle)} bytes, expected 64")
    raw = _IpcMemHandle()
    ctypes.memmove(ctypes.addressof(raw), handle, 64)
    ptr = ctypes.c_uint64()
    res = _driver().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), raw, 1)
    if res != 0:
        raise RuntimeError(f"cuIpcOpenMemHandle failed with CUDA error {res}")
    return ptr.value


def ipc_close(ptr: int):
    """Closes what ``ipc_open`` opened."""
    _driver().cuIpcCloseMemHandle(ptr)


def host_register(ptr: int, size: int, flags: int = 0):
    """Page-locks ``size`` bytes at ``ptr`` for the device's copy engine
    (``cudaHostRegister``). Returns the CUDA error: 0 on success, else what the caller names in
    its message."""
    return torch.cuda.cudart().cudaHostRegister(ptr, size, flags)


def host_unregister(ptr: int):
    """Gives back what ``host_register`` page-locked (``cudaHostUnregister``)."""
    torch.cuda.cudart().cudaHostUnregister(ptr)


def populate(ptr: int, size: int) -> bool:
    """Faults ``size`` bytes at ``ptr`` (a shared mapping of the upload region) in, allocating
    their pages (``MADV_POPULATE_WRITE``; the GIL is released while the kernel works). False
    where the kernel lacks the advice (before 5.14): page-locking then faults them in, slower.
    A full tmpfs or memory cgroup is an ``OSError`` saying so (a write would be a SIGBUS)."""
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = lib
    if _libc.madvise(ptr, size, _MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EINVAL:
        return False
    raise OSError(
        err,
        f"reserving {size} bytes of the upload region failed ({os.strerror(err)}): the host's "
        "shared memory (tmpfs, or this process's memory cgroup) has no room for the model",
    )
