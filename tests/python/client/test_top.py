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

from tests.daemon import BIN

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


def test_top_once_prints_plain_lines_without_a_terminal(daemon):
    manifest, _ = daemon.client.upload_model("top", {"w": torch.zeros(16384)})
    session = daemon.client.open_session(manifest.model_id, [("w", ["w"])], 1 << 20, label="once")
    try:
        session.release(session.acquire(0))
        out = subprocess.run(
            [BIN, "top", "--socket", daemon.socket, "--once", "--interval-ms", "100"],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        assert out.returncode == 0, out.stderr
        assert out.stderr == ""
        lines = out.stdout.splitlines()
        assert lines[0] == f"weightstream top — {daemon.socket} — backend host — 1 session"
        assert lines[1] == "devices"
        assert lines[2].split() == [
            "device",
            "name",
            "sessions",
            "GB/s",
            "GPU",
            "wait",
            "pending",
            "hit",
            "rate",
            "budget",
        ]
        # Nothing moved during the interval: no rate, no wait (the client's first report
        # is 0), no hit rate; the budget of 1 MiB.
        assert lines[3].split()[:1] == ["host-0"]
        assert " 1 " in lines[3] and "0.00  0.0 %     0.0 %    -" in lines[3], lines[3]
        assert lines[4] == "sessions"
        columns = (
            "session label pid GB/s GPU wait pending hit rate"
            " budget staging resident host state acquires copied"
        )
        assert lines[5].split() == columns.split()
        row = lines[6].split()
        pid = str(os.getpid())
        assert row[:9] == [session.id, "once", pid, "0.00", "0.0", "%", "0.0", "%", "-"], row
        assert row[9:11] == ["1.0", "MiB"] and row[-5:] == ["0", "B", "1", "64.0", "KiB"], row
        # The passes by kind: a client that names no kind counts as training.
        assert lines[7] == "passes"
        assert lines[8].split() == "session kind GB/s GPU wait hit rate acquires copied".split()
        # The group went resident as the session opened, a copy in no pass: none is counted.
        row = lines[9].split()
        assert row == [session.id, "train", "0.00", "0.0", "%", "-", "1", "0", "B"], row
        assert len(lines) == 10, out.stdout
    finally:
        session.close()


def test_top_without_a_terminal_says_to_use_once_and_exits_2(daemon):
    out = subprocess.run(
        [BIN, "top", "--socket", daemon.socket],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == (
        "error: weightstream top needs a terminal; use `weightstream top --once` for plain output\n"
    )
