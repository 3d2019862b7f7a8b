"""Benchmark: LoRA training of a full-size FLUX.1 transformer (random weights, bf16) on the
H200, resident against weightstream at several budgets (and the in-process peers), with a
deterministic pass that checks weightstream's losses equal the resident ones bit for bit.

One command on the GPU machine (diffusers and ramtorch come as wheels in .whl/):
    python3 tests/bench/flux_train.py --bin target/release/weightstream --out $OUT
Each mode runs in its own process (clean GPU memory, its own memory fraction); results are
appended to $OUT/flux_train.json as they come, and summarised in flux_train.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]

LORA_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
    "proj_mlp",
    "proj_out",
]


def build(device="cuda"):
    """FLUX.1-dev's transformer with random weights, initialised on the GPU, seeded."""
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    with torch.device(device):
        model = FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=19,
            num_single_layers=38,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            guidance_embeds=True,
        ).to(torch.bfloat16)
    model.requires_grad_(False)
    return model


def build_on_host():
    """The same model, initialised on the GPU (fast) and moved to host memory."""
    import torch

    model = build()
    model.to("cpu")
    torch.cuda.empty_cache()
    return model


def add_lora(model):
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(1)  # peft's init uses the global RNG
    config = LoraConfig(r=32, lora_alpha=32, target_modules=LORA_TARGETS)
    model = inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
    model.enable_gradient_checkpointing()
    return model


def batch(device="cuda"):
    import torch

    g = torch.Generator(device=device).manual_seed(2)
    bf = torch.bfloat16
    return {
        "hidden_states": torch.randn(1, 4096, 64, generator=g, device=device, dtype=bf),
        "encoder_hidden_states": torch.randn(1, 512, 4096, generator=g, device=device, dtype=bf),
        "pooled_projections": torch.randn(1, 768, generator=g, device=device, dtype=bf),
        "timestep": torch.tensor([0.5], device=device, dtype=bf),
        "img_ids": torch.zeros(4096, 3, device=device, dtype=bf),
        "txt_ids": torch.zeros(512, 3, device=device, dtype=bf),
        "guidance": torch.tensor([3.5], device=device, dtype=bf),
    }


def steps(model, n, lora_state=None):
    """n AdamW steps on the LoRA parameters; returns per-step seconds and losses."""
    import torch

    if lora_state is not None:
        model.load_state_dict(lora_state, strict=False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    inputs = batch()
    times, losses = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.monotonic()
        out = model(**inputs, return_dict=False)[0]
        loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.monotonic() - t)
        losses.append(loss.item())
    return times, losses


def lora_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def deterministic(on: bool):
    import torch

    torch.use_deterministic_algorithms(on)


def timing(model, args, record):
    import torch

    torch.cuda.reset_peak_memory_stats()
    t, _ = steps(model, args.warmup + args.measured)
    measured = t[args.warmup :]
    record["s_per_step"] = round(statistics.median(measured), 4)
    record["steps_s"] = [round(x, 4) for x in measured]
    record["trainer_peak_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 2)


def mode_resident(args, record):
    model = add_lora(build())
    init = lora_state(model)
    timing(model, args, record)
    deterministic(True)
    _, losses = steps(model, args.det_steps, init)
    record["det_losses"] = losses


def mode_weightstream(args, record):
    import torch
    import weightstream
    import weightstream.torch as wst

    model = build_on_host()
    model = add_lora(model)
    init = lora_state(model)
    client = weightstream.connect(args.socket)
    total = torch.cuda.get_device_properties(0).total_memory
    started = time.monotonic()
    first = args.budgets[0]
    handle = wst.attach(model, "cuda", client=client, vram_budget=daemon_part(first))
    record["attach_s"] = round(time.monotonic() - started, 1)
    record["streamed_modules"] = len(handle.streamed)
    record["budgets"] = {}
    for budget in args.budgets:
        r = record["budgets"][str(budget)] = {"daemon_budget_gib": daemon_part(budget) / GiB}
        try:
            if budget != first:
                handle.set_budget(daemon_part(budget))
            trainer = budget * GiB - daemon_part(budget)
            torch.cuda.set_per_process_memory_fraction(trainer / total)
            before = handle.stats()
            timing(model, args, r)
            after = handle.stats()
            n = args.warmup + args.measured
            r["bytes_per_step_gib"] = round(
                (after["bytes_copied"] - before["bytes_copied"]) / n / GiB, 2
            )
            r["hit_rate"] = round(
                (after["hits"] - before["hits"]) / max(1, after["acquires"] - before["acquires"]), 4
            )
            r["stall_s_per_step"] = round((after["stall_ns"] - before["stall_ns"]) / n / 1e9, 4)
            sess = [s for s in client.list_sessions() if s.session_id == handle.session.id][0]
            r["daemon_staging_gib"] = round(sess.staging_bytes / GiB, 2)
            r["daemon_resident_gib"] = round(sess.resident_bytes / GiB, 2)
        except Exception as e:  # noqa: BLE001 - a budget that fails is reported, not fatal
            r["error"] = repr(e)[:400]
            traceback.print_exc()
    torch.cuda.set_per_process_memory_fraction(1.0)
    handle.set_budget(daemon_part(args.det_budget))
    deterministic(True)
    _, losses = steps(model, args.det_steps, init)
    record["det_losses"] = losses
    record["det_budget_gib"] = args.det_budget


def daemon_part(budget_gib: int) -> int:
    """The daemon's share of a budget: all but what the trainer needs beside the weights
    (activations with checkpointing, LoRA and its optimizer state)."""
    return max(2 * GiB, budget_gib * GiB - 6 * GiB)


def mode_ramtorch(args, record):
    import torch
    from ramtorch import Linear as RamLinear

    model = build_on_host()
    for m in list(model.modules()):
        for cname, child in list(m.named_children()):
            if isinstance(child, torch.nn.Linear):
                new = RamLinear(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    device="cuda",
                    dtype=torch.bfloat16,
                )
                with torch.no_grad():
                    new.weight.copy_(child.weight)
                    if child.bias is not None:
                        new.bias.copy_(child.bias)
                new.requires_grad_(False)
                setattr(m, cname, new)
    model.to("cuda")
    model = add_lora(model)
    init = lora_state(model)
    timing(model, args, record)
    deterministic(True)
    _, losses = steps(model, args.det_steps, init)
    record["det_losses"] = losses


def mode_accelerate(args, record):
    import torch
    from accelerate import cpu_offload

    model = build_on_host()
    model = add_lora(model)
    cpu_offload(model, execution_device=torch.device("cuda"))
    args.warmup, args.measured = 1, 3
    timing(model, args, record)
    record["note"] = "1 warm-up and 3 measured steps (slow)"


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


MODES = {
    "resident": mode_resident,
    "weightstream": mode_weightstream,
    "ramtorch": mode_ramtorch,
    "accelerate-offload": mode_accelerate,
    "diffusers-group-offload": mode_group_offload,
}


def child(args):
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)
    record = {"mode": args.mode}
    try:
        MODES[args.mode](args, record)
    except Exception as e:  # noqa: BLE001 - the error is the result for this mode
        record["error"] = repr(e)[:600]
        traceback.print_exc()
    print("RESULT " + json.dumps(record), flush=True)


def pinned_bandwidth():
    import torch

    src = torch.empty(512 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    times = []
    for _ in range(8):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return (512 << 20) / statistics.median(times[2:]) / 1e9


def parent(args):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ws-flux-"))
    socket = str(tmp / "ws.sock")
    daemon = subprocess.Popen(
        [args.bin, "serve", "--backend", "cuda", "--socket", socket],
        stderr=open(out / "flux-daemon.log", "ab"),
    )
    results = {
        "command": "python3 " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "pinned_h2d_gbps": round(pinned_bandwidth(), 2),
        "modes": [],
    }
    import torch

    results["device"] = torch.cuda.get_device_name(0)
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    for mode in args.modes:
        started = time.monotonic()
        cmd = [sys.executable, __file__, "--child", mode, "--socket", socket]
        cmd += ["--budgets", *map(str, args.budgets), "--det-budget", str(args.det_budget)]
        cmd += ["--warmup", str(args.warmup), "--measured", str(args.measured)]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            record = (
                json.loads(lines[-1][7:]) if lines else {"mode": mode, "error": p.stderr[-600:]}
            )
            (out / f"flux-{mode}.log").write_text(p.stdout + p.stderr)
        except subprocess.TimeoutExpired:
            record = {"mode": mode, "error": f"timed out after {args.timeout} s"}
        record["wall_s"] = round(time.monotonic() - started, 1)
        results["modes"].append(record)
        (out / "flux_train.json").write_text(json.dumps(results, indent=2))
        print(json.dumps(record)[:1500], flush=True)
    daemon.terminate()
    daemon.wait(timeout=60)
    ok = check_equality(results)
    (out / "flux_train.json").write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


def check_equality(results):
    modes = {m["mode"]: m for m in results["modes"]}
    ref = modes.get("resident", {}).get("det_losses")
    ok = True
    for m in results["modes"]:
        if "det_losses" in m and ref is not None:
            m["losses_equal_resident"] = m["det_losses"] == ref
            if m["mode"] == "weightstream" and not m["losses_equal_resident"]:
                ok = False
    results["weightstream_losses_equal"] = modes.get("weightstream", {}).get(
        "losses_equal_resident"
    )
    print("weightstream losses equal resident:", results["weightstream_losses_equal"])
    return ok


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", default="target/release/weightstream")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-flux-out"))
    parser.add_argument("--child")
    parser.add_argument("--socket")
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--budgets", nargs="+", type=int, default=[24, 16, 12, 8])
    parser.add_argument("--det-budget", type=int, default=16)
    parser.add_argument("--det-steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--measured", type=int, default=10)
    parser.add_argument("--timeout", type=int, default=400)
    args = parser.parse_args()
    if args.child:
        args.mode = args.child
        return child(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
