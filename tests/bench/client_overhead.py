"""Micro-benchmark: what one acquire+release costs the trainer's Python process, with the
groups already staged (nothing resident, nothing to copy: the daemon answers from its staging
arena), so that what is measured is the client.

Per acquire+release pair, over N pairs on the trainer thread:
- ``thread_cpu_us``: CPU time of the trainer thread (``time.thread_time_ns``);
- ``process_cpu_us``: CPU time of the whole trainer process (its client threads included:
  grpcio's and the reader thread before, the native runtime's after);
- ``wall_us``: elapsed time;
- ``gil_us``: how long the GIL was held by anything but a probe thread that spins on a counter
  meanwhile: ``(1 - probe share) * wall``, the probe's share being its count against its rate
  alone (``sys.setswitchinterval`` set to ``--switch-interval`` so that it yields promptly);
  ``wall_probe_us`` is the pair's time with the probe running.

Runs against whichever ``weightstream`` package is imported (``PYTHONPATH``): the native
client, or the grpcio client of an older commit (``git archive 573cf88 client-py/src``). Starts
its own daemon (``--bin``) on a temporary socket. Merges its result into ``--out``
(client_overhead.json, under ``--label``) and rewrites client_overhead.md next to it.

    PYTHONPATH=client-py/src python -m tests.bench.client_overhead \\
        --bin target/debug/weightstream --label native \\
        --out tests/bench/results/client_overhead.json

On the GPU machine: ``--backend cuda --device cuda`` (the same groups, streamed to a device).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from tests.daemon import Daemon

GROUP_BYTES = 64 << 10


class Probe:
    """A thread that counts while it holds the GIL."""

    def __init__(self):
        self.count = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self):
        while not self.stop.is_set():
            self.count += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def probe_rate(seconds: float) -> float:
    """Counts per second with the GIL free (the main thread sleeps)."""
    with Probe() as p:
        time.sleep(0.05)
        c0, t0 = p.count, time.perf_counter()
        time.sleep(seconds)
        return (p.count - c0) / (time.perf_counter() - t0)


def loop(session, groups: int, pairs: int) -> tuple[int, int, int]:
    w0, t0, p0 = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
    for i in range(pairs):
        session.release(session.acquire(i % groups))
    return (
        time.perf_counter_ns() - w0,
        time.thread_time_ns() - t0,
        time.process_time_ns() - p0,
    )


def measure(session, args) -> dict:
    runs = []
    for _ in range(args.repeats):
        wall, thread_cpu, process_cpu = loop(session, args.groups, args.pairs)
        rate = probe_rate(0.5)
        with Probe() as p:
            c0 = p.count
            wall_p, _, _ = loop(session, args.groups, args.pairs)
            counted = p.count - c0
        share = min(1.0, counted / (rate * wall_p / 1e9))
        runs.append(
            {
                "wall_us": wall / args.pairs / 1e3,
                "thread_cpu_us": thread_cpu / args.pairs / 1e3,
                "process_cpu_us": process_cpu / args.pairs / 1e3,
                "wall_probe_us": wall_p / args.pairs / 1e3,
                "gil_us": (1 - share) * wall_p / args.pairs / 1e3,
                "probe_share": share,
            }
        )
    keys = runs[0].keys()
    return {
        "median": {k: round(statistics.median(r[k] for r in runs), 3) for k in keys},
        "runs": runs,
    }


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_md(results: dict, path: Path):
    lines = [
        "# Client overhead per acquire+release (tests/bench/client_overhead.py)",
        "",
        "Groups already staged (64 KiB each, none resident), one acquire+release pair after",
        "another on the trainer thread; microseconds per pair: median (min–max) of the repeats.",
        "`GIL held` is how long the GIL was held by anything but a probe thread spinning",
        "meanwhile. The machine is shared (2 cores, other builds running: see the load",
        "averages): compare rows of one run more than runs.",
        "",
    ]
    for backend in sorted({r["backend"] for r in results["runs"].values()}):
        lines += [
            f"## {results['machines'].get(backend, backend)} ({backend} backend)",
            "",
            "| client | wall | trainer thread CPU | process CPU | GIL held | wall with probe |",
            "|---|---|---|---|---|---|",
        ]
        for label, r in results["runs"].items():
            if r["backend"] != backend:
                continue
            cells = []
            for key in ("wall_us", "thread_cpu_us", "process_cpu_us", "gil_us", "wall_probe_us"):
                values = [run[key] for run in r["runs"]]
                cells.append(f"{r['median'][key]:.1f} ({min(values):.0f}–{max(values):.0f})")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
        for label, r in results["runs"].items():
            if r["backend"] == backend:
                lines.append(
                    f"- {label}: `{r['command']}` (commit {r['commit']}, {r['when']}; "
                    f"load average {r['load_average'][0]} then {r['load_average'][1]}, "
                    f"daemon hits {r['daemon_hits']})"
                )
        lines.append("")
    if "cuda" not in {r["backend"] for r in results["runs"].values()}:
        lines += [
            "## GPU machine: not run yet",
            "",
            "Run the same script there with `--backend cuda --device cuda` against the wheel",
            "(native) and against the grpcio package of 573cf88 (before).",
            "",
        ]
    path.write_text("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin", default="target/debug/weightstream")
    parser.add_argument("--backend", default="host", choices=["host", "cuda"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--switch-interval", type=float, default=1e-4)
    parser.add_argument("--label", required=True)
    parser.add_argument("--out", default="tests/bench/results/client_overhead.json")
    args = parser.parse_args()
    sys.setswitchinterval(args.switch_interval)

    import weightstream

    native = getattr(weightstream, "_native", None) is not None or os.path.exists(
        os.path.join(os.path.dirname(weightstream.__file__), "_native.abi3.so")
    )
    with tempfile.TemporaryDirectory() as tmp:
        daemon = Daemon(tmp, binary=args.bin, backend=args.backend, ready_s=60)
        try:
            client = daemon.client
            tensors = {
                f"g{i}": torch.full((GROUP_BYTES // 4,), float(i)) for i in range(args.groups)
            }
            manifest, _ = client.upload_model("overhead", tensors)
            budget = args.groups * GROUP_BYTES
            session = client.open_session(
                manifest.model_id,
                [(n, [n]) for n in tensors],
                budget,
                staging_bytes=budget,
                device=args.device,
            )
            loop(session, args.groups, 2 * args.groups)  # every group staged once
            threads_before = threading.active_count()
            load_before = os.getloadavg()[0]
            result = measure(session, args)
            load_after = os.getloadavg()[0]
            stats = session.stats()
            session.close()
        finally:
            daemon.stop(timeout=30)
    result.update(
        {
            "backend": args.backend,
            "client": "native (weightstream._native)" if native else "grpcio",
            "package": os.path.dirname(weightstream.__file__),
            "python_threads": threads_before,
            "pairs": args.pairs,
            "groups": args.groups,
            "group_bytes": GROUP_BYTES,
            "switch_interval": args.switch_interval,
            "daemon_hits": f"{stats.hits}/{stats.acquires}" if stats else None,
            "load_average": [round(load_before, 2), round(load_after, 2)],
            "command": f"PYTHONPATH={os.environ.get('PYTHONPATH', '')} "
            + shlex.join(["python", *sys.argv]),
            "commit": commit(),
            "when": time.strftime("%Y-%m-%d"),
        }
    )
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {"runs": {}, "machines": {}}
    results["runs"][args.label] = result
    machine = f"{platform.node() or 'this machine'}: {os.cpu_count()} cores"
    results["machines"][args.backend] = (
        "build machine, " + machine if args.backend == "host" else "GPU machine, " + machine
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    write_md(results, out.with_suffix(".md"))
    print(json.dumps(result["median"], indent=2))


if __name__ == "__main__":
    main()
