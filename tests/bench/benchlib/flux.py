"""The FLUX transformers of the training benchmarks and their training step: the models
(``--model``: FLUX.1-dev or FLUX.2-dev, random seeded weights, built one process at a time),
their LoRA (``--rank``) and optimizer (``--optimizer``), a batch, the steps (optionally in
lockstep with another process), deterministic mode. Used by tests/bench/flux_train.py and the
benches that train the same model (ddp_train, first_step, flux_profile, high_rank, ...)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from tests.bench.card import phase

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[3]

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
