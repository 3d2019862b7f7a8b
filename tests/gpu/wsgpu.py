"""A small CUDA IPC consumer of the weightstream daemon, for the GPU suite and benchmarks.

It speaks no protocol of its own: the native client (``weightstream._native``, client-rs) drives
the session and its ``Run`` stream, and ``weightstream._ipc`` opens the session's IPC memory
handles. What it adds over ``weightstream.Session`` is control the checks need: the raw region
tensors (to poison them), a group's bytes before its ready event is waited on (the negative
control of the ordering check), and explicit ``wait_ready`` / free-event records.
"""

from __future__ import annotations

import time

import torch
import weightstream
from weightstream import protocol as pb  # noqa: F401 - the suite's enums (pb.BACKEND_CUDA, ...)
from weightstream._ipc import CudaRegion

#: A fault of one acquire or release (``ticket``, ``code`` by name, ``message``).
DaemonFault = weightstream.SessionFault


def pinned_h2d_gbps(nbytes: int = 512 << 20, reps: int = 8) -> float:
    """torch's pinned host-to-device copy rate on the current device, GB/s: the median of
    ``reps`` timed copies after two warm-up ones (the reference the benchmarks compare with)."""
    import statistics

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return nbytes / statistics.median(times[2:]) / 1e9


def connect(socket: str) -> weightstream.Client:
    return weightstream.connect(socket)


def groups_per_tensor(manifest) -> list[tuple[str, list[str]]]:
    return [(t.name, [t.name]) for t in manifest.tensors]


class Session:
    def __init__(
        self,
        client,
        model_id,
        budget,
        staging=0,
        groups=None,
        manifest=None,
        label="gpu-test",
        copy_bandwidth_limit=0,
    ):
        torch.zeros(1, device="cuda")  # makes the primary context current on this thread
        self.client = client
        groups = groups if groups is not None else groups_per_tensor(manifest)
        self.native = client._native.open_session(
            model_id, groups, budget, staging, "", label, copy_bandwidth_limit
        )
        self.opened = self.native.layout
        self.id = self.opened.session_id
        device = torch.device("cuda", torch.cuda.current_device())
        self.mapped = [CudaRegion(r.cuda_ipc_handle, r.size, device) for r in self.opened.regions]
        self.regions = [m.bytes for m in self.mapped]
        self.events = {}

    def event(self, index: int) -> torch.cuda.Event:
        if index not in self.events:
            handle = self.opened.event_handles[index - 1]
            self.events[index] = torch.cuda.Event.from_ipc_handle(
                torch.cuda.current_device(), handle
            )
        return self.events[index]

    def send_acquire(self, group: int) -> int:
        """Sends an Acquire without waiting for its reply (to keep several in flight)."""
        return self.native.submit(group)

    def wait_staged(self, ticket: int):
        """Returns (ticket, staged, view) once the daemon staged `ticket`; the view is the
        group's bytes, not yet ordered (wait_ready orders them)."""
        staged = self.native.wait(ticket)
        layout = self.opened.groups[staged.group]
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
        self.native.release(ticket)

    def plan(self, groups):
        self.native.plan(list(groups))

    def stats(self):
        for s in self.client.list_sessions():
            if s.session_id == self.id:
                return s.stats
        return None

    def close(self):
        """Closes the mappings first, then the session (the daemon frees after that)."""
        torch.cuda.synchronize()
        self.regions.clear()
        self.events.clear()
        for m in self.mapped:
            m.close()
        self.mapped.clear()
        self.native.close()


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
