"""Benchmark (CPU): what the daemon's lossless coding (``coding="rans8"``) saves on 8-bit
weights, through the daemon itself: a host-backend daemon loads each weight from a safetensors
file quantized to each 8-bit format the daemon makes (``fp8_e4m3_block64``, the per-row fp8
and int8 of 8-bit compute), once as it is and once coded; the manifests give the bytes held
(what a session copies for the tensor: its ``stored_nbytes``) against the bytes decoded, and
the load's coding time (``phases.code_ns``) the encoder's rate on this machine's cores.

Weights: ``entropy8.py``'s seeded random ones (a FLUX-sized linear [3072, 12288]; Gaussian,
std 0.02, and Student-t with 4 and 3 degrees of freedom: heavier tails, as trained weights
have), or the 2-D floating tensors of ``--safetensors`` files:

    python3 -m tests.bench.coding_cpu --bin target/release/weightstream --out $OUT

Results: $OUT/coding_cpu.json and coding_cpu.md, with the command and the commit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from tests.bench import entropy8
from tests.bench.provenance import command, commit, write_report

FORMATS = ("fp8_e4m3_block64", "fp8_e4m3_row", "int8_row")


def measure(client, path: str, fmt: str) -> dict:
    plain = client.load_model([path], quantize=fmt, retention="connection")
    coded = client.load_model([path], quantize=fmt, retention="connection", coding="rans8")
    (p,) = plain.tensors
    (c,) = coded.tensors
    held = c.stored_nbytes or c.nbytes
    return {
        "format": fmt,
        "bytes": p.nbytes,
        "coded_bytes": held,
        "coded": c.coding,
        "lanes": c.coded_lanes,
        "saved": round(1 - held / p.nbytes, 4),
        "code_s": coded.phases.code_ns / 1e9,
        "encode_mb_s": round(p.nbytes / max(coded.phases.code_ns, 1) * 1e3, 1),
    }


def markdown(report: dict) -> str:
    lines = [
        "# What the daemon's coding (rans8) saves on 8-bit weights",
        "",
        f"- command: `{report['command']}`",
        f"- commit: {report['commit']}; {report['cores']} CPU cores, host backend",
        "- saved: the bytes a session copies for the weight (its coded blob: table, states, "
        "offsets, words; data and scales coded together) against the bytes it decodes to",
        "",
        "| weights | format | bytes | held coded | saved | lanes | coding | encode |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['weights']} | {r['format']} | {r['bytes']:,} | {r['coded_bytes']:,} | "
            f"{100 * r['saved']:.1f} % | {r['lanes']} | {r['coded']} | "
            f"{r['code_s']:.3f} s ({r['encode_mb_s']} MB/s) |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", default="target/release/weightstream")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-coding"))
    parser.add_argument("--safetensors", nargs="*", default=[])
    args = parser.parse_args(argv)

    from safetensors.torch import save_file

    from tests.daemon import Daemon

    rows = []
    with tempfile.TemporaryDirectory(prefix="ws-coding-") as tmp:
        daemon = Daemon(tmp, binary=args.bin)
        try:
            for i, (name, w) in enumerate(entropy8.weights(args.safetensors).items()):
                path = str(Path(tmp) / f"w{i}.safetensors")
                save_file({"l.weight": w.bfloat16().contiguous()}, path)
                for fmt in FORMATS:
                    rows.append({"weights": name, **measure(daemon.client, path, fmt)})
                    print(rows[-1], flush=True)
                    for m in daemon.client.list_models().models:
                        daemon.client.release_model(m.model_id)
        finally:
            daemon.stop()
    report = {
        "command": command(),
        "commit": commit(),
        "cores": os.cpu_count(),
        "rows": rows,
    }
    write_report(args.out, "coding_cpu", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
