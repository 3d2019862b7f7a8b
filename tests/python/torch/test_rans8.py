"""``weightstream._rans8``, the client's decoder of coded tensors, on blobs that
``tests/bench/rans8.py``'s encoder codes (the daemon's encoder is bit for bit the same): the CPU
decoder for one tensor and for a group of tensors at their offsets in a read-only mapped region
(n not a multiple of the lanes, below them, 1; 1 lane; more lanes than a program takes; skewed,
uniform, one repeated and e4m3 bytes), its refusal of malformed placements and corrupt blobs,
the error where Triton is missing on a device, and the Triton group kernel under Triton's
interpreter on the CPU (its pointers cast from the descriptor's int64 addresses)."""

from __future__ import annotations

import mmap
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from weightstream import _rans8
from weightstream._rans8 import CodedTensor

from tests.bench import rans8
from tests.python.interpreted import run_interpreted

ROOT = Path(__file__).resolve().parents[3]
#: What the output holds where no tensor decodes.
UNTOUCHED = 0xEE


def blob(c: rans8.Coded) -> bytes:
    """``c``'s blob as the daemon stores it: table, states, offsets, words, little endian."""
    arrays = (rans8.table(c), c.states, c.offsets)
    return b"".join(a.astype("<u4").tobytes() for a in arrays) + c.words.astype("<u2").tobytes()


def skewed(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.geometric(0.3, n) - 1, 255).astype(np.uint8)


def e4m3(n: int, seed: int = 0) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, generator=g) * 0.02).to(torch.float8_e4m3fn)
    return w.view(torch.uint8).numpy()


#: name: (bytes, lanes)
CASES = {
    "skewed": (skewed(10_000), 64),
    "uniform": (np.random.default_rng(1).integers(0, 256, 3_000, dtype=np.uint8), 200),
    "e4m3": (e4m3(5_000), 300),  # 3 programs of the kernel
    "n not a multiple of the lanes": (skewed(1_001, seed=2), 48),
    "one lane": (skewed(700, seed=3), 1),
    "n below the lanes": (skewed(5, seed=4), 32),
    "n = 1": (np.array([200], np.uint8), 8),
    "one byte repeated": (np.full(999, 0xA7, np.uint8), 130),
}


def layout(cases: dict, gap: int = 12, out_gap: int = 5):
    """The region's bytes (each blob at a multiple of 4 from ``gap`` bytes after the last),
    the ``CodedTensor`` of each case (outputs ``out_gap`` bytes apart) and the bytes the output
    should hold (``UNTOUCHED`` between them)."""
    region, tensors, want = bytearray(), [], bytearray()
    for data, lanes in cases.values():
        c = rans8.encode(data, lanes)
        b = blob(c)
        assert _rans8.blob_nbytes(lanes, c.words.size) == len(b)
        region += bytes([0x55] * (-(len(region) + gap) % 4 + gap))
        want += bytes([UNTOUCHED] * out_gap)
        tensors.append(CodedTensor(len(region), len(b), len(want), data.size, lanes))
        region += b
        want += data.tobytes()
    region += bytes(8)
    want += bytes([UNTOUCHED] * 3)
    return bytes(region), tensors, torch.frombuffer(want, dtype=torch.uint8)


def mapped(data: bytes, tmp_path: Path) -> torch.Tensor:
    """``data`` as a read-only mapping (a write through it would fault)."""
    path = tmp_path / "region"
    path.write_bytes(data)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns of a buffer it cannot write
        return torch.frombuffer(m, dtype=torch.uint8)


def decoded(region: torch.Tensor, tensors: list, size: int) -> torch.Tensor:
    out = torch.full((size,), UNTOUCHED, dtype=torch.uint8)
    _rans8.decode_into(region, tensors, out)
    return out


def test_a_single_tensor_decodes_to_its_bytes():
    data, lanes = CASES["skewed"]
    b = blob(rans8.encode(data, lanes))
    region = torch.frombuffer(bytearray(b), dtype=torch.uint8)
    out = decoded(region, [CodedTensor(0, len(b), 0, data.size, lanes)], data.size)
    assert torch.equal(out, torch.from_numpy(data))


def test_a_group_decodes_each_tensor_at_its_place_from_a_read_only_mapping(tmp_path):
    data, tensors, want = layout(CASES)
    region = mapped(data, tmp_path)
    out = decoded(region, tensors, want.numel())
    assert torch.equal(out, want)
    assert bytes(region.numpy()) == data


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lanes": 0}, "has 0 lanes"),
        ({"n": 0}, "decodes to 0 bytes"),
        ({"stored": _rans8.blob_nbytes(64, 0) - 2}, "which cannot hold 64 lanes"),
        ({"stored": _rans8.blob_nbytes(64, 10) + 1}, "whole 16-bit words"),
        ({"src": -4}, "cannot be negative"),
    ],
)
def test_a_placement_that_cannot_be_a_blob_is_refused(change, message):
    t = replace(CodedTensor(0, _rans8.blob_nbytes(64, 10), 0, 100, 64), **change)
    with pytest.raises(ValueError, match=message):
        _rans8.check(t)
    region, out = torch.zeros(1 << 15, dtype=torch.uint8), torch.zeros(200, dtype=torch.uint8)
    with pytest.raises(ValueError, match=message):
        _rans8.decode_into(region, [t], out)


def corrupt(how: str) -> tuple[bytes, CodedTensor]:
    data, lanes = CASES["skewed"]
    c = rans8.encode(data, lanes)
    if how == "truncated words":
        c.words = c.words[:-1]  # the offsets still count the last word
    elif how == "wrong offsets":
        c.offsets = c.offsets.copy()
        c.offsets[5] += 1
    elif how == "a flipped word":
        c.words = c.words.copy()
        c.words[100] ^= 0x0100
    elif how == "a flipped bit in a lane's last word":
        c.words = c.words.copy()
        c.words[c.offsets[1] - 1] ^= 1  # lane 0 reads no word after it: only its state is off
    b = blob(c)
    return b, CodedTensor(8, len(b), 16, data.size, lanes)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("truncated words", "the lanes' words do not match their offsets"),
        ("wrong offsets", "the lanes' words do not match their offsets"),
        ("a flipped word", "the lanes' words do not match their offsets"),
        ("a flipped bit in a lane's last word", "the lanes do not end in the state 65536"),
    ],
)
def test_a_corrupt_blob_is_refused_on_the_cpu(how, message):
    b, t = corrupt(how)
    region = torch.frombuffer(bytearray(bytes(8) + b), dtype=torch.uint8)
    out = torch.zeros(16 + t.n, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"out\[16:{16 + t.n}\]: ({message})"):
        _rans8.decode_into(region, [t], out)


def test_a_blob_past_the_region_or_an_output_past_out_is_refused():
    data, lanes = CASES["uniform"]
    b = blob(rans8.encode(data, lanes))
    region = torch.frombuffer(bytearray(b), dtype=torch.uint8)
    t = CodedTensor(0, len(b), 0, data.size, lanes)
    with pytest.raises(ValueError, match="lies past the region or out"):
        _rans8.decode_into(region[:-2], [t], torch.zeros(data.size, dtype=torch.uint8))
    with pytest.raises(ValueError, match="lies past the region or out"):
        _rans8.decode_into(region, [t], torch.zeros(data.size - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="past the region's"):
        _rans8.plan_for(region[:-2], [t], "cpu")
    with pytest.raises(ValueError, match="not at a multiple of 4 bytes"):
        _rans8.plan_for(torch.zeros(len(b) + 2, dtype=torch.uint8), [replace(t, src=2)], "cpu")


def test_a_device_without_triton_is_told_to_install_it(monkeypatch):
    monkeypatch.setattr(_rans8, "_kernel", lambda: None)
    region, out = (torch.empty(1 << 15, dtype=torch.uint8, device="meta") for _ in range(2))
    t = CodedTensor(0, _rans8.blob_nbytes(1, 0), 0, 1, 1)
    with pytest.raises(RuntimeError, match=r"needs Triton \(pip install triton\)"):
        _rans8.decode_into(region, [t], out)


CHILD = r"""
import numpy as np
import torch
from tests.bench import rans8
from tests.python.torch import test_rans8 as cases
from weightstream import _rans8

data, tensors, want = cases.layout(cases.CASES)
region = torch.frombuffer(bytearray(data), dtype=torch.uint8)
out = torch.full_like(want, cases.UNTOUCHED)
plan = _rans8.plan_for(region, tensors, "cpu")
print("programs", plan.programs.tolist())
_rans8.launch(plan, out)
print("group", "equal" if torch.equal(out, want) else "DIFFER")
out.fill_(cases.UNTOUCHED)
_rans8.launch(plan, out)  # the same plan again
print("again", "equal" if torch.equal(out, want) else "DIFFER")
# Offsets far past the blob: no lane reads a word outside it (such reads would fault).
b, t = cases.corrupt("truncated words")
b = bytearray(b)
at = _rans8.HEADER_BYTES + 4 * t.lanes
b[at : at + 4 * (t.lanes + 1)] = np.full(t.lanes + 1, 0x7FFFFFF0, "<u4").tobytes()
region = torch.frombuffer(bytearray(8) + b, dtype=torch.uint8)
_rans8.launch(_rans8.plan_for(region, [t], "cpu"), torch.zeros(16 + t.n, dtype=torch.uint8))
print("corrupt offsets read nothing past the blob")
"""


def test_the_group_kernel_decodes_every_tensor_under_the_interpreter():
    pytest.importorskip("triton")
    lines = run_interpreted(CHILD)
    blocks = [-(-lanes // _rans8.BLOCK) for _, lanes in CASES.values()]
    programs = [i for i, k in enumerate(blocks) for _ in range(k)]
    assert lines == [
        f"programs {programs}",
        "group equal",
        "again equal",
        "corrupt offsets read nothing past the blob",
    ]
