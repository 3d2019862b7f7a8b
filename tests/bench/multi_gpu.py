"""Several GPUs, one host copy: the box's topology, host->device bandwidth with one
shared host copy against one local copy per socket, and DDP LoRA training (ddp_train.py under
torchrun) against one GPU alone and against every rank resident. One invocation per model:

    python3 -m tests.bench.multi_gpu --bin target/release/weightstream --model flux1 \
        --runs resident:2 weightstream:1 weightstream:2 --job-gib 24 --trainer-gib 5 --out $OUT

Writes ``multi_gpu_<model>.json`` under --out (the command, the date, the topology, the
bandwidth table and each run's record) and prints each part as it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.bench.provenance import command
from tests.daemon import Daemon

GiB = 1 << 30


def sh(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"{cmd[0]}: {e!r}"


def gpus() -> list[dict]:
    """Each GPU's index, PCI bus id and the NUMA node its bus hangs off."""
    out = sh("nvidia-smi", "--query-gpu=index,pci.bus_id,name", "--format=csv,noheader")
    found = []
    for line in out.strip().splitlines():
        index, bus, name = (x.strip() for x in line.split(","))
        sysfs = Path("/sys/bus/pci/devices") / bus.lower()[-12:]
        try:
            node = int((sysfs / "numa_node").read_text())
        except (OSError, ValueError):
            node = None
        found.append({"index": int(index), "bus_id": bus, "name": name, "numa_node": node})
    return found


def numa_nodes() -> dict[int, str]:
    """NUMA node -> its CPU list, as the kernel reports them."""
    nodes = {}
    for d in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        nodes[int(d.name[4:])] = (d / "cpulist").read_text().strip()
    return nodes


def cpus_of(cpulist: str) -> set[int]:
    cpus = set()
    for part in cpulist.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def topology() -> dict:
    return {
        "gpus": gpus(),
        "numa_nodes": numa_nodes(),
        "nvidia_smi_topo": sh("nvidia-smi", "topo", "-m"),
        "cpus": os.cpu_count(),
    }


def bandwidth(topo: dict, size: int = 2 * GiB, reps: int = 8) -> list[dict]:
    """Host->device GB/s of each GPU alone and of all at once, from one page-locked buffer shared
    by every GPU (the daemon's layout: one copy) and, on a box of several NUMA nodes, from a
    buffer local to each GPU's node (allocated by a thread bound to that node's CPUs: the kernel
    places pages on the node that first touches them) and from the node across."""
    import torch

    devices = [g["index"] for g in topo["gpus"]]
    nodes = topo["numa_nodes"]
    everything = os.sched_getaffinity(0)

    def pinned_on(node):
        if node is not None and node in nodes:
            os.sched_setaffinity(0, cpus_of(nodes[node]))
        try:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        finally:
            os.sched_setaffinity(0, everything)

    dst = {d: torch.empty(size, dtype=torch.uint8, device=f"cuda:{d}") for d in devices}
    streams = {d: torch.cuda.Stream(device=f"cuda:{d}") for d in devices}

    def run(sources: dict) -> dict:
        for _ in range(2):  # warm-up
            for d, src in sources.items():
                with torch.cuda.stream(streams[d]):
                    dst[d].copy_(src, non_blocking=True)
            for d in sources:
                streams[d].synchronize()
        started = time.perf_counter()
        for _ in range(reps):
            for d, src in sources.items():
                with torch.cuda.stream(streams[d]):
                    dst[d].copy_(src, non_blocking=True)
        for d in sources:
            streams[d].synchronize()
        elapsed = time.perf_counter() - started
        per = {str(d): round(size * reps / elapsed / 1e9, 2) for d in sources}
        return {"per_gpu_gb_s": per, "aggregate_gb_s": round(sum(per.values()), 2)}

    rows = []
    shared = pinned_on(None)
    for d in devices:
        rows.append({"source": "shared", "gpus": [d], **run({d: shared})})
    rows.append({"source": "shared", "gpus": devices, **run(dict.fromkeys(devices, shared))})
    gpu_node = {g["index"]: g["numa_node"] for g in topo["gpus"]}
    if len(nodes) > 1 and all(n is not None for n in gpu_node.values()):
        # Every buffer stays alive until the end: torch's pinned-memory cache would hand a freed
        # one (placed on another node) back for the next.
        local = {d: pinned_on(gpu_node[d]) for d in devices}
        remote = {d: pinned_on(next(n for n in nodes if n != gpu_node[d])) for d in devices}
        for d in devices:
            rows.append(
                {"source": f"local (node {gpu_node[d]})", "gpus": [d], **run({d: local[d]})}
            )
            rows.append({"source": "remote", "gpus": [d], **run({d: remote[d]})})
        rows.append({"source": "local per GPU", "gpus": devices, **run(local)})
    return rows


def ddp_run(args, kind: str, world: int, socket: str, out: Path) -> dict:
    result = out / f"ddp-{kind}-{world}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    # -m: ddp_train imports tests.bench.*, run from the repository root like this script.
    cmd += [f"--nproc-per-node={world}", "-m", "tests.bench.ddp_train"]
    cmd += ["--model", args.model, "--lora-rank", str(args.lora_rank), "--out", str(result)]
    cmd += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    if kind == "resident":
        cmd += ["--resident"]
    else:
        cmd += ["--socket", socket, "--job-gib", str(args.job_gib)]
        cmd += ["--trainer-gib", str(args.trainer_gib)]
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_NVLS_ENABLE": "0"}
    env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    started = time.monotonic()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        (out / f"multi-{kind}-{world}.log").write_text(p.stdout + p.stderr)
        record = json.loads(result.read_text()) if result.exists() else {"error": p.stderr[-800:]}
    except subprocess.TimeoutExpired:
        record = {"error": f"timed out after {args.timeout} s"}
    record.update(kind=kind, world_size=world, wall_s=round(time.monotonic() - started, 1))
    return record


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", default="target/release/weightstream")
    p.add_argument("--model", choices=["flux1", "flux2"], default="flux1")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument(
        "--runs",
        nargs="*",
        default=["resident:2", "weightstream:1", "weightstream:2"],
        help="KIND:WORLD, KIND resident or weightstream",
    )
    p.add_argument("--job-gib", type=float, default=24)
    p.add_argument("--trainer-gib", type=float, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--timeout", type=int, default=300, help="seconds per run")
    p.add_argument("--no-bandwidth", action="store_true")
    p.add_argument("--bandwidth-only", action="store_true", help="(the child that measures it)")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-multi-out"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"multi_gpu_{args.model}.json"
    results = {
        "command": command(),
        "date": time.strftime("%Y-%m-%d"),
        "topology": topology(),
        "runs": [],
    }
    print(results["topology"]["nvidia_smi_topo"], json.dumps(results["topology"]["gpus"]))
    if args.bandwidth_only:
        print("RESULT " + json.dumps(bandwidth(results["topology"])), flush=True)
        return
    if not args.no_bandwidth:
        # In a child: the runs below should find no CUDA context of this process on the GPUs.
        p = subprocess.run(
            [sys.executable, "-m", "tests.bench.multi_gpu", "--bandwidth-only"],
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        results["bandwidth"] = json.loads(lines[-1][7:]) if lines else {"error": p.stderr[-800:]}
        print(json.dumps(results["bandwidth"]), flush=True)
        path.write_text(json.dumps(results, indent=1))
    daemon = Daemon(
        tempfile.mkdtemp(prefix="ws-multi-"),
        binary=args.bin,
        backend="cuda",
        log=out / "multi-daemon.log",
        log_level=None,
        ready_s=120,
    )
    try:
        for run in args.runs:
            kind, _, world = run.partition(":")
            record = ddp_run(args, kind, int(world), daemon.socket, out)
            results["runs"].append(record)
            path.write_text(json.dumps(results, indent=1))
            print(json.dumps(record)[:2000], flush=True)
    finally:
        daemon.stop(timeout=60)
    logs = sorted(x.name for x in out.glob("multi-*.log"))
    if logs:
        subprocess.run(
            ["tar", "czf", f"multi-logs-{args.model}.tgz", "--remove-files", *logs], cwd=out
        )
    for f in out.glob("ddp-*.json"):
        f.unlink()


if __name__ == "__main__":
    main()
