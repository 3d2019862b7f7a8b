"""Where a FLUX LoRA step's time goes, resident against weightstream (GPU machine): per step,
when the CPU finished issuing forward, backward and the optimizer step against when the GPU
finished; then one step under torch.profiler (CPU and CUDA), written as a Chrome trace for
tests/bench/flux_gaps.py to find the GPU's idle gaps and what each waited for.

    python3 -m tests.bench.flux_profile --bin target/release/weightstream --out $OUT \\
        [--budget 24] [--trainer-gib 4] [--quantize fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from tests.bench import flux_gaps
from tests.bench.benchlib import flux, modes
from tests.bench.provenance import command, commit  # noqa: E402

GiB = 1 << 30


def timed_steps(model, n):
    """Per step: seconds until forward, backward and the optimizer step were issued, and
    until the GPU was done."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    inputs = flux.batch()
    rows = []
    phase = torch.profiler.record_function  # ranges that flux_gaps splits the gaps by
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.monotonic()
        with phase("ws_forward"):
            out = model(**inputs, return_dict=False)[0]
            loss = out.float().pow(2).mean()
        t1 = time.monotonic()
        with phase("ws_backward"):
            loss.backward()
        t2 = time.monotonic()
        with phase("ws_optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        t3 = time.monotonic()
        torch.cuda.synchronize()
        t4 = time.monotonic()
        rows.append([t1 - t0, t2 - t0, t3 - t0, t4 - t0])
    return rows


def profile(model, out: Path, name: str, warmup: int, n: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    rows = timed_steps(model, warmup + n)[warmup:]
    med = [round(statistics.median(r[i] for r in rows), 4) for i in range(4)]
    keys = ["forward_issued", "backward_issued", "opt_issued", "gpu_done"]
    summary = dict(zip(keys, med, strict=True))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_steps(model, 1)
    trace = out / f"trace_{name}.json"
    prof.export_chrome_trace(str(trace))
    summary["gaps"] = flux_gaps.gaps(str(trace))
    subprocess.run(["gzip", "-f", str(trace)], check=False)
    return summary


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", default="target/release/weightstream")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-flux-prof"))
    parser.add_argument("--budget", type=float, default=24)
    parser.add_argument("--trainer-gib", type=float, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--only", choices=["resident", "weightstream"])
    parser.add_argument(
        "--quantize",
        choices=["fp8"],
        help="8 bits: the resident model holds each streamed weight's w_hat (flux_train's "
        "resident-fp8), weightstream streams fp8_e4m3_block64",
    )
    parser.add_argument(
        "--dequantize",
        choices=["auto", "layer", "group"],
        default="auto",
        help="attach's dequantize",
    )
    args = parser.parse_args()
    import torch
    import weightstream.torch as wst

    from tests.daemon import Daemon

    torch.backends.cuda.enable_cudnn_sdp(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "command": command(),
        "commit": commit(),
        "budget_gib": args.budget,
        "quantize": args.quantize,
        "dequantize": args.dequantize,
    }
    if args.only != "weightstream":
        model = flux.add_lora(flux.build())
        if args.quantize:
            from weightstream import quantize

            quantize.to_fp8_resident(model, modes.streamable(model))
        results["resident"] = profile(model, out, "resident", args.warmup, args.steps)
        print("resident", results["resident"], flush=True)
        del model
        torch.cuda.empty_cache()
    if args.only != "resident":
        daemon = Daemon(
            tempfile.mkdtemp(prefix="ws-prof-"),
            binary=args.bin,
            backend="cuda",
            log=out / "prof-daemon.log",
            log_level=None,
            ready_s=60,
        )
        model = flux.add_lora(flux.build_on_host())
        client = daemon.client
        budget = int((args.budget - args.trainer_gib) * GiB)
        handle = wst.attach(
            model,
            "cuda",
            client=client,
            vram_budget=budget,
            quantize=args.quantize,
            dequantize=args.dequantize,
        )
        results["weightstream"] = profile(model, out, "weightstream", args.warmup, args.steps)
        results["weightstream"]["stats"] = handle.stats()
        print("weightstream", results["weightstream"], flush=True)
        handle.detach(release=True)
        daemon.stop(timeout=30)
    (out / "flux_profile.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
