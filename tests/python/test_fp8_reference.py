"""The committed fp8_e4m3_block64 test vectors are what torch computes today, and torch's float8
conversion is the documented one (round to nearest, ties to even). Needs no daemon."""

from __future__ import annotations

import math
from fractions import Fraction

import gen_fp8_vectors as gen
import pytest
import torch
from safetensors.torch import load_file


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
        block = gen.BLOCK if cols % gen.BLOCK == 0 else cols
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
