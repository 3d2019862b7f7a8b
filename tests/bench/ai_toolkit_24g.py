"""ai-toolkit's own recipe for a 24 GB card, through its real `run.py`, on an emulated 24 GiB
card: ai-toolkit's MemoryManager against weightstream-aitk, with one YAML
(tests/bench/ai_toolkit_24g.yaml: `quantize: true` qfloat8, `quantize_te: true`, `low_vram`,
`layer_offloading: true`, LoRA, 1024 px, gradient checkpointing, adamw8bit).

`--qtype` sets another `model.qtype` (e.g. `uint4`, `convrot8`); `--ara` adds a seeded random
accuracy recovery adapter (`model.accuracy_recovery_adapter`, flux2).

    # on the GPU machine, one call per architecture (tests/bench/README.md has the commands)
    python3 -m tests.bench.ai_toolkit_24g --aitk .aitk --bin target/release/weightstream \\
        --arch flux2 --size dev --card 24 --budget-s 500 --out $OUT
    # rank 1024 with the LoRA in host memory (ai-toolkit's own manager is expected not to fit
    # rank 1024 on the card: its comparison is at rank 128)
    python3 -m tests.bench.ai_toolkit_24g --aitk .aitk --bin target/release/weightstream \\
        --arch flux2 --size dev --card 24 --runs host:r1024:25GB/s,host:r1024:full,aitk:r128 \\
        --budget-s 500 --out $OUT
    # the whole flow on a tiny model, no card (CPU or GPU)
    python3 -m tests.bench.ai_toolkit_24g --aitk .aitk --bin target/debug/weightstream \\
        --smoke --out /tmp/aitk-smoke

What runs, unchanged: ai-toolkit's `run.py` and everything under it (tests/bench/
aitk/measure.py's `run_one`, its stubs and shim), once per run of `--runs`:
`MODE:rRANK[:LINK]`, MODE `aitk` (`python run.py job.yaml`) or `weightstream`
(`python -m weightstream.integrations.ai_toolkit run.py job.yaml` against a daemon started for
the run, its copies capped at LINK, e.g. `25GB/s`, or `full`), or `host` (a `weightstream` run
with `WEIGHTSTREAM_TRAINABLE=host`: the LoRA's weights, gradients and optimizer state in host
memory; `--host-delay false` turns its delayed update off), or `resident` (`python run.py` with
`layer_offloading: false`: the 8-bit weights in place, never under the card, since they do not
fit one; the floor any offloading is measured against), or `resident16` (the same with
`quantize: false`: the bf16 weights in place, for ai-toolkit's resident 8-bit layers are
optimum-quanto's, not the torchao ones its layer offloading streams). ai-toolkit's own manager
copies with its own streams: the link cap does not reach it (it always has the device's full
link).

With `--host-limit-gib N` (and `--card`) each run's card.py, and so its daemon and trainer,
runs in a fresh memory cgroup of N GiB with swap off (tests/bench/aitk/cgroup.py, cgroup v2 or
v1; root and the memory controller needed, checked before the build); the report gives the
cgroup's peak, the limit and the OOM killer's kills.

With `--card GIB` each run is wrapped in tests/bench/card.py (`--card-cmd`), which holds all but
GIB of the device for the run's whole life, daemon included, and reports the device's peak use
while loading and while training (the shim marks the training phase at ai-toolkit's first
train loop step, and splits torch's peaks in the trainer there). Runs
are started in order while `--budget-s` allows (a run is expected to take as long as the longest
so far, `--first-run-s` before any); the rest are recorded as not run.

Models, seeded random weights in the layout each loader reads (what is reduced is in the
report):
- flux2 (FLUX.2-dev, `extensions_built_in/diffusion_models/flux2/flux2_model.py`):
  `model/flux2-dev.safetensors` (ai-toolkit's own `Flux2(Flux2Params())`, 32 B parameters, Linear
  weights stored as float8 e4m3 unless `--disk-dtype bf16`: the loader casts them to bf16),
  `model/ae.safetensors` (its `AutoEncoder` at the real size), and a Mistral3ForConditional
  Generation saved as `mistralai/Mistral-Small-3.1-24B-Instruct-2503` in HF_HOME's cache with a
  PixtralProcessor over a byte-level tokenizer: the real width (5120: the transformer reads
  3 x 5120) and the 30 layers the pipeline reads (hidden states 10, 20, 30), with narrower
  attention and MLP and a tiny vision tower; with `--te-size full`, Mistral Small 3.1's text
  model at its full size (40 layers, vocabulary 131072: 47 GB of bf16, written one shard at a
  time), the vision tower still one layer and the tokenizer byte-level. `--single-blocks N`
  (or `disk`: the most that fit --work's free disk) sets the single blocks in place of
  `--host-gib`.
- flux (FLUX.1-dev, `toolkit/stable_diffusion_model.py`): a diffusers folder, the transformer at
  FLUX.1-dev's size (Linear weights float8 on disk), T5-XXL's encoder at its real size (bf16),
  one-layer CLIP, a small VAE (tests/bench/aitk/build.py's `build_model`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from tests.bench.aitk import build, cgroup, measure
from tests.bench.aitk.build_24g import (
    FLUX2_CLASS,
    MISTRAL_FULL,
    SIZES,
    TE_SHARD_BYTES,
    build_flux1,
    build_flux2,
    flux2_ara_layers,
    flux2_disk_bytes,
    flux2_singles_for_disk,
    flux2_singles_for_host,
)
from tests.bench.aitk.report_24g import markdown
from tests.bench.aitk.runs_24g import (
    BUILT,
    CARD_CMD,
    DEFAULT_RUNS,
    host_limit_conflict,
    launch,
    one,
    parse_runs,
    reused,
    summarize,
)
from tests.bench.aitk_packed_real import write_ara
from tests.bench.provenance import commit

STEM = "ai_toolkit_24g"


def free_disk(work: Path) -> int:
    """The bytes free on ``work``'s file system once ``work``'s old contents are removed (a
    build removes them first; links are not followed)."""
    where = work
    while not where.exists():
        where = where.parent
    held = 0
    if work.is_dir():
        for path in work.rglob("*"):
            if path.is_file() and not path.is_symlink():
                held += path.lstat().st_size
    return shutil.disk_usage(where).free + held


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--aitk", help="ai-toolkit checkout (its run.py is run unchanged)")
    ap.add_argument("--bin", help="the weightstream daemon binary")
    ap.add_argument("--arch", choices=sorted(SIZES), default="flux2")
    ap.add_argument("--size", choices=["tiny", "dev"], default="dev")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 4 steps at 64 px")
    ap.add_argument("--runs", default=None, help=f"default: {DEFAULT_RUNS}")
    ap.add_argument(
        "--host-delay",
        choices=["true", "false"],
        default="true",
        help="host runs: WEIGHTSTREAM_TRAINABLE_DELAY (HostAdamW's delayed update)",
    )
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument(
        "--sample-every",
        type=int,
        default=0,
        help="ai-toolkit's sample: section, rendering --sample-prompt at step 0, every N steps"
        " and at the end, each denoising pass timed by the shim (0: no sampling)",
    )
    ap.add_argument("--sample-steps", type=int, default=28, help="denoising steps a sample")
    ap.add_argument("--sample-prompt", default="a lighthouse at dusk, oil painting")
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--images", type=int, default=2)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--optimizer", default=None, help="default: adamw8bit on CUDA, else adamw")
    ap.add_argument("--no-quantize", action="store_true", help="quantize/quantize_te: false")
    ap.add_argument(
        "--qtype",
        default="qfloat8",
        help="the job's model.qtype, the transformer's quantization (e.g. uint4, convrot8, nvfp4:"
        " ai-toolkit's quantize_model packs the blocks' Linears)",
    )
    ap.add_argument(
        "--ara",
        action="store_true",
        help="flux2: a seeded random accuracy recovery adapter (rank 8) on every Linear of the"
        " transformer's blocks, written to --work and given as model.accuracy_recovery_adapter",
    )
    ap.add_argument("--disk-dtype", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument(
        "--save-dtype",
        choices=["float32", "bf16", "float16"],
        default="float32",
        help="the job's save.dtype: the LoRA's dtype in the file ai-toolkit saves at the end",
    )
    ap.add_argument("--device", default=None)
    ap.add_argument(
        "--host-gib",
        type=float,
        default=128,
        help="flux2 dev: the host's memory, which sets how many single blocks fit (see"
        " flux2_singles_for_host); 0 keeps all 48",
    )
    ap.add_argument(
        "--single-blocks",
        default=None,
        help="flux2: build this many of the 48 single blocks (1-48; in place of --host-gib's"
        " count), or `disk`: the most whose build fits the free disk of --work (its old"
        " contents counted as free), 1 GiB kept for the runs; a number is checked the same"
        " way before the build",
    )
    ap.add_argument(
        "--te-size",
        choices=["reduced", "full"],
        default="reduced",
        help="flux2 dev: the Mistral3 text encoder reduced (30 layers, narrow attention and"
        " MLP, byte-level vocabulary) or at Mistral Small 3.1's text model's full size (40"
        " layers, vocabulary 131072; 47 GB of bf16, written shard by shard)",
    )
    ap.add_argument("--card", type=float, default=0, help="emulated card GiB (card.py)")
    ap.add_argument("--card-cmd", default=CARD_CMD)
    ap.add_argument(
        "--host-limit-gib",
        type=float,
        default=0,
        help="run each card.py subprocess (its daemon and trainer) in a fresh memory cgroup of"
        " this many GiB, swap off (needs --card, root and the memory controller); the report"
        " gives the cgroup's peak and OOM kills",
    )
    ap.add_argument(
        "--cgroup-root",
        default=None,
        help="where --host-limit-gib makes its cgroups (default: /sys/fs/cgroup on cgroup v2"
        " with the memory controller, else cgroup v1's memory mount)",
    )
    ap.add_argument("--budget-s", type=float, default=None, help="start no run past this")
    ap.add_argument("--first-run-s", type=float, default=240)
    ap.add_argument("--timeout", type=float, default=1200, help="one run's limit")
    ap.add_argument("--work", default=None)
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="keep the model and data an earlier call built in --work from the same settings",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", action="append", default=[], help="earlier reports to include")
    ap.add_argument("--machine", default=None)
    ap.add_argument("--pythonpath", action="append", default=[])
    ap.add_argument(
        "--daemon-socket",
        default=None,
        help="every weightstream run uses this running daemon instead of one of its own "
        "(a later run then finds what an earlier one stored; the link is the daemon's)",
    )
    args = ap.parse_args(argv)
    if args.one:
        return one(args.one)
    if not (args.aitk and args.bin and args.out):
        ap.error("--aitk, --bin and --out are required")
    if args.ara and args.arch != "flux2":
        ap.error(f"--ara is made for --arch flux2's transformer only, not {args.arch}")
    if args.single_blocks is not None and args.arch != "flux2":
        ap.error(f"--single-blocks is FLUX.2's transformer's, not --arch {args.arch}'s")
    if args.single_blocks not in (None, "disk") and not (
        args.single_blocks.isdigit() and 1 <= int(args.single_blocks) <= 48
    ):
        ap.error(f"--single-blocks {args.single_blocks}: expected 1 to 48 or `disk`")
    if args.te_size == "full" and (args.arch != "flux2" or args.smoke or args.size != "dev"):
        ap.error("--te-size full is FLUX.2-dev's text encoder: --arch flux2 --size dev only")
    started = time.monotonic()
    import torch

    cuda = torch.cuda.is_available() if args.device is None else args.device.startswith("cuda")
    device = args.device or ("cuda:0" if cuda else "cpu")
    if args.smoke:
        args.size, args.steps, args.images = "tiny", 4, 1
        args.resolution = min(args.resolution, 64)
        args.runs = args.runs or "aitk:r4,weightstream:r4:full"
    runs = parse_runs(args.runs or DEFAULT_RUNS, host_delay=args.host_delay == "true")
    conflict = host_limit_conflict(runs, args)
    if conflict:
        ap.error(conflict)
    if args.host_limit_gib:  # before the build: a run that cannot be limited is not run
        why = cgroup.check(args.cgroup_root)
        if why:
            print(
                f"ai_toolkit_24g: --host-limit-gib {args.host_limit_gib:g}: {why}", file=sys.stderr
            )
            return 2
    size = json.loads(json.dumps(SIZES[args.arch][args.size]))
    aitk = Path(args.aitk).resolve()
    fp8 = args.disk_dtype == "fp8"
    if args.te_size == "full":
        size["te"], size["te_shard_bytes"] = dict(MISTRAL_FULL), TE_SHARD_BYTES
    work = Path(args.work) if args.work else Path(f"/tmp/ws-aitk24-{os.getpid()}")
    singles_by, disk = None, None
    if args.single_blocks is not None:
        disk = flux2_disk_bytes(aitk, size, fp8)
        disk["free"] = free_disk(work)
        fit = flux2_singles_for_disk(disk, disk["free"])
        singles = fit if args.single_blocks == "disk" else int(args.single_blocks)
        if not 0 < singles <= fit:
            print(
                f"ai_toolkit_24g: --single-blocks {args.single_blocks}: the build writes"
                f" {(disk['fixed'] + singles * disk['single']) / 1e9:.2f} GB and {work} has"
                f" {disk['free'] / 1e9:.2f} GB free, 1 GiB of which is kept for the runs: "
                + (f"at most --single-blocks {fit} fit" if fit else "not one single block fits")
                + f" ({disk['single'] / 1e9:.3f} GB each); free the disk"
                + (" or give fewer" if fit else ""),
                file=sys.stderr,
            )
            return 2
        singles_by = "disk" if args.single_blocks == "disk" else "single-blocks"
        disk["singles"] = singles
    elif args.arch == "flux2" and args.size == "dev" and args.host_gib:
        singles = flux2_singles_for_host(aitk, size["transformer"], args.host_gib, fp8)
        singles_by = "host"
    if singles_by and singles < 48:
        size["transformer"]["depth_single_blocks"] = singles
    what = {
        "arch": args.arch,
        "size": size,
        "seed": args.seed,
        "disk_dtype": args.disk_dtype,
        "images": args.images,
        "resolution": args.resolution,
    }
    built = reused(work, what) if args.reuse else None
    env = {}
    if args.arch == "flux2":
        env["HF_HOME"] = str(work / "hf")
        if size["transformer"]:
            env["WS_AITK_FLUX2_PARAMS"] = json.dumps(size["transformer"])
            env["WS_AITK_FLUX2_CLASS"] = FLUX2_CLASS
    if built is None:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        print(f"building {args.arch} {args.size} in {work}", flush=True)
        if args.arch == "flux2":
            built = build_flux2(work / "model", aitk, size, args.seed, device, fp8)
        else:
            built = build_flux1(work / "model", size, args.seed, device, fp8)
        build.build_data(work / "data", args.images, args.resolution, args.seed)
        (work / BUILT).write_text(json.dumps({"what": what, "built": built}))
    else:
        print(f"reusing {args.arch} {args.size} in {work}", flush=True)
        for old in work.iterdir():  # the runs' folders and results of an earlier call
            if old.name not in ("model", "data", "hf", BUILT):
                shutil.rmtree(old) if old.is_dir() else old.unlink()
    if cuda:
        torch.cuda.empty_cache()
    print(f"built: {json.dumps(built)}", flush=True)
    ara = None
    if args.ara:  # written each call: the cleanup above keeps only what the build made
        ara = work / "ara.safetensors"
        write_ara(torch, ara, args.seed + 3, flux2_ara_layers(aitk, size["transformer"]))
    common = {
        "arch": args.arch,
        "device": device,
        "resolution": args.resolution,
        "work": str(work),
        "model": str(work / "model"),
        "data": str(work / "data"),
        "cuda": cuda,
        "env": env,
        "ara": str(ara) if ara else None,
        "args": {
            "aitk": str(aitk),
            "bin": str(Path(args.bin).resolve()),
            "pythonpath": args.pythonpath,
            "seed": args.seed,
            "timeout": args.timeout,
            "daemon_socket": args.daemon_socket,
        },
    }
    results, longest = [], args.first_run_s
    for run in runs:
        elapsed = time.monotonic() - started
        if args.budget_s is not None and elapsed + longest > args.budget_s:
            results.append(dict(run, rc="not run", why=f"{elapsed:.0f} s of {args.budget_s:.0f}"))
            continue
        result = launch(run, common, args, cuda)
        result["summary"] = summarize(result)
        longest = max(longest if results else 0, result.get("wall_s") or 0)
        results.append(result)
        print(
            json.dumps({"run": run["label"], "rc": result["rc"], **result["summary"]}, default=str),
            flush=True,
        )
    call = {
        "machine": args.machine or ("GPU: " + torch.cuda.get_device_name(0) if cuda else "CPU"),
        "host": platform.node(),
        "torch": torch.__version__,
        "commit": commit(),
        "ai_toolkit": measure.AITK_COMMIT,
        "command": " ".join(sys.argv),
        "arch": args.arch,
        "size": args.size,
        "sizes": size,
        "built": built,
        "disk_dtype": args.disk_dtype,
        "qtype": args.qtype,
        "ara": str(ara) if ara else None,
        "host_gib": args.host_gib,
        "te_size": args.te_size,
        "singles_by": singles_by,
        "disk": disk,
        "card_gib": args.card or None,
        "host_limit_gib": args.host_limit_gib or None,
        "host_delay": args.host_delay == "true",
        "steps": args.steps,
        "sample": {"every": args.sample_every, "steps": args.sample_steps}
        if args.sample_every
        else None,
        "resolution": args.resolution,
        "images": args.images,
        "runs": [{k: v for k, v in r.items() if k not in ("stubs", "probe")} for r in results],
        "stubs_called_outside_imports": {r["label"]: measure.stubs_called(r) for r in results},
        "wall_s": time.monotonic() - started,
    }
    calls = [c for path in args.merge for c in json.loads(Path(path).read_text())["calls"]]
    report = {"calls": [*calls, call]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{STEM}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / f"{STEM}.md").write_text(markdown(report))
    print(markdown(report), flush=True)
    ok = all(
        r["rc"] in (0, "not run")
        or r["summary"].get("oom")
        or (r["summary"].get("host_cgroup") or {}).get("oom_kill")
        for r in results
    )
    # weightstream's runs must have streamed: the transformer attached, layers streamed; the
    # host runs' LoRA must have been in host memory
    for r in results:
        if r["kind"] == "weightstream" and r["rc"] == 0:
            attached = [a for rep in r["summary"]["launcher_loading"] for a in rep["attached"]]
            ok = ok and any(a["role"] == "transformer" and a["streamed"] for a in attached)
        if r["mode"] == "host" and r["rc"] == 0:
            ok = ok and r["summary"]["trainable_host"] is not None
    return 0 if ok and not any(call["stubs_called_outside_imports"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
