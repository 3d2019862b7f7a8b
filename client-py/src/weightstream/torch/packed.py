"""Packed quantized layers streamed as they are: a format is a description of its tensors.

A quantizer keeps a layer's weight in one of two shapes, and both stream the same way:

- **a weight that is a tensor subclass** implementing torch's traceable-subclass protocol
  (``__tensor_flatten__`` gives its inner plain tensors and a context,
  ``__tensor_unflatten__`` makes it again from them);
- **a quantizer's Linear module** whose packed state is a set of named buffers (ai-toolkit's
  ``OstrisLinear``: ``module.ostris_quantizer.forward(module, x)`` reads them off the module).

The layer's inner tensors stream as one group with its bias, each uploaded byte for byte as a
raw tensor of its own dtype (the daemon holds any dtype; nothing is converted). On use the
client rebuilds the weight (``__tensor_unflatten__`` of the streamed views) or puts the views
in the module's buffers, and runs the layer's own class forward, which is the quantizer's: the
output is the same function of the same bytes as the layer in place, so outputs and gradients
are ``torch.equal`` to it (``ops`` re-runs that forward in backward and lets autograd
differentiate it). Between calls the module holds ``Placeholder``s of its streamed tensors.

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

An accuracy recovery adapter (ARA, ai-toolkit's side LoRA on a quantized layer) is a module of
its own whose forward wraps the layer's (``org_forward``): it stays on the device, trainable or
frozen as ai-toolkit made it, and the streamed layer runs inside it (``hooks``); its sizes are
checked against the layer's. Every other ai-toolkit qtype (``convrotbitnet``: ternary codes
five a byte; ``convrotcomfyw4a4``; ``orbit2/3/4`` and the vector-quantized ``orbit``) and every
other torchao subclass is refused by name, before anything is uploaded, with what to use
instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from weightstream import _dtypes
from weightstream.torch import placeholder

WEIGHT = "weight"  # the weight is a tensor subclass
BUFFERS = "buffers"  # the module holds named buffers


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
#: What to do with a packed form that does not stream, at the end of its refusal.
INSTEAD = (
    "stream a form weightstream takes ({streamed}), load the model unquantized "
    "(quantize='fp8' streams it in 8 bits), or keep the layer on the device (ignore=[{name!r}])"
)


def _type_key(obj) -> tuple[str, str]:
    return (type(obj).__module__ or "", type(obj).__qualname__)


def is_ostris_linear(m: nn.Module) -> bool:
    """Whether ``m`` is ai-toolkit's ``OstrisLinear`` (by its type, without importing it)."""
    return any((c.__module__, c.__qualname__) == OSTRIS_LINEAR for c in type(m).__mro__)


def form_of(m: nn.Module) -> Form | None:
    """The format ``m`` streams in, if its weight or its class is one of ``FORMATS``; None
    otherwise (also for an ``OstrisLinear`` of a qtype that does not stream: ``refusal``)."""
    if is_ostris_linear(m):
        return OSTRIS_FORMS.get(getattr(getattr(m, "ostris_quantizer", None), "qtype", None))
    w = m._parameters.get("weight")
    return None if w is None else WEIGHT_FORMS.get(_type_key(w))


def claims(m: nn.Module) -> bool:
    """Whether this module decides ``m``: a streamed form, or an ``OstrisLinear`` (refused by
    qtype)."""
    return is_ostris_linear(m) or form_of(m) is not None


def torchao_names() -> str:
    """The torchao subclasses that stream as packed layers, in words."""
    return " and ".join(name for _, name in WEIGHT_FORMS)


def streamed_names() -> str:
    """The packed forms that stream, in words (refusals name them)."""
    runs = [[q for q in OSTRIS_FORMS if q.startswith(p)] for p in ("uint", "convrotint")]
    single = [q for q in OSTRIS_FORMS if not any(q in run for run in runs)]
    aitk = ", ".join([f"{run[0]}..{run[-1]}" for run in runs] + single)
    return f"torchao's {torchao_names()}, ai-toolkit's OstrisLinear of {aitk}"


def inner(m: nn.Module, form: Form) -> dict[str, torch.Tensor]:
    """The tensors of ``m`` that stream in ``form``, by their name in it (present ones)."""
    if form.kind == WEIGHT:
        names, _ = m.weight.__tensor_flatten__()
        return {n: getattr(m.weight, n) for n in names if getattr(m.weight, n) is not None}
    return {n: b for n, b in m._buffers.items() if b is not None}


def refusal(name: str, m: nn.Module) -> str | None:
    """Why layer ``name`` cannot stream as a packed form, naming the form, the rule and what
    to do; None when it streams (or is no packed form: ``claims``)."""
    instead = INSTEAD.format(streamed=streamed_names(), name=name)
    if is_ostris_linear(m):
        q = getattr(m, "ostris_quantizer", None)
        qtype = getattr(q, "qtype", None)
        form = OSTRIS_FORMS.get(qtype)
        if q is None:
            return (
                f"cannot stream {name!r}: it is ai-toolkit's OstrisLinear without a quantizer "
                f"(no ostris_quantizer): {instead}"
            )
        if form is None:
            return (
                f"cannot stream {name!r}: it is ai-toolkit's OstrisLinear of qtype {qtype!r} "
                f"({type(q).__name__}), a packed form weightstream does not stream: {instead}"
            )
        what = f"it is ai-toolkit's OstrisLinear of qtype {qtype!r}"
    else:
        form = form_of(m)
        if form is None:
            return None
        what = f"its weight is a {type(m.weight).__name__} made by torchao"
        if not isinstance(m, nn.Linear) or type(m).forward is not nn.Linear.forward:
            return (
                f"cannot stream {name!r}: {what}, on a {type(m).__name__}: packed torchao "
                "weights stream on nn.Linear layers with Linear's own forward; keep the layer "
                f"on the device (ignore=[{name!r}])"
            )
        if m.weight.requires_grad:
            return (
                f"cannot stream {name!r}: {what}, which requires grad: a packed base weight is "
                "frozen; freeze it (module.weight.requires_grad_(False)) or keep the layer on "
                f"the device (ignore=[{name!r}])"
            )
    why = _layout_refusal(m, form)
    if why is None:
        why = _side_refusal(m)
    if why is None:
        return None
    return f"cannot stream {name!r}: {what} ({form.name}), which {why}: {instead}"


def _layout_refusal(m: nn.Module, form: Form) -> str | None:
    try:
        why = form.check(m)
        want = form.tensors(m)
    except (AttributeError, TypeError, ZeroDivisionError) as e:
        return f"is not the layout of {form.name} ({e})"
    if why is not None:
        return why
    have = inner(m, form)
    missing = sorted(set(want) - set(have) - form.optional)
    unknown = sorted(set(have) - set(want))
    if missing or unknown:
        return (
            f"holds tensors {sorted(have)}, not the layout of {form.name} ({sorted(want)}; "
            f"missing {missing}, unknown {unknown})"
        )
    for n, t in have.items():
        dtype, shape = want[n]
        if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
            return f"has {n} of type {type(t).__name__}: only plain tensors stream byte for byte"
        if t.dtype != dtype or tuple(t.shape) != shape:
            return f"has {n} of {t.dtype} {list(t.shape)}; {form.name} holds {dtype} {list(shape)}"
        if t.dtype not in _dtypes.FROM_TORCH:
            return f"has {n} of {t.dtype}, which the daemon cannot hold"
        if not t.is_contiguous():
            return f"has {n} not contiguous: its bytes are not the tensor's in order"
        if t.requires_grad:
            return f"has {n} requiring grad: a packed base is frozen"
    if form.kind == BUFFERS:
        params = sorted(n for n, p in m._parameters.items() if p is not None and n != "bias")
        if params:
            return f"has parameters {params} besides its bias: only its buffers stream"
    bias = m._parameters.get("bias")
    if bias is not None and bias.requires_grad:
        return "has a bias that requires grad: a packed base is frozen"
    return None


def _side_refusal(m: nn.Module) -> str | None:
    """An ai-toolkit ARA whose sizes do not match its layer."""
    ref = getattr(m, "ara_lora_ref", None)
    lora = ref() if callable(ref) else None
    if lora is None:
        return None
    down, up = getattr(lora, "lora_down", None), getattr(lora, "lora_up", None)
    sizes = (getattr(down, "in_features", None), getattr(up, "out_features", m.out_features))
    if sizes != (m.in_features, m.out_features):
        return (
            f"has an ARA of in/out {list(sizes)} on a layer of in/out "
            f"{[m.in_features, m.out_features]}"
        )
    return None


# --- a streamed layer ----------------------------------------------------------------------


@dataclass(eq=False)
class Packed:
    """A layer streamed in a packed form: its inner tensors' names in upload order, and what
    rebuilds its state from their views (``state``)."""

    form: Form
    names: tuple[str, ...]
    has_bias: bool
    #: The weight's float dtype (the subclass's, or ``ostris_orig_dtype``).
    dtype: torch.dtype
    #: Bytes of the inner tensors; weights of the layer (out x in).
    nbytes: int
    weights: int
    #: WEIGHT: the subclass type, its flatten context, size and stride.
    rebuild: tuple | None = None
    #: The placeholders the module holds between calls (name -> tensor).
    held: dict = field(default_factory=dict)

    @classmethod
    def of(cls, m: nn.Module) -> Packed:
        form = form_of(m)
        tensors = inner(m, form)
        rebuild = None
        if form.kind == WEIGHT:
            w = m.weight
            _, ctx = w.__tensor_flatten__()
            rebuild = (type(w), ctx, w.shape, w.stride())
            dtype = w.dtype
        else:
            dtype = m.ostris_orig_dtype
        return cls(
            form,
            tuple(tensors),
            m.bias is not None,
            dtype,
            sum(t.nbytes for t in tensors.values()),
            m.out_features * m.in_features,
            rebuild,
        )

    def tensors(self, name: str, m: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """The layer's tensors as the daemon names them: the inner ones, then the bias."""
        where = f"{name}.weight." if self.form.kind == WEIGHT else f"{name}."
        out = [(where + n, t) for n, t in inner(m, self.form).items()]
        if self.has_bias:
            out.append((f"{name}.bias", m.bias))
        return out

    def labels(self, name: str) -> dict[str, tuple[str, int]]:
        """The daemon's labels of the layer's inner tensors (``Client.upload_model``): the
        form's name on each, the layer's weights on the first, so that the daemon's ``status``
        shows the form with its bytes and bits per weight (the bias counts as its dtype)."""
        where = f"{name}.weight." if self.form.kind == WEIGHT else f"{name}."
        return {
            where + n: (self.form.name, self.weights if i == 0 else 0)
            for i, n in enumerate(self.names)
        }

    def views(self, tensors, slot: int) -> tuple:
        """(``State``, bias view) from a ticket's tensors, the layer's starting at ``slot``."""
        n = len(self.names)
        bias = tensors[slot + n] if self.has_bias else None
        return State(self, dict(zip(self.names, tensors[slot : slot + n], strict=True))), bias

    def free(self, name: str, m: nn.Module, device: torch.device) -> list[str]:
        """Placeholders on ``device`` in place of the streamed tensors (the bias is
        ``attach``'s). Returns the daemon's names of those replaced."""
        if self.form.kind == WEIGHT:
            w = m._parameters["weight"]
            if placeholder.is_placeholder(w):
                return []
            m._parameters["weight"] = placeholder.parameter(w, device, f"{name}.weight")
            self.held = {"weight": m._parameters["weight"]}
            return [f"{name}.weight"]
        freed = []
        for n in self.names:
            b = m._buffers[n]
            if not placeholder.is_placeholder(b):
                m._buffers[n] = placeholder.Placeholder(b, device, f"{name}.{n}")
                freed.append(f"{name}.{n}")
        self.held = {n: m._buffers[n] for n in self.names}
        return freed

    def restore(self, m: nn.Module, state: State, device: torch.device):
        """Puts copies of ``state``'s tensors on ``device`` back into ``m`` (``detach``)."""
        copies = {n: t.to(device, copy=True) for n, t in state.tensors.items()}
        if self.form.kind == WEIGHT:
            w = _unflatten(self.rebuild, copies)
            m.weight = nn.Parameter(w, requires_grad=False)
        else:
            for n, t in copies.items():
                m._buffers[n] = t
        self.held = {}


def _on_device(value, device: torch.device):
    """A flatten context with its recorded device replaced (NF4Tensor records it in a
    ``tensor_meta`` named tuple): the views may be on another device than the tensor was."""
    if isinstance(value, dict):
        return {k: _on_device(v, device) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_replace") and "device" in value._fields:
        return value._replace(device=device)
    return value


def _unflatten(rebuild: tuple, tensors: dict) -> torch.Tensor:
    cls, ctx, size, stride = rebuild
    device = next(iter(tensors.values())).device
    return cls.__tensor_unflatten__(dict(tensors), _on_device(ctx, device), size, stride)


class State:
    """A packed layer's state rebuilt from views: ``run`` computes the layer's own forward on
    it (``ops.op``)."""

    __slots__ = ("packed", "tensors")

    def __init__(self, packed: Packed, tensors: dict):
        self.packed, self.tensors = packed, tensors

    def run(self, module: nn.Module, x: torch.Tensor, bias) -> torch.Tensor:
        """The layer's class forward with its state swapped in for the call and the
        placeholders put back after (the quantizer reads its state off the module)."""
        p = self.packed
        params, buffers = module._parameters, module._buffers
        saved_bias = params.get("bias")
        if p.form.kind == WEIGHT:
            saved = {"weight": params["weight"]}
            params["weight"] = _unflatten(p.rebuild, self.tensors)
            swap = params
        else:
            saved = {n: buffers.get(n) for n in self.tensors}
            buffers.update(self.tensors)
            swap = buffers
        if p.has_bias:
            params["bias"] = bias
        try:
            return type(module).forward(module, x)
        finally:
            swap.update(saved)
            if p.has_bias:
                params["bias"] = saved_bias


def summary(layers) -> dict:
    """Per streamed packed format: its layers, bytes, bytes and bits per weight, and what stays
    on the device (``Handle.stats``: ``packed_formats``)."""
    out: dict[str, dict] = {}
    for layer in layers:
        p = layer.packed
        if p is None:
            continue
        entry = out.setdefault(
            p.form.name, {"layers": 0, "bytes": 0, "weights": 0, "stays": p.form.stays}
        )
        entry["layers"] += 1
        entry["bytes"] += p.nbytes
        entry["weights"] += p.weights
    for entry in out.values():
        entry["bytes_per_weight"] = round(entry["bytes"] / max(1, entry["weights"]), 4)
        entry["bits_per_weight"] = round(8 * entry["bytes"] / max(1, entry["weights"]), 3)
    return out
