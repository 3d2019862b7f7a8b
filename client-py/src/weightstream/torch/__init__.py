"""``weightstream.torch.attach(model, device)``: stream a model's frozen weights through the
daemon, with outputs and gradients identical to the model run with its weights in place.

Each streamed layer's own forward is replaced, inside whatever other libraries wrapped around
it, by an autograd Function that acquires the layer's group in forward and again in backward
and saves no view of streamed memory: backward applies autograd's own input-gradient formula
to the re-acquired weight (or re-runs the layer's operation on the saved input and
differentiates that), under the same autocast state, so the gradient is the one autograd
computes for the original layer, bit for bit (inside torch's non-reentrant checkpoint, a
layer whose 8-bit weight is dequantized with its group's, a new tensor, runs its operation as
it is: ``ops.forward``). Weights read other than through their layer's
forward (tied weights, parametrizations, ``nn.MultiheadAttention``'s ``out_proj``) stay on the
device.

A group is, by default, one of the model's repeated blocks (a child of its outermost
``nn.ModuleList``/``nn.Sequential``, e.g. ``transformer_blocks.3``): one round trip to the
daemon per block and pass instead of one per layer. A group's ticket is held while the layers
that use it run, and given back when a layer of another group (or of the same group in another
pass: forward, or backward with its recomputation) asks for its own.

A streamed parameter becomes a ``Placeholder``: its shape and dtype on the session's device,
with no data (code that places new modules by ``weight.device``, like peft, sees the device
the layer computes on; code that reads the data gets an error naming the tensor).

This module is the package's face: it only re-exports. Modules: ``attach`` (``attach``,
``ddp_ignore_streamed``), ``options`` (``StreamOptions``), ``policy`` (selection, groups, plan,
lookahead; no daemon), ``budget`` (``vram_budget="auto"``), ``hooks`` (where the forward goes
in a layer's chain, and back out), ``ops`` (the autograd Function), ``placeholder``
(``Placeholder``), ``handle`` (``Handle``: tickets, plan, ``detach``, ``close``), ``passes``
(sampling passes under ``no_grad`` and their forward plan, ``Handle.sampling()``),
``torchao_weights`` (torchao's weights, streamed as they are), ``packed`` (packed quantized
layers: a format described by its tensors, streamed byte for byte), and the ``host`` sub-package:
trainable weights held in host memory (``stream_trainable``, ``attach(...,
trainable="host")``, ``HostAdamW``, the 8-bit AdamW step).
"""

from __future__ import annotations

from weightstream.torch.attach import attach, ddp_ignore_streamed
from weightstream.torch.budget import AutoBudget, AutoBudgetError
from weightstream.torch.handle import Handle, StreamedLayer
from weightstream.torch.hooks import HookConflict
from weightstream.torch.host import HostAdamW, TrainableError, stream_trainable
from weightstream.torch.options import DEFAULT_MIN_BYTES, StreamOptions
from weightstream.torch.passes import ConcurrentPasses, SampleBudgetError
from weightstream.torch.placeholder import Placeholder
from weightstream.torch.policy import QuantizedWeight

__all__ = [
    "DEFAULT_MIN_BYTES",
    "AutoBudget",
    "AutoBudgetError",
    "ConcurrentPasses",
    "Handle",
    "HookConflict",
    "HostAdamW",
    "Placeholder",
    "QuantizedWeight",
    "SampleBudgetError",
    "StreamOptions",
    "StreamedLayer",
    "TrainableError",
    "attach",
    "ddp_ignore_streamed",
    "stream_trainable",
]
