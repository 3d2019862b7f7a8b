"""Benchmark: LoRA training of a full-size FLUX.1 transformer (random weights, bf16) on the
H200, resident against weightstream at several budgets (and the in-process peers), with a
deterministic pass that checks weightstream's losses equal the resident ones bit for bit.

One command on the GPU machine (diffusers and ramtorch come as wheels in .whl/):
    python3 -m tests.bench.flux_train --bin target/release/weightstream --out $OUT
Each mode runs in its own process (clean GPU memory, its own memory fraction); results are
appended to $OUT/flux_train.json as they come (the children's logs end up in flux-logs.tgz).
`python3 -m tests.bench.flux_report` turns tests/bench/results/flux_train.json into the tables
of flux_train.md and the plot flux_train.png.

8 bits: `--quantize fp8` streams the weights in fp8_e4m3_block64 in the weightstream modes and
adds the mode `resident-fp8` (the 8-bit resident reference: each weight weightstream streams
replaced on the GPU by its w_hat) to the default modes; their deterministic losses are compared
with it, the others' with `resident`, so one run compares fp8 streaming, 8-bit resident and bf16
resident. Both 8-bit modes record the per-tensor SQNR of the quantized weights (`sqnr`: median
and worst, dB); the weightstream mode also the device time of its dequantizations over one step
(`dequant_ms_per_step`, CUDA events around each) and the largest dequantization's memory.
The weightstream mode then times one more step's client calls on the CPU, per pass
(`client_cpu_ms_per_pass`: the streamed layers' forwards, the blocks for replies, the sends,
the dequantization launches).
`--modes resident-fp8 resident-fp8-copying` times the 8-bit reference alone and again while a
thread copies pinned host memory to the device without pause (`--copy-duty D`: that share of
the time): what the link's traffic costs a step by itself, apart from weightstream's code.

Variants: `--interleave weightstream weightstream+layer --budgets 7 --min-blocks 0` runs both
modes at once with their timed steps alternating one by one, and reports each later mode's step
over the first mode's step just before it (`interleaved`: per pair, median, min, max), so that
the machine's drift between and within calls (steps of one mode spread ±20 % on the H200)
cancels. Each step then starts after the other process ran one: a step bound by the CPU pays
for that more than one bound by the GPU (FLUX.1 8-bit streamed against resident: 1.17–1.27 ×
interleaved, 1.06–1.09 × with `--modes`, each mode's steps back to back as a trainer runs
them), so ratios against the resident step are taken with `--modes`, or with `--turn K`:
turns of K steps, the steps after a turn's first compared (`steady_ratio_of_medians`).
Each step also records when the CPU had issued the forward (`forward_issued_s_per_step`): near
`forward_s_per_step`, the forward waits on the CPU, not the GPU.

8-bit compute (W8A8, attach's `compute=`): `--modes resident resident-w8a8-fp8
weightstream-w8a8-fp8` (or `-int8`) compares the bf16 resident step, the same W8A8 layers in
place (`compute8.to_w8a8_resident`) and streamed W8A8 in one call; `--rotation B` and
`--grad-compute` apply to both W8A8 modes, whose deterministic losses are compared with each
other (`losses_equal_resident`). Not among the default modes.

The host copy coded (attach's `coding=`): `--coding rans8` holds every weightstream mode's
one-byte weights coded losslessly, the trainer decoding each group on the device
(`coding_cpu.py` measures what that saves); the modes `weightstream-rans8`,
`weightstream-w8a8-fp8-rans8` and `weightstream-w8a8-int8-rans8` are those modes coded whatever
`--coding` says, so one call times a mode and its coded form, and with `--det-steps` checks
that their losses are equal (`losses_equal_uncoded`): where the link binds, e.g.
`--model flux1 --modes weightstream-w8a8-fp8 weightstream-w8a8-fp8-rans8 --grad-compute bf16
--budgets 8 --trainer-gib 6 --min-blocks 0 --copy-bandwidth-limit 12GB/s`. Not among the
default modes.

ai-toolkit's own layer offloading: `--modes ... aitk` runs its `MemoryManager` (its
toolkit/memory_management at AITK_COMMIT, laid out in .aitk/ by tests/bench/ai_toolkit_prepare.sh,
or `--aitk DIR`) at 100 % offload in bf16; `aitk-float8` the same over torchao float8 weights
where torchao is installed. Neither is among the default modes. On the CPU,
tests/bench/aitk_memory_manager_cpu.py checks the mode's import and attach by hand.
"""

from __future__ import annotations

import argparse
import os
import sys

from tests.bench.benchlib import flux
from tests.bench.benchlib.runner import CODED, MODES, child, parent
from tests.bench.card import LINK_ENV


def main(model: str = "flux1"):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["flux1", "flux2"], default=model)
    parser.add_argument("--rank", type=int, default=32, help="the LoRA rank")
    parser.add_argument(
        "--optimizer",
        choices=["adamw", "adamw8bit"],
        default="adamw",
        help="the LoRA optimizer: torch's AdamW, or torchao's AdamW8bit (a quarter of the "
        "state: for high ranks whose AdamW state outgrows --trainer-gib)",
    )
    parser.add_argument(
        "--copy-bandwidth-limit",
        default=os.environ.get(LINK_ENV),
        help="the daemon's copy_bandwidth_limit (e.g. 25GB/s: a PCIe Gen4 x16 link, emulated; "
        f"default: ${LINK_ENV}, which tests/bench/card.py --link sets)",
    )
    parser.add_argument("--bin", default="target/release/weightstream")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-flux-out"))
    parser.add_argument("--child")
    parser.add_argument("--socket")
    parser.add_argument("--modes", nargs="+", default=None)
    parser.add_argument(
        "--quantize",
        choices=["fp8"],
        default=None,
        help="weightstream modes stream the weights in 8 bits (fp8_e4m3_block64); their "
        "losses are compared with resident-fp8, which the default modes then include",
    )
    parser.add_argument(
        "--coding",
        choices=["none", "rans8"],
        default="none",
        help="weightstream modes: attach's coding (rans8: the daemon holds the 8-bit weights "
        "coded losslessly, the trainer decodes each group on the device)",
    )
    parser.add_argument("--budgets", nargs="+", type=float, default=[24, 16, 12, 8])
    parser.add_argument(
        "--trainer-gib",
        type=float,
        default=5.0,
        help="the trainer's share of each budget (its allocator's cap); the daemon gets the rest",
    )
    parser.add_argument("--group-by", default="block", help="attach's group_by")
    parser.add_argument(
        "--dequantize",
        choices=("auto", "layer", "group"),
        default="auto",
        help="attach's dequantize (8 bits: each layer's weight at each call, a group's at once, "
        "or auto: by group for the groups of at most 768 MiB dequantized)",
    )
    parser.add_argument(
        "--rotation",
        type=int,
        default=0,
        help="8-bit compute modes (resident-w8a8-*, weightstream-w8a8-*): the block-Hadamard "
        "rotation (0: none)",
    )
    parser.add_argument(
        "--grad-compute",
        choices=("fp8", "int8", "bf16"),
        default=None,
        help="8-bit compute modes: the input gradient's mode (default: bf16)",
    )
    parser.add_argument(
        "--early-release",
        action="store_true",
        help="attach's early_release (a group dequantized by group gives its staging back "
        "once dequantized); with --interleave, MODE+early runs MODE with it",
    )
    parser.add_argument(
        "--staging-gib",
        type=float,
        default=0.0,
        help="the daemon's staging space within each budget (default 0: the daemon's choice)",
    )
    parser.add_argument(
        "--min-blocks",
        type=float,
        default=3,
        help="the smallest budget: the trainer's share and this many of the largest group",
    )
    parser.add_argument("--metrics", default="127.0.0.1:9464", help="the daemon's metrics address")
    parser.add_argument("--jobs-budget", type=float, default=12.0, help="two-jobs: GiB per job")
    parser.add_argument("--job", type=int, default=0)
    parser.add_argument("--barrier")
    parser.add_argument("--jobs-resident", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--aitk",
        default=None,
        help="the aitk modes: ai-toolkit's code laid out by tests/bench/ai_toolkit_prepare.sh "
        "(default: .aitk in the repo root)",
    )
    parser.add_argument(
        "--interleave",
        nargs="+",
        metavar="MODE",
        help="run modes A B [C ...] at once, their timed steps alternating one by one (instead "
        "of --modes; one --budgets value, --min-blocks 0): each later mode's step over A's, pair "
        "by pair; MODE+group / MODE+layer runs MODE with that --dequantize, MODE+early with "
        "--early-release",
    )
    parser.add_argument(
        "--turn",
        type=int,
        default=1,
        help="with --interleave: each mode's steps per turn (more than 1: ratios also of the "
        "steps that follow a step of their own process, as a trainer's do)",
    )
    parser.add_argument("--lockstep", help=argparse.SUPPRESS)
    parser.add_argument(
        "--copy-duty",
        type=float,
        default=1.0,
        help="resident-fp8-copying: the share of the time its copy loop copies (0 < d <= 1)",
    )
    parser.add_argument("--det-budget", type=int, default=16)
    parser.add_argument("--det-steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--measured", type=int, default=10)
    parser.add_argument("--timeout", type=int, default=400)
    args = parser.parse_args()
    flux.MODEL, flux.RANK, flux.OPTIMIZER = args.model, args.rank, args.optimizer
    if args.modes is None:
        skip = {"job", "aitk", "aitk-float8", "resident-fp8-copying"}
        skip |= {m for m in MODES if "w8a8" in m or m.endswith(CODED)}
        skip |= set() if args.quantize else {"resident-fp8"}
        args.modes = [m for m in MODES if m not in skip]
    if args.interleave is not None and len(args.interleave) < 2:
        parser.error("--interleave times each mode against the first: give two modes or more")
    if args.interleave and (len(args.budgets) != 1 or args.min_blocks != 0):
        parser.error("--interleave times one budget: give one --budgets value and --min-blocks 0")
    if args.turn < 1:
        parser.error(f"--turn {args.turn}: give 1 or more steps per turn")
    if not 0 < args.copy_duty <= 1:
        parser.error(f"--copy-duty {args.copy_duty}: give a share of the time, 0 < d <= 1")
    if args.child:
        args.mode = args.child
        return child(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
