"""Writes daemon/e2e/tests/data/fp8_vectors.safetensors: inputs and torch's outputs of the
formats the daemon quantizes into (fp8_e4m3_block64, fp8_e4m3_row, int8_row).

    .venv/bin/python -m tests.python.client.gen_fp8_vectors    # (re)write the fixture

For each case `C` the file holds `C.w` (the weight: BF16, F16 or F32, rank >= 2), `C.q` (torch's
float8_e4m3fn bytes as U8, the weight's shape) and `C.scale` (F32, [rows, cols/64] or [rows, 1]);
`convert.x` (F32) and `convert.q` (U8) pin the bare f32 -> e4m3fn conversion, including inputs
past 448 that the quantizer clamps away. For each row case `R` (name starting with "row_"):
`R.rw` (the weight), `R.fp8_row` (e4m3fn bytes as U8) with `R.fp8_row_scale` (F32 [rows, 1]), and
`R.int8_row` (I8) with `R.int8_row_scale`: 8-bit compute's per-row quantization
(``weightstream.torch.compute8.quantize_rows_reference``) of the weight viewed as [rows, cols].
The Rust quantizer must reproduce every byte
(daemon/e2e/tests/quantize.rs); tests/python/client/test_fp8_reference.py checks that this script
still writes the committed file. The quantizer is the package's (``weightstream.quantize``): needs
the package installed, torch (CPU) and safetensors; deterministic (seeded generators).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from weightstream.quantize import E4M3_MAX, quantize_fp8_block64
from weightstream.torch.compute8 import quantize_rows_reference

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = ROOT / "daemon" / "e2e" / "tests" / "data" / "fp8_vectors.safetensors"
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented quantization (``weightstream.quantize``): (q as uint8 in w's shape, f32
    scales)."""
    q, scale = quantize_fp8_block64(w)
    return q.view(torch.uint8), scale


#: The row formats: (suffix of the outputs, compute8's mode).
ROW_FORMATS = (("fp8_row", "fp8"), ("int8_row", "int8"))


def row_reference(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit compute's per-row quantization of ``w`` viewed as [rows, cols]: (q in w's shape,
    e4m3fn bytes as uint8 or int8; f32 scales [rows, 1])."""
    rows = w.shape[0]
    q, scale = quantize_rows_reference(w.reshape(rows, -1), mode)
    if q.dtype == torch.float8_e4m3fn:
        q = q.view(torch.uint8)
    return q.reshape(w.shape), scale.reshape(rows, 1)


def e4m3_values() -> torch.Tensor:
    """The 127 non-negative finite e4m3fn values, by code (0x00..0x7E), as f32."""
    return torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def midpoints() -> torch.Tensor:
    """The 126 rounding ties between neighbouring non-negative finite e4m3fn values."""
    v = e4m3_values()
    return (v[:-1] + v[1:]) / 2


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _blocks(amax: list[float], picks: list[torch.Tensor], dtype, gen) -> torch.Tensor:
    """One row of 64 per amax: the amax first (it fixes the scale), then up to 63 picks with
    random signs, padded with random values below the amax."""
    rows = []
    for a, p in zip(amax, picks, strict=True):
        p = p[:63]
        pad = torch.rand(63 - len(p), generator=gen) * a
        row = torch.cat([torch.tensor([a]), p, pad])
        signs = torch.where(torch.rand(64, generator=gen) < 0.5, -1.0, 1.0)
        signs[0] = 1.0
        rows.append(row * signs)
    out = torch.stack(rows).to(dtype)
    assert out.abs().amax(dim=1).tolist() == torch.tensor(amax).to(dtype).tolist(), "amax moved"
    return out


def _discriminating(dtype, gen, want_rows: int, itype=torch.int16):
    """Blocks of weights on which the exact fp32 division and a multiplication by the
    reciprocal give different e4m3 codes, or whose quotient is exactly a rounding tie:
    (amax per row, picks per row). Found by trying every value of `dtype` in the top 17
    binades below random amaxes."""
    mids = midpoints()
    amaxs, picks = [], []
    while len(amaxs) < want_rows:
        a = (torch.rand(1, generator=gen) * 20 + 0.05).to(dtype)
        hi = int(a.view(itype))
        lo = int((a.float() * 2**-17).to(dtype).view(itype))
        x = torch.arange(lo, hi, dtype=torch.int32).to(itype).view(dtype).float()
        s = a.float() / E4M3_MAX
        quotient = x / s
        differs = _e4m3(quotient) != _e4m3(x * torch.reciprocal(s))
        ties = torch.isin(quotient, mids)
        chosen = torch.cat([x[differs], x[ties][torch.randperm(int(ties.sum()), generator=gen)]])
        if int(differs.sum()) == 0:
            continue
        amaxs.append(float(a.float()))
        picks.append(chosen)
    return amaxs, picks


def _ties_pow2(dtype, k: int) -> torch.Tensor:
    """[4, 64]: scale exactly 2^k (amax 448 * 2^k first in each row), then every tie of the
    e4m3 grid times 2^k, positive and negative (126 * 2 = 252 = 4 * 63)."""
    m = midpoints() * 2.0**k
    vals = torch.cat([m, -m]).reshape(4, 63)
    amax = torch.full((4, 1), E4M3_MAX * 2.0**k)
    return torch.cat([amax, vals], dim=1).to(dtype)


def _conversion_inputs() -> torch.Tensor:
    """f32 inputs of the bare conversion: every e4m3 value and tie, 3 ulps either side, the
    range past 448 up to 500, infinities and NaN; both signs."""
    v = e4m3_values()
    grid = torch.cat([v, midpoints(), torch.tensor([464.0, 472.0, 480.0])])
    bits = grid.view(torch.int32)
    near = torch.cat([bits + k for k in range(-3, 4)]).view(torch.float32)
    near = near[near >= 0]
    past = torch.linspace(440.0, 500.0, 121)
    special = torch.tensor([float("inf"), float("nan"), 1e-30, 1e30, 2.0**-149, 3.4e38])
    x = torch.cat([near, past, special])
    return torch.cat([x, -x])


def _int8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-127.0, 127.0).round().to(torch.int8)


def _grid(mode: str):
    """(qmax, encode, the grid's non-negative rounding ties) of compute8's ``mode``."""
    if mode == "fp8":
        return E4M3_MAX, _e4m3, midpoints()
    return 127.0, _int8, torch.arange(0, 127, dtype=torch.float32) + 0.5


def _rows(amax: list[float], picks: list[torch.Tensor], dtype, gen, width: int) -> torch.Tensor:
    """As `_blocks`, one row of ``width`` per amax."""
    rows = []
    for a, p in zip(amax, picks, strict=True):
        p = p[: width - 1]
        pad = torch.rand(width - 1 - len(p), generator=gen) * a
        row = torch.cat([torch.tensor([a]), p, pad])
        signs = torch.where(torch.rand(width, generator=gen) < 0.5, -1.0, 1.0)
        signs[0] = 1.0
        rows.append(row * signs)
    out = torch.stack(rows).to(dtype)
    assert out.abs().amax(dim=1).tolist() == torch.tensor(amax).to(dtype).tolist(), "amax moved"
    return out


def _row_discriminating(dtype, gen, want_rows: int, mode: str, itype=torch.int16):
    """As `_discriminating`, on ``mode``'s grid with the row's amax / qmax as the scale."""
    qmax, encode, mids = _grid(mode)
    amaxs, picks = [], []
    while len(amaxs) < want_rows:
        a = (torch.rand(1, generator=gen) * 20 + 0.05).to(dtype)
        hi = int(a.view(itype))
        lo = int((a.float() * 2**-17).to(dtype).view(itype))
        x = torch.arange(lo, hi, dtype=torch.int32).to(itype).view(dtype).float()
        s = a.float() / torch.full_like(a.float(), qmax)
        quotient = x / s
        differs = encode(quotient) != encode(x * torch.reciprocal(s))
        ties = torch.isin(quotient, mids)
        chosen = torch.cat([x[differs], x[ties][torch.randperm(int(ties.sum()), generator=gen)]])
        if int(differs.sum()) == 0:
            continue
        amaxs.append(float(a.float()))
        picks.append(chosen[torch.randperm(len(chosen), generator=gen)])
    return amaxs, picks


def _discriminating_f32(gen, rows: int, mode: str = "fp8"):
    """As `_discriminating`, for f32 on ``mode``'s grid: candidates are the products m * scale
    of every tie m, and their neighbours up to 2 ulps away."""
    qmax, encode, mids = _grid(mode)
    amaxs, picks = [], []
    while len(amaxs) < rows:
        a = torch.rand(1, generator=gen) * 20 + 0.05
        s = a / torch.full_like(a, qmax)
        near = (mids * s).view(torch.int32)
        x = torch.cat([near + k for k in (-2, -1, 0, 1, 2)]).view(torch.float32)
        x = x[(x > 0) & (x < a)]
        quotient = x / s
        differs = encode(quotient) != encode(x * torch.reciprocal(s))
        ties = torch.isin(quotient, mids)
        chosen = torch.cat([x[differs], x[ties & ~differs]])
        if int(differs.sum()) == 0:
            continue
        amaxs.append(float(a))
        picks.append(chosen[torch.randperm(len(chosen), generator=gen)])
    return amaxs, picks


def _int8_ties_pow2(dtype, k: int) -> torch.Tensor:
    """[2, 128]: scale exactly 2^k (amax 127 * 2^k first in each row), then every tie of the
    int8 grid, n + 1/2 for n in 0..126, times 2^k: positive in row 0, negative in row 1."""
    m = (torch.arange(0, 127, dtype=torch.float32) + 0.5) * 2.0**k
    amax = torch.full((2, 1), 127.0 * 2.0**k)
    return torch.cat([amax, torch.stack([m, -m])], dim=1).to(dtype)


def build_rows() -> dict[str, torch.Tensor]:
    """The row cases' weights (compute8's per-row quantization, both modes, on each)."""
    cases: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(20261206)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    for name, dt in DTYPES.items():
        for tag, mag in (("1e-3", 1e-3), ("30", 30.0)):
            cases[f"row_normal_{name}_x{tag}"] = (randn(8, 256) * mag).to(dt)
        # Zeros, some negative: scale 1; -0.0 stays 0x80 in e4m3fn, 0 in int8.
        z = torch.zeros(4, 128)
        z[1, ::3] = -0.0
        z[3] = randn(128)
        cases[f"row_zeros_{name}"] = z.to(dt)
        # Exact ties under power-of-two scales: of the int8 grid (half to even), of e4m3's.
        for k in (0, -3, 4):
            cases[f"row_int8_ties_{name}_2^{k}"] = _int8_ties_pow2(dt, k)
        cases[f"row_e4m3_ties_{name}_2^-2"] = _ties_pow2(dt, -2)
    # Quotients a division and a multiplication by the reciprocal round differently.
    for mode in ("int8", "fp8"):
        for name, dt, width in (("bf16", torch.bfloat16, 200), ("f16", torch.float16, 96)):
            amax, picks = _row_discriminating(dt, gen, 6, mode)
            cases[f"row_div_{mode}_{name}"] = _rows(amax, picks, dt, gen, width)
        amax, picks = _discriminating_f32(gen, 6, mode)
        cases[f"row_div_{mode}_f32"] = _rows(amax, picks, torch.float32, gen, 300)
    # +-max: both signs of the amax in a row, and amax * (1 - 2^-k).
    w = randn(4, 64)
    w[:, 0] = 7.0
    w[:, 1] = -7.0
    w[:, 2:10] = 7.0 * (1 - 2.0 ** -torch.arange(1, 9, dtype=torch.float32))
    cases["row_at_max_f32"] = w
    cases["row_at_max_bf16"] = w.to(torch.bfloat16)
    # Widths that are not multiples of 64 (and some that are: one scale per row all the same).
    cases["row_w100_bf16"] = randn(5, 100).to(torch.bfloat16)
    cases["row_w63_f16"] = randn(3, 63).to(torch.float16)
    cases["row_w1_f32"] = randn(4, 1)
    cases["row_w65_bf16"] = randn(2, 65).to(torch.bfloat16)
    cases["row_w1000_f32"] = randn(3, 1000) * 0.02
    cases["row_w192_bf16"] = randn(3, 192).to(torch.bfloat16)
    # f32 extremes: tiny and huge rows, amaxes whose scale is an f32 subnormal or underflows
    # to 0 (scale 1), the f32 maximum; bf16 subnormals.
    w = randn(8, 128)
    w[0] *= 1e-30
    w[1] *= 1e30
    w[2] = randn(128) * 1e-40
    w[3] = randn(128).sign() * torch.arange(128).float() * 2.0**-149
    w[4] = randn(128).sign() * torch.arange(128).float() * 63 / 127 * 2.0**-149
    w[5] = randn(128).sign() * torch.arange(128).float() * 300 / 127 * 2.0**-149
    w[6] = randn(128) * 1e37
    w[6, 7] = 3.4028234663852886e38
    w[7] = randn(128) * 2.0**-130
    cases["row_extremes_f32"] = w
    cases["row_subnormal_bf16"] = (randn(4, 96) * 2.0**-128).to(torch.bfloat16)
    # Higher ranks: a Conv2d weight [out, in, kh, kw] is [out, in * kh * kw].
    cases["row_conv_8x4x3x3_bf16"] = (randn(8, 4, 3, 3) * 0.1).to(torch.bfloat16)
    cases["row_rank3_2x3x128_f32"] = randn(2, 3, 128)
    return cases


def build() -> dict[str, torch.Tensor]:
    cases: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(20261201)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    # Random normal weights at several magnitudes, in every dtype.
    for name, dt in DTYPES.items():
        for tag, mag in (("1e-3", 1e-3), ("1", 1.0), ("30", 30.0)):
            cases[f"normal_{name}_x{tag}"] = (randn(8, 256) * mag).to(dt)
    # Zeros (some negative): every block gets scale 1; -0.0 stays 0x80.
    for name, dt in DTYPES.items():
        z = torch.zeros(4, 128)
        z[1, ::3] = -0.0
        cases[f"zeros_{name}"] = z.to(dt)
    # One block of zeros and one of negative zeros among random blocks.
    w = randn(4, 192)
    w[2, 64:128] = 0.0
    w[3, 128:] = -0.0
    cases["zero_block_bf16"] = w.to(torch.bfloat16)
    # Subnormal e4m3 results: one large weight per block, the rest below 2^-6 of the scale.
    for name, dt in DTYPES.items():
        w = torch.rand(4, 128, generator=gen) * 2.0**-6 * (2 * torch.rand(4, 128, generator=gen))
        w[:, ::64] = E4M3_MAX
        w[1] *= 2.0**-3
        w[2] *= 3.0  # a scale that is not a power of two
        cases[f"subnormal_{name}"] = (w * torch.where(randn(4, 128) < 0, -1.0, 1.0)).to(dt)
    # Exact ties of the e4m3 grid under power-of-two scales (round half to even).
    for name, dt in DTYPES.items():
        for k in (0, -3, 5):
            cases[f"ties_{name}_2^{k}"] = _ties_pow2(dt, k)
    # Weights where a / scale and a * (1 / scale) round differently, and exact ties under
    # scales that are not powers of two.
    for name, dt, rows in (("bf16", torch.bfloat16, 8), ("f16", torch.float16, 4)):
        amax, picks = _discriminating(dt, gen, rows)
        cases[f"div_not_reciprocal_{name}"] = _blocks(amax, picks, dt, gen)
    amax, picks = _discriminating_f32(gen, 8)
    cases["div_not_reciprocal_f32"] = _blocks(amax, picks, torch.float32, gen)
    # Values at +-448 * scale: both signs of the amax in one block, and amax * (1 - 2^-k).
    w = randn(4, 64)
    w[:, 0] = 7.0
    w[:, 1] = -7.0
    w[:, 2:10] = 7.0 * (1 - 2.0 ** -torch.arange(1, 9, dtype=torch.float32))
    cases["at_448_f32"] = w
    cases["at_448_bf16"] = w.to(torch.bfloat16)
    # f32 extremes: 1e-30 and 1e30 blocks, both in one block, f32 subnormals, an amax whose
    # scale underflows to 0 (scale 1) or to an f32 subnormal, the f32 maximum.
    w = randn(6, 128)
    w[0] *= 1e-30
    w[1] *= 1e30
    w[2, :64] = 1e-30
    w[2, 5] = 1e30
    w[3] = randn(128) * 1e-40
    w[4, :64] = randn(64).sign() * torch.arange(64).float() * 2.0**-149
    w[4, 64:] = randn(64).sign() * torch.arange(64).float() * 300 / 63 * 2.0**-149
    w[5, :64] = randn(64) * 1e37
    w[5, 0] = 3.4028234663852886e38
    cases["extremes_f32"] = w
    # Rows that are not a multiple of 64: one scale per row.
    cases["rows_100_bf16"] = randn(5, 100).to(torch.bfloat16)
    cases["rows_63_f16"] = randn(3, 63).to(torch.float16)
    cases["rows_1_f32"] = randn(4, 1)
    cases["rows_65_bf16"] = randn(2, 65).to(torch.bfloat16)
    cases["rows_1000_f32"] = randn(3, 1000) * 0.02
    # Higher ranks: a Conv2d weight [out, in, kh, kw] is [out, in * kh * kw].
    cases["conv_8x4x3x3_bf16"] = (randn(8, 4, 3, 3) * 0.1).to(torch.bfloat16)
    cases["conv_4x16x2x2_f16"] = (randn(4, 16, 2, 2) * 0.1).to(torch.float16)
    cases["rank3_2x3x128_f32"] = randn(2, 3, 128)

    out: dict[str, torch.Tensor] = {}
    for name, w in cases.items():
        assert bool(torch.isfinite(w).all()), name
        q, scale = reference(w)
        out[f"{name}.w"] = w.contiguous()
        out[f"{name}.q"] = q.contiguous()
        out[f"{name}.scale"] = scale.contiguous()
    for name, w in build_rows().items():
        assert bool(torch.isfinite(w).all()), name
        out[f"{name}.rw"] = w.contiguous()
        for suffix, mode in ROW_FORMATS:
            q, scale = row_reference(w, mode)
            out[f"{name}.{suffix}"] = q.contiguous()
            out[f"{name}.{suffix}_scale"] = scale.contiguous()
    x = _conversion_inputs()
    out["convert.x"] = x
    out["convert.q"] = x.to(torch.float8_e4m3fn).view(torch.uint8)
    return out


METADATA = {
    "format": "fp8_e4m3_block64 test vectors: C.w (input), C.q (e4m3fn bytes), C.scale (f32); "
    "fp8_e4m3_row and int8_row: R.rw (input), R.fp8_row (e4m3fn bytes), R.int8_row (int8), "
    "R.fp8_row_scale and R.int8_row_scale (f32 [rows, 1])",
    "generator": "tests/python/client/gen_fp8_vectors.py",
}


def main() -> int:
    tensors = build()
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(FIXTURE), metadata={**METADATA, "torch": torch.__version__})
    cases = sum(1 for k in tensors if k.endswith(".w"))
    print(f"wrote {FIXTURE.relative_to(ROOT)}: {cases} cases, {FIXTURE.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
