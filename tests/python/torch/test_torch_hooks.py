"""weightstream.torch.hooks without a daemon: weightstream's forward goes in the innermost link
of a layer's forward chain, inside what other libraries wrapped around it, and comes out
leaving exactly what was there."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from torch import nn
from weightstream.torch.hooks import HookConflict, HookRegistry, StreamedForward


class OrgForwardLoRA(nn.Module):
    """ai-toolkit's (and kohya's) LoRA module: replaces the layer's forward with its own and
    keeps the original as ``org_forward``; the layer sits in a list so it is no submodule."""

    def __init__(self, org: nn.Linear, rank: int = 2):
        super().__init__()
        torch.manual_seed(3)
        self.lora_down = nn.Linear(org.in_features, rank, bias=False)
        self.lora_up = nn.Linear(rank, org.out_features, bias=False)
        nn.init.normal_(self.lora_up.weight)
        self.org_module = [org]
        self.calls = 0

    def apply_to(self):
        self.org_forward = self.org_module[0].forward
        self.org_module[0].forward = self.forward

    def unapply_to(self):
        self.org_module[0].forward = self.org_forward

    def forward(self, x):
        self.calls += 1
        return self.org_forward(x) + self.lora_up(self.lora_down(x))


OrgForwardLoRA.__module__ = "toolkit.lora_special"


class ReadsTheWeight(nn.Module):
    """LyCORIS's LoHa: replaces the layer's forward and reads its weight itself."""

    def __init__(self, org: nn.Linear):
        super().__init__()
        self.org_module = [org]
        org.forward = self.forward

    def forward(self, x):
        org = self.org_module[0]
        return F.linear(x, org.weight * 2, org.bias)


ReadsTheWeight.__module__ = "lycoris.modules.loha"


class CountingHook(ModelHook):
    def __init__(self):
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        return args, kwargs


def layer() -> nn.Linear:
    torch.manual_seed(1)
    return nn.Linear(8, 8)


def streamed(m: nn.Linear, counter: list):
    """A stand-in for the streamed op: the layer's own computation, counted."""
    w, b = m.weight.detach().clone(), m.bias.detach().clone()

    def forward(x):
        counter.append(1)
        return F.linear(x, w, b)

    return forward


X = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))


def test_a_plain_layer_gets_an_instance_forward_and_loses_it_again():
    m, calls, hooks = layer(), [], HookRegistry()
    want = m(X)
    hooks.install("fc", m, streamed(m, calls))
    assert isinstance(vars(m)["forward"], StreamedForward)
    assert torch.equal(m(X), want) and calls == [1]
    hooks.remove("fc")
    assert "forward" not in vars(m)
    assert torch.equal(m(X), want) and calls == [1]


def test_an_org_forward_wrapper_keeps_running_around_the_streamed_forward():
    m, calls, hooks = layer(), [], HookRegistry()
    lora = OrgForwardLoRA(m)
    lora.apply_to()
    want = m(X)
    theirs, original = vars(m)["forward"], vars(lora)["org_forward"]
    hooks.install("fc", m, streamed(m, calls))
    assert vars(m)["forward"] is theirs, "the library's forward stays outermost"
    assert isinstance(vars(lora)["org_forward"], StreamedForward)
    assert torch.equal(m(X), want) and calls == [1] and lora.calls == 2
    hooks.remove("fc")
    assert vars(m)["forward"] is theirs and vars(lora)["org_forward"] is original
    lora.unapply_to()
    assert torch.equal(m(X), F.linear(X, m.weight, m.bias))


def test_an_accelerate_hook_keeps_running_around_the_streamed_forward():
    m, calls, hooks, hook = layer(), [], HookRegistry(), CountingHook()
    add_hook_to_module(m, hook)
    want = m(X)
    theirs, original = vars(m)["forward"], vars(m)["_old_forward"]
    hooks.install("fc", m, streamed(m, calls))
    assert vars(m)["forward"] is theirs
    assert isinstance(vars(m)["_old_forward"], StreamedForward)
    assert torch.equal(m(X), want) and calls == [1] and hook.calls == 2
    hooks.remove("fc")
    assert vars(m)["forward"] is theirs and vars(m)["_old_forward"] is original
    remove_hook_from_module(m)
    assert torch.equal(m(X), want) and calls == [1]


def test_wrappers_stack_and_the_innermost_link_is_found_through_all():
    """accelerate first, then ai-toolkit's LoRA around accelerate's forward."""
    m, calls, hooks, hook = layer(), [], HookRegistry(), CountingHook()
    add_hook_to_module(m, hook)
    lora = OrgForwardLoRA(m)
    lora.apply_to()
    want = m(X)
    hooks.install("fc", m, streamed(m, calls))
    assert isinstance(vars(m)["_old_forward"], StreamedForward)
    assert torch.equal(m(X), want) and calls == [1] and hook.calls == 2 and lora.calls == 2
    hooks.remove("fc")
    assert not isinstance(vars(m)["_old_forward"], StreamedForward)
    assert torch.equal(m(X), want)


def test_a_wrapper_added_after_install_is_unwound_on_removal():
    m, calls, hooks = layer(), [], HookRegistry()
    want = m(X)
    hooks.install("fc", m, streamed(m, calls))
    lora = OrgForwardLoRA(m)
    lora.apply_to()  # captures weightstream's forward as org_forward
    nn.init.zeros_(lora.lora_up.weight)
    assert torch.equal(m(X), want) and calls == [1]
    theirs = vars(m)["forward"]
    hooks.remove("fc")
    assert vars(m)["forward"] is theirs, "the library's forward stays"
    org = vars(lora)["org_forward"]
    assert org.__self__ is m and org.__func__ is nn.Linear.forward
    assert torch.equal(m(X), want) and calls == [1]


def test_a_forward_that_keeps_nothing_to_chain_onto_is_refused():
    m, hooks = layer(), HookRegistry()
    ReadsTheWeight(m)
    message = (
        "cannot stream 'blocks.0.fc': lycoris replaced its forward with ReadsTheWeight.forward, "
        "which keeps no reference to the layer's own forward for weightstream to run inside. "
        "Pass ignore=['blocks.0.fc'] to keep the layer on the device, or remove lycoris's "
        "wrapper (wrappers that keep the original forward, like ai-toolkit's org_forward or "
        "accelerate's _old_forward, are chained)."
    )
    with pytest.raises(HookConflict, match=f"^{re.escape(message)}$"):
        hooks.install("blocks.0.fc", m, streamed(m, []))
    assert isinstance(vars(m)["forward"].__self__, ReadsTheWeight), "left untouched"


def test_a_closure_is_refused_naming_its_library():
    m = layer()
    m.forward = lambda x: x
    with pytest.raises(HookConflict, match="^cannot stream 'fc': tests replaced"):
        HookRegistry().check("fc", m)


def test_a_layer_is_streamed_once():
    m, hooks = layer(), HookRegistry()
    hooks.install("fc", m, streamed(m, []))
    with pytest.raises(HookConflict, match="weightstream already streams it"):
        HookRegistry().install("fc", m, streamed(m, []))


def test_a_chain_changed_beyond_reach_is_left_and_the_old_forward_runs_the_layers_own():
    m, calls, hooks = layer(), [], HookRegistry()
    want = m(X)
    hooks.install("fc", m, streamed(m, calls))
    ours = m.forward
    m.forward = lambda x: ours(x)  # a closure: nothing to follow
    with pytest.warns(UserWarning, match="no longer leads to weightstream's forward"):
        hooks.remove("fc")
    assert torch.equal(m(X), want) and calls == [], "the layer's own forward ran"
