"""One rank of the DDP benchmark (run by tests/bench/multi_gpu.py under torchrun): FLUX.1 or
FLUX.2 LoRA, one rank per GPU, every rank streaming the same host copy from one daemon (or, with
--resident, each rank holding the whole model on its GPU).

    torchrun --standalone --nproc-per-node 2 tests/bench/ddp_train.py --socket /tmp/ws.sock \
        --model flux1 --job-gib 24 --trainer-gib 5 --out /tmp/ddp.json

Rank 0 uploads the transformer and broadcasts its id; the other ranks build the same module on
their GPU (its shapes and the parameters that are not streamed) and attach to that id, which
frees their device copies. Each rank's trainer is capped at --trainer-gib (its allocator's
memory fraction) and its session at the rest of --job-gib. Records per rank: s/step (median
after the warm-up), bytes copied host->device and their rate, nvidia-smi's view of its GPU;
rank 0 adds the daemon's store bytes (one copy whatever the world size), the host's
MemAvailable before and after attaching, and the aggregate H2D rate (all ranks' bytes over the
slowest rank's measured time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from tests.bench.benchlib import flux, modes

GiB = 1 << 30


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return round(kb / (1 << 20), 2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--socket")
    p.add_argument("--model", choices=["flux1", "flux2"], default="flux1")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--resident", action="store_true", help="no daemon: the model on each GPU")
    p.add_argument("--job-gib", type=float, default=24, help="the GPU memory of one rank's job")
    p.add_argument("--trainer-gib", type=float, default=5, help="the trainer's part of it")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default="multi_gpu.json")
    args = p.parse_args()
    flux.MODEL, flux.RANK = args.model, args.lora_rank

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    torch.backends.cuda.enable_cudnn_sdp(False)
    before = mem_available_gib()
    mine = {"rank": rank, "device": torch.cuda.get_device_name(local)}
    handle = client = None
    if args.resident:
        model = flux.add_lora(flux.build(str(device)))
    else:
        import weightstream
        import weightstream.torch as wst

        client = weightstream.connect(args.socket)
        on_host = rank == 0 and args.model == "flux1"  # FLUX.2 uploads from the GPU by DMA
        model = flux.build_on_host() if on_host else flux.build(str(device))
        model = flux.add_lora(model)
        budget = int((args.job_gib - args.trainer_gib) * GiB)
        started = time.monotonic()
        ids = [None]
        if rank == 0:
            handle = wst.attach(model, device, client=client, vram_budget=budget, label="ddp")
            ids = [handle.model_id]
        dist.broadcast_object_list(ids, src=0)
        if rank != 0:
            handle = wst.attach(model, device, client=client, vram_budget=budget, model=ids[0])
        mine["attach_s"] = round(time.monotonic() - started, 1)
        dist.barrier()
        mine["streamed_placeholders"] = len(wst.ddp_ignore_streamed(model))
        total = torch.cuda.get_device_properties(local).total_memory
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(args.trainer_gib * GiB / total, local)
    after_attach = mem_available_gib()
    ddp = DDP(model, device_ids=[local])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    inputs = flux.batch(str(device))
    torch.cuda.reset_peak_memory_stats(local)
    times, copied0 = [], 0
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize(local)
        if step == args.warmup and handle is not None:
            copied0 = handle.stats()["bytes_copied"]
        t = time.monotonic()
        loss = ddp(**inputs, return_dict=False)[0].float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(local)
        times.append(time.monotonic() - t)
    measured = times[args.warmup :]
    mine["s_per_step"] = round(statistics.median(measured), 4)
    mine["steps_s"] = [round(x, 4) for x in measured]
    mine["measured_s"] = round(sum(measured), 4)
    mine["trainer_reserved_gib"] = round(torch.cuda.max_memory_reserved(local) / GiB, 2)
    mine["nvidia_smi_used_gib"] = modes.nvidia_smi_used_gib(local)
    if handle is not None:
        mine["h2d_bytes"] = handle.stats()["bytes_copied"] - copied0
        mine["h2d_gb_s"] = round(mine["h2d_bytes"] / mine["measured_s"] / 1e9, 2)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        record = {
            "model": args.model,
            "world_size": world,
            "resident": args.resident,
            "job_gib": None if args.resident else args.job_gib,
            "trainer_gib": None if args.resident else args.trainer_gib,
            "ranks": everyone,
            "s_per_step_max": max(r["s_per_step"] for r in everyone),
            "mem_available_gib": {"before": before, "after_attach": after_attach},
        }
        if client is not None:
            record["store_gib"] = round(client.list_models().store_bytes / GiB, 2)
            slowest = max(r["measured_s"] for r in everyone)
            total_bytes = sum(r["h2d_bytes"] for r in everyone)
            record["aggregate_h2d_gb_s"] = round(total_bytes / slowest / 1e9, 2)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print("RESULT " + json.dumps(record), flush=True)
    # Rank 0 gives the daemon's copy back once every other rank has closed its session.
    if handle is not None and rank != 0:
        handle.detach()
    dist.barrier()
    if handle is not None and rank == 0:
        handle.detach(release=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
