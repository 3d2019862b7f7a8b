"""Benchmark: the 8-bit AdamW step on the CPU (weightstream.torch.adamw8.native_step: fp32
master, bf16 gradient, bf16 copy out) against torch.optim.AdamW(fused=True) on fp32 parameters,
gradients and moments, both over N parameters (one flat tensor), in G parameters per second
(best and median of --steps steps after one warm-up). Needs no GPU and no daemon.

    PYTHONPATH=$PWD/client-py/src python3 -m tests.bench.adamw8_speed [--n 200000000]
        [--threads T] [--out DIR]

--threads sets the kernel's pool (RAYON_NUM_THREADS) and torch's; by default all cores. Memory:
about 10 bytes per parameter for the 8-bit step, 16 for fused AdamW (not at the same time).
With --out, writes adamw8_speed.{json,md} there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path


def timed(step, steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step(t)`` (t from 2; t = 1 is the warm-up)."""
    step(1)
    seconds = []
    for t in range(2, steps + 2):
        start = time.perf_counter()
        step(t)
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200_000_000, help="parameters")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each")
    parser.add_argument("--threads", type=int, default=0, help="0: every core")
    parser.add_argument("--out", type=Path, help="write adamw8_speed.{json,md} here")
    args = parser.parse_args()
    if args.threads:
        # Read by rayon when its pool starts (the first step), so before the import.
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)

    import torch
    from weightstream import _native
    from weightstream.torch import adamw8

    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.n
    rows = []

    def report(name: str, seconds: list[float], bytes_per_param: int) -> None:
        best, median = min(seconds), statistics.median(seconds)
        row = {
            "name": name,
            "best_gparams_s": n / best / 1e9,
            "median_gparams_s": n / median / 1e9,
            "best_gb_s": n * bytes_per_param / best / 1e9,
            "seconds": seconds,
        }
        rows.append(row)
        print(
            f"{name}: {row['best_gparams_s']:.2f} G params/s best, "
            f"{row['median_gparams_s']:.2f} median ({row['best_gb_s']:.0f} GB/s moved at best)"
        )

    lr, betas, eps, wd = 1e-4, (0.9, 0.999), 1e-8, 0.01

    def eight_bit() -> list[float]:
        # Every tensor written once first, so that no step pays for first-touch page faults.
        p = torch.randn(n)
        g = torch.randn(n).bfloat16()
        qm, qv, sm, sv = adamw8.new_state(n)
        w = torch.empty(n, dtype=torch.bfloat16)
        for t in (qm, qv, sm, sv, w):
            t.fill_(0)

        def step(t: int) -> None:
            adamw8.native_step(p, g, qm, qv, sm, sv, w, t, lr, *betas, eps, wd)

        return timed(step, args.steps)

    def fused() -> list[float]:
        x = torch.nn.Parameter(torch.randn(n))
        x.grad = torch.randn(n)
        opt = torch.optim.AdamW([x], lr=lr, betas=betas, eps=eps, weight_decay=wd, fused=True)
        return timed(lambda t: opt.step(), args.steps)

    isa = _native.adamw8bit_isas()[0]
    # reads p 4, g 2, qm 1, qv 1; writes p 4, qm 1, qv 1, w 2
    report(f"weightstream 8-bit AdamW, bf16 grad, bf16 out ({isa})", eight_bit(), 16)
    # reads p, g, m, v; writes p, m, v: 7 x 4 bytes
    report("torch.optim.AdamW(fused=True), fp32", fused(), 28)

    threads = args.threads or os.cpu_count()
    print(f"N = {n:,}, {threads} threads, torch {torch.__version__}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        result = {"n": n, "threads": threads, "torch": torch.__version__, "commit": commit}
        result["rows"] = rows
        (args.out / "adamw8_speed.json").write_text(json.dumps(result, indent=2) + "\n")
        lines = [
            f"# 8-bit AdamW step speed (N = {n:,}, {threads} threads, commit {commit[:12]})",
            "",
            "| step | G params/s (best) | median | GB/s moved (best) |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r['name']} | {r['best_gparams_s']:.2f} | {r['median_gparams_s']:.2f} "
            f"| {r['best_gb_s']:.0f} |"
            for r in rows
        ]
        (args.out / "adamw8_speed.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
