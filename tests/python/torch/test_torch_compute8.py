"""weightstream.torch.attach(compute="fp8"|"int8") on the CPU against the daemon's host
backend: outputs, input gradients, LoRA gradients and losses equal (torch.equal) to the same
model with ``compute8.to_w8a8_resident`` in place (the CPU runs compute8's reference
arithmetic), streamed and resident groups, by layer and by block, with and without gradient
checkpointing; the weights stream already row-scaled (no requantization per call); bad input
is refused before anything is uploaded; fallbacks are counted."""

from __future__ import annotations

import copy

import pytest
import torch
import weightstream.torch as wst
from weightstream import quantize
from weightstream.torch import compute8, compute_plan, policy

from tests.python.torch.test_torch import make_model
from tests.python.torch.test_torch_fp8 import FP8, assert_equal_runs, budget, loaded, run

#: The LoRA-wrapped base layers of ``make_model``: every one computes in 8 bits.
BASE = [
    f"blocks.{b}.{layer}.base_layer"
    for b in range(3)
    for layer in ("attn.q", "attn.k", "attn.v", "attn.o", "fc1", "fc2")
]
#: The streamed layers that keep the trainer's dtype, and why.
FALLBACKS = {
    "fp8": {
        "conv_in": "Conv2d: 8-bit compute takes nn.Linear layers",
        "proj_out": "fp8 needs in and out features that are multiples of 16, not 64 -> 4",
    },
    "int8": {
        "conv_in": "Conv2d: 8-bit compute takes nn.Linear layers",
        "proj_out": "int8 needs in and out features that are multiples of 8, not 64 -> 4",
    },
}


def sizes(model, mode: str, group_by: str, alignment: int, quantized=False) -> list[int]:
    """The groups' sizes when the 8-bit compute layers stream row-scaled (the others in
    fp8_e4m3_block64 with ``quantized``)."""
    layers = policy.select(model, wst.StreamOptions(min_bytes=0)).streamed
    rowwise = frozenset(f"{n}.weight" for n in BASE)
    block64 = frozenset(f"{n}.weight" for n, _ in layers) - rowwise if quantized else frozenset()
    return policy.choose_groups(model, layers, group_by, alignment, None, 0, block64, rowwise).sizes


def attach8(daemon, model, mode, group_by="block", where="streamed", quantized=False, **kw):
    vram_budget, staging = budget(
        sizes(model, mode, group_by, daemon.client.info().alignment, quantized), where
    )
    with pytest.warns(UserWarning, match=rf"attach\(compute='{mode}'\): 2 streamed layers"):
        return wst.attach(
            model,
            "cpu",
            client=daemon.client,
            min_bytes=0,
            vram_budget=vram_budget,
            staging_bytes=staging,
            group_by=group_by,
            compute=mode,
            quantize="fp8" if quantized else None,
            **kw,
        )


#: (mode, rotation, grad_compute, dtype, ckpt, autocast, group_by, where)
CASES = [
    ("fp8", 0, "fp8", torch.float32, None, False, "layer", "streamed"),
    ("fp8", 0, "bf16", torch.bfloat16, "non-reentrant", False, "block", "mixed"),
    ("fp8", 64, "fp8", torch.bfloat16, "reentrant", False, "block", "streamed"),
    ("fp8", 16, "bf16", torch.float32, None, True, "layer", "mixed"),
    ("int8", 0, None, torch.bfloat16, None, False, "block", "streamed"),
    ("int8", 0, "bf16", torch.float32, "reentrant", False, "layer", "mixed"),
    ("int8", 64, "int8", torch.float32, "non-reentrant", True, "block", "mixed"),
    ("int8", 32, "bf16", torch.bfloat16, "non-reentrant", False, "layer", "streamed"),
]


@pytest.mark.parametrize("mode,rotation,grad_compute,dtype,ckpt,autocast,group_by,where", CASES)
def test_compute8_attach_equals_the_w8a8_resident_reference(
    daemon, mode, rotation, grad_compute, dtype, ckpt, autocast, group_by, where
):
    ref = make_model(dtype)
    streamed = copy.deepcopy(ref)
    ref.ckpt = streamed.ckpt = ckpt
    handle = attach8(
        daemon,
        streamed,
        mode,
        group_by,
        where,
        rotation=rotation,
        grad_compute=grad_compute,
    )
    resident = [g.resident for g in handle.session.groups]
    assert any(resident) == (where == "mixed") and not all(resident), resident
    assert [n for n, layer in handle.streamed.items() if layer.compute8] == BASE
    # The daemon holds the 8-bit layers' weights row-scaled, the others as they were.
    placed = {t.name: t.quantization for g in handle.session.groups for t in g.tensors}
    row = compute_plan.UPLOAD_FORMATS[mode]
    assert {placed[f"{n}.weight"] for n in BASE} == {row}
    assert placed["conv_in.weight"] == placed["proj_out.weight"] == "none"
    ref_stats = compute8.Stats()
    changed = compute8.to_w8a8_resident(
        ref, mode, BASE, rotation=rotation, grad_compute=grad_compute, stats=ref_stats
    )
    assert changed == BASE
    assert_equal_runs(
        run(ref, 3, dtype, sample_between=True, autocast=autocast),
        run(streamed, 3, dtype, sample_between=True, autocast=autocast),
    )
    stats = handle.stats()
    assert stats["compute"] == mode
    # As many 8-bit matmuls as the reference: forward (checkpoints run it again) and, unless
    # in bf16, the input gradient.
    assert stats["compute_gemm8"] == ref_stats.gemm8 > 0
    # conv_in and proj_out ran once per forward: 3 steps and 3 samples.
    assert stats["compute_fallbacks"] == {why: 6 for why in FALLBACKS[mode].values()}
    assert stats["compute_fallback_layers"] == FALLBACKS[mode]
    handle.detach(release=True)


def test_streamed_8bit_layers_save_no_input_and_prepare_nothing_per_call(daemon, monkeypatch):
    """The weights were prepared at attach: no call quantizes a weight again; backward
    re-acquires the weight, and the Function keeps no input for it."""
    ref = make_model()
    model = copy.deepcopy(ref)
    handle = attach8(daemon, model, "int8", "layer")
    prepared = []
    real = compute8.prepare
    monkeypatch.setattr(compute8, "prepare", lambda *a, **k: prepared.append(1) or real(*a, **k))
    saved = []
    real_save = torch.autograd.function.FunctionCtx.save_for_backward

    def save(ctx, *tensors):
        saved.append(ctx)
        return real_save(ctx, *tensors)

    monkeypatch.setattr(torch.autograd.function.FunctionCtx, "save_for_backward", save)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    model(x).float().pow(2).mean().backward()
    assert prepared == []
    # conv_in and proj_out (the bf16 path) save their input; the 8-bit layers nothing.
    assert len(saved) == 2
    model.zero_grad(set_to_none=True)
    compute8.to_w8a8_resident(ref, "int8", BASE)
    monkeypatch.undo()
    assert_equal_runs(run(ref, 1, torch.float32), run(model, 1, torch.float32))
    handle.detach(release=True)


def test_quantize_fp8_weights_are_requantized_per_row_once_at_upload(daemon):
    """quantize="fp8" with compute: the 8-bit layers stream row-scaled from their
    fp8_e4m3_block64 dequantization (the weight quantize="fp8" computes with), the others in
    fp8_e4m3_block64 as before."""
    ref = make_model(torch.bfloat16)
    model = copy.deepcopy(ref)
    handle = attach8(daemon, model, "fp8", "block", "mixed", quantized=True)
    placed = {t.name: t.quantization for g in handle.session.groups for t in g.tensors}
    assert {placed[f"{n}.weight"] for n in BASE} == {quantize.TORCHAO_FLOAT8_ROWWISE}
    assert placed["conv_in.weight"] == placed["proj_out.weight"] == FP8
    quantize.to_fp8_resident(ref, handle.streamed)
    compute8.to_w8a8_resident(ref, "fp8", BASE)
    assert_equal_runs(run(ref, 2, torch.bfloat16), run(model, 2, torch.bfloat16))
    handle.detach(release=True)


def test_a_torchao_float8_model_computes_as_it_is(daemon, monkeypatch):
    """ai-toolkit's qfloat8 (torchao's per-row Float8Tensor) in compute="fp8": its qdata and
    scales stream as they are and are the 8-bit operands, with no requantization."""
    # Imported here: tests/gpu/torch_suite.py takes BASE and sizes from this module on a
    # machine without torchao.
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    ref = make_model(torch.bfloat16)
    quantize_(ref, Float8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn.endswith("base_layer"))
    model = copy.deepcopy(ref)
    qdata = {n: dict(model.named_modules())[n].weight.qdata.clone() for n in BASE}
    prepared = []
    real = compute8.prepare
    monkeypatch.setattr(compute8, "prepare", lambda *a, **k: prepared.append(a[0]) or real(*a, **k))
    handle = attach8(daemon, model, "fp8", "block", "mixed")
    assert prepared == [], "nothing requantized at attach"
    monkeypatch.undo()
    for name in BASE:
        w = handle.streamed[name].weights(False)[0]
        assert isinstance(w, compute8.W8Weight) and torch.equal(w.data, qdata[name]), name
        if handle.streamed[name].pinned is None:
            handle._release_held()
    compute8.to_w8a8_resident(ref, "fp8", BASE)
    assert_equal_runs(run(ref, 2, torch.bfloat16), run(model, 2, torch.bfloat16))
    handle.detach(release=True)
    # detach gives torchao's tensors back, as they were attached.
    assert torch.equal(
        model.blocks[0].fc1.base_layer.weight.qdata, qdata["blocks.0.fc1.base_layer"]
    )


def test_bad_compute_options_name_what_to_use():
    """No daemon needed: refused when the options are made, or at attach before it connects."""
    with pytest.raises(ValueError) as e:
        wst.StreamOptions(compute="fp4")
    assert str(e.value) == (
        "compute='fp4': expected 'bf16' (the trainer's dtype), 'fp8' or 'int8' (8-bit "
        "matmuls: weightstream.torch.compute8)"
    )
    with pytest.raises(ValueError) as e:
        wst.attach(make_model(), "cpu", min_bytes=0, compute="fp8", grad_compute="int8")
    assert str(e.value) == (
        "grad_compute='int8' with compute='fp8': expected 'fp8' (the same 8-bit mode) or "
        "'bf16' (dY times the dequantized weight in the trainer's dtype)"
    )
    with pytest.raises(ValueError, match=r"^grad_compute='fp8' with compute='bf16': .*fp8'$"):
        wst.StreamOptions(grad_compute="fp8")
    with pytest.raises(ValueError, match=r"^rotation=64 with compute='bf16'"):
        wst.StreamOptions(rotation=64)
    with pytest.raises(ValueError, match=r"^rotation=48: expected 0 \(none\) or a block of 16"):
        wst.StreamOptions(compute="int8", rotation=48)
    wst.StreamOptions(compute="int8", grad_compute="bf16", rotation=64)  # valid


def test_a_gpu_without_the_instruction_is_refused_at_attach(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA GeForce RTX 3090")
    model = make_model()
    with pytest.raises(ValueError) as e:
        wst.attach(model, "cuda:0", min_bytes=0, compute="fp8")
    assert str(e.value) == (
        "compute='fp8' needs an NVIDIA GPU of compute capability 8.9 or newer; NVIDIA GeForce "
        "RTX 3090 (compute capability 8.6) runs compute='int8' or compute='bf16'"
    )
    assert model.blocks[0].fc1.base_layer.weight.device.type == "cpu"


def test_a_rotation_that_does_not_divide_a_layer_leaves_nothing_uploaded(daemon):
    model = make_model()
    with pytest.raises(ValueError) as e:
        wst.attach(model, "cpu", client=daemon.client, min_bytes=0, compute="int8", rotation=128)
    assert str(e.value) == (
        "blocks.0.attn.q.base_layer: rotation=128 does not divide the layer's input width 64; "
        "use rotation=64 or 0"
    )
    assert daemon.client.list_models().models == []
    assert daemon.client.info().usage.uploads == 0
    assert model.blocks[0].attn.q.base_layer.weight.device.type == "cpu"


def test_a_model_by_id_in_block64_is_refused_naming_the_format_to_load(daemon, tmp_path):
    model = make_model(torch.bfloat16)
    manifest = loaded(daemon, tmp_path, model, "fp8")
    with pytest.warns(UserWarning, match="compute in the trainer's dtype"):
        with pytest.raises(ValueError) as e:
            wst.attach(
                model,
                "cpu",
                client=daemon.client,
                min_bytes=0,
                model=manifest.model_id,
                compute="int8",
            )
    assert str(e.value) == (
        f"model={manifest.model_id!r}: compute='int8', but its tensor "
        "'blocks.0.attn.q.base_layer.weight' is held as fp8_e4m3_block64 (8-bit compute "
        "streams weights with one scale per row, prepared once, not requantized at each "
        "call); load the model with --quantize int8_row (or quantize='int8_row'), or attach "
        "without model= to upload it"
    )
    assert [m.model_id for m in daemon.client.list_models().models] == [manifest.model_id]
    assert daemon.client.info().usage.uploads == 0
    assert model.blocks[0].attn.q.base_layer.weight.device.type == "cpu"


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_a_model_by_id_in_its_row_format_equals_the_w8a8_resident_reference(daemon, tmp_path, mode):
    """The daemon's own row format (``weightstream load --quantize fp8_e4m3_row|int8_row``)
    streams as it is: the same bits as the weights prepared in place."""
    ref = make_model(torch.bfloat16)
    streamed = copy.deepcopy(ref)
    manifest = loaded(daemon, tmp_path, ref, compute_plan.LOAD_AS[mode])
    vram_budget, staging = budget(
        sizes(streamed, mode, "block", daemon.client.info().alignment, False), "streamed"
    )
    with pytest.warns(UserWarning, match=rf"attach\(compute='{mode}'\): 2 streamed layers"):
        handle = wst.attach(
            streamed,
            "cpu",
            client=daemon.client,
            min_bytes=0,
            vram_budget=vram_budget,
            staging_bytes=staging,
            model=manifest.model_id,
            compute=mode,
        )
    placed = {t.name: t.quantization for g in handle.session.groups for t in g.tensors}
    assert {placed[f"{n}.weight"] for n in BASE} == {compute_plan.LOAD_AS[mode]}
    compute8.to_w8a8_resident(ref, mode, BASE)
    # The daemon holds every weight of the file in the row format: the layers that keep the
    # trainer's dtype (conv_in, proj_out) compute with its dequantization.
    for name in FALLBACKS[mode]:
        w = ref.get_submodule(name).weight
        q, scale = compute8.quantize_rows_reference(w.detach().reshape(w.shape[0], -1), mode)
        w.data = (q.float() * scale[:, None]).to(w.dtype).reshape(w.shape)
    assert_equal_runs(
        run(ref, 2, torch.bfloat16, sample_between=True),
        run(streamed, 2, torch.bfloat16, sample_between=True),
    )
    assert handle.stats()["compute_gemm8"] > 0
    handle.detach(release=True)


def test_a_rotation_with_a_model_by_id_is_refused(daemon, tmp_path):
    model = make_model(torch.bfloat16)
    manifest = loaded(daemon, tmp_path, model, "int8_row")
    with pytest.warns(UserWarning, match="compute in the trainer's dtype"):
        with pytest.raises(ValueError) as e:
            wst.attach(
                model,
                "cpu",
                client=daemon.client,
                min_bytes=0,
                model=manifest.model_id,
                compute="int8",
                rotation=16,
            )
    assert str(e.value) == (
        f"model={manifest.model_id!r}: rotation=16 needs the weights rotated before they are "
        "quantized, and a model the daemon loaded is not; use rotation=0, or attach without "
        "model= to upload the weights rotated"
    )
    assert daemon.client.info().usage.uploads == 0
    assert model.blocks[0].attn.q.base_layer.weight.device.type == "cpu"


def test_ai_toolkit_computes_in_8_bits_when_configured(daemon):
    from weightstream.integrations import ai_toolkit
    from weightstream.integrations.ai_toolkit import MemoryManager
    from weightstream.integrations.ai_toolkit.settings import Settings

    ref = make_model()
    model = copy.deepcopy(ref)
    settings = Settings(socket=daemon.socket, compute="int8", grad_compute="bf16", rotation=16)
    ai_toolkit.configure(settings)
    try:
        with pytest.warns(UserWarning, match=r"attach\(compute='int8'\): 2 streamed layers"):
            manager = MemoryManager.attach(model, torch.device("cpu"), offload_percent=1.0)
    finally:
        ai_toolkit.configure(None)
    handle = manager.handle
    options = handle.options
    assert (options.compute, options.grad_compute, options.rotation) == ("int8", "bf16", 16)
    assert [n for n, layer in handle.streamed.items() if layer.compute8] == BASE
    compute8.to_w8a8_resident(ref, "int8", BASE, rotation=16, grad_compute="bf16")
    assert_equal_runs(run(ref, 2, torch.float32), run(model, 2, torch.float32))
    MemoryManager.detach(model, release=True)
