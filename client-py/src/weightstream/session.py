"""A session: the torch side of the hot path over the native session.

The protocol is the native client's (``weightstream._native.Session``, over client-rs):
``submit`` and ``release`` put one message on the session's stream and return; the native
runtime's reader task routes each ``Staged`` or ``Fault`` to its ticket; ``wait`` blocks in
Rust with the GIL released. No Python thread runs on this path. What stays here is the torch
glue: mapping the regions (host shared memory from the fd the native client fetched, CUDA IPC
handles through ``regions``), the tensor views of a staged group (a group with tensors the
daemon holds coded decoded first, ``_decoded``), and the CUDA events a ticket is ordered by.
A daemon that stops or dies fails every waiting ticket and the next ``submit`` at once with
``DaemonUnavailable``; ``Session.reconnect`` re-opens the session against the daemon that
comes back on the socket.

The session measures how long the trainer's compute waited for weights: on the host backend the
native ``wait`` counts the time it blocked for a ticket not yet staged; on CUDA the compute
stream is timed around each wait for a ticket that was not ready (``_wait_timer``). The native
session sums the waits per group and per step and reports them to the daemon (its
``gpu_wait_ns``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from weightstream import _dtypes, _rans8
from weightstream._wait_timer import WaitTimer
from weightstream.protocol import OpenSessionResponse, SessionStats, Staged
from weightstream.quantize import FORMATS, Fp8Weight
from weightstream.regions import CudaRegion, HostRegion, StateRegion


def group_specs(groups) -> list[tuple[str, list[str]]]:
    """``(name, tensor names)`` of a session's ``groups`` (its layouts): what
    ``Client.open_session`` takes to open a session of the same groups."""
    return [(g.name, [t.name for t in g.tensors]) for g in groups]


def device_uuid(device: torch.device) -> str:
    """The protocol names GPUs by UUID (CUDA_VISIBLE_DEVICES renumbers them)."""
    if device.type != "cuda":
        return ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def tensor_view(base: torch.Tensor, start: int, t) -> torch.Tensor | Fp8Weight:
    """The view of placement ``t`` at byte ``start`` of a region's bytes: a tensor of its dtype
    and shape, or for an 8-bit tensor (``quantize.FORMATS``) an ``Fp8Weight`` of its data
    (its dtype, e4m3fn or int8, and shape), scales (f32, ``scale_shape``, ``scale_offset``
    bytes further) and format."""
    shape = tuple(t.shape)
    if t.quantization in FORMATS:
        numel = math.prod(shape)
        data = base[start : start + numel].view(_dtypes.TO_TORCH[t.dtype]).view(shape)
        scales = start + t.scale_offset
        count = math.prod(t.scale_shape)
        scale = base[scales : scales + 4 * count].view(torch.float32).view(tuple(t.scale_shape))
        return Fp8Weight(data, scale, t.quantization)
    if t.quantization != "none":
        raise ValueError(f"tensor {t.name!r}: unknown quantization {t.quantization!r}")
    raw = base[start : start + t.nbytes]
    return raw.view(_dtypes.TO_TORCH[t.dtype]).view(shape)


#: Views kept per (group, region, offset) before the cache starts over.
VIEW_CACHE_ENTRIES = 8192
#: Where each decoded tensor of a coded group starts in its decoded buffer: a multiple of this.
DECODED_ALIGN = 256
#: Whether a coded group decodes on a stream of its own (``Session._decoded``).
DECODE_STREAM = os.environ.get("WEIGHTSTREAM_DECODE_STREAM", "1") != "0"


@dataclass
class Decoding:
    """How a group's coded tensors (``coding`` "rans8") are decoded at one staged place:
    their blobs in the region (``_rans8.CodedTensor``) and where each goes in the group's
    decoded buffer of ``size`` bytes (``dst``: tensor index -> offset); ``plan`` is the
    decoder's launch plan for the place (on CUDA), made once."""

    coded: list
    dst: dict[int, int]
    size: int
    plan: Any = None


def decoding_for(base: torch.Tensor, start: int, tensors) -> Decoding:
    """The ``Decoding`` of a group staged at byte ``start`` of ``base`` (its placements
    ``tensors``): each coded tensor's blob at ``start + offset``, ``stored_nbytes`` long,
    decoding to its ``nbytes`` at the next multiple of ``DECODED_ALIGN``."""
    coded, dst, size = [], {}, 0
    for i, t in enumerate(tensors):
        if t.coding == "none":
            continue
        if t.coding != "rans8":
            raise ValueError(f"tensor {t.name!r}: unknown coding {t.coding!r}")
        ct = _rans8.CodedTensor(start + t.offset, t.stored_nbytes, size, t.nbytes, t.coded_lanes)
        _rans8.check(ct)
        coded.append(ct)
        dst[i] = size
        size += -(-t.nbytes // DECODED_ALIGN) * DECODED_ALIGN
    plan = _rans8.plan_for(base, coded, base.device) if base.device.type == "cuda" else None
    return Decoding(coded, dst, size, plan)


@dataclass
class Ticket:
    """A staged group: tensor views valid until ``Session.release`` (an ``Fp8Weight`` for a
    tensor the daemon keeps in 8 bits)."""

    number: int
    group: int
    staged: Staged
    tensors: list[torch.Tensor | Fp8Weight] = field(default_factory=list)
    #: Which opening of the session staged it (``Session.reconnect`` opens it again).
    generation: int = 0


class SessionClient(Protocol):
    """What a ``Session`` needs of the client that opened it (``weightstream.Client``): its
    native client (to open and reopen the session), the daemon's sessions, reconnecting and
    restoring a model after a restart, and state regions."""

    _native: Any

    def list_sessions(self) -> list: ...

    def reconnect(self, timeout: float = 30.0): ...

    def restore_model(self, model_id: str): ...

    def alloc_state_region(self, session_id: str, nbytes: int, label: str = "") -> StateRegion: ...


class Session:
    def __init__(
        self,
        client: SessionClient,
        model_id: str,
        groups: list[tuple[str, list[str]]],
        vram_budget: int,
        *,
        staging_bytes: int = 0,
        device: torch.device | str | None = None,
        label: str = "",
        copy_bandwidth_limit: int = 0,
    ):
        self.client = client
        self.label = label
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda" and self.device.index is None:
            # CUDA IPC events and memory are per device: torch takes "cuda" without an index for
            # the current device in most places, but Event.from_ipc_handle on such a device
            # yields an event whose record() fails (UnicodeDecodeError, torch 2.11).
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._regions = None
        self._generation = 0
        #: Bytes decoded from coded groups, all openings together (``_decoded``).
        self.decoded_bytes = 0
        self._state: list[StateRegion] = []
        self._native = client._native.open_session(
            model_id,
            [(n, list(t)) for n, t in groups],
            vram_budget,
            staging_bytes,
            device_uuid(self.device),
            label,
            copy_bandwidth_limit,
        )
        try:
            self._setup()
        except BaseException:
            self._native.close()
            raise

    def _setup(self):
        """Maps the regions of the current opening."""
        self.opened: OpenSessionResponse = self._native.layout
        self.id = self.opened.session_id
        self.model_id = self._native.model_id
        self.groups = list(self.opened.groups)
        self._view_cache: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        self._decodings: dict[tuple[int, int, int], Decoding] = {}
        self._decode_stream: torch.cuda.Stream | None = None
        # Groups with a coded tensor: decoded at each acquire (``_decoded``).
        self._coded_groups = {
            i for i, g in enumerate(self.groups) if any(t.coding != "none" for t in g.tensors)
        }
        self._events: dict[int, torch.cuda.Event] = {}
        self._regions = [self._map(r) for r in self.opened.regions]
        self._generation += 1
        # The step in progress for the waits (``mark_step``); a new opening starts at 0.
        self._step = 0
        # CUDA (the daemon hands out events): the compute stream is timed; host: the native
        # wait counts its own blocked time.
        self._timer = (
            WaitTimer(self._native.add_gpu_wait, _timing_event)
            if self.opened.event_handles
            else None
        )

    def _map(self, region):
        if region.kind == "host":
            return HostRegion(self._native.region_fd(region.index), region.size)
        if self.device.type != "cuda":
            raise ValueError("the daemon runs on CUDA: open the session with a CUDA device")
        return CudaRegion(region.cuda_ipc_handle, region.size, self.device)

    @property
    def paces_client_copies(self) -> bool:
        """Whether this process should ``grant`` each copy of its own before issuing it: the
        device has a copy bandwidth limit or the session a share, which those copies then count
        in with the daemon's (the current opening's ``OpenSessionResponse``)."""
        return self.opened.paces_client_copies

    def grant(self, nbytes: int, to_device: bool) -> None:
        """Blocks (the GIL released) until the daemon lets this process copy ``nbytes`` of its
        own to the device (``to_device``) or back: the LoRA's working weights and gradients of
        ``weightstream.torch.stream_trainable``, paced with the daemon's copies of the base. To
        the device the grant takes its turn among the daemon's copies and is charged as one;
        from it, it is charged to the link's other direction at the same limit. At once (no
        message) where ``paces_client_copies`` is false."""
        self._native.grant(nbytes, to_device)

    # --- the hot path -----------------------------------------------------------------

    def submit(self, group: int) -> int:
        """Sends an Acquire for ``group``; returns its ticket number for ``wait``."""
        return self._native.submit(group)

    def wait(self, number: int, stream: torch.cuda.Stream | None = None) -> Ticket:
        """Waits until ticket ``number`` is staged; on CUDA, orders ``stream`` (default: the
        current one) after the copy. Returns the views of the group's tensors."""
        if self._timer is None:
            return self._ticket(self._native.wait(number), stream)
        return self._timed(number, stream, block=True)

    def settle(self, number: int) -> None:
        """Blocks until ticket ``number``'s reply has come, keeping it for ``wait`` or
        ``poll``; not counted as a wait for weights (a caller settles between steps)."""
        self._native.settle(number)

    def poll(self, number: int, stream: torch.cuda.Stream | None = None) -> Ticket | None:
        """``wait(number)`` if the ticket's reply has come, else None at once (the ticket is
        still to be waited for)."""
        if self._timer is None:
            staged = self._native.try_wait(number)
            return None if staged is None else self._ticket(staged, stream)
        return self._timed(number, stream, block=False)

    def acquire(self, group: int, stream: torch.cuda.Stream | None = None) -> Ticket:
        if self._timer is None:
            return self._ticket(self._native.acquire(group), stream)
        return self._timed(self._native.submit(group), stream, block=True)

    def release_and_acquire(
        self, ticket: Ticket, group: int, stream: torch.cuda.Stream | None = None
    ) -> Ticket:
        """``release(ticket)`` then ``acquire(group)``, with one call into the native client
        on the host backend (still two messages on the wire: Release, then Acquire)."""
        if not self._drop(ticket, stream):
            return self.acquire(group, stream)
        if self._timer is None:
            return self._ticket(self._native.release_and_acquire(ticket.number, group), stream)
        self._native.release(ticket.number)
        return self.acquire(group, stream)

    def _timed(self, number: int, stream, block: bool) -> Ticket | None:
        """The CUDA wait, timed on ``stream`` when the ticket is not ready (see
        ``_wait_timer``): the first event goes before blocking for the reply, so that the
        time the stream ran dry while the host waited counts too."""
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        timer = self._timer
        timer.harvest()
        before = None
        staged = self._native.try_wait(number)
        if staged is None:
            if not block:
                return None
            before = timer.start(s)
            staged = self._native.wait(number)
        elif staged.ready_event and not self._event(staged.ready_event).query():
            before = timer.start(s)
        ticket = self._ticket(staged, s)
        if before is not None:
            timer.finish(before, s, staged.group, self._step)
        return ticket

    def _ticket(self, staged: Staged, stream) -> Ticket:
        s = None
        if staged.ready_event:
            s = stream if stream is not None else torch.cuda.current_stream(self.device)
            s.wait_event(self._event(staged.ready_event))
        views = self._views(staged, s if s is not None else stream)
        return Ticket(staged.ticket, staged.group, staged, views, self._generation)

    def _views(self, staged: Staged, stream=None) -> list[torch.Tensor | Fp8Weight]:
        """The group's tensors at the staged place. A group comes back to the same few places
        (resident, or its usual slots of the staging ring), so the views are kept: building
        them costs three tensor operations per tensor, on every acquire. A group with coded
        tensors is decoded instead, for ``stream`` (CUDA), into a new buffer each time."""
        key = (staged.group, staged.region, staged.offset)
        views = self._view_cache.get(key)
        if views is not None:
            return views
        base = self._regions[staged.region].bytes
        tensors = self.groups[staged.group].tensors
        if staged.group in self._coded_groups:
            return self._decoded(key, base, staged, tensors, stream)
        views = [tensor_view(base, staged.offset + t.offset, t) for t in tensors]
        if len(self._view_cache) >= VIEW_CACHE_ENTRIES:
            self._view_cache.clear()
        self._view_cache[key] = views
        return views

    def _decoded(self, key, base: torch.Tensor, staged: Staged, tensors, stream) -> list:
        """A coded group's views: its coded tensors decoded into a new buffer, which the views
        keep alive; the other tensors viewed in place. On CUDA one kernel decodes them on the
        session's decode stream as soon as the copy has landed (its ready event), beside the
        compute stream's queued work rather than behind it, and ``stream`` (the compute
        stream: default, the current one) waits for the decode; the buffer is recorded on
        ``stream`` for the allocator. ``WEIGHTSTREAM_DECODE_STREAM=0`` decodes on ``stream``
        itself. The daemon reuses the staged bytes only after the release's free event,
        recorded on ``stream`` after the decode."""
        start = staged.offset
        decoding = self._decodings.get(key)
        if decoding is None:
            if len(self._decodings) >= VIEW_CACHE_ENTRIES:
                self._decodings.clear()
            decoding = self._decodings[key] = decoding_for(base, start, tensors)
        if base.device.type != "cuda":
            out = torch.empty(decoding.size, dtype=torch.uint8)
            _rans8.decode_into(base, decoding.coded, out, decoding.plan)
        else:
            s = stream if stream is not None else torch.cuda.current_stream(base.device)
            ds = s
            if DECODE_STREAM:
                if self._decode_stream is None:
                    self._decode_stream = torch.cuda.Stream(base.device)
                ds = self._decode_stream
                if staged.ready_event:
                    ds.wait_event(self._event(staged.ready_event))
            with torch.cuda.stream(ds):
                out = torch.empty(decoding.size, dtype=torch.uint8, device=base.device)
                _rans8.decode_into(base, decoding.coded, out, decoding.plan)
            if ds is not s:
                done = torch.cuda.Event()
                done.record(ds)
                s.wait_event(done)
                out.record_stream(s)
        self.decoded_bytes += decoding.size
        return [
            tensor_view(out, decoding.dst[i], t)
            if i in decoding.dst
            else tensor_view(base, start + t.offset, t)
            for i, t in enumerate(tensors)
        ]

    def release(self, ticket: Ticket, stream: torch.cuda.Stream | None = None):
        """Gives the group back. On CUDA, records its free event on ``stream`` (default: the
        current one) first, so the daemon reuses the space only after the reads queued so far.
        A ticket of a session since reconnected is only dropped (that session is gone)."""
        if self._drop(ticket, stream):
            self._native.release(ticket.number)

    def _drop(self, ticket: Ticket, stream) -> bool:
        """Drops the ticket's views and records its free event; False for a ticket of an
        opening since replaced (nothing to send)."""
        ticket.tensors = []
        if ticket.generation and ticket.generation != self._generation:
            return False
        if ticket.staged.free_event:
            s = stream if stream is not None else torch.cuda.current_stream(self.device)
            self._event(ticket.staged.free_event).record(s)
        return True

    def plan(self, groups: list[int]):
        """Sends the access plan of one step (the daemon prefetches along it)."""
        self._native.plan(list(groups))

    # --- the trainer's waits for weights ----------------------------------------------

    def mark_step(self) -> int:
        """Ends a training step for the waits' per-step figures; the step that starts."""
        self._step = self._native.mark_step()
        return self._step

    def gpu_wait(self, settle: bool = False):
        """The waits for weights measured so far in this opening (``protocol.WaitTotals``:
        ``total_ns``, ``waits``, ``by_group``, ``per_step``, ``this_step``, ``step``), with
        every timed CUDA wait that is done by now (``settle``: every one timed so far, once
        the device has passed it)."""
        if self._timer is not None:
            self._timer.harvest(block=settle)
        return self._native.gpu_wait()

    def reply_wait(self):
        """How long the calling thread blocked for the daemon's reply to an acquire (the
        group's copy not yet queued), since this opening (``protocol.WaitTotals``:
        ``total_ns``, ``waits``, ``by_group``), as the native ``wait`` times it. On CUDA the
        host stops issuing work meanwhile, which ``gpu_wait`` does not show while work queued
        earlier keeps the device busy (the host's lead shrinks instead); on the host backend
        the blocked thread is the compute, and these are ``gpu_wait``'s."""
        return self._native.reply_wait()

    def report_gpu_wait(self):
        """Sends the daemon the waits now (else it has them within 250 ms of a release)."""
        if self._timer is not None:
            self._timer.harvest()
        self._native.report_gpu_wait()

    def set_pass_kind(self, kind: str):
        """The kind of pass (``"train"``, ``"sample"``) the next acquires serve: the daemon
        counts them, their copies and the reported waits per kind (``SessionStats.kinds``).
        At a change the waits measured so far go to the daemon first, for the kind that ends."""
        if self._timer is not None:
            self._timer.harvest()
        self._native.set_pass_kind(kind)

    @property
    def submitted(self) -> int:
        """Acquires sent so far by this session object (across reconnects)."""
        return self._native.submitted

    @property
    def last_plan(self) -> list[int] | None:
        """The plan last sent (``reconnect`` sends it again)."""
        return self._native.last_plan

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

    def stats(self) -> SessionStats | None:
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
        restore: Callable[[SessionClient], object] | None = None,
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
        self._native.disconnect()
        self._unmap()
        self.client.reconnect(timeout)
        if restore is not None:
            restored = restore(self.client)
            model_id = getattr(restored, "model_id", restored)
        else:
            model_id = model_id or self.model_id
            self.client.restore_model(model_id)
        self._native.reopen(self.client._native, model_id)
        self._setup()
        return self

    def alloc_state_region(self, nbytes: int, label: str = "") -> StateRegion:
        """Host memory for this session's own state (master weights, optimizer moments):
        ``nbytes`` rounded up to whole pages, zero-filled, mapped read-write here
        (``StateRegion.buffer``, ``StateRegion.tensor(dtype)``), charged to this uid's host
        bytes and freed by the daemon with the session (see ``weightstream.regions``). Raises
        ``RequestRejected`` ("RESOURCE_EXHAUSTED") when a host quota would pass. A region of
        an opening that ``reconnect`` replaced is no longer the daemon's: allocate again."""
        region = self.client.alloc_state_region(self.id, nbytes, label)
        self._state = [r for r in self._state if not r.closed]
        self._state.append(region)
        return region

    @property
    def holds_state(self) -> bool:
        """Whether state regions of this opening are open (``alloc_state_region``): closing
        the session would drop them."""
        return any(not r.closed for r in self._state)

    def close(self):
        """Closes the mappings and state regions, then the session; safe to call twice."""
        self._unmap()
        for region in self._state:
            region.close()
        self._state = []
        self._native.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
