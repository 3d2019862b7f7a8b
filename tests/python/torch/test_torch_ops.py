"""weightstream.torch.ops without a daemon: the streamed op gives the outputs and input
gradients of the layer with its weights in place, bit for bit, by either input-gradient path,
acquiring once in forward and once in backward."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from weightstream.torch import ops


class FakeLayer:
    """An ``ops.Layer`` whose acquires hand out copies of the module's own weights."""

    def __init__(self, module: nn.Module, input_grad: str):
        self.module, self.name, self.fixed, self.input_grad = (
            module,
            "layer",
            None,
            input_grad,
        )
        self.weight = module.weight.detach().clone()
        self.bias = None if module.bias is None else module.bias.detach().clone()
        self.acquires = 0
        self.by_group = False  # its weight is handed out as it is, not a group's dequantization
        self.compute8 = self.compute_fallback = None  # computes in its own dtype
        self.packed = None  # a plain weight, not a packed layer's tensors
        self.pinned = self.handle = None  # streamed, not resident: no handle asked
        self.group = 0

    def weights(self, training: bool) -> tuple:
        self.acquires += 1
        return self.weight, self.bias


def layers():
    torch.manual_seed(4)
    return {
        "linear": (nn.Linear(16, 8), (2, 5, 16)),
        "linear, no bias": (nn.Linear(16, 8, bias=False), (3, 16)),
        # Transposed to [2, 3, 13] below: not one matrix, so matmul runs bmm on it.
        "linear, input not one matrix": (nn.Linear(13, 7), (3, 2, 13)),
        "conv": (nn.Conv2d(4, 6, 3, padding=1, stride=2), (2, 4, 9, 9)),
        "conv, grouped, dilated": (
            nn.Conv2d(4, 8, 3, groups=2, dilation=2),
            (2, 4, 9, 9),
        ),
        "conv, reflect padding": (
            nn.Conv2d(4, 6, 3, padding=1, padding_mode="reflect"),
            (1, 4, 6, 6),
        ),
    }


@pytest.mark.parametrize("input_grad", ["formula", "recompute"])
@pytest.mark.parametrize(
    "dtype,autocast",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
)
def test_the_streamed_op_equals_the_layer(input_grad, dtype, autocast):
    wrong = []
    for name, (module, shape) in layers().items():
        module = module.to(dtype).requires_grad_(False)
        layer = FakeLayer(module, input_grad)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(*shape, generator=g).to(dtype)
        if "not one matrix" in name:
            x = x.transpose(0, 1)
        grad = None
        results = []
        for run in (module, functools.partial(ops.forward, layer)):
            xi = x.clone().requires_grad_()
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                out = run(xi)
            if grad is None:
                grad = torch.randn(out.shape, generator=g).to(out.dtype)
            out.backward(grad)
            results.append((out, xi.grad))
        (want_out, want_grad), (out, got_grad) = results
        if not torch.equal(want_out, out):
            wrong.append(f"{name}: output")
        if not torch.equal(want_grad, got_grad):
            wrong.append(f"{name}: input gradient")
        if layer.acquires != 2:
            wrong.append(f"{name}: {layer.acquires} acquires, not one per pass")
    assert not wrong, wrong


def test_a_resident_layer_runs_its_op_on_the_fixed_views_without_acquiring():
    module = nn.Linear(4, 4).requires_grad_(False)
    layer = FakeLayer(module, "formula")
    layer.fixed = (layer.weight, layer.bias)
    x = torch.randn(2, 4, requires_grad=True)
    assert torch.equal(ops.forward(layer, x), module(x)) and layer.acquires == 0
    with pytest.raises(TypeError, match="layer: streamed modules take one input"):
        ops.forward(layer, x, 1)
