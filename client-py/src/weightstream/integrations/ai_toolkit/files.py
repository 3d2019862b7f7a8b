"""``load_from_files``: the streamed weights go from the loader's safetensors files into the
daemon, never through the trainer's memory.

ai-toolkit's FLUX.2 loader (``extensions_built_in/diffusion_models/flux2/flux2_model.py`` at
27a03a91, ``load_model``) builds the transformer on the ``meta`` device, reads the whole file
with ``safetensors.torch.load_file(path, device="cpu")`` (imported into its module), casts each
tensor to the train dtype, ``load_state_dict(..., assign=True)``, then, with ``quantize: true``,
quantizes it in host memory (``toolkit.util.quantize.quantize_model``: torchao float8 for
``qfloat8`` under ``layer_offloading``) before ``MemoryManager.attach``. Its ``load_te`` reads
the 24 B Mistral with ``Mistral3ForConditionalGeneration.from_pretrained(path,
torch_dtype=dtype)`` and, with ``quantize_te``, quantizes it with ``quantize(text_encoder,
weights=get_qtype(qtype))`` before attaching it (FLUX.2 Klein's ``load_te``, in its own module:
``Qwen3ForCausalLM``). While such a loader runs (``Interception``, installed by
``loading.run_load_model``):

- the ``load_file`` of the loader's module gives ``FileTensor``s (no data);
- ``nn.Module.load_state_dict`` reads from the file every tensor that is not the weight or
  bias of a Linear/Conv2d layer assigned to the module; those stay ``FileTensor``s;
- transformers' ``from_pretrained`` (5.x: its ``_load_pretrained_model``) reads the
  checkpoint's safetensors shards as ``FileTensor``s, which its renames, casts and assignments
  keep without data; tied weights (an ``lm_head`` sharing the embedding) are read as it
  returns and their layers stay on the device; a model whose streamable weights are cast, not
  the files' tensors,
  or loaded with a ``device_map``, a quantization config or a state dict, is read whole as it
  returns (what transformers gives without weightstream), the reason on it (``why_read``);
- the loader's ``quantize_model`` / ``quantize`` (in the globals of ``load_model`` and of
  the object's ``load_te``) leave a module whose streamable layers are all ``FileTensor``s to
  the daemon when the qtype is one it makes (``float8``/``qfloat8``: ``fp8``), recording it on
  the module (``QUANTIZE``) with ai-toolkit's call (``LATER``); any other qtype, or an accuracy
  recovery adapter or exclusions, reads those layers first and quantizes as ai-toolkit does;
  but ai-toolkit's own qtypes (``uint2..7`` with or without an accuracy recovery adapter,
  ``nvfp4``, ``convrot*``) are quantized once for every job (``recipes``: a later job with the
  same recipe key builds the layers with ai-toolkit's quantizer on ``meta`` and attaches the
  first job's stored model by id);
- ``MemoryManager.attach`` asks ``source`` whether the layers it streams can come from the
  files: then the daemon loads them (``Client.load_model`` of those layers' tensors only, from
  every file they are in as one model, quantized as recorded or as the ``quantize``/``compute``
  settings ask; the files' other tensors stay the trainer's to read) and the layers
  attach by the model's id, under the files' names where those differ (``Source.names``);
  a Conv2d layer of a module ai-toolkit would have quantized stays on the device
  (``linear_only``: its quantizers quantize Linear layers only); else (a cast the daemon would
  not make, two layers of one tensor, a model read whole) they are read and uploaded as usual
  and ``source`` says why;
- once the loader returns, ``unstreamed`` names each module read whole or not attached, and
  ``read_left`` reads every ``FileTensor`` still in the model's modules (a VAE, layers kept on
  the device, a text encoder not attached: quantized then by ai-toolkit's call).

``filetensor.READ`` counts what was read anyway, reported with the loading summary.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import os
import sys
from dataclasses import dataclass, field

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
#: The attribute of such a module: ai-toolkit's quantizing call, for a module not attached.
LATER = "_weightstream_files_quantize_later"
#: Where ai-toolkit's quantizers live; the loader's names for them are intercepted.
QUANTIZE_MODULE = "toolkit.util.quantize"
#: The attribute of a module ``from_pretrained`` made whose layers the trainer read whole:
#: why they could not come from the files.
WHY = "_weightstream_files_why"


def _lazy_layers(module: nn.Module) -> tuple[list[str], list[str]]:
    """(streamable layers whose parameters are all ``FileTensor``s, those that are not). A
    layer with a tied parameter is neither: policy never streams it (it stays on the device with
    what it shares), so the daemon's quantization of the others leaves it as the files hold
    it."""
    lazy, real, tied = [], [], _tied(module)
    for name, m in module.named_modules():
        if isinstance(m, STREAMABLE):
            params = [p for p in m.parameters(recurse=False)]
            if any(id(p) in tied for p in params):
                continue
            if params and all(is_file_tensor(p) for p in params):
                lazy.append(name)
            elif params:
                real.append(name)
    return lazy, real


def read(module: nn.Module, keep=frozenset(), only=None) -> int:
    """Reads each ``FileTensor`` parameter or buffer of ``module`` (but those of the layers in
    ``keep``; with ``only``, the parameters of those ids alone) into a real tensor, in place;
    returns how many. A parameter two modules share (tied weights) is read once and stays
    shared."""
    n, done = 0, {}
    for m in module.modules() if only is None else ():
        recipe = recipes.of(m)
        if recipe is not None:
            n += recipe.make(module, keep)
    for name, m in module.named_modules():
        if name in keep:
            continue
        for pname, p in list(m._parameters.items()):
            if is_file_tensor(p) and (only is None or id(p) in only):
                if id(p) not in done:  # p is kept alive with it, so its id is not reused
                    done[id(p)] = (p, nn.Parameter(p.read(), requires_grad=p.requires_grad))
                    n += 1
                m._parameters[pname] = done[id(p)][1]
        for bname, b in list(m._buffers.items()) if only is None else ():
            if is_file_tensor(b):
                m._buffers[bname] = b.read()
                n += 1
    return n


def unstreamed(modules) -> list[str]:
    """For each of ``modules`` (each once) not attached whose streamable layers came from
    files, why the trainer reads them: ``from_pretrained``'s reason, or that it is not
    attached (``read_left`` reads it then)."""
    seen, out = set(), []
    for module in modules:
        if id(module) in seen or "_memory_manager" in vars(module):
            continue
        seen.add(id(module))
        why = why_read(module) or ("not attached" if _lazy_layers(module)[0] else "")
        if why:
            out.append(f"{type(module).__name__} read by the trainer: {why}")
    return out


def linear_only(module: nn.Module, chosen: list[str]) -> list[str]:
    """``chosen`` without its Conv2d layers where the daemon makes ai-toolkit's qtype for
    ``module`` (``QUANTIZE``): ai-toolkit's quantizers quantize Linear layers only, so those
    stay as they are, on the device."""
    if not vars(module).get(QUANTIZE):
        return chosen
    return [n for n in chosen if not isinstance(module.get_submodule(n), nn.Conv2d)]


def read_left(modules) -> int:
    """``read`` over ``modules`` (each once); one whose quantization was left to the daemon
    but that was not attached is then quantized by ai-toolkit's call, as it would have been."""
    seen, n = set(), 0
    for module in modules:
        if id(module) not in seen:
            seen.add(id(module))
            n += read(module)
            later = vars(module).pop(LATER, None)
            if later is not None and "_memory_manager" not in vars(module):
                later()
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


def _daemon_quantizes(model: nn.Module, qtype_name, plain: bool, later) -> bool:
    """Records the daemon's format on ``model`` and returns True where every streamable layer
    of ``model`` is in the files and the daemon makes ``qtype_name`` (and the call is ``plain``:
    no include, exclude or adapter), with ``later`` (ai-toolkit's call) to run should the model
    not be attached (``read_left``)."""
    lazy, real = _lazy_layers(model)
    fmt = QTYPES.get(str(qtype_name))
    if lazy and fmt is not None and plain and not real:
        vars(model)[QUANTIZE] = fmt
        vars(model)[LATER] = later
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
    later = functools.partial(original, base_model, model_to_quantize)
    if _daemon_quantizes(model_to_quantize, qtype, adapter is None and not exclude, later):
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
    later = functools.partial(original, model, weights, activations, *args, **kwargs)
    if _daemon_quantizes(model, name, plain, later):
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


# --- transformers' from_pretrained --------------------------------------------------------------

#: The parameters of transformers' ``PreTrainedModel._load_pretrained_model`` (5.x) that are
#: read here: the model, the state dict (None: read from the checkpoint files), the files.
LOAD_PARAMETERS = ("model", "state_dict", "checkpoint_files", "load_config")


def _pretrained_model():
    """transformers' ``PreTrainedModel`` where the loader's process imported it, else None."""
    return getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)


def _knows(load) -> bool:
    """Whether ``load`` (``PreTrainedModel.__dict__["_load_pretrained_model"]``) is the
    static method whose state dict replaces the checkpoint files' (transformers 5.x)."""
    if not isinstance(load, staticmethod):
        return False
    with contextlib.suppress(TypeError, ValueError):
        names = tuple(inspect.signature(load.__func__).parameters)[: len(LOAD_PARAMETERS)]
        return names == LOAD_PARAMETERS
    return False


def _lazy_refusal(state_dict, files, load_config) -> str:
    """Why the checkpoint of one ``from_pretrained`` is read as usual ('' where it is not)."""
    if state_dict is not None:
        return "from_pretrained was given a state dict"
    if not files or not all(str(f).endswith(".safetensors") for f in files):
        return "its checkpoint is not in safetensors files"
    for option in ("hf_quantizer", "device_map", "device_mesh"):
        if getattr(load_config, option, None) is not None:
            return f"from_pretrained was given a {option}"
    return ""


def _load_pretrained_model(original, model, state_dict, files, load_config, *args, **kwargs):
    """transformers' read of the checkpoint: its files' tensors as ``FileTensor``s, which its
    renames, casts and assignments keep without data; else as usual, the reason on ``model``."""
    why = _lazy_refusal(state_dict, files, load_config)
    lazy: dict = {}
    for path in files if not why else ():
        tensors = lazy_load_file(path)
        if tensors is None:
            why = f"{path} holds a dtype torch does not have"
            break
        lazy.update(tensors)
    if why:
        vars(model)[WHY] = why
        return original(model, state_dict, files, load_config, *args, **kwargs)
    return original(model, lazy, files, load_config, *args, **kwargs)


def _unsafe(model: nn.Module) -> str:
    """Why the streamable layers of a model ``from_pretrained`` made from ``FileTensor``s cannot
    be loaded from its files by the daemon ('' where they can): each weight and bias must be
    a tensor of the files (under any key: ``Source.names``) in its own dtype. A parameter
    shared with another module (tied: an ``lm_head`` that is the embedding) is no reason:
    ``_from_pretrained`` reads it, and ``policy`` keeps its layer on the device."""
    shared = _tied(model)
    for name, m in model.named_modules():
        if not isinstance(m, STREAMABLE):
            continue
        for pname, p in m.named_parameters(recurse=False):
            tname = f"{name}.{pname}" if name else pname
            if id(p) in shared:
                continue
            if not is_file_tensor(p):
                return f"{tname!r} is not a tensor of the files (transformers made it)"
            if p.dtype != p.stored:
                return f"{tname!r} is stored as {p.stored}, the loader casts it to {p.dtype}"
    return ""


def _tied(model: nn.Module) -> set[int]:
    """Ids of the parameters more than one module holds (tied weights)."""
    seen = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return {i for i, n in seen.items() if n > 1}


def _from_pretrained(original, knows: bool, cls, *args, **kwargs):
    """``from_pretrained``; where its model cannot stream from its files, the model read whole
    (what transformers gives without weightstream) with the reason on it (``WHY``)."""
    out = original(cls, *args, **kwargs)
    model = out[0] if isinstance(out, tuple) else out
    if isinstance(model, nn.Module):
        why = vars(model).get(WHY) or _unsafe(model)
        if not knows:
            why = f"transformers {sys.modules['transformers'].__version__} reads it itself"
        if why:
            read(model)
            vars(model)[WHY] = why
        else:  # policy never streams a tied layer: it stays on the device with the embedding
            read(model, only=_tied(model))
    return out


def why_read(module: nn.Module) -> str:
    """Why ``from_pretrained``'s ``module`` was read whole by the trainer ('' where it was not)."""
    return vars(module).get(WHY, "")


class Interception:
    """Installs the calls above for one ``load_model``: in the globals of the loader's function
    and of its object's ``load_te`` (their ``load_file``, ``quantize_model`` and ``quantize``,
    where they are safetensors' and ai-toolkit's), ``nn.Module.load_state_dict``, and
    transformers' ``PreTrainedModel.from_pretrained`` where transformers is imported."""

    def __init__(self, load_model):
        funcs = [getattr(load_model, "__func__", load_model)]
        load_te = getattr(type(getattr(load_model, "__self__", None)), "load_te", None)
        if load_te is not None:
            funcs.append(load_te)
        self.scopes = []
        for func in funcs:
            scope = getattr(func, "__globals__", None)
            if scope is not None and all(scope is not s for s in self.scopes):
                self.scopes.append(scope)
        self._saved: list = []

    def _wrap(self, name, wrapper):
        for scope in self.scopes:
            original = scope.get(name)
            if original is None:
                continue
            if name == "load_file" and original is not safetensors.torch.load_file:
                continue
            if name != "load_file" and getattr(original, "__module__", None) != QUANTIZE_MODULE:
                continue
            self._saved.append((scope, name, original))
            scope[name] = functools.wraps(original)(functools.partial(wrapper, original))

    def _wrap_pretrained(self):
        cls = _pretrained_model()
        if cls is None:
            return
        load, pretrained = cls.__dict__["_load_pretrained_model"], cls.__dict__["from_pretrained"]
        knows = _knows(load)
        self._saved.append((cls, "from_pretrained", pretrained))
        cls.from_pretrained = classmethod(
            functools.partial(_from_pretrained, pretrained.__func__, knows)
        )
        if knows:
            self._saved.append((cls, "_load_pretrained_model", load))
            cls._load_pretrained_model = staticmethod(
                functools.partial(_load_pretrained_model, load.__func__)
            )

    @contextlib.contextmanager
    def installed(self):
        self._wrap("load_file", _load_file)
        self._wrap("quantize_model", _quantize_model)
        self._wrap("quantize", _quantize)
        self._wrap_pretrained()
        original = nn.Module.load_state_dict

        @functools.wraps(original)
        def load_state_dict(module, state_dict, strict=True, assign=False):
            return _load_state_dict(original, module, state_dict, strict, assign)

        nn.Module.load_state_dict = load_state_dict
        try:
            yield self
        finally:
            nn.Module.load_state_dict = original
            for owner, name, original_value in reversed(self._saved):
                if isinstance(owner, dict):
                    owner[name] = original_value
                else:
                    setattr(owner, name, original_value)
            self._saved.clear()


# --- the daemon's load -------------------------------------------------------------------------


@dataclass
class Source:
    """The files a module's streamed layers come from, or why they cannot (``why``)."""

    paths: list[str]
    quantize: str | None = None  # the daemon's format: None (as stored), fp8, or a row format
    names: dict[str, str] = field(default_factory=dict)  # parameter -> file key, where they differ
    why: str = ""
    tensors: int = 0
    nbytes: int = 0
    # The streamed tensors' names in the files: all the daemon loads of them (an embedding, a
    # head, a vision tower in the same shards are the trainer's to read).
    keys: list[str] = field(default_factory=list)
    coding: str = "none"  # how the daemon holds them (``Settings.coding``)

    def text(self) -> str:
        if self.why:
            return f"read by the trainer: {self.why}"
        return (
            f"{self.tensors} tensors ({self.nbytes / 1e9:.2f} GB) loaded by the daemon from "
            f"{len(self.paths)} file(s) as {self.quantize or 'stored'}"
            + (f", {len(self.names)} under other names there" if self.names else "")
        )


def source(module: nn.Module, chosen, settings) -> Source | None:
    """Whether the layers ``chosen`` to stream can be loaded by the daemon from their files:
    every parameter a ``FileTensor`` (the file's tensor as it is, under the parameter's name or
    another: ``Source.names``) in its own dtype (no cast the daemon would not make). None when
    none is a ``FileTensor``."""
    paths, tensors, nbytes, why, names, keys = [], 0, 0, "", {}, {}
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
                names[tname] = p.key
            other = keys.setdefault((p.path, p.key), tname)
            if other != tname:
                why = why or f"{other!r} and {tname!r} are one tensor of the files ({p.key!r})"
            elif p.dtype != p.stored:
                why = why or f"{tname!r} is stored as {p.stored}, the loader casts it to {p.dtype}"
    if not tensors:
        why = why_read(module)  # from_pretrained read it whole: uploaded as before
        return Source([], quantize=settings.quantize, why=why) if why else None
    src = Source(
        paths,
        why=why,
        tensors=tensors,
        nbytes=nbytes,
        names=names,
        keys=sorted({k for _, k in keys}),
    )
    src.coding = settings.coding
    if settings.compute in LOAD_AS:
        src.quantize = LOAD_AS[settings.compute]
    else:
        src.quantize = vars(module).get(QUANTIZE) or settings.quantize
    return src


def load(client, module: nn.Module, src: Source) -> str:
    """The daemon's model of the streamed tensors of ``src``'s files (``Source.keys``: only
    those are read and held), for this process's connection; its id."""
    manifest = client.load_model(
        src.paths,
        type(module).__name__,
        quantize=src.quantize,
        retention="connection",
        tensors=src.keys,
        coding=src.coding,
    )
    return manifest.model_id
