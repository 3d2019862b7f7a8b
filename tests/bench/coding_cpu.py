"""Benchmark (CPU): what the daemon's lossless coding (``coding="rans8"``) saves on 8-bit and
4-bit weights, through the daemon itself, on a host-backend daemon.

8-bit: the daemon loads each weight from a safetensors file quantized to each 8-bit format it
makes (``fp8_e4m3_block64``, the per-row fp8 and int8 of 8-bit compute), once as it is and once
coded; the manifests give the bytes held (what a session copies for the tensor: its
``stored_nbytes``) against the bytes decoded, and the load's coding time (``phases.code_ns``)
the encoder's rate on this machine's cores.

4-bit: each weight packed by the real quantizers where they are installed: bitsandbytes' NF4
and FP4 (``bitsandbytes.functional.quantize_4bit``, block 64, on the CPU) and ai-toolkit's
``uint4`` and ``nvfp4`` (from ``--aitk``, imported as ``aitk_packed_real.py`` imports it: its
``get_ostris_quantizer`` and ``convert_linear_to_ostris``, what its ``quantize_model`` runs on
each Linear for these qtypes, without the optimum-quanto that ``quantize_model``'s module
imports; where ai-toolkit cannot run, the stand-ins of tests/python/torch/aitk_layouts.py,
named so in the rows). The layer's packed tensors, as the quantizer holds them (codes and
scales, each its own tensor), are uploaded (``upload_model``) once as they are and once coded;
a row per tensor and one for the layer (``all``). Not uploaded: bitsandbytes' ``quant_map``
(16 float32, the code book) and ai-toolkit's ``nv4_pts`` (one float32). The daemon codes only
one-byte tensors of 1 MiB or more, and only where that saves at least 1/32 of their bytes: the
rows say why a tensor is not coded.

Peak memory: a fresh daemon's ``VmHWM`` (its heap and the shared memory it maps) once it has
stored one model of 8 FLUX-sized Gaussian layers, as it is and coded: loaded from a bf16 file
quantized to ``fp8_e4m3_block64`` (the load codes its arena in place), and uploaded as e4m3
weights (the upload is coded into a new arena).

Weights: ``entropy8.py``'s seeded random ones (a FLUX-sized linear [3072, 12288]; Gaussian,
std 0.02, and Student-t with 4 and 3 degrees of freedom: heavier tails, as trained weights
have), or the 2-D floating tensors of ``--safetensors`` files:

    python3 -m tests.bench.coding_cpu --bin target/release/weightstream --out $OUT [--aitk .aitk]

Results: $OUT/coding_cpu.json and coding_cpu.md, with the command and the commit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from tests.bench import entropy8
from tests.bench.aitk.measure import AITK_COMMIT
from tests.bench.provenance import command, commit, write_report

FORMATS = ("fp8_e4m3_block64", "fp8_e4m3_row", "int8_row")
#: The daemon's rules for what it codes (daemon/src/store/coding.rs).
MIN_CODED_BYTES = 1 << 20
MIN_SAVING = 32


def coding_of(t, dtype=None) -> str:
    """How the daemon holds manifest tensor ``t`` (uploaded as torch ``dtype``; None: one of
    one byte): its coding, or why it is not coded."""
    if t.coding != "none":
        return t.coding
    if t.nbytes < MIN_CODED_BYTES:
        return "not coded: under 1 MiB"
    if dtype is not None and dtype.itemsize != 1:
        return f"not coded: {str(dtype).removeprefix('torch.')}, not one byte"
    return f"not coded: saves under 1/{MIN_SAVING}"


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
        "coded": coding_of(c),
        "lanes": c.coded_lanes,
        "saved": round(1 - held / p.nbytes, 4),
        "code_s": coded.phases.code_ns / 1e9,
        "encode_mb_s": round(p.nbytes / max(coded.phases.code_ns, 1) * 1e3, 1),
    }


# --- 4-bit -----------------------------------------------------------------------------------


def bnb_formats(w) -> dict:
    """``w`` in bitsandbytes' NF4 and FP4 (block 64, on the CPU): name -> {tensor: uint8 or
    float32}; {} where bitsandbytes is not installed."""
    try:
        import bitsandbytes
        import bitsandbytes.functional as bnbf
    except ImportError:
        return {}
    out = {}
    for qt in ("nf4", "fp4"):
        data, state = bnbf.quantize_4bit(w.bfloat16(), quant_type=qt, blocksize=64)
        name = f"{qt} (bitsandbytes {bitsandbytes.__version__}, block 64)"
        out[name] = {"data": data, "absmax": state.absmax}
    return out


def load_aitk(aitk: str | None):
    """ai-toolkit's ``(get_ostris_quantizer, convert_linear_to_ostris)`` from ``aitk``, or None
    (with the reason printed) where it is not there or cannot be imported."""
    if not aitk or not (Path(aitk) / "toolkit" / "util" / "ostris_quant.py").is_file():
        print(f"ai-toolkit: no checkout at {aitk!r}: its stand-ins instead", flush=True)
        return None
    from tests.bench.aitk_packed_real import install_aitk

    try:
        install_aitk(Path(aitk))
        from toolkit.util.ostris_quant import convert_linear_to_ostris, get_ostris_quantizer
    except Exception as e:  # noqa: BLE001 - the stand-ins take its place, said so
        print(f"ai-toolkit: {type(e).__name__}: {e}: its stand-ins instead", flush=True)
        return None
    return get_ostris_quantizer, convert_linear_to_ostris


def aitk_formats(w, aitk) -> dict:
    """``w`` as ai-toolkit's ``uint4`` and ``nvfp4`` layers hold it (``aitk``: ``load_aitk``'s,
    or None for the stand-ins): name -> {buffer: uint8}, without ``nv4_pts``."""
    import torch

    def linear():
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        layer.weight = torch.nn.Parameter(w.bfloat16(), requires_grad=False)
        return layer

    out = {}
    for qtype in ("uint4", "nvfp4"):
        layer = None
        if aitk is not None:
            get_ostris_quantizer, convert_linear_to_ostris = aitk
            layer = linear()
            try:
                if not convert_linear_to_ostris(layer, get_ostris_quantizer(qtype)):
                    raise RuntimeError(f"it refuses a {list(w.shape)} Linear")
                name = f"{qtype} (ai-toolkit)"
            except Exception as e:  # noqa: BLE001 - the stand-in takes its place, said so
                print(f"ai-toolkit's {qtype}: {type(e).__name__}: {e}: its stand-in", flush=True)
                layer = None
        if layer is None:
            from tests.python.torch import aitk_layouts

            layer = linear()
            stand_in = aitk_layouts.UIntX(4) if qtype == "uint4" else aitk_layouts.Nvfp4()
            aitk_layouts.convert(layer, stand_in)
            name = f"{qtype} (stand-in: tests/python/torch/aitk_layouts.py)"
        out[name] = {n: b for n, b in layer._buffers.items() if n != "nv4_pts"}
    return out


def measure4(client, fmt: str, tensors: dict) -> list[dict]:
    """``tensors`` (a layer's, in 4-bit format ``fmt``) uploaded as they are and coded: a row
    per tensor, then one for them all (``all``: with the upload's coding time, and the coder's
    rate over the bytes it ran on: one-byte tensors of 1 MiB or more, its blob kept or not)."""
    up = {f"l.{n}": t.contiguous() for n, t in tensors.items()}
    plain, _ = client.upload_model("plain", up, retention="connection")
    coded, _ = client.upload_model("coded", up, retention="connection", coding="rans8")
    p_at = {t.name: t for t in plain.tensors}
    rows = []
    for c in coded.tensors:
        held = c.stored_nbytes or c.nbytes
        dtype = up[c.name].dtype
        rows.append(
            {
                "format": f"{fmt}: {c.name.removeprefix('l.')}",
                "dtype": str(dtype).removeprefix("torch."),
                "bytes": p_at[c.name].nbytes,
                "coded_bytes": held,
                "coded": coding_of(c, dtype),
                "lanes": c.coded_lanes,
                "saved": round(1 - held / p_at[c.name].nbytes, 4),
                "code_s": None,
                "encode_mb_s": None,
            }
        )
    total = sum(r["bytes"] for r in rows)
    held = sum(r["coded_bytes"] for r in rows)
    code_ns = coded.phases.code_ns
    n_coded = sum(r["coded"] == "rans8" for r in rows)
    # The bytes the coder ran on: those coded, and those it coded too little to keep.
    tried = sum(r["bytes"] for r in rows if r["coded"] == "rans8" or "1/" in r["coded"])
    rows.append(
        {
            "format": f"{fmt}: all",
            "dtype": None,
            "bytes": total,
            "coded_bytes": held,
            "coded": f"rans8: {n_coded} of {len(rows)} tensors",
            "lanes": sum(r["lanes"] for r in rows),
            "saved": round(1 - held / total, 4),
            "code_s": code_ns / 1e9,
            "encode_mb_s": round(tried / max(code_ns, 1) * 1e3, 1) if tried else None,
        }
    )
    return rows


def quantizers4(aitk, path: str | None) -> str:
    """The 4-bit quantizers that ran, for the report."""
    try:
        import bitsandbytes

        bnb = f"bitsandbytes {bitsandbytes.__version__}"
    except ImportError:
        bnb = "bitsandbytes not installed (no nf4/fp4 rows)"
    if aitk is None:
        return f"{bnb}; ai-toolkit's stand-ins (tests/python/torch/aitk_layouts.py)"
    return f"{bnb}; ai-toolkit {AITK_COMMIT[:8]} ({path})"


def formats4(w, aitk) -> dict:
    """``w`` in each 4-bit format whose quantizer is here: name -> its tensors."""
    return {**bnb_formats(w), **aitk_formats(w, aitk)}


# --- peak memory -----------------------------------------------------------------------------

#: Layers of the peak measurement's model (FLUX-sized, the Gaussian weight's seed each).
PEAK_LAYERS = 8


def vm_hwm_gib(pid: int) -> float:
    """Process ``pid``'s peak resident memory (``VmHWM``: heap and mapped shared memory)."""
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib / (1 << 20)


def peaks(binary: str, tmp: str, layers: int = PEAK_LAYERS) -> list[dict]:
    """A fresh daemon's peak resident memory for one model of ``layers`` FLUX-sized layers,
    stored as it is and coded: loaded from a bf16 file quantized to
    ``fp8_e4m3_block64``, and uploaded as e4m3 weights (each scaled to e4m3's range)."""
    import torch
    from safetensors.torch import save_file

    from tests.daemon import Daemon

    g = torch.Generator().manual_seed(0)
    bf16 = {
        f"b{i}.weight": (torch.randn(3072, 12288, generator=g) * 0.02).bfloat16()
        for i in range(layers)
    }
    path = str(Path(tmp) / "peak.safetensors")
    save_file(bf16, path)
    fp8 = {
        n: (w.float() * (448 / w.float().abs().max())).to(torch.float8_e4m3fn)
        for n, w in bf16.items()
    }
    del bf16

    def store(client, how: str, coding: str):
        if how == "load":
            return client.load_model(
                [path], quantize="fp8_e4m3_block64", retention="connection", coding=coding
            )
        return client.upload_model("peak", fp8, retention="connection", coding=coding)[0]

    rows = []
    for how in ("load", "upload"):
        for coding in ("none", "rans8"):
            with tempfile.TemporaryDirectory(prefix="ws-peak-", dir=tmp) as d:
                daemon = Daemon(d, binary=binary)
                try:
                    start = vm_hwm_gib(daemon.pid)
                    model = store(daemon.client, how, coding)
                    rows.append(
                        {
                            "how": how,
                            "coding": coding,
                            "bytes_gib": sum(t.nbytes for t in model.tensors) / (1 << 30),
                            "held_gib": sum(t.stored_nbytes or t.nbytes for t in model.tensors)
                            / (1 << 30),
                            "peak_gib": vm_hwm_gib(daemon.pid),
                            "start_gib": start,
                        }
                    )
                    print(rows[-1], flush=True)
                finally:
                    daemon.stop()
    return rows


# --- report ----------------------------------------------------------------------------------


def encode_cell(r: dict) -> str:
    if r["code_s"] is None:
        return "—"
    rate = f" ({r['encode_mb_s']} MB/s)" if r["encode_mb_s"] is not None else ""
    return f"{r['code_s']:.3f} s{rate}"


def markdown(report: dict) -> str:
    lines = [
        "# What the daemon's coding (rans8) saves on 8-bit and 4-bit weights",
        "",
        f"- command: `{report['command']}`",
        f"- commit: {report['commit']}; {report['cores']} CPU cores, host backend",
        f"- 4-bit quantizers: {report['quantizers4']}",
        "- saved: the bytes a session copies for the weight (its coded blob: table, states, "
        "offsets, words; data and scales coded together) against the bytes it decodes to",
        "- 4-bit rows: the layer's packed tensors as the quantizer holds them, uploaded "
        '(`upload_model`) as they are and with `coding="rans8"`, a row each and one for the '
        "layer (`all`; its encode: the upload's coding time, its rate over the bytes the coder "
        "ran on, kept or not); "
        "not uploaded: bitsandbytes' `quant_map` (16 float32) and ai-toolkit's `nv4_pts` "
        "(one float32). The daemon codes one-byte tensors of 1 MiB or more that code at least "
        "1/32 smaller; the coding column says why the others are not coded",
        "",
        "| weights | format | bytes | held coded | saved | lanes | coding | encode |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['weights']} | {r['format']} | {r['bytes']:,} | {r['coded_bytes']:,} | "
            f"{100 * r['saved']:.1f} % | {r['lanes'] or '—'} | {r['coded']} | "
            f"{encode_cell(r)} |"
        )
    if report.get("peaks"):
        lines += [
            "",
            f"## The daemon's peak memory storing a model ({PEAK_LAYERS} FLUX-sized layers)",
            "",
            "- a fresh daemon each; peak: its `VmHWM` (heap and the shared memory it maps) once "
            "the model is stored; load: a bf16 file quantized to fp8_e4m3_block64; upload: e4m3 "
            "weights",
            "",
            "| stored by | coding | bytes | held | daemon's peak | peak / bytes |",
            "|---|---|---|---|---|---|",
        ]
        for r in report["peaks"]:
            lines.append(
                f"| {r['how']} | {r['coding']} | {r['bytes_gib']:.3f} GiB | "
                f"{r['held_gib']:.3f} GiB | {r['peak_gib']:.3f} GiB | "
                f"{r['peak_gib'] / r['bytes_gib']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def release_all(client) -> None:
    for m in client.list_models().models:
        client.release_model(m.model_id)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", default="target/release/weightstream")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-coding"))
    parser.add_argument("--safetensors", nargs="*", default=[])
    parser.add_argument(
        "--aitk",
        default=".aitk",
        help="ai-toolkit's source (tests/bench/ai_toolkit_prepare.sh); none there: its "
        "stand-ins (tests/python/torch/aitk_layouts.py)",
    )
    args = parser.parse_args(argv)

    from safetensors.torch import save_file

    from tests.daemon import Daemon

    aitk = load_aitk(args.aitk)
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
                    release_all(daemon.client)
                for fmt, tensors in formats4(w, aitk).items():
                    for r in measure4(daemon.client, fmt, tensors):
                        rows.append({"weights": name, **r})
                        print(rows[-1], flush=True)
                    release_all(daemon.client)
        finally:
            daemon.stop()
        peak_rows = peaks(args.bin, tmp)
    report = {
        "command": command(),
        "commit": commit(),
        "cores": os.cpu_count(),
        "quantizers4": quantizers4(aitk, args.aitk),
        "rows": rows,
        "peaks": peak_rows,
    }
    write_report(args.out, "coding_cpu", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
