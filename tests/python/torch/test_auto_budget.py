"""``vram_budget="auto"``: the ``AutoBudget`` policy alone (grow, margin, shrink, the error),
and ``attach(vram_budget="auto")`` on the daemon's host backend with a fake probe of the
device's free memory: the session grows after the first step keeping its plan, shrinks when
another job takes memory, and training stays equal (torch.equal) to the model without
weightstream throughout."""

from __future__ import annotations

import copy

import pytest
import torch
import weightstream.torch as wst
from peft import LoraConfig, inject_adapter_in_model
from torch import nn
from torch.utils.checkpoint import checkpoint
from weightstream.torch.budget import AutoBudget, AutoBudgetError, TrainerMemory, default_margin

from tests.python.torch.test_torch import Block, assert_equal_runs, inputs, train

GiB = 1 << 30
MiB = 1 << 20


# --- the policy, pure --------------------------------------------------------------------


def policy(sizes=(100 * MiB,) * 10, margin=None) -> AutoBudget:
    return AutoBudget(margin=margin).bind(torch.device("cpu"), list(sizes), alignment=256)


def test_starts_at_two_of_the_largest_group_all_staging():
    p = policy([10 * MiB, 300 * MiB, 200 * MiB])
    assert (p.minimum, p.budget, p.staging) == (600 * MiB, 600 * MiB, 600 * MiB)
    assert p.ceiling == 810 * MiB  # every group resident, plus one of the largest as staging


def test_default_margin_is_1_gib_or_5_percent_of_the_device():
    assert default_margin(16 * GiB) == GiB
    assert default_margin(141 * GiB) == int(141 * GiB * 0.05)
    p = policy()
    d = p.grow(free=10 * GiB, total=141 * GiB, trainer=TrainerMemory())
    assert d.margin == int(141 * GiB * 0.05)


def test_grows_to_the_free_memory_less_the_trainer_and_the_margin():
    p = policy([GiB] * 40)  # a 40 GiB model in 1 GiB blocks
    trainer = TrainerMemory(
        peak_reserved=8 * GiB,
        peak_allocated=7 * GiB,
        reserved=5 * GiB,
        allocated=4 * GiB,
        start_allocated=4 * GiB,
    )
    d = p.grow(free=20 * GiB, total=16 * GiB, trainer=trainer)
    # The trainer's peak comes back each step: 3 GiB beyond what its allocator holds now.
    assert d.need == 3 * GiB and d.margin == GiB
    assert d.budget == 2 * GiB + 20 * GiB - 3 * GiB - GiB
    assert d.staging == 3 * GiB, "three of the largest; the rest resident"
    assert (p.budget, p.grows, p.free_seen) == (d.budget, 1, 20 * GiB)


def test_growth_counts_what_the_first_step_kept_allocated():
    """Optimizer states made in the first step's opt.step() add to a later step's peak."""
    p = policy([GiB] * 40)
    trainer = TrainerMemory(
        peak_reserved=6 * GiB,
        peak_allocated=6 * GiB,
        reserved=6 * GiB,
        allocated=3 * GiB,
        start_allocated=1 * GiB,
    )
    d = p.grow(free=20 * GiB, total=16 * GiB, trainer=trainer)
    assert d.need == 2 * GiB  # 6 + (3 - 1) - 6 held
    assert d.budget == 2 * GiB + 20 * GiB - 2 * GiB - GiB


def test_growth_stops_at_the_ceiling_and_never_goes_below_the_current_budget():
    p = policy([GiB] * 4)
    d = p.grow(free=100 * GiB, total=141 * GiB, trainer=TrainerMemory())
    assert (d.budget, d.staging) == (5 * GiB, GiB), "all four resident, least staging"
    q = policy([GiB] * 4)
    d = q.grow(free=GiB // 2, total=16 * GiB, trainer=TrainerMemory())
    assert d.budget == 2 * GiB and q.grows == 0, "no room: keeps the minimum the step ran with"


def test_no_shrink_while_half_the_margin_is_free():
    p = policy([GiB] * 40)
    p.grow(free=20 * GiB, total=16 * GiB, trainer=TrainerMemory())
    assert p.check(free=GiB // 2, total=16 * GiB, trainer=TrainerMemory()) is None
    assert (p.shrinks, p.checks) == (0, 1)


def test_shrinks_so_that_the_margin_is_free_again():
    p = policy([GiB] * 40)
    p.grow(free=20 * GiB, total=16 * GiB, trainer=TrainerMemory())  # 21 GiB
    d = p.check(free=GiB // 4, total=16 * GiB, trainer=TrainerMemory())
    assert d.budget == 21 * GiB + GiB // 4 - GiB
    assert (p.budget, p.shrinks) == (d.budget, 1)
    # the trainer's allocator gave back most of what its peak needs: down to the minimum
    p.expected_peak = 18 * GiB
    d = p.check(free=0, total=16 * GiB, trainer=TrainerMemory())
    assert (d.budget, d.need) == (p.minimum, 18 * GiB) and p.minimum == 2 * GiB


def test_grows_back_once_twice_the_margin_is_free_and_the_gain_is_worth_a_reopen():
    p = policy([4 * GiB] * 10)  # a 1 GiB margin on a 16 GiB device
    none = TrainerMemory()
    p.grow(free=20 * GiB, total=16 * GiB, trainer=none)
    assert p.budget == 8 * GiB + 20 * GiB - GiB
    p.check(free=0, total=16 * GiB, trainer=none)  # another job took memory
    assert (p.budget, p.shrinks) == (26 * GiB, 1)
    for free in (GiB, 3 * GiB // 2, 9 * GiB // 2):
        # Within the band, or twice the margin free but a gain (3.5 GiB) below one group.
        assert p.check(free=free, total=16 * GiB, trainer=none) is None, free
    assert p.grows == 1
    d = p.check(free=10 * GiB, total=16 * GiB, trainer=none)  # the other job ended
    assert (d.budget, d.staging) == (26 * GiB + 10 * GiB - GiB, 12 * GiB)
    assert (p.budget, p.grows, p.shrinks) == (d.budget, 2, 1)
    assert d.why.startswith(f"free {10 * GiB} >= 2 x margin {GiB}: {26 * GiB} -> {35 * GiB}")
    # What the trainer will still need counts, and the ceiling holds.
    p.expected_peak = 3 * GiB
    d = p.check(free=100 * GiB, total=16 * GiB, trainer=none)
    assert d.budget == p.ceiling == 44 * GiB and d.need == 3 * GiB


def test_fails_naming_the_numbers_when_the_minimum_does_not_fit():
    p = policy([GiB] * 40)
    p.grow(free=GiB, total=16 * GiB, trainer=TrainerMemory(peak_reserved=6 * GiB))
    # at the minimum (2 GiB); the trainer's allocator gave 3 GiB back and will need them
    trainer = TrainerMemory(reserved=3 * GiB)
    with pytest.raises(AutoBudgetError) as e:
        p.check(free=GiB // 4, total=16 * GiB, trainer=trainer)
    text = str(e.value)
    for number in (GiB // 4, GiB // 2, 3 * GiB, 2 * GiB, GiB):
        assert str(number) in text, (number, text)
    assert "less than the minimum" in text


def test_auto_or_an_instance_or_a_size():
    from weightstream.torch import budget

    assert isinstance(budget.resolve("auto"), AutoBudget)
    mine = AutoBudget(margin=5)
    assert budget.resolve(mine) is mine
    assert budget.resolve(8 << 30) is None and budget.resolve(None) is None
    with pytest.raises(ValueError, match="expected a number of bytes or 'auto'"):
        budget.resolve("8GiB")


# --- attach(vram_budget="auto") on the host backend ---------------------------------------


class Deep(nn.Module):
    """Eight blocks (attention, MLP) behind a Linear, gradient checkpointing per block."""

    def __init__(self):
        super().__init__()
        self.proj_in = nn.Linear(4, 64)
        self.blocks = nn.ModuleList(Block() for _ in range(8))
        self.proj_out = nn.Linear(64, 4)

    def forward(self, x):
        h = self.proj_in(x.flatten(2).transpose(1, 2))
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return self.proj_out(h)


def make_deep() -> nn.Module:
    torch.manual_seed(0)
    model = Deep()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q", "k", "v", "o", "fc1", "fc2"])
    model = inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
    return model


class FakeDevice:
    """A device's (free, total) bytes: ``pool`` is what neither the trainer nor another job
    uses; the session's budget (``auto.budget``) comes out of it, as the daemon's allocations
    would."""

    def __init__(self, pool: int, total: int = 64 * GiB):
        self.pool, self.total, self.auto = pool, total, None

    def __call__(self):
        return self.pool - self.auto.budget, self.total


def session_info(handle):
    (info,) = [s for s in handle.client.list_sessions() if s.session_id == handle.session.id]
    return info


def test_auto_grows_after_the_first_step_keeps_the_plan_and_shrinks(daemon):
    ref = make_deep()
    streamed = copy.deepcopy(ref)
    xs = inputs(10, torch.float32)
    # One optimizer per step, as below (a fresh AdamW each time).
    want = [train(ref, xs[i : i + 1]) for i in range(len(xs))]
    want = tuple([x for step in want for x in step[k]] for k in range(4))
    device = FakeDevice(pool=0)
    auto = device.auto = AutoBudget(margin=256 << 10, probe=device)
    handle = wst.attach(streamed, "cpu", client=daemon.client, min_bytes=0, vram_budget=auto)
    sizes = [g.nbytes for g in handle.session.groups]
    block = max(sizes)
    info = session_info(handle)
    assert (info.vram_budget, info.staging_bytes, info.resident_bytes) == (2 * block, 2 * block, 0)
    assert handle.stats()["auto_budget"] == 2 * block
    # The device has room for the minimum and four more blocks, beyond the margin.
    device.pool = 6 * block + auto.margin
    steps = [train(streamed, xs[i : i + 1]) for i in range(2)]
    recorded = handle.session.last_plan
    info = session_info(handle)
    assert info.vram_budget == 6 * block, "grown by what the device had left less the margin"
    resident = [g for g in handle.session.groups if g.resident]
    assert info.staging_bytes == 3 * block and 2 <= len(resident) < len(sizes) - 1
    assert info.resident_bytes == sum(g.nbytes for g in resident) <= 3 * block
    assert info.plan_length == len(recorded) == 2 * len(sizes), "forward, backward: each group"
    s = handle.stats()
    assert (s["auto_grows"], s["auto_shrinks"], s["auto_free_seen"]) == (
        1,
        0,
        4 * block + auto.margin,
    )
    assert s["auto_margin"] == auto.margin
    # Step 2 ran on the grown session with the first step's plan, not a new recording.
    assert handle._recording is None and handle.session.last_plan == recorded
    assert s["acquires"] > 0 and s["hits"] / s["acquires"] >= 0.95, s
    before, submitted = handle.stats(), handle.session.submitted
    steps += [train(streamed, xs[i : i + 1]) for i in range(2, 4)]
    after = handle.stats()
    # Resident groups cost nothing per step: the streamed ones are acquired once per pass.
    assert handle.session.submitted - submitted == 2 * 2 * (len(sizes) - len(resident))
    acquires = after["acquires"] - before["acquires"]
    assert acquires > 0 and (after["hits"] - before["hits"]) / acquires >= 0.95, (before, after)
    # Another job takes memory: the next step starts by shrinking until the margin is free.
    device.pool -= auto.margin * 3 // 4  # a quarter of the margin left free
    steps += [train(streamed, xs[i : i + 1]) for i in range(4, 6)]
    info = session_info(handle)
    assert info.vram_budget == 6 * block - auto.margin * 3 // 4
    assert handle.session.last_plan == recorded, "the plan survives the shrink too"
    s = handle.stats()
    assert (s["auto_grows"], s["auto_shrinks"], s["auto_checks"]) == (1, 1, 4), s
    steps += [train(streamed, xs[i : i + 1]) for i in range(6, 8)]
    assert handle.stats()["auto_shrinks"] == 1, "the margin is free again: no more reopening"
    # The other job ends, and two blocks more are free: the session grows back, plan kept.
    device.pool += auto.margin * 3 // 4 + 2 * block
    steps += [train(streamed, xs[i : i + 1]) for i in range(8, 10)]
    info = session_info(handle)
    assert info.vram_budget == min(8 * block, auto.ceiling)
    assert handle.session.last_plan == recorded, "the plan survives growing back"
    s = handle.stats()
    assert (s["auto_grows"], s["auto_shrinks"]) == (2, 1), s
    got = tuple([x for step in steps for x in step[k]] for k in range(4))
    assert_equal_runs(want, got)
    handle.detach(release=True)


def test_auto_fails_clearly_when_the_device_is_full(daemon):
    model = make_deep()
    device = FakeDevice(pool=1 << 30)
    auto = device.auto = AutoBudget(margin=256 << 10, probe=device)
    handle = wst.attach(model, "cpu", client=daemon.client, min_bytes=0, vram_budget=auto)
    xs = inputs(3, torch.float32)
    train(model, xs[:2])
    # The trainer will need more than the device has left.
    auto.trainer_probe = lambda: TrainerMemory()
    auto.expected_peak = 1 << 40
    device.pool = auto.budget
    with pytest.raises(AutoBudgetError, match="less than the minimum"):
        train(model, xs[2:])
    handle.detach(release=True)


def test_auto_refuses_a_staging_size(daemon):
    with pytest.raises(ValueError, match='"auto" chooses staging_bytes'):
        wst.attach(
            make_deep(),
            "cpu",
            client=daemon.client,
            min_bytes=0,
            vram_budget="auto",
            staging_bytes=1 << 20,
        )


# --- the ai-toolkit launcher's default ---------------------------------------------------


@pytest.mark.parametrize(
    "budget,percent,auto",
    [
        (None, 1.0, True),  # ai-toolkit's default: offload everything, weightstream sizes it
        (None, 0.5, False),  # a percent the job chose: that fraction streams, fixed default
        (8 << 20, 1.0, False),  # a budget the job chose
        ("auto", 0.5, True),
    ],
)
def test_ai_toolkit_budget_is_auto_unless_the_job_sets_one(daemon, budget, percent, auto):
    from weightstream.integrations import ai_toolkit
    from weightstream.integrations.ai_toolkit import MemoryManager, Settings

    ai_toolkit.configure(Settings(socket=daemon.socket, vram_budget=budget))
    try:
        model = make_deep()
        manager = MemoryManager.attach(model, "cpu", offload_percent=percent)
        handle = manager.handle
        assert (handle._auto is not None) == auto
        if budget is not None and not auto:
            assert session_info(handle).vram_budget == budget
        MemoryManager.detach(model)
    finally:
        ai_toolkit.configure(None)


def test_ai_toolkit_settings_take_auto():
    from weightstream.integrations.ai_toolkit import Settings

    assert Settings.load({"vram_budget": "auto"}, {}).vram_budget == "auto"
    assert Settings.load({"vram_budget": "8GiB"}, {"WEIGHTSTREAM_BUDGET": "Auto"}).vram_budget == (
        "auto"
    )
    assert Settings.load(None, {}).vram_budget is None
