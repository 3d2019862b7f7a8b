"""The two kinds of pass a ``Handle`` serves, and the plan each follows.

A *training* pass (grad enabled) follows the training plan: the first step's acquisitions
(forward, recompute, backward; ``policy.PlanRecorder``). A *sampling* pass (under ``no_grad``
or ``inference_mode``: a trainer's samples, or inference) follows the *forward plan*: before
any such pass completes, the groups in the order their layers are registered (what a forward
of most models walks; resident ones too, which a later budget may stream), then the first
sampling pass as it ran (it ends when its first group is acquired again; the groups resident
in its session, which it did not acquire, keep their places). Both plans are cyclic: the
lookahead wraps from the last group to the first, so consecutive denoising steps (and
classifier-free guidance's two passes, or its batch of two) stream without a miss. Sampling
passes are never recorded into the training plan.

``Passes`` keeps both plans, says which one is in force (the client's ``policy.Lookahead``
and the daemon's plan follow one at a time), and counts per kind: acquires, hits (the reply
was already in flight from the lookahead), acquires off the plan in force (served on demand),
and the waits for weights. When a pass of the other kind begins, the handle swaps plans
(``Handle._switch``): the daemon gets the other plan and the kind (``Session.set_pass_kind``:
its ``SessionStats.kinds`` and ``weightstream top`` split their figures by kind), and the
acquires in flight that the new plan uses next are kept, the rest given back.

Sampling in one thread while another thread trains on the same handle would share its group
tickets: ``enter``/``check`` raise ``ConcurrentPasses`` instead.

``sampling(handle)`` is ``Handle.sampling()``: the session grown to
``StreamOptions.sample_vram_budget`` for the passes inside, given back after; with
``sample_vram_budget="auto"`` (``AutoSample``), to what the device has free then, less what
the trainer's own sampling passes took the first time and a margin.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields

from weightstream.errors import WeightstreamError
from weightstream.session import device_uuid, group_specs
from weightstream.sizes import size_text
from weightstream.torch import budget as auto_budget
from weightstream.torch.policy import STAGED_GROUPS

TRAIN, SAMPLE = "train", "sample"
KINDS = (TRAIN, SAMPLE)


class ConcurrentPasses(WeightstreamError):
    """A sampling pass and a training pass ran at once in two threads on one handle."""


class SampleBudgetError(WeightstreamError, ValueError):
    """``sample_vram_budget`` is more than the device has or the daemon allows."""


def kind_of(training: bool) -> str:
    return TRAIN if training else SAMPLE


@dataclass
class KindCounters:
    """One kind's counters (``Handle.stats()``: ``<kind>_<field>``)."""

    #: Acquires of a streamed group by a layer of this kind of pass.
    acquires: int = 0
    #: Of those, the ones whose reply was already in flight from the lookahead.
    hits: int = 0
    #: Of those, the ones of a group not in the plan in force (served on demand).
    off_plan: int = 0
    #: Sampling: passes begun (the forward plan's first group acquired); training: steps
    #: begun after the first (the training plan's first group acquired outside backward).
    passes: int = 0
    #: The waits for weights measured (``Session.gpu_wait``, ``Session.reply_wait``) while
    #: this kind's plan was in force.
    gpu_wait_ns: int = 0
    gpu_waits: int = 0
    reply_wait_ns: int = 0
    reply_waits: int = 0

    def stats(self, kind: str) -> dict:
        out = {f"{kind}_{f.name}": getattr(self, f.name) for f in fields(self)}
        out[f"{kind}_hit_rate"] = self.hits / self.acquires if self.acquires else 0.0
        return out


class ForwardRecorder:
    """The first sampling pass's acquisitions: complete when the attached module's forward
    that ran it returns (``Passes.end_sample_pass``), or, for passes that do not go through
    that forward, when its first group comes again."""

    def __init__(self):
        self.groups: list[int] = []

    def add(self, group: int, in_pass: bool) -> list[int] | None:
        """Records ``group``; returns the pass once ``group`` starts the next one, unless
        ``in_pass`` (inside the attached module's forward, whose return ends the pass: a pass
        may run a group twice)."""
        if not in_pass and self.groups and group == self.groups[0]:
            return self.groups
        self.groups.append(group)
        return None


def with_resident(recorded: list[int], before: list[int], resident: frozenset[int]) -> list[int]:
    """``recorded`` (a pass's acquires) with the ``resident`` groups of the plan ``before`` it
    put back, each just before the first recorded group that follows it in ``before`` (at the
    end where none does), in ``before``'s order."""
    missing = [g for g in before if g in resident and g not in recorded]
    if not missing:
        return list(recorded)
    place = {g: i for i, g in enumerate(recorded)}
    keys = {g: (i, 1, 0) for i, g in enumerate(recorded)}
    for i, g in enumerate(before):
        if g in missing:
            nxt = next((place[h] for h in before[i + 1 :] if h in place), len(recorded))
            keys[g] = (nxt, 0, i)
    return sorted(keys, key=keys.__getitem__)


def next_streamed(plan: list[int], after: int, resident: frozenset[int]) -> int | None:
    """The first group of ``plan`` not in ``resident`` after position ``after`` (-1: from the
    start), wrapping to the start; None where every group is resident."""
    n = len(plan)
    return next(
        (g for g in (plan[(after + k) % n] for k in range(1, n + 1)) if g not in resident), None
    )


#: What ``_keep_resident`` kept (``stats()["sampling_resident_kept_*"]``), where it kept none.
NOTHING_KEPT = {"groups": 0, "bytes": 0, "staged_groups": 0, "staged_bytes": 0}


class Passes:
    """A handle's plans and counters per kind; ``kind``: whose plan is in force (None before
    the first acquire)."""

    def __init__(self, forward: list[int]):
        #: The forward plan: the module order until the first sampling pass completes.
        self.forward = list(forward)
        #: The training plan once the first step ended; None while it is recorded.
        self.train: list[int] | None = None
        self.kind: str | None = None
        #: The plan the daemon was last sent (None: none yet).
        self.sent: list[int] | None = None
        self.counters = {k: KindCounters() for k in KINDS}
        #: ``sample_vram_budget="auto"``'s policy and what it measured (attach sets it).
        self.auto: AutoSample | None = None
        self._recorder: ForwardRecorder | None = ForwardRecorder()
        #: The forward plan's first streamed group (``first_streamed``), until the plan or the
        #: session changes; ``...``: not known yet.
        self._first: object = ...
        self._seen = (0, 0, 0, 0)
        #: Thread id -> [kind, depth] of the attached module's forwards running in it.
        self._running: dict[int, list] = {}
        self._lock = threading.Lock()
        #: The last ``sampling()`` block's trainer segments: given back, made again, their bytes.
        self.segments = {"given": 0, "made": 0, "made_bytes": 0}
        #: The last ``sampling()`` block's resident groups kept on the device through the
        #: session's reopening at the training budget (``_keep_resident``): groups, bytes.
        self.kept = dict(NOTHING_KEPT)

    def begin(self, kind: str, session):
        """``kind``'s plan comes in force; the daemon counts the session's next acquires, their
        copies and the waits reported from now on under ``kind`` (``SessionStats.kinds``)."""
        self.kind = kind
        session.set_pass_kind(kind)

    def plan_of(self, kind: str) -> list[int] | None:
        return self.train if kind == TRAIN else self.forward

    @property
    def recording(self) -> bool:
        """Whether the first sampling pass is still being recorded."""
        return self._recorder is not None

    def record_sample(
        self,
        group: int,
        resident: Callable[[], frozenset[int]] = frozenset,
        acquired: bool = True,
    ) -> bool:
        """A sampling acquire of ``group`` (``acquired``), or a layer of a resident ``group``
        run in a sampling pass while the first is recorded: counts a pass at an acquire of
        the forward plan's first streamed group, and records the first pass; True when it
        completed just now (``forward`` is the new forward plan). ``resident()``: the
        session's resident groups, which a pass does not acquire: the recorded pass has them
        where their layers ran (a session at another budget, ``Handle.sampling()``'s, may
        stream them), or where none ran, at their places of the plan so far."""
        done = False
        recorder = self._recorder
        if recorder is not None and (acquired or recorder.groups[-1:] != [group]):
            # A resident group once for its layers in a row.
            recorded = recorder.add(group, threading.get_ident() in self._running)
            if recorded is not None:
                done = self._recorded(recorded, resident)
        if acquired and group == self.first_streamed(resident):
            self.counters[SAMPLE].passes += 1
        return done

    def end_sample_pass(self, resident: Callable[[], frozenset[int]], ran: bool = True) -> bool:
        """The attached module's forward of a sampling pass returned (``leave``): the first
        pass, while recorded, is complete; True when it completed just now. One that raised
        (not ``ran``) is dropped: the next pass is recorded from its start."""
        recorder = self._recorder
        if recorder is None or not recorder.groups:
            return False
        if not ran:
            self._recorder = ForwardRecorder()
            return False
        return self._recorded(recorder.groups, resident)

    def _recorded(self, recorded: list[int], resident) -> bool:
        self.forward = with_resident(recorded, self.forward, resident())
        self._recorder, self._first = None, ...
        return True

    def first_streamed(self, resident: Callable[[], frozenset[int]]) -> int | None:
        """The forward plan's first group not in ``resident()``, where a sampling pass is
        counted: worked out once per plan and session, not at every acquire."""
        if self._first is ...:
            self._first = next_streamed(self.forward, -1, resident())
        return self._first

    def count(self, kind: str, hit: bool, off_plan: bool):
        c = self.counters[kind]
        c.acquires += 1
        c.hits += hit
        c.off_plan += off_plan

    # --- the waits, attributed to the kind whose plan was in force ------------------------

    def attribute_waits(self, session, settle: bool = False):
        """Adds the session's waits since the last call to the kind in force (``settle``: on
        CUDA, wait for the timed waits still queued, at a switch of kinds)."""
        gpu = session.gpu_wait(settle=settle)
        reply = session.reply_wait()
        now = (gpu.total_ns, gpu.waits, reply.total_ns, reply.waits)
        if self.kind is not None:
            c = self.counters[self.kind]
            delta = [max(0, a - b) for a, b in zip(now, self._seen, strict=True)]
            c.gpu_wait_ns += delta[0]
            c.gpu_waits += delta[1]
            c.reply_wait_ns += delta[2]
            c.reply_waits += delta[3]
        self._seen = now

    def reopened(self):
        """The session was opened again: its wait totals start from zero, its resident groups
        may be others."""
        self._seen = (0, 0, 0, 0)
        self._first = ...

    def stats(self) -> dict:
        out = {"pass_kind": self.kind}
        for kind in KINDS:
            out.update(self.counters[kind].stats(kind))
        if self.auto is not None:
            out.update(self.auto.stats())
        out["forward_plan_length"] = len(self.forward)
        out["forward_plan_recorded"] = self._recorder is None
        out.update({f"sampling_segments_{k}": v for k, v in self.segments.items()})
        out.update({f"sampling_resident_kept_{k}": v for k, v in self.kept.items()})
        return out

    # --- threads ------------------------------------------------------------------------

    def enter(self, kind: str):
        """The attached module's forward begins in this thread."""
        me = threading.get_ident()
        with self._lock:
            self._refuse_other(me, kind)
            entry = self._running.setdefault(me, [kind, 0])
            entry[1] += 1

    def leave(self) -> bool:
        """The attached module's forward returns in this thread; True where that ends a
        sampling pass (its outermost call)."""
        me = threading.get_ident()
        with self._lock:
            entry = self._running.get(me)
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._running[me]
                    return entry[0] == SAMPLE
        return False

    def check(self, kind: str):
        """An acquire of ``kind`` in this thread (a backward's too, which runs in autograd's
        thread on CUDA): refused while another thread runs the other kind's forward."""
        if self._running:
            with self._lock:
                self._refuse_other(threading.get_ident(), kind)

    def _refuse_other(self, me: int, kind: str):
        for tid, (other, _) in self._running.items():
            if tid != me and other != kind:
                names = {t.ident: t.name for t in threading.enumerate()}
                raise ConcurrentPasses(
                    f"a {_words(kind)} in thread {names.get(me, me)!r} while thread "
                    f"{names.get(tid, tid)!r} runs a {_words(other)} of the same attached "
                    "module: the two would share its streamed groups' tickets. Sample between "
                    "training steps in the training thread, or attach a second copy of the "
                    "model for the other thread."
                )


def _words(kind: str) -> str:
    return "training pass" if kind == TRAIN else "sampling pass (no_grad)"


# --- the sampling budget ------------------------------------------------------------------


@dataclass(eq=False)
class AutoSample:
    """``sample_vram_budget="auto"``: the sampling budget chosen from what the device has free
    when ``Handle.sampling()`` begins. Each block empties torch's cache and grows the session
    to what it holds plus what the device has free, less the trainer's need and a margin, at
    most every group resident (plus the daemon's least staging) and the daemon's limits. The
    need is measured over the first block (the trainer's allocator's peak less what it held at
    the start: the sampling passes' activations, a VAE's decode); until then, half of what is
    free beyond the margin is left to the trainer (a first sample may come before any
    training step, where ``vram_budget="auto"`` runs at its minimum: two of the largest group,
    nothing in flight ahead). A gain of less than the largest group is not worth a reopen (it
    copies the resident groups again), and the block runs at the training budget. ``margin``:
    bytes left free (None: ``budget.default_margin`` of the device, as ``vram_budget="auto"``
    keeps); ``probe()``: the device's (free, total) bytes; ``trainer_probe``: as
    ``budget.AutoBudget``'s (None: from ``torch``). Pass an instance as ``sample_vram_budget``
    to choose them; ``need`` and ``chosen`` say what it measured and chose
    (``Handle.stats()``'s ``sample_auto_need`` and ``sample_auto_budget``)."""

    margin: int | None = None
    probe: Callable[[], tuple[int, int]] | None = None
    trainer_probe: Callable[[], auto_budget.TrainerMemory] | None = None
    #: The trainer's own device bytes over the first block (None until it ended).
    need: int | None = None
    #: The budget the last block ran at.
    chosen: int = 0

    def bind(self, device) -> AutoSample:
        """The probes of ``device`` where none were given. Returns self."""
        if self.probe is None:
            cuda = getattr(device, "type", None) == "cuda"
            self.probe = auto_budget._cuda_probe(device) if cuda else auto_budget._host_probe
        if self.trainer_probe is None:
            self.trainer_probe = auto_budget._TorchTrainer(device)
        return self

    def start(self):
        start = getattr(self.trainer_probe, "start", None)
        if start is not None:
            start()

    def measured(self):
        """The first block ended: what the trainer took over it."""
        t = self.trainer_probe()
        self.need = max(0, max(t.peak_allocated, t.allocated) - t.start_allocated)

    def choose(self, held: int, sizes: list[int], limit: int | None) -> int | None:
        """The budget for a block, from the session's ``held`` device bytes (staging and
        resident groups, which the reopen gives back first), the groups' ``sizes`` and the
        daemon's ``limit``; None: not worth a reopen."""
        free, total = self.probe()
        margin = self.margin if self.margin is not None else auto_budget.default_margin(total)
        room = free - self.need - margin if self.need is not None else max(0, free - margin) // 2
        target = min(held + room, auto_budget.ceiling(sizes))
        if limit is not None:
            target = min(target, limit)
        return target if target >= held + max(sizes) else None

    def stats(self) -> dict:
        return {"sample_auto_need": self.need, "sample_auto_budget": self.chosen}


def auto_sample(options, device) -> AutoSample | None:
    """``options.sample_vram_budget`` as an ``AutoSample`` bound to ``device``: a new one for
    ``"auto"``, the one given; None when it is a number or unset."""
    budget = options.sample_vram_budget
    if budget == "auto":
        return AutoSample().bind(device)
    return budget.bind(device) if isinstance(budget, AutoSample) else None


def budget_limit(client, device_uuid: str) -> tuple[int, str] | None:
    """The most device bytes a session on the device may have: the least of the device's
    memory and the daemon's limits on it (``[quotas]``), with the limit's name; None where the
    daemon names no such device."""
    info = client.info()
    devices = list(info.devices)
    index = next((i for i, d in enumerate(devices) if d.uuid == device_uuid), None)
    if index is None and len(devices) == 1 and not device_uuid:
        index = 0  # the host backend's one device
    if index is None:
        return None
    limits = [(devices[index].total_memory, f"the device's memory ({devices[index].name})")]
    quotas = info.quotas
    if quotas is not None:
        if index < len(quotas.max_device_bytes) and quotas.max_device_bytes[index]:
            limits.append((quotas.max_device_bytes[index], "the daemon's max_device_bytes"))
        if quotas.per_uid_device_bytes:
            limits.append((quotas.per_uid_device_bytes, "the daemon's per_uid_device_bytes"))
    limits = [(n, why) for n, why in limits if n]
    return min(limits) if limits else None


def check_budget(budget: int, limit: tuple[int, str] | None):
    """Raises ``SampleBudgetError`` when ``budget`` passes ``limit`` (``budget_limit``)."""
    if limit is None or budget <= limit[0]:
        return
    n, why = limit
    raise SampleBudgetError(
        f"sample_vram_budget={size_text(budget)} ({budget} bytes) is more than {why}: "
        f"{size_text(n)} ({n} bytes); set it at most that, less what the trainer's sampling "
        "passes need on the device"
    )


def check_sample_staging(staging: int | None, largest: int) -> None:
    """Raises ``SampleBudgetError`` when ``sample_staging_bytes`` is under the largest streamed
    group (``attach``, before anything is freed): the daemon would refuse it only at
    ``sampling()``, after the session was closed to reopen it."""
    if staging is not None and staging < largest:
        raise SampleBudgetError(
            f"sample_staging_bytes={staging} is smaller than the largest streamed group "
            f"({largest} bytes): give at least {largest} bytes, or None for "
            f"{STAGED_GROUPS} of the largest group"
        )


def sample_staging(handle, budget: int) -> int:
    """The staging part of the sampling budget: ``StreamOptions.sample_staging_bytes``, else
    ``STAGED_GROUPS`` of the largest group (at most the budget). A forward-only pass needs the
    link only a few groups ahead of the compute, the resident groups being spread along the
    pass; a quarter of the budget (the daemon's default, for training's turns) would stream
    more."""
    staging = handle.options.sample_staging_bytes  # checked at attach
    if staging is not None:
        return staging
    return forward_staging(budget, max(g.nbytes for g in handle.session.groups))


def forward_staging(budget: int, largest: int) -> int:
    """``STAGED_GROUPS`` of the ``largest`` group, at most ``budget``: the staging forward-only
    passes need (a sampling budget's; ``attach(staging_bytes="forward")``'s)."""
    return min(budget, STAGED_GROUPS * largest)


@contextlib.contextmanager
def sampling(handle):
    """``Handle.sampling()``: with ``StreamOptions.sample_vram_budget`` above the session's
    budget, the session grows to it for the passes inside (no activations for backward, no
    gradients and no optimizer work are on the device meanwhile) and shrinks back when the
    block ends, both plans kept (``set_budget(keep_plan=True)``). A budget above the device's
    memory or the daemon's limits raises ``SampleBudgetError`` before anything changes.
    Before it grows, the trainer's allocator gives its cached, unused device segments back (the
    session grows into them); when the block ends it makes the same segments again
    (``_restore_segments``), so that the next training step finds them as the step before
    sampling left them; the groups resident at both budgets stay on the device meanwhile
    (``_keep_resident``). Without a sampling budget it changes nothing: sampling passes follow
    the forward plan with or without it."""
    budget = handle.options.sample_vram_budget
    old_budget, old_staging = handle.vram_budget, handle.session.opened.staging_bytes
    if budget is None:
        yield handle
        return
    trained = [g.resident for g in handle.session.groups]  # the training session's resident set
    given = None  # the trainer's segments given back for the passes
    if handle.session.holds_state:
        raise SampleBudgetError(
            "sample_vram_budget: the session holds trainable state in host memory "
            "(trainable='host'), which reopening it at another budget would drop; leave "
            "sample_vram_budget unset with trainable='host'"
        )
    auto = handle._passes.auto
    limit = None
    if auto is not None:
        limit = budget_limit(handle.client, device_uuid(handle.device))
        given = _give_back(handle.device)
        groups = handle.session.groups
        held = old_staging + sum(g.nbytes for g in groups if g.resident)
        budget = auto.choose(held, [g.nbytes for g in groups], limit and limit[0])
        auto.chosen = budget if budget is not None and budget > old_budget else old_budget
    grow = budget is not None and budget > old_budget
    if grow:
        if auto is None:
            given = _give_back(handle.device)
        check_budget(budget, limit or budget_limit(handle.client, device_uuid(handle.device)))
        staging = min(budget, sample_staging(handle, budget))
        if auto is not None:  # its budget may reach every group resident: one group then stages
            staging = auto_budget.staging_for(
                budget, [g.nbytes for g in handle.session.groups], staging
            )
        handle.set_budget(budget, staging, keep_plan=True)
    measure = auto is not None and auto.need is None
    if measure:
        auto.start()
    try:
        yield handle
    except Exception as e:
        if grow and type(e).__name__ == "OutOfMemoryError":  # torch's, CUDA's or the CPU's
            how = " (auto: half of what was free, the trainer's need unmeasured)" if measure else ""
            e.add_note(
                f"weightstream: the session had grown to sample_vram_budget={size_text(budget)}"
                f"{how} for these passes, from {size_text(old_budget)}; a smaller "
                "sample_vram_budget, or none, leaves the trainer more of the device"
            )
        raise
    finally:
        try:
            if measure:
                auto.measured()
        finally:
            kept = dict(NOTHING_KEPT)
            if grow:
                first = _first_staged(handle, trained, old_staging, budget - old_budget)
                with _keep_resident(handle, trained, first) as kept:
                    handle.set_budget(old_budget, old_staging, keep_plan=True)
                    _settle_lookahead(handle)
            made, made_bytes = _restore_segments(handle.device, given)
            handle._passes.segments = {
                "given": len(given or ()),
                "made": made,
                "made_bytes": made_bytes,
            }
            handle._passes.kept = kept


def _first_staged(handle, wanted: list[bool], staging: int, room: int) -> frozenset[int]:
    """The groups the session reopened with ``wanted`` resident and ``staging`` bytes of
    staging stages first, resident now: along the plan its look-ahead follows from the start
    (the next step's first acquires), its streamed groups, each once, until they fill the
    staging; of those, the ones resident in the session now, at most ``room`` bytes of them
    (what the grown budget had beyond the one the block reopens)."""
    p, groups = handle._passes, handle.session.groups
    plan = (p.plan_of(p.kind) if p.kind is not None else None) or []
    first, seen, filled, held = set(), set(), 0, 0
    for g in plan:
        if g in seen or wanted[g]:
            continue
        seen.add(g)
        filled += groups[g].nbytes
        if filled > staging:
            break
        if groups[g].resident and held + groups[g].nbytes <= room:
            first.add(g)
            held += groups[g].nbytes
    return frozenset(first)


def _settle_lookahead(handle):
    """Waits until the daemon has answered the look-ahead's acquires in flight (the replies
    kept for the step that takes them, ``Session.settle``): by then it has placed their copies,
    from the regions ``_keep_resident`` holds where they are there."""
    with handle._lock:
        ahead = list(handle._lookahead.ahead) if handle._lookahead is not None else []
    for _, number in ahead:
        handle.session.settle(number)


@contextlib.contextmanager
def _keep_resident(handle, wanted: list[bool], first: frozenset[int] = frozenset()):
    """The groups resident both in the session now and in ``wanted`` (the resident set of the
    session the block reopens, as it was before: its budget and split are the same, and so is
    the daemon's choice) stay on the device while the session is opened again: a session of
    those groups alone holds them resident, sharing the regions they are in (the daemon shares
    a model's resident groups between the sessions on a device), so the reopened session shares
    them instead of copying them again, and the next training step does not wait for their
    copies. So do the groups in ``first`` (``_first_staged``: resident now, staged first by the
    reopened session): the daemon stages a group from a region that holds it resident on the
    device, within the device, instead of over the link, so the next step finds the groups it
    acquires first staged, as the step before sampling found them. That session costs one of
    its groups of staging while it is open; where the daemon cannot open it (the device's
    memory, a quota), the reopening copies them as before. Yields what it keeps: groups,
    bytes of those resident at both budgets, and of ``first`` (``staged_``)."""
    groups = handle.session.groups
    keep = [
        g
        for i, (g, w) in enumerate(zip(groups, wanted, strict=True))
        if g.resident and (w or i in first)
    ]
    kept = dict(NOTHING_KEPT)
    holder = None
    if keep:
        sizes = [g.nbytes for g in keep]
        try:
            holder = handle.client.open_session(
                handle.model_id,
                group_specs(keep),
                sum(sizes) + max(sizes),
                staging_bytes=max(sizes),
                device=handle.device,
                label=f"{handle.session.label} (resident groups kept)",
            )
        except WeightstreamError:
            holder = None
        else:
            staged = [groups[i].nbytes for i in first]
            kept = {
                "groups": len(keep) - len(staged),
                "bytes": sum(sizes) - sum(staged),
                "staged_groups": len(staged),
                "staged_bytes": sum(staged),
            }
    try:
        yield kept
    finally:
        if holder is not None:
            holder.close()


#: The small pool's largest block: two fill one of its 2 MiB segments.
SMALL_BLOCK = 1 << 20


def _give_back(device) -> list[tuple[int, int, bool]] | None:
    """The trainer's cached, unused device segments given back, so that the device's free
    memory counts them (``AutoSample``) and the session can grow into them; returns them as
    (bytes, stream, of the small pool), for ``_restore_segments`` (None off CUDA, or where
    torch's allocator is not its native one or maps memory as it grows)."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    segments = _idle_segments(device)
    torch.cuda.empty_cache()
    return segments


def _idle_segments(device) -> list[tuple[int, int, bool]] | None:
    """The device's segments (cudaMalloc'd blocks) of torch's allocator in which no tensor
    lives, of its default pool: what ``empty_cache`` frees (a CUDA graph's private pool keeps
    its segments)."""
    import torch

    if torch.cuda.memory.get_allocator_backend() != "native":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    segments = [
        s
        for s in torch.cuda.memory_snapshot(include_traces=False)
        if s.get("device", index) == index
    ]
    if any(s.get("is_expandable") for s in segments):
        return None
    return [
        (s["total_size"], s["stream"], s["segment_type"] == "small")
        for s in segments
        if s["active_size"] == 0 and tuple(s.get("segment_pool_id", (0, 0))) == (0, 0)
    ]


def _restore_segments(device, segments) -> tuple[int, int]:
    """The segments ``_give_back`` gave made again, of the same sizes on the same streams,
    once sampling's own cached blocks are given back: the trainer's allocator is as the
    training step before sampling left it, and the step after allocates nothing anew (on
    FLUX.2-dev it allocated 124 blocks again, one step 2.6 % slower). Returns the segments and
    bytes made; it stops at an allocation that fails (less is free now): the step allocates
    the rest."""
    if not segments:
        return 0, 0
    import torch

    torch.cuda.empty_cache()
    held, made, count = [], 0, 0
    try:
        for size, stream, small in segments:
            with torch.cuda.stream(_stream_of(device, stream)):
                if small:
                    held += [
                        torch.empty(SMALL_BLOCK, dtype=torch.uint8, device=device)
                        for _ in range(max(1, size // SMALL_BLOCK))
                    ]
                else:
                    held.append(torch.empty(size, dtype=torch.uint8, device=device))
            made, count = made + size, count + 1
    except torch.OutOfMemoryError:
        pass
    finally:
        del held  # each block back to its stream's pool, cached
    return count, made


def _stream_of(device, pointer: int):
    import torch

    default = torch.cuda.default_stream(device)
    return default if pointer == default.cuda_stream else torch.cuda.ExternalStream(pointer, device)
