"""A test fixture: minimal stand-ins for ai-toolkit's quantized Linear (``OstrisLinear``) and
its accuracy recovery adapter, written for these tests from the layouts that
``weightstream.torch.packed`` documents. They are not ai-toolkit's code and do not claim its
numerics: they hold the same buffers (names, dtypes, shapes) and compute through the same
entry points (the class forward calls ``module.ostris_quantizer.forward(module, x)``, which
reads the buffers and the bias off the module; the ``weight`` property dequantizes them; the
ARA wraps the layer's forward as ``org_forward``), which is all the streaming mechanism relies
on. ``tests/bench/aitk_packed_real.py`` checks the same forms against ai-toolkit's own code.

``OstrisLinear`` reports ai-toolkit's module and name (``toolkit.util.ostris_quant``) because
weightstream recognises ai-toolkit's layers by them, without importing ai-toolkit.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn


class OstrisLinear(nn.Linear):
    def forward(self, x):
        return self.ostris_quantizer.forward(self, x)

    @property
    def weight(self):
        # ai-toolkit's: the dequantized weight, read by code that inspects a layer's weight
        # (its LoRA network's create_modules) and by an ARA's org_forward (nn.Linear.forward).
        with torch.no_grad():
            return self.ostris_quantizer.dequantize(self).to(self.ostris_orig_dtype)


OstrisLinear.__module__ = "toolkit.util.ostris_quant"


def convert(layer: nn.Linear, quantizer) -> OstrisLinear:
    """Quantizes ``layer`` in place (class swap, weight parameter deleted, bias frozen)."""
    w = layer.weight.detach()
    quantizer.quantize(layer, w)
    layer.ostris_quantizer = quantizer
    layer.ostris_orig_dtype = w.dtype
    del layer._parameters["weight"]
    if layer.bias is not None:
        layer.bias.requires_grad_(False)
    layer.__class__ = OstrisLinear
    return layer


def rot_size(inputs: int) -> int:
    """The rotation's block size, ai-toolkit's rule: the largest power of 4 that divides the
    layer's inputs, at most 256."""
    size = 1
    while size < 256 and inputs % (size * 4) == 0:
        size *= 4
    return size


def _pack_bits(codes: torch.Tensor, nbits: int) -> torch.Tensor:
    """Codes < 2**nbits as shards of 4, 2 and 1 bits, each shard packed 8/k codes a byte (the
    k-bit values of code i at byte i mod n/(8/k), bits (i div that) * k)."""
    flat, shards, offset = codes.flatten().to(torch.uint8), [], 0
    for k in (8, 4, 2, 1):
        if nbits & k:
            vals = (flat >> offset) & ((1 << k) - 1)
            per = 8 // k
            vals = torch.cat([vals, vals.new_zeros((-vals.numel()) % per)]).view(per, -1)
            byte = vals[0].clone()
            for j in range(1, per):
                byte |= vals[j] << (j * k)
            shards.append(byte)
            offset += k
    return torch.cat(shards)


def _unpack_bits(packed: torch.Tensor, nbits: int, numel: int) -> torch.Tensor:
    out, offset, pos = torch.zeros(numel, dtype=torch.uint8, device=packed.device), 0, 0
    for k in (8, 4, 2, 1):
        if nbits & k:
            per = 8 // k
            n = -(-numel // per)
            shard = packed[pos : pos + n]
            vals = torch.stack([(shard >> (j * k)) & ((1 << k) - 1) for j in range(per)])
            out |= vals.flatten()[:numel] << offset
            offset, pos = offset + k, pos + n
    return out


class UIntX:
    """Asymmetric ``nbits`` codes per 64 inputs; scale in the weight's dtype (as bytes)."""

    group_size = 64

    def __init__(self, nbits: int):
        self.nbits, self.qtype = nbits, f"uint{nbits}"

    def quantize(self, m, w):
        out, inputs = w.shape
        g = w.reshape(out, inputs // 64, 64)
        lo = g.amin(-1).clamp(max=0)
        hi = g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / ((1 << self.nbits) - 1)).clamp(min=1e-6)
        zp = (-lo / scale).round().clamp(0, (1 << self.nbits) - 1)
        q = (g / scale[..., None] + zp[..., None]).round().clamp(0, (1 << self.nbits) - 1)
        m.register_buffer("uintx_packed", _pack_bits(q, self.nbits), persistent=False)
        m.register_buffer("uintx_scale", scale.contiguous().view(torch.uint8), persistent=False)
        m.register_buffer("uintx_zero_point", zp.to(torch.uint8), persistent=False)

    def dequantize(self, m):
        out, inputs, dtype = m.out_features, m.in_features, m.ostris_orig_dtype
        q = _unpack_bits(m.uintx_packed, self.nbits, out * inputs)
        w = q.view(out, inputs // 64, 64).to(dtype) - m.uintx_zero_point.to(dtype)[..., None]
        return (w * m.uintx_scale.view(dtype)[..., None]).view(out, inputs)

    def forward(self, m, x):
        with torch.no_grad():
            w = self.dequantize(m).to(x.dtype)
        return F.linear(x, w, m.bias)


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class Nvfp4:
    """e2m1 codes two a byte (low nibble first), an e4m3 scale per 16 inputs, a float32
    per-tensor scale; optional float32 input scales."""

    qtype = "nvfp4"

    def __init__(self, pre_scale: bool = False):
        self.pre_scale = pre_scale

    def quantize(self, m, w):
        out, inputs = w.shape
        w = w.float()
        pts = (w.abs().amax() / (6 * 448)).clamp(min=1e-12)
        blocks = w.view(out, inputs // 16, 16)
        scales = (blocks.abs().amax(-1) / (6 * pts)).to(torch.float8_e4m3fn)
        z = blocks / (scales.float() * pts).clamp(min=1e-12)[..., None]
        table = torch.tensor(E2M1, device=w.device)  # on w's device: ``meta`` too, as ai-toolkit's
        mag = (z.abs()[..., None] - table).abs().argmin(-1).to(torch.uint8)
        codes = (mag | ((z < 0).to(torch.uint8) << 3)).view(out, inputs)
        m.register_buffer("nv4_qdata", codes[:, ::2] | (codes[:, 1::2] << 4), persistent=False)
        m.register_buffer("nv4_scales", scales.view(torch.uint8), persistent=False)
        m.register_buffer("nv4_pts", pts.reshape(1).view(torch.uint8), persistent=False)
        if self.pre_scale:
            s = torch.linspace(0.5, 1.5, inputs, device=w.device)
            m.register_buffer("nv4_pre_scale", s.view(torch.uint8), persistent=False)

    def forward(self, m, x):
        pre = m._buffers.get("nv4_pre_scale")
        if pre is not None:
            x = x * pre.view(torch.float32).to(x.dtype)
        out, inputs = m.out_features, m.in_features
        with torch.no_grad():
            codes = torch.stack([m.nv4_qdata & 15, m.nv4_qdata >> 4], -1).view(out, inputs)
            v = torch.tensor(E2M1, device=codes.device)[(codes & 7).long()]
            v = torch.where(codes & 8 > 0, -v, v).view(out, inputs // 16, 16)
            s = m.nv4_scales.view(torch.float8_e4m3fn).float() * m.nv4_pts.view(torch.float32)
            w = (v * s[..., None]).view(out, inputs).to(x.dtype)
        return F.linear(x, w, m.bias)


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


class ConvRot8:
    """The weight rotated by a block Hadamard of ``cr8_rot_size``, int8 codes with a float32
    scale per row; the input rotated alike; in training (x requires grad) the activations are
    fake-quantized per row with a straight-through gradient."""

    qtype = "convrot8"

    def quantize(self, m, w):
        rot = rot_size(m.in_features)
        wr = rotate(w.float(), rot)
        scale = (wr.abs().amax(1) / 127).clamp(min=1e-12)
        q = (wr / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        m.register_buffer("cr8_qdata", q, persistent=False)
        m.register_buffer("cr8_scales", scale.view(torch.uint8), persistent=False)
        m.cr8_rot_size = rot

    def forward(self, m, x):
        xr = rotate(x, m.cr8_rot_size)
        if x.requires_grad:
            with torch.no_grad():
                s = (xr.abs().amax(-1, keepdim=True).float() / 127).clamp(min=1e-12)
                xq = ((xr.float() / s).round().clamp(-127, 127) * s).to(x.dtype)
            xr = xr + (xq - xr).detach()
        return _Int8Linear.apply(xr, m.cr8_qdata, m.cr8_scales, m.bias)


class _Int8Linear(torch.autograd.Function):
    """As ai-toolkit's convrot8 does: the int8 codes and their scales kept for the backward
    (``save_for_backward``), dequantized again there for the input's gradient."""

    @staticmethod
    def forward(ctx, x, qdata, scales, bias):
        ctx.save_for_backward(qdata, scales)
        return F.linear(x, _int8_weight(qdata, scales, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        qdata, scales = ctx.saved_tensors
        return grad @ _int8_weight(qdata, scales, grad.dtype), None, None, None


def _int8_weight(qdata: torch.Tensor, scales: torch.Tensor, dtype) -> torch.Tensor:
    return (qdata.float() * scales.view(torch.float32)[:, None]).to(dtype)


def rotate(x: torch.Tensor, rot: int) -> torch.Tensor:
    h = hadamard(rot).to(x.device, x.dtype)
    return (x.reshape(*x.shape[:-1], -1, rot) @ h).reshape(x.shape)


class Ara(nn.Module):
    """An accuracy recovery adapter: a LoRA whose forward wraps the layer's (``org_forward``),
    marked on the layer as ``ara_lora_ref``. ai-toolkit applies it to the Linear before
    quantizing (``quantize_model``), so its ``org_forward`` stays ``nn.Linear.forward``, which
    reads the quantized layer's dequantizing ``weight`` property (``ara_first``); applied after
    ``convert`` it wraps the quantizer's forward."""

    def __init__(self, layer: nn.Module, rank: int = 4, scale: float = 0.5):
        super().__init__()
        self.lora_down = nn.Linear(layer.in_features, rank, bias=False)
        self.lora_up = nn.Linear(rank, layer.out_features, bias=False)
        nn.init.normal_(self.lora_up.weight, std=0.02)
        self.scale = scale
        self.org_module = [layer]
        layer.ara_lora_ref = weakref.ref(self)
        self.org_forward = layer.forward
        layer.forward = self.forward

    def forward(self, x):
        return self.org_forward(x) + self.lora_up(self.lora_down(x)) * self.scale


def ara_first(layer: nn.Linear, quantizer, rank: int = 4) -> Ara:
    """ai-toolkit's order with an accuracy recovery adapter (``quantize_model``): the ARA wraps
    the Linear, then the layer is quantized, so the ARA runs ``nn.Linear.forward`` on the
    dequantized ``weight``, not the quantizer's forward."""
    ara = Ara(layer, rank)
    convert(layer, quantizer)
    return ara


class ConvRot4(Nvfp4):
    """``Nvfp4``'s codes and scales of the rotated weight (``cr_`` buffers, no input scales),
    the scales also padded to 128 x 4 tiles (``cr_scales_blocked``, here in row order: only
    its size is the layout's); the input rotated alike."""

    qtype = "convrot4"

    def quantize(self, m, w):
        rot = rot_size(m.in_features)
        super().quantize(m, rotate(w.float(), rot))
        for old, new in (("nv4_qdata", "cr_qdata"), ("nv4_scales", "cr_scales")):
            m.register_buffer(new, m._buffers.pop(old), persistent=False)
        m.register_buffer("cr_pts", m._buffers.pop("nv4_pts"), persistent=False)
        out, blocks = m.cr_scales.shape
        tiles = torch.zeros(
            -(-out // 128) * 128, -(-blocks // 4) * 4, dtype=torch.uint8, device=w.device
        )
        tiles[:out, :blocks] = m.cr_scales
        m.register_buffer("cr_scales_blocked", tiles.flatten(), persistent=False)
        m.cr_rot_size = rot

    def forward(self, m, x):
        out, inputs = m.out_features, m.in_features
        xr = rotate(x, m.cr_rot_size)
        with torch.no_grad():
            codes = torch.stack([m.cr_qdata & 15, m.cr_qdata >> 4], -1).view(out, inputs)
            v = torch.tensor(E2M1, device=codes.device)[(codes & 7).long()]
            v = torch.where(codes & 8 > 0, -v, v).view(out, inputs // 16, 16)
            s = m.cr_scales.view(torch.float8_e4m3fn).float() * m.cr_pts.view(torch.float32)
            w = (v * s[..., None]).view(out, inputs).to(x.dtype)
        return F.linear(xr, w, m.bias)


def group(inputs: int) -> int:
    """The k-group: 128, halved until it divides the width."""
    g = 128
    while inputs % g:
        g //= 2
    return g


class ConvRotIntN:
    """Symmetric ``bits``-bit codes of the rotated weight, offset by qmax and packed 8 codes in
    ``bits`` bytes along a row (``crn_qdata``), a float32 scale per row (``crn_scales``) and,
    below 8 bits, a float32 ratio per row and k-group (``crn_gratio``, ``group``)."""

    def __init__(self, bits: int):
        self.bits, self.qtype = bits, f"convrotint{bits}"

    def quantize(self, m, w):
        rot, bits, qmax = rot_size(m.in_features), self.bits, (1 << (self.bits - 1)) - 1
        wr = rotate(w.float(), rot)
        out, inputs = wr.shape
        scale = (wr.abs().amax(1) / qmax).clamp(min=1e-12)
        q = (wr / scale[:, None]).round().clamp(-qmax, qmax).to(torch.int64) + qmax
        steps = torch.arange(8, device=w.device)
        words = (q.view(out, inputs // 8, 8) << (steps * bits)).sum(-1)
        packed = (words[..., None] >> (steps[:bits] * 8)) & 0xFF
        m.register_buffer("crn_qdata", packed.to(torch.uint8).view(out, -1), persistent=False)
        m.register_buffer("crn_scales", scale.view(torch.uint8), persistent=False)
        if bits <= 7:
            n = out * (inputs // group(inputs))
            ratio = torch.linspace(0.9, 1.0, n, device=w.device).view(out, -1)
            m.register_buffer("crn_gratio", ratio.view(torch.uint8), persistent=False)
        m.crn_bits, m.crn_rot_size = bits, rot

    def forward(self, m, x):
        out, inputs, bits = m.out_features, m.in_features, self.bits
        xr = rotate(x, m.crn_rot_size)
        with torch.no_grad():
            b = m.crn_qdata.view(out, inputs // 8, bits).to(torch.int64)
            words = (b << (torch.arange(bits, device=b.device) * 8)).sum(-1)
            shifts = torch.arange(8, device=b.device) * bits
            q = ((words[..., None] >> shifts) & ((1 << bits) - 1)).view(out, inputs)
            w = (q - ((1 << (bits - 1)) - 1)).float() * m.crn_scales.view(torch.float32)[:, None]
            ratio = m._buffers.get("crn_gratio")
            if ratio is not None:
                w = w.view(out, -1, group(inputs)) * ratio.view(torch.float32)[..., None]
            w = w.reshape(out, inputs).to(x.dtype)
        return F.linear(xr, w, m.bias)
