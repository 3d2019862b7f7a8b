"""One DDP rank of test_ddp: gloo on the CPU, the model's frozen weights streamed by the daemon.

Rank 0 uploads (``attach``) and broadcasts the model id; the other ranks attach to that id
(``attach(model=id)``: no second upload). DDP ignores the streamed (placeholder) parameters and
averages the LoRA gradients. Saves, per step, the LoRA parameters after the optimizer step, and
(rank 0) what the daemon listed while every rank was attached.

Also the model, the global batch and the single-process reference, imported by test_ddp.
Usage: python ddp_worker.py RANK WORLD_SIZE SOCKET STORE_FILE OUT_FILE
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

DIM = 64
STEPS = 4
GLOBAL_BATCH = 8
LR = 0.05


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = nn.Linear(16, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.proj_out = nn.Linear(DIM, 16)

    def forward(self, x):
        h = self.proj_in(x)
        for block in self.blocks:
            h = block(h)
        return self.proj_out(h)


def setup():
    """Single-threaded, deterministic kernels: every process computes a half batch the same way
    (a GEMM's blocking, and so its summation order, may depend on the thread count)."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def make_model() -> nn.Module:
    torch.manual_seed(0)  # peft's LoRA init uses the global RNG
    model = Net()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["fc1", "fc2", "proj_in", "proj_out"])
    model = inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
    return model


def lora_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, 5, 16, generator=g)
    return x, torch.randn(GLOBAL_BATCH, 5, 16, generator=g)


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(list(lora_params(model).values()), lr=LR, momentum=0.9)


def reference(world: int, micro_batches: bool) -> list[dict[str, torch.Tensor]]:
    """The same global batches in one process, no weightstream, no DDP. ``micro_batches``: as
    ``world`` per-rank halves, each loss its half's mean, gradients accumulated and divided by
    ``world`` (what DDP computes); otherwise one forward over the whole batch."""
    setup()
    model = make_model()
    opt = optimizer(model)
    after = []
    for step in range(STEPS):
        x, y = global_batch(step)
        if micro_batches:
            for r in range(world):
                F.mse_loss(model(shard(x, r, world)), shard(y, r, world)).backward()
            for p in lora_params(model).values():
                p.grad.div_(world)
        else:
            F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        after.append({n: p.detach().clone() for n, p in lora_params(model).items()})
    return after


def main(rank: int, world: int, socket: str, store: str, out: str):
    import weightstream
    import weightstream.torch as wst
    from torch.nn.parallel import DistributedDataParallel as DDP
    from weightstream.torch.placeholder import is_placeholder

    setup()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    client = weightstream.connect(socket)
    model = make_model()
    ids = [None]
    if rank == 0:
        handle = wst.attach(model, "cpu", client=client, min_bytes=0, label="ddp")
        ids = [handle.model_id]
    dist.broadcast_object_list(ids, src=0)
    if rank != 0:
        handle = wst.attach(model, "cpu", client=client, min_bytes=0, model=ids[0])
    dist.barrier()  # every rank attached
    listed = None
    if rank == 0:
        models = client.list_models()
        listed = {
            "store_bytes": models.store_bytes,
            "models": [(m.model_id, m.total_bytes) for m in models.models],
            "sessions": sorted(s.model_id for s in client.list_sessions()),
        }
    dist.barrier()  # rank 0 listed before anyone trains or detaches
    # The streamed weights are placeholders without storage: DDP must not broadcast them.
    streamed = wst.ddp_ignore_streamed(model)
    assert streamed and all(is_placeholder(p) for n, p in model.named_parameters() if n in streamed)
    ddp = DDP(model)
    opt = optimizer(model)
    after = []
    for step in range(STEPS):
        x, y = global_batch(step)
        F.mse_loss(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        after.append({n: p.detach().clone() for n, p in lora_params(model).items()})
    dist.barrier()  # every rank done with the daemon's copy
    stats = handle.stats()
    # Rank 0 holds the upload's reference; each session holds one for its uid until it closes.
    handle.detach(release=rank == 0)
    saved = {"after": after, "listed": listed, "model_id": ids[0], "streamed": streamed}
    torch.save({**saved, "stats": stats}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6])
