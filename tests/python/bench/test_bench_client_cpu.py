"""tests/bench/flux_train.py's ``client_cpu_probe`` on the CPU, against the daemon's host
backend: one step of a small model streamed in 8 bits by block, its blocks in torch's
non-reentrant checkpoint, with the client's calls timed per pass. The counts are exact (what
each pass calls is known); the times are only checked to be there."""

from __future__ import annotations

import torch
import weightstream.torch as wst

from tests.bench.benchlib import modes
from tests.python.torch.test_torch import inputs, make_model, train
from tests.python.torch.test_torch_fp8 import attach_fp8


def test_the_client_cpu_probe_counts_each_pass_s_calls(daemon, monkeypatch):
    model = make_model()
    model.ckpt = "non-reentrant"
    handle = attach_fp8(daemon, model, "streamed", dequantize="group")
    xs = inputs(3, torch.float32)
    train(model, xs[:2])  # the first step records the plan
    monkeypatch.setattr(modes, "steps", lambda m, n: train(m, xs[2:3]))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    record = {}
    modes.client_cpu_probe(model, handle, record)
    split = record["client_cpu_ms_per_pass"]
    assert set(split) == {"forward", "backward"}
    calls = {p: {k: v["calls"] for k, v in cell.items()} for p, cell in split.items()}
    streamed = len(handle.streamed)
    in_blocks = sum(n.startswith("blocks.") for n in handle.streamed)
    groups = len(handle.session.groups)
    # The forward calls every streamed layer and acquires each group once; the backward
    # recomputes the checkpointed blocks' layers and acquires each group again.
    assert calls["forward"]["layer"] == streamed
    assert calls["backward"]["layer"] == in_blocks
    for phase in ("forward", "backward"):
        assert calls[phase]["wait"] == calls[phase]["dequantize_group"] == groups, calls
    # The look-ahead sends each acquire ahead of its wait, some in the pass before: the step
    # sends as many as it waits for, and gives each group back once per pass.
    assert sum(c["submit"] for c in calls.values()) == 2 * groups, calls
    assert sum(c.get("release", 0) for c in calls.values()) == 2 * groups, calls
    assert handle._lookahead is not None
    assert all(v["ms"] > 0 for cell in split.values() for v in cell.values())
    # The client's methods are its own again.
    assert "call" not in wst.handle.Handle._dequantize_group.__qualname__
    assert "call" not in handle._lookahead.submit.__qualname__
    handle.detach(release=True)
