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
from weightstream.torch import packed, placeholder, policy

from tests.python.ai_toolkit.test_ai_toolkit import toolkit  # noqa: F401 - a fixture
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
    "convrot4": aitk.ConvRot4,
    "convrotint3": lambda: aitk.ConvRotIntN(3),
    "convrotint8": lambda: aitk.ConvRotIntN(8),
}


def torchao_model(form: str, dtype):
    model = make_model(dtype)
    {"torchao.NF4Tensor": _nf4, "torchao.IntxUnpackedToInt8Tensor": _int4}[form](model)
    return model, []


def aitk_model(qtype: str, dtype, ara_first: bool = False):
    """``test_torch``'s model without peft: its blocks' Linears are ai-toolkit's OstrisLinear of
    ``qtype``, each with a trainable ARA (kept outside the model, as ai-toolkit's network is),
    applied after quantizing or, ``ara_first``, before (ai-toolkit's ``quantize_model``)."""
    model = make_model(dtype)
    model = _unwrap_peft(model)
    aras = []
    torch.manual_seed(3)
    for n, m in list(model.named_modules()):
        if n.split(".")[-1] in BASE:
            if ara_first:
                aras.append(aitk.ara_first(m, QUANTIZERS[qtype]()).to(dtype))
            else:
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


def build(form: str, dtype, device: str = "cpu"):
    """``form``'s model and its ARAs (none for torchao's forms), made on the CPU and moved to
    ``device`` (the packed inner tensors with them)."""
    if form.startswith("torchao."):
        model, aras = torchao_model(form, dtype)
    else:
        model, aras = aitk_model(form.removeprefix("aitk."), dtype)
    return model.to(device), [ara.to(device) for ara in aras]


ARA = "the ARA side LoRA (ara_lora_ref), trainable or frozen as ai-toolkit made it"
#: What each form's summary says stays on the device.
STAYS = {
    "torchao.NF4Tensor": "the weight's flatten context (attributes, no tensor)",
    "torchao.IntxUnpackedToInt8Tensor": "the weight's flatten context (attributes, no tensor)",
    "aitk.uint4": ARA,
    "aitk.uint3": ARA,
    "aitk.nvfp4": ARA,
    "aitk.convrot8": f"cr8_rot_size; {ARA}",
    "aitk.convrot4": f"cr_rot_size; {ARA}",
    "aitk.convrotint3": f"crn_bits, crn_rot_size; {ARA}",
    "aitk.convrotint8": f"crn_bits, crn_rot_size; {ARA}",
}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.numel(), dtype=t.dtype)  # strides of 1 (a size-1 dim may have any)
    return out.copy_(t.detach().reshape(-1)).view(torch.uint8)


def packed_layers(model) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if packed.form_of(m) is not None}


def train_run(model, aras, dtype, autocast=False, steps=3, device="cpu"):
    """``run`` with the ARAs' parameters trained too (AdamW over every trainable parameter),
    its inputs on ``device``."""
    holder = nn.ModuleList([model, *aras])
    holder.forward = model.forward
    return run(holder, steps, dtype, device=device, sample_between=True, autocast=autocast)


FORMS = [
    "torchao.NF4Tensor",
    "torchao.IntxUnpackedToInt8Tensor",
    "aitk.uint4",
    "aitk.uint3",
    "aitk.nvfp4",
    "aitk.convrot8",
    "aitk.convrot4",
    "aitk.convrotint3",
    "aitk.convrotint8",
]


def attach_packed(
    client, streamed, layers: dict, group_by: str, where: str, device: str = "cpu", **options
):
    """``streamed`` attached on ``device`` with a staging arena of three of its largest groups
    and, where ``where`` is "mixed", room for its three smallest groups to stay resident
    ("streamed": none); checks the groups are the sizes policy lays out with the packed
    ``layers``. ``options``: more of ``attach``'s."""
    selected = policy.select(streamed, wst.StreamOptions(min_bytes=0)).streamed
    packs = {n: packed.Packed.of(m) for n, m in selected if n in layers}
    alignment = client.info().alignment
    sizes = policy.choose_groups(streamed, selected, group_by, alignment, None, 0, packs=packs)
    staging = 3 * max(sizes.sizes)
    budget = staging if where == "streamed" else staging + sum(sorted(sizes.sizes)[:3])
    handle = wst.attach(
        streamed,
        device,
        client=client,
        min_bytes=0,
        vram_budget=budget,
        staging_bytes=staging,
        group_by=group_by,
        **options,
    )
    assert [g.nbytes for g in handle.session.groups] == sizes.sizes
    resident = [g.resident for g in handle.session.groups]
    assert any(resident) == (where == "mixed") and not all(resident), resident
    return handle


def packed_equality(
    client, form, dtype, ckpt, autocast, group_by, where, device: str = "cpu"
) -> dict:
    """``form``'s model (``build``) on ``device`` streamed as it is (``attach_packed``) against
    the same packed layers in place there: the daemon holds each inner tensor byte for byte,
    the summary names the form with its bytes per weight, the runs (``train_run``) are equal
    (torch.equal), and ``detach`` gives the quantizer's state back, the same bytes. Returns the
    handle's stats, read before ``detach``. The CPU test below and the GPU suite's
    "equal: packed ..." checks (``tests/gpu/torch_suite.py``, ``device="cuda"``)."""
    (ref, ref_aras), (streamed, aras) = build(form, dtype, device), build(form, dtype, device)
    ref.ckpt = streamed.ckpt = ckpt
    layers = packed_layers(streamed)
    assert len(layers) == 18 and {packed.form_of(m).name for m in layers.values()} == {form}
    inner = {
        n: {k: t.clone() for k, t in packed.inner(m, packed.form_of(m)).items()}
        for n, m in layers.items()
    }
    handle = attach_packed(client, streamed, layers, group_by, where, device)
    model_id = handle.model_id
    # The daemon holds each inner tensor as it is: its dtype, shape and bytes.
    (model,) = [m for m in client.list_models().models if m.model_id == model_id]
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
    stats = handle.stats()
    nbytes = sum(t.nbytes for ts in inner.values() for t in ts.values())
    weights = sum(m.in_features * m.out_features for m in layers.values())
    assert stats["packed_formats"] == {
        form: {
            "layers": 18,
            "bytes": nbytes,
            "weights": weights,
            "bytes_per_weight": round(nbytes / weights, 4),
            "bits_per_weight": round(8 * nbytes / weights, 3),
            "stays": STAYS[form],
        }
    }
    assert_equal_runs(
        train_run(ref, ref_aras, dtype, autocast, device=device),
        train_run(streamed, aras, dtype, autocast, device=device),
    )
    stats = handle.stats()
    handle.detach(release=True)
    # The quantizer's state again, the same bytes.
    for name, tensors in inner.items():
        back = packed.inner(
            streamed.get_submodule(name), packed.form_of(streamed.get_submodule(name))
        )
        assert set(back) == set(tensors), name
        for k, t in tensors.items():
            assert torch.equal(as_bytes(back[k]), as_bytes(t)), (name, k)
    assert model_id not in {m.model_id for m in client.list_models().models}
    return stats


#: (dtype, checkpointing, autocast, group_by, where) of the packed layers' equality tests.
RUNS = [
    (torch.bfloat16, None, False, "layer", "streamed"),
    (torch.bfloat16, "non-reentrant", False, "block", "mixed"),
    (torch.float32, "reentrant", True, "layer", "streamed"),
    # A group a layer in a non-reentrant checkpoint: the staging space of a layer's codes is
    # reused before its backward, which may keep them (convrot8's Function does).
    (torch.bfloat16, "non-reentrant", False, "layer", "streamed"),
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype,ckpt,autocast,group_by,where", RUNS)
def test_attach_equals_the_same_packed_layers_in_place(
    daemon, form, dtype, ckpt, autocast, group_by, where
):
    packed_equality(daemon.client, form, dtype, ckpt, autocast, group_by, where)
    assert daemon.client.list_models().models == []


@pytest.mark.parametrize("dequantize,more", [("auto", 0), ("layer", 1)])
def test_in_a_checkpoint_a_packed_layers_quantizer_runs_as_often_as_in_place(
    daemon, monkeypatch, dequantize, more
):
    """Under torch's non-reentrant checkpoint the backward runs on the recompute's forward, as
    in place (twice a layer and step); ``dequantize="layer"`` runs it once more for the input
    gradient, holding one layer's dequantized weight at a time."""
    calls = []
    forward = aitk.UIntX.forward
    monkeypatch.setattr(aitk.UIntX, "forward", lambda q, m, x: calls.append(m) or forward(q, m, x))
    (ref, ref_aras), (streamed, aras) = (
        build("aitk.uint4", torch.bfloat16),
        build("aitk.uint4", torch.bfloat16),
    )
    ref.ckpt = streamed.ckpt = "non-reentrant"
    layers = packed_layers(streamed)
    handle = attach_packed(
        daemon.client, streamed, layers, "layer", "streamed", dequantize=dequantize
    )
    runs = []
    for model, model_aras in ((ref, ref_aras), (streamed, aras)):
        calls.clear()
        runs.append(train_run(model, model_aras, torch.bfloat16, steps=2))
        runs.append(len(calls))
    assert_equal_runs(runs[0], runs[2])
    # 18 layers, 2 steps: a forward, the checkpoint's recompute and a sampling pass each.
    assert runs[1] == 18 * 2 * 3
    assert runs[3] == runs[1] + 18 * 2 * more
    handle.detach(release=True)


@pytest.mark.parametrize("qtype", ["uint4", "uint3"])
def test_an_ara_applied_before_quantizing_runs_as_ai_toolkit_runs_it(daemon, qtype):
    """ai-toolkit applies an accuracy recovery adapter to the Linear, then quantizes the layer
    (``quantize_model``): the ARA's ``org_forward`` stays ``nn.Linear.forward``, which reads the
    dequantizing ``weight`` property, not the quantizer's forward. The streamed layer runs that
    same function on its streamed buffers: losses and gradients equal the layers in place. Once
    attached, the property gives a placeholder of the weight (ai-toolkit's LoRA network reads
    every layer's ``weight`` when it is made, after the loader attached the model); detached,
    the dequantized weight again."""
    dtype = torch.bfloat16
    (ref, ref_aras), (streamed, aras) = (aitk_model(qtype, dtype, ara_first=True) for _ in "ab")
    layers = packed_layers(streamed)
    name, layer = next(iter(layers.items()))
    before = layer.weight
    handle = attach_packed(daemon.client, streamed, layers, "layer", "streamed")
    w = layer.weight
    assert placeholder.is_placeholder(w) and not isinstance(w, nn.Parameter)
    assert (w.shape, w.dtype, w.streamed_name) == (before.shape, dtype, f"{name}.weight")
    assert_equal_runs(train_run(ref, ref_aras, dtype), train_run(streamed, aras, dtype))
    handle.detach(release=True)
    assert torch.equal(layer.weight, before)


@pytest.mark.parametrize("form", FORMS)
def test_the_daemon_shows_each_packed_form_with_its_bits_per_weight(daemon, form):
    """The upload labels a packed layer's inner tensors with its form and the layer's weights:
    the daemon's status, as the client sees it (``list_models``), shows the form with its
    tensors, bytes and bits per weight, those of ``Handle.stats()["packed_formats"]``; every
    other tensor counts under its dtype."""
    model, _ = build(form, torch.bfloat16)
    layers = {n: packed.inner(m, packed.form_of(m)) for n, m in packed_layers(model).items()}
    nbytes = sum(t.nbytes for inner in layers.values() for t in inner.values())
    count = sum(len(inner) for inner in layers.values())
    weights = sum(m.in_features * m.out_features for m in packed_layers(model).values())
    handle = wst.attach(model, "cpu", client=daemon.client, min_bytes=0)
    (manifest,) = daemon.client.list_models().models
    formats = {f.format: (f.tensors, f.bytes, f.weights) for f in manifest.formats}
    assert formats[form] == (count, nbytes, weights), formats
    (use,) = [f for f in manifest.formats if f.format == form]
    assert use.bits_per_weight == 8 * nbytes / weights
    assert (
        round(use.bits_per_weight, 3) == handle.stats()["packed_formats"][form]["bits_per_weight"]
    )
    assert set(formats) - {form} == {"bf16"}, formats
    assert sum(f.tensors for f in manifest.formats) == len(manifest.tensors)
    labelled = [t for t in manifest.tensors if t.format]
    assert len(labelled) == count and {t.format for t in labelled} == {form}
    assert sum(t.weights for t in labelled) == weights
    handle.detach(release=True)


# --- refusals ------------------------------------------------------------------------------


class OrbitQuantizer:
    """A stand-in for a quantizer of a qtype that does not stream."""

    qtype = "orbit4"

    def quantize(self, m, w):
        m.register_buffer("orbit_codes", w.to(torch.int8), persistent=False)


def refused_case(case: str) -> nn.Sequential:
    """Three bf16 layers; the middle one ('1') in the form of ``case``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    model = model.to(torch.bfloat16).requires_grad_(False)
    middle = model[1]
    if case == "orbit4":
        aitk.convert(middle, OrbitQuantizer())
    elif case.startswith("uint4"):
        aitk.convert(middle, aitk.UIntX(4))
        if case == "uint4, a scale of bf16":
            middle.uintx_scale = middle.uintx_scale.view(torch.bfloat16)
        elif case == "uint4, no zero points":
            del middle._buffers["uintx_zero_point"]
        elif case == "uint4, an ARA of another size":
            aitk.Ara(middle)
            middle.ara_lora_ref().lora_down = nn.Linear(32, 4, bias=False)
    elif case == "convrot8, a rotation of 48":
        aitk.convert(middle, aitk.ConvRot8())
        middle.cr8_rot_size = 48
    elif case == "nf4 requiring grad":
        middle.weight = nn.Parameter(to_nf4(middle.weight.detach(), 64, 64))
    elif case == "int4 on a Conv2d":
        model[1] = nn.Conv2d(64, 64, 1).to(torch.bfloat16).requires_grad_(False)
        config = IntxWeightOnlyConfig(weight_dtype=torch.int4)
        quantize_(model[1], config, filter_fn=lambda m, fqn: True)
        assert packed.form_of(model[1]) is not None
    return model


INSTEAD = (
    "stream a form weightstream takes (torchao's NF4Tensor and IntxUnpackedToInt8Tensor, "
    "ai-toolkit's OstrisLinear of uint2..uint7, convrotint2..convrotint8, nvfp4, convrot8, "
    "convrot4, bitsandbytes' Linear4bit of nf4 and fp4), load the model unquantized "
    "(quantize='fp8' streams it in 8 bits), or keep the layer on the device (ignore=['1'])"
)
UINT4 = "cannot stream '1': it is ai-toolkit's OstrisLinear of qtype 'uint4' (aitk.uint4), which "
REFUSALS = {
    "orbit4": "cannot stream '1': it is ai-toolkit's OstrisLinear of qtype 'orbit4' "
    "(OrbitQuantizer), a packed form weightstream does not stream: " + INSTEAD,
    "uint4, a scale of bf16": UINT4 + "has uintx_scale of torch.bfloat16 [64, 1]; aitk.uint4 "
    "holds torch.uint8 [64, 2]: " + INSTEAD,
    "uint4, no zero points": UINT4 + "holds tensors ['uintx_packed', 'uintx_scale'], not the "
    "layout of aitk.uint4 (['uintx_packed', 'uintx_scale', 'uintx_zero_point']; missing "
    "['uintx_zero_point'], unknown []): " + INSTEAD,
    "uint4, an ARA of another size": UINT4 + "has an ARA of in/out [32, 64] on a layer of "
    "in/out [64, 64]: " + INSTEAD,
    "convrot8, a rotation of 48": "cannot stream '1': it is ai-toolkit's OstrisLinear of qtype "
    "'convrot8' (aitk.convrot8), which has cr8_rot_size 48, which does not divide in_features "
    "64: " + INSTEAD,
    "nf4 requiring grad": "cannot stream '1': its weight is a NF4Tensor made by torchao, which "
    "requires grad: a packed base weight is frozen; freeze it "
    "(module.weight.requires_grad_(False)) or keep the layer on the device (ignore=['1'])",
    "int4 on a Conv2d": "cannot stream '1': its weight is a IntxUnpackedToInt8Tensor made by "
    "torchao, on a Conv2d: packed torchao weights stream on nn.Linear layers with Linear's own "
    "forward; keep the layer on the device (ignore=['1'])",
}


def assert_refused(daemon, refusals: dict[str, str], make_case, kept: str):
    """Each case of ``refusals`` (``make_case(case)``: a model whose layer '1' is refused)
    fails attach with its exact message and uploads nothing; the case ``kept``, its layer
    ignored, streams the rest with the layer in place."""
    bad = []
    for case, want in refusals.items():
        model = make_case(case)
        try:
            wst.attach(model, "cpu", client=daemon.client, min_bytes=0)
            got = "attached"
        except wst.QuantizedWeight as e:
            got = str(e)
        if got != want:
            bad.append(f"{case}:\n  want {want}\n  got  {got}")
        if daemon.client.list_models().models or daemon.client.info().usage.uploads:
            bad.append(f"{case}: something was uploaded")
    assert not bad, "\n".join(bad)
    handle = wst.attach(make_case(kept), "cpu", client=daemon.client, min_bytes=0, ignore=["1"])
    assert set(handle.streamed) == {"0", "2"}
    assert handle.stats()["packed_formats"] == {}
    handle.detach(release=True)


def test_packed_forms_that_do_not_stream_are_refused_before_anything_is_uploaded(daemon):
    assert_refused(daemon, REFUSALS, refused_case, kept="orbit4")


# --- through ai-toolkit's MemoryManager ------------------------------------------------------


@pytest.mark.parametrize("qtype", ["uint4", "convrot8"])
def test_ai_toolkits_memory_manager_streams_its_packed_layers_with_their_adapters(
    daemon, request, qtype
):
    """``MemoryManager.attach`` (what ai-toolkit calls under ``weightstream-aitk``) streams
    the OstrisLinear layers as they are; the ARAs stay on the device and train, equal to the
    same model in place. (``toolkit``: test_ai_toolkit's fixture, a ``toolkit`` package under
    the launcher.)"""
    aitk_package = request.getfixturevalue("toolkit").package
    dtype = torch.bfloat16
    (ref, ref_aras), (streamed, aras) = aitk_model(qtype, dtype), aitk_model(qtype, dtype)
    manager = aitk_package.MemoryManager.attach(streamed, "cpu")
    assert set(packed_layers(ref)) <= set(manager.handle.streamed)
    assert list(manager.handle.stats()["packed_formats"]) == [f"aitk.{qtype}"]
    assert_equal_runs(train_run(ref, ref_aras, dtype), train_run(streamed, aras, dtype))
    aitk_package.MemoryManager.free(streamed)
