"""``load_from_files``: the streamed weights go from the loader's safetensors files into the
daemon, never through the trainer's memory.

ai-toolkit's FLUX.2 loader (``extensions_built_in/diffusion_models/flux2/flux2_model.py`` at
27a03a91, ``load_model``) builds the transformer on the ``meta`` device, reads the whole file
with ``safetensors.torch.load_file(path, device="cpu")`` (imported into its module), casts each
tensor to the train dtype, ``load_state_dict(..., assign=True)``, then, with ``quantize: true``,
quantizes it in host memory (``toolkit.util.quantize.quantize_model``: torchao float8 for
``qfloat8`` under ``layer_offloading``) before ``MemoryManager.attach``. While such a loader
runs (``Interception``, installed by ``loading.run_load_model``):

- the ``load_file`` of the loader's module gives ``FileTensor``s (no data);
- ``nn.Module.load_state_dict`` reads from the file every tensor that is not the weight or
  bias of a Linear/Conv2d layer assigned to the module; those stay ``FileTensor``s;
- the loader's ``quantize_model`` / ``quantize`` leave a module whose streamable layers are
  all ``FileTensor``s to the daemon when the qtype is one it makes (``float8``/``qfloat8``:
  ``fp8``), recording it on the module (``QUANTIZE``); ai-toolkit's own qtypes (``uint2..7``
  with or without an accuracy recovery adapter, ``nvfp4``, ``convrot*``) are quantized once
  for every job (``recipes``: a later job with the same recipe key builds the layers with
  ai-toolkit's quantizer on ``meta`` and attaches the first job's stored model by id); any
  other call reads those layers first and quantizes as ai-toolkit does;
- ``MemoryManager.attach`` asks ``source`` whether the layers it streams can come from the
  files: then the daemon loads them (``Client.load_model``, quantized as recorded or as the
  ``quantize``/``compute`` settings ask) and the layers attach by the model's id; else
  (renamed keys, a cast the daemon would not make) they are read and uploaded as usual and
  ``source`` says why;
- once the loader returns, ``read_left`` reads every ``FileTensor`` still in the model's
  modules (a VAE, layers kept on the device).

``filetensor.READ`` counts what was read anyway, reported with the loading summary.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import safetensors.torch
from torch import nn

import weightstream
from weightstream.integrations.ai_toolkit import recipes
from weightstream.integrations.ai_toolkit.settings import current
from weightstream.torch.compute_plan import LOAD_AS
from weightstream.torch.filetensor import is_file_tensor
from weightstream.torch.filetensor import load_file as lazy_load_file
from weightstream.torch.packed_forms import OSTRIS_FORMS

#: The layers whose weights and biases may stay in the files (weightstream streams these).
STREAMABLE = (nn.Linear, nn.Conv2d)
#: The attribute of a module whose quantization was left to the daemon: the daemon's format.
QUANTIZE = "_weightstream_files_quantize"
#: ai-toolkit's qtypes the daemon makes itself (``weightstream.quantize`` formats).
QTYPES = {"float8": "fp8", "qfloat8": "fp8"}
#: Where ai-toolkit's quantizers live; the loader's names for them are intercepted.
QUANTIZE_MODULE = "toolkit.util.quantize"


def _lazy_layers(module: nn.Module) -> tuple[list[str], list[str]]:
    """(streamable layers whose parameters are all ``FileTensor``s, those that are not)."""
    lazy, real = [], []
    for name, m in module.named_modules():
        if isinstance(m, STREAMABLE):
            params = [p for p in m.parameters(recurse=False)]
            if params and all(is_file_tensor(p) for p in params):
                lazy.append(name)
            elif params:
                real.append(name)
    return lazy, real


def read(module: nn.Module, keep=frozenset()) -> int:
    """Reads each ``FileTensor`` parameter or buffer of ``module`` (but those of the layers in
    ``keep``) into a real tensor, in place; returns how many."""
    n = 0
    for m in module.modules():
        recipe = recipes.of(m)
        if recipe is not None:
            n += recipe.make(module, keep)
    for name, m in module.named_modules():
        if name in keep:
            continue
        for pname, p in list(m._parameters.items()):
            if is_file_tensor(p):
                m._parameters[pname] = nn.Parameter(p.read(), requires_grad=p.requires_grad)
                n += 1
        for bname, b in list(m._buffers.items()):
            if is_file_tensor(b):
                m._buffers[bname] = b.read()
                n += 1
    return n


def read_left(modules) -> int:
    """``read`` over ``modules`` (each once)."""
    seen, n = set(), 0
    for module in modules:
        if id(module) not in seen:
            seen.add(id(module))
            n += read(module)
    return n


# --- the loader's calls ------------------------------------------------------------------------


def _load_state_dict(original, module, state_dict, strict=True, assign=False):
    """``nn.Module.load_state_dict`` with the streamable layers' ``FileTensor``s kept (when
    assigned) and every other one read."""
    if any(is_file_tensor(v) for v in state_dict.values()):
        keep = set()
        if assign:
            for name, m in module.named_modules():
                if isinstance(m, STREAMABLE):
                    keep.update(f"{name}.{p}" if name else p for p in ("weight", "bias"))
        state_dict = {
            k: v.read() if is_file_tensor(v) and k not in keep else v for k, v in state_dict.items()
        }
    return original(module, state_dict, strict=strict, assign=assign)


def _daemon_quantizes(model: nn.Module, qtype_name, plain: bool) -> bool:
    """Records the daemon's format on ``model`` and returns True where every streamable layer
    of ``model`` is in the files and the daemon makes ``qtype_name`` (and the call is ``plain``:
    no include, exclude or adapter)."""
    lazy, real = _lazy_layers(model)
    fmt = QTYPES.get(str(qtype_name))
    if lazy and fmt is not None and plain and not real:
        vars(model)[QUANTIZE] = fmt
        return True
    return False


def _quantized(model: nn.Module, call: dict, original, run):
    """``run()``, ai-toolkit's quantization of ``model``: once for every job where the layers
    are all in their files and the qtype is one of ai-toolkit's own (``recipes``), else on
    the file's layers read first."""
    lazy, real = _lazy_layers(model)
    if not lazy:
        return run()
    if real or str(call["qtype"]) not in OSTRIS_FORMS:
        read(model)
        return run()
    settings = current()
    code = getattr(getattr(original, "__code__", None), "co_filename", None)
    call = {**call, "weightstream": [settings.quantize, settings.compute]}
    return recipes.quantize_once(
        model, STREAMABLE, call, code, run, read, lambda: weightstream.connect(settings.socket)
    )


def _adapter(path):
    """An accuracy recovery adapter's identity: its file's where it is one, else its name."""
    return recipes.identity(path) if path and os.path.isfile(path) else path


def _quantize_model(original, base_model, model_to_quantize):
    config = base_model.model_config
    qtype = getattr(config, "qtype", None)
    adapter = getattr(config, "accuracy_recovery_adapter", None)
    exclude = base_model.get_quantization_exclude_modules() or []
    if _daemon_quantizes(model_to_quantize, qtype, adapter is None and not exclude):
        return None
    blocks = getattr(base_model, "get_transformer_block_names", None)
    call = {
        "fn": "quantize_model",
        "qtype": qtype,
        "adapter": _adapter(adapter),
        "exclude": list(exclude),
        "blocks": list(blocks()) if callable(blocks) else None,
        "dtype": str(getattr(base_model, "torch_dtype", None)),
    }
    return _quantized(
        model_to_quantize, call, original, lambda: original(base_model, model_to_quantize)
    )


def _quantize(original, model, weights=None, activations=None, *args, **kwargs):
    plain = activations is None and not args and not any(kwargs.values())
    name = getattr(weights, "name", weights)
    if _daemon_quantizes(model, name, plain):
        return None
    call = {
        "fn": "quantize",
        "qtype": name,
        "rest": repr((activations, args, sorted(kwargs.items()))),
    }
    return _quantized(
        model, call, original, lambda: original(model, weights, activations, *args, **kwargs)
    )


def _load_file(original, filename, device="cpu"):
    lazy = lazy_load_file(filename) if str(device) == "cpu" else None
    return lazy if lazy is not None else original(filename, device=device)


class Interception:
    """Installs the calls above for one ``load_model``: in the globals of the loader's function
    (its ``load_file``, ``quantize_model`` and ``quantize``, where they are safetensors' and
    ai-toolkit's) and ``nn.Module.load_state_dict``."""

    def __init__(self, load_model):
        func = getattr(load_model, "__func__", load_model)
        self.globals = getattr(func, "__globals__", {})
        self._saved: dict = {}

    def _wrap(self, name, wrapper):
        original = self.globals.get(name)
        if original is None:
            return
        if name == "load_file" and original is not safetensors.torch.load_file:
            return
        if name != "load_file" and getattr(original, "__module__", None) != QUANTIZE_MODULE:
            return
        self._saved[name] = original
        self.globals[name] = functools.wraps(original)(functools.partial(wrapper, original))

    @contextlib.contextmanager
    def installed(self):
        self._wrap("load_file", _load_file)
        self._wrap("quantize_model", _quantize_model)
        self._wrap("quantize", _quantize)
        original = nn.Module.load_state_dict

        @functools.wraps(original)
        def load_state_dict(module, state_dict, strict=True, assign=False):
            return _load_state_dict(original, module, state_dict, strict, assign)

        nn.Module.load_state_dict = load_state_dict
        try:
            yield self
        finally:
            nn.Module.load_state_dict = original
            self.globals.update(self._saved)
            self._saved.clear()


# --- the daemon's load -------------------------------------------------------------------------


@dataclass
class Source:
    """The files a module's streamed layers come from, or why they cannot (``why``)."""

    paths: list[str]
    quantize: str | None = None  # the daemon's format: None (as stored), fp8, or a row format
    why: str = ""
    tensors: int = 0
    nbytes: int = 0

    def text(self) -> str:
        if self.why:
            return f"read by the trainer: {self.why}"
        return (
            f"{self.tensors} tensors ({self.nbytes / 1e9:.2f} GB) loaded by the daemon from "
            f"{len(self.paths)} file(s) as {self.quantize or 'stored'}"
        )


def source(module: nn.Module, chosen, settings) -> Source | None:
    """Whether the layers ``chosen`` to stream can be loaded by the daemon from their files:
    every parameter a ``FileTensor`` under its own name (the module's parameter name is the
    file's key) and dtype (no cast the daemon would not make). None when none is a
    ``FileTensor``."""
    paths, tensors, nbytes, why = [], 0, 0, ""
    for name in chosen:
        m = module.get_submodule(name)
        for pname, p in m.named_parameters(recurse=False):
            if not is_file_tensor(p):
                if tensors or paths:
                    why = why or f"{name}.{pname} is not in a file"
                continue
            tname = f"{name}.{pname}"
            if p.path not in paths:
                paths.append(p.path)
            tensors += 1
            nbytes += p.nbytes
            if p.key != tname:
                why = why or f"the file names {tname!r} {p.key!r}"
            elif p.dtype != p.stored:
                why = why or f"{tname!r} is stored as {p.stored}, the loader casts it to {p.dtype}"
    if not tensors:
        return None
    src = Source(paths, why=why, tensors=tensors, nbytes=nbytes)
    if settings.compute in LOAD_AS:
        src.quantize = LOAD_AS[settings.compute]
    else:
        src.quantize = vars(module).get(QUANTIZE) or settings.quantize
    return src


def load(client, module: nn.Module, src: Source) -> str:
    """The daemon's model of ``src``'s files, for this process's connection; its id."""
    manifest = client.load_model(
        src.paths, type(module).__name__, quantize=src.quantize, retention="connection"
    )
    return manifest.model_id
