"""The one way the tests, the GPU suites and the benches start a daemon (``weightstream serve``):
a private socket in a directory of the caller's, the caller's extra ``serve`` options, the log
in a file, ready once it answers a request (not once its socket file appears, nor after a
sleep), stopped by its PID with a deadline, and its log's tail in the error when it does not
start. The pytest fixtures over it are in tests/python/conftest.py; a failed test shows the log
of every daemon it started.

Imported as ``tests.daemon``: pytest puts the repository root on ``sys.path`` (tests/ and its
folders are packages), and the GPU suites and benches run as ``python -m tests.gpu.X`` /
``python -m tests.bench.X`` from the root."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import weightstream

ROOT = Path(__file__).resolve().parents[1]
#: The binary the tests start (tests/run.sh builds it; the benches pass their own, a release one).
BIN = os.environ.get("WEIGHTSTREAM_BIN", str(ROOT / "target" / "debug" / "weightstream"))
#: How much of a daemon's log an error or a failed test shows.
LOG_TAIL = 4000

#: Every daemon started in this process, oldest first (the conftest shows a failed test's logs).
STARTED: list[Daemon] = []


def memfds(pid: int) -> list[str]:
    """The kinds of the memfds among process ``pid``'s open fds ("model", "upload", "staging",
    "resident"; /proc shows one as "/memfd:weightstream-KIND (deleted)"), sorted. A committed
    upload stays an "upload": it is its model's arena."""
    kinds = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if link.startswith("/memfd:"):
            name = link.removeprefix("/memfd:").removesuffix(" (deleted)")
            kinds.append(name.removeprefix("weightstream-"))
    return sorted(kinds)


class DaemonFailed(RuntimeError):
    """The daemon exited at start or did not answer in time; the message ends with its log."""


class Daemon:
    """``weightstream serve --backend BACKEND --socket DIR/ws.sock EXTRA...``, started and
    answering; ``client`` is connected to it.

    ``tmp``: the directory of the socket and, unless ``log`` names another file, of the log
    (``daemon.log``, appended to). ``socket``: another socket path (a restart on the socket of
    a daemon that died). ``log_level``: ``WEIGHTSTREAM_LOG`` for the daemon (None: the
    environment's). ``env``: more variables for the daemon, None for one of the caller's that
    it must not see. ``log_stdout``: its stdout into the log too (else it shares the caller's).
    ``ready_s``: how long it may take to answer; None: not waited for (a caller whose clients
    wait for the daemon themselves)."""

    def __init__(
        self,
        tmp: Path | str,
        *extra_args: str,
        binary: str = BIN,
        backend: str = "host",
        socket: str | None = None,
        log: Path | str | None = None,
        log_level: str | None = "warn",
        env: dict[str, str | None] | None = None,
        log_stdout: bool = False,
        ready_s: float | None = 30.0,
    ):
        self.tmp = Path(tmp)
        self.socket = socket or str(self.tmp / "ws.sock")
        self.log_path = Path(log) if log is not None else self.tmp / "daemon.log"
        self.args = [binary, "serve", "--backend", backend, "--socket", self.socket, *extra_args]
        env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
        if log_level is not None:
            env["WEIGHTSTREAM_LOG"] = log_level
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log_file:
            stdout = log_file if log_stdout else None
            self.proc = subprocess.Popen(self.args, stdout=stdout, stderr=log_file, env=env)
        STARTED.append(self)
        self.client = weightstream.connect(self.socket)
        if ready_s is None:
            return
        try:
            self._wait_ready(ready_s)
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_ready(self, ready_s: float) -> None:
        """Polls until the daemon answers ``info`` (any answer: one that refuses this uid
        answers too); fails at once if it exits."""
        deadline = time.monotonic() + ready_s
        while True:
            if self.proc.poll() is not None:
                raise DaemonFailed(
                    f"the daemon exited at start with status {self.proc.returncode}: "
                    f"{' '.join(self.args)}\n{self.log_tail()}"
                )
            if os.path.exists(self.socket):
                try:
                    self.client.info()
                    return
                except weightstream.DaemonUnavailable:
                    pass
                except weightstream.WeightstreamError:
                    return
            if time.monotonic() > deadline:
                raise DaemonFailed(
                    f"the daemon did not answer on {self.socket} within {ready_s:g} s: "
                    f"{' '.join(self.args)}\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def log_tail(self, limit: int = LOG_TAIL) -> str:
        """The end of what this daemon wrote to its log (at most ``limit`` characters)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                text = f.read().decode(errors="replace")
        except FileNotFoundError:
            return f"(no log at {self.log_path})"
        return text[-limit:] if text else f"(nothing in {self.log_path})"

    def memfds(self) -> list[str]:
        """The daemon's shared memory (see ``memfds``)."""
        return memfds(self.proc.pid)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM to the daemon's PID (nothing if it has ended), waited for ``timeout``
        seconds, then SIGKILL; its exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
