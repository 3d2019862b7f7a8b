"""torchao's quantized weights streamed as they are (torchao 0.18, on the CPU against the daemon's
host backend).

- The formulas (no daemon): ``quantize.dequantize_as`` equals torchao's own ``dequantize()`` and
  ``quantize.linear_as`` equals torchao's own ``F.linear`` (output and input gradient) bit for
  bit, for many shapes, seeds and dtypes; where torchao's linear is not the dequantized weight's
  ``F.linear`` (the int8 one) is shown, not assumed.
- ``attach`` of a LoRA model whose base layers torchao quantized (``Float8WeightOnlyConfig()``,
  ``Int8WeightOnlyConfig()``): the daemon holds ``qdata`` and ``scale`` as torchao made them
  (one byte per weight), and losses, outputs, LoRA and input gradients equal (torch.equal)
  those of the same quantized model in place, with and without checkpointing and autocast;
  ``detach`` gives torchao's tensors back; ai-toolkit's ``MemoryManager.attach`` takes them.
- Every other quantized tensor is refused before anything is uploaded, naming the layer and
  the type or the rule and what to do; a scale the daemon refuses at commit leaves nothing.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
import weightstream.torch as wst
from torch import nn
from torchao.quantization import (
    Float8Tensor,
    Float8WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8Tensor,
    Int8WeightOnlyConfig,
    quantize_,
)
from torchao.quantization.granularity import PerGroup, PerRow, PerTensor
from torchao.quantization.quant_primitives import MappingType
from weightstream import _dtypes, quantize
from weightstream.errors import RequestRejected
from weightstream.integrations.ai_toolkit import MemoryManager
from weightstream.torch import ops, policy, torchao_weights

from tests.python.torch.test_torch import make_model
from tests.python.torch.test_torch_fp8 import assert_equal_runs, run

FLOAT8, INT8 = quantize.TORCHAO_FLOAT8_ROWWISE, quantize.TORCHAO_INT8_ROWWISE
CONFIGS = {FLOAT8: Float8WeightOnlyConfig, INT8: Int8WeightOnlyConfig}
TYPES = {FLOAT8: Float8Tensor, INT8: Int8Tensor}
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
SHAPES = [(1, 1), (7, 13), (48, 100), (64, 64), (33, 256), (256, 1000)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))
    )


def quantized_linear(fmt: str, out: int, inputs: int, dtype, seed: int, bias=True, scale=1.0):
    """An nn.Linear of seeded weights (times ``scale``) that torchao quantized with ``fmt``'s
    config."""
    torch.manual_seed(seed)
    layer = nn.Linear(inputs, out, bias=bias)
    with torch.no_grad():
        layer.weight.mul_(scale)
    layer = layer.to(dtype)
    quantize_(layer, CONFIGS[fmt]())
    assert type(layer.weight) is TYPES[fmt]
    return layer


def streamed_form(layer) -> quantize.Fp8Weight:
    return torchao_weights.upload_form(layer.weight)


# --- the formulas ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [FLOAT8, INT8])
@pytest.mark.parametrize("dtype", FLOATS)
def test_dequantize_as_is_torchaos_dequantize_bit_for_bit(fmt, dtype):
    bad = []
    for (out, inputs), seed, scale in itertools.product(SHAPES, range(3), (1.0, 1e-3, 300.0)):
        w = quantized_linear(fmt, out, inputs, dtype, seed, scale=scale).weight
        got = quantize.dequantize_as(fmt, w.qdata, w.scale, w.dtype)
        if not same_bits(got, w.dequantize()):
            bad.append(f"{out}x{inputs} seed {seed} scale {scale}")
        if not same_bits(quantize.dequantize_weight(torchao_weights.upload_form(w), dtype), got):
            bad.append(f"{out}x{inputs} seed {seed} scale {scale}: dequantize_weight")
    assert not bad, bad


def torchao_and_streamed(layer, x, autocast: bool):
    """(output, input gradient) of torchao's own ``F.linear`` on the layer and of
    ``linear_as`` on its streamed form, for the same upstream gradient."""
    results = []
    for linear in (
        lambda x: F.linear(x, layer.weight, layer.bias),
        lambda x: quantize.linear_as(streamed_form(layer), x, layer.bias),
    ):
        x_ = x.detach().requires_grad_(True)
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = linear(x_)
        grad = torch.ones_like(out).mul_(0.5).add_(out.detach().sin())
        out.backward(grad)
        results.append((out.detach(), x_.grad))
    return results


@pytest.mark.parametrize("fmt", [FLOAT8, INT8])
def test_linear_as_is_torchaos_linear_bit_for_bit(fmt):
    """Outputs and input gradients of 2-D, 3-D and non-contiguous inputs, with and without a
    bias, in each dtype and under autocast; and the float8 input-gradient formula
    (``ops.input_grad``) gives autograd's gradient of torchao's linear."""
    bad = []
    cases = itertools.product(
        [(7, 13), (48, 100), (64, 64)], FLOATS, (True, False), ("2d", "3d", "strided"), (0, 1)
    )
    for (out, inputs), dtype, bias, form, autocast in cases:
        if autocast and dtype != torch.float32:
            continue
        layer = quantized_linear(fmt, out, inputs, dtype, seed=out + inputs, bias=bias)
        g = torch.Generator().manual_seed(inputs)
        shape = {"2d": (5, inputs), "3d": (2, 3, inputs), "strided": (3, 2, inputs)}[form]
        x = torch.randn(*shape, generator=g).to(dtype)
        if form == "strided":
            x = x.transpose(0, 1)  # [2, 3, inputs], not foldable into a matrix as it is
        (want, want_grad), (got, got_grad) = torchao_and_streamed(layer, x, bool(autocast))
        case = f"{out}x{inputs} {dtype} bias={bias} {form} autocast={bool(autocast)}"
        if not torch.equal(got, want) or not torch.equal(got_grad, want_grad):
            bad.append(case)
        if fmt == FLOAT8:
            x_ = x.detach().requires_grad_(True)
            with torch.autocast("cpu", torch.bfloat16, enabled=bool(autocast)):
                out_ = F.linear(x_, layer.weight, layer.bias)
            grad_out = torch.ones_like(out_).mul_(0.5).add_(out_.detach().sin())
            out_.backward(grad_out)
            formula = ops.input_grad(
                layer, x, grad_out, streamed_form(layer), bool(autocast), torch.bfloat16
            )
            if formula is None:  # left to the recompute where the input is not one matrix
                if x.is_contiguous():
                    bad.append(f"{case}: no input_grad formula")
            elif not torch.equal(formula, x_.grad):
                bad.append(f"{case}: input_grad formula")
    assert not bad, bad


def test_int8_linear_is_not_the_dequantized_weights_linear():
    """torchao's int8 weight-only linear multiplies by the scales after the matmul (rounded to
    the input's dtype), so ``F.linear`` of ``dequantize()`` is another result: the streamed
    layer computes torchao's (``linear_as``), not that."""
    layer = quantized_linear(INT8, 64, 64, torch.bfloat16, seed=0)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    own = F.linear(x, layer.weight, layer.bias)
    assert torch.equal(quantize.linear_as(streamed_form(layer), x, layer.bias), own)
    assert not torch.equal(F.linear(x, layer.weight.dequantize(), layer.bias), own)


# --- the daemon's copy ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [FLOAT8, INT8])
def test_an_upload_holds_qdata_and_scales_as_torchao_made_them(daemon, fmt):
    """Data of an odd size (91 bytes: zero padding before the scales), one float32 scale per
    row; a session stages exactly torchao's qdata and scale."""
    layer = quantized_linear(fmt, 7, 13, torch.bfloat16, seed=1)
    w = layer.weight
    manifest, _ = daemon.client.upload_model(
        "one", {"l.weight": torchao_weights.upload_form(w), "l.bias": layer.bias}
    )
    listed = {t.name: t for t in manifest.tensors}
    t = listed["l.weight"]
    wire = _dtypes.to_wire(w.qdata.dtype)
    assert (t.quantization, t.dtype, list(t.shape), list(t.scale_shape)) == (
        fmt,
        wire,
        [7, 13],
        [7, 1],
    )
    assert (t.scale_offset, t.nbytes) == (96, 96 + 7 * 4)
    assert manifest.total_bytes == 124 + 7 * 2
    session = daemon.client.open_session(
        manifest.model_id, [("l", ["l.weight", "l.bias"])], 1 << 20
    )
    ticket = session.acquire(0)
    staged, bias = ticket.tensors
    assert isinstance(staged, quantize.Fp8Weight) and staged.format == fmt
    assert staged.data.dtype == w.qdata.dtype
    assert torch.equal(staged.data.view(torch.uint8), w.qdata.view(torch.uint8))
    assert torch.equal(staged.scale, w.scale) and torch.equal(bias, layer.bias)
    session.release(ticket)
    session.close()
    daemon.client.release_model(manifest.model_id)


# --- attach ----------------------------------------------------------------------------------


def torchao_model(fmt: str, dtype) -> nn.Module:
    """``test_torch``'s LoRA model with its LoRA-wrapped base layers quantized by torchao (the
    others, Conv2d, proj_out and nn.MultiheadAttention's, stay plain)."""
    model = make_model(dtype)
    quantize_(model, CONFIGS[fmt](), filter_fn=lambda m, fqn: fqn.endswith("base_layer"))
    return model


def torchao_layers(model) -> dict[str, nn.Module]:
    """The layers holding a torchao weight, by name."""
    return {
        n: m
        for n, m in model.named_modules()
        if isinstance(m._parameters.get("weight"), (Float8Tensor, Int8Tensor))
    }


@pytest.mark.parametrize(
    "fmt,dtype,ckpt,autocast,group_by,where,input_grad",
    [
        (FLOAT8, torch.bfloat16, None, False, "layer", "streamed", "formula"),
        (FLOAT8, torch.bfloat16, "non-reentrant", False, "block", "mixed", "formula"),
        (FLOAT8, torch.float32, "reentrant", True, "layer", "mixed", "formula"),
        (FLOAT8, torch.bfloat16, None, False, "block", "streamed", "recompute"),
        (INT8, torch.bfloat16, None, False, "layer", "streamed", "formula"),
        (INT8, torch.bfloat16, "reentrant", False, "block", "mixed", "formula"),
        (INT8, torch.float32, "non-reentrant", True, "layer", "streamed", "formula"),
        (INT8, torch.bfloat16, None, False, "block", "mixed", "recompute"),
    ],
)
def test_attach_equals_the_same_torchao_layers_in_place(
    daemon, fmt, dtype, ckpt, autocast, group_by, where, input_grad
):
    ref, streamed = torchao_model(fmt, dtype), torchao_model(fmt, dtype)
    ref.ckpt = streamed.ckpt = ckpt
    quantized = torchao_layers(streamed)
    assert len(quantized) == 18
    layers = policy.select(streamed, wst.StreamOptions(min_bytes=0)).streamed
    alignment = daemon.client.info().alignment
    sizes = policy.choose_groups(streamed, layers, group_by, alignment, None, 0).sizes
    staging = 3 * max(sizes)
    vram_budget = staging if where == "streamed" else staging + sum(sorted(sizes)[:3])
    handle = wst.attach(
        streamed,
        "cpu",
        client=daemon.client,
        min_bytes=0,
        vram_budget=vram_budget,
        staging_bytes=staging,
        group_by=group_by,
        input_grad=input_grad,
    )
    assert [g.nbytes for g in handle.session.groups] == sizes
    resident = [g.resident for g in handle.session.groups]
    assert any(resident) == (where == "mixed") and not all(resident), resident
    assert set(quantized) <= set(handle.streamed)
    # The daemon holds what torchao made: qdata (F8_E4M3 or I8) and one fp32 scale per row.
    (model,) = daemon.client.list_models().models
    held = {t.name: t for t in model.tensors}
    wire = _dtypes.to_wire(torchao_weights.DATA_DTYPE[fmt])
    for name, m in torchao_layers(ref).items():
        t = held[f"{name}.weight"]
        assert (t.quantization, t.dtype, list(t.scale_shape)) == (fmt, wire, [m.out_features, 1])
        assert t.nbytes == quantize.rowwise_nbytes(m.weight.shape), name
        assert held[f"{name}.bias"].quantization == "none" if m.bias is not None else True
    assert_equal_runs(
        run(ref, 3, dtype, sample_between=True, autocast=autocast),
        run(streamed, 3, dtype, sample_between=True, autocast=autocast),
    )
    largest = max(m.weight.numel() * dtype.itemsize for m in torchao_layers(ref).values())
    assert handle.stats()["dequant_peak_bytes"] == largest
    handle.detach(release=True)
    # Back as torchao's tensors, the same bytes.
    for name, m in torchao_layers(ref).items():
        back = streamed.get_submodule(name).weight
        assert type(back) is TYPES[fmt] and not back.requires_grad, name
        assert torch.equal(back.qdata.view(torch.uint8), m.weight.qdata.view(torch.uint8))
        assert torch.equal(back.scale, m.weight.scale), name
        assert back.__tensor_flatten__()[1] == m.weight.__tensor_flatten__()[1], name
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(9)).to(dtype)
    with torch.no_grad():
        assert torch.equal(streamed(x), ref(x))
    assert daemon.client.list_models().models == []


def test_quantize_fp8_applies_to_the_other_layers(daemon):
    """With ``quantize="fp8"`` the daemon quantizes the plain weights (fp8_e4m3_block64) and
    keeps torchao's as torchao made them: the result is the torchao model with each plain
    streamed weight replaced by its w_hat."""
    ref, streamed = torchao_model(INT8, torch.bfloat16), torchao_model(INT8, torch.bfloat16)
    handle = wst.attach(streamed, "cpu", client=daemon.client, min_bytes=0, quantize="fp8")
    placed = {p.name: p.quantization for g in handle.session.groups for p in g.tensors}
    plain = sorted(set(handle.streamed) - set(torchao_layers(ref)))
    assert plain == ["conv_in", "proj_out"]
    assert {placed[f"{n}.weight"] for n in plain} == {quantize.FP8_E4M3_BLOCK64}
    assert {placed[f"{n}.weight"] for n in torchao_layers(ref)} == {INT8}
    quantize.to_fp8_resident(ref, plain)
    assert_equal_runs(run(ref, 2, torch.bfloat16), run(streamed, 2, torch.bfloat16))
    handle.detach(release=True)


def test_attach_to_a_model_uploaded_with_torchao_weights(daemon):
    """``attach(model=id)`` of a model uploaded with the torchao weights checks each one's
    format and streams it as the upload wrote it."""
    ref, streamed = torchao_model(FLOAT8, torch.bfloat16), torchao_model(FLOAT8, torch.bfloat16)
    layers = policy.select(streamed, wst.StreamOptions(min_bytes=0)).streamed
    tensors = {}
    for name, m in layers:
        tensors[f"{name}.weight"] = (
            torchao_weights.upload_form(m.weight) if name in torchao_layers(ref) else m.weight
        )
        if m.bias is not None:
            tensors[f"{name}.bias"] = m.bias
    manifest, _ = daemon.client.upload_model("torchao", tensors)
    with pytest.warns(UserWarning, match="streaming the daemon's copy"):
        handle = wst.attach(
            streamed, "cpu", client=daemon.client, min_bytes=0, model=manifest.model_id
        )
    assert_equal_runs(run(ref, 2, torch.bfloat16), run(streamed, 2, torch.bfloat16))
    handle.detach(release=True)  # the upload's reference
    # A model holding those weights in another format is refused by name.
    plain = {n: t if not isinstance(t, quantize.Fp8Weight) else t.data for n, t in tensors.items()}
    other, _ = daemon.client.upload_model("plain", plain)
    fresh = torchao_model(FLOAT8, torch.bfloat16)
    with pytest.raises(
        ValueError,
        match=r"^model='u-[0-9a-f]+': tensor 'blocks.0.attn.q.base_layer.weight' is held as "
        r"none, the module's weight is torchao's torchao_float8_rowwise$",
    ):
        wst.attach(fresh, "cpu", client=daemon.client, min_bytes=0, model=other.model_id)
    daemon.client.release_model(other.model_id)


def test_ai_toolkit_memory_manager_streams_torchao_weights(daemon, monkeypatch):
    """ai-toolkit's 24 GB recipe quantizes the transformer with torchao's float8 weight-only
    config: its ``MemoryManager.attach`` streams those weights as they are."""
    monkeypatch.setenv("WEIGHTSTREAM_SOCKET", daemon.socket)
    ref, model = torchao_model(FLOAT8, torch.bfloat16), torchao_model(FLOAT8, torch.bfloat16)
    manager = MemoryManager.attach(model, torch.device("cpu"))
    assert set(torchao_layers(ref)) <= set(manager.handle.streamed)
    placed = {t.name: t.quantization for g in manager.handle.session.groups for t in g.tensors}
    assert all(placed[f"{n}.weight"] == FLOAT8 for n in torchao_layers(ref))
    assert_equal_runs(run(ref, 2, torch.bfloat16), run(model, 2, torch.bfloat16))
    MemoryManager.detach(model, release=True)
    assert daemon.client.list_models().models == []


# --- refusals ----------------------------------------------------------------------------------


def stand_in(module: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """A tensor subclass named as another library names its own."""
    return torch.Tensor._make_subclass(type(name, (torch.Tensor,), {"__module__": module}), t)


def rebuilt_float8(w: Float8Tensor, scale: torch.Tensor) -> Float8Tensor:
    return Float8Tensor(w.qdata, scale, w.block_size, dtype=w.dtype)


def refused_case(case: str) -> nn.Module:
    """A Sequential of three Linear layers whose middle one holds the case's weight."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)).bfloat16()
    model.requires_grad_(False)
    middle = model[1]
    if case in CASE_CONFIGS:
        quantize_(middle, CASE_CONFIGS[case]())
    elif case == "a float8 conv":
        model[1] = nn.Conv2d(4, 8, 3).bfloat16().requires_grad_(False)
        quantize_(model[1], Float8WeightOnlyConfig(), filter_fn=lambda m, fqn: True)
    else:
        quantize_(middle, Float8WeightOnlyConfig())
        w = middle.weight
        if case == "asymmetric int8":
            t = Int8Tensor.from_hp(
                w.dequantize(), granularity=PerRow(), mapping_type=MappingType.ASYMMETRIC
            )
            middle.weight = nn.Parameter(t, requires_grad=False)
        elif case == "a bfloat16 scale":
            middle.weight = nn.Parameter(rebuilt_float8(w, w.scale.bfloat16()), requires_grad=False)
        elif case == "scales of shape [out]":
            middle.weight = nn.Parameter(rebuilt_float8(w, w.scale.flatten()), requires_grad=False)
        elif case == "requires grad":
            middle.weight.requires_grad_(True)
        elif case == "quanto":
            t = stand_in(
                "optimum.quanto.tensor.weights.qbytes", "WeightQBytesTensor", w.dequantize()
            )
            middle.weight = nn.Parameter(t, requires_grad=False)
        elif case == "a torchao lookalike":
            t = stand_in("torchao.quantization", "Float8Tensor", w.dequantize())
            middle.weight = nn.Parameter(t, requires_grad=False)
    return model


CASE_CONFIGS = {
    "float8 per tensor": lambda: Float8WeightOnlyConfig(granularity=PerTensor()),
    "float8 per group": lambda: Float8WeightOnlyConfig(granularity=PerGroup(32)),
    "float8 e5m2": lambda: Float8WeightOnlyConfig(weight_dtype=torch.float8_e5m2),
    "int8 per group": lambda: Int8WeightOnlyConfig(granularity=PerGroup(32)),
    "int8 dynamic activation": lambda: Int8DynamicActivationInt8WeightConfig(),
}

INSTEAD = (
    "quantize the layer with Float8WeightOnlyConfig() or Int8WeightOnlyConfig() (granularity "
    "PerRow(), their default), load it unquantized (quantize='fp8' streams it in 8 bits), or "
    "keep it on the device (ignore=['1'])"
)
OTHER = (
    "a layout weightstream does not stream (it streams Float8Tensor (Float8WeightOnlyConfig()) "
    "and Int8Tensor (Int8WeightOnlyConfig()) in 8 bits, and NF4Tensor and "
    "IntxUnpackedToInt8Tensor as packed layers): " + INSTEAD
)
REFUSALS = {
    "float8 per tensor": "Float8Tensor made by torchao, with block_size [64, 64]; weightstream "
    "streams one scale per row (block_size [1, 64], granularity PerRow()): " + INSTEAD,
    "float8 per group": "Float8Tensor made by torchao, with block_size [1, 32]; weightstream "
    "streams one scale per row (block_size [1, 64], granularity PerRow()): " + INSTEAD,
    "float8 e5m2": "Float8Tensor made by torchao, of torch.float8_e5m2 qdata; "
    "Float8WeightOnlyConfig() makes torch.float8_e4m3fn: " + INSTEAD,
    "int8 per group": "Int8Tensor made by torchao, with block_size [1, 32]; weightstream streams "
    "one scale per row (block_size [1, 64], granularity PerRow()): " + INSTEAD,
    "int8 dynamic activation": "Int8Tensor made by torchao, with activation quantization (a "
    "dynamic-activation config): its linear is a quantized matmul, not the weight's; "
    "weightstream streams the weight-only Int8WeightOnlyConfig(): " + INSTEAD,
    "asymmetric int8": "Int8Tensor made by torchao, with nonzero zero points (asymmetric "
    "quantization); weightstream streams the symmetric Int8WeightOnlyConfig(): " + INSTEAD,
    "a bfloat16 scale": "Float8Tensor made by torchao, with a torch.bfloat16 scale of shape "
    "[64, 1]; Float8WeightOnlyConfig() makes one torch.float32 scale per row, shape [64, 1]: "
    + INSTEAD,
    "scales of shape [out]": "Float8Tensor made by torchao, with a torch.float32 scale of shape "
    "[64]; Float8WeightOnlyConfig() makes one torch.float32 scale per row, shape [64, 1]: "
    + INSTEAD,
    "requires grad": "Float8Tensor made by torchao, which requires grad: a quantized base weight "
    "is frozen (torchao makes it with requires_grad=False); freeze it "
    "(module.weight.requires_grad_(False)) or keep the layer on the device (ignore=['1'])",
    "a float8 conv": "Float8Tensor made by torchao, on a Conv2d: torchao weights stream on "
    "nn.Linear layers (torchao's Float8WeightOnlyConfig() quantizes those); keep the layer on "
    "the device (ignore=['1'])",
    "a torchao lookalike": "Float8Tensor made by torchao, " + OTHER,
    "quanto": None,
}


def test_other_quantized_weights_are_refused_by_rule_before_anything_is_uploaded(daemon):
    bad = []
    for case, rest in REFUSALS.items():
        model = refused_case(case)
        kept = model[1].weight
        try:
            wst.attach(model, "cpu", client=daemon.client, min_bytes=0)
            got = "attached"
        except wst.QuantizedWeight as e:
            got = str(e)
        if rest is None:  # another library's: the general refusal
            want = (
                "cannot stream '1': its weight is a WeightQBytesTensor made by optimum-quanto, "
                "whose bytes are not the weight's (of other libraries' quantized weights, "
                "weightstream streams torchao's Float8Tensor and Int8Tensor quantized per row, "
                "and torchao's NF4Tensor and IntxUnpackedToInt8Tensor, ai-toolkit's "
                "OstrisLinear of uint2..uint7, convrotint2..convrotint8, nvfp4, convrot8, "
                "convrot4, bitsandbytes' Linear4bit of nf4 and fp4, as they are). Keep the "
                "layer on "
                "the device (ignore=['1']), or load the model "
                "unquantized (quantize='fp8' streams it in 8 bits)."
            )
        else:
            want = "cannot stream '1': its weight is a " + rest
        if got != want:
            bad.append(f"{case}:\n  want {want}\n  got  {got}")
        if model[1].weight is not kept:
            bad.append(f"{case}: the layer's weight was replaced")
        if daemon.client.list_models().models or daemon.client.info().usage.uploads:
            bad.append(f"{case}: something was uploaded")
    assert not bad, "\n".join(bad)
    # Kept on the device when ignored: the rest streams.
    model = refused_case("float8 per tensor")
    handle = wst.attach(model, "cpu", client=daemon.client, min_bytes=0, ignore=["1"])
    assert set(handle.streamed) == {"0", "2"}
    handle.detach(release=True)


def test_a_scale_the_daemon_refuses_leaves_nothing(daemon):
    """A non-finite scale passes the client's rules and is refused at commit: attach fails
    naming the tensor, and no model or upload is left."""
    model = refused_case("")
    w = model[1].weight
    scale = w.scale.clone()
    scale[3, 0] = float("inf")
    model[1].weight = nn.Parameter(rebuilt_float8(w, scale), requires_grad=False)
    kept = model[1].weight
    with pytest.raises(RequestRejected) as refused:
        wst.attach(model, "cpu", client=daemon.client, min_bytes=0)
    assert str(refused.value).endswith(
        "tensor '1.weight': scale +inf at index 3: the scales of 8-bit data must be finite"
    ), str(refused.value)
    assert model[1].weight is kept
    assert daemon.client.list_models().models == []
    assert daemon.client.info().usage.uploads == 0
