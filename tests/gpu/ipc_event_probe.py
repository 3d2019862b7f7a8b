"""Probe of what the daemon assumes about CUDA interprocess events (run on the GPU machine):
the process that created an event (the daemon) queries it after another process (a trainer)
recorded it behind long-running work, and told the creator so over a pipe.

    python3 tests/gpu/ipc_event_probe.py [--out DIR]

Checks, each printed and written to ipc_event_probe.json:
- query_first_record: the opener records the event once behind a ~0.5 s kernel; the creator's
  query right after must say "not ready".
- query_rerecord: the opener records an already-completed event again behind a long kernel;
  the creator's query must say "not ready" (the daemon relies on this for every free event).
- opener_queries: the other direction (the creator records, the opener queries).
- stream_wait: the creator's stream waits on the opener's record; a kernel queued after the
  wait must finish after the opener's long kernel, and how much later is printed.
Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

SLEEP_CYCLES = 1_000_000_000  # ~0.5 s on an H200


def opener(handle: bytes, conn) -> None:
    import torch

    dev = torch.device("cuda", 0)
    event = torch.cuda.Event.from_ipc_handle(dev, handle)
    stream = torch.cuda.Stream(dev)
    for step in conn.recv():
        with torch.cuda.stream(stream):
            if step == "record_idle":
                event.record(stream)
                stream.synchronize()
            else:
                torch.cuda._sleep(SLEEP_CYCLES)
                event.record(stream)
        conn.send(("recorded", time.monotonic()))
        if step != "record_idle":
            stream.synchronize()
            conn.send(("done", time.monotonic()))
    # 4. The other direction: the creator recorded behind a long kernel; query it here.
    conn.recv()
    first = event.query()
    event.synchronize()
    conn.send((first, event.query()))
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
    child = mp.Process(target=opener, args=(event.ipc_handle(), there))
    child.start()
    results = {}

    # 1. First record by the opener, behind a long kernel.
    here.send(["record_long", "record_idle", "record_long", "wait"])
    _, t_rec = here.recv()
    results["query_first_record"] = {"ready_right_after_record": event.query()}
    _, t_done = here.recv()
    results["query_first_record"]["ready_after_done"] = event.query()

    # 2. The opener records an idle (completed) event, then again behind a long kernel.
    here.recv()
    assert event.query()
    _, t_rec = here.recv()
    results["query_rerecord"] = {"ready_right_after_record": event.query()}
    _, t_done = here.recv()
    results["query_rerecord"]["ready_after_done"] = event.query()

    # 3. Stream wait on the opener's record.
    stream = torch.cuda.Stream()
    _, t_rec = here.recv()
    with torch.cuda.stream(stream):
        stream.wait_event(event)
        x = torch.ones(1, device="cuda")
        x += 1
        after = torch.cuda.Event()
        after.record(stream)
    after.synchronize()
    t_mine = time.monotonic()
    _, t_done = here.recv()
    results["stream_wait"] = {
        "mine_finished_after_theirs": t_mine >= t_done - 0.002,
        "lag_ms": round((t_mine - t_done) * 1e3, 3),
        "their_kernel_ms": round((t_done - t_rec) * 1e3, 1),
    }
    # 4. The creator records behind a long kernel, the opener queries.
    torch.cuda._sleep(SLEEP_CYCLES)
    event.record()
    here.send("go")
    first, later = here.recv()
    results["opener_queries"] = {"ready_right_after_record": first, "ready_after_done": later}
    child.join()

    ok = (
        results["query_first_record"]["ready_right_after_record"] is False
        and results["query_first_record"]["ready_after_done"] is True
        and results["query_rerecord"]["ready_right_after_record"] is False
        and results["query_rerecord"]["ready_after_done"] is True
        and results["stream_wait"]["mine_finished_after_theirs"]
        and results["opener_queries"]["ready_right_after_record"] is False
    )
    results["ok"] = ok
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out, "ipc_event_probe.json").write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
