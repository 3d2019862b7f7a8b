"""8-bit uploads quantized by the client as it copies (``upload_model(quantize_on=...)``,
``weightstream._upload.QuantizeAtCopy``), forced on the CPU, against the daemon's quantization
at commit: the same model id, the same stored bytes, the same streamed results, the same refusal
of a non-finite weight, and nothing left in the daemon after a refusal. (On a CUDA device
``"auto"`` takes the client's path: tests/gpu/torch_suite.py checks it there.)"""

from __future__ import annotations

import copy

import pytest
import torch
import weightstream
import weightstream.torch as wst
from torch import nn
from weightstream import _upload, quantize
from weightstream.torch import options as ws_options

from tests.python.torch.test_torch import make_model
from tests.python.torch.test_torch_fp8 import assert_equal_runs, budget, fp8_sizes, run

FP8 = quantize.FP8_E4M3_BLOCK64


def weights() -> dict[str, torch.Tensor]:
    """Blocks of 64 (bf16), one block per row (f32, 100 columns; a f16 conv of 27), a weight of
    130 rows for the chunks, and a bias that stays as it is."""
    g = torch.Generator().manual_seed(7)
    return {
        "attn.weight": torch.randn(64, 128, generator=g).to(torch.bfloat16),
        "mlp.weight": torch.randn(33, 100, generator=g),
        "conv.weight": torch.randn(8, 3, 3, 3, generator=g).to(torch.float16),
        "big.weight": (torch.randn(130, 192, generator=g) * 1e-3).to(torch.bfloat16),
        "attn.bias": torch.randn(64, generator=g).to(torch.bfloat16),
    }


QUANTIZED = ["attn.weight", "mlp.weight", "conv.weight", "big.weight"]
#: Columns of the widest streamed weight of ``make_model`` (fc2: 256).
WIDEST = 256


def stored(client, manifest) -> dict:
    """Each tensor of ``manifest`` as a session stages it (an ``Fp8Weight`` for an 8-bit one)."""
    names = [t.name for t in manifest.tensors]
    with client.open_session(manifest.model_id, [("all", names)], 1 << 20) as session:
        ticket = session.acquire(0)
        out = {
            n: quantize.Fp8Weight(t.data.clone(), t.scale.clone())
            if isinstance(t, quantize.Fp8Weight)
            else t.clone()
            for n, t in zip(names, ticket.tensors, strict=True)
        }
        session.release(ticket)
    return out


def assert_same_store(a: dict, b: dict):
    assert list(a) == list(b)
    for n in a:
        x, y = a[n], b[n]
        if isinstance(x, quantize.Fp8Weight):
            assert isinstance(y, quantize.Fp8Weight), n
            assert torch.equal(x.data.view(torch.uint8), y.data.view(torch.uint8)), n
            assert torch.equal(x.scale, y.scale), n
        else:
            assert torch.equal(x, y), n


@pytest.mark.parametrize("chunk", [None, 1, 3 * 192 * 4])
def test_client_side_quantization_stores_the_daemons_bytes(daemon, monkeypatch, chunk):
    """Quantized here (in chunks of one row, of three rows, or whole) or by the daemon at
    commit: one model id, the same bytes, which are ``quantize_fp8_block64``'s; the client's
    upload declares and writes the 8-bit layout and the commit quantizes nothing."""
    tensors = weights()
    at_daemon = {}
    manifest, _ = daemon.client.upload_model(
        "w", tensors, QUANTIZED, quantize_on="daemon", phases=at_daemon
    )
    want = stored(daemon.client, manifest)
    daemon.client.release_model(manifest.model_id)
    assert daemon.client.list_models().models == []

    calls = []
    real = _upload.quantize_fp8_block64
    monkeypatch.setattr(_upload, "quantize_fp8_block64", lambda w: calls.append(w.shape) or real(w))
    if chunk is not None:
        monkeypatch.setattr(_upload, "QUANTIZE_CHUNK", chunk)
    here = {}
    again, dedup = daemon.client.upload_model(
        "w", tensors, QUANTIZED, quantize_on="client", phases=here
    )
    assert not dedup, "the first upload was released: the id is the content's"
    assert again.model_id == manifest.model_id
    got = stored(daemon.client, again)
    assert_same_store(want, got)
    for n in QUANTIZED:
        q, scale = quantize.quantize_fp8_block64(tensors[n])
        assert torch.equal(got[n].data.view(torch.uint8), q.view(torch.uint8)), n
        assert torch.equal(got[n].scale, scale), n

    big = [s[0] for s in calls if s[1:] == (192,)]
    assert big == {None: [130], 1: [1] * 130, 3 * 192 * 4: [3] * 43 + [1]}[chunk]
    assert sum(s[0] for s in calls) == sum(tensors[n].shape[0] for n in QUANTIZED)
    fp8_bytes = sum(quantize.fp8_nbytes(tensors[n].shape) for n in QUANTIZED)
    bias = tensors["attn.bias"].nbytes
    assert (here["write_quantized_tensors"], here["write_bytes"]) == (4, fp8_bytes + bias)
    assert here["daemon_input_bytes"] == fp8_bytes + bias and here["daemon_quantize_s"] == 0
    assert here["write_quantize_device_s"] == 0, "no CUDA events on the CPU"
    raw = sum(t.nbytes for t in tensors.values())
    assert at_daemon["daemon_input_bytes"] == raw and "write_quantized_tensors" not in at_daemon


def test_auto_leaves_host_memory_to_the_daemon_and_refusals_are_the_daemons(daemon):
    """``"auto"`` quantizes tensors in host memory at the daemon (the native path: no client
    write phases); a tensor that cannot be quantized is refused by the daemon, with its
    message, whichever side was asked; an unknown side is refused before anything is sent."""
    tensors = weights()
    phases = {}
    daemon.client.upload_model("w", tensors, QUANTIZED, quantize_on="auto", phases=phases)
    assert phases["daemon_input_bytes"] == sum(t.nbytes for t in tensors.values())
    assert "write_quantized_tensors" not in phases
    messages = []
    for side in ("daemon", "client"):
        with pytest.raises(weightstream.RequestRejected) as e:
            daemon.client.upload_model("w", tensors, ["attn.bias"], quantize_on=side)
        messages.append(str(e.value))
    assert (
        messages
        == [
            "tensors[4].quantization: tensor 'attn.bias' has rank 1: "
            "fp8_e4m3_block64 quantizes only rank ≥ 2 weights"
        ]
        * 2
    )
    with pytest.raises(
        ValueError, match="quantize_on='gpu': expected 'auto', 'client' or 'daemon'"
    ):
        daemon.client.upload_model("w", tensors, QUANTIZED, quantize_on="gpu")
    assert len(daemon.client.list_models().models) == 1
    assert daemon.client.info().usage.uploads == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attach_quantized_here_is_the_daemons_model_and_the_resident_reference(
    daemon, monkeypatch, dtype
):
    """attach(quantize="fp8") with the client's quantization forced on the CPU: the model id
    of the daemon's quantization, and outputs, LoRA and input gradients torch.equal to the
    8-bit resident reference; its phases say that the client quantized every weight."""
    ref = make_model(dtype)
    streamed = copy.deepcopy(ref)
    sizes = fp8_sizes(streamed, "block", daemon.client.info().alignment)
    vram_budget, staging = budget(sizes, "mixed")
    kwargs = dict(
        client=daemon.client,
        min_bytes=0,
        vram_budget=vram_budget,
        staging_bytes=staging,
        quantize="fp8",
    )
    monkeypatch.setattr(ws_options, "QUANTIZE_ON", "daemon")
    first = wst.attach(copy.deepcopy(ref), "cpu", **kwargs)
    model_id = first.model_id
    assert first.stats()["attach_upload_daemon_quantize_s"] > 0
    first.detach(release=True)
    assert daemon.client.list_models().models == []

    monkeypatch.setattr(ws_options, "QUANTIZE_ON", "client")
    monkeypatch.setattr(_upload, "QUANTIZE_CHUNK", 4 * WIDEST)  # one row of fc2, 4 of fc1
    handle = wst.attach(streamed, "cpu", **kwargs)
    assert handle.model_id == model_id
    stats = handle.stats()
    assert stats["attach_upload_write_quantized_tensors"] == len(handle.streamed) == 20
    assert stats["attach_upload_daemon_quantize_s"] == 0
    quantize.to_fp8_resident(ref, handle.streamed)
    assert_equal_runs(
        run(ref, 3, dtype, sample_between=True), run(streamed, 3, dtype, sample_between=True)
    )
    handle.detach(release=True)


def three_layers() -> nn.Module:
    """Weights '0.weight' [64, 64], '1.weight' [128, 64], '2.weight' [64, 128]: '1.weight'
    holds -inf at [5, 7] (index 327) and NaN at [9, 1] (577), '2.weight' NaN at [0, 0]."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 128), nn.Linear(128, 64))
    model.requires_grad_(False)
    with torch.no_grad():
        model[1].weight[5, 7] = float("-inf")
        model[1].weight[9, 1] = float("nan")
        model[2].weight[0, 0] = float("nan")
    return model


def test_a_non_finite_weight_is_refused_alike_and_leaves_nothing(daemon, monkeypatch):
    """The daemon's refusal when it quantizes (the first non-finite value of the first such
    weight, by its index in the flattened weight), word for word, when the client quantized
    (here in chunks of two rows, the bad ones in later chunks); the module keeps its weights
    and the daemon holds no model and no upload."""
    monkeypatch.setattr(_upload, "QUANTIZE_CHUNK", 2 * 64 * 4)
    messages = []
    for side in ("daemon", "client"):
        monkeypatch.setattr(ws_options, "QUANTIZE_ON", side)
        model = three_layers()
        kept = [m.weight for m in model]
        with pytest.raises(weightstream.RequestRejected) as e:
            wst.attach(model, "cpu", client=daemon.client, min_bytes=0, quantize="fp8")
        messages.append((e.value.code, e.value.message))
        assert [m.weight for m in model] == kept
        assert daemon.client.list_models().models == []
        assert daemon.client.info().usage.uploads == 0
        assert [k for k in daemon.memfds() if k in ("model", "upload")] == []
    assert (
        messages
        == [("INVALID_ARGUMENT", "tensor '1.weight': -inf at index 327: cannot quantize")] * 2
    )


def test_an_attach_that_fails_mid_write_leaves_nothing(daemon, monkeypatch):
    """attach(quantize="fp8") quantizing here whose quantization fails after the first weights
    were written (a device out of memory): the error is the caller's as it was, the module keeps
    its weights, the upload is aborted (no model, no upload, no host bytes, no region, with the
    client's connection open), and the same process attaches again."""
    monkeypatch.setattr(ws_options, "QUANTIZE_ON", "client")
    monkeypatch.setattr(_upload, "QUANTIZE_CHUNK", 2 * 64 * 4)
    real = _upload.quantize_fp8_block64
    calls = []

    def out_of_memory(w):
        calls.append(w.shape)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return real(w)

    monkeypatch.setattr(_upload, "quantize_fp8_block64", out_of_memory)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 128), nn.Linear(128, 64))
    model.requires_grad_(False)
    kept = [m.weight for m in model]
    with pytest.raises(torch.OutOfMemoryError) as e:
        wst.attach(model, "cpu", client=daemon.client, min_bytes=0, quantize="fp8")
    assert str(e.value) == "CUDA out of memory. Tried to allocate 2.00 MiB"
    assert [m.weight for m in model] == kept
    assert daemon.client.list_models().models == []
    usage = daemon.client.info().usage
    assert (usage.uploads, usage.host_bytes) == (0, 0)
    assert [k for k in daemon.memfds() if k in ("model", "upload")] == []
    monkeypatch.setattr(_upload, "quantize_fp8_block64", real)
    handle = wst.attach(model, "cpu", client=daemon.client, min_bytes=0, quantize="fp8")
    assert len(daemon.client.list_models().models) == 1
    handle.detach(release=True)


@pytest.mark.parametrize(
    "where,value,want",
    [((0, 0), float("nan"), "NaN at index 0"), ((63, 127), float("inf"), "+inf at index 8191")],
)
def test_the_refusal_names_the_first_non_finite_value(where, value, want):
    """No daemon: ``first_non_finite`` over weights quantized here, in their order."""
    w = torch.ones(64, 128, dtype=torch.bfloat16)
    w[where] = value
    tensors = {
        "ok.weight": _upload.QuantizeAtCopy(torch.ones(4, 64)),
        "plain": torch.full((3,), float("nan")),  # not quantized here: not looked at
        "bad.weight": _upload.QuantizeAtCopy(w),
    }
    assert _upload.first_non_finite(tensors) == f"tensor 'bad.weight': {want}: cannot quantize"
    del tensors["bad.weight"]
    assert _upload.first_non_finite(tensors) is None
