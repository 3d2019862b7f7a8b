"""The GPU's idle gaps in a torch.profiler Chrome trace (from tests/bench/flux_profile.py), split
by cause: a kernel whose launch call returned after the previous kernel ended was launched late
(the CPU was behind); one that was queued earlier waited on something else (an event: a copy).
Per phase too (``ws_forward``, ``ws_backward``, ``ws_optimizer``: the ranges flux_profile
records; a kernel belongs to the phase its launch was issued in), and, for the late gaps, what
the launching thread ran meanwhile: the CPU ops overlapping each gap's interval (inclusive
time, so nested ops count in each), and the part no op covered (Python between ops).

    python3 -m tests.bench.flux_gaps trace_resident.json.gz trace_weightstream.json.gz
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import sys

GAP_US = 5  # shorter gaps are launch latency, not idleness
PHASES = ("ws_forward", "ws_backward", "ws_optimizer")
#: How many CPU ops to name for the late gaps.
TOP = 15


def _phase_of(ts: float, phases: list[tuple[float, float, str]]) -> str:
    for start, end, name in phases:
        if start <= ts <= end:
            return name
    return "other"


class _Thread:
    """One CPU thread's ops, for the time they cover within an interval."""

    def __init__(self, ops: list[dict]):
        self.ops = sorted(ops, key=lambda e: e["ts"])
        self.starts = [e["ts"] for e in self.ops]
        longest = max((e["dur"] for e in self.ops), default=0)
        self.longest = longest

    def overlapping(self, lo: float, hi: float):
        i = bisect.bisect_left(self.starts, lo - self.longest)
        for e in self.ops[i:]:
            if e["ts"] >= hi:
                break
            a, b = max(lo, e["ts"]), min(hi, e["ts"] + e["dur"])
            if b > a:
                yield e, a, b


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def gaps(path: str) -> dict:
    with gzip.open(path) if path.endswith(".gz") else open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    phases = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("cat") == "user_annotation" and e.get("name") in PHASES
    )
    threads: dict = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver"):
            threads[e["tid"]].append(e)
    threads = {tid: _Thread(ops) for tid, ops in threads.items()}
    device = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
        key=lambda e: e["ts"],
    )
    kernels = [e for e in device if e.get("cat") == "kernel"]
    by_phase = collections.defaultdict(lambda: {"busy": 0.0, "late": 0.0, "waiting": 0.0})
    late_ops: collections.Counter = collections.Counter()
    late_uncovered = 0.0
    late = waiting = 0.0
    end = device[0]["ts"] + device[0]["dur"]
    for e in device:
        launch = launches.get(e["args"].get("correlation"))
        phase = by_phase[_phase_of(launch["ts"], phases) if launch else "other"]
        if e.get("cat") == "kernel":
            phase["busy"] += e["dur"]
        gap = e["ts"] - end
        if gap > GAP_US:
            launched = None if launch is None else launch["ts"] + launch["dur"]
            if launched is not None and launched > end:
                late += gap
                phase["late"] += gap
                # What the launching thread ran between the device going idle and the launch.
                spans = []
                for op, a, b in threads[launch["tid"]].overlapping(end, launch["ts"]):
                    late_ops[op["name"]] += b - a
                    spans.append((a, b))
                late_uncovered += max(0.0, launch["ts"] - end) - _union(spans)
            else:
                waiting += gap
                phase["waiting"] += gap
        end = max(end, e["ts"] + e["dur"])
    span = max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)
    ms = lambda us: round(us / 1e3, 1)  # noqa: E731
    return {
        "kernels": len(kernels),
        "kernel_busy_ms": ms(sum(k["dur"] for k in kernels)),
        "kernel_span_ms": ms(span),
        "gpu_idle_launched_late_ms": ms(late),
        "gpu_idle_waiting_on_copies_ms": ms(waiting),
        "by_phase_ms": {
            name: {k: ms(v) for k, v in p.items()} for name, p in sorted(by_phase.items())
        },
        "late_cpu_ops_ms": {name: ms(us) for name, us in late_ops.most_common(TOP)},
        "late_no_op_ms": ms(late_uncovered),
    }


if __name__ == "__main__":
    for trace in sys.argv[1:]:
        print(trace, json.dumps(gaps(trace), indent=1))
