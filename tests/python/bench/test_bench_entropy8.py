"""tests/bench/entropy8.py on small tensors: the entropy, the per-chunk bound and the formats'
bytes, exact."""

from __future__ import annotations

import pytest
import torch

from tests.bench import entropy8


def test_entropy_is_the_order_0_entropy_of_the_bytes():
    four = torch.arange(4, dtype=torch.uint8).repeat(1024)  # four codes, equally often
    assert entropy8.entropy_bits(four) == 2.0
    assert entropy8.entropy_bits(torch.full((100,), 7, dtype=torch.uint8)) == 0.0


def test_the_bound_codes_each_chunk_at_its_entropy_plus_its_table():
    # Two chunks of 8 bytes: the first four codes (2 bits each: 2 bytes + 4 symbols' table),
    # the second one code (0 bits: 0 bytes + 1 symbol's table).
    codes = torch.tensor([0, 1, 2, 3] * 2 + [9] * 8, dtype=torch.uint8)
    assert entropy8.chunk_bound(codes, chunk=8) == (2 + 4 * 2) + (0 + 1 * 2)


def test_each_format_counts_its_codes_and_scales():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    rows = {r["format"]: r for r in entropy8.measure("w", w)}
    # block64: 2 scales a row; the row formats: one; float32 each.
    assert {f: r["bytes"] for f, r in rows.items()} == {
        "fp8_e4m3_block64": 64 * 128 + 64 * 2 * 4,
        "fp8_row": 64 * 128 + 64 * 4,
        "int8_row": 64 * 128 + 64 * 4,
    }
    for r in rows.values():
        assert 0 < r["bits_per_code"] <= 8
        assert r["bound_saved"] == pytest.approx(1 - r["bound_bytes"] / r["bytes"])


def test_the_report_names_its_command_and_commit(tmp_path):
    report = {"command": "cmd", "commit": "abc", "rows": entropy8.measure("w", torch.ones(64, 64))}
    md = entropy8.markdown(report)
    assert "- command: `cmd`" in md and "- commit: abc" in md
    assert "| w | fp8_e4m3_block64 | 0.000 |" in md
