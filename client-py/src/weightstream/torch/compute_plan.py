"""8-bit compute for streamed layers (``StreamOptions.compute`` ``"fp8"``/``"int8"``): which of
the streamed layers compute in 8 bits (``plan``), the form their weights stream in
(``upload_forms``: prepared once at attach, no requantization per call), the check of a model
the daemon loaded (``check_model``), and each call's ``compute8.W8Weight`` made from a ticket's
views (``Layer8.weight``). The arithmetic is ``compute8``'s.

A weight in 8-bit compute streams with one float32 scale per output row, in the layout of
torchao's per-row formats (data [out, in], float32 scale [out, 1], w = data.float() * scale):
the mode's format of ``UPLOAD_FORMATS``. With ``rotation``, the data is that of W·H; the block
is recorded here, on the layer, not in the daemon.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from weightstream import quantize
from weightstream.quantize import Fp8Weight
from weightstream.torch import compute8, packed, torchao_weights

#: The format a weight prepared at attach is uploaded in, per mode.
UPLOAD_FORMATS = {
    "fp8": quantize.TORCHAO_FLOAT8_ROWWISE,
    "int8": quantize.TORCHAO_INT8_ROWWISE,
}
#: THE ONE PLACE where the daemon formats a layer in 8-bit compute streams as they are are
#: listed, per mode: row-scaled data [out, in] and a float32 scale [out, 1], dequantized as
#: ``data.float() * scale``. ``fp8_e4m3_row`` and ``int8_row`` (the daemon's own row formats,
#: which a model loaded by id can be held in) are accepted once ``quantize.FORMATS`` knows
#: them; until then only the upload formats above are.
_ROW_FORMAT_NAMES = {
    "fp8": (quantize.TORCHAO_FLOAT8_ROWWISE, "fp8_e4m3_row"),
    "int8": (quantize.TORCHAO_INT8_ROWWISE, "int8_row"),
}
ROW_FORMATS = {
    mode: frozenset(f for f in names if f in quantize.FORMATS)
    for mode, names in _ROW_FORMAT_NAMES.items()
}
#: What a model loaded by id must be loaded with, per mode.
LOAD_AS = {"fp8": "fp8_e4m3_row", "int8": "int8_row"}


@dataclass(frozen=True, eq=False)
class Layer8:
    """A streamed layer that computes in 8 bits: its mode, rotation block and input gradient's
    mode, and the handle's counters."""

    name: str
    mode: str
    rotation: int
    grad_compute: str
    stats: compute8.Stats

    def weight(self, w: Fp8Weight) -> compute8.W8Weight:
        """The ``W8Weight`` of the layer's weight as the ticket holds it (views, no copy)."""
        if w.format not in ROW_FORMATS[self.mode]:
            raise ValueError(
                f"{self.name}: compute={self.mode!r} takes weights held in "
                f"{' or '.join(sorted(ROW_FORMATS[self.mode]))}, not {w.format}"
            )
        return compute8.W8Weight(w.data, w.scale.reshape(-1), self.mode, self.rotation, None)


@dataclass(frozen=True, eq=False)
class Fallback:
    """A streamed layer of an 8-bit compute session that computes in the trainer's dtype, and
    why: ``count`` adds a call to the handle's counters."""

    name: str
    reason: str
    stats: compute8.Stats

    def count(self):
        self.stats.fallbacks[(self.name, self.reason)] += 1


@dataclass
class Plan:
    """The streamed layers that compute in 8 bits (``layers``), and those that keep the
    trainer's dtype with why (``fallbacks``: layer name -> reason)."""

    mode: str | None = None
    layers: dict[str, Layer8] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)
    stats: compute8.Stats = field(default_factory=compute8.Stats)

    def fallback(self, name: str) -> Fallback | None:
        why = self.fallbacks.get(name)
        return None if why is None else Fallback(name, why, self.stats)

    def rowwise(self) -> frozenset[str]:
        """The weights the daemon holds with one scale per row (their group sizes)."""
        return frozenset(f"{n}.weight" for n in self.layers)


def plan(streamed, options, device: torch.device) -> Plan:
    """Which of ``streamed`` ((name, module) pairs) compute in ``options.compute``, checked
    before anything is uploaded: the device runs the mode (``compute8.check_device``), and the
    rotation divides each such layer's input width. Conv2d layers and shapes the mode's kernel
    cannot take keep the trainer's dtype, named in one warning."""
    mode = options.compute
    if mode == "bf16":
        return Plan()
    compute8.check_device(mode, device)
    grad_compute = compute8.check_grad_compute(mode, options.grad_compute)
    out = Plan(mode)
    for name, m in streamed:
        why = fallback_reason(mode, m)
        if why is not None:
            out.fallbacks[name] = why
            continue
        compute8.check_rotation(options.rotation, m.weight.shape[1], name)
        out.layers[name] = Layer8(name, mode, options.rotation, grad_compute, out.stats)
    if out.fallbacks:
        listed = ", ".join(f"{n!r} ({why})" for n, why in out.fallbacks.items())
        warnings.warn(
            f"attach(compute={mode!r}): {len(out.fallbacks)} streamed layers compute in the "
            f"trainer's dtype as with compute='bf16' (Handle.stats()['compute_fallbacks']): "
            f"{listed}; ignore=[...] keeps such a layer on the device instead",
            stacklevel=3,
        )
    return out


def fallback_reason(mode: str, m: nn.Module) -> str | None:
    if packed.claims(m):
        return f"{packed.form_of(m).name}: a packed layer computes with its quantizer's forward"
    if isinstance(m, nn.Conv2d):
        return "Conv2d: 8-bit compute takes nn.Linear layers"
    if not isinstance(m, nn.Linear):
        return f"{type(m).__name__}: 8-bit compute takes nn.Linear layers"
    n, k = m.weight.shape
    return compute8.untileable(mode, n, k)


def upload_forms(plan_: Plan, streamed, fmt: str | None, torchao: set[str]) -> dict:
    """The weights of the plan's layers as they are uploaded, by layer name: prepared once
    (``compute8.prepare``, rotation included) from the weight, or with ``quantize="fp8"``
    (``fmt``) from its fp8_e4m3_block64 dequantization, the weight the model would compute
    with otherwise. A torchao per-row weight of the mode (a name in ``torchao``) without
    rotation is absent: it streams as it is."""
    out = {}
    for name, m in streamed:
        layer = plan_.layers.get(name)
        if layer is None:
            continue
        w = m.weight
        if name in torchao:
            if torchao_weights.format_of(w) == UPLOAD_FORMATS[layer.mode] and not layer.rotation:
                continue
        else:
            w = w.detach()
            if fmt is not None:
                w = quantize.w_hat(w)
        w8 = compute8.prepare(w, layer.mode, rotation=layer.rotation, name=name)
        data, scale = w8.data, w8.scale.reshape(-1, 1)
        if data.device.type != "cpu":
            # Prepared where the weight is (fast), held in host memory until the upload copies
            # it: the 8-bit forms of a model on the device beside its own weights (32 GB beside
            # FLUX.2's 64 GB) would not fit the card while attach has both.
            data, scale = data.cpu(), scale.cpu()
        out[name] = Fp8Weight(data, scale, UPLOAD_FORMATS[layer.mode], m.weight.dtype)
    return out


def check_model(plan_: Plan, model_id: str, manifest):
    """A model the daemon loaded (``attach(model=...)``): each weight of the plan's layers must
    be held in a row format of the mode (``ROW_FORMATS``); 8-bit compute does not quantize per
    call."""
    held = {t.name: t.quantization for t in manifest.tensors}
    for name, layer in plan_.layers.items():
        if layer.rotation:
            # The daemon quantized the weights as they are in the files: a rotation of the
            # activations alone would multiply them by weights it never rotated.
            raise ValueError(
                f"model={model_id!r}: rotation={layer.rotation} needs the weights rotated before "
                "they are quantized, and a model the daemon loaded is not; use rotation=0, or "
                "attach without model= to upload the weights rotated"
            )
        tname = f"{name}.weight"
        got = held.get(tname)
        if got is None or got in ROW_FORMATS[layer.mode]:
            continue  # a missing tensor is _match's to name
        raise ValueError(
            f"model={model_id!r}: compute={layer.mode!r}, but its tensor {tname!r} is held as "
            f"{got} (8-bit compute streams weights with one scale per row, prepared once, not "
            f"requantized at each call); load the model with --quantize {LOAD_AS[layer.mode]} "
            f"(or quantize={LOAD_AS[layer.mode]!r}), or attach without model= to upload it"
        )
