"""The client side of the daemon's handoff socket (its gRPC socket's path + ``.fd``): files pass
between this process and the daemon as file descriptors (``SCM_RIGHTS``), never as paths.

One request per connection, one ASCII line each way (at most 4096 bytes), within 5 s:
``PUT\\n`` with 1 to 253 fds -> ``OK <token>\\n``; ``GET <secret>\\n`` -> ``OK <size>\\n`` with
one fd; either may be answered ``ERR <message>\\n``. The wire format's reference is client-rs's
``handoff.rs``; this mirrors its client half.
"""

from __future__ import annotations

import array
import contextlib
import os
import re
import socket
import time

from weightstream.errors import DaemonUnavailable, RequestRejected, WeightstreamError

#: The most fds one message can carry (the kernel's SCM_MAX_FD).
MAX_FDS = 253
#: The longest line either side sends, ``\n`` included.
MAX_LINE = 4096
#: The bound on one exchange, in seconds.
TIMEOUT = 5.0

_SECRET = re.compile(r"[0-9a-f]{32}")
_FD_BYTES = array.array("i").itemsize


def handoff_path(socket_path: str) -> str:
    """Where the daemon takes handoffs: the gRPC socket's path + ``.fd``."""
    return f"{socket_path}.fd"


def put_fds(socket_path: str, fds: list[int]) -> str:
    """Passes 1 to 253 open files to the daemon; returns the token that names them
    (``LoadModelRequest.fd_token``)."""
    if not 1 <= len(fds) <= MAX_FDS:
        raise WeightstreamError(f"{len(fds)} files: one handoff passes 1 to {MAX_FDS}")
    with _Exchange(socket_path) as x:
        x.send(b"PUT\n", fds)
        token, _ = x.reply(max_fds=0)
    if not _SECRET.fullmatch(token):
        raise WeightstreamError(
            "handoff: the daemon's reply to PUT is not 'OK <token>' with a token of 32 "
            "lowercase hex characters"
        )
    return token


def get_fd(socket_path: str, secret: str) -> tuple[int, int]:
    """Fetches the fd that ``secret`` names (``BeginUploadResponse.fd_secret``,
    ``Region.fd_secret``): returns ``(fd, size)``; the caller closes the fd."""
    if not _SECRET.fullmatch(secret):
        raise WeightstreamError(
            f"handoff: fd_secret: 32 lowercase hex characters expected, got {len(secret)}"
        )
    with _Exchange(socket_path) as x:
        x.send(f"GET {secret}\n".encode(), [])
        size, fds = x.reply(max_fds=1)
    try:
        if len(fds) != 1:
            raise WeightstreamError(
                f"handoff: the daemon's reply to GET carried {len(fds)} files, expected 1"
            )
        if not size.isdigit():
            raise WeightstreamError("handoff: the daemon's reply to GET is not 'OK <size>'")
        actual = os.fstat(fds[0]).st_size
        if actual < int(size):
            raise WeightstreamError(
                f"handoff: the daemon passed a file of {actual} bytes for a region of {size}"
            )
    except BaseException:
        _close(fds)
        raise
    return fds[0], int(size)


class _Exchange:
    """One connection to the handoff socket, every step within one deadline; socket errors
    come out as ``DaemonUnavailable``."""

    def __init__(self, socket_path: str):
        self.deadline = time.monotonic() + TIMEOUT
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(TIMEOUT)
            self.sock.connect(socket_path)
        except OSError as e:
            self.sock.close()
            raise DaemonUnavailable(
                f"cannot reach the daemon's handoff socket {socket_path}: {e} (a weightstream "
                "daemon of this version listens there, next to its gRPC socket: is it running, "
                "and is it as new as this client?)"
            ) from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.sock.close()

    @contextlib.contextmanager
    def _step(self):
        left = self.deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            self.sock.settimeout(left)
            yield
        except TimeoutError:
            raise DaemonUnavailable(
                f"handoff: the exchange did not finish within {TIMEOUT} s"
            ) from None
        except OSError as e:
            raise DaemonUnavailable(f"handoff: {e}") from None

    def send(self, line: bytes, fds: list[int]):
        with self._step():
            sent = socket.send_fds(self.sock, [line], fds) if fds else self.sock.send(line)
        while sent < len(line):  # the fds went with the first bytes
            with self._step():
                sent += self.sock.send(line[sent:])

    def reply(self, max_fds: int) -> tuple[str, list[int]]:
        """The text after ``OK `` and the fds that came with it; ``ERR`` raises
        ``RequestRejected``."""
        line = b""
        fds: list[int] = []
        try:
            while b"\n" not in line:
                if len(line) >= MAX_LINE:
                    raise WeightstreamError(f"handoff: a reply longer than {MAX_LINE} bytes")
                with self._step():
                    data, got, flags = _recv(self.sock, MAX_LINE - len(line), max_fds)
                fds += got
                if flags & socket.MSG_CTRUNC or len(fds) > max_fds:
                    raise WeightstreamError(
                        f"handoff: the daemon passed more files than the {max_fds} expected"
                    )
                if not data:
                    raise DaemonUnavailable("handoff: the daemon closed the connection mid-reply")
                line += data
            text = line.decode("utf-8", "replace")
            if not text.endswith("\n") or text.count("\n") != 1:
                raise WeightstreamError("handoff: bytes after the daemon's reply line")
            text = text[:-1]
            if text.startswith("ERR "):
                raise RequestRejected("INVALID_ARGUMENT", text[4:])
            if not text.startswith("OK "):
                raise WeightstreamError("handoff: the daemon's reply is neither 'OK …' nor 'ERR …'")
        except BaseException:
            _close(fds)
            raise
        return text[3:], fds


def _recv(sock: socket.socket, size: int, max_fds: int) -> tuple[bytes, list[int], int]:
    """``recvmsg`` with ``MSG_CMSG_CLOEXEC`` (``socket.recv_fds`` drops its flags), room for
    one fd more than expected (so that one too many is seen, not truncated)."""
    room = socket.CMSG_SPACE((max_fds + 1) * _FD_BYTES)
    data, ancdata, flags, _ = sock.recvmsg(size, room, socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % _FD_BYTES])
    return data, list(fds), flags


def _close(fds: list[int]):
    for fd in fds:
        os.close(fd)
