"""Benchmark: time to first step — loading FLUX.2 from safetensors in memory, a second
job attaching to the model the daemon holds, and attaching by upload from the GPU — each split
into its phases.

One command on the GPU machine (the release binary and the wheel built from the same commit;
full FLUX.2 needs the two-GPU machine's 256 GiB: the file in /dev/shm and the daemon's copy of
it are 2 x 60 GiB at once; on the 128 GiB machine add --scale 0.5):
    python3 -m tests.bench.first_step --bin target/release/weightstream --out $OUT

Parts, in this order (``--parts``), each in its own process under a timeout, its error recorded
and never fatal to the others; the daemon is stopped and the file deleted however it ends:
- ``register``: cudaHostRegister of fresh and of already populated shared memory, on one thread
  and on several (what page-locking costs per GB, and whether it scales with threads);
- ``gen``: a FLUX.2-sized safetensors file (diffusers' ``Flux2Transformer2DModel`` on the meta
  device for the names and shapes, the LoRA layers' ``base_layer`` names as attach streams them;
  bf16 random values made on the GPU) in ``--dir`` (/dev/shm: in memory, as the page cache);
- ``load``: ``weightstream load --json`` of it: seconds to ready and GB/s, by phase (the arena's
  allocation, reading, page-locking);
- ``attach-id``: a second job (its own process, the model built on the GPU, LoRA r=32) attaches
  to the loaded model by id: seconds from ``attach`` to the end of its first step;
- ``load-fp8``: the same load with ``--quantize fp8`` (GB/s of bf16 input);
- ``attach-id-fp8`` (only when asked): the second job on the 8-bit model;
- ``upload``: the model built on the GPU, attached by upload (the file and the loaded models are
  gone first): the client's write (page-locking the windows, copies) and the daemon's commit
  (seal, hash while pinning), then its first step;
- ``upload-fp8`` (only when asked): the same in 8 bits, each weight quantized on the GPU as it is
  copied (``quantize_on="auto"``): half the bytes to reserve and write, nothing to quantize at
  commit;
- ``upload-fp8-daemon`` (only when asked): the same in 8 bits, the bf16 weights written and
  quantized by the daemon at commit (``quantize_on="daemon"``, the way before the GPU did it):
  the baseline of ``upload-fp8`` in the same run;
- ``upload-daemon-reserves`` (only when asked): ``upload`` with the daemon reserving the whole
  region's pages before it answers (``_upload.CLIENT_RESERVES = False``), the way before the
  writer faulted each window in as it page-locked it: the baseline of ``upload``.
$OUT/first_step.json is written after each part; a Markdown table is printed (and written to
$OUT/first_step.md) at the end; the logs are packed into $OUT/first-step-logs.tgz.

A dry run without a GPU (the daemon's host backend, FLUX.1 cut to two blocks, few tokens):
    python3 -m tests.bench.first_step --bin target/debug/weightstream --backend host \\
        --device cpu --model flux1 --scale 0.02 --tokens 64 16 --dir /tmp --out /tmp/fs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tests.bench.benchlib.first_step_parts import child, host_info, need_memory
from tests.bench.benchlib.first_step_report import report
from tests.bench.provenance import command
from tests.daemon import Daemon

PARTS = ["register", "gen", "load", "attach-id", "load-fp8", "upload"]
OPTIONAL = ["attach-id-fp8", "upload-fp8", "upload-fp8-daemon", "upload-daemon-reserves"]

#: Each part's default timeout (s); all of them end by --deadline.
TIMEOUTS = {
    "register": 120,
    "gen": 300,
    "upload": 360,
    "upload-fp8": 360,
    "upload-fp8-daemon": 360,
    "upload-daemon-reserves": 360,
}

DEFAULT_TIMEOUT = 240


class Run:
    """One benchmark run: the daemon, the state parts hand on (model ids), the results."""

    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix="ws-first-step-"))
        self.socket = str(self.tmp / "ws.sock")
        self.deadline = time.monotonic() + args.deadline
        self.daemon: subprocess.Popen | None = None
        self.loaded: dict[str, str] = {}  # part -> model id this run loaded and still holds
        self.results = {
            "command": command(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "model": args.model,
            "scale": args.scale,
            "tokens": args.tokens,
            "budget_gib": args.budget_gib,
            "host": host_info(args),
            "parts": {},
        }

    def save(self):
        (self.out / "first_step.json").write_text(json.dumps(self.results, indent=2))

    def cli(self, *cmd: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.args.bin, "--socket", self.socket, *cmd],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start_daemon(self):
        self.daemon = Daemon(
            self.tmp,
            binary=self.args.bin,
            backend=self.args.backend,
            socket=self.socket,
            log=self.out / "first-step-daemon.log",
            log_level=os.environ.get("WEIGHTSTREAM_LOG", "info"),
            ready_s=60,
        )

    def stop_daemon(self):
        if self.daemon is not None:
            self.daemon.stop(timeout=60)

    def store_bytes(self) -> int | None:
        try:
            p = self.cli("status", "--json", timeout=30)
            return json.loads(p.stdout)["store_bytes"]
        except (subprocess.SubprocessError, ValueError, KeyError, OSError):
            return None

    def release_all(self):
        """Gives back the models this run loaded, and waits until the store is empty."""
        for part, model_id in list(self.loaded.items()):
            self.cli("release", model_id, timeout=30)
            del self.loaded[part]
        deadline = time.monotonic() + 60
        while (self.store_bytes() or 0) > 0 and time.monotonic() < deadline:
            time.sleep(0.5)

    def child(self, part: str, timeout: float, **extra) -> dict:
        a = self.args
        cmd = [
            sys.executable,
            "-m",
            "tests.bench.first_step",
            "--child",
            part,
            "--socket",
            self.socket,
        ]
        cmd += ["--model", a.model, "--scale", str(a.scale), "--rank", str(a.rank)]
        cmd += ["--device", a.device, "--dir", a.dir, "--file", a.file]
        cmd += ["--tokens", *map(str, a.tokens), "--budget-gib", str(a.budget_gib)]
        cmd += ["--steps", str(a.steps), "--probe-gib", str(a.probe_gib)]
        if a.no_memory_check:
            cmd.append("--no-memory-check")
        for k, v in extra.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        log = self.out / f"first-step-{part}.log"
        with open(log, "w") as f:
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=env)
            try:
                stdout, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                return {"error": f"timed out after {timeout:.0f} s (see {log.name})"}
            except BaseException:  # stopped meanwhile (SIGTERM): the child goes too
                p.kill()
                raise
            f.write(stdout)
        lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
        if not lines:
            tail = log.read_text()[-600:]
            return {"error": f"no result (exit {p.returncode}): {tail}"}
        return json.loads(lines[-1][7:])

    def load(self, part: str, timeout: float) -> dict:
        a = self.args
        if not os.path.exists(a.file):
            raise FileNotFoundError(f"{a.file}: run the gen part first")
        size = os.path.getsize(a.file)
        fp8 = part == "load-fp8"
        self.release_all()
        need_memory(f"{part} (the daemon's copy)", int(size * (0.6 if fp8 else 1.0)), a)
        cmd = ["load", "--json", "--name", f"first-step-{part}", a.file]
        if fp8:
            cmd[1:1] = ["--quantize", "fp8"]
        p = self.cli(*cmd, timeout=timeout)
        (self.out / f"first-step-{part}.log").write_text(p.stdout + p.stderr)
        if p.returncode != 0:
            raise RuntimeError(f"weightstream load exited {p.returncode}: {p.stderr[-600:]}")
        result = json.loads(p.stdout)
        self.loaded[part] = result["model_id"]
        ph = result["phases"]
        result["file_gb_s"] = round(result["file_bytes"] / max(ph["total_s"], 1e-9) / 1e9, 2)
        return result

    def run_part(self, part: str) -> dict:
        a = self.args
        left = self.deadline - time.monotonic()
        if left < 40:
            return {"error": f"skipped: {left:.0f} s left before --deadline"}
        timeout = min(TIMEOUTS.get(part, DEFAULT_TIMEOUT), left - 20)
        if part in ("load", "load-fp8"):
            return self.load(part, timeout)
        if part.startswith("attach-id"):
            source = "load-fp8" if part.endswith("fp8") else "load"
            if source not in self.loaded:
                raise RuntimeError(f"{part} needs the model of the {source} part")
            return self.child(part, timeout, model_id=self.loaded[source])
        if part.startswith("upload"):
            self.release_all()
            later = a.parts[a.parts.index(part) + 1 :]
            if not any(p.startswith("load") for p in later):
                self.delete_file()
        return self.child(part, timeout)

    def delete_file(self):
        if not self.args.keep_file and os.path.exists(self.args.file):
            os.unlink(self.args.file)

    def main(self) -> int:
        try:
            self.start_daemon()
            for part in self.args.parts:
                print(f"== {part} ({self.deadline - time.monotonic():.0f} s left)", flush=True)
                started = time.monotonic()
                try:
                    record = self.run_part(part)
                except Exception as e:  # noqa: BLE001 - the error is this part's result
                    record = {"error": repr(e)[:800]}
                    traceback.print_exc()
                record["wall_s"] = round(time.monotonic() - started, 1)
                self.results["parts"][part] = record
                self.save()
                print(f"{part}: {json.dumps(record)[:1200]}", flush=True)
        except Exception as e:  # noqa: BLE001 - recorded; the daemon still stops below
            self.results["error"] = repr(e)[:800]
            traceback.print_exc()
        finally:
            try:
                if self.daemon is not None and self.daemon.poll() is None:
                    self.release_all()
            finally:
                self.stop_daemon()
                self.delete_file()
                shutil.rmtree(self.tmp, ignore_errors=True)
                self.save()
                table = report(self.results)
                (self.out / "first_step.md").write_text(table + "\n")
                print(table)
                logs = sorted(p.name for p in self.out.glob("first-step-*.log"))
                if logs:
                    subprocess.run(
                        ["tar", "czf", "first-step-logs.tgz", "--remove-files", *logs],
                        cwd=self.out,
                        check=False,
                    )
        failed = [p for p, r in self.results["parts"].items() if "error" in r]
        return 1 if failed or "error" in self.results else 0


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default="target/release/weightstream")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-first-step"))
    p.add_argument("--dir", default="/dev/shm", help="where the safetensors file is written")
    p.add_argument("--model", choices=["flux1", "flux2"], default="flux2")
    p.add_argument(
        "--scale", type=float, default=1.0, help="fraction of the model's blocks (same widths)"
    )
    p.add_argument(
        "--parts", nargs="+", default=PARTS, choices=PARTS + OPTIONAL, help="in this order"
    )
    p.add_argument("--backend", default="cuda", choices=["cuda", "host"])
    p.add_argument(
        "--device", default="cuda", help="the trainer's device (cpu with --backend host)"
    )
    p.add_argument("--rank", type=int, default=32, help="the LoRA rank")
    p.add_argument("--tokens", type=int, nargs=2, default=[4096, 512], metavar=("IMAGE", "TEXT"))
    p.add_argument("--budget-gib", type=float, default=15.0, help="the session's vram_budget (GiB)")
    p.add_argument("--steps", type=int, default=2, help="steps timed after the first")
    p.add_argument("--probe-gib", type=float, default=4.0, help="the register part's size")
    p.add_argument("--deadline", type=float, default=570.0, help="seconds for the whole run")
    p.add_argument("--keep-file", action="store_true", help="leave the file in --dir")
    p.add_argument(
        "--no-memory-check",
        action="store_true",
        help="run parts even when MemAvailable says they will not fit",
    )
    p.add_argument("--file", help=argparse.SUPPRESS)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    p.add_argument("--model-id", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.file is None:
        args.file = str(Path(args.dir) / f"ws-first-step-{args.model}-{args.scale:g}.safetensors")
    if args.backend == "host" and args.device.startswith("cuda"):
        p.error("--backend host streams to the host: pass --device cpu")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.child:
        return child(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks still run
    args.bin = str(Path(args.bin).resolve())
    return Run(args).main()


if __name__ == "__main__":
    sys.exit(main())
