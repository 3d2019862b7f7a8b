"""Where a capped link idles: the daemon's copy timeline (``WEIGHTSTREAM_LOG=
warn,weightstream::timeline=debug``, e.g. ``sampling.py --daemon-log``) replayed against the
link's rate. Each dispatched copy holds the link for its bytes over ``--rate`` from when it was
dispatched or the previous one's end, whichever is later; a dispatch after that end leaves the
link idle in between. Each idle gap is put down to the copy dispatched after it: ``late``, the
session submitted it only after the link fell idle (it had not asked: e.g. its staging arena
full until a group was released), or ``pending``, submitted before (it waited on its readers'
free events, or on the copy thread).

    python3 -m tests.bench.timeline_gaps daemon.log --rate 25GB/s [--from ISO --to ISO]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gzip
import json
import re
import sys

LINE = re.compile(r"^(\S+)\s+DEBUG weightstream::timeline: (.+?)((?: \w+=\S+)*)$")
FIELD = re.compile(r"(\w+)=(\S+)")


def parse_rate(text: str) -> float:
    """``25GB/s`` -> bytes per second."""
    m = re.fullmatch(r"([\d.]+)\s*(G|M)B/s", text)
    if not m:
        raise SystemExit(f"--rate {text}: expected e.g. 25GB/s")
    return float(m.group(1)) * (1e9 if m.group(2) == "G" else 1e6)


def events(lines) -> list[dict]:
    """The timeline's events in order: ``t`` (seconds), ``event`` (the message), its fields."""
    out = []
    for line in lines:
        m = LINE.match(line.rstrip("\n"))
        if not m:
            continue
        t = datetime.datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()
        out.append({**dict(FIELD.findall(m.group(3))), "t": t, "event": m.group(2)})
    return out


def gaps(evs: list[dict], rate: float, min_gap_s: float = 1e-4) -> dict:
    """The link's busy and idle time over the dispatched copies of ``evs``; each idle gap put
    down to the copy dispatched after it: submitted before the link fell idle (``pending``: it
    waited on its readers' free events or the copy thread) or only after (``late``: the
    session had not asked yet)."""
    submitted: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
    link_end = start = None
    busy = 0.0
    idle = {"late": 0.0, "pending": 0.0}
    count = {"late": 0, "pending": 0}
    longest = []
    for e in evs:
        key = (e.get("session"), e.get("group"))
        if e["event"] == "copy submitted":
            submitted[key].append(e["t"])
        elif e["event"] == "copy dispatched" and "bytes" in e:
            t, dur = e["t"], int(e["bytes"]) / rate
            asked = submitted[key].popleft() if submitted[key] else t
            if start is None:
                start = t
            if link_end is not None and t - link_end > min_gap_s:
                gap = t - link_end
                kind = "pending" if asked <= link_end else "late"
                count[kind] += 1
                idle[kind] += gap
                longest.append((gap, kind, link_end - start, e.get("group"), t - asked))
            link_end = (t if link_end is None else max(t, link_end)) + dur
            busy += dur
    longest.sort(reverse=True)
    return {
        "span_s": (link_end - start) if start is not None else 0.0,
        "busy_s": busy,
        "idle_s": idle,
        "gaps": count,
        "longest": [
            {"gap_s": g, "kind": k, "at_s": at, "group": grp, "submitted_before_s": ago}
            for g, k, at, grp, ago in longest[:10]
        ],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--rate", required=True, help="the link's cap, e.g. 25GB/s")
    ap.add_argument("--from", dest="since", help="first event's time (ISO), e.g. a phase's")
    ap.add_argument("--to", dest="until", help="last event's time (ISO)")
    args = ap.parse_args(argv)
    opener = gzip.open if args.log.endswith(".gz") else open
    with opener(args.log, "rt") as f:
        evs = events(f)

    def ts(text):
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()

    if args.since:
        evs = [e for e in evs if e["t"] >= ts(args.since)]
    if args.until:
        evs = [e for e in evs if e["t"] <= ts(args.until)]
    print(json.dumps(gaps(evs, parse_rate(args.rate)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
