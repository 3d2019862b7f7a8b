"""Benchmark: two generation processes on one GPU served from one host copy (issue #48). One
daemon; ``python -m weightstream.examples.generate`` run alone, then twice at once (same model,
prompt and seed), each process denoising FLUX.2-dev's transformer (random seeded bf16 weights,
diffusers' default config, 32 B, built on the device and uploaded from there; ``--size tiny``: a
few blocks of width 128, on the CPU too) at 1024² for ``--steps`` steps:

    python3 -m tests.bench.generate_two --bin target/release/weightstream --out $OUT \\
        --vram-budget-gib 10 [--link 25GB/s]
    python3 -m tests.bench.generate_two --bin target/debug/weightstream --smoke --out /tmp/g2

The pipeline is this module's ``pipeline`` (generate's ``--pipeline``): the prompt's embedding
is seeded noise in place of a text encoder's, and each denoising step is one forward pass of
the streamed transformer (``sampling.back_to_back``: the steps run one after the other, each
timed by CUDA events between them), an Euler step of a flow-matching schedule, the final
latents the "image". With ``WS_GEN_BARRIER`` set a process prints ``ATTACHED`` once its
transformer is attached and waits for a line on stdin before it denoises: both processes of the
pair are attached, and measured, before either starts, and then they run at once.

Recorded: each process's per-step seconds (the first step apart: the first pass also learns
the plan), its counters (``Handle.stats()``'s sampling line), whether its latents are
``torch.equal`` to the process alone; the host's memory (``/proc``: VmRSS, RssAnon, RssShmem
of the daemon and each process, and MemAvailable) before the pair, with the first attached and
with both attached, and what the second process's attach took of the host (MemAvailable's
drop: the target is less than 1 GiB, one host copy). The daemon's ``list_models`` store bytes
beside it. Results: $OUT/generate_two.json and .md with the command, the commit and the device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from tests.bench.aitk.measure import memory_kib
from tests.bench.provenance import command, commit
from tests.bench.sampling import GiB, back_to_back, device_name

ROOT = Path(__file__).resolve().parents[2]
BARRIER = "WS_GEN_BARRIER"
ATTACHED = "ATTACHED"
STEPS = "STEPS "
MEMORY_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")

#: ``--size``: the transformer's Flux2Transformer2DModel fields (``dev``: diffusers' default,
#: FLUX.2-dev) and the text tokens of the prompt's embedding.
SIZES = {
    "dev": ({}, 512),
    "tiny": (
        dict(
            in_channels=16,
            num_layers=2,
            num_single_layers=4,
            attention_head_dim=32,
            num_attention_heads=4,
            joint_attention_dim=64,
            timestep_guidance_channels=32,
            axes_dims_rope=(8, 8, 8, 8),
        ),
        16,
    ),
}


# --- the generation process's pipeline ------------------------------------------------------


class Flux2Loop:
    """A diffusers pipeline's calling convention and ``components`` over a FLUX.2 transformer:
    ``steps`` Euler steps of a flow-matching schedule from seeded noise latents, each step's
    seconds printed as ``STEPS <json>``."""

    def __init__(self, transformer, text_tokens: int, device: str):
        self.transformer, self.text_tokens, self.device = transformer, text_tokens, device

    @property
    def components(self):
        return {"transformer": self.transformer}

    def sync(self):
        import torch

        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def __call__(self, prompt, num_inference_steps, height, width, generator):
        import torch

        if self.device.startswith("cuda"):
            # The transformer was built on the device and uploaded from there: its copies are
            # freed but cached by torch, and the other process of the pair builds its own next.
            torch.cuda.empty_cache()
        config = self.transformer.config
        dtype, tokens = torch.bfloat16, (height // 16) * (width // 16)
        latents = torch.randn(1, tokens, config.in_channels, generator=generator)
        text_gen = torch.Generator().manual_seed(sum(prompt.encode()))  # a text encoder's stand-in
        text = torch.randn(1, self.text_tokens, config.joint_attention_dim, generator=text_gen)
        axes = len(config.axes_dims_rope)
        inputs = {
            "encoder_hidden_states": text.to(self.device, dtype),
            "img_ids": torch.zeros(tokens, axes, device=self.device, dtype=dtype),
            "txt_ids": torch.zeros(self.text_tokens, axes, device=self.device, dtype=dtype),
            "guidance": torch.tensor([3.5], device=self.device, dtype=dtype),
            "return_dict": False,
        }
        state = {"latents": latents.to(self.device, dtype), "i": 0}
        dt = 1.0 / num_inference_steps

        def step():
            t = torch.tensor([1.0 - state["i"] * dt], device=self.device, dtype=dtype)
            v = self.transformer(hidden_states=state["latents"], timestep=t, **inputs)[0]
            state["latents"] = state["latents"] - dt * v
            state["i"] += 1

        if os.environ.get(BARRIER):
            print(ATTACHED, flush=True)
            sys.stdin.readline()
        times = back_to_back(step, num_inference_steps, self.sync)
        print(STEPS + json.dumps({"step_s": times}), flush=True)
        return SimpleNamespace(images=[state["latents"].float().cpu()])


def pipeline(model: str, dtype):
    """``--pipeline`` for generate: ``model`` is a ``SIZES`` name; the transformer is built with
    seeded random weights on the GPU where there is one (uploaded from there by attach)."""
    import torch
    from diffusers import Flux2Transformer2DModel

    from tests.bench.benchlib.flux import seeded_random

    fields, text_tokens = SIZES[model]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device("meta"):
        transformer = Flux2Transformer2DModel(**fields).to(dtype)
    transformer = seeded_random(transformer, device).requires_grad_(False)
    return Flux2Loop(transformer, text_tokens, device)


# --- the parent -----------------------------------------------------------------------------


class Generation:
    """One ``weightstream.examples.generate`` process with this module's pipeline, held at the
    barrier once attached (``attached`` is then set), denoising on ``go``."""

    def __init__(self, args, socket: str, name: str, model_id: str | None = None):
        out = Path(args.out)
        self.name, self.latents = name, out / f"{name}.pt"
        self.log = out / f"{name}.log"
        cmd = [sys.executable, "-m", "weightstream.examples.generate", "--model", args.size]
        cmd += ["--pipeline", "tests.bench.generate_two:pipeline", "--prompt", args.prompt]
        cmd += ["--steps", str(args.steps), "--size", str(args.resolution), "--seed", "0"]
        cmd += ["--device", args.device, "--socket", socket, "--hold", "--out", str(self.latents)]
        cmd += ["--vram-budget", str(int(args.vram_budget_gib * GiB))]
        if args.min_bytes is not None:
            cmd += ["--min-bytes", str(args.min_bytes)]
        if model_id is not None:
            cmd += ["--model-id", model_id]
        self.cmd = cmd
        with open(self.log, "w") as log:  # stderr to a file: a full pipe would stall the child
            self.proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env={**os.environ, BARRIER: "1"},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        self.lines: list[str] = []
        self.started = time.monotonic()
        self._until(ATTACHED)
        self.attach_s = time.monotonic() - self.started

    def _until(self, prefix: str) -> str:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith(prefix):
                return line
        self.proc.wait(timeout=60)
        raise RuntimeError(
            f"{self.name} exited ({self.proc.returncode}) before {prefix.strip()!r}: "
            f"{' '.join(self.cmd)}\n{''.join(self.lines)}{self.log.read_text()[-3000:]}"
        )

    def go(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def result(self) -> dict:
        """Its steps, once it has written its latents (it holds its session until ``end``)."""
        steps = json.loads(self._until(STEPS)[len(STEPS) :])["step_s"]
        self._until("wrote ")
        stats = next((s.strip() for s in self.lines if s.startswith("transformer: ")), None)
        return {
            "pid": self.proc.pid,
            "attach_s": self.attach_s,
            "first_step_s": steps[0],
            "step_s": steps[1:],
            "median_step_s": statistics.median(steps[1:]) if len(steps) > 1 else steps[0],
            "stats": stats,
        }

    def end(self) -> int:
        self.proc.communicate("\n", timeout=120)
        return self.proc.returncode


def snapshot(daemon, procs: dict) -> dict:
    """The host's memory now: each process's ``MEMORY_FIELDS`` (bytes), MemAvailable (bytes),
    and the daemon's store (``list_models``' bytes)."""
    point = {"store_bytes": daemon.client.list_models().store_bytes}
    for name, pid in {"daemon": daemon.pid, **procs}.items():
        kib = memory_kib(Path(f"/proc/{pid}/status").read_text(), MEMORY_FIELDS)
        point["MemAvailable"] = kib.pop("MemAvailable") * 1024
        point[name] = {k: v * 1024 for k, v in kib.items()}
    return point


def progress(started: float, text: str):
    """One line per phase, so that a run cut short by its time limit says how far it got."""
    print(f"[{time.monotonic() - started:6.1f} s] {text}", flush=True)


def run(args, daemon) -> dict:
    import torch

    started = time.monotonic()
    alone = Generation(args, daemon.socket, "alone")
    progress(started, f"alone attached ({alone.attach_s:.1f} s)")
    memory = {"alone_attached": snapshot(daemon, {"alone": alone.proc.pid})}
    alone.go()
    results = {"alone": alone.result()}
    progress(started, f"alone denoised: {results['alone']['median_step_s']:.3f} s a step")
    results["alone"]["returncode"] = alone.end()
    memory["before_pair"] = snapshot(daemon, {})
    first = Generation(args, daemon.socket, "first")
    progress(started, f"first attached ({first.attach_s:.1f} s)")
    memory["first_attached"] = snapshot(daemon, {"first": first.proc.pid})
    # The second attaches the model the first uploaded, by its id: an upload of the same
    # weights is found the same only once it is hashed, and until then needs the room of a
    # second copy in the daemon (more than a host holding a 64 GB model has).
    (model,) = daemon.client.list_models().models
    second = Generation(args, daemon.socket, "second", model.model_id)
    progress(started, f"second attached by id ({second.attach_s:.1f} s); the pair denoises")
    memory["second_attached"] = snapshot(
        daemon, {"first": first.proc.pid, "second": second.proc.pid}
    )
    pair = (first, second)
    for g in pair:
        g.go()
    for g in pair:
        results[g.name] = g.result()
    want = torch.load(alone.latents)
    for g in pair:
        results[g.name]["returncode"] = g.end()
        results[g.name]["equal_to_alone"] = torch.equal(torch.load(g.latents), want)
    a, b = memory["first_attached"], memory["second_attached"]
    alone_median = results["alone"]["median_step_s"]
    summary = {
        "second_attach_host_bytes": a["MemAvailable"] - b["MemAvailable"],
        "second_attach_store_bytes": b["store_bytes"] - a["store_bytes"],
        # the second process's own heap (Python, torch, the CUDA runtime): part of that drop
        "second_process_anon_bytes": b["second"]["RssAnon"],
        "step_over_alone": {g.name: results[g.name]["median_step_s"] / alone_median for g in pair},
        "outputs_equal": all(results[g.name]["equal_to_alone"] for g in pair),
    }
    summary["one_host_copy"] = summary["second_attach_host_bytes"] < GiB
    summary["within_2_1x"] = all(r <= 2.1 for r in summary["step_over_alone"].values())
    return {"results": results, "memory": memory, "summary": summary}


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f}"


def markdown(report: dict) -> str:
    s, res = report["summary"], report["results"]
    lines = [
        "# Two generation processes on one device, one host copy (FLUX.2 transformer)",
        "",
        f"- command: `{report['command']}`",
        f"- commit: {report['commit']}; device: {report['device']}",
        f"- size `{report['size']}`, {report['steps']} steps at {report['resolution']}², "
        f"each session's budget {report['vram_budget_gib']:g} GiB, link {report['link']}",
        "",
        "| process | attach s | first step s | median step s | × alone | equal to alone |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("alone", "first", "second"):
        r = res[name]
        ratio = s["step_over_alone"].get(name, 1.0)
        equal = "-" if name == "alone" else ("yes" if r["equal_to_alone"] else "**no**")
        lines.append(
            f"| {name} | {r['attach_s']:.2f} | {r['first_step_s']:.3f} | "
            f"{r['median_step_s']:.3f} | {ratio:.2f} | {equal} |"
        )
    lines += [
        "",
        "Host memory, MiB (VmRSS / RssAnon / RssShmem; MemAvailable; the daemon's store):",
        "",
        "| when | daemon | first | second | MemAvailable | store |",
        "|---|---|---|---|---|---|",
    ]
    for when in ("before_pair", "first_attached", "second_attached"):
        m = report["memory"][when]
        cells = [
            " / ".join(_mib(m[p][k]) for k in ("VmRSS", "RssAnon", "RssShmem")) if p in m else "-"
            for p in ("daemon", "first", "second")
        ]
        lines.append(
            f"| {when.replace('_', ' ')} | {' | '.join(cells)} | {_mib(m['MemAvailable'])} | "
            f"{_mib(m['store_bytes'])} |"
        )
    lines += [
        "",
        f"- the second process's attach took {_mib(s['second_attach_host_bytes'])} MiB of the "
        f"host (MemAvailable's drop; target < 1024: "
        f"{'met' if s['one_host_copy'] else 'not met'}), of which its own anonymous memory "
        f"(Python, torch) {_mib(s['second_process_anon_bytes'])} MiB; the daemon's store grew "
        f"by {_mib(s['second_attach_store_bytes'])} MiB",
        f"- each step of the pair ≤ 2.1 × alone: {'met' if s['within_2_1x'] else 'not met'}; "
        f"outputs equal to alone: {'yes' if s['outputs_equal'] else 'no'}",
    ]
    for name in ("alone", "first", "second"):
        lines.append(f"- {name}: {res[name]['stats']}")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python3 -m tests.bench.generate_two", description=__doc__)
    p.add_argument("--bin", default="target/release/weightstream")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-generate-two"))
    p.add_argument("--size", choices=sorted(SIZES), default="dev")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--prompt", default="a lighthouse at dusk")
    p.add_argument("--vram-budget-gib", type=float, default=10.0, help="each process's session")
    p.add_argument("--min-bytes", type=int, default=None, help="generate's --min-bytes")
    p.add_argument("--link", default=None, help="the daemon's copy bandwidth limit (e.g. 25GB/s)")
    p.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    p.add_argument("--smoke", action="store_true", help="--size tiny, 6 steps at 128² (the CPU)")
    args = p.parse_args(argv)
    if args.smoke:
        args.size, args.steps, args.resolution = "tiny", 6, 128
        args.vram_budget_gib, args.min_bytes = 1.5 / 1024, 0  # about a third of it
    return args


def main(argv=None) -> int:
    import torch

    from tests.daemon import Daemon

    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    link = ["--copy-bandwidth-limit", args.link] if args.link else []
    backend = "cuda" if args.device.startswith("cuda") else "host"
    daemon = Daemon(out, *link, binary=args.bin, backend=backend)
    try:
        measured = run(args, daemon)
    finally:
        daemon.stop()
    report = {
        "command": command(),
        "commit": commit(),
        "device": device_name(),
        "size": args.size,
        "steps": args.steps,
        "resolution": args.resolution,
        "vram_budget_gib": args.vram_budget_gib,
        "link": args.link or "full",
        **measured,
    }
    (out / "generate_two.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "generate_two.md").write_text(markdown(report))
    print(markdown(report))
    ok = all(r["returncode"] == 0 for r in measured["results"].values())
    return 0 if ok and measured["summary"]["outputs_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
