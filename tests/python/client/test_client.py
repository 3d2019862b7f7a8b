"""The Python client against a real daemon (host backend)."""

from __future__ import annotations

import mmap
import os
import threading
import time

import pytest
import torch
import weightstream
from safetensors.torch import save_file
from weightstream import protocol as pb
from weightstream.client import SYSTEM_SOCKET, socket_path


def test_a_missing_daemon_fails_fast_with_a_clear_error(tmp_path):
    socket = tmp_path / "none.sock"
    client = weightstream.connect(str(socket))
    started = time.monotonic()
    with pytest.raises(weightstream.DaemonUnavailable) as e:
        client.info()
    assert time.monotonic() - started < 5
    assert str(e.value) == (
        f"cannot reach the weightstream daemon at {socket}: no such socket (named by --socket or "
        f"WEIGHTSTREAM_SOCKET). Start the daemon there with `weightstream serve --socket {socket}`"
    )


@pytest.mark.no_daemon
def test_with_no_socket_named_the_client_says_every_place_it_looked(monkeypatch, tmp_path):
    if os.path.exists(SYSTEM_SOCKET):
        pytest.skip(f"{SYSTEM_SOCKET} exists: the client would reach that daemon")
    monkeypatch.delenv("WEIGHTSTREAM_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    user = tmp_path / "weightstream.sock"
    with pytest.raises(weightstream.DaemonUnavailable) as e:
        weightstream.connect().info()
    assert str(e.value) == (
        f"cannot reach the weightstream daemon at {user}: no such socket (tried {SYSTEM_SOCKET}, "
        f"{user}). Start the daemon with `weightstream serve`, or pass --socket (or set "
        "WEIGHTSTREAM_SOCKET) to name another socket"
    )


@pytest.mark.no_daemon
def test_the_socket_is_found_by_the_same_rules_as_the_cli(monkeypatch, tmp_path):
    """A socket given, else $WEIGHTSTREAM_SOCKET, else the system socket if it exists, else
    $XDG_RUNTIME_DIR/weightstream.sock, else /tmp/weightstream-<uid>/weightstream.sock. (That
    the system socket wins when it exists is checked in client-rs, on a stand-in path.)"""
    system = os.path.exists(SYSTEM_SOCKET)
    cases = [
        ("/given.sock", "/env.sock", str(tmp_path), "/given.sock"),
        (None, "/env.sock", str(tmp_path), "/env.sock"),
        (None, "", str(tmp_path), str(tmp_path / "weightstream.sock")),
        (None, None, None, f"/tmp/weightstream-{os.getuid()}/weightstream.sock"),
        (None, None, "relative", f"/tmp/weightstream-{os.getuid()}/weightstream.sock"),
    ]
    failures = []
    for given, env, runtime_dir, want in cases:
        for name, value in (("WEIGHTSTREAM_SOCKET", env), ("XDG_RUNTIME_DIR", runtime_dir)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        if system and given is None and not env:
            want = SYSTEM_SOCKET
        got = (socket_path(given), weightstream.Client(given).socket)
        if got != (want, want):
            failures.append(f"{given=} {env=} {runtime_dir=}: {got}, want {want}")
    assert not failures, failures


def test_upload_then_acquire_gives_the_same_tensors(daemon):
    g = torch.Generator().manual_seed(3)
    tensors = {
        "a": torch.randn(64, 32, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.randint(0, 100, (3, 4, 5), generator=g),
        "s": torch.tensor(2.5, dtype=torch.float16),
    }
    manifest, dedup = daemon.client.upload_model("up", tensors)
    assert not dedup and [t.name for t in manifest.tensors] == list(tensors)
    _, again = daemon.client.upload_model("again", tensors)
    assert again
    groups = [("ab", ["a", "b"]), ("c", ["c"]), ("s", ["s"])]
    with daemon.client.open_session(manifest.model_id, groups, 1 << 20) as session:
        for i, (_, names) in enumerate(groups):
            ticket = session.acquire(i)
            for name, view in zip(names, ticket.tensors, strict=True):
                assert view.dtype == tensors[name].dtype
                assert torch.equal(view, tensors[name]), name
            session.release(ticket)


def test_an_upload_by_tensor_copies_stores_the_same_bytes(daemon):
    """The path device tensors take (the region mapped here and written by tensor copies, cut
    into windows) stores what the native memcpy path stores: the same content digest."""
    from weightstream import _upload

    g = torch.Generator().manual_seed(4)
    tensors = {
        "a": torch.randn(64, 33, generator=g),
        "t": torch.randn(16, 8, generator=g).to(torch.bfloat16).t(),  # not contiguous
        "c": torch.randint(0, 100, (3, 4, 5), generator=g),
        "s": torch.tensor(2.5, dtype=torch.float16),
        "big": torch.randn(3000, generator=g),
        # One element with a stride of 64 (contiguous to torch: torchao's NF4Tensor on CUDA
        # holds such a tensor), which a flat view cannot reinterpret as bytes.
        "one": torch.arange(128, dtype=torch.bfloat16).as_strided((1,), (64,)),
    }
    begun = daemon.client.begin_upload("copied", tensors)
    at = {t.name: t for t in begun.tensors}
    placements = [at[n] for n in tensors]
    # offsets are 4096-aligned: a is 8448 bytes, t+c fit in 8192 bytes from t, s would not
    assert _upload.windows(placements, limit=8192) == [[0], [1, 2], [3], [4], [5]]
    fd, size = daemon.client.fetch_fd(begun.fd_secret)
    _upload.write_by_copy(fd, size, placements, list(tensors.values()), pin=False)
    copied, dedup = daemon.client.commit_upload(begun.upload_id)
    assert not dedup
    native, dedup = daemon.client.upload_model("copied", tensors)
    assert dedup and native.model_id == copied.model_id


def test_a_process_forked_while_an_upload_is_written_leaves_it_committable(daemon, monkeypatch):
    """A fork by another thread while the region is mapped writable (a trainer's data loader, a
    compile worker) must not leave the child holding the writable mapping: the daemon seals
    the region at commit, which fails while one is alive. The child here lives on past the
    commit."""
    from weightstream import _upload

    tensors = {"w": torch.arange(4096, dtype=torch.float32)}
    begun = daemon.client.begin_upload("forked", tensors)
    read, write = os.pipe()
    children = []
    run = _upload._Copier.run

    def forking(self, windows):
        run(self, windows)
        pid = os.fork()
        if pid == 0:  # the child: waits for the parent's word, then leaves
            os.close(write)
            os.read(read, 1)
            os._exit(0)
        children.append(pid)

    monkeypatch.setattr(_upload._Copier, "run", forking)
    try:
        write_begun(daemon.client, begun, tensors, pin=False)
        assert len(children) == 1
        model, dedup = daemon.client.commit_upload(begun.upload_id)
        assert not dedup and model.total_bytes >= 4 * 4096
    finally:
        os.close(read)
        os.write(write, b"x")
        os.close(write)
        for pid in children:
            assert os.waitpid(pid, 0)[1] == 0


class FakeDriver:
    """Stands in for cudaHostRegister/Unregister: records the windows locked, refuses the
    registration numbered ``refuse`` (from 0)."""

    def __init__(self, refuse: int | None = None):
        self.lock = threading.Lock()
        self.locked: dict[int, int] = {}
        self.registered: list[int] = []
        self.peak = 0
        self.refuse = refuse

    def register(self, ptr: int, size: int, flags: int):
        with self.lock:
            if len(self.registered) == self.refuse:
                self.registered.append(-1)
                raise RuntimeError("cudaHostRegister refused")
            assert ptr not in self.locked, "a window is locked once"
            self.locked[ptr] = size
            self.registered.append(ptr)
            self.peak = max(self.peak, len(self.locked))

    def unregister(self, ptr: int):
        with self.lock:
            del self.locked[ptr]


def write_begun(client, begun, tensors: dict, **kwargs):
    """``_upload.write_by_copy`` of ``tensors`` into the region of upload ``begun``."""
    from weightstream import _upload

    at = {t.name: t for t in begun.tensors}
    fd, size = client.fetch_fd(begun.fd_secret)
    placements = [at[n] for n in tensors]
    return _upload.write_by_copy(fd, size, placements, list(tensors.values()), **kwargs)


def many_tensors(n: int = 24) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {f"t{i}": torch.randn(900 + 37 * i, generator=g) for i in range(n)}


def test_a_pinned_upload_locks_each_window_once_a_few_at_a_time(daemon, monkeypatch):
    """The page-locked path's pipeline (windows registered ahead on a pool, copied in order,
    unregistered behind the copies), with the driver's calls recorded: each window locked once
    and unlocked by the end, at most two per thread at once; the bytes stored are the native
    path's, and the write says where its time went."""
    from weightstream import _upload

    driver = FakeDriver()
    monkeypatch.setattr(_upload, "_register", driver.register)
    monkeypatch.setattr(_upload, "_unregister", driver.unregister)
    tensors = many_tensors()
    begun = daemon.client.begin_upload("pinned", tensors)
    at = {t.name: t for t in begun.tensors}
    placements = [at[n] for n in tensors]
    fd, size = daemon.client.fetch_fd(begun.fd_secret)
    done = []
    timings = _upload.write_by_copy(
        fd,
        size,
        placements,
        list(tensors.values()),
        pin=True,
        threads=3,
        window=3 * 4096,
        progress=lambda d, t: done.append((d, t)),
    )
    runs = _upload.windows(placements, 3 * 4096)
    assert (timings.windows, timings.threads) == (len(runs), 3) and len(runs) > 6
    assert not driver.locked, "every window unlocked"
    assert len(driver.registered) == len(runs) and driver.peak <= 6
    assert timings.bytes == sum(t.nbytes for t in tensors.values()) == done[-1][0]
    assert timings.wall >= timings.copy and timings.as_dict()["windows"] == len(runs)
    copied, _ = daemon.client.commit_upload(begun.upload_id)
    native, dedup = daemon.client.upload_model("pinned", tensors)
    assert dedup and native.model_id == copied.model_id


def resident_pages(ptr: int, size: int) -> int:
    """How many pages of the mapping at ``ptr`` are in memory (mincore)."""
    import ctypes

    page = mmap.PAGESIZE
    pages = -(-size // page)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ptr, size, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vec)


def region_pages_in_memory(client, begun) -> tuple[int, int]:
    """(pages in memory, pages) of a begun upload's region, seen through a mapping of its fd."""
    import ctypes

    fd, size = client.fetch_fd(begun.fd_secret)
    try:
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    view = (ctypes.c_char * size).from_buffer(m)
    try:
        return resident_pages(ctypes.addressof(view), size), -(-size // mmap.PAGESIZE)
    finally:
        del view
        m.close()


def test_a_writer_that_reserves_faults_each_window_in_before_locking_it(daemon, monkeypatch):
    """``client_reserves``: the daemon answers without faulting the region's pages in (it does
    without it), and the page-locking writer faults each window in before registering it; the
    bytes stored are the native path's."""
    from weightstream import _upload

    tensors = many_tensors()
    reserved = daemon.client.begin_upload("reserved", tensors)
    assert region_pages_in_memory(daemon.client, reserved) == (reserved.size // 4096,) * 2
    daemon.client.abort_upload(reserved.upload_id)

    begun = daemon.client.begin_upload("by the writer", tensors, client_reserves=True)
    assert region_pages_in_memory(daemon.client, begun) == (0, begun.size // 4096)
    driver = FakeDriver()
    in_memory_when_locked = []

    def register(ptr: int, size: int, flags: int):
        in_memory_when_locked.append((resident_pages(ptr, size), -(-size // mmap.PAGESIZE)))
        driver.register(ptr, size, flags)

    monkeypatch.setattr(_upload, "_register", register)
    monkeypatch.setattr(_upload, "_unregister", driver.unregister)
    timings = write_begun(
        daemon.client, begun, tensors, pin=True, threads=3, window=3 * 4096, reserve=True
    )
    assert len(in_memory_when_locked) == timings.windows > 6
    assert all(n == total for n, total in in_memory_when_locked), in_memory_when_locked
    assert timings.populate > 0
    copied, _ = daemon.client.commit_upload(begun.upload_id)
    native, dedup = daemon.client.upload_model("by the writer", tensors)
    assert dedup and native.model_id == copied.model_id


def test_a_window_the_host_cannot_back_is_an_error_that_says_so():
    """``_cuda.populate`` past the end of a memfd (what a full tmpfs or memory cgroup does to
    MADV_POPULATE_WRITE: EFAULT where a write would be a SIGBUS) raises an OSError naming the
    bytes and the cause; a kernel without the advice (EINVAL) leaves the faults to the
    page-locking."""
    import ctypes
    import errno

    from weightstream import _cuda

    page = mmap.PAGESIZE
    fd = os.memfd_create("ws-test")
    try:
        os.ftruncate(fd, 2 * page)
        m = mmap.mmap(fd, 2 * page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.ftruncate(fd, page)  # the second page has no file behind it any more
    finally:
        os.close(fd)
    view = (ctypes.c_char * (2 * page)).from_buffer(m)
    base = ctypes.addressof(view)
    try:
        assert _cuda.populate(base, page) is True
        assert resident_pages(base, page) == 1
        with pytest.raises(OSError) as e:
            _cuda.populate(base, 2 * page)
        assert e.value.errno == errno.EFAULT
        assert str(e.value) == (
            f"[Errno {errno.EFAULT}] reserving {2 * page} bytes of the upload region failed "
            f"({os.strerror(errno.EFAULT)}): the host's shared memory (tmpfs, or this "
            "process's memory cgroup) has no room for the model"
        )
    finally:
        del view
        m.close()

    class OldKernel:
        def madvise(self, ptr, size, advice):
            ctypes.set_errno(errno.EINVAL)
            return -1

    real, _cuda._libc = _cuda._libc, OldKernel()
    try:
        assert _cuda.populate(0, page) is False
    finally:
        _cuda._libc = real


def test_an_uploads_progress_line_shows_the_rate_then_the_commit_then_the_time(capsys):
    """Nothing for a quick upload; past ``after``, one line on stderr rewritten in place: the
    bytes written and their rate, the commit's phase (padded over the longer line before), the
    whole time (or "failed", the error to follow on the next line)."""
    from weightstream import _upload

    now = [0.0]
    quick = _upload.ProgressLine("up", after=2.0, clock=lambda: now[0])
    now[0] = 1.0
    quick(1 << 30, 1 << 30)
    quick.phase("committing")
    quick.end()
    assert capsys.readouterr().err == ""

    now[0] = 0.0
    line = _upload.ProgressLine("up", after=2.0, clock=lambda: now[0])
    now[0] = 1.0
    line(1 << 30, 4 << 30)  # before `after`: nothing yet
    now[0] = 2.5
    line(2 << 30, 4 << 30)
    now[0] = 4.0
    line(4 << 30, 4 << 30)
    line.phase("committing")
    now[0] = 5.25
    line.end()
    writing = "up: writing 4.0/4.0 GiB, 1.1 GB/s, 4 s"
    committing = "up: committing, 4 s"
    assert capsys.readouterr().err == (
        "\rup: writing 2.0/4.0 GiB, 0.9 GB/s, 2 s"
        f"\r{writing}"
        f"\r{committing}{' ' * (len(writing) - len(committing))}"
        f"\rup: done in 5.2 s{' ' * (len(committing) - len('up: done in 5.2 s'))}\n"
    )
    failed = _upload.ProgressLine("up", after=0.0, clock=lambda: now[0])
    failed.end(ok=False)
    assert capsys.readouterr().err == "\rup: failed\n"


def test_windows_that_share_a_page_are_locked_as_one():
    """Pages larger than the tensors' alignment (64 KiB on some ARM hosts) would put one page
    in two windows locked at once: those windows merge."""
    from weightstream import _upload

    runs, spans = _upload._disjoint([[0], [1], [2, 3], [4]], [(0, 8), (8, 16), (12, 24), (32, 40)])
    assert runs == [[0], [1, 2, 3], [4]] and spans == [(0, 8), (8, 24), (32, 40)]


def test_a_refused_registration_fails_the_write_and_unlocks_the_rest(daemon, monkeypatch):
    from weightstream import _upload

    driver = FakeDriver(refuse=4)
    monkeypatch.setattr(_upload, "_register", driver.register)
    monkeypatch.setattr(_upload, "_unregister", driver.unregister)
    tensors = many_tensors()
    begun = daemon.client.begin_upload("refused", tensors)
    with pytest.raises(RuntimeError, match="cudaHostRegister refused"):
        write_begun(daemon.client, begun, tensors, pin=True, threads=2, window=2 * 4096)
    assert not driver.locked, "what was locked is unlocked"


def left_in_the_daemon(daemon) -> tuple[int, int, list[str]]:
    """Uploads in progress, host bytes charged to this uid, and upload regions the daemon
    holds (a committed upload's region is its model's arena: none is committed here)."""
    usage = daemon.client.info().usage
    return (
        usage.uploads,
        usage.host_bytes,
        [k for k in daemon.memfds() if k == "upload"],
    )


class Interrupted(KeyboardInterrupt):
    """A KeyboardInterrupt told from pytest's own."""


@pytest.mark.parametrize(
    "error", [RuntimeError("cudaHostRegister refused"), Interrupted("^C")], ids=type
)
def test_an_upload_that_fails_while_written_is_aborted(daemon, monkeypatch, error):
    """The page-locked path (device tensors'; here with the driver faked): whatever raises
    while the region is written (a refused page-lock, Ctrl-C) aborts the upload before it
    propagates, as it was: nothing is left in the daemon, with the connection still open, and
    the same client uploads the same tensors again."""
    from weightstream import _upload

    driver = FakeDriver(refuse=0)

    def register(ptr, size, flags):
        try:
            driver.register(ptr, size, flags)
        except RuntimeError:
            raise error from None

    monkeypatch.setattr(_upload, "_register", register)
    monkeypatch.setattr(_upload, "_unregister", driver.unregister)
    tensors = many_tensors()
    with pytest.raises(type(error)) as e:
        daemon.client._upload_by_copy("w", tensors, pin=True)
    assert e.value is error and not getattr(error, "__notes__", None)
    assert not driver.locked, "what was locked is unlocked"
    assert left_in_the_daemon(daemon) == (0, 0, [])
    driver.refuse = None
    copied, _ = daemon.client._upload_by_copy("w", tensors, pin=True)
    native, dedup = daemon.client.upload_model("w", tensors)
    assert dedup and native.model_id == copied.model_id


def test_a_native_upload_that_cannot_fetch_its_region_is_aborted(daemon):
    """The native path (tensors in host memory): an upload whose region cannot be fetched
    (the handoff socket gone) is aborted over the connection, which still works."""
    handoff, away = daemon.socket + ".fd", daemon.socket + ".away"
    tensors = many_tensors(3)
    os.rename(handoff, away)
    try:
        with pytest.raises(weightstream.DaemonUnavailable) as e:
            daemon.client.upload_model("w", tensors)
    finally:
        os.rename(away, handoff)
    assert handoff in str(e.value)
    assert left_in_the_daemon(daemon) == (0, 0, [])
    manifest, dedup = daemon.client.upload_model("w", tensors)
    assert not dedup and [t.name for t in manifest.tensors] == list(tensors)


def test_an_abort_that_fails_does_not_hide_the_error(daemon, monkeypatch):
    """An abort the daemon refuses adds a note to the error that ended the upload, which is
    raised as it was; NOT_FOUND (the upload already gone) adds none. The upload the failed
    abort left goes with the connection, as before."""
    from weightstream import _upload, client

    def failing(self, run):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(_upload._Copier, "run", failing)
    for code, notes in (("NOT_FOUND", None), ("UNAVAILABLE", 1)):
        asked = []

        def abort(self, upload_id, code=code, asked=asked):
            asked.append(upload_id)
            raise weightstream.RequestRejected(code, "no")

        monkeypatch.setattr(client.Client, "abort_upload", abort)
        with pytest.raises(RuntimeError) as e:
            daemon.client._upload_by_copy("w", many_tensors(2), pin=False)
        assert str(e.value) == "CUDA out of memory"
        assert len(asked) == 1 and asked[0].startswith("up-")
        want = [f"weightstream: the upload {asked[0]} was not aborted: no"]
        assert getattr(e.value, "__notes__", None) == (want if notes else None)
    assert left_in_the_daemon(daemon)[0] == 2


def test_abort_upload_drops_a_begun_upload_once(daemon):
    """``abort_upload`` alone: the upload goes at once; committing or aborting it again is
    NOT_FOUND, with the id."""
    tensors = many_tensors(2)
    begun = daemon.client.begin_upload("w", tensors)
    assert left_in_the_daemon(daemon)[0] == 1
    daemon.client.abort_upload(begun.upload_id)
    assert left_in_the_daemon(daemon) == (0, 0, [])
    unknown = f"unknown upload_id '{begun.upload_id}'"
    with pytest.raises(weightstream.RequestRejected) as e:
        daemon.client.commit_upload(begun.upload_id)
    assert (e.value.code, str(e.value)) == ("NOT_FOUND", unknown), "the message, no code"
    with pytest.raises(weightstream.RequestRejected) as e:
        daemon.client.abort_upload(begun.upload_id)
    assert str(e.value) == unknown


def test_loads_and_uploads_say_where_the_daemons_time_went(daemon, tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.arange(4096.0)}, str(path))
    loaded = daemon.client.load_model([str(path)])
    p = loaded.phases
    assert p.input_bytes == 4 * 4096 and p.total_ns >= p.alloc_ns + p.read_ns > 0
    assert p.pin_ns == 0, "the host backend locks nothing"
    assert daemon.client.list_models().models[0].phases is None
    phases = {}
    manifest, _ = daemon.client.upload_model("u", {"w": torch.ones(4096)}, phases=phases)
    assert manifest.phases.seal_ns > 0 and manifest.phases.hash_ns > 0
    assert phases["daemon_input_bytes"] == 4 * 4096
    assert phases["total_s"] >= phases["daemon_total_s"] >= phases["daemon_hash_s"] > 0


def test_load_model_from_safetensors_and_idempotence(daemon, tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.arange(12.0).reshape(3, 4)}, str(path))
    seen = []
    first = daemon.client.load_model([str(path)], "m", progress=seen.append)
    second = daemon.client.load_model([str(path)])
    assert first.model_id == second.model_id and second.refcount == 2
    assert seen and seen[-1].bytes_done == seen[-1].bytes_total == 48
    assert daemon.client.list_models().store_bytes == 48


def test_a_load_of_some_tensors_holds_only_those(daemon, tmp_path):
    """``tensors=``: the daemon reads and holds only the tensors named (in any order: the same
    model), another selection is another model, and a name none of the files holds is refused
    naming it."""
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(16), "b": torch.zeros(4, 4), "c": torch.ones(100)}, str(path))
    ca = daemon.client.load_model([str(path)], tensors=["c", "a"])
    assert [(t.name, t.nbytes) for t in ca.tensors] == [("a", 64), ("c", 400)]
    assert ca.total_bytes == 464
    ac = daemon.client.load_model([str(path)], tensors=iter(["a", "c"]))
    assert (ac.model_id, ac.refcount) == (ca.model_id, 2)
    every = daemon.client.load_model([str(path)])
    assert every.model_id != ca.model_id and every.total_bytes == 528
    with pytest.raises(weightstream.RequestRejected) as e:
        daemon.client.load_model([str(path)], tensors=["a", "x"])
    assert (e.value.code, str(e.value.message)) == (
        "INVALID_ARGUMENT",
        f"tensors: 'x' is in none of the files ({path})",
    )


def test_list_models_reads_pages_that_fit_a_message(tmp_path):
    """Manifests too large for more than two in one message: the daemon cuts its pages to fit,
    and ``list_models`` reads every page."""
    from tests.daemon import Daemon

    d = Daemon(tmp_path, "--max-message-bytes", "64KiB")
    try:
        ids = []
        for seed in range(5):
            # 250 tensors with names of ~100 bytes: a manifest of ~27 KB.
            tensors = {f"{seed}.{i:0>96}": torch.full((1,), float(seed)) for i in range(250)}
            manifest, _ = d.client.upload_model(f"m{seed}", tensors)
            ids.append(manifest.model_id)
        listed = d.client.list_models()
        assert sorted(m.model_id for m in listed.models) == sorted(ids)
        assert all(len(m.tensors) == 250 for m in listed.models)
        assert listed.next_page_token == ""
    finally:
        d.stop()


def test_bad_requests_are_refused_with_the_field_named(daemon):
    manifest, _ = daemon.client.upload_model("x", {"w": torch.zeros(1024)})
    with pytest.raises(weightstream.RequestRejected) as e:
        daemon.client.open_session(manifest.model_id, [("w", ["w"])], 100)
    assert e.value.code == "INVALID_ARGUMENT"
    assert "vram_budget 100 is smaller than the largest group 'w'" in e.value.message
    with pytest.raises(weightstream.RequestRejected, match="^unknown model_id 'nope'$"):
        daemon.client.open_session("nope", [("w", ["w"])], 1 << 20)
    with daemon.client.open_session(manifest.model_id, [("w", ["w"])], 1 << 20) as session:
        with pytest.raises(weightstream.SessionFault) as e:
            session.acquire(5)
        said = f"ticket {e.value.ticket}: acquire.group 5 is out of range: the session has 1 groups"
        assert (e.value.code, str(e.value)) == ("FAULT_INVALID_ARGUMENT", said), "no code"
        ticket = session.acquire(0)
        assert torch.equal(ticket.tensors[0], torch.zeros(1024))
        session.release(ticket)


def test_a_stopped_daemon_fails_the_next_acquire(daemon):
    manifest, _ = daemon.client.upload_model("x", {"w": torch.ones(256)})
    session = daemon.client.open_session(manifest.model_id, [("w", ["w"])], 1 << 20)
    session.release(session.acquire(0))
    daemon.stop()
    started = time.monotonic()
    with pytest.raises(weightstream.DaemonUnavailable):
        session.acquire(0)
    assert time.monotonic() - started < 5
    assert pb.FAULT_SHUTTING_DOWN  # the fault the daemon sends on its way out


def test_the_upload_charge_is_the_daemons(daemon):
    """``_upload.upload_charge`` (what ``attach`` checks beside the trainable state before it
    uploads) mirrors the store's accounting: ``TENSOR_ALIGN`` as daemon/src/store/mod.rs
    defines it, and the host bytes a daemon charges for an upload, to the byte."""
    import re
    from pathlib import Path

    from weightstream import _upload

    rust = Path(__file__).resolve().parents[3] / "daemon" / "src" / "store" / "mod.rs"
    found = re.search(r"pub const TENSOR_ALIGN: u64 = (\d+);", rust.read_text())
    assert int(found.group(1)) == _upload.TENSOR_ALIGN == 4096
    tensors = {
        "blocks.0.weight": torch.ones(3, 5, dtype=torch.bfloat16),
        "blocks.0.bias": torch.ones(5000),
        "scale": torch.ones(()),
    }
    before = daemon.client.info().usage.host_bytes
    daemon.client.upload_model("charged model", tensors)
    charged = daemon.client.info().usage.host_bytes - before
    assert charged == _upload.upload_charge(
        "charged model", [(n, t.ndim, t.nbytes) for n, t in tensors.items()]
    )


def test_labels_name_packed_formats_in_the_manifest_and_leave_the_model_as_it_is(daemon):
    """Both upload paths send labels: the manifest counts the labelled tensors under their
    format with the weights declared; the same bytes with another label are the same model,
    which keeps the first labels; a bad label is the daemon's refusal, naming the field."""
    tensors = {"codes": torch.full((2048,), 33, dtype=torch.uint8), "bias": torch.ones(64)}
    labels = {"codes": ("aitk.uint4", 4096)}
    copied, _ = daemon.client._upload_by_copy("p", tensors, pin=False, labels=labels)
    native, dedup = daemon.client.upload_model("p", tensors, labels={"codes": ("x.y", 1)})
    assert dedup and native.model_id == copied.model_id
    for m in (copied, native):
        got = [(f.format, f.tensors, f.bytes, f.weights, f.bits_per_weight) for f in m.formats]
        assert got == [("aitk.uint4", 1, 2048, 4096, 4.0), ("f32", 1, 256, 64, 32.0)]
        assert [(t.name, t.format, t.weights) for t in m.tensors] == [
            ("codes", "aitk.uint4", 4096),
            ("bias", "", 0),
        ]
    with pytest.raises(weightstream.RequestRejected) as e:
        daemon.client.upload_model("q", tensors, labels={"codes": ("a" * 65, 1)})
    refused = (e.value.code, str(e.value))
    assert refused == ("INVALID_ARGUMENT", "tensors[0].format: 65 bytes, the limit is 64")
