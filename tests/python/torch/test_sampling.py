"""Sampling passes (under ``no_grad``) on the host backend: a model of 8 blocks streamed at a
budget of three blocks follows the forward plan (the module order, then the first sampling
pass), cyclically, before any training step and after; switching between sampling and
training keeps the acquires in flight that the other plan uses next; outputs equal the model
in memory; the daemon counts each kind's acquires apart; a pass off both plans falls back to
on-demand, counted; sampling while another
thread trains is refused; the sampling budget grows the session and gives it back."""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from dataclasses import dataclass

import pytest
import torch
import weightstream.torch as wst
import weightstream.torch.passes as ws_passes
from torch import nn
from weightstream.errors import RequestRejected

DIM = 64
BLOCKS = 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.lora = nn.Linear(DIM, DIM, bias=False)  # trainable, stays on the device

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x))) + self.lora(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.skip: set[int] = set()  # blocks a pass leaves out (a model changed between passes)
        self.order = list(range(BLOCKS))  # the blocks in the order a pass runs them
        self.fail_at: int | None = None  # a pass raises before this block

    def forward(self, x):
        for i in self.order:
            if i == self.fail_at:
                raise RuntimeError(f"stopped before block {i}")
            if i not in self.skip:
                x = self.blocks[i](x)
        return x


#: A block's bytes as the daemon lays it out (a: 64 KiB + 1 KiB, b: 64 KiB + 256 B).
BLOCK_BYTES = 132352


def make_models():
    """The reference and the model to stream: the same weights, the LoRA layers trainable."""
    torch.manual_seed(0)
    ref = Net()
    for name, p in ref.named_parameters():
        p.requires_grad = "lora" in name
    return ref, copy.deepcopy(ref)


def make_pair(daemon, **options):
    ref, model = make_models()
    handle = wst.attach(
        model, "cpu", client=daemon.client, min_bytes=0, vram_budget=3 * BLOCK_BYTES, **options
    )
    assert [g.nbytes for g in handle.session.groups] == [BLOCK_BYTES] * BLOCKS
    assert not any(g.resident for g in handle.session.groups)
    return ref, model, handle


X = torch.randn(2, DIM, generator=torch.Generator().manual_seed(1))


def sample(ref, model, passes, x=X):
    with torch.no_grad():
        for _ in range(passes):
            assert torch.equal(model(x), ref(x))


def train(ref, model, steps):
    """SGD steps on both models' LoRA weights; the losses equal."""
    for m in (ref, model):
        if not hasattr(m, "opt"):
            m.opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.01)
    for _ in range(steps):
        losses = []
        for m in (ref, model):
            loss = m(X).pow(2).mean()
            loss.backward()
            m.opt.step()
            m.opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(*losses)


def counts(handle, kind):
    s = handle.stats()
    return s[f"{kind}_acquires"], s[f"{kind}_hits"], s[f"{kind}_off_plan"]


def delta(after, before):
    return tuple(a - b for a, b in zip(after, before, strict=True))


def test_sampling_before_any_training_step_follows_the_forward_plan(daemon):
    ref, model, handle = make_pair(daemon)
    sample(ref, model, 1)
    # The first pass: the plan comes in force at its first acquire, every later one is a hit.
    assert counts(handle, "sample") == (8, 7, 0)
    assert handle.stats()["forward_plan_recorded"], "a pass ends when the model's forward returns"
    sample(ref, model, 4)
    assert counts(handle, "sample") == (40, 39, 0), "all 32 acquires after the first pass hit"
    stats = handle.stats()
    assert stats["sample_passes"] == 5 and stats["train_acquires"] == 0
    assert stats["forward_plan_recorded"] and stats["forward_plan_length"] == 8
    assert stats["pass_kind"] == "sample" and stats["misses"] == 0
    handle.detach(release=True)


def test_a_pass_that_runs_a_group_twice_is_recorded_whole(daemon):
    """A pass ends when the attached model's forward returns, not when its first group comes
    again: a block run twice in one pass (A, B, A, ...) stays in the forward plan."""
    ref, model, handle = make_pair(daemon)
    ref.order = model.order = [0, 1, 0, *range(2, BLOCKS)]
    sample(ref, model, 1)
    assert handle._passes.forward == model.order
    before, misses = counts(handle, "sample"), handle.stats()["misses"]
    sample(ref, model, 3)
    assert delta(counts(handle, "sample"), before) == (27, 27, 0), "every acquire on the plan"
    assert handle.stats()["misses"] == misses
    handle.detach(release=True)


def test_a_pass_that_raises_is_not_recorded_as_the_forward_plan(daemon):
    ref, model, handle = make_pair(daemon)
    model.fail_at = 3
    with torch.no_grad(), pytest.raises(RuntimeError, match="stopped before block 3"):
        model(X)
    assert not handle.stats()["forward_plan_recorded"]
    model.fail_at = None
    sample(ref, model, 1)
    assert handle._passes.forward == list(range(BLOCKS)), "the next pass from its start"
    before = counts(handle, "sample")
    sample(ref, model, 2)
    assert delta(counts(handle, "sample"), before) == (16, 16, 0)
    handle.detach(release=True)


def test_sampling_after_training_follows_the_forward_plan(daemon):
    ref, model, handle = make_pair(daemon)
    train(ref, model, 2)
    assert counts(handle, "sample") == (0, 0, 0)
    before = counts(handle, "sample")
    sample(ref, model, 1)
    # The training lookahead's copy of block 0 (the next step's first) is kept: all 8 hit.
    # (A step is 15 acquires: block 0 has no backward, its input needs no gradient.)
    assert delta(counts(handle, "sample"), before) == (8, 8, 0)
    sample(ref, model, 4)
    assert delta(counts(handle, "sample"), before) == (40, 40, 0)
    handle.detach(release=True)


def daemon_kinds(handle):
    """The daemon's statistics of the session and its counters per pass kind, once it has
    taken every acquire the handle sent (ListSessions reads them on another connection than the
    Run stream), from one reading in which every ended copy is counted under its kind too (a
    copy that ends while the daemon reads them may be in the total and not yet in its kind;
    the session has no resident groups, whose copies count in the total only)."""
    deadline = time.monotonic() + 10
    while True:
        s = handle.session.stats()
        counted = s.bytes_copied == sum(k.bytes_copied for k in s.kinds)
        if (s.acquires == handle.session.submitted and counted) or time.monotonic() > deadline:
            break
    assert s.acquires == handle.session.submitted and counted
    return s, {k.kind: k for k in s.kinds}


def test_the_daemon_counts_sampling_and_training_passes_under_their_kinds(daemon):
    ref, model, handle = make_pair(daemon)
    sample(ref, model, 2)
    stats, kinds = daemon_kinds(handle)
    sampled = handle.session.submitted
    assert list(kinds) == ["train", "sample"]
    assert (kinds["train"].acquires, kinds["train"].bytes_copied) == (0, 0)
    assert kinds["sample"].acquires == sampled >= 16
    assert kinds["sample"].hits + kinds["sample"].misses == sampled
    assert kinds["sample"].bytes_copied == stats.bytes_copied > 0
    train(ref, model, 1)
    _, kinds = daemon_kinds(handle)
    # The acquires in flight at the switch were sent for sampling: they stay counted there.
    assert kinds["sample"].acquires == sampled
    assert kinds["train"].acquires == handle.session.submitted - sampled >= 15
    assert kinds["train"].hits + kinds["train"].misses == kinds["train"].acquires
    assert handle.stats()["kinds"]["sample"]["acquires"] == sampled, "Handle.stats() too"
    handle.detach(release=True)


def test_a_training_step_after_sampling_hits_as_one_before_it(daemon):
    ref, model, handle = make_pair(daemon)
    train(ref, model, 2)
    before = counts(handle, "train")
    train(ref, model, 1)
    step = delta(counts(handle, "train"), before)
    assert step == (15, 15, 0), "forward and backward, every acquire in flight"
    sample(ref, model, 3)
    before = counts(handle, "train")
    train(ref, model, 1)
    assert delta(counts(handle, "train"), before) == step
    assert handle.stats()["train_passes"] == 3, "the steps after the first"
    handle.detach(release=True)


def test_training_plan_is_recorded_without_the_sampling_passes(daemon):
    ref, model, handle = make_pair(daemon)
    sample(ref, model, 2)
    train(ref, model, 2)
    forward = list(range(BLOCKS))
    backward = forward[:0:-1]  # block 0's input needs no gradient: no backward acquire
    assert handle._passes.train == forward + backward
    assert handle.session.last_plan == forward + backward
    sample(ref, model, 1)
    assert handle.session.last_plan == forward, "the daemon follows the forward plan"
    handle.detach(release=True)


@pytest.mark.parametrize("guidance", ["two passes", "batch of two"])
def test_classifier_free_guidance_streams_the_same(daemon, guidance):
    ref, model, handle = make_pair(daemon)
    train(ref, model, 2)
    uncond = torch.zeros_like(X)
    before = counts(handle, "sample")
    with torch.no_grad():
        for _ in range(4):
            if guidance == "two passes":
                got = [model(X), model(uncond)]
                want = [ref(X), ref(uncond)]
            else:
                got, want = [model(torch.cat([X, uncond]))], [ref(torch.cat([X, uncond]))]
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    passes = 8 if guidance == "two passes" else 4
    assert delta(counts(handle, "sample"), before) == (8 * passes, 8 * passes, 0)
    handle.detach(release=True)


def test_a_pass_off_both_plans_falls_back_to_on_demand(daemon):
    """The forward plan is the first pass as it ran (block 5 left out); a later pass that runs
    block 5 acquires it off the plan, on demand, and the lookahead resyncs after it."""
    ref, model, handle = make_pair(daemon)
    ref.skip = model.skip = {5}
    sample(ref, model, 2)
    assert handle._passes.forward == [0, 1, 2, 3, 4, 6, 7]
    # The first pass along the module order misses block 6 (block 5's copy was in flight);
    # the second, along the pass as it ran, hits from its first acquire on.
    assert counts(handle, "sample") == (14, 12, 0)
    ref.skip = model.skip = set()
    before = counts(handle, "sample")
    sample(ref, model, 2)
    # Per pass: block 5 off the plan, and block 6, whose copy went back at block 5's miss.
    assert delta(counts(handle, "sample"), before) == (16, 12, 2)
    train(ref, model, 2)  # training is unaffected
    handle.detach(release=True)


def test_sampling_while_another_thread_trains_is_refused(daemon):
    ref, model, handle = make_pair(daemon)
    train(ref, model, 2)
    inside, go_on = threading.Event(), threading.Event()

    def wait_in_block_4(module, args):
        inside.set()
        assert go_on.wait(60)

    hook = model.blocks[4].register_forward_pre_hook(wait_in_block_4)
    losses = []
    trainer = threading.Thread(target=lambda: losses.append(model(X).pow(2).mean()))
    trainer.start()
    assert inside.wait(60)
    hook.remove()
    with pytest.raises(wst.ConcurrentPasses) as raised, torch.no_grad():
        model(X)
    go_on.set()
    trainer.join(60)
    assert str(raised.value) == (
        f"a sampling pass (no_grad) in thread {threading.current_thread().name!r} while thread "
        f"{trainer.name!r} runs a training pass of the same attached module: the two would "
        "share its streamed groups' tickets. Sample between training steps in the training "
        "thread, or attach a second copy of the model for the other thread."
    )
    assert torch.equal(losses[0], ref(X).pow(2).mean())
    sample(ref, model, 1)  # the trainer's pass ended: sampling runs again
    handle.detach(release=True)


def test_sampling_budget_grows_the_session_and_gives_it_back(daemon):
    ref, model, handle = make_pair(daemon, sample_vram_budget=f"{8 * BLOCK_BYTES}")
    train(ref, model, 2)
    before = counts(handle, "train")
    train(ref, model, 1)
    step = delta(counts(handle, "train"), before)
    with handle.sampling():
        assert handle.vram_budget == 8 * BLOCK_BYTES
        resident = [g.resident for g in handle.session.groups]
        assert resident.count(True) == 5, "staging for three blocks, the rest resident"
        before = counts(handle, "sample")
        sample(ref, model, 4)
        # The grown session's first acquires went in flight at the reopen: every one hits.
        assert delta(counts(handle, "sample"), before) == (12, 12, 0)
    assert handle.vram_budget == 3 * BLOCK_BYTES
    assert not any(g.resident for g in handle.session.groups)
    assert handle._recording is None, "the training plan was kept"
    before = counts(handle, "train")
    train(ref, model, 1)
    # The shrunk session's first acquires went in flight at the reopen, where the training
    # step's plan adopted them: it hits as the step before sampling did.
    assert delta(counts(handle, "train"), before) == step
    # The forward plan was recorded with five groups resident: it keeps them, and sampling at
    # the training budget streams them along it.
    assert handle._passes.forward == list(range(BLOCKS))
    before = counts(handle, "sample")
    sample(ref, model, 2)
    assert delta(counts(handle, "sample"), before) == (16, 16, 0)
    handle.detach(release=True)


@pytest.mark.parametrize(
    "blocks, staging, staged, resident",
    [
        (10, None, 3, [True, True, True, True, False, True, True, True]),
        (10, f"{4 * BLOCK_BYTES}", 4, [True, True, False, True, True, True, False, True]),
        (13, None, 3, [True] * BLOCKS),  # the daemon's own split would stage 3.25 blocks
    ],
)
def test_the_sampling_budget_stages_three_groups_and_keeps_the_rest_resident(
    daemon, blocks, staging, staged, resident
):
    """At a sampling budget of ``blocks`` blocks: staging for three (the default, where the
    daemon's own split keeps a quarter of the budget) or for ``sample_staging_bytes``, the rest
    resident, spread along the pass; the outputs stay equal."""
    ref, model, handle = make_pair(
        daemon, sample_vram_budget=f"{blocks * BLOCK_BYTES}", sample_staging_bytes=staging
    )
    train(ref, model, 1)
    with handle.sampling():
        assert handle.session.opened.staging_bytes == staged * BLOCK_BYTES
        assert [g.resident for g in handle.session.groups] == resident
        sample(ref, model, 2)
    assert handle.session.opened.staging_bytes == 3 * BLOCK_BYTES, "training's split is back"
    handle.detach(release=True)


class Trainer:
    """A trainer probe for ``AutoSample``: the allocator's figures it is told."""

    def __init__(self):
        self.started = 0
        self.memory = wst.budget.TrainerMemory()

    def start(self):
        self.started += 1

    def __call__(self):
        return self.memory


def test_an_auto_sampling_budget_measures_the_first_block_then_grows_into_what_is_free(daemon):
    """``sample_vram_budget="auto"``: the first ``sampling()`` block, with the trainer's need
    not known yet, grows the session into half of what is free beyond the margin (6 blocks:
    3 held + (7 free - 1 margin) / 2) and measures the trainer's own memory over it; a later
    block grows the session to what it holds, plus what the device has free, less that and
    the margin (here 8 blocks: 3 held + 7 free - 1 measured - 1 margin); each gives it back
    after; a gain under one block reopens nothing, and the growth stops at every group
    resident plus one of staging."""
    free = [7 * BLOCK_BYTES]
    trainer = Trainer()
    auto = wst.passes.AutoSample(
        margin=BLOCK_BYTES, probe=lambda: (free[0], 100 * BLOCK_BYTES), trainer_probe=trainer
    )
    ref, model, handle = make_pair(daemon, sample_vram_budget=auto)
    assert handle.options.sample_vram_budget is auto and handle._passes.auto is auto
    train(ref, model, 1)
    session = handle.session.id
    trainer.memory = wst.budget.TrainerMemory(
        peak_allocated=5 * BLOCK_BYTES, allocated=4 * BLOCK_BYTES, start_allocated=4 * BLOCK_BYTES
    )
    with handle.sampling():
        assert handle.vram_budget == 6 * BLOCK_BYTES and handle.session.id != session
        assert handle.session.opened.staging_bytes == 3 * BLOCK_BYTES
        sample(ref, model, 2)
    assert (trainer.started, auto.need, auto.chosen) == (1, BLOCK_BYTES, 6 * BLOCK_BYTES)
    assert handle.vram_budget == 3 * BLOCK_BYTES
    with handle.sampling():
        assert handle.vram_budget == 8 * BLOCK_BYTES
        assert handle.session.opened.staging_bytes == 3 * BLOCK_BYTES
        assert [g.resident for g in handle.session.groups].count(True) == 5
        sample(ref, model, 2)
    assert handle.vram_budget == 3 * BLOCK_BYTES and handle.session.id != session
    stats = handle.stats()
    assert (stats["sample_auto_need"], stats["sample_auto_budget"]) == (
        BLOCK_BYTES,
        8 * BLOCK_BYTES,
    )
    # Less than a block to gain (3 held + 2.5 free - 1 - 1): the session stays as it is.
    free[0] = 5 * BLOCK_BYTES // 2
    session = handle.session.id
    with handle.sampling():
        assert (handle.session.id, handle.vram_budget) == (session, 3 * BLOCK_BYTES)
        sample(ref, model, 1)
    assert auto.chosen == 3 * BLOCK_BYTES
    # Room for more than the model: every group resident and one group of staging.
    free[0] = 100 * BLOCK_BYTES
    with handle.sampling():
        assert handle.vram_budget == (BLOCKS + 1) * BLOCK_BYTES
        assert all(g.resident for g in handle.session.groups)
        sample(ref, model, 1)
    handle.detach(release=True)


@pytest.mark.no_daemon
def test_sample_vram_budget_takes_auto():
    assert wst.StreamOptions(sample_vram_budget=" Auto ").sample_vram_budget == "auto"
    options = wst.StreamOptions(sample_vram_budget="auto", sample_staging_bytes="1GiB")
    assert options.sample_staging_bytes == 1 << 30


def test_a_sampling_staging_under_the_largest_group_is_refused_at_attach(daemon):
    with pytest.raises(wst.passes.SampleBudgetError) as e:
        make_pair(
            daemon,
            sample_vram_budget=f"{10 * BLOCK_BYTES}",
            sample_staging_bytes=f"{BLOCK_BYTES - 1}",
        )
    assert str(e.value) == (
        f"sample_staging_bytes={BLOCK_BYTES - 1} is smaller than the largest streamed group "
        f"({BLOCK_BYTES} bytes): give at least {BLOCK_BYTES} bytes, or None for 3 of the "
        "largest group"
    )
    assert daemon.client.list_sessions() == [], "refused before a session was opened"


def test_sample_staging_bytes_is_part_of_the_sampling_budget():
    with pytest.raises(ValueError) as e:
        wst.StreamOptions(sample_vram_budget="1GiB", sample_staging_bytes="2GiB")
    assert str(e.value) == (
        "sample_staging_bytes=2147483648: it is part of sample_vram_budget (1073741824); set "
        "sample_vram_budget at least as large"
    )
    with pytest.raises(ValueError, match="part of sample_vram_budget \\(None\\)"):
        wst.StreamOptions(sample_staging_bytes="1GiB")


@pytest.mark.no_daemon
@pytest.mark.parametrize(
    "recorded, before, resident, expected",
    [
        ([5, 6, 7], list(range(8)), {0, 1, 2, 3, 4}, list(range(8))),
        ([1, 3], [0, 1, 2, 3, 4], {0, 2, 4}, [0, 1, 2, 3, 4]),
        # the pass's order wins; each resident group goes before the recorded one after it
        ([3, 1], [0, 1, 2, 3], {0, 2}, [2, 3, 0, 1]),
        ([1, 2], [0, 1, 2], set(), [1, 2]),  # nothing resident: the pass as it ran
        ([1, 2], [0, 1, 2], {1}, [1, 2]),  # resident but acquired: not put back twice
    ],
)
def test_a_recorded_forward_plan_keeps_the_resident_groups(recorded, before, resident, expected):
    assert wst.passes.with_resident(recorded, before, frozenset(resident)) == expected


def test_a_sampling_budget_larger_than_the_device_is_refused(daemon):
    info = daemon.client.info()
    device = info.devices[0]
    limit = min(
        (device.total_memory, f"the device's memory ({device.name})"),
        (info.quotas.max_device_bytes[0], "the daemon's max_device_bytes"),
    )
    too_big = limit[0] + 1
    expected = (
        f"sample_vram_budget={wst.passes.size_text(too_big)} ({too_big} bytes) is more than "
        f"{limit[1]}: {wst.passes.size_text(limit[0])} ({limit[0]} bytes); set it at most "
        "that, less what the trainer's sampling passes need on the device"
    )
    torch.manual_seed(0)
    with pytest.raises(wst.SampleBudgetError) as raised:
        wst.attach(
            Net().requires_grad_(False),
            "cpu",
            client=daemon.client,
            min_bytes=0,
            sample_vram_budget=too_big,
        )
    assert str(raised.value) == expected
    assert daemon.client.list_models().models == [], "refused before the upload"
    ref, model, handle = make_pair(daemon)
    handle.options = handle.options.__class__(sample_vram_budget=too_big)
    session = handle.session.id
    with pytest.raises(wst.SampleBudgetError) as raised, handle.sampling():
        pass
    assert str(raised.value) == expected
    assert handle.session.id == session and handle.vram_budget == 3 * BLOCK_BYTES
    sample(ref, model, 1)
    handle.detach(release=True)


@pytest.mark.no_daemon
@pytest.mark.parametrize(
    "value,expected",
    [(None, None), (1 << 30, 1 << 30), ("2GiB", 2 << 30), ("1.5 GB", 1_500_000_000)],
)
def test_sample_vram_budget_takes_sizes(value, expected):
    assert wst.StreamOptions(sample_vram_budget=value).sample_vram_budget == expected


@pytest.mark.no_daemon
@pytest.mark.parametrize(
    "value,message",
    [
        (
            "lots",
            "sample_vram_budget: 'lots' is not a size (bytes, or a number with B, KiB, "
            "MiB, GiB, TiB, KB, MB, GB or TB)",
        ),
        (0, "sample_vram_budget: 0 bytes; expected None, 'auto' or a size above 0"),
        (-1, "sample_vram_budget: -1 is negative"),
    ],
)
def test_sample_vram_budget_refuses_what_is_not_a_size(value, message):
    with pytest.raises(ValueError) as raised:
        wst.StreamOptions(sample_vram_budget=value)
    assert str(raised.value) == message


def test_the_forward_plan_has_resident_groups_where_they_ran(daemon):
    """A first sampling pass recorded at a sampling budget, some groups resident there: the
    forward plan has them where their layers ran, not where the module order has them, so
    that at the training budget, which streams them, every acquire is in flight (a model run
    out of its declaration order: blocks swapped in pairs)."""
    ref, model, handle = make_pair(daemon, sample_vram_budget=f"{6 * BLOCK_BYTES}")
    ref.order = model.order = [1, 0, 3, 2, 5, 4, 7, 6]
    with handle.sampling():
        resident = [i for i, g in enumerate(handle.session.groups) if g.resident]
        assert len(resident) == 3
        sample(ref, model, 3)
    stats = handle.stats()
    assert stats["forward_plan_recorded"] and handle._passes.forward == model.order
    assert stats["sample_passes"] == 3
    before = counts(handle, "sample")
    sample(ref, model, 3)
    assert delta(counts(handle, "sample"), before) == (24, 24, 0)
    assert handle.stats()["sample_passes"] == 6
    handle.detach(release=True)


def test_running_out_of_memory_at_the_sampling_budget_says_which_budget(daemon):
    """An out-of-memory error in a block the session grew for carries a note naming the
    budget and what to do; the session is back at the training budget."""
    ref, model, handle = make_pair(daemon, sample_vram_budget=f"{6 * BLOCK_BYTES}")
    with pytest.raises(torch.OutOfMemoryError) as e:
        with handle.sampling():
            sample(ref, model, 1)
            raise torch.OutOfMemoryError("out of memory")
    assert e.value.__notes__ == [
        f"weightstream: the session had grown to sample_vram_budget={6 * BLOCK_BYTES} bytes "
        f"for these passes, from {3 * BLOCK_BYTES} bytes; a smaller sample_vram_budget, or "
        "none, leaves the trainer more of the device"
    ]
    assert handle.vram_budget == 3 * BLOCK_BYTES
    with pytest.raises(ValueError) as e:  # any other error passes as it is
        with handle.sampling():
            raise ValueError("x")
    assert not hasattr(e.value, "__notes__")
    handle.detach(release=True)


def test_passes_are_counted_at_the_first_streamed_group_of_each_session(daemon):
    """A pass is counted at the forward plan's first streamed group: block 0 at the training
    budget, and at a sampling budget that keeps block 0 resident, the first block it streams."""
    ref, model, handle = make_pair(daemon, sample_vram_budget=f"{9 * BLOCK_BYTES}")
    sample(ref, model, 3)
    assert handle.stats()["sample_passes"] == 3
    with handle.sampling():
        assert handle.session.groups[0].resident
        sample(ref, model, 3)
    sample(ref, model, 2)
    assert handle.stats()["sample_passes"] == 8
    handle.detach(release=True)


def test_the_trainer_gives_its_idle_segments_up_to_grow_and_makes_them_again_after(
    daemon, monkeypatch
):
    """A fixed sampling budget: the trainer's idle device segments are given back before the
    session grows, and made again after it shrinks."""
    _, model, handle = make_pair(daemon, sample_vram_budget=f"{8 * BLOCK_BYTES}")
    events, given = [], [(20 << 20, 0, False)]

    def give_back(device):
        events.append(("give back", handle.vram_budget))
        return given

    monkeypatch.setattr(ws_passes, "_give_back", give_back)

    def restore(device, segments):
        events.append(("restore", segments, handle.vram_budget))
        return 1, 20 << 20

    monkeypatch.setattr(ws_passes, "_restore_segments", restore)
    assert handle.stats()["sampling_segments_given"] == 0
    with handle.sampling():
        events.append(("passes", handle.vram_budget))
    assert events == [
        ("give back", 3 * BLOCK_BYTES),
        ("passes", 8 * BLOCK_BYTES),
        ("restore", given, 3 * BLOCK_BYTES),
    ]
    stats = handle.stats()
    got = [stats[f"sampling_segments_{k}"] for k in ("given", "made", "made_bytes")]
    assert got == [1, 1, 20 << 20]
    handle.detach(release=True)


class Allocator:
    """torch's CUDA allocator as ``_idle_segments`` and ``_restore_segments`` see it: its
    snapshot, ``empty_cache``, streams, and ``torch.empty`` (recorded, failing after
    ``room`` bytes)."""

    def __init__(self, monkeypatch, segments=(), room=1 << 40):
        self.segments, self.room, self.asked, self.emptied = list(segments), room, [], 0
        self.stream = None
        cuda = torch.cuda
        monkeypatch.setattr(cuda.memory, "get_allocator_backend", lambda: "native")
        monkeypatch.setattr(cuda, "memory_snapshot", lambda include_traces: self.segments)
        monkeypatch.setattr(cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(cuda, "default_stream", lambda device: SimpleStream(0))
        monkeypatch.setattr(cuda, "ExternalStream", lambda p, device: SimpleStream(p))
        monkeypatch.setattr(cuda, "stream", self.use)
        monkeypatch.setattr(torch, "empty", self.empty)

    def empty_cache(self):
        self.emptied += 1

    @contextlib.contextmanager
    def use(self, stream):
        self.stream = stream.cuda_stream
        yield
        self.stream = None

    def empty(self, n, dtype, device):
        if sum(a for a, _ in self.asked) + n > self.room:
            raise torch.OutOfMemoryError("out of memory")
        self.asked.append((n, self.stream))


@dataclass
class SimpleStream:
    cuda_stream: int


def segment(size, stream=0, small=False, active=0, device=0, **more):
    kind = "small" if small else "large"
    return dict(
        total_size=size, stream=stream, segment_type=kind, active_size=active, device=device, **more
    )


def test_the_idle_segments_are_given_back_and_made_again_on_their_streams(monkeypatch):
    """Segments holding no tensor, of this device, are given back; made again, a large one is
    one allocation of its size, a small one (2 MiB) two of the small pool's 1 MiB."""
    alloc = Allocator(
        monkeypatch,
        [
            segment(64 << 20),
            segment(20 << 20, stream=7),
            segment(2 << 20, small=True),
            segment(40 << 20, active=512),  # a tensor lives there: it stays
            segment(30 << 20, device=1),
            segment(8 << 20, segment_pool_id=(1, 0)),  # a CUDA graph's pool
        ],
    )
    device = torch.device("cuda", 0)
    given = ws_passes._give_back(device)
    assert given == [(64 << 20, 0, False), (20 << 20, 7, False), (2 << 20, 0, True)]
    assert alloc.emptied == 1
    assert ws_passes._restore_segments(device, given) == (3, 86 << 20)
    assert alloc.emptied == 2, "sampling's own cached blocks first"
    assert alloc.asked == [(64 << 20, 0), (20 << 20, 7), (1 << 20, 0), (1 << 20, 0)]
    assert ws_passes._give_back(torch.device("cpu")) is None
    assert ws_passes._restore_segments(device, None) == (0, 0)


def test_making_segments_again_stops_where_the_device_has_less_free(monkeypatch):
    alloc = Allocator(monkeypatch, room=80 << 20)
    given = [(64 << 20, 0, False), (20 << 20, 0, False), (2 << 20, 0, True)]
    assert ws_passes._restore_segments(torch.device("cuda", 0), given) == (1, 64 << 20)
    assert alloc.asked == [(64 << 20, 0)]


def test_an_allocator_that_maps_memory_as_it_grows_gives_back_but_is_not_remade(monkeypatch):
    alloc = Allocator(monkeypatch, [segment(64 << 20, is_expandable=True)])
    assert ws_passes._give_back(torch.device("cuda", 0)) is None
    assert alloc.emptied == 1


def test_a_budget_shrunk_before_the_first_sampling_pass_streams_along_the_forward_plan(daemon):
    """The forward plan before any sampling pass is the module order of every group, those
    resident at attach too: a session opened again at a smaller budget streams them, and
    they are on the plan (they were off it, served on demand)."""
    ref, model = make_models()
    handle = wst.attach(
        model, "cpu", client=daemon.client, min_bytes=0, vram_budget=6 * BLOCK_BYTES
    )
    assert [g.resident for g in handle.session.groups].count(True) == 3
    handle.set_budget(3 * BLOCK_BYTES, keep_plan=True)
    assert not any(g.resident for g in handle.session.groups)
    sample(ref, model, 5)
    assert counts(handle, "sample") == (40, 39, 0)
    handle.detach(release=True)


def resident_copied(handle) -> int:
    """Bytes the session copied into its resident regions when it opened: the daemon counts
    them in its total, not under a pass kind (read while no copy is in flight)."""
    s = handle.session.stats()
    return s.bytes_copied - sum(k.bytes_copied for k in s.kinds)


def kept_resident_pair(daemon, lookahead=0):
    """A pair at a training budget of five blocks (three staged, blocks 1 and 5 resident) and
    a sampling budget of eight (three staged, blocks 0, 2, 3, 5 and 7 resident)."""
    ref, model = make_models()
    handle = wst.attach(
        model,
        "cpu",
        client=daemon.client,
        min_bytes=0,
        vram_budget=5 * BLOCK_BYTES,
        staging_bytes=3 * BLOCK_BYTES,
        sample_vram_budget=f"{8 * BLOCK_BYTES}",
        lookahead=lookahead,
    )
    assert [i for i, g in enumerate(handle.session.groups) if g.resident] == [1, 5]
    return ref, model, handle


def test_the_training_sessions_resident_groups_stay_on_the_device_through_sampling(daemon):
    """At the end of a ``sampling()`` block the session opens again at the training budget; the
    groups resident both at the sampling budget and at the training budget stay on the device
    meanwhile (a session of those alone holds them), and the reopened session shares them
    instead of copying them again: only the training set's other groups are copied. (No
    lookahead: no copy is in flight where the test reads the counts.)"""
    ref, model, handle = kept_resident_pair(daemon)
    trained = [1, 5]
    assert resident_copied(handle) == 2 * BLOCK_BYTES
    train(ref, model, 2)
    with handle.sampling():
        assert [i for i, g in enumerate(handle.session.groups) if g.resident] == [0, 2, 3, 5, 7]
        sample(ref, model, 2)
    assert [i for i, g in enumerate(handle.session.groups) if g.resident] == trained
    # Group 5, resident in both, was kept; group 1 was copied again. The session holds a
    # region per resident group: none of the sampling session's other groups stays with it.
    assert resident_copied(handle) == BLOCK_BYTES
    assert [r.size for r in handle.session.opened.regions[1:]] == [BLOCK_BYTES] * 2
    stats = handle.stats()
    kept = [stats[f"sampling_resident_kept_{k}"] for k in ws_passes.NOTHING_KEPT]
    assert kept == [1, BLOCK_BYTES, 3, 3 * BLOCK_BYTES], "and blocks 0, 2 and 3, staged first"
    # Only the training session is left open: the holder closed.
    assert [s.label for s in daemon.client.list_sessions()] == [handle.session.label]
    train(ref, model, 1)
    sample(ref, model, 1)
    handle.detach(release=True)


def test_the_groups_the_next_step_stages_first_are_staged_within_the_device(daemon):
    """Blocks 0, 2 and 3, resident at the sampling budget, are the first the reopened training
    session stages (its streamed blocks are 0, 2, 3, 4, 6 and 7, its staging three blocks):
    they stay on the device while it reopens, and the daemon stages them from there, within
    the device, before the block ends (the look-ahead's acquires answered): the next step
    finds them staged, and none of their bytes crossed the link."""
    ref, model, handle = kept_resident_pair(daemon, lookahead=None)
    train(ref, model, 2)
    with handle.sampling():
        sample(ref, model, 2)
    stats = handle.stats()
    kept = [stats[f"sampling_resident_kept_{k}"] for k in ws_passes.NOTHING_KEPT]
    assert kept == [1, BLOCK_BYTES, 3, 3 * BLOCK_BYTES]
    s = handle.session.stats()
    assert (s.bytes_from_device, s.bytes_copied - resident_copied(handle)) == (3 * BLOCK_BYTES, 0)
    assert [s.label for s in daemon.client.list_sessions()] == [handle.session.label]
    before = counts(handle, "train")
    train(ref, model, 1)
    acquires, hits, _ = delta(counts(handle, "train"), before)
    assert hits == acquires, (hits, acquires)
    sample(ref, model, 1)
    handle.detach(release=True)


def test_where_the_resident_groups_cannot_be_kept_the_session_copies_them_again(
    daemon, monkeypatch
):
    """The session that would hold them refused (the device's memory, a quota): the block ends
    as before, copying the training set's resident groups again."""
    ref, model, handle = kept_resident_pair(daemon)
    train(ref, model, 1)
    opened = []
    open_session = daemon.client.open_session

    def refusing(model_id, groups, vram_budget, **kwargs):
        opened.append(kwargs["label"])
        if kwargs["label"].endswith("(resident groups kept)"):
            raise RequestRejected("RESOURCE_EXHAUSTED", "vram_budget: over the device's memory")
        return open_session(model_id, groups, vram_budget, **kwargs)

    monkeypatch.setattr(daemon.client, "open_session", refusing)
    with handle.sampling():
        sample(ref, model, 2)
    assert opened == [
        handle.session.label,
        f"{handle.session.label} (resident groups kept)",
        handle.session.label,
    ]
    assert resident_copied(handle) == 2 * BLOCK_BYTES
    stats = handle.stats()
    assert (stats["sampling_resident_kept_groups"], stats["sampling_resident_kept_bytes"]) == (0, 0)
    train(ref, model, 1)
    handle.detach(release=True)
