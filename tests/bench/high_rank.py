"""High LoRA ranks within a 24 GiB job: FLUX.2-dev's architecture (32 B, seeded random weights)
streamed in 8 bits, its LoRA's weights, gradients and optimizer state in host memory held by the
daemon (``stream_trainable`` + ``HostAdamW``), on an emulated card, against the LoRA trained
with its weights in place (the bf16 model resident on the GPU, torch's AdamW on the device).

    python3 -m tests.bench.high_rank --bin target/release/weightstream --out $OUT \\
        [--ranks 16 128 512 1024 1280] [--links full 25GB/s] [--card 24] [--master none]

Per link, one daemon (``--copy-bandwidth-limit`` for a link other than "full") and one child
process that builds the model on the GPU, runs the resident reference per rank (first link
only; where it fits the device), attaches the model in 8 bits, then per rank: adds a LoRA of
that rank to the attention and MLP linears (ai-toolkit's way: a module whose ``org_forward`` is
the layer's forward), moves it to host memory, holds all of the device but what the job may
still use of the card (``card.Holder``: an allocation past the card is a real out-of-memory
error), and times ``--warmup`` + ``--measured`` steps at 1024² (4096 image + 512 text tokens),
gradient checkpointing, lr 1e-4. ``--master``: ``fp32`` (the default) keeps an fp32 master of
each bf16 LoRA weight in host memory; ``none`` keeps none (``stream_trainable(...,
master="none")``: the optimizer updates the bf16 weights in place), 4 bytes less per parameter;
each run records it (``master``; its ``mode`` says "master none").

Writes ``high_rank.json`` (``{"runs": [{rank, mode, link_gbps, job_gib, host_gib, s_per_step,
x_resident, master, command, commit, ...}]}``) and ``high_rank.md`` to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
from tests.bench.provenance import commit  # noqa: E402
from tests.daemon import Daemon  # noqa: E402

GiB = 1 << 30


def targets(model) -> list[tuple[str, object]]:
    """The linears FLUX.2's LoRA targets (``flux.FLUX2_TARGETS``, the regex peft is given
    there): attention and MLP of both block kinds."""
    import re

    from torch import nn

    from tests.bench.benchlib import flux

    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and "lora" not in name
        and re.fullmatch(flux.FLUX2_TARGETS, name)
    ]


def lora_module(rank: int):
    import torch
    from torch import nn

    class Lora(nn.Module):
        """ai-toolkit's LoRA module shape: ``lora_down``/``lora_up`` around ``org_forward``."""

        def __init__(self, linear: nn.Linear):
            super().__init__()
            dev = "cuda"
            self.lora_down = nn.Linear(
                linear.in_features, rank, bias=False, device=dev, dtype=torch.bfloat16
            )
            self.lora_up = nn.Linear(
                rank, linear.out_features, bias=False, device=dev, dtype=torch.bfloat16
            )
            with torch.no_grad():
                self.lora_down.weight.normal_(0, linear.in_features**-0.5)
                self.lora_up.weight.normal_(0, 1e-3)
            self.org_forward = linear.forward
            self.linear = [linear]  # not a child: the base stays where it is

        def forward(self, x):
            return self.org_forward(x) + self.lora_up(self.lora_down(x))

    return Lora


def add_lora(model, rank: int) -> list:
    """Wraps each target linear's forward with a rank-``rank`` LoRA; the LoRA modules become
    children of their linears (``...to_q.lora``), so they group by block."""
    import torch

    torch.manual_seed(rank)
    cls = lora_module(rank)
    added = []
    for _, m in targets(model):
        lora = cls(m)
        m.lora = lora
        m.forward = lora.forward
        added.append(m)
    return added


def remove_lora(added: list):
    for m in added:
        m.forward = m.lora.org_forward
        del m.lora


def lora_params(added) -> list:
    return [p for m in added for p in m.lora.parameters()]


def timed_steps(model, opt, n: int):
    import torch

    from tests.bench.benchlib import flux

    inputs = flux.batch()
    times, losses = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.monotonic()
        out = model(**inputs, return_dict=False)[0]
        loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.monotonic() - t)
        losses.append(loss.item())
    return times, losses


def record_steps(rec: dict, times: list[float], losses: list[float], warmup: int):
    measured = times[warmup:]
    rec["s_per_step"] = round(statistics.median(measured), 4)
    rec["steps_s"] = [round(x, 4) for x in times]
    rec["losses"] = [round(x, 6) for x in losses]


def numel(params) -> int:
    return sum(p.numel() for p in params)


def resident(args, model, rank: int, emit):
    import torch

    rec = {"rank": rank, "mode": "resident", "link_gbps": None}
    added = add_lora(model, rank)
    try:
        params = lora_params(added)
        rec["trainable_params"] = numel(params)
        opt = torch.optim.AdamW(params, lr=1e-4)
        torch.cuda.reset_peak_memory_stats()
        times, losses = timed_steps(model, opt, args.warmup + args.measured)
        record_steps(rec, times, losses, args.warmup)
        rec["job_gib"] = round(torch.cuda.max_memory_reserved() / GiB, 2)
        del opt
    except torch.OutOfMemoryError as e:
        rec["error"] = f"out of memory on the {torch.cuda.get_device_name()}: {str(e)[:200]}"
    finally:
        for p in lora_params(added):
            p.grad = None
        remove_lora(added)
        torch.cuda.empty_cache()
    emit(rec)


def streamed(args, model, handle, rank: int, link: str, baseline_used: int, emit):
    import torch
    from weightstream.torch.host_optim import HostAdamW
    from weightstream.torch.trainable import stream_trainable

    from tests.bench import card

    rec = {
        "rank": rank,
        "mode": f"weightstream {args.optimizer}"
        + (", master none" if args.master == "none" else ""),
        "link_gbps": link_gbps(link),
    }
    rec["delay"] = args.delay
    rec["master"] = args.master
    added = add_lora(model, rank)
    tr = holder = sampler = None
    try:
        params = lora_params(added)
        rec["trainable_params"] = numel(params)
        t = time.monotonic()
        tr = stream_trainable(
            model, handle, optimizer=args.optimizer, lookahead=args.lookahead, master=args.master
        )
        opt = HostAdamW(tr.params(), lr=1e-4, trainable=tr, kind=args.optimizer, delay=args.delay)
        rec["host_state_s"] = round(time.monotonic() - t, 1)
        rec["trainable_host_gib"] = round(tr.host_bytes / GiB, 2)
        rec["host_gib"] = round((tr.host_bytes + model_bytes(handle)) / GiB, 2)
        torch.cuda.empty_cache()
        device = card.open_device(0)
        before = device.sample()
        used = before.used - baseline_used
        rec["job_gib_before_training"] = round(used / GiB, 2)
        held = context = 0
        if args.card:
            left = args.card - used / GiB
            if left <= 0.5:
                raise RuntimeError(f"the job already uses {used / GiB:.2f} GiB of the card")
            holder = card.Holder(left, dict(os.environ))
            held = holder.report["held"]
            # The helper's own CUDA context is on the device too, and not the job's.
            context = max(0, before.free - holder.report["free_before"])
            rec["card_gib"] = args.card
        sampler = card.Sampler(device, 0.05)
        sampler.start()
        times, losses = timed_steps(model, opt, args.warmup)
        start_times = dict(tr.times)
        start_stats = handle.stats()
        more, more_losses = timed_steps(model, opt, args.measured)
        end_stats = handle.stats()
        times, losses = times + more, losses + more_losses
        sampler.stop.set()
        sampler.join()
        peak = max(s.used for s in sampler.samples) - held - context - baseline_used
        rec["job_gib"] = round(peak / GiB, 2)
        record_steps(rec, times, losses, args.warmup)
        rec["per_step_s"] = {
            k: round((tr.times[k] - start_times[k]) / args.measured, 4) for k in tr.times
        }
        # What crossed the link per step: the base's copies, and the LoRA's own copies the
        # daemon paced (granted; 0 where the daemon paces nothing), and the GPU's wait.
        rec["per_step_link"] = {
            k: round((end_stats.get(k, 0) - start_stats.get(k, 0)) / args.measured)
            for k in ("bytes_copied", "granted_h2d_bytes", "granted_d2h_bytes", "gpu_wait_ns")
        }
        rec["reference"] = opt.reference
    except Exception as e:  # noqa: BLE001 - reported per rank
        oom = isinstance(e, torch.OutOfMemoryError)
        rec["error"] = ("out of memory on the emulated card: " if oom else "") + repr(e)[:400]
        traceback.print_exc()
    finally:
        if sampler is not None:
            sampler.stop.set()
        if holder is not None:
            holder.release()
        if tr is not None:
            tr.close(device="cpu")
        remove_lora(added)
        gc.collect()
        torch.cuda.empty_cache()
    emit(rec)


def model_bytes(handle) -> int:
    return sum(g.nbytes for g in handle.session.groups)


def link_gbps(link: str) -> float | None:
    if link == "full":
        return None
    return float(link.lower().removesuffix("gb/s"))


def child(args):
    import torch
    import weightstream
    import weightstream.torch as wst

    from tests.bench.benchlib import flux

    flux.MODEL = "flux2"

    def emit(rec):
        print("RESULT " + json.dumps(rec), flush=True)

    torch.backends.cuda.enable_cudnn_sdp(False)
    model = flux.build_flux2()
    model.enable_gradient_checkpointing()
    for rank in args.resident_ranks:
        resident(args, model, rank, emit)
    client = weightstream.connect(args.socket)
    t = time.monotonic()
    handle = wst.attach(
        model,
        "cuda",
        client=client,
        vram_budget=int((args.card - args.trainer_gib) * GiB),
        quantize="fp8",
    )
    emit(
        {
            "attach_s": round(time.monotonic() - t, 1),
            "attach_phases": handle.attach_phases,
            "link": args.link,
        }
    )
    torch.cuda.empty_cache()
    for rank in args.ranks:
        streamed(args, model, handle, rank, args.link, args.baseline_used, emit)
    handle.close(release=True)


def parent(args):
    from tests.bench import card

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ws-high-rank-"))
    command = "python3 -m tests.bench.high_rank " + " ".join(sys.argv[1:])
    runs, extra = [], []
    for i, link in enumerate(args.links):
        baseline = card.open_device(0).sample().used
        serve = []
        if args.max_host:
            config = tmp / "config.toml"
            config.write_text(f'[quotas]\nmax_host_bytes = "{args.max_host}"\n')
            serve += ["--config", str(config)]
        if link != "full":
            serve += ["--copy-bandwidth-limit", link]
        daemon = Daemon(
            tmp,
            *serve,
            binary=args.bin,
            backend="cuda",
            socket=str(tmp / f"ws-{len(os.listdir(tmp))}.sock"),
            log_level=None,
            # A link of the environment's would cap the "full" one.
            env={"WEIGHTSTREAM_COPY_BANDWIDTH_LIMIT": None},
            ready_s=60,
        )
        cmd = [
            sys.executable,
            "-m",
            "tests.bench.high_rank",
            "--child",
            "--socket",
            daemon.socket,
            "--link",
            link,
            "--baseline-used",
            str(baseline),
            *child_args(args, first=i == 0),
        ]
        try:
            r = subprocess.run(
                cmd,
                check=False,
                stdout=subprocess.PIPE,
                text=True,
                timeout=args.timeout,
            )
            stdout, status = r.stdout, r.returncode
        except subprocess.TimeoutExpired as e:
            stdout, status = (
                (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""),
                "timeout",
            )
        finally:
            daemon.stop(timeout=60)
        for line in stdout.splitlines():
            if line.startswith("RESULT "):
                rec = json.loads(line[7:])
                (runs if "rank" in rec else extra).append(rec)
            else:
                print(line, flush=True)
        extra.append({"link": link, "child_status": status})
    res = {
        r["rank"]: r["s_per_step"] for r in runs if r["mode"] == "resident" and "s_per_step" in r
    }
    for r in runs:
        r["command"], r["commit"] = command, commit()
        if r["mode"] != "resident" and r.get("s_per_step") and r["rank"] in res:
            r["x_resident"] = round(r["s_per_step"] / res[r["rank"]], 3)
    if args.merge:
        runs = merged(json.loads(Path(args.merge).read_text())["runs"], runs)
    doc = {"runs": runs, "children": extra, "command": command, "commit": commit()}
    (out / "high_rank.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "high_rank.md").write_text(markdown(doc))
    print(markdown(doc))


def merged(old: list[dict], new: list[dict]) -> list[dict]:
    """``new`` and the runs of ``old`` (an earlier call's) it does not repeat, each keeping its
    command, commit and × resident (from the resident reference of its own call)."""

    def key(r):
        return (r["rank"], r["mode"], r.get("link_gbps"))

    done = {key(r) for r in new}
    runs = [r for r in old if key(r) not in done] + new
    return sorted(runs, key=lambda r: (r["mode"] != "resident", r.get("link_gbps") or 0, r["rank"]))


def markdown(doc) -> str:
    lines = [
        "# High LoRA ranks, FLUX.2-dev architecture, 1024², checkpointing",
        "",
        f"`{doc['command']}` at {doc['commit']}",
        "",
        "| rank | trainable params | mode | link GB/s | s/step | × resident | job GiB | host GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        if "error" in r:
            lines.append(
                f"| {r['rank']} | {r.get('trainable_params', '')} | {r['mode']} | "
                f"{r.get('link_gbps') or 'full'} | {r['error'][:80]} | | | |"
            )
            continue
        lines.append(
            f"| {r['rank']} | {r.get('trainable_params', 0) / 1e9:.2f} B | {r['mode']} | "
            f"{r.get('link_gbps') or 'full'} | {r['s_per_step']} | {r.get('x_resident', '')} | "
            f"{r.get('job_gib', '')} | {r.get('host_gib', '')} |"
        )
    attaches = [attach_line(c) for c in doc.get("children", []) if "attach_s" in c]
    if attaches:
        lines += ["", *attaches]
    return "\n".join(lines) + "\n"


def attach_line(c: dict) -> str:
    """One child's attach in 8 bits and where its time went (``Handle.attach_phases``)."""
    p = c.get("attach_phases", {})

    def g(k):
        return p.get(f"upload_{k}", 0) or 0

    return (
        f"- attach in 8 bits ({c.get('link')}): **{c['attach_s']} s**: begin {g('begin_s'):.1f} s, "
        f"write {g('write_wall_s'):.1f} s of {g('write_bytes') / GiB:.1f} GiB "
        f"({g('write_quantized_tensors')} weights quantized on the GPU in "
        f"{g('write_quantize_device_s'):.1f} s of its time), commit {g('commit_s'):.1f} s "
        f"(daemon: quantize {g('daemon_quantize_s'):.1f} s, hash {g('daemon_hash_s'):.1f} s "
        f"while pinning {g('daemon_pin_s'):.1f} s); session {p.get('open_session_s', 0):.1f} s"
    )


def child_args(args, first: bool) -> list[str]:
    out = [
        "--ranks",
        *map(str, args.ranks),
        "--card",
        str(args.card),
        "--trainer-gib",
        str(args.trainer_gib),
        "--warmup",
        str(args.warmup),
        "--measured",
        str(args.measured),
        "--optimizer",
        args.optimizer,
        "--lookahead",
        str(args.lookahead),
        "--master",
        args.master,
    ]
    out += ["--resident-ranks", *map(str, args.resident_ranks if first else [])]
    if not args.delay:
        out.append("--no-delay")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default="target/release/weightstream")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-high-rank"))
    ap.add_argument("--ranks", nargs="+", type=int, default=[16, 128, 512, 1024, 1280])
    ap.add_argument(
        "--resident-ranks",
        nargs="*",
        type=int,
        default=None,
        help="ranks of the resident reference (default: --ranks up to 1024)",
    )
    ap.add_argument("--links", nargs="+", default=["full", "25GB/s"])
    ap.add_argument("--card", type=float, default=24.0, help="the job's card, GiB (0: none)")
    ap.add_argument(
        "--trainer-gib",
        type=float,
        default=9.0,
        help="the trainer's part of the card; the daemon gets the rest",
    )
    ap.add_argument("--optimizer", choices=["adamw", "adamw8bit"], default="adamw8bit")
    ap.add_argument(
        "--no-delay",
        dest="delay",
        action="store_false",
        help="step when step() is called instead of one step late",
    )
    ap.add_argument(
        "--master",
        choices=["fp32", "none"],
        default="fp32",
        help="fp32: an fp32 master of each bf16 LoRA weight; none: the weights updated in place",
    )
    ap.add_argument("--lookahead", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--measured", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=560)
    ap.add_argument(
        "--max-host",
        default=None,
        help="the daemon's quotas.max_host_bytes (default its own: 80%% of MemTotal)",
    )
    ap.add_argument("--merge", default=None, help="keep the runs of this earlier high_rank.json")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--socket")
    ap.add_argument("--link", default="full")
    ap.add_argument("--baseline-used", type=int, default=0)
    args = ap.parse_args()
    if args.resident_ranks is None:
        args.resident_ranks = [r for r in args.ranks if r <= 1024]
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
