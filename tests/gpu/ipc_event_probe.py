"""Probe of what the daemon assumes about CUDA interprocess events (run on the GPU machine).
The parent plays the daemon (it creates the event and exports it), the child plays a trainer
(it opens the handle). One side records the event behind a kernel of ~50 ms and tells the
other over a pipe; the other side then queries the event, or makes a stream wait on it.

    python3 -m tests.gpu.ipc_event_probe [--out DIR]

Per direction, over TRIALS trials: whether a query right after the record says "not ready"
(it must: the daemon overwrites staged bytes once a free event says done), and how long after
the recorder saw its work finish the other side sees it (polled query; stream wait), median
and max in ms. Written to ipc_event_probe.json; exit status 1 if a query said "ready" early.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

SLEEP_CYCLES = 100_000_000  # ~50 ms on an H200
TRIALS = 5


def record_behind_kernel(torch, event, stream, conn):
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        event.record(stream)
    conn.send("recorded")
    stream.synchronize()
    conn.send(time.monotonic())


def observe(torch, event, conn, how: str) -> tuple[bool, float]:
    """Waits for the other side's record; returns (query said ready at once, lag in s)."""
    assert conn.recv() == "recorded"
    early = event.query()
    if how == "query":
        while not event.query():
            pass
        seen = time.monotonic()
    else:
        stream = torch.cuda.Stream()
        after = torch.cuda.Event()
        with torch.cuda.stream(stream):
            stream.wait_event(event)
            after.record(stream)
        after.synchronize()
        seen = time.monotonic()
    done = conn.recv()
    return early, seen - done


def child_main(handle: bytes, conn) -> None:
    import torch

    event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", 0), handle)
    stream = torch.cuda.Stream()
    while True:
        task = conn.recv()
        if task is None:
            break
        role, how = task
        if role == "record":
            record_behind_kernel(torch, event, stream, conn)
        else:
            conn.send(observe(torch, event, conn, how))
    conn.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    mp.set_start_method("spawn")
    event = torch.cuda.Event(interprocess=True)
    event.record()
    torch.cuda.synchronize()
    here, there = mp.Pipe()
    child = mp.Process(target=child_main, args=(event.ipc_handle(), there))
    child.start()
    stream = torch.cuda.Stream()
    results = {}
    for how in ("query", "stream_wait"):
        # The trainer records (a free event), the daemon observes.
        trials = []
        for _ in range(TRIALS):
            here.send(("record", how))
            trials.append(observe(torch, event, here, how))
        results[f"opener_records_creator_{how}"] = trials
        # The daemon records (a ready event), the trainer observes.
        trials = []
        for _ in range(TRIALS):
            here.send(("observe", how))
            record_behind_kernel(torch, event, stream, here)
            trials.append(here.recv())
        results[f"creator_records_opener_{how}"] = trials
    here.send(None)
    child.join()

    summary, ok = {}, True
    for name, trials in results.items():
        early = [e for e, _ in trials]
        lags = [lag * 1e3 for _, lag in trials]
        ok = ok and not any(early)
        summary[name] = {
            "ready_at_once": early,
            "lag_ms_median": round(statistics.median(lags), 3),
            "lag_ms_max": round(max(lags), 3),
        }
    summary["ok"] = ok
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out, "ipc_event_probe.json").write_text(json.dumps(summary, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
