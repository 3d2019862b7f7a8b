"""fp8_e4m3_block64 through the plain client API (no torch glue): the manifests of a load and
an upload quantized by the daemon, and the refusals of what it cannot quantize."""

from __future__ import annotations

import pytest
import torch
import weightstream
from safetensors.torch import save_file

F8_E4M3 = 5  # weightstream.v1.Dtype.DTYPE_F8_E4M3


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "blocks.0.attn.weight": torch.randn(64, 128, generator=g).to(torch.bfloat16),
        "blocks.0.mlp.weight": torch.randn(33, 100, generator=g),
        "blocks.0.norm.weight": torch.randn(48, generator=g).to(torch.bfloat16),
        "blocks.0.attn.bias": torch.randn(64, generator=g).to(torch.bfloat16),
    }


def by_name(manifest):
    return {t.name: t for t in manifest.tensors}


def check_fp8(manifest):
    t = by_name(manifest)
    attn, mlp = t["blocks.0.attn.weight"], t["blocks.0.mlp.weight"]
    assert (attn.quantization, attn.dtype, list(attn.shape)) == (
        "fp8_e4m3_block64",
        F8_E4M3,
        [64, 128],
    )
    assert (list(attn.scale_shape), attn.scale_offset, attn.nbytes) == (
        [64, 2],
        8192,
        8192 + 64 * 2 * 4,
    )
    assert (list(mlp.scale_shape), mlp.scale_offset, mlp.nbytes) == ([33, 1], 3312, 3312 + 33 * 4)
    for name in ["blocks.0.norm.weight", "blocks.0.attn.bias"]:
        assert (t[name].quantization, list(t[name].scale_shape), t[name].scale_offset) == (
            "none",
            [],
            0,
        )
        assert t[name].nbytes == weights()[name].nbytes


def test_load_model_quantize_fp8_reports_the_quantized_manifest(daemon, tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(weights(), str(path))
    plain = daemon.client.load_model([str(path)])
    fp8 = daemon.client.load_model([str(path)], quantize="fp8")
    again = daemon.client.load_model([str(path)], quantize="fp8_e4m3_block64")
    assert plain.model_id != fp8.model_id == again.model_id and again.refcount == 2
    assert all(t.quantization == "none" for t in plain.tensors)
    check_fp8(fp8)
    assert fp8.total_bytes == sum(t.nbytes for t in fp8.tensors) < plain.total_bytes
    listed = {m.model_id: m for m in daemon.client.list_models().models}
    check_fp8(listed[fp8.model_id])
    with pytest.raises(ValueError, match='quantize: "int4" is not supported'):
        daemon.client.load_model([str(path)], quantize="int4")


def test_upload_model_quantizes_the_named_tensors_at_commit(daemon):
    tensors = weights()
    names = ["blocks.0.attn.weight", "blocks.0.mlp.weight"]
    manifest, dedup = daemon.client.upload_model("q", tensors, quantize=names)
    assert not dedup
    check_fp8(manifest)
    with pytest.raises(ValueError, match='quantize: "nope" is not one of the uploaded tensors'):
        daemon.client.upload_model("q", tensors, quantize=["nope"])
    with pytest.raises(weightstream.RequestRejected) as e:
        daemon.client.upload_model("q", tensors, quantize=["blocks.0.norm.weight"])
    assert e.value.code == "INVALID_ARGUMENT"
    assert e.value.message == (
        "tensors[2].quantization: tensor 'blocks.0.norm.weight' has rank 1: "
        "fp8_e4m3_block64 quantizes only rank ≥ 2 weights"
    )
    assert [m.model_id for m in daemon.client.list_models().models] == [manifest.model_id]
