"""What streams and how: pure functions and small classes, no daemon and no hooks.

- ``select``: which Linear/Conv2d layers stream, and why each other one stays on the device;
  ``nothing_to_stream`` turns the reasons into the error ``attach`` raises; quantized weights
  (``quantizer_of``) are refused with ``QuantizedWeight``, never uploaded as plain tensors,
  but for torchao's per-row ``Float8Tensor`` and ``Int8Tensor``, which stream as they are
  (``torchao_weights``), and the packed forms of ``packed`` (torchao's NF4 and intx tensors,
  ai-toolkit's ``OstrisLinear``, bitsandbytes' ``Linear4bit``), which stream their inner
  tensors as they are.
- ``block_of``, ``choose_groups``: the unit of transfer (a repeated block, or one layer) and
  each group's size as the daemon lays it out. Which groups stay resident within the budget is
  the daemon's choice (``split_budget`` in ``daemon/src/session/layout.rs``); the client only
  sizes the budget (``default_budget``) and falls back to layers when blocks cannot stream.
- ``PlanRecorder``: the first training step's acquisitions, sent as the plan.
- ``Lookahead``: the plan's next acquires kept in flight (the training plan's or, for passes
  under ``no_grad``, the forward plan's: ``passes``).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from weightstream import quantize as fp8
from weightstream.sizes import size_text
from weightstream.torch import packed, torchao_weights
from weightstream.torch.filetensor import is_file_tensor
from weightstream.torch.options import StreamOptions
from weightstream.torch.placeholder import is_placeholder

#: Staging for blocks holds three of the largest group: the one in use, the next, and one
#: re-acquired (the daemon's own least, ``split_budget``).
STAGED_GROUPS = 3

#: Why a considered layer stays on the device, as the words after a count of such layers.
REASONS = {
    "trainable": "their weights require grad — freeze the base model first "
    "(model.requires_grad_(False))",
    "trainable_small": "trainable (their weights require grad: a LoRA's own layers stay on the "
    "device, a base model is frozen with model.requires_grad_(False)) and smaller than "
    "min_bytes ({min_bytes})",
    "small": "smaller than min_bytes ({min_bytes})",
    "no_weight": "no weight to stream (None, on the meta device, or streamed already)",
    "parametrized": "parametrized (the weight is computed, not read)",
    "tied": "tied to another layer's weight",
    "read_directly": "read directly by their parent (nn.MultiheadAttention's out_proj)",
    "own_forward": "a subclass with its own forward (replacing it could change the result)",
    "unsupported": "not a Linear or Conv2d (only those stream)",
    "ignored": "in ignore",
}


@dataclass
class Selection:
    """The layers to stream, in the model's order, and the reason each other one stays."""

    streamed: list[tuple[str, nn.Module]] = field(default_factory=list)
    resident: dict[str, str] = field(default_factory=dict)  # name -> key of REASONS
    kinds: dict[str, str] = field(default_factory=dict)  # name -> its type's name


def _shared_parameters(root: nn.Module) -> set[int]:
    """Ids of parameters that appear under more than one module (tied weights)."""
    owners: collections.Counter[int] = collections.Counter()
    for _, m in root.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            owners[id(p)] += 1
    return {pid for pid, n in owners.items() if n > 1}


class QuantizedWeight(ValueError):
    """A layer's weight is kept by a quantizer in a form whose bytes are not the weight's."""


#: Where quantizers keep their weights: the module of the weight's type starts with one of these.
QUANTIZERS = {"torchao": "torchao", "optimum.quanto": "optimum-quanto", "quanto": "quanto"}


def quantizer_of(t) -> str | None:
    """Which quantizer made ``t`` (a tensor subclass of torchao or optimum-quanto, or one of
    torch's quantized tensors), judged by its type without importing the library; None for a
    plain tensor. Another tensor subclass from outside torch is named by its type: its bytes
    are not a plain tensor's either."""
    if not isinstance(t, torch.Tensor) or is_placeholder(t) or is_file_tensor(t):
        return None
    where = type(t).__module__ or ""
    for prefix, quantizer in QUANTIZERS.items():
        if where == prefix or where.startswith(prefix + "."):
            return quantizer
    if where == "torch" or where.startswith("torch."):
        return "torch.quantization" if t.is_quantized else None
    return f"{where}.{type(t).__qualname__}"


def refuse_quantized(name: str, m: nn.Module):
    """Raises ``QuantizedWeight`` naming layer ``name`` when its weight or bias is a quantizer's
    tensor that does not stream: any but a torchao weight that ``torchao_weights`` streams as
    it is, or a packed form that ``packed`` streams (an ai-toolkit ``OstrisLinear`` of a qtype
    it does not stream is refused too)."""
    if packed.claims(m):
        why = packed.refusal(name, m)
        if why is not None:
            raise QuantizedWeight(why)
        return
    for pname in ("weight", "bias"):
        t = m._parameters.get(pname)
        quantizer = quantizer_of(t)
        if quantizer is None:
            continue
        kind = type(t).__qualname__
        if pname == "weight" and quantizer == "torchao":
            why = torchao_weights.refusal(name, m, t)
            if why is None:
                continue
            raise QuantizedWeight(
                f"cannot stream {name!r}: its weight is a {kind} made by torchao, {why}"
            )
        raise QuantizedWeight(
            f"cannot stream {name!r}: its {pname} is a {kind} made by {quantizer}, whose bytes "
            f"are not the {pname}'s (of other libraries' quantized weights, weightstream streams "
            "torchao's Float8Tensor and Int8Tensor quantized per row, and "
            f"{packed.streamed_names()}, as they are). Keep the "
            f"layer on the device (ignore=[{name!r}]), or load the model unquantized "
            "(quantize='fp8' streams it in 8 bits)."
        )


def _why_resident(name, m, shared, read_directly, options: StreamOptions) -> str | None:
    if not isinstance(m, (nn.Linear, nn.Conv2d)):
        return "unsupported"
    if name in options.ignore or isinstance(
        m, tuple(t for t in options.ignore if isinstance(t, type))
    ):
        return "ignored"
    refuse_quantized(name, m)  # before the forward check: quanto's QLinear has its own
    if packed.claims(m):
        return _why_packed_resident(name, m, shared, read_directly, options)
    base = nn.Linear if isinstance(m, nn.Linear) else nn.Conv2d
    if type(m).forward is not base.forward:
        return "own_forward"
    if name in read_directly:
        return "read_directly"
    w, b = m.weight, m.bias
    if not isinstance(w, torch.Tensor) or _no_data(m, w) or is_placeholder(w):
        return "no_weight"
    small = _layer_nbytes(m) < options.min_bytes
    if w.requires_grad or (b is not None and b.requires_grad):
        return "trainable_small" if small else "trainable"
    if parametrize.is_parametrized(m):
        return "parametrized"
    if id(w) in shared or (b is not None and id(b) in shared):
        return "tied"
    return "small" if small else None


#: The attribute of a layer whose ``meta`` tensors are a daemon's stored model's (an ai-toolkit
#: recipe, ``integrations.ai_toolkit.recipes``): they stream from it by the model's id.
STORED = "_weightstream_stored"


def _no_data(m: nn.Module, t: torch.Tensor) -> bool:
    return t.device.type == "meta" and not vars(m).get(STORED, False)


def _layer_nbytes(m: nn.Module) -> int:
    """A layer's weight and bias bytes, what ``min_bytes`` is compared with."""
    return m.weight.nbytes + (m.bias.nbytes if m.bias is not None else 0)


def _why_packed_resident(name, m, shared, read_directly, options: StreamOptions) -> str | None:
    """``_why_resident`` of a packed layer (``packed``): its forward is the quantizer's, which
    streams, and its size is that of its inner tensors (an ``OstrisLinear``'s ``weight`` is a
    property that dequantizes: never read here)."""
    if name in read_directly:
        return "read_directly"
    form = packed.form_of(m)
    tensors = list(packed.inner(m, form).values())
    if any(_no_data(m, t) or is_placeholder(t) for t in tensors):
        return "no_weight"
    b = m.bias
    if b is not None and id(b) in shared:
        return "tied"
    if sum(t.nbytes for t in tensors) + (b.nbytes if b is not None else 0) < options.min_bytes:
        return "small"
    return None


def select(root: nn.Module, options: StreamOptions) -> Selection:
    """Streams a layer only where its weight is read through its own forward alone: tied,
    parametrized, trainable and directly-read weights (and subclasses that compute their own
    way) stay on the device, as do layers under ``min_bytes`` or in ``ignore``. A quantized
    weight outside ``ignore`` raises ``QuantizedWeight``."""
    shared = _shared_parameters(root)
    read_directly = {
        f"{n}.out_proj" if n else "out_proj"
        for n, m in root.named_modules()
        if isinstance(m, nn.MultiheadAttention)
    }
    out = Selection()
    for name, m in root.named_modules():
        if not isinstance(m, options.include):
            continue
        why = _why_resident(name, m, shared, read_directly, options)
        if why is None:
            out.streamed.append((name, m))
        else:
            out.resident[name] = why
            out.kinds[name] = type(m).__name__
    return out


def reason_text(key: str, options: StreamOptions) -> str:
    return REASONS[key].format(min_bytes=size_text(options.min_bytes, whole=True))


def nothing_to_stream(selection: Selection, options: StreamOptions, root: nn.Module) -> str:
    """Why ``attach`` found no layer to stream, with a count per reason. The reason to act on
    leads: trainable layers of at least ``min_bytes`` (the base model was not frozen), else
    frozen layers under ``min_bytes`` (a small model: lower it), else the most common one; the
    others follow, most first. Where ``min_bytes`` kept layers back, the message ends with the
    largest of them and how to lower it."""
    if not selection.resident:
        kinds = " or ".join(t.__name__ for t in options.include)
        return f"nothing to stream: {type(root).__name__} has no {kinds} layer"
    counts = collections.Counter(selection.resident.values())
    order = list(REASONS)
    ranked = sorted(counts, key=lambda k: (-counts[k], order.index(k)))
    first = next((k for k in ("trainable", "small") if k in counts), ranked[0])
    ranked.remove(first)
    ranked.insert(0, first)
    parts = [f"{counts[k]} {reason_text(k, options)}" for k in ranked]
    kinds = "/".join(
        sorted({selection.kinds[n] for n, why in selection.resident.items() if why == first})
    )
    noun = "layer" if counts[first] == 1 else "layers"
    parts[0] = f"{counts[first]} {kinds} {noun} skipped: {reason_text(first, options)}"
    message = "nothing to stream: " + "; ".join(parts)
    small = [n for n, why in selection.resident.items() if why in ("small", "trainable_small")]
    if small:
        largest = max(_layer_nbytes(root.get_submodule(n)) for n in small)
        message += (
            f". The largest layer under min_bytes holds {size_text(largest)}: to "
            "stream layers that small, lower min_bytes (attach(..., min_bytes=0) streams every "
            "frozen Linear and Conv2d layer)"
        )
    return message


# --- groups -------------------------------------------------------------------------------


def block_of(root: nn.Module, name: str) -> str:
    """The model's repeated block that layer ``name`` belongs to: the child of the outermost
    ``nn.ModuleList``/``nn.Sequential`` on its path (``transformer_blocks.3`` for
    ``transformer_blocks.3.attn.to_q``), or the layer itself when there is none."""
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if isinstance(root.get_submodule(".".join(parts[:i])), (nn.ModuleList, nn.Sequential)):
            return ".".join(parts[: i + 1])
    return name


def group_layers(root, layers, group_by) -> dict[str, list[tuple[str, nn.Module]]]:
    """Group name -> its layers, in the model's order."""
    if group_by == "layer":
        key: Callable[[str], str] = str
    elif group_by == "block":
        key = functools.partial(block_of, root)
    else:
        key = group_by
    members: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, m in layers:
        members.setdefault(str(key(name)), []).append((name, m))
    return members


def layer_tensors(name: str, m: nn.Module, packs=None) -> list[tuple[str, torch.Tensor]]:
    """A streamed layer's tensors as the daemon names them: weight, then bias; of a packed
    layer (``packs``: layer name -> ``packed.Packed``), its inner tensors, then bias."""
    if packs and name in packs:
        return packs[name].tensors(name, m)
    out = [(f"{name}.weight", m.weight)]
    if m.bias is not None:
        out.append((f"{name}.bias", m.bias))
    return out


def tensor_nbytes(
    name: str,
    t: torch.Tensor,
    quantized: frozenset[str] = frozenset(),
    rowwise: frozenset[str] = frozenset(),
) -> int:
    """Bytes of a streamed tensor in the daemon's store: its own, those of its 8-bit form
    when the daemon keeps it quantized (``name`` in ``quantized``), or of a torchao weight or
    one prepared for 8-bit compute (``name`` in ``rowwise``): data and one scale per row."""
    if name in rowwise or torchao_weights.format_of(t) is not None:
        return fp8.rowwise_nbytes(t.shape)
    if name in quantized:
        return fp8.fp8_nbytes(t.shape)
    return t.nbytes


def group_nbytes(tensor_bytes: list[int], alignment: int) -> int:
    """Bytes a group takes in the daemon: each tensor starts aligned, the end is rounded up
    (as ``layout_groups`` in ``daemon/src/session/layout.rs``)."""
    end = 0
    for n in tensor_bytes:
        end = -(-end // alignment) * alignment + n
    return -(-max(end, 1) // alignment) * alignment


@dataclass
class Grouping:
    members: dict[str, list[tuple[str, nn.Module]]]
    sizes: list[int]
    #: Why blocks were given up for layers (for a warning), else None.
    fallback: str | None = None


def choose_groups(
    root,
    layers,
    group_by,
    alignment: int,
    vram_budget: int | None,
    staging_bytes: int,
    quantized: frozenset[str] = frozenset(),
    rowwise: frozenset[str] = frozenset(),
    packs: dict | None = None,
) -> Grouping:
    """The groups and their sizes (``quantized``: the tensors the daemon keeps in 8 bits;
    ``rowwise``: those it keeps with one scale per row, ``tensor_nbytes``; ``packs``: the
    packed layers, ``layer_tensors``).
    Blocks need staging for three of the largest (the one in use, the next, and one
    re-acquired); a smaller budget without an explicit staging size streams layer by layer
    instead."""

    def grouping(by) -> Grouping:
        members = group_layers(root, layers, by)
        sizes = [
            group_nbytes(
                [
                    tensor_nbytes(tname, t, quantized, rowwise)
                    for n, m in ms
                    for tname, t in layer_tensors(n, m, packs)
                ],
                alignment,
            )
            for ms in members.values()
        ]
        return Grouping(members, sizes)

    chosen = grouping(group_by)
    largest = max(chosen.sizes)
    if group_by == "block" and vram_budget is not None and not staging_bytes:
        if vram_budget < STAGED_GROUPS * largest:
            chosen = grouping("layer")
            chosen.fallback = (
                f"attach: vram_budget {vram_budget} is less than three of the largest block "
                f"({largest} bytes): streaming layer by layer instead"
            )
    return chosen


def check_budget(grouping: Grouping, vram_budget: int, staging_bytes: int) -> None:
    """Refuses, with ``ValueError``, a budget the daemon would refuse (``split_budget`` in
    ``daemon/src/session/layout.rs``): under the largest group, or staging under it or above
    the budget. ``attach`` asks before it frees any of the trainer's weights."""
    largest = max(grouping.sizes)
    name = list(grouping.members)[grouping.sizes.index(largest)]
    shown = size_text(largest)
    exact = "" if shown.endswith(" bytes") else f", {largest} bytes"
    group = f"the largest streamed group {name!r} ({shown}{exact})"
    if vram_budget < largest:
        raise ValueError(
            f"vram_budget={vram_budget} is smaller than {group}: the session needs at least "
            f"{largest} bytes; raise vram_budget or pass vram_budget='auto'. Nothing was freed."
        )
    if staging_bytes and staging_bytes < largest:
        raise ValueError(
            f"staging_bytes={staging_bytes} is smaller than {group}: give at least {largest} "
            "bytes, or 0 for the daemon's choice. Nothing was freed."
        )
    if staging_bytes > vram_budget:
        raise ValueError(
            f"staging_bytes={staging_bytes} exceeds vram_budget={vram_budget}: staging is a part "
            "of the budget. Nothing was freed."
        )


def default_budget(sizes: list[int]) -> int:
    """A quarter of the streamed bytes, at least three of the largest group."""
    return max(sum(sizes) // 4, STAGED_GROUPS * max(sizes))


# --- the plan -----------------------------------------------------------------------------


class PlanRecorder:
    """Records the first training step's acquisitions as the plan. The step ends when its
    first group is acquired again outside a backward pass, after a backward pass ran; passes
    under ``no_grad`` (sampling) are not recorded. Where torch cannot tell backward from
    forward (``backward`` is None), everything is recorded until ``Handle.end_step``."""

    def __init__(self):
        self.groups: list[int] = []
        self.seen_backward = False

    def add(self, group: int, backward: bool | None) -> bool:
        """Records an acquisition; True when it starts the next step instead (the plan is
        complete and this acquisition is not part of it)."""
        if backward is not None:
            if self.groups and group == self.groups[0] and not backward and self.seen_backward:
                return True
            self.seen_backward = self.seen_backward or backward
        self.groups.append(group)
        return False


class Lookahead:
    """Keeps the plan's next acquires in flight, so that a layer's acquire finds its reply
    already there instead of waiting for a round trip (the trainer's thread must never block
    on the daemon when the plan is followed). The tickets in flight hold their space, so they
    are bounded to the staging arena less room for two of the largest groups (the one in use
    and the next one placed), and to ``limit`` acquires.

    ``submit(group)`` sends an acquire and returns its number; ``give_back(number)`` waits for
    it and releases it (an acquire the client did not follow)."""

    def __init__(
        self,
        plan: list[int],
        sizes: list[int],
        staging_bytes: int,
        submit: Callable[[int], int],
        give_back: Callable[[int], None],
        limit: int | None = None,
    ):
        self.plan = plan
        self.sizes = sizes
        self.submit = submit
        self.give_back = give_back
        self.limit = len(plan) if limit is None else min(limit, len(plan))
        self.cap = max(0, staging_bytes - 2 * max(sizes))
        self.cursor = 0  # the plan position that ahead[0] stands for
        self.ahead: collections.deque[tuple[int, int]] = collections.deque()
        self.bytes = 0
        #: What the last ``take`` found: its acquire was in flight already (``hit``), or its
        #: group is not in the plan (``off_plan``: served on demand, no lookahead).
        self.hit = False
        self.off_plan = False

    def take(self, group: int) -> int:
        """The number of an acquire of ``group``: the one in flight if the client follows the
        plan, else a fresh one (and the lookahead re-syncs to the plan's next ``group``)."""
        self.hit = bool(self.ahead) and self.ahead[0][0] == group
        self.off_plan = False
        if self.hit:
            _, number = self.ahead.popleft()
            self.bytes -= self.sizes[group]
            self.cursor = (self.cursor + 1) % len(self.plan)
        else:
            self.drain()
            number = self.submit(group)
            position = self.next_position(group)
            if position is None:
                self.off_plan = True
                return number  # off the plan (a model changed between passes): no lookahead
            self.cursor = (position + 1) % len(self.plan)
        self.top_up()
        return number

    def adopt(self, other: Lookahead, group: int):
        """Takes over ``other``'s acquires in flight (another plan's lookahead) where they are
        this plan's next from ``group`` on: the plan in force changes at an acquire of
        ``group``, and the copies it needs next need not be made again. The others are given
        back."""
        ahead, other.ahead, other.bytes = other.ahead, collections.deque(), 0
        position = self.next_position(group)
        if position is not None:
            n = len(self.plan)
            while ahead and len(self.ahead) < self.limit:
                g, number = ahead[0]
                if g != self.plan[(position + len(self.ahead)) % n]:
                    break
                if self.bytes + self.sizes[g] > self.cap:
                    break
                self.ahead.append(ahead.popleft())
                self.bytes += self.sizes[g]
            self.cursor = position
        for _, number in ahead:
            self.give_back(number)

    def next_position(self, group: int) -> int | None:
        n = len(self.plan)
        for i in range(n):
            if self.plan[(self.cursor + i) % n] == group:
                return (self.cursor + i) % n
        return None

    def top_up(self):
        n = len(self.plan)
        while len(self.ahead) < self.limit:
            group = self.plan[(self.cursor + len(self.ahead)) % n]
            if self.bytes + self.sizes[group] > self.cap:
                break
            self.ahead.append((group, self.submit(group)))
            self.bytes += self.sizes[group]

    def drain(self):
        """Gives back the acquires in flight that the client did not follow."""
        while self.ahead:
            _, number = self.ahead.popleft()
            self.give_back(number)
        self.bytes = 0
