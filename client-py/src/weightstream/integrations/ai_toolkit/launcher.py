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

Settings: a top-level ``weightstream:`` section of the job's YAML (ai-toolkit reads only
``job``, ``config`` and ``meta``) and ``WEIGHTSTREAM_*`` variables, which win (``settings``).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import os
import runpy
import sys

from weightstream.integrations.ai_toolkit.settings import ENV, Settings, configure, current

PACKAGE = "toolkit.memory_management"
#: What each module of the package gives ai-toolkit, by attribute of ``manager``.
EXPORTS = {
    PACKAGE: ("MemoryManager", "sync_grad_transfers"),
    f"{PACKAGE}.manager": ("MemoryManager",),
    f"{PACKAGE}.manager_modules": ("sync_grad_transfers",),
}
CONFIG_EXTENSIONS = (".json", ".jsonc", ".yaml", ".yml")  # ai-toolkit's toolkit/config.py

USAGE = f"""usage: weightstream-aitk RUN_PY CONFIG [CONFIG ...] [-r] [-n NAME] [-l LOG]

Runs ai-toolkit's RUN_PY (its run.py) with layer offloading served by weightstream: keep
`model.layer_offloading: true` (and the *_percent settings) in the job's YAML. While the model
loads, Linear/Conv2d weights stay on the CPU (quantized there with quantize: true) and are
uploaded at attach; models the loader does not attach are attached after it. Optional settings
in a top-level `weightstream:` section of the YAML, or in the environment (which wins):
{chr(10).join(f"  {var:28} weightstream.{key}" for key, var in ENV.items())}
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


def config_paths(run_py: str, args: list[str]) -> list[str]:
    """The config files ai-toolkit's run.py will read, found as its ``get_config`` finds
    them: under ``config/`` beside run.py (with or without an extension), else as a path."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("config_file_list", nargs="*")
    parser.add_argument("-r", "--recover", action="store_true")
    parser.add_argument("-n", "--name")
    parser.add_argument("-l", "--log")
    known, _ = parser.parse_known_args(args)
    root = os.path.dirname(os.path.abspath(run_py))
    out = []
    for name in known.config_file_list:
        under = os.path.join(root, "config", name)
        found = [under] if os.path.exists(under) else []
        found += [under + ext for ext in CONFIG_EXTENSIONS if os.path.exists(under + ext)]
        found += [p for p in (name, os.path.abspath(name)) if os.path.exists(p)]
        if found:
            out.append(found[0])
    return out


def read_section(path: str) -> dict | None:
    """The ``weightstream:`` section of one config file (None if it has none)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith((".json", ".jsonc")):
        config = json.loads(text)
    else:
        import yaml  # ai-toolkit's requirements include PyYAML

        config = yaml.safe_load(text)
    return config.get("weightstream") if isinstance(config, dict) else None


def job_section(run_py: str, args: list[str]) -> dict | None:
    """The ``weightstream:`` section of the jobs to run; settings are process-wide, so jobs
    run together must not disagree on it."""
    sections = {p: read_section(p) for p in config_paths(run_py, args)}
    given = {p: s for p, s in sections.items() if s is not None}
    if len({json.dumps(s, sort_keys=True, default=str) for s in given.values()}) > 1:
        raise ValueError(
            "the jobs' weightstream: sections differ ("
            + ", ".join(given)
            + "): run them in separate weightstream-aitk processes"
        )
    return next(iter(given.values()), None)


# --- entry point ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``weightstream-aitk RUN_PY ARGS...`` (also ``python -m
    weightstream.integrations.ai_toolkit``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    run_py, args = os.path.abspath(argv[0]), argv[1:]
    if not os.path.isfile(run_py):
        print(f"weightstream-aitk: {argv[0]}: no such file (ai-toolkit's run.py)", file=sys.stderr)
        return 2
    try:
        settings = Settings.load(job_section(run_py, args))
    except ValueError as e:
        print(f"weightstream-aitk: {e}", file=sys.stderr)
        return 2
    configure(settings)
    install()
    # As `python run.py ...` would have it.
    sys.argv = [run_py, *args]
    sys.path.insert(0, os.path.dirname(run_py))
    runpy.run_path(run_py, run_name="__main__")
    return 0
