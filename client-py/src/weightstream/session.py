"""A session: the mapped regions, the hot-path stream and its background reader.

``submit`` sends an Acquire and returns at once; a reader thread routes each ``Staged`` or
``Fault`` to the future of its ticket, so module hooks can keep several acquires in flight and
never block on a round trip they did not need to wait for. A daemon that stops or dies fails
every waiting ticket and the next ``submit`` at once; ``Session.reconnect`` re-opens the session
against the daemon that comes back on the socket.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import torch

from weightstream import _dtypes
from weightstream._ipc import CudaRegion, HostRegion
from weightstream.client import Client, rpc_error
from weightstream.errors import DaemonUnavailable, SessionFault, WeightstreamError
from weightstream.v1 import weightstream_pb2 as pb


def device_uuid(device: torch.device) -> str:
    """The protocol names GPUs by UUID (CUDA_VISIBLE_DEVICES renumbers them)."""
    if device.type != "cuda":
        return ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


#: Views kept per (group, region, offset) before the cache starts over.
VIEW_CACHE_ENTRIES = 8192


@dataclass
class Ticket:
    """A staged group: tensor views valid until ``Session.release``."""

    number: int
    group: int
    staged: pb.Staged
    tensors: list[torch.Tensor] = field(default_factory=list)
    #: Which opening of the session staged it (``Session.reconnect`` opens it again).
    generation: int = 0


class _Stream:
    """One attachment of a session: its ``Run`` stream, the reader thread and the futures of
    the tickets waiting for a reply. ``Session.reconnect`` replaces it as a whole, so a reader
    that ends late can only fail its own tickets."""

    def __init__(self, client: Client, session_id: str):
        self.lock = threading.Lock()
        self.pending: dict[int, Future] = {}
        self.ended: Exception | None = None
        self.requests: queue.Queue = queue.Queue()
        self.requests.put(pb.ClientMessage(attach=pb.Attach(session_id=session_id)))
        try:
            self.replies = client.stub.Run(iter(self.requests.get, None))
            first = next(self.replies)
        except grpc.RpcError as e:
            raise rpc_error(client.socket, e) from None
        if first.WhichOneof("msg") != "attached":
            raise DaemonUnavailable(f"expected Attached, got {first}")
        self.socket = client.socket
        self.reader = threading.Thread(target=self._read, name="weightstream-run", daemon=True)
        self.reader.start()

    def send(self, msg: pb.ClientMessage):
        self.requests.put(msg)

    def expect(self, number: int, future: Future):
        with self.lock:
            if self.ended is not None:
                raise self.ended
            self.pending[number] = future

    def _read(self):
        reason: Exception = DaemonUnavailable("the daemon closed the session")
        try:
            for reply in self.replies:
                self._route(reply)
        except grpc.RpcError as e:
            reason = rpc_error(self.socket, e)
        self.end(reason)

    def end(self, reason: Exception):
        """Fails every ticket still waiting, and later ones at once (the first reason stays)."""
        with self.lock:
            self.ended = self.ended or reason
            pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(self.ended)

    def _route(self, reply: pb.ServerMessage):
        which = reply.WhichOneof("msg")
        if which == "staged":
            with self.lock:
                future = self.pending.pop(reply.staged.ticket, None)
            if future:
                future.set_result(reply.staged)
        elif which == "fault":
            f = reply.fault
            code = pb.FaultCode.Name(f.code)
            with self.lock:
                future = self.pending.pop(f.ticket, None) if f.ticket else None
                if f.code == pb.FAULT_SHUTTING_DOWN:
                    self.ended = DaemonUnavailable(f"the daemon is stopping: {f.message}")
            if future:
                future.set_exception(SessionFault(f.ticket, code, f.message))

    def stop(self, timeout: float = 10):
        """Ends the outgoing stream and waits for the reader (bounded)."""
        self.requests.put(None)
        self.reader.join(timeout=timeout)

    def cancel(self):
        """Cuts the stream: a daemon that is still up tears its session down."""
        self.end(DaemonUnavailable("the session was reconnected"))
        self.replies.cancel()
        self.stop()


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
        self._request = pb.OpenSessionRequest(
            model_id=model_id,
            device_uuid=device_uuid(self.device),
            vram_budget=vram_budget,
            staging_bytes=staging_bytes,
            groups=[pb.GroupSpec(name=n, tensors=t) for n, t in groups],
            label=label,
        )
        self._lock = threading.Lock()
        # Submitted and not yet waited for: number -> (group, future, the stream it went on).
        self._submitted: dict[int, tuple[int, Future, _Stream]] = {}
        self._next = 1
        self._plan: list[int] | None = None
        self._regions = None
        self._generation = 0
        self._open()

    def _open(self):
        self.opened = self.client.call("OpenSession", self._request)
        self.id = self.opened.session_id
        self.model_id = self._request.model_id
        self.groups = list(self.opened.groups)
        self._regions = [self._map(r) for r in self.opened.regions]
        self._view_cache: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        self._events: dict[int, torch.cuda.Event] = {}
        self._stream = _Stream(self.client, self.id)
        self._generation += 1

    def _map(self, region: pb.Region):
        if region.WhichOneof("handle") == "fd_secret":
            fd, size = self.client.fetch_fd(region.fd_secret)
            if size < region.size:
                os.close(fd)
                raise WeightstreamError(
                    f"region {region.index}: the daemon passed {size} bytes for a region of "
                    f"{region.size}"
                )
            return HostRegion(fd, region.size)
        if self.device.type != "cuda":
            raise ValueError("the daemon runs on CUDA: open the session with a CUDA device")
        return CudaRegion(region.cuda_ipc_handle, region.size, self.device)

    def _send(self, msg: pb.ClientMessage):
        self._stream.send(msg)

    # --- the hot path -----------------------------------------------------------------

    def submit(self, group: int) -> int:
        """Sends an Acquire for ``group``; returns its ticket number for ``wait``."""
        future: Future = Future()
        with self._lock:
            stream = self._stream
            number = self._next
            stream.expect(number, future)
            self._next += 1
            self._submitted[number] = (group, future, stream)
        stream.send(pb.ClientMessage(acquire=pb.Acquire(group=group, ticket=number)))
        return number

    def wait(self, number: int, stream: torch.cuda.Stream | None = None) -> Ticket:
        """Waits until ticket ``number`` is staged; on CUDA, orders ``stream`` (default: the
        current one) after the copy. Returns the views of the group's tensors."""
        group, future, sent_on = self._submitted.pop(number)
        staged = future.result()
        if sent_on is not self._stream:
            raise DaemonUnavailable(f"ticket {number} was staged by a session since reconnected")
        if staged.ready_event:
            s = stream if stream is not None else torch.cuda.current_stream(self.device)
            s.wait_event(self._event(staged.ready_event))
        return Ticket(number, group, staged, self._views(group, staged), self._generation)

    def _views(self, group: int, staged: pb.Staged) -> list[torch.Tensor]:
        """The group's tensors at the staged place. A group comes back to the same few places
        (resident, or its usual slots of the staging ring), so the views are kept: building
        them costs three tensor operations per tensor, on every acquire."""
        key = (group, staged.region, staged.offset)
        views = self._view_cache.get(key)
        if views is not None:
            return views
        base = self._regions[staged.region].bytes
        views = []
        for t in self.groups[group].tensors:
            start = staged.offset + t.offset
            raw = base[start : start + t.nbytes]
            views.append(raw.view(_dtypes.TO_TORCH[t.dtype]).view(tuple(t.shape)))
        if len(self._view_cache) >= VIEW_CACHE_ENTRIES:
            self._view_cache.clear()
        self._view_cache[key] = views
        return views

    def acquire(self, group: int, stream: torch.cuda.Stream | None = None) -> Ticket:
        return self.wait(self.submit(group), stream)

    def release(self, ticket: Ticket, stream: torch.cuda.Stream | None = None):
        """Gives the group back. On CUDA, records its free event on ``stream`` (default: the
        current one) first, so the daemon reuses the space only after the reads queued so far.
        A ticket of a session since reconnected is only dropped (that session is gone)."""
        ticket.tensors = []
        if ticket.generation and ticket.generation != self._generation:
            return
        if ticket.staged.free_event:
            s = stream if stream is not None else torch.cuda.current_stream(self.device)
            self._event(ticket.staged.free_event).record(s)
        self._send(pb.ClientMessage(release=pb.Release(ticket=ticket.number)))

    def plan(self, groups: list[int]):
        """Sends the access plan of one step (the daemon prefetches along it)."""
        self._plan = list(groups)
        self._send(pb.ClientMessage(plan=pb.Plan(groups=self._plan)))

    @property
    def submitted(self) -> int:
        """Acquires sent so far by this session object (across reconnects)."""
        return self._next - 1

    @property
    def last_plan(self) -> list[int] | None:
        """The plan last sent (``reconnect`` sends it again)."""
        return None if self._plan is None else list(self._plan)

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

    def _unmap(self):
        if self._regions is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._view_cache.clear()
        for region in self._regions:
            region.close()
        self._regions = None
        self._events.clear()

    def reconnect(
        self,
        model_id: str | None = None,
        *,
        restore: Callable[[Client], object] | None = None,
        timeout: float = 30.0,
    ) -> Session:
        """Opens this session again, for a trainer to resume at its next step after the daemon
        was restarted (or the session lost) without restarting its process. Waits up to
        ``timeout`` seconds for a daemon to answer on the socket (``Client.reconnect``).

        The new session has the same groups, budget, staging, device and label, and gets the
        plan last sent again. Its model: what ``restore(client)`` returns (a model id or a
        manifest; the way to upload tensors again), else ``model_id``, else the same id as
        before. A model this client loaded from files that the daemon no longer has is loaded
        again from them (unchanged files give the same id); an uploaded one needs ``restore``
        (the same bytes give the same id). Views and tickets of the old session are dead:
        releasing one does nothing, waiting for one raises ``DaemonUnavailable``. Returns self.
        """
        self._stream.cancel()
        self._unmap()
        self.client.reconnect(timeout)
        if restore is not None:
            restored = restore(self.client)
            model_id = getattr(restored, "model_id", restored)
        else:
            model_id = model_id or self._request.model_id
            self.client.restore_model(model_id)
        self._request.model_id = model_id
        self._open()
        if self._plan is not None:
            self.plan(self._plan)
        return self

    def close(self):
        """Closes the mappings, then the session; safe to call twice."""
        if self._regions is None:
            return
        self._unmap()
        try:
            with self._stream.lock:
                alive = self._stream.ended is None
            if alive:
                self.client.call("CloseSession", pb.CloseSessionRequest(session_id=self.id))
        finally:
            self._stream.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
