"""A trainer process for the tests of processes that attach: attaches a seeded model (its upload
pinned when the third argument is "pin"), prints the model id, runs a step, and waits for its
stdin to close before detaching."""

from __future__ import annotations

import sys

import torch
import weightstream.torch as wst
from torch import nn


def main():
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)).requires_grad_(False)
    handle = wst.attach(model, "cpu", min_bytes=0, pin=sys.argv[3:] == ["pin"])
    print(handle.model_id, flush=True)
    model(torch.randn(2, 256))
    sys.stdin.read()
    handle.detach()


if __name__ == "__main__":
    main()
