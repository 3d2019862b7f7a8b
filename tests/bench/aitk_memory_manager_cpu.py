"""A check by hand, on the CPU, of flux_train.py's `aitk` mode up to where it needs CUDA: it
imports ai-toolkit's own MemoryManager from its laid-out code (`aitk_memory_manager`, nothing
stubbed), attaches it at 100 % to a tiny diffusers FLUX.2 transformer and adds the LoRA in
ai-toolkit's order (`aitk_offload`, the mode's own code), then trains a few AdamW steps next to
the same model without offloading and compares the losses. On the CPU ai-toolkit's bouncing
Linear takes its CPU branch (`device.type != "cuda"`: F.linear forward, `grad_out @ weight`
backward); its CUDA branch (the ring of staging buffers, the transfer streams, pinning) and the
mode's timing and memory records run only on the GPU machine.

    python3 -m tests.bench.aitk_memory_manager_cpu [--aitk .aitk]

Also shown: attaching after peft's LoRA would take the LoRA over (its wrapper and lora_A/lora_B
are classes named `Linear`), and the `aitk-float8` mode records "torchao not installed" where
torchao is absent. Exits 1 if a check fails; losses that differ from the reference in the last
digits are reported, not failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from tests.bench.benchlib import baselines, flux

TINY = {
    "in_channels": 8,
    "num_layers": 1,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "timestep_guidance_channels": 32,
    "axes_dims_rope": (4, 4, 4, 4),
}


def tiny_model():
    import torch
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    model = Flux2Transformer2DModel(**TINY).to(torch.bfloat16)
    model.requires_grad_(False)
    return model


def tiny_batch():
    import torch

    g = torch.Generator().manual_seed(2)
    bf = torch.bfloat16
    return {
        "hidden_states": torch.randn(1, 16, 8, generator=g).to(bf),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g).to(bf),
        "timestep": torch.tensor([0.5], dtype=bf),
        "img_ids": torch.randint(0, 4, (16, 4), generator=g).to(bf),
        "txt_ids": torch.zeros(8, 4, dtype=bf),
        "guidance": torch.tensor([3.5], dtype=bf),
    }


def train(model, n=3):
    """flux.steps' loop on the CPU: AdamW on the LoRA, loss = mean square of the output."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    inputs = tiny_batch()
    losses, with_grad = [], 0
    for _ in range(n):
        out = model(**inputs, return_dict=False)[0]
        loss = out.float().pow(2).mean()
        loss.backward()
        with_grad = sum(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in params)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, with_grad, len(params)


def counting(manager_modules):
    """Counts the calls of ai-toolkit's bouncing Linear (its layers' forward looks the class
    up in its module at each call)."""
    calls = {"forward": 0, "backward": 0}
    base = manager_modules._BouncingLinearFn

    class Counted(base):
        @staticmethod
        def forward(ctx, *args):
            calls["forward"] += 1
            return base.forward(ctx, *args)

        @staticmethod
        def backward(ctx, *grads):
            calls["backward"] += 1
            return base.backward(ctx, *grads)

    manager_modules._BouncingLinearFn = Counted
    return calls


def main() -> int:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--aitk", default=None, help="default: .aitk in the repo root")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    flux.MODEL, flux.RANK = "flux2", 4
    torch.use_deterministic_algorithms(True)
    record: dict = {}
    manager = baselines.aitk_memory_manager(args.aitk, record)
    from toolkit.memory_management import manager_modules

    calls = counting(manager_modules)
    checks = {}

    base_linears = sum(type(m) is torch.nn.Linear for m in tiny_model().modules())
    resident = flux.add_lora(tiny_model())
    ref_losses, ref_grads, n_lora = train(resident, args.steps)

    model = baselines.aitk_offload(manager, tiny_model(), torch.device("cpu"), record)
    record["modules_managed"] = sorted(
        {type(m).__name__ for m in model.modules() if hasattr(m, "_layer_memory_manager")}
    )
    lora_managed = [
        n for n, p in model.named_parameters() if "lora_" in n and hasattr(p, "_is_memory_managed")
    ]
    losses, grads, _ = train(model, args.steps)
    checks["managed_every_base_linear"] = record["aitk_managed_layers"] == base_linears
    checks["lora_not_managed"] = not lora_managed
    checks["bounced_forward_and_backward"] = calls["forward"] > 0 and calls["backward"] > 0
    checks["every_lora_param_got_grads"] = grads == n_lora == ref_grads
    checks["losses_close"] = all(
        abs(a - b) <= 1e-2 * abs(b) for a, b in zip(losses, ref_losses, strict=True)
    )
    record.update(
        base_linears=base_linears,
        bounced_calls=calls,
        losses=losses,
        resident_losses=ref_losses,
        losses_equal_resident=losses == ref_losses,
    )

    # The other order: attach after peft's LoRA takes the LoRA over too.
    late = flux.add_lora(tiny_model())
    manager.attach(late, torch.device("cpu"), offload_percent=1.0)
    taken = [n for n, m in late.named_modules() if hasattr(m, "_layer_memory_manager")]
    record["attach_after_lora_takes"] = sum(".lora_" in n for n in taken)
    checks["attach_after_lora_takes_the_lora"] = record["attach_after_lora_takes"] > 0

    if importlib.util.find_spec("torchao") is None:
        float8: dict = {"mode": "aitk-float8"}
        baselines.mode_aitk_float8(argparse.Namespace(aitk=args.aitk), float8)
        record["aitk_float8"] = float8
        checks["float8_skipped_without_torchao"] = float8 == {
            "mode": "aitk-float8",
            "skipped": "torchao not installed",
        }

    record["checks"] = checks
    print(json.dumps(record, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
