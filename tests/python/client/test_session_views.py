"""Session views of staged bytes, without a daemon: a placement of the spec's fields over a byte
buffer laid out as the daemon lays out a group (tensors aligned, an 8-bit weight as data, zeros
to 16 bytes, f32 scales)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from weightstream import _dtypes, quantize
from weightstream.session import tensor_view


def placement(name, dtype, shape, offset, nbytes, quantization="none", scales=(), scale_at=0):
    return SimpleNamespace(
        name=name,
        dtype=_dtypes.to_wire(dtype),
        shape=list(shape),
        offset=offset,
        nbytes=nbytes,
        quantization=quantization,
        scale_shape=list(scales),
        scale_offset=scale_at,
    )


def fp8_bytes(w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The stored form of ``w``: data, zeros to 16 bytes, scales; and the scales' offset."""
    q, scale = quantize.quantize_fp8_block64(w)
    data = q.view(torch.uint8).flatten()
    at = -(-data.numel() // 16) * 16
    pad = torch.zeros(at - data.numel(), dtype=torch.uint8)
    return torch.cat([data, pad, scale.flatten().view(torch.uint8)]), at


@pytest.mark.parametrize("shape", [(8, 128), (5, 100), (6, 4, 3, 3)])
def test_an_fp8_placement_is_a_weight_and_its_scales(shape):
    torch.manual_seed(0)
    w = torch.randn(*shape, dtype=torch.bfloat16)
    bias = torch.randn(shape[0])
    stored, at = fp8_bytes(w)
    assert stored.numel() == quantize.fp8_nbytes(shape)
    start = 4096  # where the group was staged; the bias is laid out after the weight
    bias_at = -(-stored.numel() // 512) * 512
    base = torch.full((start + bias_at + bias.nbytes + 64,), 0xEE, dtype=torch.uint8)
    base[start : start + stored.numel()] = stored
    base[start + bias_at : start + bias_at + bias.nbytes] = bias.view(torch.uint8)
    scales = quantize.scale_shape(shape)
    wp = placement(
        "l.weight",
        torch.float8_e4m3fn,
        shape,
        0,
        stored.numel(),
        quantize.FP8_E4M3_BLOCK64,
        scales,
        at,
    )
    bp = placement("l.bias", torch.float32, bias.shape, bias_at, bias.nbytes)
    weight = tensor_view(base, start + wp.offset, wp)
    assert isinstance(weight, quantize.Fp8Weight)
    q, scale = quantize.quantize_fp8_block64(w)
    assert weight.data.dtype == torch.float8_e4m3fn and weight.data.shape == shape
    assert torch.equal(weight.data.view(torch.uint8), q.view(torch.uint8))
    assert weight.scale.dtype == torch.float32 and tuple(weight.scale.shape) == scales
    assert torch.equal(weight.scale, scale)
    assert weight.data.data_ptr() == base.data_ptr() + start, "a view, not a copy"
    got = quantize.dequantize(weight.data, weight.scale, torch.bfloat16)
    assert torch.equal(got, quantize.w_hat(w))
    b = tensor_view(base, start + bp.offset, bp)
    assert isinstance(b, torch.Tensor) and torch.equal(b, bias)


def test_an_unknown_quantization_is_refused():
    t = placement("x.weight", torch.float32, (2, 2), 0, 16, quantization="int4")
    with pytest.raises(ValueError, match="'x.weight': unknown quantization 'int4'"):
        tensor_view(torch.zeros(16, dtype=torch.uint8), 0, t)


def test_a_view_outlives_its_closed_host_region():
    """``HostRegion.close`` with a view still alive leaves the mapping to the view (an
    ``mmap.close()`` under ``torch.frombuffer`` would unmap it: reading the view would crash
    the process). Run in a child, so that a crash fails the test instead of the run."""
    import subprocess
    import sys

    code = (
        "import mmap, os, torch\n"
        "from weightstream.regions import HostRegion\n"
        "fd = os.memfd_create('t')\n"
        "os.ftruncate(fd, 1 << 20)\n"
        "os.pwrite(fd, bytes(range(10, 20)), 10)\n"
        "r = HostRegion(fd, 1 << 20)\n"
        "view = r.bytes[10:20]\n"
        "r.close()\n"
        "print(view.tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert (out.returncode, out.stdout) == (0, f"{list(range(10, 20))}\n"), out.stderr[-2000:]
