"""Where a sampled process spent its CPU: a py-spy raw profile (``py-spy record -f raw``,
optionally ``--native --idle --subprocesses``) summed per process, over the samples whose stack
passes through one of the ``--under`` functions (by default a bench's step loop, ``timing``,
and autograd's worker threads, which run the backward), without those of a waiting thread
(``IDLE``; ``--idle`` keeps them), as JSON: per process the samples counted, the share of each
function's inclusive samples (the largest ``--top``) and of the stacks containing each
``--match`` string.

    py-spy record -r 50 --native --subprocesses -f raw -o spy.txt -- \
        python3 -m tests.bench.flux_train ...
    python3 -m tests.bench.spy_summary spy.txt --match parseChosenWorkspaceSize
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

#: The step loop of tests/bench/flux_train.py, and autograd's worker threads.
UNDER = ["timing", "torch::autograd::Engine::thread_main"]
#: Leaf frames of a thread that waits rather than runs.
IDLE = ("pthread_cond_wait", "pthread_cond_timedwait", "futex", "epoll_wait", "poll")
#: A frame's location: " (file:line)" or a native frame's "(args) (lib)"; names are compared
#: without it.
_LOCATION = re.compile(r"\s*\((?:[^()]|\([^()]*\))*\)\s*$")


def name(frame: str) -> str:
    return _LOCATION.sub("", frame)


def summarize(
    lines, under: list[str], matches: list[str], top: int, keep_idle: bool = False
) -> dict:
    """The summary of the profile's ``lines`` (see the module's doc)."""
    per: dict[str, dict] = {}
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        processes = [i for i, f in enumerate(frames) if f.startswith("process ")]
        process = frames[processes[-1]] if processes else ""
        frames = frames[processes[-1] + 1 :] if processes else frames
        names = [name(f) for f in frames]
        if not any(u in names for u in under):
            continue
        if not keep_idle and any(i in f for f in names[-3:] for i in IDLE):
            continue
        p = per.setdefault(
            process, {"samples": 0, "inclusive": collections.Counter(), "matched": {}}
        )
        p["samples"] += n
        for f in dict.fromkeys(names):  # once per stack, in the stack's order
            p["inclusive"][f] += n
        for m in matches:
            if any(m in f for f in frames):
                p["matched"][m] = p["matched"].get(m, 0) + n
    out = {}
    for process, p in per.items():
        total = p["samples"]
        out[process] = {
            "samples": total,
            "matched_share": {m: round(c / total, 4) for m, c in p["matched"].items()},
            "inclusive_share": {f: round(c / total, 4) for f, c in p["inclusive"].most_common(top)},
        }
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile")
    parser.add_argument(
        "--under", action="append", help=f"a function to count under (default: {UNDER})"
    )
    parser.add_argument("--match", action="append", default=[], help="a frame substring")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--idle", action="store_true", help="keep waiting threads' samples")
    args = parser.parse_args(argv)
    with open(args.profile, errors="replace") as f:
        summary = summarize(f, args.under or UNDER, args.match, args.top, args.idle)
    json.dump(summary, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
