"""Packed quantized layers streamed as they are: a format is a description of its tensors.

A quantizer keeps a layer's weight in one of three shapes, and all stream the same way:

- **a weight that is a tensor subclass** implementing torch's traceable-subclass protocol
  (``__tensor_flatten__`` gives its inner plain tensors and a context,
  ``__tensor_unflatten__`` makes it again from them);
- **a quantizer's Linear module** whose packed state is a set of named buffers (ai-toolkit's
  ``OstrisLinear``: ``module.ostris_quantizer.forward(module, x)`` reads them off the module);
- **a weight parameter with a state object** (bitsandbytes' ``Linear4bit``: a ``Params4bit``
  whose data are the codes and whose ``QuantState`` holds the scales and code tables).

The layer's inner tensors stream as one group with its bias, each uploaded byte for byte as a
raw tensor of its own dtype (the daemon holds any dtype; nothing is converted). On use the
client rebuilds the weight (``__tensor_unflatten__`` of the streamed views; a ``Params4bit`` of
the views with a ``QuantState`` holding them) or puts the views in the module's buffers, and
runs the layer's own class forward, which is the quantizer's: the output is the same function
of the same bytes as the layer in place, so outputs and gradients are ``torch.equal`` to it
(``ops`` re-runs that forward in backward and lets autograd differentiate it). Between calls
the module holds ``Placeholder``s of its streamed tensors.

The formats are ``packed_forms``'s: this module recognises a layer's form, checks its layout,
and streams it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from weightstream import _dtypes
from weightstream.torch import placeholder
from weightstream.torch.packed_forms import (
    BNB_FORMS,
    BUFFERS,
    INSTEAD,
    LINEAR4BIT,
    OSTRIS_FORMS,
    OSTRIS_LINEAR,
    QUANT_STATE,
    REFUSED,
    WEIGHT,
    WEIGHT_FORMS,
    Form,
)


def _type_key(obj) -> tuple[str, str]:
    return (type(obj).__module__ or "", type(obj).__qualname__)


def _is(obj, key: tuple[str, str]) -> bool:
    return any((c.__module__, c.__qualname__) == key for c in type(obj).__mro__)


def is_ostris_linear(m: nn.Module) -> bool:
    """Whether ``m`` is ai-toolkit's ``OstrisLinear`` (by its type, without importing it)."""
    return _is(m, OSTRIS_LINEAR)


def is_linear4bit(m: nn.Module) -> bool:
    """Whether ``m`` is bitsandbytes' ``Linear4bit`` (by its type, without importing it)."""
    return _is(m, LINEAR4BIT)


def _refused_name(m: nn.Module) -> tuple[str, type] | None:
    """The name in ``REFUSED`` of the layer's or its weight's type (or a base of them), and
    that type."""
    for obj in (m, m._parameters.get("weight")):
        for c in type(obj).__mro__:
            if c.__qualname__ in REFUSED:
                return c.__qualname__, type(obj)
    return None


def _bnb_quant_type(m: nn.Module) -> str | None:
    """A Linear4bit's quant type: its weight's, or (streamed: a placeholder weight) its
    module's ``quant_state``'s."""
    for holder in (m._parameters.get("weight"), getattr(m, "quant_state", None)):
        quant_type = getattr(holder, "quant_type", None)
        if quant_type is not None:
            return quant_type
    return None


def form_of(m: nn.Module) -> Form | None:
    """The format ``m`` streams in, if its weight or its class is one of ``FORMATS``; None
    otherwise (also for an ``OstrisLinear`` or ``Linear4bit`` of a type that does not stream:
    ``refusal``)."""
    if is_ostris_linear(m):
        return OSTRIS_FORMS.get(getattr(getattr(m, "ostris_quantizer", None), "qtype", None))
    if is_linear4bit(m):
        return BNB_FORMS.get(_bnb_quant_type(m))
    w = m._parameters.get("weight")
    return None if w is None else WEIGHT_FORMS.get(_type_key(w))


def claims(m: nn.Module) -> bool:
    """Whether this module decides ``m``: a streamed form, an ``OstrisLinear`` or
    ``Linear4bit`` (refused by qtype), or a form refused by name (``REFUSED``)."""
    return (
        is_ostris_linear(m)
        or is_linear4bit(m)
        or _refused_name(m) is not None
        or form_of(m) is not None
    )


def torchao_names() -> str:
    """The torchao subclasses that stream as packed layers, in words."""
    return " and ".join(name for _, name in WEIGHT_FORMS)


def streamed_names() -> str:
    """The packed forms that stream, in words (refusals name them)."""
    runs = [[q for q in OSTRIS_FORMS if q.startswith(p)] for p in ("uint", "convrotint")]
    single = [q for q in OSTRIS_FORMS if not any(q in run for run in runs)]
    aitk = ", ".join([f"{run[0]}..{run[-1]}" for run in runs] + single)
    bnb = " and ".join(BNB_FORMS)
    return (
        f"torchao's {torchao_names()}, ai-toolkit's OstrisLinear of {aitk}, bitsandbytes' "
        f"Linear4bit of {bnb}"
    )


def inner(m: nn.Module, form: Form) -> dict[str, torch.Tensor]:
    """The tensors of ``m`` that stream in ``form``, by their name in it (present ones)."""
    if form.kind == WEIGHT:
        names, _ = m.weight.__tensor_flatten__()
        return {n: getattr(m.weight, n) for n in names if getattr(m.weight, n) is not None}
    if form.kind == QUANT_STATE:
        w = m._parameters["weight"]
        qs = getattr(w, "quant_state", None) or m.quant_state  # streamed: the module's
        out = {"weight": w if placeholder.is_placeholder(w) else w.data, "weight.absmax": qs.absmax}
        if qs.nested:
            out["weight.offset"] = qs.offset
            out["weight.nested_absmax"] = qs.state2.absmax
        return out
    return {n: b for n, b in m._buffers.items() if b is not None}


def refusal(name: str, m: nn.Module) -> str | None:
    """Why layer ``name`` cannot stream as a packed form, naming the form, the rule and what
    to do; None when it streams (or is no packed form: ``claims``)."""
    instead = INSTEAD.format(streamed=streamed_names(), name=name)
    refused = _refused_name(m)
    if refused is not None:
        kind, cls = refused
        what, todo = REFUSED[kind]
        what = what.format(kind=kind, module=cls.__module__)
        return (
            f"cannot stream {name!r}: it is {what}, a quantized form weightstream does not "
            f"stream: {todo}, or keep the layer on the device (ignore=[{name!r}])"
        )
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
    elif is_linear4bit(m):
        quant_type, form = _bnb_quant_type(m), form_of(m)
        what = f"it is bitsandbytes' {type(m).__name__} of quant_type {quant_type!r}"
        if form is None:
            return (
                f"cannot stream {name!r}: {what}, a packed form weightstream does not stream: "
                f"{instead}"
            )
        if getattr(m._parameters.get("weight"), "requires_grad", False):
            return (
                f"cannot stream {name!r}: {what}, whose weight requires grad: a packed base "
                "weight is frozen; freeze it (module.weight.requires_grad_(False)) or keep the "
                f"layer on the device (ignore=[{name!r}])"
            )
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
        want = form.tensors(m) if why is None else {}
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
    #: WEIGHT: the subclass type, its flatten context, size and stride. QUANT_STATE: the
    #: Params4bit type, its attributes but ``quant_state``, and that ``QuantState`` (from
    #: ``free`` on, holding placeholders of the streamed tensors and the code tables).
    rebuild: tuple | None = None
    #: The placeholders the module holds between calls (name -> tensor).
    held: dict = field(default_factory=dict)
    #: The function ``State.run`` calls on the module: the one its forward chain ends in
    #: (``hooks.own_function``; an ARA's ``nn.Linear.forward``), else its class's forward.
    forward: object = None

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
        elif form.kind == QUANT_STATE:
            w = m.weight
            attrs = {k: v for k, v in vars(w).items() if k != "quant_state"}
            rebuild = (type(w), attrs, w.quant_state)
            dtype = w.quant_state.dtype
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
        where = self._where(name)
        out = [(where + n, t) for n, t in inner(m, self.form).items()]
        if self.has_bias:
            out.append((f"{name}.bias", m.bias))
        return out

    def labels(self, name: str) -> dict[str, tuple[str, int]]:
        """The daemon's labels of the layer's inner tensors (``Client.upload_model``): the
        form's name on each, the layer's weights on the first, so that the daemon's ``status``
        shows the form with its bytes and bits per weight (the bias counts as its dtype)."""
        where = self._where(name)
        return {
            where + n: (self.form.name, self.weights if i == 0 else 0)
            for i, n in enumerate(self.names)
        }

    def _where(self, name: str) -> str:
        """The prefix of the daemon's names of the inner tensors (a QUANT_STATE form's names
        are bitsandbytes' state dict keys: ``weight``, ``weight.absmax``, ...)."""
        return f"{name}.weight." if self.form.kind == WEIGHT else f"{name}."

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
        if self.form.kind == QUANT_STATE:
            return self._free_quant_state(name, m, device)
        _guard_weight(type(m))
        freed = []
        for n in self.names:
            b = m._buffers[n]
            if not placeholder.is_placeholder(b):
                m._buffers[n] = placeholder.Placeholder(b, device, f"{name}.{n}")
                freed.append(f"{name}.{n}")
        self.held = {n: m._buffers[n] for n in self.names}
        return freed

    def _free_quant_state(self, name: str, m: nn.Module, device: torch.device) -> list[str]:
        """A Linear4bit's weight and the streamed tensors of its ``QuantState`` (on the weight
        and on the module) become placeholders; the code tables move to ``device`` and stay."""
        w = m._parameters["weight"]
        if placeholder.is_placeholder(w):
            return []
        qs = w.quant_state
        held = {"weight": placeholder.parameter(w, device, f"{name}.weight")}

        def hold(n: str, t: torch.Tensor) -> torch.Tensor:
            held[n] = placeholder.Placeholder(t, device, f"{name}.{n}")
            return held[n]

        kept = _copied(qs, code=qs.code.to(device), absmax=hold("weight.absmax", qs.absmax))
        if qs.nested:
            kept.offset = hold("weight.offset", qs.offset)
            kept.state2 = _copied(
                qs.state2,
                code=qs.state2.code.to(device),
                absmax=hold("weight.nested_absmax", qs.state2.absmax),
            )
        cls, attrs, _ = self.rebuild
        self.rebuild = (cls, attrs, kept)
        m._parameters["weight"] = held["weight"]
        if getattr(m, "quant_state", None) is not None:
            m.quant_state = kept  # it held the QuantState too: its tensors go with it
        self.held = held
        return [f"{name}.{n}" for n in held]

    def restore(self, m: nn.Module, state: State, device: torch.device):
        """Puts copies of ``state``'s tensors on ``device`` back into ``m`` (``detach``)."""
        copies = {n: t.to(device, copy=True) for n, t in state.tensors.items()}
        if self.form.kind == WEIGHT:
            w = _unflatten(self.rebuild, copies)
            m.weight = nn.Parameter(w, requires_grad=False)
        elif self.form.kind == QUANT_STATE:
            w = _params4bit(self.rebuild, copies)
            m._parameters["weight"] = w
            if hasattr(m, "quant_state"):
                m.quant_state = w.quant_state
        else:
            for n, t in copies.items():
                m._buffers[n] = t
        self.held = {}


def _guard_weight(cls: type):
    """ai-toolkit's ``OstrisLinear.weight`` is a property that dequantizes the layer's buffers,
    and ai-toolkit reads it off every layer when it makes its LoRA network (``create_modules``:
    ``isinstance(weight, nn.Parameter)``), after the loader attached the model. While the
    buffers are weightstream's placeholders there is nothing to dequantize: the property then
    gives a placeholder of the weight's shape and dtype (no ``Parameter``, as ai-toolkit's
    dequantized tensor is not); otherwise, and during ``State.run``, it is ai-toolkit's. The
    class that defines the property gets the guard once."""
    owner = next((c for c in cls.__mro__ if isinstance(vars(c).get("weight"), property)), None)
    if owner is None:
        return
    prop = vars(owner)["weight"]
    if getattr(prop.fget, "weightstream_guard", False):
        return
    dequantized = prop.fget

    def weight(m):
        held = next((b for b in m._buffers.values() if placeholder.is_placeholder(b)), None)
        if held is None:
            return dequantized(m)
        name = held.streamed_name.rpartition(".")[0] + ".weight"
        shape = (m.out_features, m.in_features)
        return placeholder.Placeholder.make(shape, m.ostris_orig_dtype, held.device, name)

    weight.weightstream_guard = True
    owner.weight = property(weight, prop.fset, prop.fdel, prop.__doc__)


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


def _copied(obj, **changes):
    """A shallow copy of a bitsandbytes ``QuantState`` with ``changes`` (its attributes are
    plain: a new object of its type with its ``__dict__``)."""
    out = object.__new__(type(obj))
    out.__dict__.update(vars(obj), **changes)
    return out


def _params4bit(rebuild: tuple, tensors: dict) -> torch.Tensor:
    """bitsandbytes' ``Params4bit`` on the streamed views: the data ``weight``, its
    ``QuantState`` a copy of the kept one with the views of absmax (and of the offset and
    nested absmax) and the code tables on the views' device; made as ``Params4bit.__new__``
    makes it, without importing bitsandbytes."""
    cls, attrs, kept = rebuild
    data = tensors["weight"]
    code = kept.code.to(data.device)
    qs = _copied(kept, code=code, absmax=tensors["weight.absmax"])
    if kept.nested:
        qs.offset = tensors["weight.offset"]
        qs.state2 = _copied(
            kept.state2,
            code=kept.state2.code.to(data.device),
            absmax=tensors["weight.nested_absmax"],
        )
    w = torch.Tensor._make_subclass(cls, data, False)
    w.__dict__.update(attrs)
    w.quant_state = qs
    return w


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
        if p.form.kind in (WEIGHT, QUANT_STATE):
            saved = {"weight": params["weight"]}
            rebuild = _unflatten if p.form.kind == WEIGHT else _params4bit
            params["weight"] = rebuild(p.rebuild, self.tensors)
            swap = params
        else:
            saved = {n: buffers.get(n) for n in self.tensors}
            buffers.update(self.tensors)
            swap = buffers
        if p.has_bias:
            params["bias"] = bias
        try:
            return (p.forward or type(module).forward)(module, x)
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
