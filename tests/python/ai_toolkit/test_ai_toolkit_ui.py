"""``weightstream-aitk install-ui`` / ``uninstall-ui``: jobs started as ai-toolkit's web UI
starts them stream through weightstream when they ask for layer offloading, and run untouched
otherwise.

A stand-in ai-toolkit checkout with a real venv (``venv.create``, no pip: ``PYTHONPATH`` stands
for weightstream and torch installed in it, which ``site`` does not read ``.pth`` files from;
the hook's ``.pth`` is in the venv's own site-packages, read by ``site`` as in a real
install). Each job starts as ``ui/cron/actions/startJob.ts`` starts it (ostris/ai-toolkit
27a03a91f23eb1b757d5ec2e80ee3e129cfcc350): ``<AITK_ROOT>/.venv/bin/python <AITK_ROOT>/run.py
<training folder>/.job_config.json``, the JSON config with ``sqlite_db_path`` set, cwd
``AITK_ROOT``, the UI's environment (``AITK_JOB_ID``, ``CUDA_DEVICE_ORDER``,
``CUDA_VISIBLE_DEVICES``, ``IS_AI_TOOLKIT_UI=1``, ``PYTHONUNBUFFERED=1``), stdin ignored, stdout
and stderr appended to ``<training folder>/log.txt``, a session of its own (``detached``); the
UI stops it with SIGINT to the pid it recorded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
from weightstream.integrations.ai_toolkit import launcher, ui

#: weightstream's import root, and where this Python has torch: the venv's packages.
PACKAGES = [str(Path(launcher.__file__).parents[3]), sysconfig.get_path("purelib")]

RUN_PY = '''\
"""Stands for ai-toolkit's run.py as the UI runs it: gets the memory manager as ai-toolkit's
modules do (the first import of toolkit), records what it got, trains until SIGINT and ends
as run.py ends a KeyboardInterrupt: "Job stopped", exit code 0."""
import json, os, signal, sys
sys.path.insert(0, os.getcwd())
from toolkit.memory_management import MemoryManager
config = json.load(open(sys.argv[1]))
print("Running 1 job")
json.dump({
    "pid": os.getpid(),
    "manager": f"{MemoryManager.__module__}.{MemoryManager.__qualname__}",
    "env": {k: os.environ.get(k) for k in ("AITK_JOB_ID", "IS_AI_TOOLKIT_UI",
                                           "CUDA_VISIBLE_DEVICES")},
    "sqlite_db_path": config["config"]["process"][0]["sqlite_db_path"],
}, open(os.environ["REPORT"], "w"))
try:
    os.write(int(os.environ["READY_FD"]), b"training\\n")
    while True:
        signal.pause()
except KeyboardInterrupt:
    print("")
    print("========================================")
    print("Job stopped")
    print("========================================")
    sys.exit(0)
'''
#: ai-toolkit's own memory manager in the stand-in checkout.
OWN_MANAGER = "class MemoryManager:\n    pass\n\n\ndef sync_grad_transfers():\n    pass\n"
JOB_STOPPED = "Running 1 job\n\n" + "=" * 40 + "\nJob stopped\n" + "=" * 40 + "\n"


def environment(**more) -> dict:
    """The environment the UI was started in: weightstream and torch importable, no
    ``WEIGHTSTREAM_*`` of the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSTREAM_")}
    return {**env, "PYTHONPATH": os.pathsep.join(PACKAGES), **more}


@pytest.fixture
def aitk(tmp_path) -> Path:
    """A stand-in ai-toolkit checkout: run.py, toolkit/ with its own memory manager, and a
    venv at .venv."""
    root = tmp_path / "ai-toolkit"
    (root / "toolkit" / "memory_management").mkdir(parents=True)
    (root / "toolkit" / "__init__.py").write_text("")
    (root / "toolkit" / "memory_management" / "__init__.py").write_text(OWN_MANAGER)
    (root / "run.py").write_text(RUN_PY)
    venv.create(root / ".venv", with_pip=False, symlinks=True)
    site = ui.site_packages(str(root / ".venv" / "bin" / "python"))
    assert site.startswith(f"{root}/.venv/"), site  # the tests write nowhere else
    return root


def aitk_cli(*args, env=None) -> subprocess.CompletedProcess:
    """``weightstream-aitk ARGS``; with ``env``, weightstream is found without ``PYTHONPATH``
    (which the venv's Python would see too)."""
    command = f"import sys; sys.path.insert(0, {PACKAGES[0]!r}); " + (
        "from weightstream.integrations.ai_toolkit.launcher import main; raise SystemExit(main())"
    )
    return subprocess.run(
        [sys.executable, "-c", command, *map(str, args)],
        env=environment() if env is None else env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def job_config(layer_offloading: bool, section: dict | None = None) -> dict:
    """A job as the UI stores it (``job_config``), with a ``weightstream:`` section."""
    config = {
        "job": "extension",
        "config": {
            "name": "ui_lora",
            "process": [
                {
                    "type": "ui_trainer",
                    "training_folder": "output",
                    "model": {
                        "name_or_path": "black-forest-labs/FLUX.2-dev",
                        "arch": "flux2",
                        "layer_offloading": layer_offloading,
                        "layer_offloading_transformer_percent": 1,
                        "layer_offloading_text_encoder_percent": 1,
                    },
                }
            ],
        },
        "meta": {"name": "[name]", "version": "1.0"},
    }
    return {**config, "weightstream": section} if section is not None else config


def default_signals():
    """In the job, SIGINT and SIGQUIT as the UI's Node leaves them (libuv's spawn resets every
    signal to its default): a test run from a background shell, which ignores both, would
    otherwise pass that on, and the job would never see the stop."""
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


class UIJob:
    """One job started as startJob.ts starts it; ``stop()`` is the UI's stop route."""

    def __init__(self, root: Path, config: dict, job_id: str = "42", gpu_ids: str = "0"):
        self.folder = root / "output" / config["config"]["name"]
        self.folder.mkdir(parents=True)
        self.report = self.folder / "report.json"
        config["config"]["process"][0]["sqlite_db_path"] = str(root / "aitk_db.db")
        config_path = self.folder / ".job_config.json"
        config_path.write_text(json.dumps(config, indent=2))
        self.log = self.folder / "log.txt"
        ready, self._ready_w = os.pipe()
        env = environment(
            REPORT=str(self.report),
            READY_FD=str(self._ready_w),
            AITK_JOB_ID=job_id,
            CUDA_DEVICE_ORDER="PCI_BUS_ID",
            CUDA_VISIBLE_DEVICES=gpu_ids,
            IS_AI_TOOLKIT_UI="1",
            PYTHONUNBUFFERED="1",
        )
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [str(root / ".venv" / "bin" / "python"), str(root / "run.py"), str(config_path)],
                cwd=root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                pass_fds=(self._ready_w,),
                preexec_fn=default_signals,
            )
        os.close(self._ready_w)
        self._ready = os.fdopen(ready)

    def training(self) -> bool:
        """Waits until the job trains (True) or ends first (False)."""
        return self._ready.readline() == "training\n"

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        return self.wait()

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=120)
        finally:
            self._ready.close()


def test_a_ui_job_with_layer_offloading_streams_and_stops_as_without_the_hook(aitk, daemon):
    installed = aitk_cli("install-ui", aitk)
    assert installed.returncode == 0, installed.stderr
    job = UIJob(aitk, job_config(True, {"socket": daemon.socket}))
    assert job.training(), job.log.read_text()
    assert json.loads(job.report.read_text()) == {
        "pid": job.proc.pid,  # the UI's pid is the job's: its SIGINT reaches run.py
        "manager": "weightstream.integrations.ai_toolkit.manager.MemoryManager",
        "env": {"AITK_JOB_ID": "42", "IS_AI_TOOLKIT_UI": "1", "CUDA_VISIBLE_DEVICES": "0"},
        "sqlite_db_path": str(aitk / "aitk_db.db"),
    }
    assert job.stop() == 0
    version = daemon.client.info().version
    assert job.log.read_text() == (
        f"weightstream-aitk: weightstream daemon {version} at {daemon.socket}; "
        "toolkit.memory_management is weightstream's; layer_offloading in .job_config.json\n"
        + JOB_STOPPED
    )

    # Without the hook the same job gets ai-toolkit's own manager and ends the same way.
    assert aitk_cli("uninstall-ui", aitk).returncode == 0
    (aitk / "output").rename(aitk / "output.hooked")
    job = UIJob(aitk, job_config(True, {"socket": daemon.socket}))
    assert job.training(), job.log.read_text()
    assert (
        json.loads(job.report.read_text())["manager"] == "toolkit.memory_management.MemoryManager"
    )
    assert job.stop() == 0
    assert job.log.read_text() == JOB_STOPPED


def test_a_ui_job_without_layer_offloading_is_untouched(aitk, tmp_path):
    """The hook does not look further: no daemon is asked (its socket names nothing), the
    ``weightstream:`` section is not read (a bad setting would be refused)."""
    assert aitk_cli("install-ui", aitk).returncode == 0
    section = {"socket": str(tmp_path / "none.sock"), "budget": 1}
    job = UIJob(aitk, job_config(False, section))
    assert job.training(), job.log.read_text()
    got = json.loads(job.report.read_text())
    assert got["manager"] == "toolkit.memory_management.MemoryManager"
    assert job.stop() == 0
    assert job.log.read_text() == JOB_STOPPED


def test_a_ui_job_that_cannot_stream_ends_with_the_reason_in_its_log(aitk, tmp_path):
    assert aitk_cli("install-ui", aitk).returncode == 0
    sock = tmp_path / "none.sock"
    job = UIJob(aitk, job_config(True, {"socket": str(sock)}))
    assert not job.training()
    assert job.wait() == 2
    assert job.log.read_text() == (
        f"weightstream-aitk: cannot reach the weightstream daemon at {sock}: no such socket "
        "(named by --socket or WEIGHTSTREAM_SOCKET). Start the daemon there with `weightstream "
        f"serve --socket {sock}`\n"
    )
    assert not job.report.exists()


def site_files(root: Path) -> dict[str, bytes]:
    site = Path(ui.site_packages(str(root / ".venv" / "bin" / "python")))
    return {
        str(p.relative_to(site)): p.read_bytes() for p in sorted(site.rglob("*")) if p.is_file()
    }


def test_install_is_idempotent_and_uninstall_removes_exactly_it(aitk):
    python = str(aitk / ".venv" / "bin" / "python")
    (Path(ui.site_packages(python)) / "__pycache__").mkdir()  # a venv has one of its own
    before = site_files(aitk)
    first = aitk_cli("install-ui", aitk)
    assert first.returncode == 0, first.stderr
    installed = site_files(aitk)
    assert sorted(set(installed) - set(before)) == [ui.MODULE + ".py", ui.PTH]
    assert installed[ui.PTH].decode() == ui.PTH_TEXT
    assert f"ROOT = {str(aitk)!r}\n" in installed[ui.MODULE + ".py"].decode()
    again = aitk_cli("install-ui", aitk)
    assert (again.returncode, again.stdout) == (0, first.stdout)
    assert site_files(aitk) == installed
    # Every start of the venv's Python imports the module (and caches its bytecode).
    env = {k: v for k, v in environment().items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([python, "-c", "pass"], env=env, check=True)
    cached = [p for p in site_files(aitk) if p.startswith(f"__pycache__/{ui.MODULE}.")]
    assert len(cached) == 1
    removed = aitk_cli("uninstall-ui", aitk)
    site = ui.site_packages(python)
    assert (removed.returncode, removed.stdout) == (
        0,
        f"weightstream-aitk: removed {site}/{ui.PTH}, {site}/{ui.MODULE}.py, {site}/{cached[0]}\n",
    )
    assert site_files(aitk) == before
    assert aitk_cli("uninstall-ui", aitk).stdout == (
        "weightstream-aitk: removed nothing (not installed)\n"
    )


def test_install_leaves_a_file_of_another_alone(aitk):
    site = Path(ui.site_packages(str(aitk / ".venv" / "bin" / "python")))
    (site / ui.PTH).write_text("import something_else\n")
    done = aitk_cli("install-ui", aitk)
    assert (done.returncode, done.stderr) == (
        2,
        f"weightstream-aitk: {site / ui.PTH} exists and is not weightstream-aitk's: move it "
        "away and run install-ui again\n",
    )
    assert (site / ui.PTH).read_text() == "import something_else\n"
    assert not (site / f"{ui.MODULE}.py").exists()


def test_install_refuses_what_is_not_an_ai_toolkit_checkout_with_a_venv(aitk, tmp_path):
    def refused(root, line, env=None):
        done = aitk_cli("install-ui", root, env=env)
        assert (done.returncode, done.stderr, done.stdout) == (
            2,
            f"weightstream-aitk: {line}\n",
            "",
        )

    refused(
        tmp_path / "nowhere", f"{tmp_path / 'nowhere'}: no such folder (give ai-toolkit's checkout)"
    )
    refused(
        tmp_path,
        f"{tmp_path} is not an ai-toolkit checkout (it has no run.py and toolkit/): give the "
        "folder of `git clone https://github.com/ostris/ai-toolkit`",
    )
    python = aitk / ".venv" / "bin" / "python"
    refused(
        aitk,
        f"weightstream does not import with ai-toolkit's Python {python} (ModuleNotFoundError: "
        f"No module named 'weightstream'): install it there ({python} -m pip install "
        "<weightstream>/client-py) and run install-ui again",
        env={k: v for k, v in environment().items() if k != "PYTHONPATH"},
    )
    # A .venv/bin/python whose prefix is elsewhere (the system's Python: its site-packages
    # would get the files), played by a script that answers as such a Python would.
    python.unlink()
    python.write_text(f"#!/bin/sh\necho /usr\necho {tmp_path / 'site'}\n")
    python.chmod(0o755)
    refused(
        aitk,
        f"{python} is not the Python of a venv at {aitk / '.venv'}: create ai-toolkit's venv as "
        f"its README says (python3 -m venv {aitk / '.venv'}) and install its requirements there",
    )
    (aitk / ".venv").rename(aitk / "elsewhere")
    refused(
        aitk,
        f"{aitk} has no venv (.venv/bin/python or venv/bin/python, where ai-toolkit's UI looks "
        "for its Python; without one the UI runs python3 from PATH, which install-ui leaves "
        f"alone): create it as ai-toolkit's README says (cd {aitk} && python3 -m venv venv && "
        "venv/bin/pip install -r requirements.txt), install weightstream into it, and run "
        "install-ui again",
    )
