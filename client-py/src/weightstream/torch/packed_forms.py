"""The packed forms that stream, and those refused by name: ``packed``'s registry.

A format is an entry of ``FORMATS``: how it is recognised (a type's module and name, read
without importing the library, as ``policy.quantizer_of`` does), which tensors stream and the
layout they must have (dtype and shape from the layer's size), and what stays on the device.
Nothing else in the client knows a format.

The forms, per layer (``out`` x ``in`` the Linear's size, ``d`` the weight's float dtype):

torchao 0.18 (a weight subclass on an ``nn.Linear`` with Linear's own forward, frozen):

- ``torchao.NF4Tensor`` (``torchao.quantization.to_nf4``, QLoRA's NF4, the format of
  bitsandbytes' ``Linear4bit``): ``quantized_data`` uint8 [out*in/2] (two 4-bit codes a byte),
  ``quantized_scalers`` int8 [out*in/block] (each block's absmax, quantized again per
  ``scaler_block_size``), ``quantization_factor`` d [n scaler blocks], ``scaler_mean`` d [],
  ``nf4`` d [16] (the code book). Forward: its ``F.linear`` (``LinearNF4``: ``x @
  w.to(x.dtype).t()``, then ``+ bias``). About 4.1 bits a weight.
- ``torchao.IntxUnpackedToInt8Tensor`` (``IntxWeightOnlyConfig(weight_dtype=torch.int1..8)``,
  ``PerGroup``/``PerAxis``): ``qdata`` int8 [out, in] (one code a byte), ``scale`` d and
  ``zero_point`` int8 or d [out, in/group]. Forward: its ``F.linear`` (dequantize, then
  ``F.linear``; with activation quantization, that first). 8 bits a weight plus the scales.

ai-toolkit (``toolkit/util/ostris_quant.py``: ``OstrisLinear``, a Linear class-swapped in
place, its ``weight`` parameter deleted, ``ostris_quantizer`` and ``ostris_orig_dtype`` set;
forward ``module.ostris_quantizer.forward(module, x)``; the bias a frozen parameter):

- ``aitk.uint2`` .. ``aitk.uint7`` (``UIntXQuantizer``, asymmetric per 64 inputs, bit-exact
  with torchao 0.10's UIntX): ``uintx_packed`` uint8 [sum over the power-of-two shards k of
  ``nbits`` of ceil(out*in / (8/k))] (the codes split into 4-, 2- and 1-bit shards, each
  packed 8/k a byte), ``uintx_scale`` uint8 [out, in/64 * d.itemsize] (d's bytes),
  ``uintx_zero_point`` uint8 [out, in/64]. Forward: unpack, ``(q - zp) * scale`` in d,
  ``F.linear``.
- ``aitk.nvfp4`` (``Nvfp4Quantizer``, ComfyUI's layout): ``nv4_qdata`` uint8 [out, in/2] (e2m1
  codes, low nibble first), ``nv4_scales`` uint8 [out, in/16] (e4m3 bytes), ``nv4_pts`` uint8
  [4] (a float32), optionally ``nv4_pre_scale`` uint8 [in*4] (float32 AWQ input scales).
  Forward: ``x * pre_scale``, dequantize to x's dtype, ``F.linear``.
- ``aitk.convrot8`` (``ConvRotInt8Quantizer``): ``cr8_qdata`` int8 [out, in] (the rotated
  weight's codes), ``cr8_scales`` uint8 [out*4] (float32 per row); the attribute
  ``cr8_rot_size`` stays on the module. Forward: the block-Hadamard rotation of x, then the
  int8 GEMM with a straight-through backward where the device has one, else fake-quantized
  activations and ``F.linear`` of the dequantized weight.

- ``aitk.convrot4`` (``ConvRotQuantizer``, W4A4 NVFP4): ``cr_qdata`` uint8 [out, in/2],
  ``cr_scales`` uint8 [out, in/16] (e4m3), ``cr_scales_blocked`` uint8 [ceil(out/128)*128 *
  ceil(in/64)*4] (the same scales in cuBLAS's 128x4 tiles), ``cr_pts`` uint8 [4]; the
  attribute ``cr_rot_size`` stays. Forward: rotate x; with no grad on a GPU with fp4 GEMMs
  (sm_100+) quantize x to nvfp4 and run ``torch._scaled_mm``, else (training, or another GPU)
  fake-quantized activations and ``F.linear`` of the dequantized weight: the quantizer picks,
  as in place.
- ``aitk.convrotint2`` .. ``aitk.convrotint8`` (``ConvRotIntNQuantizer``, W{n}A8):
  ``crn_qdata`` uint8 [out, in/8*n] (8 codes in n bytes), ``crn_scales`` uint8 [out*4]
  (float32 per row), below 8 bits ``crn_gratio`` uint8 [out, in/group*4] (float32 ratios per
  row and k-group: 128 halved until it divides in); ``crn_bits`` and ``crn_rot_size`` stay.
  Forward: unpack to int8 and run convrot8's.

bitsandbytes (``bitsandbytes.nn.Linear4bit`` and its ``LinearNF4``/``LinearFP4``, as diffusers'
and OneTrainer's 4-bit loading make them: a Linear with its own forward, its ``weight`` a
``Params4bit`` quantized as it moved to its device, its ``QuantState`` on ``weight.quant_state``
and on the module; named as bitsandbytes' state dict names them):

- ``bnb.nf4`` and ``bnb.fp4`` (``quant_type``): ``weight`` (the Params4bit's data) s
  [ceil(out*in/2) / s.itemsize, 1] (two 4-bit codes a byte, in ``quant_storage`` s, uint8 by
  default), ``weight.absmax`` float32 [ceil(out*in/blocksize)]; with double quantization
  (``compress_statistics``) ``weight.absmax`` is uint8 (the absmax quantized again, 256 a block)
  and ``weight.offset`` float32 [] and ``weight.nested_absmax`` float32 [ceil(blocks/256)] stream
  too. The code tables stay on the device (``quant_state.code``, 16 floats; with double
  quantization ``state2.code``, 256): they are the quant type's constants, not the weight's,
  and streaming them would add two tensors to every layer's group for 1.1 KiB. Forward:
  ``Linear4bit.forward`` on a ``Params4bit`` of the streamed data whose ``QuantState`` holds the
  streamed views (``bnb.matmul_4bit``: dequantize, then the linear, or its gemv for one row
  under no grad). 4.5 bits a weight at blocksize 64, about 4.13 with double quantization.

An accuracy recovery adapter (ARA, ai-toolkit's side LoRA on a quantized layer) is a module of
its own whose forward wraps the layer's (``org_forward``): it stays on the device, trainable or
frozen as ai-toolkit made it, and the streamed layer runs inside it (``hooks``); its sizes are
checked against the layer's. Every other ai-toolkit qtype (``convrotbitnet``: ternary codes
five a byte; ``convrotcomfyw4a4``; ``orbit2/3/4`` and the vector-quantized ``orbit``) and every
other torchao subclass is refused by name, before anything is uploaded, with what to use
instead; so are bitsandbytes' 8-bit ``Linear8bitLt``/``Int8Params`` and GGUF tensors
(``GGUFParameter``: diffusers' GGUF loading, OneTrainer's GGUF bases) (``REFUSED``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

WEIGHT = "weight"  # the weight is a tensor subclass
BUFFERS = "buffers"  # the module holds named buffers
QUANT_STATE = "quant_state"  # bitsandbytes: the weight's data and its QuantState's tensors


@dataclass(frozen=True)
class Form:
    """One streamed format. ``tensors(m)``: the layout its inner tensors must have, name ->
    (dtype, shape), from the layer's size (``optional``: names that may be absent);
    ``check(m)``: a further rule of the layout in words, or None; ``stays``: what stays on the
    device, in words (the attach summary)."""

    name: str
    kind: str
    tensors: Callable[[nn.Module], dict[str, tuple[torch.dtype, tuple[int, ...]]]]
    optional: frozenset[str] = frozenset()
    check: Callable[[nn.Module], str | None] = lambda m: None
    stays: str = "the weight's flatten context (attributes, no tensor)"


# --- the layouts ---------------------------------------------------------------------------


def _nf4_tensors(m):
    w = m.weight
    n = w.numel()
    return {
        "quantized_data": (torch.uint8, (n // 2,)),
        "scaler_mean": (w.dtype, ()),
        "quantization_factor": (w.dtype, (n // w.block_size // w.scaler_block_size,)),
        "quantized_scalers": (torch.int8, (n // w.block_size,)),
        "nf4": (w.dtype, (16,)),
    }


def _intx_tensors(m):
    w = m.weight
    blocks = tuple(s // b for s, b in zip(w.shape, w.block_size, strict=False))
    return {
        "qdata": (torch.int8, tuple(w.shape)),
        "scale": (w.scale.dtype, blocks),
        "zero_point": (w.zero_point.dtype, blocks),
    }


def _intx_check(m):
    w = m.weight
    if (
        w.dim() != 2
        or len(w.block_size) != 2
        or any(s % b for s, b in zip(w.shape, w.block_size, strict=True))
    ):
        return f"has shape {list(w.shape)} in blocks {list(w.block_size)}; 2-D whole blocks stream"
    return None


def _uintx_tensors(nbits: int):
    def tensors(m):
        out, inputs = m.out_features, m.in_features
        groups = inputs // 64
        numel = out * inputs
        packed = sum(-(-numel // (8 // k)) for k in (8, 4, 2, 1) if nbits & k)
        itemsize = m.ostris_orig_dtype.itemsize
        return {
            "uintx_packed": (torch.uint8, (packed,)),
            "uintx_scale": (torch.uint8, (out, groups * itemsize)),
            "uintx_zero_point": (torch.uint8, (out, groups)),
        }

    return tensors


def _uintx_check(nbits: int):
    def check(m):
        q = m.ostris_quantizer
        if getattr(q, "nbits", nbits) != nbits or getattr(q, "group_size", 64) != 64:
            return f"has nbits {q.nbits} and group_size {q.group_size}, not {nbits} and 64"
        if m.in_features % 64:
            return f"has in_features {m.in_features}, not a multiple of the group size 64"
        return None

    return check


def _nvfp4_tensors(m):
    out, inputs = m.out_features, m.in_features
    return {
        "nv4_qdata": (torch.uint8, (out, inputs // 2)),
        "nv4_scales": (torch.uint8, (out, inputs // 16)),
        "nv4_pts": (torch.uint8, (4,)),
        "nv4_pre_scale": (torch.uint8, (inputs * 4,)),
    }


def _convrot8_tensors(m):
    return {
        "cr8_qdata": (torch.int8, (m.out_features, m.in_features)),
        "cr8_scales": (torch.uint8, (m.out_features * 4,)),
    }


def _convrot4_tensors(m):
    out, inputs = m.out_features, m.in_features
    blocked = -(-out // 128) * 128 * -(-(inputs // 16) // 4) * 4
    return {
        "cr_qdata": (torch.uint8, (out, inputs // 2)),
        "cr_scales": (torch.uint8, (out, inputs // 16)),
        "cr_scales_blocked": (torch.uint8, (blocked,)),
        "cr_pts": (torch.uint8, (4,)),
    }


def _rotation_check(attribute: str):
    def check(m):
        rot = getattr(m, attribute, None)
        if not isinstance(rot, int) or rot < 1 or m.in_features % rot:
            return f"has {attribute} {rot!r}, which does not divide in_features {m.in_features}"
        return None

    return check


def _intn_group(inputs: int) -> int:
    """ai-toolkit's k-group of ``convrotint*`` (128, halved until it divides the width)."""
    group = 128
    while inputs % group:
        group //= 2
    return group


def _convrotint_tensors(bits: int):
    def tensors(m):
        out, inputs = m.out_features, m.in_features
        return {
            "crn_qdata": (torch.uint8, (out, inputs // 8 * bits)),
            "crn_scales": (torch.uint8, (out * 4,)),
            "crn_gratio": (torch.uint8, (out, inputs // _intn_group(inputs) * 4)),
        }

    return tensors


def _convrotint_check(bits: int):
    rotation = _rotation_check("crn_rot_size")

    def check(m):
        if getattr(m, "crn_bits", None) != bits:
            return f"has crn_bits {getattr(m, 'crn_bits', None)!r}, not {bits}"
        if m.in_features % 8:
            return f"has in_features {m.in_features}, not a multiple of 8"
        grouped = m._buffers.get("crn_gratio") is not None
        if grouped != (bits <= 7):
            return f"{'has' if grouped else 'has no'} crn_gratio at {bits} bits"
        return rotation(m)

    return check


def _bnb4_tensors(m):
    w = m.weight
    qs = w.quant_state
    n = m.out_features * m.in_features
    blocks = -(-n // qs.blocksize)
    out = {"weight": (w.dtype, ((n + 1) // (2 * w.dtype.itemsize), 1))}
    if not qs.nested:
        return {**out, "weight.absmax": (torch.float32, (blocks,))}
    return {
        **out,
        "weight.absmax": (torch.uint8, (blocks,)),
        "weight.offset": (torch.float32, ()),
        "weight.nested_absmax": (torch.float32, (-(-blocks // qs.state2.blocksize),)),
    }


def _bnb4_check(quant_type: str):
    def check(m):
        w = m._parameters.get("weight")
        if (type(w).__module__, type(w).__qualname__) != PARAMS4BIT:
            return f"has a weight of type {type(w).__name__}, not bitsandbytes' Params4bit"
        qs = getattr(w, "quant_state", None)
        if not getattr(w, "bnb_quantized", False) or qs is None:
            return (
                "is not quantized yet (no quant_state): bitsandbytes quantizes a Linear4bit "
                "as it moves to its device; move the model there (model.to(device)) first"
            )
        if getattr(qs, "packing_format_for_cpu", False):
            return (
                "was repacked for bitsandbytes' CPU kernel (quant_state.packing_format_for_cpu, "
                "after an inference forward on an AVX512-BF16 CPU), not the layout Linear4bit "
                "holds on a GPU"
            )
        if qs.quant_type != quant_type:
            return f"has quant_state.quant_type {qs.quant_type!r}, not {quant_type!r}"
        if tuple(qs.shape) != (m.out_features, m.in_features):
            return (
                f"has quant_state.shape {list(qs.shape)}, not its [out_features, in_features] "
                f"{[m.out_features, m.in_features]}"
            )
        tables = [("quant_state.code", qs.code)]
        if qs.nested:
            tables.append(("quant_state.state2.code", qs.state2.code))
        for what, code in tables:
            if not isinstance(code, torch.Tensor) or code.device.type == "meta":
                return f"has no {what} (the code table that stays on the device)"
        return None

    return check


#: The weight subclasses that stream, by (their type's module, its name).
WEIGHT_FORMS = {
    ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "NF4Tensor"): Form(
        "torchao.NF4Tensor", WEIGHT, _nf4_tensors
    ),
    ("torchao.quantization", "IntxUnpackedToInt8Tensor"): Form(
        "torchao.IntxUnpackedToInt8Tensor", WEIGHT, _intx_tensors, check=_intx_check
    ),
}
#: ai-toolkit's quantized Linear, by its type's module and name; its formats by qtype.
OSTRIS_LINEAR = ("toolkit.util.ostris_quant", "OstrisLinear")
_ARA = "the ARA side LoRA (ara_lora_ref), trainable or frozen as ai-toolkit made it"
OSTRIS_FORMS = {
    **{
        f"uint{b}": Form(
            f"aitk.uint{b}", BUFFERS, _uintx_tensors(b), check=_uintx_check(b), stays=_ARA
        )
        for b in range(2, 8)
    },
    "nvfp4": Form(
        "aitk.nvfp4",
        BUFFERS,
        _nvfp4_tensors,
        optional=frozenset({"nv4_pre_scale"}),
        stays=_ARA,
    ),
    "convrot8": Form(
        "aitk.convrot8",
        BUFFERS,
        _convrot8_tensors,
        check=_rotation_check("cr8_rot_size"),
        stays=f"cr8_rot_size; {_ARA}",
    ),
    "convrot4": Form(
        "aitk.convrot4",
        BUFFERS,
        _convrot4_tensors,
        check=_rotation_check("cr_rot_size"),
        stays=f"cr_rot_size; {_ARA}",
    ),
    **{
        f"convrotint{b}": Form(
            f"aitk.convrotint{b}",
            BUFFERS,
            _convrotint_tensors(b),
            optional=frozenset({"crn_gratio"}),
            check=_convrotint_check(b),
            stays=f"crn_bits, crn_rot_size; {_ARA}",
        )
        for b in range(2, 9)
    },
}
#: bitsandbytes' 4-bit Linear and its weight, by their types' module and name; its formats by
#: quant_type.
LINEAR4BIT = ("bitsandbytes.nn.modules", "Linear4bit")
PARAMS4BIT = ("bitsandbytes.nn.modules", "Params4bit")
_CODES = "the code tables (quant_state.code; state2.code with double quantization)"
BNB_FORMS = {
    q: Form(f"bnb.{q}", QUANT_STATE, _bnb4_tensors, check=_bnb4_check(q), stays=_CODES)
    for q in ("nf4", "fp4")
}
#: Quantized forms refused by name, by a type's name in the MRO of the layer or of its weight
#: (any module: forks keep the names): what it is and why it does not stream; what to do.
_BNB8 = (
    "bitsandbytes' 8-bit {kind} (LLM.int8()), whose forward keeps and changes its own int8 "
    "state (CB, SCB, the outlier columns) as it runs",
    "load the model in 4 bits instead (bitsandbytes' Linear4bit, nf4 or fp4, streams as it "
    "is) or unquantized (quantize='fp8' streams it in 8 bits)",
)
REFUSED = {
    "Linear8bitLt": _BNB8,
    "Int8Params": _BNB8,
    "GGUFParameter": (
        "a GGUF tensor ({kind} of {module}: GGML blocks, which only its loader's kernels read)",
        "load the model from its bf16/fp16 safetensors instead and stream it in 8 bits "
        "(quantize='fp8') or in 4 bits as bitsandbytes' Linear4bit (nf4) or torchao's "
        "NF4Tensor",
    ),
}
#: What to do with a packed form that does not stream, at the end of its refusal.
INSTEAD = (
    "stream a form weightstream takes ({streamed}), load the model unquantized "
    "(quantize='fp8' streams it in 8 bits), or keep the layer on the device (ignore=[{name!r}])"
)
