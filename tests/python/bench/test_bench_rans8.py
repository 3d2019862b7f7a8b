"""tests/bench/rans8.py on the CPU: the rANS coder's round trip through the numpy decoder, its
size against the bytes' empirical entropy, the Triton decoder under Triton's interpreter, and
``main`` refusing to run without a CUDA device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.bench import rans8
from tests.python.interpreted import run_interpreted

ROOT = Path(__file__).resolve().parents[3]


def skewed(n: int, seed: int = 0) -> np.ndarray:
    """Bytes of a geometric distribution (p = 0.3): about 2.9 bits a byte."""
    rng = np.random.default_rng(seed)
    return np.minimum(rng.geometric(0.3, n) - 1, 255).astype(np.uint8)


CASES = {
    "uniform": (np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8), 64),
    "skewed": (skewed(10_000), 64),
    "one byte repeated": (np.full(5_000, 0xA7, np.uint8), 32),
    "n not a multiple of the lanes": (skewed(1_000, seed=2), 48),
    "n below the lanes": (skewed(5, seed=3), 32),
    "n = 1": (np.array([200], np.uint8), 8),
}


@pytest.mark.parametrize("name", CASES)
def test_the_numpy_decoder_gives_back_the_bytes(name):
    data, lanes = CASES[name]
    c = rans8.encode(data, lanes)
    assert np.array_equal(rans8.decode_numpy(c), data)
    assert (c.n, c.lanes) == (data.size, lanes)
    assert int(c.freq.sum()) == 4096
    assert np.array_equal(c.freq > 0, np.bincount(data, minlength=256) > 0)
    assert (c.states.size, c.offsets.size, int(c.offsets[-1])) == (lanes, lanes + 1, c.words.size)
    assert c.nbytes() == 512 + 4 * lanes + 4 * (lanes + 1) + 2 * c.words.size


def test_the_coding_is_deterministic():
    data, lanes = CASES["skewed"]
    a, b = rans8.encode(data, lanes), rans8.encode(data, lanes)
    for field in ("freq", "states", "offsets", "words"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field


def test_skewed_bytes_code_within_one_percent_of_their_entropy_plus_the_tables():
    n, lanes = 200_000, 64
    data = skewed(n)
    p = np.bincount(data, minlength=256) / n
    p = p[p > 0]
    entropy_bytes = n * float(-(p * np.log2(p)).sum()) / 8
    tables = 512 + 4 * lanes + 4 * (lanes + 1)
    c = rans8.encode(data, lanes)
    assert c.nbytes() <= 1.01 * entropy_bytes + tables
    assert c.nbytes() < 0.4 * n


CHILD = r"""
import numpy as np
import torch
from tests.bench import rans8

rng = np.random.default_rng(4)
cases = {
    "uniform": (rng.integers(0, 256, 3000, dtype=np.uint8), 200),
    "skewed": (np.minimum(rng.geometric(0.3, 3000) - 1, 255).astype(np.uint8), 200),
    "one byte repeated": (np.full(700, 9, np.uint8), 128),
    "n below the lanes": (np.array([1, 2, 250], np.uint8), 130),
    "n = 1": (np.array([77], np.uint8), 4),
}
for name, (data, lanes) in cases.items():
    out = rans8.decode_triton(rans8.encode(data, lanes), "cpu")
    same = out.dtype == torch.uint8 and np.array_equal(out.numpy(), data)
    print(name, "equal" if same else "DIFFER")
"""


def test_the_triton_decoder_gives_back_the_bytes_under_the_interpreter():
    pytest.importorskip("triton")
    lines = run_interpreted(CHILD)
    assert lines == [
        "uniform equal",
        "skewed equal",
        "one byte repeated equal",
        "n below the lanes equal",
        "n = 1 equal",
    ]


def test_main_without_a_cuda_device_says_so_and_exits_2(monkeypatch, capsys, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        rans8.main(["--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "rans8 needs a CUDA device: its decoder runs on the GPU" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_report_has_a_row_a_codec_with_where_it_encoded():
    row = {"weights": "w", "format": "fp8_row", "saved": 0.125, "decode_gbps": 150.0}
    row |= {"spared_over_decode": 0.9, "equal": True, "encode_s": 1.5}
    rows = [
        {**row, "codec": "rANS 64 lanes", "encode_mbps": 30.0},
        {**row, "codec": "ANS", "equal": False},
        {"weights": "w", "format": "int8_row", "codec": "ANS", "error": "E: x"},
    ]
    report = {"command": "c", "commit": "k", "device": "d", "nvcomp": "6", "repeat": 9}
    md = rans8.markdown({**report, "lanes": [64], "rows": rows})
    assert (
        "| w | fp8_row | rANS 64 lanes | 12.5 % | 150.0 | 0.90 | yes | 1.500 s (CPU 30 MB/s) |"
        in md
    )
    assert "| w | fp8_row | ANS | 12.5 % | 150.0 | 0.90 | **no** | 1.500 s (device) |" in md
    assert "| w | int8_row | ANS | E: x | - | - | - | - |" in md
