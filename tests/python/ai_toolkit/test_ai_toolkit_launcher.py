"""``weightstream-aitk RUN_PY CONFIG...``, run as a user runs it, in a stand-in ai-toolkit tree:
ai-toolkit's run.py gets weightstream's ``toolkit.memory_management``, and every check before
it starts (job files, settings, ai-toolkit's checkout, the daemon, torch) refuses on one line,
exit code 2, before run.py runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from weightstream.integrations.ai_toolkit import launcher, preflight
from weightstream.integrations.ai_toolkit.settings import Settings

RUN_PY = '''\
"""Stands for ai-toolkit's run.py: reads its config like toolkit/config.py, imports the memory
manager the ways ai-toolkit's modules do, and reports what it got."""
import json, os, sys
sys.path.insert(0, os.getcwd())
import yaml
from toolkit.memory_management import MemoryManager, sync_grad_transfers
from toolkit.memory_management.manager import MemoryManager as FromManager
import toolkit.memory_management.manager_modules as modules
from weightstream.integrations.ai_toolkit.settings import current
config = yaml.safe_load(open(os.path.join("config", sys.argv[1] + ".yaml")))
sync_grad_transfers()
json.dump({
    "argv": sys.argv[1:],
    "main": __name__,
    "manager": f"{MemoryManager.__module__}.{MemoryManager.__qualname__}",
    "same": MemoryManager is FromManager and modules.sync_grad_transfers is sync_grad_transfers,
    "settings": vars(current()),
    "offloading": config["config"]["process"][0]["model"]["layer_offloading"],
}, open(os.environ["REPORT"], "w"))
'''

JOB = """\
job: extension
config:
  name: flux_lora
  process:
    - type: sd_trainer
      model:
        name_or_path: black-forest-labs/FLUX.2-dev
        arch: flux2
        layer_offloading: true
        layer_offloading_transformer_percent: 1.0
        layer_offloading_text_encoder_percent: 1.0
weightstream:
  vram_budget: 6GiB
  staging_bytes: 2GiB
"""
LAUNCHER = [sys.executable, "-m", "weightstream.integrations.ai_toolkit"]
#: weightstream's import root.
SRC = str(Path(launcher.__file__).parents[3])


def tree(tmp_path, job=JOB, name="job.yaml") -> Path:
    """A stand-in ai-toolkit checkout whose own ``toolkit.memory_management`` fails if
    imported, with ``job`` as ``config/<name>``."""
    root = tmp_path / "ai-toolkit"
    (root / "toolkit" / "memory_management").mkdir(parents=True)
    (root / "toolkit" / "__init__.py").write_text("")
    (root / "toolkit" / "memory_management" / "__init__.py").write_text(
        'raise AssertionError("ai-toolkit\'s own memory manager was imported")\n'
    )
    (root / "run.py").write_text(RUN_PY)
    (root / "config").mkdir()
    (root / "config" / name).write_text(job)
    return root


def launch(
    tmp_path, command=LAUNCHER, env=None, job=JOB, args=("job", "-r"), root=None, path=()
) -> subprocess.CompletedProcess:
    """Runs ``command RUN_PY args`` in ``root`` (default: a stand-in tree with ``job``), with
    ``path`` first on ``PYTHONPATH``."""
    root = tree(tmp_path, job) if root is None else root
    env = {**os.environ, "REPORT": str(tmp_path / "report.json"), **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, path), SRC, env.get("PYTHONPATH", "")])
    return subprocess.run(
        [*command, str(root / "run.py"), *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def report(tmp_path, done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr
    return json.loads((tmp_path / "report.json").read_text())


def test_the_launcher_runs_ai_toolkit_with_weightstreams_memory_manager(tmp_path, daemon):
    done = launch(
        tmp_path, env={"WEIGHTSTREAM_BUDGET": "4GiB", "WEIGHTSTREAM_SOCKET": daemon.socket}
    )
    assert report(tmp_path, done) == {
        "argv": ["job", "-r"],
        "main": "__main__",
        "manager": "weightstream.integrations.ai_toolkit.manager.MemoryManager",
        "same": True,
        # The environment wins over the YAML's weightstream: section.
        "settings": vars(
            Settings(socket=daemon.socket, vram_budget=4 << 30, staging_bytes=2 << 30)
        ),
        "offloading": True,
    }
    version = daemon.client.info().version
    assert done.stdout == (
        f"weightstream-aitk: weightstream daemon {version} at {daemon.socket}; "
        "toolkit.memory_management is weightstream's; layer_offloading in job.yaml\n"
    )


def test_the_console_script_is_the_launcher(tmp_path, daemon):
    """``weightstream-aitk`` in client-py/pyproject.toml points at the launcher; where the
    package is installed (tests/run.sh installs it), the script itself runs it."""
    import tomllib

    pyproject = Path(__file__).parents[3] / "client-py" / "pyproject.toml"
    target = tomllib.loads(pyproject.read_text())["project"]["scripts"]["weightstream-aitk"]
    assert target == "weightstream.integrations.ai_toolkit.launcher:main"
    script = Path(sys.executable).parent / "weightstream-aitk"
    if script.exists():
        got = report(
            tmp_path, launch(tmp_path, [str(script)], {"WEIGHTSTREAM_SOCKET": daemon.socket})
        )
        assert got["manager"] == "weightstream.integrations.ai_toolkit.manager.MemoryManager"


def test_help_says_what_the_arguments_do_and_what_runs_first():
    done = subprocess.run(
        [*LAUNCHER, "--help"],
        env={**os.environ, "PYTHONPATH": SRC},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    assert done.stdout == launcher.USAGE + "\n"
    for words in (
        "  RUN_PY          ai-toolkit's run.py",
        "  -r, --recover   go on with the next CONFIG when a job fails",
        "  -n, --name NAME replace the [name] tag in the job files with NAME",
        "  -l, --log LOG   also write ai-toolkit's output to the file LOG",
        "First start the daemon: `weightstream serve` (your own), or the systemd service",
        "install-ui AITK_ROOT",
    ):
        assert words in launcher.USAGE


# --- each check, refused on its own ------------------------------------------------------------


def refused(tmp_path, done: subprocess.CompletedProcess, line: str):
    """``done`` stopped before run.py ran, with exit code 2, ``line`` alone on stderr and
    nothing on stdout."""
    assert (done.returncode, done.stderr, done.stdout) == (2, f"weightstream-aitk: {line}\n", "")
    assert not (tmp_path / "report.json").exists()


def module_that_fails(tmp_path, name: str, raise_: str) -> Path:
    """A folder to put first on ``PYTHONPATH`` where ``import name`` raises ``raise_``."""
    folder = tmp_path / f"no-{name}"
    (folder / name).mkdir(parents=True)
    (folder / name / "__init__.py").write_text(f"raise {raise_}\n")
    return folder


def test_a_missing_run_py_is_refused(tmp_path):
    root = tree(tmp_path)
    (root / "run.py").unlink()
    refused(
        tmp_path,
        launch(tmp_path, root=root),
        f"{root / 'run.py'}: no such file (give ai-toolkit's run.py)",
    )


def test_no_job_file_is_refused(tmp_path):
    refused(
        tmp_path,
        launch(tmp_path, args=("-r",)),
        "no job file given: weightstream-aitk RUN_PY CONFIG [CONFIG ...] (see --help)",
    )


def test_a_missing_job_file_is_refused(tmp_path):
    root = tree(tmp_path)
    refused(
        tmp_path,
        launch(tmp_path, root=root, args=("job", "nosuch")),
        f"nosuch: no such job file (looked for {root}/config/nosuch[.json|.jsonc|.yaml|.yml] "
        f"and {root}/nosuch): give its path",
    )


def test_a_yaml_job_without_pyyaml_is_refused(tmp_path):
    no_yaml = module_that_fails(tmp_path, "yaml", "ModuleNotFoundError(\"No module named 'yaml'\")")
    root = tree(tmp_path)
    refused(
        tmp_path,
        launch(tmp_path, root=root, path=[no_yaml]),
        f"{root}/config/job.yaml: reading a YAML job file needs PyYAML, which this Python lacks: "
        "run `pip install pyyaml` (or ai-toolkit's `pip install -r requirements.txt`) in the "
        "environment that runs ai-toolkit",
    )


def test_a_job_file_that_does_not_parse_is_refused(tmp_path):
    root = tree(tmp_path, job="job: extension\nconfig: [unclosed\n")
    refused(
        tmp_path,
        launch(tmp_path, root=root),
        f"{root}/config/job.yaml: not valid YAML (line 3, column 1: expected ',' or ']', but "
        "got '<stream end>'): fix the job file",
    )
    (root / "config" / "job.json").write_text('{"job": "extension",\n "config": }')
    refused(
        tmp_path,
        launch(tmp_path, root=root, args=("config/job.json",)),
        f"{root}/config/job.json: not valid JSON (line 2, column 12: Expecting value): fix the "
        "job file",
    )


def test_bad_settings_are_refused(tmp_path):
    refused(
        tmp_path,
        launch(tmp_path, job=JOB + "  budget: 1\n"),
        "weightstream.budget: unknown setting (known: " + ", ".join(sorted(launcher.ENV)) + ")",
    )


def test_a_run_py_outside_ai_toolkit_is_refused(tmp_path):
    root = tree(tmp_path)
    (root / "toolkit" / "memory_management" / "__init__.py").unlink()
    (root / "toolkit" / "memory_management").rmdir()
    (root / "toolkit" / "__init__.py").unlink()
    (root / "toolkit").rmdir()
    refused(
        tmp_path,
        launch(tmp_path, root=root),
        f"{root / 'run.py'}: no ai-toolkit beside it ({root / 'toolkit'} is missing): give the "
        "run.py of an ai-toolkit checkout (git clone https://github.com/ostris/ai-toolkit)",
    )


def test_no_daemon_is_refused_before_ai_toolkit_starts(tmp_path):
    sock = tmp_path / "none.sock"
    refused(
        tmp_path,
        launch(tmp_path, env={"WEIGHTSTREAM_SOCKET": str(sock)}),
        f"cannot reach the weightstream daemon at {sock}: no such socket (named by --socket or "
        f"WEIGHTSTREAM_SOCKET). Start the daemon there with `weightstream serve --socket {sock}`",
    )


def test_a_daemon_that_does_not_answer_is_refused(tmp_path):
    """A socket that takes connections and never answers (a hung daemon): refused after the
    timeout, naming the socket."""
    path = str(tmp_path / "mute.sock")
    with socket.socket(socket.AF_UNIX) as mute:
        mute.bind(path)
        mute.listen(8)
        with pytest.raises(preflight.Refused) as e:
            preflight.daemon_version(path, timeout=0.5)
    assert str(e.value) == (
        f"the weightstream daemon at {path} did not answer within 0.5 s: see its log "
        "(`journalctl -u weightstream` for the service), restart it, and start the job again"
    )


def test_torch_that_does_not_import_is_refused(tmp_path, daemon):
    error = "libcudart.so.12: cannot open shared object file: No such file or directory"
    no_torch = module_that_fails(tmp_path, "torch", f"OSError({error!r})")
    refused(
        tmp_path,
        launch(tmp_path, env={"WEIGHTSTREAM_SOCKET": daemon.socket}, path=[no_torch]),
        f"torch does not import in this Python (OSError: {error}): run weightstream-aitk with "
        "ai-toolkit's environment (its venv, where `pip install -r requirements.txt` put torch)",
    )
