"""``Placeholder``: what a streamed layer's ``weight`` and ``bias`` become after ``attach``.

Code outside the layer's forward still reads these parameters to place and size things: peft
creates its LoRA layers on ``base_layer.weight.device`` in ``base_layer.weight.dtype``,
diffusers reports ``model.device``/``model.dtype`` from the first parameter, ai-toolkit counts
parameters. So a placeholder has the streamed tensor's shape and dtype and the *session's
device*, like the weight it stands for once on the device, but no storage at all (a wrapper
tensor subclass: no memory on any device). Any operation that would read its data raises an
error naming the layer, instead of computing with garbage (a zero-stride tensor would) or
leaking the ``meta`` device into new modules (a ``meta`` tensor would).

Allowed, because they read no data: ``detach`` (``nn.Parameter`` and ``.data`` need it), a
move to ``meta`` (freeing a module), ``is_pinned``. A ``to()`` that changes nothing returns the
tensor itself without reaching here, so ``module.to(device)`` with the session's device and
dtype is a no-op; any other move or cast names the layer.
"""

from __future__ import annotations

import torch

_aten = torch.ops.aten
_ALIASES = {_aten.detach.default, _aten.alias.default}


class Placeholder(torch.Tensor):
    """A streamed tensor's shape, dtype and device, without data. ``streamed_name`` is the
    daemon's name of the tensor (``transformer_blocks.0.attn.to_q.weight``)."""

    streamed_name: str

    @staticmethod
    def __new__(cls, like: torch.Tensor, device: torch.device, name: str):
        return cls.make(like.shape, like.dtype, device, name)

    @classmethod
    def make(cls, shape, dtype, device, name: str) -> Placeholder:
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        t.streamed_name = name
        return t

    # Placeholders never enter autograd or torch functions as data: no __torch_function__
    # wrapping of results.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        this = next(a for a in args if isinstance(a, Placeholder))
        if func in _ALIASES:
            return Placeholder.make(this.shape, this.dtype, this.device, this.streamed_name)
        if func is _aten.is_pinned.default:
            return False
        if func is _aten._to_copy.default and torch.device(kwargs.get("device", "cpu")).type == (
            "meta"
        ):
            return torch.empty(this.shape, dtype=kwargs.get("dtype") or this.dtype, device="meta")
        raise RuntimeError(
            f"{this.streamed_name!r} is streamed by weightstream: the parameter is a placeholder "
            f"(shape {list(this.shape)}, {this.dtype}, {this.device}) with no data, and "
            f"{func} would read or convert it. Only the layer's own forward reads a streamed "
            "weight. Keep the layer on the device (ignore=[...]) if other code reads its "
            "weight, cast before attach (the daemon streams the dtype it was given), or "
            "detach first."
        )

    def __repr__(self):
        return (
            f"Placeholder({self.streamed_name!r}, shape={list(self.shape)}, dtype={self.dtype}, "
            f"device={self.device})"
        )

    def __reduce_ex__(self, protocol):
        raise RuntimeError(f"{self.streamed_name!r} is streamed by weightstream: nothing to pickle")


def is_placeholder(t) -> bool:
    return isinstance(t, Placeholder)


def parameter(like: torch.Tensor, device: torch.device, name: str) -> torch.nn.Parameter:
    """A frozen parameter holding a placeholder for ``like`` on ``device``."""
    return torch.nn.Parameter(Placeholder(like, device, name), requires_grad=False)
