"""The optimizer of ``trainable: host``: ai-toolkit's own LoRA training, unchanged, with the
LoRA's weights and its optimizer's state in host memory (``weightstream.torch.host``:
``HostPlan`` and ``HostAdamW``).

ai-toolkit's calls, as ``jobs/process/BaseSDTrainProcess.py`` ``run`` makes them at
ostris/ai-toolkit 27a03a91, and what weightstream does at each:

1. The network: ``LoRASpecialNetwork(...)``, ``force_to(device, float32)``, ``apply_to``,
   ``prepare_grad_etc``, ``prepare_optimizer_params`` (the parameter groups, in
   ``self.params``); when resuming, ``network.load_weights`` of the last saved LoRA; with
   ``network.layer_offloading``, ``MemoryManager.attach(network)`` (nothing of a LoRA streams
   there: weightstream streams frozen weights).
2. ``get_optimizer(self.params, optimizer_type, learning_rate=train.lr,
   optimizer_params=train.optimizer_params)``: **here**. The type and parameters are checked
   (``resolve_optimizer``), then every parameter given is checked to be the weight of one of
   the network's ``nn.Linear`` layers (``lora_down``/``lora_up``), all before anything moves;
   then ``stream_trainable`` takes the network's layers into host memory (the daemon's, held
   for the session of the model the LoRA trains on, where the daemon offers it; else the
   trainer's own), grouped by the base model's blocks, and the optimizer returned is a
   ``ToolkitHostAdamW`` (``HostAdamW`` that clips each parameter group as ai-toolkit does).
   The LoRA layers get ``_memory_management_device``: ai-toolkit's
   ``_update_torch_multiplier`` places the multiplier there rather than on the CPU.
3. ``optimizer.pt`` in the save folder, if there, goes to ``load_state_dict``
   (``torch.load(..., weights_only=True)``): ``HostAdamW``'s state (master weights, moments,
   a pending delayed update). A file from another optimizer is refused and ai-toolkit prints
   the error and starts with fresh moments, as it does for any file it cannot load.
4. ``accelerator.prepare(optimizer)``: accelerate's device placement would copy the whole
   state to the GPU and back; the launcher prepares a ``HostAdamW`` without it. One process
   only: a job that accelerate runs in several is refused at step 2 (the host gradients are
   not reduced across processes).
   ``accelerator.prepare(network)`` moves the network: ``stream_trainable``'s layers keep
   their weights in host memory through any ``.to()``.
5. Each step (``SDTrainer.hook_train_loop``): ``zero_grad``, forward and backward (the
   gradients go to host memory as backward makes them), ``sync_grad_transfers``,
   ``accelerator.clip_grad_norm_`` on each group (the parameters' ``.grad`` stay ``None``:
   it does nothing; the optimizer clips the host gradients of each group to
   ``train.max_grad_norm`` instead), ``step``, ``zero_grad``.
6. ``save`` (every ``save_every`` steps and at the end): the network's ``state_dict`` is the
   host working weights; ``optimizer.pt`` is ``HostAdamW.state_dict()``. ai-toolkit's
   ``save_weights`` copies the LoRA in ``save.dtype`` (``get_state_dict``'s clones) and
   serializes that copy once more in memory to hash it (``add_model_hash_to_meta``): twice
   the LoRA in that dtype, on top of everything else, at every save. At step 2 the launcher
   warns when the host's available memory is short of that (``save_room_warning``). ``sample``: the
   LoRA's weights are copied to the device as the layers run. Before either, the launcher
   applies a pending delayed update (``flush``: what is saved or sampled at step N is the
   LoRA after N steps); after either, it drops the device copies (an EMA swapped in and out
   writes the host weights).
7. When ``run`` returns or raises, the layers get their weights back as ordinary CPU
   parameters and the host memory is freed.

The fp32 master (``stream_trainable``'s ``master``): ``trainable_master`` (env
``WEIGHTSTREAM_TRAINABLE_MASTER``, ``fp32`` or ``none``) or, unset, ``master_for``: ``none``
where the network's weights are bf16 or f16, ``fp32`` otherwise. ai-toolkit's optimizers
(``torch.optim.AdamW``, bitsandbytes' ``AdamW8bit``) update the network's parameters in place
and keep no fp32 copy of their own; at 27a03a91 ``run`` makes the network fp32
(``force_to(device, dtype=torch.float32)``), whose weights are their own master either way, so
the default changes nothing there and saves 4 bytes per parameter where a network is bf16 (a
fork or job that casts it) without changing what ai-toolkit itself would compute.

Supported optimizers (``SUPPORTED``): ai-toolkit's ``adamw`` (``torch.optim.AdamW``) and
``adamw8bit`` (bitsandbytes) as ``HostAdamW``'s ``adamw`` and ``adamw8bit``; its own
``adamw8`` (``toolkit.optimizers.adam8bit``, decoupled decay) as ``adamw8bit``; ``adam``,
``adam8bit`` and ``adam8`` without weight decay (Adam is AdamW then). ``eps`` is 1e-6, as
ai-toolkit's ``get_optimizer`` passes it; weight decay defaults to the default of the
optimizer ai-toolkit would have made.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from weightstream.integrations.ai_toolkit.manager import MemoryManager
from weightstream.integrations.ai_toolkit.settings import Settings
from weightstream.sizes import size_text
from weightstream.torch import policy
from weightstream.torch.host import HostAdamW, HostPlan, Trainable, TrainableError, clip_grads_


@dataclass(frozen=True)
class Optimizer:
    """How an ai-toolkit optimizer type is run in host memory."""

    kind: str  # HostAdamW's kind
    weight_decay: float  # the default of the optimizer ai-toolkit makes for this type
    decoupled: bool  # False: Adam's weight decay (an L2 term), supported only at 0
    made_by: str  # what ai-toolkit makes for it, for messages


#: ai-toolkit's optimizer types (``toolkit/optimizer.py`` ``get_optimizer``, lower-cased) that
#: run in host memory.
SUPPORTED = {
    "adamw": Optimizer("adamw", 1e-2, True, "torch.optim.AdamW"),
    "adamw8bit": Optimizer("adamw8bit", 1e-2, True, "bitsandbytes.optim.AdamW8bit"),
    "adamw8": Optimizer("adamw8bit", 0.0, True, "toolkit.optimizers.adam8bit.Adam8bit"),
    "adam": Optimizer("adamw", 0.0, False, "torch.optim.Adam"),
    "adam8bit": Optimizer("adamw8bit", 0.0, False, "bitsandbytes.optim.Adam8bit"),
    "adam8": Optimizer("adamw8bit", 0.0, False, "toolkit.optimizers.adam8bit.Adam8bit"),
}
#: The ``eps`` ai-toolkit's ``get_optimizer`` gives each of them.
EPS = 1e-6
#: ``optimizer_params`` that only choose the device kernel of ai-toolkit's optimizer.
KERNEL_CHOICES = ("foreach", "fused", "capturable")
#: ``optimizer_params`` that change nothing at their default (false).
OFF_BY_DEFAULT = ("amsgrad", "maximize", "differentiable")


@dataclass(frozen=True)
class Hyper:
    kind: str
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


def supported_names() -> str:
    return (
        "adamw, adamw8bit (ai-toolkit's aliases: adamw8; adam, adam8bit, adam8 without "
        "weight_decay)"
    )


def resolve_optimizer(
    optimizer_type: str, learning_rate, optimizer_params: Mapping | None
) -> Hyper:
    """``HostAdamW``'s kind and hyper-parameters for ai-toolkit's ``optimizer``,
    ``lr`` and ``optimizer_params``; ``TrainableError`` naming the setting otherwise."""
    name = str(optimizer_type).lower()
    spec = SUPPORTED.get(name)
    if spec is None:
        raise TrainableError(
            f"train.optimizer: {optimizer_type!r} is not supported with weightstream's "
            f"trainable: host: use one of {supported_names()}, or trainable: device"
        )
    params = dict(optimizer_params or {})
    for key in params:
        if key in ("betas", "weight_decay", "eps") or key in KERNEL_CHOICES:
            continue
        if key in OFF_BY_DEFAULT and not params[key]:
            continue
        raise TrainableError(
            f"train.optimizer_params.{key}: {params[key]!r} is not supported with "
            "trainable: host (it takes betas, weight_decay and eps)"
        )
    lr = _number("train.lr", learning_rate)
    if not lr >= 0:
        raise TrainableError(f"train.lr: {learning_rate!r}: expected 0 or more")
    betas = params.get("betas", (0.9, 0.999))
    if (
        not isinstance(betas, (list, tuple))
        or len(betas) != 2
        or not all(0.0 <= _number("train.optimizer_params.betas", b) < 1.0 for b in betas)
    ):
        raise TrainableError(
            f"train.optimizer_params.betas: {betas!r}: expected two numbers in [0, 1)"
        )
    eps = _number("train.optimizer_params.eps", params.get("eps", EPS))
    if not eps > 0:
        raise TrainableError(f"train.optimizer_params.eps: {eps!r}: expected more than 0")
    wd = _number(
        "train.optimizer_params.weight_decay", params.get("weight_decay", spec.weight_decay)
    )
    if not wd >= 0:
        raise TrainableError(f"train.optimizer_params.weight_decay: {wd!r}: expected 0 or more")
    if wd != 0 and not spec.decoupled:
        raise TrainableError(
            f"train.optimizer_params.weight_decay: {wd!r} with {name!r} ({spec.made_by}) adds "
            "an L2 term to the gradient, which trainable: host does not run: use adamw (or "
            "adamw8bit) for decoupled weight decay, or weight_decay 0"
        )
    return Hyper(spec.kind, lr, (float(betas[0]), float(betas[1])), eps, wd)


def _number(what: str, value) -> float:
    if isinstance(value, bool):
        raise TrainableError(f"{what}: {value!r}: expected a number")
    try:
        n = float(value)
    except (TypeError, ValueError):
        raise TrainableError(f"{what}: {value!r}: expected a number") from None
    if math.isnan(n) or math.isinf(n):
        raise TrainableError(f"{what}: {value!r}: expected a finite number")
    return n


# --- the optimizer -------------------------------------------------------------------------


class ToolkitHostAdamW(HostAdamW):
    """``HostAdamW`` as ai-toolkit's trainer uses an optimizer: ``max_grad_norm`` clips each
    parameter group on its own (``SDTrainer`` clips ``self.params[i]['params']`` one group at a
    time), before the step."""

    def __init__(self, params, *args, max_grad_norm: float | None = None, **kwargs):
        super().__init__(params, *args, max_grad_norm=None, **kwargs)
        self.group_max_grad_norm = max_grad_norm

    def _clip(self, taken):
        if self.group_max_grad_norm is None:
            return
        for gi in range(len(self.param_groups)):
            grads = [s.grad for s, i in taken if i == gi]
            if grads:
                clip_grads_(grads, self.group_max_grad_norm)


def master_for(layers, setting: str | None) -> str:
    """``stream_trainable``'s ``master`` for the network's ``(name, nn.Linear)`` layers: the
    setting where given, else ``"none"`` where a weight is bf16 or f16 (ai-toolkit's own
    optimizer would update those parameters in place, with no fp32 copy), ``"fp32"``
    otherwise."""
    if setting is not None:
        return setting
    narrow = any(m.weight.dtype in (torch.bfloat16, torch.float16) for _, m in layers)
    return "none" if narrow else "fp32"


def host_optimizer(
    params,
    optimizer_type: str,
    learning_rate,
    optimizer_params: Mapping | None,
    *,
    network: nn.Module | None,
    max_grad_norm: float | None,
    settings: Settings,
) -> ToolkitHostAdamW:
    """What ``get_optimizer`` returns under ``trainable: host`` (``settings``: the launcher's):
    ``network``'s LoRA layers taken into host memory and a ``ToolkitHostAdamW`` on ``params``
    (ai-toolkit's parameter groups, or a list of parameters). Every check is made before
    anything moves: ai-toolkit's own here, then ``HostPlan``'s (its layers, its optimizer and
    master, its size against the daemon's host memory), then ``HostPlan.apply`` moves them."""
    hyper = resolve_optimizer(optimizer_type, learning_rate, optimizer_params)
    if network is None:
        raise TrainableError(
            "weightstream's trainable: host trains a LoRA network (the job's network: section), "
            "and this job has none: use trainable: device"
        )
    if (
        hyper.kind == "adamw8bit"
        and importlib.util.find_spec("weightstream.torch.host.adamw8") is None
    ):
        raise TrainableError(
            f"train.optimizer: {optimizer_type!r} runs as HostAdamW's adamw8bit, which this "
            "weightstream lacks (weightstream.torch.host.adamw8): use adamw"
        )
    groups = _groups(params)
    plan = HostPlan(network)  # refuses Conv2d LoRA layers and trainable biases
    streamable = {id(w) for w in plan.weights}
    names = {id(p): n for n, p in network.named_parameters()}
    stray = [p for g in groups for p in g["params"] if id(p) not in streamable]
    if stray:
        shown = [names.get(id(p), f"a {list(p.shape)} tensor outside the network") for p in stray]
        raise TrainableError(
            f"{len(stray)} of the parameters ai-toolkit gives its optimizer are not weights of "
            f"the network's nn.Linear layers (e.g. {', '.join(map(repr, shown[:4]))}): "
            "trainable: host holds a LoRA's lora_down/lora_up weights only (not DoRA, LoKr, "
            "embeddings or adapters): use trainable: device for this job"
        )
    if not plan.layers:
        raise TrainableError("the network has no trainable nn.Linear layers")
    device = plan.weights[0].device
    handle, model = _session_for(network)
    plan.check(
        handle,
        device=device,
        group_by=_base_blocks(network, model),
        optimizer=hyper.kind,
        master=master_for(plan.layers, settings.trainable_master),
    )
    trainable = plan.apply()
    try:
        for _, m in plan.layers:
            m._memory_management_device = device
        opt = ToolkitHostAdamW(
            groups,
            lr=hyper.lr,
            betas=hyper.betas,
            eps=hyper.eps,
            weight_decay=hyper.weight_decay,
            trainable=trainable,
            kind=hyper.kind,
            max_grad_norm=max_grad_norm,
            delay=settings.trainable_delay,
        )
    except BaseException:
        release(trainable)
        raise
    if trainable.storage.session is not None:
        where = f"held by the daemon for the session of {type(model).__name__}"
    elif model is not None:
        where = f"the trainer's own: the session of {type(model).__name__} offers none"
    else:
        where = "the trainer's own: no attached model holds the layers the LoRA wraps"
    print(
        f"weightstream-aitk: trainable: host: {len(plan.layers)} LoRA layers and their "
        f"{hyper.kind} state in {trainable.host_bytes / 1e9:.2f} GB of host memory ({where}); "
        f"computing on {device}; delayed update {'on' if settings.trainable_delay else 'off'}; "
        f"master {trainable.master}",
        flush=True,
    )
    return opt


def _groups(params) -> list[dict]:
    """ai-toolkit's ``params``: parameter groups (dicts), or parameters."""
    params = list(params)
    if params and isinstance(params[0], Mapping):
        return [dict(g, params=list(g["params"])) for g in params]
    return [{"params": params}]


def _session_for(network: nn.Module):
    """The handle (and module) of the attached model whose layers the LoRA wraps, when its
    session can hold host memory (``Session.alloc_state_region``); else (None, that module or
    None): the trainer's own memory."""
    wrapped = {id(org) for org in _wrapped(network).values()}
    best, best_count = None, 0
    for manager in MemoryManager.attached():
        count = sum(1 for m in manager.module.modules() if id(m) in wrapped)
        if count > best_count:
            best, best_count = manager, count
    if best is None:
        return None, None
    handle = best.handle
    if handle is None or not hasattr(handle.session, "alloc_state_region"):
        return None, best.module
    return handle, best.module


def _wrapped(network: nn.Module) -> dict[str, nn.Module]:
    """LoRA module name -> the layer it wraps (ai-toolkit's ``org_module``, kept in a list)."""
    out = {}
    for name, m in network.named_modules():
        org = vars(m).get("org_module")
        if isinstance(org, (list, tuple)) and org and isinstance(org[0], nn.Module):
            out[name] = org[0]
    return out


def _base_blocks(network: nn.Module, model: nn.Module | None):
    """Groups the LoRA's layers by the block of the model that their wrapped layer is in
    (``transformer_blocks.3``), so that one block's LoRA weights travel together; layers whose
    base is not found, by the network's own blocks."""
    wrapped = _wrapped(network)
    base_names = {id(m): n for n, m in model.named_modules()} if model is not None else {}

    def key(name: str) -> str:
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            org = wrapped.get(".".join(parts[:i]))
            if org is not None and id(org) in base_names:
                return "model:" + policy.block_of(model, base_names[id(org)])
        return "network:" + policy.block_of(network, name)

    return key


def release(trainable: Trainable):
    """Gives the layers their weights back as ordinary CPU parameters and frees the host
    memory."""
    for s in trainable.slots:
        vars(s.module).pop("_memory_management_device", None)
    trainable.close("cpu")


# --- the hooks on ai-toolkit's trainer ------------------------------------------------------

#: The trainer processes whose ``run`` is in progress (innermost last).
RUNNING: list = []
#: The attribute of a process that holds its ``ToolkitHostAdamW``.
ATTR = "_weightstream_host_optimizer"


def hook_trainer_module(module, settings: Callable[[], Settings]):
    """Hooks ``jobs.process.BaseSDTrainProcess`` once it has run: its ``get_optimizer`` (the
    name it imported from ``toolkit.optimizer``) and ``BaseSDTrainProcess``'s ``run``, ``save``
    and ``sample``. Each does as ai-toolkit does unless ``trainable: host`` (``settings()``:
    the launcher's settings, read when ai-toolkit calls), and ``sample`` with a
    ``sample_vram_budget`` runs inside each attached session's ``Handle.sampling()``; a
    trainer module without them is an error under ``trainable: host`` only."""
    cls = getattr(module, "BaseSDTrainProcess", None)
    original = getattr(module, "get_optimizer", None)
    if cls is None or original is None:
        if settings().trainable != "host":
            return
        raise ImportError(
            f"{module.__name__} has no {'BaseSDTrainProcess' if cls is None else 'get_optimizer'}:"
            " weightstream-aitk knows ai-toolkit's trainer as of ostris/ai-toolkit 27a03a91",
            name=module.__name__,
        )
    if getattr(cls, "_weightstream_trainable", False):
        return

    @functools.wraps(original)
    def hooked(params, optimizer_type="adam", learning_rate=1e-6, optimizer_params=None):
        return get_optimizer(
            original, settings(), params, optimizer_type, learning_rate, optimizer_params
        )

    module.get_optimizer = hooked
    cls.run = _run(cls.run)
    cls.save = _synced(cls.save)
    cls.sample = _sampling(_synced(cls.sample))
    cls._weightstream_trainable = True


def get_optimizer(
    original,
    settings: Settings,
    params,
    optimizer_type="adam",
    learning_rate=1e-6,
    optimizer_params=None,
):
    """ai-toolkit's ``get_optimizer`` (``original``), or under ``trainable: host`` (in
    ``settings``) the optimizer of ``host_optimizer`` for the network of the trainer running."""
    if settings.trainable != "host":
        return original(params, optimizer_type, learning_rate, optimizer_params)
    if not RUNNING:
        raise TrainableError(
            "weightstream's trainable: host: get_optimizer was called outside "
            "BaseSDTrainProcess.run, where the network and the train config are"
        )
    process = RUNNING[-1]
    processes = getattr(getattr(process, "accelerator", None), "num_processes", 1)
    if processes != 1:
        raise TrainableError(
            f"weightstream's trainable: host trains in one process, and this job runs in "
            f"{processes} (accelerate's num_processes): the gradients in host memory are not "
            "reduced across them; use trainable: device"
        )
    train = getattr(process, "train_config", None)
    opt = host_optimizer(
        params,
        optimizer_type,
        learning_rate,
        optimizer_params,
        network=getattr(process, "network", None),
        max_grad_norm=getattr(train, "max_grad_norm", None),
        settings=settings,
    )
    numel = sum(slot.numel for slot in opt.trainable.slots)
    warning = save_room_warning(numel, _save_dtype(process), _host_available())
    if warning:
        print(warning, flush=True)
    previous = vars(process).get(ATTR)
    if previous is not None:
        release(previous.trainable)
    setattr(process, ATTR, opt)
    _keep_state_on_host(getattr(process, "accelerator", None))
    return opt


def save_room_warning(numel: int, save_dtype: torch.dtype | None, available: int | None):
    """The launcher's warning when ai-toolkit's save of a LoRA of ``numel`` parameters in
    ``save_dtype`` needs more host memory than the ``available`` bytes (its copy of the LoRA
    in that dtype and the same bytes serialized again to hash them), or ``None``: nothing to
    say, or nothing known."""
    if save_dtype is None or available is None:
        return None
    copy = numel * save_dtype.itemsize
    if 2 * copy <= available:
        return None
    name = str(save_dtype).removeprefix("torch.")
    smaller = (
        " Set save.dtype: bf16 (half of it), train a lower rank, or free host memory."
        if save_dtype.itemsize > 2
        else " Train a lower rank or free host memory."
    )
    return (
        f"weightstream-aitk: warning: ai-toolkit's save of this LoRA needs about "
        f"{2 * copy / 1e9:.1f} GB more host memory (its copy of the {numel / 1e9:.2f} B "
        f"parameters in {name}, {copy / 1e9:.1f} GB, and that copy serialized again to hash "
        f"it), and the host has {available / 1e9:.1f} GB available now: the host's "
        f"out-of-memory killer may end the job at its first save.{smaller}"
    )


def _save_dtype(process) -> torch.dtype | None:
    """ai-toolkit's ``save.dtype`` of ``process`` as torch's dtype (its own
    ``get_torch_dtype``), or ``None`` where the process has none."""
    name = getattr(getattr(process, "save_config", None), "dtype", None)
    if name is None:
        return None
    if isinstance(name, torch.dtype):
        return name
    try:
        from toolkit.train_tools import get_torch_dtype
    except ImportError:
        return None
    dtype = get_torch_dtype(name)
    return dtype if isinstance(dtype, torch.dtype) else None


def _host_available() -> int | None:
    """The host's ``MemAvailable``, bytes (``None`` where /proc/meminfo does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _run(run):
    @functools.wraps(run)
    def wrapper(self, *args, **kwargs):
        RUNNING.append(self)
        try:
            result = run(self, *args, **kwargs)
        except BaseException:
            with contextlib.suppress(Exception):  # the trainer's error is the one to see
                _end(self)
            raise
        _end(self)
        return result

    return wrapper


def _end(process):
    RUNNING.remove(process)
    opt = vars(process).pop(ATTR, None)
    if opt is not None:
        release(opt.trainable)


def _synced(method):
    """``save``/``sample``: the pending delayed update applied before, the device copies of the
    LoRA's weights dropped after."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        opt = vars(self).get(ATTR)
        if opt is None:
            return method(self, *args, **kwargs)
        opt.flush()
        try:
            return method(self, *args, **kwargs)
        finally:
            opt.trainable.invalidate()

    return wrapper


def _sampling(method):
    """``sample``: the attached modules' sessions grown to their ``sample_vram_budget`` while
    ai-toolkit samples (``Handle.sampling()``, which changes nothing without one), given back
    after; with ``auto``, only the session that streams the most bytes (the transformer: a
    text encoder encodes a prompt once a sample, and each ``auto`` session would take its
    share of what the trainer has free); one line on stdout once it returns
    (``sample_summary``)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        managers = [m for m in MemoryManager.attached() if m.handle is not None]
        managers.sort(key=lambda m: -sum(g.nbytes for g in m.handle.session.groups))
        before = [m.handle.stats() for m in managers]
        start = time.monotonic()
        with contextlib.ExitStack() as stack:
            for i, manager in enumerate(managers):
                if i == 0 or manager.handle.options.sample_vram_budget != "auto":
                    stack.enter_context(manager.handle.sampling())
            budgets = [m.handle.vram_budget for m in managers]
            result = method(self, *args, **kwargs)
        if managers:
            after = [m.handle.stats() for m in managers]
            names = [type(m.module).__name__ for m in managers]
            seconds = time.monotonic() - start
            print(sample_summary(seconds, names, budgets, before, after), flush=True)
        return result

    return wrapper


def sample_summary(seconds: float, names, budgets, before, after) -> str:
    """One line on an ai-toolkit ``sample``: per attached module (``names``), the sampling
    passes it ran, how many of their acquires were in flight already, how long the device
    waited for weights, and the session's budget while sampling (``budgets``, bytes); with
    ``sample_vram_budget: auto``, what the trainer took over its first sample (``stats()``
    ``before`` and ``after`` the call)."""
    parts = []
    for name, budget, b, a in zip(names, budgets, before, after, strict=True):
        passes = a["sample_passes"] - b["sample_passes"]
        part = (
            f"{name} {passes} pass{'' if passes == 1 else 'es'}, "
            f"{a['sample_hits'] - b['sample_hits']}/{a['sample_acquires'] - b['sample_acquires']}"
            f" acquires in flight, GPU waited "
            f"{(a['sample_gpu_wait_ns'] - b['sample_gpu_wait_ns']) / 1e9:.2f} s, "
            f"at {size_text(budget)}"
        )
        if a.get("sample_auto_need") is not None:
            part += f" (auto; the trainer took {size_text(a['sample_auto_need'])} sampling)"
        parts.append(part)
    return f"weightstream-aitk: sampled in {seconds:.1f} s: " + "; ".join(parts)


def _keep_state_on_host(accelerator):
    """Makes ``accelerator.prepare`` prepare a ``HostAdamW`` without device placement
    (accelerate's would copy its whole state to the GPU and back)."""
    prepare = getattr(accelerator, "prepare_optimizer", None)
    if prepare is None or getattr(prepare, "_weightstream", False):
        return

    @functools.wraps(prepare)
    def prepare_optimizer(optimizer, device_placement=None):
        if isinstance(optimizer, HostAdamW):
            device_placement = False
        return prepare(optimizer, device_placement=device_placement)

    prepare_optimizer._weightstream = True
    accelerator.prepare_optimizer = prepare_optimizer
