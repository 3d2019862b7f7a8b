"""Benchmark (UNTESTED: written without a two-GPU machine, never run): FLUX.1 LoRA under DDP,
one rank per GPU, all ranks streaming the same host copy from one daemon.

On a machine with two GPUs, the daemon already serving on its CUDA backend
(`weightstream serve --backend cuda --socket /run/weightstream/ws.sock`):
    torchrun --nproc-per-node 2 tests/bench/ddp_train.py --socket /run/weightstream/ws.sock \
        --budget-gib 16 --steps 10 --out tests/bench/results/multi_gpu.json
Rank 0 uploads the transformer and broadcasts its id; the other ranks attach to that id. Records
per rank: s/step (after a warm-up step), bytes copied host→device and their rate; rank 0 adds
the daemon's store bytes (one copy expected, whatever the world size), the host's MemAvailable
before and after attaching, and the aggregate H2D bandwidth (all ranks' bytes over the slowest
rank's time). Compare with one rank (`--nproc-per-node 1`) and with `flux_train.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import flux_train  # noqa: E402  (its model, LoRA and batch)


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return round(kb / (1 << 20), 2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--budget-gib", type=float, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default="multi_gpu.json")
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    import weightstream
    import weightstream.torch as wst
    from torch.nn.parallel import DistributedDataParallel as DDP
    from weightstream.torch.placeholder import is_placeholder

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local)
    client = weightstream.connect(args.socket)
    before = mem_available_gib()
    # Rank 0 uploads from host memory; the others only need the module's shapes and the
    # non-streamed parameters (built on their GPU, freed there by attach).
    model = flux_train.build_on_host() if rank == 0 else flux_train.build(device=str(device))
    model = flux_train.add_lora(model)
    budget = int(args.budget_gib * (1 << 30))
    ids = [None]
    if rank == 0:
        handle = wst.attach(model, device, client=client, vram_budget=budget, label="ddp")
        ids = [handle.model_id]
    dist.broadcast_object_list(ids, src=0)
    if rank != 0:
        handle = wst.attach(model, device, client=client, vram_budget=budget, model=ids[0])
    dist.barrier()
    store_bytes = client.list_models().store_bytes
    after_attach = mem_available_gib()
    streamed = [n for n, p in model.named_parameters() if is_placeholder(p)]
    DDP._set_params_and_buffers_to_ignore_for_model(model, streamed)
    ddp = DDP(model, device_ids=[local])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    inputs = flux_train.batch(str(device))
    times = []
    copied0 = 0
    for step in range(args.steps + 1):
        torch.cuda.synchronize()
        if step == 1:
            copied0 = handle.stats()["bytes_copied"]
        t = time.monotonic()
        ddp(**inputs, return_dict=False)[0].float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.monotonic() - t)
    copied = handle.stats()["bytes_copied"] - copied0
    mine = {
        "rank": rank,
        "s_per_step": round(sum(times[1:]) / args.steps, 3),
        "h2d_bytes": copied,
        "h2d_gb_s": round(copied / sum(times[1:]) / 1e9, 2),
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        slowest = max(r["s_per_step"] for r in everyone) * args.steps
        record = {
            "world_size": world,
            "budget_gib": args.budget_gib,
            "ranks": everyone,
            "store_gib": round(store_bytes / (1 << 30), 2),
            "mem_available_gib": {"before": before, "after_attach": after_attach},
            "aggregate_h2d_gb_s": round(sum(r["h2d_bytes"] for r in everyone) / slowest / 1e9, 2),
        }
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps(record, indent=1))
    dist.barrier()
    handle.detach(release=rank == 0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
