"""8-bit compute (``weightstream.torch.compute8``) on the CPU: the fused activation quantizer and
the int8 epilogue under Triton's interpreter equal the torch formulas bit for bit; the reference
matmul equals exact arithmetic where exactness holds; shapes the kernels cannot take fall back,
counted; bad modes, formats and widths are refused with what to use; the layer's backward is the
documented input-gradient formula, exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from weightstream import quantize
from weightstream.torch import compute8

from tests.python.interpreted import run_interpreted

INTERPRETED = r"""
import torch
from weightstream import _quant8
from weightstream.torch import compute8

used = []
real = _quant8._kernels()


class Seen:
    def __init__(self, name, kernel):
        self.name, self.kernel = name, kernel

    def __getitem__(self, grid):
        used.append(self.name)
        return self.kernel[grid]


_quant8._kernels = lambda: (real[0], Seen("quantize_rows", real[1]), Seen("scale_int32", real[2]))
g = torch.Generator().manual_seed(5)


def rows(m, k, dtype):
    x = torch.randn(m, k, generator=g)
    x[:, 3] *= 60  # an outlier channel
    x[1] = 0  # an all-zero row: scale 1
    x[2] = torch.randn(k, generator=g) * 1e-30  # amax / qmax underflows nothing in fp32
    return x.to(dtype)


for k in (64, 1500, 2051):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = rows(6, k, dtype)
        cs = torch.rand(k, generator=g) + 0.25
        for mode in ("fp8", "int8"):
            for col in (None, cs):
                used.clear()
                q, s = compute8.quantize_rows(x, mode, col)
                rq, rs = compute8.quantize_rows_reference(x, mode, col)
                same = torch.equal(q.view(torch.int8), rq.view(torch.int8)) and torch.equal(s, rs)
                tag = f"{k} {dtype} {mode} {'col' if col is not None else '-'}"
                print(tag, used, "equal" if same else "DIFFER")
# int8 ties: values that land on x.5 after scaling round half to even, like torch.round.
x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -126.5]])
used.clear()
q, _ = compute8.quantize_rows(x, "int8")
print("ties", used, q.tolist())
# e4m3 edges (scale 1: amax 448): ties between grid points, the subnormal spacing 2^-9, -0.
x = torch.tensor([[448.0, 440.0, 124.0, -124.0, 2.0**-10, 3 * 2.0**-10, 2.0**-6, -0.0, 9.5]])
used.clear()
q, s = compute8.quantize_rows(x, "fp8")
rq, _ = compute8.quantize_rows_reference(x, "fp8")
same = q.view(torch.uint8).tolist() == rq.view(torch.uint8).tolist()
print("e4m3 edges", used, same, rq.float().tolist())
acc = torch.randint(-(2**30), 2**30, (5, 2100), generator=g, dtype=torch.int32)
sa, sb = torch.rand(5, generator=g), torch.rand(2100, generator=g)
bias = torch.randn(2100, generator=g)
for out in (torch.float16, torch.float32):
    for b in (None, bias):
        for col in (None, sb):
            used.clear()
            y = compute8.scale_int32(acc, sa, col, b, out)
            want = compute8._scale_int32_reference(acc, sa, col, b, out)
            same = torch.equal(y, want)
            print("epilogue", out, b is not None, col is not None, used, same)
"""


def test_kernels_equal_the_torch_formulas_under_the_interpreter():
    pytest.importorskip("triton")
    lines = run_interpreted(INTERPRETED, timeout=600)
    quant = [ln for ln in lines if ln.split()[0] in ("64", "1500", "2051")]
    assert len(quant) == 3 * 3 * 2 * 2
    assert all(ln.endswith("['quantize_rows'] equal") for ln in quant), quant
    assert "ties ['quantize_rows'] [[127, 0, 2, 2, 0, -2, 126, -126]]" in lines
    assert (
        "e4m3 edges ['quantize_rows'] True "
        "[[448.0, 448.0, 128.0, -128.0, 0.0, 0.00390625, 0.015625, -0.0, 10.0]]"
    ) in lines
    epilogue = [ln for ln in lines if ln.startswith("epilogue")]
    assert len(epilogue) == 8
    assert all(ln.endswith("['scale_int32'] True") for ln in epilogue), epilogue


def _int8(shape, g):
    return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)


def test_int8_reference_gemm_is_the_exact_integer_product_scaled():
    g = torch.Generator().manual_seed(1)
    # Mostly large positive values: sums past 2^24, where float32 stops holding every integer.
    a = torch.randint(90, 128, (33, 4096), generator=g, dtype=torch.int8)
    b = torch.randint(90, 128, (24, 4096), generator=g, dtype=torch.int8)
    b[::3] *= -1
    sa, sb = torch.rand(33, generator=g), torch.rand(24, generator=g)
    bias = torch.randn(24, generator=g).to(torch.bfloat16)
    got = compute8.gemm_reference(a, sa, b, sb, bias, torch.bfloat16, "int8")
    exact = (a.long() @ b.long().t()).to(torch.int32)
    assert int(exact.abs().max()) > 2**25
    want = ((exact.float() * sa[:, None]) * sb[None, :] + bias.float()).to(torch.bfloat16)
    assert torch.equal(got, want)


def test_fp8_reference_gemm_equals_the_dequantized_float32_product_where_it_is_exact():
    g = torch.Generator().manual_seed(2)
    # Integers up to 8 are e4m3 values; their products and 64-term sums are exact in float32.
    a = torch.randint(-8, 9, (20, 64), generator=g).float()
    b = torch.randint(-8, 9, (32, 64), generator=g).float()
    sa, sb = torch.rand(20, generator=g), torch.rand(32, generator=g)
    qa, qb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    assert torch.equal(qa.float(), a) and torch.equal(qb.float(), b)
    got = compute8.gemm_reference(qa, sa, qb, sb, None, torch.float32, "fp8")
    want = ((a @ b.t()) * sa[:, None] * sb[None, :]).to(torch.bfloat16).float()
    assert torch.equal(got, want)


def _linear(k, n, bias=True, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = nn.Linear(k, n, bias=bias).to(dtype)
    m.weight.requires_grad_(False)
    return m


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_forward_is_quantize_rows_then_the_reference_gemm(mode):
    m = _linear(64, 48)
    w = compute8.prepare(m.weight, mode)
    x = torch.randn(2, 5, 64)
    stats = compute8.Stats()
    y = compute8.linear(x, w, m.bias, stats=stats, name="l")
    qx, sx = compute8.quantize_rows_reference(x.reshape(10, 64), mode)
    want = compute8.gemm_reference(qx, sx, w.data, w.scale, m.bias, torch.float32, mode)
    assert torch.equal(y, want.reshape(2, 5, 48))
    assert stats.as_dict() == {"gemm8": 1, "fallbacks": {}}
    # Close to the float layer: 8 bits lose little on gaussian data.
    with torch.no_grad():
        assert quantize.sqnr_db(F.linear(x, m.weight, m.bias), y) > 25


def test_a_width_the_kernel_cannot_tile_falls_back_counted():
    m = _linear(40, 24)  # 40 is a multiple of 8 (int8) but not of 16 (fp8)
    x = torch.randn(3, 40)
    stats = compute8.Stats()
    w = compute8.prepare(m.weight, "fp8", name="blocks.0.proj")
    assert w.fallback == "fp8 needs in and out features that are multiples of 16, not 40 -> 24"
    y = compute8.linear(x, w, m.bias, stats=stats, name="blocks.0.proj")
    assert torch.equal(y, F.linear(x, compute8.dequantize(w, torch.float32), m.bias))
    assert stats.as_dict() == {
        "gemm8": 0,
        "fallbacks": {
            "blocks.0.proj: fp8 needs in and out features that are multiples of 16, not 40 -> 24": 1
        },
    }
    assert compute8.prepare(m.weight, "int8").fallback is None


def test_bad_modes_formats_and_widths_name_what_to_use():
    m = _linear(64, 32)
    with pytest.raises(ValueError) as e:
        compute8.prepare(m.weight, "fp4")
    assert str(e.value) == (
        "compute='fp4': expected one of 'fp8', 'int8' (8-bit compute) or 'bf16' (the "
        "dequantized weight in the trainer's dtype)"
    )
    with pytest.raises(ValueError) as e:
        compute8.check_grad_compute("fp8", "int8")
    assert str(e.value) == (
        "grad_compute='int8' with compute='fp8': expected 'fp8' (the same 8-bit mode) or "
        "'bf16' (dY times the dequantized weight in the trainer's dtype)"
    )
    with pytest.raises(ValueError) as e:
        compute8.prepare(_linear(96, 32).weight, "int8", rotation=64, name="ff.out")
    assert str(e.value) == (
        "ff.out: rotation=64 does not divide the layer's input width 96; use rotation=32 or 0"
    )
    with pytest.raises(ValueError) as e:
        compute8.prepare(torch.zeros(8, 16, dtype=torch.int32), "int8", name="x")
    assert str(e.value).startswith(
        "x: cannot quantize a torch.int32 weight for compute='int8': 8-bit compute takes"
    )
    with pytest.raises(ValueError) as e:
        compute8.prepare(quantize.Fp8Weight(torch.zeros(8, 16), torch.ones(8, 1), "nf4"), "fp8")
    assert str(e.value).startswith("layer: unknown 8-bit format 'nf4': expected one of ")
    with pytest.raises(ValueError) as e:
        compute8.linear(torch.randn(2, 48), compute8.prepare(m.weight, "int8"), name="q")
    assert str(e.value) == "q: input of width 48 for a layer of 64 inputs"
    conv = nn.Sequential(nn.Conv2d(4, 8, 3))
    with pytest.raises(ValueError) as e:
        compute8.to_w8a8_resident(conv, "int8", ["0"])
    assert str(e.value) == (
        "to_w8a8_resident: '0' is a Conv2d; 8-bit compute takes nn.Linear layers (others keep "
        "the dequantized path)"
    )


def test_a_gpu_without_the_instruction_is_refused_naming_the_mode_that_works(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA GeForce RTX 3090")
    assert compute8.supported_modes("cuda:0") == ("int8",)
    with pytest.raises(ValueError) as e:
        compute8.check_device("fp8", "cuda:0")
    assert str(e.value) == (
        "compute='fp8' needs an NVIDIA GPU of compute capability 8.9 or newer; NVIDIA GeForce "
        "RTX 3090 (compute capability 8.6) runs compute='int8' or compute='bf16'"
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))
    with pytest.raises(ValueError, match=r"8\.0 or newer; .* runs compute='bf16'$"):
        compute8.check_device("int8", "cuda:0")
    compute8.check_device("fp8", "cpu")


def test_weights_prepared_from_8_bit_formats():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(32, 128, generator=g)
    # torchao's per-row float8, as it is: the same data tensor, the scales flattened.
    qdata = (w * 10).to(torch.float8_e4m3fn)
    scale = torch.rand(32, 1, generator=g)
    ao = quantize.Fp8Weight(qdata, scale, quantize.TORCHAO_FLOAT8_ROWWISE, torch.bfloat16)
    p = compute8.prepare(ao, "fp8")
    assert p.data is qdata and torch.equal(p.scale, scale.flatten())
    # ... and in int8 (or rotated), requantized from its float32 dequantization, once.
    want = compute8.prepare(qdata.float() * scale, "int8")
    got = compute8.prepare(ao, "int8")
    assert torch.equal(got.data, want.data) and torch.equal(got.scale, want.scale)
    want = compute8.prepare(qdata.float() * scale, "fp8", rotation=32)
    got = compute8.prepare(ao, "fp8", rotation=32)
    assert torch.equal(got.data.view(torch.int8), want.data.view(torch.int8))
    assert torch.equal(got.scale, want.scale) and got.rotation == 32
    # fp8_e4m3_block64: dequantized, then quantized per row.
    q, s = quantize.quantize_fp8_block64(w)
    got = compute8.prepare(quantize.Fp8Weight(q, s), "fp8")
    want = compute8.prepare(quantize.dequantize(q, s, torch.float32), "fp8")
    assert torch.equal(got.data.view(torch.int8), want.data.view(torch.int8))
    assert torch.equal(got.scale, want.scale)


def _rows_with_outliers(m, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, [5, 77, 200]] *= torch.tensor([30.0, 60.0, 100.0])
    return x


def test_rotation_recovers_accuracy_on_outlier_channels():
    m = _linear(256, 128, bias=False, seed=3)
    x = _rows_with_outliers(64, 256, 6)
    ref = F.linear(x, m.weight)
    plain = compute8.linear(x, compute8.prepare(m.weight, "int8"))
    rot = compute8.linear(x, compute8.prepare(m.weight, "int8", rotation=64))
    w = compute8.prepare(m.weight, "int8", rotation=64)
    # The rotation is undone exactly enough that the weight reads back as int8 per row would.
    assert quantize.sqnr_db(m.weight, compute8.dequantize(w, torch.float32)) > 35
    assert quantize.sqnr_db(ref, rot) > quantize.sqnr_db(ref, plain) + 6


@pytest.mark.parametrize(("mode", "rotation"), [("fp8", 0), ("int8", 0), ("int8", 64)])
@pytest.mark.parametrize("grad_compute", [None, "bf16", "mode"])
def test_backward_is_the_input_gradient_formula(mode, rotation, grad_compute):
    grad_compute = mode if grad_compute == "mode" else grad_compute
    model = nn.Sequential(_linear(128, 64, seed=1), nn.GELU(), _linear(64, 32, seed=2))
    model[0].bias.requires_grad_(True)
    model[2].bias.requires_grad_(False)
    stats = compute8.Stats()
    names = compute8.to_w8a8_resident(
        model, mode, rotation=rotation, grad_compute=grad_compute, stats=stats
    )
    assert names == ["0", "2"]
    x = torch.randn(3, 7, 128, requires_grad=True)
    h = model[0](x)
    h.retain_grad()
    a = model[1](h)
    a.retain_grad()
    y = model[2](a)
    gy = torch.randn_like(y)
    y.backward(gy)
    w0, w2 = model[0].w8a8, model[2].w8a8
    gc = grad_compute or "bf16"

    def formula(g, w):
        g2 = g.reshape(-1, g.shape[-1])
        if gc == "bf16":
            wr = (
                (w.data.float() * w.scale[:, None])
                if w.rotation
                else compute8.dequantize(w, g.dtype)
            )
            out = g2 @ wr
        else:
            qg, sg = compute8.quantize_rows_reference(g2, mode, w.scale)
            out = compute8.gemm_reference(qg, sg, w.data.t(), None, None, torch.float32, mode)
        if w.rotation:
            out = compute8.rotate(out, w.rotation)
        return out.reshape(*g.shape[:-1], -1)

    assert torch.equal(a.grad, formula(gy, w2))
    assert torch.equal(x.grad, formula(h.grad, w0))
    assert torch.equal(model[0].bias.grad, h.grad.reshape(-1, 64).sum(0))
    eight = 2 + (2 if gc != "bf16" else 0)
    assert stats.as_dict() == {"gemm8": eight, "fallbacks": {}}
