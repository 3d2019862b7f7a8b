"""Host-held training of a module, checked before anything moves: ``HostPlan(module)`` finds the
layers it takes (refusing what it cannot hold), ``check`` settles where they compute, how they
are grouped, the optimizer and the master, and sizes it all against the host memory the daemon
allows this uid; ``apply`` then moves the weights and returns the ``Trainable``.
``stream_trainable`` is the three in one call."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from weightstream.torch.host.layers import Trainable
from weightstream.torch.host.sizing import (
    check_host_fits,
    check_master,
    check_optimizer,
    layer_ring_bytes,
    trainable_layers,
)
from weightstream.torch.host.storage import HostStorage, TrainableError


class HostPlan:
    """The trainable layers of ``module`` (``trainable_layers``: every ``nn.Linear`` whose
    weight requires grad; ``TrainableError`` for a trainable layer it cannot take), then what
    ``check`` settles; nothing moves before ``apply``."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.layers = trainable_layers(module)
        self.handle = None
        self.device: torch.device | None = None
        self.group_by: str | Callable[[str], str] = "block"
        self.lookahead = 1
        self.optimizer: str | None = None
        self.master = "fp32"

    @property
    def weights(self) -> list[nn.Parameter]:
        """The weights the plan holds in host memory, in the module's order."""
        return [m.weight for _, m in self.layers]

    def fits(self, client, optimizer: str | None, master: str, upload: int = 0, group_by="block"):
        """``check_host_fits`` of these layers' state (and the bounce ring of their groups),
        with ``upload`` bytes of a model still to upload beside it."""
        check_host_fits(
            client,
            self.weights,
            optimizer,
            upload,
            master=master,
            ring=layer_ring_bytes(self.module, self.layers, group_by),
        )

    def check(
        self,
        handle=None,
        *,
        device=None,
        group_by="block",
        lookahead=1,
        optimizer=None,
        master="fp32",
    ) -> HostPlan:
        """Settles the rest of the plan (``stream_trainable``'s keywords, which say what each
        takes) and checks it: the optimizer, the master, where the layers compute, and, with
        ``handle``, that the state fits the daemon's host memory. Returns self."""
        if optimizer is not None:
            check_optimizer(optimizer)
        check_master(master)
        dev = torch.device(device) if device is not None else getattr(handle, "device", None)
        if dev is None:
            raise TrainableError("pass device= (or a handle) to say where the layers compute")
        if handle is not None:
            self.fits(handle.client, optimizer, master, group_by=group_by)
        self.handle, self.device, self.group_by = handle, dev, group_by
        self.lookahead, self.optimizer, self.master = lookahead, optimizer, master
        return self

    def apply(self) -> Trainable:
        """Moves the weights into host memory (the handle's session's, else the trainer's own)
        and streams them to the device as the layers run."""
        if self.device is None:
            raise TrainableError("HostPlan.apply before check: nothing is settled yet")
        session = self.handle.session if self.handle is not None else None
        storage = HostStorage(self.device, session)
        try:
            return Trainable(
                self.module,
                self.layers,
                self.device,
                storage,
                group_by=self.group_by,
                lookahead=self.lookahead,
                master=self.master,
            )
        except BaseException:
            storage.close()
            raise


def stream_trainable(
    module: nn.Module,
    handle=None,
    *,
    device: torch.device | str | None = None,
    group_by: str | Callable[[str], str] = "block",
    lookahead: int = 1,
    optimizer: str | None = None,
    master: str = "fp32",
) -> Trainable:
    """Moves the trainable weights of ``module`` (a LoRA's ``nn.Linear`` layers) into host
    memory held by ``handle``'s daemon session, and streams them to the device as the layers
    run. ``device``: where the layers compute (default: the handle's device). ``group_by``:
    which weights are copied to the device together: ``"block"`` (the model's repeated block,
    ``policy.block_of``), ``"layer"``, or a function of the layer's name giving its group's
    name. ``optimizer``
    ("adamw" or "adamw8bit"), when given, is only used to check up front that the trainable
    state and the optimizer's fit the host memory the daemon allows (``host_bytes``).
    ``master``: ``"fp32"`` (the default) keeps an fp32 master of each bf16/f16 weight, which
    ``HostAdamW`` updates and rounds into the weight; ``"none"`` keeps none: the optimizer
    updates the weight itself (fp32 arithmetic, rounded to nearest-even back to its dtype),
    4 bytes less per element, and the updates smaller than half the weight's last bit are lost
    (as in any trainer of bf16 weights without a master).

    Without ``handle``, the host memory is the trainer's own (for tests and for models not
    streamed through the daemon)."""
    plan = HostPlan(module)
    if not plan.layers:
        raise TrainableError(
            "no trainable nn.Linear in the module: add the LoRA (and freeze the base) before "
            "stream_trainable"
        )
    plan.check(
        handle,
        device=device,
        group_by=group_by,
        lookahead=lookahead,
        optimizer=optimizer,
        master=master,
    )
    return plan.apply()
