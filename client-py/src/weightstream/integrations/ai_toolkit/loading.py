"""Loading with ``layer_offloading``: ai-toolkit's loaders, unchanged, kept from putting the
weights that will stream on the device, and the models whose loader attaches nothing attached
by weightstream.

ai-toolkit's loaders (at 27a03a91) move whole models to the device before they attach or
quantize them: FLUX.2's ``load_model`` moves an unquantized transformer there before
``MemoryManager.attach``, ``load_te`` moves the 24 B Mistral there before quantizing it,
``quantize_model`` moves each block there to quantize it, and the FLUX.1 / SDXL loader
(``toolkit/stable_diffusion_model.py``) moves the transformer and the text encoders there and
attaches nothing. On a 24 GB card the first of these is an out-of-memory error. While the
trainer's ``load_model`` runs with ``layer_offloading: true``, ``LoadingPhase``:

- installs a ``PlacementGuard``: ``nn.Module.to`` / ``nn.Module.cuda`` towards an accelerator
  keep the weights and biases of every Linear and Conv2d layer (what weightstream streams) on
  the CPU, cast to the dtype asked for, and move everything else, an adapter's layers (an
  accuracy recovery adapter's ``LoRAModule``) included; the guard remembers where each
  held layer was last sent. Quantization then runs where the weights are, on the CPU, and
  ``MemoryManager.attach`` uploads them from host memory. ``attach`` forgets the layers of the
  module it attaches (it places them: streamed, or moved with the rest);
- after ``load_model`` returns, attaches the transformer / UNet (``layer_offloading_transformer_
  percent``) and each text encoder (``layer_offloading_text_encoder_percent``) that the loader
  left unattached, through the same ``MemoryManager.attach`` (FLUX.1, SDXL, SD3 ...);
- then sends every layer still held (a VAE, a text encoder with percent 0) to where the loader
  last sent it, so a module that is not attached ends where ai-toolkit put it;
- prints one summary line with the time it took, what was attached and by whom, and the peak
  device memory while loading (torch's allocator, and NVML's reading of the whole device where
  ``pynvml`` is installed).

Moves of single tensors (``param.data = param.data.to(device)``) and ``from_pretrained(...,
device_map=...)`` are not seen by the guard; ai-toolkit's loaders at 27a03a91 use neither for
these models.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from weightstream.integrations.ai_toolkit import files
from weightstream.integrations.ai_toolkit.settings import current
from weightstream.torch import filetensor
from weightstream.torch.placeholder import is_placeholder

#: The layers whose weights and biases weightstream streams, held on the CPU while loading.
STREAMABLE = (nn.Linear, nn.Conv2d)


def _is_accelerator(device: torch.device) -> bool:
    return device.type not in ("cpu", "meta")


class PlacementGuard:
    """While installed, ``nn.Module.to`` and ``nn.Module.cuda`` towards an accelerator keep the
    parameters of Linear/Conv2d layers on the CPU (cast as asked) and move the rest; each held
    layer's last destination is remembered until the layer is sent to a non-accelerator device,
    ``release``d (attached), or ``finish`` places it.

    ``is_accelerator`` says which destinations are held (tests pass ``meta``'s)."""

    def __init__(self, is_accelerator=_is_accelerator):
        self.is_accelerator = is_accelerator
        self._pending: dict[int, tuple[weakref.ref, torch.device]] = {}
        self._originals: dict[str, object] | None = None
        self._suspended = 0
        self.held_bytes = 0  # bytes of held layers at their largest, for the summary

    # --- installing -------------------------------------------------------------------------

    def install(self):
        if self._originals is not None:
            return
        self._originals = {"to": nn.Module.to, "cuda": nn.Module.cuda}
        guard = self

        @functools.wraps(nn.Module.to)
        def to(module, *args, **kwargs):
            return guard.to(module, *args, **kwargs)

        @functools.wraps(nn.Module.cuda)
        def cuda(module, device=None):
            return guard.to(module, _cuda_device(device))

        nn.Module.to, nn.Module.cuda = to, cuda

    def uninstall(self):
        if self._originals is not None:
            nn.Module.to, nn.Module.cuda = self._originals["to"], self._originals["cuda"]
            self._originals = None

    @contextlib.contextmanager
    def suspended(self):
        """Moves as torch does, inside (``MemoryManager.attach`` places what it attaches)."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    # --- the guarded move -------------------------------------------------------------------

    def _original_to(self, module, *args, **kwargs):
        return (self._originals or {"to": nn.Module.to})["to"](module, *args, **kwargs)

    def to(self, module: nn.Module, *args, **kwargs):
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if self._suspended or device is None or not self.is_accelerator(device):
            if device is not None:
                self.release(module)  # its layers' last destination is not held
            return self._original_to(module, *args, **kwargs)
        held = _held_layers(module)  # placeholders stay as they are: the daemon holds those
        # The held layers' parameters leave their modules for the time of torch's own move,
        # so that everything else moves exactly as torch moves it.
        aside = [(m, dict(m._parameters)) for m in held]
        for m, params in aside:
            for name in params:
                m._parameters[name] = None
        try:
            self._original_to(module, *args, **kwargs)
        finally:
            for m, params in aside:
                m._parameters.update(params)
        if dtype is not None or memory_format is not None:
            cast = _caster(dtype, non_blocking, memory_format)
            for m in held:
                m._apply(cast, recurse=False)
        for m in held:
            if not all(is_placeholder(p) for p in m.parameters(recurse=False)):
                self._pending[id(m)] = (weakref.ref(m), device)
        self.held_bytes = max(self.held_bytes, self.pending_bytes())
        return module

    # --- what is held -----------------------------------------------------------------------

    def release(self, module: nn.Module):
        """Forgets the layers of ``module`` (attached, or sent off the accelerator)."""
        if not self._pending:
            return
        for m in module.modules():
            self._pending.pop(id(m), None)

    def pending(self) -> list[tuple[nn.Module, torch.device]]:
        out = []
        for key, (ref, device) in list(self._pending.items()):
            m = ref()
            if m is None:
                del self._pending[key]
            else:
                out.append((m, device))
        return out

    def pending_bytes(self) -> int:
        return sum(
            _nbytes(p) if hasattr(p, "__tensor_flatten__") else p.nbytes
            for m, _ in self.pending()
            for p in m.parameters(recurse=False)
            if not is_placeholder(p) and not filetensor.is_file_tensor(p)
        )

    def finish(self) -> int:
        """Sends each layer still held to its last destination; returns how many."""
        placed = self.pending()
        self._pending.clear()
        for m, device in placed:
            self._original_to(m, device)
        return len(placed)


def _is_adapter(m: nn.Module) -> bool:
    """ai-toolkit's LoRA modules (``LoRAModule``, the accuracy recovery adapter's too) hold the
    layer they wrap in ``org_module``."""
    return "org_module" in vars(m)


def _held_layers(module: nn.Module) -> list[nn.Module]:
    """The Linear/Conv2d layers with parameters in ``module``, but an adapter's: weightstream
    streams base weights, never an adapter's, and ai-toolkit puts a network's multiplier where
    its first ``lora_down`` is when it moves the network (``force_to``), so the adapter moves as
    asked (an ARA's layers held on the CPU left its multiplier there, and its forward failed
    on the device)."""
    held, seen, todo = [], set(), [module]
    while todo:
        m = todo.pop()
        if id(m) in seen or _is_adapter(m):
            continue
        seen.add(id(m))
        if isinstance(m, STREAMABLE) and any(True for _ in m.parameters(recurse=False)):
            held.append(m)
        todo.extend(reversed(list(m.children())))
    return held


def _cuda_device(device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _caster(dtype, non_blocking, memory_format):
    """``nn.Module.to``'s conversion without the device: the dtype for floating and complex
    tensors, the memory format for 4- and 5-dimensional ones."""

    def cast(t):
        if is_placeholder(t):
            return t
        to = dtype if dtype is not None and (t.is_floating_point() or t.is_complex()) else None
        if memory_format is not None and t.dim() in (4, 5):
            return t.to(t.device, to, non_blocking, memory_format=memory_format)
        return t.to(t.device, to, non_blocking) if to is not None else t

    return cast


def _nbytes(t) -> int:
    """Bytes of a tensor subclass that keeps its data in inner tensors (torchao's)."""
    names, _ = t.__tensor_flatten__()
    inner = [getattr(t, n) for n in names]
    return sum(
        _nbytes(x) if hasattr(x, "__tensor_flatten__") else x.nbytes
        for x in inner
        if isinstance(x, torch.Tensor)
    )


# --- peak device memory ------------------------------------------------------------------------


class DevicePeak:
    """The device's peak memory over a span: torch's allocator (this process) and, where
    ``pynvml`` (nvidia-ml-py) is installed, NVML's used memory of the whole device, sampled
    every ``interval`` seconds on a thread."""

    def __init__(self, device: torch.device, interval: float = 0.02):
        self.device, self.interval = device, interval
        self.torch_allocated = self.torch_reserved = None
        self.nvml_start = self.nvml_peak = None
        self._stop = threading.Event()
        self._thread = None
        self._nvml = None

    def start(self):
        if self.device.type != "cuda" or not torch.cuda.is_available():
            return
        torch.cuda.reset_peak_memory_stats(self.device)
        self._nvml = _nvml_handle(self.device)
        if self._nvml is not None:
            pynvml, handle = self._nvml
            self.nvml_start = self.nvml_peak = pynvml.nvmlDeviceGetMemoryInfo(handle).used
            self._thread = threading.Thread(
                target=self._sample, name="weightstream-aitk-nvml", daemon=True
            )
            self._thread.start()

    def _sample(self):
        pynvml, handle = self._nvml
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):
                self.nvml_peak = max(self.nvml_peak, pynvml.nvmlDeviceGetMemoryInfo(handle).used)

    def stop(self):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        if self.device.type == "cuda" and torch.cuda.is_available():
            self.torch_allocated = torch.cuda.max_memory_allocated(self.device)
            self.torch_reserved = torch.cuda.max_memory_reserved(self.device)

    def text(self) -> str:
        if self.torch_allocated is None:
            return f"no device memory used ({self.device})"
        out = (
            f"{_gib(self.torch_allocated)} allocated by torch here"
            f" ({_gib(self.torch_reserved)} reserved)"
        )
        if self.nvml_peak is not None:
            out += (
                f", {_gib(self.nvml_peak)} in use on the device (NVML, all processes;"
                f" {_gib(self.nvml_start)} when loading began)"
            )
        return out

    def as_dict(self) -> dict:
        return {
            "torch_max_allocated": self.torch_allocated,
            "torch_max_reserved": self.torch_reserved,
            "nvml_used_at_start": self.nvml_start,
            "nvml_used_peak": self.nvml_peak,
        }


def _nvml_handle(device: torch.device):
    """(pynvml, the device's handle), found by the device's UUID; None without pynvml."""
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        return pynvml, pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
    except Exception:  # noqa: BLE001 - NVML is optional: torch's figures are reported anyway
        return None


def _gib(n) -> str:
    return f"{n / (1 << 30):.2f} GiB"


# --- peak host memory --------------------------------------------------------------------------


def _vm_hwm() -> int | None:
    """This process's peak resident memory (``VmHWM`` of /proc/self/status, Linux), bytes."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    with contextlib.suppress(ImportError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return None


class HostPeak:
    """The host's memory at its peak so far: this process's resident set (``VmHWM``) and the
    daemon's host bytes (its store, all uids: ``GetInfo``'s ``usage.daemon_host_bytes``) at
    the largest ``sample`` saw; the daemon's is sampled at the end of each loading phase and
    at exit, not continuously."""

    def __init__(self):
        self.process = None
        self.daemon = None

    def sample(self, socket: str | None = None):
        self.process = _vm_hwm()
        with contextlib.suppress(Exception):  # a daemon gone is no reason to fail the job
            import weightstream

            used = weightstream.connect(socket).info().usage.daemon_host_bytes
            self.daemon = max(self.daemon or 0, used)

    def text(self) -> str:
        own = "unknown" if self.process is None else _gib(self.process)
        daemon = "unknown" if self.daemon is None else _gib(self.daemon)
        return f"host memory peak: this process {own} (VmHWM), the daemon's store {daemon}"

    def as_dict(self) -> dict:
        return {"process_vm_hwm": self.process, "daemon_host_bytes": self.daemon}


#: The host peak of this process and of its daemon (the launcher prints it at exit too).
HOST = HostPeak()


def exit_line() -> str | None:
    """The launcher's last line: the host's peak over the whole job (loading and training);
    None where nothing was loaded with ``layer_offloading``."""
    if not REPORTS:
        return None
    HOST.sample(current().socket)
    return f"weightstream-aitk: over the job, {HOST.text()}"


# --- the loading phase -----------------------------------------------------------------------


@dataclass
class LoadingReport:
    """What one ``load_model`` under ``layer_offloading`` did (``REPORTS`` keeps them)."""

    model: str
    seconds: float = 0.0
    attached: list[dict] = field(default_factory=list)  # role, module, by, streamed layers
    held_bytes: int = 0
    placed_after: int = 0
    peak: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)  # HostPeak.as_dict() once loaded
    read_from_files: int = 0  # bytes of FileTensors read by the trainer (load_from_files)
    unstreamed: list[str] = field(default_factory=list)  # models read whole, and why

    def line(self, peak: DevicePeak) -> str:
        attached = (
            "; ".join(
                f"{a['role']} {a['module']} ({a['by']}, {a['streamed']} layers streamed"
                + (f", {a['files']}" if a.get("files") else "")
                + (f", {a['recipe']}" if a.get("recipe") else "")
                + ")"
                for a in self.attached
            )
            or "nothing"
        )
        return (
            f"weightstream-aitk: {self.model} loaded in {self.seconds:.1f} s; attached: "
            f"{attached}; held on the CPU while loading: up to {self.held_bytes / 1e9:.2f} GB "
            f"of Linear/Conv2d weights, {self.placed_after} layers placed after loading; "
            f"peak device memory while loading: {peak.text()}; "
            f"{HOST.text()}; read from the files by the trainer: "
            f"{self.read_from_files / 1e9:.2f} GB"
            + (f" ({'; '.join(self.unstreamed)})" if self.unstreamed else "")
        )


#: Every loading phase's report, in order (the benches read them at exit).
REPORTS: list[LoadingReport] = []
#: The guard of the loading phase in progress (None outside one), for ``MemoryManager.attach``.
ACTIVE: PlacementGuard | None = None


@contextlib.contextmanager
def attaching(module: nn.Module):
    """``MemoryManager.attach`` inside a loading phase: the guard lets the module be placed as
    attach places it, and forgets its layers."""
    guard = ACTIVE
    if guard is None:
        yield
        return
    guard.release(module)
    with guard.suspended():
        yield


def _targets(sd) -> list[tuple[str, nn.Module, float]]:
    """The modules to attach after the loader: its transformer / UNet and its text encoders,
    with the job's percents (ai-toolkit attaches where the percent is above 0)."""
    config = sd.model_config
    out = []
    unet = getattr(sd, "unet", None)
    if isinstance(unet, nn.Module):
        out.append(("transformer", unet, float(config.layer_offloading_transformer_percent)))
    encoders = getattr(sd, "text_encoder", None)
    if isinstance(encoders, nn.Module):
        encoders = [encoders]
    for te in encoders or ():
        if isinstance(te, nn.Module):
            out.append(("text encoder", te, float(config.layer_offloading_text_encoder_percent)))
    return out


def _streamed_count(module: nn.Module) -> int:
    manager = vars(module).get("_memory_manager")
    handle = getattr(manager, "handle", None)
    return len(handle.streamed) if handle is not None else 0


def run_load_model(sd, load_model, manager_cls, is_accelerator=_is_accelerator):
    """``sd.load_model()`` with ``layer_offloading`` as the module docstring says, attaching
    with ``manager_cls`` (``MemoryManager``); as it is without it."""
    global ACTIVE
    config = getattr(sd, "model_config", None)
    if not getattr(config, "layer_offloading", False) or ACTIVE is not None:
        return load_model()
    device = torch.device(sd.device_torch)
    report = LoadingReport(model=type(sd).__name__)
    peak = DevicePeak(device)
    guard = PlacementGuard(is_accelerator)
    settings = current()
    started, read_before = time.monotonic(), filetensor.READ.read_bytes
    peak.start()
    guard.install()
    ACTIVE = guard
    try:
        with contextlib.ExitStack() as stack:
            if settings.load_from_files:
                stack.enter_context(files.Interception(load_model).installed())
            result = load_model()
        by_loader = {id(m) for _, m, _ in _targets(sd) if "_memory_manager" in vars(m)}
        for role, module, percent in _targets(sd):
            if id(module) in by_loader:
                report.attached.append(_attached(role, module, "by ai-toolkit's loader"))
            elif percent > 0 and "_memory_manager" not in vars(module) and _has_layers(module):
                manager_cls.attach(module, device, offload_percent=percent)
                report.attached.append(_attached(role, module, "by weightstream-aitk"))
        if settings.load_from_files:
            report.unstreamed = files.unstreamed(_modules_of(sd))
        files.read_left(_modules_of(sd))
        report.held_bytes = guard.held_bytes
        report.placed_after = guard.finish()
    finally:
        ACTIVE = None
        guard.uninstall()
        peak.stop()
    report.seconds = time.monotonic() - started
    report.peak = peak.as_dict()
    report.read_from_files = filetensor.READ.read_bytes - read_before
    HOST.sample(settings.socket)
    report.host = HOST.as_dict()
    REPORTS.append(report)
    print(report.line(peak), flush=True)
    return result


def _attached(role: str, module: nn.Module, by: str) -> dict:
    src = getattr(vars(module).get("_memory_manager"), "files", None)
    recipe = getattr(vars(module).get("_memory_manager"), "recipe", None)
    return {
        "role": role,
        "module": type(module).__name__,
        "by": by,
        "streamed": _streamed_count(module),
        "files": src.text() if src is not None else "",
        "recipe": recipe.text() if recipe is not None else "",
    }


def _modules_of(sd) -> list[nn.Module]:
    """The modules the loader left on ``sd`` and its pipeline (lists of them too)."""
    out = []
    for owner in (sd, getattr(sd, "pipeline", None)):
        for value in vars(owner).values() if owner is not None else ():
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, nn.Module):
                    out.append(item)
    return out


def _has_layers(module: nn.Module) -> bool:
    return any(isinstance(m, STREAMABLE) for m in module.modules())


def hook_model_class(cls, manager_cls):
    """Makes every instance of ``cls`` (ai-toolkit's ``BaseModel`` or ``StableDiffusion``, and
    so every architecture's class) run its ``load_model`` through ``run_load_model`` with
    ``manager_cls`` (``MemoryManager``): the instance's own ``load_model``, whichever subclass
    defines it, is wrapped once, in ``__init__``."""
    if getattr(cls, "_weightstream_loading", False):
        return
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if "load_model" not in vars(self):
            self.load_model = functools.partial(run_load_model, self, self.load_model, manager_cls)

    cls.__init__ = __init__
    cls._weightstream_loading = True
