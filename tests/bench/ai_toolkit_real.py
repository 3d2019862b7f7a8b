"""ai-toolkit's real code, run twice on one model: its own layer offloading, then weightstream's
launcher, with the same YAML.

    # FLUX.2 klein 4B: the loader attaches the transformer and the Qwen3 text encoder
    python3 -m tests.bench.ai_toolkit_real --aitk .aitk --bin target/release/weightstream \\
        --arch flux2_klein_4b --size klein4b --out $OUT          # -> $OUT/ai_toolkit.{json,md}
    # FLUX.1: the loader attaches nothing at the pinned commit
    python3 -m tests.bench.ai_toolkit_real --aitk .aitk --bin target/release/weightstream \\
        --arch flux1 --size flux1 --out $OUT                     # -> $OUT/ai_toolkit_flux1.*

What runs, unchanged: ai-toolkit's `run.py` (given by --aitk, a checkout of ostris/ai-toolkit,
kept outside this repository), its ExtensionJob, SDTrainer, the model's loader (FLUX.1:
`toolkit/stable_diffusion_model.py`; FLUX.2 klein 4B:
`extensions_built_in/diffusion_models/flux2/flux2{,_klein}_model.py`, which call
`MemoryManager.attach` on the transformer and on the Qwen3 text encoder when
`model.layer_offloading` is set), latent and text-embedding caching, the unloader
(`MemoryManager.free` of the text encoder), its LoRA network and training steps, and its
UILogger (every step's loss in `output/<name>/loss_log.db`). Run (a) is `python run.py
job.yaml`; run (b) is `python -m weightstream.integrations.ai_toolkit run.py job.yaml` against a
daemon this script starts (`--bin`). Each run has its own folder with the same `job.yaml`, a
link to the shared model, a fresh copy of the dataset (ai-toolkit writes its caches there) and
its own output. `network.layer_offloading` stays off (the LoRA stays on the device in both).

What this script makes, with seeded random weights:
- flux1 (tests/bench/ai_toolkit_flux.yaml): a diffusers FLUX.1 folder (FluxTransformer2DModel at
  `--size tiny|flux1`, `--double`/`--single` to cut blocks; a small AutoencoderKL; one-layer
  CLIP and T5 encoders whose widths match the transformer's, tokenizers from a made-up
  vocabulary).
- flux2_klein_4b (tests/bench/ai_toolkit_flux2_klein.yaml): `model/flux-2-klein-base-4b.
  safetensors` (ai-toolkit's own `Flux2` class, loaded by path from --aitk, at
  `Klein4BParams(**fields)`: `--size klein4b` is the real 4B, `--double`/`--single` cut its 5 +
  20 blocks, `--size tiny` is narrow too), `model/ae.safetensors` (ai-toolkit's FLUX.2
  `AutoEncoder` at its real size) and a 27-layer Qwen3ForCausalLM with a byte-level tokenizer
  saved as `Qwen/Qwen3-4B` in an HF cache (`<work>/hf/hub/models--Qwen--Qwen3-4B/{refs/main,
  snapshots/<rev>}`; the runs get HF_HOME=<work>/hf and HF_HUB_OFFLINE=1), where klein's
  `load_te` finds it with `from_pretrained("Qwen/Qwen3-4B")`. When the transformer's fields
  differ from ai-toolkit's Klein4BParams, the shim rebinds that name in
  `flux2_klein_model.py` (WS_AITK_FLUX2_PARAMS, both runs): the only patch of ai-toolkit.
- a few random images with captions, and the YAML.

What it stubs: tests/bench/aitk_shim/sitecustomize.py serves the modules in STUBS when they are
not installed (ai-toolkit imports every extension and model at start-up; none of these is on
these runs' path, and the shim records any call into a stub outside an import, which fails the
bench). On a machine without CUDA it hides `triton` (OmniGen2's kernels query the CUDA device at
import). Pure-Python packages missing from the GPU image travel as wheels (`.whl/`: ai-toolkit's
pinned diffusers commit, oyaml, python-dotenv).

Measured per run: seconds per step (UILogger's wall times, after the first logged step), the
run's wall time, the trainer's peak RSS (VmHWM) and, on CUDA, torch's peak allocated/reserved
bytes in the trainer and nvidia-smi's peak device memory in use; the daemon's peak RSS; what
each `MemoryManager.attach` took over (ai-toolkit: the layers it bounces from the CPU;
weightstream: the handle's streamed layers) and weightstream's daemon session statistics.
Checked: every logged loss and the saved LoRA tensors are bit-identical between the two runs;
for klein, that both managers took layers over and that the daemon copied bytes for acquires.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from pathlib import Path

from tests.bench.aitk.build import (
    KLEIN_SIZES,
    SIZES,
    TEMPLATES,
    build_data,
    build_klein,
    build_model,
    job_yaml,
)
from tests.bench.aitk.measure import AITK_COMMIT, STUB_DISTS, STUBS, run_one, stubs_called
from tests.bench.aitk.report import markdown, probe_diff, streaming_check


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--aitk", required=True, help="ai-toolkit checkout (its run.py is run unchanged)"
    )
    ap.add_argument("--bin", required=True, help="the weightstream daemon binary")
    ap.add_argument(
        "--arch",
        choices=sorted(TEMPLATES),
        default="flux1",
        help="flux1: the FLUX.1 loader (attaches nothing at the pinned commit); flux2_klein_4b:"
        " FLUX.2 klein 4B (attaches the transformer and the Qwen3 text encoder)",
    )
    ap.add_argument(
        "--size",
        choices=sorted(set(SIZES) | set(KLEIN_SIZES)),
        default="tiny",
        help="flux1: tiny|flux1; flux2_klein_4b: tiny|klein4b",
    )
    ap.add_argument("--double", type=int, help="double-stream blocks (default: the size's)")
    ap.add_argument("--single", type=int, help="single-stream blocks (default: the size's)")
    ap.add_argument("--steps", type=int, default=4, help="ai-toolkit's train.steps")
    ap.add_argument("--resolution", type=int, default=None, help="image side (tiny 64, flux1 512)")
    ap.add_argument("--images", type=int, default=2)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--device", default=None, help="cuda:0 or cpu (default: cuda:0 when present)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a new one under /tmp)")
    ap.add_argument("--out", required=True, help="where ai_toolkit.json and .md go")
    ap.add_argument("--machine", default=None, help="what to call this machine in the results")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument(
        "--pythonpath", action="append", default=[], help="more entries for the runs' PYTHONPATH"
    )
    ap.add_argument("--modes", default="aitk,weightstream")
    args = ap.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available() if args.device is None else args.device.startswith("cuda")
    device = args.device or ("cuda:0" if cuda else "cpu")
    resolution = args.resolution or (64 if args.size == "tiny" else 512)
    klein = args.arch == "flux2_klein_4b"
    sizes = KLEIN_SIZES if klein else SIZES
    if args.size not in sizes:
        ap.error(f"--size {args.size} is not one of {sorted(sizes)} for --arch {args.arch}")
    if klein:
        cfg = dict(KLEIN_SIZES[args.size]["transformer"])
        te_cfg = dict(KLEIN_SIZES[args.size]["te"])
        double, single = "depth", "depth_single_blocks"
    else:
        cfg, te_cfg = dict(SIZES[args.size]), None
        double, single = "num_layers", "num_single_layers"
    if args.double is not None:
        cfg[double] = args.double
    if args.single is not None:
        cfg[single] = args.single
    work = Path(args.work) if args.work else Path(f"/tmp/ws-aitk-{os.getpid()}")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    print(f"building the model ({args.arch} {args.size}, {cfg}) in {work}", flush=True)
    extra_env = {}
    if klein:
        built = build_klein(
            work / "model", Path(args.aitk).resolve(), cfg, te_cfg, args.seed, device
        )
        extra_env["HF_HOME"] = str(work / "hf")  # Qwen/Qwen3-4B from its cache, offline
        if cfg:
            extra_env["WS_AITK_FLUX2_PARAMS"] = json.dumps(cfg)
    else:
        built = build_model(work / "model", cfg, args.seed, device if cuda else "cpu")
    build_data(work / "data", args.images, resolution, args.seed)
    yaml_text = job_yaml(args.arch, device, args.steps, resolution)
    print(f"built: {built}", flush=True)
    if cuda:
        torch.cuda.empty_cache()

    runs, loras = [], {}
    for mode in args.modes.split(","):
        result, lora = run_one(
            mode, args, work, work / "model", work / "data", yaml_text, cuda, extra_env
        )
        runs.append(result)
        loras[mode] = lora
        print(
            json.dumps({k: v for k, v in result.items() if k not in ("stubs", "log_tail")}),
            flush=True,
        )

    report = {
        "machine": args.machine or ("GPU: " + torch.cuda.get_device_name(0) if cuda else "CPU"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ai_toolkit": {"path": str(Path(args.aitk).resolve()), "commit": AITK_COMMIT},
        "device": device,
        "arch": args.arch,
        "size": args.size,
        "transformer_config": cfg,
        "text_encoder_config": te_cfg,
        "env": extra_env,
        "model": built,
        "steps": args.steps,
        "resolution": resolution,
        "images": args.images,
        "seed": args.seed,
        "job_yaml": yaml_text,
        "stubs": STUBS,
        "stub_dists": STUB_DISTS,
        "hidden": [] if cuda else ["triton"],
        "runs": runs,
    }
    ok = all(r["rc"] == 0 for r in runs)
    called = {r["mode"]: stubs_called(r) for r in runs}
    report["stubs_called_outside_imports"] = called
    ok = ok and not any(called.values())
    if klein and ok:
        report["streaming"] = streaming = streaming_check(
            [r for r in runs if not r["mode"].startswith("resident")]
        )
        ok = ok and streaming["ok"]
    by_mode = {r["mode"]: r for r in runs}
    if ok and "resident" in by_mode:
        # With the weights-in-place run present, each offloading run is compared with it;
        # weightstream's must equal it bit for bit (ai-toolkit's is reported).
        ref, ref_lora = by_mode["resident"], loras["resident"]
        report["vs_resident"] = {}
        for mode, run in by_mode.items():
            if mode == "resident":
                continue
            lora = loras[mode]
            report["vs_resident"][mode] = {
                "losses_equal": run["losses"] == ref["losses"] and len(ref["losses"]) > 0,
                "lora_equal": lora.keys() == ref_lora.keys()
                and all(torch.equal(lora[k], ref_lora[k]) for k in lora),
                "loss_diffs": [x - y for x, y in zip(run["losses"], ref["losses"], strict=False)],
                "probe": probe_diff(ref.get("probe"), run.get("probe")),
            }
        ws = report["vs_resident"].get("weightstream", {})
        ok = bool(ws.get("losses_equal") and ws.get("lora_equal"))
    elif ok and len(runs) == 2:
        a, b = runs
        report["losses_equal"] = a["losses"] == b["losses"] and len(a["losses"]) > 0
        la, lb = loras[a["mode"]], loras[b["mode"]]
        report["lora_equal"] = la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)
        report["lora_tensors"] = len(la)
        if not report["losses_equal"]:
            report["loss_diffs"] = [x - y for x, y in zip(a["losses"], b["losses"], strict=False)]
        ok = report["losses_equal"] and report["lora_equal"]
    report["ok"] = bool(ok)
    stem = "ai_toolkit" if klein else "ai_toolkit_flux1"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
