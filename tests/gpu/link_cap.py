"""GPU check of the copy bandwidth limit (a PCIe Gen4 link emulated on the H200's Gen5): for each
of --limits (25 and 12 GB/s), runs the daemon with ``--copy-bandwidth-limit`` on the CUDA backend
and streams a synthetic model (4 GiB of 8-256 MiB groups through 2 GiB of staging) to CUDA IPC
consumers for a few seconds.

1. One session: the link's rate, the bytes the daemon copied for the session (its
   ``bytes_copied``) per second of the consumer's steady-state window, is within 5 % of the limit.
2. Two sessions at once, one with a share (``OpenSessionRequest.copy_bandwidth_limit``): the
   capped one's rate stays within 5 % of its share, and the two together within 5 % of the limit.

The consumer's own rate (the bytes of the groups it used) is printed beside it and is not the
link's: the staging arena keeps released groups as a cache, and a group still there when the next
pass needs it is used again without a copy (with 2 GiB of staging over 4 GiB, about a tenth of
the bytes), so it reads above the limit (27.7 GB/s at a 25 GB/s limit).

Prints the numbers (and the daemon's throttle metrics), writes link_cap.json under --out, and
exits non-zero if a check fails. Needs the release binary and the client's wheel (run.sh):

    python3 -m tests.gpu.link_cap --bin target/release/weightstream --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import socket as pysocket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

from tests.bench.card import parse_rate  # noqa: E402
from tests.daemon import Daemon
from tests.gpu import wsgpu

MiB = 1 << 20
GiB = 1 << 30
SIZES_MIB = [8, 16, 32, 64, 128, 256]
LOOKAHEAD = 8
TOLERANCE = 0.05


def model_tensors(total: int) -> dict[str, torch.Tensor]:
    sizes = []
    while sum(sizes) < total:
        sizes.append(SIZES_MIB[len(sizes) % len(SIZES_MIB)] * MiB)
    pattern = torch.randint(0, 256, (256 * MiB,), dtype=torch.uint8, device="cuda").cpu()
    return {f"g{i:04d}": pattern[:s].view(torch.bfloat16) for i, s in enumerate(sizes)}


def copied_by_session(client) -> dict[str, int]:
    """Bytes the daemon has copied for each session so far, by session id."""
    return {s.session_id: s.stats.bytes_copied for s in client.list_sessions()}


class Stream:
    """One consumer: passes over every group, LOOKAHEAD acquires in flight, each group's ready
    event waited on by its own CUDA stream (two consumers in one process must not order each
    other through the default stream)."""

    def __init__(self, session: wsgpu.Session, nbytes: list[int]):
        self.session = session
        self.nbytes = nbytes
        self.order = list(range(len(nbytes)))
        self.stream = torch.cuda.Stream()

    def one_pass(self) -> int:
        s, order = self.session, self.order
        tickets = [s.send_acquire(g) for g in order[:LOOKAHEAD]]
        for i in range(len(order)):
            ticket, staged, _view = s.wait_staged(tickets[i])
            if i + LOOKAHEAD < len(order):
                tickets.append(s.send_acquire(order[i + LOOKAHEAD]))
            s.wait_ready(staged, self.stream)
            s.release(ticket, staged, self.stream)
        self.stream.synchronize()
        return sum(self.nbytes)

    def warm_up(self):
        with torch.cuda.stream(self.stream):
            self.one_pass()  # the plan is sent after it
            self.session.plan(self.order)
            self.one_pass()

    def measure(self, seconds: float, stop: threading.Event | None = None) -> dict:
        """Steady-state window: from the end of a first timed pass (staging already full of
        prefetched groups then, as at the end) to the end of the last; runs until `seconds`
        have passed, or until `stop` is set when given. The link's rate is what the daemon
        copied for this session over the window (``rate_gbps``); ``copied_by_session`` has
        every session's bytes over it, for rates of several together. ``used_gbps`` is the
        consumer's own (reuses of staged copies included)."""
        client = self.session.client
        with torch.cuda.stream(self.stream):
            self.one_pass()
            before = copied_by_session(client)
            began, used, passes = time.monotonic(), 0, 0
            while True:
                used += self.one_pass()
                passes += 1
                elapsed = time.monotonic() - began
                done = stop.is_set() if stop is not None else elapsed >= seconds
                if done and passes >= 2:
                    break
            after = copied_by_session(client)
        copied = {k: v - before.get(k, 0) for k, v in after.items()}
        mine = copied[self.session.id]
        return {
            "bytes_used": used,
            "bytes_copied": mine,
            "seconds": round(elapsed, 4),
            "passes": passes,
            "rate_gbps": round(mine / elapsed / 1e9, 3),
            "used_gbps": round(used / elapsed / 1e9, 3),
            "used_without_copy": round(1 - mine / used, 4),
            "copied_by_session": copied,
        }


def scrape(url: str) -> dict[str, float]:
    """The daemon's device-level metrics of interest, by name."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("weightstream_device_") and "{" in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            out[name] = out.get(name, 0.0) + value
    return out


def within(got: float, want: float) -> bool:
    return abs(got / want - 1.0) <= TOLERANCE


def free_port() -> int:
    with pysocket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_limit(args, limit_text: str, tensors: dict, out: Path, failures: list) -> dict:
    """Both checks under one device limit (its own daemon); appends what failed."""
    limit, share = parse_rate(limit_text), parse_rate(args.share)
    port = free_port()
    daemon = Daemon(
        tempfile.mkdtemp(prefix="ws-linkcap-"),
        "--copy-bandwidth-limit",
        limit_text,
        "--metrics-listen",
        f"127.0.0.1:{port}",
        binary=args.bin,
        backend="cuda",
        log=out / "link-cap-daemon.log",
        log_level=None,
        ready_s=60,
    )
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    result: dict = {"limit_bytes_per_s": limit, "share_bytes_per_s": share}
    at = f"at {limit / 1e9:g} GB/s"
    try:
        client = daemon.client
        manifest, _ = client.upload_model("link-cap", tensors)
        nbytes = [t.nbytes for t in manifest.tensors]
        staging = int(args.staging_gib * GiB)

        def open_stream(label: str, cap: int = 0) -> Stream:
            session = wsgpu.Session(
                client,
                manifest.model_id,
                budget=staging,
                staging=staging,
                manifest=manifest,
                label=label,
                copy_bandwidth_limit=cap,
            )
            return Stream(session, nbytes)

        # 1. One session, the device's limit alone.
        before = scrape(metrics_url)
        one = open_stream("link-cap")
        one.warm_up()
        solo = one.measure(args.seconds)
        after = scrape(metrics_url)
        one.session.close()
        key = "weightstream_device_copy_throttled_seconds_total"
        solo["daemon_throttled_s"] = round(after.get(key, 0.0) - before.get(key, 0.0), 3)
        solo["daemon_limit_gauge"] = after.get(
            "weightstream_device_copy_bandwidth_limit_bytes_per_second"
        )
        result["one_session"] = solo
        ok = within(solo["rate_gbps"] * 1e9, limit)
        print(
            f"[{'PASS' if ok else 'FAIL'}] one session {at}: copied {solo['rate_gbps']} GB/s "
            f"over {solo['seconds']} s; its consumer used {solo['used_gbps']} GB/s, "
            f"{solo['used_without_copy']:.1%} of it staged copies used again: {solo}"
        )
        if not ok:
            failures.append(f"one session {at}: {solo['rate_gbps']} GB/s")
        if solo["daemon_limit_gauge"] != limit:
            failures.append(f"the limit gauge says {solo['daemon_limit_gauge']}, not {limit}")

        # 2. Two sessions: one capped at its share, one free; the free one is measured while
        # the capped one streams (the capped one goes on until the free one is done).
        capped, free = open_stream("link-cap-capped", share), open_stream("link-cap-free")
        capped.warm_up()
        free.warm_up()
        stop, results = threading.Event(), {}
        errors = []

        def run(name, stream, seconds, until):
            try:
                results[name] = stream.measure(seconds, until)
            except BaseException as e:  # reported below; a thread must not die silently
                errors.append(f"{name}: {e!r}")
            finally:
                stop.set()

        before = scrape(metrics_url)
        t_capped = threading.Thread(target=run, args=("capped", capped, 0.0, stop))
        t_capped.start()
        time.sleep(0.2)  # the capped one is streaming before the free one starts measuring
        run_free = threading.Thread(target=run, args=("free", free, args.seconds, None))
        run_free.start()
        run_free.join()
        t_capped.join()
        after = scrape(metrics_url)
        capped.session.close()
        free.session.close()
        if errors:
            failures.extend(errors)
            return result
        # The capped session over its own window; both over the free one's (the capped one
        # streams throughout it).
        c = results["capped"]["rate_gbps"] * 1e9
        window = results["free"]
        both = sum(window["copied_by_session"][s.session.id] for s in (capped, free))
        both_rate = both / window["seconds"]
        key = "weightstream_device_copy_share_throttled_seconds_total"
        result["two_sessions"] = {
            **results,
            "together_gbps": round(both_rate / 1e9, 3),
            "daemon_share_throttled_s": round(after.get(key, 0) - before.get(key, 0), 3),
        }
        for what, got, want in (("capped session", c, share), ("both", both_rate, limit)):
            ok = within(got, want)
            print(
                f"[{'PASS' if ok else 'FAIL'}] {what} {at}: {got / 1e9:.2f} GB/s, "
                f"want {want / 1e9:.2f} GB/s +-{TOLERANCE:.0%}"
            )
            if not ok:
                failures.append(f"{what} {at}: {got / 1e9:.2f} GB/s, want {want / 1e9:.2f}")
        print(f"two sessions {at}: {result['two_sessions']}")
        return result
    finally:
        daemon.stop(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", default="target/release/weightstream")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-gpu-out"))
    parser.add_argument(
        "--limits",
        nargs="+",
        default=["25GB/s", "12GB/s"],
        help="device limits, each checked with its own daemon",
    )
    parser.add_argument("--share", default="5GB/s", help="the capped session's share")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--size-gib", type=float, default=4.0)
    # LOOKAHEAD acquires in flight hold up to ~0.9 GiB of staged groups (two 256 MiB ones among
    # them): at 1 GiB a session could not stage its next 256 MiB group past them (the daemon
    # refused it with RESOURCE_EXHAUSTED on the H200, run of 2026-12-01).
    parser.add_argument("--staging-gib", type=float, default=2.0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"limits": {}}
    failures: list[str] = []
    try:
        pinned = wsgpu.pinned_h2d_gbps() * 1e9  # bytes/s: the link must be faster than a limit
        result["pinned_h2d_gbps"] = round(pinned / 1e9, 2)
        print(f"pinned host-to-device: {pinned / 1e9:.1f} GB/s; limits {args.limits}")
        tensors = model_tensors(int(args.size_gib * GiB))
        for text in args.limits:
            if pinned < parse_rate(text) * (1 + TOLERANCE):
                failures.append(f"the link is not faster than {text}: nothing to emulate")
                continue
            result["limits"][text] = check_limit(args, text, tensors, out, failures)
    except BaseException as e:
        failures.append(f"error: {e!r}")
        raise
    finally:
        result["failures"] = failures
        (out / "link_cap.json").write_text(json.dumps(result, indent=2))
    print("link_cap:", "PASS" if not failures else f"FAIL {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
