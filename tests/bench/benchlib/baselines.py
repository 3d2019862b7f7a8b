"""The in-process peers of weightstream in tests/bench/flux_train.py: ramtorch, ai-toolkit's
``MemoryManager`` (at AITK_COMMIT, with and without torchao float8 weights), accelerate's CPU
offload and diffusers' group offloading, each timed as the resident mode is."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.bench.benchlib.flux import (
    ROOT,
    GiB,
    add_lora,
    batch,
    build,
    build_on_host,
    deterministic,
    lora_state,
    steps,
)
from tests.bench.benchlib.modes import nvidia_smi_used_gib, rss_gib, timing


def mode_ramtorch(args, record):
    """RamTorch's Linear (its weights in pinned host memory, copied in on every use) in place
    of every frozen Linear, under peft's LoRA layers."""
    import torch
    from ramtorch import Linear as RamLinear

    model = add_lora(build_on_host())
    replaced = 0
    for m in list(model.modules()):
        for cname, child in list(m.named_children()):
            if type(child) is torch.nn.Linear and not child.weight.requires_grad:
                new = RamLinear(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    device="cuda",
                    dtype=torch.bfloat16,
                    skip_init=True,
                )
                new.weight.data = child.weight.data.pin_memory()
                if child.bias is not None:
                    new.bias.data = child.bias.data.pin_memory()
                new.requires_grad_(False)
                setattr(m, cname, new)
                replaced += 1
    record["replaced_linears"] = replaced
    model.to("cuda")
    init = lora_state(model)
    record["trainer_rss_gib"] = rss_gib()
    timing(model, args, record)
    deterministic(True)
    _, losses = steps(model, args.det_steps, init)
    record["det_losses"] = losses


#: ai-toolkit's commit (tests/bench/ai_toolkit_prepare.sh lays its code out in .aitk/) and the git
#: blob ids of its toolkit/memory_management files there: the aitk modes record whether the code
#: they imported is that commit's.
AITK_COMMIT = "27a03a91f23eb1b757d5ec2e80ee3e129cfcc350"
AITK_BLOBS = {
    "__init__.py": "83fa980f482fd7e4eca07db119d417b738142ffa",
    "manager.py": "910c426b58d8d0f95df9c824bbc9a74c3a3d5a61",
    "manager_modules.py": "d559f18f787a8345d912c771a44e70387d918f24",
}


def git_blob_id(path: Path) -> str:
    import hashlib

    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def aitk_memory_manager(aitk: str | None, record: dict):
    """ai-toolkit's own ``MemoryManager``, imported from its code at ``aitk`` (default
    ROOT/.aitk), which goes last on ``sys.path`` in this process only (its top-level names,
    e.g. ``config``, ``version``, shadow nothing installed; an installed ``toolkit`` would be
    refused below). Nothing is stubbed:
    ``toolkit.memory_management`` imports only torch and the standard library, and
    ``toolkit/__init__.py`` huggingface_hub (a dependency of diffusers)."""
    root = Path(aitk) if aitk else ROOT / ".aitk"
    pkg = root / "toolkit" / "memory_management"
    if not pkg.is_dir():
        raise FileNotFoundError(
            f"{pkg}: lay ai-toolkit out with tests/bench/ai_toolkit_prepare.sh or pass --aitk"
        )
    sys.path.append(str(root))
    import toolkit.memory_management as mm
    from toolkit.memory_management import manager_modules

    if Path(mm.__file__).resolve().parent != pkg.resolve():
        raise RuntimeError(f"toolkit.memory_management came from {mm.__file__}, not {pkg}")
    record["aitk"] = {
        "path": str(root),
        "commit": AITK_COMMIT,
        "matches_commit": all(git_blob_id(pkg / n) == b for n, b in AITK_BLOBS.items()),
        "stubs": [],
        "pipeline_depth": manager_modules.PIPELINE_DEPTH,  # AI_TOOLKIT_OFFLOAD_DEPTH
    }
    return mm.MemoryManager


def aitk_offload(manager, model, device, record: dict):
    """``manager.attach(model, device, offload_percent=1.0)``, then the LoRA: ai-toolkit's order
    (its loaders attach the transformer, its trainer builds the network afterwards; its own
    toolkit/memory_management/test_memory_manager.py: "Attach BEFORE the LoRA so the LoRA wraps
    the bouncing forward"). attach moves the weight and bias of every module whose class is
    named ``Linear`` (or ``Conv2d``) to pinned host memory and replaces its forward by the
    bouncing one; peft's LoRA wraps that forward. The other order cannot work: peft's wrapper
    and its ``lora_A``/``lora_B`` are named ``Linear`` too, so attach would bounce the LoRA and
    bypass it. peft puts each adapter on its base layer's device, the host once attached: the
    LoRA moves to ``device`` as ai-toolkit moves its network."""
    started = time.monotonic()
    manager.attach(model, device, offload_percent=1.0)
    record["attach_s"] = round(time.monotonic() - started, 1)
    managed = [m for m in model.modules() if hasattr(m, "_layer_memory_manager")]
    record["aitk_managed_layers"] = len(managed)
    record["aitk_managed_gib"] = round(
        sum(p.numel() * p.element_size() for m in managed for p in m.parameters(recurse=False))
        / GiB,
        2,
    )
    model = add_lora(model)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(device)
    # What attach bounces is on the host; the rest (the LoRA too) on the device.
    stray = [
        n
        for n, p in model.named_parameters()
        if p.device.type != ("cpu" if getattr(p, "_is_memory_managed", False) else device.type)
    ]
    if stray:
        raise RuntimeError(f"parameters on the wrong side after attach: {stray[:8]}")
    return model


def host_pinned(record: dict):
    """What torch's pinned host allocator holds: it rounds each block up to a power of two
    (ATen/core/CachingHostAllocator.h), so FLUX.2's 60 GiB of Linear weights take 94 GiB."""
    import torch

    stats = torch.cuda.host_memory_stats()
    record["host_pinned_gib"] = round(stats.get("allocated_bytes.current", 0) / GiB, 2)
    record["host_pinned_peak_gib"] = round(stats.get("allocated_bytes.peak", 0) / GiB, 2)


def mode_aitk_memory_manager(args, record, quantize=None):
    """ai-toolkit's own MemoryManager (toolkit/memory_management at AITK_COMMIT, from --aitk or
    ROOT/.aitk) at 100 % offload: the model built on the GPU as in ``mode_resident``, attached
    and given its LoRA as ai-toolkit does it (``aitk_offload``), in bf16 (``quantize``: the
    Linear weights quantized on the GPU before attach, as ai-toolkit quantizes before it
    offloads)."""
    import torch

    manager = aitk_memory_manager(args.aitk, record)
    model = build()
    if quantize is not None:
        quantize(model, record)
    model = aitk_offload(manager, model, torch.device("cuda:0"), record)
    torch.cuda.empty_cache()
    init = lora_state(model)
    record["trainer_rss_gib"] = rss_gib()
    host_pinned(record)
    # ai-toolkit keeps a pageable copy, silently, where pinning fails (host memory short).
    record["aitk_unpinned_tensors"] = sum(
        not p.is_pinned() for p in model.parameters() if getattr(p, "_is_memory_managed", False)
    )
    timing(model, args, record)
    record["nvidia_smi_used_gib"] = nvidia_smi_used_gib()
    deterministic(True)
    _, losses = steps(model, args.det_steps, init)
    record["det_losses"] = losses


def mode_aitk_float8(args, record):
    """ai-toolkit's MemoryManager over torchao float8 weight-only weights (its ``quantize:
    float8``: torchao's Float8WeightOnlyConfig on the Linear layers, toolkit/util/quantize.py),
    only where torchao can be imported; otherwise the record says so and nothing runs. Its
    losses are compared with bf16 resident (``losses_equal_resident`` false is expected)."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        record["skipped"] = "torchao not installed"
        return

    def float8(model, record):
        from torchao.quantization import Float8WeightOnlyConfig, quantize_

        quantize_(model, Float8WeightOnlyConfig())
        record["weights"] = "torchao Float8WeightOnlyConfig"

    mode_aitk_memory_manager(args, record, quantize=float8)


def mode_accelerate(args, record):
    import torch
    from accelerate import cpu_offload

    model = build_on_host()
    model = add_lora(model)
    cpu_offload(model, execution_device=torch.device("cuda"))
    args.warmup, args.measured = 1, 3
    timing(model, args, record)
    record["note"] = "1 warm-up and 3 measured steps (slow)"
    record["lora_params_with_grad_after_backward"] = None  # set below
    params = [p for p in model.parameters() if p.requires_grad]
    out = model(**batch(), return_dict=False)[0]
    out.float().pow(2).mean().backward()
    record["lora_params_with_grad_after_backward"] = sum(p.grad is not None for p in params)
    record["lora_params"] = len(params)


def mode_group_offload(args, record):
    import torch
    from diffusers.hooks import apply_group_offloading

    model = build_on_host()
    model = add_lora(model)
    apply_group_offloading(
        model,
        onload_device=torch.device("cuda"),
        offload_type="leaf_level",
        use_stream=True,
        record_stream=True,
    )
    timing(model, args, record)
