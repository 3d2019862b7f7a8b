"""tests/bench/flux_train.py's ``--interleave`` on the CPU, with stand-in children that speak the
lockstep protocol: the two modes' steps alternate one by one (each child's step starts only
after the other's step before it ended), the ratios are B's step over the A step before it, and
a child that dies mid-run (or before its first step) ends the run with the step it stopped at
instead of hanging; the children build their models one at a time, and the parent stops its
daemon also when the run fails."""

from __future__ import annotations

import fcntl
import os
import select
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.bench.benchlib import flux, runner

CHILD = r"""
import json, os, sys
mode, log, die_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
go, back = map(int, sys.argv[sys.argv.index("--lockstep") + 1].split(","))
if die_at == -2:  # gone before its first turn, as a child whose model does not fit
    os._exit(3)
times = {
    "a": [1.0, 2.0, 1.0, 1.0, 4.0],
    "b": [1.5, 2.2, 1.3, 1.0, 4.4],
    "c": [1.0, 1.0, 2.0, 2.4, 4.4],
    "e": [1.0, 1.0, 3.0, 3.0, 4.0],
}["c" if "--dequantize" in sys.argv else "e" if "--early-release" in sys.argv else mode]
for i in range(5):
    if os.read(go, 1) != b"g":
        sys.exit("no turn")
    if i == die_at:
        os._exit(3)
    with open(log, "a") as f:
        f.write(f"{mode}{i} start\n")
    with open(log, "a") as f:
        f.write(f"{mode}{i} end\n")
    os.write(back, b"d")
print("RESULT " + json.dumps({"mode": mode, "steps_s": times[2:], "det_losses": [0.5]}))
"""


def run(tmp_path, monkeypatch, die: dict | None = None, modes=("a", "b"), turn=1):
    log = tmp_path / "order.log"
    die = die or {}

    def child_cmd(args, mode, socket):
        return [sys.executable, "-c", CHILD, mode, str(log), str(die.get(mode, -1))]

    monkeypatch.setattr(runner, "child_cmd", child_cmd)
    args = SimpleNamespace(warmup=2, measured=3, interleave=list(modes), timeout=60, turn=turn)
    records, summary = runner.interleaved(args, "unused.sock", {}, tmp_path)
    return records, summary, log.read_text().splitlines()


def test_steps_alternate_and_each_b_step_is_over_the_a_step_before_it(tmp_path, monkeypatch):
    records, summary, order = run(tmp_path, monkeypatch)
    want = []
    for i in range(5):
        want += [f"a{i} start", f"a{i} end", f"b{i} start", f"b{i} end"]
    assert order == want
    assert [r["mode"] for r in records] == ["a", "b"]
    assert all(r["interleaved"] for r in records)
    assert summary["ratio_per_pair"] == [1.3, 1.0, 1.1]
    assert summary["ratio_median"] == pytest.approx(1.1)
    assert (summary["ratio_min"], summary["ratio_max"]) == (1.0, 1.3)
    assert summary["ratio_of_medians"] == 1.3
    assert "steady_ratio_of_medians" not in summary, "every step follows another process's"
    assert "error" not in summary


def test_a_child_that_dies_ends_the_run_at_its_step(tmp_path, monkeypatch):
    records, summary, order = run(tmp_path, monkeypatch, die={"b": 3})
    assert summary["error"] == "b did not finish its step 3"
    assert order[-2:] == ["a3 start", "a3 end"]
    assert records[1]["error"] == "no result: see flux-b.log"
    assert "ratio_median" not in summary


def test_a_third_mode_with_another_dequantize_is_timed_against_the_first(tmp_path, monkeypatch):
    """``--interleave a b b+group``: three children in turn; ``b+group`` runs b's child with
    ``--dequantize group`` and gets ratios of its own against a; the top level keeps b's."""
    records, summary, order = run(tmp_path, monkeypatch, modes=("a", "b", "b+group"))
    want = []
    for i in range(5):
        want += [f"a{i} start", f"a{i} end", f"b{i} start", f"b{i} end"]
        want += [f"b{i} start", f"b{i} end"]
    assert order == want
    assert [r["variant"] for r in records] == ["a", "b", "b+group"]
    assert summary["ratio_per_pair"] == [1.3, 1.0, 1.1]
    assert summary["ratios"]["b"]["ratio_per_pair"] == [1.3, 1.0, 1.1]
    assert summary["ratios"]["b+group"] == {
        "ratio_per_pair": [2.0, 2.4, 1.1],
        "ratio_median": 2.0,
        "ratio_min": 1.1,
        "ratio_max": 2.4,
        "ratio_of_medians": 2.4,
    }


def test_a_mode_with_early_release_runs_its_child_with_the_flag(tmp_path, monkeypatch):
    """``--interleave a b+early``: b's child runs with ``--early-release`` (the stand-in then
    times like ``e``) and its ratios are against a."""
    records, summary, _ = run(tmp_path, monkeypatch, modes=("a", "b+early"))
    assert [r["variant"] for r in records] == ["a", "b+early"]
    assert summary["ratios"]["b+early"]["ratio_per_pair"] == [3.0, 3.0, 1.0]


def test_turns_of_several_steps_and_the_steps_after_one_of_the_same_process(tmp_path, monkeypatch):
    """``--turn 2``: each child runs two steps per turn (a0 a1 b0 b1 a2 a3 b2 b3 a4 b4); pairs
    are still of the same index, and the steady ratio takes the measured steps that are not a
    turn's first (steps 3 of 2..4: a 1.0, b 1.0)."""
    records, summary, order = run(tmp_path, monkeypatch, turn=2)
    want = []
    for first in (0, 2, 4):
        for mode in "ab":
            for i in range(first, min(5, first + 2)):
                want += [f"{mode}{i} start", f"{mode}{i} end"]
    assert order == want
    assert summary["turn"] == 2
    assert summary["ratio_per_pair"] == [1.3, 1.0, 1.1]
    assert summary["ratios"]["b"]["steady_ratio_of_medians"] == 1.0


def test_a_child_gone_before_its_first_step_ends_the_run_there(tmp_path, monkeypatch):
    """The parent's turn to a child already gone, its pipe closed, ends the run at step 0 (not
    with the write's BrokenPipeError): the parent's second write, b's first turn, waits until
    b's end of the pipe is closed."""
    writes = []

    class Os:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def write(fd, data):
            writes.append(fd)
            if len(writes) == 2:
                poll = select.poll()
                poll.register(fd, select.POLLERR)
                assert poll.poll(30_000), "b's end of the pipe is still open"
            return os.write(fd, data)

    monkeypatch.setattr(runner, "os", Os())
    records, summary, order = run(tmp_path, monkeypatch, die={"b": -2})
    assert summary["error"] == "b did not finish its step 0"
    assert order == ["a0 start", "a0 end"]
    assert records[1]["error"] == "no result: see flux-b.log"


def test_children_build_one_at_a_time(tmp_path, monkeypatch):
    """With ``$WS_BENCH_BUILD_LOCK`` set (the parent sets it for every child), a build holds
    the lock: another process's try to take it fails until the build is done."""
    lock = tmp_path / "build.lock"
    monkeypatch.setenv(runner.BUILD_LOCK_ENV, str(lock))

    def taken() -> bool:
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False

    with flux.one_build_at_a_time():
        assert taken()
    assert not taken()


def test_the_parent_stops_its_daemon_when_the_run_fails(tmp_path, monkeypatch):
    """A run that raises (a child's pipe broken, say) still stops the daemon, which would
    otherwise hold the metrics port and the GPU for the next run."""
    daemon = tmp_path / "daemon"
    daemon.write_text("#!/bin/sh\nexec sleep 600\n")
    daemon.chmod(0o755)
    started = []
    popen = subprocess.Popen

    def recording(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    def failing(args, socket, out):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(runner.subprocess, "Popen", recording)
    monkeypatch.setattr(runner, "run_modes", failing)
    args = SimpleNamespace(
        out=str(tmp_path / "out"), bin=str(daemon), metrics="127.0.0.1:0", copy_bandwidth_limit=None
    )
    with pytest.raises(BrokenPipeError):
        runner.parent(args)
    assert len(started) == 1
    assert started[0].returncode == -15, "the daemon was terminated and waited for"
