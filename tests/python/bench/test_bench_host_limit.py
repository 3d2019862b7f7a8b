"""tests/bench/aitk/cgroup.py and ai_toolkit_24g.py's ``--host-limit-gib``: cgroup v2 and v1
on fake trees (a test's directories standing in for the kernel's files), the bench's refusals
and report, and, where this host lets root make a memory cgroup, a real one: a child past its
limit OOM-killed, one under it measured, a file the bench had cached counted once dropped."""

from __future__ import annotations

import errno
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.bench import ai_toolkit_24g
from tests.bench.aitk import cgroup, report_24g, runs_24g
from tests.bench.aitk.cgroup import CgroupError
from tests.python.bench.test_bench_ai_toolkit_24g import report_call

pytestmark = pytest.mark.no_daemon

MiB, GiB = 1 << 20, 1 << 30

#: What the kernel puts in a new cgroup's directory, per version (the fake ``mkdir``'s files).
V2_FILES = {
    "cgroup.procs": "",
    "memory.max": "max\n",
    "memory.swap.max": "max\n",
    "memory.peak": "0\n",
    "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
}
V1_FILES = {
    "cgroup.procs": "",
    "tasks": "",
    "memory.limit_in_bytes": "9223372036854771712\n",
    "memory.memsw.limit_in_bytes": "9223372036854771712\n",
    "memory.max_usage_in_bytes": "0\n",
    "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
}
NO_SWAP = "MemTotal:       24683996 kB\nSwapTotal:             0 kB\n"
SWAP = "MemTotal:       24683996 kB\nSwapTotal:       8388604 kB\n"


class FakeKernel:
    """``mkdir`` fills the new directory with ``files``; ``rmdir`` removes it and records it."""

    def __init__(self, files: dict):
        self.files, self.removed = files, []

    def mkdir(self, path):
        os.mkdir(path)
        for name, text in self.files.items():
            (Path(path) / name).write_text(text)

    def rmdir(self, path):
        shutil.rmtree(path)
        self.removed.append(Path(path).name)


def fake(monkeypatch, tmp_path, version, files=None, swap=NO_SWAP):
    root = tmp_path / "cg"
    root.mkdir()
    if version == 2:
        (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
        (root / "cgroup.subtree_control").write_text("cpu memory\n")
    else:
        (root / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    kernel = FakeKernel(V2_FILES if files is None and version == 2 else files or V1_FILES)
    monkeypatch.setattr(cgroup, "_mkdir", kernel.mkdir)
    monkeypatch.setattr(cgroup, "_rmdir", kernel.rmdir)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(swap)
    return root, kernel, meminfo


def join(cg) -> int:
    """A child that joins ``cg`` in preexec_fn and exits; its pid."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"], preexec_fn=cg.preexec)
    assert proc.wait() == 0
    return proc.pid


def test_v2_limits_swap_off_joins_and_reads_back_peak_and_oom_kills(tmp_path, monkeypatch):
    root, kernel, meminfo = fake(monkeypatch, tmp_path, 2)
    with cgroup.memory_cgroup(3 * GiB + 123, root, "run", meminfo) as cg:
        path = root / "run"
        assert (path / "memory.max").read_text() == str(3 * GiB)  # rounded down to a page
        assert (path / "memory.swap.max").read_text() == "0"
        pid = join(cg)
        assert (path / "cgroup.procs").read_text() == str(pid)
        (path / "memory.peak").write_text("123456789\n")
        (path / "memory.events").write_text("low 0\nhigh 4\nmax 9\noom 2\noom_kill 2\n")
        assert cg.report() == {
            "cgroup_version": 2,
            "limit_bytes": 3 * GiB,
            "peak_bytes": 123456789,
            "oom_kill": 2,
            "swap": "memory.swap.max",
            "path": str(path),
        }
        assert kernel.removed == []
    assert kernel.removed == ["run"] and not path.exists()


def test_v2_peak_is_none_on_a_kernel_without_memory_peak(tmp_path, monkeypatch):
    files = {k: v for k, v in V2_FILES.items() if k != "memory.peak"}
    root, _, meminfo = fake(monkeypatch, tmp_path, 2, files)
    with cgroup.memory_cgroup(GiB, root, "run", meminfo) as cg:
        assert cg.peak_bytes() is None and cg.oom_kills() == 0


def test_v2_enables_memory_for_children_or_says_it_could_not(tmp_path, monkeypatch):
    root, kernel, meminfo = fake(monkeypatch, tmp_path, 2)
    (root / "cgroup.subtree_control").write_text("cpu io\n")
    with pytest.raises(CgroupError) as e:
        with cgroup.memory_cgroup(GiB, root, "run", meminfo):
            pass
    # the fake keeps what was written; the kernel would list memory
    assert (root / "cgroup.subtree_control").read_text() == "+memory"
    assert str(e.value) == (
        f"{root}/cgroup.subtree_control does not list memory after +memory; run as root on a"
        " host with the memory controller, or drop --host-limit-gib"
    )
    assert not (root / "run").exists() and kernel.removed == []


@pytest.mark.parametrize("version", [1, 2])
def test_swap_unaccounted_is_refused_on_a_host_with_swap(tmp_path, monkeypatch, version):
    swap = "memory.swap.max" if version == 2 else "memory.memsw.limit_in_bytes"
    files = {k: v for k, v in (V2_FILES if version == 2 else V1_FILES).items() if k != swap}
    root, kernel, meminfo = fake(monkeypatch, tmp_path, version, files, swap=SWAP)
    with pytest.raises(CgroupError) as e:
        with cgroup.memory_cgroup(GiB, root, "run", meminfo):
            pass
    assert str(e.value) == (
        f"{root}/run/{swap} is missing (swap accounting off) and the host has 8.0 GiB of swap:"
        " the run could swap past the limit; boot with swapaccount=1 or swapoff -a, or drop"
        " --host-limit-gib"
    )
    assert kernel.removed == ["run"]  # made, then removed
    meminfo.write_text(NO_SWAP)
    with cgroup.memory_cgroup(GiB, root, "run", meminfo) as cg:
        assert cg.report()["swap"] == "the host has no swap"


def test_v1_limits_memory_and_memsw_and_reads_max_usage_and_oom_control(tmp_path, monkeypatch):
    root, kernel, meminfo = fake(monkeypatch, tmp_path, 1)
    with cgroup.memory_cgroup(64 * GiB, root, "run", meminfo) as cg:
        path = root / "run"
        assert (path / "memory.limit_in_bytes").read_text() == str(64 * GiB)
        assert (path / "memory.memsw.limit_in_bytes").read_text() == str(64 * GiB)
        pid = join(cg)
        assert (path / "cgroup.procs").read_text() == str(pid)
        assert (path / "tasks").read_text() == ""
        (path / "memory.max_usage_in_bytes").write_text(f"{60 * GiB}\n")
        (path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 1\noom_kill 1\n")
        assert cg.report() == {
            "cgroup_version": 1,
            "limit_bytes": 64 * GiB,
            "peak_bytes": 60 * GiB,
            "oom_kill": 1,
            "swap": "memory.memsw.limit_in_bytes",
            "path": str(path),
        }
    assert kernel.removed == ["run"]


def test_v1_without_cgroup_procs_joins_through_tasks(tmp_path, monkeypatch):
    files = {k: v for k, v in V1_FILES.items() if k != "cgroup.procs"}
    root, _, meminfo = fake(monkeypatch, tmp_path, 1, files)
    with cgroup.memory_cgroup(GiB, root, "run", meminfo) as cg:
        pid = join(cg)
        assert (root / "run" / "tasks").read_text() == str(pid)


def test_a_limit_the_kernel_reads_back_otherwise_is_an_error(tmp_path, monkeypatch):
    root, kernel, meminfo = fake(monkeypatch, tmp_path, 1)
    written = []

    def write(path, value):  # a kernel that rounds up, as v1 may to its own granularity
        written.append(path.name)
        path.write_text(str(int(value) + 4096) if path.name == "memory.limit_in_bytes" else value)

    monkeypatch.setattr(cgroup, "_write", write)
    with pytest.raises(CgroupError) as e:
        with cgroup.memory_cgroup(GiB, root, "run", meminfo):
            pass
    assert str(e.value).startswith(
        f"{root}/run/memory.limit_in_bytes reads {GiB + 4096} after {GiB} was written;"
    )
    assert written == ["memory.limit_in_bytes"] and kernel.removed == ["run"]


def test_the_processes_a_run_leaves_in_its_cgroup_are_ended_before_it_is_removed(
    tmp_path, monkeypatch
):
    root, kernel, meminfo = fake(monkeypatch, tmp_path, 1)
    stays = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
    busy = []

    def rmdir(path):  # the kernel's EBUSY while a process is in the cgroup
        if stays.poll() is None:
            busy.append(stays.pid)
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        kernel.rmdir(path)

    monkeypatch.setattr(cgroup, "_rmdir", rmdir)
    with cgroup.memory_cgroup(GiB, root, "run", meminfo):
        (root / "run" / "cgroup.procs").write_text(f"{stays.pid}\n")
    assert stays.returncode == -9 and busy[0] == stays.pid and kernel.removed == ["run"]


def test_where_no_cgroup_can_be_made_the_reason_says_what_to_do(tmp_path, monkeypatch):
    assert cgroup.check(tmp_path) == (
        f"{tmp_path} is no memory cgroup: it has neither cgroup.controllers (v2) nor"
        " memory.limit_in_bytes (v1); run as root on a host with the memory controller, or drop"
        " --host-limit-gib"
    )
    root, _, meminfo = fake(monkeypatch, tmp_path, 1)
    assert cgroup.check(root, meminfo) is None

    def denied(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(cgroup, "_mkdir", denied)
    assert cgroup.check(root, meminfo) == (
        f"cannot make {root}/weightstream-bench-probe-{os.getpid()}: Permission denied; run as"
        " root on a host with the memory controller, or drop --host-limit-gib"
    )


def test_the_root_is_v2s_with_memory_else_v1s_memory_mount(tmp_path):
    v2 = tmp_path / "unified"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu io memory pids\n")
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0\n"
        "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n"
        "cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n"
    )
    assert cgroup.find_root(v2, mounts) == v2
    (v2 / "cgroup.controllers").write_text("cpu io pids\n")  # hybrid: memory is v1's
    assert cgroup.find_root(v2, mounts) == Path("/sys/fs/cgroup/memory")
    mounts.write_text("cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n")
    with pytest.raises(CgroupError) as e:
        cgroup.find_root(v2, mounts)
    assert str(e.value) == (
        f"no memory controller: neither {v2}/cgroup.controllers lists memory nor does {mounts}"
        " mount cgroup v1's; run as root on a host with the memory controller, or drop"
        " --host-limit-gib"
    )


BENCH = ["--aitk", "/nonexistent/aitk", "--bin", "/nonexistent/ws", "--smoke"]


@pytest.mark.parametrize(
    "extra,want",
    [
        (
            [],
            "error: --host-limit-gib needs --card: the limit holds each run's card.py subprocess"
            " (its daemon and trainer); without --card the runs are in this process\n",
        ),
        (
            ["--card", "24", "--runs", "resident:r32,aitk:r32"],
            "error: --host-limit-gib: resident r32 run in this process, not under card.py; drop"
            " them from --runs\n",
        ),
        (
            ["--card", "24", "--daemon-socket", "/tmp/ws.sock"],
            "error: --host-limit-gib with --daemon-socket: that daemon runs outside the runs'"
            " cgroups and its memory would not count; drop one of them\n",
        ),
    ],
)
def test_the_bench_refuses_runs_the_limit_cannot_hold(tmp_path, capsys, extra, want):
    work = tmp_path / "work"
    argv = [*BENCH, "--work", str(work), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        ai_toolkit_24g.main([*argv, "--host-limit-gib", "64", *extra])
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith(want)
    assert not work.exists()


def test_the_bench_stops_before_the_build_where_no_cgroup_can_be_made(tmp_path, capsys):
    work = tmp_path / "work"
    argv = [*BENCH, "--work", str(work), "--out", str(tmp_path / "out"), "--card", "24"]
    code = ai_toolkit_24g.main([*argv, "--host-limit-gib", "64", "--cgroup-root", str(tmp_path)])
    assert code == 2
    assert capsys.readouterr().err == (
        f"ai_toolkit_24g: --host-limit-gib 64: {tmp_path} is no memory cgroup: it has neither"
        " cgroup.controllers (v2) nor memory.limit_in_bytes (v1); run as root on a host with"
        " the memory controller, or drop --host-limit-gib\n"
    )
    assert not work.exists()


def _limited_call(runs):
    return report_call(runs, card_gib=24, host_limit_gib=64)


def test_the_report_gives_each_runs_cgroup_peak_and_limit_and_its_oom_kills():
    ws, aitk = runs_24g.parse_runs("weightstream:r32:full,aitk:r32")
    limit = {"cgroup_version": 1, "limit_bytes": 64 * GiB, "path": "/sys/fs/cgroup/memory/x"}
    ws = dict(ws, rc=0, host_limit=dict(limit, peak_bytes=61 * GiB + GiB // 2, oom_kill=0))
    aitk = dict(aitk, rc=-9, host_limit=dict(limit, peak_bytes=64 * GiB, oom_kill=1))
    for r in (ws, aitk):
        r["summary"] = runs_24g.summarize(r)
    assert aitk["summary"]["host_cgroup"] == {
        "cgroup_version": 1,
        "limit_bytes": 64 * GiB,
        "peak_bytes": 64 * GiB,
        "oom_kill": 1,
    }
    text = report_24g.markdown({"calls": [_limited_call([ws, aitk])]})
    assert (
        "- host limit: 64 GiB, swap off: each run's card.py, its daemon and its trainer in a"
        " memory cgroup of their own (cgroup v1); its peak counts the page cache the run read as"
        " well as its own memory\n"
    ) in text
    assert "| host GiB trainer / daemon | host GiB peak (cgroup) / limit |\n" in text
    assert "| --- | --- | --- | --- | --- | --- | --- | --- |\n" in text
    assert "| weightstream r32 full | 0 | - | - | - / - | - / - | - / - | 61.50 / 64.00 |\n" in text
    assert "| aitk r32 | -9 | - | - | - / - | - / - | - / - | 64.00 / 64.00 |\n" in text
    assert (
        "- aitk r32: OOM-killed: the kernel's OOM killer ended 1 process of the run at its 64.00"
        " GiB host limit\n"
    ) in text
    assert "weightstream r32 full: OOM-killed" not in text
    unlimited = dict(
        _limited_call([dict(ws, summary=runs_24g.summarize(dict(ws, host_limit=None)))])
    )
    unlimited["host_limit_gib"] = None
    plain = report_24g.markdown({"calls": [unlimited]})
    assert "host limit" not in plain and "cgroup" not in plain


# A real cgroup: where this host lets the tests make one (root and a writable memory
# controller, as on the development machine); elsewhere a skip that names why (a container may
# give root without the controller; the fake trees above cover the logic there).
WHY = cgroup.check()
real = pytest.mark.skipif(WHY is not None, reason=f"no memory cgroup here: {WHY}")

TOUCH = "import sys; b = b'x' * (int(sys.argv[1]) << 20)"  # every page written


@real
def test_a_real_cgroup_ooms_a_child_past_its_limit_and_measures_one_under_it():
    assert WHY is None, WHY
    with cgroup.memory_cgroup(128 * MiB, name=f"weightstream-test-{os.getpid()}") as cg:
        over = subprocess.run([sys.executable, "-c", TOUCH, "256"], preexec_fn=cg.preexec)
        assert over.returncode == -9
        assert cg.oom_kills() == 1 and cg.limit_bytes == 128 * MiB
    assert not cg.path.exists()
    with cgroup.memory_cgroup(128 * MiB, name=f"weightstream-test-{os.getpid()}") as cg:
        under = subprocess.run([sys.executable, "-c", TOUCH, "32"], preexec_fn=cg.preexec)
        assert under.returncode == 0
        report = cg.report()
    assert report["oom_kill"] == 0
    assert 32 * MiB <= report["peak_bytes"] <= 128 * MiB
    assert not cg.path.exists()


@real
def test_a_runs_card_py_runs_in_its_cgroup_and_its_oom_kill_is_recorded(tmp_path):
    assert WHY is None, WHY
    common = {
        "arch": "flux2",
        "device": "cpu",
        "resolution": 64,
        "work": str(tmp_path),
        "env": {},
    }
    args = SimpleNamespace(
        steps=4,
        optimizer=None,
        no_quantize=False,
        qtype="qfloat8",
        card=24,
        save_dtype="float32",
        sample_every=0,
        sample_steps=28,
        sample_prompt="a lighthouse",
        timeout=60,
        host_limit_gib=0.125,
        cgroup_root=None,
    )
    (run,) = runs_24g.parse_runs("aitk:r4")
    # card.py's stand-in: the python after `-c` takes "--" and the bench's command as argv
    args.card_cmd = "{python} -c \"b = b'x' * (256 << 20)\""
    result = runs_24g.launch(run, common, args, cuda=False)
    assert result["card_rc"] == -9
    got = result["host_limit"]
    assert (got["cgroup_version"], got["limit_bytes"], got["oom_kill"]) == (
        cgroup.version(Path(got["path"]).parent),
        128 * MiB,
        1,
    )
    assert not Path(got["path"]).exists()
    # a file of the work folder, in the page cache as the build leaves it: the run pays for it
    model = tmp_path / "model.bin"
    model.write_bytes(b"m" * (64 * MiB))
    args.card_cmd = f"{{python}} -c {shlex.quote(READ.format(path=str(model)))}"
    result = runs_24g.launch(run, common, args, cuda=False)
    assert result["card_rc"] == 0 and result["host_limit"]["oom_kill"] == 0
    assert 64 * MiB <= result["host_limit"]["peak_bytes"] <= 128 * MiB


#: A child that reads a file through a 1 MiB buffer: the page cache it fills is its only
#: memory of the file's size.
READ = "f = open({path!r}, 'rb', buffering=0); b = bytearray(1 << 20)\nwhile f.readinto(b): pass"


@real
def test_a_file_the_bench_has_cached_counts_in_the_run_once_dropped(tmp_path):
    assert WHY is None, WHY
    model = tmp_path / "model" / "weights.bin"
    model.parent.mkdir()
    model.write_bytes(b"m" * (96 * MiB))  # cached, charged to this process's cgroup
    assert cgroup.drop_page_cache(tmp_path) == 96 * MiB
    with cgroup.memory_cgroup(512 * MiB, name=f"weightstream-test-{os.getpid()}") as cg:
        read = subprocess.run(
            [sys.executable, "-c", READ.format(path=str(model))], preexec_fn=cg.preexec
        )
        assert read.returncode == 0
        assert cg.peak_bytes() >= 96 * MiB
