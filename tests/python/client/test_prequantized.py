"""Pre-quantized files read as published: musubi-tuner ``--fp8_scaled`` (``fp8_scaled_musubi``)
and ComfyUI scaled-fp8 (``fp8_scaled_comfy``: the legacy ``scaled_fp8`` files and the newer
mixed-precision ones, whose layers carry a ``.comfy_quant`` marker or are listed in the header's
``_quantization_metadata``) safetensors.

``quantize.dequantize_as`` is checked bit for bit against each project's dequantization: the
expression reproduced verbatim below (source lines cited), and, when ``WEIGHTSTREAM_MUSUBI_SRC``
names the ``src`` folder of a musubi-tuner checkout (outside this repository; its
``modules/fp8_optimization_utils.py`` imports on the CPU), against musubi's own
``quantize_weight`` and ``fp8_linear_forward_patch``. ComfyUI's ``comfy.ops`` needs ComfyUI's
model management to import, so its expression is reproduced only. Then a model the daemon
loaded from such a file, attached with ``model=<id>``, computes what the module computes with
each weight replaced by that w_hat (torch.equal, CPU host backend).
"""

from __future__ import annotations

import importlib
import os
import sys
from unittest import mock

import pytest
import torch
import weightstream.torch as wst
from safetensors.torch import save_file
from torch import nn
from weightstream import quantize

E4M3 = torch.float8_e4m3fn
MAX = torch.finfo(E4M3).max
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))
    )


def fp8_scaled(w: torch.Tensor, mode: str, block: int = 64):
    """A weight in musubi's layout: q e4m3fn, scale float32 of shape [] (tensor), [out, 1]
    (channel) or [out, in / block, 1] (block); scale = amax / 448."""
    x = w.float()
    if mode == "tensor":
        scale = x.abs().max() / MAX
    elif mode == "channel":
        scale = x.abs().amax(dim=1, keepdim=True) / MAX
    else:
        out, inputs = x.shape
        x = x.view(out, inputs // block, block)
        scale = x.abs().amax(dim=2, keepdim=True) / MAX
    scale = scale.clamp(min=1e-8)
    q = (x / scale).clamp(-MAX, MAX).to(E4M3).view(w.shape)
    return q, scale


def musubi_reference(weight: torch.Tensor, scale_weight: torch.Tensor) -> torch.Tensor:
    """musubi-tuner ``fp8_linear_forward_patch``, its non-scaled_mm branch
    (src/musubi_tuner/modules/fp8_optimization_utils.py, lines 418-427 at commit
    30c658c4f4b0bf05038b3346eff9670259b10fc7), ``self.weight`` -> weight and
    ``self.scale_weight`` -> scale_weight."""
    original_dtype = scale_weight.dtype
    if scale_weight.ndim < 3:
        dequantized_weight = weight.to(original_dtype) * scale_weight
    else:
        out_features, num_blocks, _ = scale_weight.shape
        dequantized_weight = (
            weight.to(original_dtype).contiguous().view(out_features, num_blocks, -1)
        )
        dequantized_weight = dequantized_weight * scale_weight
        dequantized_weight = dequantized_weight.view(weight.shape)
    return dequantized_weight


def comfy_reference(s_weight: torch.Tensor, scale_weight: torch.Tensor, dtype) -> torch.Tensor:
    """ComfyUI ``scaled_fp8_ops``' Linear (comfy/ops.py): ``cast_bias_weight`` gives
    ``weight = s.weight.to(dtype=dtype)`` (dtype: the input's), then
    ``weight * self.scale_weight.to(device=weight.device, dtype=weight.dtype)``
    (``forward_comfy_cast_weights`` and ``convert_weight``)."""
    weight = s_weight.to(dtype=dtype)
    return weight * scale_weight.to(device=weight.device, dtype=weight.dtype)


def comfy_mixed_reference(qdata: torch.Tensor, scale: torch.Tensor, orig_dtype) -> torch.Tensor:
    """ComfyUI ``TensorCoreFP8Layout.dequantize`` (comfy/quant_ops.py, the ``float8_e4m3fn``
    layout of mixed-precision files; ``orig_dtype`` is ``MixedPrecisionOps``' compute dtype):
    ``plain_tensor = torch.ops.aten._to_copy.default(qdata, dtype=orig_dtype)``, then
    ``plain_tensor * scale``, the fp32 ``weight_scale`` moved to the weight's device with it
    (``_move_layout_params_to_device``). On the GPU, where ComfyUI computes, that product reads
    the 0-d fp32 operand as the common dtype (a CUDA tensor operand is cast to the kernel's
    argument type, ``BinaryFunctor<scalar_t, scalar_t, ...>`` in ATen's
    ``opmath_symmetric_gpu_kernel_with_scalars``): the scale is rounded to ``orig_dtype``
    first. The CPU treats a 0-d CPU tensor as a scalar kept in fp32 instead (see the test
    below), so the GPU's rule is written out here."""
    plain_tensor = torch.ops.aten._to_copy.default(qdata, dtype=orig_dtype)
    return plain_tensor * scale.to(plain_tensor.dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("mode", ["tensor", "channel", "block"])
def test_musubi_dequantization_is_musubis_bit_for_bit(dtype, mode):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(48, 192, generator=g) * 0.02).to(dtype)
    q, scale = fp8_scaled(w, mode)
    scale = scale.to(dtype)  # musubi keeps the scale in the weight's original dtype
    want = musubi_reference(q, scale)
    # The daemon holds the scale as fp32 (exact for every dtype musubi writes).
    got = quantize.dequantize_as(quantize.FP8_SCALED_MUSUBI, q, scale.float(), dtype)
    assert same_bits(got, want)
    assert same_bits(
        quantize.dequantize_weight(
            quantize.Fp8Weight(q, scale.float(), quantize.FP8_SCALED_MUSUBI), dtype
        ),
        want,
    )


@pytest.mark.parametrize("dtype", FLOATS)
def test_comfy_dequantization_is_comfys_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 96, generator=g) * 0.05
    q, _ = fp8_scaled(w, "tensor")
    for scale in (torch.tensor(0.0123456789), torch.tensor(1.0 / 3.0), torch.tensor(2.5e-4)):
        want = comfy_reference(q, scale, dtype)
        got = quantize.dequantize_as(quantize.FP8_SCALED_COMFY, q, scale, dtype)
        assert same_bits(got, want), (dtype, float(scale))
    # ComfyUI rounds the scale to the compute dtype first: not (q.float() * s).to(bf16).
    s = torch.tensor(1.0 / 3.0)
    assert not same_bits(
        quantize.dequantize_as(quantize.FP8_SCALED_COMFY, q, s, torch.bfloat16),
        (q.float() * s).to(torch.bfloat16),
    )


@pytest.mark.parametrize("dtype", FLOATS)
def test_comfy_mixed_precision_dequantization_is_comfys_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 96, generator=g) * 0.05
    q, _ = fp8_scaled(w, "tensor")
    for value in (0.0123456789, 1.0 / 3.0, 2.5e-4):
        for shape in ((), (1,)):  # weight_scale: 0-d, or one element
            scale = torch.full(shape, value, dtype=torch.float32)
            want = comfy_mixed_reference(q, scale, dtype)
            got = quantize.dequantize_as(quantize.FP8_SCALED_COMFY, q, scale, dtype)
            assert same_bits(got, want), (dtype, value, shape)
    # ComfyUI's expression as written, on the CPU, keeps the scale in fp32: not what it
    # computes on the GPU, nor what weightstream computes anywhere.
    if dtype != torch.float32:
        scale = torch.tensor(1.0 / 3.0)
        on_cpu = torch.ops.aten._to_copy.default(q, dtype=dtype) * scale
        assert same_bits(on_cpu, (q.to(dtype).float() * scale).to(dtype))
        assert not same_bits(on_cpu, comfy_mixed_reference(q, scale, dtype))


def test_unknown_format_is_refused():
    q = torch.zeros(2, 2, dtype=E4M3)
    with pytest.raises(ValueError, match="unknown 8-bit format 'int4'"):
        quantize.dequantize_as("int4", q, torch.ones(()), torch.float32)


def musubi_module():
    src = os.environ.get("WEIGHTSTREAM_MUSUBI_SRC")
    if not src:
        pytest.skip("WEIGHTSTREAM_MUSUBI_SRC (a musubi-tuner checkout's src folder) is not set")
    sys.path.insert(0, src)
    try:
        return importlib.import_module("musubi_tuner.modules.fp8_optimization_utils")
    finally:
        sys.path.remove(src)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("mode", ["tensor", "channel", "block"])
def test_musubi_against_its_own_code(dtype, mode):
    f = musubi_module()
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(32, 128, generator=g) * 0.02).to(dtype)
    max_value = f.calculate_fp8_maxval(4, 3)
    q, scale = f.quantize_weight("l.weight", w, E4M3, max_value, -max_value, mode, 64)
    scale = scale.to(dtype)  # as optimize_state_dict_with_fp8 stores it
    layer = nn.Linear(128, 32, bias=False)
    layer.weight = nn.Parameter(q, requires_grad=False)
    layer.register_buffer("scale_weight", scale)
    with mock.patch.object(f.F, "linear", lambda x, weight, bias=None: weight):
        want = f.fp8_linear_forward_patch(layer, torch.zeros(1, 128, dtype=dtype))
    got = quantize.dequantize_as(quantize.FP8_SCALED_MUSUBI, q, scale.float(), dtype)
    assert same_bits(got, want)


class Net(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.a = nn.Linear(128, 64, dtype=dtype)
        self.b = nn.Linear(64, 48, bias=False, dtype=dtype)
        self.c = nn.Linear(48, 16, dtype=dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.c(torch.nn.functional.gelu(self.b(torch.nn.functional.gelu(self.a(x)))))


def comfy_mixed_file(model: Net, path):
    """The model's weights as a ComfyUI mixed-precision file: ``<layer>.weight`` e4m3fn with a
    scalar fp32 ``<layer>.weight_scale``; a and c marked by ``<layer>.comfy_quant`` (the JSON
    config as uint8), b listed in the header's ``_quantization_metadata``; a's ``input_scale``.
    Each weight's w_hat in the model's dtype."""
    tensors, w_hats = {}, {}
    dtype = model.a.weight.dtype
    config = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
    for name in ("a", "b", "c"):
        layer = getattr(model, name)
        q, scale = fp8_scaled(layer.weight, "tensor")
        scale = scale.reshape(()).float()
        w_hats[name] = comfy_mixed_reference(q, scale, dtype)
        tensors[f"{name}.weight"] = q
        tensors[f"{name}.weight_scale"] = scale
        if name != "b":
            tensors[f"{name}.comfy_quant"] = config.clone()
        if layer.bias is not None:
            tensors[f"{name}.bias"] = layer.bias.detach().clone()
    tensors["a.input_scale"] = torch.ones(())
    listing = '{"format_version": "1.0", "layers": {"b": {"format": "float8_e4m3fn"}}}'
    save_file(tensors, str(path), metadata={"_quantization_metadata": listing})
    return w_hats


def prequantized_file(model: Net, path, fmt: str):
    """The model's weights as a musubi (a: block, b: channel, c: tensor) or ComfyUI (scalar
    scales, a ``scaled_fp8`` marker) file, and each weight's w_hat in the model's dtype."""
    if fmt == "comfy-mixed":
        return comfy_mixed_file(model, path)
    tensors, w_hats = {}, {}
    modes = {"a": "block", "b": "channel", "c": "tensor"}
    dtype = model.a.weight.dtype
    for name in modes:
        layer = getattr(model, name)
        if fmt == quantize.FP8_SCALED_MUSUBI:
            q, scale = fp8_scaled(layer.weight, modes[name])
            scale = scale.to(dtype)
            w_hats[name] = musubi_reference(q, scale)
        else:
            q, scale = fp8_scaled(layer.weight, "tensor")
            w_hats[name] = comfy_reference(q, scale, dtype)
        tensors[f"{name}.weight"] = q
        tensors[f"{name}.scale_weight"] = (
            scale.reshape(()) if fmt == quantize.FP8_SCALED_COMFY else scale
        )
        if layer.bias is not None:
            tensors[f"{name}.bias"] = layer.bias.detach().clone()
    if fmt == quantize.FP8_SCALED_COMFY:
        tensors["scaled_fp8"] = torch.empty(0, dtype=E4M3)
        tensors["a.scale_input"] = torch.ones(())
    save_file(tensors, str(path))
    return w_hats


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [
        (quantize.FP8_SCALED_MUSUBI, torch.bfloat16),
        (quantize.FP8_SCALED_MUSUBI, torch.float16),
        (quantize.FP8_SCALED_COMFY, torch.bfloat16),
        ("comfy-mixed", torch.bfloat16),
        ("comfy-mixed", torch.float16),
    ],
)
def test_attach_to_a_prequantized_model_equals_its_w_hat_in_place(daemon, tmp_path, kind, dtype):
    torch.manual_seed(7)
    model = Net(dtype)
    path = tmp_path / "pre.safetensors"
    w_hats = prequantized_file(model, path, kind)
    manifest = daemon.client.load_model([str(path)], "pre")
    kinds = {t.name: t.quantization for t in manifest.tensors}
    fmt = (
        quantize.FP8_SCALED_MUSUBI
        if kind == quantize.FP8_SCALED_MUSUBI
        else quantize.FP8_SCALED_COMFY
    )
    assert kinds["a.weight"] == kinds["b.weight"] == kinds["c.weight"] == fmt
    assert "a.scale_weight" not in kinds and "a.weight_scale" not in kinds
    assert kinds["a.bias"] == "none"
    ref = Net(dtype)
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, w in w_hats.items():
            getattr(ref, name).weight.copy_(w)
    x = torch.randn(5, 128, dtype=dtype)
    with pytest.warns(UserWarning, match="streaming the daemon's copy"):
        handle = wst.attach(
            model, "cpu", client=daemon.client, min_bytes=0, model=manifest.model_id
        )
    with torch.no_grad():
        got = model(x)
        want = ref(x)
    assert torch.equal(got, want)
    handle.detach()
