"""A memory cgroup for one run of a bench (tests/bench/ai_toolkit_24g.py's ``--host-limit-gib``):
``memory_cgroup`` makes a fresh cgroup under a cgroup root, limits it to N bytes with swap off,
lets a child join it before the child runs (``MemoryCgroup.preexec``, Popen's ``preexec_fn``:
the child and everything it starts count), reads back its peak and its OOM kills
(``MemoryCgroup.report``), and removes it when the run is over; ``drop_page_cache`` makes a
run pay for the files it reads.

cgroup v2 (a root with ``cgroup.controllers`` listing ``memory``): ``memory.max``,
``memory.swap.max``, ``memory.peak``, ``memory.events``' ``oom_kill``. cgroup v1 (the memory
controller's mount, e.g. /sys/fs/cgroup/memory): ``memory.limit_in_bytes``,
``memory.memsw.limit_in_bytes`` where swap is accounted, ``memory.max_usage_in_bytes``,
``memory.oom_control``'s ``oom_kill``. Both count the page cache a run reads (reclaimed at the
limit, not a cause of OOM kills) besides its anonymous memory. The root is a parameter: the
tests give a directory tree of their own."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

#: Where the bench looks when it is given no root: cgroup v2's unified hierarchy, else the v1
#: memory controller's mount as /proc/self/mounts names it.
V2_ROOT = Path("/sys/fs/cgroup")
MOUNTS = Path("/proc/self/mounts")
MEMINFO = Path("/proc/meminfo")

PAGE = os.sysconf("SC_PAGE_SIZE")

#: What to do, in every refusal's line.
ADVICE = "run as root on a host with the memory controller, or drop --host-limit-gib"


class CgroupError(Exception):
    """A memory cgroup cannot be made, set or removed; the message says why and what to do."""


# The steps the kernel does on a cgroup file system (a fake tree's test replaces them).
_mkdir = os.mkdir
_rmdir = os.rmdir


def find_root(v2_root: Path = V2_ROOT, mounts: Path = MOUNTS) -> Path:
    """The cgroup root this host gives the memory controller: ``v2_root`` where it is cgroup v2
    with ``memory`` in its ``cgroup.controllers``, else the v1 mount with the ``memory`` option
    in ``mounts``."""
    controllers = v2_root / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return v2_root
    for line in mounts.read_text().splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[2] == "cgroup" and "memory" in fields[3].split(","):
            return Path(fields[1])
    raise CgroupError(
        f"no memory controller: neither {controllers} lists memory nor does {mounts} mount"
        f" cgroup v1's; {ADVICE}"
    )


def version(root: Path) -> int:
    """2 for a cgroup v2 root (``cgroup.controllers``), 1 for a v1 memory root
    (``memory.limit_in_bytes``)."""
    if (root / "cgroup.controllers").exists():
        return 2
    if (root / "memory.limit_in_bytes").exists():
        return 1
    raise CgroupError(
        f"{root} is no memory cgroup: it has neither cgroup.controllers (v2) nor"
        f" memory.limit_in_bytes (v1); {ADVICE}"
    )


def host_swap_bytes(meminfo: Path = MEMINFO) -> int:
    """The host's swap (``SwapTotal``), bytes."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("SwapTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def _write(path: Path, value: str) -> None:
    # No O_CREAT: a cgroup's files are the kernel's, and one that is missing is a controller or
    # feature the host lacks, not a file to make (O_TRUNC is for a test's plain files).
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _field(text: str, key: str) -> int:
    """``key N`` in a flat-keyed file (memory.events, memory.oom_control)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    raise CgroupError(f"no {key} line in {text!r}")


class MemoryCgroup:
    """One made cgroup: ``path``, ``version`` (1 or 2), ``limit_bytes`` as the kernel reads it
    back, and ``swap`` (how swap was turned off)."""

    def __init__(self, path: Path, version: int, limit_bytes: int, swap: str):
        self.path, self.version, self.limit_bytes, self.swap = path, version, limit_bytes, swap
        procs = path / "cgroup.procs"
        if version == 1 and not procs.exists():
            procs = path / "tasks"
        self._procs = os.fsencode(procs)

    def preexec(self) -> None:
        """Popen's ``preexec_fn``: the child joins the cgroup before it executes its command,
        so nothing it allocates is outside it. Only os calls: it runs between fork and exec."""
        fd = os.open(self._procs, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    def pids(self) -> list[int]:
        """The processes in the cgroup now."""
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def peak_bytes(self) -> int | None:
        """The cgroup's peak memory use (v2 ``memory.peak``, None on kernels before 5.19 that
        lack it; v1 ``memory.max_usage_in_bytes``)."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except FileNotFoundError:
            return None

    def oom_kills(self) -> int:
        """How many processes the OOM killer ended in the cgroup (``oom_kill``)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        return _field((self.path / name).read_text(), "oom_kill")

    def report(self) -> dict:
        """What a run's JSON records of its cgroup."""
        return {
            "cgroup_version": self.version,
            "limit_bytes": self.limit_bytes,
            "peak_bytes": self.peak_bytes(),
            "oom_kill": self.oom_kills(),
            "swap": self.swap,
            "path": str(self.path),
        }


def _limit(path: Path, vers: int, limit: int, meminfo: Path) -> tuple[int, str]:
    """Sets the limit and turns swap off; returns the limit read back and how swap is off."""
    name = "memory.max" if vers == 2 else "memory.limit_in_bytes"
    _write(path / name, str(limit))
    got = int((path / name).read_text())
    if got != limit:
        raise CgroupError(f"{path / name} reads {got} after {limit} was written; {ADVICE}")
    # v2: memory.swap.max; v1: memsw (memory + swap) at the memory limit. Without swap
    # accounting the file is missing, which is fine only on a host with no swap.
    swap_file = path / ("memory.swap.max" if vers == 2 else "memory.memsw.limit_in_bytes")
    try:
        _write(swap_file, "0" if vers == 2 else str(limit))
        return got, swap_file.name
    except FileNotFoundError:
        swap = host_swap_bytes(meminfo)
        if swap:
            raise CgroupError(
                f"{swap_file} is missing (swap accounting off) and the host has"
                f" {swap / (1 << 30):.1f} GiB of swap: the run could swap past the limit;"
                " boot with swapaccount=1 or swapoff -a, or drop --host-limit-gib"
            ) from None
        return got, "the host has no swap"


@contextlib.contextmanager
def memory_cgroup(
    limit_bytes: int, root: Path | None = None, name: str | None = None, meminfo: Path = MEMINFO
):
    """A fresh cgroup ``name`` (default ``weightstream-bench-PID``) under ``root`` (default
    ``find_root()``), limited to ``limit_bytes`` (rounded down to a page) with swap off;
    removed on exit, after ending (SIGKILL) any process of the run still in it."""
    root = Path(root) if root is not None else find_root()
    vers = version(root)
    limit = limit_bytes // PAGE * PAGE
    if limit <= 0:
        raise CgroupError(f"the host limit is {limit_bytes} bytes: give at least a page")
    if vers == 2:
        control = root / "cgroup.subtree_control"
        try:
            if "memory" not in control.read_text().split():
                _write(control, "+memory")  # the root cgroup may hand memory down to children
        except OSError as e:
            raise CgroupError(f"{control}: cannot enable memory: {e.strerror}; {ADVICE}") from e
        if "memory" not in control.read_text().split():
            raise CgroupError(f"{control} does not list memory after +memory; {ADVICE}")
    path = root / (name or f"weightstream-bench-{os.getpid()}")
    try:
        _mkdir(path)
    except OSError as e:
        raise CgroupError(f"cannot make {path}: {e.strerror}; {ADVICE}") from e
    try:
        try:
            got, swap = _limit(path, vers, limit, meminfo)
        except OSError as e:
            raise CgroupError(f"cannot limit {path}: {e.strerror}; {ADVICE}") from e
        yield MemoryCgroup(path, vers, got, swap)
    finally:
        _remove(path)


def _remove(path: Path) -> None:
    """Ends what the run left in the cgroup and removes it (a cgroup with processes cannot
    be removed)."""
    procs = path / "cgroup.procs"
    deadline = time.monotonic() + 10
    while True:
        try:
            _rmdir(path)
            return
        except OSError as e:
            left = [int(p) for p in procs.read_text().split()] if procs.exists() else []
            if not left or time.monotonic() > deadline:
                raise CgroupError(
                    f"cannot remove {path}: {e.strerror}"
                    + (f" (processes {left} still in it)" if left else "")
                    + "; rmdir it once they have ended"
                ) from e
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)  # the kernel takes an ended process out of cgroup.procs


def drop_page_cache(folder: Path) -> int:
    """Takes the files under ``folder`` out of the page cache (written back, then
    ``POSIX_FADV_DONTNEED``); their bytes. A cached page stays charged to the cgroup that read
    or wrote it first (the bench that built the model, or an earlier run): dropped, each run's
    cgroup pays for what it reads."""
    total = 0
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages are not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def check(root: Path | None = None, meminfo: Path = MEMINFO) -> str | None:
    """Why no memory cgroup can be made here, or None: a probe cgroup made, limited and
    removed, as each run's will be."""
    try:
        with memory_cgroup(64 << 20, root, f"weightstream-bench-probe-{os.getpid()}", meminfo):
            return None
    except (CgroupError, OSError) as e:
        return str(e)
