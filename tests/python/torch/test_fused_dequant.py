"""The fused dequantization's kernels (``weightstream._fused_dequant``) run by Triton's
interpreter on the CPU, against the documented formula ``(q.float() * scale).to(dtype)``: both
kernels (a power-of-two block, and whole rows of any length, longer than a program's chunk too),
partial last programs, and the committed edge vectors. float16 and float32 only: the
interpreter rounds to bfloat16 unlike the GPU (its bf16 results are checked on the GPU machine,
``tests/gpu/torch_suite.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.gpu import torch_suite  # noqa: E402
from tests.python.interpreted import run_interpreted

CHILD = r"""
import sys
import torch
from safetensors.torch import load_file
from weightstream import _fused_dequant, quantize

kernels = []
real = _fused_dequant._kernel


def which():
    triton, blocks, rows = real()

    class Seen:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            kernels.append(self.name)
            return self.kernel[grid]

    return triton, Seen("blocks", blocks), Seen("rows", rows)


_fused_dequant._kernel = which
g = torch.Generator().manual_seed(3)
cases = []
for shape in [(70, 128), (5, 100), (7, 64, 3, 3), (3, 5000), (2, 8192)]:
    w = torch.randn(shape, generator=g).mul_(0.02).to(torch.bfloat16)
    cases.append((str(shape), *quantize.quantize_fp8_block64(w)))
# torchao's per-row scales: one per row of 4096 (a power of two: the block kernel, one block a
# program) and of 3072 (the row kernel).
for cols in (4096, 3072):
    q = (torch.randn(3, cols, generator=g) * 50).to(torch.float8_e4m3fn)
    cases.append((f"rowwise {cols}", q, torch.rand(3, 1, generator=g) + 0.5))
vectors = load_file(sys.argv[1])
for k in sorted(vectors):
    if k.endswith(".w"):
        q = vectors[f"{k[:-2]}.q"].view(torch.float8_e4m3fn)
        cases.append((k, q, vectors[f"{k[:-2]}.scale"]))
for name, q, scale in cases:
    rows, nb = scale.shape
    for dtype, bits in ((torch.float16, torch.int16), (torch.float32, torch.int32)):
        want = (q.float().view(rows, nb, -1) * scale.view(rows, nb, 1)).view(q.shape).to(dtype)
        out = torch.empty(q.shape, dtype=dtype)
        kernels.clear()
        _fused_dequant.launch(q.contiguous(), scale.contiguous(), out)
        same = torch.equal(out.view(bits), want.view(bits))
        print(name, str(dtype), kernels, "equal" if same else "DIFFER")
"""


def test_the_kernels_compute_the_formula_under_the_interpreter():
    vectors = torch_suite.FP8_VECTORS  # the GPU suite's check reads the same file
    lines = run_interpreted(CHILD, str(vectors))
    by_case = {}
    for line in lines:
        name, rest = line.split(" torch.", 1)
        by_case.setdefault(name, []).append(rest)
    want_kernel = {
        "(70, 128)": "blocks",
        "(5, 100)": "rows",  # a row of 100 is not a multiple of 64: one scale per row
        "(7, 64, 3, 3)": "blocks",
        "(3, 5000)": "rows",  # 5000 is no multiple of 64; longer than a program's chunk
        "(2, 8192)": "blocks",
        "rowwise 4096": "blocks",
        "rowwise 3072": "rows",
    }
    for name, kernel in want_kernel.items():
        assert by_case[name] == [
            f"float16 ['{kernel}'] equal",
            f"float32 ['{kernel}'] equal",
        ], name
    vector_cases = [n for n in by_case if n not in want_kernel]
    assert vector_cases, "no edge vectors were read"
    differ = [line for line in lines if not line.endswith(" equal")]
    assert not differ, differ


GROUP_CHILD = r"""
import torch
from weightstream import _fused_dequant, quantize

g = torch.Generator().manual_seed(3)
# A group's weights as a staging block holds them: the 8-bit data, then the scales, each at a
# 256-byte boundary of one buffer (the kernel works from offsets to the first weight's).
shapes = [(70, 128), (7, 64, 3, 3), (2, 8192), (16, 64)]
pairs = [quantize.quantize_fp8_block64(torch.randn(s, generator=g).mul_(0.02)) for s in shapes]


def aligned(n):
    return -(-n // 256) * 256


size = sum(aligned(q.numel()) + aligned(s.numel() * 4) for q, s in pairs)
buf = torch.zeros(size + 16, dtype=torch.uint8)


def place(at, t, dtype):
    n = t.numel() * t.element_size()
    view = buf[at : at + n].view(dtype).view(t.shape)
    view.copy_(t)
    return view


def group(shift_scale=0):
    at, qs = 0, []
    for q, _ in pairs:
        qs.append(place(at, q, torch.float8_e4m3fn))
        at += aligned(q.numel())
    out = []
    for i, (q, s) in enumerate(pairs):
        shift = shift_scale if i == 2 else 0
        out.append((qs[i], place(at + shift, s, torch.float32)))
        at += aligned(s.numel() * 4)
    return out


for dtype, bits in ((torch.float16, torch.int16), (torch.float32, torch.int32)):
    weights = group()
    outs = _fused_dequant.launch_group(weights, dtype)
    for (q, s), o in zip(weights, outs, strict=True):
        rows, nb = s.shape
        want = (q.float().view(rows, nb, -1) * s.view(rows, nb, 1)).view(q.shape).to(dtype)
        same = torch.equal(o.view(bits), want.view(bits))
        print(tuple(q.shape), str(dtype), "equal" if same else "DIFFER")
    print("one tensor", len({o.untyped_storage().data_ptr() for o in outs}))
# A plan runs again on the same layout, and refuses weights placed otherwise.
plan = _fused_dequant.plan_group(weights, torch.float32)
again = plan.run(weights[0], weights[-1])
want = _fused_dequant.launch_group(weights, torch.float32)
print("again", all(torch.equal(a, b) for a, b in zip(again, want, strict=True)))
print("moved", plan.run(weights[1], weights[-1]))
# Scales 8 bytes off a 16-byte boundary: one launch cannot take them (its loads assume it).
print("misaligned", _fused_dequant.launch_group(group(shift_scale=8), torch.float32))
# Scale blocks of different sizes: no one kernel for both.
rowwise = (torch.ones(3, 4096).to(torch.float8_e4m3fn), torch.ones(3, 1))
print("mixed blocks", _fused_dequant.launch_group([group()[0], rowwise], torch.float32))
"""


def test_the_group_kernel_computes_the_formula_for_each_weight_under_the_interpreter():
    """``launch_group``: the weights of one group (at offsets in one buffer, as a staging
    block holds them) dequantized in one launch into views of one tensor, each equal to the
    formula; its plan runs again on the same layout and refuses another; weights one launch
    cannot take are refused (None: dequantized one by one)."""
    lines = run_interpreted(GROUP_CHILD)
    shapes = ("(70, 128)", "(7, 64, 3, 3)", "(2, 8192)", "(16, 64)")
    want = []
    for dtype in ("float16", "float32"):
        want += [f"{shape} torch.{dtype} equal" for shape in shapes] + ["one tensor 1"]
    assert lines == [
        *want,
        "again True",
        "moved None",
        "misaligned None",
        "mixed blocks None",
    ]
