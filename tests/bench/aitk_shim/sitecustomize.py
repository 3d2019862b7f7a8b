"""Import stubs for ai-toolkit's dependencies that the bench machine lacks.

tests/bench/aitk/measure.py's `run_one` puts this folder first on PYTHONPATH for ai-toolkit's
`run.py` (plain and through weightstream's launcher alike), so Python imports it at start-up. It
serves the modules named in WS_AITK_STUBS (comma-separated top-level names) *only when they cannot
be imported for real*: the finder sits at the end of `sys.meta_path`. ai-toolkit imports every
extension and every model class at start-up (`toolkit/extension.py`), so most of these are imported
but never run by an SDTrainer LoRA job on FLUX.1.

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
import importlib.util
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
        loading = sys.modules.get("weightstream.integrations.ai_toolkit.loading")
        if loading is not None:  # weightstream-aitk's loading phases (layer_offloading)
            _MM["loading"] = [vars(r) for r in loading.REPORTS]
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


# torch's cuDNN attention backend fails in FLUX training on the GPU machine's image (an illegal
# memory access in backward, ai-toolkit's own MemoryManager and weightstream-aitk alike; see
# daemon/DESIGN.md): both runs use the other SDPA backends.
if os.environ.get("WS_AITK_NO_CUDNN_SDP", "1") == "1":
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)


_PHASES: dict = {}


def _peaks(torch) -> dict:
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
    }


def _stats():
    path = os.environ.get("WS_AITK_STATS")
    torch = sys.modules.get("torch")
    if not path or torch is None:
        return
    stats = _peaks(torch)
    if _PHASES:  # the peaks since training began; the whole run's is the larger of the two
        stats = {
            "loading": _PHASES,
            "training": stats,
            **{k: max(v, _PHASES.get(k, 0)) for k, v in stats.items()},
        }
    with open(path, "w") as f:
        json.dump(stats, f)


# WS_AITK_STATS: the trainer's peak device memory as torch counts it, while loading and while
# training (split where the training phase starts: `_mark_training` below), written at exit.
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
            record = {"call": name, "module": type(module).__name__}
            _MM["calls"].append(record)
            if name in ("free", "detach"):
                _session_stats(module, record)
            out = func(klass, module, *args, **kwargs)
            if name == "attach":
                record.update(_attached(module))
            return out

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


def _layer_bytes(m) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))


def _attached(module) -> dict:
    """What the manager took over in ``module`` right after ``attach``: ai-toolkit's marks
    each layer it bounces from the CPU with ``_layer_memory_manager``; weightstream's handle
    lists the layers it streams (``handle.streamed``) and those it keeps (``handle.resident``)."""
    layers = [
        (n, m)
        for n, m in module.named_modules()
        if type(m).__name__ in ("Linear", "Conv2d", "LoRACompatibleLinear", "LoRACompatibleConv")
    ]
    out = {
        "linear_conv_layers": len(layers),
        "linear_conv_bytes": sum(_layer_bytes(m) for _, m in layers),
    }
    aitk = [(n, m) for n, m in module.named_modules() if hasattr(m, "_layer_memory_manager")]
    if aitk:
        out["aitk_managed_layers"] = len(aitk)
        out["aitk_managed_bytes"] = sum(_layer_bytes(m) for _, m in aitk)
        out["aitk_managed_on_cpu"] = all(
            p.device.type == "cpu" for _, m in aitk for p in m.parameters(recurse=False)
        )
        out["aitk_unmanaged"] = len(module._memory_manager.unmanaged_modules)
    manager = vars(module).get("_memory_manager")
    handle = getattr(manager, "handle", None)
    if handle is not None:
        out["ws_streamed_layers"] = len(handle.streamed)
        out["ws_streamed_bytes"] = sum(
            _layer_bytes(layer.module) for layer in handle.streamed.values()
        )
        out["ws_resident_layers"] = len(handle.resident)
        reasons: dict = {}
        for layer, why in handle.resident.items():  # why a layer stays on the device
            reasons.setdefault(str(why), []).append(layer)
        out["ws_resident"] = {
            why: names[:8] + ["..."] * (len(names) > 8) for why, names in reasons.items()
        }
        out["ws_model_id"] = handle.model_id
        _HANDLES.append((type(module).__name__, handle))
    elif manager is not None and "aitk_managed_layers" not in out:
        out["ws_streamed_layers"] = 0
    return out


#: weightstream handles attached in this process: their daemon session statistics are taken
#: when ai-toolkit frees or detaches the module and at exit (the sessions end with them).
_HANDLES: list = []


def _session_stats(module, record=None):
    manager = vars(module).get("_memory_manager")
    handle = getattr(manager, "handle", None)
    if handle is None:
        return
    try:
        stats = handle.stats()
    except Exception as e:  # the bench reports it; the run goes on
        stats = {"error": repr(e)}
    _MM.setdefault("session_stats", []).append(
        {"module": type(module).__name__, "when": record["call"] if record else "exit", **stats}
    )


def _stats_at_exit():
    for name, handle in _HANDLES:
        try:
            stats = handle.stats()  # {} once the session is closed
        except Exception as e:
            stats = {"error": repr(e)}
        if stats:
            _MM.setdefault("session_stats", []).append({"module": name, "when": "exit", **stats})


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
    atexit.register(_stats_at_exit)  # registered after _dump: runs before it


# WS_AITK_FLUX2_PARAMS: a JSON object of Klein4BParams fields (e.g. a reduced depth, or a
# reduced width for the CPU). ai-toolkit's FLUX.2 klein 4B loader builds its transformer from
# `Klein4BParams()`, a name looked up in its module's globals
# (extensions_built_in/diffusion_models/flux2/flux2_klein_model.py, `get_flux2_params`):
# once that module is imported, the name is rebound to `Klein4BParams(**fields)`. Nothing
# else of ai-toolkit is changed; both runs get the same fields.
# WS_AITK_FLUX2_CLASS ("module:Name") names another such class: FLUX.2-dev's loader builds
# `Flux2Params()` in flux2_model.py (its `get_flux2_params`).
_PATCHED, _, _PARAMS = os.environ.get(
    "WS_AITK_FLUX2_CLASS",
    "extensions_built_in.diffusion_models.flux2.flux2_klein_model:Klein4BParams",
).partition(":")


def _patch_klein(module):
    import functools

    fields = json.loads(os.environ["WS_AITK_FLUX2_PARAMS"])
    setattr(module, _PARAMS, functools.partial(getattr(module, _PARAMS), **fields))
    _MM["patched"] = {f"{_PATCHED}.{_PARAMS}": fields}


class _PatchFinder(importlib.abc.MetaPathFinder):
    """Finds module `name` with the finders after it, then runs `patch` on the module once it
    has executed. Only those after it: a finder before it that delegates the same way
    (weightstream-aitk's launcher hooks the trainer's module too) has asked it, and asking that
    one back would never end."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self not in sys.meta_path:
            return None
        for finder in sys.meta_path[sys.meta_path.index(self) + 1 :]:
            if not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            self.patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("WS_AITK_FLUX2_PARAMS"):
    sys.meta_path.insert(0, _PatchFinder(_PATCHED, _patch_klein))
    if not (_NAMES or _HIDE or os.environ.get("WS_AITK_STUB_LOG")):
        atexit.register(_dump)


# WS_PHASE_FILE (tests/bench/card.py, the emulated card): the training phase starts at the
# first step of ai-toolkit's train loop, which opens with `self.timer.start('train_loop')`
# (jobs/process/BaseSDTrainProcess.py, `run`; the Timer of toolkit/timer.py): the first such
# call appends card.py's marker, labelled with WS_PHASE_LABEL. With WS_AITK_STATS, torch's
# peaks until then are kept as the loading phase's, and counted again from there.
def _mark_training(module):
    start = module.Timer.start

    def timed_start(self, timer_name):
        if timer_name == "train_loop" and not _MM.get("training_marked"):
            _MM["training_marked"] = True
            torch = sys.modules.get("torch")
            if os.environ.get("WS_AITK_STATS") and torch is not None:
                _PHASES.update(_peaks(torch))
                if _PHASES:
                    torch.cuda.reset_peak_memory_stats()
            if os.environ.get("WS_PHASE_FILE"):
                spec = importlib.util.spec_from_file_location(
                    "ws_card", os.path.join(os.path.dirname(os.path.dirname(__file__)), "card.py")
                )
                card = sys.modules["ws_card"] = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(card)
                card.phase("training", os.environ.get("WS_PHASE_LABEL", ""))
        return start(self, timer_name)

    module.Timer.start = timed_start


if os.environ.get("WS_PHASE_FILE") or os.environ.get("WS_AITK_STATS"):
    sys.meta_path.insert(0, _PatchFinder("toolkit.timer", _mark_training))


# WS_AITK_SAMPLING: ai-toolkit's sampling timed from its own run. `BaseSDTrainProcess.sample`
# (jobs/process/BaseSDTrainProcess.py) renders the `sample:` prompts at step 0 (unless
# `skip_first_sample`), every `sample_every` steps and at the end; while it runs, each forward
# pass of the model's transformer (`self.sd.unet`, under no_grad: one a denoising step for a
# guidance-distilled model such as FLUX.2-dev) is timed on the device, by CUDA events recorded
# before and after it, so that the passes run back to back as ai-toolkit runs them (a wait for
# the device around each would hold the next pass's copies until the last one ended); read
# once the call is done. One record a `sample` call: the step, whether training had started
# (the shim's train_loop mark), its seconds and each pass's, written at exit.
_SAMPLES: list = []


def _time_sampling(module):
    import time

    cls = module.BaseSDTrainProcess
    sample = cls.sample

    def timed_sample(self, *args, **kwargs):
        torch = sys.modules["torch"]
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        record = {
            "step": args[0] if args else kwargs.get("step"),
            "after_training_started": bool(_MM.get("training_marked")),
            "forward_s": [],
        }
        marks = []  # (start, end) of each no_grad pass: CUDA events, or monotonic seconds

        def now():
            if not cuda:
                return time.monotonic()
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event

        def pre(_module, _args):
            if not torch.is_grad_enabled():
                marks.append([now(), None])

        def post(_module, _args, _out):
            if marks and marks[-1][1] is None:
                marks[-1][1] = now()

        transformer = self.sd.unet
        hooks = [
            transformer.register_forward_pre_hook(pre),
            transformer.register_forward_hook(post),
        ]
        t0 = time.monotonic()
        try:
            return sample(self, *args, **kwargs)
        finally:
            if cuda:
                torch.cuda.synchronize()
            record["wall_s"] = time.monotonic() - t0
            for start, end in marks:
                if end is not None:
                    seconds = start.elapsed_time(end) / 1e3 if cuda else end - start
                    record["forward_s"].append(seconds)
            for hook in hooks:
                hook.remove()
            _SAMPLES.append(record)

    cls.sample = timed_sample


def _dump_samples():
    with open(os.environ["WS_AITK_SAMPLING"], "w") as f:
        json.dump({"samples": _SAMPLES}, f)


if os.environ.get("WS_AITK_SAMPLING"):
    sys.meta_path.insert(0, _PatchFinder("jobs.process.BaseSDTrainProcess", _time_sampling))
    atexit.register(_dump_samples)


# WS_AITK_PROBE: where two runs part. Every nn.Linear call (in call order, the first
# _PROBE_CALLS of them) is recorded with its weight's and input's shapes, the input's strides,
# and checksums of the input's and the output's bits (summed on the device, read at exit); the
# warnings torch gives for an operation without a deterministic implementation are recorded too.
_PROBE_CALLS = 6000


def _probe():
    import warnings

    import torch

    calls, nondeterministic = [], []
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if "determinis" in str(message):
            nondeterministic.append(str(message)[:300])
        return shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning

    def bits(t):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return None
        v = t.detach()
        v = v.contiguous().view(torch.int16 if v.element_size() == 2 else torch.int32)
        return v.to(torch.int64).sum()

    def hook(module, args, output):
        if not isinstance(module, torch.nn.Linear) or len(calls) >= _PROBE_CALLS:
            return
        x = args[0] if args else None
        calls.append(
            (
                tuple(module.weight.shape),
                tuple(x.shape) if isinstance(x, torch.Tensor) else None,
                tuple(x.stride()) if isinstance(x, torch.Tensor) else None,
                torch.is_grad_enabled(),
                bits(x),
                bits(output),
            )
        )

    torch.nn.modules.module.register_module_forward_hook(hook)

    def dump():
        out = []
        for w, xs, st, grad, bx, by in calls:
            out.append(
                [
                    list(w),
                    xs and list(xs),
                    st and list(st),
                    grad,
                    None if bx is None else int(bx),
                    None if by is None else int(by),
                ]
            )
        with open(os.environ["WS_AITK_PROBE"], "w") as f:
            json.dump({"calls": out, "nondeterministic_warnings": sorted(set(nondeterministic))}, f)

    atexit.register(dump)


if os.environ.get("WS_AITK_PROBE"):
    _probe()
