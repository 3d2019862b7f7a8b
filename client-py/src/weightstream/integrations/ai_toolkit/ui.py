"""``weightstream-aitk install-ui AITK_ROOT`` / ``uninstall-ui AITK_ROOT``: the jobs ai-toolkit's
web UI starts stream too, with no edit to ai-toolkit's files.

The UI (ostris/ai-toolkit 27a03a91f23eb1b757d5ec2e80ee3e129cfcc350, ``ui/cron/actions/
startJob.ts``) writes each job to ``<training folder>/.job_config.json`` and starts
``<python> <AITK_ROOT>/run.py <that file>`` detached, with cwd ``AITK_ROOT``, its own
environment plus ``AITK_JOB_ID``, ``IS_AI_TOOLKIT_UI=1``, ``CUDA_VISIBLE_DEVICES`` and
``PYTHONUNBUFFERED=1``, stdout and stderr on ``<training folder>/log.txt``. ``<python>`` is the
first of ``AITK_ROOT/.venv/bin/python`` and ``AITK_ROOT/venv/bin/python`` that exists
(``ui/cron/pythonPath.ts``; else ``python3`` from ``PATH``). It stops a job by setting ``stop``
in its sqlite database and sending SIGINT to the pid it recorded
(``ui/src/app/api/jobs/[jobID]/stop/route.ts``); the trainer (``extensions_built_in/
sd_trainer/UITrainer.py``) polls that flag (``SELECT stop FROM Job WHERE id = AITK_JOB_ID``),
and run.py turns the KeyboardInterrupt into "Job stopped" and exit code 0.

How: ``install-ui`` puts two files into that venv's site-packages: ``weightstream_aitk_ui.pth``,
whose one line imports ``_weightstream_aitk_ui``, the second file, which holds ``AITK_ROOT``.
Python's ``site`` runs the line at every start of that interpreter; the module does nothing
unless the script is ``AITK_ROOT/run.py``, and then only puts a one-shot finder first on
``sys.meta_path``. At run.py's first ``import toolkit`` (site-packages complete, ai-toolkit's
``.env`` loaded by run.py, torch not yet imported) the finder calls ``launcher.ui_job``: a
job file with ``model.layer_offloading: true`` gets the launcher's checks, settings and
finders (``launcher.prepare``) in the job's own process, and every other job, or one whose
file does not parse, runs untouched with ai-toolkit's own modules.

Why this and not an interpreter shim in place of ``.venv/bin/python``: nothing of ai-toolkit
or of the venv's interpreter changes, so the pid the UI records is the job's (SIGINT reaches
run.py as it would), the UI's command line, environment and log stay exactly its own, and
``pip install`` or a venv upgrade leave the two files alone (a venv made again loses them:
run ``install-ui`` again). A ``sitecustomize`` would shadow one the system may have; a ``.pth``
adds to what is there. ``python -S``/``-I`` skip ``site`` and so the hook.

Several jobs on one GPU: the UI runs one job at a time per GPU queue (``ui/cron/actions/
processQueue.ts``: a job waits while another of the same ``gpu_ids`` is running). Start the
other jobs for that GPU from a terminal with ``weightstream-aitk run.py job.yaml`` (or
``.venv/bin/python run.py job.yaml`` once the hook is installed), with ``CUDA_VISIBLE_DEVICES``
set to the same card: they share the daemon's one copy of the weights and the card.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

from weightstream.integrations.ai_toolkit import preflight

#: The files ``install-ui`` writes into the venv's site-packages, and the marker of their first
#: line that says they are weightstream-aitk's.
PTH = "weightstream_aitk_ui.pth"
MODULE = "_weightstream_aitk_ui"
MARKER = "weightstream-aitk install-ui"
#: Where ai-toolkit's UI looks for its Python, in order (``ui/cron/pythonPath.ts``).
VENV_PYTHONS = (".venv/bin/python", "venv/bin/python")

PTH_TEXT = f"""\
# {MARKER}: ai-toolkit's UI jobs with layer_offloading stream through weightstream
import {MODULE}
"""

MODULE_TEXT = '''\
"""{marker}: written by `weightstream-aitk install-ui ROOT`, removed by
`weightstream-aitk uninstall-ui ROOT`. Loaded by {pth} at every start of this Python; it does
nothing unless the script is ROOT/run.py, and then hands the job to weightstream at run.py's
first `import toolkit` (weightstream.integrations.ai_toolkit.ui says how)."""

import os
import sys

ROOT = {root!r}


class FirstToolkitImport:
    """Removes itself at the first import of `toolkit` and lets weightstream look at the job."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "toolkit":
            return None
        sys.meta_path.remove(self)
        try:
            from weightstream.integrations.ai_toolkit import launcher
        except ImportError as e:
            print(
                f"weightstream-aitk: {{e}}: this job runs without weightstream. Install it with "
                f"{{sys.executable}} -m pip install <weightstream>/client-py, or remove the hook: "
                f"weightstream-aitk uninstall-ui {{ROOT}}",
                file=sys.stderr,
                flush=True,
            )
        else:
            launcher.ui_job()
        import importlib.util

        return importlib.util.find_spec(fullname)


if sys.argv and os.path.realpath(sys.argv[0]) == os.path.join(ROOT, "run.py"):
    sys.meta_path.insert(0, FirstToolkitImport())
'''


# --- install-ui / uninstall-ui ----------------------------------------------------------------


def checkout(root: str) -> tuple[str, str]:
    """The real path of ai-toolkit's checkout ``root`` and the Python its UI runs jobs with."""
    real = os.path.realpath(os.path.expanduser(root))
    if not os.path.isdir(real):
        raise preflight.Refused(f"{root}: no such folder (give ai-toolkit's checkout)")
    if not (
        os.path.isfile(os.path.join(real, "run.py"))
        and os.path.isdir(os.path.join(real, "toolkit"))
    ):
        raise preflight.Refused(
            f"{root} is not an ai-toolkit checkout (it has no run.py and toolkit/): give the "
            "folder of `git clone https://github.com/ostris/ai-toolkit`"
        )
    for name in VENV_PYTHONS:
        if os.path.isfile(os.path.join(real, name)):
            return real, os.path.join(real, name)
    raise preflight.Refused(
        f"{root} has no venv ({' or '.join(VENV_PYTHONS)}, where ai-toolkit's UI looks for its "
        "Python; without one the UI runs python3 from PATH, which install-ui leaves alone): "
        f"create it as ai-toolkit's README says (cd {real} && python3 -m venv venv && "
        "venv/bin/pip install -r requirements.txt), install weightstream into it, and run "
        "install-ui again"
    )


def site_packages(python: str) -> str:
    """The venv's site-packages, as its own Python names it (``-B``: the hook, when installed,
    leaves no bytecode behind), refused unless it lies inside the venv (a ``.venv/bin/python``
    that is the system's Python would name the system's)."""
    code = (
        "import sys, sysconfig; print(sys.prefix if sys.prefix != sys.base_prefix else '');"
        "print(sysconfig.get_path('purelib'))"
    )
    done = subprocess.run([python, "-I", "-B", "-c", code], capture_output=True, text=True)
    lines = done.stdout.splitlines()
    if done.returncode != 0 or len(lines) != 2:
        error = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise preflight.Refused(f"{python} does not run ({error}): repair ai-toolkit's venv")
    prefix, site = lines
    venv = os.path.dirname(os.path.dirname(python))
    if not prefix or os.path.realpath(prefix) != os.path.realpath(venv):
        raise preflight.Refused(
            f"{python} is not the Python of a venv at {venv}: create ai-toolkit's venv as its "
            f"README says (python3 -m venv {venv}) and install its requirements there"
        )
    return site


def installed_files(site: str) -> list[str]:
    return [os.path.join(site, PTH), os.path.join(site, f"{MODULE}.py")]


def _ours(path: str) -> bool:
    with open(path, encoding="utf-8", errors="replace") as f:
        return MARKER in f.readline()


def install(root: str) -> list[str]:
    """Writes the hook's two files into the UI's venv (again: the same files); returns them."""
    root, python = checkout(root)
    site = site_packages(python)
    done = subprocess.run(
        [python, "-B", "-c", "import weightstream.integrations.ai_toolkit.ui"],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        error = (done.stderr.strip().splitlines() or ["it exits with " + str(done.returncode)])[-1]
        raise preflight.Refused(
            f"weightstream does not import with ai-toolkit's Python {python} ({error}): install "
            f"it there ({python} -m pip install <weightstream>/client-py) and run install-ui again"
        )
    pth, module = installed_files(site)
    for path in (pth, module):
        if os.path.exists(path) and not _ours(path):
            raise preflight.Refused(
                f"{path} exists and is not weightstream-aitk's: move it away and run install-ui "
                "again"
            )
    # The module first: a .pth naming a module not there yet would fail every start between.
    for path, text in (
        (module, MODULE_TEXT.format(marker=MARKER, root=root, pth=PTH)),
        (pth, PTH_TEXT),
    ):
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return [pth, module]


def uninstall(root: str) -> list[str]:
    """Removes what ``install`` wrote (and the bytecode Python cached of its module); returns
    what it removed."""
    _, python = checkout(root)
    site = site_packages(python)
    removed = []
    for path in installed_files(site):  # the .pth first: nothing imports the module after
        if os.path.exists(path):
            if not _ours(path):
                raise preflight.Refused(
                    f"{path} is not weightstream-aitk's (its first line lacks {MARKER!r}): "
                    "left as it is"
                )
            os.remove(path)
            removed.append(path)
    cache = os.path.join(site, "__pycache__")
    for path in glob.glob(os.path.join(cache, f"{MODULE}.*.pyc")):
        os.remove(path)
        removed.append(path)
    if os.path.isdir(cache) and not os.listdir(cache):
        os.rmdir(cache)
    return removed


def main(argv: list[str]) -> int:
    """``install-ui AITK_ROOT`` or ``uninstall-ui AITK_ROOT``."""
    command, args = argv[0], argv[1:]
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(
            f"usage: weightstream-aitk {command} AITK_ROOT (ai-toolkit's checkout)", file=sys.stderr
        )
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    try:
        if command == "install-ui":
            files = install(args[0])
            print(
                f"weightstream-aitk: installed {', '.join(files)}: from the next job on, "
                "jobs with layer_offloading that ai-toolkit's UI starts stream through "
                f"weightstream (undo: weightstream-aitk uninstall-ui {args[0]})"
            )
        else:
            files = uninstall(args[0])
            what = ", ".join(files) if files else "nothing (not installed)"
            print(f"weightstream-aitk: removed {what}")
    except preflight.Refused as e:
        print(f"weightstream-aitk: {e}", file=sys.stderr)
        return 2
    return 0
