"""``weightstream-aitk run.py config.yaml``: runs ai-toolkit's own entry point unchanged, with
``toolkit.memory_management`` resolving to weightstream's implementation.

A finder at the front of ``sys.meta_path`` answers for ``toolkit.memory_management`` and the
submodules ai-toolkit imports from it (at ostris/ai-toolkit 27a03a91: ``from
toolkit.memory_management import MemoryManager`` in the loaders, the trainer and
``toolkit/unloader.py``; ``... import sync_grad_transfers`` in ``SDTrainer``; ``from
toolkit.memory_management.manager import MemoryManager`` in the FLUX.2 and Wan loaders); the
real ``toolkit`` package is imported as usual around it. The manager itself is loaded when
ai-toolkit first imports it. A second finder hooks ai-toolkit's model base classes
(``toolkit.models.base_model.BaseModel``, ``toolkit.stable_diffusion_model.StableDiffusion``)
once they are imported: with ``layer_offloading`` their ``load_model`` keeps the streamable
weights off the device and attaches what the loader left unattached (``loading``). It also
hooks ai-toolkit's trainer (``jobs.process.BaseSDTrainProcess``) once imported: with
``trainable: host`` the LoRA's weights and optimizer state live in host memory
(``optimizer``).

Settings: a top-level ``weightstream:`` section of the job's file, YAML or JSON (ai-toolkit
reads only ``job``, ``config`` and ``meta``) and ``WEIGHTSTREAM_*`` variables, which win
(``settings``). Before anything is installed, ``preflight`` checks the job files, ai-toolkit's
environment and the daemon (``prepare``); jobs started by ai-toolkit's web UI go through
``prepare`` too, in the job's own process (``ui_job``, called by ``ui``'s hook).
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import json
import os
import runpy
import sys

from weightstream.integrations.ai_toolkit import preflight
from weightstream.integrations.ai_toolkit.settings import ENV, Settings, configure, current

PACKAGE = "toolkit.memory_management"
#: What each module of the package gives ai-toolkit, by attribute of ``manager``.
EXPORTS = {
    PACKAGE: ("MemoryManager", "sync_grad_transfers"),
    f"{PACKAGE}.manager": ("MemoryManager",),
    f"{PACKAGE}.manager_modules": ("sync_grad_transfers",),
}

USAGE = f"""usage: weightstream-aitk RUN_PY CONFIG [CONFIG ...] [-r] [-n NAME] [-l LOG]
       weightstream-aitk install-ui AITK_ROOT | uninstall-ui AITK_ROOT

Runs ai-toolkit's run.py with its layer offloading served by weightstream, with no edit to
ai-toolkit. The arguments are run.py's own, passed on unchanged:
  RUN_PY          ai-toolkit's run.py, in its checkout (run this with ai-toolkit's venv)
  CONFIG          a job file (.json, .jsonc, .yaml, .yml): a path, or a name under the
                  checkout's config/ folder, extension optional; several run one after another
  -r, --recover   go on with the next CONFIG when a job fails
  -n, --name NAME replace the [name] tag in the job files with NAME
  -l, --log LOG   also write ai-toolkit's output to the file LOG

First start the daemon: `weightstream serve` (your own), or the systemd service
(deploy/README.md). Before run.py starts, weightstream-aitk checks that the job files exist and
parse, that their settings are valid, that RUN_PY's folder holds ai-toolkit and torch imports,
and that the daemon answers on its socket; a failure is one line saying what to do (exit 2).

Keep `model.layer_offloading: true` (and the *_percent settings) in the job: while the model
loads, Linear/Conv2d weights stay on the CPU (quantized there with quantize: true) and are
uploaded at attach; models the loader does not attach are attached after it. Optional settings
in a top-level `weightstream:` section of the job, or in the environment (which wins):
{chr(10).join(f"  {var:28} weightstream.{key}" for key, var in ENV.items())}

install-ui AITK_ROOT: every job that ai-toolkit's web UI (or `.venv/bin/python run.py`) starts
in that checkout with layer_offloading runs as above; uninstall-ui AITK_ROOT undoes it.
"""


class ToolkitMemoryFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``toolkit.memory_management`` and its submodules to weightstream's."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == PACKAGE or fullname.startswith(f"{PACKAGE}."):
            return importlib.util.spec_from_loader(
                fullname, self, origin="weightstream", is_package=fullname == PACKAGE
            )
        return None

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        names = EXPORTS.get(module.__name__)
        if names is None:
            raise ImportError(
                f"{module.__name__}: weightstream-aitk serves {PACKAGE} (MemoryManager, "
                "sync_grad_transfers) and has no such module",
                name=module.__name__,
            )
        from weightstream.integrations.ai_toolkit import manager

        module.__doc__ = f"weightstream's {PACKAGE} (weightstream.integrations.ai_toolkit)"
        for name in names:
            setattr(module, name, getattr(manager, name))


FINDER = ToolkitMemoryFinder()


class ModelClassHook(importlib.abc.MetaPathFinder):
    """Finds the ai-toolkit modules of ``HOOKS`` with the finders after it, and hooks them once
    the module has run: the model base classes (``MODEL_BASES``, ``loading.hook_model_class``:
    ``load_model`` with ``layer_offloading`` keeps the streamable weights off the device and
    attaches what the loader left unattached) and the trainer
    (``optimizer.hook_trainer_module``: ``trainable: host``)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in HOOKS:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = getattr(spec.loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_and_hook(module):
            exec_module(module)
            HOOKS[fullname](module)

        spec.loader.exec_module = exec_and_hook
        return spec


#: ai-toolkit's model base classes, by module: every architecture's class derives from one, and
#: the trainer loads it with ``load_model()`` (``jobs/process/BaseSDTrainProcess.py``).
MODEL_BASES = {
    "toolkit.models.base_model": ("BaseModel",),
    "toolkit.stable_diffusion_model": ("StableDiffusion",),
}
MODEL_HOOK = ModelClassHook()
#: ai-toolkit's trainer, which asks for the optimizer, saves and samples.
TRAINER = "jobs.process.BaseSDTrainProcess"


def hook_trainer(module):
    from weightstream.integrations.ai_toolkit import optimizer

    optimizer.hook_trainer_module(module, current)


def hook_classes(module):
    from weightstream.integrations.ai_toolkit import loading
    from weightstream.integrations.ai_toolkit.manager import MemoryManager

    for name in MODEL_BASES[module.__name__]:
        cls = getattr(module, name, None)
        if cls is None:
            raise ImportError(
                f"{module.__name__} has no {name}: weightstream-aitk knows ai-toolkit's model "
                "classes as of ostris/ai-toolkit 27a03a91",
                name=module.__name__,
            )
        loading.hook_model_class(cls, MemoryManager)


#: The hook of each ai-toolkit module, run once the module has run.
HOOKS = {**dict.fromkeys(MODEL_BASES, hook_classes), TRAINER: hook_trainer}


def install():
    """Puts the finders first on ``sys.meta_path``. Refuses when ai-toolkit's own memory
    manager was imported already (its classes would be in use); model base classes imported
    already are hooked at once."""
    loaded = sys.modules.get(PACKAGE)
    if loaded is not None and not isinstance(getattr(loaded, "__loader__", None), type(FINDER)):
        raise RuntimeError(f"{PACKAGE} was imported before weightstream's launcher installed it")
    for finder in (MODEL_HOOK, FINDER):
        if finder not in sys.meta_path:
            sys.meta_path.insert(0, finder)
    for name, hook in HOOKS.items():
        if name in sys.modules:
            hook(sys.modules[name])


def uninstall():
    for finder in (FINDER, MODEL_HOOK):
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(f"{PACKAGE}.")]:
        del sys.modules[name]


# --- the job's weightstream: section ----------------------------------------------------------


def job_section(jobs: list[preflight.Job]) -> dict | None:
    """The ``weightstream:`` section of the jobs to run; settings are process-wide, so jobs
    run together must not disagree on it."""
    given = {job.path: job.section for job in jobs if job.section is not None}
    if len({json.dumps(s, sort_keys=True, default=str) for s in given.values()}) > 1:
        raise preflight.Refused(
            "the jobs' weightstream: sections differ ("
            + ", ".join(given)
            + "): run them in separate weightstream-aitk processes"
        )
    return next(iter(given.values()), None)


# --- entry point ---------------------------------------------------------------------------


def prepare(run_py: str, args: list[str], jobs: list[preflight.Job] | None = None) -> str:
    """Everything but running ``run_py``: the checks of ``preflight`` (raising ``Refused``),
    the settings configured and the finders installed. Returns the line that says so."""
    if not os.path.isfile(run_py):
        raise preflight.Refused(f"{run_py}: no such file (give ai-toolkit's run.py)")
    jobs = preflight.read_jobs(run_py, args) if jobs is None else jobs
    try:
        settings = Settings.load(job_section(jobs))
    except ValueError as e:
        raise preflight.Refused(str(e)) from None
    preflight.check_checkout(run_py)
    version, socket = preflight.daemon_version(settings.socket)
    preflight.check_torch()
    configure(settings)
    install()
    _print_host_peak_at_exit()
    offloading = [os.path.basename(job.path) for job in jobs if job.layer_offloading]
    return (
        f"weightstream-aitk: weightstream daemon {version} at {socket}; "
        f"toolkit.memory_management is weightstream's; layer_offloading in "
        f"{', '.join(offloading) if offloading else 'no job (nothing will stream)'}"
    )


def _print_host_peak_at_exit():
    """At the job's exit, one line with the host's peak over loading and training
    (``loading.exit_line``), once per process."""
    global _AT_EXIT
    if _AT_EXIT:
        return
    _AT_EXIT = True

    def line():
        from weightstream.integrations.ai_toolkit import loading

        text = loading.exit_line()
        if text is not None:
            print(text, flush=True)

    atexit.register(line)


_AT_EXIT = False


def ui_job():
    """In ai-toolkit's ``run.py`` process, at its first ``import toolkit`` (``ui``'s hook): a
    job with ``layer_offloading`` gets the launcher's checks, settings and finders, and its
    line on stdout (the job's log); a refused check ends the process with exit code 2 and its
    line on stderr. Other jobs, and job files that do not parse (ai-toolkit says why), are
    untouched."""
    run_py, args = os.path.abspath(sys.argv[0]), sys.argv[1:]
    try:
        jobs = preflight.read_jobs(run_py, args)
    except preflight.Refused:
        return
    if not any(job.layer_offloading for job in jobs):
        return
    try:
        line = prepare(run_py, args, jobs)
    except preflight.Refused as e:
        print(f"weightstream-aitk: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``weightstream-aitk RUN_PY ARGS...`` (also ``python -m
    weightstream.integrations.ai_toolkit``), or ``weightstream-aitk install-ui|uninstall-ui
    AITK_ROOT`` (``ui``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("install-ui", "uninstall-ui"):
        from weightstream.integrations.ai_toolkit import ui

        return ui.main(argv)
    run_py, args = os.path.abspath(argv[0]), argv[1:]
    try:
        line = prepare(run_py, args)
    except preflight.Refused as e:
        print(f"weightstream-aitk: {e}", file=sys.stderr)
        return 2
    print(line, flush=True)
    # As `python run.py ...` would have it.
    sys.argv = [run_py, *args]
    sys.path.insert(0, os.path.dirname(run_py))
    runpy.run_path(run_py, run_name="__main__")
    return 0
