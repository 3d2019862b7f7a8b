"""Benchmark: LoRA training of a full-size FLUX.1 transformer (random weights, bf16) on the
H200, resident against weightstream at several budgets (and the in-process peers), with a
deterministic pass that checks weightstream's losses equal the resident ones bit for bit.

One command on the GPU machine (diffusers and ramtorch come as wheels in .whl/):
    python3 tests/bench/flux_train.py --bin target/release/weightstream --out $OUT
Each mode runs in its own process (clean GPU memory, its own memory fraction); results are
appended to $OUT/flux_train.json as they come (the children's logs end up in flux-logs.tgz).
`python3 tests/bench/flux_report.py` turns tests/bench/results/flux_train.json into the tables
of flux_train.md and the plot flux_train.png.

8 bits: `--quantize fp8` streams the weights in fp8_e4m3_block64 in the weightstream modes and
adds the mode `resident-fp8` (the 8-bit resident reference: each weight weightstream streams
replaced on the GPU by its w_hat) to the default modes; their deterministic losses are compared
with it, the others' with `resident`, so one run compares fp8 streaming, 8-bit resident and bf16
resident. Both 8-bit modes record the per-tensor SQNR of the quantized weights (`sqnr`: median
and worst, dB); the weightstream mode also the device time of its dequantizations over one step
(`dequant_ms_per_step`, CUDA events around each) and the largest dequantization's memory.
The weightstream mode then times one more step's client calls on the CPU, per pass
(`client_cpu_ms_per_pass`: the streamed layers' forwards, the blocks for replies, the sends,
the dequantization launches).
`--modes resident-fp8 resident-fp8-copying` times the 8-bit reference alone and again while a
thread copies pinned host memory to the device without pause (`--copy-duty D`: that share of
the time): what the link's traffic costs a step by itself, apart from weightstream's code.

Variants: `--interleave weightstream weightstream+layer --budgets 7 --min-blocks 0` runs both
modes at once with their timed steps alternating one by one, and reports each later mode's step
over the first mode's step just before it (`interleaved`: per pair, median, min, max), so that
the machine's drift between and within calls (steps of one mode spread ±20 % on the H200)
cancels. Each step then starts after the other process ran one: a step bound by the CPU pays
for that more than one bound by the GPU (FLUX.1 8-bit streamed against resident: 1.17–1.27 ×
interleaved, 1.06–1.09 × with `--modes`, each mode's steps back to back as a trainer runs
them), so ratios against the resident step are taken with `--modes`, or with `--turn K`:
turns of K steps, the steps after a turn's first compared (`steady_ratio_of_medians`).
Each step also records when the CPU had issued the forward (`forward_issued_s_per_step`): near
`forward_s_per_step`, the forward waits on the CPU, not the GPU.

ai-toolkit's own layer offloading: `--modes ... aitk` runs its `MemoryManager` (its
toolkit/memory_management at AITK_COMMIT, laid out in .aitk/ by tests/bench/ai_toolkit_prepare.sh,
or `--aitk DIR`) at 100 % offload in bf16; `aitk-float8` the same over torchao float8 weights
where torchao is installed. Neither is among the default modes. On the CPU,
tests/bench/aitk_memory_manager_cpu.py checks the mode's import and attach by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from card import LINK_ENV, phase
from provenance import commit

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


#: Which transformer (``--model``): FLUX.1-dev (12 B) or FLUX.2-dev (32 B).
MODEL = "flux1"
#: The LoRA rank (``--rank``).
RANK = 32
#: The LoRA parameters' optimizer: "adamw" (torch's) or "adamw8bit" (torchao's, for ranks
#: whose AdamW state would not fit the trainer's share; needs torchao: carry its wheel).
OPTIMIZER = "adamw"

#: FLUX.2's LoRA targets (peft regex): the attention and MLP linears of both block kinds.
FLUX2_TARGETS = (
    r".*\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out|"
    r"to_qkv_mlp_proj|linear_in|linear_out)$|.*single_transformer_blocks\.\d+\.attn\.to_out$"
)


def results_name() -> str:
    return "flux_train" if MODEL == "flux1" else f"{MODEL}_train"


#: FLUX.1-dev's transformer config apart from its depth (19 double, 38 single blocks).
FLUX1_CONFIG = {
    "patch_size": 1,
    "in_channels": 64,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
}


def seeded_random(model, device):
    """``model`` (built on the meta device) materialised on ``device`` with seeded random
    weights: N(0, 1/fan_in) matrices, unit vectors."""
    import torch

    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, p[0].numel() ** -0.5, generator=g)
            else:
                p.fill_(1.0)
    return model


#: The lock file that makes concurrent children (``--interleave``, two jobs) build their models
#: one at a time: FLUX.1's build peaks at ~45 GiB of GPU memory (built in fp32, then cast),
#: and two at once overflow an 80 GB card.
BUILD_LOCK_ENV = "WS_BENCH_BUILD_LOCK"


@contextlib.contextmanager
def one_build_at_a_time():
    """Holds ``$WS_BENCH_BUILD_LOCK`` (when set) exclusively for the block."""
    path = os.environ.get(BUILD_LOCK_ENV)
    if not path:
        yield
        return
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build(device="cuda", num_layers=19, num_single_layers=38):
    """The transformer with random weights, initialised on the GPU, seeded (FLUX.1: fewer
    blocks, same width, for the equality probe); one child at a time."""
    with one_build_at_a_time():
        return _build(device, num_layers, num_single_layers)


def _build(device="cuda", num_layers=19, num_single_layers=38):
    if MODEL == "flux2":
        return build_flux2(device)
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    with torch.device(device):
        model = FluxTransformer2DModel(
            num_layers=num_layers, num_single_layers=num_single_layers, **FLUX1_CONFIG
        ).to(torch.bfloat16)
    model.requires_grad_(False)
    return model


def build_flux2(device="cuda"):
    """FLUX.2-dev's transformer (diffusers' default config, 32 B parameters) in bf16: built on
    the meta device and materialised on ``device`` (building in fp32 first would leave ~120 GiB
    in the caching allocator), then seeded random weights: N(0, 1/fan_in) matrices, unit norms."""
    import torch
    from diffusers import Flux2Transformer2DModel

    with torch.device("meta"):
        model = Flux2Transformer2DModel().to(torch.bfloat16)
    model = seeded_random(model, device)
    model.requires_grad_(False)
    torch.cuda.empty_cache()
    return model


def build_for_attach():
    """The model as the trainer holds it before attach: FLUX.1 moved to host memory (the
    upload reads it there), FLUX.2 left on the GPU (attach uploads it from the device by DMA
    and frees the device copies: 64 GB would not fit twice in host memory)."""
    return build() if MODEL == "flux2" else build_on_host()


def build_on_host():
    """The same model, initialised on the GPU (fast) and moved to host memory; the GPU's
    memory is given back before another child builds."""
    import torch

    with one_build_at_a_time():
        model = _build()
        model.to("cpu")
        torch.cuda.empty_cache()
    return model


def add_lora(model):
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(1)  # peft's init uses the global RNG
    targets = FLUX2_TARGETS if MODEL == "flux2" else LORA_TARGETS
    config = LoraConfig(r=RANK, lora_alpha=RANK, target_modules=targets)
    model = inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
    model.enable_gradient_checkpointing()
    return model


def batch(device="cuda"):
    import torch

    g = torch.Generator(device=device).manual_seed(2)
    bf = torch.bfloat16
    if MODEL == "flux2":
        return {
            "hidden_states": torch.randn(1, 4096, 128, generator=g, device=device, dtype=bf),
            "encoder_hidden_states": torch.randn(
                1, 512, 15360, generator=g, device=device, dtype=bf
            ),
            "timestep": torch.tensor([0.5], device=device, dtype=bf),
            "img_ids": torch.zeros(4096, 4, device=device, dtype=bf),
            "txt_ids": torch.zeros(512, 4, device=device, dtype=bf),
            "guidance": torch.tensor([3.5], device=device, dtype=bf),
        }
    return {
        "hidden_states": torch.randn(1, 4096, 64, generator=g, device=device, dtype=bf),
        "encoder_hidden_states": torch.randn(1, 512, 4096, generator=g, device=device, dtype=bf),
        "pooled_projections": torch.randn(1, 768, generator=g, device=device, dtype=bf),
        "timestep": torch.tensor([0.5], device=device, dtype=bf),
        "img_ids": torch.zeros(4096, 3, device=device, dtype=bf),
        "txt_ids": torch.zeros(512, 3, device=device, dtype=bf),
        "guidance": torch.tensor([3.5], device=device, dtype=bf),
    }


def steps(model, n, lora_state=None, lockstep: bool = False, before_step=None):
    """n AdamW steps on the LoRA parameters; returns per-step seconds and losses. With
    ``lockstep`` and a ``Lockstep`` set up (``--interleave``), each step waits for its turn.
    ``before_step(i)``, if given, runs before step i's clock starts (after its turn)."""
    import torch

    if lora_state is not None:
        model.load_state_dict(lora_state, strict=False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params)
    inputs = batch()
    times, losses = [], []
    for values in marks.values():
        values.clear()
    gate = LOCKSTEP if lockstep else None
    phase("training", training_label)
    for i in range(n):
        if gate is not None:
            gate.wait_turn()
        if before_step is not None:
            before_step(i)
        # The forward's end is an event on the stream, not a synchronisation: a trainer does
        # not wait for the device between forward and backward, and waiting there would cost
        # the backward the CPU's lead (a streamed step more than a resident one).
        start = torch.cuda.Event(enable_timing=True)
        forward_done = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t = time.monotonic()
        start.record()
        out = model(**inputs, return_dict=False)[0]
        loss = out.float().pow(2).mean()
        # When the CPU had queued the forward: near the forward's time below, the forward is
        # bound by the CPU's issuing (hooks, launches), not by the GPU.
        marks["forward_issued_s"].append(time.monotonic() - t)
        forward_done.record()
        loss.backward()
        marks["backward_issued_s"].append(time.monotonic() - t)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.monotonic() - t)
        # The forward's share of the step (where streaming can stall), on the device's clock.
        marks["forward_s"].append(start.elapsed_time(forward_done) / 1e3)
        losses.append(loss.item())
        if gate is not None:
            gate.done()
    return times, losses


class Lockstep:
    """A child's side of ``--interleave``: before each timed step it reads its turn (one byte)
    from the parent, after it writes one back, so the two modes' steps alternate one by one
    and the machine's drift reaches both alike."""

    def __init__(self, spec: str):
        self.go, self.back = (int(fd) for fd in spec.split(","))

    def wait_turn(self):
        if os.read(self.go, 1) != b"g":
            raise SystemExit("interleave: the parent is gone")

    def done(self):
        os.write(self.back, b"d")


#: The child's ``Lockstep`` under ``--interleave``, else None.
LOCKSTEP: Lockstep | None = None


def optimizer(params):
    """``OPTIMIZER`` over ``params`` at lr 1e-4."""
    import torch

    if OPTIMIZER == "adamw":
        return torch.optim.AdamW(params, lr=1e-4)
    try:
        from torchao.optim import AdamW8bit
    except ImportError as e:
        raise SystemExit(
            f"--optimizer adamw8bit needs torchao ({e}): carry its wheel in .whl/ "
            "(pip download --no-deps torchao) and install it as the benches' other wheels"
        ) from e
    return AdamW8bit(params, lr=1e-4)


#: Per step of the last ``steps`` call, seconds from the step's start: ``forward_s`` until the
#: GPU had done the forward pass (and the loss), ``forward_issued_s`` and ``backward_issued_s``
#: until the CPU had issued the forward and the backward. ``timing`` records each one's median
#: as ``<key>_per_step``.
marks: dict[str, list[float]] = {"forward_s": [], "forward_issued_s": [], "backward_issued_s": []}
#: What ``steps`` calls its training phase for tests/bench/card.py (the mode, and the budget
#: where a mode has several).
training_label = ""


def lora_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def deterministic(on: bool):
    """Deterministic algorithms for the equality phases, with the cuBLAS workspace setting they
    need. Only there: with ``CUBLAS_WORKSPACE_CONFIG`` set, torch 2.11 compiles a std::regex
    to parse it at every cuBLAS call (``parseChosenWorkspaceSize``, from
    ``setWorkspaceForHandle``): ~22 % of a FLUX.1 step's CPU on the H200 in a sampled profile,
    in place and streamed alike, which ai-toolkit's users (who do not set it) never pay."""
    import torch

    if on:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    else:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    torch.use_deterministic_algorithms(on)


def timing(model, args, record, measuring=None):
    """The warm-up and measured steps; per-step figures are of the measured ones.
    ``measuring()``, if given, runs once the warm-up is done, before the first measured step
    (where counters are read: the first step's cold copies and plan are warm-up)."""
    import torch

    def before_step(i):
        # Each step ends synchronised: the warm-up's device work is done here.
        if i == args.warmup:
            torch.cuda.reset_accumulated_memory_stats()
            if measuring is not None:
                measuring()

    torch.cuda.reset_peak_memory_stats()
    t, _ = steps(model, args.warmup + args.measured, lockstep=True, before_step=before_step)
    measured = t[args.warmup :]
    record["s_per_step"] = round(statistics.median(measured), 4)
    record["steps_s"] = [round(x, 4) for x in measured]
    for key, values in marks.items():
        record[f"{key}_per_step"] = round(statistics.median(values[args.warmup :]), 4)
    record["trainer_peak_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 2)
    record["trainer_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GiB, 2)
    stats = torch.cuda.memory_stats()
    # Allocations that hit the memory-fraction cap: each frees the cache and synchronises.
    record["alloc_retries"] = stats.get("num_alloc_retries", 0)
    # The caching allocator's own device allocations and frees over the measured steps (a
    # cudaFree synchronises the device: under a cap, blocks of changing sizes are freed to make
    # room).
    for key in ("num_device_alloc", "num_device_free"):
        record[f"{key.removeprefix('num_')}s_per_step"] = round(
            stats.get(key, 0) / args.measured, 2
        )


def mode_resident(args, record):
    model = add_lora(build())
    init = lora_state(model)
    timing(model, args, record)
    deterministic(True)
    _, losses = steps(model, args.det_steps, init)
    record["det_losses"] = losses


def streamable(model) -> list[str]:
    """The layers attach streams with its default options (what 8-bit streaming quantizes)."""
    import weightstream.torch as wst
    from weightstream.torch import policy

    return [n for n, _ in policy.select(model, wst.StreamOptions()).streamed]


def sqnr_stats(model, names, device="cuda") -> dict:
    """Per-tensor SQNR (dB) of the 8-bit weights of the layers ``names``, each weight moved to
    ``device`` for its quantization: median and worst, and the worst tensor's name."""
    from weightstream import quantize

    modules = dict(model.named_modules())
    values = {}
    for name in names:
        w = modules[name].weight.detach().to(device)
        values[name] = quantize.sqnr_db(w, quantize.w_hat(w))
    worst = min(values, key=values.get)
    return {
        "median_db": round(statistics.median(values.values()), 2),
        "worst_db": round(values[worst], 2),
        "worst_tensor": worst,
        "tensors": len(values),
    }


def mode_resident_fp8(args, record):
    """The 8-bit resident reference: the bf16 model on the GPU with each weight that
    weightstream would stream replaced in place by its w_hat."""
    from weightstream import quantize

    model = add_lora(build())
    names = streamable(model)
    record["sqnr"] = sqnr_stats(model, names)
    record["quantized_layers"] = len(quantize.to_fp8_resident(model, names))
    init = lora_state(model)
    timing(model, args, record)
    deterministic(True)
    _, losses = steps(model, args.det_steps, init)
    record["det_losses"] = losses


def mode_resident_fp8_copying(args, record):
    """The 8-bit resident reference while a thread of this process copies 1 GiB of pinned host
    memory to the device on its own stream without pause (``--copy-duty`` of the time; the
    rest it sleeps): what the link's traffic alone costs a step, in the host's memory
    bandwidth the copies take and on the device, against resident-fp8 in the same call
    (weightstream's copies keep the link busy about half of a FLUX.1 8-bit step at 2 GiB).
    Records the copies' rate (``copy_gbps``); no deterministic losses."""
    import threading

    import torch
    from weightstream import quantize

    model = add_lora(build())
    quantize.to_fp8_resident(model, streamable(model))
    src = torch.empty(GiB, dtype=torch.uint8).pin_memory()
    dst = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    stop = threading.Event()
    copied = []

    def copy_loop():
        stream = torch.cuda.Stream()
        while not stop.is_set():
            started = time.perf_counter()
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()
            busy = time.perf_counter() - started
            copied.append(busy)
            stop.wait(busy * (1 / args.copy_duty - 1))

    thread = threading.Thread(target=copy_loop, name="copy-load", daemon=True)
    started = time.perf_counter()
    thread.start()
    try:
        timing(model, args, record)
    finally:
        stop.set()
        thread.join()
    elapsed = time.perf_counter() - started
    record["copy_duty"] = args.copy_duty
    record["copy_gbps"] = round(len(copied) * GiB / sum(copied) / 1e9, 1) if copied else 0.0
    record["copy_busy_share"] = round(sum(copied) / elapsed, 3)


def step_patched(model, patches):
    """One step with each ``owner.name`` of ``patches`` (``(owner, name, wrap)``) replaced by
    ``wrap(real)``, the real one put back after it."""
    reals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for (owner, name, real), (_, _, wrap) in zip(reals, patches, strict=True):
        setattr(owner, name, wrap(real))
    try:
        steps(model, 1)
    finally:
        for owner, name, real in reals:
            setattr(owner, name, real)


def dequant_probe(model, record):
    """One more step with CUDA events around each dequantization (a weight's, or a group's
    launch where the group dequantizes at once): its device time per step (the events wait on
    nothing else: each dequantization follows its group's ready event)."""
    import torch
    from weightstream import _fused_dequant, quantize

    events = []

    def timed(real):
        def call(*args):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = real(*args)
            end.record()
            events.append((start, end))
            return out

        return call

    step_patched(
        model, [(quantize, "dequantize", timed), (_fused_dequant.GroupLaunch, "run", timed)]
    )
    torch.cuda.synchronize()
    record["dequant_calls_per_step"] = len(events)
    record["dequant_ms_per_step"] = round(sum(a.elapsed_time(b) for a, b in events), 2)


def client_cpu_probe(model, handle, record):
    """One more step with the client's calls timed on the CPU, per pass (``forward``; and
    ``backward``, its recompute included, on autograd's thread): milliseconds the calling
    thread spent in the streamed layers' forwards (``layer``, which holds the rest),
    blocked for replies (``Session.wait``), sending acquires and releases (``submit``,
    ``release``), and launching groups' dequantizations (``dequantize_group``), each with
    its number of calls. What ``layer`` leaves of a pass's issuing is the model's own work."""
    import torch
    from weightstream import session as ws_session
    from weightstream.torch import handle as ws_handle
    from weightstream.torch import hooks, ops

    totals: dict = {}

    def timed(real, key):
        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                spent = time.perf_counter() - started
                cell = totals.setdefault("backward" if ops.in_backward() else "forward", {})
                ms, calls = cell.get(key, (0.0, 0))
                cell[key] = (ms + spent * 1e3, calls + 1)

        return call

    targets = [
        (hooks.StreamedForward, "__call__", "layer"),
        (ws_session.Session, "wait", "wait"),
        (ws_session.Session, "submit", "submit"),
        (ws_session.Session, "release", "release"),
        (ws_handle.Handle, "_dequantize_group", "dequantize_group"),
    ]
    if handle._lookahead is not None:  # it keeps the session's submit, bound at its start
        targets.append((handle._lookahead, "submit", "submit"))
    step_patched(
        model,
        [(owner, name, functools.partial(timed, key=key)) for owner, name, key in targets],
    )
    torch.cuda.synchronize()
    record["client_cpu_ms_per_pass"] = {
        phase: {key: {"ms": round(ms, 2), "calls": calls} for key, (ms, calls) in cell.items()}
        for phase, cell in totals.items()
    }


def scrape(args, name: str) -> float:
    """Sum of a metric's samples from the daemon's Prometheus endpoint."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{args.metrics}/metrics", timeout=10).read().decode()
    names = (name + " ", name + "{", name + "_total ", name + "_total{")
    lines = [line for line in text.splitlines() if line.startswith(names)]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return round(kb / (1 << 20), 2)


def measure_budget(args, handle, client, model, r):
    """One budget's timing, with the daemon's and the client's counters over the measured
    steps (the warm-up's first step copies every group cold and records the plan)."""
    start = {}

    def measuring():
        start["stats"] = handle.stats()
        start["busy"] = scrape(args, "weightstream_device_copy_busy_seconds")

    timing(model, args, r, measuring)
    after = handle.stats()
    before, busy = start["stats"], start["busy"]
    n = args.measured
    r["copy_busy_s_per_step"] = round(
        (scrape(args, "weightstream_device_copy_busy_seconds") - busy) / n, 4
    )
    r["bytes_per_step_gib"] = round((after["bytes_copied"] - before["bytes_copied"]) / n / GiB, 2)
    r["hit_rate"] = round(
        (after["hits"] - before["hits"]) / max(1, after["acquires"] - before["acquires"]), 4
    )
    r["acquires_per_step"] = round((after["acquires"] - before["acquires"]) / n, 1)
    per_step = lambda key: (after[key] - before[key]) / n / 1e9  # noqa: E731
    # The trainer's own wait for weights (the compute stream's, timed by the client), and the
    # daemon's time with some acquire pending (look-ahead ones included: not a wait).
    r["gpu_wait_s_per_step"] = round(per_step("gpu_wait_ns"), 4)
    r["acquire_pending_s_per_step"] = round(per_step("acquire_pending_ns"), 4)
    # The trainer's thread blocked for the daemon's reply (issuing nothing meanwhile).
    r["reply_wait_s_per_step"] = round(per_step("reply_wait_ns"), 4)
    r["reply_waits_per_step"] = round((after["reply_waits"] - before["reply_waits"]) / n, 1)
    r["reply_wait_ms_per_step_by_group"] = {
        name: round((ns - before["reply_wait_by_group"][name]) / n / 1e6, 3)
        for name, ns in after["reply_wait_by_group"].items()
    }
    # Where the waits were: per group, ms per step (the groups in the plan's order).
    r["gpu_wait_ms_per_step_by_group"] = {
        name: round((ns - before["gpu_wait_by_group"][name]) / n / 1e6, 3)
        for name, ns in after["gpu_wait_by_group"].items()
    }
    sess = [s for s in client.list_sessions() if s.session_id == handle.session.id][0]
    r["daemon_staging_gib"] = round(sess.staging_bytes / GiB, 2)
    r["daemon_resident_gib"] = round(sess.resident_bytes / GiB, 2)
    r["daemon_resident_groups"] = [g.name for g in handle.session.groups if g.resident]
    r["gpu_total_gib"] = round(
        r["trainer_reserved_gib"] + r["daemon_staging_gib"] + r["daemon_resident_gib"], 2
    )
    r["nvidia_smi_used_gib"] = nvidia_smi_used_gib()


def nvidia_smi_used_gib(index: int = 0) -> float | None:
    """Device ``index``'s used memory as nvidia-smi sees it (every process and context on it)."""
    try:
        query = ["--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(index)]
        out = subprocess.run(
            ["nvidia-smi", *query],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return round(float(out.split()[0]) / 1024, 2)
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def mode_weightstream(args, record):
    global training_label
    import torch
    import weightstream
    import weightstream.torch as wst

    model = add_lora(build_for_attach())
    init = lora_state(model)
    if args.quantize:
        record["quantize"] = args.quantize
        record["sqnr"] = sqnr_stats(model, streamable(model))
    client = weightstream.connect(args.socket)
    total = torch.cuda.get_device_properties(0).total_memory
    started = time.monotonic()
    first = args.budgets[0]
    handle = wst.attach(
        model,
        "cuda",
        client=client,
        vram_budget=daemon_part(args, first),
        staging_bytes=int(args.staging_gib * GiB),
        group_by=args.group_by,
        quantize=args.quantize,
        dequantize=args.dequantize,
        early_release=args.early_release,
    )
    record["dequantize"] = args.dequantize
    record["early_release"] = args.early_release
    record["attach_s"] = round(time.monotonic() - started, 1)
    record["streamed_modules"] = len(handle.streamed)
    record["groups"] = len(handle.session.groups)
    largest = max(g.nbytes for g in handle.session.groups)
    record["largest_group_gib"] = round(largest / GiB, 3)
    record["trainer_rss_gib"] = rss_gib()
    record["daemon_store_gib"] = round(scrape(args, "weightstream_store_bytes") / GiB, 2)
    # The smallest budget: --min-blocks of the largest block, all of it staging.
    smallest = round(args.trainer_gib + args.min_blocks * largest / GiB, 2)
    record["budgets"] = {}
    for budget in [*args.budgets, smallest] if args.min_blocks > 0 else args.budgets:
        key = f"{budget:g}"
        training_label = f"{args.mode} {key} GiB"
        r = record["budgets"][key] = {"daemon_budget_gib": daemon_part(args, budget) / GiB}
        try:
            if budget == smallest:
                part = daemon_part(args, budget)
                handle.set_budget(part, staging_bytes=part)
            elif budget != first:
                handle.set_budget(daemon_part(args, budget), int(args.staging_gib * GiB))
            torch.cuda.set_per_process_memory_fraction(args.trainer_gib * GiB / total)
            torch.cuda.empty_cache()
            measure_budget(args, handle, client, model, r)
        except Exception as e:  # noqa: BLE001 - a budget that fails is reported, not fatal
            r["error"] = repr(e)[:400]
            traceback.print_exc()
    if args.quantize:
        # At the last timed budget, where the streamed groups dequantize as in the timed steps
        # (at the deterministic budget most groups are resident, dequantized per call).
        dequant_probe(model, record)
        record["dequant_peak_gib"] = round(handle.stats()["dequant_scratch_peak_bytes"] / GiB, 3)
    client_cpu_probe(model, handle, record)
    torch.cuda.set_per_process_memory_fraction(1.0)
    handle.set_budget(daemon_part(args, args.det_budget))
    training_label = f"{args.mode} deterministic, {args.det_budget:g} GiB"
    deterministic(True)
    _, losses = steps(model, args.det_steps, init)
    record["det_losses"] = losses
    record["det_budget_gib"] = args.det_budget
    # The next mode uploads again: give the daemon's host copy back (the host quota would
    # refuse a second 64 GB FLUX.2 copy).
    handle.close(release=True)


def mode_weightstream_auto(args, record):
    """attach(vram_budget="auto"): the session starts at its minimum, grows after the first
    step to what the device has left less the margin, and is timed there."""
    import torch
    import weightstream
    import weightstream.torch as wst

    model = add_lora(build_for_attach())
    client = weightstream.connect(args.socket)
    started = time.monotonic()
    handle = wst.attach(model, "cuda", client=client, vram_budget="auto", quantize=args.quantize)
    record["attach_s"] = round(time.monotonic() - started, 1)
    if args.quantize:
        record["quantize"] = args.quantize
    r = record["budgets"] = {"auto": {}}
    measure_budget(args, handle, client, model, r["auto"])
    stats = handle.stats()
    r["auto"].update({k: v for k, v in stats.items() if k.startswith("auto_")})
    free, total = torch.cuda.mem_get_info()
    r["auto"]["device_free_after_gib"] = round(free / GiB, 2)
    handle.close(release=True)


def daemon_part(args, budget_gib: float) -> int:
    """The daemon's share of a budget: all but what the trainer needs beside the weights
    (activations with checkpointing, LoRA and its optimizer state)."""
    return int((budget_gib - args.trainer_gib) * GiB)


def mode_job(args, record):
    """One of the two jobs sharing the GPU (see two_jobs): job 0 uploads the weights, job 1
    streams the daemon's copy of them; both time their steps over the same window."""
    import torch
    import weightstream
    import weightstream.torch as wst

    barrier = Path(args.barrier)
    if args.jobs_resident:
        # The ceiling for two jobs on one GPU: each with its own weights in place (8-bit ones
        # as w_hat with --quantize fp8), no streaming, the same timing window.
        from weightstream import quantize

        model = add_lora(build())
        if args.quantize:
            quantize.to_fp8_resident(model, streamable(model))
        together(model, args, barrier, record)
        return
    if args.job == 1:
        # Built once job 0 has attached (and freed its device copy): two FLUX.2 copies at once
        # would not fit on the device, nor two uploads in host memory.
        while not (barrier / "model").exists():
            time.sleep(0.5)
    model = add_lora(build_for_attach())
    client = weightstream.connect(args.socket)
    total = torch.cuda.get_device_properties(0).total_memory
    budget = daemon_part(args, args.jobs_budget)
    if args.job == 0:
        handle = wst.attach(
            model, "cuda", client=client, vram_budget=budget, quantize=args.quantize
        )
        (barrier / "model").write_text(handle.model_id)
    else:
        model_id = (barrier / "model").read_text()
        handle = wst.attach(
            model, "cuda", client=client, vram_budget=budget, model=model_id, quantize=args.quantize
        )
    record["trainer_rss_gib"] = rss_gib()
    torch.cuda.set_per_process_memory_fraction(args.trainer_gib * GiB / total)
    together(model, args, barrier, record)
    record["model_id"] = handle.model_id


def together(model, args, barrier: Path, record):
    """The warm-up steps, then, once both jobs are warm, the timed ones: the same window."""
    steps(model, args.warmup)
    (barrier / f"ready{args.job}").write_text("")
    while not all((barrier / f"ready{k}").exists() for k in (0, 1)):
        time.sleep(0.01)
    t, _ = steps(model, args.measured)
    record["s_per_step"] = round(statistics.median(t), 4)
    record["steps_s"] = [round(x, 4) for x in t]


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


MODES = {
    "resident": mode_resident,
    "resident-fp8": mode_resident_fp8,  # run by default only with --quantize fp8
    # The same with the link kept busy by a copy loop: only with --modes.
    "resident-fp8-copying": mode_resident_fp8_copying,
    "weightstream": mode_weightstream,
    "weightstream-auto": mode_weightstream_auto,
    "ramtorch": mode_ramtorch,
    "accelerate-offload": mode_accelerate,
    "diffusers-group-offload": mode_group_offload,
    "aitk": mode_aitk_memory_manager,  # ai-toolkit's MemoryManager, 100 %: only with --modes
    "aitk-float8": mode_aitk_float8,  # the same over torchao float8 weights (torchao needed)
    "two-jobs": None,  # run by the parent: two `job` children at once
    "two-resident": None,  # the same, each job with its weights in place
    "job": mode_job,
}


def child(args):
    global training_label, LOCKSTEP
    import torch

    if args.lockstep:
        LOCKSTEP = Lockstep(args.lockstep)
    label = args.mode if args.mode != "job" else f"job {args.job}"
    phase("loading", label)
    training_label = label
    torch.backends.cuda.enable_cudnn_sdp(False)
    record = {"mode": args.mode}
    try:
        MODES[args.mode](args, record)
    except Exception as e:  # noqa: BLE001 - the error is the result for this mode
        record["error"] = repr(e)[:600]
        traceback.print_exc()
    print("RESULT " + json.dumps(record), flush=True)


def device_and_pinned_bandwidth() -> tuple[str, float]:
    """The device's name and its pinned host-to-device GB/s, measured in a process of their own:
    the parent holds no CUDA context (on an emulated card it would take the children's room)."""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'tests' / 'gpu')!r}); import torch, wsgpu; "
        "print(torch.cuda.get_device_name(0)); print(wsgpu.pinned_h2d_gbps(reps=6))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    name, gbps = out.strip().splitlines()[-2:]
    return name, float(gbps)


def child_cmd(args, mode: str, socket: str) -> list[str]:
    cmd = [sys.executable, __file__, "--child", mode, "--socket", socket, "--metrics", args.metrics]
    cmd += ["--budgets", *map(str, args.budgets), "--det-budget", str(args.det_budget)]
    cmd += ["--det-steps", str(args.det_steps)]
    cmd += ["--warmup", str(args.warmup), "--measured", str(args.measured)]
    cmd += ["--trainer-gib", str(args.trainer_gib), "--group-by", args.group_by]
    cmd += ["--dequantize", args.dequantize]
    if args.early_release:
        cmd.append("--early-release")
    cmd += ["--staging-gib", str(args.staging_gib), "--copy-duty", str(args.copy_duty)]
    cmd += ["--jobs-budget", str(args.jobs_budget), "--min-blocks", str(args.min_blocks)]
    cmd += ["--model", args.model, "--rank", str(args.rank), "--optimizer", args.optimizer]
    if args.aitk:
        cmd += ["--aitk", args.aitk]
    if args.quantize:
        cmd += ["--quantize", args.quantize]
    return cmd


def result_of(mode: str, stdout: str, stderr: str) -> dict:
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(lines[-1][7:]) if lines else {"mode": mode, "error": stderr[-600:]}


def run_mode(args, mode, socket, env, out) -> dict:
    try:
        p = subprocess.run(
            child_cmd(args, mode, socket),
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        (out / f"flux-{mode}.log").write_text(p.stdout + p.stderr)
        return result_of(mode, p.stdout, p.stderr)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {args.timeout} s"}


def two_jobs(args, socket, env, out, resident: bool = False) -> dict:
    """Two trainers on one GPU and one daemon, each at --jobs-budget GiB: per-job s/step over
    the same window, and the host memory held for the model. ``resident``: each job with its
    weights in place instead (``two-resident``, the ceiling of two jobs sharing the GPU)."""
    barrier = Path(tempfile.mkdtemp(prefix="ws-flux-jobs-"))
    mode = "two-resident" if resident else "two-jobs"
    record = {"mode": mode, "budget_gib": None if resident else args.jobs_budget, "jobs": []}
    procs = []
    for job in (0, 1):
        cmd = child_cmd(args, "job", socket) + ["--job", str(job), "--barrier", str(barrier)]
        cmd += ["--jobs-resident"] if resident else []
        log = open(out / f"flux-job{job}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log), log))
    peak_store = 0.0
    deadline = time.monotonic() + args.timeout
    while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
        try:
            peak_store = max(peak_store, scrape(args, "weightstream_store_bytes"))
        except OSError:
            pass
        time.sleep(1)
    for job, (p, log) in enumerate(procs):
        if p.poll() is None:
            p.kill()
        stdout = p.stdout.read().decode()
        log.close()
        record["jobs"].append(result_of("job", stdout, f"no result: see flux-job{job}.log"))
    record["daemon_store_peak_gib"] = round(peak_store / GiB, 2)
    times = [j.get("s_per_step") for j in record["jobs"]]
    if all(times):
        record["combined_steps_per_s"] = round(sum(1 / t for t in times), 4)
    return record


def timed_record(record: dict) -> dict:
    """Where a mode's record keeps its timing: its only budget's record, or itself."""
    budgets = record.get("budgets") or {}
    return next(iter(budgets.values())) if len(budgets) == 1 else record


def interleaved(args, socket, env, out) -> tuple[list[dict], dict]:
    """``--interleave A B [C ...]``: the modes' children at once, their timed steps alternating
    in turns of ``--turn`` steps (A's steps i..i+turn-1, then B's, ...: ``Lockstep``), so that
    a drift of the machine's speed reaches all. A mode written ``MODE+group`` (or ``+layer``)
    runs MODE with that ``--dequantize``, ``MODE+early`` with ``--early-release``. Returns
    the records (each with its ``variant``, the name as given) and the summary: each later
    mode's step over A's step of the same index, per pair, and their median (``ratios``, by
    name; the second mode's also at the top level); with turns of several steps also the
    ratio of the medians of the steps that are not a turn's first (``steady_ratio_of_medians``:
    those follow a step of the same process, as a trainer's steps do)."""
    n = args.warmup + args.measured
    turn = args.turn
    children = []
    for mode in args.interleave:
        go_r, go_w = os.pipe()
        back_r, back_w = os.pipe()
        log = open(out / f"flux-{mode}.log", "w")
        base, _, variant = mode.partition("+")
        extra = {"": [], "early": ["--early-release"]}.get(variant, ["--dequantize", variant])
        cmd = child_cmd(args, base, socket) + extra + ["--lockstep", f"{go_r},{back_w}"]
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, pass_fds=(go_r, back_w))
        os.close(go_r)
        os.close(back_w)
        children.append((mode, base, p, go_w, back_r, log))
    deadline = time.monotonic() + args.timeout
    stopped = None
    for first in range(0, n, turn):
        for mode, _, _, go_w, back_r, _ in children:
            for i in range(first, min(n, first + turn)):
                try:
                    os.write(go_w, b"g")
                except BrokenPipeError:  # gone already (its model did not fit, say)
                    stopped = f"{mode} did not finish its step {i}"
                    break
                left = max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([back_r], [], [], left)
                if not ready or os.read(back_r, 1) != b"d":
                    stopped = f"{mode} did not finish its step {i}"
                    break
            if stopped:
                break
        if stopped:
            break
    records = []
    for mode, base, p, go_w, back_r, log in children:
        os.close(go_w)  # a child still waiting for its turn stops
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        os.close(back_r)
        log.close()
        text = (out / f"flux-{mode}.log").read_text()
        record = result_of(base, text, f"no result: see flux-{mode}.log")
        record["interleaved"] = True
        record["variant"] = mode
        records.append(record)
    summary = {"modes": list(args.interleave), "turn": turn}
    if stopped:
        summary["error"] = stopped
    a = timed_record(records[0]).get("steps_s")
    # The measured steps that follow a step of their own process (none in turns of one).
    steady = [j for j in range(len(a or ())) if (args.warmup + j) % turn != 0]
    summary["ratios"] = {}
    for mode, record in zip(args.interleave[1:], records[1:], strict=True):
        b = timed_record(record).get("steps_s")
        if a and b and len(a) == len(b):
            ratios = sorted(y / x for x, y in zip(a, b, strict=True))
            summary["ratios"][mode] = {
                "ratio_per_pair": [round(y / x, 4) for x, y in zip(a, b, strict=True)],
                "ratio_median": round(statistics.median(ratios), 4),
                "ratio_min": round(ratios[0], 4),
                "ratio_max": round(ratios[-1], 4),
                "ratio_of_medians": round(statistics.median(b) / statistics.median(a), 4),
            }
            if steady:
                sa = statistics.median(a[j] for j in steady)
                sb = statistics.median(b[j] for j in steady)
                summary["ratios"][mode]["steady_ratio_of_medians"] = round(sb / sa, 4)
    summary.update(summary["ratios"].get(args.interleave[1], {}))
    return records, summary


def run_modes(args, socket: str, out: Path) -> dict:
    """The modes (or the interleaved run) against the daemon at ``socket``: the results."""
    device, pinned = device_and_pinned_bandwidth()
    results = {
        "command": "python3 " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "device": device,
        "pinned_h2d_gbps": round(pinned, 2),
        "trainer_gib": args.trainer_gib,
        "model": args.model,
        "rank": args.rank,
        "optimizer": args.optimizer,
        "copy_bandwidth_limit": args.copy_bandwidth_limit,
        "modes": [],
    }
    if os.environ.get("WS_CARD_GIB"):
        results["card_gib"] = float(os.environ["WS_CARD_GIB"])
    # The children time their steps without CUBLAS_WORKSPACE_CONFIG (see ``deterministic``).
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    env[BUILD_LOCK_ENV] = str(Path(socket).parent / "build.lock")
    if args.interleave:
        started = time.monotonic()
        records, summary = interleaved(args, socket, env, out)
        summary["wall_s"] = round(time.monotonic() - started, 1)
        results["modes"] += records
        results["interleaved"] = summary
        print(json.dumps(summary), flush=True)
    for mode in [] if args.interleave else args.modes:
        started = time.monotonic()
        if mode in ("two-jobs", "two-resident"):
            record = two_jobs(args, socket, env, out, resident=mode == "two-resident")
        else:
            record = run_mode(args, mode, socket, env, out)
        record["wall_s"] = round(time.monotonic() - started, 1)
        results["modes"].append(record)
        (out / f"{results_name()}.json").write_text(json.dumps(results, indent=2))
        print(json.dumps(record)[:1500], flush=True)
    return results


def stop(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Terminates ``proc`` (nothing if it has ended) and waits for it, killing it if it has not
    ended within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def parent(args):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ws-flux-"))
    socket = str(tmp / "ws.sock")
    cap = ["--copy-bandwidth-limit", args.copy_bandwidth_limit] if args.copy_bandwidth_limit else []
    daemon = subprocess.Popen(
        [args.bin, "serve", "--backend", "cuda", "--socket", socket]
        + ["--metrics-listen", args.metrics]
        + cap,
        stderr=open(out / "flux-daemon.log", "ab"),
    )
    try:
        results = run_modes(args, socket, out)
    finally:
        # Also after a failure (a child gone mid-run): no daemon is left holding the metrics
        # port and the GPU's memory for the next run.
        stop(daemon)
    ok = check_equality(results)
    (out / f"{results_name()}.json").write_text(json.dumps(results, indent=2))
    # The device tool brings back at most 8 files from $OUT: pack the logs into one.
    logs = sorted(p.name for p in out.glob("flux-*.log"))
    if logs:
        subprocess.run(["tar", "czf", "flux-logs.tgz", "--remove-files", *logs], cwd=out)
    return 0 if ok else 1


def check_equality(results):
    """Each mode's deterministic losses against the resident reference of its format: bf16
    resident, or for 8-bit streaming (and resident-fp8 itself) the 8-bit resident reference."""
    modes = {m["mode"]: m for m in results["modes"]}
    refs = {fmt: modes.get(mode, {}).get("det_losses") for fmt, mode in REFERENCE.items()}
    ok = True
    for m in results["modes"]:
        ref = refs[m.get("quantize") or ("fp8" if m["mode"] == "resident-fp8" else None)]
        if "det_losses" in m and ref is not None and m["mode"] != "resident-fp8":
            m["losses_equal_resident"] = m["det_losses"] == ref
            if m["mode"] == "weightstream" and not m["losses_equal_resident"]:
                ok = False
    # Every weightstream record (an interleaved run may hold several: ``MODE+group``).
    equal = [
        m.get("losses_equal_resident") for m in results["modes"] if m["mode"] == "weightstream"
    ]
    results["weightstream_losses_equal"] = None if not equal or None in equal else all(equal)
    print("weightstream losses equal resident:", results["weightstream_losses_equal"])
    return ok


#: The reference mode of each weight format (the key: ``--quantize``).
REFERENCE = {None: "resident", "fp8": "resident-fp8"}


def main(model: str = "flux1"):
    global MODEL, RANK, OPTIMIZER
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["flux1", "flux2"], default=model)
    parser.add_argument("--rank", type=int, default=32, help="the LoRA rank")
    parser.add_argument(
        "--optimizer",
        choices=["adamw", "adamw8bit"],
        default="adamw",
        help="the LoRA optimizer: torch's AdamW, or torchao's AdamW8bit (a quarter of the "
        "state: for high ranks whose AdamW state outgrows --trainer-gib)",
    )
    parser.add_argument(
        "--copy-bandwidth-limit",
        default=os.environ.get(LINK_ENV),
        help="the daemon's copy_bandwidth_limit (e.g. 25GB/s: a PCIe Gen4 x16 link, emulated; "
        f"default: ${LINK_ENV}, which tests/bench/card.py --link sets)",
    )
    parser.add_argument("--bin", default="target/release/weightstream")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-flux-out"))
    parser.add_argument("--child")
    parser.add_argument("--socket")
    parser.add_argument("--modes", nargs="+", default=None)
    parser.add_argument(
        "--quantize",
        choices=["fp8"],
        default=None,
        help="weightstream modes stream the weights in 8 bits (fp8_e4m3_block64); their "
        "losses are compared with resident-fp8, which the default modes then include",
    )
    parser.add_argument("--budgets", nargs="+", type=float, default=[24, 16, 12, 8])
    parser.add_argument(
        "--trainer-gib",
        type=float,
        default=5.0,
        help="the trainer's share of each budget (its allocator's cap); the daemon gets the rest",
    )
    parser.add_argument("--group-by", default="block", help="attach's group_by")
    parser.add_argument(
        "--dequantize",
        choices=("auto", "layer", "group"),
        default="auto",
        help="attach's dequantize (8 bits: each layer's weight at each call, a group's at once, "
        "or auto: by group for the groups of at most 768 MiB dequantized)",
    )
    parser.add_argument(
        "--early-release",
        action="store_true",
        help="attach's early_release (a group dequantized by group gives its staging back "
        "once dequantized); with --interleave, MODE+early runs MODE with it",
    )
    parser.add_argument(
        "--staging-gib",
        type=float,
        default=0.0,
        help="the daemon's staging space within each budget (default 0: the daemon's choice)",
    )
    parser.add_argument(
        "--min-blocks",
        type=float,
        default=3,
        help="the smallest budget: the trainer's share and this many of the largest group",
    )
    parser.add_argument("--metrics", default="127.0.0.1:9464", help="the daemon's metrics address")
    parser.add_argument("--jobs-budget", type=float, default=12.0, help="two-jobs: GiB per job")
    parser.add_argument("--job", type=int, default=0)
    parser.add_argument("--barrier")
    parser.add_argument("--jobs-resident", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--aitk",
        default=None,
        help="the aitk modes: ai-toolkit's code laid out by tests/bench/ai_toolkit_prepare.sh "
        "(default: .aitk in the repo root)",
    )
    parser.add_argument(
        "--interleave",
        nargs="+",
        metavar="MODE",
        help="run modes A B [C ...] at once, their timed steps alternating one by one (instead "
        "of --modes; one --budgets value, --min-blocks 0): each later mode's step over A's, pair "
        "by pair; MODE+group / MODE+layer runs MODE with that --dequantize, MODE+early with "
        "--early-release",
    )
    parser.add_argument(
        "--turn",
        type=int,
        default=1,
        help="with --interleave: each mode's steps per turn (more than 1: ratios also of the "
        "steps that follow a step of their own process, as a trainer's do)",
    )
    parser.add_argument("--lockstep", help=argparse.SUPPRESS)
    parser.add_argument(
        "--copy-duty",
        type=float,
        default=1.0,
        help="resident-fp8-copying: the share of the time its copy loop copies (0 < d <= 1)",
    )
    parser.add_argument("--det-budget", type=int, default=16)
    parser.add_argument("--det-steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--measured", type=int, default=10)
    parser.add_argument("--timeout", type=int, default=400)
    args = parser.parse_args()
    MODEL, RANK, OPTIMIZER = args.model, args.rank, args.optimizer
    if args.modes is None:
        skip = {"job", "aitk", "aitk-float8", "resident-fp8-copying"}
        skip |= set() if args.quantize else {"resident-fp8"}
        args.modes = [m for m in MODES if m not in skip]
    if args.interleave is not None and len(args.interleave) < 2:
        parser.error("--interleave times each mode against the first: give two modes or more")
    if args.interleave and (len(args.budgets) != 1 or args.min_blocks != 0):
        parser.error("--interleave times one budget: give one --budgets value and --min-blocks 0")
    if args.turn < 1:
        parser.error(f"--turn {args.turn}: give 1 or more steps per turn")
    if not 0 < args.copy_duty <= 1:
        parser.error(f"--copy-duty {args.copy_duty}: give a share of the time, 0 < d <= 1")
    if args.child:
        args.mode = args.child
        return child(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
