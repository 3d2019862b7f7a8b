"""The modes of tests/bench/flux_train.py that train in one process with weightstream or the
weights in place: resident (bf16, 8 bits, 8 bits under a copy loop, W8A8 8-bit compute),
weightstream (fixed and auto budgets, 8-bit compute, one of two jobs), their timing and
per-step counters, and the probes (dequantization time, the client's CPU per pass, SQNR).
Each ``mode_X(args, record)`` fills ``record``; the in-process peers are in ``baselines``."""

from __future__ import annotations

import functools
import statistics
import subprocess
import time
import traceback
from pathlib import Path

from tests.bench.benchlib import flux
from tests.bench.benchlib.flux import (
    GiB,
    add_lora,
    build,
    build_for_attach,
    deterministic,
    lora_state,
    marks,
    steps,
)


def timing(model, args, record, measuring=None):
    """The warm-up and measured steps; per-step figures are of the measured ones.
    ``measuring()``, if given, runs once the warm-up is done, before the first measured step
    (where counters are read: the first step's cold copies and plan are warm-up)."""
    import torch

    def before_step(i):
        # Each step ends synchronised: the warm-up's device work is done here.
        if i == args.warmup:
            torch.cuda.reset_accumulated_memory_stats()
            if measuring is not None:
                measuring()

    torch.cuda.reset_peak_memory_stats()
    t, _ = steps(model, args.warmup + args.measured, lockstep=True, before_step=before_step)
    measured = t[args.warmup :]
    record["s_per_step"] = round(statistics.median(measured), 4)
    record["steps_s"] = [round(x, 4) for x in measured]
    for key, values in marks.items():
        record[f"{key}_per_step"] = round(statistics.median(values[args.warmup :]), 4)
    record["trainer_peak_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 2)
    record["trainer_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GiB, 2)
    stats = torch.cuda.memory_stats()
    # Allocations that hit the memory-fraction cap: each frees the cache and synchronises.
    record["alloc_retries"] = stats.get("num_alloc_retries", 0)
    # The caching allocator's own device allocations and frees over the measured steps (a
    # cudaFree synchronises the device: under a cap, blocks of changing sizes are freed to make
    # room).
    for key in ("num_device_alloc", "num_device_free"):
        record[f"{key.removeprefix('num_')}s_per_step"] = round(
            stats.get(key, 0) / args.measured, 2
        )


def mode_resident(args, record):
    model = add_lora(build())
    init = lora_state(model)
    timing(model, args, record)
    deterministic(True)
    _, losses = steps(model, args.det_steps, init)
    record["det_losses"] = losses


def streamable(model) -> list[str]:
    """The layers attach streams with its default options (what 8-bit streaming quantizes)."""
    import weightstream.torch as wst
    from weightstream.torch import policy

    return [n for n, _ in policy.select(model, wst.StreamOptions()).streamed]


def sqnr_stats(model, names, device="cuda") -> dict:
    """Per-tensor SQNR (dB) of the 8-bit weights of the layers ``names``, each weight moved to
    ``device`` for its quantization: median and worst, and the worst tensor's name."""
    from weightstream import quantize

    modules = dict(model.named_modules())
    values = {}
    for name in names:
        w = modules[name].weight.detach().to(device)
        values[name] = quantize.sqnr_db(w, quantize.w_hat(w))
    worst = min(values, key=values.get)
    return {
        "median_db": round(statistics.median(values.values()), 2),
        "worst_db": round(values[worst], 2),
        "worst_tensor": worst,
        "tensors": len(values),
    }


def mode_resident_fp8(args, record):
    """The 8-bit resident reference: the bf16 model on the GPU with each weight that
    weightstream would stream replaced in place by its w_hat."""
    from weightstream import quantize

    model = add_lora(build())
    names = streamable(model)
    record["sqnr"] = sqnr_stats(model, names)
    record["quantized_layers"] = len(quantize.to_fp8_resident(model, names))
    init = lora_state(model)
    timing(model, args, record)
    deterministic(True)
    _, losses = steps(model, args.det_steps, init)
    record["det_losses"] = losses


def compute8_layers(model, mode: str) -> list[str]:
    """The layers ``attach(compute=mode)`` computes in 8 bits: those it streams, less the ones
    that keep the trainer's dtype (``compute_plan.fallback_reason``)."""
    from weightstream.torch import compute_plan

    modules = dict(model.named_modules())
    return [n for n in streamable(model) if compute_plan.fallback_reason(mode, modules[n]) is None]


def mode_resident_w8a8(args, record, compute: str):
    """The W8A8 reference with the weights in place: the layers that ``weightstream-w8a8-MODE``
    computes in 8 bits, prepared on the GPU (``compute8.to_w8a8_resident``, after
    ``to_fp8_resident`` with ``--quantize fp8``: the weights that mode streams)."""
    import torch
    from weightstream import quantize
    from weightstream.torch import compute8

    model = add_lora(build())
    names = compute8_layers(model, compute)
    if args.quantize:
        record["quantize"] = args.quantize
        quantize.to_fp8_resident(model, streamable(model))
    stats = compute8.Stats()
    modules = dict(model.named_modules())
    changed = []
    # A block's worth of layers at a time, each bf16 weight given back once its 8-bit form is
    # made: FLUX.2's 64 GB of bf16 and 32 GB of 8-bit weights do not fit an 80 GB card together.
    # The weight keeps its shape, dtype and device (the LoRA wrapper reads them) over no memory.
    for start in range(0, len(names), 16):
        chunk = names[start : start + 16]
        changed += compute8.to_w8a8_resident(
            model,
            compute,
            chunk,
            rotation=args.rotation,
            grad_compute=args.grad_compute,
            stats=stats,
        )
        for name in chunk:
            w = modules[name].weight
            w.data = w.data.new_zeros(()).expand(w.shape)
        torch.cuda.empty_cache()
    record.update(compute=compute, rotation=args.rotation, grad_compute=args.grad_compute)
    record["w8a8_layers"] = len(changed)
    init = lora_state(model)
    timing(model, args, record)
    record["gemm8"] = stats.gemm8
    deterministic(True)
    _, losses = steps(model, args.det_steps, init)
    record["det_losses"] = losses


def mode_resident_fp8_copying(args, record):
    """The 8-bit resident reference while a thread of this process copies 1 GiB of pinned host
    memory to the device on its own stream without pause (``--copy-duty`` of the time; the
    rest it sleeps): what the link's traffic alone costs a step, in the host's memory
    bandwidth the copies take and on the device, against resident-fp8 in the same call
    (weightstream's copies keep the link busy about half of a FLUX.1 8-bit step at 2 GiB).
    Records the copies' rate (``copy_gbps``); no deterministic losses."""
    import threading

    import torch
    from weightstream import quantize

    model = add_lora(build())
    quantize.to_fp8_resident(model, streamable(model))
    src = torch.empty(GiB, dtype=torch.uint8).pin_memory()
    dst = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    stop = threading.Event()
    copied = []

    def copy_loop():
        stream = torch.cuda.Stream()
        while not stop.is_set():
            started = time.perf_counter()
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()
            busy = time.perf_counter() - started
            copied.append(busy)
            stop.wait(busy * (1 / args.copy_duty - 1))

    thread = threading.Thread(target=copy_loop, name="copy-load", daemon=True)
    started = time.perf_counter()
    thread.start()
    try:
        timing(model, args, record)
    finally:
        stop.set()
        thread.join()
    elapsed = time.perf_counter() - started
    record["copy_duty"] = args.copy_duty
    record["copy_gbps"] = round(len(copied) * GiB / sum(copied) / 1e9, 1) if copied else 0.0
    record["copy_busy_share"] = round(sum(copied) / elapsed, 3)


def step_patched(model, patches):
    """One step with each ``owner.name`` of ``patches`` (``(owner, name, wrap)``) replaced by
    ``wrap(real)``, the real one put back after it."""
    reals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for (owner, name, real), (_, _, wrap) in zip(reals, patches, strict=True):
        setattr(owner, name, wrap(real))
    try:
        steps(model, 1)
    finally:
        for owner, name, real in reals:
            setattr(owner, name, real)


def dequant_probe(model, record):
    """One more step with CUDA events around each dequantization (a weight's, or a group's
    launch where the group dequantizes at once): its device time per step (the events wait on
    nothing else: each dequantization follows its group's ready event)."""
    import torch
    from weightstream import _fused_dequant, quantize

    events = []

    def timed(real):
        def call(*args):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = real(*args)
            end.record()
            events.append((start, end))
            return out

        return call

    step_patched(
        model, [(quantize, "dequantize", timed), (_fused_dequant.GroupLaunch, "run", timed)]
    )
    torch.cuda.synchronize()
    record["dequant_calls_per_step"] = len(events)
    record["dequant_ms_per_step"] = round(sum(a.elapsed_time(b) for a, b in events), 2)


def client_cpu_probe(model, handle, record):
    """One more step with the client's calls timed on the CPU, per pass (``forward``; and
    ``backward``, its recompute included, on autograd's thread): milliseconds the calling
    thread spent in the streamed layers' forwards (``layer``, which holds the rest),
    blocked for replies (``Session.wait``), sending acquires and releases (``submit``,
    ``release``), and launching groups' dequantizations (``dequantize_group``), each with
    its number of calls. What ``layer`` leaves of a pass's issuing is the model's own work."""
    import torch
    from weightstream import session as ws_session
    from weightstream.torch import handle as ws_handle
    from weightstream.torch import hooks, ops

    totals: dict = {}

    def timed(real, key):
        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                spent = time.perf_counter() - started
                cell = totals.setdefault("backward" if ops.in_backward() else "forward", {})
                ms, calls = cell.get(key, (0.0, 0))
                cell[key] = (ms + spent * 1e3, calls + 1)

        return call

    targets = [
        (hooks.StreamedForward, "__call__", "layer"),
        (ws_session.Session, "wait", "wait"),
        (ws_session.Session, "submit", "submit"),
        (ws_session.Session, "release", "release"),
        (ws_handle.Handle, "_dequantize_group", "dequantize_group"),
    ]
    if handle._lookahead is not None:  # it keeps the session's submit, bound at its start
        targets.append((handle._lookahead, "submit", "submit"))
    step_patched(
        model,
        [(owner, name, functools.partial(timed, key=key)) for owner, name, key in targets],
    )
    torch.cuda.synchronize()
    record["client_cpu_ms_per_pass"] = {
        phase: {key: {"ms": round(ms, 2), "calls": calls} for key, (ms, calls) in cell.items()}
        for phase, cell in totals.items()
    }


def scrape(args, name: str) -> float:
    """Sum of a metric's samples from the daemon's Prometheus endpoint."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{args.metrics}/metrics", timeout=10).read().decode()
    names = (name + " ", name + "{", name + "_total ", name + "_total{")
    lines = [line for line in text.splitlines() if line.startswith(names)]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return round(kb / (1 << 20), 2)


def measure_budget(args, handle, client, model, r):
    """One budget's timing, with the daemon's and the client's counters over the measured
    steps (the warm-up's first step copies every group cold and records the plan)."""
    start = {}

    def measuring():
        start["stats"] = handle.stats()
        start["busy"] = scrape(args, "weightstream_device_copy_busy_seconds")

    timing(model, args, r, measuring)
    after = handle.stats()
    before, busy = start["stats"], start["busy"]
    n = args.measured
    r["copy_busy_s_per_step"] = round(
        (scrape(args, "weightstream_device_copy_busy_seconds") - busy) / n, 4
    )
    r["bytes_per_step_gib"] = round((after["bytes_copied"] - before["bytes_copied"]) / n / GiB, 2)
    r["hit_rate"] = round(
        (after["hits"] - before["hits"]) / max(1, after["acquires"] - before["acquires"]), 4
    )
    r["acquires_per_step"] = round((after["acquires"] - before["acquires"]) / n, 1)
    per_step = lambda key: (after[key] - before[key]) / n / 1e9  # noqa: E731
    # The trainer's own wait for weights (the compute stream's, timed by the client), and the
    # daemon's time with some acquire pending (look-ahead ones included: not a wait).
    r["gpu_wait_s_per_step"] = round(per_step("gpu_wait_ns"), 4)
    r["acquire_pending_s_per_step"] = round(per_step("acquire_pending_ns"), 4)
    # The trainer's thread blocked for the daemon's reply (issuing nothing meanwhile).
    r["reply_wait_s_per_step"] = round(per_step("reply_wait_ns"), 4)
    r["reply_waits_per_step"] = round((after["reply_waits"] - before["reply_waits"]) / n, 1)
    r["reply_wait_ms_per_step_by_group"] = {
        name: round((ns - before["reply_wait_by_group"][name]) / n / 1e6, 3)
        for name, ns in after["reply_wait_by_group"].items()
    }
    # Where the waits were: per group, ms per step (the groups in the plan's order).
    r["gpu_wait_ms_per_step_by_group"] = {
        name: round((ns - before["gpu_wait_by_group"][name]) / n / 1e6, 3)
        for name, ns in after["gpu_wait_by_group"].items()
    }
    sess = [s for s in client.list_sessions() if s.session_id == handle.session.id][0]
    r["daemon_staging_gib"] = round(sess.staging_bytes / GiB, 2)
    r["daemon_resident_gib"] = round(sess.resident_bytes / GiB, 2)
    r["daemon_resident_groups"] = [g.name for g in handle.session.groups if g.resident]
    r["gpu_total_gib"] = round(
        r["trainer_reserved_gib"] + r["daemon_staging_gib"] + r["daemon_resident_gib"], 2
    )
    r["nvidia_smi_used_gib"] = nvidia_smi_used_gib()


def nvidia_smi_used_gib(index: int = 0) -> float | None:
    """Device ``index``'s used memory as nvidia-smi sees it (every process and context on it)."""
    try:
        query = ["--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(index)]
        out = subprocess.run(
            ["nvidia-smi", *query],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return round(float(out.split()[0]) / 1024, 2)
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def mode_weightstream(args, record, compute: str = "bf16", coding: str | None = None):
    """``compute``: ``attach``'s (``--rotation`` and ``--grad-compute`` with it where 8-bit);
    ``coding``: ``attach``'s, else ``--coding``."""
    import torch
    import weightstream
    import weightstream.torch as wst

    model = add_lora(build_for_attach())
    init = lora_state(model)
    if args.quantize:
        record["quantize"] = args.quantize
        record["sqnr"] = sqnr_stats(model, streamable(model))
    client = weightstream.connect(args.socket)
    total = torch.cuda.get_device_properties(0).total_memory
    started = time.monotonic()
    first = args.budgets[0]
    compute_options = {}
    if compute != "bf16":
        compute_options = dict(
            compute=compute, rotation=args.rotation, grad_compute=args.grad_compute
        )
        record.update(compute_options)
    handle = wst.attach(
        model,
        "cuda",
        client=client,
        vram_budget=daemon_part(args, first),
        staging_bytes=int(args.staging_gib * GiB),
        group_by=args.group_by,
        quantize=args.quantize,
        dequantize=args.dequantize,
        early_release=args.early_release,
        coding=coding or args.coding,
        **compute_options,
    )
    record["coding"] = coding or args.coding
    record["dequantize"] = args.dequantize
    record["early_release"] = args.early_release
    record["attach_s"] = round(time.monotonic() - started, 1)
    record["streamed_modules"] = len(handle.streamed)
    record["groups"] = len(handle.session.groups)
    largest = max(g.nbytes for g in handle.session.groups)
    record["largest_group_gib"] = round(largest / GiB, 3)
    record["trainer_rss_gib"] = rss_gib()
    record["daemon_store_gib"] = round(scrape(args, "weightstream_store_bytes") / GiB, 2)
    # The smallest budget: --min-blocks of the largest block, all of it staging.
    smallest = round(args.trainer_gib + args.min_blocks * largest / GiB, 2)
    record["budgets"] = {}
    for budget in [*args.budgets, smallest] if args.min_blocks > 0 else args.budgets:
        key = f"{budget:g}"
        flux.training_label = f"{args.mode} {key} GiB"
        r = record["budgets"][key] = {"daemon_budget_gib": daemon_part(args, budget) / GiB}
        try:
            if budget == smallest:
                part = daemon_part(args, budget)
                handle.set_budget(part, staging_bytes=part)
            elif budget != first:
                handle.set_budget(daemon_part(args, budget), int(args.staging_gib * GiB))
            torch.cuda.set_per_process_memory_fraction(args.trainer_gib * GiB / total)
            torch.cuda.empty_cache()
            measure_budget(args, handle, client, model, r)
        except Exception as e:  # noqa: BLE001 - a budget that fails is reported, not fatal
            r["error"] = repr(e)[:400]
            traceback.print_exc()
    if args.quantize:
        # At the last timed budget, where the streamed groups dequantize as in the timed steps
        # (at the deterministic budget most groups are resident, dequantized per call).
        dequant_probe(model, record)
        record["dequant_peak_gib"] = round(handle.stats()["dequant_scratch_peak_bytes"] / GiB, 3)
    client_cpu_probe(model, handle, record)
    if compute_options:
        stats = handle.stats()
        record["w8a8_layers"] = sum(1 for layer in handle.streamed.values() if layer.compute8)
        record["compute_fallback_layers"] = stats["compute_fallback_layers"]
    torch.cuda.set_per_process_memory_fraction(1.0)
    handle.set_budget(daemon_part(args, args.det_budget))
    flux.training_label = f"{args.mode} deterministic, {args.det_budget:g} GiB"
    deterministic(True)
    _, losses = steps(model, args.det_steps, init)
    record["det_losses"] = losses
    record["det_budget_gib"] = args.det_budget
    # The next mode uploads again: give the daemon's host copy back (the host quota would
    # refuse a second 64 GB FLUX.2 copy).
    handle.close(release=True)


def mode_weightstream_auto(args, record):
    """attach(vram_budget="auto"): the session starts at its minimum, grows after the first
    step to what the device has left less the margin, and is timed there."""
    import torch
    import weightstream
    import weightstream.torch as wst

    model = add_lora(build_for_attach())
    client = weightstream.connect(args.socket)
    started = time.monotonic()
    handle = wst.attach(model, "cuda", client=client, vram_budget="auto", quantize=args.quantize)
    record["attach_s"] = round(time.monotonic() - started, 1)
    if args.quantize:
        record["quantize"] = args.quantize
    r = record["budgets"] = {"auto": {}}
    measure_budget(args, handle, client, model, r["auto"])
    stats = handle.stats()
    r["auto"].update({k: v for k, v in stats.items() if k.startswith("auto_")})
    free, total = torch.cuda.mem_get_info()
    r["auto"]["device_free_after_gib"] = round(free / GiB, 2)
    handle.close(release=True)


def daemon_part(args, budget_gib: float) -> int:
    """The daemon's share of a budget: all but what the trainer needs beside the weights
    (activations with checkpointing, LoRA and its optimizer state)."""
    return int((budget_gib - args.trainer_gib) * GiB)


def mode_job(args, record):
    """One of the two jobs sharing the GPU (see two_jobs): job 0 uploads the weights, job 1
    streams the daemon's copy of them; both time their steps over the same window."""
    import torch
    import weightstream
    import weightstream.torch as wst

    barrier = Path(args.barrier)
    if args.jobs_resident:
        # The ceiling for two jobs on one GPU: each with its own weights in place (8-bit ones
        # as w_hat with --quantize fp8), no streaming, the same timing window.
        from weightstream import quantize

        model = add_lora(build())
        if args.quantize:
            quantize.to_fp8_resident(model, streamable(model))
        together(model, args, barrier, record)
        return
    if args.job == 1:
        # Built once job 0 has attached (and freed its device copy): two FLUX.2 copies at once
        # would not fit on the device, nor two uploads in host memory.
        while not (barrier / "model").exists():
            time.sleep(0.5)
    model = add_lora(build_for_attach())
    client = weightstream.connect(args.socket)
    total = torch.cuda.get_device_properties(0).total_memory
    budget = daemon_part(args, args.jobs_budget)
    if args.job == 0:
        handle = wst.attach(
            model, "cuda", client=client, vram_budget=budget, quantize=args.quantize
        )
        (barrier / "model").write_text(handle.model_id)
    else:
        model_id = (barrier / "model").read_text()
        handle = wst.attach(
            model, "cuda", client=client, vram_budget=budget, model=model_id, quantize=args.quantize
        )
    record["trainer_rss_gib"] = rss_gib()
    torch.cuda.set_per_process_memory_fraction(args.trainer_gib * GiB / total)
    together(model, args, barrier, record)
    record["model_id"] = handle.model_id


def together(model, args, barrier: Path, record):
    """The warm-up steps, then, once both jobs are warm, the timed ones: the same window."""
    steps(model, args.warmup)
    (barrier / f"ready{args.job}").write_text("")
    while not all((barrier / f"ready{k}").exists() for k in (0, 1)):
        time.sleep(0.01)
    t, _ = steps(model, args.measured)
    record["s_per_step"] = round(statistics.median(t), 4)
    record["steps_s"] = [round(x, 4) for x in t]
