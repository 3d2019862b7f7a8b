"""Quantized once for every job: the layers ai-toolkit quantizes at load, kept in the daemon
under a recipe key and attached by its id in later jobs, which neither read nor quantize them.

ai-toolkit quantizes a model at load for qtypes the daemon does not make (``uint2..7`` with or
without an accuracy recovery adapter, ``nvfp4``, ``convrot*``): every job reads the bf16
layers, quantizes them and uploads the packed buffers, although the daemon would find the
upload identical to the last job's. With ``load_from_files`` (``files.Interception``), when
every streamable layer of the model is still in its file, ``quantize``:

- makes the **recipe key**: a digest of the layers' file tensors (each layer's parameter name,
  key, stored and loaded dtype and shape), the files' identity (real path, device, inode, size,
  modification and change times: a file written again is another recipe), ai-toolkit's
  quantizer sources (every ``*quant*.py`` beside ``toolkit/util/quantize.py``), torch's
  version, and the call (the qtype, the adapter file's identity, the exclusions, the block
  names, the dtype, weightstream's ``quantize``/``compute``);
- looks the key up in this user's recipe index (``directory``: one file per key holding the
  daemon's model id, written by this user's jobs only; the id is the digest of the model's
  bytes, so the daemon's model of that id holds exactly the bytes that job uploaded, whoever
  uploaded them since). A model name in the daemon would serve any uid's claim instead;
- **found and still in the daemon** (``ListModels``): each streamable layer's parameters
  become ``meta`` tensors and ai-toolkit's own quantization runs on them, so the layers get
  their quantizer, class, buffer names, dtypes, shapes and attributes from ai-toolkit's code
  without a byte read or quantized (its quantizers at 27a03a91 all run on ``meta``). The model
  carries a ``Recipe`` holding each layer's file tensors: ``MemoryManager.attach`` checks that
  the stored model holds every tensor it streams (name, shape, dtype), attaches by its id, and
  ``make``s the layers it does not stream (read from the file, cast, quantized by
  ai-toolkit's ``convert_linear_to_ostris`` as its ``quantize`` would have);
- **not found**, or gone from the daemon (restarted, evicted), or the stored model does not
  match, or attaching by its id fails because it is gone: the layers are read and quantized by
  ai-toolkit (today's path: ``make`` every layer that is not yet), uploaded as a cached model
  (``Client.RETENTIONS``: kept after the job, evicted when the daemon needs the room) and the
  index records it for the next job. The loading line says which and why.

The job holds the stored model through its session and takes no reference of its own: freeing
or detaching the module leaves the model to the daemon's cache either way.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from weightstream import _dtypes, quantize
from weightstream.torch import packed, policy
from weightstream.torch.filetensor import is_file_tensor
from weightstream.torch.placeholder import is_placeholder

#: The record's format; a record of another is not used.
VERSION = 1
#: The directory of this user's recipe index; ``0``/``off``/empty turns recipes off.
DIR_ENV = "WEIGHTSTREAM_RECIPES"
#: The attribute of the quantized module that holds its ``Recipe``.
RECIPE = "_weightstream_recipe"


def directory() -> Path | None:
    """``$WEIGHTSTREAM_RECIPES``, else ``$XDG_CACHE_HOME/weightstream/recipes`` (``~/.cache``
    without it); None when recipes are off."""
    value = os.environ.get(DIR_ENV)
    if value is not None:
        return None if value.strip().lower() in ("", "0", "off", "false") else Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "weightstream" / "recipes"


def identity(path: str) -> list:
    """What says a file is unchanged without reading it (a rewrite changes its change time)."""
    st = os.stat(path)
    return [
        os.path.realpath(path),
        st.st_dev,
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
        st.st_ctime_ns,
    ]


def _sources(code_file: str | None) -> str:
    """A digest of ai-toolkit's quantizer sources: every ``*quant*.py`` beside ``code_file``."""
    h = hashlib.sha256()
    if code_file:
        for p in sorted(Path(code_file).parent.glob("*quant*.py")):
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def key(model: nn.Module, streamable, call: dict, code_file: str | None) -> str:
    """The recipe key of quantizing ``model`` (its ``streamable`` layers all file tensors but
    the tied ones, read whole and quantized by every job, which it leaves out) by
    ``call`` with the code beside ``code_file``."""
    layers, files = [], {}
    for name, m in model.named_modules():
        if isinstance(m, streamable):
            for pname, p in m.named_parameters(recurse=False):
                if not is_file_tensor(p):  # a tied layer's: read whole, quantized by every job
                    continue
                layers.append(
                    [f"{name}.{pname}", p.key, str(p.stored), str(p.dtype), list(p.shape)]
                )
                if p.path not in files:
                    files[p.path] = identity(p.path)
    doc = {
        "version": VERSION,
        "torch": torch.__version__,
        "code": _sources(code_file),
        "call": call,
        "files": sorted(files.values()),
        "layers": layers,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=repr).encode()).hexdigest()


def _record_path(k: str) -> Path | None:
    d = directory()
    return None if d is None else d / f"{k}.json"


def recorded(k: str) -> str | None:
    """The model id the index holds for key ``k``, if any."""
    path = _record_path(k)
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads(path.read_text()) if path is not None else {}
        if doc.get("version") == VERSION and isinstance(doc.get("model_id"), str):
            return doc["model_id"]
    return None


def record(k: str, model_id: str, about: dict):
    """Writes the index entry of ``k`` (readable by this user only; replaced whole)."""
    path = _record_path(k)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"version": VERSION, "model_id": model_id, "recipe": about}))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


# --- a layer made from its file ------------------------------------------------------------


def _meta(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta" and not is_placeholder(t)


@dataclass(eq=False)
class Layer:
    """A streamable layer whose parameters were its file tensors (``params``), made by
    ai-toolkit's quantization on ``meta`` tensors instead; ``cls``: its class before."""

    module: nn.Module
    cls: type
    params: dict

    def pending(self) -> bool:
        m = self.module
        return any(_meta(t) for t in [*m._parameters.values(), *m._buffers.values()])

    def make(self) -> int:
        """Reads the layer's tensors and quantizes them as ai-toolkit did on ``meta``, in
        place: a layer ai-toolkit converted gets its file weight back (cast to the dtype it
        was converted from) and is converted again by ai-toolkit's ``convert_linear_to_ostris``
        with the same quantizer. Returns the tensors read."""
        m = self.module
        if not self.pending():
            return 0
        vars(m).pop(policy.STORED, None)
        converted = type(m) is not self.cls
        values = {}
        for pname, ft in self.params.items():
            now = m._parameters.get(pname)
            dtype = m.ostris_orig_dtype if now is None and converted else now.dtype
            grad = False if now is None else now.requires_grad
            values[pname] = nn.Parameter(ft.read().to(dtype), requires_grad=grad)
        if not converted:
            m._parameters.update(values)
            return len(values)
        convert = sys.modules[type(m).__module__].convert_linear_to_ostris
        quantizer = m.ostris_quantizer
        m._buffers.clear()  # the quantizer's, all of them (a Linear has none of its own)
        for attr in ("ostris_quantizer", "ostris_orig_dtype"):
            vars(m).pop(attr, None)
        m.__class__ = self.cls
        rest = {k: v for k, v in m._parameters.items() if k not in values}
        m._parameters.clear()
        m._parameters.update({**values, **rest})
        convert(m, quantizer)
        return len(values)


def structure_only(model: nn.Module, streamable) -> list[Layer]:
    """Puts ``meta`` tensors of the same shapes and dtypes in place of the file tensors of
    ``model``'s streamable layers; returns them with their file tensors."""
    out = []
    for _, m in model.named_modules():
        if not isinstance(m, streamable):
            continue
        params = {p: t for p, t in m._parameters.items() if is_file_tensor(t)}
        for pname, t in params.items():
            empty = torch.empty(t.shape, dtype=t.dtype, device="meta")
            m._parameters[pname] = nn.Parameter(empty, requires_grad=t.requires_grad)
        if params:
            out.append(Layer(m, type(m), params))
    return out


@contextlib.contextmanager
def _meta_stays():
    """``nn.Module.to`` leaves ``meta`` tensors on ``meta`` (cast as asked) and moves the rest:
    ai-toolkit moves each block to the device and back while it quantizes."""
    original = nn.Module.to

    @functools.wraps(original)
    def to(module, *args, **kwargs):
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        aside = []
        for m in module.modules():
            for store in (m._parameters, m._buffers):
                for n, t in list(store.items()):
                    if _meta(t):
                        aside.append((store, n, t))
                        store[n] = None
        try:
            original(module, *args, **kwargs)
        finally:
            for store, n, t in aside:
                if dtype is not None and t.is_floating_point():
                    cast = t.detach().to(dtype=dtype)
                    t = nn.Parameter(cast, t.requires_grad) if isinstance(t, nn.Parameter) else cast
                store[n] = t
        return module

    nn.Module.to = to
    try:
        yield
    finally:
        nn.Module.to = original


# --- the recipe of one quantized module ------------------------------------------------------


@dataclass(eq=False)
class Recipe:
    """How a module's quantization went: ``model_id`` the stored model it attaches from (a
    hit, with its ``layers`` to make where they do not stream), else quantized here for
    ``why`` and, once uploaded, kept as ``stored``."""

    key: str
    call: dict
    model_id: str | None = None
    why: str = ""
    layers: list[Layer] = field(default_factory=list)
    stored: str | None = None

    def make(self, module: nn.Module, keep=frozenset()) -> int:
        """Makes the layers of ``module`` (but those named in ``keep``) that are not made."""
        kept = {id(m) for n, m in module.named_modules() if n in keep}
        inside = {id(m) for m in module.modules()}
        return sum(lay.make() for lay in self.layers if id(lay.module) in inside - kept)

    def fall_back(self, module: nn.Module, why: str):
        """Today's path: every layer made here, and quantized by ai-toolkit, for ``why``."""
        self.make(module)
        self.model_id, self.why = None, why

    def stored_model(self, client, module: nn.Module, chosen) -> str | None:
        """The stored model's id when it holds every tensor the ``chosen`` layers stream as
        the module names them (shape; dtype where the daemon keeps it as it is); else None,
        having fallen back."""
        if self.model_id is None:
            return None
        manifest = _listed(client, self.model_id)
        why = (
            f"the daemon no longer holds model {self.model_id[:12]} (restarted or evicted)"
            if manifest is None
            else _mismatch(manifest, module, chosen)
        )
        if why:
            self.fall_back(module, why)
            return None
        return self.model_id

    def attach_failed(self, client, module: nn.Module, error: BaseException) -> bool:
        """After attaching by the stored model's id failed: falls back (True) when the model
        is gone, else (the failure is not the model's) leaves the error to the caller."""
        if self.model_id is None or _listed(client, self.model_id) is not None:
            return False
        self.fall_back(
            module, f"the daemon lost model {self.model_id[:12]} while attaching ({error})"
        )
        return True

    def keep(self, model_id: str):
        """Records the model uploaded for this recipe for the next job."""
        if self.key and directory() is not None:
            record(self.key, model_id, self.call)
            self.stored = model_id

    def text(self) -> str:
        qtype = self.call.get("qtype")
        if self.model_id is not None:
            return (
                f"{qtype} layers attached from the daemon's stored model {self.model_id[:12]} "
                f"(recipe {self.key[:12]}), none read or quantized by this job"
            )
        out = f"{qtype} quantized by ai-toolkit in this job: {self.why}"
        if self.stored:
            out += (
                f"; kept in the daemon as {self.stored[:12]} for later jobs "
                f"(recipe {self.key[:12]})"
            )
        return out


def of(module: nn.Module) -> Recipe | None:
    return vars(module).get(RECIPE)


def _listed(client, model_id: str):
    return next((m for m in client.list_models().models if m.model_id == model_id), None)


def _mismatch(manifest, module: nn.Module, chosen) -> str | None:
    have = {t.name: t for t in manifest.tensors}
    packs = {}
    for name in chosen:
        m = module.get_submodule(name)
        if packed.form_of(m) is not None:
            packs[name] = packed.Packed.of(m)
        for tname, t in policy.layer_tensors(name, m, packs):
            info = have.get(tname)
            where = f"the stored model {manifest.model_id[:12]}"
            if info is None:
                return f"{where} has no {tname!r}"
            if list(info.shape) != list(t.shape):
                shape = list(info.shape)
                return f"{where} has {tname!r} of shape {shape}, this job's is {list(t.shape)}"
            kept_as_is = info.quantization not in quantize.FORMATS
            dtype = _dtypes.TO_TORCH.get(info.dtype)
            if kept_as_is and dtype != t.dtype:
                return f"{where} has {tname!r} as {dtype}, this job's is {t.dtype}"
    return None


def lookup(k: str, client_of) -> tuple[str | None, str]:
    """(the stored model's id for key ``k``, or None and why not)."""
    if directory() is None:
        return None, f"recipes are off ({DIR_ENV}={os.environ.get(DIR_ENV)!r})"
    model_id = recorded(k)
    if model_id is None:
        return None, f"no job stored recipe {k[:12]} yet"
    try:
        listed = _listed(client_of(), model_id)
    except Exception as e:  # noqa: BLE001 - a daemon that cannot answer: quantize here
        return None, f"the daemon could not be asked for model {model_id[:12]} ({e})"
    if listed is None:
        return None, f"the daemon no longer holds model {model_id[:12]} (restarted or evicted)"
    return model_id, ""


def quantize_once(model: nn.Module, streamable, call: dict, code_file, run, read, client_of):
    """``run()`` (ai-toolkit's quantization of ``model``, whose streamable layers are all file
    tensors): on ``meta`` where a job stored this recipe and the daemon still holds its model,
    else on the layers ``read`` first; the ``Recipe`` goes on ``model``."""
    k = key(model, streamable, call, code_file)
    model_id, why = lookup(k, client_of)
    if model_id is None:
        read(model)
        out = run()
        vars(model)[RECIPE] = Recipe(k, call, why=why)
        return out
    layers = structure_only(model, streamable)
    with _meta_stays():
        out = run()
    for lay in layers:
        vars(lay.module)[policy.STORED] = True
    vars(model)[RECIPE] = Recipe(k, call, model_id=model_id, layers=layers)
    return out
