"""Fixtures of the Python tests: a real daemon (the binary built by tests/run.sh) on its host
backend, on a private socket and shared-memory directory."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import weightstream

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("WEIGHTSTREAM_BIN", str(ROOT / "target" / "debug" / "weightstream"))


class Daemon:
    def __init__(self, tmp: Path, *extra_args: str):
        self.socket = str(tmp / "ws.sock")
        self.shm = tmp / "shm"
        self.shm.mkdir()
        self.log = open(tmp / "daemon.log", "wb")
        self.proc = subprocess.Popen(
            [
                BIN,
                "serve",
                "--backend",
                "host",
                "--socket",
                self.socket,
                "--shm-dir",
                str(self.shm),
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

    def shm_files(self) -> list[str]:
        return sorted(os.listdir(self.shm))

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
