"""The daemon's defences from the Python client's side, with a second uid (user ``ws-attacker``,
made by tests/run.sh when it runs as root) where it takes one: another uid gets neither a session's
regions nor an upload's region through the handoff socket, even holding their secrets; and
an uploader cannot truncate its region, nor commit it while mapped, nor write it once
committed. Without root or that user the attacker tests are skipped, and fail when
WEIGHTSTREAM_REQUIRE_ROOT=1 (tests/run.sh sets it). (The daemon end to end, with more
attacks: ``daemon/e2e/tests/security.rs``.)"""

from __future__ import annotations

import errno
import mmap
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import weightstream

from tests.daemon import Daemon

#: The attacker runs the client's native module alone (an abi3 extension, with the exceptions
#: it raises): it needs no torch, so any Python >= 3.10 the attacker may execute will do (the
#: test's own may live under a private home). ``fetch_fd`` asks the daemon's handoff socket.
ATTACK = """
import sys, types
pkg = types.ModuleType("weightstream")
pkg.__path__ = [sys.argv[1]]
sys.modules["weightstream"] = pkg
from weightstream import _native
client = _native.Client(sys.argv[2])
for secret in sys.argv[3:]:
    try:
        fd, size = client.fetch_fd(secret)
        print(f"got {size} bytes")
    except Exception as e:
        print(f"refused: {getattr(e, 'message', e)}")
"""


def attacker() -> tuple[int, int]:
    """``ws-attacker``'s uid and gid, or a skip (a failure under WEIGHTSTREAM_REQUIRE_ROOT=1)."""
    why = None
    if os.geteuid() != 0:
        why = "the attacker runs as another uid: run the tests as root"
    else:
        try:
            pw = pwd.getpwnam("ws-attacker")
        except KeyError:
            why = "no user ws-attacker (tests/run.sh creates it)"
    if why is not None:
        if os.environ.get("WEIGHTSTREAM_REQUIRE_ROOT") == "1":
            pytest.fail(f"WEIGHTSTREAM_REQUIRE_ROOT=1: {why}")
        pytest.skip(why)
    return pw.pw_uid, pw.pw_gid


#: Runs a script as another uid with ``subprocess(..., user=, group=)``, from a process of its
#: own: forking this one (grpc's and torch's threads, their fork handlers) as ``user=`` must, can
#: crash the child before it execs. Tries this Python, then the system's.
LAUNCH = """
import shutil, subprocess, sys
uid, gid, script, args = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
as_them = dict(user=uid, group=gid, extra_groups=[])
def runs(python):
    try:
        return subprocess.run([python, "-c", "pass"], **as_them).returncode == 0
    except PermissionError:
        return False
for python in (sys.executable, shutil.which("python3", path="/usr/bin:/bin")):
    if python and runs(python):
        sys.exit(subprocess.run([python, "-c", script, *args], **as_them).returncode)
sys.exit("no Python interpreter that the attacker may run")
"""


def run_as(ids: tuple[int, int], script: str, args: list[str]) -> subprocess.CompletedProcess:
    """``script`` with ``args``, run by Python as uid and gid ``ids``."""
    uid, gid = ids
    return subprocess.run(
        [sys.executable, "-c", LAUNCH, str(uid), str(gid), script, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def shared_daemon():
    """A daemon the attacker can reach: the socket's group is the attacker's, its directory
    open to it (and a copy of the client's native module there, for the attacker to run)."""
    _, gid = attacker()
    tmp = Path(tempfile.mkdtemp(prefix="ws-security-"))
    tmp.chmod(0o755)
    src = Path(weightstream.__file__).parent
    (tmp / "weightstream").mkdir(mode=0o755)
    for module in (Path(weightstream._native.__file__).name, "errors.py"):
        shutil.copy(src / module, tmp / "weightstream" / module)
    d = Daemon(tmp, "--socket-group", str(gid))
    yield d
    d.stop()
    shutil.rmtree(tmp)


def test_another_uid_gets_no_region_and_no_upload(shared_daemon):
    ids = attacker()
    client = shared_daemon.client
    tensors = {f"l{i}.weight": torch.full((64, 64), float(i)) for i in range(4)}
    manifest, _ = client.upload_model("mine", tensors)
    groups = [(n, [n]) for n in tensors]
    session = client.open_session(manifest.model_id, groups, 4 * 64 * 64 * 4)
    begun = client.begin_upload("pending", {"x": torch.empty(1024)})
    secrets = [r.fd_secret for r in session.opened.regions] + [begun.fd_secret]
    assert all(len(s) == 32 for s in secrets), secrets
    src = str(shared_daemon.tmp / "weightstream")
    out = run_as(ids, ATTACK, [src, shared_daemon.socket, *secrets])
    assert out.returncode == 0, out.stderr
    refused = (
        f"refused: no such fd_secret for uid {ids[0]}: a secret is only for the uid it was "
        "given to, and ends with its upload or session"
    )
    assert out.stdout.splitlines() == [refused] * len(secrets)
    for secret in secrets:  # the owner's
        fd, _ = client.fetch_fd(secret)
        os.close(fd)
    session.close()


def test_an_upload_region_is_sealed_by_the_daemon(daemon):
    """No second uid needed: the uploader itself cannot truncate its region (EPERM), its
    commit is refused while it maps the region writable, and once committed its fd writes no
    more."""
    client = daemon.client
    begun = client.begin_upload("sealed", {"x": torch.empty(1024)})
    fd, size = client.fetch_fd(begun.fd_secret)
    try:
        with pytest.raises(OSError) as e:
            os.ftruncate(fd, 0)
        assert e.value.errno == errno.EPERM
        mapped = mmap.mmap(fd, size)
        mapped[:4096] = torch.arange(1024, dtype=torch.float32).numpy().tobytes()
        with pytest.raises(weightstream.RequestRejected) as e:
            client.commit_upload(begun.upload_id)
        assert e.value.code == "FAILED_PRECONDITION"
        assert e.value.message == (
            f"upload_id '{begun.upload_id}': the upload region is still mapped writable by the "
            "client: unmap it before CommitUpload"
        )
        mapped.close()
        committed, _ = client.commit_upload(begun.upload_id)
        with pytest.raises(OSError) as e:
            os.pwrite(fd, b"tamper", 0)
        assert e.value.errno == errno.EPERM
    finally:
        os.close(fd)
    assert committed.tensors[0].name == "x"
    assert client.release_model(committed.model_id) == 0
