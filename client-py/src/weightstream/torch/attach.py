"""``attach(module, device)``: select a module's streamed layers, group them, upload (or match)
their weights, open the session, hook each layer's forward, and move the rest to the device;
undone on failure. ``ddp_ignore_streamed`` tells DistributedDataParallel to leave the streamed
placeholders alone. See ``weightstream.torch`` for what streaming guarantees."""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
import warnings

import torch
from torch import nn

import weightstream
from weightstream import _upload, quantize
from weightstream.client import Client
from weightstream.session import device_uuid
from weightstream.torch import (
    budget,
    compute_plan,
    ops,
    packed,
    passes,
    placeholder,
    policy,
    torchao_weights,
)
from weightstream.torch import options as options_module
from weightstream.torch.budget import AutoBudget
from weightstream.torch.handle import Handle, StreamedLayer
from weightstream.torch.hooks import HookRegistry, own_function
from weightstream.torch.host import HostPlan, TrainableError
from weightstream.torch.host.sizing import check_master, check_optimizer
from weightstream.torch.options import StreamOptions
from weightstream.torch.placeholder import is_placeholder


def ddp_ignore_streamed(model: nn.Module) -> list[str]:
    """Tells ``DistributedDataParallel`` to leave the streamed weights alone, before wrapping
    ``model`` in it: they are placeholders without storage (the daemon holds the weights), so
    DDP's initial broadcast of the module's state must skip them. Returns their names. Uses
    torch's ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` (the hook
    torch's own wrappers use), in this one place."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    names = [n for n, p in model.named_parameters() if is_placeholder(p)]
    ignore = getattr(DDP, "_set_params_and_buffers_to_ignore_for_model", None)
    if ignore is None:
        raise RuntimeError(
            "this torch has no DistributedDataParallel._set_params_and_buffers_to_ignore_for_"
            f"model: DDP would broadcast {len(names)} streamed placeholders; use torch >= 1.8"
        )
    ignore(model, names)
    return names


def _options(options: StreamOptions | None, overrides: dict) -> StreamOptions:
    """``options`` with ``attach``'s keyword overrides."""
    known = {f.name for f in dataclasses.fields(StreamOptions)}
    for key in overrides:
        if key not in known:
            raise TypeError(f"attach() got an unexpected keyword argument {key!r}")
    return dataclasses.replace(options or StreamOptions(), **overrides)


def attach(
    module: nn.Module,
    device: torch.device | str,
    options: StreamOptions | None = None,
    *,
    vram_budget: int | str | AutoBudget | None = None,
    staging_bytes: int | str = 0,
    model: str | None = None,
    names: dict[str, str] | None = None,
    client: Client | None = None,
    label: str = "",
    pin: bool = False,
    retention: str | None = None,
    trainable: str = "device",
    optimizer: str | None = None,
    master: str = "fp32",
    **overrides,
) -> Handle:
    """Streams the frozen weights (and biases) of ``module``'s Linear and Conv2d layers
    through the daemon; everything else moves to ``device`` as usual.

    - ``options``: ``StreamOptions`` (input gradient, grouping, ``min_bytes``, ``include``,
      ``ignore``, lookahead, ``quantize``, ``dequantize``); any of its fields may also be
      passed as a keyword here.
    - ``vram_budget``: device bytes the daemon may use for this session (default: a quarter
      of the streamed bytes, at least three times the largest group). ``"auto"`` (or an
      ``AutoBudget``, to choose its margin or probes): starts at two of the largest group,
      measures the trainer through its first step, then grows to what the device has left
      less a margin, and shrinks when another job needs room (``budget``). A budget under
      the largest group (or ``staging_bytes`` under it or over the budget) raises
      ``ValueError`` with the minimum before any weight is freed.
    - ``staging_bytes``: the part of it for streaming (default: the daemon's choice);
      ``"forward"``: three of the largest group, as a sampling budget stages, for a module
      that runs forward-only passes (inference): what staging does not take stays resident.
    - ``pin``: the upload (when there is one) stays in the daemon after this process exits,
      never evicted, until ``Client.release_model`` (``weightstream release``) gives it back.
      By default the upload is released once this process's connection and the session are
      gone: the next job uploads again. ``retention`` names the upload's reference's life
      instead (``Client.RETENTIONS``: ``"cached"`` keeps it after this process exits until the
      daemon needs the room).
    - ``model``: the id of a model the daemon already loaded from safetensors whose tensor
      names match the module's parameter names; otherwise the weights are uploaded. A model
      loaded with ``quantize="fp8"`` streams its weights in 8 bits, as below. ``names``: the
      model's name of each streamed tensor whose name is not the module's (a checkpoint whose
      keys transformers renames as it loads them).
    - ``quantize="fp8"`` (a ``StreamOptions`` field): the streamed layers' weights are
      uploaded for the daemon to keep in 8 bits (``fp8_e4m3_block64``: weights on a CUDA
      device are quantized there as they are copied, a chunk of rows at a time, those in host
      memory by the daemon at commit; the same bytes either way); each layer
      dequantizes its weight on the device after it arrives, into a tensor of the weight's
      dtype from the trainer's allocator (``dequantize``: by default a block's weights at
      once where they take at most 768 MiB, kept while the block runs in a pass, else one
      layer at a time, freed after use; the largest is
      ``Handle.stats()["dequant_peak_bytes"]``), and runs its own operation on it. Results
      equal the model with each streamed weight replaced by its dequantization
      (``weightstream.quantize.to_fp8_resident``). A weight that is not bf16/f16/f32 raises
      ``ValueError`` naming the layer, before anything is uploaded.
    - A packed quantized layer (``packed``: torchao's ``NF4Tensor`` and
      ``IntxUnpackedToInt8Tensor`` weights, ai-toolkit's ``OstrisLinear`` of ``uint2..7``,
      ``convrotint2..8``, ``nvfp4``, ``convrot8``, ``convrot4``) streams its inner tensors
      byte for byte and runs its own forward on them: outputs and gradients equal the layer
      in place (``Handle.stats()["packed_formats"]`` lists the formats and their bytes per
      weight).
    - A layer whose weight torchao quantized per row (``Float8WeightOnlyConfig()``,
      ``Int8WeightOnlyConfig()``: ``torchao_weights``) streams that weight as it is, its
      ``qdata`` and ``scale`` uploaded without a float round trip, and computes what torchao's
      own linear computes with it (``quantize.linear_as``): outputs and gradients equal those of
      the quantized layer in place (``quantize`` applies to the other layers). Other quantized
      weights are refused (``policy.QuantizedWeight``) before anything is uploaded.
    - ``trainable="host"``: the module's trainable ``nn.Linear`` weights (a LoRA added before
      ``attach``) go to host memory held by the daemon for the session, as
      ``trainable.stream_trainable`` does (``Handle.trainable``; step them with
      ``host_optim.HostAdamW``). ``optimizer`` ("adamw" or "adamw8bit") sizes the state: the
      upload and that state are checked together against the host memory the daemon allows
      this uid, and a configuration that cannot fit raises ``TrainableError`` with the numbers
      before anything is uploaded. ``master``: ``"fp32"`` (the default) keeps an fp32 master
      of each bf16/f16 weight for the optimizer; ``"none"`` keeps none, the optimizer updating
      the weights in place (``trainable.stream_trainable``). ``"device"`` (the default) leaves
      trainable layers on the device.
    ``Handle.stats()`` says where the attach's time went (``attach_*``: ``Handle.attach_phases``).
    The trainer's own copies of the streamed weights are freed, those already on ``device``
    before the session opens (so that the daemon can allocate the budget where they were),
    the others once it is open; their parameters become ``Placeholder``s on ``device``. A
    failed attach releases what it uploaded. Layers whose forward another library replaced
    stream inside its wrapper, or are refused (``hooks``); quantized weights are refused
    (``policy.QuantizedWeight``) but torchao's above.
    """
    started = time.monotonic()
    options = _options(options, overrides)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    selection = policy.select(module, options)
    if not selection.streamed:
        raise ValueError(policy.nothing_to_stream(selection, options, module))
    hooks = HookRegistry()
    for name, m in selection.streamed:
        hooks.check(name, m)  # refuse before uploading anything
    fmt = quantize.format_name(options.quantize)
    # Packed layers stream their inner tensors as they are (``packed``; an OstrisLinear's
    # ``weight`` is a property that dequantizes, so it is never read here).
    packs = {
        name: packed.Packed.of(m) for name, m in selection.streamed if packed.form_of(m) is not None
    }
    for name, m in selection.streamed:  # what the layer runs in place (an ARA's: nn.Linear's)
        if name in packs:
            packs[name].forward = own_function(m, name)
    # torchao's weights stream in their own format (read before any weight is freed).
    rebuilds = {
        name: torchao_weights.Rebuild.of(m.weight)
        for name, m in selection.streamed
        if name not in packs and torchao_weights.format_of(m.weight) is not None
    }
    if fmt is not None:
        for name, m in selection.streamed:
            if name not in rebuilds and name not in packs:
                quantize.check_quantizable(name, m.weight)
    compute = compute_plan.plan(selection.streamed, options, device)
    client = client or weightstream.connect()
    alignment = client.info().alignment or 1
    if options.sample_vram_budget is not None:
        if trainable == "host":
            raise passes.SampleBudgetError(
                "sample_vram_budget with trainable='host': the trainable state lives in the "
                "session's host memory, which reopening the session for sampling would drop; "
                "leave sample_vram_budget unset"
            )
        if isinstance(options.sample_vram_budget, int):
            limit = passes.budget_limit(client, device_uuid(device))
            passes.check_budget(options.sample_vram_budget, limit)
    if trainable not in ("device", "host"):
        raise ValueError(f"trainable={trainable!r}: expected 'device' or 'host'")
    check_master(master)
    label = label or type(module).__name__
    plan = None
    if trainable == "host":
        plan = _check_host_room(
            client,
            module,
            selection.streamed,
            model,
            fmt,
            set(rebuilds),
            packs,
            optimizer,
            master,
            label,
            compute.rowwise(),
        )
    auto = budget.resolve(vram_budget)
    if auto is not None:
        if staging_bytes:
            raise ValueError('vram_budget="auto" chooses staging_bytes: leave it 0')
        vram_budget = None  # the groups are chosen as for a budget that fits blocks
    upload_phases: dict = {}
    t = time.monotonic()
    prepared = (
        {}
        if model is not None
        else compute_plan.upload_forms(compute, selection.streamed, fmt, set(rebuilds))
    )
    for name in prepared:
        rebuilds.pop(name, None)  # requantized: detach gives the dequantization back
    manifest, uploaded = _model_of(
        client,
        selection.streamed,
        model,
        label,
        fmt,
        set(rebuilds),
        packs,
        upload_phases,
        retention or ("pinned" if pin else "connection"),
        compute,
        prepared,
        names or {},
        options.coding,
    )
    phases = {"model_s": time.monotonic() - t}
    phases.update({f"upload_{k}": v for k, v in upload_phases.items()})
    session, freed = None, []
    try:
        quantized = frozenset(
            t.name for t in manifest.tensors if t.quantization in quantize.FORMATS
        )
        grouping = policy.choose_groups(
            module,
            selection.streamed,
            options.group_by,
            alignment,
            vram_budget,
            0 if staging_bytes == "forward" else staging_bytes,
            quantized,
            compute.rowwise(),
            packs,
        )
        if grouping.fallback:
            warnings.warn(grouping.fallback, stacklevel=2)
        groups = [
            (
                gname,
                [
                    (names or {}).get(t, t)
                    for n, m in ms
                    for t, _ in policy.layer_tensors(n, m, packs)
                ],
            )
            for gname, ms in grouping.members.items()
        ]
        if auto is not None:
            auto.bind(device, grouping.sizes, alignment)
            vram_budget, staging_bytes = auto.budget, auto.staging
        elif vram_budget is None:
            vram_budget = policy.default_budget(grouping.sizes)
        if staging_bytes == "forward":
            staging_bytes = passes.forward_staging(vram_budget, max(grouping.sizes))
        policy.check_budget(grouping, vram_budget, staging_bytes)  # before anything is freed
        passes.check_sample_staging(options.sample_staging_bytes, max(grouping.sizes))
        # The daemon allocates the session's budget on the device: the trainer's copies there
        # go first, and torch's cache gives their memory back.
        freed += _free(selection.streamed, device, packs, only_on=device)
        gc.collect()
        torch.cuda.empty_cache()
        t = time.monotonic()
        session = client.open_session(
            manifest.model_id,
            groups,
            vram_budget,
            staging_bytes=staging_bytes,
            device=device,
            label=label,
        )
        phases["open_session_s"] = time.monotonic() - t
        resident = {n: policy.reason_text(why, options) for n, why in selection.resident.items()}
        handle = Handle(client, session, manifest.model_id, device, options, resident=resident)
        handle.vram_budget = vram_budget
        handle._compute = compute
        handle._hooks = hooks
        for gname, members in grouping.members.items():
            group, slot = session.group_index(gname), 0
            for name, m in members:
                layer = StreamedLayer(
                    handle,
                    m,
                    name,
                    group,
                    m.bias is not None,
                    slot,
                    dtype=packs[name].dtype if name in packs else m.weight.dtype,
                    rebuild=rebuilds.get(name),
                    packed=packs.get(name),
                    compute8=compute.layers.get(name),
                    compute_fallback=compute.fallback(name),
                )
                tensors = len(packs[name].names) if name in packs else 1
                slot += tensors + (m.bias is not None)
                handle.streamed[name] = layer
                hooks.install(name, m, functools.partial(ops.forward, layer))
        handle._choose_dequantize()
        handle._pin_resident()
        _move_the_rest(module, handle.streamed, device)
        _free(selection.streamed, device, packs)
        if plan is not None:
            plan.check(handle, device=device, optimizer=optimizer, master=master)
            handle.trainable = plan.apply()
        if auto is not None:
            handle._auto_attach(module, auto)
        handle._pass_hooks = [
            module.register_forward_pre_hook(handle._enter_pass),
            module.register_forward_hook(handle._leave_pass, always_call=True),
        ]
        handle._passes.auto = passes.auto_sample(options, device)
    except BaseException as e:
        _undo(hooks, session, client, uploaded, freed, e)
        raise
    phases["total_s"] = time.monotonic() - started
    handle.attach_phases = {
        k: round(v, 4) if isinstance(v, float) else v for k, v in phases.items()
    }
    return handle


def _check_host_room(
    client,
    module,
    streamed,
    model,
    fmt,
    torchao: set[str],
    packs: dict,
    optimizer,
    master: str,
    label: str,
    rowwise: frozenset[str],
) -> HostPlan:
    """``trainable="host"``: the upload and the trainable state together against the host
    memory the daemon allows this uid, before anything is uploaded. Returns the plan that
    ``attach`` applies once the session is open."""
    plan = HostPlan(module)
    if not plan.layers:
        raise TrainableError(
            "trainable='host': the module has no trainable nn.Linear; add the LoRA (and freeze "
            "the base) before attach, or call stream_trainable after adding it"
        )
    if optimizer is not None:
        check_optimizer(optimizer)
    upload = 0
    if model is None:
        quantized = frozenset(
            f"{n}.weight" for n, _ in streamed if fmt and n not in torchao and n not in packs
        )
        upload = _upload.upload_charge(
            label,
            [
                (t, w.ndim, policy.tensor_nbytes(t, w, quantized, rowwise))
                for n, m in streamed
                for t, w in policy.layer_tensors(n, m, packs)
            ],
        )
    plan.fits(client, optimizer, master, upload)
    return plan


def _model_of(
    client: Client,
    streamed,
    model: str | None,
    label: str,
    fmt: str | None,
    torchao: set[str],
    packs: dict,
    phases: dict,
    retention: str,
    compute: compute_plan.Plan,
    prepared: dict,
    names: dict[str, str],
    coding: str = "none",
):
    """The daemon's model of the streamed tensors: uploaded (then also returned as the id to
    release if attach fails; ``phases`` filled as ``Client.upload_model`` says; its reference
    lasting as ``retention`` says), with the
    weights quantized to ``fmt`` (on their CUDA device as they are copied, or by the daemon
    at commit: ``options.QUANTIZE_ON``), those of the layers in ``torchao`` written in their
    torchao format and those ``prepared`` for 8-bit compute in theirs
    (``compute_plan.upload_forms``), or ``model``, checked against them (its tensors seen
    under the module's names: ``names``)."""
    tensors = {}
    for name, m in streamed:
        for tname, t in policy.layer_tensors(name, m, packs):
            as_is = name in torchao and t is m.weight
            tensors[tname] = torchao_weights.upload_form(t) if as_is else t.detach()
        if name in prepared:
            tensors[f"{name}.weight"] = prepared[name]
    weights = [
        f"{name}.weight"
        for name, _ in streamed
        if name not in torchao and name not in compute.layers and name not in packs
    ]
    if model is not None:
        listed = _renamed(_listed(client, model), names)
        compute_plan.check_model(compute, model, listed)
        return _match(listed, tensors, weights if fmt else ()), None
    labels = {t: lb for name, pack in packs.items() for t, lb in pack.labels(name).items()}
    manifest, _ = client.upload_model(
        label,
        tensors,
        quantize=weights if fmt else (),
        phases=phases,
        retention=retention,
        quantize_on=options_module.QUANTIZE_ON,
        labels=labels,
        coding=coding,
    )
    return manifest, manifest.model_id


def _free(
    streamed, device: torch.device, packs: dict, only_on: torch.device | None = None
) -> list[str]:
    """Puts placeholders on ``device`` in place of the streamed layers' weights and biases
    (those on ``only_on`` alone, when given), and of a packed layer's streamed tensors
    (``packed.Packed.free``; with ``only_on``, where all are there): the trainer's copies go
    with the last reference. Returns the names of the tensors replaced."""
    freed = []
    for name, m in streamed:
        pack = packs.get(name)
        if pack is not None and not pack.held:
            inner = packed.inner(m, pack.form).values()
            if only_on is None or all(t.device == only_on for t in inner):
                freed += pack.free(name, m, device)
        for pname, tname in (("weight", f"{name}.weight"), ("bias", f"{name}.bias")):
            t = m._parameters.get(pname)
            if t is None or is_placeholder(t) or (only_on is not None and t.device != only_on):
                continue
            setattr(m, pname, placeholder.parameter(t, device, tname))
            freed.append(tname)
    return freed


def _undo(hooks: HookRegistry, session, client: Client, uploaded: str | None, freed, error):
    """After a failed attach: closes the session, releases the upload, and puts each layer's
    forward back. Weights freed to make room for the session are gone: the error says so."""
    hooks.remove_all()
    for step in (
        session.close if session is not None else None,
        (lambda: client.release_model(uploaded)) if uploaded is not None else None,
    ):
        try:
            if step is not None:
                step()
        except Exception:  # noqa: BLE001 - the first error is the one to report
            pass
    if freed and hasattr(error, "add_note"):  # notes: Python 3.11+
        error.add_note(
            f"weightstream.torch.attach failed after freeing {len(freed)} tensors that were "
            f"on the session's device (e.g. {freed[0]!r}) to make room for it: their layers "
            "hold placeholders; load the model again. The upload was released."
        )


def _move_the_rest(module: nn.Module, streamed, device: torch.device):
    for name, m in module.named_modules():
        if name in streamed:
            continue
        for pname, p in m.named_parameters(recurse=False):
            if p.device != device:
                setattr(m, pname, nn.Parameter(p.data.to(device), requires_grad=p.requires_grad))
        for bname, b in m.named_buffers(recurse=False):
            if b is not None and b.device != device:
                m.register_buffer(bname, b.to(device))


def _listed(client: Client, model_id: str):
    """The manifest of the daemon's model ``model_id``."""
    listed = {m.model_id: m for m in client.list_models().models}
    if model_id not in listed:
        raise ValueError(f"model={model_id!r}: the daemon has no such model")
    return listed[model_id]


class _Renamed:
    """A tensor of a model's manifest under the module's name for it."""

    def __init__(self, tensor, name: str):
        self._tensor, self.name = tensor, name

    def __getattr__(self, attr):
        return getattr(self._tensor, attr)


def _renamed(manifest, names: dict[str, str]):
    """``manifest`` with the module's names for the tensors ``names`` gives the model's names of
    (the session is opened with the model's)."""
    if not names:
        return manifest
    back = {v: k for k, v in names.items()}
    tensors = [_Renamed(t, back[t.name]) if t.name in back else t for t in manifest.tensors]
    return dataclasses.make_dataclass("Manifest", ["model_id", "tensors"])(
        manifest.model_id, tensors
    )


def _match(manifest, tensors: dict[str, torch.Tensor], quantized=()):
    """The daemon's loaded model, checked against the module's weights (names and shapes), and
    the tensors named in ``quantized`` against the 8-bit format."""
    model_id = manifest.model_id
    have = {t.name: t for t in manifest.tensors}
    for name, t in tensors.items():
        info = have.get(name)
        if info is None:
            raise ValueError(f"model={model_id!r} has no tensor {name!r}")
        shape = list((t.data if isinstance(t, quantize.Fp8Weight) else t).shape)
        if list(info.shape) != shape:
            raise ValueError(
                f"model={model_id!r}: tensor {name!r} has shape {list(info.shape)}, "
                f"the module's is {shape}"
            )
        if isinstance(t, quantize.Fp8Weight) and info.quantization != t.format:
            raise ValueError(
                f"model={model_id!r}: tensor {name!r} is held as {info.quantization}, the "
                f"module's weight is torchao's {t.format}"
            )
    for name in quantized:
        if have[name].quantization != quantize.FP8_E4M3_BLOCK64:
            raise ValueError(
                f"model={model_id!r}: quantize='fp8', but its tensor {name!r} is not in 8 bits "
                "(load the model with quantize='fp8')"
            )
    warnings.warn(
        "attach(model=...): streaming the daemon's copy; the module's own weights are freed",
        stacklevel=4,
    )
    return manifest
