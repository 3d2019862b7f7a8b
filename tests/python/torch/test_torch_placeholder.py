"""weightstream.torch.placeholder without a daemon: a placeholder has the streamed tensor's
shape, dtype and the session's device, holds no data, and names the tensor when anything would
read or convert it."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from weightstream.torch.placeholder import Placeholder, is_placeholder, parameter


def layer() -> nn.Linear:
    m = nn.Linear(8, 4).to(torch.bfloat16)
    m.weight = parameter(m.weight, torch.device("cpu"), "block.fc.weight")
    return m


def test_it_has_the_identity_and_no_data():
    w = layer().weight
    assert isinstance(w, nn.Parameter) and is_placeholder(w) and not w.requires_grad
    assert (w.shape, w.dtype, w.device) == (torch.Size([4, 8]), torch.bfloat16, torch.device("cpu"))
    assert w.numel() == 32 and w.nbytes == 64 and w.data_ptr() == 0
    assert is_placeholder(w.detach()) and is_placeholder(w.data)
    assert repr(w).startswith("Placeholder('block.fc.weight', shape=[4, 8], dtype=torch.bfloat16")


def test_moves_that_change_nothing_are_no_ops_and_meta_empties_it():
    m = layer()
    w = m.weight
    m.to("cpu")
    m.to(torch.bfloat16)
    m.requires_grad_(False)
    m.eval()
    assert m.weight is w
    m.to("meta")
    assert m.weight.device.type == "meta" and not is_placeholder(m.weight)


@pytest.mark.parametrize(
    "use",
    [
        lambda m: m(torch.randn(2, 8, dtype=torch.bfloat16)),
        lambda m: m.weight.sum(),
        lambda m: m.to(torch.float32),
        lambda m: m.half(),
        lambda m: copy.deepcopy(m),
        lambda m: m.weight.clone(),
        lambda m: pickle.dumps(m.weight),
    ],
    ids=["forward", "sum", "to dtype", "half", "deepcopy", "clone", "pickle"],
)
def test_reading_or_converting_it_names_the_tensor(use):
    with pytest.raises(RuntimeError, match="'block.fc.weight' is streamed by weightstream"):
        use(layer())


def test_it_takes_no_memory_on_its_device():
    """2 TiB of placeholder on the CPU: nothing is allocated."""
    p = Placeholder.make((1 << 20, 1 << 20), torch.bfloat16, torch.device("cpu"), "huge")
    assert p.nbytes == 2 << 40 and p.data_ptr() == 0
