"""Two DDP ranks (gloo on the CPU) against one daemon on its host backend: one host copy of the
model, the ranks' LoRA parameters equal after every step, and equal to one process training on
the same global batches without weightstream.

Equality (torch.equal) holds against the single-process run that takes each global batch as the
ranks' halves (gradient accumulation over the two micro-batches, then divided by 2): DDP
divides each rank's gradient by the world size and gloo sums the two; halving is exact and a
sum of two floats does not depend on its order, so both give (g0 + g1) / 2 to the bit. Against
one forward over the whole batch the results are close, not equal: the loss's mean and the
weight gradients' GEMMs reduce over all eight samples at once instead of two sums of four
(another summation order), so that comparison has a bound (``assert_close``'s float32
defaults)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.python.torch.ddp_worker import STEPS, make_model, reference

WORLD = 2
WORKER = Path(__file__).with_name("ddp_worker.py")


def run_ranks(daemon, tmp_path: Path) -> list[dict]:
    store = tmp_path / "gloo-store"
    outs = [tmp_path / f"rank{r}.pt" for r in range(WORLD)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(WORLD), daemon.socket, str(store), str(o)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r, o in enumerate(outs)
    ]
    errors = []
    for r, p in enumerate(ranks):
        try:
            _, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in ranks:
                q.kill()
            raise
        if p.returncode != 0:
            errors.append(f"rank {r} exited {p.returncode}:\n{err[-4000:]}")
    assert not errors, "\n".join(errors)
    return [torch.load(o) for o in outs]


def test_two_ranks_share_one_copy_and_train_as_one_process(daemon, tmp_path):
    results = run_ranks(daemon, tmp_path)
    model_id = results[0]["model_id"]

    # One host copy: one model, the store's bytes are its bytes, both sessions stream it.
    listed = results[0]["listed"]
    streamed = results[0]["streamed"]
    assert streamed and results[1]["streamed"] == streamed
    model = make_model()
    params = dict(model.named_parameters())
    raw = sum(params[n].numel() * params[n].element_size() for n in streamed)
    assert [m[0] for m in listed["models"]] == [model_id]
    assert listed["store_bytes"] == listed["models"][0][1]
    assert raw <= listed["store_bytes"] < 2 * raw, (raw, listed)
    assert listed["sessions"] == [model_id] * WORLD
    assert all(r["stats"]["acquires"] > 0 for r in results), [r["stats"] for r in results]

    accumulated = reference(WORLD, micro_batches=True)
    one_forward = reference(WORLD, micro_batches=False)
    rank0, rank1 = (r["after"] for r in results)
    assert len(rank0) == len(rank1) == STEPS
    for step in range(STEPS):
        assert rank0[step].keys() == accumulated[step].keys()
        for name in rank0[step]:
            a, b = rank0[step][name], rank1[step][name]
            assert torch.equal(a, b), f"step {step}: ranks differ in {name}"
            assert torch.equal(a, accumulated[step][name]), (
                f"step {step}: {name} differs from the single-process run "
                f"(max |diff| {(a - accumulated[step][name]).abs().max().item():.3g})"
            )
            torch.testing.assert_close(a, one_forward[step][name])

    # Every session closed, rank 0 released the upload: nothing left in the daemon.
    assert daemon.client.list_models().models == []
    assert daemon.client.list_sessions() == []
