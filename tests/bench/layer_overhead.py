"""Benchmark (GPU machine): what one streamed layer call costs the trainer's CPU. A stack of
Linear(3072, 3072) layers in bf16 on 16 tokens (the GPU's share of each call is a few
microseconds, so the forward is bound by the CPU's issuing) is run forward with an input that
requires grad, as under LoRA training: microseconds per layer for the layers in place, streamed
with every group resident (no copies: what is left is the client's own work), and streamed in 8
bits (dequantized per call: the fused kernel, and torch's three kernels; and by group, the
default: a block's weights in one launch); a whole training step per layer, each block
checkpointed as diffusers' models are, in place and streamed by group; then a cProfile of the
per-call 8-bit case and of the by-group one, their functions by own time.

    python3 -m tests.bench.layer_overhead --bin target/release/weightstream --out $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

from tests.bench.dequant_speed import torch_path
from tests.bench.provenance import command, commit

BLOCKS, PER_BLOCK, TOKENS = 16, 8, 16
STEP_IN_PLACE = "in place, bf16: a checkpointed step (forward, recompute, backward)"
STEP_BY_GROUP = "streamed, resident groups, 8-bit, by group: a checkpointed step"
#: The layers' width (``--width``).
WIDTH = 3072


def make_model():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(PER_BLOCK))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
            return x

    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = Stack().to(torch.bfloat16).requires_grad_(False)
    model.checkpointed = False
    return model


def sync(device: str):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def us_per_layer(model, x, reps: int) -> float:
    for _ in range(3):
        model(x)
    sync(x.device.type)
    t = time.perf_counter()
    for _ in range(reps):
        model(x)
    sync(x.device.type)
    return (time.perf_counter() - t) / reps / (BLOCKS * PER_BLOCK) * 1e6


def us_per_layer_step(model, x, reps: int) -> float:
    """``us_per_layer`` of a training step: each block checkpointed (torch's non-reentrant
    checkpoint, as diffusers' models do), forward and backward, so each layer runs its
    forward, its recompute and its backward."""
    model.checkpointed = True
    try:

        def step():
            model(x).float().sum().backward()

        for _ in range(3):
            step()
        sync(x.device.type)
        t = time.perf_counter()
        for _ in range(reps):
            step()
        sync(x.device.type)
    finally:
        model.checkpointed = False
    return (time.perf_counter() - t) / reps / (BLOCKS * PER_BLOCK) * 1e6


def floor(model, x, reps: int, rows: dict):
    """What the 8-bit layer's own operations cost without the client around them: the fused
    dequantization and ``F.linear`` on the layers' weights quantized, called in a plain loop,
    then the same inside a minimal autograd Function."""
    import torch
    import torch.nn.functional as F
    from weightstream import quantize

    layers = [layer for block in model.blocks for layer in block.layers]
    weights = [(*quantize.quantize_fp8_block64(m.weight), m.bias) for m in layers]

    class Stack:
        def __init__(self, step):
            self.step = step

        def __call__(self, y):
            for q, scale, bias in weights:
                y = self.step(y, q, scale, bias)
            return y

    def plain(y, q, scale, bias):
        return F.linear(y, quantize.dequantize(q, scale, torch.bfloat16), bias)

    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, q, scale, bias):
            ctx.save_for_backward(y)
            return plain(y, q, scale, bias)

        @staticmethod
        def backward(ctx, grad):
            return None, None, None, None

    rows["dequantize + F.linear, a plain loop"] = us_per_layer(Stack(plain), x, reps)
    rows["dequantize + F.linear in a bare autograd Function"] = us_per_layer(
        Stack(Op.apply), x, reps
    )


def measure(args, client) -> dict:
    """Microseconds per layer call of each kind of layer (see the module's doc)."""
    import torch
    import weightstream.torch as wst

    x = torch.randn(TOKENS, WIDTH, device=args.device, dtype=torch.bfloat16, requires_grad=True)
    rows = {}
    model = make_model().to(args.device)
    rows["in place, bf16"] = us_per_layer(model, x, args.reps)
    rows[STEP_IN_PLACE] = us_per_layer_step(model, x, args.reps)
    floor(model, x, args.reps, rows)
    del model
    everything = 4 << 30

    def attached(quantize=None, dequantize="auto"):
        model = make_model()
        handle = wst.attach(
            model,
            args.device,
            client=client,
            vram_budget=everything,
            quantize=quantize,
            dequantize=dequantize,
            min_bytes=0,
        )
        return model, handle

    model, handle = attached()
    rows["streamed, resident groups, bf16"] = us_per_layer(model, x, args.reps)
    handle.detach(release=True)
    model, handle = attached("fp8", "layer")
    rows["streamed, resident groups, 8-bit, fused dequantization"] = us_per_layer(
        model, x, args.reps
    )
    profiled(model, x, args, "layer_overhead_profile.txt")
    with torch_path():
        rows["streamed, resident groups, 8-bit, torch dequantization"] = us_per_layer(
            model, x, args.reps
        )
    handle.detach(release=True)
    # The default: a block's weights dequantized in one launch at its first call of a pass.
    model, handle = attached("fp8", "auto")
    assert handle.stats()["dequant_by_group"], "auto takes these blocks by group"
    rows["streamed, resident groups, 8-bit, by group (the default)"] = us_per_layer(
        model, x, args.reps
    )
    profiled(model, x, args, "layer_overhead_profile_group.txt")
    rows[STEP_BY_GROUP] = us_per_layer_step(model, x, args.reps)
    handle.detach(release=True)
    return rows


def profiled(model, x, args, name: str):
    """``us_per_layer`` again under cProfile; its functions by own time, into ``name``."""
    profile = cProfile.Profile()
    profile.enable()
    us_per_layer(model, x, args.reps)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    (Path(args.out) / name).write_text(text.getvalue())


def main():
    global WIDTH
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", default="target/release/weightstream")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-layer"))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument(
        "--device", default="cuda", help="cpu: a dry run on the host backend (no GPU)"
    )
    parser.add_argument(
        "--width",
        type=int,
        default=WIDTH,
        help="the layers' width (a small one on the CPU leaves the client's Python to time)",
    )
    args = parser.parse_args()
    WIDTH = args.width
    import torch

    from tests.daemon import Daemon

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    daemon = Daemon(
        tempfile.mkdtemp(prefix="ws-layer-"),
        binary=args.bin,
        backend="host" if args.device == "cpu" else "cuda",
        log=out / "layer-daemon.log",
        log_level=None,
        ready_s=60,
    )
    try:
        rows = measure(args, daemon.client)
    finally:
        daemon.stop(timeout=60)
    result = {
        "command": command(),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if args.device != "cpu" else "cpu",
        "layers": BLOCKS * PER_BLOCK,
        "us_per_layer": {k: round(v, 1) for k, v in rows.items()},
    }
    (out / "layer_overhead.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
