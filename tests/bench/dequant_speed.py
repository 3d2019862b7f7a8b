"""Benchmark (GPU machine): the fused dequantization (``weightstream._fused_dequant``) on
FLUX.1's weight shapes against the torch path it replaces: device time per call (CUDA events over
``--reps`` calls), the memory rate it reaches (3 bytes per element: fp8 read, bf16 written),
whether the two are equal bit for bit, and what one call costs the trainer's CPU (a small tensor,
``--calls`` launches without synchronising).

    python3 -m tests.bench.dequant_speed --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

from tests.bench.provenance import command, commit

#: FLUX.1's streamed weight shapes (out, in), and how many of each one step dequantizes
#: (19 double blocks, 38 single ones).
SHAPES = {
    (3072, 3072): "attention q/k/v/out, double and single",
    (18432, 3072): "double block's norm (6 x 3072)",
    (9216, 3072): "single block's norm (3 x 3072)",
    (12288, 3072): "feed-forward in, proj_mlp",
    (3072, 12288): "feed-forward out",
    (3072, 15360): "single block's proj_out",
}


@contextlib.contextmanager
def torch_path():
    """Meanwhile ``quantize.dequantize`` runs torch's three kernels
    (``WEIGHTSTREAM_FUSED_DEQUANT=0``), as where Triton is missing."""
    from weightstream import _fused_dequant

    os.environ["WEIGHTSTREAM_FUSED_DEQUANT"] = "0"
    _fused_dequant._kernel.cache_clear()
    try:
        yield
    finally:
        del os.environ["WEIGHTSTREAM_FUSED_DEQUANT"]
        _fused_dequant._kernel.cache_clear()


def device_us(fn, reps: int) -> float:
    import torch

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-dequant"))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    import torch
    from weightstream import _fused_dequant, quantize

    torch.manual_seed(0)
    rows = []
    for shape, what in SHAPES.items():
        w = (torch.randn(shape, device="cuda") * 0.02).to(torch.bfloat16)
        q, scale = quantize.quantize_fp8_block64(w)
        assert _fused_dequant.applies(q, scale, torch.bfloat16), "the fused kernel does not apply"
        fused = device_us(lambda q=q, s=scale: quantize.dequantize(q, s, torch.bfloat16), args.reps)
        with torch_path():
            plain = device_us(
                lambda q=q, s=scale: quantize.dequantize(q, s, torch.bfloat16), args.reps
            )
            want = quantize.dequantize(q, scale, torch.bfloat16)
        got = quantize.dequantize(q, scale, torch.bfloat16)
        rows.append(
            {
                "shape": list(shape),
                "what": what,
                "fused_us": round(fused, 1),
                "torch_us": round(plain, 1),
                "fused_gb_s": round(3 * q.numel() / fused / 1e3, 1),
                "equal": torch.equal(got.view(torch.int16), want.view(torch.int16)),
            }
        )
        print(rows[-1], flush=True)
    q, scale = quantize.quantize_fp8_block64(torch.randn(64, 64, device="cuda"))
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.calls):
        quantize.dequantize(q, scale, torch.bfloat16)
    issued = (time.perf_counter() - t) / args.calls * 1e6
    torch.cuda.synchronize()
    result = {
        "command": command(),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0),
        "shapes": rows,
        "cpu_us_per_call": round(issued, 1),
        "all_equal": all(r["equal"] for r in rows),
        "median_fused_gb_s": statistics.median(r["fused_gb_s"] for r in rows),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dequant_speed.json").write_text(json.dumps(result, indent=2))
    lines = [
        "| shape | what | fused µs | torch µs | fused GB/s | equal |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape'][0]}×{r['shape'][1]} | {r['what']} | {r['fused_us']} | "
            f"{r['torch_us']} | {r['fused_gb_s']} | {r['equal']} |"
        )
    lines.append(f"\nCPU per call (launch): {result['cpu_us_per_call']} µs")
    (out / "dequant_speed.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(result), flush=True)
    return 0 if result["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
