"""ai-toolkit's ``toolkit.memory_management`` surface, with the frozen weights streamed by
weightstream (read at ostris/ai-toolkit 27a03a91f23eb1b757d5ec2e80ee3e129cfcc350:
``toolkit/memory_management/{__init__,manager,manager_modules}.py``).

ai-toolkit's loaders call ``MemoryManager.attach(transformer, device, offload_percent=...)``
right after loading, before the base model is frozen and before the LoRA network exists;
``toolkit/unloader.py`` calls ``free`` and ``release_cached_memory`` once text embeddings are
cached; ``SDTrainer`` calls the module-level ``sync_grad_transfers()`` after backward; an
attached module's ``to`` moves only what is not managed. Here:

- ``attach`` streams the largest Linear/Conv2d layers that make up ``offload_percent`` of the
  bytes (deterministic: by size, then name) and keeps the rest, and ``ignore_modules``, on the
  device. Every base layer counts although its weights still require grad at that point (the
  loaders freeze later); the layers of a LoRA already in the model (peft's ``lora_A``...,
  ai-toolkit's ``LoRAModule``) never do. A streamed weight that still requires grad when the
  module runs is refused: weightstream streams frozen weights only.
- ai-toolkit's quantized layers (``OstrisLinear``) stream as they are where weightstream knows
  their qtype (``weightstream.torch.packed``: ``uint2..7``, ``convrotint2..8``, ``nvfp4``,
  ``convrot8``, ``convrot4``), their
  accuracy recovery adapters staying on the device; another qtype is refused by name.
- ``to()`` moves and casts what is not streamed; casting streamed weights to another dtype
  than the daemon's copy is refused.
- ``free`` closes the session, drops the daemon's reference and sends the rest to ``meta``.
- ``sync_grad_transfers`` has nothing to wait for: gradients never leave the device.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import warnings
import weakref

import torch
from torch import nn

import weightstream
import weightstream.torch as wst
from weightstream.integrations.ai_toolkit import files, loading, recipes
from weightstream.integrations.ai_toolkit.settings import Settings, current
from weightstream.torch import packed, policy
from weightstream.torch.placeholder import is_placeholder


def sync_grad_transfers():
    """Nothing to wait for: streamed weights are frozen and gradients never leave the device."""


#: The managers of the modules attached and not yet detached or freed, in attach order.
_ATTACHED: list[weakref.ref] = []


class MemoryManager:
    """One attached module: its weightstream ``Handle`` (None when nothing streams) and the
    overrides ``attach`` installed on it."""

    def __init__(self, module: nn.Module, process_device: torch.device, handle):
        self.module = module
        self.process_device = process_device
        self.handle: wst.Handle | None = handle
        self.files: files.Source | None = None  # where the streamed weights came from
        self.recipe: recipes.Recipe | None = None  # how ai-toolkit's quantization went
        self._own_to = vars(module).get("to")  # an instance ``to`` that was there before
        self._check = module.register_forward_pre_hook(self._refuse_trainable)

    sync_grad_transfers = staticmethod(sync_grad_transfers)

    # --- ai-toolkit's entry points --------------------------------------------------------

    @classmethod
    def attach(
        cls,
        module: nn.Module,
        device: torch.device | str,
        offload_percent: float = 1.0,
        ignore_modules: list[nn.Module] | tuple = (),
    ) -> MemoryManager | None:
        """Streams the largest layers making up ``offload_percent`` of the module's base
        Linear/Conv2d bytes; the rest of the module moves to ``device``. A module attached
        already is left as it is (ai-toolkit's behaviour)."""
        if hasattr(module, "_memory_manager"):
            return None
        if not 0.0 <= offload_percent <= 1.0:
            raise ValueError(f"offload_percent={offload_percent} is not between 0 and 1")
        with loading.attaching(module):  # while loading: placed here, not by the guard
            return cls._attach(module, torch.device(device), offload_percent, ignore_modules)

    @classmethod
    def _attach(cls, module, device, offload_percent, ignore_modules):
        ignore = _ignored_names(module, ignore_modules)
        _refuse_ostris_quantized(module, ignore)
        settings = current()
        options = _options(settings, ignore, _budget(settings, offload_percent))
        base = [(n, m) for n, m in _base_layers(module) if n not in ignore]
        with _frozen(base) as was_trainable:
            candidates = policy.select(module, options).streamed
            chosen = files.linear_only(module, _largest_first(candidates, offload_percent))
            handle, src = None, None
            recipe = recipes.of(module)
            if chosen:
                keep = {n for n, _ in candidates} - set(chosen)
                client = weightstream.connect(settings.socket)

                def attach_by(model_id, quantize, retention="connection", names=None):
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", "attach\\(model=", UserWarning)
                        return wst.attach(
                            module,
                            device,
                            dataclasses.replace(options, ignore=ignore | keep, quantize=quantize),
                            vram_budget=_budget(settings, offload_percent),
                            staging_bytes=settings.staging_bytes,
                            client=client,
                            model=model_id,
                            retention=retention,
                            names=names,
                        )

                stored = recipe and recipe.stored_model(client, module, chosen)
                if stored:
                    files.read(module, keep=set(chosen))  # the layers that do not stream
                    try:
                        handle = attach_by(stored, options.quantize)
                    except Exception as e:
                        if not recipe.attach_failed(client, module, e):
                            raise
                if handle is None:
                    src, model_id, quantize = _from_files(client, module, chosen, settings, options)
                    keeps = recipe is not None and recipes.directory() is not None
                    try:
                        names = src.names if model_id is not None else None
                        retention = "cached" if keeps else "connection"
                        handle = attach_by(model_id, quantize, retention, names)
                    except BaseException:
                        if model_id is not None:
                            with contextlib.suppress(Exception):
                                client.release_model(model_id)
                        raise
                    if keeps:
                        recipe.keep(handle.model_id)
            else:
                files.read(module)
                nn.Module.to(module, device)
        if handle is not None:  # placeholders take the trainability of what they replaced
            for name, layer in handle.streamed.items():
                for pname in ("weight", "bias"):
                    p = layer.module._parameters.get(pname)
                    if p is not None and was_trainable.get((name, pname)):
                        p.requires_grad_(True)
        manager = cls(module, device, handle)
        manager.files = src
        manager.recipe = recipe
        module._memory_manager = manager
        module.to = manager.memory_managed_to
        _ATTACHED.append(weakref.ref(manager))
        return manager

    @classmethod
    def attached(cls) -> list[MemoryManager]:
        """The managers of the modules attached now (not detached or freed), in attach order:
        ``trainable: host`` finds among them the session of the model a LoRA trains on."""
        live = [m for m in (ref() for ref in _ATTACHED) if m is not None]
        _ATTACHED[:] = [weakref.ref(m) for m in live]
        return live

    @classmethod
    def detach(cls, module: nn.Module, release: bool = True):
        """Gives the streamed weights back (on the CPU, where ai-toolkit's detach leaves the
        module), moves the rest there, puts ``to`` back and closes the session; with
        ``release`` (the default) also drops this session's reference to the daemon's copy."""
        manager = getattr(module, "_memory_manager", None)
        if manager is None:
            return
        manager._uninstall()
        if manager.handle is not None:
            trainable = {n for n, p in module.named_parameters() if p.requires_grad}
            manager.handle.detach(release=release and manager._owns_model(), device="cpu")
            for n, p in module.named_parameters():
                if n in trainable:
                    p.requires_grad_(True)
        nn.Module.to(module, "cpu")
        torch.cuda.empty_cache()

    @classmethod
    def free(cls, module: nn.Module):
        """Destroys the module's weights: closes its session without copying anything back,
        drops the daemon's reference (the daemon frees its copy when no other session holds
        it) and moves everything else to ``meta``. Also for a module never attached."""
        manager = getattr(module, "_memory_manager", None)
        if manager is not None:
            manager._uninstall()
            if manager.handle is not None:
                manager.handle.close(release=manager._owns_model())
        nn.Module.to(module, "meta")  # placeholders become meta tensors too
        torch.cuda.empty_cache()

    @classmethod
    def release_cached_memory(cls):
        """Gives freed memory back to the system: Python's garbage, torch's device cache, and
        the C allocator's free arenas (the trainer pinned nothing itself: the daemon holds the
        pinned copies)."""
        gc.collect()
        torch.cuda.empty_cache()
        with contextlib.suppress(OSError, AttributeError):  # glibc only
            ctypes.CDLL(None).malloc_trim(0)

    # --- the attached module ----------------------------------------------------------------

    def memory_managed_to(self, *args, **kwargs):
        """``module.to(...)`` of an attached module: moves and casts everything that is not
        streamed; streamed weights stay in the daemon, and a dtype other than their copy's
        is refused."""
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None:
            self._refuse_cast(dtype)

        def convert(t):
            if is_placeholder(t):
                return t
            cast = dtype if t.is_floating_point() or t.is_complex() else None
            if memory_format is not None and t.dim() in (4, 5):
                return t.to(device, cast, non_blocking, memory_format=memory_format)
            return t.to(device, cast, non_blocking)

        self.module._apply(convert)
        return self.module

    def _refuse_cast(self, dtype: torch.dtype):
        streamed = [
            p
            for _, p in self.module.named_parameters()
            if is_placeholder(p) and p.is_floating_point() and p.dtype != dtype
        ]
        if streamed:
            p = streamed[0]
            raise ValueError(
                f"{type(self.module).__name__}.to({dtype}): {len(streamed)} streamed tensors "
                f"are {p.dtype} in the daemon (e.g. {p.streamed_name!r}), which streams the "
                f"dtype it was given: cast the model to {dtype} before MemoryManager.attach "
                "(in ai-toolkit, the loader's dtype and train.dtype should agree)"
            )

    def _refuse_trainable(self, module, args):
        if self.handle is None:
            return
        for name, layer in self.handle.streamed.items():
            w = layer.module._parameters.get("weight")
            if w is not None and w.requires_grad:
                raise RuntimeError(
                    f"{name!r} is streamed by weightstream, which streams frozen weights only, "
                    "but its weight requires grad: freeze the base model "
                    "(model.requires_grad_(False)) to train a LoRA, or keep the layers you "
                    "train on the device (ignore_modules, or layer_offloading off)"
                )

    def _owns_model(self) -> bool:
        """Whether this job's reference holds the daemon's model: not one it attached from a
        stored recipe (it took none) or kept for later jobs (the cache's, not to give back)."""
        r = self.recipe
        return r is None or (r.model_id is None and r.stored is None)

    def _uninstall(self):
        _ATTACHED[:] = [ref for ref in _ATTACHED if ref() not in (None, self)]
        self._check.remove()
        if self._own_to is not None:
            self.module.to = self._own_to
        else:
            vars(self.module).pop("to", None)
        vars(self.module).pop("_memory_manager", None)


# --- choosing the layers --------------------------------------------------------------------


def _options(s: Settings, ignore: set[str], budget) -> wst.StreamOptions:
    return wst.StreamOptions(
        min_bytes=s.min_bytes,
        group_by=s.group_by,
        lookahead=s.lookahead,
        ignore=ignore,
        quantize=s.quantize,
        dequantize=s.dequantize,
        early_release=s.early_release,
        compute=s.compute,
        grad_compute=s.grad_compute,
        rotation=s.rotation,
        sample_vram_budget=_sample_budget(s, budget),
        coding=s.coding,
    )


def _sample_budget(settings: Settings, budget):
    """The sampling budget: the one set (``none``: none), else ``"auto"`` where the session's
    ``budget`` is ``"auto"`` too and the LoRA trains on the device, else none."""
    chosen = settings.sample_vram_budget
    if chosen is None:
        return "auto" if budget == "auto" and settings.trainable == "device" else None
    return None if chosen == "none" else chosen


def _from_files(client, module, chosen, settings: Settings, options: wst.StreamOptions):
    """(the ``files.Source`` of the layers ``chosen`` or None, the id of the daemon's model of
    their files or None, the ``quantize`` option to attach with). Every ``FileTensor`` that
    does not stream from the daemon's model is read here."""
    src = files.source(module, chosen, settings)
    if src is None:
        return None, None, options.quantize
    quantize = src.quantize if src.quantize in (None, "fp8") else options.quantize
    if src.why:  # uploaded as usual, quantized as the loader asked the daemon to
        files.read(module)
        return src, None, quantize
    files.read(module, keep=set(chosen))
    return src, files.load(client, module, src), quantize


def _ignored_names(root: nn.Module, modules) -> set[str]:
    """The names of ``ignore_modules`` and of everything inside them."""
    ids = {id(m) for m in modules}
    tops = [n for n, m in root.named_modules() if id(m) in ids]
    return {
        n
        for n, _ in root.named_modules()
        if any(t in ("", n) or n.startswith(f"{t}.") for t in tops)
    }


def _adapter_layers(root: nn.Module) -> set[str]:
    """Layers that belong to a LoRA inside the module: peft's tuner layers list the attributes
    that hold their adapters in ``adapter_layer_names`` (``lora_A``, ``lora_B``, ...);
    ai-toolkit's and kohya's LoRA modules keep the layer they wrap in ``org_module``, so their
    own layers (``lora_down``, ``lora_up``) are the adapter."""
    out = set()
    for name, m in root.named_modules():
        prefix = f"{name}." if name else ""
        for attr in getattr(m, "adapter_layer_names", ()) or ():
            sub = getattr(m, attr, None)
            if isinstance(sub, nn.Module):
                out.update(prefix + attr + (f".{n}" if n else "") for n, _ in sub.named_modules())
        if "org_module" in vars(m):
            out.update(prefix + n for n, _ in m.named_modules() if n)
    return out


def _base_layers(root: nn.Module) -> list[tuple[str, nn.Module]]:
    adapters = _adapter_layers(root)
    return [
        (n, m)
        for n, m in root.named_modules()
        if isinstance(m, (nn.Linear, nn.Conv2d)) and n not in adapters
    ]


@contextlib.contextmanager
def _frozen(layers):
    """Treats the base layers as frozen while weightstream chooses and attaches them (the
    loaders freeze the model after attach); yields which (layer, parameter) required grad and
    puts that back on whatever parameter is there afterwards."""
    was = {}
    for name, m in layers:
        for pname, p in m.named_parameters(recurse=False):
            if p.requires_grad:
                was[(name, pname)] = True
                p.requires_grad_(False)
    try:
        yield was
    finally:
        for name, m in layers:
            for pname, p in m.named_parameters(recurse=False):
                if was.get((name, pname)) and not is_placeholder(p):
                    p.requires_grad_(True)


def _budget(settings, offload_percent: float):
    """The session's budget: the one set, else ``"auto"`` when ai-toolkit offloads every
    layer (``offload_percent`` 1, its default), else weightstream's fixed default (None): a
    job that chose a percent keeps ai-toolkit's meaning of it, that fraction streamed."""
    if settings.vram_budget is not None:
        return settings.vram_budget
    return "auto" if offload_percent >= 1.0 else None


def _largest_first(candidates, percent: float) -> list[str]:
    """The largest layers (by weight and bias bytes, then name) until they hold ``percent``
    of the candidates' bytes."""
    packs = {n: packed.Packed.of(m) for n, m in candidates if packed.form_of(m) is not None}
    sized = sorted(
        ((n, sum(t.nbytes for _, t in policy.layer_tensors(n, m, packs))) for n, m in candidates),
        key=lambda x: (-x[1], x[0]),
    )
    left, chosen = percent * sum(size for _, size in sized), []
    for name, size in sized:
        if left <= 0:
            break
        chosen.append(name)
        left -= size
    return chosen


def _refuse_ostris_quantized(root: nn.Module, ignore: set[str]):
    """ai-toolkit's own quantized layers (``OstrisLinear``) stream as they are where
    ``packed`` knows their qtype; the others are refused by ``packed.refusal``, naming the
    qtype. A layer marked ``is_ostris_quantized`` of another class holds bytes that are not
    the weight's either."""
    for name, m in root.named_modules():
        if name in ignore:
            continue
        if packed.is_ostris_linear(m):
            why = packed.refusal(name, m)
            if why is not None:
                raise policy.QuantizedWeight(why)
        elif getattr(m, "is_ostris_quantized", False):
            raise policy.QuantizedWeight(
                f"cannot stream {name!r}: it is ai-toolkit's {type(m).__name__}, quantized by "
                "ai-toolkit (its bytes are not the weight's); load the model unquantized "
                "(model.quantize: false; weightstream's quantize: fp8 streams it in 8 bits), "
                "or pass it in ignore_modules"
            )
