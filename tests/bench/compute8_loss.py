"""LoRA training on a frozen base computed in 8 bits (``weightstream.torch.compute8``) against the
same training with the base in bf16 and in float32, on a model that fits the CPU: the loss
curves side by side and how far each departs from the float32 one.

The task: a fixed random teacher (a 6-layer MLP of width 512 with GELU and residuals) maps
tokens that have outlier channels to targets; the student is the teacher with every linear
weight perturbed (20 % noise), frozen, plus rank-16 LoRA adapters on every linear, trained by
AdamW to recover the teacher's outputs (mean squared error). The loss starts at the perturbed
base's error and falls as the adapters learn the perturbation back; the same seeds and batches
in every mode. The base computes in float32 (the reference), bf16 (weights and inputs rounded
to bf16), fp8, int8 and int8 with a rotation of block 64 (W8A8, input gradient in the same
mode), each through ``to_w8a8_resident`` on the CPU's reference arithmetic.

    python3 tests/bench/compute8_loss.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from tests.bench.provenance import commit

MODES = ["fp32", "bf16", "fp8", "int8", "int8+rot64"]


def build(width: int, depth: int, rank: int, seed: int):
    import torch
    from torch import nn

    class Lora(nn.Module):
        def __init__(self, base: nn.Linear):
            super().__init__()
            self.base = base
            self.a = nn.Parameter(torch.randn(rank, base.in_features) / base.in_features**0.5)
            self.b = nn.Parameter(torch.zeros(base.out_features, rank))

        def forward(self, x):
            return self.base(x) + (x @ self.a.t()) @ self.b.t()

    class Net(nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layers = nn.ModuleList(layer() for _ in range(depth))

        def forward(self, x):
            for i, f in enumerate(self.layers):
                h = f(x)
                x = x + (torch.nn.functional.gelu(h) if i < depth - 1 else h)
            return x

    torch.manual_seed(seed)
    teacher = Net(lambda: nn.Linear(width, width))
    for p in teacher.parameters():
        p.data.mul_(0.5)
    student = Net(lambda: nn.Linear(width, width))
    with torch.no_grad():
        for s, t in zip(student.layers, teacher.layers, strict=True):
            s.weight.copy_(t.weight + 0.2 * t.weight.std() * torch.randn_like(t.weight))
            s.bias.copy_(t.bias)
    student.requires_grad_(False)
    for i, layer in enumerate(student.layers):
        student.layers[i] = Lora(layer)
    return teacher.requires_grad_(False), student


def batch(step: int, n: int, width: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, width, generator=g)
    x[:, :4] *= torch.tensor([20.0, 40.0, 70.0, 100.0])
    return x


def floor(mode: str, args) -> float:
    """The loss of the teacher itself computed in ``mode`` against the teacher in float32: the
    error no adapter can remove (the 8-bit noise of the activations is not a weight)."""
    import copy

    import torch

    teacher, _ = build(args.width, args.depth, args.rank, args.seed)
    noisy = copy.deepcopy(teacher)
    in_mode(mode, list(noisy.layers))
    x = batch(10**6, args.tokens * 4, args.width)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(noisy(x), teacher(x)).item()


def in_mode(mode: str, bases: list):
    """Makes the linears ``bases`` compute in ``mode`` (``MODES``)."""
    import torch
    from weightstream.torch import compute8

    if mode == "bf16":
        for b in bases:
            b.to(torch.bfloat16)

            def fwd(x, b=b):
                return torch.nn.functional.linear(x.to(torch.bfloat16), b.weight, b.bias).float()

            b.forward = fwd
    elif mode != "fp32":
        m, _, rot = mode.partition("+rot")
        wrapper = torch.nn.ModuleList(bases)
        compute8.to_w8a8_resident(wrapper, m, rotation=int(rot or 0))


def train(mode: str, args) -> list[float]:
    import torch

    teacher, student = build(args.width, args.depth, args.rank, args.seed)
    in_mode(mode, [layer.base for layer in student.layers])
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    losses = []
    for step in range(args.steps):
        x = batch(step, args.tokens, args.width)
        with torch.no_grad():
            want = teacher(x)
        loss = torch.nn.functional.mse_loss(student(x), want)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-compute8-loss"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    curves = {}
    for mode in MODES:
        t = time.perf_counter()
        curves[mode] = train(mode, args)
        print(
            mode, f"{time.perf_counter() - t:.0f} s", curves[mode][0], curves[mode][-1], flush=True
        )
    ref = curves["fp32"]
    tail = max(1, args.steps // 10)
    summary = {}
    for mode, c in curves.items():
        last = sum(c[-tail:]) / tail
        summary[mode] = {
            "first": round(c[0], 6),
            "last_mean": round(last, 6),
            "last_vs_fp32": round(last / (sum(ref[-tail:]) / tail), 4),
            "floor": round(floor(mode, args), 6),
            "max_rel_gap_to_fp32": round(
                max(abs(a - b) / b for a, b in zip(c, ref, strict=True)), 4
            ),
        }
    result = {
        "command": "python3 " + " ".join(sys.argv),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "device": "cpu",
        "torch": torch.__version__,
        "settings": vars(args) | {"out": None},
        "summary": summary,
        "curves": {m: [round(v, 6) for v in c] for m, c in curves.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compute8_loss.json").write_text(json.dumps(result, indent=2))
    every = max(1, args.steps // 10)
    lines = [
        "# LoRA loss curves on a frozen base computed in 8 bits (CPU reference arithmetic)",
        "",
        f"`{result['command']}` at {result['commit']}, {result['date']}, "
        f"torch {torch.__version__}.",
        f"Teacher-recovery task: {args.depth} linears of {args.width}, rank {args.rank}, "
        f"{args.tokens} tokens a step, AdamW lr {args.lr}, {args.steps} steps; inputs with 4 "
        "outlier channels (20-100 ×).",
        "",
        "The floor: the teacher computed in the mode against the teacher in float32, the part",
        "of the loss no adapter can remove (the activations' 8-bit noise is not a weight).",
        "",
        "| mode | first loss | mean of last 10 % | ÷ fp32 | floor | max gap to fp32 along the "
        "curve |",
        "|---|---|---|---|---|---|",
    ]
    for mode, s in summary.items():
        lines.append(
            f"| {mode} | {s['first']} | {s['last_mean']} | {s['last_vs_fp32']} | {s['floor']} | "
            f"{100 * s['max_rel_gap_to_fp32']:.1f} % |"
        )
    lines += ["", "Loss by step:", "", "| step | " + " | ".join(MODES) + " |"]
    lines += ["|---|" + "---|" * len(MODES)]
    for i in list(range(0, args.steps, every)) + [args.steps - 1]:
        lines.append(f"| {i} | " + " | ".join(f"{curves[m][i]:.5f}" for m in MODES) + " |")
    (out / "compute8_loss.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
