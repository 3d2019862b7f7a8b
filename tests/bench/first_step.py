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
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tests.bench.benchlib import flux
from tests.bench.provenance import command
from tests.daemon import Daemon

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]

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
#: Host memory kept free beyond what a part needs (the CUDA contexts, Python, the kernel).
MARGIN = 6 * GiB

# --- the model --------------------------------------------------------------------------


def layers(double: int, single: int, scale: float) -> tuple[int, int]:
    return max(1, round(double * scale)), max(1, round(single * scale))


def build_meta(args):
    """The transformer on the meta device, bf16, frozen (``--scale`` cuts its blocks)."""
    import torch

    with torch.device("meta"):
        if args.model == "flux2":
            from diffusers import Flux2Transformer2DModel

            n, s = layers(8, 48, args.scale)
            model = Flux2Transformer2DModel(num_layers=n, num_single_layers=s)
        else:
            from diffusers import FluxTransformer2DModel

            n, s = layers(19, 38, args.scale)
            model = FluxTransformer2DModel(num_layers=n, num_single_layers=s, **flux.FLUX1_CONFIG)
    model = model.to(torch.bfloat16)
    model.requires_grad_(False)
    return model


def build(args):
    """The model materialised on ``--device`` with flux_train's seeded random weights, then
    LoRA."""
    import torch

    model = flux.seeded_random(build_meta(args), args.device)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return add_lora(args, model)


def add_lora(args, model):
    flux.MODEL, flux.RANK = args.model, args.rank
    return flux.add_lora(model)


def frozen_tensors(args) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every frozen parameter of the model with its LoRA layers, as attach
    names them (``...to_q.base_layer.weight``): what the file holds."""
    model = add_lora(args, build_meta(args))
    return [(n, tuple(p.shape)) for n, p in model.named_parameters() if not p.requires_grad]


def batch(args):
    """flux_train's batch with ``--tokens`` image and text tokens (4096 + 512 by default)."""
    import torch

    img, txt = args.tokens
    g = torch.Generator(device=args.device).manual_seed(2)
    bf, dev = torch.bfloat16, args.device
    channels, text_dim, ids = (128, 15360, 4) if args.model == "flux2" else (64, 4096, 3)
    inputs = {
        "hidden_states": torch.randn(1, img, channels, generator=g, device=dev, dtype=bf),
        "encoder_hidden_states": torch.randn(1, txt, text_dim, generator=g, device=dev, dtype=bf),
        "timestep": torch.tensor([0.5], device=dev, dtype=bf),
        "img_ids": torch.zeros(img, ids, device=dev, dtype=bf),
        "txt_ids": torch.zeros(txt, ids, device=dev, dtype=bf),
        "guidance": torch.tensor([3.5], device=dev, dtype=bf),
    }
    if args.model == "flux1":
        inputs["pooled_projections"] = torch.randn(1, 768, generator=g, device=dev, dtype=bf)
    return inputs


def sync(args):
    import torch

    if args.device.startswith("cuda"):
        torch.cuda.synchronize()


def train(args, model, n: int) -> tuple[list[float], float]:
    """n AdamW steps on the LoRA parameters (the optimizer made here): seconds each, last loss."""
    import torch

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    inputs = batch(args)
    times, loss = [], float("nan")
    for _ in range(n):
        sync(args)
        t = time.monotonic()
        out = model(**inputs, return_dict=False)[0]
        step_loss = out.float().pow(2).mean()
        step_loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(args)
        times.append(round(time.monotonic() - t, 3))
        loss = step_loss.item()
    return times, loss


# --- host facts -------------------------------------------------------------------------


def meminfo(key: str = "MemAvailable") -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def read_text(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def host_info(args) -> dict:
    def run(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    usage = shutil.disk_usage(args.dir) if os.path.isdir(args.dir) else None
    return {
        "cpus": os.cpu_count(),
        "mem_total_gib": round(meminfo("MemTotal") / GiB, 1),
        "mem_available_gib": round(meminfo() / GiB, 1),
        "dir": args.dir,
        "dir_free_gib": round(usage.free / GiB, 1) if usage else None,
        "kernel": os.uname().release,
        "shmem_thp": read_text("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "gpus": run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]),
        "commit": run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
    }


def in_memory(path: Path) -> bool:
    """Whether ``path`` is on a tmpfs (its files are host memory that nothing evicts)."""
    best, kind = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            mount = fields[1]
            if str(path.resolve()).startswith(mount.rstrip("/") + "/") or str(path) == mount:
                if len(mount) > len(best):
                    best, kind = mount, fields[2]
    return kind in ("tmpfs", "ramfs")


def need_memory(what: str, nbytes: int, args):
    """Refuses a part whose host memory would not fit (the machine would swap or kill)."""
    if args.no_memory_check:
        return
    available = meminfo()
    if nbytes + MARGIN > available:
        raise MemoryError(
            f"{what} needs {nbytes / GiB:.1f} GiB of host memory (+{MARGIN / GiB:.0f} GiB "
            f"margin), {available / GiB:.1f} GiB available: use --scale, or a larger machine"
        )


# --- child parts (GPU work, each in its own process) -----------------------------------


def part_register(args, record):
    """cudaHostRegister of a fresh memfd mapping (the driver faults its pages in) and of one
    populated first (MADV_POPULATE_WRITE), in one call and in N windows on N threads."""
    import ctypes
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    import torch

    torch.zeros(1, device=args.device)
    cudart = torch.cuda.cudart()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    size = int(args.probe_gib * GiB)
    need_memory("the registration probe", size, args)
    threads = max(1, min(8, os.cpu_count() or 1))
    record["bytes"], record["threads"] = size, threads

    def split(n: int) -> list[tuple[int, int]]:
        per = -(-size // n // mmap.PAGESIZE) * mmap.PAGESIZE
        return [(o, min(per, size - o)) for o in range(0, size, per)]

    def timed_map(fn, pieces, n) -> float:
        t = time.monotonic()
        with ThreadPoolExecutor(n) as pool:
            for r in pool.map(fn, pieces):
                if r:
                    raise RuntimeError(f"{fn.__name__}: {r}")
        return time.monotonic() - t

    # (populated first, threads, cudaHostRegister flags): the client registers with 0, the
    # daemon with PORTABLE (1), each on several threads.
    cases = [(False, 1, 0), (False, threads, 0), (True, 1, 0), (True, threads, 0)]
    cases.append((True, threads, 1))
    for populated, n, flags in cases:
        fd = os.memfd_create("ws-probe")
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        buf = (ctypes.c_char * size).from_buffer(m)
        base = ctypes.addressof(buf)
        pieces = split(n)

        def populate(piece, base=base):
            r = libc.madvise(base + piece[0], piece[1], 23)  # MADV_POPULATE_WRITE
            return f"errno {ctypes.get_errno()}" if r else None

        def register(piece, base=base, flags=flags):
            return int(cudart.cudaHostRegister(base + piece[0], piece[1], flags))

        def unregister(piece, base=base):
            return int(cudart.cudaHostUnregister(base + piece[0]))

        case = {}
        try:
            if populated:
                case["populate_s"] = round(timed_map(populate, pieces, n), 3)
            took = timed_map(register, pieces, n)
            case["register_s"] = round(took, 3)
            case["register_gb_s"] = round(size / max(took, 1e-9) / 1e9, 2)
            case["unregister_s"] = round(timed_map(unregister, pieces, n), 3)
        except Exception as e:  # noqa: BLE001 - one case's failure is its result
            case["error"] = repr(e)[:300]
        finally:
            del buf
            m.close()
        name = f"{'populated' if populated else 'fresh'}, {n} thread{'s' * (n > 1)}"
        name += ", PORTABLE" if flags else ""
        record[name] = case
        print(name, case, flush=True)


def part_gen(args, record):
    """The safetensors file: header, then each tensor's bf16 random bytes, made on the device
    and written from pinned buffers by a pool of threads (pwrite releases the GIL)."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    import torch

    started = time.monotonic()
    entries = frozen_tensors(args)
    header, offset = {}, 0
    for name, shape in entries:
        n = 2 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start, path = 8 + len(text), Path(args.file)
    record.update(tensors=len(entries), bytes=start + offset, path=str(path))
    free = shutil.disk_usage(path.parent).free
    if start + offset > free:
        raise OSError(
            f"{path.parent} has {free / GiB:.1f} GiB free, the file needs {offset / GiB:.1f}"
        )
    if in_memory(path.parent):
        need_memory("the file in memory", offset, args)
    chunk, buffers = 128 << 20, 8
    pinned = args.device.startswith("cuda")
    free_bufs: queue.Queue = queue.Queue()
    for _ in range(buffers):
        free_bufs.put(torch.empty(chunk, dtype=torch.uint8, pin_memory=pinned))
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)

    def write(buf, n: int, at: int):
        try:
            view, done = memoryview(buf.numpy())[:n], 0
            while done < n:
                done += os.pwrite(fd, view[done:], at + done)
        finally:
            free_bufs.put(buf)

    try:
        os.ftruncate(fd, start + offset)
        os.pwrite(fd, struct.pack("<Q", len(text)) + text, 0)
        g = torch.Generator(device=args.device).manual_seed(1)
        futures = []
        with ThreadPoolExecutor(buffers) as pool:
            for name, _ in entries:
                lo, hi = header[name]["data_offsets"]
                if hi == lo:
                    continue
                values = torch.randn((hi - lo) // 2, generator=g, device=args.device)
                values = values.mul_(0.02).to(torch.bfloat16).view(torch.uint8)
                for at in range(0, hi - lo, chunk):
                    n = min(chunk, hi - lo - at)
                    buf = free_bufs.get()
                    buf[:n].copy_(values[at : at + n])
                    futures.append(pool.submit(write, buf, n, start + lo + at))
                del values
            for f in futures:
                f.result()
    finally:
        os.close(fd)
    record["gen_s"] = round(time.monotonic() - started, 1)


def part_attach_id(args, record):
    """A second job: the model built here, attached by id to the daemon's copy; the time from
    attach to the end of the first step, then a few steps at speed."""
    import torch
    import weightstream
    import weightstream.torch as wst

    t = time.monotonic()
    model = build(args)
    record["build_s"] = round(time.monotonic() - t, 1)
    client = weightstream.connect(args.socket)
    quantize = "fp8" if args.child.endswith("fp8") else None
    started = time.monotonic()
    handle = wst.attach(
        model,
        args.device,
        client=client,
        vram_budget=int(args.budget_gib * GiB),
        model=args.model_id,
        quantize=quantize,
    )
    attached = time.monotonic()
    _, loss = train(args, model, 1)
    done = time.monotonic()
    record.update(
        attach_s=round(attached - started, 2),
        first_step_s=round(done - attached, 2),
        to_first_step_s=round(done - started, 2),
        first_loss=loss,
    )
    record["steps_s"], _ = train(args, model, args.steps)
    stats = handle.stats()
    record["attach"] = {k: v for k, v in stats.items() if k.startswith("attach_")}
    record["hit_rate"] = round(stats.get("hit_rate", 0.0), 4)
    if args.device.startswith("cuda"):
        record["trainer_peak_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 2)
    handle.close()


def part_upload(args, record):
    """The model built on the GPU, attached by upload; the attach's phases (the client's write,
    the daemon's commit), then its first step. Releases the upload at the end."""
    import torch
    import weightstream
    import weightstream.torch as wst
    from weightstream import _upload
    from weightstream.torch import options as ws_options

    quantize = "fp8" if "fp8" in args.child else None
    at_commit = args.child.endswith("daemon")
    ws_options.QUANTIZE_ON = "daemon" if at_commit else "auto"
    _upload.CLIENT_RESERVES = args.child != "upload-daemon-reserves"
    nbytes = sum(2 * torch.Size(s).numel() for _, s in frozen_tensors(args))
    # Quantized at commit: the bf16 region and the 8-bit arena at once, for a while; on the
    # GPU: the 8-bit region alone.
    factor = 1.6 if at_commit else (0.6 if quantize else 1.0)
    need_memory("the upload", int(nbytes * factor), args)
    t = time.monotonic()
    model = build(args)
    record["build_s"] = round(time.monotonic() - t, 1)
    client = weightstream.connect(args.socket)
    available = meminfo()
    started = time.monotonic()
    handle = wst.attach(
        model,
        args.device,
        client=client,
        vram_budget=int(args.budget_gib * GiB),
        quantize=quantize,
    )
    attached = time.monotonic()
    _, loss = train(args, model, 1)
    done = time.monotonic()
    stats = handle.stats()
    record.update(
        bytes=stats.get("attach_upload_write_bytes") or nbytes,
        attach_s=round(attached - started, 2),
        first_step_s=round(done - attached, 2),
        to_first_step_s=round(done - started, 2),
        first_loss=loss,
        host_memory_used_gib=round((available - meminfo()) / GiB, 1),
    )
    record["attach"] = {k: v for k, v in stats.items() if k.startswith("attach_")}
    record["model_id"] = handle.model_id
    handle.close(release=True)


CHILDREN = {
    "register": part_register,
    "gen": part_gen,
    "attach-id": part_attach_id,
    "attach-id-fp8": part_attach_id,
    "upload": part_upload,
    "upload-fp8": part_upload,
    "upload-fp8-daemon": part_upload,
    "upload-daemon-reserves": part_upload,
}


def child(args):
    record = {"part": args.child}
    try:
        if args.device.startswith("cuda"):
            import torch

            torch.backends.cuda.enable_cudnn_sdp(False)  # fails in FLUX training on this image
        CHILDREN[args.child](args, record)
    except Exception as e:  # noqa: BLE001 - the error is this part's result
        record["error"] = repr(e)[:800]
        traceback.print_exc()
    print("RESULT " + json.dumps(record), flush=True)
    return 0


# --- the parent: daemon, CLI loads, children, report -----------------------------------


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


# --- the report ---------------------------------------------------------------------------


def gb(nbytes: float, secs: float) -> str:
    return f"{nbytes / secs / 1e9:.1f} GB/s" if secs > 0 else "–"


def row_load(r: dict, target: str) -> list[str]:
    ph, n = r["phases"], r["phases"]["input_bytes"]
    text = (
        f"ready in **{ph['total_s']:.1f} s** ({gb(n, ph['total_s'])} of the file's "
        f"{n / GiB:.1f} GiB): arena {ph['alloc_s']:.1f} s, reading {ph['read_s']:.1f} s "
        f"({gb(n, ph['read_s'])}), page-locking {ph['pin_s']:.1f} s ({gb(n, ph['pin_s'])}); "
        f"the command {r['wall_s']:.1f} s"
    )
    return [text, target]


def row_attach(r: dict, target: str) -> list[str]:
    a = r.get("attach", {})
    text = (
        f"attach {r['attach_s']:.1f} s (finding the model {a.get('attach_model_s', 0):.1f} s, "
        f"session {a.get('attach_open_session_s', 0):.1f} s) + first step "
        f"{r['first_step_s']:.1f} s = **{r['to_first_step_s']:.1f} s**; then "
        f"{', '.join(f'{s:.2f}' for s in r.get('steps_s', []))} s/step"
    )
    return [text, target]


def row_upload(r: dict, target: str) -> list[str]:
    a, n = r.get("attach", {}), r.get("bytes", 0)

    def g(k):
        return a.get(f"attach_upload_{k}", 0) or 0

    if "attach_upload_write_wall_s" in a:
        client = (
            f"begin {g('begin_s'):.1f} s; client write {g('write_wall_s'):.1f} s "
            f"({gb(n, g('write_wall_s'))}; faulting in {g('write_populate_s'):.1f} s, "
            f"cudaHostRegister {g('write_register_s'):.1f} s over "
            f"{g('write_threads')} threads, waited {g('write_wait_register_s'):.1f} s, copies "
            f"{g('write_copy_s'):.1f} s, unregister {g('write_unregister_s'):.1f} s"
        )
        if g("write_quantized_tensors"):
            client += (
                f"; {g('write_quantized_tensors')} weights quantized on the GPU: "
                f"{g('write_quantize_device_s'):.1f} s of GPU time, "
                f"{g('write_quantize_s'):.1f} s issuing"
            )
        client += f"); commit {g('commit_s'):.1f} s"
    else:  # tensors in host memory: the native client's memcpy path, not split
        client = f"upload {g('total_s'):.1f} s (host memory: the native path)"
    text = (
        f"attach **{r['attach_s']:.1f} s** for {n / GiB:.1f} GiB: {client} (daemon: seal "
        f"{g('daemon_seal_s'):.1f} s, quantize {g('daemon_quantize_s'):.1f} s, hash "
        f"{g('daemon_hash_s'):.1f} s while pinning {g('daemon_pin_s'):.1f} s); session "
        f"{a.get('attach_open_session_s', 0):.1f} s; first step {r['first_step_s']:.1f} s; "
        f"attach to the end of the first step **{r['to_first_step_s']:.1f} s**"
    )
    return [text, target]


def row_register(r: dict) -> list[str]:
    cases = [
        f"{k}: {v['register_gb_s']} GB/s"
        + (f" (populating {v['populate_s']} s first)" if "populate_s" in v else "")
        for k, v in r.items()
        if isinstance(v, dict) and "register_gb_s" in v
    ]
    return [f"{r.get('bytes', 0) / GiB:.1f} GiB: " + "; ".join(cases), ""]


ROWS = {
    "register": ("cudaHostRegister of shared memory", lambda r: row_register(r)),
    "gen": ("the file", lambda r: [f"{r['bytes'] / GiB:.1f} GiB written in {r['gen_s']} s", ""]),
    "load": ("`weightstream load` (bf16)", lambda r: row_load(r, "≤ 30 s for 64 GB")),
    "load-fp8": (
        "`weightstream load --quantize fp8`",
        lambda r: row_load(r, "≥ 3 GB/s of bf16 input"),
    ),
    "attach-id": ("second job, attach by id → first step", lambda r: row_attach(r, "≤ 10 s")),
    "attach-id-fp8": ("second job on the 8-bit model", lambda r: row_attach(r, "")),
    "upload": ("attach by upload (from the GPU)", lambda r: row_upload(r, "≤ 30 s")),
    "upload-fp8": (
        "attach by upload, 8 bits quantized on the GPU",
        lambda r: row_upload(r, "≤ 30 s"),
    ),
    "upload-fp8-daemon": ("attach by upload, 8 bits at commit", lambda r: row_upload(r, "")),
    "upload-daemon-reserves": (
        "attach by upload, the daemon reserving the region first",
        lambda r: row_upload(r, ""),
    ),
}


def report(results: dict) -> str:
    host = results.get("host", {})
    lines = [
        f"first_step ({results['model']}, scale {results['scale']}, {results['date']}, "
        f"commit {host.get('commit')}, {host.get('cpus')} CPUs, "
        f"{host.get('mem_total_gib')} GiB, {host.get('gpus')})",
        "",
        "| part | result | target |",
        "|---|---|---|",
    ]
    for part, r in results["parts"].items():
        label, row = ROWS.get(part, (part, None))
        if "error" in r or row is None:
            cells = [f"error: {r.get('error', '?')[:300]}", ""]
        else:
            try:
                cells = row(r)
            except (KeyError, TypeError, ValueError) as e:
                cells = [f"(incomplete result: {e!r})", ""]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |".replace("\n", " "))
    if "error" in results:
        lines.append(f"\nrun error: {results['error']}")
    return "\n".join(lines)


# --- arguments ------------------------------------------------------------------------------


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
