"""weightstream for ai-toolkit's layer offloading.

- ``weightstream-aitk run.py config.yaml`` (or ``python -m weightstream.integrations.ai_toolkit
  run.py config.yaml``) runs ai-toolkit unchanged with ``toolkit.memory_management`` served by
  weightstream (``launcher``): jobs keep ``model.layer_offloading: true``. It checks the job
  files, ai-toolkit's environment and the daemon first (``preflight``).
- ``weightstream-aitk install-ui AITK_ROOT`` (``ui``): the jobs ai-toolkit's web UI starts
  with layer offloading run the same way, in their own process.
- ``MemoryManager`` and ``sync_grad_transfers`` (``manager``) are ai-toolkit's surface; a
  trainer that imports them itself can swap ``from toolkit.memory_management import
  MemoryManager`` for ``from weightstream.integrations.ai_toolkit import MemoryManager``.
- ``Settings`` (``settings``): socket, budget, staging, from a ``weightstream:`` YAML section
  or ``WEIGHTSTREAM_*`` variables.
- ``trainable: host`` (``trainable``): the LoRA's weights and optimizer state in host memory,
  the optimizer ai-toolkit asks for run there as ``HostAdamW``.

The manager is loaded when first used (by ai-toolkit's first import of
``toolkit.memory_management``).
"""

from __future__ import annotations

from weightstream.integrations.ai_toolkit.settings import Settings, configure

__all__ = ["MemoryManager", "Settings", "configure", "main", "sync_grad_transfers"]


def __getattr__(name):
    if name in ("MemoryManager", "sync_grad_transfers"):
        from weightstream.integrations.ai_toolkit import manager

        return getattr(manager, name)
    if name == "main":
        from weightstream.integrations.ai_toolkit.launcher import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
