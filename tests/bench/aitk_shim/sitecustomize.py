"""Import stubs for ai-toolkit's dependencies that the bench machine lacks.

tests/bench/ai_toolkit_real.py puts this folder first on PYTHONPATH for ai-toolkit's `run.py`
(plain and through weightstream's launcher alike), so Python imports it at start-up. It serves
the modules named in WS_AITK_STUBS (comma-separated top-level names) *only when they cannot be
imported for real*: the finder sits at the end of `sys.meta_path`. ai-toolkit imports every
extension and every model class at start-up (`toolkit/extension.py`), so most of these are
imported but never run by an SDTrainer LoRA job on FLUX.1.

A stub's attributes are placeholder classes that can be subclassed, compared with `isinstance`
and used in annotations. Calling one (ai-toolkit builds a few torchao configs at import time)
returns an inert placeholder and records the caller's file:line. Every attribute read and every
call is written to WS_AITK_STUB_LOG (JSON, at exit), so the bench reports which stubbed names
the run touched and where anything stubbed was called: a call outside an import is a stub on
the executed path, which the bench treats as a failure.
"""

import atexit
import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import os
import sys
import types

_NAMES = {n.strip() for n in os.environ.get("WS_AITK_STUBS", "").split(",") if n.strip()}
_DISTS = {n.strip() for n in os.environ.get("WS_AITK_STUB_DISTS", "").split(",") if n.strip()}
_TOUCHED: dict[str, set[str]] = {}


_CALLS: list[dict] = []


class _StubMeta(type):
    def __call__(cls, *args, **kwargs):
        frame = sys._getframe(1)
        _CALLS.append(
            {
                "name": f"{cls.__module__}.{cls.__qualname__}",
                "at": f"{frame.f_code.co_filename}:{frame.f_lineno}",
                "in_import": frame.f_code.co_name == "<module>",
            }
        )
        return cls

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(cls.__module__, f"{cls.__qualname__}.{name}")

    def __getitem__(cls, item):
        return cls


def _placeholder(module: str, qualname: str):
    return _StubMeta(
        qualname.rsplit(".", 1)[-1], (), {"__module__": module, "__qualname__": qualname}
    )


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        _TOUCHED.setdefault(self.__name__, set()).add(name)
        value = _placeholder(self.__name__, name)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in _NAMES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+stub"
        _TOUCHED.setdefault(spec.name, set())
        return module

    def exec_module(self, module):
        pass

    def find_distributions(self, context=None):
        # WS_AITK_STUB_DISTS: stubs that must also look installed to importlib.metadata
        # (diffusers' LTX-2 export utilities check that PyAV is installed before importing it).
        if context is not None and context.name in _DISTS:
            return iter([_StubDistribution(context.name)])
        return iter(())


class _StubDistribution(importlib.metadata.Distribution):
    def __init__(self, name):
        self._name = name

    def read_text(self, filename):
        if filename == "METADATA":
            return f"Metadata-Version: 2.1\nName: {self._name}\nVersion: 0.0.0+stub\n"
        return None

    def locate_file(self, path):
        return None


def _dump():
    path = os.environ.get("WS_AITK_STUB_LOG")
    if path:
        with open(path, "w") as f:
            touched = {k: sorted(v) for k, v in sorted(_TOUCHED.items())}
            json.dump({"touched": touched, "calls": _CALLS, "memory_manager": _MM}, f, indent=1)


_HIDE = {n.strip() for n in os.environ.get("WS_AITK_HIDE", "").split(",") if n.strip()}
# WS_AITK_HIDE: top-level names imported as if not installed (`None` in sys.modules makes
# `import` raise and `importlib.util.find_spec` answer None). CPU runs hide `triton`: with triton
# present, ai-toolkit's OmniGen2 kernels query the CUDA device at import time.
for _name in _HIDE:
    sys.modules[_name] = None
if _NAMES:
    sys.meta_path.append(_StubFinder())
if _NAMES or _HIDE:
    atexit.register(_dump)


# WS_AITK_DETERMINISTIC: torch's deterministic algorithms (warn where an op has none), for the
# bench's bit-for-bit comparison of two runs. run.py seeds from SEED itself.
if os.environ.get("WS_AITK_DETERMINISTIC") == "1":
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def _stats():
    path = os.environ.get("WS_AITK_STATS")
    torch = sys.modules.get("torch")
    if not path or torch is None:
        return
    stats = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = {
            "max_memory_allocated": torch.cuda.max_memory_allocated(),
            "max_memory_reserved": torch.cuda.max_memory_reserved(),
        }
    with open(path, "w") as f:
        json.dump(stats, f)


# WS_AITK_STATS: the trainer's peak device memory as torch counts it, written at exit.
if os.environ.get("WS_AITK_STATS"):
    atexit.register(_stats)


# Which MemoryManager served the run, and what ai-toolkit asked of it: once
# `toolkit.memory_management` is imported (ai-toolkit's, or weightstream's through the
# launcher), its class methods are wrapped to count the calls (recorded with the stub log).
_MM: dict = {"implementation": None, "calls": []}


def _wrap_memory_manager():
    mod = sys.modules.get("toolkit.memory_management")
    cls = getattr(mod, "MemoryManager", None) if mod is not None else None
    if cls is None or getattr(cls, "_ws_bench_wrapped", False):
        return cls is not None
    _MM["implementation"] = cls.__module__

    def wrap(name):
        func = cls.__dict__[name].__func__

        def call(klass, module, *args, **kwargs):
            _MM["calls"].append({"call": name, "module": type(module).__name__})
            return func(klass, module, *args, **kwargs)

        return classmethod(call)

    for name in ("attach", "detach", "free"):
        if isinstance(cls.__dict__.get(name), classmethod):
            setattr(cls, name, wrap(name))
    release = cls.__dict__.get("release_cached_memory")
    if isinstance(release, classmethod):

        def release_cached_memory(klass, _f=release.__func__):
            _MM["calls"].append({"call": "release_cached_memory"})
            return _f(klass)

        cls.release_cached_memory = classmethod(release_cached_memory)
    cls._ws_bench_wrapped = True
    return True


def _audit(event, args):
    if (
        event == "import"
        and not _MM.get("done")
        and str(args[0]).startswith(("jobs", "extensions"))
    ):
        _MM["done"] = _wrap_memory_manager()


if os.environ.get("WS_AITK_STUB_LOG"):
    sys.addaudithook(_audit)
    if not (_NAMES or _HIDE):
        atexit.register(_dump)
