"""A drop-in for ai-toolkit's layer-offloading ``MemoryManager``.

In ai-toolkit's model loaders, replace

    from toolkit.memory_management import MemoryManager

with

    from weightstream.integrations.ai_toolkit import MemoryManager

and keep the calls:
``MemoryManager.attach(module, device, offload_percent=..., ignore_modules=[...])``.
The LoRA network is never touched: its rank, alpha scale and dtype stay as the trainer set them
(ai-toolkit users who train in bf16 set ``network.dtype: bf16`` as before).
"""

from __future__ import annotations

import torch
from torch import nn

from weightstream import torch as ws_torch


def _streamable(module: nn.Module, ignore: set[int]) -> list[tuple[str, nn.Module, int]]:
    out = []
    for name, m in module.named_modules():
        if id(m) in ignore or not isinstance(m, (nn.Linear, nn.Conv2d)):
            continue
        if m.weight is None or m.weight.requires_grad:
            continue
        size = m.weight.nbytes + (m.bias.nbytes if m.bias is not None else 0)
        out.append((name, m, size))
    return out


class MemoryManager:
    """Same entry points as ai-toolkit's: ``attach`` and ``sync_grad_transfers``."""

    def __init__(self, handle: ws_torch.Handle | None):
        self.handle = handle

    @classmethod
    def attach(
        cls,
        module: nn.Module,
        device: torch.device | str,
        offload_percent: float = 1.0,
        ignore_modules: list | None = None,
    ) -> MemoryManager:
        """Streams ``offload_percent`` of the module's Linear/Conv2d weight bytes through the
        daemon: the largest layers first (deterministic: by size, then by name), the rest stay
        resident on ``device``."""
        if not 0.0 <= offload_percent <= 1.0:
            raise ValueError(f"offload_percent={offload_percent} is not between 0 and 1")
        ignored = {id(m) for m in ignore_modules or []}
        layers = _streamable(module, ignored)
        total = sum(size for _, _, size in layers)
        layers.sort(key=lambda x: (-x[2], x[0]))
        streamed, budget = [], offload_percent * total
        for name, _, size in layers:
            if budget <= 0:
                break
            streamed.append(name)
            budget -= size
        if not streamed:
            module.to(device)
            return cls(None)
        keep = {name for name, _, _ in layers} - set(streamed)
        ignore = {n for n, m in module.named_modules() if id(m) in ignored} | keep
        options = ws_torch.StreamOptions(min_bytes=0, ignore=ignore)
        manager = cls(ws_torch.attach(module, device, options))
        module._memory_manager = manager
        return manager

    @staticmethod
    def sync_grad_transfers(*_args, **_kwargs):
        """Nothing to do: weights are frozen and gradients never leave the device."""

    @classmethod
    def detach(cls, module: nn.Module, release: bool = False):
        manager = getattr(module, "_memory_manager", None)
        if manager is not None and manager.handle is not None:
            manager.handle.detach(release=release)
            del module._memory_manager
