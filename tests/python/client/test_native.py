"""The native client's process model: a client made before ``os.fork()`` works in the child (a
DataLoader worker) while the parent's session stays the parent's; the hot path starts no Python
thread; blocking calls release the GIL; ``release_and_acquire``."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import weightstream

#: A child that has not finished by then is killed (SIGALRM), failing the test instead of
#: hanging it.
CHILD_DEADLINE = 30


def upload(client, n: int = 4):
    tensors = {f"l{i}": torch.full((256,), float(i)) for i in range(n)}
    manifest, _ = client.upload_model("native", tensors)
    return manifest, tensors, [(name, [name]) for name in tensors]


def in_child(body) -> tuple[int, str]:
    """Runs ``body()`` in a forked child; its exit code and what it reported."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            signal.alarm(CHILD_DEADLINE)
            os.write(w, str(body()).encode())
            code = 0
        except BaseException as e:  # reported to the parent
            os.write(w, f"{type(e).__name__}: {e}".encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        said = f.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), said


def test_a_client_made_before_fork_works_in_the_child(daemon):
    client = daemon.client
    manifest, tensors, groups = upload(client)
    session = client.open_session(manifest.model_id, groups, 1 << 20)
    session.release(session.acquire(0))  # the parent's runtime and stream are busy

    def child():
        with pytest.raises(weightstream.WeightstreamError, match="before a fork"):
            session.acquire(1)
        assert [m.model_id for m in client.list_models().models] == [manifest.model_id]
        with client.open_session(manifest.model_id, groups, 1 << 20) as mine:
            for g, name in enumerate(tensors):
                ticket = mine.acquire(g)
                assert torch.equal(ticket.tensors[0], tensors[name])
                mine.release(ticket)
        return "ok"

    assert in_child(child) == (0, "ok")
    # The parent's session goes on, and only it is left.
    for g, name in enumerate(tensors):
        ticket = session.acquire(g)
        assert torch.equal(ticket.tensors[0], tensors[name])
        session.release(ticket)
    assert [s.session_id for s in client.list_sessions()] == [session.id]
    session.close()


def test_dataloader_workers_use_the_parents_client(daemon):
    manifest, _, _ = upload(daemon.client)

    class Models(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return len(daemon.client.list_models().models) + i

    loader = torch.utils.data.DataLoader(
        Models(), batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    assert sorted(int(x) for x in loader) == [1, 2, 3, 4]
    assert daemon.client.release_model(manifest.model_id) == 0


def test_the_hot_path_starts_no_python_thread(daemon):
    before = threading.active_count()
    client = weightstream.connect(daemon.socket)
    manifest, tensors, groups = upload(client)
    session = client.open_session(manifest.model_id, groups, 1 << 20)
    for _ in range(3):
        for g in range(len(groups)):
            session.release(session.acquire(g))
        numbers = [session.submit(g) for g in range(len(groups))]
        for n in numbers:
            session.release(session.wait(n))
    assert threading.active_count() == before
    session.close()
    assert threading.active_count() == before


def test_release_and_acquire_is_one_call(daemon):
    manifest, tensors, groups = upload(daemon.client)
    names = list(tensors)
    with daemon.client.open_session(manifest.model_id, groups, 1 << 20) as session:
        ticket = session.acquire(0)
        for g in [1, 2, 3, 0]:
            ticket = session.release_and_acquire(ticket, g)
            assert torch.equal(ticket.tensors[0], tensors[names[g]])
        session.release(ticket)
        deadline = time.monotonic() + CHILD_DEADLINE  # a release is not answered: poll
        while (info := daemon.client.list_sessions()[0]).live_tickets:
            assert time.monotonic() < deadline, info
            time.sleep(0.02)
        assert info.stats.acquires == 5


def test_a_settled_ticket_is_waited_for_at_once_and_counts_no_wait(daemon):
    """``settle`` blocks until the reply has come and keeps it: the later ``wait`` (or
    ``poll``) returns it, and neither the client's waits for weights nor its reply waits
    count the time settling blocked."""
    manifest, tensors, groups = upload(daemon.client)
    names = list(tensors)
    with daemon.client.open_session(manifest.model_id, groups, 1 << 20) as session:
        numbers = [session.submit(g) for g in range(len(groups))]
        for n in numbers:
            session.settle(n)
            session.settle(n)  # twice: nothing more
        waited = (session.gpu_wait().waits, session.reply_wait().waits)
        assert waited == (0, 0)
        first = session.poll(numbers[0])
        assert first is not None and torch.equal(first.tensors[0], tensors[names[0]])
        session.release(first)
        for g, n in enumerate(numbers[1:], start=1):
            ticket = session.wait(n)
            assert torch.equal(ticket.tensors[0], tensors[names[g]])
            session.release(ticket)
        assert (session.gpu_wait().waits, session.reply_wait().waits) == (0, 0)
        with pytest.raises(KeyError):
            session.settle(numbers[0])


@pytest.mark.no_daemon
def test_blocking_calls_release_the_gil(tmp_path):
    """While ``reconnect`` waits for a daemon that never comes, another Python thread runs."""
    client = weightstream.connect(str(tmp_path / "none.sock"))
    ticks, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        started = time.monotonic()
        with pytest.raises(weightstream.DaemonUnavailable, match="no daemon answered"):
            client.reconnect(timeout=0.5)
        waited = time.monotonic() - started
        before = ticks[0]
        time.sleep(0.2)  # the spinner's own rate, for scale
        rate = (ticks[0] - before) / 0.2
    finally:
        stop.set()
        thread.join()
    assert 0.4 < waited < 3
    assert before > 0.2 * rate * 0.5, (before, rate)
