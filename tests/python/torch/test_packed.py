"""Packed quantized layers streamed as they are (``weightstream.torch.packed``), on the CPU
against the daemon's host backend.

- torchao 0.18's ``NF4Tensor`` (4 bits a weight, two codes a byte) and
  ``IntxUnpackedToInt8Tensor`` of an int4 config on a peft LoRA model's base layers, and
  ai-toolkit's ``OstrisLinear`` forms (``uint4``, ``uint3``, ``nvfp4``, ``convrot8``, through
  the stand-ins of ``aitk_layouts``) with an accuracy recovery adapter that trains: losses,
  outputs, trainable and input gradients equal (torch.equal) those of the same quantized model
  in place, with and without checkpointing and resident groups.
- The daemon holds each inner tensor byte for byte (its dtype, shape and bytes), the summary
  names each format and its bytes per weight, and ``detach`` gives the quantizer's state back.
- Forms that do not stream are refused before anything is uploaded, naming the layer, the form,
  the rule and what to use.
"""

from __future__ import annotations

import pytest
import torch
import weightstream.torch as wst
from torch import nn
from torchao.quantization import IntxWeightOnlyConfig, to_nf4
from torchao.quantization.granularity import PerGroup
from torchao.quantization.quant_api import quantize_
from weightstream import _dtypes
from weightstream.torch import packed, policy

from tests.python.torch import aitk_layouts as aitk
from tests.python.torch.test_torch import make_model
from tests.python.torch.test_torch_fp8 import assert_equal_runs, run

BASE = ("q", "k", "v", "o", "fc1", "fc2")


def _nf4(model):
    for n, m in model.named_modules():
        if n.endswith("base_layer"):
            m.weight = nn.Parameter(to_nf4(m.weight.detach(), 64, 64), requires_grad=False)


def _int4(model):
    config = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
    quantize_(model, config, filter_fn=lambda m, fqn: fqn.endswith("base_layer"))


QUANTIZERS = {
    "uint4": lambda: aitk.UIntX(4),
    "uint3": lambda: aitk.UIntX(3),
    "nvfp4": lambda: aitk.Nvfp4(pre_scale=True),
    "convrot8": aitk.ConvRot8,
}


def torchao_model(form: str, dtype):
    model = make_model(dtype)
    {"torchao.NF4Tensor": _nf4, "torchao.IntxUnpackedToInt8Tensor": _int4}[form](model)
    return model, []


def aitk_model(qtype: str, dtype):
    """``test_torch``'s model without peft: its blocks' Linears are ai-toolkit's OstrisLinear of
    ``qtype``, each with a trainable ARA (kept outside the model, as ai-toolkit's network is)."""
    model = make_model(dtype)
    model = _unwrap_peft(model)
    aras = []
    torch.manual_seed(3)
    for n, m in list(model.named_modules()):
        if n.split(".")[-1] in BASE:
            aitk.convert(m, QUANTIZERS[qtype]())
            aras.append(aitk.Ara(m).to(dtype))
    return model, aras


def _unwrap_peft(model):
    for n, m in list(model.named_modules()):
        base = getattr(m, "base_layer", None)
        if isinstance(base, nn.Linear) and n:
            parent, _, child = n.rpartition(".")
            setattr(model.get_submodule(parent), child, base)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def build(form: str, dtype):
    if form.startswith("torchao."):
        return torchao_model(form, dtype)
    return aitk_model(form.removeprefix("aitk."), dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.numel(), dtype=t.dtype)  # strides of 1 (a size-1 dim may have any)
    return out.copy_(t.detach().reshape(-1)).view(torch.uint8)


def packed_layers(model) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if packed.form_of(m) is not None}


def train_run(model, aras, dtype, steps=3):
    """``run`` with the ARAs' parameters trained too (AdamW over every trainable parameter)."""
    holder = nn.ModuleList([model, *aras])
    holder.forward = model.forward
    return run(holder, steps, dtype, sample_between=True)


FORMS = [
    "torchao.NF4Tensor",
    "torchao.IntxUnpackedToInt8Tensor",
    "aitk.uint4",
    "aitk.uint3",
    "aitk.nvfp4",
    "aitk.convrot8",
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "ckpt,group_by,where", [(None, "layer", "streamed"), ("non-reentrant", "block", "mixed")]
)
def test_attach_equals_the_same_packed_layers_in_place(daemon, form, ckpt, group_by, where):
    dtype = torch.bfloat16
    (ref, ref_aras), (streamed, aras) = build(form, dtype), build(form, dtype)
    ref.ckpt = streamed.ckpt = ckpt
    layers = packed_layers(streamed)
    assert len(layers) == 18 and {packed.form_of(m).name for m in layers.values()} == {
        form.replace("aitk.", "aitk.")
    }
    inner = {
        n: {k: t.clone() for k, t in packed.inner(m, packed.form_of(m)).items()}
        for n, m in layers.items()
    }
    selected = policy.select(streamed, wst.StreamOptions(min_bytes=0)).streamed
    packs = {n: packed.Packed.of(m) for n, m in selected if n in layers}
    alignment = daemon.client.info().alignment
    sizes = policy.choose_groups(streamed, selected, group_by, alignment, None, 0, packs=packs)
    staging = 3 * max(sizes.sizes)
    budget = staging if where == "streamed" else staging + sum(sorted(sizes.sizes)[:3])
    handle = wst.attach(
        streamed,
        "cpu",
        client=daemon.client,
        min_bytes=0,
        vram_budget=budget,
        staging_bytes=staging,
        group_by=group_by,
    )
    assert [g.nbytes for g in handle.session.groups] == sizes.sizes
    resident = [g.resident for g in handle.session.groups]
    assert any(resident) == (where == "mixed") and not all(resident), resident
    # The daemon holds each inner tensor as it is: its dtype, shape and bytes.
    (model,) = daemon.client.list_models().models
    held = {t.name: t for t in model.tensors}
    kind = packed.form_of(ref.get_submodule(next(iter(layers)))).kind
    for name, tensors in inner.items():
        where_ = f"{name}.weight." if kind == packed.WEIGHT else f"{name}."
        for k, t in tensors.items():
            h = held[where_ + k]
            assert (h.quantization, h.dtype, list(h.shape), h.nbytes) == (
                "none",
                _dtypes.to_wire(t.dtype),
                list(t.shape),
                t.nbytes,
            ), (name, k)
    summary = handle.stats()["packed_formats"]
    nbytes = sum(t.nbytes for ts in inner.values() for t in ts.values())
    weights = sum(m.in_features * m.out_features for m in layers.values())
    assert summary == {
        form: {
            "layers": 18,
            "bytes": nbytes,
            "weights": weights,
            "bytes_per_weight": round(nbytes / weights, 4),
            "bits_per_weight": round(8 * nbytes / weights, 3),
        }
    }
    assert_equal_runs(train_run(ref, ref_aras, dtype), train_run(streamed, aras, dtype))
    handle.detach(release=True)
    # The quantizer's state again, the same bytes.
    for name, tensors in inner.items():
        back = packed.inner(
            streamed.get_submodule(name), packed.form_of(streamed.get_submodule(name))
        )
        assert set(back) == set(tensors), name
        for k, t in tensors.items():
            assert torch.equal(as_bytes(back[k]), as_bytes(t)), (name, k)
    assert daemon.client.list_models().models == []
