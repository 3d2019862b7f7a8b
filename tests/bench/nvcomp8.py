"""Benchmark (GPU): nvCOMP's lossless codecs on the daemon's 8-bit weights, on the device: the
bytes each saves and how fast the device decodes them, against the link they would spare
(issue #50's compression: "≥ 30 % fewer bytes per step on FLUX.2 8-bit, and a faster step
wherever the link binds"). ``entropy8.py`` bounds what an order-0 coder can save on the CPU;
this measures what nvCOMP (``nvidia-nvcomp-cu13``, its Python API) does: per 8-bit format the
quantizers make (``fp8_e4m3_block64``, the per-row fp8 and int8 of 8-bit compute) and per
codec (``ANS`` on bytes, ``ANS`` told the codes are FP8 E4M3 (``data_type="|f1"``) for the
fp8 formats, ``Bitcomp``, ``GDeflate``, ``Zstd``), the codes compressed once on the device,
then decoded ``--repeat`` times on torch's stream, timed with CUDA events, and checked equal
byte for byte. The scales stay as they are.

Weights: ``entropy8.py``'s (seeded Gaussian and Student-t weights of a FLUX-sized linear, or
the 2-D tensors of ``--safetensors`` files). On the GPU machine, the wheels carried in
``.nvc/`` (``nvidia-nvcomp-cu13`` and ``nvidia-libnvcomp-cu13``, 34 MB together, and
``zstandard``):

    python3 -m pip install -q --no-index --no-deps --target /tmp/nvc .nvc/*.whl
    PYTHONPATH=/tmp/nvc:client-py/src python3 -m tests.bench.nvcomp8 --out $OUT

Results: $OUT/nvcomp8.json and nvcomp8.md, with the command, the commit and the device. A codec
that fails is reported with its error and the others still run.
"""

from __future__ import annotations

import sys

from tests.bench import entropy8
from tests.bench.provenance import command, commit, write_report

#: Codec label -> ``nvcomp.Codec`` keyword arguments (the algorithm, and its options).
CODECS = {
    "ANS": {"algorithm": "ANS"},
    "ANS fp8": {"algorithm": "ANS", "data_type": "|f1"},
    "Bitcomp": {"algorithm": "Bitcomp"},
    "GDeflate": {"algorithm": "GDeflate"},
    "Zstd": {"algorithm": "Zstd"},
    # Zstandard frames made on the CPU (``zstandard``, one per chunk of ``frames`` bytes) and
    # decoded by nvCOMP's batched Zstd (``RAW`` bitstreams): the form a host copy coded on the
    # CPU would take.
    "Zstd CPU 64K": {"algorithm": "Zstd", "frames": 64 << 10, "level": 3},
    "Zstd CPU 1M": {"algorithm": "Zstd", "frames": 1 << 20, "level": 3},
}
#: Where each frame starts in the coded buffer: nvCOMP's decoders want aligned inputs.
FRAME_ALIGN = 16
#: The link the decoded bytes would otherwise cross (a 4090's PCIe Gen4 x16).
LINK_GBPS = 25.0


def applies(label: str, fmt: str) -> bool:
    """``ANS fp8`` codes FP8 E4M3 only."""
    return label != "ANS fp8" or fmt.startswith("fp8")


def nbytes(array) -> int:
    """The bytes of an nvCOMP ``Array`` (its buffer, else its DLPack view's)."""
    size = getattr(array, "buffer_size", None)
    if isinstance(size, int):
        return size
    import torch

    t = torch.from_dlpack(array)
    return t.numel() * t.element_size()


def timed(fn):
    """``fn()`` on torch's current stream: its result and the seconds between CUDA events
    recorded before and after it."""
    import torch

    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, begin.elapsed_time(end) / 1e3


def repeated(repeat: int, decode, same) -> tuple[float, bool]:
    """``decode()`` (giving its result and seconds) ``repeat`` times: the median seconds, and
    whether ``same(result)`` held every time."""
    seconds, equal = [], True
    for _ in range(repeat):
        out, s = decode()
        seconds.append(s)
        equal = equal and same(out)
    seconds.sort()
    return seconds[len(seconds) // 2], equal


def frames(data: bytes, chunk: int, level: int) -> tuple[bytearray, list[int], list[int]]:
    """``data`` coded as one Zstandard frame per ``chunk`` bytes (the last may be shorter):
    the frames laid out at ``FRAME_ALIGN``-byte offsets in one buffer, their offsets and sizes."""
    import zstandard

    coder = zstandard.ZstdCompressor(level=level, write_content_size=True)
    coded = [coder.compress(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    offsets, at = [], 0
    for frame in coded:
        offsets.append(at)
        at += -(-len(frame) // FRAME_ALIGN) * FRAME_ALIGN
    buf = bytearray(at)
    for offset, frame in zip(offsets, coded, strict=True):
        buf[offset : offset + len(frame)] = frame
    return buf, offsets, [len(f) for f in coded]


def run_frames(codes, options: dict, repeat: int, nvcomp) -> dict:
    """``codes`` coded on the CPU in Zstandard frames (``frames``) and decoded ``repeat`` times
    by nvCOMP on torch's current stream into one buffer: the coded bytes with their padding,
    the CPU's seconds to encode, the median seconds to decode, and whether each decode equals
    ``codes``. The decode's configuration is made once, before the timed decodes."""
    import time

    import torch

    chunk = options["frames"]
    data = codes.reshape(-1).cpu().numpy().tobytes()
    begin = time.perf_counter()
    buf, offsets, sizes = frames(data, chunk, options["level"])
    encode_s = time.perf_counter() - begin
    stream = torch.cuda.current_stream().cuda_stream if codes.is_cuda else 0
    codec = nvcomp.Codec(
        algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW, cuda_stream=stream
    )
    coded = torch.frombuffer(buf, dtype=torch.uint8).to(codes.device)
    source = nvcomp.as_arrays(coded, offsets, sizes, cuda_stream=stream)
    out = torch.empty(len(data), dtype=torch.uint8, device=codes.device)
    starts = list(range(0, len(data), chunk))
    target = nvcomp.as_arrays(
        out, starts, [min(chunk, len(data) - s) for s in starts], cuda_stream=stream
    )
    config = codec.decompression_config(source)

    def decode():
        out.zero_()  # an entry the decode left alone would keep the last decode's bytes
        return timed(lambda: codec.decode(source, out=target, decompression_config=config))

    decode_s, equal = repeated(repeat, decode, lambda _: torch.equal(out, codes.reshape(-1)))
    return {
        "compressed_bytes": len(buf),
        "encode_s": encode_s,
        "decode_s": decode_s,
        "equal": equal,
    }


def run_codec(codes, options: dict, repeat: int, nvcomp) -> dict:
    """``codes`` (a uint8 CUDA tensor) compressed once and decoded ``repeat`` times on torch's
    current stream: the compressed bytes, the seconds to encode, the median seconds to decode,
    and whether every decode equals ``codes``. Options with ``frames``: ``run_frames``."""
    if "frames" in options:
        return run_frames(codes, options, repeat, nvcomp)
    import torch

    stream = torch.cuda.current_stream().cuda_stream
    codec = nvcomp.Codec(cuda_stream=stream, **options)
    source = nvcomp.as_array(codes, cuda_stream=stream)

    encoded, encode_s = timed(lambda: codec.encode(source))

    def same(decoded) -> bool:
        return torch.equal(
            torch.from_dlpack(decoded).reshape(-1).view(torch.uint8), codes.reshape(-1)
        )

    decode_s, equal = repeated(repeat, lambda: timed(lambda: codec.decode(encoded)), same)
    return {
        "compressed_bytes": nbytes(encoded),
        "encode_s": encode_s,
        "decode_s": decode_s,
        "equal": equal,
    }


def measure(name: str, w, codecs: dict, repeat: int, run=run_codec, nvcomp=None) -> list[dict]:
    """Rows of one weight: per format and codec, the bytes stored (codes and scales), the
    bytes after coding the codes, the share saved, and the decode speed next to the link."""
    rows = []
    for fmt, (codes, scale_bytes) in entropy8.formats(w).items():
        stored = codes.numel() + scale_bytes
        on_device = codes.to("cuda") if run is run_codec else codes
        for label, options in codecs.items():
            if not applies(label, fmt):
                continue
            row = {"weights": name, "format": fmt, "codec": label, "bytes": stored}
            try:
                got = run(on_device, options, repeat, nvcomp)
            except Exception as e:  # a codec the library or the data refuses: said, not fatal
                rows.append({**row, "error": f"{type(e).__name__}: {e}"})
                continue
            coded = got["compressed_bytes"] + scale_bytes
            decode_gbps = codes.numel() / got["decode_s"] / 1e9 if got["decode_s"] else None
            rows.append(
                {
                    **row,
                    **got,
                    "coded_bytes": coded,
                    "saved": 1 - coded / stored,
                    "decode_gbps": decode_gbps,
                    # The link time the saving spares, over the decode time it costs.
                    "spared_over_decode": (
                        (stored - coded) / (LINK_GBPS * 1e9) / got["decode_s"]
                        if got["decode_s"]
                        else None
                    ),
                }
            )
    return rows


def markdown(report: dict) -> str:
    lines = [
        "# nvCOMP on the 8-bit formats, on the device",
        "",
        f"- command: `{report['command']}`",
        f"- commit: {report['commit']}; device: {report['device']}; nvCOMP {report['nvcomp']}",
        f"- each format's codes compressed once and decoded {report['repeat']} times (the "
        "median); scales stored as they are; spared / decode: the link time the saving spares "
        f"at {LINK_GBPS:g} GB/s over the time the decode takes (above 1: a faster copy where "
        "the link binds, if the decode overlaps nothing else)",
        "",
        "| weights | format | codec | saved | decode GB/s | spared / decode | equal |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [table_row(r) for r in report["rows"]]
    return "\n".join(lines) + "\n"


def table_row(r: dict, more: tuple[str, ...] = ()) -> str:
    """A row's line of the table: weights, format, codec, saved, decode GB/s, spared / decode,
    equal, and the cells ``more`` (a row that failed: its error and dashes)."""
    head = f"| {r['weights']} | {r['format']} | {r['codec']} |"
    if "error" in r:
        return f"{head} {r['error'][:80]} |" + " - |" * (3 + len(more))
    gbps = f"{r['decode_gbps']:.1f}" if r["decode_gbps"] else "-"
    ratio = f"{r['spared_over_decode']:.2f}" if r["spared_over_decode"] is not None else "-"
    cells = [f"{100 * r['saved']:.1f} %", gbps, ratio, "yes" if r["equal"] else "**no**", *more]
    return f"{head} {' | '.join(cells)} |"


def main(argv=None) -> int:
    p = entropy8.parser("nvcomp8")
    p.add_argument("--codecs", default=",".join(CODECS), help="of " + ", ".join(CODECS))
    p.add_argument("--repeat", type=int, default=9)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    unknown = [c for c in args.codecs.split(",") if c not in CODECS]
    if unknown:
        p.error(f"--codecs: {', '.join(unknown)} unknown; known: {', '.join(CODECS)}")
    import torch

    if not torch.cuda.is_available():
        p.error("nvcomp8 runs on a CUDA device (entropy8.py is the CPU's bound)")
    try:
        from nvidia import nvcomp
    except ImportError:
        p.error(
            "nvCOMP's Python API is missing: pip install nvidia-nvcomp-cu13 (or --target DIR "
            "of the carried wheels, on PYTHONPATH)"
        )
    codecs = {c: CODECS[c] for c in args.codecs.split(",")}
    rows = [
        row
        for name, w in entropy8.weights(args.safetensors).items()
        for row in measure(name, w, codecs, args.repeat, nvcomp=nvcomp)
    ]
    report = {
        "command": command(),
        "commit": commit(),
        "device": torch.cuda.get_device_name(),
        "nvcomp": getattr(nvcomp, "__version__", "unknown"),
        "repeat": args.repeat,
        "rows": rows,
    }
    write_report(args.out, "nvcomp8", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
