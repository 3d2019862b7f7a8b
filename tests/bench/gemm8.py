"""Benchmark (GPU machine): 8-bit matmuls (``weightstream.torch.compute8``) at FLUX.2-dev's GEMM
shapes (4608 tokens), each against bf16 cuBLAS in the same call: bf16 ``F.linear``,
dequantize-then-bf16 (today's streamed 8-bit layer: ``fp8_e4m3_block64`` dequantized by the
fused kernel, then ``F.linear``), fp8 ``_scaled_mm`` and int8 ``_int_mm`` alone (activations
quantized beforehand) and as the layer (activation quantization counted: the fused kernel,
and torch's ops for comparison), int8 with a block-Hadamard rotation, and the input gradient
dY·W of each. Device time per call from CUDA events, the median of ``--reps`` calls after a
warm-up. Before the timings, checks on the GPU: the fused quantizer and epilogue equal the
torch formulas bit for bit, the int8 layer equals the CPU reference bit for bit, the layer's
forward and backward through autograd equal ``to_w8a8_resident``'s and run twice alike.

    python3 tests/bench/gemm8.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from tests.bench.provenance import commit

#: FLUX.2-dev's streamed linear shapes (out, in): hidden 6144, mlp 18432 (SwiGLU: gate and up
#: in one weight), single blocks fusing qkv with mlp-in and attention-out with mlp-out.
SHAPES = {
    (18432, 6144): "double block qkv",
    (6144, 6144): "attention out",
    (36864, 6144): "mlp in (gate + up)",
    (6144, 18432): "mlp out",
    (55296, 6144): "single block qkv + mlp in",
    (6144, 24576): "single block out",
}
TOKENS = 4608


def median_us(fn, reps: int) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)


def checks() -> dict:
    """Bit-equality checks of the GPU path (see the module doc)."""
    import torch
    from torch import nn
    from weightstream import _quant8
    from weightstream.torch import compute8

    g = torch.Generator(device="cuda").manual_seed(0)
    out = {"triton_kernels": _quant8.available()}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(300, 6144 + 40, device="cuda", generator=g)
        x[:, 7] *= 80
        x[3] = 0
        x = x.to(dtype)
        cs = torch.rand(x.shape[1], device="cuda", generator=g) + 0.5
        for mode in compute8.MODES:
            for col in (None, cs):
                q, s = compute8.quantize_rows(x, mode, col)
                rq, rs = compute8.quantize_rows_reference(x, mode, col)
                same = torch.equal(q.view(torch.int8), rq.view(torch.int8)) and torch.equal(s, rs)
                key = (
                    f"quantize_rows {str(dtype)[6:]} {mode}{' colscale' if col is not None else ''}"
                )
                out[key] = same
    acc = torch.randint(-(2**30), 2**30, (257, 3000), device="cuda", dtype=torch.int32)
    sa, sb = torch.rand(257, device="cuda"), torch.rand(3000, device="cuda")
    bias = torch.randn(3000, device="cuda").to(torch.bfloat16)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        y = compute8.scale_int32(acc, sa, sb, bias, dt)
        out[f"scale_int32 {str(dt)[6:]}"] = torch.equal(
            y, compute8._scale_int32_reference(acc, sa, sb, bias, dt)
        )
    # int8 is exact: the GPU's layer equals the CPU reference bit for bit.
    torch.manual_seed(1)
    lin = nn.Linear(3072, 1024).to(torch.bfloat16)
    xc = torch.randn(4, 77, 3072).to(torch.bfloat16)
    w = compute8.prepare(lin.weight, "int8")
    cpu = compute8.linear(xc, w, lin.bias)
    wg = compute8.W8Weight(w.data.cuda(), w.scale.cuda(), "int8")
    gpu = compute8.linear(xc.cuda(), wg, lin.bias.cuda())
    out["int8 layer gpu == cpu reference"] = torch.equal(gpu.cpu(), cpu)
    gy = torch.randn(4, 77, 1024).to(torch.bfloat16)
    gc = compute8.input_grad(gy, w, "int8", torch.bfloat16)
    gg = compute8.input_grad(gy.cuda(), wg, "int8", torch.bfloat16)
    out["int8 input grad gpu == cpu reference"] = torch.equal(gg.cpu(), gc)
    # fp8: the GPU's kernel sums in its own order; how far from the CPU's exact sum.
    wf = compute8.prepare(lin.weight, "fp8")
    cpu = compute8.linear(xc, wf, lin.bias)
    wfg = compute8.W8Weight(wf.data.cuda(), wf.scale.cuda(), "fp8")
    gpu = compute8.linear(xc.cuda(), wfg, lin.bias.cuda()).cpu()
    diff = (gpu.float() - cpu.float()).abs()
    out["fp8 layer gpu vs cpu reference: elements differing"] = int((diff > 0).sum())
    out["fp8 layer gpu vs cpu reference: max abs diff"] = float(diff.max())
    out["fp8 layer gpu vs cpu reference: max abs output"] = float(cpu.float().abs().max())
    # Autograd on the GPU: two runs alike, and the layer equals the formula's functions.
    for mode, rot in (("fp8", 0), ("int8", 0), ("int8", 128)):
        runs = []
        for _ in range(2):
            torch.manual_seed(2)
            model = nn.Sequential(nn.Linear(3072, 6144), nn.GELU(), nn.Linear(6144, 3072))
            model = model.cuda().to(torch.bfloat16).requires_grad_(False)
            stats = compute8.Stats()
            compute8.to_w8a8_resident(model, mode, rotation=rot, stats=stats)
            x = torch.randn(2, 600, 3072, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            y = model(x)
            y.backward(torch.ones_like(y))
            runs.append((y.detach(), x.grad, stats.as_dict()))
        (y0, g0, s0), (y1, g1, _) = runs
        w2 = model[2].w8a8
        h = model[1](model[0](x.detach()))
        key = f"autograd {mode}{' rot' + str(rot) if rot else ''}"
        out[f"{key}: forward equals compute8.forward"] = torch.equal(
            y0, compute8.forward(h, w2, model[2].bias, torch.bfloat16)
        )
        out[f"{key}: two runs equal"] = torch.equal(y0, y1) and torch.equal(g0, g1)
        out[f"{key}: stats"] = s0
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-gemm8"))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--rotation", type=int, default=128)
    args = parser.parse_args()
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    result = {
        "command": "python3 " + " ".join(sys.argv),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "tokens": args.tokens,
        "checks": checks(),
    }
    print(json.dumps(result["checks"], indent=1), flush=True)
    rows = []
    for (n, k), what in SHAPES.items():
        rows.append(time_shape(n, k, what, args.tokens, args.reps, args.rotation))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    result["shapes"] = rows
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compute8_gemm.json").write_text(json.dumps(result, indent=2))
    (out / "compute8_gemm.md").write_text(markdown(result))


def time_shape(n: int, k: int, what: str, m: int, reps: int, rotation: int) -> dict:
    """Device µs per call of each variant at one shape (the module doc's list)."""
    import torch
    import torch.nn.functional as F
    from weightstream import quantize
    from weightstream.torch import compute8

    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    q64, s64 = quantize.quantize_fp8_block64(w)
    t = {}
    t["bf16"] = median_us(lambda: F.linear(x, w), reps)
    t["dequant_bf16"] = median_us(
        lambda: F.linear(x, quantize.dequantize(q64, s64, torch.bfloat16)), reps
    )
    t["dgrad_bf16"] = median_us(lambda: gy @ w, reps)
    for mode in compute8.MODES:
        t.update(time_mode(x, gy, compute8.prepare(w, mode), reps))
    wr = compute8.prepare(w, "int8", rotation=rotation)
    t["layer_int8_rot"] = median_us(lambda: compute8.forward(x, wr, None, torch.bfloat16), reps)
    dr = wr.data.t().contiguous()
    t["dgrad_int8_rot"] = median_us(
        lambda: compute8.input_grad(gy, wr, "int8", torch.bfloat16, data_t=dr), reps
    )
    flops = 2 * m * n * k
    row = {"shape": [n, k], "what": what, "us": {a: round(b, 1) for a, b in t.items()}}
    row["tflops"] = {a: round(flops / b / 1e6, 1) for a, b in t.items() if "quant_" not in a}
    fwd, bwd = t["bf16"], t["dgrad_bf16"]
    row["x_bf16"] = {
        a: round(fwd / b if not a.startswith("dgrad") else bwd / b, 2)
        for a, b in t.items()
        if "quant_" not in a
    }
    return row


def time_mode(x, gy, w8, reps: int) -> dict:
    """The variants of one 8-bit mode at one shape."""
    import torch
    from weightstream.torch import compute8

    mode, t = w8.mode, {}
    qx, sx = compute8.quantize_rows(x, mode)
    t[f"quant_{mode}"] = median_us(lambda: compute8.quantize_rows(x, mode), reps)
    t[f"quant_{mode}_torch"] = median_us(lambda: compute8.quantize_rows_reference(x, mode), reps)
    bt = w8.data.t()
    if mode == "fp8":
        sxx, sww = sx.reshape(-1, 1), w8.scale.reshape(1, -1)
        for fast in (False, True):
            t["gemm_fp8" + ("_fast_accum" if fast else "")] = median_us(
                lambda fast=fast: torch._scaled_mm(
                    qx,
                    bt,
                    scale_a=sxx,
                    scale_b=sww,
                    out_dtype=torch.bfloat16,
                    use_fast_accum=fast,
                ),
                reps,
            )
    else:
        t["gemm_int8"] = median_us(lambda: torch._int_mm(qx, bt), reps)
        t["gemm_int8_epilogue"] = median_us(
            lambda: compute8.gemm(qx, sx, w8.data, w8.scale, None, torch.bfloat16, mode), reps
        )
    t[f"layer_{mode}"] = median_us(lambda: compute8.forward(x, w8, None, torch.bfloat16), reps)

    def torch_quant_layer():
        q, s = compute8.quantize_rows_reference(x, mode)
        return compute8.gemm(q, s, w8.data, w8.scale, None, torch.bfloat16, mode)

    t[f"layer_{mode}_torch_quant"] = median_us(torch_quant_layer, reps)
    data_t = w8.data.t().contiguous()
    t[f"dgrad_{mode}"] = median_us(
        lambda: compute8.input_grad(gy, w8, mode, torch.bfloat16, data_t=data_t), reps
    )
    t[f"dgrad_{mode}_transposing"] = median_us(
        lambda: compute8.input_grad(gy, w8, mode, torch.bfloat16), reps
    )
    return t


COLUMNS = [
    ("bf16", "bf16"),
    ("dequant_bf16", "dequant→bf16"),
    ("gemm_fp8", "fp8 mm"),
    ("layer_fp8", "fp8 layer"),
    ("layer_fp8_torch_quant", "fp8 layer, torch quant"),
    ("gemm_int8", "int8 mm"),
    ("gemm_int8_epilogue", "int8 mm+epilogue"),
    ("layer_int8", "int8 layer"),
    ("layer_int8_rot", "int8+rot layer"),
]
DGRAD = [
    ("dgrad_bf16", "bf16"),
    ("dgrad_fp8", "fp8"),
    ("dgrad_fp8_transposing", "fp8, W transposed per call"),
    ("dgrad_int8", "int8"),
    ("dgrad_int8_transposing", "int8, W transposed per call"),
    ("dgrad_int8_rot", "int8+rot"),
]


def _cell(s: dict, k: str) -> str:
    """µs (TFLOP/s); the dequantization has no TFLOP/s of its own (it is not a matmul)."""
    tflops = s["tflops"].get(k)
    return f"{s['us'][k]}" + (f" ({tflops})" if tflops is not None else "")


def _x_bf16(s: dict, k: str) -> float:
    """The bf16 matmul's time over this column's (the JSON has no ratio for the dequantization)."""
    return s["x_bf16"].get(k) or round(s["us"]["bf16"] / s["us"][k], 2)


def markdown(r: dict) -> str:
    lines = [
        f"# 8-bit GEMMs at FLUX.2-dev's shapes, {r['tokens']} tokens",
        "",
        f"`{r['command']}` at {r['commit']} on {r['device']} (torch {r['torch']}), {r['date']}.",
        'Device µs per call (median), TFLOP/s in brackets; "layer" counts the activations\'',
        'quantization (the fused Triton kernel; "torch quant": torch\'s ops).',
        "",
        "## Forward (y = x·Wᵀ)",
        "",
        "| shape (out, in) | " + " | ".join(c for _, c in COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for s in r["shapes"]:
        cells = [_cell(s, k) for k, _ in COLUMNS]
        lines.append(f"| {s['shape']} {s['what']} | " + " | ".join(cells) + " |")
    lines += ["", "Speed-up over bf16 (same shape):", ""]
    lines += ["| shape | " + " | ".join(c for _, c in COLUMNS[1:]) + " |"]
    lines += ["|---|" + "---|" * (len(COLUMNS) - 1)]
    for s in r["shapes"]:
        lines.append(
            f"| {s['shape']} | " + " | ".join(f"{_x_bf16(s, k)}×" for k, _ in COLUMNS[1:]) + " |"
        )
    lines += [
        "",
        "## Input gradient (dX = dY·W), dY quantized per row with W's scales folded in",
        "",
        "| shape (out, in) | " + " | ".join(c for _, c in DGRAD) + " |",
        "|---|" + "---|" * len(DGRAD),
    ]
    for s in r["shapes"]:
        cells = [f"{s['us'][k]} ({s['x_bf16'].get(k, '–')}×)" for k, _ in DGRAD]
        lines.append(f"| {s['shape']} | " + " | ".join(cells) + " |")
    lines += ["", "## Activation quantization alone (µs)", ""]
    lines += [
        "| shape | fp8 fused | fp8 torch | int8 fused | int8 torch |",
        "|---|---|---|---|---|",
    ]
    for s in r["shapes"]:
        u = s["us"]
        lines.append(
            f"| {s['shape']} | {u['quant_fp8']} | {u['quant_fp8_torch']} | {u['quant_int8']} | "
            f"{u['quant_int8_torch']} |"
        )
    lines += ["", "## Checks on the GPU", ""]
    lines += [f"- {k}: {v}" for k, v in r["checks"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
