"""The committed fp8_e4m3_block64 test vectors are what torch computes today, torch's float8
conversion is the documented one (round to nearest, ties to even), and weightstream.quantize
(the quantizer, dequantize, the 8-bit resident reference) follows them. Needs no daemon."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from weightstream import quantize

from tests.python.client import gen_fp8_vectors as gen


@pytest.fixture(scope="module")
def committed() -> dict[str, torch.Tensor]:
    return load_file(str(gen.FIXTURE))


def _difference(fresh: torch.Tensor, old: torch.Tensor) -> str:
    """How a regenerated tensor differs from the committed one ("" when it does not)."""
    if fresh.dtype != old.dtype or fresh.shape != old.shape:
        return f"{fresh.dtype} {list(fresh.shape)} != {old.dtype} {list(old.shape)}"
    a = fresh.contiguous().view(torch.uint8).reshape(fresh.numel(), -1)
    b = old.contiguous().view(torch.uint8).reshape(old.numel(), -1)
    bad = (a != b).any(dim=1).nonzero().flatten().tolist()
    return f"{len(bad)} of {fresh.numel()} elements differ, first at {bad[0]}" if bad else ""


def test_regenerated_vectors_equal_the_committed_fixture(committed):
    fresh = gen.build()
    assert sorted(fresh) == sorted(committed), "the set of tensors changed"
    bad = [f"{name}: {_difference(fresh[name], committed[name])}" for name in sorted(fresh)]
    bad = [b for b in bad if not b.endswith(": ")]
    assert not bad, f"{len(bad)} tensors differ (rerun gen_fp8_vectors.py?):\n" + "\n".join(bad)


def _rne_e4m3(x: float) -> int:
    """The e4m3fn code of float x by exact arithmetic: nearest value, ties to the even code;
    past 448 the next grid point is 480, the NaN pattern (as torch, without saturation)."""
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    if math.isnan(x) or abs(x) >= 480:
        return sign | 0x7F
    a = Fraction(abs(x))
    values = [Fraction(v) for v in gen.e4m3_values().tolist()] + [Fraction(480)]
    hi = next(c for c, v in enumerate(values) if v >= a)
    if values[hi] == a or hi == 0:
        return sign | hi
    lo = hi - 1
    d_lo, d_hi = a - values[lo], values[hi] - a
    code = lo if d_lo < d_hi or (d_lo == d_hi and lo % 2 == 0) else hi
    return sign | code


def test_torch_float8_conversion_rounds_to_nearest_even(committed):
    x, q = committed["convert.x"].tolist(), committed["convert.q"].tolist()
    bad = [
        f"{v!r}: torch {c:#04x}, exact {_rne_e4m3(v):#04x}"
        for v, c in zip(x, q, strict=True)
        if _rne_e4m3(v) != c
    ]
    assert len(x) > 1000
    assert not bad, f"{len(bad)} conversions differ:\n" + "\n".join(bad[:50])


def test_every_case_meets_the_format(committed):
    """Scales are amax / 448 (or 1), q decodes within half a grid step of w / scale."""
    bad = []
    for name in sorted(k[:-2] for k in committed if k.endswith(".w")):
        w, q, scale = (committed[f"{name}.{s}"] for s in ("w", "q", "scale"))
        rows = w.shape[0]
        cols = w.numel() // rows
        block = quantize.BLOCK if cols % quantize.BLOCK == 0 else cols
        x = w.float().reshape(rows, cols // block, block)
        if list(scale.shape) != [rows, cols // block]:
            bad.append(f"{name}: scale shape {list(scale.shape)}")
            continue
        amax = x.abs().amax(dim=-1)
        want = torch.where(amax / 448 == 0, 1.0, amax / 448)
        if not torch.equal(scale, want):
            bad.append(f"{name}: scales are not amax / 448")
        w_hat = q.view(torch.float8_e4m3fn).float().reshape(x.shape) * scale.unsqueeze(-1)
        # Half the e4m3 spacing at the value (2^-10 relative to 448 * scale at worst for the
        # subnormals; 1/16 relative for normals), plus the f32 rounding of the division.
        tol = torch.maximum(x.abs() / 16, 2.0**-10 * scale.unsqueeze(-1)) * (1 + 2**-20)
        if not bool(((w_hat - x).abs() <= tol).all()):
            bad.append(f"{name}: a dequantized weight is further than half a step from w")
    assert not bad, "\n".join(bad)


def _cases(committed) -> list[str]:
    return sorted(k[:-2] for k in committed if k.endswith(".w"))


def test_the_package_quantizer_gives_the_committed_bytes(committed):
    bad = []
    for name in _cases(committed):
        q, scale = quantize.quantize_fp8_block64(committed[f"{name}.w"])
        if q.dtype != torch.float8_e4m3fn:
            bad.append(f"{name}: q is {q.dtype}")
        elif not torch.equal(q.view(torch.uint8), committed[f"{name}.q"]):
            bad.append(f"{name}: q differs")
        if not torch.equal(scale, committed[f"{name}.scale"]):
            bad.append(f"{name}: scale differs")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_is_the_documented_formula(committed, dtype):
    """w_hat = (q.float().view(rows, nb, -1) * scale.view(rows, nb, 1)).view(S).to(dtype), for
    every case of the fixture, in every compute dtype."""
    bad = []
    for name in _cases(committed):
        q = committed[f"{name}.q"].view(torch.float8_e4m3fn)
        scale = committed[f"{name}.scale"]
        rows, nb = scale.shape
        want = (q.float().view(rows, nb, -1) * scale.view(rows, nb, 1)).view(q.shape).to(dtype)
        got = quantize.dequantize(q, scale, dtype)
        if got.dtype != dtype or got.shape != q.shape or not torch.equal(got, want):
            bad.append(name)
        if not torch.equal(quantize.dequantize_weight(quantize.Fp8Weight(q, scale), dtype), want):
            bad.append(f"{name} (Fp8Weight)")
    assert not bad, f"{len(bad)} cases differ: {bad}"


def test_scale_shape_and_stored_bytes():
    cases = [
        # shape, scale shape, bytes in the store (data, zeros to 16, f32 scales)
        ((8, 256), (8, 4), 8 * 256 + 4 * 8 * 4),
        ((5, 100), (5, 1), 512 + 4 * 5),
        ((3, 63), (3, 1), 192 + 4 * 3),
        ((4, 1), (4, 1), 16 + 4 * 4),
        ((8, 4, 3, 3), (8, 1), 288 + 4 * 8),
        ((4, 16, 2, 2), (4, 1), 256 + 4 * 4),
        ((2, 3, 128), (2, 6), 768 + 4 * 2 * 6),
    ]
    bad = [
        f"{shape}: {quantize.scale_shape(shape)}, {quantize.fp8_nbytes(shape)} bytes"
        for shape, scales, nbytes in cases
        if quantize.scale_shape(shape) != scales or quantize.fp8_nbytes(shape) != nbytes
    ]
    assert not bad, "\n".join(bad)


def test_format_names():
    assert quantize.format_name("fp8") == quantize.format_name("fp8_e4m3_block64")
    assert quantize.format_name("fp8") == "fp8_e4m3_block64"
    assert quantize.format_name(None) is None
    with pytest.raises(ValueError, match="quantize='int4': expected None or 'fp8'"):
        quantize.format_name("int4")


def _net(dtype):
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(4, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 100), nn.LayerNorm(100)
    ).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_to_fp8_resident_replaces_the_named_weights_in_place(dtype):
    model, before = _net(dtype), _net(dtype)
    weight = model[2].weight
    assert quantize.to_fp8_resident(model, ["2", "0"]) == ["0", "2"]
    assert model[2].weight is weight, "the same parameter, changed in place"
    for i in (0, 2):
        w = before[i].weight.detach()
        q, scale = quantize.quantize_fp8_block64(w)
        want = (q.float().view(*scale.shape, -1) * scale.unsqueeze(-1)).view(w.shape).to(dtype)
        assert model[i].weight.dtype == dtype
        assert torch.equal(model[i].weight, want), i
        assert not torch.equal(model[i].weight, w), "the weight changed"
        assert torch.equal(model[i].bias, before[i].bias), "biases stay"
    assert torch.equal(model[3].weight, before[3].weight), "norms stay"


def test_to_fp8_resident_by_predicate_and_its_errors():
    model, before = _net(torch.float32), _net(torch.float32)
    changed = quantize.to_fp8_resident(model, lambda name, m: isinstance(m, nn.Linear))
    assert changed == ["2"]
    assert torch.equal(model[0].weight, before[0].weight)
    assert torch.equal(model[2].weight, quantize.w_hat(before[2].weight.detach()))
    with pytest.raises(KeyError, match="no module named 'nope'"):
        quantize.to_fp8_resident(model, ["nope"])
    with pytest.raises(ValueError, match="'1' has no weight"):
        quantize.to_fp8_resident(model, ["1"])
    model[2].weight = nn.Parameter(torch.zeros(100, 128, dtype=torch.int8), requires_grad=False)
    with pytest.raises(ValueError, match="cannot quantize '2' to fp8: its weight is torch.int8"):
        quantize.to_fp8_resident(model, ["2"])


def test_sqnr():
    w = torch.tensor([3.0, 4.0])
    assert quantize.sqnr_db(w, w) == float("inf")
    assert quantize.sqnr_db(w, torch.tensor([3.0, 3.5])) == pytest.approx(20.0)
