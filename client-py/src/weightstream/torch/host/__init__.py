"""Host-held training: ``stream_trainable`` (or ``attach(...,
trainable="host")``) moves a LoRA's weights (every ``nn.Linear`` whose weight requires grad)
off the device, and ``HostAdamW`` steps them there.

A streamed trainable layer keeps, in host memory held by the daemon for the session (charged to
the session's uid, freed with it): its *working* weight (the trainer's dtype, what the layer
computes with), an fp32 *master* copy where the working dtype is narrower (``master="fp32"``,
the default; with ``master="none"`` the optimizer updates the working weight in place, in fp32
arithmetic rounded back to its dtype, as a trainer with bf16 parameters and no master does),
and its accumulated *gradient*. The optimizer adds its state there (``HostAdamW``).
``host_bytes`` gives the bytes per configuration. The device holds only what is in
flight: the working weights of the group running and of the next ones (copied host→device on a
side stream, ahead of use, along the order of the first forward), and each gradient until its
device→host copy is done.

- The layer's parameter stays the trainer's: an ``nn.Parameter`` on the CPU whose storage is
  the working weight (``state_dict``, saving and loading see the current weights), ignored by
  ``module.to(...)``. Its ``.grad`` stays ``None``: gradients go to host memory as backward
  produces them, and the optimizer reads them there (``clip_grad_norm_`` on these parameters
  therefore does nothing: give the optimizer ``max_grad_norm``).
- The layer's operation is an autograd Function that runs ``F.linear`` on the device copy,
  saves only its input, and in backward takes the weight again and applies autograd's own
  formulas for ``linear``: outputs and gradients are the bits autograd gives for the layer with
  its weight on the device.
- Gradients go device→host on their own stream, directly into the accumulated gradient, or
  through the bounce ring when one is already there (gradient accumulation) or the optimizer
  still has to read the previous step's (the delayed step). The ring is one more region of
  the session's host memory (``BounceRing``: twice the largest group's gradients, in the
  region of the weights and gradients), so every
  byte the gradients land in is the daemon's, page-locked and charged like the rest; a
  gradient that finds it full waits for the worker (``wait_bounce_s``). One worker thread
  takes each arrival in order: waits for its copy, runs a pending delayed update of that
  layer, adds the gradient.
- The delayed update of a layer runs as early as it can: when backward first takes (or
  prefetches) the layer's group, whose device copies are then the weights' last read in the
  step, the worker applies the group's pending updates as soon as that copy is done, so that the
  step's gradients, produced a little later, find the previous ones consumed and land in
  place. The group's device copies are then kept until each of its updated layers has given
  its gradient: a copy made later would read the updated weights. A forward that finds a
  group's copies older than its weights (the next micro-batch of an accumulated step, after
  backward updated them) copies them again.

Exactness: the layer's forward and gradients are those of the same weights on the device; the
accumulation is a bf16 (or the working dtype's) add, as autograd's; the step is ``HostAdamW``'s
(see there). Tests: ``tests/python/torch_host/test_trainable.py``.

Modules: ``storage`` (``HostStorage``, ``Carver``, ``BounceRing``: the host memory),
``sizing`` (what it takes and costs, checked before anything moves), ``transfers`` (the
trainer's copies under the daemon's pacing), ``layers`` (``Trainable`` and the trainable
``nn.Linear``'s autograd Function), ``plan`` (``HostPlan``: check, then apply;
``stream_trainable``), ``optim`` (``HostAdamW``), ``adamw8`` (the 8-bit AdamW step).
"""

from weightstream.torch.host.layers import Trainable
from weightstream.torch.host.optim import HostAdamW, clip_grads_, reference_adamw
from weightstream.torch.host.plan import HostPlan, stream_trainable
from weightstream.torch.host.sizing import (
    MASTERS,
    OPTIMIZERS,
    check_host_fits,
    host_bytes,
    trainable_layers,
)
from weightstream.torch.host.storage import TrainableError

__all__ = [
    "MASTERS",
    "OPTIMIZERS",
    "HostAdamW",
    "HostPlan",
    "Trainable",
    "TrainableError",
    "check_host_fits",
    "clip_grads_",
    "host_bytes",
    "reference_adamw",
    "stream_trainable",
    "trainable_layers",
]
