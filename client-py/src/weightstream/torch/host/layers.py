"""The trainable layers: ``Trainable`` (the slots and groups of a module's trainable weights in
host memory, their device copies in flight, the gradient path and its worker) and the autograd
Function a streamed trainable ``nn.Linear`` runs (see the package's doc for the design)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from weightstream.torch import ops
from weightstream.torch.hooks import HookRegistry
from weightstream.torch.host.sizing import check_master, group_names, has_master, ring_bytes
from weightstream.torch.host.storage import BounceRing, Carver, HostStorage
from weightstream.torch.host.transfers import ISSUING, Granter, Issued

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
    #: The copies the granter thread is still to issue (``copies`` is then ``ISSUING``).
    fetched: Issued | None = None
    #: Each slot's ``version`` when the copies were made.
    versions: list[int] | None = None
    #: Positions of the slots whose delayed update backward set off at this group's copy and
    #: whose gradient has not come yet: while any is left the copies are kept.
    early: set[int] = dataclasses.field(default_factory=set)

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of the group's working weights: what one copy to the device moves."""
        return sum(s.working.nbytes for s in self.slots)


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
        #: each one and issues it once granted (``Granter``): the daemon paces the two
        #: directions apart, so a gradient's copy never waits behind the weights' grants.
        self._granter = Granter(storage, True) if storage.paces else None
        self._granter_back = Granter(storage, False) if storage.paces else None
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
            group.copies, group.fetched = ISSUING, self._granter.request(group.nbytes, copy)
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
