"""Where weightstream's forward goes in a layer, and how it comes out again.

A streamed layer's weights are read by its own operation (``nn.Linear.forward``) and nowhere
else, while whatever another library wrapped around that forward must keep running around it
(a LoRA branch, accelerate's device moves). So weightstream replaces the *innermost* link of
the layer's forward chain, the layer's own forward, and nothing else. The links it follows:

- ``module.forward`` not set on the instance: the class's forward is the link (replaced by an
  instance attribute, removed again on detach).
- ``module.forward`` is a bound method of another object that keeps exactly one reference to
  a forward of the module (ai-toolkit's and kohya's LoRA: ``lora.org_forward``, called as
  ``self.org_forward(x)``): that attribute is the next link.
- ``module.forward`` is accelerate's ``partial(new_forward, module)`` with ``module._hf_hook``:
  accelerate calls ``module._old_forward`` at call time, so that attribute is the next link.
peft needs no link: its LoRA layers are modules that call ``base_layer(x)``. A wrapper added
after ``attach`` captures weightstream's forward and is followed the same way on removal.

A forward replaced by something that keeps no such reference (a closure, or a module that
reads the weight itself, like LyCORIS's LoHa) cannot be chained: ``check`` raises
``HookConflict`` naming the layer and the library, before ``attach`` uploads anything.

Removal puts back exactly the object that was in the link (another library's forward stays
where it is), and leaves weightstream's forward calling the layer's own forward, so a wrapper
that still holds it keeps working.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

_ABSENT = object()  # no instance attribute: the class's forward
#: More links than any wrapper stack seen in practice; a longer chain is a cycle.
MAX_LINKS = 16


class HookConflict(ValueError):
    """A layer's forward was replaced in a way weightstream cannot run inside."""


class StreamedForward:
    """weightstream's forward in a layer's chain. After removal it calls the layer's own
    forward, for any wrapper that captured it and still calls it."""

    __slots__ = ("module", "name", "_call")

    def __init__(self, module: nn.Module, name: str, forward: Callable):
        self.module, self.name, self._call = module, name, forward

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def retire(self):
        self._call = _own_forward(self.module)

    def __repr__(self):
        return f"<weightstream forward of {self.name!r}>"


def _own_forward(module: nn.Module):
    return type(module).forward.__get__(module, type(module))


def _is_ours(value, module) -> bool:
    return isinstance(value, StreamedForward) and value.module is module


def _is_innermost(value, module) -> bool:
    if value is _ABSENT or _is_ours(value, module):
        return True
    # The class's forward captured as a bound method (ai-toolkit's org_forward, accelerate's
    # _old_forward, or an instance attribute someone restored), or a base class's captured
    # before a class swap: ai-toolkit's accuracy recovery adapter wraps a Linear, then its
    # quantizer makes the layer an OstrisLinear, and the adapter's org_forward stays
    # nn.Linear.forward (``own_function`` runs it).
    return (
        inspect.ismethod(value)
        and value.__self__ is module
        and any(value.__func__ is vars(c).get("forward") for c in type(module).__mro__)
    )


def own_function(module: nn.Module, name: str) -> Callable:
    """The function the layer's forward chain ends in, to be called as ``f(module, x)``: a
    captured forward's (a base class's, after a class swap), else the class's."""
    value = innermost(module, name)[2]
    if inspect.ismethod(value) and value.__self__ is module:
        return value.__func__
    return type(module).forward


def _refers_to(value, module) -> bool:
    """Whether a wrapper's attribute holds a forward of ``module`` (its own, ours, or one
    accelerate wrapped)."""
    if _is_ours(value, module):
        return True
    if inspect.ismethod(value):
        return value.__self__ is module
    return isinstance(value, functools.partial) and bool(value.args) and value.args[0] is module


def _next_link(value, module) -> tuple[object, str] | None:
    """The (owner, attribute) where the wrapper ``value`` keeps the forward it wraps."""
    if isinstance(value, functools.partial) and value.args and value.args[0] is module:
        if getattr(module, "_hf_hook", None) is not None and "_old_forward" in vars(module):
            return module, "_old_forward"
        return None
    if inspect.ismethod(value) and value.__self__ is not module:
        owner = value.__self__
        refs = [a for a, v in getattr(owner, "__dict__", {}).items() if _refers_to(v, module)]
        if len(refs) == 1:
            return owner, refs[0]
    return None


def _library(value) -> str:
    target = value.func if isinstance(value, functools.partial) else value
    if inspect.ismethod(target):
        where = type(target.__self__).__module__
    else:
        where = getattr(target, "__module__", None) or type(target).__module__
    return str(where).split(".")[0]


def _describe(value) -> str:
    if isinstance(value, functools.partial):
        return f"functools.partial({_describe(value.func)}, ...)"
    if inspect.ismethod(value):
        return value.__func__.__qualname__
    return getattr(value, "__qualname__", type(value).__qualname__)


def innermost(module: nn.Module, name: str) -> tuple[object, str, object]:
    """(owner, attribute, value) of the last link of ``module``'s forward chain: where the
    layer's own forward (or weightstream's, in its place) sits. Raises ``HookConflict`` when
    the chain passes through a wrapper that keeps no reference to follow."""
    owner, attr = module, "forward"
    for _ in range(MAX_LINKS):
        value = vars(owner).get(attr, _ABSENT)
        if _is_innermost(value, module):
            return owner, attr, value
        link = _next_link(value, module)
        if link is None:
            lib = _library(value)
            raise HookConflict(
                f"cannot stream {name!r}: {lib} replaced its forward with {_describe(value)}, "
                "which keeps no reference to the layer's own forward for weightstream to run "
                f"inside. Pass ignore=[{name!r}] to keep the layer on the device, or remove "
                f"{lib}'s wrapper (wrappers that keep the original forward, like ai-toolkit's "
                "org_forward or accelerate's _old_forward, are chained)."
            )
        owner, attr = link
    raise HookConflict(f"cannot stream {name!r}: its forward chain has over {MAX_LINKS} links")


@dataclass
class _Installed:
    module: nn.Module
    forward: StreamedForward
    original: object  # what the link held (_ABSENT: the class's forward)


class HookRegistry:
    """weightstream's forwards, by layer name."""

    def __init__(self):
        self._hooks: dict[str, _Installed] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._hooks

    def check(self, name: str, module: nn.Module):
        """Raises ``HookConflict`` if ``install`` would fail."""
        if _is_ours(innermost(module, name)[2], module):
            raise HookConflict(f"cannot stream {name!r}: weightstream already streams it")

    def install(self, name: str, module: nn.Module, forward: Callable) -> StreamedForward:
        """Puts ``forward`` in place of the layer's own forward, inside any wrapper."""
        self.check(name, module)
        owner, attr, original = innermost(module, name)
        hook = StreamedForward(module, name, forward)
        setattr(owner, attr, hook)
        self._hooks[name] = _Installed(module, hook, original)
        return hook

    def remove(self, name: str):
        """Puts back what the link held before ``install``."""
        installed = self._hooks.pop(name)
        module, hook = installed.module, installed.forward
        hook.retire()
        try:
            owner, attr, value = innermost(module, name)
        except HookConflict:
            value = None
        if value is not hook:
            warnings.warn(
                f"weightstream: {name!r}: its forward chain changed after attach and no longer "
                "leads to weightstream's forward; left as it is (that forward, if still "
                "called, runs the layer's own)",
                stacklevel=3,
            )
            return
        if installed.original is not _ABSENT:
            setattr(owner, attr, installed.original)
        elif owner is module and attr == "forward":
            delattr(module, "forward")
        else:
            # A wrapper added after attach captured our forward: give it the layer's own.
            setattr(owner, attr, _own_forward(module))

    def remove_all(self):
        for name in list(self._hooks):
            self.remove(name)


def first_grad_tensor(output):
    """The first tensor requiring grad in a module's output (a tensor, a tuple or list, a
    dict or a ``ModelOutput``), or None."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        for item in output:
            t = first_grad_tensor(item)
            if t is not None:
                return t
    return None
