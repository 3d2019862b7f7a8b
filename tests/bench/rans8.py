"""Benchmark (GPU): a candidate lossless coder for the daemon's 8-bit weights whose encoder runs
on the CPU and whose decoder runs on the device, against nvCOMP's ANS. nvCOMP's ANS decodes at
156-206 GB/s but its encoder runs on the device (``nvcomp8.py``); a coder whose encoder runs on
the CPU lets the daemon code its host copy when it stores the weights, with no GPU, and the
device decode the coded bytes after the copy.

The coder: interleaved rANS over bytes (order 0). One table of frequencies per coded buffer,
quantized to 12 bits (they sum to 4096; every byte that occurs gets at least 1); a 32-bit state
kept in [2^16, 2^32) by 16-bit words (ryg_rans's ``rans_word``). ``K`` lanes: lane ``j`` codes
bytes ``j, j + K, j + 2K, ...`` (``T = ceil(n / K)`` steps, the last row padded with the most
frequent byte). Per lane: its decoder's initial state and its words in the order the decoder
reads them, contiguous, at ``offsets[j]``. ``encode`` runs on the CPU (numpy, vectorised over
the lanes); ``decode_numpy`` is the reference decoder; ``decode_triton`` is a Triton kernel, one
thread a lane, a loop over the steps.

Measured, per weight and 8-bit format (``entropy8.py``'s weights and formats, as
``nvcomp8.py`` measures them): the CPU's seconds to encode; the bytes saved (codes coded with
their table, states and offsets; scales stored as they are); the decode, run ``--repeat`` times
on torch's stream after one untimed run, timed with CUDA events (the median), its output checked
equal byte for byte; and the link time the saving spares at 25 GB/s over the decode time. Where
``nvidia.nvcomp`` imports, nvCOMP's ANS on the same codes in the same run (``nvcomp8``'s
``run_codec``). On the GPU machine (the nvCOMP wheels as ``nvcomp8.py`` installs them):

    python3 -m pip install -q --no-index --no-deps --target /tmp/nvc .nvc/*.whl
    PYTHONPATH=/tmp/nvc:client-py/src python3 -m tests.bench.rans8 --out $OUT \\
        [--lanes K,...] [--mib M]

Results: $OUT/rans8.json and rans8.md, with the command, the commit and the device.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np

from tests.bench import entropy8, nvcomp8
from tests.bench.provenance import command, commit, write_report

#: Bits of the quantized probabilities: the frequencies sum to ``1 << SCALE_BITS``.
SCALE_BITS = 12
#: The lower bound of a normalized state; a state is kept in [L, 2^32).
L = 1 << 16
#: Lanes a Triton program decodes (one a thread).
BLOCK = 128
LANES = 1 << 16


@dataclass
class Coded:
    """``n`` bytes coded in ``lanes`` interleaved rANS streams."""

    n: int
    lanes: int
    freq: np.ndarray  # uint16[256], summing to 4096
    states: np.ndarray  # uint32[lanes]: each lane's decoder's initial state
    offsets: np.ndarray  # uint32[lanes + 1]: where each lane's words start in ``words``
    words: np.ndarray  # uint16[...]: each lane's words in the order its decoder reads them

    def nbytes(self) -> int:
        """The bytes it takes on the wire: table, states, offsets and words."""
        return sum(a.nbytes for a in (self.freq, self.states, self.offsets, self.words))


def frequencies(counts: np.ndarray) -> np.ndarray:
    """``counts`` [256] scaled to frequencies summing to 4096, each byte that occurs at least 1:
    each rounded down, the shortfall added to the most frequent byte, an excess taken 1 at a
    time from the most frequent bytes (in turn) that stay at least 1."""
    total = 1 << SCALE_BITS
    freq = np.where(counts > 0, np.maximum(1, counts * total // counts.sum()), 0)
    order = np.argsort(-counts, kind="stable")[: int((counts > 0).sum())]
    freq[order[0]] += max(0, total - int(freq.sum()))
    at = 0
    while freq.sum() > total:
        s = order[at % len(order)]
        if freq[s] > 1:
            freq[s] -= 1
        at += 1
    return freq.astype(np.uint16)


def encode(data: np.ndarray, lanes: int = LANES) -> Coded:
    """``data`` (uint8, n >= 1) coded in ``lanes`` interleaved rANS streams."""
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    n = data.size
    if n == 0:
        raise ValueError("nothing to code")
    counts = np.bincount(data, minlength=256).astype(np.int64)
    freq16 = frequencies(counts)
    freq = freq16.astype(np.int64)
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]])
    steps = -(-n // lanes)
    rows = np.full(steps * lanes, int(np.argmax(counts)), np.uint8)
    rows[:n] = data
    rows = rows.reshape(steps, lanes)
    emitted = np.zeros((steps, lanes), bool)
    low = np.zeros((steps, lanes), np.uint16)
    x = np.full(lanes, L, np.int64)
    for t in range(steps - 1, -1, -1):
        f, c = freq[rows[t]], cum[rows[t]]
        out = x >= (f << (32 - SCALE_BITS))  # ((L >> SCALE_BITS) << 16) * f
        emitted[t], low[t] = out, x & 0xFFFF
        x = np.where(out, x >> 16, x)
        q, r = np.divmod(x, f)
        x = (q << SCALE_BITS) + r + c
    # The decoder of lane j reads the word the encoder emitted at step t after decoding byte t:
    # lane-major, t increasing.
    words = low.T[emitted.T]
    offsets = np.concatenate([[0], np.cumsum(emitted.sum(axis=0))]).astype(np.uint32)
    return Coded(n, lanes, freq16, x.astype(np.uint32), offsets, words)


def table(c: Coded) -> np.ndarray:
    """The decoder's table, one uint32 a slot of the 4096: its byte (bits 0-7), the byte's
    frequency less 1 (bits 8-19) and the slot's place in the byte's range (slot - cum, bits
    20-31), so that a step reads one entry."""
    freq = c.freq.astype(np.uint32)
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]]).astype(np.uint32)
    byte = np.repeat(np.arange(256, dtype=np.uint32), freq)
    slot = np.arange(1 << SCALE_BITS, dtype=np.uint32)
    return byte | ((freq[byte] - 1) << 8) | ((slot - cum[byte]) << 20)


def decode_numpy(c: Coded) -> np.ndarray:
    """The bytes ``c`` codes (uint8[n]), decoded on the CPU, all lanes a step at a time."""
    entries = table(c).astype(np.int64)
    words = c.words.astype(np.int64)
    x = c.states.astype(np.int64)
    at = c.offsets[:-1].astype(np.int64)
    steps = -(-c.n // c.lanes)
    out = np.empty((steps, c.lanes), np.uint8)
    for t in range(steps):
        e = entries[x & ((1 << SCALE_BITS) - 1)]
        out[t] = e & 0xFF
        x = (((e >> 8) & 0xFFF) + 1) * (x >> SCALE_BITS) + (e >> 20)
        need = x < L
        x[need] = (x[need] << 16) | words[at[need]]
        at += need
    if not np.array_equal(at, c.offsets[1:]):
        raise ValueError("the lanes' words do not match their offsets")
    return out.reshape(-1)[: c.n]


def kernel():
    """The Triton decoder (built on first use: Triton imports only where it decodes)."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        # n and lanes as arguments at any value (Triton makes an argument of 1 a constant).
        @triton.jit(do_not_specialize=["n", "lanes"])
        def rans8_decode(states, offsets, words, table, out, n, lanes, B: tl.constexpr):
            lane = tl.program_id(0) * B + tl.arange(0, B)
            live = lane < lanes
            x = tl.load(states + lane, mask=live, other=65536).to(tl.uint32, bitcast=True)
            at = tl.load(offsets + lane, mask=live, other=0)
            dst = out + lane
            left = n  # bytes from this step's first on: one step while any are left
            while left > 0:
                e = tl.load(table + (x & 4095).to(tl.int32)).to(tl.uint32, bitcast=True)
                tl.store(dst, (e & 0xFF).to(tl.uint8), mask=live & (lane < left))
                x = (((e >> 8) & 0xFFF) + 1) * (x >> 12) + (e >> 20)
                need = live & (x < 65536)
                w = tl.load(words + at, mask=need, other=0).to(tl.uint32) & 0xFFFF
                x = tl.where(need, (x << 16) | w, x)
                at += need.to(tl.int32)
                dst += lanes
                left -= lanes

        _KERNEL = (triton, rans8_decode)
    return _KERNEL


_KERNEL = None


def to_device(c: Coded, device) -> dict:
    """``c``'s arrays and decoder tables as tensors on ``device``, as the kernel reads them
    (uint32 and uint16 as int32 and int16 of the same bits)."""
    import torch

    arrays = {
        "states": c.states.view(np.int32),
        "offsets": c.offsets.view(np.int32),
        "words": c.words.view(np.int16) if c.words.size else np.zeros(1, np.int16),
        "table": table(c).view(np.int32),
    }
    return {k: torch.from_numpy(np.ascontiguousarray(a)).to(device) for k, a in arrays.items()}


def launch(c: Coded, on: dict, out) -> None:
    """Decodes ``c`` (its tensors ``on``, ``to_device``'s) into ``out`` (uint8[n])."""
    triton, decode = kernel()
    grid = (triton.cdiv(c.lanes, BLOCK),)
    decode[grid](
        on["states"],
        on["offsets"],
        on["words"],
        on["table"],
        out,
        c.n,
        c.lanes,
        B=BLOCK,
    )


def decode_triton(c: Coded, device):
    """The bytes ``c`` codes, decoded by the Triton kernel: a uint8 tensor on ``device``."""
    import torch

    out = torch.empty(c.n, dtype=torch.uint8, device=device)
    launch(c, to_device(c, device), out)
    return out


def run_rans(codes, options: dict, repeat: int, nvcomp) -> dict:
    """``nvcomp8.measure``'s codec runner for rANS: ``codes`` (uint8, on the CPU) encoded on
    the CPU with ``options["lanes"]`` lanes, carried to the device, decoded once untimed, then
    ``repeat`` times timed; ``nvcomp8.run_codec`` (on the device) for nvCOMP's codecs."""
    import torch

    if "lanes" not in options:
        return nvcomp8.run_codec(codes.to("cuda"), options, repeat, nvcomp)
    flat = codes.reshape(-1)
    begin = time.perf_counter()
    c = encode(flat.numpy(), options["lanes"])
    encode_s = time.perf_counter() - begin
    on, want = to_device(c, "cuda"), flat.to("cuda")
    out = torch.empty(c.n, dtype=torch.uint8, device="cuda")
    launch(c, on, out)  # Triton compiles the kernel on its first launch

    def decode():
        out.zero_()  # a byte the decode left alone would keep the last decode's
        return nvcomp8.timed(lambda: launch(c, on, out))

    decode_s, equal = nvcomp8.repeated(repeat, decode, lambda _: torch.equal(out, want))
    return {
        "compressed_bytes": c.nbytes(),
        "encode_s": encode_s,
        "encode_mbps": c.n / encode_s / 1e6,
        "decode_s": decode_s,
        "equal": equal,
    }


def markdown(report: dict) -> str:
    lines = [
        "# rANS coded on the CPU, decoded by Triton, on the 8-bit formats",
        "",
        f"- command: `{report['command']}`",
        f"- commit: {report['commit']}; device: {report['device']}; nvCOMP: {report['nvcomp']}",
        f"- rANS: {', '.join(map(str, report['lanes']))} lanes, 12-bit frequencies, one table "
        "a format's codes; "
        "saved counts its table, states and offsets; scales stored as they are",
        f"- each decode run {report['repeat']} times (the median); spared / decode: the link "
        f"time the saving spares at {nvcomp8.LINK_GBPS:g} GB/s over the time the decode takes",
        "",
        "| weights | format | codec | saved | decode GB/s | spared / decode | equal | encode |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        where = f"CPU {r['encode_mbps']:.0f} MB/s" if "encode_mbps" in r else "device"
        encode = f"{r['encode_s']:.3f} s ({where})" if "encode_s" in r else "-"
        lines.append(nvcomp8.table_row(r, (encode,)))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = entropy8.parser("rans8")
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--lanes", default=f"{LANES},{4 * LANES}", help="lane counts, comma-separated")
    p.add_argument("--mib", type=float, default=0, help="each weight's first rows of M MiB")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    if not torch.cuda.is_available():
        p.error(
            "rans8 needs a CUDA device: its decoder runs on the GPU (the tests run it on the "
            "CPU in Triton's interpreter)"
        )
    try:
        from nvidia import nvcomp
    except ImportError:
        nvcomp = None
    lanes = [int(k) for k in args.lanes.split(",")]
    codecs = {f"rANS {k} lanes": {"lanes": k} for k in lanes}
    if nvcomp is not None:
        codecs["ANS"] = nvcomp8.CODECS["ANS"]
    rows = []
    for name, w in entropy8.weights(args.safetensors).items():
        if args.mib:
            w = w[: max(1, int(args.mib * (1 << 20)) // w.shape[1])]
        rows += nvcomp8.measure(name, w, codecs, args.repeat, run=run_rans, nvcomp=nvcomp)
    report = {
        "command": command(),
        "commit": commit(),
        "device": torch.cuda.get_device_name(),
        "nvcomp": getattr(nvcomp, "__version__", "unknown") if nvcomp else "not installed",
        "repeat": args.repeat,
        "lanes": lanes,
        "rows": rows,
    }
    write_report(args.out, "rans8", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
