"""Quality of 8-bit compute (``weightstream.torch.compute8``), per layer: the signal to noise ratio
in dB of each mode's output and input gradient against the exact (float64-accumulated, on the GPU
float32 without TF32) product of the same bf16 operands, at FLUX.2-dev's and FLUX.1's GEMM shapes,
with activations that have realistic outlier channels (a few channels 20-100 × the rest, as
diffusion transformers' residual streams do) and weights with heavy tails.

Modes: the bf16 layer itself (its output rounded to bf16), today's streamed 8-bit layer
(``fp8_e4m3_block64`` weights dequantized, bf16 matmul: weight-only), fp8 and int8 W8A8, and
each with a block-Hadamard rotation. The gradient dY is gaussian with a few loud rows.

    python3 tests/bench/compute8_quality.py --out $OUT                      # GPU, FLUX shapes
    python3 tests/bench/compute8_quality.py --device cpu --small --out DIR  # CPU, 1/8 widths
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from tests.bench.provenance import commit

#: (out, in, what) of each model's streamed linears, and its tokens per sample at 1024².
MODELS = {
    "flux2": {
        "tokens": 4608,
        "shapes": [
            (18432, 6144, "double qkv"),
            (6144, 6144, "attention out"),
            (36864, 6144, "mlp in"),
            (6144, 18432, "mlp out"),
            (55296, 6144, "single qkv + mlp in"),
            (6144, 24576, "single out"),
        ],
    },
    "flux1": {
        "tokens": 4608,
        "shapes": [
            (9216, 3072, "double qkv"),
            (3072, 3072, "attention out"),
            (12288, 3072, "mlp in"),
            (3072, 12288, "mlp out"),
            (21504, 3072, "single qkv + mlp in"),
            (3072, 15360, "single out"),
        ],
    },
}
MODES = ["bf16", "fp8 weight-only", "fp8", "fp8+rot", "int8", "int8+rot"]


def activations(m: int, k: int, g, device):
    """Gaussian tokens with 8 outlier channels at 20-100 × and a per-token spread of 4 ×."""
    import torch

    x = torch.randn(m, k, generator=g, device=device)
    idx = torch.randperm(k, generator=g, device=device)[:8]
    x[:, idx] *= torch.linspace(20, 100, 8, device=device)
    x *= torch.rand(m, 1, generator=g, device=device) * 3 + 1
    return x.to(torch.bfloat16)


def weights(n: int, k: int, g, device):
    """Student-t(4)-like tails: gaussian over the root of a chi-square of 4 degrees."""
    import torch

    z = torch.randn(n, k, generator=g, device=device)
    chi = torch.randn(4, n, k, generator=g, device=device).pow(2).sum(0) / 4
    return (z / chi.sqrt() * 0.02).to(torch.bfloat16)


def output_grads(m: int, n: int, g, device):
    import torch

    gy = torch.randn(m, n, generator=g, device=device)
    gy[torch.randperm(m, generator=g, device=device)[: m // 64]] *= 30
    return gy.to(torch.bfloat16)


def sqnr(ref, got) -> float:
    import torch

    ref, got = ref.double(), got.double()
    noise = (ref - got).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / noise)) if float(noise) else float("inf")


def run_shape(n, k, m, rotation, g, device) -> dict:
    import torch
    import torch.nn.functional as F
    from weightstream import quantize
    from weightstream.torch import compute8

    x, w, gy = activations(m, k, g, device), weights(n, k, g, device), output_grads(m, n, g, device)
    exact_dtype = torch.float64 if device == "cpu" else torch.float32
    y_ref = F.linear(x.to(exact_dtype), w.to(exact_dtype))
    gx_ref = gy.to(exact_dtype) @ w.to(exact_dtype)
    out = {"forward": {}, "input_grad": {}}
    out["forward"]["bf16"] = sqnr(y_ref, F.linear(x, w))
    out["input_grad"]["bf16"] = sqnr(gx_ref, gy @ w)
    wo = quantize.w_hat(w)
    out["forward"]["fp8 weight-only"] = sqnr(y_ref, F.linear(x, wo))
    out["input_grad"]["fp8 weight-only"] = sqnr(gx_ref, gy @ wo)
    del wo
    for mode in compute8.MODES:
        for rot in (0, rotation):
            name = mode + ("+rot" if rot else "")
            w8 = compute8.prepare(w, mode, rotation=rot)
            out["forward"][name] = sqnr(y_ref, compute8.forward(x, w8, None, torch.bfloat16))
            gx = compute8.input_grad(gy, w8, mode, torch.bfloat16)
            out["input_grad"][name] = sqnr(gx_ref, gx)
            out.setdefault("weight", {})[name] = sqnr(w, compute8.dequantize(w8, torch.float32))
            del w8, gx
    return {a: {b: round(c, 2) for b, c in d.items()} for a, d in out.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-compute8-quality"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="flux2,flux1")
    parser.add_argument("--small", action="store_true", help="widths / 8, 512 tokens (CPU)")
    parser.add_argument("--rotation", type=int, default=128)
    args = parser.parse_args()
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    div = 8 if args.small else 1
    rows = []
    for model in args.models.split(","):
        spec = MODELS[model]
        m = spec["tokens"] if not args.small else 512
        for n, k, what in spec["shapes"]:
            g = torch.Generator(device=args.device).manual_seed(n * 7 + k)
            r = run_shape(n // div, k // div, m, args.rotation, g, args.device)
            rows.append({"model": model, "shape": [n // div, k // div], "what": what, **r})
            print(json.dumps(rows[-1]), flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    result = {
        "command": "python3 " + " ".join(sys.argv),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "device": device,
        "rotation": args.rotation,
        "tokens": rows and (512 if args.small else MODELS["flux2"]["tokens"]),
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compute8_quality.json").write_text(json.dumps(result, indent=2))
    (out / "compute8_quality.md").write_text(markdown(result))


def markdown(r: dict) -> str:
    lines = [
        "# 8-bit compute: per-layer SQNR (dB) against the exact product of the bf16 operands",
        "",
        f"`{r['command']}` at {r['commit']} on {r['device']}, {r['date']}; {r['tokens']} tokens;"
        f" rotation block {r['rotation']}. Activations: 8 outlier channels at 20-100 ×;",
        "weights: heavy-tailed; dY: 1/64 of the rows 30 × louder. Higher is better; each 6 dB",
        "is one bit.",
        "",
    ]
    for part, title in (("forward", "Forward output"), ("input_grad", "Input gradient dY·W")):
        lines += [f"## {title}", "", "| model | shape | " + " | ".join(MODES) + " |"]
        lines += ["|---|---|" + "---|" * len(MODES)]
        for row in r["rows"]:
            cells = [str(row[part].get(mo, "")) for mo in MODES]
            lines.append(
                f"| {row['model']} | {row['shape']} {row['what']} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
