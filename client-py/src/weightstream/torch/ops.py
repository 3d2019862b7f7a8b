"""The streamed layer's operation: an autograd Function that acquires the layer's weights in
forward and again in backward and saves no view of streamed memory (the staging space is
reused once released) nor any dequantized weight (an 8-bit weight is dequantized again for
backward), with backward's input gradient computed exactly as autograd computes it for the
layer with its weights in place. Two exceptions need no Function, inside torch's non-reentrant
checkpoint: a layer whose 8-bit weight is dequantized with its group's runs its operation as
it is (``forward``), and so does an ai-toolkit packed layer (``packed_in_checkpoint``). A
layer in 8-bit compute (``StreamOptions.compute``) gets a ``compute8.W8Weight`` from
``weights`` and computes ``compute8``'s forward and input gradient (always through
``StreamedOp``, or ``compute8``'s own Function on a resident group's views): autograd cannot
differentiate an 8-bit matmul, and the input gradient needs no saved input.

``forward(layer, x)`` is what runs in place of ``nn.Linear.forward``/``nn.Conv2d.forward``.
``layer`` is anything with the attributes of ``Layer``; ``op`` and ``input_grad`` are looked up
at call time, so a probe can wrap them (``tests/bench/flux_equality_probe.py`` does).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from weightstream import quantize
from weightstream.torch import compute8, packed


class Layer(Protocol):
    module: nn.Module
    name: str
    #: (weight, bias) views of a resident group, valid for the session's life, that the op
    #: may run on as they are (autograd may keep them); else None (an 8-bit weight is
    #: dequantized per call by ``weights``, even when resident).
    fixed: tuple | None
    #: A resident group's views (``fixed``'s, or its 8-bit weight's); else None.
    pinned: tuple | None
    #: Its group's index in the session, and the ``Handle`` that streams it.
    group: int
    handle: object
    #: "formula" or "recompute" (see ``StreamOptions.input_grad``).
    input_grad: str
    #: Whether ``weights`` gives its group's dequantization of an 8-bit weight: a new tensor,
    #: not streamed memory, that the group keeps for the pass anyway.
    by_group: bool
    #: How the layer computes in 8 bits (``compute_plan.Layer8``: mode, input gradient's mode,
    #: counters), its weight then a ``compute8.W8Weight``; None in the trainer's dtype.
    compute8: object
    #: In an 8-bit compute session, a layer that computes in the trainer's dtype
    #: (``compute_plan.Fallback``: ``count()`` per call); else None.
    compute_fallback: object
    #: A packed layer's ``packed.Packed`` (``weights`` gives its ``packed.State``); else None.
    packed: object

    def weights(self, training: bool) -> tuple:
        """The (weight, bias) for this pass (views, or a dequantized weight); ``training``: the
        pass is recorded."""
        ...


_GRAPH_TASK = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool | None:
    """True while autograd runs a backward pass (a checkpoint's recompute runs inside one);
    None where torch cannot tell (then the plan needs ``Handle.end_step``)."""
    return None if _GRAPH_TASK is None else _GRAPH_TASK() != -1


def _top_saved_tensors_hooks():
    """torch's query of the innermost saved-tensor hooks, called as torch 2.x takes it; None
    where this torch has none such (then no checkpoint is recognised)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        top(False)
    except TypeError:
        return None
    return top


_TOP_SAVED_TENSORS_HOOKS = _top_saved_tensors_hooks()
_RECOMPUTE_PACK_HOOK = "_recomputation_hook.__init__.<locals>.pack_hook"
#: The pack hooks of torch's non-reentrant checkpoint (``torch.utils.checkpoint``,
#: ``use_reentrant=False``): the forward's keeps no tensor, the recompute's keeps each until
#: the backward unpacks it.
CHECKPOINT_PACK_HOOKS = frozenset(
    {"_checkpoint_hook.__init__.<locals>.pack_hook", _RECOMPUTE_PACK_HOOK}
)


def checkpoint_hooks() -> tuple | None:
    """The innermost saved-tensor hooks, (pack, unpack), where they are torch's non-reentrant
    checkpoint's (its forward, or its recompute in the backward); None elsewhere, and where
    this torch's checkpoint cannot be recognised."""
    if _TOP_SAVED_TENSORS_HOOKS is None:
        return None
    top = _TOP_SAVED_TENSORS_HOOKS(False)
    if top is not None and getattr(top[0], "__qualname__", None) in CHECKPOINT_PACK_HOOKS:
        return top
    return None


def in_checkpoint() -> bool:
    """True while the innermost saved-tensor hooks are torch's non-reentrant checkpoint's."""
    return checkpoint_hooks() is not None


def op(module: nn.Module, x, weight, bias, compute=None):
    """The module's own operation with the given weight and bias (a packed layer's state:
    its class forward on that state, ``packed.State.run``); for an 8-bit weight whose
    library computes its own linear (a torchao weight: ``quantize.OWN_LINEAR``), that
    library's operation (``quantize.linear_as``); for a ``compute8.W8Weight``, the 8-bit
    linear (``compute8.linear``; ``compute``: the layer's ``compute_plan.Layer8``)."""
    if isinstance(weight, compute8.W8Weight):
        return compute8.linear(x, weight, bias, compute.grad_compute, compute.stats, compute.name)
    if isinstance(weight, packed.State):
        return weight.run(module, x, bias)
    if isinstance(weight, quantize.Fp8Weight):
        return quantize.linear_as(weight, x, bias)
    if isinstance(module, nn.Linear):
        return F.linear(x, weight, bias)
    if isinstance(module, nn.Conv2d):
        return module._conv_forward(x, weight, bias)
    raise TypeError(f"cannot stream {type(module).__name__}")


def autocast_state(x: torch.Tensor) -> tuple[bool, torch.dtype]:
    """Whether autocast is on for ``x``'s device, and its dtype: what a backward that runs the
    op again restores."""
    return torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type)


class StreamedOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer: Layer, x: torch.Tensor):
        weight, bias = layer.weights(True)
        ctx.layer = layer
        if isinstance(weight, compute8.W8Weight):
            # dY·W needs the weight alone: no input saved.
            ctx.x_dtype = x.dtype
            return op(layer.module, x, weight, bias, layer.compute8)
        out = op(layer.module, x, weight, bias)
        ctx.autocast = autocast_state(x)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        layer: Layer = ctx.layer
        weights = layer.weights(True)
        if isinstance(weights[0], compute8.W8Weight):
            c = layer.compute8
            grad_x = compute8.input_grad(
                grad_out, weights[0], c.grad_compute, ctx.x_dtype, c.stats, c.name
            )
            return None, grad_x
        (x,) = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        grad_x = None
        if layer.input_grad == "formula":
            grad_x = input_grad(layer.module, x, grad_out, weights[0], enabled, dtype)
        if grad_x is None:
            grad_x = input_grad_by_recompute(layer.module, x, grad_out, weights, enabled, dtype)
        return None, grad_x


def input_grad(module, x, grad_out, weight, autocast: bool, dtype):
    """The input gradient by the formula autograd applies to the module's op (the same kernel
    on the same operands, so the same bits), without running the op again. None where this
    module's op has no such formula here (then the op is recomputed and differentiated).
    torchao's float8 linear is a matmul of the input and the transposed dequantized weight,
    then the bias: its input gradient is the same ``mm`` of the gradient and that weight; the
    int8 one scales the product afterwards, so it is recomputed, as is a packed layer's
    quantizer forward (``packed.State``)."""
    if isinstance(weight, packed.State):
        return None
    matmul_then_bias = isinstance(weight, quantize.Fp8Weight)
    if matmul_then_bias:
        if weight.format != quantize.TORCHAO_FLOAT8_ROWWISE:
            return None
        weight = quantize.dequantize_weight(weight, weight.dtype)
    if autocast and weight.is_floating_point() and weight.dtype != dtype:
        weight = weight.to(dtype)  # what autocast fed the op
    if matmul_then_bias and grad_out.dtype != weight.dtype:
        # The bias was added to the matmul's output in a wider dtype (autocast's matmul gives
        # its dtype, the bias is not cast): autograd hands the matmul its gradient cast back.
        grad_out = grad_out.to(weight.dtype)
    if isinstance(module, nn.Linear):
        if not x.is_contiguous():
            # Not one row-major matrix: matmul runs bmm on an input it cannot flatten, and
            # mm_mat1_backward transposes its product for a column-major one.
            return None
        # aten::linear runs addmm/mm on the input flattened to 2-D; the gradient of that
        # operand is grad @ weight (mm_mat1_backward), reshaped back.
        g = grad_out.reshape(-1, grad_out.shape[-1]).mm(weight)
        g = g.reshape(*x.shape[:-1], weight.shape[1])
    elif (
        isinstance(module, nn.Conv2d)
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
    ):
        xin = x.to(dtype) if autocast and x.is_floating_point() else x
        g = torch.ops.aten.convolution_backward(
            grad_out,
            xin,
            weight,
            None,
            module.stride,
            module.padding,
            module.dilation,
            False,
            [0, 0],
            module.groups,
            [True, False, False],
        )[0]
    else:
        return None
    return g.to(x.dtype) if g.dtype != x.dtype else g


def input_grad_by_recompute(module, x, grad_out, weights, autocast: bool, dtype):
    """Re-runs the op on the saved input under the forward's autocast state and lets autograd
    differentiate it: exact for any op, at the cost of one more forward operation."""
    with torch.enable_grad(), torch.autocast(x.device.type, dtype, enabled=autocast):
        x_ = x.detach().requires_grad_(True)
        out = op(module, x_, *weights)
    (grad_x,) = torch.autograd.grad(out, x_, grad_out)
    return grad_x


def forward(layer: Layer, x, *args, **kwargs):
    """Runs in place of the layer's own forward."""
    if args or kwargs:
        raise TypeError(f"{layer.name}: streamed modules take one input")
    if layer.compute_fallback is not None:
        layer.compute_fallback.count()
    if layer.pinned is not None and layer.handle._passes.recording:
        layer.handle._saw_resident(layer.group)  # where it runs in a pass, for a later budget
    if layer.fixed is not None:
        # A resident group: its views stay valid for the whole session, so the module's own
        # operation runs on them as is (autograd may keep them for backward); in 8-bit
        # compute, compute8's linear, which keeps the weight for its input gradient.
        if layer.compute8 is not None:
            return op(layer.module, x, *layer.fixed, layer.compute8)
        return op(layer.module, x, *layer.fixed)
    if not x.requires_grad:
        # No graph is recorded (the weights never require grad): nothing keeps the views.
        weight, bias = layer.weights(torch.is_grad_enabled())
        if layer.compute8 is not None:
            return op(layer.module, x, weight, bias, layer.compute8)
        return op(layer.module, x, weight, bias)
    if layer.by_group and in_checkpoint():
        # The weight is the group's dequantization, a new tensor: autograd may save it, and
        # the checkpoint drops it after the forward and keeps it from the recompute to the
        # backward, while the group keeps it anyway. No linear or convolution saves the bias
        # (a view) for an input's gradient. So the op runs as it is, and its backward is
        # autograd's own: no Function, no second acquire, as with the weights in place.
        return op(layer.module, x, *layer.weights(True))
    if (
        layer.packed is not None
        and layer.packed.form.kind == packed.BUFFERS
        and layer.handle.options.dequantize != "layer"
        and (hooks := checkpoint_hooks()) is not None
    ):
        return packed_in_checkpoint(layer, x, hooks)
    return StreamedOp.apply(layer, x)


def packed_in_checkpoint(layer: Layer, x, hooks: tuple):
    """A packed layer of ai-toolkit's (``packed.BUFFERS``: its quantizer reads its buffers off
    the module) inside torch's non-reentrant checkpoint runs its quantizer's forward as it is,
    and autograd's own backward follows, as with the layer in place: the recompute's forward
    is the only one the backward needs, where ``StreamedOp`` would run it a third time for the
    input gradient. What autograd saves from the recompute for the backward (the quantizer's
    dequantized weight, a new tensor) lives until the layer's backward, as in place: a
    checkpointed block's dequantized weights at once (``dequantize="layer"`` keeps
    ``StreamedOp``). A saved tensor that is streamed memory (a quantizer's own Function that
    keeps its codes for the backward: ai-toolkit's convrot) is copied as the checkpoint's
    recompute keeps it: the staging space is reused once the group is released. ai-toolkit's
    quantizers keep tensors only through ``save_for_backward``, which these hooks see.
    ``hooks``: the checkpoint's (``checkpoint_hooks``)."""
    weight, bias = layer.weights(True)
    pack, unpack = hooks
    if pack.__qualname__ != _RECOMPUTE_PACK_HOOK:
        # The checkpoint's first forward keeps no tensor: nothing to copy.
        return op(layer.module, x, weight, bias)
    streamed = {t.untyped_storage().data_ptr() for t in weight.tensors.values()}
    if bias is not None:
        streamed.add(bias.untyped_storage().data_ptr())

    def keep(t):
        plain = type(t) is torch.Tensor and t.layout == torch.strided
        if plain and t.untyped_storage().data_ptr() in streamed:
            t = t.clone()
        return pack(t)

    with torch.autograd.graph.saved_tensors_hooks(keep, unpack):
        return op(layer.module, x, weight, bias)
