"""Reliability of the Python client against a real daemon (host backend): a daemon killed or
stopped under a running trainer fails it within seconds, and ``Session.reconnect`` resumes the
trainer at its next step against the restarted daemon, in the same process; a trainer process
SIGKILLed mid-step leaves nothing behind. (Many more client kills, and the daemon's fds and
memory: ``daemon/cli/tests/faults.rs``.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch
import weightstream
from safetensors.torch import save_file

from tests.daemon import Daemon, memfds

#: How long a failure may take to reach the trainer once the daemon is gone.
FAIL_FAST = 5.0
#: Bound of every poll below.
DEADLINE = 30.0


def wait_until(what: str, cond, deadline: float = DEADLINE):
    """Polls ``cond`` until it holds; fails after ``deadline`` seconds."""
    end = time.monotonic() + deadline
    while not cond():
        assert time.monotonic() < end, f"no {what} within {deadline} s"
        time.sleep(0.02)


def serve(daemon) -> Daemon:
    """Another daemon on the fixture's socket (a restart), answering."""
    return Daemon(daemon.tmp, socket=daemon.socket, log=daemon.tmp / "restarted.log")


def stop(restarted: Daemon):
    if restarted.proc.poll() is None:
        assert restarted.stop() == 0


def layers(seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}.weight": torch.randn(64, 64, generator=g) for i in range(n)}


def order(n: int) -> list[int]:
    return list(range(n)) + list(reversed(range(n)))


def step(session, tensors: dict[str, torch.Tensor], plan: list[int], on_acquire=None):
    """One training-like step: every acquire checked against the tensors, exactly."""
    names = list(tensors)
    for i, g in enumerate(plan):
        ticket = session.acquire(g)
        assert torch.equal(ticket.tensors[0], tensors[names[g]]), names[g]
        if on_acquire is not None:
            on_acquire(i, ticket)
        session.release(ticket)


def fails_fast(session) -> Exception:
    started = time.monotonic()
    with pytest.raises(weightstream.DaemonUnavailable) as e:
        session.acquire(0)
    assert time.monotonic() - started < FAIL_FAST
    return e.value


def test_a_killed_daemon_fails_fast_and_reconnect_resumes_the_trainer(daemon, tmp_path):
    """The daemon is SIGKILLed mid-step while the trainer holds a ticket. The trainer's next
    acquire fails at once; its handler waits for the restarted daemon with ``reconnect``,
    which loads the model again from its file (same id) and re-sends the plan; the trainer
    goes on from the next step with exact bytes, in the same process."""
    tensors = layers(1)
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    manifest = daemon.client.load_model([str(path)])
    groups = [(n, [n]) for n in tensors]
    session = daemon.client.open_session(manifest.model_id, groups, 4 * 64 * 64 * 4)
    plan = order(len(groups))
    restarted = None
    held = []

    def kill_mid_step(i, ticket):
        if i == 3:
            held.append(ticket)  # a ticket the dead daemon staged
            daemon.proc.send_signal(signal.SIGKILL)
            daemon.proc.wait(timeout=30)

    done, failures = [], 0
    try:
        for n in range(6):  # a trainer's loop: the step that fails is not redone
            try:
                step(session, tensors, plan, kill_mid_step if n == 2 else None)
                if n == 0:
                    session.plan(plan)
                done.append(n)
            except weightstream.DaemonUnavailable:
                failures += 1
                fails_fast(session)  # and again, at once
                started = time.monotonic()
                with pytest.raises(weightstream.DaemonUnavailable, match="no daemon answered"):
                    session.reconnect(timeout=0.3)
                assert time.monotonic() - started < 3
                restarted = serve(daemon)
                assert memfds(restarted.pid) == [], "a new daemon holds nothing"
                assert session.reconnect() is session
        assert (done, failures) == ([0, 1, 3, 4, 5], 1)
        assert session.model_id == manifest.model_id and session.last_plan == plan
        listed = {m.model_id: m for m in daemon.client.list_models().models}
        assert (listed[manifest.model_id].refcount, listed[manifest.model_id].sessions) == (1, 1)
        session.release(held[0])  # of the dead session: dropped, no fault
        info = [s for s in daemon.client.list_sessions() if s.session_id == session.id]
        assert len(info) == 1 and info[0].plan_length == len(plan)
        s = session.stats()
        assert s.acquires == 3 * len(plan) and s.prefetches > 0, s
        session.close()
        assert daemon.client.release_model(manifest.model_id) == 0
        assert memfds(restarted.pid) == []
    finally:
        if restarted is not None:
            stop(restarted)


def test_a_stopped_daemon_fails_fast_and_reconnect_takes_a_restore_callback(daemon):
    """SIGTERM under a trainer streaming uploaded weights: the next acquire says the daemon
    is stopping. The restarted daemon has no such model, so ``reconnect()`` is refused with
    NOT_FOUND; ``reconnect(restore=...)`` uploads the same tensors again (same id)."""
    tensors = layers(2, 4)
    manifest, _ = daemon.client.upload_model("up", tensors)
    groups = [(n, [n]) for n in tensors]
    session = daemon.client.open_session(manifest.model_id, groups, 3 * 64 * 64 * 4)
    step(session, tensors, order(4))
    daemon.proc.terminate()
    assert daemon.proc.wait(timeout=30) == 0
    assert "stopping" in str(fails_fast(session))
    restarted = serve(daemon)
    try:
        with pytest.raises(weightstream.RequestRejected) as e:
            session.reconnect()
        assert e.value.code == "NOT_FOUND" and manifest.model_id in e.value.message
        uploads = []

        def restore(client):
            m, dedup = client.upload_model("up", tensors)
            uploads.append(dedup)
            return m

        session.reconnect(restore=restore)
        assert uploads == [False] and session.model_id == manifest.model_id
        for _ in range(2):
            step(session, tensors, order(4))
        session.close()
        assert daemon.client.release_model(manifest.model_id) == 0
    finally:
        stop(restarted)


def test_reconnect_against_a_live_daemon_replaces_the_session(daemon):
    """Reconnecting while the daemon is up tears the old session down (its staging goes),
    fails the ticket still in flight on it, and the new session streams exact bytes."""
    tensors = layers(3, 4)
    manifest, _ = daemon.client.upload_model("up", tensors)
    groups = [(n, [n]) for n in tensors]
    session = daemon.client.open_session(manifest.model_id, groups, 3 * 64 * 64 * 4)
    step(session, tensors, [0, 1])
    old = session.id
    in_flight = session.submit(2)
    session.reconnect()
    assert session.id != old
    with pytest.raises(weightstream.DaemonUnavailable, match="reconnected"):
        session.wait(in_flight)
    wait_until(
        "old session torn down",
        lambda: [s.session_id for s in daemon.client.list_sessions()] == [session.id],
    )
    assert daemon.memfds().count("staging") == 1
    step(session, tensors, order(4))
    session.close()


WORKER = """
import sys, torch, weightstream
client = weightstream.connect(sys.argv[1])
tensors = {f"l{i}.weight": torch.full((64, 64), float(i)) for i in range(4)}
manifest, _ = client.upload_model("w", tensors)
session = client.open_session(manifest.model_id, [(n, [n]) for n in tensors], 3 * 64 * 64 * 4)
held = [session.acquire(0), session.acquire(1)]
session.submit(2)
client.begin_upload("never", {"x": torch.empty(1024)})
print(manifest.model_id, flush=True)
sys.stdin.read()
"""


def test_a_killed_python_trainer_leaves_nothing_behind(daemon):
    """A trainer process SIGKILLed while it holds tickets, has an acquire in flight and an
    upload begun: its session, staging and upload go; the model it uploaded stays with the
    reference it held; another trainer is unaffected. Shared memory is counted among the
    daemon's fds (memfds): a committed upload is its model's arena."""
    tensors = layers(4, 4)
    manifest, _ = daemon.client.upload_model("other", tensors)
    groups = [(n, [n]) for n in tensors]
    other = daemon.client.open_session(manifest.model_id, groups, 3 * 64 * 64 * 4)
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, daemon.socket],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    worker_model = worker.stdout.readline().strip()
    assert worker_model.startswith("u-"), worker_model
    assert len(daemon.client.list_sessions()) == 2
    # Two committed uploads (the models) and the worker's upload in progress.
    assert daemon.memfds().count("upload") == 3
    worker.send_signal(signal.SIGKILL)
    assert worker.wait(timeout=30) == -signal.SIGKILL
    wait_until(
        "the killed trainer's session torn down",
        lambda: [s.session_id for s in daemon.client.list_sessions()] == [other.id],
    )
    wait_until("its upload dropped", lambda: daemon.memfds().count("upload") == 2)
    assert daemon.memfds().count("staging") == 1
    listed = {m.model_id: m for m in daemon.client.list_models().models}
    assert (listed[worker_model].refcount, listed[worker_model].sessions) == (1, 0)
    step(other, tensors, order(4))
    other.close()
    assert daemon.client.release_model(worker_model) == 0
    assert daemon.client.release_model(manifest.model_id) == 0
    wait_until("no shared memory left", lambda: daemon.memfds() == [])


def test_an_attached_model_resumes_after_a_daemon_restart(daemon):
    """weightstream.torch: the daemon dies mid-step; Handle.reconnect re-opens the session
    against a restarted daemon (re-uploading the same weights) and training resumes at the
    next step in the same process, still equal to the model with its weights in place."""
    import copy
    import signal

    import weightstream.torch as wst

    from tests.python.torch.test_torch import assert_equal_runs, inputs, make_model, train

    ref = make_model()
    model = copy.deepcopy(ref)
    weights = {n: p.detach().clone() for n, p in ref.named_parameters()}
    handle = wst.attach(model, "cpu", client=daemon.client, min_bytes=0, vram_budget=1 << 20)
    uploaded = {t.name: weights[t.name] for t in daemon.client.list_models().models[0].tensors}
    xs = inputs(4, torch.float32)
    train(ref, xs[:1])
    train(model, xs[:1])
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait(timeout=30)
    with pytest.raises(weightstream.DaemonUnavailable):
        train(model, xs[1:2])  # the failed step: dropped by both
    for p in model.parameters():
        p.grad = None
    restarted = serve(daemon)
    try:
        handle.reconnect(restore=lambda c: c.upload_model("again", uploaded)[0], timeout=30)
        assert_equal_runs(train(ref, xs[2:]), train(model, xs[2:]))
        handle.detach(release=True)
    finally:
        stop(restarted)
