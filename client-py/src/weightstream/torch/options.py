"""``StreamOptions``: how ``attach`` chooses, groups and streams layers (the session's size,
the daemon and the model id stay arguments of ``attach``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from weightstream import quantize as fp8

#: Layers smaller than this stay on the device by default: not worth a round trip.
DEFAULT_MIN_BYTES = 1 << 20

INPUT_GRADS = ("formula", "recompute")
DEQUANTIZE = ("auto", "layer", "group")
#: Where an upload's 8-bit weights are quantized (``Client.upload_model(quantize_on=)``):
#: ``"auto"``, on their device for weights on a CUDA device (half the bytes to write, nothing
#: to quantize at commit), by the daemon for weights in host memory (its quantizer on every
#: core is faster than torch's on the CPU). Tests and benches set it here to compare the two;
#: ``attach`` reads it here at each call.
QUANTIZE_ON = "auto"


@dataclass(frozen=True)
class StreamOptions:
    """- ``input_grad``: how backward gets a streamed layer's input gradient: ``"formula"``
      applies autograd's own formula to the re-acquired weight; ``"recompute"`` re-runs the
      layer on the saved input and differentiates it (one more operation per layer, exact for
      any layer type). Both are bit-identical to the layer with its weight in place.
    - ``group_by``: the unit of transfer: ``"block"`` (one of the model's repeated blocks, see
      ``policy.block_of``; layer by layer when the budget is below three of the largest block
      and no staging size is given), ``"layer"``, or a function from a layer's name to its
      group's name.
    - ``min_bytes``: layers with fewer weight and bias bytes stay on the device.
    - ``include``: the layer types considered (only Linear and Conv2d can stream).
    - ``ignore``: layer names or types to keep on the device.
    - ``lookahead``: at most this many of the plan's next acquires kept in flight; ``None``:
      as many as the staging arena holds; 0: none (the daemon still prefetches along the plan).
    - ``quantize``: ``"fp8"`` streams the layers' weights in 8 bits (``fp8_e4m3_block64``: the
      daemon keeps and copies only the quantized weight; each layer dequantizes it on the
      device into its original dtype, one layer at a time, and runs its own operation). The
      result is that of the model with each streamed weight replaced by its dequantization
      (``weightstream.quantize.to_fp8_resident``), bit for bit. Biases stay as they are.
      ``None``: the weights as they are.
    - ``dequantize``: when a group's 8-bit weights are dequantized. ``"layer"``:
      each layer's at each of its calls, so the device holds one layer's dequantized weight at
      a time. ``"group"``: all of the group's at its first layer call of a pass, in one kernel
      launch on a CUDA device, kept until the group is released, so that the backward's
      recompute and input gradients share one dequantization: a launch per group and pass
      instead of up to three per layer, for the trainer's CPU, at the cost of the group's
      dequantized weights held at once (FLUX.1's double block: 0.63 GiB in bf16;
      ``Handle.stats()["dequant_peak_bytes"]``). ``"auto"`` (the default): ``"group"`` for
      the groups whose dequantized weights take at most 768 MiB
      (``handle.GROUP_DEQUANTIZE_MAX_BYTES``: FLUX.1's blocks), ``"layer"`` for larger ones
      (FLUX.2's). A resident group dequantizes the same way, its weights kept for the pass
      that runs it. One group's dequantized weights are kept at a time. Same results, bit for
      bit, in every mode. Weights in a format with its own linear (torchao's) are not
      dequantized.
    - ``early_release``: a streamed group whose every layer dequantizes by group gives its
      staging space back as soon as its first layer call of a pass has dequantized its
      weights and copied its biases (one more small kernel per group and pass), instead of
      when the next group is acquired: the daemon's next copy into that space waits for those
      kernels only, not for the whole block's work on the GPU, so the copies keep a block
      more of lead over a pass whose blocks take about as long to compute as to copy. Off
      by default (its effect on step times is not measured yet). Same results, bit for bit.
    """

    input_grad: Literal["formula", "recompute"] = "formula"
    group_by: str | Callable[[str], str] = "block"
    min_bytes: int = DEFAULT_MIN_BYTES
    include: tuple[type, ...] = (nn.Linear, nn.Conv2d)
    ignore: Iterable = field(default_factory=frozenset)
    lookahead: int | None = None
    quantize: Literal["fp8", "fp8_e4m3_block64"] | None = None
    dequantize: Literal["auto", "layer", "group"] = "auto"
    early_release: bool = False

    def __post_init__(self):
        if self.input_grad not in INPUT_GRADS:
            raise ValueError(f"input_grad={self.input_grad!r}: expected 'formula' or 'recompute'")
        if self.group_by not in ("block", "layer") and not callable(self.group_by):
            raise ValueError(f"group_by={self.group_by!r}: expected 'block', 'layer' or a function")
        if self.min_bytes < 0:
            raise ValueError(f"min_bytes={self.min_bytes}: expected 0 or more")
        if self.lookahead is not None and self.lookahead < 0:
            raise ValueError(f"lookahead={self.lookahead}: expected None, 0 or more")
        if self.dequantize not in DEQUANTIZE:
            raise ValueError(f"dequantize={self.dequantize!r}: expected 'auto', 'layer' or 'group'")
        fp8.format_name(self.quantize)  # raises for an unknown format
        # Callers pass lists and sets; a frozen value keeps the options hashable and shareable.
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "ignore", frozenset(self.ignore))
