"""tests/bench/nvcomp8.py's rows and report on the CPU, a fake codec standing for nvCOMP (the
codecs themselves run on the GPU machine only)."""

from __future__ import annotations

import zlib

import torch

from tests.bench import nvcomp8

W = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.02


def deflate(codes, options, repeat, nvcomp):
    """Stands for ``run_codec``: zlib's bytes, 1 µs a decode; Bitcomp refused."""
    if options["algorithm"] == "Bitcomp":
        raise RuntimeError("unsupported data type")
    packed = zlib.compress(codes.numpy().tobytes(), 9)
    assert codes.dtype == torch.uint8 and repeat == 3 and nvcomp is None
    return {"compressed_bytes": len(packed), "encode_s": 0.002, "decode_s": 1e-6, "equal": True}


def test_each_format_gets_each_codec_fp8_coding_for_the_fp8_formats_only():
    rows = nvcomp8.measure("w", W, nvcomp8.CODECS, 3, run=deflate)
    got = [(r["format"], r["codec"]) for r in rows]
    assert got == [
        (fmt, codec)
        for fmt in ("fp8_e4m3_block64", "fp8_row", "int8_row")
        for codec in nvcomp8.CODECS
        if codec != "ANS fp8" or fmt != "int8_row"
    ]
    row = next(r for r in rows if (r["format"], r["codec"]) == ("fp8_row", "ANS"))
    codes = 64 * 128
    scales = 64 * 4
    packed = len(zlib.compress(row_codes("fp8_row").numpy().tobytes(), 9))
    assert row["bytes"] == codes + scales
    assert row["coded_bytes"] == packed + scales
    assert row["saved"] == 1 - (packed + scales) / (codes + scales)
    assert row["decode_gbps"] == codes / 1e-6 / 1e9
    assert row["spared_over_decode"] == (codes - packed) / 25e9 / 1e-6
    refused = next(r for r in rows if r["codec"] == "Bitcomp")
    assert refused["error"] == "RuntimeError: unsupported data type"
    assert "saved" not in refused


def row_codes(fmt):
    return nvcomp8.entropy8.formats(W)[fmt][0]


def test_the_report_gives_each_row_and_each_error():
    rows = nvcomp8.measure("w", W, {"ANS": nvcomp8.CODECS["ANS"]}, 3, run=deflate)
    rows.append({"weights": "w", "format": "int8_row", "codec": "Bitcomp", "error": "E: x"})
    report = {
        "command": "cmd",
        "commit": "abc",
        "device": "H100",
        "nvcomp": "6.0.0",
        "repeat": 3,
        "rows": rows,
    }
    md = nvcomp8.markdown(report)
    r = rows[0]
    assert (
        f"| w | fp8_e4m3_block64 | ANS | {100 * r['saved']:.1f} % | 8.2 | "
        f"{r['spared_over_decode']:.2f} | yes |"
    ) in md
    assert "| w | int8_row | Bitcomp | E: x | - | - | - |" in md
    assert "- commit: abc; device: H100; nvCOMP 6.0.0" in md


def test_frames_are_aligned_zstandard_frames_of_each_chunk():
    import zstandard

    data = row_codes("int8_row").numpy().tobytes() * 3  # 24 KiB
    buf, offsets, sizes = nvcomp8.frames(data, 10_000, 3)
    assert offsets[0] == 0 and all(o % nvcomp8.FRAME_ALIGN == 0 for o in offsets)
    assert len(offsets) == len(sizes) == 3
    assert len(buf) == offsets[-1] + -(-sizes[-1] // 16) * 16
    decoder = zstandard.ZstdDecompressor()
    got = [decoder.decompress(bytes(buf[o : o + n])) for o, n in zip(offsets, sizes, strict=True)]
    assert got == [data[:10_000], data[10_000:20_000], data[20_000:]]


class FakeNvcomp:
    """Stands for nvCOMP's Python API on the CPU: ``as_arrays`` carves views, the codec's
    ``decode`` of a batch writes each Zstandard frame into its entry of ``out``."""

    class BitstreamKind:
        RAW = "raw"

    class Codec:
        def __init__(self, algorithm, bitstream_kind, cuda_stream):
            assert (algorithm, bitstream_kind, cuda_stream) == ("Zstd", "raw", 0)
            self.decodes = 0

        def decompression_config(self, source):
            return ("config", len(source))

        def decode(self, source, out, decompression_config):
            import zstandard

            assert decompression_config == ("config", len(source)) == ("config", len(out))
            for frame, entry in zip(source, out, strict=True):
                got = zstandard.ZstdDecompressor().decompress(frame.numpy().tobytes())
                entry.copy_(torch.frombuffer(bytearray(got), dtype=torch.uint8))

    @staticmethod
    def as_arrays(buffer, offsets, sizes, cuda_stream):
        return [buffer[o : o + n] for o, n in zip(offsets, sizes, strict=True)]


def test_frames_decode_into_one_buffer_equal_to_the_codes(monkeypatch):
    calls = []

    def timed(fn):
        calls.append(fn)
        return fn(), 0.5 + len(calls)

    monkeypatch.setattr(nvcomp8, "timed", timed)
    codes = row_codes("int8_row")
    got = nvcomp8.run_frames(codes, {"frames": 3000, "level": 3}, 3, FakeNvcomp)
    buf, _, _ = nvcomp8.frames(codes.numpy().tobytes(), 3000, 3)
    assert got["compressed_bytes"] == len(buf) and got["equal"] is True
    assert got["decode_s"] == 2.5 and len(calls) == 3  # the median of 1.5, 2.5, 3.5
