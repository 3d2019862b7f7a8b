"""tests/bench/coding_cpu.py's 4-bit rows on the CPU, against the daemon's host backend: a
layer's tensors uploaded as they are and coded, a row each with why one is not coded, and the
layer's row summing them; the 4-bit formats' tensors as their quantizers hold them."""

from __future__ import annotations

import pytest
import torch

from tests.bench import coding_cpu

MIB = 1 << 20


def test_each_tensor_is_coded_or_says_why_not(daemon):
    g = torch.Generator().manual_seed(0)
    tensors = {
        # few distinct bytes: codes to far fewer
        "skewed": (torch.randn(2 * MIB, generator=g).abs() * 3).to(torch.uint8),
        # every byte equally likely: codes to no fewer
        "uniform": torch.randint(0, 256, (2 * MIB,), generator=g, dtype=torch.uint8),
        "floats": torch.zeros(MIB // 2, dtype=torch.float32),  # 2 MiB of 4-byte elements
        "small": torch.zeros(MIB - 1, dtype=torch.uint8),
    }
    rows = {r["format"]: r for r in coding_cpu.measure4(daemon.client, "f", tensors)}
    assert list(rows) == ["f: skewed", "f: uniform", "f: floats", "f: small", "f: all"]
    assert {f: r["coded"] for f, r in rows.items()} == {
        "f: skewed": "rans8",
        "f: uniform": "not coded: saves under 1/32",
        "f: floats": "not coded: float32, not one byte",
        "f: small": "not coded: under 1 MiB",
        "f: all": "rans8: 1 of 4 tensors",
    }
    assert [r["bytes"] for r in rows.values()] == [2 * MIB, 2 * MIB, 2 * MIB, MIB - 1, 7 * MIB - 1]
    skewed = rows["f: skewed"]
    assert skewed["coded_bytes"] < skewed["bytes"] // 2
    assert skewed["lanes"] == 2 * MIB // 512
    for f in ("f: uniform", "f: floats", "f: small"):
        assert rows[f]["coded_bytes"] == rows[f]["bytes"] and rows[f]["lanes"] == 0, f
        assert rows[f]["saved"] == 0
    total = rows["f: all"]
    assert total["coded_bytes"] == 5 * MIB - 1 + skewed["coded_bytes"]
    assert total["saved"] == round(1 - total["coded_bytes"] / total["bytes"], 4)
    assert total["lanes"] == skewed["lanes"]
    # The coder ran on the two one-byte tensors of 1 MiB or more, its blob kept or not.
    assert total["code_s"] > 0
    assert total["encode_mb_s"] == pytest.approx(4 * MIB / total["code_s"] / 1e6, abs=0.1)


def test_the_4_bit_formats_hold_their_quantizers_tensors():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    got = {
        name: {n: (t.dtype, t.numel()) for n, t in tensors.items()}
        for name, tensors in coding_cpu.aitk_formats(w, None).items()
    }
    stand_in = "(stand-in: tests/python/torch/aitk_layouts.py)"
    assert got == {
        f"uint4 {stand_in}": {
            "uintx_packed": (torch.uint8, 64 * 256 // 2),
            "uintx_scale": (torch.uint8, 64 * 4 * 2),  # a bf16 scale per 64 inputs, as bytes
            "uintx_zero_point": (torch.uint8, 64 * 4),
        },
        f"nvfp4 {stand_in}": {
            "nv4_qdata": (torch.uint8, 64 * 256 // 2),
            "nv4_scales": (torch.uint8, 64 * 256 // 16),  # nv4_pts not uploaded
        },
    }
    pytest.importorskip("bitsandbytes")
    bnb = coding_cpu.bnb_formats(w)
    assert [n.split(" ")[0] for n in bnb] == ["nf4", "fp4"]
    for tensors in bnb.values():
        assert {n: (t.dtype, t.numel()) for n, t in tensors.items()} == {
            "data": (torch.uint8, 64 * 256 // 2),
            "absmax": (torch.float32, 64 * 256 // 64),
        }


def test_the_table_shows_a_tensor_not_coded():
    row = {
        "weights": "w",
        "format": "nf4: data",
        "bytes": 2 * MIB,
        "coded_bytes": 2 * MIB,
        "coded": "not coded: saves under 1/32",
        "lanes": 0,
        "saved": 0.0,
        "code_s": None,
        "encode_mb_s": None,
    }
    report = {"command": "cmd", "commit": "abc", "cores": 2, "quantizers4": "q", "rows": [row]}
    md = coding_cpu.markdown(report)
    assert (
        "| w | nf4: data | 2,097,152 | 2,097,152 | 0.0 % | — | not coded: saves under 1/32 | — |"
        in md
    )
    assert "- 4-bit quantizers: q" in md


def test_peaks_stores_one_model_each_way_in_a_fresh_daemon(tmp_path):
    from tests.daemon import BIN

    rows = coding_cpu.peaks(BIN, str(tmp_path), layers=1)
    assert [(r["how"], r["coding"]) for r in rows] == [
        ("load", "none"),
        ("load", "rans8"),
        ("upload", "none"),
        ("upload", "rans8"),
    ]
    # fp8 block64: a byte a weight and a float32 scale per 64; e4m3 uploaded: a byte a weight.
    weights = 3072 * 12288
    assert [r["bytes_gib"] * (1 << 30) for r in rows] == [weights * 17 / 16] * 2 + [weights] * 2
    for r in rows:
        coded = r["coding"] == "rans8"
        assert (r["held_gib"] < r["bytes_gib"]) == coded, r
        assert r["peak_gib"] >= r["held_gib"] > 0 and r["peak_gib"] >= r["start_gib"], r
