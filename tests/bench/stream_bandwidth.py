"""Benchmark: the daemon streams a synthetic model of >= 16 GiB in groups of 8-256 MiB to a
CUDA IPC consumer (a) doing no compute and (b) doing a matmul per group sized so that compute
and transfer take about as long. Reports, from one run: torch's pinned host-to-device bandwidth,
the daemon's achieved bandwidth and its ratio to it, and for (b) the step time against
max(compute alone, transfer alone). Writes stream_bandwidth.{json,md} under --out.

Run on the GPU machine by tests/gpu/run.sh (which carries the release binary).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tests.daemon import Daemon
from tests.gpu import wsgpu

MiB = 1 << 20
GiB = 1 << 30
SIZES_MIB = [8, 16, 32, 64, 128, 256]


def matmul_rate(n=8192, reps=10) -> float:
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        x @ y
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        x @ y
    b.record()
    b.synchronize()
    return 2 * n**3 * reps / (a.elapsed_time(b) / 1e3)


def upload_model(client, total: int):
    """Uploads >= `total` bytes of bf16 groups; each is a view of one 256 MiB random pattern
    (no host copy of the model besides the daemon's). Returns the manifest and the seconds
    the upload took (the native client writes the region, then commits and the daemon pins)."""
    sizes = []
    while sum(sizes) < total:
        sizes.append(SIZES_MIB[len(sizes) % len(SIZES_MIB)] * MiB)
    pattern = torch.randint(0, 256, (256 * MiB,), dtype=torch.uint8, device="cuda").cpu()
    tensors = {f"g{i:04d}": pattern[:s].view(torch.bfloat16) for i, s in enumerate(sizes)}
    started = time.monotonic()
    manifest, _ = client.upload_model("stream-bench", tensors)
    return manifest, time.monotonic() - started


LOOKAHEAD = 8


def run_pass(
    session, order, compute=None, xs=None, cpu=None, timeline=None, early_free=False, no_wait=False
):
    """One step over `order`: acquire, wait on the ready event, (compute), free, release.
    Keeps LOOKAHEAD acquires in flight, as a trainer's client does from a background thread,
    so that no group waits on a message round trip. `cpu` collects the time the loop itself
    took (to tell a slow consumer from a slow link)."""
    torch.cuda.synchronize()
    started = time.monotonic()
    tickets = [session.send_acquire(g) for g in order[:LOOKAHEAD]]
    for i, _ in enumerate(order):
        ticket, staged, view = session.wait_staged(tickets[i])
        if i + LOOKAHEAD < len(order):
            tickets.append(session.send_acquire(order[i + LOOKAHEAD]))
        if not no_wait:
            session.wait_ready(staged)
        if timeline is not None:
            timeline.append([torch.cuda.Event(enable_timing=True) for _ in range(2)])
            timeline[-1][0].record()
        if early_free:  # probe only: frees the space before the compute reads it
            session.release(ticket, staged)
        if compute is not None:
            k = view.numel() // 8192
            w = view[: k * 8192].view(torch.bfloat16).view(k, 4096)
            compute(xs[k], w)
        if timeline is not None:
            timeline[-1][1].record()
        if not early_free:
            session.release(ticket, staged)
    if cpu is not None:
        cpu.append(time.monotonic() - started)
    torch.cuda.synchronize()
    return time.monotonic() - started


def gaps(timeline):
    """(total ms the compute stream waited for data, total ms it computed)."""
    wait = sum(
        timeline[i][0].elapsed_time(timeline[i - 1][1]) * -1 for i in range(1, len(timeline))
    )
    busy = sum(a.elapsed_time(b) for a, b in timeline)
    return round(wait, 1), round(busy, 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", default="target/release/weightstream")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-gpu-out"))
    parser.add_argument("--size-gib", type=float, default=16.0)
    parser.add_argument("--staging-gib", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--probe", action="store_true", help="timelines of (b) and variants")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    daemon = Daemon(
        tempfile.mkdtemp(prefix="ws-bench-"),
        binary=args.bin,
        backend="cuda",
        log=out / "bench-daemon.log",
        log_level=None,
        ready_s=60,
    )
    try:
        client = daemon.client
        pinned = wsgpu.pinned_h2d_gbps(reps=10)
        rate = matmul_rate()
        manifest, upload_s = upload_model(client, int(args.size_gib * GiB))
        total = manifest.total_bytes
        session = wsgpu.Session(
            client,
            manifest.model_id,
            budget=int(args.staging_gib * GiB),
            staging=int(args.staging_gib * GiB),
            manifest=manifest,
            label="stream-bench",
        )
        order = list(range(len(manifest.tensors)))
        run_pass(session, order)  # records nothing yet: the plan follows
        session.plan(order)
        run_pass(session, order)  # warm-up with the plan
        before = session.stats()
        cpu_a, cpu_b = [], []
        transfer = [run_pass(session, order, cpu=cpu_a) for _ in range(args.steps)]
        after = session.stats()
        copied = after.bytes_copied - before.bytes_copied
        transfer_s = statistics.median(transfer)
        achieved = copied / args.steps / transfer_s / 1e9

        # (b): x[M, k] @ w[k, 4096] with M = rate / bandwidth: compute time = transfer time.
        m_rows = int(rate / (pinned * 1e9))
        ks = {s // 8192 for s in (t.nbytes for t in manifest.tensors)}
        xs = {k: torch.randn(m_rows, k, device="cuda", dtype=torch.bfloat16) for k in ks}

        def mm(x, w):
            return x @ w

        resident = {k: torch.randn(k, 4096, device="cuda", dtype=torch.bfloat16) for k in ks}
        torch.cuda.synchronize()

        def compute_alone():
            torch.cuda.synchronize()
            t = time.monotonic()
            for tensor in manifest.tensors:
                k = tensor.nbytes // 8192
                mm(xs[k], resident[k])
            torch.cuda.synchronize()
            return time.monotonic() - t

        compute_alone()
        compute_s = statistics.median(compute_alone() for _ in range(args.steps))
        both = [run_pass(session, order, mm, xs, cpu=cpu_b) for _ in range(args.steps)]
        stats = session.stats()
        both_s = statistics.median(both)
        bound = max(compute_s, transfer_s)
        probe = {}
        if args.probe:
            tl = []
            probe["b_step_s"] = round(run_pass(session, order, mm, xs, timeline=tl), 4)
            probe["b_wait_busy_ms"] = gaps(tl)
            tl = []
            probe["early_free_step_s"] = round(
                run_pass(session, order, mm, xs, timeline=tl, early_free=True), 4
            )
            probe["early_free_wait_busy_ms"] = gaps(tl)
            tl = []
            probe["no_client_wait_step_s"] = round(
                run_pass(session, order, mm, xs, timeline=tl, no_wait=True), 4
            )
            probe["no_client_wait_wait_busy_ms"] = gaps(tl)
            print("probe", probe, flush=True)
        session.close()
    finally:
        daemon.stop(timeout=60)

    result = {
        "device": torch.cuda.get_device_name(0),
        "model_bytes": total,
        "groups": len(manifest.tensors),
        "group_sizes_mib": SIZES_MIB,
        "staging_bytes": int(args.staging_gib * GiB),
        "upload_commit_and_pin_s": round(upload_s, 2),
        "pinned_h2d_gbps": round(pinned, 2),
        "matmul_tflops": round(rate / 1e12, 1),
        "a_no_compute": {
            "step_s_median": round(transfer_s, 4),
            "steps_s": [round(t, 4) for t in transfer],
            "achieved_gbps": round(achieved, 2),
            "ratio_to_pinned": round(achieved / pinned, 3),
            "consumer_loop_s_median": round(statistics.median(cpu_a), 4),
            "target": ">= 0.90",
        },
        "b_matmul_per_group": {
            "m_rows": m_rows,
            "compute_alone_s": round(compute_s, 4),
            "transfer_alone_s": round(transfer_s, 4),
            "step_s_median": round(both_s, 4),
            "steps_s": [round(t, 4) for t in both],
            "ratio_to_max": round(both_s / bound, 3),
            "consumer_loop_s_median": round(statistics.median(cpu_b), 4),
            "target": "<= 1.10",
        },
        "lookahead": LOOKAHEAD,
        "probe": probe,
        "session_stats": {
            "acquires": stats.acquires,
            "hits": stats.hits,
            "misses": stats.misses,
            "reuses": stats.reuses,
            "resyncs": stats.resyncs,
            # This consumer times no wait of its own (no gpu_wait_ns): the daemon's figure.
            "acquire_pending_ms": round(stats.acquire_pending_ns / 1e6, 1),
        },
        "command": "PYTHONPATH=$PWD/client-py/src python3 " + " ".join(sys.argv),
    }
    (out / "stream_bandwidth.json").write_text(json.dumps(result, indent=2))
    a, b = result["a_no_compute"], result["b_matmul_per_group"]
    md = f"""# stream_bandwidth — {result["device"]}

Model: {total / GiB:.1f} GiB in {len(manifest.tensors)} groups of 8–256 MiB, staging
{args.staging_gib:.0f} GiB, median of {args.steps} steps after a warm-up step with the plan.

| measure | value | target |
|---|---|---|
| torch pinned host→device (512 MiB copies) | {pinned:.1f} GB/s | |
| (a) daemon → consumer, no compute | {a["achieved_gbps"]:.1f} GB/s | |
| (a) ratio to pinned | {a["ratio_to_pinned"]:.3f} | ≥ 0.90 |
| (b) compute alone per step | {compute_s * 1e3:.1f} ms | |
| (b) transfer alone per step | {transfer_s * 1e3:.1f} ms | |
| (b) streamed + matmul per step | {both_s * 1e3:.1f} ms | |
| (b) ratio to max(compute, transfer) | {b["ratio_to_max"]:.3f} | ≤ 1.10 |

Command: `{result["command"]}`
"""
    (out / "stream_bandwidth.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
