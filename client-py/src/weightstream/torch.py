"""``weightstream.torch.attach(model, device)``: stream a model's frozen weights through the
daemon, with outputs and gradients identical to the model run with its weights in place.

Each streamed module's forward becomes an autograd Function that acquires the module's group
in forward and again in backward, and saves no view of streamed memory: in backward it applies
autograd's own input-gradient formula to the re-acquired weight (or re-runs the module's
operation on the saved input and differentiates that), under the same autocast state, so the
gradient is the one autograd computes for the original module, bit for bit. Weights that are
read other than through their module's forward (tied weights, parametrizations,
``nn.MultiheadAttention``'s ``out_proj``) stay on the device.

A group is, by default, one of the model's repeated blocks (a child of its outermost
``nn.ModuleList``/``nn.Sequential``, e.g. ``transformer_blocks.3``): one round trip to the
daemon per block and pass instead of one per layer. A group's ticket is held while the layers
that use it run, and given back when a layer of another group (or of the same group in another
pass: forward, or backward with its recomputation) asks for its own.
"""

from __future__ import annotations

import collections
import functools
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

import weightstream
from weightstream.client import Client
from weightstream.errors import SessionFault
from weightstream.session import Session

#: Modules smaller than this stay on the device by default: not worth a round trip.
DEFAULT_MIN_BYTES = 1 << 20
#: How backward gets a streamed layer's input gradient: "formula" applies autograd's own
#: formula to the re-acquired weight; "recompute" re-runs the layer and differentiates it
#: (one more forward operation per layer, exact for any layer type).
INPUT_GRAD = "formula"


@dataclass
class _Streamed:
    """What a streamed module's forward needs."""

    handle: Handle
    module: nn.Module
    name: str
    group: int
    has_bias: bool
    #: Index of the module's weight among its group's tensors (the bias follows it).
    slot: int = 0
    #: (weight, bias) views of a resident group, valid for the session's life; else None.
    fixed: tuple | None = None


_GRAPH_TASK = getattr(torch._C, "_current_graph_task_id", None)


def _in_backward() -> bool | None:
    """True while autograd runs a backward pass (a checkpoint's recompute runs inside one);
    None where torch cannot tell (then the plan needs ``Handle.end_step``)."""
    return None if _GRAPH_TASK is None else _GRAPH_TASK() != -1


def _op(module: nn.Module, x, weight, bias):
    """The module's own operation with the given weight and bias."""
    if isinstance(module, nn.Linear):
        return F.linear(x, weight, bias)
    if isinstance(module, nn.Conv2d):
        return module._conv_forward(x, weight, bias)
    raise TypeError(f"cannot stream {type(module).__name__}")


class _StreamedOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state: _Streamed, x: torch.Tensor):
        out = _op(state.module, x, *state.handle._acquire(state, training=True))
        ctx.state = state
        ctx.autocast = (
            torch.is_autocast_enabled(x.device.type),
            torch.get_autocast_dtype(x.device.type),
        )
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        state: _Streamed = ctx.state
        enabled, dtype = ctx.autocast
        weights = state.handle._acquire(state, training=True)
        grad_x = None
        if INPUT_GRAD == "formula":
            grad_x = _input_grad(state.module, x, grad_out, weights[0], enabled, dtype)
        if grad_x is None:
            grad_x = _input_grad_by_recompute(state.module, x, grad_out, weights, enabled, dtype)
        return None, grad_x


def _input_grad(module, x, grad_out, weight, autocast: bool, dtype):
    """The input gradient by the formula autograd applies to the module's op (the same kernel
    on the same operands, so the same bits), without running the op again. None where this
    module's op has no such formula here (then the op is recomputed and differentiated)."""
    if autocast and weight.is_floating_point() and weight.dtype != dtype:
        weight = weight.to(dtype)  # what autocast fed the op
    if isinstance(module, nn.Linear):
        # aten::linear runs addmm/mm on the input flattened to 2-D; the gradient of that
        # operand is grad @ weight (mm_mat1_backward), reshaped back.
        g = grad_out.reshape(-1, grad_out.shape[-1]).mm(weight)
        g = g.reshape(*x.shape[:-1], weight.shape[1])
    elif (
        isinstance(module, nn.Conv2d)
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
    ):
        xin = x.to(dtype) if autocast and x.is_floating_point() else x
        g = torch.ops.aten.convolution_backward(
            grad_out,
            xin,
            weight,
            None,
            module.stride,
            module.padding,
            module.dilation,
            False,
            [0, 0],
            module.groups,
            [True, False, False],
        )[0]
    else:
        return None
    return g.to(x.dtype) if g.dtype != x.dtype else g


def _input_grad_by_recompute(module, x, grad_out, weights, autocast: bool, dtype):
    with torch.enable_grad(), torch.autocast(x.device.type, dtype, enabled=autocast):
        x_ = x.detach().requires_grad_(True)
        out = _op(module, x_, *weights)
    (grad_x,) = torch.autograd.grad(out, x_, grad_out)
    return grad_x


def _streamed_forward(state: _Streamed, x, *args, **kwargs):
    if args or kwargs:
        raise TypeError(f"{state.name}: streamed modules take one input")
    if state.fixed is not None:
        # A resident group: its views stay valid for the whole session, so the module's own
        # operation runs on them as is (autograd may keep them for backward).
        return _op(state.module, x, *state.fixed)
    if not x.requires_grad:
        # No graph is recorded (the weights never require grad): nothing keeps the views.
        return _op(state.module, x, *state.handle._acquire(state, training=torch.is_grad_enabled()))
    return _StreamedOp.apply(state, x)


def _weights(ticket, state: _Streamed) -> tuple:
    """The module's (weight, bias) views in its group's ticket."""
    t, i = ticket.tensors, state.slot
    return t[i], t[i + 1] if state.has_bias else None


@dataclass
class _Held:
    """The group ticket the layers of one block share while they run."""

    group: int
    ticket: object
    backward: bool | None


@dataclass
class Handle:
    """What ``attach`` returns: statistics, plan control, and ``detach``."""

    client: Client
    session: Session
    model_id: str
    device: torch.device
    streamed: dict[str, _Streamed] = field(default_factory=dict)
    resident: list[str] = field(default_factory=list)
    _recording: list[int] | None = field(default_factory=list)
    _seen_backward: bool = False
    _lookahead: _Lookahead | None = None
    _held: _Held | None = None
    _pinned: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # --- used by the streamed modules ---------------------------------------------------

    def _acquire(self, state: _Streamed, training: bool) -> tuple:
        """The module's (weight, bias) views, from the group's held ticket when it serves this
        pass, else from a new acquire (the held ticket is given back first)."""
        backward = _in_backward()
        with self._lock:
            held = self._held
            if held is not None and held.group == state.group and held.backward == backward:
                return _weights(held.ticket, state)
            self._held = None
        if held is not None:
            self.session.release(held.ticket)
        if training:
            self._record(state.group)
        with self._lock:
            ahead = self._lookahead
            number = ahead.take(state.group) if ahead else self.session.submit(state.group)
        try:
            ticket = self.session.wait(number)
        except SessionFault as e:
            if ahead is None or e.code != "FAULT_RESOURCE_EXHAUSTED":
                raise
            # A lookahead acquire found the arena full of tickets still in use: ask again
            # now that they are released, without lookahead in the way.
            with self._lock:
                ahead.drain()
                number = self.session.submit(state.group)
            ticket = self.session.wait(number)
        with self._lock:
            self._held = _Held(state.group, ticket, backward)
        return _weights(ticket, state)

    def _release_held(self):
        with self._lock:
            held, self._held = self._held, None
        if held is not None:
            self.session.release(held.ticket)

    def _record(self, group: int):
        """Records the first training step's acquisitions as the plan: the step ends when the
        first group is acquired again outside a backward pass, after a backward pass ran.
        (Passes under ``no_grad``, such as sampling, are not recorded.)"""
        if self._recording is None:
            return
        backward = _in_backward()
        if backward is None:
            self._recording.append(group)
            return
        if self._recording and group == self._recording[0] and not backward and self._seen_backward:
            self.end_step()
            return
        self._seen_backward = self._seen_backward or backward
        self._recording.append(group)

    def _pin_resident(self):
        """Acquires each resident group once for the session's life: its modules then run
        their own operation on the views, with no acquire, Function or message per call."""
        by_group: dict[int, list[_Streamed]] = {}
        for state in self.streamed.values():
            by_group.setdefault(state.group, []).append(state)
        for group, states in by_group.items():
            if not self.session.groups[group].resident:
                continue
            ticket = self.session.acquire(group)
            self._pinned.append(ticket)
            for state in states:
                state.fixed = _weights(ticket, state)

    def _unpin(self, release: bool = True):
        """Drops the resident views; gives their tickets back unless the session is gone."""
        for state in self.streamed.values():
            state.fixed = None
        pinned, self._pinned = self._pinned, []
        for ticket in pinned if release else ():
            self.session.release(ticket)

    # --- public ------------------------------------------------------------------------

    def end_step(self):
        """Marks the end of the first training step explicitly (attach also detects it): its
        acquisitions are sent as the plan, and later steps are prefetched along it."""
        if self._recording:
            self.session.plan(self._recording)
            self._lookahead = _Lookahead(self.session, self._recording)
        self._recording = None

    def set_budget(self, vram_budget: int, staging_bytes: int = 0):
        """Reopens the session with another device budget (same model, same groups); the plan
        is recorded again from the next step."""
        self._drop_lookahead()
        self._unpin()
        old = self.session
        groups = [(g.name, [t.name for t in g.tensors]) for g in old.groups]
        old.close()
        self.session = self.client.open_session(
            self.model_id,
            groups,
            vram_budget,
            staging_bytes=staging_bytes,
            device=self.device,
            label=old.opened.session_id,
        )
        self._pin_resident()
        self._recording, self._seen_backward = [], False

    def reconnect(self, *, restore=None, timeout: float = 30.0):
        """After the daemon restarted (a call raised ``DaemonUnavailable``): opens the session
        again against the new daemon, so that training resumes at the next step in the same
        process (drop the failed step first: ``optimizer.zero_grad()``). The model comes back
        from the files this client loaded it from (``attach(model=...)``), or from
        ``restore(client)`` returning a model id or manifest: for uploaded weights, upload the
        same tensors again, e.g. ``restore=lambda c: c.upload_model(name, tensors)[0]``, which
        gives the same model id."""
        with self._lock:
            self._lookahead = None  # its tickets died with the old session
            self._held = None
        self._unpin(release=False)  # the tickets and views died with the old session
        self.session.reconnect(restore=restore, timeout=timeout)
        self.model_id = self.session.model_id
        self._pin_resident()
        if self._recording is None and self.session.last_plan:
            self._lookahead = _Lookahead(self.session, self.session.last_plan)
        else:
            self._recording, self._seen_backward = [], False

    def stats(self) -> dict:
        s = self.session.stats()
        if s is None:
            return {}
        fields = [f.name for f in s.DESCRIPTOR.fields]
        out = {f: getattr(s, f) for f in fields}
        out["hit_rate"] = s.hits / s.acquires if s.acquires else 0.0
        return out

    def _drop_lookahead(self):
        self._release_held()
        with self._lock:
            if self._lookahead is not None:
                self._lookahead.drain()
            self._lookahead = None

    def detach(self, release: bool = False):
        """Puts the weights back into the modules (on ``device``) and closes the session;
        with ``release``, also drops this handle's reference to the daemon's copy (it goes
        when no other session uses it)."""
        self._drop_lookahead()
        self._unpin()
        for state in self.streamed.values():
            ticket = self.session.acquire(state.group)
            weight, bias = _weights(ticket, state)
            weight = weight.to(self.device, copy=True)
            bias = bias.to(self.device, copy=True) if bias is not None else None
            self.session.release(ticket)
            m = state.module
            del m.forward
            m.weight = nn.Parameter(weight, requires_grad=False)
            if state.has_bias:
                m.bias = nn.Parameter(bias, requires_grad=False)
        self.streamed.clear()
        self.session.close()
        if release:
            self.client.release_model(self.model_id)


class _Lookahead:
    """Keeps the plan's next acquires in flight, so that a layer's acquire finds its reply
    already there instead of waiting for a round trip (the trainer's thread must never block
    on the daemon when the plan is followed). The tickets in flight hold their space, so they
    are bounded to the staging arena less room for two of the largest groups (the one in use
    and the next one placed)."""

    def __init__(self, session: Session, plan: list[int]):
        self.session = session
        self.plan = plan
        self.cursor = 0  # the plan position that ahead[0] stands for
        self.ahead: collections.deque[tuple[int, int]] = collections.deque()
        self.bytes = 0
        largest = max(g.nbytes for g in session.groups)
        self.cap = max(0, session.opened.staging_bytes - 2 * largest)

    def size(self, group: int) -> int:
        return self.session.groups[group].nbytes

    def take(self, group: int) -> int:
        """The ticket number for an acquire of `group`: the one in flight if the client
        follows the plan, else a fresh one (and the lookahead re-syncs)."""
        if self.ahead and self.ahead[0][0] == group:
            _, number = self.ahead.popleft()
            self.bytes -= self.size(group)
            self.cursor = (self.cursor + 1) % len(self.plan)
        else:
            self.drain()
            number = self.session.submit(group)
            position = self.next_position(group)
            if position is None:
                return number  # off the plan (a sampling pass of other layers): no lookahead
            self.cursor = (position + 1) % len(self.plan)
        self.top_up()
        return number

    def next_position(self, group: int) -> int | None:
        n = len(self.plan)
        for i in range(n):
            if self.plan[(self.cursor + i) % n] == group:
                return (self.cursor + i) % n
        return None

    def top_up(self):
        n = len(self.plan)
        while len(self.ahead) < n:
            group = self.plan[(self.cursor + len(self.ahead)) % n]
            if self.bytes + self.size(group) > self.cap:
                break
            self.ahead.append((group, self.session.submit(group)))
            self.bytes += self.size(group)

    def drain(self):
        """Gives back the acquires in flight that the client did not follow."""
        while self.ahead:
            _, number = self.ahead.popleft()
            try:
                self.session.release(self.session.wait(number))
            except SessionFault:
                pass  # refused (arena full): nothing to give back
        self.bytes = 0


def _shared_parameters(root: nn.Module) -> set[int]:
    """Ids of parameters that appear under more than one module (tied weights)."""
    owners: dict[int, int] = {}
    for _, m in root.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {pid for pid, n in owners.items() if n > 1}


def _why_resident(root, name, m, shared, min_bytes) -> str | None:
    w, b = m.weight, m.bias
    if not isinstance(w, torch.Tensor) or w.device.type == "meta":
        return "no weight"
    if w.requires_grad or (b is not None and b.requires_grad):
        return "trainable (only frozen weights are streamed)"
    if parametrize.is_parametrized(m):
        return "parametrized (its weight is computed, not read)"
    if id(w) in shared or (b is not None and id(b) in shared):
        return "tied to another module's weight"
    if w.nbytes + (b.nbytes if b is not None else 0) < min_bytes:
        return "smaller than min_bytes"
    return None


def _block_of(root: nn.Module, name: str) -> str:
    """The model's repeated block that module ``name`` belongs to: the child of the outermost
    ``nn.ModuleList``/``nn.Sequential`` on its path (``transformer_blocks.3`` for
    ``transformer_blocks.3.attn.to_q``), or the module itself when there is none."""
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if isinstance(root.get_submodule(".".join(parts[:i])), (nn.ModuleList, nn.Sequential)):
            return ".".join(parts[: i + 1])
    return name


def _group(root, chosen, group_by) -> dict[str, list[tuple[str, nn.Module]]]:
    """Group name -> its modules, in the model's order."""
    if group_by == "layer":
        key = None
    elif group_by == "block":
        key = functools.partial(_block_of, root)
    else:
        key = group_by
    members: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, m in chosen:
        members.setdefault(name if key is None else str(key(name)), []).append((name, m))
    return members


def _select(root, include, ignore, min_bytes):
    shared = _shared_parameters(root)
    # Weights that another module reads directly: keep those modules resident.
    direct = {
        f"{n}.out_proj" if n else "out_proj"
        for n, m in root.named_modules()
        if isinstance(m, nn.MultiheadAttention)
    }
    chosen, resident = [], []
    for name, m in root.named_modules():
        if not isinstance(m, include):
            continue
        base = nn.Linear if isinstance(m, nn.Linear) else nn.Conv2d
        if not isinstance(m, (nn.Linear, nn.Conv2d)) or type(m).forward is not base.forward:
            resident.append(name)  # a custom forward: replacing it could change the result
            continue
        if name in ignore or isinstance(m, tuple(t for t in ignore if isinstance(t, type))):
            resident.append(name)
            continue
        if name in direct:
            resident.append(name)
            continue
        if _why_resident(root, name, m, shared, min_bytes) is None:
            chosen.append((name, m))
        else:
            resident.append(name)
    return chosen, resident


def attach(
    module: nn.Module,
    device: torch.device | str,
    *,
    vram_budget: int | None = None,
    min_bytes: int = DEFAULT_MIN_BYTES,
    include: tuple[type, ...] = (nn.Linear, nn.Conv2d),
    ignore: Iterable = (),
    model: str | None = None,
    client: Client | None = None,
    staging_bytes: int = 0,
    label: str = "",
    group_by="block",
) -> Handle:
    """Streams the frozen weights (and biases) of ``module``'s Linear and Conv2d layers of at
    least ``min_bytes`` through the daemon; everything else moves to ``device`` as usual.

    - ``vram_budget``: device bytes the daemon may use for this session (default: a quarter
      of the streamed bytes, at least three times the largest group).
    - ``model``: the id of a model the daemon already loaded from safetensors whose tensor
      names match the module's parameter names; otherwise the weights are uploaded.
    - ``ignore``: module names or types to keep on the device.
    - ``group_by``: the unit of transfer: ``"block"`` (default: one of the model's repeated
      blocks, see ``_block_of``; layer by layer when ``vram_budget`` is below three of the
      largest block and ``staging_bytes`` is not given), ``"layer"``, or a function from a
      module's name to its group's name.
    The trainer's own copies of the streamed weights are freed.
    """
    if group_by not in ("block", "layer") and not callable(group_by):
        raise ValueError(f"group_by={group_by!r}: expected 'block', 'layer' or a function")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    client = client or weightstream.connect()
    chosen, resident = _select(module, tuple(include), set(ignore), min_bytes)
    if not chosen:
        raise ValueError("attach: no module to stream (check include, ignore and min_bytes)")
    tensors = {}
    for name, m in chosen:
        tensors[f"{name}.weight"] = m.weight.detach()
        if m.bias is not None:
            tensors[f"{name}.bias"] = m.bias.detach()
    if model is None:
        manifest, _ = client.upload_model(label or type(module).__name__, tensors)
    else:
        manifest = _match(client, model, tensors)

    def tensor_names(name, m):
        return [f"{name}.weight"] + ([f"{name}.bias"] if m.bias is not None else [])

    def nbytes(name, m):
        # The daemon aligns each tensor within its group (at most 4 KiB).
        return sum(-(-p.nbytes // 4096) * 4096 for p in (m.weight, m.bias) if p is not None)

    members = _group(module, chosen, group_by)
    sizes = [sum(nbytes(n, m) for n, m in ms) for ms in members.values()]
    small = vram_budget is not None and vram_budget < 3 * max(sizes) and not staging_bytes
    if group_by == "block" and small:
        warnings.warn(
            f"attach: vram_budget {vram_budget} is less than three of the largest block "
            f"({max(sizes)} bytes): streaming layer by layer instead",
            stacklevel=2,
        )
        members = _group(module, chosen, "layer")
        sizes = [sum(nbytes(n, m) for n, m in ms) for ms in members.values()]
    groups = [
        (gname, [t for n, m in ms for t in tensor_names(n, m)]) for gname, ms in members.items()
    ]
    if vram_budget is None:
        vram_budget = max(sum(sizes) // 4, 3 * max(sizes))
    session = client.open_session(
        manifest.model_id,
        groups,
        vram_budget,
        staging_bytes=staging_bytes,
        device=device,
        label=label or type(module).__name__,
    )
    handle = Handle(client, session, manifest.model_id, device, resident=resident)
    for gname, ms in members.items():
        group, slot = session.group_index(gname), 0
        for name, m in ms:
            state = _Streamed(handle, m, name, group, m.bias is not None, slot)
            slot += 2 if m.bias is not None else 1
            handle.streamed[name] = state
            # Placeholders keep shape and dtype for code that inspects them, and fail loudly
            # if anything computes with them instead of going through the module's forward.
            m.weight = nn.Parameter(torch.empty_like(m.weight, device="meta"), requires_grad=False)
            if m.bias is not None:
                m.bias = nn.Parameter(torch.empty_like(m.bias, device="meta"), requires_grad=False)
            m.forward = functools.partial(_streamed_forward, state)
    handle._pin_resident()
    del tensors
    for name, m in module.named_modules():
        if name in handle.streamed:
            continue
        for pname, p in m.named_parameters(recurse=False):
            if p.device != device:
                setattr(m, pname, nn.Parameter(p.data.to(device), requires_grad=p.requires_grad))
        for bname, b in m.named_buffers(recurse=False):
            if b is not None and b.device != device:
                m.register_buffer(bname, b.to(device))
    return handle


def _match(client: Client, model_id: str, tensors: dict[str, torch.Tensor]):
    """The daemon's loaded model, checked against the module's weights (names and shapes)."""
    listed = {m.model_id: m for m in client.list_models().models}
    if model_id not in listed:
        raise ValueError(f"model={model_id!r}: the daemon has no such model")
    manifest = listed[model_id]
    have = {t.name: t for t in manifest.tensors}
    for name, t in tensors.items():
        info = have.get(name)
        if info is None:
            raise ValueError(f"model={model_id!r} has no tensor {name!r}")
        if list(info.shape) != list(t.shape):
            raise ValueError(
                f"model={model_id!r}: tensor {name!r} has shape {list(info.shape)}, "
                f"the module's is {list(t.shape)}"
            )
    warnings.warn(
        "attach(model=...): streaming the daemon's copy; the module's own weights are freed",
        stacklevel=3,
    )
    return manifest
