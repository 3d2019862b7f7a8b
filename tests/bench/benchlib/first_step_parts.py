"""The parts of tests/bench/first_step.py that run in a child process of their own (``child``,
``--child PART``): the model (FLUX.1 or FLUX.2 from diffusers, cut by ``--scale``, with LoRA),
its batch and steps, the host's facts and the memory check, and the parts themselves
(``register``, ``gen``, ``attach-id``, ``upload`` and their 8-bit and baseline variants)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import time
import traceback
from pathlib import Path

from tests.bench.benchlib import flux

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[3]

#: Host memory kept free beyond what a part needs (the CUDA contexts, Python, the kernel).
MARGIN = 6 * GiB


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
