"""``StreamOptions``: how ``attach`` chooses, groups and streams layers (the session's size,
the daemon and the model id stay arguments of ``attach``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from weightstream import quantize as fp8
from weightstream.sizes import parse_size
from weightstream.torch import compute8

#: Layers smaller than this stay on the device by default: not worth a round trip.
DEFAULT_MIN_BYTES = 1 << 20

INPUT_GRADS = ("formula", "recompute")
#: ``compute``: the trainer's dtype (the weight, dequantized where it streams in 8 bits), or
#: the 8-bit modes of ``compute8``.
COMPUTES = ("bf16", "fp8", "int8")
DEQUANTIZE = ("auto", "layer", "group")
#: ``coding``: how the daemon holds the uploaded model (``Client.load_model(coding=)``).
CODINGS = ("none", "rans8")
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
      dequantized. For ai-toolkit's packed layers (``OstrisLinear``) inside torch's
      non-reentrant checkpoint, ``"auto"`` and ``"group"`` let the backward use what the
      checkpoint's recompute saved, as in place (its quantizer's forward runs twice a step,
      and a block's dequantized weights live from its recompute to its backward);
      ``"layer"`` runs that forward a third time for each input gradient instead, holding one
      layer's dequantized weight at a time.
    - ``early_release``: a streamed group whose every layer dequantizes by group gives its
      staging space back as soon as its first layer call of a pass has dequantized its
      weights and copied its biases (one more small kernel per group and pass), instead of
      when the next group is acquired: the daemon's next copy into that space waits for those
      kernels only, not for the whole block's work on the GPU, so the copies keep a block
      more of lead over a pass whose blocks take about as long to compute as to copy. Off
      by default (its effect on step times is not measured yet). Same results, bit for bit.
    - ``compute``: how a streamed ``nn.Linear`` multiplies. ``"bf16"`` (the default): its own
      operation on the weight in the trainer's dtype (an 8-bit weight dequantized first).
      ``"fp8"`` / ``"int8"``: W8A8 (``weightstream.torch.compute8``): the weight streams in
      8 bits with one float32 scale per output row, prepared once at attach (a torchao per-row
      weight of the mode is taken as it is; ``quantize="fp8"``'s block-scaled weights are
      requantized per row from their dequantization), the activations are quantized per token
      at each call and multiplied in 8 bits (``_scaled_mm``: Ada, Hopper, Blackwell; ``_int_mm``:
      Ampere and newer; the CPU runs the reference arithmetic). Results equal the same model
      with ``compute8.to_w8a8_resident`` in place, bit for bit; they are not those of the bf16
      layer (plain int8 loses quality where activations have outlier channels: use
      ``rotation``). Conv2d layers and Linear shapes the kernels cannot take keep the
      ``"bf16"`` path (``Handle.stats()["compute_fallbacks"]``, and a warning at attach).
      ``input_grad`` does not apply to the 8-bit layers: their input gradient is
      ``grad_compute``'s.
    - ``grad_compute``: the 8-bit layers' input gradient (dY·W): ``None`` or ``"bf16"`` (the
      default: dY times the dequantized weight in the trainer's dtype), or the mode itself (in
      8 bits, dY scaled per row; slower than bf16 while the weight is transposed per call).
    - ``rotation``: 0, or a block-Hadamard rotation of that block (16 to 512, dividing each
      8-bit layer's input width) applied to the weights once at attach and to the activations
      at each call: spreads outlier channels before the per-row scales are taken.
    - ``sample_vram_budget``: the session's device budget while sampling
      (``Handle.sampling()``): bytes, or a size such as ``"20GiB"`` (``weightstream.sizes``),
      or ``"auto"`` (``passes.AutoSample``, or an instance of it: what the device has free at
      each ``sampling()``, less what the trainer's first sampling block took and a margin;
      before that is measured, half of what is free beyond the margin).
      ``None`` (the default): sampling runs at the training budget. More than the device has
      or the daemon allows is refused (``passes.SampleBudgetError``) at ``attach`` and at
      ``sampling()``.
    - ``sample_staging_bytes``: the staging part of ``sample_vram_budget`` (a size, as
      above). ``None`` (the default): three of the largest group (at most the budget), the
      least the daemon keeps for streaming; the rest holds resident groups, spread along the
      pass, so that a forward-only pass streams fewer bytes. Training's own split is the
      daemon's default (a quarter of the budget, at least three of the largest group). Less
      than the largest group is refused at ``attach`` (``passes.SampleBudgetError``).
    - ``coding``: ``"rans8"`` has the daemon hold the uploaded model's 8-bit tensors of 1 MiB
      or more coded losslessly where that saves at least 1/32 of their bytes
      (``Client.load_model(coding=)``): fewer bytes over the link, each group decoded on the
      device after its copy (one Triton kernel a group, on the compute stream), bit for bit.
      For 8-bit weights (``quantize``, ``compute``); ``"none"`` (the default): as they are.
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
    compute: Literal["bf16", "fp8", "int8"] = "bf16"
    grad_compute: Literal["bf16", "fp8", "int8"] | None = None
    rotation: int = 0
    sample_vram_budget: int | str | object | None = None
    sample_staging_bytes: int | str | None = None
    coding: Literal["none", "rans8"] = "none"

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
        if self.coding not in CODINGS:
            raise ValueError(f"coding={self.coding!r}: expected 'none' or 'rans8'")
        fp8.format_name(self.quantize)  # raises for an unknown format
        budget = self.sample_vram_budget
        # "auto", or a passes.AutoSample (not imported here: it needs the policy module,
        # which needs these options) carrying its own probes and margin.
        auto = isinstance(budget, str) and budget.strip().lower() == "auto"
        if auto:
            object.__setattr__(self, "sample_vram_budget", "auto")
        elif hasattr(budget, "choose"):
            auto = True
        elif budget is not None:
            n = parse_size("sample_vram_budget", budget)
            if n == 0:
                raise ValueError(
                    "sample_vram_budget: 0 bytes; expected None, 'auto' or a size above 0"
                )
            object.__setattr__(self, "sample_vram_budget", n)
        if self.sample_staging_bytes is not None:
            n = parse_size("sample_staging_bytes", self.sample_staging_bytes)
            if n == 0:
                raise ValueError("sample_staging_bytes: 0 bytes; expected None or a size above 0")
            if self.sample_vram_budget is None or (not auto and n > self.sample_vram_budget):
                raise ValueError(
                    f"sample_staging_bytes={n}: it is part of sample_vram_budget "
                    f"({self.sample_vram_budget}); set sample_vram_budget at least as large"
                )
            object.__setattr__(self, "sample_staging_bytes", n)
        self._check_compute()
        # Callers pass lists and sets; a frozen value keeps the options hashable and shareable.
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "ignore", frozenset(self.ignore))

    def _check_compute(self):
        if self.compute not in COMPUTES:
            raise ValueError(
                f"compute={self.compute!r}: expected 'bf16' (the trainer's dtype), 'fp8' or "
                "'int8' (8-bit matmuls: weightstream.torch.compute8)"
            )
        if self.compute == "bf16":
            if self.grad_compute not in (None, "bf16"):
                raise ValueError(
                    f"grad_compute={self.grad_compute!r} with compute='bf16': an 8-bit input "
                    f"gradient needs the 8-bit forward; use compute={self.grad_compute!r}"
                )
            if self.rotation:
                raise ValueError(
                    f"rotation={self.rotation!r} with compute='bf16': the rotation is part of "
                    "8-bit compute; use compute='int8' or 'fp8', or rotation=0"
                )
            return
        compute8.check_grad_compute(self.compute, self.grad_compute)
        if self.rotation != 0 and self.rotation not in compute8.ROTATIONS:
            raise ValueError(
                f"rotation={self.rotation!r}: expected 0 (none) or a block of "
                f"{', '.join(map(str, compute8.ROTATIONS))}"
            )
