"""The trainer's wait for weights (``gpu_wait_ns``): the CUDA timer's accounting against fake
events, and end to end on the host backend, where the wait is the time the client's thread
blocked for a ticket not yet staged; the daemon's ``acquire_pending_ns`` is apart from it."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import torch
import weightstream.torch as wst
from weightstream._wait_timer import WaitTimer

from tests.daemon import BIN
from tests.python.torch.test_torch import inputs, make_model, train

# --- the CUDA timer, against fake events --------------------------------------------------


class FakeEvent:
    """A timing event whose completion and time the test sets; it refuses to be waited for
    unless the test allows it."""

    def __init__(self, clock):
        self.clock = clock
        self.done = False
        self.at_ms = None
        self.may_block = False

    def record(self, stream):
        stream.recorded.append(self)
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        assert self.may_block, "the timer waited for an event"
        self.done = True

    def elapsed_time(self, end):
        assert self.done and end.done, "elapsed time of an event not done"
        return end.at_ms - self.at_ms


class FakeStream:
    def __init__(self):
        self.recorded = []


class Sink:
    def __init__(self):
        self.adds = []

    def __call__(self, group, ns, step):
        self.adds.append((group, ns, step))


def complete(event, at_ms):
    event.done, event.at_ms = True, at_ms


def make_timer(limit=1024):
    made = []

    def new_event():
        made.append(FakeEvent(None))
        return made[-1]

    sink = Sink()
    return WaitTimer(sink, new_event, limit), sink, made


def test_waits_are_harvested_exactly_once_done_and_never_waited_for():
    timer, sink, made = make_timer()
    stream = FakeStream()
    b1 = timer.start(stream)
    timer.finish(b1, stream, group=3, step=0)
    b2 = timer.start(stream)
    timer.finish(b2, stream, group=5, step=1)
    a1, a2 = stream.recorded[1], stream.recorded[3]
    timer.harvest()
    assert sink.adds == [] and timer.pending == 2, "nothing is done yet"
    # The second pair is done first (another stream): it waits behind the first.
    complete(b2, 10.0)
    complete(a2, 10.25)
    timer.harvest()
    assert sink.adds == [] and timer.pending == 2
    complete(b1, 1.0)
    complete(a1, 3.5)
    timer.harvest()
    # Milliseconds to nanoseconds, each wait once, with the step it was recorded in.
    assert sink.adds == [(3, 2_500_000, 0), (5, 250_000, 1)]
    assert timer.pending == 0
    timer.harvest()
    assert len(sink.adds) == 2
    # The four events are reused for the next pair.
    b3 = timer.start(stream)
    timer.finish(b3, stream, group=0, step=2)
    assert len(made) == 4


def test_past_the_limit_the_oldest_pair_is_waited_for():
    timer, sink, made = make_timer(limit=2)
    stream = FakeStream()
    for group in range(2):
        timer.finish(timer.start(stream), stream, group=group, step=0)
    assert timer.pending == 2
    first_before, first_after = stream.recorded[0], stream.recorded[1]
    first_before.done, first_before.at_ms = True, 0.0
    first_after.at_ms, first_after.may_block = 0.004, True
    timer.finish(timer.start(stream), stream, group=2, step=0)
    assert sink.adds == [(0, 4000, 0)]
    assert timer.pending == 2


# --- end to end on the host backend ---------------------------------------------------------


def session_info(client, session_id):
    return next(s for s in client.list_sessions() if s.session_id == session_id)


def reported(client, session, what):
    """The daemon's view of the session once it has every report the client sent (reports
    travel on the session's stream, ListSessions on another call)."""
    sent = session._native.gpu_wait_reports
    deadline = time.monotonic() + 30
    while (info := session_info(client, session.id)).stats.gpu_wait_reports != sent:
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return info


def model(client, groups: int, floats: int):
    g = torch.Generator().manual_seed(3)
    tensors = {f"w{i}": torch.randn(floats, generator=g) for i in range(groups)}
    manifest, _ = client.upload_model("gpu-wait", tensors)
    return manifest.model_id, [(name, [name]) for name in tensors]


def test_acquires_staged_before_the_wait_cost_the_trainer_nothing(daemon):
    client = daemon.client
    model_id, groups = model(client, 4, 16384)
    budget = 4 * 65536
    session = client.open_session(model_id, groups, budget, staging_bytes=budget)
    numbers = [session.submit(g) for g in range(4)]
    tickets = {}
    deadline = time.monotonic() + 30
    # Poll without blocking until every reply is there: the trainer never waits.
    while len(tickets) < 4:
        for n in numbers:
            if n not in tickets and (t := session.poll(n)) is not None:
                tickets[n] = t
        assert time.monotonic() < deadline, "the acquires were never staged"
        time.sleep(0.001)
    for t in tickets.values():
        session.release(t)  # the first release carries the first report
    info = reported(client, session, "the first report")
    st = info.stats
    assert st.gpu_wait_reports >= 1
    assert (st.gpu_wait_ns, st.gpu_waits) == (0, 0)
    # Nor did the thread block for a reply.
    replies = session.reply_wait()
    assert (replies.total_ns, replies.waits, replies.by_group) == (0, 0, [0, 0, 0, 0])
    assert info.group_gpu_wait_ns == [0, 0, 0, 0]
    # The daemon saw each acquire pending while its copy ran: its own figure, not a wait.
    assert st.acquire_pending_ns > 0
    assert sum(info.group_acquire_pending_ns) == st.acquire_pending_ns
    assert not hasattr(st, "stall_ns") and not hasattr(info, "group_stall_ns"), "the old names went"
    session.close()


def test_a_wait_for_a_slow_copy_is_the_trainers_wait_in_every_view(daemon):
    """Copies capped at 100 MB/s: the share's 16 MiB burst lets two 12 MiB copies go at once,
    the third waits ~84 ms for the debt; every acquire blocks at least for its reply.
    ListSessions, `status --json` and the client's own totals agree exactly, per group too."""
    client = daemon.client
    model_id, groups = model(client, 3, 3 << 20)
    budget = 3 * (12 << 20)
    session = client.open_session(
        model_id, groups, budget, staging_bytes=budget, copy_bandwidth_limit=100_000_000
    )
    for g in range(3):
        session.release(session.acquire(g))
    mine = session.gpu_wait()
    assert mine.total_ns > 0 and mine.waits > 0
    assert sum(mine.by_group) == mine.total_ns
    assert mine.by_group[1] > 0 and mine.by_group[2] > 0, mine
    session.report_gpu_wait()
    info = reported(client, session, "the report")
    assert (info.stats.gpu_wait_ns, info.stats.gpu_waits) == (mine.total_ns, mine.waits)
    assert info.group_gpu_wait_ns == list(mine.by_group)

    out = subprocess.run(
        [BIN, "status", "--socket", daemon.socket, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    [shown] = [s for s in json.loads(out.stdout)["sessions"] if s["session_id"] == session.id]
    assert shown["stats"]["gpu_wait_ns"] == mine.total_ns
    assert shown["stats"]["gpu_wait_reports"] == info.stats.gpu_wait_reports
    assert shown["group_gpu_wait_ns"] == list(mine.by_group)
    assert shown["stats"]["acquire_pending_ns"] > 0
    assert "stall_ns" not in shown["stats"]
    session.close()


def test_a_report_naming_a_group_the_session_lacks_is_refused_by_the_client(daemon):
    client = daemon.client
    model_id, groups = model(client, 2, 16384)
    session = client.open_session(model_id, groups, 2 * 65536)
    with pytest.raises(ValueError, match="group 2 is out of range: the session has 2 groups"):
        session._native.add_gpu_wait(2, 5)
    session.close()


def test_handle_stats_split_the_wait_by_group_and_step(daemon):
    model = make_model()
    handle = wst.attach(
        model, "cpu", client=daemon.client, min_bytes=0, vram_budget=1 << 20, staging_bytes=1 << 20
    )
    train(model, inputs(3, torch.float32))
    stats = handle.stats()
    by_group = stats["gpu_wait_by_group"]
    assert list(by_group) == [g.name for g in handle.session.groups]
    assert stats["gpu_wait_ns"] == sum(by_group.values())
    # Three steps: the first two are complete (each ends where the next one's first acquire
    # starts), the third is in progress.
    per_step = stats["gpu_wait_ns_per_step"]
    assert len(per_step) == 2
    assert stats["gpu_wait_ns"] == sum(per_step) + stats["gpu_wait_ns_this_step"]
    # The first step has no plan: its acquires wait at least for the daemon's reply.
    assert per_step[0] > 0
    assert stats["gpu_waits"] > 0
    # On the host the blocked thread is the compute: its reply wait is the wait.
    assert (stats["reply_wait_ns"], stats["reply_waits"]) == (
        stats["gpu_wait_ns"],
        stats["gpu_waits"],
    )
    assert stats["reply_wait_by_group"] == by_group
    handle.session.report_gpu_wait()
    info = reported(daemon.client, handle.session, "the report")
    assert info.stats.gpu_wait_ns == stats["gpu_wait_ns"]
    handle.detach(release=True)
