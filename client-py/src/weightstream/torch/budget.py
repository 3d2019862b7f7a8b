"""``vram_budget="auto"``: the session's device budget chosen from what the device has left.

``attach(..., vram_budget="auto")`` opens the session at the *minimum* (staging for two of the
largest group, nothing resident: what a streamed step needs) and measures the trainer's own
memory through its first step. When the step ends (its plan recorded), the session grows to
what the device has free, less what the trainer will still need, less a *margin*; the plan is
kept (sent again to the grown session, not recorded again). Before each later step one probe
of the device's free memory (``torch.cuda.mem_get_info``) decides whether another job took
room: under half the margin free, the session shrinks until the margin is free again, or, if
even the minimum no longer fits, the step fails with ``AutoBudgetError`` naming the numbers.
When room comes back (another job ended: twice the margin free) the session grows again, as
after the first step, if that gains at least one group or a margin's worth
(``AutoBudget.grow_back``): each reopen copies the resident groups again, so small gains are
not worth one.

``AutoBudget`` is the policy, pure: it takes numbers (free and total device bytes, the
trainer's memory, the session's budget, the group sizes) and returns a ``Decision`` or raises.
Its ``probe`` and ``trainer_probe`` callables are where the numbers come from (the device's
``torch.cuda`` functions by default; for the host backend, ``/proc/meminfo``): tests replace
them.

The margin: by default ``max(1 GiB, 5 % of the device)``. The trainer's first step is measured
once, but later steps allocate more than it did in ways the measure cannot see: allocator
fragmentation (torch's caching allocator rounds and splits blocks), library workspaces created
lazily (cuBLAS, cuDNN, attention kernels), a sampling pass at another resolution, another
process's CUDA context (~0.5 GiB). 1 GiB covers those on a 24 GB card; 5 % scales with the
larger batches and resolutions a larger device runs (7 GiB on a 141 GB H200).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from weightstream.errors import WeightstreamError
from weightstream.torch.policy import STAGED_GROUPS

GiB = 1 << 30
#: The margin's floor and its share of the device (``default_margin``).
MARGIN_FLOOR = GiB
MARGIN_SHARE = 0.05


def default_margin(total: int) -> int:
    """``max(1 GiB, 5 % of the device's total bytes)``."""
    return max(MARGIN_FLOOR, int(total * MARGIN_SHARE))


def ceiling(sizes: list[int]) -> int:
    """Every group resident, plus the daemon's least staging (one of the largest): a larger
    budget would never be used."""
    return sum(sizes) + max(sizes)


def staging_for(budget: int, sizes: list[int], staged: int | None = None) -> int:
    """The staging part of ``budget``: the least staging (one of the largest group) when every
    group fits resident beside it (``ceiling``), else ``staged`` (None: three of the largest,
    double buffering and one re-acquire, the daemon's own default floor), at most all of it."""
    if budget >= ceiling(sizes):
        return max(sizes)
    return min(budget, STAGED_GROUPS * max(sizes) if staged is None else staged)


class AutoBudgetError(WeightstreamError):
    """The device no longer has room for the session's minimum next to the trainer."""


@dataclass(frozen=True)
class TrainerMemory:
    """The trainer's own device memory (torch's allocator), in bytes: its peaks since the
    first step began, what it holds now, and what it had allocated when the step began."""

    peak_reserved: int = 0
    peak_allocated: int = 0
    reserved: int = 0
    allocated: int = 0
    start_allocated: int = 0

    def expected_peak(self) -> int:
        """The trainer's peak in a later step: the first step's, plus what it kept allocated
        beyond its start (optimizer states made in the first ``opt.step()``, which a later
        step's peak holds on top of its activations)."""
        kept = max(0, self.allocated - self.start_allocated)
        return max(self.peak_reserved, self.peak_allocated + kept)


@dataclass(frozen=True)
class Decision:
    """A budget and its staging part, and the numbers it was chosen from."""

    budget: int
    staging: int
    free: int
    need: int
    margin: int
    why: str


def _cuda_probe(device) -> Callable[[], tuple[int, int]]:
    import torch

    return lambda: torch.cuda.mem_get_info(device)


def _host_probe() -> tuple[int, int]:
    """MemAvailable and MemTotal: the host backend's budgets are host memory."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0]) * 1024
    return fields["MemAvailable"], fields["MemTotal"]


class _TorchTrainer:
    """The trainer's memory from ``torch.cuda``'s allocator statistics (zeros off CUDA)."""

    def __init__(self, device):
        self.device = device
        self.start_allocated = 0

    def _cuda(self) -> bool:
        return getattr(self.device, "type", None) == "cuda"

    def start(self):
        if self._cuda():
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_allocated = torch.cuda.memory_allocated(self.device)

    def __call__(self) -> TrainerMemory:
        if not self._cuda():
            return TrainerMemory()
        import torch

        d = self.device
        return TrainerMemory(
            torch.cuda.max_memory_reserved(d),
            torch.cuda.max_memory_allocated(d),
            torch.cuda.memory_reserved(d),
            torch.cuda.memory_allocated(d),
            self.start_allocated,
        )


@dataclass
class AutoBudget:
    """The ``"auto"`` budget policy of one session. ``margin``: bytes left free on the device
    (None: ``default_margin`` of the device's total). ``probe()``: the device's (free, total)
    bytes now; ``trainer_probe()``: the trainer's ``TrainerMemory`` (None: from ``torch``, set
    by ``bind``). Pass an instance as ``attach(vram_budget=...)`` to choose them."""

    margin: int | None = None
    probe: Callable[[], tuple[int, int]] | None = None
    trainer_probe: Callable[[], TrainerMemory] | None = None
    sizes: list[int] = field(default_factory=list)
    alignment: int = 1
    #: The trainer's peak expected in a later step (set when the first step ends).
    expected_peak: int = 0
    # What it decided, for ``Handle.stats``.
    budget: int = 0
    staging: int = 0
    free_seen: int = 0
    need_seen: int = 0
    margin_used: int = 0
    grows: int = 0
    shrinks: int = 0
    checks: int = 0
    last: Decision | None = None

    # --- setup --------------------------------------------------------------------------

    def bind(self, device, sizes: list[int], alignment: int = 1) -> AutoBudget:
        """Sets the group sizes (aligned, as the daemon lays them out), and the probes of
        ``device`` where none were given. Returns self."""
        if not sizes:
            raise ValueError("AutoBudget: no groups")
        self.sizes, self.alignment = list(sizes), max(1, alignment)
        if self.probe is None:
            cuda = getattr(device, "type", None) == "cuda"
            self.probe = _cuda_probe(device) if cuda else _host_probe
        if self.trainer_probe is None:
            self.trainer_probe = _TorchTrainer(device)
        self.budget = self.staging = self.minimum
        return self

    def start(self):
        """The first step begins: the trainer's peaks are measured from here."""
        start = getattr(self.trainer_probe, "start", None)
        if start is not None:
            start()

    @property
    def largest(self) -> int:
        return max(self.sizes)

    @property
    def minimum(self) -> int:
        """Staging for two of the largest group (the one in use and the next), nothing
        resident: the least a streamed step runs with."""
        return 2 * self.largest

    @property
    def ceiling(self) -> int:
        """``ceiling`` of the groups."""
        return ceiling(self.sizes)

    def staging_for(self, budget: int) -> int:
        """``staging_for`` of the groups: three of the largest, or one where every group is
        resident."""
        return staging_for(budget, self.sizes)

    def _margin(self, total: int) -> int:
        return self.margin if self.margin is not None else default_margin(total)

    def _round(self, n: int) -> int:
        return n - n % self.alignment

    def _need(self, trainer: TrainerMemory) -> int:
        """What the trainer will still take beyond what its allocator holds now."""
        return max(0, self.expected_peak - trainer.reserved)

    def _target(self, current: int, free: int, need: int, margin: int) -> int:
        """What the session may hold: its ``current`` budget (given back when it reopens)
        plus the device's ``free`` bytes, less the trainer's ``need`` and the margin, rounded
        to the alignment, at most the ceiling."""
        return min(self.ceiling, self._round(current + free - need - margin))

    # --- decisions ----------------------------------------------------------------------

    def grow(
        self, free: int, total: int, trainer: TrainerMemory, current: int | None = None
    ) -> Decision:
        """At the first step's end: the budget the session may grow to. The device's
        ``free`` bytes plus the session's ``current`` budget (given back when it reopens),
        less what the trainer will still take beyond what its allocator holds, less the
        margin; between the minimum and the ceiling. Never less than ``current``: the first
        step ran with it."""
        current = self.budget if current is None else current
        self.expected_peak = trainer.expected_peak()
        need = self._need(trainer)
        margin = self._margin(total)
        budget = max(current, self._target(current, free, need, margin))
        why = (
            f"free {free} + current {current} - trainer's need {need} - margin {margin} "
            f"= {current + free - need - margin}; ceiling {self.ceiling}"
        )
        decision = Decision(budget, self.staging_for(budget), free, need, margin, why)
        if budget > current:
            self.grows += 1
        return self._record(decision)

    def check(
        self, free: int, total: int, trainer: TrainerMemory, current: int | None = None
    ) -> Decision | None:
        """Before a later step: the budget to shrink to when under half the margin is free
        (so that the margin is free again; the minimum at least), the budget to grow back to
        when twice the margin is free and growing gains enough (``grow_back``), else None.
        Raises ``AutoBudgetError`` when the minimum does not fit in what the device can give
        the session (its budget and the free bytes, less what the trainer still needs)."""
        current = self.budget if current is None else current
        margin = self._margin(total)
        self.checks += 1
        self.free_seen, self.margin_used = free, margin
        need = self._need(trainer)
        if free >= 2 * margin:
            return self.grow_back(free, need, margin, current)
        if free >= margin // 2:
            return None
        room = current + free - need
        if room < self.minimum:
            raise AutoBudgetError(
                f'vram_budget="auto": the device has {free} bytes free (under half the margin, '
                f"{margin // 2}); the session's {current} bytes plus those, less the "
                f"{need} the trainer still needs, leave {room}: less than the minimum "
                f"{self.minimum} (staging for two of the largest group, {self.largest} bytes). "
                "Another process took the device's memory: free some, or stream with a "
                "smaller model/batch."
            )
        budget = max(self.minimum, min(current, self._round(room - margin)))
        why = f"free {free} < margin/2 {margin // 2}: {current} -> {budget}"
        decision = Decision(budget, self.staging_for(budget), free, need, margin, why)
        if budget < current:
            self.shrinks += 1
        return self._record(decision)

    def grow_back(self, free: int, need: int, margin: int, current: int) -> Decision | None:
        """Room came back: the budget ``grow`` would choose now, if it passes ``current`` by
        at least one of the largest group or a margin (a reopen copies the resident groups
        again); else None."""
        target = self._target(current, free, need, margin)
        if target - current < max(self.largest, margin):
            return None
        why = (
            f"free {free} >= 2 x margin {margin}: {current} -> {target} "
            f"(free + current - trainer's need {need} - margin; ceiling {self.ceiling})"
        )
        self.grows += 1
        return self._record(Decision(target, self.staging_for(target), free, need, margin, why))

    def _record(self, d: Decision) -> Decision:
        self.last = d
        self.budget, self.staging = d.budget, d.staging
        self.free_seen, self.need_seen, self.margin_used = d.free, d.need, d.margin
        return d

    def stats(self) -> dict:
        """The decisions so far, for ``Handle.stats()`` (keys prefixed ``auto_``)."""
        return {
            "auto_budget": self.budget,
            "auto_staging": self.staging,
            "auto_free_seen": self.free_seen,
            "auto_trainer_need": self.need_seen,
            "auto_margin": self.margin_used,
            "auto_grows": self.grows,
            "auto_shrinks": self.shrinks,
            "auto_checks": self.checks,
        }


def resolve(vram_budget) -> AutoBudget | None:
    """The ``AutoBudget`` that ``attach``'s ``vram_budget`` asks for (a fresh one for
    ``"auto"``, the instance given), or None for a size or None."""
    if isinstance(vram_budget, AutoBudget):
        return vram_budget
    if isinstance(vram_budget, str):
        if vram_budget.strip().lower() != "auto":
            raise ValueError(f"vram_budget={vram_budget!r}: expected a number of bytes or 'auto'")
        return AutoBudget()
    return None
