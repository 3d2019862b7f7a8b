"""What ``weightstream-aitk`` checks before ai-toolkit's ``run.py`` starts, so that a job that
cannot stream stops in a second, not after its model has loaded: in this order, the job files
exist and parse, their ``weightstream:`` settings are valid, ``RUN_PY`` sits in an ai-toolkit
checkout, the daemon answers its version on the configured socket, and ``torch`` imports (last:
that takes seconds). Each failure is one ``Refused`` whose message says what to do; the
launcher prints it on one line and exits 2.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import threading
from dataclasses import dataclass

#: The extensions ai-toolkit's ``toolkit/config.py`` (``get_config``) tries after a name.
CONFIG_EXTENSIONS = (".json", ".jsonc", ".yaml", ".yml")
#: How long the daemon may take to answer its version.
DAEMON_TIMEOUT_S = 5.0


class Refused(Exception):
    """A check failed; the message is one line saying what to do."""


@dataclass(frozen=True)
class Job:
    """One job file of the command line: its path and its parsed content."""

    path: str
    config: object

    @property
    def section(self):
        """Its ``weightstream:`` section (None without one)."""
        return self.config.get("weightstream") if isinstance(self.config, dict) else None

    @property
    def layer_offloading(self) -> bool:
        """Whether a process of the job asks for ``model.layer_offloading``."""
        config = self.config.get("config") if isinstance(self.config, dict) else None
        processes = config.get("process") if isinstance(config, dict) else None
        for process in processes if isinstance(processes, list) else ():
            model = process.get("model") if isinstance(process, dict) else None
            if isinstance(model, dict) and model.get("layer_offloading") is True:
                return True
        return False


def config_names(args: list[str]) -> list[str]:
    """The job names or paths among ai-toolkit's ``run.py`` arguments (its own parser's)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("config_file_list", nargs="*")
    parser.add_argument("-r", "--recover", action="store_true")
    parser.add_argument("-n", "--name")
    parser.add_argument("-l", "--log")
    known, _ = parser.parse_known_args(args)
    return known.config_file_list


def find_config(root: str, name: str) -> str | None:
    """Where ai-toolkit's ``get_config`` finds job ``name``: under ``config/`` beside run.py
    (with or without an extension), else as a path."""
    under = os.path.join(root, "config", name)
    found = [under] if os.path.isfile(under) else []
    found += [under + ext for ext in CONFIG_EXTENSIONS if os.path.isfile(under + ext)]
    found += [os.path.abspath(name)] if os.path.isfile(name) else []
    return found[0] if found else None


def read_job(path: str) -> Job:
    """A job file parsed as ai-toolkit parses it (JSON by extension, else YAML)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise Refused(f"{path}: cannot read the job file ({e})") from None
    if path.endswith((".json", ".jsonc")):
        try:
            return Job(path, json.loads(text))
        except json.JSONDecodeError as e:
            raise Refused(
                f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}): "
                "fix the job file"
            ) from None
    try:
        import yaml
    except ImportError:
        raise Refused(
            f"{path}: reading a YAML job file needs PyYAML, which this Python lacks: run "
            "`pip install pyyaml` (or ai-toolkit's `pip install -r requirements.txt`) in the "
            "environment that runs ai-toolkit"
        ) from None
    try:
        return Job(path, yaml.safe_load(text))
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f"line {where.line + 1}, column {where.column + 1}: " if where else ""
        what = getattr(e, "problem", None) or type(e).__name__
        raise Refused(f"{path}: not valid YAML ({at}{what}): fix the job file") from None


def read_jobs(run_py: str, args: list[str]) -> list[Job]:
    """Every job file of the command line, found and parsed; one missing is refused."""
    names = config_names(args)
    if not names:
        raise Refused(
            "no job file given: weightstream-aitk RUN_PY CONFIG [CONFIG ...] (see --help)"
        )
    root = os.path.dirname(os.path.abspath(run_py))
    jobs = []
    for name in names:
        path = find_config(root, name)
        if path is None:
            raise Refused(
                f"{name}: no such job file (looked for {os.path.join(root, 'config', name)}"
                f"[{'|'.join(CONFIG_EXTENSIONS)}] and {os.path.abspath(name)}): give its path"
            )
        jobs.append(read_job(path))
    return jobs


def check_checkout(run_py: str):
    """``RUN_PY`` is ai-toolkit's: its ``toolkit`` package is beside it."""
    root = os.path.dirname(os.path.abspath(run_py))
    if importlib.machinery.PathFinder.find_spec("toolkit", [root]) is None:
        raise Refused(
            f"{run_py}: no ai-toolkit beside it ({os.path.join(root, 'toolkit')} is missing): "
            "give the run.py of an ai-toolkit checkout (git clone "
            "https://github.com/ostris/ai-toolkit)"
        )


def check_torch():
    """``torch`` imports (ai-toolkit's run.py imports it next)."""
    try:
        import torch  # noqa: F401
    except Exception as e:  # an ImportError, or an OSError of a missing CUDA library
        raise Refused(
            f"torch does not import in this Python ({type(e).__name__}: {e}): run "
            "weightstream-aitk with ai-toolkit's environment (its venv, where `pip install -r "
            "requirements.txt` put torch)"
        ) from None


def daemon_version(socket: str | None, timeout: float = DAEMON_TIMEOUT_S) -> tuple[str, str]:
    """The daemon's version and socket, asked as every client asks it; refused when nothing
    answers there within ``timeout`` seconds."""
    import weightstream

    got: dict = {}

    def ask():
        try:
            client = weightstream.connect(socket)
            got["socket"] = client.socket
            got["version"] = client.info().version
        except Exception as e:
            got["error"] = e

    asking = threading.Thread(target=ask, name="weightstream-aitk daemon check", daemon=True)
    asking.start()
    asking.join(timeout)
    if "error" in got:
        raise Refused(str(got["error"]))
    if "version" not in got:
        where = got.get("socket", socket or "the default socket")
        raise Refused(
            f"the weightstream daemon at {where} did not answer within {timeout:g} s: see its "
            "log (`journalctl -u weightstream` for the service), restart it, and start the job "
            "again"
        )
    return got["version"], got["socket"]
