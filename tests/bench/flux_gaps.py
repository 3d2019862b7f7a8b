"""The GPU's idle gaps in a torch.profiler Chrome trace (from tests/bench/flux_profile.py), split
by cause: a kernel whose launch call returned after the previous kernel ended was launched late
(the CPU was behind); one that was queued earlier waited on something else (an event: a copy).

    python3 tests/bench/flux_gaps.py trace_resident.json.gz trace_weightstream.json.gz
"""

from __future__ import annotations

import gzip
import json
import sys

GAP_US = 5  # shorter gaps are launch latency, not idleness


def gaps(path: str) -> dict:
    with gzip.open(path) if path.endswith(".gz") else open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    launch_end = {
        e["args"]["correlation"]: e["ts"] + e["dur"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    device = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
        key=lambda e: e["ts"],
    )
    kernels = [e for e in device if e.get("cat") == "kernel"]
    late = waiting = 0.0
    end = device[0]["ts"] + device[0]["dur"]
    for e in device[1:]:
        gap = e["ts"] - end
        if gap > GAP_US:
            launched = launch_end.get(e["args"].get("correlation"))
            if launched is not None and launched > end:
                late += gap
            else:
                waiting += gap
        end = max(end, e["ts"] + e["dur"])
    span = max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)
    return {
        "kernels": len(kernels),
        "kernel_busy_ms": round(sum(k["dur"] for k in kernels) / 1e3, 1),
        "kernel_span_ms": round(span / 1e3, 1),
        "gpu_idle_launched_late_ms": round(late / 1e3, 1),
        "gpu_idle_waiting_on_copies_ms": round(waiting / 1e3, 1),
    }


if __name__ == "__main__":
    for trace in sys.argv[1:]:
        print(trace, json.dumps(gaps(trace)))
