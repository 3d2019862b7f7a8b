"""An emulated consumer card on a big GPU: runs CMD with all but --gib GiB of the device held by a
helper process and the weightstream daemon's copy bandwidth capped at --link, and reports the
device's peak memory use while CMD loads and while it trains.

    python3 -m tests.bench.card --gib 24 --link 25GB/s --json $OUT/card.json -- \\
        python3 -m tests.bench.flux2_train --bin target/release/weightstream ...

- The card: a helper process (this script with ``--hold``) makes its CUDA context, allocates
  (cudaMalloc, through torch) the device's free memory but --gib GiB, checks with cudaMemGetInfo
  that this much is left, and holds it until card.py ends (it exits when its stdin closes, so
  nothing stays held if card.py dies). Everything CMD starts (trainers, daemons, their CUDA
  contexts) shares what is left: an allocation past it is a real out-of-memory error. CMD sees
  only this device (CUDA_VISIBLE_DEVICES is set to its UUID).
- The link: CMD runs with WEIGHTSTREAM_COPY_BANDWIDTH_LIMIT set to --link, which every
  ``weightstream serve`` it starts reads (an explicit ``--copy-bandwidth-limit`` wins). Without
  --link the variable is removed: the device's own link. Copies that no daemon makes (an
  in-process offloader such as ai-toolkit's MemoryManager) run at the device's own link.
- Phases: a line ``WS-PHASE <phase> [t=<unix time>] [label]`` starts a phase, read from CMD's
  stdout/stderr or from the file WS_PHASE_FILE names (set for CMD: ``phase()`` below appends
  there, so that processes whose output their parent captures are heard too). Before the first
  marker the phase is ``loading``. The benches mark ``loading`` when a mode starts and
  ``training`` when its steps start.
- Reported (printed, and as JSON with --json): the free memory left by the helper (cudaMemGetInfo
  and NVML), per phase and per marked segment the peak of the card's memory in use (what CMD's
  processes took of the free memory the helper left) and of the whole device's, CMD's exit
  status, and "out of memory on the emulated N GiB card" with the line that said so when CMD's
  output reports an out-of-memory error. The device's memory is sampled every --interval-ms
  through NVML (nvidia-ml-py), else ``nvidia-smi -lms``.
- Bad input: a card size that does not leave the trainer's own share (--trainer-gib, by default
  CMD's own --trainer-gib) beside two CUDA contexts (the trainer's and the daemon's, each the
  size of the helper's), or a card larger than the device's free memory, is an error that names
  the numbers.

card.py exits with CMD's status, or 2 for its own errors (bad arguments, no card).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from weightstream import sizes

MiB = 1 << 20
GiB = 1 << 30
#: The daemon's lowest copy bandwidth limit (config.rs MIN_COPY_BANDWIDTH).
MIN_LINK = 100_000_000
#: The environment variable ``weightstream serve`` reads its copy bandwidth limit from.
LINK_ENV = "WEIGHTSTREAM_COPY_BANDWIDTH_LIMIT"
#: The file CMD's processes append phase markers to.
PHASE_ENV = "WS_PHASE_FILE"
#: CMD's environment also says the card's size (a bench can check its budgets against it).
CARD_ENV = "WS_CARD_GIB"
#: How far the free memory the helper leaves may be from --gib (the allocator's granularity is
#: 2 MiB; the driver's page tables for the held memory take a few MiB more).
HOLD_SLACK = 64 * MiB
#: CUDA contexts besides the helper's that share the card in a weightstream job: the trainer's
#: and the daemon's.
CONTEXTS = 2
HOLD_TIMEOUT_S = 300
#: How long CMD's output may stay open after CMD exits before what holds it is ended.
LEFT_RUNNING_GRACE_S = 10.0


class CardError(Exception):
    """A bad argument or a card that cannot be made; the message says what to do."""


def parse_rate(text: str) -> int:
    """Bytes per second of "25GB/s", "25 GiB/s", "1.5GB/s" or a plain number, in the daemon's
    units (GB = 10^9 bytes, GiB = 2^30): ``weightstream.sizes.parse_rate``."""
    try:
        return sizes.parse_rate("--link", text)
    except ValueError:
        raise CardError(
            f"{text!r} is not a rate like '25GB/s', '25GiB/s' or bytes per second"
        ) from None


def parse_args(argv: list[str]) -> argparse.Namespace:
    """card.py's arguments: options, then ``--`` and CMD."""
    if "--" not in argv:
        raise CardError("no command: give it after '--' (card.py --gib 24 -- python3 train.py)")
    at = argv.index("--")
    ap = argparse.ArgumentParser(prog="card.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, required=True, help="the card's memory, GiB")
    ap.add_argument("--link", default=None, help="the link, e.g. 25GB/s (default: the device's)")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--log", default=None, help="copy CMD's output here")
    ap.add_argument(
        "--trainer-gib",
        type=float,
        default=None,
        help="the trainer's own share of the card (default: CMD's --trainer-gib, if any)",
    )
    ap.add_argument("--device", type=int, default=0, help="the device's NVML index")
    ap.add_argument("--interval-ms", type=int, default=100, help="sampling interval")
    args = ap.parse_args(argv[:at])
    args.cmd = argv[at + 1 :]
    if not args.cmd:
        raise CardError("no command after '--'")
    if not args.gib > 0:
        raise CardError(f"--gib {args.gib:g}: a card needs some memory (e.g. --gib 24)")
    if not 10 <= args.interval_ms <= 10_000:
        raise CardError(f"--interval-ms {args.interval_ms}: between 10 and 10000")
    args.link_bytes = None
    if args.link is not None:
        args.link_bytes = parse_rate(args.link)
        if args.link_bytes < MIN_LINK:
            raise CardError(
                f"--link {args.link} is {args.link_bytes} bytes/s, below the daemon's lowest "
                f"limit ({MIN_LINK // 10**6} MB/s): did you mean GB/s?"
            )
    if args.trainer_gib is None:
        args.trainer_gib = trainer_gib_of(args.cmd)
    return args


def trainer_gib_of(cmd: list[str]) -> float | None:
    """CMD's own ``--trainer-gib`` (the flux benches' trainer share), if it has one."""
    for i, word in enumerate(cmd):
        value = None
        if word.startswith("--trainer-gib="):
            value = word.split("=", 1)[1]
        elif word == "--trainer-gib" and i + 1 < len(cmd):
            value = cmd[i + 1]
        if value is not None:
            try:
                return float(value)
            except ValueError:
                raise CardError(f"the command's --trainer-gib {value!r} is not a number") from None
    return None


def check_card(card_gib: float, trainer_gib: float | None, context_bytes: int) -> None:
    """The card must hold the trainer's own share and the trainer's and the daemon's CUDA
    contexts, with room left for the daemon's weights."""
    if trainer_gib is None:
        return
    need = trainer_gib * GiB + CONTEXTS * context_bytes
    if card_gib * GiB <= need:
        raise CardError(
            f"a {card_gib:g} GiB card is too small for the trainer's own share: "
            f"{trainer_gib:g} GiB (--trainer-gib) and {CONTEXTS} CUDA contexts of "
            f"{context_bytes / GiB:.2f} GiB (the trainer's and the daemon's) need "
            f"{need / GiB:.2f} GiB, leaving nothing for the daemon's weights; give --gib more "
            f"than {need / GiB:.2f} or a smaller --trainer-gib"
        )


_MARKER = re.compile(r"WS-PHASE\s+(\w+)(?:\s+t=([0-9.]+))?(?:\s+(.*\S))?\s*$")
_OOM = re.compile(r"out[ _]?of[ _]?memory|cudaErrorMemoryAllocation", re.IGNORECASE)


@dataclass(frozen=True, order=True)
class Marker:
    t: float
    phase: str
    label: str = ""


def parse_marker(line: str, now: float) -> Marker | None:
    """A phase marker in ``line`` (anywhere in it: a logger may prefix it); its own time if it
    says one, else ``now``."""
    m = _MARKER.search(line)
    if m is None:
        return None
    return Marker(float(m.group(2)) if m.group(2) else now, m.group(1), m.group(3) or "")


def is_oom(line: str) -> bool:
    """Whether a line of CMD's output reports an out-of-memory error (torch's, CUDA's, the
    daemon's ``CUDA_ERROR_OUT_OF_MEMORY``)."""
    return _OOM.search(line) is not None and _MARKER.search(line) is None


def phase(name: str, label: str = "") -> None:
    """Marks the start of phase ``name`` for card.py: appended to $WS_PHASE_FILE when card.py
    runs this process, else printed."""
    if not re.fullmatch(r"\w+", name):
        raise ValueError(f"phase {name!r}: one word")
    line = f"WS-PHASE {name} t={time.time():.6f}" + (f" {label}" if label else "")
    path = os.environ.get(PHASE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
    else:
        print(line, flush=True)


@dataclass(frozen=True)
class Sample:
    t: float
    #: Bytes of the device in use (NVML's ``used``).
    used: int
    #: Bytes of the device free.
    free: int


@dataclass
class Segment:
    phase: str
    label: str
    start: float
    end: float
    #: The card's memory in use: the helper's free bytes less those free now.
    peak_card: int | None = None
    peak_device: int | None = None
    samples: int = 0


def split_phases(
    samples: list[Sample], markers: list[Marker], start: float, end: float, free_at_hold: int
) -> list[Segment]:
    """Cuts [start, end] at each marker into segments (the first one ``loading``), each with
    the peaks of the samples taken within it. A segment too short for a sample has no peak."""
    bounds = [Marker(start, "loading")]
    bounds += [Marker(min(max(m.t, start), end), m.phase, m.label) for m in sorted(markers)]
    segments = []
    for i, b in enumerate(bounds):
        stop = bounds[i + 1].t if i + 1 < len(bounds) else end
        segments.append(Segment(b.phase, b.label, b.t, stop))
    for s in samples:
        if not start <= s.t <= end:
            continue
        # The last segment that starts by the sample's time (a sample at a marker's time is the
        # new phase's).
        seg = next(g for g in reversed(segments) if g.start <= s.t)
        card = max(0, free_at_hold - s.free)
        seg.peak_card = card if seg.peak_card is None else max(seg.peak_card, card)
        seg.peak_device = s.used if seg.peak_device is None else max(seg.peak_device, s.used)
        seg.samples += 1
    # A marker at the very start (or two at once) leaves an empty segment before it.
    return [g for g in segments if g.end > g.start or g.samples]


def phase_peaks(segments: list[Segment]) -> dict[str, dict]:
    """Per phase (in order of first appearance): the peaks over its segments and its time."""
    out: dict[str, dict] = {}
    for g in segments:
        p = out.setdefault(g.phase, {"peak_card": None, "peak_device": None, "seconds": 0.0})
        for key in ("peak_card", "peak_device"):
            v = getattr(g, key)
            if v is not None:
                p[key] = v if p[key] is None else max(p[key], v)
        p["seconds"] += g.end - g.start
    return out


def gib(n: int | None) -> float | None:
    return None if n is None else round(n / GiB, 3)


def report(args, device: dict, hold: dict, run: dict) -> dict:
    """The JSON report of a run (see the module's docstring)."""
    segments = split_phases(
        run["samples"], run["markers"], run["start"], run["end"], hold["free_sampled"]
    )
    phases = phase_peaks(segments)
    return {
        "command": args.cmd,
        "card_gib": args.gib,
        "link": args.link,
        "link_bytes_per_s": args.link_bytes,
        "trainer_gib": args.trainer_gib,
        "device": device,
        "hold": {
            "held_gib": gib(hold["held"]),
            "free_cuda_gib": gib(hold["free"]),
            "free_sampled_gib": gib(hold["free_sampled"]),
            "helper_context_gib": gib(hold["context"]),
        },
        "sampler": run["sampler"],
        "interval_ms": args.interval_ms,
        "samples": len(run["samples"]),
        "phases": {
            name: {
                "peak_card_gib": gib(p["peak_card"]),
                "peak_device_gib": gib(p["peak_device"]),
                "seconds": round(p["seconds"], 2),
            }
            for name, p in phases.items()
        },
        "segments": [
            {
                "phase": g.phase,
                "label": g.label,
                "start_s": round(g.start - run["start"], 2),
                "seconds": round(g.end - g.start, 2),
                "peak_card_gib": gib(g.peak_card),
                "peak_device_gib": gib(g.peak_device),
            }
            for g in segments
        ],
        "exit_status": run["status"],
        "left_running_ended": run["left_running"],
        "oom": {"lines": run["oom"]} if run["oom"] else None,
        "wall_s": round(run["end"] - run["start"], 1),
    }


def summary(rep: dict) -> list[str]:
    """The report's lines for a person."""
    card = f"{rep['card_gib']:g} GiB"
    h = rep["hold"]
    link = (
        f"the daemons' link {rep['link']} (in-process offloaders copy at the device's own)"
        if rep["link"]
        else "the device's own link"
    )
    lines = [
        f"card: emulated {card} card on {rep['device']['name']}: {h['free_cuda_gib']} GiB free "
        f"(cudaMemGetInfo), {h['free_sampled_gib']} GiB ({rep['sampler']}) with "
        f"{h['held_gib']} GiB held; {link}"
    ]
    for name, p in rep["phases"].items():
        lines.append(
            f"card: {name}: peak {p['peak_card_gib']} GiB of the card "
            f"({p['peak_device_gib']} GiB of the device) over {p['seconds']} s"
        )
    lines.append(f"card: command exited with status {rep['exit_status']}")
    if rep["oom"]:
        lines.append(f"card: out of memory on the emulated {card} card: {rep['oom']['lines'][0]}")
    return lines


# --- The device: NVML or nvidia-smi (the GPU machine has both; tests fake this). ---


class NvmlDevice:
    name = "nvml"

    def __init__(self, index: int):
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def info(self) -> dict:
        def text(v):
            return v.decode() if isinstance(v, bytes) else v

        n = self.nvml
        return {
            "name": text(n.nvmlDeviceGetName(self.handle)),
            "uuid": text(n.nvmlDeviceGetUUID(self.handle)),
            "total_gib": gib(n.nvmlDeviceGetMemoryInfo(self.handle).total),
        }

    def sample(self) -> Sample:
        m = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
        return Sample(time.time(), m.used, m.free)

    def close(self):
        self.nvml.nvmlShutdown()


class SmiDevice:
    """nvidia-smi, queried once per sample (MiB resolution)."""

    name = "nvidia-smi"

    def __init__(self, index: int):
        self.index = str(index)

    def query(self, fields: str) -> list[str]:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
            + ["-i", self.index],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return [v.strip() for v in out.strip().split(",")]

    def info(self) -> dict:
        name, uuid, total = self.query("name,uuid,memory.total")
        return {"name": name, "uuid": uuid, "total_gib": gib(int(total) * MiB)}

    def sample(self) -> Sample:
        used, free = self.query("memory.used,memory.free")
        return Sample(time.time(), int(used) * MiB, int(free) * MiB)

    def close(self):
        pass


def open_device(index: int):
    """NVML where nvidia-ml-py is installed and answers, else nvidia-smi."""
    try:
        device = NvmlDevice(index)
        device.info(), device.sample()
        return device
    except Exception:  # noqa: BLE001 - no nvidia-ml-py, or NVML unusable: nvidia-smi then
        return SmiDevice(index)


class Sampler(threading.Thread):
    def __init__(self, device, interval_s: float):
        super().__init__(daemon=True)
        self.device, self.interval_s = device, interval_s
        self.samples: list[Sample] = []
        self.errors = 0
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            try:
                self.samples.append(self.device.sample())
            except Exception:  # noqa: BLE001 - one lost sample; counted
                self.errors += 1
            self.stop.wait(self.interval_s)


# --- The helper that holds the device's memory. ---


def hold(card_gib: float) -> int:
    """``card.py --hold GIB``: allocates the device's free memory but GIB, prints what it did
    (``CARD-HOLD {json}``, or ``CARD-HOLD-ERROR {json}``), and holds it until stdin closes."""
    import torch

    torch.zeros(1, device="cuda")  # the helper's own context, counted before it allocates
    free0, total = torch.cuda.mem_get_info()
    target = int(card_gib * GiB)
    if free0 < target:
        message = (
            f"cannot emulate a {card_gib:g} GiB card: the device has {free0 / GiB:.2f} GiB free "
            f"(of {total / GiB:.2f} GiB) besides the helper's own CUDA context; give a smaller "
            "--gib or stop what else uses the device"
        )
        print("CARD-HOLD-ERROR " + json.dumps({"message": message}), flush=True)
        return 2
    held, blocks, step = 0, [], None
    for _ in range(64):
        free, _ = torch.cuda.mem_get_info()
        want = (free - target) // (2 * MiB) * (2 * MiB)
        if want <= 0:
            break
        ask = want if step is None else min(want, step)
        try:
            blocks.append(torch.empty(ask, dtype=torch.uint8, device="cuda"))
            held += ask
        except torch.OutOfMemoryError:
            # Refused (no range that large, or the driver's bookkeeping for what is held
            # took some of it): ask in halves from here.
            step = max(2 * MiB, ask // 2 // (2 * MiB) * (2 * MiB))
    free, _ = torch.cuda.mem_get_info()
    out = {"free_before": free0, "total": total, "held": held, "free": free}
    print("CARD-HOLD " + json.dumps(out), flush=True)
    sys.stdin.read()  # until card.py closes it (or dies)
    return 0


class Holder:
    """The helper process; ``report`` is its CARD-HOLD line."""

    def __init__(self, card_gib: float, env: dict, cmd: list[str] | None = None):
        self.proc = subprocess.Popen(
            cmd or [sys.executable, __file__, "--hold", repr(card_gib)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        self.report = self._read_report()

    def _read_report(self) -> dict:
        lines = []
        timer = threading.Timer(HOLD_TIMEOUT_S, self.proc.kill)
        timer.start()
        try:
            for line in self.proc.stdout:
                lines.append(line)
                if line.startswith("CARD-HOLD "):
                    return json.loads(line.split(" ", 1)[1])
                if line.startswith("CARD-HOLD-ERROR "):
                    self.proc.wait()
                    raise CardError(json.loads(line.split(" ", 1)[1])["message"])
        finally:
            timer.cancel()
        raise CardError(
            f"the helper holding the device's memory ended without a report "
            f"(status {self.proc.wait()}): {''.join(lines)[-2000:]}"
        )

    def release(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def make_card(args, device, env: dict, holder=Holder) -> dict:
    """Holds the device's memory but the card's; returns what was held and what is free, or
    raises CardError (nothing held then)."""
    before = device.sample()
    h = holder(args.gib, env)
    try:
        context = max(0, before.free - h.report["free_before"])
        if abs(h.report["free"] - args.gib * GiB) > HOLD_SLACK:
            raise CardError(
                f"the helper left {h.report['free'] / GiB:.3f} GiB free, not the card's "
                f"{args.gib:g} GiB (within {HOLD_SLACK // MiB} MiB): another process allocated "
                "meanwhile?"
            )
        check_card(args.gib, args.trainer_gib, context)
        return {
            "holder": h,
            "held": h.report["held"],
            "free": h.report["free"],
            "free_sampled": device.sample().free,
            "context": context,
        }
    except BaseException:
        h.release()
        raise


def run_command(args, env: dict, phase_file: Path) -> dict:
    """Runs CMD to its end, echoing its output; returns its status, markers and OOM lines."""
    markers: list[Marker] = []
    oom: list[str] = []
    start = time.time()
    proc = subprocess.Popen(
        args.cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: what it leaves running can be ended
        text=True,
        errors="replace",
        bufsize=1,
    )

    def read():
        with open(args.log, "w") if args.log else open(os.devnull, "w") as log:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log.write(line)
                m = parse_marker(line, time.time())
                if m:
                    markers.append(m)
                elif is_oom(line) and len(oom) < 5:
                    oom.append(line.strip()[:500])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        status = proc.wait()
    except BaseException:
        signal_group(proc.pid, reader)
        raise
    end = time.time()
    # A process CMD started and left running (a daemon) keeps its output open: end it.
    reader.join(timeout=LEFT_RUNNING_GRACE_S)
    left_running = reader.is_alive()
    if left_running:
        signal_group(proc.pid, reader)
    reader.join(timeout=30)
    if phase_file.exists():
        for line in phase_file.read_text(errors="replace").splitlines():
            m = parse_marker(line, end)
            if m:
                markers.append(m)
    return {
        "status": status,
        "markers": markers,
        "oom": oom,
        "start": start,
        "end": end,
        "left_running": left_running,
    }


def signal_group(pgid: int, reader: threading.Thread):
    """Ends CMD's process group (SIGTERM, then SIGKILL), until its output closes."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        reader.join(timeout=30)
        if not reader.is_alive():
            break


def command_env(args, uuid: str, phase_file: Path) -> dict:
    env = dict(os.environ)
    env.pop(LINK_ENV, None)
    if args.link_bytes is not None:
        env[LINK_ENV] = str(args.link_bytes)
    env["CUDA_VISIBLE_DEVICES"] = uuid
    env[PHASE_ENV] = str(phase_file)
    env[CARD_ENV] = f"{args.gib:g}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def main(argv: list[str] | None = None, device=None, holder=Holder) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--hold"]:
        return hold(float(argv[1]))
    try:
        args = parse_args(argv)
    except CardError as e:
        print(f"card: error: {e}", file=sys.stderr)
        return 2
    device = device or open_device(args.device)
    with tempfile.TemporaryDirectory(prefix="ws-card-") as scratch:
        try:
            return with_card(args, device, holder, Path(scratch) / "phases")
        except CardError as e:
            print(f"card: error: {e}", file=sys.stderr)
            return 2
        finally:
            device.close()


def with_card(args, device, holder, phase_file: Path) -> int:
    """Makes the card, runs CMD on it, reports; returns CMD's status."""
    info = device.info()
    env = command_env(args, info["uuid"], phase_file)
    card = make_card(args, device, env, holder)
    sampler = Sampler(device, args.interval_ms / 1000)
    try:
        sampler.start()
        run = run_command(args, env, phase_file)
    finally:
        sampler.stop.set()
        sampler.join()
        card["holder"].release()
    run["samples"], run["sampler"] = sampler.samples, device.name
    rep = report(args, info, card, run)
    rep["sample_errors"] = sampler.errors
    for line in summary(rep):
        print(line, flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=2))
    return run["status"] if run["status"] >= 0 else 128 - run["status"]


if __name__ == "__main__":
    # SIGTERM ends card.py as Ctrl-C does: CMD's group is ended and the memory given back.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
