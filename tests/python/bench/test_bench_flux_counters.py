"""tests/bench/flux_train.py's per-step counters on the CPU, with torch.cuda's timing and memory
calls stood in for: the daemon's and the client's counters (waits, hit rate, bytes, copy engine
busy) cover the measured steps only, not the warm-up, whose first step copies every group cold
and waits for each."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.bench.benchlib import flux, modes

GROUPS = ("transformer_blocks.0", "single_transformer_blocks.0")
#: What the cold first step adds to each counter, and what each step after it adds.
COLD = {"gpu_wait_ns": 340_000_000, "reply_wait_ns": 90_000_000, "hits": 0, "bytes": 8 << 30}
STEADY = {"gpu_wait_ns": 400_000, "reply_wait_ns": 2_000_000, "hits": 99, "bytes": 20 << 30}


class Event:
    def record(self):
        pass

    def elapsed_time(self, other):
        return 0.0


class Counters:
    """A handle's ``stats()`` and the daemon's copy-busy metric, advanced by each step's
    forward: the first step by ``COLD``, the others by ``STEADY``."""

    def __init__(self):
        self.steps = 0
        self.c = {
            "bytes_copied": 0,
            "hits": 0,
            "acquires": 0,
            "gpu_wait_ns": 0,
            "acquire_pending_ns": 0,
            "reply_wait_ns": 0,
            "reply_waits": 0,
        }
        self.by_group = dict.fromkeys(GROUPS, 0)
        self.busy = 0.0

    def step(self):
        add = COLD if self.steps == 0 else STEADY
        self.steps += 1
        self.c["bytes_copied"] += add["bytes"]
        self.c["hits"] += add["hits"]
        self.c["acquires"] += 100
        self.c["gpu_wait_ns"] += add["gpu_wait_ns"]
        self.c["reply_wait_ns"] += add["reply_wait_ns"]
        self.c["reply_waits"] += 1
        for g in GROUPS:
            self.by_group[g] += add["gpu_wait_ns"] // len(GROUPS)
        self.busy += 1.0 if add is COLD else 0.25

    def stats(self):
        return {
            **self.c,
            "reply_wait_by_group": dict(self.by_group),
            "gpu_wait_by_group": dict(self.by_group),
        }


class Model(torch.nn.Module):
    def __init__(self, counters: Counters):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.counters = counters

    def forward(self, return_dict=False):
        self.counters.step()
        return ((self.w * 2).sum().reshape(1),)


def test_counters_cover_the_measured_steps_not_the_cold_warm_up(monkeypatch):
    counters = Counters()
    for name, value in {
        "synchronize": lambda: None,
        "Event": lambda enable_timing=False: Event(),
        "reset_peak_memory_stats": lambda: None,
        "reset_accumulated_memory_stats": lambda: None,
        "max_memory_allocated": lambda: 0,
        "max_memory_reserved": lambda: 0,
        "memory_stats": lambda: {"num_device_alloc": 0},
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(flux, "batch", lambda: {})
    monkeypatch.setattr(modes, "scrape", lambda args, name: counters.busy)
    monkeypatch.setattr(modes, "nvidia_smi_used_gib", lambda: None)
    session = SimpleNamespace(id="s-1", groups=[SimpleNamespace(name="g", resident=False)])
    handle = SimpleNamespace(stats=counters.stats, session=session)
    listed = SimpleNamespace(session_id="s-1", staging_bytes=0, resident_bytes=0)
    client = SimpleNamespace(list_sessions=lambda: [listed])
    args = SimpleNamespace(warmup=3, measured=10)
    r = {}
    modes.measure_budget(args, handle, client, Model(counters), r)
    assert counters.steps == 13
    assert len(r["steps_s"]) == 10
    # The steady steps' figures exactly: none of the cold step's.
    assert r["gpu_wait_s_per_step"] == 0.0004
    assert r["reply_wait_s_per_step"] == 0.002
    assert r["reply_waits_per_step"] == 1.0
    assert r["hit_rate"] == 0.99
    assert r["bytes_per_step_gib"] == 20.0
    assert r["copy_busy_s_per_step"] == 0.25
    assert r["gpu_wait_ms_per_step_by_group"] == dict.fromkeys(GROUPS, 0.2)
