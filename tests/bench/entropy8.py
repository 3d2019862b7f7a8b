"""Benchmark (CPU): how far lossless entropy coding could shrink the daemon's 8-bit weights
(issue #50's compression: "≥ 30 % fewer bytes per step on FLUX.2 8-bit"). An order-0 entropy
coder with a table per chunk (nvCOMP's ANS codes each chunk with its own frequency table) can
at best code a chunk's bytes in their order-0 entropy; the scales stay as they are. Per format
the weightstream quantizers make (``fp8_e4m3_block64``, the default; the per-row fp8 and int8
of 8-bit compute), the bench reports the codes' entropy in bits a code (over the whole tensor
and per chunk), the bound it sets on the bytes saved (codes at their per-chunk entropy, scales
stored as they are, 2 bytes of table per symbol a chunk uses), and what ``zlib`` at level 9
(Deflate: LZ77 and Huffman, on the CPU) actually saves per chunk, as a check on the bound.

Weights: seeded random ones of a FLUX-sized linear [3072, 12288] (FLUX.1's MLP), Gaussian
(std 0.02) and Student-t with 4 and 3 degrees of freedom (heavier tails, as trained weights
have: their per-row absmax sits further from the bulk), or the 2-D floating tensors of
``--safetensors`` files (real weights, where a machine has them):

    python3 -m tests.bench.entropy8 --out $OUT [--safetensors FILE ...]

Results: $OUT/entropy8.json and entropy8.md, with the command and the commit.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import zlib
from pathlib import Path

from tests.bench.provenance import command, commit, write_report

#: nvCOMP's batched APIs' default chunk (64 KiB).
CHUNK = 64 << 10
#: A chunk's table: two bytes for each symbol it uses (a frequency of 16 bits).
TABLE_BYTES_PER_SYMBOL = 2
SHAPE = (3072, 12288)


def entropy_bits(codes) -> float:
    """Order-0 entropy of a uint8 tensor, bits a byte."""
    import torch

    counts = torch.bincount(codes.reshape(-1).long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float((p * p.reciprocal().log2()).sum())


def chunk_bound(codes, chunk: int = CHUNK) -> int:
    """Bytes an order-0 coder with a table per chunk needs at best: each chunk's entropy times
    its length, plus its table."""
    import torch

    flat = codes.reshape(-1)
    total = 0.0
    for at in range(0, flat.numel(), chunk):
        part = flat[at : at + chunk]
        counts = torch.bincount(part.long(), minlength=256)
        used = int((counts > 0).sum())
        total += entropy_bits(part) * part.numel() / 8 + TABLE_BYTES_PER_SYMBOL * used
    return math.ceil(total)


def zlib_bytes(codes, chunk: int = CHUNK) -> int:
    """``zlib`` level 9 of each chunk, summed (a real coder's bytes, on the CPU)."""
    raw = codes.reshape(-1).numpy().tobytes()
    return sum(len(zlib.compress(raw[at : at + chunk], 9)) for at in range(0, len(raw), chunk))


def formats(w) -> dict:
    """``w`` [out, in] in each 8-bit format: name -> (codes as uint8, scale bytes)."""
    import torch
    from weightstream import quantize
    from weightstream.torch import compute8

    out = {}
    q, scale = quantize.quantize_fp8_block64(w)
    out["fp8_e4m3_block64"] = (q.view(torch.uint8), scale.numel() * 4)
    for mode in ("fp8", "int8"):
        prepared = compute8.prepare(w, mode)
        out[f"{mode}_row"] = (prepared.data.view(torch.uint8), prepared.scale.numel() * 4)
    return out


def measure(name: str, w) -> list[dict]:
    rows = []
    for fmt, (codes, scale_bytes) in formats(w).items():
        stored = codes.numel() + scale_bytes
        bound = chunk_bound(codes) + scale_bytes
        deflated = zlib_bytes(codes) + scale_bytes
        rows.append(
            {
                "weights": name,
                "format": fmt,
                "bytes": stored,
                "bits_per_code": entropy_bits(codes),
                "bound_bytes": bound,
                "bound_saved": 1 - bound / stored,
                "zlib_bytes": deflated,
                "zlib_saved": 1 - deflated / stored,
            }
        )
    return rows


def synthetic(seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(SHAPE, generator=g) * 0.02
    out = {"normal, std 0.02": normal}
    for df in (4, 3):
        torch.manual_seed(seed + df)  # torch.distributions draws from the global generator
        t = torch.distributions.StudentT(float(df)).sample(SHAPE)
        out[f"Student-t, {df} degrees of freedom"] = t * 0.02
    return out


def from_files(paths: list[str]) -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in paths:
        for name, t in load_file(path).items():
            if t.dim() == 2 and t.is_floating_point() and min(t.shape) >= 64:
                out[f"{Path(path).name}:{name}"] = t.float()
    return out


def weights(paths: list[str]) -> dict:
    """The 2-D tensors of the safetensors files ``paths``, else the seeded random ones."""
    return from_files(paths) if paths else synthetic()


def markdown(report: dict) -> str:
    lines = [
        "# How far lossless coding could shrink the 8-bit formats (CPU)",
        "",
        f"- command: `{report['command']}`",
        f"- commit: {report['commit']}",
        f"- chunks of {CHUNK >> 10} KiB, each with its own table ({TABLE_BYTES_PER_SYMBOL} "
        "bytes a symbol used); scales stored as they are",
        "",
        "| weights | format | bits a code | order-0 bound: saved | zlib -9: saved |",
        "|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['weights']} | {r['format']} | {r['bits_per_code']:.3f} | "
            f"{100 * r['bound_saved']:.1f} % | {100 * r['zlib_saved']:.1f} % |"
        )
    return "\n".join(lines) + "\n"


def parser(name: str) -> argparse.ArgumentParser:
    """The arguments of this bench and of those that measure its weights: ``--out`` (``$OUT``
    by default) and ``--safetensors`` (``weights``)."""
    p = argparse.ArgumentParser(prog=f"python3 -m tests.bench.{name}")
    p.add_argument("--out", default=os.environ.get("OUT", f"/tmp/ws-{name}"))
    p.add_argument("--safetensors", nargs="*", default=[], help="real weights' files")
    return p


def main(argv=None) -> int:
    p = parser("entropy8")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    rows = [row for name, w in weights(args.safetensors).items() for row in measure(name, w)]
    report = {"command": command(), "commit": commit(), "rows": rows}
    write_report(args.out, "entropy8", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
