"""Benchmark: sampling at the link's pace (issue #48). FLUX.2-dev's transformer (random bf16
weights, diffusers' default config, 32 B) at 1024² (4096 image + 512 text tokens), N denoising
forward passes under ``no_grad``: the bf16 resident forward on the whole device as the
reference, then weightstream within a --card-gib job (built on the device and uploaded from
there, then the trainer's allocator capped at the card less the session, as flux2_train does;
the daemon's link capped at --link) before any training step and after two LoRA training steps,
optionally at a sampling budget; in the same call:

    python3 -m tests.bench.sampling --bin target/release/weightstream --out $OUT \\
        --card-gib 24 --link 25GB/s --vram-budget-gib 15 --quantize fp8 \\
        [--sample-vram-budget-gib 20]

Recorded per phase (``before``, ``after``): each pass's seconds (the first apart), their
median over the resident median, the passes' streamed bytes over the link
(``bytes_per_pass / link``: the bound a streamed step cannot beat), the client's counters per
kind (``sample_*``, ``train_*`` of ``Handle.stats()``), what the daemon's copy thread did over
the passes after the first (its device metrics, scraped: GB/s, the share of the time it was
throttled by the link cap and its copy engine busy; the rest is time it had no copy ready,
which is where a pass over the link bound loses it), and the training step just before and
right after sampling. Results: $OUT/sampling.json and sampling.md, with the command, the
commit ($WS_COMMIT, else git's) and the device. Children run as ``python3 -m
tests.bench.sampling --child MODE`` and print one ``RESULT <json>`` line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tests.bench.benchlib.runner import result_of
from tests.bench.provenance import command, commit
from tests.gpu.link_cap import free_port, scrape

GiB = 1 << 30
RESULT = "RESULT "


def timed(step, n: int, sync) -> list[float]:
    """Seconds of each of ``n`` calls of ``step()`` under ``no_grad`` (``sync()``: wait for the
    device before and after each)."""
    import torch

    times = []
    with torch.no_grad():
        for _ in range(n):
            sync()
            t = time.monotonic()
            step()
            sync()
            times.append(time.monotonic() - t)
    return times


def timed_passes(model, inputs: dict, n: int, sync) -> list[float]:
    """Seconds of each of ``n`` forward passes of ``model(**inputs)`` (``timed``)."""
    return timed(lambda: model(**inputs), n, sync)


def back_to_back(step, n: int, sync) -> list[float]:
    """Seconds of each of ``n`` calls of ``step()`` under ``no_grad`` run one after the other
    with no wait for the device between them, as a denoising loop runs them (``timed`` waits
    before and after each, so the next call's first copies start only once the device has
    finished the last one): on CUDA, from events recorded between the calls, read once all
    are done; on the CPU, the calls' own seconds."""
    import torch

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()

    def mark():
        if not cuda:
            return time.monotonic()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    with torch.no_grad():
        sync()
        marks = [mark()]
        for _ in range(n):
            step()
            marks.append(mark())
        sync()
    pairs = zip(marks[:-1], marks[1:], strict=True)
    if cuda:
        return [a.elapsed_time(b) / 1e3 for a, b in pairs]
    return [b - a for a, b in pairs]


def kind_counts(stats: dict) -> dict:
    keys = ("acquires", "hits", "off_plan", "passes", "gpu_wait_ns", "reply_wait_ns")
    return {f"{k}_{c}": stats[f"{k}_{c}"] for k in ("sample", "train") for c in keys}


def difference(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def link_use(moved: dict, seconds: float) -> dict:
    """What the daemon's copy thread did over ``seconds`` of passes (``moved``: its device
    metrics' differences): the bytes and rate, and the shares of the time it waited for the
    link cap (throttled: a copy was ready) and its copy engine copied; what neither covers is
    time the link had nothing ready to copy (waiting for space, events or acquires)."""
    get = lambda name: moved[f"weightstream_device_{name}_total"]  # noqa: E731
    return {
        "seconds": seconds,
        "streamed_bytes": get("streamed_bytes"),
        "gb_per_s": get("streamed_bytes") / seconds / 1e9,
        "throttled_share": get("copy_throttled_seconds") / seconds,
        "busy_share": get("copy_busy_seconds") / seconds,
        "copies": get("copies"),
    }


def sampling_phase(
    model, inputs, n, handle, sync, around=contextlib.nullcontext, device=None
) -> dict:
    """``n`` passes inside ``handle.sampling()`` and, within it, ``around()``: times and the
    counters they moved, and the seconds ``sampling()`` took to begin and to end (at a sampling
    budget: the session opened again at the other budget, its resident groups copied, and the
    trainer's allocator given back what it gave up for sampling in one allocation); with
    ``device`` (the daemon's device metrics, by name), what the copy thread did over the passes
    after the first (``link_use``)."""
    before = kind_counts(handle.stats())
    sync()
    began = time.monotonic()
    with handle.sampling():
        with around():
            sync()
            enter_s = time.monotonic() - began
            times, flowing, streamed, moved, seconds = _passes(
                model, inputs, n, handle, sync, device
            )
            sync()
            ending = time.monotonic()
    sync()
    exit_s = time.monotonic() - ending
    record = {
        "first_pass_s": times[0],
        "pass_s": times[1:],
        "median_s": statistics.median(times[1:]) if n > 1 else times[0],
        "back_to_back_pass_s": flowing,
        "back_to_back_s": statistics.median(flowing) if flowing else None,
        "counters": difference(kind_counts(handle.stats()), before),
        "bytes_per_pass": streamed,
        "enter_s": enter_s,
        "exit_s": exit_s,
        # The trainer's idle segments given back for the passes and made again after them.
        "segments": {
            k: v
            for k, v in handle.stats().items()
            if k.startswith(("sampling_segm", "sampling_resident_kept"))
        },
    }
    if moved is not None and n > 1:
        record["link"] = link_use(moved, seconds)
    return record


def _passes(model, inputs, n, handle, sync, device):
    """``sampling_phase``'s passes: (their seconds, back to back ones, the streamed bytes a
    pass, the device metrics they moved, the seconds of the passes after the first)."""
    times = timed_passes(model, inputs, 1, sync)
    start, metrics = time.monotonic(), device() if device else None
    times += timed_passes(model, inputs, n - 1, sync)
    seconds = time.monotonic() - start
    moved = difference(device(), metrics) if device else None
    flowing = back_to_back(lambda: model(**inputs), n - 1, sync) if n > 1 else None
    streamed = streamed_bytes_per_pass(handle)  # at the sampling budget, where one is set
    return times, flowing, streamed, moved, seconds


def weightstream_run(
    model,
    inputs,
    n,
    handle,
    train_step,
    sync,
    around=contextlib.nullcontext,
    device=None,
    allocs=lambda: 0,
) -> dict:
    """Sampling before any training step, two training steps, sampling again, two more steps:
    the phases' records, the training steps' seconds (the second is the one just before
    sampling, the third the one right after, the fourth the next: what the third loses once
    only), and the trainer allocator's device allocations in each step (``allocs()``: a
    running count; on CUDA, torch's ``num_device_alloc``: a step after sampling that allocates
    again what sampling's budget had it give back). ``around``: what holds each sampling phase
    (the trainer's share of the card while the session has grown)."""
    record = {"before": sampling_phase(model, inputs, n, handle, sync, around, device)}
    steps, made = [], []

    def step():
        sync()
        t, a = time.monotonic(), allocs()
        train_step()
        sync()
        steps.append(time.monotonic() - t)
        made.append(allocs() - a)

    step()
    counts = kind_counts(handle.stats())
    step()
    record["train_counters_step_before"] = difference(kind_counts(handle.stats()), counts)
    counts = kind_counts(handle.stats())
    record["after"] = sampling_phase(model, inputs, n, handle, sync, around, device)
    step()
    record["train_counters_step_after"] = difference(kind_counts(handle.stats()), counts)
    step()
    record["train_step_s"] = steps
    record["train_step_device_allocs"] = made
    return record


def streamed_bytes_per_pass(handle) -> int:
    return sum(g.nbytes for g in handle.session.groups if not g.resident)


# --- children (GPU) -------------------------------------------------------------------------


def _cuda_inputs():
    import torch

    from tests.bench.benchlib import flux

    flux.MODEL = "flux2"
    inputs = flux.batch()
    inputs["return_dict"] = False
    torch.backends.cuda.enable_cudnn_sdp(False)  # see DESIGN.md: cuDNN attention fails here
    return flux, inputs


def child_resident(args) -> dict:
    import torch

    flux, inputs = _cuda_inputs()
    model = flux.add_lora(flux.build())
    times = timed_passes(model, inputs, args.passes + 1, torch.cuda.synchronize)
    flowing = back_to_back(lambda: model(**inputs), args.passes, torch.cuda.synchronize)
    return {
        "first_pass_s": times[0],
        "pass_s": times[1:],
        "median_s": statistics.median(times[1:]),
        "back_to_back_pass_s": flowing,
        "back_to_back_s": statistics.median(flowing),
    }


def child_weightstream(args) -> dict:
    import torch
    import weightstream.torch as wst

    from tests.daemon import Daemon

    flux, inputs = _cuda_inputs()
    link = ["--copy-bandwidth-limit", args.link] if args.link else []
    port = free_port()
    metrics = ["--metrics-listen", f"127.0.0.1:{port}"]
    daemon = Daemon(
        Path(args.out), *link, *metrics, binary=args.bin, backend="cuda", log_level=args.daemon_log
    )
    try:
        model = flux.add_lora(flux.build_for_attach())
        sample_budget = args.sample_vram_budget_gib
        handle = wst.attach(
            model,
            "cuda",
            vram_budget=int(args.vram_budget_gib * GiB),
            client=daemon.client,
            quantize=args.quantize,
            compute=args.compute,
            sample_vram_budget=int(sample_budget * GiB) if sample_budget else None,
            sample_staging_bytes=(
                int(args.sample_staging_gib * GiB) if args.sample_staging_gib else None
            ),
        )
        total = torch.cuda.get_device_properties(0).total_memory

        def hold(session_gib, empty=True):
            """The trainer's allocator held to the card less the session's budget."""
            if empty:
                torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction((args.card_gib - session_gib) * GiB / total)

        @contextlib.contextmanager
        def card_while_sampling():
            # Inside sampling(): the session has grown into what training's activations and
            # gradients would take (the trainer's cache emptied for it); the trainer's share
            # is back before the session shrinks and sampling() reserves that share again.
            hold(sample_budget)
            try:
                yield
            finally:
                hold(args.vram_budget_gib, empty=False)

        if args.card_gib:
            hold(args.vram_budget_gib)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)

        def train_step():
            model(**inputs)[0].float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        around = card_while_sampling if args.card_gib and sample_budget else None
        record = weightstream_run(
            model,
            inputs,
            args.passes + 1,
            handle,
            train_step,
            torch.cuda.synchronize,
            around or contextlib.nullcontext,
            lambda: scrape(f"http://127.0.0.1:{port}/metrics"),
            lambda: torch.cuda.memory_stats().get("num_device_alloc", 0),
        )
        record["bytes_per_pass"] = streamed_bytes_per_pass(handle)
        # Not detach: it would give FLUX.2's weights back to the device, over the card.
        handle.close(release=True)
        return record
    finally:
        daemon.stop()


# --- the parent ---------------------------------------------------------------------------


def child_cmd(args, mode: str) -> list[str]:
    cmd = [sys.executable, "-m", "tests.bench.sampling", "--child", mode, "--out", args.out]
    cmd += ["--bin", args.bin, "--passes", str(args.passes), "--daemon-log", args.daemon_log]
    cmd += ["--vram-budget-gib", str(args.vram_budget_gib)]
    if args.quantize:
        cmd += ["--quantize", args.quantize]
    if args.compute != "bf16":
        cmd += ["--compute", args.compute]
    if args.sample_vram_budget_gib:
        cmd += ["--sample-vram-budget-gib", str(args.sample_vram_budget_gib)]
    if args.sample_staging_gib:
        cmd += ["--sample-staging-gib", str(args.sample_staging_gib)]
    if mode == "weightstream" and args.card_gib:
        # Not card.py: FLUX.2's 64 GB of bf16 weights are built on the device and uploaded
        # from there by attach (they do not fit host memory twice), which a card held to 24 GiB
        # from the start cannot hold. As flux2_train does, the job is held to the card after
        # attach: the trainer's allocator capped at the card less the daemon's budget.
        cmd += ["--card-gib", str(args.card_gib)]
        if args.link:
            cmd += ["--link", args.link]
    return cmd


def ratios(results: dict, link: int | None) -> dict:
    """Each weightstream phase's median pass over the resident one, and over the larger of
    it and the pass's bytes over the link (the issue's target: at most 1.05); the same for the
    passes run back to back (``b2b_`` keys), each over the resident ones run so."""
    res, ws = results.get("resident", {}), results.get("weightstream", {})
    out = {}
    for key, prefix in (("median_s", ""), ("back_to_back_s", "b2b_")):
        ref = res.get(key)
        for phase in ("before", "after"):
            mine = ws.get(phase, {}).get(key)
            if ref and mine:
                out[f"{prefix}{phase}_over_resident"] = mine / ref
                streamed = ws[phase].get("bytes_per_pass", ws.get("bytes_per_pass"))
                if link and streamed:
                    out[f"{prefix}{phase}_over_bound"] = mine / max(ref, streamed / link)
    return out


def markdown(report: dict) -> str:
    lines = [
        "# Sampling at the link's pace (FLUX.2-dev, 1024², no_grad passes)",
        "",
        f"- command: `{report['command']}`",
        f"- commit: {report['commit']}; device: {report['device']}",
        f"- sampling budget: {report.get('sample_vram_budget_gib') or 'none'} (GiB), its "
        f"staging: {report.get('sample_staging_gib') or 'three of the largest group'} (GiB)",
        "",
        "Each pass timed alone (the device waited for before and after it) and the passes run "
        "back to back as a denoising loop runs them (the median pass, from CUDA events between "
        "them); each over the resident "
        "pass timed the same way, and over the bound: the larger of that and the pass's "
        "streamed bytes over the link.",
        "",
        "| mode | phase | first pass s | median pass s | × resident | × bound "
        "| back to back s | × resident | × bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    res, ratios = report["results"], report["ratios"]

    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    if "median_s" in res.get("resident", {}):
        r = res["resident"]
        lines.append(
            f"| resident bf16 | - | {r['first_pass_s']:.3f} | {r['median_s']:.3f} | 1.00 | - "
            f"| {num(r.get('back_to_back_s'), '.3f')} | 1.00 | - |"
        )
    for phase in ("before", "after"):
        p = res.get("weightstream", {}).get(phase)
        if p:
            cells = [
                num(ratios.get(f"{pre}{phase}_over_{what}"), ".2f")
                for pre in ("", "b2b_")
                for what in ("resident", "bound")
            ]
            lines.append(
                f"| weightstream | {phase} training | {p['first_pass_s']:.3f} | "
                f"{p['median_s']:.3f} | {cells[0]} | {cells[1]} | "
                f"{num(p.get('back_to_back_s'), '.3f')} | {cells[2]} | {cells[3]} |"
            )
    failed = [(mode, r) for mode, r in res.items() if "error" in r]
    if failed:
        lines.append("")
    for mode, r in failed:  # a child with no RESULT line: its exit status and stderr's tail
        tail = " / ".join(x.strip() for x in r["error"].strip().splitlines()[-3:])
        lines.append(f"- {mode} failed (exit status {r.get('returncode')}): `{tail}`")
    links = [
        (ph, res.get("weightstream", {}).get(ph, {}).get("link")) for ph in ("before", "after")
    ]
    if any(link for _, link in links):
        lines.append("")
    for phase, link in links:
        if link:
            lines.append(
                f"- {phase} training, the passes after the first: the daemon copied "
                f"{link['gb_per_s']:.2f} GB/s, its copy thread throttled by the link cap "
                f"{100 * link['throttled_share']:.1f} % of the time, the copy engine busy "
                f"{100 * link['busy_share']:.1f} %"
            )
    for phase in ("before", "after"):
        rec = res.get("weightstream", {}).get(phase, {})
        if rec.get("enter_s") is not None:
            seg = rec.get("segments") or {}
            made = (
                f"; the trainer's idle segments: {seg['sampling_segments_given']} given back, "
                f"{seg['sampling_segments_made']} made again "
                f"({seg['sampling_segments_made_bytes'] / 2**30:.2f} GiB)"
                if seg
                else ""
            )
            if "sampling_resident_kept_groups" in seg:
                made += (
                    f"; resident groups kept through the reopen: "
                    f"{seg['sampling_resident_kept_groups']} "
                    f"({seg['sampling_resident_kept_bytes'] / 2**30:.2f} GiB)"
                )
            if seg.get("sampling_resident_kept_staged_groups"):
                made += (
                    f"; the groups the next step stages first, staged within the device: "
                    f"{seg['sampling_resident_kept_staged_groups']} "
                    f"({seg['sampling_resident_kept_staged_bytes'] / 2**30:.2f} GiB)"
                )
            lines.append(
                f"- {phase} training, `sampling()` began in {rec['enter_s']:.3f} s and ended in "
                f"{rec['exit_s']:.3f} s (at a sampling budget: the session opened again){made}"
            )
    steps = res.get("weightstream", {}).get("train_step_s")
    if steps:
        line = f"Training step before / after sampling: {steps[1]:.3f} / {steps[2]:.3f} s"
        if len(steps) > 3:
            line += f" (the next: {steps[3]:.3f} s)"
        made = res["weightstream"].get("train_step_device_allocs")
        if made:
            line += f"; the trainer's device allocations in each step: {made}"
        waits = [
            res["weightstream"].get(f"train_counters_step_{k}", {}).get("train_gpu_wait_ns")
            for k in ("before", "after")
        ]
        if None not in waits:
            line += f"; GPU wait before / after: {waits[0] / 1e6:.0f} / {waits[1] / 1e6:.0f} ms"
        lines += ["", line]
    return "\n".join(lines) + "\n"


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "unknown"


def parent(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for mode in ("resident", "weightstream"):
        proc = subprocess.run(child_cmd(args, mode), capture_output=True, text=True)
        (out / f"sampling-{mode}.log").write_text(proc.stdout + proc.stderr)
        results[mode] = result_of(mode, proc.stdout, proc.stderr)
        results[mode]["returncode"] = proc.returncode
    from weightstream.sizes import parse_rate

    link = parse_rate("--link", args.link) if args.link else None
    report = {
        "command": command(),
        "commit": commit(),
        "device": device_name(),
        "sample_vram_budget_gib": args.sample_vram_budget_gib or None,
        "sample_staging_gib": args.sample_staging_gib or None,
        "results": results,
        "ratios": ratios(results, link),
    }
    (out / "sampling.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "sampling.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if all(r["returncode"] == 0 for r in results.values()) else 1


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python3 -m tests.bench.sampling")
    p.add_argument("--bin", default="target/release/weightstream")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-sampling-out"))
    p.add_argument("--passes", type=int, default=28, help="timed passes after the first")
    p.add_argument("--card-gib", type=float, default=24.0, help="the emulated card (0: none)")
    p.add_argument("--link", default="25GB/s", help="the daemon's copy bandwidth limit")
    p.add_argument("--vram-budget-gib", type=float, default=15.0)
    p.add_argument("--sample-vram-budget-gib", type=float, default=0.0)
    p.add_argument(
        "--sample-staging-gib",
        type=float,
        default=0.0,
        help="its staging (sample_staging_bytes; 0: the client's default, three of the "
        "largest group)",
    )
    p.add_argument("--quantize", choices=["fp8"], default=None)
    p.add_argument(
        "--compute",
        choices=["bf16", "fp8", "int8"],
        default="bf16",
        help="attach's compute: how the streamed layers multiply (fp8, int8: W8A8)",
    )
    p.add_argument(
        "--daemon-log",
        default="warn",
        help="the daemon's WEIGHTSTREAM_LOG (its log: OUT/daemon.log), e.g. "
        "warn,weightstream::timeline=debug for each copy's dispatch, acquire and release",
    )
    p.add_argument("--child", choices=["resident", "weightstream"])
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child is None:
        return parent(args)
    run = child_resident if args.child == "resident" else child_weightstream
    print(RESULT + json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
