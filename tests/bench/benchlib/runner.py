"""The parent and children of tests/bench/flux_train.py: a child process per mode (``child``,
the mode table ``MODES``), and the parent that starts the daemon, runs the modes one after the
other, two jobs at once or interleaved step by step, stops the daemon, and checks the
deterministic losses against the resident reference.

Children run as ``python -m tests.bench.flux_train --child MODE``, from the working directory
and with the environment of the parent (the repository root)."""

from __future__ import annotations

import functools
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tests.bench.benchlib import flux
from tests.bench.benchlib.baselines import (
    mode_accelerate,
    mode_aitk_float8,
    mode_aitk_memory_manager,
    mode_group_offload,
    mode_ramtorch,
)
from tests.bench.benchlib.flux import (
    BUILD_LOCK_ENV,
    ROOT,
    GiB,
    Lockstep,
    results_name,
)
from tests.bench.benchlib.modes import (
    mode_job,
    mode_resident,
    mode_resident_fp8,
    mode_resident_fp8_copying,
    mode_resident_w8a8,
    mode_weightstream,
    mode_weightstream_auto,
    scrape,
)
from tests.bench.card import phase
from tests.bench.provenance import command, commit
from tests.daemon import Daemon

#: The script the children run (``python -m SCRIPT --child MODE``).
SCRIPT = "tests.bench.flux_train"

#: The suffix of a mode held coded (``weightstream-rans8``...; its reference: the mode without).
CODED = "-rans8"

MODES = {
    "resident": mode_resident,
    "resident-fp8": mode_resident_fp8,  # run by default only with --quantize fp8
    # The same with the link kept busy by a copy loop: only with --modes.
    "resident-fp8-copying": mode_resident_fp8_copying,
    "weightstream": mode_weightstream,
    "weightstream-auto": mode_weightstream_auto,
    # 8-bit compute (attach's compute=, --rotation, --grad-compute), each against the same
    # W8A8 layers in place: only with --modes.
    "resident-w8a8-fp8": functools.partial(mode_resident_w8a8, compute="fp8"),
    "resident-w8a8-int8": functools.partial(mode_resident_w8a8, compute="int8"),
    "weightstream-w8a8-fp8": functools.partial(mode_weightstream, compute="fp8"),
    "weightstream-w8a8-int8": functools.partial(mode_weightstream, compute="int8"),
    # The same held coded (attach's coding="rans8", whatever --coding says), each against the
    # same mode uncoded: only with --modes.
    "weightstream" + CODED: functools.partial(mode_weightstream, coding="rans8"),
    "weightstream-w8a8-fp8" + CODED: functools.partial(
        mode_weightstream, compute="fp8", coding="rans8"
    ),
    "weightstream-w8a8-int8" + CODED: functools.partial(
        mode_weightstream, compute="int8", coding="rans8"
    ),
    "ramtorch": mode_ramtorch,
    "accelerate-offload": mode_accelerate,
    "diffusers-group-offload": mode_group_offload,
    "aitk": mode_aitk_memory_manager,  # ai-toolkit's MemoryManager, 100 %: only with --modes
    "aitk-float8": mode_aitk_float8,  # the same over torchao float8 weights (torchao needed)
    "two-jobs": None,  # run by the parent: two `job` children at once
    "two-resident": None,  # the same, each job with its weights in place
    "job": mode_job,
}


def child(args):
    import torch

    if args.lockstep:
        flux.LOCKSTEP = Lockstep(args.lockstep)
    label = args.mode if args.mode != "job" else f"job {args.job}"
    phase("loading", label)
    flux.training_label = label
    torch.backends.cuda.enable_cudnn_sdp(False)
    record = {"mode": args.mode}
    try:
        MODES[args.mode](args, record)
    except Exception as e:  # noqa: BLE001 - the error is the result for this mode
        record["error"] = repr(e)[:600]
        traceback.print_exc()
    print("RESULT " + json.dumps(record), flush=True)


def device_and_pinned_bandwidth() -> tuple[str, float]:
    """The device's name and its pinned host-to-device GB/s, measured in a process of their own:
    the parent holds no CUDA context (on an emulated card it would take the children's room)."""
    code = (
        "import torch; from tests.gpu import wsgpu; "
        "print(torch.cuda.get_device_name(0)); print(wsgpu.pinned_h2d_gbps(reps=6))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    name, gbps = out.strip().splitlines()[-2:]
    return name, float(gbps)


def child_cmd(args, mode: str, socket: str) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        SCRIPT,
        "--child",
        mode,
        "--socket",
        socket,
        "--metrics",
        args.metrics,
    ]
    cmd += ["--budgets", *map(str, args.budgets), "--det-budget", str(args.det_budget)]
    cmd += ["--det-steps", str(args.det_steps)]
    cmd += ["--warmup", str(args.warmup), "--measured", str(args.measured)]
    cmd += ["--trainer-gib", str(args.trainer_gib), "--group-by", args.group_by]
    cmd += ["--dequantize", args.dequantize, "--rotation", str(args.rotation)]
    if args.grad_compute:
        cmd += ["--grad-compute", args.grad_compute]
    if args.early_release:
        cmd.append("--early-release")
    cmd += ["--staging-gib", str(args.staging_gib), "--copy-duty", str(args.copy_duty)]
    cmd += ["--jobs-budget", str(args.jobs_budget), "--min-blocks", str(args.min_blocks)]
    cmd += ["--model", args.model, "--rank", str(args.rank), "--optimizer", args.optimizer]
    if args.aitk:
        cmd += ["--aitk", args.aitk]
    if args.quantize:
        cmd += ["--quantize", args.quantize]
    cmd += ["--coding", args.coding]
    return cmd


def result_of(mode: str, stdout: str, stderr: str) -> dict:
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(lines[-1][7:]) if lines else {"mode": mode, "error": stderr[-600:]}


def run_mode(args, mode, socket, env, out) -> dict:
    try:
        p = subprocess.run(
            child_cmd(args, mode, socket),
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        (out / f"flux-{mode}.log").write_text(p.stdout + p.stderr)
        return result_of(mode, p.stdout, p.stderr)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {args.timeout} s"}


def two_jobs(args, socket, env, out, resident: bool = False) -> dict:
    """Two trainers on one GPU and one daemon, each at --jobs-budget GiB: per-job s/step over
    the same window, and the host memory held for the model. ``resident``: each job with its
    weights in place instead (``two-resident``, the ceiling of two jobs sharing the GPU)."""
    barrier = Path(tempfile.mkdtemp(prefix="ws-flux-jobs-"))
    mode = "two-resident" if resident else "two-jobs"
    record = {"mode": mode, "budget_gib": None if resident else args.jobs_budget, "jobs": []}
    procs = []
    for job in (0, 1):
        cmd = child_cmd(args, "job", socket) + ["--job", str(job), "--barrier", str(barrier)]
        cmd += ["--jobs-resident"] if resident else []
        log = open(out / f"flux-job{job}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log), log))
    peak_store = 0.0
    deadline = time.monotonic() + args.timeout
    while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
        try:
            peak_store = max(peak_store, scrape(args, "weightstream_store_bytes"))
        except OSError:
            pass
        time.sleep(1)
    for job, (p, log) in enumerate(procs):
        if p.poll() is None:
            p.kill()
        stdout = p.stdout.read().decode()
        log.close()
        record["jobs"].append(result_of("job", stdout, f"no result: see flux-job{job}.log"))
    record["daemon_store_peak_gib"] = round(peak_store / GiB, 2)
    times = [j.get("s_per_step") for j in record["jobs"]]
    if all(times):
        record["combined_steps_per_s"] = round(sum(1 / t for t in times), 4)
    return record


def timed_record(record: dict) -> dict:
    """Where a mode's record keeps its timing: its only budget's record, or itself."""
    budgets = record.get("budgets") or {}
    return next(iter(budgets.values())) if len(budgets) == 1 else record


def interleaved(args, socket, env, out) -> tuple[list[dict], dict]:
    """``--interleave A B [C ...]``: the modes' children at once, their timed steps alternating
    in turns of ``--turn`` steps (A's steps i..i+turn-1, then B's, ...: ``Lockstep``), so that
    a drift of the machine's speed reaches all. A mode written ``MODE+group`` (or ``+layer``)
    runs MODE with that ``--dequantize``, ``MODE+early`` with ``--early-release``. Returns
    the records (each with its ``variant``, the name as given) and the summary: each later
    mode's step over A's step of the same index, per pair, and their median (``ratios``, by
    name; the second mode's also at the top level); with turns of several steps also the
    ratio of the medians of the steps that are not a turn's first (``steady_ratio_of_medians``:
    those follow a step of the same process, as a trainer's steps do)."""
    n = args.warmup + args.measured
    turn = args.turn
    children = []
    for mode in args.interleave:
        go_r, go_w = os.pipe()
        back_r, back_w = os.pipe()
        log = open(out / f"flux-{mode}.log", "w")
        base, _, variant = mode.partition("+")
        extra = {"": [], "early": ["--early-release"]}.get(variant, ["--dequantize", variant])
        cmd = child_cmd(args, base, socket) + extra + ["--lockstep", f"{go_r},{back_w}"]
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, pass_fds=(go_r, back_w))
        os.close(go_r)
        os.close(back_w)
        children.append((mode, base, p, go_w, back_r, log))
    deadline = time.monotonic() + args.timeout
    stopped = None
    for first in range(0, n, turn):
        for mode, _, _, go_w, back_r, _ in children:
            for i in range(first, min(n, first + turn)):
                try:
                    os.write(go_w, b"g")
                except BrokenPipeError:  # gone already (its model did not fit, say)
                    stopped = f"{mode} did not finish its step {i}"
                    break
                left = max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([back_r], [], [], left)
                if not ready or os.read(back_r, 1) != b"d":
                    stopped = f"{mode} did not finish its step {i}"
                    break
            if stopped:
                break
        if stopped:
            break
    records = []
    for mode, base, p, go_w, back_r, log in children:
        os.close(go_w)  # a child still waiting for its turn stops
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        os.close(back_r)
        log.close()
        text = (out / f"flux-{mode}.log").read_text()
        record = result_of(base, text, f"no result: see flux-{mode}.log")
        record["interleaved"] = True
        record["variant"] = mode
        records.append(record)
    summary = {"modes": list(args.interleave), "turn": turn}
    if stopped:
        summary["error"] = stopped
    a = timed_record(records[0]).get("steps_s")
    # The measured steps that follow a step of their own process (none in turns of one).
    steady = [j for j in range(len(a or ())) if (args.warmup + j) % turn != 0]
    summary["ratios"] = {}
    for mode, record in zip(args.interleave[1:], records[1:], strict=True):
        b = timed_record(record).get("steps_s")
        if a and b and len(a) == len(b):
            ratios = sorted(y / x for x, y in zip(a, b, strict=True))
            summary["ratios"][mode] = {
                "ratio_per_pair": [round(y / x, 4) for x, y in zip(a, b, strict=True)],
                "ratio_median": round(statistics.median(ratios), 4),
                "ratio_min": round(ratios[0], 4),
                "ratio_max": round(ratios[-1], 4),
                "ratio_of_medians": round(statistics.median(b) / statistics.median(a), 4),
            }
            if steady:
                sa = statistics.median(a[j] for j in steady)
                sb = statistics.median(b[j] for j in steady)
                summary["ratios"][mode]["steady_ratio_of_medians"] = round(sb / sa, 4)
    summary.update(summary["ratios"].get(args.interleave[1], {}))
    return records, summary


def run_modes(args, socket: str, out: Path) -> dict:
    """The modes (or the interleaved run) against the daemon at ``socket``: the results."""
    device, pinned = device_and_pinned_bandwidth()
    results = {
        "command": command(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "device": device,
        "pinned_h2d_gbps": round(pinned, 2),
        "trainer_gib": args.trainer_gib,
        "model": args.model,
        "rank": args.rank,
        "optimizer": args.optimizer,
        "copy_bandwidth_limit": args.copy_bandwidth_limit,
        "modes": [],
    }
    if os.environ.get("WS_CARD_GIB"):
        results["card_gib"] = float(os.environ["WS_CARD_GIB"])
    # The children time their steps without CUBLAS_WORKSPACE_CONFIG (see ``deterministic``).
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    env[BUILD_LOCK_ENV] = str(Path(socket).parent / "build.lock")
    if args.interleave:
        started = time.monotonic()
        records, summary = interleaved(args, socket, env, out)
        summary["wall_s"] = round(time.monotonic() - started, 1)
        results["modes"] += records
        results["interleaved"] = summary
        print(json.dumps(summary), flush=True)
    for mode in [] if args.interleave else args.modes:
        started = time.monotonic()
        if mode in ("two-jobs", "two-resident"):
            record = two_jobs(args, socket, env, out, resident=mode == "two-resident")
        else:
            record = run_mode(args, mode, socket, env, out)
        record["wall_s"] = round(time.monotonic() - started, 1)
        results["modes"].append(record)
        (out / f"{results_name()}.json").write_text(json.dumps(results, indent=2))
        print(json.dumps(record)[:1500], flush=True)
    return results


def parent(args):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ws-flux-"))
    cap = ["--copy-bandwidth-limit", args.copy_bandwidth_limit] if args.copy_bandwidth_limit else []
    # Not waited for here: each child waits for the daemon as it connects.
    daemon = Daemon(
        tmp,
        "--metrics-listen",
        args.metrics,
        *cap,
        binary=args.bin,
        backend="cuda",
        log=out / "flux-daemon.log",
        log_level=None,
        ready_s=None,
    )
    try:
        results = run_modes(args, daemon.socket, out)
    finally:
        # Also after a failure (a child gone mid-run): no daemon is left holding the metrics
        # port and the GPU's memory for the next run.
        daemon.stop(timeout=60)
    ok = check_equality(results)
    (out / f"{results_name()}.json").write_text(json.dumps(results, indent=2))
    # The device tool brings back at most 8 files from $OUT: pack the logs into one.
    logs = sorted(p.name for p in out.glob("flux-*.log"))
    if logs:
        subprocess.run(["tar", "czf", "flux-logs.tgz", "--remove-files", *logs], cwd=out)
    return 0 if ok else 1


def check_equality(results):
    """Each mode's deterministic losses against the resident reference of its format: bf16
    resident, or for 8-bit streaming (and resident-fp8 itself) the 8-bit resident reference;
    for 8-bit compute (``W8A8_STREAMED``), the same W8A8 layers in place."""
    modes = {m["mode"]: m for m in results["modes"]}
    refs = {fmt: modes.get(mode, {}).get("det_losses") for fmt, mode in REFERENCE.items()}
    ok = True
    for m in results["modes"]:
        if "w8a8" in m["mode"]:
            continue
        ref = refs[m.get("quantize") or ("fp8" if m["mode"] == "resident-fp8" else None)]
        if "det_losses" in m and ref is not None and m["mode"] != "resident-fp8":
            m["losses_equal_resident"] = m["det_losses"] == ref
            if m["mode"] == "weightstream" and not m["losses_equal_resident"]:
                ok = False
    # Coded: lossless, so the same losses as the same mode uncoded.
    for m in results["modes"]:
        uncoded = modes.get(m["mode"].removesuffix(CODED), {})
        if m["mode"].endswith(CODED) and "det_losses" in m and "det_losses" in uncoded:
            m["losses_equal_uncoded"] = m["det_losses"] == uncoded["det_losses"]
            ok = ok and m["losses_equal_uncoded"]
    # 8-bit compute: streamed against the same W8A8 layers in place.
    for m in results["modes"]:
        if m["mode"].startswith(W8A8_STREAMED) and m["mode"].endswith(CODED):
            continue
        if m["mode"].startswith(W8A8_STREAMED) and "det_losses" in m:
            ref = modes.get(m["mode"].replace(W8A8_STREAMED, "resident-w8a8-", 1), {})
            if "det_losses" in ref:
                m["losses_equal_resident"] = m["det_losses"] == ref["det_losses"]
                ok = ok and m["losses_equal_resident"]
    # Every weightstream record (an interleaved run may hold several: ``MODE+group``).
    equal = [
        m.get("losses_equal_resident") for m in results["modes"] if m["mode"] == "weightstream"
    ]
    results["weightstream_losses_equal"] = None if not equal or None in equal else all(equal)
    print("weightstream losses equal resident:", results["weightstream_losses_equal"])
    return ok


#: The prefix of the 8-bit compute streamed modes (their reference: ``resident-w8a8-MODE``).
W8A8_STREAMED = "weightstream-w8a8-"
#: The reference mode of each weight format (the key: ``--quantize``).
REFERENCE = {None: "resident", "fp8": "resident-fp8"}
