"""What host-held training takes and costs, checked before anything moves: which layers it
takes (``trainable_layers``), the ``master`` and optimizer choices, the host bytes per tensor
(``host_bytes``) and of the bounce ring (``ring_bytes``), and whether they fit the host memory
the daemon allows this uid (``check_host_fits``, ``host_room``)."""

from __future__ import annotations

import mmap
from collections.abc import Iterable

import torch
from torch import nn

from weightstream.sizes import size_text
from weightstream.torch import policy
from weightstream.torch.host.storage import ALIGN, TrainableError

#: The bounce ring holds this many of the largest group's gradients.
BOUNCE_GROUPS = 2

#: What ``master=`` takes: ``"fp32"`` keeps an fp32 master copy of each weight narrower than
#: fp32 for the optimizer to update; ``"none"`` keeps none (the working weight is updated in
#: place).
MASTERS = ("fp32", "none")


def check_master(master) -> str:
    """``master`` if it is one of ``MASTERS``; else ``TrainableError`` listing them."""
    if not isinstance(master, str) or master not in MASTERS:
        raise TrainableError(
            f"master={master!r}: expected one of {', '.join(map(repr, MASTERS))} ('fp32' keeps "
            "an fp32 copy of each bf16/f16 weight for the optimizer, 'none' updates the weight "
            "in place)"
        )
    return master


def has_master(dtype: torch.dtype, master: str) -> bool:
    """Whether a working weight of ``dtype`` gets an fp32 master with ``master``."""
    return master == "fp32" and dtype != torch.float32


def host_bytes(numel: int, dtype: torch.dtype, optimizer: str | None, master: str = "fp32") -> int:
    """Host bytes a trainable tensor of ``numel`` elements needs: working weight, fp32 master
    (``has_master``) and gradient, plus the optimizer's state ("adamw": two moments, fp32 with a
    master or an fp32 weight, else in the weight's dtype as torch's AdamW keeps them;
    "adamw8bit": two bytes and two fp32 scales per block of 256). Per element for a bf16
    weight: 2 + 4 + 2 (+ 8 adamw, + ~2 adamw8bit) with the fp32 master, 2 + 2 (+ 4 adamw,
    + ~2 adamw8bit) without."""
    extra = has_master(dtype, master)
    total = numel * (dtype.itemsize * 2 + (4 if extra else 0))
    if optimizer == "adamw":
        total += numel * 2 * (4 if extra else dtype.itemsize)
    elif optimizer == "adamw8bit":
        total += numel * 2 + -(-numel // 256) * 8
    return total


def group_names(root: nn.Module, layers: list[tuple[str, nn.Linear]], group_by) -> list[str]:
    """Each layer's group (``stream_trainable``'s ``group_by``)."""
    if callable(group_by):
        return [str(group_by(name)) for name, _ in layers]
    if group_by == "block":
        return [policy.block_of(root, name) for name, _ in layers]
    return [name for name, _ in layers]


def ring_bytes(groups: Iterable[list[torch.Tensor]]) -> int:
    """The bounce ring's size for groups of these weights: ``BOUNCE_GROUPS`` times the largest
    group's gradients (each aligned), in whole pages."""
    largest = max(sum(-(-w.nbytes // ALIGN) * ALIGN for w in ws) for ws in groups)
    return -(-BOUNCE_GROUPS * largest // mmap.PAGESIZE) * mmap.PAGESIZE


def layer_ring_bytes(root: nn.Module, layers: list[tuple[str, nn.Linear]], group_by) -> int:
    """``ring_bytes`` of the layers grouped as ``stream_trainable`` groups them."""
    groups: dict[str, list[torch.Tensor]] = {}
    for (_, m), key in zip(layers, group_names(root, layers, group_by), strict=True):
        groups.setdefault(key, []).append(m.weight)
    return ring_bytes(groups.values())


def trainable_layers(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The layers ``stream_trainable`` takes: every ``nn.Linear`` whose weight requires grad.
    Raises ``TrainableError`` for a trainable layer it cannot take."""
    out = []
    for name, m in module.named_modules():
        weight = getattr(m, "weight", None)
        if not isinstance(weight, nn.Parameter) or not weight.requires_grad:
            continue
        if type(m) is not nn.Linear:
            raise TrainableError(
                f"{name!r} ({type(m).__name__}) has a trainable weight, and only nn.Linear "
                "layers' weights are held in host memory (LoRA's lora_A/lora_B, lora_down/"
                "lora_up): freeze it, or train it on the device without trainable streaming"
            )
        if m.bias is not None and m.bias.requires_grad:
            raise TrainableError(
                f"{name!r}: a trainable bias is not held in host memory; create the LoRA "
                "without biases (peft: lora_bias=False) or freeze it"
            )
        if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TrainableError(f"{name!r}: a {weight.dtype} weight cannot be trained here")
        out.append((name, m))
    return out


#: The optimizers whose state ``host_bytes`` sizes (``HostAdamW``'s kinds).
OPTIMIZERS = ("adamw", "adamw8bit")


def check_optimizer(kind: str):
    """Raises ``TrainableError`` for an optimizer of weights in host memory other than
    ``OPTIMIZERS``, naming them."""
    if kind not in OPTIMIZERS:
        raise TrainableError(
            f"optimizer {kind!r} is not supported for weights in host memory: use one of "
            f"{', '.join(OPTIMIZERS)}"
        )


def check_host_fits(
    client,
    params: Iterable[torch.Tensor],
    optimizer: str | None,
    upload=0,
    master: str = "fp32",
    ring: int = 0,
):
    """Raises ``TrainableError`` naming the numbers when the trainable state (and the
    optimizer's, if named; with or without the fp32 master, ``master``; and the ``ring``
    bytes of the gradients' bounce ring), with ``upload`` bytes
    of a model still to upload beside it, cannot fit the host memory the daemon allows this
    uid, even with every other uid's memory given back (what only might fit is the daemon's to
    refuse, with its own numbers, when the regions are made). Refusing with the fp32 master,
    the message says when the state would fit without it, and its size then."""
    check_master(master)
    params = list(params)
    state = ring + sum(host_bytes(p.numel(), p.dtype, optimizer, master) for p in params)
    room = host_room(client)
    if room is None or upload + state <= room[0]:
        return
    free, limit = room
    lean = ring + sum(host_bytes(p.numel(), p.dtype, optimizer, "none") for p in params)
    what = (f" with {optimizer}" if optimizer else "") + (
        " and the fp32 master" if lean != state else ""
    )
    fp8 = "quantize='fp8', " if upload else ""
    advice = f"use adamw8bit, {fp8}a lower rank, or raise the daemon's quota"
    if lean != state and upload + lean <= free:
        need = (
            f"the state is {size_text(lean)} and both need {size_text(upload + lean)}"
            if upload
            else f"it needs {size_text(lean)}"
        )
        advice = (
            "without the fp32 master (master='none': the optimizer updates the weights in "
            f"place) {need}, which fits; else {advice}"
        )
    if upload:
        raise TrainableError(
            f"the upload ({size_text(upload)}) and the trainable state ({size_text(state)}"
            f"{what}) need {size_text(upload + state)} of host memory, and {limit} leaves this "
            f"uid {size_text(max(free, 0))}: {advice}"
        )
    raise TrainableError(
        f"the trainable state needs {size_text(state)} of host memory{what}, and {limit} "
        f"leaves this uid {size_text(max(free, 0))} beside what it holds: {advice}"
    )


def host_room(client) -> tuple[int, str] | None:
    """The most host bytes this uid could still get from the daemon, and the limit that says
    so (``quotas.per_uid_host_bytes`` or ``quotas.max_host_bytes``); None without limits."""
    info = client.info()
    q, used = info.quotas, info.usage.host_bytes
    rooms = []
    if q.per_uid_host_bytes:
        rooms.append((q.per_uid_host_bytes - used, "quotas.per_uid_host_bytes"))
    if q.max_host_bytes:
        rooms.append((q.max_host_bytes - used, "quotas.max_host_bytes"))
    return min(rooms) if rooms else None
