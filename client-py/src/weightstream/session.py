"""A session: the mapped regions, the hot-path stream and its background reader.

``submit`` sends an Acquire and returns at once; a reader thread routes each ``Staged`` or
``Fault`` to the future of its ticket, so module hooks can keep several acquires in flight and
never block on a round trip they did not need to wait for.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import torch

from weightstream import _dtypes
from weightstream._ipc import CudaRegion, HostRegion
from weightstream.client import Client, rpc_error
from weightstream.errors import DaemonUnavailable, SessionFault
from weightstream.v1 import weightstream_pb2 as pb


def device_uuid(device: torch.device) -> str:
    """The protocol names GPUs by UUID (CUDA_VISIBLE_DEVICES renumbers them)."""
    if device.type != "cuda":
        return ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


@dataclass
class Ticket:
    """A staged group: tensor views valid until ``Session.release``."""

    number: int
    group: int
    staged: pb.Staged
    tensors: list[torch.Tensor] = field(default_factory=list)


class Session:
    def __init__(
        self,
        client: Client,
        model_id: str,
        groups: list[tuple[str, list[str]]],
        vram_budget: int,
        *,
        staging_bytes: int = 0,
        device: torch.device | str | None = None,
        label: str = "",
    ):
        self.client = client
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        request = pb.OpenSessionRequest(
            model_id=model_id,
            device_uuid=device_uuid(self.device),
            vram_budget=vram_budget,
            staging_bytes=staging_bytes,
            groups=[pb.GroupSpec(name=n, tensors=t) for n, t in groups],
            label=label,
        )
        self.opened = client.call("OpenSession", request)
        self.id = self.opened.session_id
        self.groups = list(self.opened.groups)
        self._regions = [self._map(r) for r in self.opened.regions]
        self._events: dict[int, torch.cuda.Event] = {}
        self._lock = threading.Lock()
        # Awaiting a reply (the reader pops these) / submitted and not yet waited for.
        self._pending: dict[int, tuple[int, Future]] = {}
        self._submitted: dict[int, tuple[int, Future]] = {}
        self._ended: Exception | None = None
        self._next = 1
        self._requests: queue.Queue = queue.Queue()
        self._send(pb.ClientMessage(attach=pb.Attach(session_id=self.id)))
        try:
            self._replies = client.stub.Run(iter(self._requests.get, None))
            first = next(self._replies)
        except grpc.RpcError as e:
            raise rpc_error(client.socket, e) from None
        if first.WhichOneof("msg") != "attached":
            raise DaemonUnavailable(f"expected Attached, got {first}")
        self._reader = threading.Thread(target=self._read, name="weightstream-run", daemon=True)
        self._reader.start()

    def _map(self, region: pb.Region):
        if region.WhichOneof("handle") == "shm_path":
            return HostRegion(region.shm_path, region.size)
        if self.device.type != "cuda":
            raise ValueError("the daemon runs on CUDA: open the session with a CUDA device")
        return CudaRegion(region.cuda_ipc_handle, region.size, self.device)

    def _send(self, msg: pb.ClientMessage):
        self._requests.put(msg)

    def _read(self):
        reason: Exception = DaemonUnavailable("the daemon closed the session")
        try:
            for reply in self._replies:
                self._route(reply)
        except grpc.RpcError as e:
            reason = rpc_error(self.client.socket, e)
        with self._lock:
            self._ended = self._ended or reason
            pending, self._pending = self._pending, {}
        for _, future in pending.values():
            future.set_exception(self._ended)

    def _route(self, reply: pb.ServerMessage):
        which = reply.WhichOneof("msg")
        if which == "staged":
            with self._lock:
                entry = self._pending.pop(reply.staged.ticket, None)
            if entry:
                entry[1].set_result(reply.staged)
        elif which == "fault":
            f = reply.fault
            code = pb.FaultCode.Name(f.code)
            with self._lock:
                entry = self._pending.pop(f.ticket, None) if f.ticket else None
                if f.code == pb.FAULT_SHUTTING_DOWN:
                    self._ended = DaemonUnavailable(f"the daemon is stopping: {f.message}")
            if entry:
                entry[1].set_exception(SessionFault(f.ticket, code, f.message))

    # --- the hot path -----------------------------------------------------------------

    def submit(self, group: int) -> int:
        """Sends an Acquire for ``group``; returns its ticket number for ``wait``."""
        future: Future = Future()
        with self._lock:
            if self._ended is not None:
                raise self._ended
            number = self._next
            self._next += 1
            self._pending[number] = (group, future)
            self._submitted[number] = (group, future)
        self._send(pb.ClientMessage(acquire=pb.Acquire(group=group, ticket=number)))
        return number

    def wait(self, number: int, stream: torch.cuda.Stream | None = None) -> Ticket:
        """Waits until ticket ``number`` is staged; on CUDA, orders ``stream`` (default: the
        current one) after the copy. Returns the views of the group's tensors."""
        group, future = self._submitted.pop(number)
        staged = future.result()
        if staged.ready_event:
            s = stream if stream is not None else torch.cuda.current_stream(self.device)
            s.wait_event(self._event(staged.ready_event))
        layout = self.groups[group]
        base = self._regions[staged.region].bytes
        tensors = []
        for t in layout.tensors:
            start = staged.offset + t.offset
            raw = base[start : start + t.nbytes]
            tensors.append(raw.view(_dtypes.TO_TORCH[t.dtype]).view(tuple(t.shape)))
        return Ticket(number, group, staged, tensors)

    def acquire(self, group: int, stream: torch.cuda.Stream | None = None) -> Ticket:
        return self.wait(self.submit(group), stream)

    def release(self, ticket: Ticket, stream: torch.cuda.Stream | None = None):
        """Gives the group back. On CUDA, records its free event on ``stream`` (default: the
        current one) first, so the daemon reuses the space only after the reads queued so far."""
        if ticket.staged.free_event:
            s = stream if stream is not None else torch.cuda.current_stream(self.device)
            self._event(ticket.staged.free_event).record(s)
        ticket.tensors = []
        self._send(pb.ClientMessage(release=pb.Release(ticket=ticket.number)))

    def plan(self, groups: list[int]):
        """Sends the access plan of one step (the daemon prefetches along it)."""
        self._send(pb.ClientMessage(plan=pb.Plan(groups=list(groups))))

    def _event(self, index: int) -> torch.cuda.Event:
        event = self._events.get(index)
        if event is None:
            handle = self.opened.event_handles[index - 1]
            event = torch.cuda.Event.from_ipc_handle(self.device, handle)
            self._events[index] = event
        return event

    # --- bookkeeping ------------------------------------------------------------------

    def group_index(self, name: str) -> int:
        for i, g in enumerate(self.groups):
            if g.name == name:
                return i
        raise KeyError(name)

    def stats(self) -> pb.SessionStats | None:
        for s in self.client.list_sessions():
            if s.session_id == self.id:
                return s.stats
        return None

    def close(self):
        """Closes the mappings, then the session; safe to call twice."""
        if self._regions is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for region in self._regions:
            region.close()
        self._regions = None
        self._events.clear()
        try:
            with self._lock:
                alive = self._ended is None
            if alive:
                self.client.call("CloseSession", pb.CloseSessionRequest(session_id=self.id))
        finally:
            self._requests.put(None)
            self._reader.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
