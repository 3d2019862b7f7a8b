"""The daemon's per-row formats, ``fp8_e4m3_row`` and ``int8_row``: a model loaded with
``weightstream load --quantize <format>`` (the CLI, host backend) streams, in a session and to
a module attached by the model's id, weights whose data and scales are 8-bit compute's per-row
quantization of the file's weights (``compute8.quantize_rows_reference``), bit for bit, and
whose dequantization is ``(q.float() * scale).to(dtype)``."""

from __future__ import annotations

import copy
import json
import subprocess

import pytest
import torch
import weightstream.torch as wst
from safetensors.torch import save_file
from torch import nn
from weightstream import _dtypes, quantize
from weightstream.torch import compute8

from tests.daemon import BIN

FORMATS = [
    (quantize.FP8_E4M3_ROW, "fp8", torch.float8_e4m3fn),
    (quantize.INT8_ROW, "int8", torch.int8),
]


def make_model() -> nn.Sequential:
    """bf16 Linear and Conv2d layers, widths that are and are not multiples of 64, a row of
    zeros (scale 1)."""
    torch.manual_seed(7)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 100),
        nn.GELU(),
        nn.Linear(100, 64),
    ).to(torch.bfloat16)
    with torch.no_grad():
        model[4].weight[5].zero_()
    return model.requires_grad_(False)


def reference(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """compute8's per-row quantization of ``w`` viewed as [rows, cols]: (q in w's shape, scale
    [rows, 1])."""
    rows = w.shape[0]
    q, scale = compute8.quantize_rows_reference(w.reshape(rows, -1), mode)
    return q.reshape(w.shape), scale.reshape(rows, 1)


def cli_load(daemon, path, fmt: str) -> dict:
    out = subprocess.run(
        [BIN, "load", "--socket", daemon.socket, "--json", "--quantize", fmt, str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize(("fmt", "mode", "qdtype"), FORMATS)
def test_a_cli_load_in_a_row_format_streams_compute8s_rows(daemon, tmp_path, fmt, mode, qdtype):
    model = make_model()
    weights = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    path = tmp_path / "m.safetensors"
    save_file(weights, str(path))
    loaded = cli_load(daemon, path, fmt)
    assert loaded["quantization"] == fmt
    [manifest] = daemon.client.list_models().models
    assert manifest.model_id == loaded["model_id"]

    # The manifest: each weight in the format, data dtype, one scale per row.
    listed = {t.name: t for t in manifest.tensors}
    for name, w in weights.items():
        t = listed[name]
        if not name.endswith(".weight"):
            assert (t.quantization, t.dtype) == ("none", _dtypes.to_wire(w.dtype)), name
            continue
        rows = w.shape[0]
        offset = quantize.scale_offset(w.shape)
        assert (t.quantization, t.dtype, list(t.shape)) == (
            fmt,
            _dtypes.to_wire(qdtype),
            list(w.shape),
        ), name
        assert (list(t.scale_shape), t.scale_offset, t.nbytes) == (
            [rows, 1],
            offset,
            quantize.rowwise_nbytes(w.shape),
        ), name

    # A session's views: the data and scales compute8 makes of the file's weights.
    names = list(weights)
    groups = [(n, [n]) for n in names]
    with daemon.client.open_session(manifest.model_id, groups, 1 << 20) as session:
        for i, name in enumerate(names):
            ticket = session.acquire(i)
            [view] = ticket.tensors
            if name.endswith(".weight"):
                q, scale = reference(weights[name], mode)
                assert isinstance(view, quantize.Fp8Weight) and view.format == fmt, name
                assert view.data.dtype == qdtype and view.data.shape == q.shape, name
                assert torch.equal(view.data.view(torch.uint8), q.view(torch.uint8)), name
                assert torch.equal(view.scale, scale), name
                got = quantize.dequantize_weight(view, torch.bfloat16)
                assert torch.equal(
                    got, (q.float() * scale.reshape(-1, *[1] * (q.dim() - 1))).to(torch.bfloat16)
                ), name
            else:
                assert torch.equal(view, weights[name]), name
            session.release(ticket)

    # Attached by the model's id: the module computes with the dequantized rows.
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(".weight"):
                q, scale = reference(p, mode)
                p.copy_(quantize.dequantize(q, scale, p.dtype))
    with pytest.warns(UserWarning, match="streaming the daemon's copy"):
        handle = wst.attach(
            model, "cpu", client=daemon.client, min_bytes=0, model=manifest.model_id
        )
    assert len(daemon.client.list_models().models) == 1, "nothing was uploaded"
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    handle.detach()


def test_the_row_formats_are_named_and_dequantized_as_the_others():
    assert {quantize.FP8_E4M3_ROW, quantize.INT8_ROW} <= set(quantize.FORMATS)
    assert (quantize.FP8_E4M3_ROW, quantize.INT8_ROW) == ("fp8_e4m3_row", "int8_row")
    g = torch.Generator().manual_seed(2)
    w = torch.randn(6, 40, generator=g).to(torch.bfloat16)
    for fmt, mode, _ in FORMATS:
        q, scale = reference(w, mode)
        want = (q.float() * scale).to(torch.float16)
        assert torch.equal(quantize.dequantize_as(fmt, q, scale, torch.float16), want), fmt
