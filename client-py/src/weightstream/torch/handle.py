"""``Handle``: what ``attach`` returns. It holds the group tickets the streamed layers share
(one acquire per group and pass), records the first step's plan and keeps the lookahead along
it (or, for passes under ``no_grad``, along the forward plan: ``passes``), pins the resident
groups, and puts everything back in ``detach`` (or only closes the session in ``close``)."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch
from torch import nn

from weightstream import _fused_dequant, quantize
from weightstream.client import Client
from weightstream.errors import SessionFault
from weightstream.quantize import Fp8Weight
from weightstream.session import Session, group_specs
from weightstream.torch import budget, compute8, compute_plan, hooks, ops, packed, passes, policy
from weightstream.torch.hooks import HookRegistry
from weightstream.torch.options import StreamOptions
from weightstream.torch.torchao_weights import Rebuild

#: ``dequantize="auto"``: a group's 8-bit weights are dequantized together where, dequantized,
#: they take at most this: FLUX.1's blocks (0.63 GiB in bf16) do; FLUX.2's (0.9–1.8 GiB), which
#: a 24 GB card's trainer would hold at once, stay one layer at a time.
GROUP_DEQUANTIZE_MAX_BYTES = 768 << 20


@dataclass(eq=False)
class StreamedLayer:
    """A streamed layer: what its forward needs (``ops.Layer``)."""

    handle: Handle
    module: nn.Module
    name: str
    group: int
    has_bias: bool
    #: Index of the layer's weight among its group's tensors (the bias follows it).
    slot: int = 0
    #: The weight's dtype in the trainer: what an 8-bit weight is dequantized to.
    dtype: torch.dtype | None = None
    #: (weight, bias) views of a resident group, valid for the session's life; else None.
    pinned: tuple | None = None
    #: ``pinned`` when the op may run on it and autograd may keep it (not an 8-bit weight,
    #: which is dequantized per call); else None.
    fixed: tuple | None = None
    #: A torchao weight streamed as it is: what makes it again (``detach``); else None.
    rebuild: Rebuild | None = None
    #: Whether its dequantization's memory is in the handle's peaks (``_dequantized``).
    counted: bool = False
    #: Whether its 8-bit weight is dequantized with its group's (``StreamOptions.dequantize``:
    #: ``Handle._choose_dequantize``).
    by_group: bool = False
    #: ``StreamOptions.compute`` in 8 bits: how this layer computes so (its weight is then a
    #: ``compute8.W8Weight`` from the views); None where it computes in the trainer's dtype.
    compute8: compute_plan.Layer8 | None = None
    #: A layer of an 8-bit compute session that computes in the trainer's dtype; else None.
    compute_fallback: compute_plan.Fallback | None = None
    #: A packed layer (``packed.Packed``): its views are its inner tensors, and ``views``
    #: gives its rebuilt state (``packed.State``) in place of a weight; else None.
    packed: packed.Packed | None = None

    @property
    def input_grad(self) -> str:
        return self.handle.options.input_grad

    def weights(self, training: bool) -> tuple:
        """The (weight, bias) this pass computes with: the views, or for an 8-bit weight its
        dequantization (a new tensor per call, freed when the op is done with it; where
        ``by_group``, the group's, kept while the group is held, or for a resident group while
        this pass runs it; the bias then a copy where the group gave its ticket back early).
        A layer in 8-bit compute gets its ``compute8.W8Weight``: the views, not dequantized."""
        handle = self.handle
        if self.compute8 is not None:
            if self.pinned is not None:
                weight, bias = self.pinned
            else:
                weight, bias = self.views(handle._acquire(self, training).ticket)
            return self.compute8.weight(weight), bias
        if self.pinned is not None:
            if self.by_group:
                return handle._from_resident_group(self), self.pinned[1]
            return handle._dequantized(self, self.pinned)
        held = handle._acquire(self, training)
        if self.by_group:
            return handle._from_group(self, held)
        return handle._dequantized(self, self.views(held.ticket))

    def views(self, ticket) -> tuple:
        """The layer's (weight, bias) views in its group's ticket."""
        t, i = ticket.tensors, self.slot
        if self.packed is not None:
            return self.packed.views(t, i)
        return t[i], t[i + 1] if self.has_bias else None


@dataclass
class _Held:
    """The group ticket a block's layers share while they run (``Handle._resident_held``)."""

    group: int
    ticket: object
    backward: bool | None
    #: A group whose layers dequantize by group: layer name -> its dequantized weight, made at
    #: the group's first 8-bit layer call under this ticket (``Handle._from_group``).
    dequantized: dict | None = None
    #: With ``dequantized``: layer name -> its bias, a view of the ticket, or of a copy where
    #: the ticket was given back early (``StreamOptions.early_release``).
    biases: dict | None = None
    #: The ticket was given back once the group was dequantized: nothing reads it any more,
    #: and ``Handle`` drops this ``_Held`` with its dequantizations.
    released: bool = False


@dataclass
class Handle:
    """What ``attach`` returns: statistics, plan control, and ``detach``."""

    client: Client
    session: Session
    model_id: str
    device: torch.device
    options: StreamOptions = field(default_factory=StreamOptions)
    streamed: dict[str, StreamedLayer] = field(default_factory=dict)
    #: Layers kept on the device: name -> why (``policy.REASONS``).
    resident: dict[str, str] = field(default_factory=dict)
    #: The session's device budget (``attach``'s ``vram_budget``, then ``set_budget``'s).
    vram_budget: int = 0
    #: The first step's acquisitions while it runs; None once the plan is sent.
    _recording: policy.PlanRecorder | None = field(default_factory=policy.PlanRecorder)
    #: The training and forward plans, the one in force, counters per kind (``passes``).
    _passes: passes.Passes | None = None
    _pass_hooks: list = field(default_factory=list)
    _lookahead: policy.Lookahead | None = None
    #: The plan's first group: acquiring it outside a backward pass starts a step (for the
    #: per-step waits); None until the plan is sent.
    _step_start: int | None = None
    _held: _Held | None = None
    _pinned: list = field(default_factory=list)
    _hooks: HookRegistry = field(default_factory=HookRegistry)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: ``vram_budget="auto"``: the policy, and the hooks on the attached module that find
    #: each step's start (``budget``).
    _auto: budget.AutoBudget | None = None
    _auto_armed: bool = False
    _auto_hooks: list = field(default_factory=list)
    #: Where ``attach`` spent its time, in seconds: ``total_s``; ``model_s`` (uploading the
    #: weights, or finding the model named by ``model=``); ``open_session_s`` (the daemon
    #: allocating the budget and copying the resident groups); for an upload its phases as
    #: ``upload_<key>`` (``Client.upload_model``'s ``phases``: the client's write and the
    #: daemon's commit). ``stats()`` has them as ``attach_<key>``.
    attach_phases: dict = field(default_factory=dict)
    #: ``attach(..., trainable="host")``: the trainable weights held in host memory
    #: (``trainable.Trainable``); closed by ``detach`` and ``close`` before the session.
    trainable: object = None
    #: See ``stats``.
    _dequant_peak: int = 0
    _dequant_scratch_peak: int = 0
    #: The groups that dequantize together -> their layers with an 8-bit weight (``by_group``),
    #: in the order they were attached, per the dtype they dequantize to, each with the
    #: launch's plan (``(layers, quantize.GroupDequantizer)``: ``_choose_dequantize``); the
    #: groups whose dequantization is in the peaks (the same at every pass, so counted once).
    _layers_by_group: dict = field(default_factory=dict)
    _groups_counted: set = field(default_factory=set)
    #: ``early_release``: the groups whose every streamed layer dequantizes by group, which
    #: give their ticket back once dequantized (``_from_group``).
    _early_release: frozenset = frozenset()
    #: The resident group whose layers dequantize by group that runs now: its dequantizations,
    #: kept until another resident group, or the next pass, needs its own. One group's
    #: dequantizations are kept at a time, streamed or resident (``_keep_dequantized``).
    _resident_held: _Held | None = None
    #: ``StreamOptions.compute``: the layers that compute in 8 bits, those that fall back, and
    #: their counters (``compute_plan.Plan``).
    _compute: compute_plan.Plan = field(default_factory=compute_plan.Plan)

    def __post_init__(self):
        if self._passes is None:  # the module order, resident groups too: a budget may change
            self._passes = passes.Passes(list(range(len(self.session.groups))))

    # --- used by the streamed layers ----------------------------------------------------

    def _dequantized(self, layer: StreamedLayer, views: tuple) -> tuple:
        """The (weight, bias) the layer's op takes: the views; an 8-bit weight dequantized to
        the layer's dtype; or, in a format of ``quantize.OWN_LINEAR``, the 8-bit weight with
        that dtype, for the op to compute its library's linear (``quantize.linear_as``)."""
        weight, bias = views
        if not isinstance(weight, Fp8Weight):
            return views
        if not layer.counted:
            # What the dequantization holds (the int8 linear's cast of q is counted alike):
            # the same at every call of the layer, so counted at its first.
            numel = weight.data.numel()
            size = numel * layer.dtype.itemsize
            # The torch path forms the product in a float32 copy; the fused kernel writes w
            # only, and the int8 linear forms no product.
            fused = weight.format in (
                quantize.FP8_E4M3_BLOCK64,
                quantize.TORCHAO_FLOAT8_ROWWISE,
            ) and _fused_dequant.applies(weight.data, weight.scale, layer.dtype)
            int8 = weight.format == quantize.TORCHAO_INT8_ROWWISE
            product = 0 if fused or int8 or layer.dtype == torch.float32 else numel * 4
            self._dequant_peak = max(self._dequant_peak, size)
            self._dequant_scratch_peak = max(self._dequant_scratch_peak, size + product)
            layer.counted = True
        if weight.format in quantize.OWN_LINEAR:
            return weight._replace(dtype=layer.dtype), bias
        return quantize.dequantize_weight(weight, layer.dtype), bias

    def _choose_dequantize(self):
        """Marks the layers whose 8-bit weight (not of a format with its own linear,
        ``quantize.OWN_LINEAR``) is dequantized with its group's (``by_group``): with
        ``dequantize="group"`` every such layer; with ``"auto"`` those of a group whose such
        weights take, dequantized, at most ``GROUP_DEQUANTIZE_MAX_BYTES``."""
        if self.options.dequantize == "layer":
            return
        by_group: dict[int, list[tuple[StreamedLayer, int]]] = {}
        for layer in self.streamed.values():
            t = self.session.groups[layer.group].tensors[layer.slot]
            if t.quantization in quantize.FORMATS and t.quantization not in quantize.OWN_LINEAR:
                size = math.prod(t.shape) * layer.dtype.itemsize
                by_group.setdefault(layer.group, []).append((layer, size))
        for group, members in by_group.items():
            size = sum(size for _, size in members)
            if self.options.dequantize == "group" or size <= GROUP_DEQUANTIZE_MAX_BYTES:
                by_dtype: dict[torch.dtype, list[StreamedLayer]] = {}
                for layer, _ in members:
                    layer.by_group = True
                    by_dtype.setdefault(layer.dtype, []).append(layer)
                self._layers_by_group[group] = [
                    (layers, quantize.GroupDequantizer(dtype)) for dtype, layers in by_dtype.items()
                ]
        if self.options.early_release:
            whole: dict[int, bool] = {}
            for layer in self.streamed.values():
                whole[layer.group] = whole.get(layer.group, True) and layer.by_group
            self._early_release = frozenset(g for g, all_by_group in whole.items() if all_by_group)

    def _from_group(self, layer: StreamedLayer, held: _Held) -> tuple:
        """A ``by_group`` layer's (weight, bias): its dequantized weight from the held group's
        dequantizations, made for every such weight of the group at the first call
        (``quantize.GroupDequantizer``: one launch where the fused kernel can take them all),
        and its bias. With ``early_release`` (``_early_release``) the group's biases are
        copied at that call too and the ticket is given back."""
        if held.dequantized is None:
            self._keep_dequantized(held)
            ticket = held.ticket
            views = {
                x.name: x.views(ticket)
                for layers, _ in self._layers_by_group[held.group]
                for x in layers
            }
            held.dequantized = self._dequantize_group(held.group, lambda x: views[x.name][0])
            biases = {name: bias for name, (_, bias) in views.items() if bias is not None}
            if held.group in self._early_release:
                biases = _copied(biases)
                # Its dequantization and bias copy are queued (the ticket's free event follows
                # them on the stream): it stays the held group of the pass for its other
                # layers, which read only those.
                self._release(held)
            held.biases = biases
        return held.dequantized[layer.name], held.biases.get(layer.name)

    def _release(self, held: _Held | None):
        """Gives ``held``'s ticket back, once: not again where it went back early."""
        if held is not None and not held.released:
            held.released = True
            self.session.release(held.ticket)

    def _from_resident_group(self, layer: StreamedLayer) -> torch.Tensor:
        """A ``by_group`` layer of a resident group: its dequantized weight from the group's
        dequantizations for this pass, made at the pass's first call of the group."""
        backward = ops.in_backward()
        with self._lock:
            held = self._resident_held
        if held is None or held.group != layer.group or held.backward != backward:
            held = _Held(layer.group, None, backward)
            self._keep_dequantized(held)
            held.dequantized = self._dequantize_group(layer.group, lambda x: x.pinned[0])
            with self._lock:
                self._resident_held = held
        return held.dequantized[layer.name]

    def _keep_dequantized(self, held: _Held):
        """Before ``held``'s group dequantizes: drops the dequantizations kept for another
        group (a resident one's, and the held streamed group's unless it is ``held``), so that
        one group's are kept at a time; a group used again in the same pass dequantizes again."""
        with self._lock:
            if self._resident_held is not held:
                self._resident_held = None
            if self._held is not None and self._held is not held:
                self._held.dequantized = self._held.biases = None
                if self._held.released:
                    # Its ticket is gone: a later call of the group acquires it again.
                    self._held = None

    def _dequantize_group(self, group: int, weight_of) -> dict:
        """The dequantized weights of ``group``'s ``by_group`` layers (``weight_of(layer)``:
        the layer's 8-bit weight), by layer name."""
        out = {}
        for layers, dequantize in self._layers_by_group[group]:
            weights = dequantize([weight_of(layer) for layer in layers])
            out.update(zip([layer.name for layer in layers], weights, strict=True))
        if group not in self._groups_counted:
            self._groups_counted.add(group)
            # Every weight of the group is held at once, and one torch-path product at a time.
            size = sum(w.numel() * w.element_size() for w in out.values())
            product = max(
                (
                    weight.data.numel() * 4
                    for layers, _ in self._layers_by_group[group]
                    for layer, weight in zip(layers, map(weight_of, layers), strict=True)
                    if layer.dtype != torch.float32
                    and not _fused_dequant.applies(weight.data, weight.scale, layer.dtype)
                ),
                default=0,
            )
            self._dequant_peak = max(self._dequant_peak, size)
            self._dequant_scratch_peak = max(self._dequant_scratch_peak, size + product)
        return out

    def _acquire(self, layer: StreamedLayer, training: bool) -> _Held:
        """The layer's group held for this pass: the held ticket when it serves this pass, else
        a new acquire (the held ticket is given back first)."""
        backward = ops.in_backward()
        kind, p = passes.kind_of(training), self._passes
        p.check(kind)
        with self._lock:
            held = self._held
            if held is not None and held.group == layer.group and held.backward == backward:
                return held
            self._held = None
        self._release(held)
        if training and self._recording is not None:
            if self._recording.add(layer.group, backward):
                self.end_step()
                p.counters[passes.TRAIN].passes += 1
        elif training and backward is False and layer.group == self._step_start:
            self.session.mark_step()
            p.counters[passes.TRAIN].passes += 1
        elif not training and p.record_sample(layer.group, self._resident_groups):
            if p.kind == passes.SAMPLE:
                self._install(p.forward, layer.group)  # the pass as it ran, from now on
        if p.kind != kind:
            self._switch(kind, layer.group)
        with self._lock:
            ahead = self._lookahead
            number = ahead.take(layer.group) if ahead else self.session.submit(layer.group)
        p.count(kind, ahead is not None and ahead.hit, ahead is not None and ahead.off_plan)
        try:
            ticket = self.session.wait(number)
        except SessionFault as e:
            if ahead is None or e.code != "FAULT_RESOURCE_EXHAUSTED":
                raise
            # A lookahead acquire found the arena full of tickets still in use: ask again
            # now that they are released, without lookahead in the way.
            with self._lock:
                ahead.drain()
                number = self.session.submit(layer.group)
            ticket = self.session.wait(number)
        held = _Held(layer.group, ticket, backward)
        with self._lock:
            self._held = held
        return held

    def _release_held(self):
        with self._lock:
            held, self._held = self._held, None
        self._release(held)

    def _give_back(self, number: int):
        try:
            self.session.release(self.session.wait(number))
        except SessionFault:
            pass  # refused (arena full): nothing to give back

    def _resident_groups(self) -> frozenset[int]:
        return frozenset(i for i, g in enumerate(self.session.groups) if g.resident)

    def _saw_resident(self, group: int):  # a resident layer ran: record the first sampling pass
        p = self._passes
        if not torch.is_grad_enabled() and p.record_sample(group, self._resident_groups, False):
            if p.kind == passes.SAMPLE:  # from the streamed group next, as it ran
                self._follow_forward(p.forward.index(group))

    def _follow_forward(self, after: int):
        """The forward plan in force from its first streamed group after ``after`` (-1: all)."""
        plan = self._passes.forward
        self._install(plan, passes.next_streamed(plan, after, self._resident_groups()))

    def _switch(self, kind: str, group: int):
        """A pass of ``kind`` begins at an acquire of ``group``: its plan comes in force. The
        waits so far go to the kind that ends (on CUDA, once the device measured them)."""
        p = self._passes
        p.attribute_waits(self.session, settle=p.kind is not None)
        p.begin(kind, self.session)
        self._install(p.plan_of(kind), group)

    def _install(self, plan: list[int] | None, group: int | None = None):
        """Sends ``plan`` to the daemon (an empty one while the training plan is recorded:
        none, as before any plan) and follows it with a new lookahead, which keeps the
        acquires in flight that it uses next from ``group`` on (``Lookahead.adopt``)."""
        p, plan = self._passes, list(plan or [])
        if plan != (p.sent or []):
            self.session.plan(plan)
            p.sent = plan
        with self._lock:
            old, self._lookahead = self._lookahead, None
        # Groups resident since the plan was recorded (set_budget with keep_plan) are not
        # acquired per step: the lookahead follows the streamed ones (the daemon skips them).
        groups = self.session.groups
        plan = [g for g in plan if not groups[g].resident]
        new = None
        if self.options.lookahead != 0 and plan:
            new = policy.Lookahead(
                plan,
                [g.nbytes for g in groups],
                self.session.opened.staging_bytes,
                self.session.submit,
                self._give_back,
                self.options.lookahead,
            )
        if old is not None:
            if new is not None and group is not None:
                new.adopt(old, group)
            else:
                old.drain()
        with self._lock:
            self._lookahead = new

    def _pin_resident(self):
        """Acquires each resident group once for the session's life: its layers then run
        their own operation on the views, with no acquire, Function or message per call."""
        by_group: dict[int, list[StreamedLayer]] = {}
        for layer in self.streamed.values():
            by_group.setdefault(layer.group, []).append(layer)
        for group, layers in by_group.items():
            if not self.session.groups[group].resident:
                continue
            ticket = self.session.acquire(group)
            self._pinned.append(ticket)
            for layer in layers:
                layer.pinned = layer.views(ticket)
                if layer.compute8 is not None:
                    # The 8-bit op saves no activation, and the views outlive any pass.
                    layer.fixed = layer.weights(False)
                    continue
                quantized = isinstance(layer.pinned[0], Fp8Weight)
                layer.fixed = None if quantized else layer.pinned

    def _unpin(self, release: bool = True):
        """Drops the resident views; gives their tickets back unless the session is gone."""
        for layer in self.streamed.values():
            layer.pinned = layer.fixed = None
        with self._lock:
            self._resident_held = None
        pinned, self._pinned = self._pinned, []
        for ticket in pinned if release else ():
            self.session.release(ticket)

    def _drop_lookahead(self):
        self._release_held()
        with self._lock:
            if self._lookahead is not None:
                self._lookahead.drain()
            self._lookahead = None

    # --- public ------------------------------------------------------------------------

    def end_step(self):
        """Marks the end of the first training step explicitly (attach also detects it): its
        acquisitions are sent as the plan, and later steps are prefetched along it."""
        if self._recording is not None and self._recording.groups:
            plan = self._recording.groups
            self._passes.train = list(plan)
            self._recording = None
            if self._passes.kind != passes.SAMPLE:
                self._passes.kind = passes.TRAIN
                self._install(plan)
            self._step_start = plan[0]
            self.session.mark_step()
            if self._auto is not None:
                self._auto_grow()
        self._recording = None

    def set_budget(self, vram_budget: int, staging_bytes: int = 0, keep_plan: bool = False):
        """Reopens the session with another device budget (same model, same groups); the plan
        is recorded again from the next step, or with ``keep_plan`` the plan sent so far is
        sent to the new session (call it between steps: views of the old session die). The
        forward plan (``passes``) is kept either way."""
        keep = keep_plan and self._recording is None
        self._passes.attribute_waits(self.session)
        self._drop_lookahead()
        self._unpin()
        old = self.session
        old.close()
        self.session = self.client.open_session(
            self.model_id,
            group_specs(old.groups),
            vram_budget,
            staging_bytes=staging_bytes,
            device=self.device,
            label=old.label,
        )
        self.vram_budget = vram_budget
        p = self._passes
        p.reopened()
        p.sent = None
        self._pin_resident()
        if not keep:
            p.train = None
            self._recording = policy.PlanRecorder()
            self._step_start = None
        if p.kind is not None:
            self._install(p.plan_of(p.kind))
        # Between steps: the next pass's first acquires go in flight now, not missed at it (a
        # training step's plan adopts them where they are its own next).
        with self._lock:
            if self._lookahead is not None:
                self._lookahead.top_up()
        if self._auto is not None:
            self._auto.budget = vram_budget
            self._auto.staging = self.session.opened.staging_bytes

    def sampling(self):
        """A context for sampling passes between training steps (``with handle.sampling():
        pipe(...)``), the session grown to ``StreamOptions.sample_vram_budget`` inside
        (``passes.sampling``)."""
        return passes.sampling(self)

    def _enter_pass(self, module, args):
        self._passes.enter(passes.kind_of(torch.is_grad_enabled()))

    def _leave_pass(self, module, args, output):
        p = self._passes  # a first sampling pass ends: as it ran, from the next one's start
        ended = p.leave() and p.end_sample_pass(self._resident_groups, output is not None)
        if ended and p.kind == passes.SAMPLE:  # (torch passes None where the forward raised)
            self._follow_forward(-1)

    def _remove_pass_hooks(self):
        for h in self._pass_hooks:
            h.remove()
        self._pass_hooks = []

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
        self.session.reconnect(restore=restore, timeout=timeout)  # sends the plan sent last
        self.model_id = self.session.model_id
        self._passes.reopened()
        self._pin_resident()
        if self._recording is not None:
            self._recording = policy.PlanRecorder()
        if self._passes.kind is not None:
            self._install(self._passes.plan_of(self._passes.kind))

    def stats(self) -> dict:
        """The daemon's counters of the session (none when it does not list it); the time the
        trainer's compute waited for weights, as this client measures it (on CUDA, on the
        compute stream): ``gpu_wait_ns`` (more current than the daemon's copy, which follows
        within 250 ms of a release), ``gpu_waits`` (the waits it sums),
        ``gpu_wait_by_group`` (group name -> ns), ``gpu_wait_ns_per_step`` (each completed
        step's, oldest first, the last 1024; a step starts when the plan's first group is
        acquired outside a backward pass) and ``gpu_wait_ns_this_step``, all since the session
        was opened (``set_budget`` and ``reconnect`` open it again); ``reply_wait_ns``,
        ``reply_waits`` and ``reply_wait_by_group`` (group name -> ns), the time the
        trainer's thread blocked for the daemon's reply to an
        acquire (``Session.reply_wait``: on CUDA the host issues nothing meanwhile, which the
        device's wait misses while earlier work keeps it busy); ``acquire_pending_ns`` is
        the daemon's time with an acquire pending, look-ahead ones included, which is not a
        wait of the trainer. The trainer's side of 8-bit streaming: ``dequant_by_group``, the
        names of the groups whose 8-bit weights are dequantized together
        (``StreamOptions.dequantize``), ``dequant_peak_bytes``, the largest dequantization
        held so far (a weight's, or such a group's weights), and
        ``dequant_scratch_peak_bytes``, the most device memory one dequantization held at once
        (that and, below float32, the float32 product); with ``vram_budget="auto"`` the
        policy's decisions (``auto_*``: ``AutoBudget.stats``); where ``attach`` spent its
        time (``attach_*``: ``attach_phases``); with ``trainable="host"``, the host bytes of
        the trainable state (``trainable_host_bytes``) and where its path waited, in seconds
        since attach (``trainable_*_s``: ``Trainable.times``); with 8-bit compute
        (``StreamOptions.compute``), ``compute_*`` (``_compute_stats``). Sampling passes
        (under ``no_grad``) and training passes apart (``passes``): ``train_*`` and
        ``sample_*`` (``KindCounters``: acquires, hits, hit rate, acquires off the plan,
        passes, and the waits above while that kind's plan was in force), ``pass_kind``, and
        ``forward_plan_length``/``_recorded``, ``sampling()``'s ``sampling_segments_*``;
        ``packed_formats``, each packed format streamed (``packed``) -> its layers, bytes, bytes
        and bits per weight (``packed.summary``); ``decoded_bytes``, the bytes decoded from
        coded groups (``StreamOptions.coding``)."""
        out = {} if self._auto is None else self._auto.stats()
        self._passes.attribute_waits(self.session)
        out.update(self._passes.stats())
        out.update({f"attach_{k}": v for k, v in self.attach_phases.items()})
        s = self.session.stats()
        if s is not None:
            out.update({f.name: getattr(s, f.name) for f in s.DESCRIPTOR.fields})
            # Plain values (the stats are pickled, logged, compared): per kind, a dict.
            out["kinds"] = {
                k.kind: {f.name: getattr(k, f.name) for f in k.DESCRIPTOR.fields} for k in s.kinds
            }
            out["hit_rate"] = s.hits / s.acquires if s.acquires else 0.0
        waits = self.session.gpu_wait()
        out["gpu_wait_ns"] = waits.total_ns
        out["gpu_waits"] = waits.waits
        out["gpu_wait_by_group"] = {
            g.name: ns for g, ns in zip(self.session.groups, waits.by_group, strict=True)
        }
        out["gpu_wait_ns_per_step"] = list(waits.per_step)
        out["gpu_wait_ns_this_step"] = waits.this_step
        replies = self.session.reply_wait()
        out["reply_wait_ns"], out["reply_waits"] = replies.total_ns, replies.waits
        out["reply_wait_by_group"] = {
            g.name: ns for g, ns in zip(self.session.groups, replies.by_group, strict=True)
        }
        groups = self.session.groups
        out["dequant_by_group"] = [groups[g].name for g in sorted(self._layers_by_group)]
        out["dequant_peak_bytes"] = self._dequant_peak
        out["dequant_scratch_peak_bytes"] = self._dequant_scratch_peak
        out["packed_formats"] = packed.summary(self.streamed.values())
        out["decoded_bytes"] = self.session.decoded_bytes
        if self._compute.mode is not None:
            out.update(self._compute_stats())
        if self.trainable is not None:
            out["trainable_host_bytes"] = self.trainable.host_bytes
            out.update({f"trainable_{k}": v for k, v in self.trainable.times.items()})
        return out

    def _compute_stats(self) -> dict:
        """``StreamOptions.compute`` in 8 bits (``stats``): ``compute``, the mode;
        ``compute_gemm8``, the 8-bit matmuls run (forward and input gradient);
        ``compute_fallbacks``, reason -> the calls of layers that computed in the trainer's
        dtype for it; ``compute_fallback_layers``, layer name -> its reason."""
        plan = self._compute
        by_reason: dict[str, int] = {}
        for (_, reason), calls in plan.stats.fallbacks.items():
            by_reason[reason] = by_reason.get(reason, 0) + calls
        return {
            "compute": plan.mode,
            "compute_gemm8": plan.stats.gemm8,
            "compute_fallbacks": by_reason,
            "compute_fallback_layers": dict(plan.fallbacks),
        }

    # --- vram_budget="auto" -------------------------------------------------------------

    def _auto_attach(self, module: nn.Module, auto: budget.AutoBudget):
        """Hooks the attached module: its forward's start is a step's start once a backward
        pass reached its output (then no graph holds views of the session: it may reopen)."""
        self._auto = auto
        self._auto_hooks = [
            module.register_forward_pre_hook(self._auto_step_start),
            module.register_forward_hook(self._auto_arm_on_backward),
        ]
        auto.start()

    def _auto_arm_on_backward(self, module, args, output):
        t = hooks.first_grad_tensor(output)
        if t is not None:
            t.register_hook(self._auto_arm)

    def _auto_arm(self, grad):
        self._auto_armed = True

    def _auto_step_start(self, module, args):
        if not self._auto_armed:
            return
        self._auto_armed = False
        rec = self._recording
        if rec is not None:
            if rec.groups and rec.seen_backward:
                self.end_step()  # the first step is over: its plan, then the growth
            return
        self.check_budget()

    def _auto_probe(self):
        free, total = self._auto.probe()
        return free, total, self._auto.trainer_probe()

    def _auto_grow(self):
        """After the first step's plan was sent: grows the session to what the device has
        left (``AutoBudget.grow``), keeping the plan."""
        free, total, trainer = self._auto_probe()
        current = self._auto.budget
        decision = self._auto.grow(free, total, trainer, current)
        if decision.budget > current:
            self.set_budget(decision.budget, decision.staging, keep_plan=True)

    def check_budget(self):
        """With ``vram_budget="auto"``: shrinks the session if the device's free memory fell
        under half the margin, grows it back when room came back (``AutoBudget.check``), or
        raises ``AutoBudgetError``. Runs by itself at the start of each step; call it between
        steps only (a step's graph may hold views of the session)."""
        if self._auto is None or self._recording is not None:
            return
        free, total, trainer = self._auto_probe()
        current = self._auto.budget
        decision = self._auto.check(free, total, trainer, current)
        if decision is not None and decision.budget != current:
            self.set_budget(decision.budget, decision.staging, keep_plan=True)

    def _auto_detach(self):
        for h in self._auto_hooks:
            h.remove()
        self._auto_hooks = []

    def _close_trainable(self, device):
        """The trainable weights back as ordinary parameters on ``device``, before the session
        (which holds their host memory) closes."""
        if self.trainable is not None:
            self.trainable.close(device=device)
            self.trainable = None

    def detach(self, release: bool = False, device: torch.device | str | None = None):
        """Puts the weights back into the layers (on ``device``, by default the session's;
        an 8-bit weight comes back dequantized, as the layer computed with it, and a torchao
        weight as torchao's tensor again),
        removes weightstream's forwards (what other libraries installed stays) and closes the
        session; with ``release``, also drops this handle's reference to the daemon's copy (it
        goes when no other session uses it)."""
        device = self.device if device is None else torch.device(device)
        self._close_trainable(device)
        self._auto_detach()
        self._remove_pass_hooks()
        self._drop_lookahead()
        self._unpin()
        for name, layer in self.streamed.items():
            ticket = self.session.acquire(layer.group)
            weight, bias = layer.views(ticket)
            if layer.packed is not None:  # the quantizer's state again, as it was attached
                layer.packed.restore(layer.module, weight, device)
                weight = None
            elif layer.rebuild is not None:  # torchao's tensor again, as it was attached
                weight = layer.rebuild(
                    weight.data.to(device, copy=True), weight.scale.to(device, copy=True)
                )
            elif layer.compute8 is not None:
                weight = compute8.dequantize(layer.compute8.weight(weight), layer.dtype)
                weight = weight.to(device, copy=True)
            else:
                weight, _ = self._dequantized(layer, (weight, bias))
                weight = weight.to(device, copy=True)
            bias = bias.to(device, copy=True) if bias is not None else None
            self.session.release(ticket)
            self._hooks.remove(name)
            m = layer.module
            if weight is not None:
                m.weight = nn.Parameter(weight, requires_grad=False)
            if layer.has_bias:
                m.bias = nn.Parameter(bias, requires_grad=False)
        self.streamed.clear()
        self.session.close()
        if release:
            self.client.release_model(self.model_id)

    def close(self, release: bool = False):
        """Closes the session without giving the weights back, for a module that is being
        discarded: weightstream's forwards come out, and the streamed layers keep their
        placeholders (they cannot run any more). With ``release``, also drops this handle's
        reference to the daemon's copy."""
        self._close_trainable("cpu")
        self._auto_detach()
        self._remove_pass_hooks()
        self._drop_lookahead()
        self._unpin()
        self._hooks.remove_all()
        self.streamed.clear()
        self.session.close()
        if release:
            self.client.release_model(self.model_id)


def _copied(tensors: dict) -> dict:
    """Copies of ``tensors`` (a group's biases, by layer name): one kernel where all are 1-D of
    one dtype on one device, else one per tensor."""
    values = list(tensors.values())
    if not values:
        return {}
    first = values[0]
    if all(t.dim() == 1 and t.dtype == first.dtype and t.device == first.device for t in values):
        parts = torch.cat(values).split([t.numel() for t in values])
    else:
        parts = [t.clone() for t in values]
    return dict(zip(tensors, parts, strict=True))
