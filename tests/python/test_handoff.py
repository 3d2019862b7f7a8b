"""The client side of the handoff socket (``weightstream._handoff``) against a fake daemon in
this process: fds pass both ways, refusals and broken replies come out as the package's errors,
and a stalled daemon cannot hold a client past the timeout. Needs no daemon binary."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from weightstream import _handoff
from weightstream.errors import DaemonUnavailable, RequestRejected, WeightstreamError

pytestmark = pytest.mark.no_daemon

SECRET = "0123456789abcdef0123456789abcdef"


class FakeDaemon:
    """Listens at the handoff path of ``<tmp>/ws.sock`` and runs ``serve(conn)`` for each
    connection, on a thread; what ``serve`` returns (or raises) is in ``results``."""

    def __init__(self, tmp, serve):
        self.socket = str(tmp / "ws.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(_handoff.handoff_path(self.socket))
        self.listener.listen()
        self.listener.settimeout(10)
        self.results: list = []
        self.thread = threading.Thread(target=self._run, args=(serve,), daemon=True)
        self.thread.start()

    @property
    def path(self) -> str:
        return _handoff.handoff_path(self.socket)

    def _run(self, serve):
        try:
            conn, _ = self.listener.accept()
        except OSError as e:
            self.results.append(e)
            return
        with conn:
            try:
                self.results.append(serve(conn))
            except Exception as e:  # reported by result()
                self.results.append(e)

    def result(self):
        self.thread.join(10)
        self.listener.close()
        [result] = self.results
        if isinstance(result, Exception):
            raise result
        return result


def read_line(conn: socket.socket) -> tuple[bytes, list[int]]:
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, got, _, _ = socket.recv_fds(conn, 4096, 253)
        if not chunk:
            break
        data, fds = data + chunk, fds + got
    return data, fds


def test_put_passes_files_in_order(tmp_path):
    contents = [b"first file", b"second", b"third and last"]
    files = []
    for i, text in enumerate(contents):
        (tmp_path / f"{i}.safetensors").write_bytes(text)
        files.append(os.open(tmp_path / f"{i}.safetensors", os.O_RDONLY))

    def serve(conn):
        line, fds = read_line(conn)
        read = []
        for fd in fds:
            with os.fdopen(fd, "rb") as f:
                read.append(f.read())
        conn.sendall(f"OK {SECRET}\n".encode())
        return line, read

    daemon = FakeDaemon(tmp_path, serve)
    try:
        assert _handoff.put_fds(daemon.path, files) == SECRET
    finally:
        for fd in files:
            os.close(fd)
    assert daemon.result() == (b"PUT\n", contents)


def test_get_returns_the_fd_and_size(tmp_path):
    region = tmp_path / "region"
    region.write_bytes(b"region bytes")

    def serve(conn):
        line, _ = read_line(conn)
        fd = os.open(region, os.O_RDONLY)
        try:
            socket.send_fds(conn, [b"OK 12\n"], [fd])
        finally:
            os.close(fd)
        return line

    daemon = FakeDaemon(tmp_path, serve)
    fd, size = _handoff.get_fd(daemon.path, SECRET)
    try:
        assert os.pread(fd, 100, 0) == b"region bytes"
        assert size == 12
        assert not os.get_inheritable(fd), "received without MSG_CMSG_CLOEXEC"
    finally:
        os.close(fd)
    assert daemon.result() == f"GET {SECRET}\n".encode()


def _reply_with(reply: bytes, nfds: int = 0):
    def serve(conn):
        read_line(conn)
        fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(nfds)]
        try:
            socket.send_fds(conn, [reply], fds) if fds else conn.sendall(reply)
        finally:
            for fd in fds:
                os.close(fd)

    return serve


@pytest.mark.parametrize(
    "reply, nfds, error, message",
    [
        (b"ERR no such secret\n", 0, RequestRejected, "INVALID_ARGUMENT: no such secret"),
        (b"OK twelve\n", 1, WeightstreamError, "reply to GET is not 'OK <size>'"),
        (b"OK 12\n", 0, WeightstreamError, "reply to GET carried 0 files, expected 1"),
        (b"OK 12\n", 2, WeightstreamError, "more files than the 1 expected"),
        (b"OK 12\n", 3, WeightstreamError, "more files than the 1 expected"),
        (b"OK 99999\n", 1, WeightstreamError, "passed a file of 0 bytes for a region of 99999"),
        (b"HELLO\n", 0, WeightstreamError, "neither 'OK …' nor 'ERR …'"),
        (b"OK 1\nOK 2\n", 1, WeightstreamError, "bytes after the daemon's reply line"),
        (b"OK 1", 0, DaemonUnavailable, "closed the connection mid-reply"),
        (b"x" * 5000, 0, WeightstreamError, "a reply longer than 4096 bytes"),
    ],
)
def test_get_reports_refusals_and_broken_replies(tmp_path, reply, nfds, error, message):
    daemon = FakeDaemon(tmp_path, _reply_with(reply, nfds))
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(error, match=message):
        _handoff.get_fd(daemon.path, SECRET)
    daemon.result()
    assert set(os.listdir("/proc/self/fd")) <= before, "a received fd was left open"


def test_put_refused_is_request_rejected(tmp_path):
    daemon = FakeDaemon(
        tmp_path, _reply_with(b"ERR file 0 is a FIFO: only regular files can be passed\n")
    )
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        with pytest.raises(RequestRejected) as e:
            _handoff.put_fds(daemon.path, [fd])
    finally:
        os.close(fd)
    daemon.result()
    assert (e.value.code, e.value.message) == (
        "INVALID_ARGUMENT",
        "file 0 is a FIFO: only regular files can be passed",
    )


def test_a_stalled_daemon_is_cut_at_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(_handoff, "TIMEOUT", 0.3)
    release = threading.Event()

    def serve(conn):
        read_line(conn)
        release.wait(10)

    daemon = FakeDaemon(tmp_path, serve)
    started = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="did not finish within 0.3 s"):
        _handoff.get_fd(daemon.path, SECRET)
    assert time.monotonic() - started < 2
    release.set()
    daemon.result()


def test_arguments_are_checked_before_connecting(tmp_path):
    nowhere = str(tmp_path / "none.sock.fd")
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        with pytest.raises(WeightstreamError, match="0 files: one handoff passes 1 to 253"):
            _handoff.put_fds(nowhere, [])
        with pytest.raises(WeightstreamError, match="254 files: one handoff passes 1 to 253"):
            _handoff.put_fds(nowhere, [fd] * 254)
        with pytest.raises(WeightstreamError, match="32 lowercase hex characters expected"):
            _handoff.get_fd(nowhere, SECRET.upper())
        with pytest.raises(DaemonUnavailable, match="cannot reach the daemon's handoff socket"):
            _handoff.put_fds(nowhere, [fd])
    finally:
        os.close(fd)


def test_handoff_path_is_next_to_the_socket():
    assert _handoff.handoff_path("/run/ws/ws.sock") == "/run/ws/ws.sock.fd"
