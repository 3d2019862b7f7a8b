"""`weightstream top` in a real terminal (tmux) against a running daemon: the test reads the
session's label from the captured screen, then quits with `q`."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import pytest
import torch
from conftest import BIN

needs_tmux = pytest.mark.skipif(
    shutil.which("tmux") is None and os.environ.get("WEIGHTSTREAM_REQUIRE_TMUX") != "1",
    reason="tmux is not installed (tests/run.sh installs it and sets WEIGHTSTREAM_REQUIRE_TMUX)",
)


def poll(what: str, cond, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@needs_tmux
def test_top_shows_the_session_in_a_real_terminal(daemon):
    manifest, _ = daemon.client.upload_model("top", {"w": torch.zeros(16384)})
    label = f"top-probe-{uuid.uuid4().hex[:6]}"
    session = daemon.client.open_session(manifest.model_id, [("w", ["w"])], 1 << 20, label=label)
    session.release(session.acquire(0))
    server = f"ws-top-{uuid.uuid4().hex[:8]}"  # a private tmux server: no clash with the user's
    tmux = ["tmux", "-L", server]
    rc = daemon.tmp / "top.rc"
    command = f"{BIN} top --socket {daemon.socket} --interval-ms 200; echo $? > {rc}"
    try:
        subprocess.run(
            [*tmux, "new-session", "-d", "-s", "top", "-x", "180", "-y", "40", command],
            check=True,
        )

        def screen() -> str:
            return subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True
            ).stdout

        shown = poll("the label on screen", lambda: label in (s := screen()) and s)
        assert "weightstream top" in shown and "backend host" in shown
        row = next(line for line in shown.splitlines() if label in line)
        assert session.id in row, row
        assert "1.0 MiB" in row, row  # the session's budget

        subprocess.run([*tmux, "send-keys", "-t", "top", "q"], check=True)

        # top's exit status, written by the pane's shell (tmux's own #{pane_dead_status}
        # is sometimes left empty by tmux 3.3).
        status = poll("top to exit", lambda: rc.exists() and rc.read_text().strip())
        assert status == "0", status
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        session.close()
