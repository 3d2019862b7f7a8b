"""Trainable weights held in host memory: ``stream_trainable`` (or ``attach(...,
trainable="host")``) moves a LoRA's weights (every ``nn.Linear`` whose weight requires grad)
off the device, and ``HostAdamW`` steps them there.

A streamed trainable layer keeps, in host memory held by the daemon for the session (charged to
the session's uid, freed with it): its *working* weight (the trainer's dtype, what the layer
computes with), an fp32 *master* copy where the working dtype is narrower (``master="fp32"``,
the default; with ``master="none"`` the optimizer updates the working weight in place, in fp32
arithmetic rounded back to its dtype, as a trainer with bf16 parameters and no master does),
and its accumulated *gradient*. The optimizer adds its state there (``HostAdamW``).
``host_bytes`` gives the bytes per configuration. The device holds only what is in
flight: the working weights of the group running and of the next ones (copied host→device on a
side stream, ahead of use, along the order of the first forward), and each gradient until its
device→host copy is done.

- The layer's parameter stays the trainer's: an ``nn.Parameter`` on the CPU whose storage is
  the working weight (``state_dict``, saving and loading see the current weights), ignored by
  ``module.to(...)``. Its ``.grad`` stays ``None``: gradients go to host memory as backward
  produces them, and the optimizer reads them there (``clip_grad_norm_`` on these parameters
  therefore does nothing: give the optimizer ``max_grad_norm``).
- The layer's operation is an autograd Function that runs ``F.linear`` on the device copy,
  saves only its input, and in backward takes the weight again and applies autograd's own
  formulas for ``linear``: outputs and gradients are the bits autograd gives for the layer with
  its weight on the device.
- Gradients go device→host on their own stream, directly into the accumulated gradient, or
  through the bounce ring when one is already there (gradient accumulation) or the optimizer
  still has to read the previous step's (the delayed step). The ring is one more region of
  the session's host memory (``BounceRing``: twice the largest group's gradients, in the
  region of the weights and gradients), so every
  byte the gradients land in is the daemon's, page-locked and charged like the rest; a
  gradient that finds it full waits for the worker (``wait_bounce_s``). One worker thread
  takes each arrival in order: waits for its copy, runs a pending delayed update of that
  layer, adds the gradient.
- The delayed update of a layer runs as early as it can: when backward first takes (or
  prefetches) the layer's group, whose device copies are then the weights' last read in the
  step, the worker applies the group's pending updates as soon as that copy is done, so that the
  step's gradients, produced a little later, find the previous ones consumed and land in
  place. The group's device copies are then kept until each of its updated layers has given
  its gradient: a copy made later would read the updated weights. A forward that finds a
  group's copies older than its weights (the next micro-batch of an accumulated step, after
  backward updated them) copies them again.

Exactness: the layer's forward and gradients are those of the same weights on the device; the
accumulation is a bf16 (or the working dtype's) add, as autograd's; the step is ``HostAdamW``'s
(see there). Tests: ``tests/python/test_trainable.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import mmap
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from weightstream.torch import ops, policy
from weightstream.torch.hooks import HookRegistry

#: What ``Trainable.times`` sums.
TIMES = (
    "wait_update_s",
    "wait_grads_s",
    "worker_copy_wait_s",
    "worker_update_s",
    "worker_grad_add_s",
    "wait_bounce_s",
    "step_update_s",
)
#: Byte alignment of each tensor in a host region (a cache line, and fp32/bf16 vector loads).
ALIGN = 256
#: The bounce ring holds this many of the largest group's gradients.
BOUNCE_GROUPS = 2


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
            err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
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
                torch.cuda.cudart().cudaHostUnregister(ptr)
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


#: What ``master=`` takes: ``"fp32"`` keeps an fp32 master copy of each weight narrower than
#: fp32 for the optimizer to update; ``"none"`` keeps none (the working weight is updated in
#: place).
MASTERS = ("fp32", "none")


def check_master(master) -> str:
    """``master`` if it is one of ``MASTERS``; else ``TrainableError`` listing them."""
    if not isinstance(master, str) or master not in MASTERS:
        raise TrainableError(
            f"master={master!r}: expected one of {', '.join(map(repr, MASTERS))} ('fp32' keeps "
            "an fp32 copy of each bf16/f16 weight for the optimizer, 'none' updates the weight "
            "in place)"
        )
    return master


def has_master(dtype: torch.dtype, master: str) -> bool:
    """Whether a working weight of ``dtype`` gets an fp32 master with ``master``."""
    return master == "fp32" and dtype != torch.float32


def host_bytes(numel: int, dtype: torch.dtype, optimizer: str | None, master: str = "fp32") -> int:
    """Host bytes a trainable tensor of ``numel`` elements needs: working weight, fp32 master
    (``has_master``) and gradient, plus the optimizer's state ("adamw": two moments, fp32 with a
    master or an fp32 weight, else in the weight's dtype as torch's AdamW keeps them;
    "adamw8bit": two bytes and two fp32 scales per block of 256). Per element for a bf16
    weight: 2 + 4 + 2 (+ 8 adamw, + ~2 adamw8bit) with the fp32 master, 2 + 2 (+ 4 adamw,
    + ~2 adamw8bit) without."""
    extra = has_master(dtype, master)
    total = numel * (dtype.itemsize * 2 + (4 if extra else 0))
    if optimizer == "adamw":
        total += numel * 2 * (4 if extra else dtype.itemsize)
    elif optimizer == "adamw8bit":
        total += numel * 2 + -(-numel // 256) * 8
    return total


# --- the layers ---------------------------------------------------------------------------


@dataclass(eq=False)
class Slot:
    """One trainable weight."""

    index: int
    name: str  # the layer's name
    module: nn.Linear
    param: nn.Parameter
    group: str
    #: Its place among its group's slots (and their device copies).
    pos: int = 0
    working: torch.Tensor | None = None
    #: What the optimizer updates: the fp32 master, or ``working`` itself (an fp32 weight, or
    #: ``master="none"``).
    master: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    #: Gradients added to ``grad`` since the optimizer last took it.
    grads: int = 0
    #: The optimizer's delayed update of this weight, to run before the next gradient lands.
    pending: Callable[[Slot], None] | None = None
    #: Gradients of this weight queued for the worker (guarded by ``Trainable._cv``).
    queued: int = 0
    #: The last host→device copy of ``working`` (CUDA), for writers to wait for.
    read_done: object = None
    #: Updates applied to ``working`` by the gradient worker (a device copy made before one
    #: is older than the weight).
    version: int = 0
    #: Its pending update is queued for the worker ahead of its gradient (``_start_updates``).
    update_queued: bool = False

    @property
    def numel(self) -> int:
        return self.param.numel()


@dataclass
class _Group:
    name: str
    slots: list[Slot]
    copies: list[torch.Tensor] | None = None
    ready: object = None  # CUDA event after the copies
    #: The copies the granter thread is still to issue (``copies`` is then ``_ISSUING``).
    fetched: _Issued | None = None
    #: Each slot's ``version`` when the copies were made.
    versions: list[int] | None = None
    #: Positions of the slots whose delayed update backward set off at this group's copy and
    #: whose gradient has not come yet: while any is left the copies are kept.
    early: set[int] = dataclasses.field(default_factory=set)

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of the group's working weights: what one copy to the device moves."""
        return sum(s.working.nbytes for s in self.slots)


class _Issued:
    """A copy the granter thread issues once the daemon grants it. ``take()`` returns, once
    it is issued, what the copy made (the device copies, handed over once: the slots keep
    this object to wait for the copy, not the copies; None for a copy to the host) and the
    CUDA event after it (None on the CPU); ``synchronize()`` waits for the copy itself (for a
    writer of the source, or a reader of the destination); ``discard()`` frees the device
    copies of a group dropped before it used them."""

    def __init__(self):
        self._set = threading.Event()
        self._lock = threading.Lock()
        self._copies = None
        self._discarded = False
        self.event = None
        self._error: BaseException | None = None

    def settle(self, result=(None, None), error: BaseException | None = None):
        with self._lock:
            copies, self.event = result
            self._copies = None if self._discarded else copies
            self._error = error
        self._set.set()

    def _wait(self):
        self._set.wait()
        if self._error is not None:
            raise RuntimeError("weightstream: a paced copy of trainable state failed") from (
                self._error
            )

    def take(self):
        self._wait()
        with self._lock:
            copies, self._copies = self._copies, None
        return copies, self.event

    def synchronize(self):
        self._wait()
        if self.event is not None:
            self.event.synchronize()

    def query(self) -> bool:
        """Whether the copy is issued and done, at once."""
        return self._set.is_set() and (self.event is None or self.event.query())

    def discard(self):
        with self._lock:
            self._discarded, self._copies = True, None


#: ``_Group.copies`` while the granter thread has yet to issue them.
_ISSUING: list = []


class _Granter:
    """One thread that, in order, asks the daemon for each of the trainer's own copies in one
    direction (``HostStorage.grant``: the session's ``grant``, which waits for the copy's turn
    among the daemon's copies under a limit or a share) and issues it once granted, so that the
    trainer's thread (and autograd's) go on queueing work meanwhile: a copy asked for ahead
    (a prefetch) is issued by the time it is used, instead of stopping the trainer until the
    daemon's earlier copies are paced."""

    def __init__(self, storage: HostStorage, to_device: bool):
        self._storage, self._to_device = storage, to_device
        self._queue: queue.Queue = queue.Queue()
        name = "weightstream-grants-" + ("h2d" if to_device else "d2h")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def request(self, nbytes: int, copy: Callable[[], tuple]) -> _Issued:
        """``copy()`` once ``nbytes`` are granted: its ``_Issued``."""
        issued = _Issued()
        self._queue.put((nbytes, copy, issued))
        return issued

    def _run(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            nbytes, copy, issued = item
            try:
                self._storage.grant(nbytes, self._to_device)
                issued.settle(copy())
            except BaseException as e:  # noqa: BLE001 - raised where the copy is waited for
                issued.settle(error=e)

    def close(self):
        """Issues what was asked for, then ends the thread."""
        self._queue.put(None)
        self._thread.join()


class Trainable:
    """What ``stream_trainable`` returns: the trainable weights in host memory, their device
    copies in flight, and the gradient path. ``HostAdamW`` steps them."""

    def __init__(
        self,
        root: nn.Module,
        layers: list[tuple[str, nn.Linear]],
        device: torch.device,
        storage: HostStorage,
        *,
        group_by: str | Callable[[str], str] = "block",
        lookahead: int = 1,
        master: str = "fp32",
    ):
        self.device = device
        self.storage = storage
        self.lookahead = lookahead
        #: ``"fp32"`` or ``"none"`` (``MASTERS``): whether narrower weights have an fp32 master.
        self.master = check_master(master)
        self.slots: list[Slot] = []
        self.groups: dict[str, _Group] = {}
        for (name, m), key in zip(layers, group_names(root, layers, group_by), strict=True):
            group = self.groups.setdefault(key, _Group(key, []))
            slot = Slot(len(self.slots), name, m, m.weight, key, len(group.slots))
            self.slots.append(slot)
            group.slots.append(slot)
        self.by_param = {id(s.param): s for s in self.slots}
        #: The groups in the order the first forward used them, and each one's position.
        self._order: list[str] = []
        self._position: dict[str, int] = {}
        self._live: collections.OrderedDict[str, _Group] = collections.OrderedDict()
        self._hooks = HookRegistry()
        self._queue: queue.Queue = queue.Queue()
        self._cv = threading.Condition()
        #: Seconds, summed since attach (``times``): the trainer's thread waiting for updates
        #: before a copy (``wait_update_s``) and for gradients in ``step()`` (``wait_grads_s``);
        #: the worker waiting for device→host copies, running delayed updates, adding gradients.
        self.times = dict.fromkeys(TIMES, 0.0)
        self._error: BaseException | None = None
        self._worker = threading.Thread(target=self._work, name="weightstream-grads", daemon=True)
        #: Where the daemon paces the trainer's copies: per direction, the thread that asks for
        #: each one and issues it once granted (``_Granter``): the daemon paces the two
        #: directions apart, so a gradient's copy never waits behind the weights' grants.
        self._granter = _Granter(storage, True) if storage.paces else None
        self._granter_back = _Granter(storage, False) if storage.paces else None
        self._closed = False
        #: What holds views of the host memory besides the slots (``HostAdamW``): ``close``
        #: calls their ``release()`` first.
        self._users: list = []
        cuda = device.type == "cuda"
        self._h2d = torch.cuda.Stream(device) if cuda else None
        self._d2h = torch.cuda.Stream(device) if cuda else None
        for s in self.slots:
            self._hooks.check(s.name, s.module)  # a forward that cannot be chained: before moving
        self._place()
        for s in self.slots:
            self._hooks.install(s.name, s.module, functools.partial(_forward, self, s))
            _keep_on_host(s.module)
        self._worker.start()

    def _place(self):
        carver = Carver()
        plan = []
        for s in self.slots:
            dtype = s.param.dtype
            w = carver.reserve(s.param.shape, dtype)
            m = (
                carver.reserve(s.param.shape, torch.float32)
                if has_master(dtype, self.master)
                else None
            )
            g = carver.reserve(s.param.shape, dtype)
            plan.append((w, m, g))
        ring = carver.reserve(
            (ring_bytes([s.param for s in g.slots] for g in self.groups.values()),), torch.uint8
        )
        region = self.storage.alloc(carver.size, "trainable weights and gradients")
        views = carver.views(region)
        self._bounce = BounceRing(views[ring])
        for s, (w, m, g) in zip(self.slots, plan, strict=True):
            s.working, s.grad = views[w], views[g]
            with torch.no_grad():
                s.working.copy_(s.param.detach())
                if m is not None:
                    s.master = views[m]
                    s.master.copy_(s.param.detach())
                else:
                    s.master = s.working
            s.param.data = s.working

    def params(self) -> list[nn.Parameter]:
        """The trainable parameters, in the model's order: what ``HostAdamW`` takes."""
        return [s.param for s in self.slots]

    # --- forward: the device copies ---------------------------------------------------

    def device_weight(self, slot: Slot) -> torch.Tensor:
        """The slot's working weight on the device, for the op on the current stream."""
        self._raise()
        group = self.groups[slot.group]
        backward = ops.in_backward()
        if not backward and slot.group not in self._position:
            self._position[slot.group] = len(self._order)
            self._order.append(slot.group)
        if group.copies is not None and backward is False:
            self._refresh(group)
        if group.copies is None:
            self._fetch(group)
        if backward:
            self._start_updates(group)
        self._live.move_to_end(group.name)
        self._prefetch(group.name, backward)
        if group.fetched is not None:
            group.copies, group.ready = group.fetched.take()
            group.fetched = None
        if group.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(group.ready)
        return group.copies[slot.pos]

    def _prefetch(self, name: str, backward: bool | None):
        i = self._position.get(name)
        if i is None:
            return
        step = -1 if backward else 1
        for k in range(1, self.lookahead + 1):
            j = i + step * k
            if 0 <= j < len(self._order):
                g = self.groups[self._order[j]]
                if g.copies is not None and backward is False:
                    self._refresh(g)
                if g.copies is None:
                    self._fetch(g)
                if backward:
                    self._start_updates(g)
        # The oldest copies go, but not those an early update still needs kept (``_Group``).
        excess = len(self._live) - (2 * self.lookahead + 2)
        if excess > 0:
            for old in [g for g in self._live.values() if not g.early][:excess]:
                self._drop(old)

    def _drop(self, group: _Group):
        self._live.pop(group.name, None)
        if group.fetched is not None:
            group.fetched.discard()
        group.copies, group.ready, group.versions, group.fetched = None, None, None, None
        group.early.clear()

    def _refresh(self, group: _Group):
        """In a forward: drops the group's copies if a delayed update changed a weight since
        they were made (after waiting for one still running)."""
        if any(s.queued for s in group.slots):
            self._idle(group.slots, "wait_update_s")
        if any(s.version != v for s, v in zip(group.slots, group.versions, strict=True)):
            self._drop(group)

    def _fetch(self, group: _Group):
        # An update of these weights may still be writing them.
        self._idle(group.slots, "wait_update_s")
        compute = torch.cuda.current_stream(self.device) if self._h2d is not None else None

        def copy():
            if self._h2d is None:
                return [s.working.clone() for s in group.slots], None
            with torch.cuda.device(self.device), torch.cuda.stream(self._h2d):
                copies = [
                    torch.empty(s.working.shape, dtype=s.working.dtype, device=self.device)
                    for s in group.slots
                ]
                for c, s in zip(copies, group.slots, strict=True):
                    c.copy_(s.working, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self._h2d)
            for c in copies:
                c.record_stream(compute)
            return copies, ready

        if self._granter is None:
            group.copies, group.ready = copy()
            for s in group.slots:
                s.read_done = group.ready
        else:
            # Asked of the daemon and issued on the granter thread: this thread goes on.
            group.copies, group.fetched = _ISSUING, self._granter.request(group.nbytes, copy)
            for s in group.slots:
                s.read_done = group.fetched
        group.versions = [s.version for s in group.slots]
        self._live[group.name] = group

    def _start_updates(self, group: _Group):
        """In backward, once the group's copies exist: they were the weights' last read in the
        step, so their delayed updates can run as soon as the copy is done, before the
        gradients they make room for arrive. The copies are kept until those gradients come."""
        with self._cv:
            early = [s for s in group.slots if s.pending is not None and not s.update_queued]
            for s in early:
                s.queued += 1
                s.update_queued = True
        for s in early:
            group.early.add(s.pos)
            self._queue.put((s, None, None, True))

    # --- backward: the gradients ------------------------------------------------------

    def grad_ready(self, slot: Slot, grad: torch.Tensor):
        """Takes the gradient backward produced for ``slot`` (on the device)."""
        self._raise()
        self.groups[slot.group].early.discard(slot.pos)
        with self._cv:
            direct = slot.grads == 0 and slot.pending is None and slot.queued == 0
            slot.queued += 1
        src = done = None
        if not direct:
            src, waited = self._bounce.take(grad.shape, grad.dtype)
            self.times["wait_bounce_s"] += waited
        dst = slot.grad if direct else src
        produced = None
        if self._d2h is not None:
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(self.device))

        def copy():
            if self._d2h is None:
                dst.copy_(grad)
                return None, None
            with torch.cuda.device(self.device), torch.cuda.stream(self._d2h):
                self._d2h.wait_event(produced)
                dst.copy_(grad, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._d2h)
            grad.record_stream(self._d2h)  # the request held it until here
            return None, done

        if self._granter is None:
            _, done = copy()
        else:
            done = self._granter_back.request(grad.nbytes, copy)
        self._queue.put((slot, src, done, False))

    def _work(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            slot, src, done, update_only = item
            try:
                t0 = time.perf_counter()
                if done is not None:
                    done.synchronize()
                t1 = time.perf_counter()
                if update_only:
                    slot.update_queued = False
                # An early update whose copy is still to be read (a paced link) is left to the
                # gradient's arrival: the worker does not stop for it.
                if slot.pending is not None and (not update_only or self._read(slot)):
                    update, slot.pending = slot.pending, None
                    self.before_write(slot)
                    update(slot)
                    slot.version += 1
                t2 = time.perf_counter()
                if src is not None:
                    if slot.grads == 0:
                        slot.grad.copy_(src)
                    else:
                        slot.grad.add_(src)
                if not update_only:
                    slot.grads += 1
                t3 = time.perf_counter()
                self.times["worker_copy_wait_s"] += t1 - t0
                self.times["worker_update_s"] += t2 - t1
                self.times["worker_grad_add_s"] += t3 - t2
            except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread
                self._error = self._error or e
            finally:
                if src is not None:
                    self._bounce.give()
                with self._cv:
                    slot.queued -= 1
                    self._cv.notify_all()

    def wait_grads(self):
        """Waits until every gradient sent so far is in host memory (and every delayed update
        they set off is done)."""
        self._idle(self.slots)

    def _idle(self, slots: list[Slot], what: str = "wait_grads_s"):
        t = time.perf_counter()
        with self._cv:
            self._cv.wait_for(lambda: all(s.queued == 0 for s in slots))
        self.times[what] += time.perf_counter() - t
        self._raise()

    def _raise(self):
        if self._error is not None:
            raise RuntimeError(
                "weightstream: taking a gradient to host memory failed"
            ) from self._error

    @staticmethod
    def _read(slot: Slot) -> bool:
        """Whether the device copies of ``slot``'s working weight have read it, at once."""
        done = slot.read_done
        return done is None or done.query()

    @staticmethod
    def before_write(slot: Slot):
        """Waits until the device copies of ``slot``'s working weight have read it."""
        if slot.read_done is not None:
            slot.read_done.synchronize()

    def invalidate(self):
        """Drops the device copies (the working weights changed)."""
        for g in list(self._live.values()):
            self._drop(g)

    # --- the end ----------------------------------------------------------------------

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory held: the trainable state (``host_bytes`` per tensor, each
        aligned) and the bounce ring (``bounce_bytes``)."""
        return self.storage.nbytes

    @property
    def bounce_bytes(self) -> int:
        return self._bounce.size if self._bounce is not None else 0

    def close(self, device: torch.device | str | None = None):
        """Puts the weights back as ordinary parameters on ``device`` (default: the device the
        layers computed on), with their current values, and frees the host memory."""
        if self._closed:
            return
        self._closed = True
        for granter in (self._granter, self._granter_back):
            if granter is not None:
                granter.close()  # first: the worker may wait for a copy it issues
        self._queue.put(None)
        self._worker.join()
        self._hooks.remove_all()
        target = torch.device(device) if device is not None else self.device
        for user in self._users:
            user.release()  # an optimizer's views of the regions go before the regions
        self._users.clear()
        for s in self.slots:
            vars(s.module).pop("_apply", None)
            s.pending = None
            s.param.data = s.working.to(target, copy=True)
            s.working = s.master = s.grad = None
        self.invalidate()
        if self._d2h is not None:
            torch.cuda.synchronize(self.device)
        self._bounce = None
        self.storage.close()


def _keep_on_host(module: nn.Linear):
    """``module.to(...)``/``.cuda()``/``.half()`` move everything but the streamed weight."""

    def apply(fn, recurse=True):
        weight = module._parameters.pop("weight")
        try:
            return type(module)._apply(module, fn, recurse)
        finally:
            module._parameters["weight"] = weight

    module._apply = apply


class _TrainableLinear(torch.autograd.Function):
    """``F.linear`` on the device copy. Saves only the input (a checkpoint's hooks see it) and
    takes the weight again in backward; the gradients are autograd's formulas for ``linear``
    (the input's is ``ops.input_grad``; ``mm_mat2_backward`` of the transposed weight, which
    is column-major: ``grad.t() @ x``), on the input and gradient flattened to 2-D as
    ``matmul`` flattens them. Where that flattening does not hold (a non-contiguous input,
    autocast), the op is run again on the saved input and differentiated."""

    @staticmethod
    def forward(ctx, trainable: Trainable, slot: Slot, x: torch.Tensor, param):
        out = F.linear(x, trainable.device_weight(slot), slot.module.bias)
        ctx.trainable, ctx.slot = trainable, slot
        ctx.autocast = ops.autocast_state(x)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        trainable, slot = ctx.trainable, ctx.slot
        w = trainable.device_weight(slot)
        autocast, dtype = ctx.autocast
        want_x = ctx.needs_input_grad[2]
        if not autocast and x.is_contiguous() and x.dtype == w.dtype == grad_out.dtype:
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            grad_w = g2.t().mm(x.reshape(-1, x.shape[-1]))
            grad_x = ops.input_grad(slot.module, x, grad_out, w, False, dtype) if want_x else None
        else:
            with torch.enable_grad(), torch.autocast(x.device.type, dtype, enabled=autocast):
                xx = x.detach().requires_grad_(want_x)
                ww = w.detach().requires_grad_(True)
                out = F.linear(xx, ww, slot.module.bias)
            if want_x:
                grad_x, grad_w = torch.autograd.grad(out, (xx, ww), grad_out)
            else:
                grad_x, (grad_w,) = None, torch.autograd.grad(out, (ww,), grad_out)
        trainable.grad_ready(slot, grad_w)
        return None, None, grad_x, None


def _forward(trainable: Trainable, slot: Slot, x, *args, **kwargs):
    if args or kwargs:
        raise TypeError(f"{slot.name}: a streamed trainable layer takes one input")
    if not torch.is_grad_enabled():
        return F.linear(x, trainable.device_weight(slot), slot.module.bias)
    return _TrainableLinear.apply(trainable, slot, x, slot.param)


def group_names(root: nn.Module, layers: list[tuple[str, nn.Linear]], group_by) -> list[str]:
    """Each layer's group (``stream_trainable``'s ``group_by``)."""
    if callable(group_by):
        return [str(group_by(name)) for name, _ in layers]
    if group_by == "block":
        return [policy.block_of(root, name) for name, _ in layers]
    return [name for name, _ in layers]


def ring_bytes(groups: Iterable[list[torch.Tensor]]) -> int:
    """The bounce ring's size for groups of these weights: ``BOUNCE_GROUPS`` times the largest
    group's gradients (each aligned), in whole pages."""
    largest = max(sum(-(-w.nbytes // ALIGN) * ALIGN for w in ws) for ws in groups)
    return -(-BOUNCE_GROUPS * largest // mmap.PAGESIZE) * mmap.PAGESIZE


def layer_ring_bytes(root: nn.Module, layers: list[tuple[str, nn.Linear]], group_by) -> int:
    """``ring_bytes`` of the layers grouped as ``stream_trainable`` groups them."""
    groups: dict[str, list[torch.Tensor]] = {}
    for (_, m), key in zip(layers, group_names(root, layers, group_by), strict=True):
        groups.setdefault(key, []).append(m.weight)
    return ring_bytes(groups.values())


def trainable_layers(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The layers ``stream_trainable`` takes: every ``nn.Linear`` whose weight requires grad.
    Raises ``TrainableError`` for a trainable layer it cannot take."""
    out = []
    for name, m in module.named_modules():
        weight = getattr(m, "weight", None)
        if not isinstance(weight, nn.Parameter) or not weight.requires_grad:
            continue
        if type(m) is not nn.Linear:
            raise TrainableError(
                f"{name!r} ({type(m).__name__}) has a trainable weight, and only nn.Linear "
                "layers' weights are held in host memory (LoRA's lora_A/lora_B, lora_down/"
                "lora_up): freeze it, or train it on the device without trainable streaming"
            )
        if m.bias is not None and m.bias.requires_grad:
            raise TrainableError(
                f"{name!r}: a trainable bias is not held in host memory; create the LoRA "
                "without biases (peft: lora_bias=False) or freeze it"
            )
        if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TrainableError(f"{name!r}: a {weight.dtype} weight cannot be trained here")
        out.append((name, m))
    return out


def stream_trainable(
    module: nn.Module,
    handle=None,
    *,
    device: torch.device | str | None = None,
    group_by: str | Callable[[str], str] = "block",
    lookahead: int = 1,
    optimizer: str | None = None,
    master: str = "fp32",
) -> Trainable:
    """Moves the trainable weights of ``module`` (a LoRA's ``nn.Linear`` layers) into host
    memory held by ``handle``'s daemon session, and streams them to the device as the layers
    run. ``device``: where the layers compute (default: the handle's device). ``group_by``:
    which weights are copied to the device together: ``"block"`` (the model's repeated block,
    ``policy.block_of``), ``"layer"``, or a function of the layer's name giving its group's
    name. ``optimizer``
    ("adamw" or "adamw8bit"), when given, is only used to check up front that the trainable
    state and the optimizer's fit the host memory the daemon allows (``host_bytes``).
    ``master``: ``"fp32"`` (the default) keeps an fp32 master of each bf16/f16 weight, which
    ``HostAdamW`` updates and rounds into the weight; ``"none"`` keeps none: the optimizer
    updates the weight itself (fp32 arithmetic, rounded to nearest-even back to its dtype),
    4 bytes less per element, and the updates smaller than half the weight's last bit are lost
    (as in any trainer of bf16 weights without a master).

    Without ``handle``, the host memory is the trainer's own (for tests and for models not
    streamed through the daemon)."""
    layers = trainable_layers(module)
    if not layers:
        raise TrainableError(
            "no trainable nn.Linear in the module: add the LoRA (and freeze the base) before "
            "stream_trainable"
        )
    if optimizer is not None:
        check_optimizer(optimizer)
    check_master(master)
    dev = torch.device(device) if device is not None else getattr(handle, "device", None)
    if dev is None:
        raise TrainableError("pass device= (or a handle) to say where the layers compute")
    if handle is not None:
        check_host_fits(
            handle.client,
            [m.weight for _, m in layers],
            optimizer,
            master=master,
            ring=layer_ring_bytes(module, layers, group_by),
        )
    storage = HostStorage(dev, handle.session if handle is not None else None)
    try:
        return Trainable(
            module, layers, dev, storage, group_by=group_by, lookahead=lookahead, master=master
        )
    except BaseException:
        storage.close()
        raise


#: The optimizers whose state ``host_bytes`` sizes (``HostAdamW``'s kinds).
OPTIMIZERS = ("adamw", "adamw8bit")


def check_optimizer(kind: str):
    """Raises ``TrainableError`` for an optimizer of weights in host memory other than
    ``OPTIMIZERS``, naming them."""
    if kind not in OPTIMIZERS:
        raise TrainableError(
            f"optimizer {kind!r} is not supported for weights in host memory: use one of "
            f"{', '.join(OPTIMIZERS)}"
        )


def check_host_fits(
    client,
    params: Iterable[torch.Tensor],
    optimizer: str | None,
    upload=0,
    master: str = "fp32",
    ring: int = 0,
):
    """Raises ``TrainableError`` naming the numbers when the trainable state (and the
    optimizer's, if named; with or without the fp32 master, ``master``; and the ``ring``
    bytes of the gradients' bounce ring), with ``upload`` bytes
    of a model still to upload beside it, cannot fit the host memory the daemon allows this
    uid, even with every other uid's memory given back (what only might fit is the daemon's to
    refuse, with its own numbers, when the regions are made). Refusing with the fp32 master,
    the message says when the state would fit without it, and its size then."""
    check_master(master)
    params = list(params)
    state = ring + sum(host_bytes(p.numel(), p.dtype, optimizer, master) for p in params)
    room = host_room(client)
    if room is None or upload + state <= room[0]:
        return
    free, limit = room
    lean = ring + sum(host_bytes(p.numel(), p.dtype, optimizer, "none") for p in params)
    what = (f" with {optimizer}" if optimizer else "") + (
        " and the fp32 master" if lean != state else ""
    )
    fp8 = "quantize='fp8', " if upload else ""
    advice = f"use adamw8bit, {fp8}a lower rank, or raise the daemon's quota"
    if lean != state and upload + lean <= free:
        need = (
            f"the state is {size_text(lean)} and both need {size_text(upload + lean)}"
            if upload
            else f"it needs {size_text(lean)}"
        )
        advice = (
            "without the fp32 master (master='none': the optimizer updates the weights in "
            f"place) {need}, which fits; else {advice}"
        )
    if upload:
        raise TrainableError(
            f"the upload ({size_text(upload)}) and the trainable state ({size_text(state)}"
            f"{what}) need {size_text(upload + state)} of host memory, and {limit} leaves this "
            f"uid {size_text(max(free, 0))}: {advice}"
        )
    raise TrainableError(
        f"the trainable state needs {size_text(state)} of host memory{what}, and {limit} "
        f"leaves this uid {size_text(max(free, 0))} beside what it holds: {advice}"
    )


def size_text(n: int) -> str:
    """``n`` bytes for a message: GiB or MiB with two decimals, else bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} bytes"


def host_room(client) -> tuple[int, str] | None:
    """The most host bytes this uid could still get from the daemon, and the limit that says
    so (``quotas.per_uid_host_bytes`` or ``quotas.max_host_bytes``); None without limits."""
    info = client.info()
    q, used = info.quotas, info.usage.host_bytes
    rooms = []
    if q.per_uid_host_bytes:
        rooms.append((q.per_uid_host_bytes - used, "quotas.per_uid_host_bytes"))
    if q.max_host_bytes:
        rooms.append((q.max_host_bytes - used, "quotas.max_host_bytes"))
    return min(rooms) if rooms else None
