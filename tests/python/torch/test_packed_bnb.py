"""bitsandbytes' 4-bit ``Linear4bit`` streamed as it is (``weightstream.torch.packed``), on the
CPU against the daemon's host backend, with bitsandbytes itself (its CPU backend quantizes,
dequantizes and runs ``Linear4bit.forward``; tests/python/requirements.txt pins it).

- NF4 and FP4, with and without double quantization, on a peft LoRA model's base layers:
  losses, outputs, LoRA and input gradients equal (torch.equal) those of the same Linear4bit
  layers in place, with and without checkpointing and resident groups.
- The daemon holds the packed data and the QuantState's absmax (and, double quantized, its
  offset and nested absmax) byte for byte, under bitsandbytes' state dict names; the code tables
  stay on the device; between calls the layer holds placeholders (its weight and its
  QuantState's tensors); ``detach`` gives back the same bytes and code tables.
- Layouts that do not stream, bitsandbytes' 8-bit layers and GGUF tensors are refused by name
  before anything is uploaded, with what to use.
"""

from __future__ import annotations

import bitsandbytes as bnb  # a declared test requirement: missing, the module fails loudly
import pytest
import torch
from torch import nn
from weightstream import _dtypes
from weightstream.torch import packed, placeholder

from tests.python.torch.test_packed import (
    RUNS,
    as_bytes,
    assert_refused,
    attach_packed,
    train_run,
)
from tests.python.torch.test_torch import make_model
from tests.python.torch.test_torch_fp8 import assert_equal_runs


def linear4bit(lin: nn.Linear, quant_type: str, double: bool, storage=torch.uint8) -> nn.Module:
    """``lin`` as bitsandbytes' Linear4bit, as diffusers' 4-bit loading makes it: the weight a
    Params4bit that bitsandbytes quantizes as the layer moves to its device."""
    m = bnb.nn.Linear4bit(
        lin.in_features,
        lin.out_features,
        bias=lin.bias is not None,
        compress_statistics=double,
        quant_type=quant_type,
        quant_storage=storage,
    )
    m.weight = bnb.nn.Params4bit(
        lin.weight.detach().clone(),
        requires_grad=False,
        compress_statistics=double,
        quant_type=quant_type,
        quant_storage=storage,
        module=m,
    )
    if lin.bias is not None:
        m.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
    return m.to("cpu")


def bnb_model(quant_type: str, double: bool, dtype):
    """``test_torch``'s peft LoRA model with its base layers as Linear4bit."""
    model = make_model(dtype)
    for n, m in list(model.named_modules()):
        if n.endswith("base_layer"):
            parent, _, child = n.rpartition(".")
            setattr(model.get_submodule(parent), child, linear4bit(m, quant_type, double))
    return model


def layers(model) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def streamed_state(m) -> dict[str, torch.Tensor]:
    """What streams of a Linear4bit, by its state dict name, read off bitsandbytes' objects."""
    w = m.weight
    qs = w.quant_state
    out = {"weight": w.data, "weight.absmax": qs.absmax}
    if qs.nested:
        out["weight.offset"] = qs.offset
        out["weight.nested_absmax"] = qs.state2.absmax
    return {k: t.detach().clone() for k, t in out.items()}


def code_tables(m) -> list[torch.Tensor]:
    qs = m.weight.quant_state
    return [qs.code.clone()] + ([qs.state2.code.clone()] if qs.nested else [])


#: The 18 base layers: 147456 weights, 4 bits each, and per 64 an absmax of float32 (or,
#: double quantized, of one byte, with per layer one float32 offset and one nested absmax).
WEIGHTS = 147456
NBYTES = {False: WEIGHTS // 2 + WEIGHTS // 64 * 4, True: WEIGHTS // 2 + WEIGHTS // 64 + 18 * 8}
STAYS = "the code tables (quant_state.code; state2.code with double quantization)"


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double", [False, True], ids=["single", "double"])
@pytest.mark.parametrize("dtype,ckpt,autocast,group_by,where", RUNS)
def test_attach_equals_the_same_linear4bit_layers_in_place(
    daemon, quant_type, double, dtype, ckpt, autocast, group_by, where
):
    ref, streamed = bnb_model(quant_type, double, dtype), bnb_model(quant_type, double, dtype)
    ref.ckpt = streamed.ckpt = ckpt
    form = f"bnb.{quant_type}"
    mods = layers(streamed)
    assert len(mods) == 18 and {packed.form_of(m).name for m in mods.values()} == {form}
    state = {n: streamed_state(m) for n, m in mods.items()}
    codes = {n: code_tables(m) for n, m in mods.items()}
    handle = attach_packed(daemon.client, streamed, mods, group_by, where)
    # The daemon holds each streamed tensor as it is, under bitsandbytes' state dict names.
    (manifest,) = daemon.client.list_models().models
    held = {t.name: t for t in manifest.tensors}
    names = ["weight", "weight.absmax"] + (["weight.offset", "weight.nested_absmax"] * double)
    for name, tensors in state.items():
        assert list(tensors) == names
        for k, t in tensors.items():
            h = held[f"{name}.{k}"]
            assert (h.quantization, h.dtype, list(h.shape), h.nbytes, h.format) == (
                "none",
                _dtypes.to_wire(t.dtype),
                list(t.shape),
                t.nbytes,
                form,
            ), (name, k)
    nbytes = NBYTES[double]
    formats = {f.format: (f.tensors, f.bytes, f.weights) for f in manifest.formats}
    assert formats[form] == (18 * len(names), nbytes, WEIGHTS), formats
    assert handle.stats()["packed_formats"] == {
        form: {
            "layers": 18,
            "bytes": nbytes,
            "weights": WEIGHTS,
            "bytes_per_weight": {False: 0.5625, True: 0.5166}[double],
            "bits_per_weight": {False: 4.5, True: 4.133}[double],
            "stays": STAYS,
        }
    }
    # Between calls the layer holds placeholders: its weight and its QuantState's tensors
    # (on the weight's stand-in and on the module); the code tables stay.
    for name, m in mods.items():
        qs = m.quant_state
        kept = [m.weight, qs.absmax] + ([qs.offset, qs.state2.absmax] if double else [])
        assert [placeholder.is_placeholder(t) for t in kept] == [True] * len(kept), name
        assert [t.streamed_name for t in kept] == [f"{name}.{k}" for k in names]
        assert torch.equal(qs.code, codes[name][0])
    assert_equal_runs(train_run(ref, [], dtype, autocast), train_run(streamed, [], dtype, autocast))
    handle.detach(release=True)
    # bitsandbytes' state again: the same bytes, code tables and attributes.
    for name, m in layers(streamed).items():
        assert type(m.weight) is bnb.nn.Params4bit and m.quant_state is m.weight.quant_state
        assert (m.weight.quant_type, m.weight.bnb_quantized, m.weight.module) == (
            quant_type,
            True,
            m,
        )
        back = streamed_state(m)
        assert list(back) == names, name
        for k, t in state[name].items():
            assert back[k].dtype == t.dtype and torch.equal(as_bytes(back[k]), as_bytes(t))
        assert all(torch.equal(a, b) for a, b in zip(code_tables(m), codes[name], strict=True))
    assert daemon.client.list_models().models == []


# --- refusals ------------------------------------------------------------------------------


class GGUFParameter(nn.Parameter):
    """A stand-in for diffusers' ``GGUFParameter`` (``diffusers.quantizers.gguf.utils``, which
    needs the ``gguf`` package): its type's name and module, GGML bytes and a quant type."""

    def __new__(cls, data, quant_type=None):
        self = torch.Tensor._make_subclass(cls, data, False)
        self.quant_type = quant_type
        return self


GGUFParameter.__module__ = "diffusers.quantizers.gguf.utils"


def refused_case(case: str) -> nn.Sequential:
    """Three bf16 layers; the middle one ('1') in the form of ``case``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    model = model.to(torch.bfloat16).requires_grad_(False)
    if case.startswith("nf4"):
        storage = torch.bfloat16 if "bf16 storage" in case else torch.uint8
        model[1] = linear4bit(model[1], "nf4", double=False, storage=storage)
        qs = model[1].weight.quant_state
        if case == "nf4, an absmax of bf16":
            qs.absmax = qs.absmax.to(torch.bfloat16)
        elif case == "nf4 in bf16 storage, requiring grad":
            model[1].weight.requires_grad_(True)
        elif case == "nf4, repacked for the CPU kernel":
            w = model[1].weight
            w.data, w.quant_state = bnb.functional._convert_weight_packed_for_cpu(w.data, qs)
    elif case == "4-bit, not quantized yet":
        model[1] = bnb.nn.Linear4bit(64, 64, quant_type="nf4").to(torch.bfloat16)
        model[1].requires_grad_(False)
    elif case == "8-bit":
        model[1] = bnb.nn.Linear8bitLt(64, 64, has_fp16_weights=False).to("cpu")
    elif case == "gguf":
        model[1].weight = GGUFParameter(torch.zeros(64, 36, dtype=torch.uint8), quant_type=12)
    return model


INSTEAD = (
    "stream a form weightstream takes (torchao's NF4Tensor and IntxUnpackedToInt8Tensor, "
    "ai-toolkit's OstrisLinear of uint2..uint7, convrotint2..convrotint8, nvfp4, convrot8, "
    "convrot4, bitsandbytes' Linear4bit of nf4 and fp4), load the model unquantized "
    "(quantize='fp8' streams it in 8 bits), or keep the layer on the device (ignore=['1'])"
)
NF4 = "cannot stream '1': it is bitsandbytes' Linear4bit of quant_type 'nf4' (bnb.nf4), which "
REFUSALS = {
    "nf4, an absmax of bf16": NF4 + "has weight.absmax of torch.bfloat16 [64]; bnb.nf4 holds "
    "torch.float32 [64]: " + INSTEAD,
    "nf4, repacked for the CPU kernel": NF4 + "was repacked for bitsandbytes' CPU kernel "
    "(quant_state.packing_format_for_cpu, after an inference forward on an AVX512-BF16 CPU), "
    "not the layout Linear4bit holds on a GPU: " + INSTEAD,
    "nf4 in bf16 storage, requiring grad": "cannot stream '1': it is bitsandbytes' Linear4bit "
    "of quant_type 'nf4', whose weight requires grad: a packed base weight is frozen; freeze it "
    "(module.weight.requires_grad_(False)) or keep the layer on the device (ignore=['1'])",
    "4-bit, not quantized yet": NF4 + "is not quantized yet (no quant_state): bitsandbytes "
    "quantizes a Linear4bit as it moves to its device; move the model there (model.to(device)) "
    "first: " + INSTEAD,
    "8-bit": "cannot stream '1': it is bitsandbytes' 8-bit Linear8bitLt (LLM.int8()), whose "
    "forward keeps and changes its own int8 state (CB, SCB, the outlier columns) as it runs, a "
    "quantized form weightstream does not stream: load the model in 4 bits instead "
    "(bitsandbytes' Linear4bit, nf4 or fp4, streams as it is) or unquantized (quantize='fp8' "
    "streams it in 8 bits), or keep the layer on the device (ignore=['1'])",
    "gguf": "cannot stream '1': it is a GGUF tensor (GGUFParameter of "
    "diffusers.quantizers.gguf.utils: GGML blocks, which only its loader's kernels read), a "
    "quantized form weightstream does not stream: load the model from its bf16/fp16 "
    "safetensors instead and stream it in 8 bits (quantize='fp8') or in 4 bits as "
    "bitsandbytes' Linear4bit (nf4) or torchao's NF4Tensor, or keep the layer on the device "
    "(ignore=['1'])",
}


def test_bitsandbytes_and_gguf_forms_that_do_not_stream_are_refused_by_name(daemon):
    assert_refused(daemon, REFUSALS, refused_case, kept="8-bit")
