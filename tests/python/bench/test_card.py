"""tests/bench/card.py, the emulated consumer card, on the CPU: its arguments, the link's rate,
the card-size check, phase markers and their segments, out-of-memory lines, the helper's
protocol, and a whole run with the device and the helper faked (the GPU runs the real ones)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bench import card
from tests.bench.card import CardError, GiB, Marker, MiB, Sample


def test_rates_read_in_the_daemons_units():
    cases = {
        "25GB/s": 25_000_000_000,
        "12 GB/s": 12_000_000_000,
        "25GiB/s": 25 << 30,
        "1.5GB/s": 1_500_000_000,
        "100MB/s": 100_000_000,
        "512MiB/s": 512 << 20,
        "25GB": 25_000_000_000,
        "25000000000": 25_000_000_000,
    }
    got = {text: card.parse_rate(text) for text in cases}
    assert got == cases


def test_a_rate_that_is_not_one_names_the_forms_it_takes():
    for text in ("fast", "GB/s", "25 GB per s"):
        with pytest.raises(CardError) as e:
            card.parse_rate(text)
        assert str(e.value) == (
            f"{text!r} is not a rate like '25GB/s', '25GiB/s' or bytes per second"
        )


def test_arguments_before_the_separator_and_the_command_after_it():
    a = card.parse_args(
        ["--gib", "24", "--link", "25GB/s", "--json", "o.json", "--", "python3", "t.py", "--", "x"]
    )
    assert (a.gib, a.link, a.link_bytes, a.json) == (24.0, "25GB/s", 25_000_000_000, "o.json")
    assert a.cmd == ["python3", "t.py", "--", "x"]
    assert (a.trainer_gib, a.device, a.interval_ms, a.log) == (None, 0, 100, None)
    no_link = card.parse_args(["--gib", "16", "--", "true"])
    assert (no_link.link, no_link.link_bytes) == (None, None)


def test_the_trainer_share_is_the_commands_own_unless_given():
    cmd = ["python3", "flux2_train.py", "--trainer-gib", "9", "--budgets", "24"]
    assert card.parse_args(["--gib", "24", "--", *cmd]).trainer_gib == 9.0
    assert card.parse_args(["--gib", "24", "--", "t.py", "--trainer-gib=7.5"]).trainer_gib == 7.5
    given = card.parse_args(["--gib", "24", "--trainer-gib", "5", "--", *cmd])
    assert given.trainer_gib == 5.0


def test_bad_arguments_say_what_to_give():
    cases = [
        (["--gib", "24", "python3", "t.py"], "no command: give it after '--' "),
        (["--gib", "24", "--"], "no command after '--'"),
        (["--gib", "0", "--", "true"], "--gib 0: a card needs some memory (e.g. --gib 24)"),
        (
            ["--gib", "24", "--link", "25MB/s", "--", "true"],
            "--link 25MB/s is 25000000 bytes/s, below the daemon's lowest limit (100 MB/s): "
            "did you mean GB/s?",
        ),
        (["--gib", "24", "--interval-ms", "1", "--", "true"], "--interval-ms 1: between 10 and"),
        (
            ["--gib", "24", "--", "t.py", "--trainer-gib", "lots"],
            "the command's --trainer-gib 'lots' is not a number",
        ),
    ]
    failures = []
    for argv, want in cases:
        try:
            card.parse_args(argv)
            failures.append(f"{argv}: accepted")
        except CardError as e:
            if not str(e).startswith(want):
                failures.append(f"{argv}: {e}")
    assert not failures, failures


def test_a_card_too_small_for_the_trainers_share_names_the_numbers():
    context = 512 * MiB
    card.check_card(24, 9, context)  # 9 + 2 × 0.5 GiB leaves 14 GiB for the daemon
    card.check_card(24, None, context)  # no share known: nothing to check
    with pytest.raises(CardError) as e:
        card.check_card(10, 9, context)
    assert str(e.value) == (
        "a 10 GiB card is too small for the trainer's own share: 9 GiB (--trainer-gib) and 2 "
        "CUDA contexts of 0.50 GiB (the trainer's and the daemon's) need 10.00 GiB, leaving "
        "nothing for the daemon's weights; give --gib more than 10.00 or a smaller --trainer-gib"
    )


def test_phase_markers_with_or_without_their_own_time_and_label():
    cases = [
        ("WS-PHASE training\n", Marker(5.0, "training")),
        (
            "WS-PHASE loading t=1733150000.25 weightstream 24\n",
            Marker(1733150000.25, "loading", "weightstream 24"),
        ),
        ("[aitk] WS-PHASE training flux1 rank 32", Marker(5.0, "training", "flux1 rank 32")),
        ("step 3 loss 0.33", None),
        ("WS-PHASE", None),
    ]
    got = [(line, card.parse_marker(line, 5.0)) for line, _ in cases]
    assert got == cases


def test_out_of_memory_lines_are_told_from_the_rest():
    cases = {
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB": True,
        "RuntimeError: CUDA error: out of memory": True,
        "cannot allocate 2147483648 bytes of staging memory on device GPU-1: "
        "cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY": True,
        "cupy.cuda.memory.OutOfMemoryError: Out of memory allocating 1,024 bytes": True,
        "cudaErrorMemoryAllocation": True,
        "step 3: loss 0.33, memory 21.5 GiB": False,
        "WS-PHASE loading out of memory probe": False,
    }
    got = {line: card.is_oom(line) for line in cases}
    assert got == cases


def samples(*rows):
    return [Sample(t, used * GiB, free * GiB) for t, used, free in rows]


def test_samples_split_at_markers_into_phases_with_their_peaks():
    # The helper left 24 GiB free (of 140 GiB: 116 held, contexts included); the card's use is
    # what is no longer free of those 24.
    rows = samples(
        (10.0, 117, 23),
        (11.0, 126, 14),  # loading: 10 GiB of the card
        (12.0, 121, 19),  # the loading marker of the second mode is at 12.0: this is its sample
        (13.0, 131, 9),  # training: 15 GiB
        (14.0, 135, 5),  # training: 19 GiB (at the end time: in the last segment)
        (14.1, 139, 1),  # after the end (the sampler's last): not the command's
    )
    markers = [
        Marker(11.5, "training", "a"),
        Marker(12.0, "loading", "b"),
        Marker(12.5, "training", "b"),
    ]
    segs = card.split_phases(rows, markers, start=10.0, end=14.0, free_at_hold=24 * GiB)
    got = [(g.phase, g.label, g.start, g.end, g.peak_card, g.peak_device, g.samples) for g in segs]
    assert got == [
        ("loading", "", 10.0, 11.5, 10 * GiB, 126 * GiB, 2),
        ("training", "a", 11.5, 12.0, None, None, 0),
        ("loading", "b", 12.0, 12.5, 5 * GiB, 121 * GiB, 1),
        ("training", "b", 12.5, 14.0, 19 * GiB, 135 * GiB, 2),
    ]
    peaks = card.phase_peaks(segs)
    assert peaks == {
        "loading": {"peak_card": 10 * GiB, "peak_device": 126 * GiB, "seconds": 2.0},
        "training": {"peak_card": 19 * GiB, "peak_device": 135 * GiB, "seconds": 2.0},
    }


def test_a_marker_at_the_start_or_before_it_leaves_no_empty_loading_segment():
    rows = samples((9.9, 139, 1), (10.0, 120, 20), (10.5, 121, 19))  # the first: before it
    markers = [Marker(9.0, "training", "early")]  # a clock a little behind: counted at start
    segs = card.split_phases(rows, markers, start=10.0, end=11.0, free_at_hold=24 * GiB)
    assert [(g.phase, g.label, g.start, g.peak_card) for g in segs] == [
        ("training", "early", 10.0, 5 * GiB)
    ]


def test_phase_writes_the_file_card_names_or_prints(tmp_path, monkeypatch, capsys):
    path = tmp_path / "phases"
    monkeypatch.setenv(card.PHASE_ENV, str(path))
    card.phase("loading", "flux1 resident")
    card.phase("training")
    lines = path.read_text().splitlines()
    marks = [card.parse_marker(x, 0.0) for x in lines]
    assert [(m.phase, m.label) for m in marks] == [
        ("loading", "flux1 resident"),
        ("training", ""),
    ]
    assert all(abs(m.t - time.time()) < 3600 for m in marks)  # its own time, not the 0.0 given
    monkeypatch.delenv(card.PHASE_ENV)
    card.phase("training", "x")
    assert capsys.readouterr().out.startswith("WS-PHASE training t=")
    with pytest.raises(ValueError, match="phase 'two words': one word"):
        card.phase("two words")


def test_the_helpers_report_and_its_lifeline(tmp_path):
    """The helper's CARD-HOLD line is read; closing its stdin ends it (card.py's exit, or its
    death, gives the memory back)."""
    said = {"free_before": 100, "total": 140, "held": 76, "free": 24}
    script = f"import sys; print('noise'); print('CARD-HOLD {json.dumps(said)}'); sys.stdin.read()"
    h = card.Holder(24, dict(os.environ), cmd=[sys.executable, "-c", script])
    assert h.report == said
    assert h.proc.poll() is None
    h.release()
    assert h.proc.returncode == 0
    error = "import json; print('CARD-HOLD-ERROR ' + json.dumps({'message': 'no room'}))"
    with pytest.raises(CardError, match="^no room$"):
        card.Holder(24, dict(os.environ), cmd=[sys.executable, "-c", error])
    with pytest.raises(CardError, match=r"ended without a report \(status 3\): oops"):
        card.Holder(24, dict(os.environ), cmd=[sys.executable, "-c", "print('oops'); exit(3)"])


class FakeDevice:
    """140 GiB; 100 GiB free before the helper, what the helper leaves after. (The peaks'
    arithmetic is tested on fixed samples above: here sampling runs on its own clock.)"""

    name = "fake"

    def __init__(self):
        self.free = 100 * GiB
        self.closed = False

    def info(self):
        return {"name": "Fake H200", "uuid": "GPU-fake", "total_gib": 140.0}

    def sample(self):
        return Sample(time.time(), 140 * GiB - self.free, self.free)

    def close(self):
        self.closed = True


def fake_holder(device, free_left, context=GiB // 2):
    """A helper that 'holds' all but `free_left` of the device's free memory."""
    made = []

    class Held:
        def __init__(self, card_gib, env):
            self.env = env
            self.report = {
                "free_before": device.free - context,
                "total": 140 * GiB,
                "held": device.free - context - free_left,
                "free": free_left,
            }
            device.free = free_left
            self.released = False
            made.append(self)

        def release(self):
            self.released = True

    return Held, made


#: A command that says where it is (both ways), reports an out-of-memory error, writes its
#: environment where the test can read it, and fails.
COMMAND = """
import json, os, sys, time
print("WS-PHASE loading t=%f fake-mode" % time.time(), flush=True)
with open(os.environ["WS_PHASE_FILE"], "a") as f:
    f.write("WS-PHASE training t=%f fake-mode\\n" % time.time())
keys = ("WEIGHTSTREAM_COPY_BANDWIDTH_LIMIT", "CUDA_VISIBLE_DEVICES", "WS_CARD_GIB")
json.dump({k: os.environ.get(k) for k in keys}, open(sys.argv[1], "w"))
print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr)
sys.exit(3)
"""


def test_a_whole_run_on_a_faked_device(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(card.LINK_ENV, "1GB/s")  # the caller's own: replaced by --link
    device = FakeDevice()
    holder, made = fake_holder(device, 24 * GiB)
    out, seen = tmp_path / "card.json", tmp_path / "env.json"
    argv = ["--gib", "24", "--link", "25GB/s", "--json", str(out), "--interval-ms", "10"]
    argv += ["--", sys.executable, "-c", COMMAND, str(seen)]
    assert card.main(argv, device=device, holder=holder) == 3
    assert json.loads(seen.read_text()) == {
        "WEIGHTSTREAM_COPY_BANDWIDTH_LIMIT": "25000000000",
        "CUDA_VISIBLE_DEVICES": "GPU-fake",
        "WS_CARD_GIB": "24",
    }
    assert made[0].released and device.closed
    rep = json.loads(out.read_text())
    assert rep["hold"] == {
        "held_gib": 75.5,
        "free_cuda_gib": 24.0,
        "free_sampled_gib": 24.0,
        "helper_context_gib": 0.5,
    }
    assert (rep["exit_status"], rep["link_bytes_per_s"], rep["sampler"]) == (3, 25 * 10**9, "fake")
    labels = [(s["phase"], s["label"]) for s in rep["segments"]]
    assert labels[-2:] == [("loading", "fake-mode"), ("training", "fake-mode")]
    assert rep["oom"] == {
        "lines": ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    }
    printed = capsys.readouterr().out
    assert (
        "card: out of memory on the emulated 24 GiB card: torch.OutOfMemoryError: CUDA out of "
        "memory. Tried to allocate 2.00 GiB\n" in printed
    )
    assert "card: command exited with status 3\n" in printed


def test_a_card_too_small_is_refused_before_the_command_runs(tmp_path, capsys):
    device = FakeDevice()
    holder, made = fake_holder(device, 6 * GiB)
    ran = tmp_path / "ran"
    argv = ["--gib", "6", "--trainer-gib", "5.5", "--", sys.executable, "-c"]
    argv += [f"open({str(ran)!r}, 'w')"]
    assert card.main(argv, device=device, holder=holder) == 2
    assert not ran.exists()
    assert made[0].released and device.closed
    err = capsys.readouterr().err
    assert err == (
        "card: error: a 6 GiB card is too small for the trainer's own share: 5.5 GiB "
        "(--trainer-gib) and 2 CUDA contexts of 0.50 GiB (the trainer's and the daemon's) need "
        "6.50 GiB, leaving nothing for the daemon's weights; give --gib more than 6.50 or a "
        "smaller --trainer-gib\n"
    )


def test_a_helper_that_left_another_amount_free_is_an_error(capsys):
    device = FakeDevice()
    holder, made = fake_holder(device, 23 * GiB)  # something else took a GiB meanwhile
    assert card.main(["--gib", "24", "--", "true"], device=device, holder=holder) == 2
    assert made[0].released
    assert capsys.readouterr().err == (
        "card: error: the helper left 23.000 GiB free, not the card's 24 GiB (within 64 MiB): "
        "another process allocated meanwhile?\n"
    )


def test_a_process_the_command_leaves_running_is_ended(tmp_path, monkeypatch):
    """A command that exits leaving a child that holds its output (a daemon it started) does
    not hang card.py: the child is ended with the command's process group."""
    monkeypatch.setattr(card, "LEFT_RUNNING_GRACE_S", 0.2)
    device = FakeDevice()
    holder, _ = fake_holder(device, 24 * GiB)
    pidfile = tmp_path / "pid"
    script = (
        "import subprocess, sys; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))"
    )
    out = tmp_path / "card.json"
    argv = ["--gib", "24", "--json", str(out), "--", sys.executable, "-c", script]
    assert card.main(argv, device=device, holder=holder) == 0
    assert json.loads(out.read_text())["left_running_ended"] is True
    # Its output is closed: it is exiting (gone, or a zombie until init reaps it, once its
    # exit is through; polled to a deadline).
    stat = Path(f"/proc/{int(pidfile.read_text())}/stat")

    def exited():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 30
    while not exited() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exited()


def run_with_shim(stand_ins: Path, script: str, env: dict) -> str:
    """``script`` run in a Python with the bench shim (tests/bench/aitk_shim) first on its path
    and ``stand_ins`` (modules shaped like ai-toolkit's) after it, ``env`` added; its stdout."""
    shim = Path(card.__file__).parent / "aitk_shim"
    path = os.pathsep.join([str(shim), str(stand_ins)])
    return subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": path, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_ai_toolkits_first_train_loop_step_marks_training(tmp_path):
    """The bench shim (tests/bench/aitk_shim, first on ai-toolkit's PYTHONPATH) appends the
    training marker at the first ``Timer.start('train_loop')``, once, with the run's label; a
    toolkit/timer.py shaped like ai-toolkit's stands in for it."""
    timer = tmp_path / "toolkit" / "timer.py"
    timer.parent.mkdir()
    (timer.parent / "__init__.py").write_text("")
    timer.write_text(
        "class Timer:\n"
        "    def __init__(self):\n"
        "        self.started = []\n"
        "    def start(self, name):\n"
        "        self.started.append(name)\n"
    )
    trainer = (
        "from toolkit.timer import Timer\n"
        "t = Timer()\n"
        "for name in ('load', 'train_loop', 'train_loop'):\n"
        "    t.start(name)\n"
        "print(t.started)\n"
    )
    phases = tmp_path / "phases"
    before = time.time()
    env = {card.PHASE_ENV: str(phases), "WS_PHASE_LABEL": "weightstream"}
    out = run_with_shim(tmp_path, trainer, env)
    assert out == "['load', 'train_loop', 'train_loop']\n"
    marks = [card.parse_marker(x, 0.0) for x in phases.read_text().splitlines()]
    assert [(m.phase, m.label) for m in marks] == [("training", "weightstream")]
    assert before <= marks[0].t <= time.time()


def test_ai_toolkits_sampling_passes_are_timed_each_no_grad_forward(tmp_path):
    """The shim's WS_AITK_SAMPLING wraps ``BaseSDTrainProcess.sample``: one record a call,
    its step and one time per no_grad forward of ``self.sd.unet`` (a forward with grad is
    not a sampling pass); a jobs/process module shaped like ai-toolkit's stands in for it."""
    jobs = tmp_path / "jobs" / "process"
    jobs.mkdir(parents=True)
    (tmp_path / "jobs" / "__init__.py").write_text("")
    (jobs / "__init__.py").write_text("")
    (jobs / "BaseSDTrainProcess.py").write_text(
        "import torch\n"
        "class BaseSDTrainProcess:\n"
        "    def sample(self, step):\n"
        "        x = torch.ones(2, 4)\n"
        "        self.sd.unet(x)\n"
        "        with torch.no_grad():\n"
        "            for _ in range(3):\n"
        "                x = self.sd.unet(x)\n"
        "        return x.sum().item()\n"
    )
    trainer = (
        "import types, torch\n"
        "from jobs.process.BaseSDTrainProcess import BaseSDTrainProcess\n"
        "p = BaseSDTrainProcess()\n"
        "p.sd = types.SimpleNamespace(unet=torch.nn.Linear(4, 4))\n"
        "torch.nn.init.eye_(p.sd.unet.weight); torch.nn.init.zeros_(p.sd.unet.bias)\n"
        "print(p.sample(7))\n"
    )
    out_file = tmp_path / "sampling.json"
    out = run_with_shim(tmp_path, trainer, {"WS_AITK_SAMPLING": str(out_file)})
    assert out == "8.0\n"  # the call's own result, through the wrapper
    (record,) = json.loads(out_file.read_text())["samples"]
    assert (record["step"], record["after_training_started"]) == (7, False)
    assert len(record["forward_s"]) == 3 and all(s >= 0 for s in record["forward_s"])
    assert record["wall_s"] >= sum(record["forward_s"])


class FakeTorch:
    """torch as the helper uses it, over a device of `free` bytes whose driver takes
    `overhead` more per allocation and makes none larger than `largest`."""

    uint8 = "uint8"

    class OutOfMemoryError(RuntimeError):
        pass

    def __init__(self, free: int, largest: int, overhead: int):
        self.free, self.largest, self.overhead = free, largest, overhead
        self.allocations: list[int] = []
        self.cuda = self

    def mem_get_info(self):
        return self.free, 140 * GiB

    def zeros(self, n, device):
        assert device == "cuda"

    def empty(self, n, dtype, device):
        assert (dtype, device) == ("uint8", "cuda") and n % (2 * MiB) == 0
        if n > self.largest or n + self.overhead > self.free:
            raise self.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} bytes")
        self.free -= n + self.overhead
        self.allocations.append(n)


def test_the_helper_leaves_the_cards_memory_free(monkeypatch, capsys):
    """It allocates what is free but the card, in 2 MiB units, halving what it asks for when
    the driver refuses (fragmentation), and says what it did; it holds until stdin closes."""
    cases = [
        # (free before, largest allocation, the driver's overhead per allocation)
        (100 * GiB + 3 * MiB, 200 * GiB, 0),
        (100 * GiB, 30 * GiB, 0),
        (100 * GiB, 200 * GiB, MiB),
    ]
    failures = []
    for free, largest, overhead in cases:
        fake = FakeTorch(free, largest, overhead)
        monkeypatch.setitem(sys.modules, "torch", fake)
        monkeypatch.setattr(sys, "stdin", io.StringIO(""))
        assert card.hold(24) == 0
        line = capsys.readouterr().out.strip()
        said = json.loads(line.removeprefix("CARD-HOLD "))
        want = {
            "free_before": free,
            "total": 140 * GiB,
            "held": sum(fake.allocations),
            "free": fake.free,
        }
        # Within the 2 MiB unit above the card, or the driver's overhead below it.
        over = fake.free - 24 * GiB
        if said != want or not -len(fake.allocations) * overhead <= over < 2 * MiB:
            failures.append(f"{(free, largest, overhead)}: {said}, {fake.allocations}")
    assert not failures, failures


def test_the_helper_refuses_a_card_larger_than_the_device(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", FakeTorch(20 * GiB, 200 * GiB, 0))
    assert card.hold(24) == 2
    line = capsys.readouterr().out.strip()
    assert json.loads(line.removeprefix("CARD-HOLD-ERROR ")) == {
        "message": "cannot emulate a 24 GiB card: the device has 20.00 GiB free (of 140.00 "
        "GiB) besides the helper's own CUDA context; give a smaller --gib or stop what else "
        "uses the device"
    }
