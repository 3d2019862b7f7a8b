"""One run of ai-toolkit's real ``run.py`` and what is measured of it (``run_one``): its folder,
environment and stubs (tests/bench/aitk_shim), weightstream's daemon for the launcher's runs, the
trainer's and the daemon's memory polled while it runs (``Sampler``), and the losses and step
times of its UILogger database."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.bench.card import phase
from tests.daemon import Daemon

BENCH = Path(__file__).resolve().parent.parent  # tests/bench
REPO = BENCH.parent.parent
SHIM = BENCH / "aitk_shim"

AITK_COMMIT = "27a03a91f23eb1b757d5ec2e80ee3e129cfcc350"

#: Imported by ai-toolkit at start-up, absent from the GPU image, off a FLUX.1 LoRA run's path.
STUBS = [
    "albumentations",  # toolkit/dataloader_mixins.py (augmentations: not configured)
    "av",  # diffusers' LTX-2 export utilities (video)
    "controlnet_aux",  # toolkit/stable_diffusion_model.py (ControlNet adapters)
    "lpips",  # SDTrainer (LPIPS loss: not configured)
    "lycoris",  # toolkit/lycoris_special.py (LoKr/LoCon networks: `type: lora` here)
    "optimum",  # optimum.quanto (quantize: false)
    "torchao",  # toolkit/util/quantize.py builds its configs at import (quantize: false)
    "torchaudio",  # audio models (real one used where installed)
    "cv2",  # image/video helpers (real one used where installed)
    "httpx",  # hub helpers (real one used where installed)
]

#: Stubs that must also look installed to importlib.metadata (diffusers checks PyAV).
STUB_DISTS = ["av"]

#: The /proc/PID/status fields of the RSS timeline: its anonymous memory (the trainer's own
#: heap and tensors), file pages (mapped files: the model read from disk) and shared memory
#: (the daemon's regions it maps), and the host's MemAvailable beside them.
RSS_FIELDS = ("RssAnon", "RssFile", "RssShmem")

#: Seconds between two points of the RSS timeline.
TIMELINE_EVERY = 2.0


def memory_kib(status: str, fields=RSS_FIELDS) -> dict:
    """``fields`` of a process's /proc/PID/status text and the host's MemAvailable (from
    /proc/meminfo, absent where it cannot be read), in KiB as /proc gives them."""
    out = {}
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name in fields:
            out[name] = int(value.split()[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                out["MemAvailable"] = int(line.split()[1])
    except OSError:
        pass
    return out


class Sampler(threading.Thread):
    """Polls a process tree's VmHWM/RSS and, on CUDA, nvidia-smi's memory in use; every
    ``TIMELINE_EVERY`` s a point of ``timeline``: seconds since the start, the RSS_FIELDS and
    the host's MemAvailable, in GiB (what a process killed by the host's out-of-memory killer
    held, and where, up to its end)."""

    def __init__(self, pid: int, gpu: bool):
        super().__init__(daemon=True)
        self.pid, self.gpu = pid, gpu
        self.hwm = 0
        self.gpu_used = 0
        self.timeline: list[dict] = []
        self.stop = threading.Event()

    def _point(self, status: str, t: float):
        kib = memory_kib(status)
        self.timeline.append(
            {"t": round(t, 1), **{k: round(v / (1 << 20), 2) for k, v in kib.items()}}
        )

    def run(self):
        last_smi = 0.0
        start = last_point = time.monotonic()
        while not self.stop.is_set():
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
                for line in status.splitlines():
                    if line.startswith("VmHWM:"):
                        self.hwm = max(self.hwm, int(line.split()[1]) * 1024)
                now = time.monotonic()
                if not self.timeline or now - last_point >= TIMELINE_EVERY:
                    last_point = now
                    self._point(status, now - start)
            except (OSError, ValueError, IndexError):
                pass
            if self.gpu and time.monotonic() - last_smi > 0.5:
                last_smi = time.monotonic()
                try:
                    out = subprocess.run(
                        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                        capture_output=True,
                        text=True,
                        timeout=10,
                    ).stdout
                    self.gpu_used = max(self.gpu_used, int(out.split()[0]) * (1 << 20))
                except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                    pass
            self.stop.wait(0.1)


def read_log(db: Path) -> dict:
    con = sqlite3.connect(db)
    try:
        steps = con.execute("SELECT step, wall_time FROM steps ORDER BY step").fetchall()
        losses = con.execute(
            "SELECT step, value_real FROM metrics WHERE key = 'loss/loss' ORDER BY step"
        ).fetchall()
    finally:
        con.close()
    times = [t for _, t in steps]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {
        "logged_steps": [s for s, _ in steps],
        "losses": [v for _, v in losses],
        "loss_steps": [s for s, _ in losses],
        "s_per_it": (sum(gaps) / len(gaps)) if gaps else None,
        "step_gaps_s": gaps,
    }


def read_log_times(db: Path) -> list[float]:
    con = sqlite3.connect(db)
    try:
        return [t for (t,) in con.execute("SELECT wall_time FROM steps ORDER BY step")]
    finally:
        con.close()


def lora_tensors(output: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(output.glob("*/*.safetensors"))
    assert files, f"no LoRA saved under {output}"
    return load_file(files[-1])


def run_one(
    mode: str,
    args,
    work: Path,
    model: Path,
    data: Path,
    yaml_text: str,
    cuda: bool,
    extra_env: dict,
    kind: str | None = None,
    link: str | None = None,
):
    # "MODE#N": MODE once more (its own folder and result), e.g. resident#2 to see whether a
    # run repeats itself bit for bit on this machine. ``kind`` (aitk, weightstream, resident)
    # when the mode is a longer label; ``link`` caps weightstream's daemon.
    kind = kind or mode.partition("#")[0]
    folder = work / mode.replace("#", "-")
    folder.mkdir()
    (folder / "model").symlink_to(model)
    shutil.copytree(data, folder / "data")
    if kind == "resident":
        # The reference: the same job without any offloading (the weights in place).
        assert "layer_offloading: true" in yaml_text, "the template no longer offloads"
        yaml_text = yaml_text.replace("layer_offloading: true", "layer_offloading: false")
    (folder / "job.yaml").write_text(yaml_text)
    aitk = Path(args.aitk).resolve()
    env = dict(os.environ)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(
                [
                    str(SHIM),
                    str(REPO / "client-py" / "src"),
                    *args.pythonpath,
                    env.get("PYTHONPATH", ""),
                ]
            ),
            "WS_AITK_STUBS": ",".join(STUBS),
            "WS_AITK_STUB_DISTS": ",".join(STUB_DISTS),
            "WS_AITK_STUB_LOG": str(folder / "stubs.json"),
            "WS_AITK_STATS": str(folder / "torch_stats.json"),
            "WS_AITK_SAMPLING": str(folder / "sampling.json"),
            "WS_AITK_PROBE": str(folder / "probe.json"),
            "WS_AITK_DETERMINISTIC": "1",
            "SEED": str(args.seed),
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
            "PYTHONHASHSEED": "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONUNBUFFERED": "1",
            "TQDM_MININTERVAL": "5",
        }
    )
    env.update(extra_env)
    env["WS_PHASE_LABEL"] = mode  # the shim marks the training phase for tests/bench/card.py
    if not cuda:
        env["WS_AITK_HIDE"] = "triton"
    daemon = None
    if kind in ("aitk", "resident"):
        cmd = [sys.executable, str(aitk / "run.py"), "job.yaml"]
    else:
        shared = args.daemon_socket
        if shared:
            # One daemon for every run of the call (started by the caller, its link as it was
            # started): a later job finds what an earlier one left in it (recipes).
            env["WEIGHTSTREAM_SOCKET"] = shared
        else:
            # ``link`` (e.g. ``25GB/s``) caps the daemon's copies.
            daemon = Daemon(
                folder,
                *(["--copy-bandwidth-limit", link] if link else []),
                binary=args.bin,
                backend="cuda" if cuda else "host",
                log_level=os.environ.get("WEIGHTSTREAM_LOG", "warn"),
                log_stdout=True,
                ready_s=60,
            )
            env["WEIGHTSTREAM_SOCKET"] = daemon.socket
        cmd = [
            sys.executable,
            "-m",
            "weightstream.integrations.ai_toolkit",
            str(aitk / "run.py"),
            "job.yaml",
        ]
    print(f"[{mode}] {' '.join(cmd)}  (cwd {folder})", flush=True)
    phase("loading", mode)
    t0, started = time.monotonic(), time.time()
    with open(folder / "trainer.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = Sampler(proc.pid, cuda)
        dsampler = Sampler(daemon.pid, False) if daemon else None
        sampler.start()
        if dsampler:
            dsampler.start()
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        wall = time.monotonic() - t0
        sampler.stop.set()
        sampler.join()
        if dsampler:
            dsampler.stop.set()
            dsampler.join()
    if daemon:
        daemon.stop(timeout=30)
    tail = (folder / "trainer.log").read_text(errors="replace")[-6000:]
    result = {
        "mode": mode,
        "command": cmd,
        "rc": rc,
        "wall_s": wall,
        "trainer_peak_rss": sampler.hwm,
        "trainer_rss_timeline": sampler.timeline,
    }
    if dsampler:
        result["daemon_peak_rss"] = dsampler.hwm
        result["daemon_rss_timeline"] = dsampler.timeline
    if cuda:
        result["nvidia_smi_peak_used"] = sampler.gpu_used
    for name in ("torch_stats.json", "stubs.json", "probe.json", "sampling.json"):
        p = folder / name
        if p.exists():
            result[name.removesuffix(".json")] = json.loads(p.read_text())
    result.update(logged_steps(folder, started))
    if rc != 0:
        result["log_tail"] = tail
        print(tail, flush=True)
        return result, None
    return result, lora_tensors(folder / "output")


def logged_steps(folder: Path, started: float) -> dict:
    """What ai-toolkit's UILogger logged of a run's steps (``read_log``) and the time from the
    launch (``started``, a ``time.time()``) to its first step; also of a run that failed or
    was stopped after some steps (a 60 s step stopped at the timeout still has its gaps).
    Empty where nothing was logged."""
    db = next(folder.glob("output/*/loss_log.db"), None)
    if db is None:
        return {}
    out = read_log(db)
    if not out["logged_steps"]:
        return {}
    # UILogger's wall times are time.time() when each step was logged: the first one's, from
    # the launch, is the time to the first step done.
    times = read_log_times(db)
    out["first_step_s"] = times[0] - started if times else None
    return out


def stubs_called(result: dict) -> list:
    return [c for c in result.get("stubs", {}).get("calls", []) if not c["in_import"]]
