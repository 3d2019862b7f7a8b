"""weightstream.torch.attach(quantize="fp8") on the CPU against the daemon's host backend:
outputs, gradients (LoRA and input) and losses equal (torch.equal) to the 8-bit resident
reference, the same model with each streamed weight replaced in place by its w_hat
(``weightstream.quantize.to_fp8_resident``)."""

from __future__ import annotations

import copy
import itertools
import weakref
from types import SimpleNamespace

import pytest
import torch
import weightstream.torch as wst
from torch import nn
from weightstream import quantize
from weightstream.session import Ticket
from weightstream.torch import policy

from tests.python.torch.test_torch import inputs, make_model, train

FP8 = quantize.FP8_E4M3_BLOCK64
#: The weights of one of ``make_model``'s blocks (q, k, v, o; fc1, fc2).
BLOCK_WEIGHTS = 4 * 64 * 64 + 2 * 256 * 64


class FakeSession:
    """The session side of ``attach`` without a daemon: acquires hand out fresh copies of the
    stored tensors (an ``Fp8Weight`` for a quantized one); groups named in ``resident`` are
    resident."""

    def __init__(self, store, groups, resident):
        self.store = store
        self.groups = [
            SimpleNamespace(
                name=name,
                tensors=[placement(t, store[t]) for t in tensors],
                resident=name in resident,
                nbytes=1,
            )
            for name, tensors in groups
        ]
        self.opened = SimpleNamespace(staging_bytes=1 << 30, session_id="fake")
        self.numbers = itertools.count(1)
        self.submitted: dict[int, int] = {}
        self.held = 0
        self.step = 0
        self.decoded_bytes = 0

    def group_index(self, name):
        return [g.name for g in self.groups].index(name)

    def submit(self, group):
        number = next(self.numbers)
        self.submitted[number] = group
        return number

    def wait(self, number):
        group = self.submitted.pop(number)
        views = []
        for t in self.groups[group].tensors:
            stored = self.store[t.name]
            copied = [x.clone() for x in stored] if isinstance(stored, tuple) else [stored.clone()]
            views.append(quantize.Fp8Weight(*copied) if isinstance(stored, tuple) else copied[0])
        self.held += 1
        return Ticket(number, group, None, views)

    def acquire(self, group):
        return self.wait(self.submit(group))

    def release(self, ticket):
        ticket.tensors = []
        self.held -= 1

    def plan(self, groups):
        pass

    def mark_step(self):
        self.step += 1
        return self.step

    def set_pass_kind(self, kind):
        pass

    def gpu_wait(self, settle: bool = False):
        """No daemon, no copy: nothing is ever waited for."""
        return SimpleNamespace(
            total_ns=0,
            waits=0,
            by_group=[0] * len(self.groups),
            per_step=[0] * self.step,
            this_step=0,
            step=self.step,
        )

    def reply_wait(self):
        return SimpleNamespace(total_ns=0, waits=0, by_group=[0] * len(self.groups))

    def stats(self):
        return None

    def close(self):
        pass


def placement(name, stored):
    """A fake placement: the name, 8-bit format and shape ``attach`` reads."""
    if isinstance(stored, tuple):
        return SimpleNamespace(name=name, quantization=FP8, shape=list(stored[0].shape))
    return SimpleNamespace(name=name, quantization="none", shape=list(stored.shape))


class FakeClient:
    """``attach``'s calls to the daemon: the upload quantizes the tensors named in
    ``quantize`` as the daemon does (``quantize_fp8_block64``)."""

    def __init__(self, resident=()):
        self.resident, self.store, self.session = set(resident), {}, None

    def info(self):
        return SimpleNamespace(alignment=512)

    def upload_model(
        self,
        name,
        tensors,
        quantize=(),
        phases=None,
        retention="cached",
        quantize_on="auto",
        labels=None,
        coding="none",
    ):
        names = set(quantize)
        for n, t in tensors.items():
            self.store[n] = quantize_fp8_block64(t) if n in names else t.clone()
        listed = [
            SimpleNamespace(name=n, quantization=FP8 if n in names else "none") for n in tensors
        ]
        return SimpleNamespace(model_id="fake", tensors=listed), False

    def open_session(self, model_id, groups, vram_budget, **kwargs):
        self.session = FakeSession(self.store, groups, self.resident)
        return self.session

    def release_model(self, model_id):
        pass


def quantize_fp8_block64(t):
    # (FakeClient.upload_model's argument `quantize` hides the module there.)
    return quantize.quantize_fp8_block64(t)


def run(model, steps, dtype, *, device="cpu", **kwargs):
    """``train`` on fresh inputs on ``device``; also returns each step's input gradient."""
    xs = inputs(steps, dtype, device)
    return (*train(model, xs, **kwargs), [x.grad.clone() for x in xs])


def assert_equal_runs(ref, got):
    what = ("loss", "output", "grads", "samples", "input grads")
    for name, a, b in zip(what, ref, got, strict=True):
        assert len(a) == len(b), name
        for step, (x, y) in enumerate(zip(a, b, strict=True)):
            if isinstance(x, list):
                for i, (gx, gy) in enumerate(zip(x, y, strict=True)):
                    assert torch.equal(gx, gy), f"{name} {i} differs at step {step}"
            else:
                assert torch.equal(x, y), f"{name} differs at step {step}"


def fp8_sizes(model, group_by: str, alignment: int) -> list[int]:
    """The groups' sizes in the daemon when the streamed weights are kept in 8 bits."""
    layers = policy.select(model, wst.StreamOptions(min_bytes=0)).streamed
    quantized = frozenset(f"{n}.weight" for n, _ in layers)
    return policy.choose_groups(model, layers, group_by, alignment, None, 0, quantized).sizes


def budget(sizes: list[int], where: str) -> tuple[int, int]:
    """(vram_budget, staging_bytes): "streamed": all staging, three of the largest group;
    "mixed": that staging and room for about half of the groups to stay resident;
    "resident": room for every group."""
    staging = 3 * max(sizes)
    if where == "streamed":
        return staging, staging
    if where == "resident":
        return staging + sum(sizes), staging
    return staging + sum(sorted(sizes)[: len(sizes) // 2]), staging


def frozen_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


#: (dtype, ckpt, autocast, group_by, where, dequantize) of the equality test.
EQUALITY_CASES = [
    (torch.float32, None, False, "layer", "streamed", "layer"),
    (torch.float32, "reentrant", False, "layer", "mixed", "layer"),
    (torch.bfloat16, None, False, "layer", "mixed", "layer"),
    (torch.bfloat16, "non-reentrant", False, "layer", "streamed", "layer"),
    (torch.float32, "non-reentrant", True, "layer", "mixed", "layer"),
    (torch.float32, None, False, "block", "mixed", "layer"),
    (torch.float32, "reentrant", False, "block", "streamed", "layer"),
    (torch.bfloat16, "non-reentrant", False, "block", "mixed", "layer"),
    (torch.bfloat16, None, False, "block", "streamed", "layer"),
    (torch.bfloat16, "non-reentrant", False, "block", "streamed", "group"),
    (torch.float32, "reentrant", True, "block", "mixed", "group"),
    (torch.bfloat16, None, False, "block", "mixed", "group"),
    (torch.float32, "non-reentrant", False, "layer", "streamed", "group"),
    (torch.float32, "non-reentrant", True, "block", "mixed", "group"),
]


@pytest.mark.parametrize(
    "dtype,ckpt,autocast,group_by,where,dequantize,early_release",
    # Early release only where a group dequantizes together (by layer there is none to give
    # back early).
    [(*case, False) for case in EQUALITY_CASES]
    + [(*case, True) for case in EQUALITY_CASES if case[-1] == "group"],
)
def test_fp8_attach_equals_the_8bit_resident_reference(
    daemon, dtype, ckpt, autocast, group_by, where, dequantize, early_release
):
    ref = make_model(dtype)
    original = frozen_weights(ref)
    streamed = copy.deepcopy(ref)
    ref.ckpt = streamed.ckpt = ckpt
    sizes = fp8_sizes(streamed, group_by, daemon.client.info().alignment)
    vram_budget, staging = budget(sizes, where)
    handle = wst.attach(
        streamed,
        "cpu",
        client=daemon.client,
        min_bytes=0,
        vram_budget=vram_budget,
        staging_bytes=staging,
        group_by=group_by,
        quantize="fp8",
        dequantize=dequantize,
        early_release=early_release,
    )
    assert [g.nbytes for g in handle.session.groups] == sizes
    assert bool(handle._early_release) == (early_release and dequantize == "group")
    resident = [g.resident for g in handle.session.groups]
    if where == "streamed":
        assert not any(resident), resident
    else:
        assert any(resident) and not all(resident), resident
    # The daemon keeps the streamed weights in 8 bits, biases as they are.
    placed = {t.name: t for g in handle.session.groups for t in g.tensors}
    for name in handle.streamed:
        assert placed[f"{name}.weight"].quantization == FP8, name
        if f"{name}.bias" in placed:
            assert placed[f"{name}.bias"].quantization == "none", name
    changed = quantize.to_fp8_resident(ref, handle.streamed)
    assert len(changed) == len(handle.streamed) == 20
    assert not torch.equal(
        ref.blocks[0].fc1.base_layer.weight, original["blocks.0.fc1.base_layer.weight"]
    ), "the reference computes with w_hat, not w"
    assert_equal_runs(
        run(ref, 3, dtype, sample_between=True, autocast=autocast),
        run(streamed, 3, dtype, sample_between=True, autocast=autocast),
    )
    stats = handle.stats()
    modules = dict(ref.named_modules())
    largest = max(modules[n].weight.nbytes for n in handle.streamed)
    product = 0 if dtype == torch.float32 else largest * 2
    peak = largest
    if dequantize == "group":
        # A streamed group's weights are held at once; a resident group's one at a time.
        by_group = {}
        for name, layer in handle.streamed.items():
            if layer.pinned is None:
                by_group[layer.group] = by_group.get(layer.group, 0) + modules[name].weight.nbytes
        peak = max(
            *by_group.values(),
            *(modules[n].weight.nbytes for n, layer in handle.streamed.items() if layer.pinned),
        )
    assert stats["dequant_peak_bytes"] == peak
    assert stats["dequant_scratch_peak_bytes"] == peak + product
    handle.detach(release=True)


def counted(monkeypatch, name: str) -> list:
    """A list that grows by one at each call of ``quantize.<name>``."""
    calls = []
    real = getattr(quantize, name)
    monkeypatch.setattr(quantize, name, lambda *a: calls.append(1) or real(*a))
    return calls


def attach_fp8(daemon, model, where: str, **options):
    """``model`` attached in 8 bits by block, with ``budget(..., where)``."""
    sizes = fp8_sizes(model, "block", daemon.client.info().alignment)
    vram_budget, staging = budget(sizes, where)
    return wst.attach(
        model,
        "cpu",
        client=daemon.client,
        min_bytes=0,
        vram_budget=vram_budget,
        staging_bytes=staging,
        quantize="fp8",
        **options,
    )


def test_fp8_weights_are_dequantized_for_each_use(daemon, monkeypatch):
    """dequantize="layer": streamed and resident layers alike dequantize in forward and again
    in backward: no w_hat is kept between calls (nor saved for backward)."""
    calls = counted(monkeypatch, "dequantize")
    model = make_model()
    handle = attach_fp8(daemon, model, "mixed", dequantize="layer")
    assert any(layer.pinned is not None for layer in handle.streamed.values())
    assert all(layer.fixed is None for layer in handle.streamed.values()), "no w_hat kept"
    xs = inputs(2, torch.float32)
    train(model, xs)
    assert len(calls) == 2 * 2 * len(handle.streamed), "one per layer and pass"
    calls.clear()
    with torch.no_grad():
        model(xs[0])
    assert len(calls) == len(handle.streamed)
    handle.detach(release=True)


@pytest.mark.parametrize("where", ["streamed", "resident"])
@pytest.mark.parametrize("ckpt", ["non-reentrant", "reentrant", None])
def test_group_dequantization_serves_a_pass_of_the_group_once(daemon, monkeypatch, ckpt, where):
    """dequantize="group": each group's weights, streamed or resident, are dequantized once per
    pass (the forward, then the backward's recompute and input gradients together), against
    once per layer call: three per step for a layer of a checkpointed block, two for the
    others."""
    calls = counted(monkeypatch, "dequantize_weight")
    counts = {}
    for dequantize in ("layer", "group"):
        model = make_model()
        model.ckpt = ckpt
        handle = attach_fp8(daemon, model, where, dequantize=dequantize)
        pinned = [layer.pinned is not None for layer in handle.streamed.values()]
        assert all(pinned) if where == "resident" else not any(pinned)
        xs = inputs(3, torch.float32)
        train(model, xs[:1])
        calls.clear()
        train(model, xs[1:])
        counts[dequantize] = len(calls) / 2
        in_blocks = sum(name.startswith("blocks.") for name in handle.streamed)
        layers = len(handle.streamed)
        handle.detach(release=True)
    recomputed = in_blocks if ckpt else 0
    assert counts == {"layer": 2 * layers + recomputed, "group": 2 * layers}


@pytest.mark.parametrize("early_release", [False, True])
def test_one_groups_dequantization_is_kept_at_a_time(daemon, monkeypatch, early_release):
    """dequantize="group" with streamed and resident groups in turn: before a group
    dequantizes, the dequantizations kept for another group are dropped, so that the trainer
    holds one group's at a time (with ``early_release``, a streamed group whose ticket went
    back is then acquired again if used again); the results stay the 8-bit reference's."""
    ref = make_model()
    model = copy.deepcopy(ref)
    model.ckpt = "non-reentrant"
    handle = attach_fp8(daemon, model, "mixed", dequantize="group", early_release=early_release)
    pinned = {layer.pinned is not None for layer in handle.streamed.values()}
    assert pinned == {True, False}, "both kinds of group"
    kept_counts = []
    real = wst.handle.StreamedLayer.weights

    def weights(layer, training):
        out = real(layer, training)
        held, resident = handle._held, handle._resident_held
        kept = [h for h in (held, resident) if h is not None and h.dequantized is not None]
        kept_counts.append(len(kept))
        return out

    monkeypatch.setattr(wst.handle.StreamedLayer, "weights", weights)
    quantize.to_fp8_resident(ref, handle.streamed)
    ref.ckpt = "non-reentrant"
    assert_equal_runs(run(ref, 2, torch.float32), run(model, 2, torch.float32))
    assert set(kept_counts) == {1}
    handle.detach(release=True)


@pytest.mark.parametrize("ckpt", ["non-reentrant", None])
def test_early_release_gives_a_group_back_once_dequantized(daemon, monkeypatch, ckpt):
    """early_release: a streamed group's ticket goes back at its first layer call of each
    pass, before that layer's operation (or input gradient) runs, and every layer of the group
    then computes with its dequantized weight and a copy of its bias, none of them in the
    staging space; the
    results stay the 8-bit reference's (a second release of a ticket would be the daemon's
    error)."""
    from weightstream.torch import ops

    ref = make_model()
    model = copy.deepcopy(ref)
    ref.ckpt = model.ckpt = ckpt
    handle = attach_fp8(daemon, model, "streamed", dequantize="group", early_release=True)
    assert handle._early_release == frozenset(range(len(handle.session.groups)))
    group_of = {layer.module: layer.group for layer in handle.streamed.values()}
    staging = handle.session._regions[0].bytes.untyped_storage().data_ptr()
    log = []
    real_op, real_grad = ops.op, ops.input_grad

    def used(module, *tensors):
        for t in tensors:
            assert t is None or t.untyped_storage().data_ptr() != staging, "not in staging"
        log.append(("use", group_of[module]))

    def op(module, x, weight, bias):
        used(module, weight, bias)
        return real_op(module, x, weight, bias)

    def input_grad(module, x, grad_out, weight, *args):
        used(module, weight)
        return real_grad(module, x, grad_out, weight, *args)

    released, real_release = set(), handle.session.release

    def release(ticket, *args):
        # Every group gives its ticket back early: each release is one.
        assert ticket.number not in released, f"ticket {ticket.number} given back twice"
        released.add(ticket.number)
        log.append(("early", ticket.group))
        return real_release(ticket, *args)

    monkeypatch.setattr(ops, "op", op)
    monkeypatch.setattr(ops, "input_grad", input_grad)
    monkeypatch.setattr(handle.session, "release", release)
    quantize.to_fp8_resident(ref, handle.streamed)
    assert_equal_runs(run(ref, 2, torch.float32), run(model, 2, torch.float32))
    early = [i for i, (what, _) in enumerate(log) if what == "early"]
    # Each group once in each pass of the two steps.
    assert len(early) == 2 * 2 * len(handle.session.groups)
    for i in early:
        assert log[i + 1] == ("use", log[i][1]), log[i - 2 : i + 3]
    handle.detach(release=True)


def test_a_group_given_back_early_is_acquired_again_after_a_resident_one(daemon):
    """early_release: a streamed group's layer called again in a pass after a resident group
    dequantized (which drops the streamed group's dequantizations) acquires its group again
    rather than reading the ticket it gave back, and computes the same."""
    model = make_model()
    handle = attach_fp8(daemon, model, "mixed", dequantize="group", early_release=True)
    linear = [x for x in handle.streamed.values() if isinstance(x.module, nn.Linear)]
    streamed = next(x for x in linear if x.pinned is None)
    resident = next(x for x in linear if x.pinned is not None)
    x = torch.randn(2, streamed.module.in_features)
    with torch.no_grad():
        first = streamed.module(x)
        assert handle._held.released
        resident.module(torch.randn(2, resident.module.in_features))
        assert handle._held is None
        assert torch.equal(streamed.module(x), first)
    handle.detach(release=True)


@pytest.mark.parametrize("ckpt", ["non-reentrant", "reentrant", None])
def test_checkpointed_layers_dequantized_by_group_run_without_a_function(daemon, monkeypatch, ckpt):
    """Inside torch's non-reentrant checkpoint a layer dequantized by group runs its operation
    as it is (autograd saves the dequantized weight, which the checkpoint drops): no
    ``StreamedOp`` for the blocks' layers, only for those outside the checkpoint; without the
    checkpoint, and in the reentrant one's recompute, every graph-recording call takes the
    Function. Either way, after a forward the trainer holds one group's dequantized weights at
    most, and the results are the 8-bit reference's."""
    from weightstream.torch import ops

    applied = []
    real = ops.StreamedOp.apply
    monkeypatch.setattr(
        ops.StreamedOp, "apply", lambda layer, x: applied.append(layer.name) or real(layer, x)
    )
    kept = []
    real_group = wst.handle.Handle._dequantize_group

    def dequantize_group(handle, group, weight_of):
        out = real_group(handle, group, weight_of)
        kept.extend(weakref.ref(w) for w in out.values())
        return out

    monkeypatch.setattr(wst.handle.Handle, "_dequantize_group", dequantize_group)
    ref = make_model()
    model = copy.deepcopy(ref)
    ref.ckpt = model.ckpt = ckpt
    handle = attach_fp8(daemon, model, "streamed", dequantize="group")
    quantize.to_fp8_resident(ref, handle.streamed)
    x = inputs(1, torch.float32)[0]
    out = model(x)
    alive = {w().data_ptr() for w in kept if w() is not None}
    assert len(alive) == 1, "one group's dequantizations (views of one tensor) are kept"
    out.float().pow(2).mean().backward()
    in_blocks = {n for n in handle.streamed if n.startswith("blocks.")}
    outside = set(handle.streamed) - in_blocks
    if ckpt == "non-reentrant":
        # The forward's calls and the recompute's: none of a block's layers.
        assert set(applied) == outside
    elif ckpt == "reentrant":
        # The forward records no graph in the blocks; their recompute does, with the Function.
        assert set(applied) == set(handle.streamed)
        assert sorted(applied).count(next(iter(in_blocks))) == 1
    else:
        assert set(applied) == set(handle.streamed)
    model.zero_grad(set_to_none=True)
    assert_equal_runs(run(ref, 2, torch.float32), run(model, 2, torch.float32))
    handle.detach(release=True)


def test_in_checkpoint_recognises_torchs_non_reentrant_checkpoint(monkeypatch):
    """``ops.in_checkpoint``: true in the forward and in the recompute of torch's non-reentrant
    checkpoint, false outside it, in the reentrant one, under other saved-tensor hooks, and
    where torch cannot say which hooks are innermost."""
    from torch.utils.checkpoint import checkpoint
    from weightstream.torch import ops

    seen = []

    def probe(x):
        seen.append((ops.in_backward(), ops.in_checkpoint()))
        return x * x

    x = torch.ones(3, requires_grad=True)
    checkpoint(probe, x, use_reentrant=False).sum().backward()
    assert seen == [(False, True), (True, True)], "the forward, then the recompute"
    seen.clear()
    checkpoint(probe, x, use_reentrant=True).sum().backward()
    assert seen == [(False, False), (True, False)]
    seen.clear()
    with torch.autograd.graph.save_on_cpu():
        probe(x)
    probe(x)
    assert seen == [(False, False), (False, False)]
    seen.clear()
    monkeypatch.setattr(ops, "_TOP_SAVED_TENSORS_HOOKS", None)
    checkpoint(probe, x, use_reentrant=False).sum().backward()
    assert seen == [(False, False), (True, False)]


@pytest.mark.parametrize("limit", [BLOCK_WEIGHTS * 4 - 1, BLOCK_WEIGHTS * 4])
def test_auto_dequantizes_by_group_the_groups_within_the_limit(daemon, monkeypatch, limit):
    """dequantize="auto" (the default): a streamed group whose weights take, dequantized, at
    most GROUP_DEQUANTIZE_MAX_BYTES dequantizes by group, a larger one layer by layer; the
    results are the same either way."""
    from weightstream.torch import handle as handle_module

    assert wst.StreamOptions().dequantize == "auto"
    monkeypatch.setattr(handle_module, "GROUP_DEQUANTIZE_MAX_BYTES", limit)
    ref = make_model()
    model = copy.deepcopy(ref)
    handle = attach_fp8(daemon, model, "streamed")
    blocks_by_group = limit >= BLOCK_WEIGHTS * 4  # float32
    by_group = {n for n, layer in handle.streamed.items() if layer.by_group}
    assert by_group == {n for n in handle.streamed if blocks_by_group or "blocks." not in n}
    assert {n.split(".")[0] for n in by_group} >= {"conv_in", "proj_out"}
    blocks = ["blocks.0", "blocks.1", "blocks.2"] if blocks_by_group else []
    assert handle.stats()["dequant_by_group"] == ["conv_in", *blocks, "proj_out"]
    quantize.to_fp8_resident(ref, handle.streamed)
    assert_equal_runs(run(ref, 2, torch.float32), run(model, 2, torch.float32))
    # The largest dequantization held: a block's weights, or its largest layer's (fc1).
    peak = BLOCK_WEIGHTS if blocks_by_group else 256 * 64
    assert handle.stats()["dequant_peak_bytes"] == peak * 4
    handle.detach(release=True)


def loaded(daemon, tmp_path, model, quantize_as):
    """The model's frozen tensors saved as safetensors and loaded by the daemon in
    ``quantize_as``: the manifest."""
    from safetensors.torch import save_file

    frozen = {
        n: p.detach().contiguous()
        for n, p in model.named_parameters()
        if not p.requires_grad and not n.startswith("mha.")
    }
    path = tmp_path / "base.safetensors"
    save_file(frozen, str(path))
    return daemon.client.load_model([str(path)], "base", quantize=quantize_as)


def test_attach_to_an_fp8_model_the_daemon_loaded(daemon, tmp_path):
    model = make_model(torch.bfloat16)
    ref = copy.deepcopy(model)
    manifest = loaded(daemon, tmp_path, model, "fp8")
    kinds = {t.name: t.quantization for t in manifest.tensors}
    assert kinds["blocks.0.fc1.base_layer.weight"] == FP8
    assert kinds["blocks.0.fc1.base_layer.bias"] == kinds["blocks.0.norm1.weight"] == "none"
    with pytest.warns(UserWarning, match="streaming the daemon's copy"):
        handle = wst.attach(
            model, "cpu", client=daemon.client, min_bytes=0, model=manifest.model_id
        )
    assert len(daemon.client.list_models().models) == 1, "nothing was uploaded"
    quantize.to_fp8_resident(ref, handle.streamed)
    assert_equal_runs(run(ref, 2, torch.bfloat16), run(model, 2, torch.bfloat16))
    # dequantize="auto": a block's weights at once.
    assert handle.stats()["dequant_peak_bytes"] == BLOCK_WEIGHTS * 2
    handle.detach()
    # Asking for 8 bits from a model loaded without them is refused, naming a tensor.
    plain = daemon.client.load_model([str(tmp_path / "base.safetensors")], "plain")
    assert plain.model_id != manifest.model_id, "the format is part of the model's identity"
    with pytest.raises(ValueError, match=r"quantize='fp8', but its tensor 'conv_in.weight'"):
        wst.attach(
            make_model(torch.bfloat16),
            "cpu",
            client=daemon.client,
            min_bytes=0,
            model=plain.model_id,
            quantize="fp8",
        )


def test_detach_gives_back_the_dequantized_weights(daemon):
    model = make_model()
    ref = copy.deepcopy(model)
    handle = wst.attach(model, "cpu", client=daemon.client, min_bytes=0, quantize="fp8")
    names = list(handle.streamed)
    handle.detach(release=True)
    quantize.to_fp8_resident(ref, names)
    for (name, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert daemon.client.list_models().models == []


def test_fp8_refuses_a_weight_it_cannot_quantize_naming_the_layer():
    """No daemon needed: attach refuses before it connects."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).requires_grad_(False)
    model[1].weight = nn.Parameter(torch.zeros(64, 64, dtype=torch.int8), requires_grad=False)
    with pytest.raises(ValueError, match="cannot quantize '1' to fp8: its weight is torch.int8"):
        wst.attach(model, "cpu", min_bytes=0, quantize="fp8")
    assert model[1].weight.dtype == torch.int8 and model[0].weight.device.type == "cpu"
    with pytest.raises(ValueError, match="quantize='int8': expected None or 'fp8'"):
        wst.StreamOptions(quantize="int8")


@pytest.mark.parametrize(
    "dtype,ckpt,autocast,resident",
    [
        (torch.float32, None, False, ()),
        (torch.bfloat16, "non-reentrant", False, ("blocks.0", "conv_in")),
        (torch.float32, "reentrant", True, ("blocks.1", "proj_out")),
        (torch.bfloat16, None, False, ("conv_in", "blocks.0", "blocks.1", "blocks.2", "proj_out")),
    ],
)
def test_fp8_glue_without_a_daemon(dtype, ckpt, autocast, resident):
    """attach's torch side over a fake daemon that quantizes as the daemon does: results equal
    the 8-bit resident reference, streamed and resident groups alike, and every ticket is
    given back."""
    ref = make_model(dtype)
    streamed = copy.deepcopy(ref)
    ref.ckpt = streamed.ckpt = ckpt
    client = FakeClient(resident)
    handle = wst.attach(streamed, "cpu", client=client, min_bytes=0, quantize="fp8")
    assert [g.name for g in client.session.groups if g.resident] == [
        g for g in ("conv_in", "blocks.0", "blocks.1", "blocks.2", "proj_out") if g in resident
    ]
    assert isinstance(client.store["blocks.0.fc1.base_layer.weight"], tuple)
    assert isinstance(client.store["blocks.0.fc1.base_layer.bias"], torch.Tensor)
    quantize.to_fp8_resident(ref, handle.streamed)
    assert_equal_runs(
        run(ref, 3, dtype, sample_between=True, autocast=autocast),
        run(streamed, 3, dtype, sample_between=True, autocast=autocast),
    )
    # dequantize="auto": a block's weights at once, streamed or resident.
    size = ref.proj_out.weight.element_size()
    assert handle.stats()["dequant_peak_bytes"] == BLOCK_WEIGHTS * size
    handle.close()
    assert client.session.held == 0


@pytest.mark.parametrize("dequantize,early_release", [("auto", True), ("layer", False)])
def test_ai_toolkit_streams_in_8_bits_when_configured(daemon, dequantize, early_release):
    from weightstream.integrations import ai_toolkit
    from weightstream.integrations.ai_toolkit import MemoryManager
    from weightstream.integrations.ai_toolkit.settings import Settings

    ref = make_model()
    model = copy.deepcopy(ref)
    settings = Settings(
        socket=daemon.socket, quantize="fp8", dequantize=dequantize, early_release=early_release
    )
    ai_toolkit.configure(settings)
    try:
        manager = MemoryManager.attach(model, torch.device("cpu"), offload_percent=1.0)
    finally:
        ai_toolkit.configure(None)
    handle = manager.handle
    placed = {t.name: t.quantization for g in handle.session.groups for t in g.tensors}
    assert {placed[f"{n}.weight"] for n in handle.streamed} == {FP8}
    # The setting reaches attach: by default the small groups dequantize together.
    assert bool(handle.stats()["dequant_by_group"]) == (dequantize == "auto")
    assert handle.options.early_release == early_release
    quantize.to_fp8_resident(ref, handle.streamed)
    assert_equal_runs(run(ref, 2, torch.float32), run(model, 2, torch.float32))
    MemoryManager.detach(model, release=True)
