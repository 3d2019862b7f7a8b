"""Fixtures of the Python tests: a real daemon (the binary built by tests/run.sh) on its host
backend, on a private socket; its shared memory is memfds, counted among its open fds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import weightstream

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("WEIGHTSTREAM_BIN", str(ROOT / "target" / "debug" / "weightstream"))


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


class Daemon:
    def __init__(self, tmp: Path, *extra_args: str):
        self.tmp = tmp
        self.socket = str(tmp / "ws.sock")
        self.log = open(tmp / "daemon.log", "wb")
        self.proc = subprocess.Popen(
            [
                BIN,
                "serve",
                "--backend",
                "host",
                "--socket",
                self.socket,
                *extra_args,
            ],
            stderr=self.log,
            env={**os.environ, "WEIGHTSTREAM_LOG": "warn"},
        )
        deadline = time.monotonic() + 30
        while not os.path.exists(self.socket):
            assert self.proc.poll() is None, "the daemon exited at start"
            assert time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.02)
        self.client = weightstream.connect(self.socket)

    def memfds(self) -> list[str]:
        """The daemon's shared memory (see ``memfds``)."""
        return memfds(self.proc.pid)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.log.close()


def pytest_configure(config):
    config.addinivalue_line("markers", "no_daemon: runs without the daemon binary")


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def _fresh_ai_toolkit_settings():
    """ai-toolkit's ``MemoryManager`` reads its settings (the socket among them) from the
    environment once per process, as a trainer does; each test has its own daemon, so each test
    starts and ends without settings read by another."""
    yield
    settings = sys.modules.get("weightstream.integrations.ai_toolkit.settings")
    if settings is not None:
        settings.configure(None)
