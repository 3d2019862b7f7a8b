"""A small CUDA IPC consumer of the weightstream daemon, for the GPU suite and benchmarks.

Plain torch + ctypes on libcuda (the full Python client is client-py's job; files and upload
regions pass through the daemon's handoff socket with ``weightstream._handoff``): it opens the
session's IPC memory handles once, wraps them as uint8 tensors through
``__cuda_array_interface__``, opens interprocess events lazily, and drives the ``Run`` stream
synchronously (one Acquire, then its Staged).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import time

import grpc
import torch
from weightstream import _handoff, _sources
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as rpc

_cuda = ctypes.CDLL("libcuda.so.1")


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def _error_name(code: int) -> str:
    name = ctypes.c_char_p()
    _cuda.cuGetErrorName(code, ctypes.byref(name))
    return f"{name.value.decode() if name.value else 'unknown'} ({code})"


_cuda.cuIpcOpenMemHandle_v2.argtypes = [
    ctypes.POINTER(ctypes.c_uint64),
    _IpcMemHandle,
    ctypes.c_uint,
]
_cuda.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
LAZY_ENABLE_PEER_ACCESS = 1


class DaemonFault(RuntimeError):
    """The daemon sent a Fault for an acquire or release."""

    def __init__(self, fault):
        super().__init__(f"{pb.FaultCode.Name(fault.code)}: {fault.message}")
        self.fault = fault


class _DevicePointer:
    """Lets torch wrap IPC-mapped device memory without copying."""

    def __init__(self, ptr: int, size: int):
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def connect(socket: str, timeout: float = 10.0) -> rpc.WeightStreamStub:
    channel = grpc.insecure_channel(
        f"unix://{socket}",
        # grpc-core sends the socket path as :authority, which the daemon's HTTP/2 stack
        # rejects (RST_STREAM, PROTOCOL_ERROR): name a plain authority instead.
        options=[
            ("grpc.default_authority", "localhost"),
            ("grpc.max_receive_message_length", 1 << 30),
        ],
    )
    grpc.channel_ready_future(channel).result(timeout=timeout)
    return rpc.WeightStreamStub(channel)


def load(stub, socket, paths, name="") -> pb.ModelManifest:
    """Loads safetensors files: opened here, passed to the daemon at ``socket`` as fds."""
    opened = _sources.open_sources([os.path.abspath(p) for p in paths])
    try:
        token = _handoff.put_fds(_handoff.handoff_path(socket), [fd for _, fd in opened])
    finally:
        for _, fd in opened:
            os.close(fd)
    request = pb.LoadModelRequest(paths=[p for p, _ in opened], name=name, fd_token=token)
    manifest = None
    for event in stub.LoadModel(request):
        if event.HasField("manifest"):
            manifest = event.manifest
    return manifest


def upload_region(socket, begun) -> mmap.mmap:
    """The writable mapping of an upload's region (its fd from the handoff socket of the
    daemon at ``socket``); close it before CommitUpload."""
    fd, _ = _handoff.get_fd(_handoff.handoff_path(socket), begun.fd_secret)
    try:
        return mmap.mmap(fd, begun.size)
    finally:
        os.close(fd)


def groups_per_tensor(manifest) -> list:
    return [pb.GroupSpec(name=t.name, tensors=[t.name]) for t in manifest.tensors]


class Session:
    def __init__(
        self, stub, model_id, budget, staging=0, groups=None, manifest=None, label="gpu-test"
    ):
        torch.zeros(1, device="cuda")  # makes the primary context current on this thread
        self.stub = stub
        groups = groups if groups is not None else groups_per_tensor(manifest)
        self.opened = stub.OpenSession(
            pb.OpenSessionRequest(
                model_id=model_id,
                vram_budget=budget,
                staging_bytes=staging,
                groups=groups,
                label=label,
            )
        )
        self.id = self.opened.session_id
        self.regions = []
        self.ptrs = []
        for region in self.opened.regions:
            ptr = ctypes.c_uint64()
            raw = region.cuda_ipc_handle
            assert len(raw) == 64, f"region {region.index}: handle of {len(raw)} bytes"
            handle = _IpcMemHandle()
            # Copy all 64 bytes: a c_char array assignment would stop at the first NUL.
            ctypes.memmove(ctypes.addressof(handle), raw, 64)
            res = _cuda.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, LAZY_ENABLE_PEER_ACCESS)
            if res != 0:
                raise RuntimeError(f"cuIpcOpenMemHandle failed: {_error_name(res)}")
            self.ptrs.append(ptr.value)
            self.regions.append(
                torch.as_tensor(_DevicePointer(ptr.value, region.size), device="cuda")
            )
        self.events = {}
        self.requests = queue.Queue()
        self.responses = stub.Run(iter(self.requests.get, None))
        self._send(pb.ClientMessage(attach=pb.Attach(session_id=self.id)))
        first = next(self.responses)
        assert first.HasField("attached"), first
        self.next_ticket = 1
        self.groups_of = {}
        self.replies = {}

    def _send(self, msg):
        self.requests.put(msg)

    def event(self, index: int) -> torch.cuda.Event:
        if index not in self.events:
            handle = self.opened.event_handles[index - 1]
            self.events[index] = torch.cuda.Event.from_ipc_handle(
                torch.cuda.current_device(), handle
            )
        return self.events[index]

    def send_acquire(self, group: int) -> int:
        """Sends an Acquire without waiting for its reply (to keep several in flight)."""
        ticket = self.next_ticket
        self.next_ticket += 1
        self.groups_of[ticket] = group
        self._send(pb.ClientMessage(acquire=pb.Acquire(group=group, ticket=ticket)))
        return ticket

    def wait_staged(self, ticket: int):
        """Returns (ticket, staged, view) once the daemon staged `ticket`; the view is the
        group's bytes, not yet ordered (wait_ready orders them)."""
        while ticket not in self.replies:
            reply = next(self.responses)
            if reply.HasField("fault"):
                if reply.fault.ticket in (0, ticket):
                    raise DaemonFault(reply.fault)
                self.replies[reply.fault.ticket] = reply.fault
            else:
                self.replies[reply.staged.ticket] = reply.staged
        staged = self.replies.pop(ticket)
        if isinstance(staged, pb.Fault):
            raise DaemonFault(staged)
        layout = self.opened.groups[self.groups_of.pop(ticket)]
        view = self.regions[staged.region][staged.offset : staged.offset + layout.nbytes]
        return ticket, staged, view

    def acquire(self, group: int):
        """Acquire and wait: (ticket, staged, view)."""
        return self.wait_staged(self.send_acquire(group))

    def wait_ready(self, staged, stream=None):
        if staged.ready_event:
            (stream or torch.cuda.current_stream()).wait_event(self.event(staged.ready_event))

    def release(self, ticket, staged, stream=None):
        if staged.free_event:
            self.event(staged.free_event).record(stream or torch.cuda.current_stream())
        self._send(pb.ClientMessage(release=pb.Release(ticket=ticket)))

    def plan(self, groups):
        self._send(pb.ClientMessage(plan=pb.Plan(groups=groups)))

    def stats(self):
        for s in self.stub.ListSessions(pb.ListSessionsRequest()).sessions:
            if s.session_id == self.id:
                return s.stats
        return None

    def close(self):
        """Closes the mappings first, then the session (the daemon frees after that)."""
        torch.cuda.synchronize()
        self.regions.clear()
        self.events.clear()
        for ptr in self.ptrs:
            _cuda.cuIpcCloseMemHandle(ptr)
        self.ptrs.clear()
        self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.id))
        self.requests.put(None)


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (bf16 etc. have no numpy type)."""
    return t.contiguous().view(torch.uint8).reshape(-1)


def wait_for(what: str, condition, timeout: float = 20.0, every: float = 0.02):
    """Polls a condition until it holds (a deadline, not a sleep used as synchronisation)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)
