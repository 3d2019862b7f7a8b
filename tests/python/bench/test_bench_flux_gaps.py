"""tests/bench/flux_gaps.py on a made-up Chrome trace: the device's idle gaps split into late
launches and waits, per phase (by the launch's time), and what the launching thread ran while a
late kernel's launch was still to come."""

from __future__ import annotations

import json

from tests.bench import flux_gaps


def x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


TRACE = [
    x("user_annotation", "ws_forward", 0, 4050),
    x("user_annotation", "ws_backward", 4050, 16000),  # k2 runs in it, launched before
    # Kernel 1, launched at 10, runs 1000-3000.
    x("cuda_runtime", "cudaLaunchKernel", 10, 5, correlation=1),
    x("kernel", "k1", 1000, 2000, tid=7, correlation=1),
    # Kernel 2's launch returns at 4000, after kernel 1 ended at 3000: the device is idle until
    # 4100, launched late. Meanwhile the thread ran aten::linear until 3100, aten::empty
    # 3200-3500 and nothing named for the other 500 us before the launch at 3900.
    x("cpu_op", "aten::linear", 2800, 300),
    x("cpu_op", "aten::empty", 3200, 300),
    x("cuda_runtime", "cudaLaunchKernel", 3900, 100, correlation=2),
    x("kernel", "k2", 4100, 500, tid=7, correlation=2),
    # Kernel 3 is launched in the backward (4300) while kernel 2 runs, but starts at 10600:
    # it waited (for a copy).
    x("cuda_runtime", "cudaLaunchKernel", 4300, 100, correlation=3),
    x("kernel", "k3", 10600, 1000, tid=7, correlation=3),
    # A gap under GAP_US is launch latency, not idleness.
    x("cuda_runtime", "cudaLaunchKernel", 10700, 5, correlation=4),
    x("kernel", "k4", 11603, 100, tid=7, correlation=4),
]


def test_gaps_are_split_by_cause_and_phase(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": TRACE}))
    out = flux_gaps.gaps(str(path))
    assert out == {
        "kernels": 4,
        "kernel_busy_ms": 3.6,
        "kernel_span_ms": 10.7,
        "gpu_idle_launched_late_ms": 1.1,
        "gpu_idle_waiting_on_copies_ms": 6.0,
        "by_phase_ms": {
            "ws_backward": {"busy": 1.1, "late": 0.0, "waiting": 6.0},
            "ws_forward": {"busy": 2.5, "late": 1.1, "waiting": 0.0},
        },
        "late_cpu_ops_ms": {"aten::empty": 0.3, "aten::linear": 0.1},
        "late_no_op_ms": 0.5,
    }
