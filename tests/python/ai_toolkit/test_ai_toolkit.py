"""weightstream under ai-toolkit's layer offloading, on the CPU against the daemon's host backend:
ai-toolkit's own order of operations replayed on tiny FLUX-shaped diffusers transformers, with
losses and LoRA gradients equal (torch.equal) to the same run without weightstream.

The calls are re-enacted, not copied, in the order ai-toolkit's code makes them at
ostris/ai-toolkit 27a03a91f23eb1b757d5ec2e80ee3e129cfcc350, read in:
- ``extensions_built_in/diffusion_models/flux2/flux2_model.py``: ``Flux2Model.load_model``
  moves the transformer to the device with the dtype, calls ``MemoryManager.attach(transformer,
  device, offload_percent=layer_offloading_transformer_percent)`` (imported from
  ``toolkit.memory_management.manager``), then ``transformer.to("cpu")`` under ``low_vram``;
  ``load_te`` moves the text encoder the same way and attaches it; "Preparing Model" calls
  ``text_encoder.to(device)``, ``requires_grad_(False)``, ``eval()`` and
  ``pipe.transformer = pipe.transformer.to(device)``. The FLUX.1 loader
  (``toolkit/stable_diffusion_model.py``) makes no MemoryManager call at this commit.
- ``jobs/process/BaseSDTrainProcess.py`` (``run``): gradient checkpointing on, text encoders
  frozen, ``unet.to(device, dtype=dtype)``, ``unet.requires_grad_(False)``, then the network:
  ``LoRASpecialNetwork(...)``, ``force_to(device, float32)``, ``apply_to(...)``,
  ``prepare_grad_etc`` (``requires_grad_(True)``).
- ``toolkit/lora_special.py``: ``LoRAModule.apply_to`` keeps the layer's forward as
  ``org_forward`` and puts its own in its place; ``toolkit/network_mixins.py``
  (``ToolkitModuleMixin.forward``): ``org_forward(x)`` plus the LoRA branch run in the LoRA's
  dtype and cast back.
- ``toolkit/unloader.py`` (``unload_text_encoder``, called by ``SDTrainer`` once embeddings
  are cached): ``MemoryManager.free(text_encoder)``, then ``release_cached_memory()``.
- ``extensions_built_in/sd_trainer/SDTrainer.py``: ``sync_grad_transfers()`` after backward,
  before clipping and the optimizer step.
- ``toolkit/memory_management/{__init__,manager,manager_modules}.py``: the surface itself.
"""

from __future__ import annotations

import copy
import gc
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import weightstream
import weightstream.torch as wst
from peft import LoraConfig, inject_adapter_in_model
from torch import nn
from weightstream.client import socket_path
from weightstream.integrations import ai_toolkit
from weightstream.integrations.ai_toolkit import launcher
from weightstream.integrations.ai_toolkit.settings import Settings
from weightstream.torch.hooks import StreamedForward

DTYPE = torch.bfloat16  # the model's dtype and ai-toolkit's train dtype
#: Each session's budget, all of it staging: nothing stays resident, every block streams.
BUDGET = 1 << 20


# --- tiny FLUX-shaped models ---------------------------------------------------------------


def make_transformer(arch: str) -> nn.Module:
    """A FLUX.1 or FLUX.2 transformer of diffusers with tiny dimensions, its weights requiring
    grad as ai-toolkit's loaders leave them until the trainer freezes the model."""
    from diffusers import Flux2Transformer2DModel, FluxTransformer2DModel

    torch.manual_seed(0)
    common = dict(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
    )
    if arch == "flux":
        return FluxTransformer2DModel(
            **common, pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6, 6)
        )
    return Flux2Transformer2DModel(
        **common, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4)
    )


class TextEncoder(nn.Module):
    """A stand-in text encoder: token embeddings, two blocks of Linear layers, and the two
    outputs a FLUX pipeline takes from its encoders (per-token and pooled)."""

    def __init__(self, vocab=64, dim=32, out=32, pooled=16):
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
            )
            for _ in range(2)
        )
        self.proj, self.pool = nn.Linear(dim, out), nn.Linear(dim, pooled)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.proj(h), self.pool(h.mean(1))


def transformer_inputs(arch: str, step: int, embeds, pooled) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    n, t = 16, embeds.shape[1]
    axes = 3 if arch == "flux" else 4
    x = dict(
        hidden_states=torch.randn(1, n, 16, generator=g).to(DTYPE),
        encoder_hidden_states=embeds,
        timestep=torch.rand(1, generator=g),
        img_ids=torch.randint(0, 4, (n, axes), generator=g).float(),
        txt_ids=torch.zeros(t, axes),
        guidance=torch.tensor([1.0]),
    )
    if arch == "flux":
        x["pooled_projections"] = pooled
    return x


def prompts(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (1, 8), generator=g) for _ in range(n)]


# --- an ai-toolkit-style LoRA network (the way LoRASpecialNetwork hooks a layer) ------------


class LoRAModule(nn.Module):
    """Like ai-toolkit's ``LoRAModule``: the wrapped layer in a list (not a submodule), its
    forward kept as ``org_forward`` by ``apply_to``; the branch runs in the LoRA's dtype."""

    def __init__(self, org: nn.Linear, rank=4, alpha=8.0):
        super().__init__()
        self.org_module = [org]
        self.lora_down = nn.Linear(org.in_features, rank, bias=False)
        self.lora_up = nn.Linear(rank, org.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_down.weight, a=5**0.5)
        nn.init.zeros_(self.lora_up.weight)
        self.scale = alpha / rank

    def apply_to(self):
        self.org_forward = self.org_module[0].forward
        self.org_module[0].forward = self.forward

    def forward(self, x, *args, **kwargs):
        org = self.org_forward(x, *args, **kwargs)
        lora = self.lora_up(self.lora_down(x.to(self.lora_down.weight.dtype))) * self.scale
        return org + lora.to(org.dtype)


class LoRANetwork(nn.Module):
    """Like ``LoRASpecialNetwork`` for a transformer: a LoRA on every Linear layer of the
    transformer blocks; the modules live in the network, not in the model."""

    def __init__(self, root: nn.Module):
        super().__init__()
        torch.manual_seed(2)
        self.loras = nn.ModuleList(
            LoRAModule(m)
            for name, m in root.named_modules()
            if "transformer_blocks" in name and isinstance(m, nn.Linear)
        )

    def force_to(self, device, dtype):
        self.to(device, dtype)

    def apply_to(self):
        for lora in self.loras:
            lora.apply_to()


# --- toolkit.memory_management served by the launcher's finder -----------------------------


@dataclass
class Toolkit:
    """What ai-toolkit's modules import: the package and its ``manager`` submodule."""

    package: object
    manager: object
    root: Path
    settings: list = field(default_factory=list)


@pytest.fixture
def toolkit(tmp_path, daemon):
    """A ``toolkit`` package whose own ``memory_management`` fails if imported, with the
    launcher's finder installed: imports resolve as they would under ``weightstream-aitk``."""
    root = tmp_path / "aitk"
    (root / "toolkit" / "memory_management").mkdir(parents=True)
    (root / "toolkit" / "__init__.py").write_text("")
    (root / "toolkit" / "memory_management" / "__init__.py").write_text(
        'raise AssertionError("ai-toolkit\'s own memory manager was imported")\n'
    )
    sys.path.insert(0, str(root))
    launcher.install()
    ai_toolkit.configure(Settings(socket=daemon.socket, vram_budget=BUDGET, staging_bytes=BUDGET))
    try:
        import toolkit.memory_management as package
        import toolkit.memory_management.manager as manager

        yield Toolkit(package, manager, root)
    finally:
        ai_toolkit.configure(None)
        launcher.uninstall()
        for name in [n for n in sys.modules if n == "toolkit" or n.startswith("toolkit.")]:
            del sys.modules[name]
        sys.path.remove(str(root))


# --- the replay ------------------------------------------------------------------------------


@dataclass
class Run:
    embeds: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    lora: list = field(default_factory=list)
    models: list = field(default_factory=list)  # the daemon's (name, bytes): attached, freed
    acquires: int = 0


def replay(arch: str, tk: Toolkit | None, client=None, steps: int = 3) -> Run:
    """ai-toolkit's calls for a FLUX LoRA job with ``layer_offloading: true`` (``tk`` given:
    weightstream's MemoryManager) or without it (``tk`` None: the same calls, and the
    unloader's ``free`` on a module that was never attached, as ai-toolkit makes them)."""
    from weightstream.integrations.ai_toolkit.manager import MemoryManager as Unattached

    MM = tk.manager.MemoryManager if tk else None  # flux2_model.py's import
    device, run = torch.device("cpu"), Run()
    # Flux2Model.load_model
    transformer = make_transformer(arch)
    transformer.to(device, dtype=DTYPE)
    if MM:
        MM.attach(transformer, device, offload_percent=1.0)
    transformer.to("cpu")  # model.low_vram
    # Flux2Model.load_te
    text_encoder = TextEncoder()
    text_encoder.to(device, dtype=DTYPE)
    if MM:
        MM.attach(text_encoder, device, offload_percent=1.0)
    # "Preparing Model"
    text_encoder.to(device)
    text_encoder.requires_grad_(False)
    text_encoder.eval()
    transformer = transformer.to(device)
    if client is not None:
        run.models.append(models(client))
    # BaseSDTrainProcess.run
    transformer.enable_gradient_checkpointing()
    text_encoder.requires_grad_(False)
    text_encoder.eval()
    transformer.to(device, dtype=DTYPE)
    transformer.requires_grad_(False)
    transformer.eval()
    network = LoRANetwork(transformer)
    network.force_to(device, torch.float32)
    network.apply_to()
    network.requires_grad_(True)  # prepare_grad_etc
    params = list(network.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    # SDTrainer: text embeddings cached, then toolkit/unloader.py's unload_text_encoder
    with torch.no_grad():
        run.embeds = [text_encoder(ids) for ids in prompts(steps)]
    (tk.package.MemoryManager if tk else Unattached).free(text_encoder)
    (tk.package.MemoryManager if tk else Unattached).release_cached_memory()
    if client is not None:
        run.models.append(models(client))
    sync = tk.package.sync_grad_transfers if tk else lambda: None
    for step, (embeds, pooled) in enumerate(run.embeds):
        out = transformer(**transformer_inputs(arch, step, embeds, pooled)).sample
        loss = out.float().pow(2).mean()
        loss.backward()
        sync()  # SDTrainer, before clipping and the step
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        run.losses.append(loss.detach())
        run.grads.append([p.grad.clone() for p in params])
        optimizer.step()
        optimizer.zero_grad()
    run.lora = [p.detach().clone() for p in params]
    if tk:
        handle = transformer._memory_manager.handle
        assert not any(g.resident for g in handle.session.groups), "every block streams"
        run.acquires = handle.stats()["acquires"]
        with pytest.raises(ValueError, match=r"streamed tensors are torch.bfloat16 in the daemon"):
            transformer.to(torch.float32)
        tk.package.MemoryManager.detach(transformer)
    return run


def models(client) -> dict[str, int]:
    listed = client.list_models()
    assert listed.store_bytes == sum(m.total_bytes for m in listed.models)
    return {m.name: m.total_bytes for m in listed.models}


def assert_equal_runs(ref: Run, got: Run):
    for step, ((a, ap), (b, bp)) in enumerate(zip(ref.embeds, got.embeds, strict=True)):
        assert torch.equal(a, b) and torch.equal(ap, bp), f"text embeddings differ at {step}"
    for step, (a, b) in enumerate(zip(ref.losses, got.losses, strict=True)):
        assert torch.equal(a, b), f"loss differs at step {step}: {a.item()} != {b.item()}"
    for step, (a, b) in enumerate(zip(ref.grads, got.grads, strict=True)):
        for i, (ga, gb) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(ga, gb), f"LoRA gradient {i} differs at step {step}"
    for i, (a, b) in enumerate(zip(ref.lora, got.lora, strict=True)):
        assert torch.equal(a, b), f"trained LoRA parameter {i} differs"


@pytest.mark.parametrize("arch", ["flux", "flux2"])
def test_ai_toolkit_order_of_operations_is_bit_exact(daemon, toolkit, arch):
    ref = replay(arch, None)
    got = replay(arch, toolkit, daemon.client)
    assert got.acquires > 0
    assert_equal_runs(ref, got)
    attached, freed = got.models
    te = sum(
        p.numel() * 2
        for m in TextEncoder().modules()
        if isinstance(m, nn.Linear)
        for p in m.parameters()
    )
    assert attached["TextEncoder"] == te
    del attached["TextEncoder"]
    assert freed == attached, "free released the text encoder's copy in the daemon, only it"
    assert daemon.client.list_models().store_bytes == 0, "detach released the transformer's"
    assert daemon.client.list_sessions() == []


# --- the LoRA before or after attach ---------------------------------------------------------


def add_lora(kind: str, model: nn.Module):
    """peft's LoRA (layers created on the base weight's device and dtype) or an ai-toolkit
    network (forwards hooked through ``org_forward``); seeded the same for both runs."""
    torch.manual_seed(3)
    if kind == "peft":
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "proj_mlp"])
        inject_adapter_in_model(config, model)
        return [p for n, p in model.named_parameters() if "lora_" in n]
    network = LoRANetwork(model)
    network.force_to("cpu", torch.float32)
    network.apply_to()
    model.network = [network]  # keep it alive, outside the model
    return list(network.parameters())


def train(model, params, steps=3) -> Run:
    run, optimizer = Run(), torch.optim.AdamW(params, lr=1e-2)
    g = torch.Generator().manual_seed(9)
    for step in range(steps):
        embeds = torch.randn(1, 8, 32, generator=g).to(DTYPE)
        pooled = torch.randn(1, 16, generator=g).to(DTYPE)
        out = model(**transformer_inputs("flux", step, embeds, pooled)).sample
        loss = out.float().pow(2).mean()
        loss.backward()
        run.losses.append(loss.detach())
        run.grads.append([p.grad.clone() for p in params])
        optimizer.step()
        optimizer.zero_grad()
    run.lora = [p.detach().clone() for p in params]
    return run


@pytest.mark.parametrize("kind", ["peft", "network"])
@pytest.mark.parametrize("order", ["lora_first", "attach_first"])
def test_the_lora_may_come_before_or_after_attach(daemon, toolkit, kind, order):
    """Before the fix, peft's LoRA added after attach was created on the placeholders' meta
    device ("expected device meta but got cpu" in backward)."""
    ref = make_transformer("flux").to(DTYPE).requires_grad_(False)
    streamed = copy.deepcopy(ref)
    ref_params = add_lora(kind, ref)
    if order == "lora_first":
        params = add_lora(kind, streamed)
    toolkit.package.MemoryManager.attach(streamed, "cpu")
    if order == "attach_first":
        params = add_lora(kind, streamed)
    assert {(p.device.type, p.dtype) for p in params} == {
        (p.device.type, p.dtype) for p in ref_params
    }
    handle = streamed._memory_manager.handle
    if kind == "network":
        org = vars(streamed.network[0].loras[0])["org_forward"]
        assert isinstance(org, StreamedForward), "weightstream runs inside org_forward"
    assert_equal_runs(train(ref, ref_params), train(streamed, params))
    assert handle.stats()["acquires"] > 0
    toolkit.package.MemoryManager.detach(streamed)


def test_placeholders_have_the_devices_identity_and_refuse_use(daemon, toolkit):
    model = make_transformer("flux").to(DTYPE)
    toolkit.package.MemoryManager.attach(model, "cpu")
    w = model.transformer_blocks[0].attn.to_q.weight
    assert isinstance(w, wst.Placeholder) and (w.device.type, w.dtype) == ("cpu", DTYPE)
    assert w.requires_grad, "still as the loader left it, until the trainer freezes the model"
    with pytest.raises(RuntimeError, match="'transformer_blocks.0.attn.to_q.weight' is streamed"):
        w.sum()
    x = transformer_inputs(
        "flux", 0, torch.zeros(1, 8, 32, dtype=DTYPE), torch.zeros(1, 16, dtype=DTYPE)
    )
    with pytest.raises(RuntimeError, match="streams frozen weights only"):
        model(**x)  # a streamed weight that requires grad is never trained silently
    model.requires_grad_(False)
    model(**x)
    toolkit.package.MemoryManager.free(model)
    assert all(p.device.type == "meta" for p in model.parameters())


# --- text encoder: attach, encode, free ------------------------------------------------------


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_free_releases_the_text_encoders_copy_and_memory(daemon, toolkit):
    """64 MiB of embeddings stay in the trainer, 4 MiB of Linear weights stream (the session
    maps less than 8 MiB of the daemon's memory): after ``free`` and ``release_cached_memory``
    the daemon holds nothing and the trainer's RSS has dropped by the embeddings."""
    ai_toolkit.configure(Settings(socket=daemon.socket))  # the default budget
    te = TextEncoder(vocab=65536, dim=256, out=64, pooled=64).requires_grad_(False)
    MM = toolkit.package.MemoryManager
    MM.attach(te, "cpu")
    opened = te._memory_manager.handle.session.opened
    assert opened.staging_bytes + opened.resident_bytes < 8 << 20
    with torch.no_grad():
        te(torch.randint(0, 65536, (2, 16)))
    assert daemon.client.list_models().store_bytes >= 4 << 20
    gc.collect()
    before = rss()
    MM.free(te)
    MM.release_cached_memory()
    dropped = before - rss()
    assert dropped > 60 << 20, f"RSS fell by only {dropped >> 20} MiB"
    listed = daemon.client.list_models()
    assert listed.models == [] and listed.store_bytes == 0
    assert daemon.client.list_sessions() == []
    assert all(p.device.type == "meta" for p in te.parameters())
    assert not hasattr(te, "_memory_manager")


# --- quantized bases are refused --------------------------------------------------------------


def quantized(module_name: str, type_name: str):
    """A stand-in for a quantizer's tensor subclass, named as the library names it."""
    cls = type(type_name, (torch.Tensor,), {"__module__": module_name})
    return lambda t: torch.Tensor._make_subclass(cls, t)


class OstrisLinear(nn.Linear):
    is_ostris_quantized = True


OstrisLinear.__module__ = "toolkit.util.ostris_quant"


@pytest.mark.parametrize(
    "case,want",
    [
        ("torchao", r"^cannot stream '1': its weight is a Float8Tensor made by torchao"),
        (
            "quanto",
            r"^cannot stream '1': its weight is a WeightQBytesTensor made by optimum-quanto",
        ),
        (
            "ostris",
            r"^cannot stream '1': it is ai-toolkit's OstrisLinear without a quantizer",
        ),
    ],
)
def test_quantized_weights_are_refused_before_upload(daemon, toolkit, case, want):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    if case == "torchao":
        make = quantized("torchao.quantization.quantize_.workflows.float8", "Float8Tensor")
        model[1].weight = nn.Parameter(make(model[1].weight.detach()), requires_grad=False)
    elif case == "quanto":
        make = quantized("optimum.quanto.tensor.weights.qbytes", "WeightQBytesTensor")
        model[1].weight = nn.Parameter(make(model[1].weight.detach()), requires_grad=False)
    else:
        model[1] = OstrisLinear(64, 64)
    with pytest.raises(wst.QuantizedWeight, match=want):
        toolkit.package.MemoryManager.attach(model, "cpu")
    with pytest.raises(wst.QuantizedWeight, match=want):
        wst.attach(model, "cpu", client=daemon.client, min_bytes=0)
    assert daemon.client.list_models().models == [], "nothing was uploaded"
    assert not hasattr(model, "_memory_manager")
    # Kept on the device when ignored: the rest streams.
    manager = toolkit.package.MemoryManager.attach(model, "cpu", ignore_modules=[model[1]])
    assert set(manager.handle.streamed) == {"0", "2"}
    toolkit.package.MemoryManager.free(model)


def test_offload_percent_and_ignore_modules(daemon, toolkit):
    """The largest layers making up the percent stream, by size then name; ignored modules
    and everything in them stay; the network's own trainable layers never stream."""
    model = nn.Sequential(
        nn.Linear(64, 256), nn.Linear(256, 64), nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    )
    MM = toolkit.package.MemoryManager
    manager = MM.attach(model, "cpu", offload_percent=0.5, ignore_modules=[model[2]])
    assert set(manager.handle.streamed) == {"0"}  # alone half of the bytes of "0" and "1"
    assert MM.attach(model, "cpu") is None, "attached already: left as it is"
    MM.free(model)
    network = LoRANetwork(make_transformer("flux"))
    network.requires_grad_(True)
    manager = MM.attach(network, "cpu")
    assert manager.handle is None and all(p.requires_grad for p in network.parameters())
    MM.detach(network)
    assert daemon.client.list_models().models == []


# --- settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "section,env,want",
    [
        (None, {}, Settings()),
        (
            {"vram_budget": "8GiB", "staging_bytes": 1024},
            {},
            Settings(vram_budget=8 << 30, staging_bytes=1024),
        ),
        (
            {"vram_budget": "8GiB"},
            {"WEIGHTSTREAM_BUDGET": "512 MiB"},
            Settings(vram_budget=512 << 20),
        ),
        (
            {"socket": "/a.sock", "group_by": "layer"},
            {},
            Settings(socket="/a.sock", group_by="layer"),
        ),
        (
            {"lookahead": "none", "min_bytes": "1.5MB"},
            {"WEIGHTSTREAM_LOOKAHEAD": "4"},
            Settings(lookahead=4, min_bytes=1_500_000),
        ),
        ({"quantize": "fp8"}, {}, Settings(quantize="fp8")),
        ({"quantize": "fp8"}, {"WEIGHTSTREAM_QUANTIZE": "none"}, Settings()),
        ({}, {"WEIGHTSTREAM_QUANTIZE": "fp8_e4m3_block64"}, Settings(quantize="fp8")),
        ({"dequantize": "group"}, {}, Settings(dequantize="group")),
        (
            {"dequantize": "group"},
            {"WEIGHTSTREAM_DEQUANTIZE": "layer"},
            Settings(dequantize="layer"),
        ),
        (
            {"dequantize": "block"},
            {},
            "weightstream.dequantize: 'block': expected one of auto, layer, group",
        ),
        ({"early_release": True}, {}, Settings(early_release=True)),
        ({"early_release": True}, {"WEIGHTSTREAM_EARLY_RELEASE": "no"}, Settings()),
        (
            {"early_release": "soon"},
            {},
            "weightstream.early_release: 'soon': expected true or false",
        ),
        (
            {"quantize": "int4"},
            {},
            "weightstream.quantize: 'int4': expected 'fp8' or 'none'",
        ),
        (
            {"compute": "int8", "grad_compute": "bf16", "rotation": 64},
            {},
            Settings(compute="int8", grad_compute="bf16", rotation=64),
        ),
        (
            {"compute": "int8", "grad_compute": "bf16"},
            {"WEIGHTSTREAM_COMPUTE": "fp8", "WEIGHTSTREAM_GRAD_COMPUTE": "none"},
            Settings(compute="fp8"),
        ),
        ({}, {"WEIGHTSTREAM_ROTATION": "128"}, Settings(rotation=128)),
        (
            {"compute": "fp4"},
            {},
            "weightstream.compute: 'fp4': expected one of bf16, fp8, int8",
        ),
        (
            {},
            {"WEIGHTSTREAM_GRAD_COMPUTE": "int4"},
            "WEIGHTSTREAM_GRAD_COMPUTE: 'int4': expected one of bf16, fp8, int8",
        ),
        ({"rotation": "big"}, {}, "weightstream.rotation: 'big': expected 0 or a block size"),
        ({"coding": "rans8"}, {}, Settings(coding="rans8")),
        ({"coding": "rans8"}, {"WEIGHTSTREAM_CODING": "none"}, Settings()),
        ({"coding": "zstd"}, {}, "weightstream.coding: 'zstd': expected one of none, rans8"),
        (
            {"trainable": "host", "trainable_delay": False},
            {},
            Settings(trainable="host", trainable_delay=False),
        ),
        (
            {"trainable": "host"},
            {"WEIGHTSTREAM_TRAINABLE": "device", "WEIGHTSTREAM_TRAINABLE_DELAY": "0"},
            Settings(trainable_delay=False),
        ),
        ({"trainable_delay": False}, {"WEIGHTSTREAM_TRAINABLE_DELAY": "Yes"}, Settings()),
        ({"trainable_master": "none"}, {}, Settings(trainable_master="none")),
        (
            {"trainable_master": "none"},
            {"WEIGHTSTREAM_TRAINABLE_MASTER": "fp32"},
            Settings(trainable_master="fp32"),
        ),
        (
            {},
            {"WEIGHTSTREAM_TRAINABLE_MASTER": "bf16"},
            "WEIGHTSTREAM_TRAINABLE_MASTER: 'bf16': expected one of fp32, none",
        ),
        (
            {"trainable": "gpu"},
            {},
            "weightstream.trainable: 'gpu': expected one of device, host",
        ),
        (
            {},
            {"WEIGHTSTREAM_TRAINABLE_DELAY": "maybe"},
            "WEIGHTSTREAM_TRAINABLE_DELAY: 'maybe': expected true or false",
        ),
        ({"budget": 1}, {}, "weightstream.budget: unknown setting"),
        ({"vram_budget": "8 GiBs"}, {}, "weightstream.vram_budget: '8 GiBs' is not a size"),
        (
            {},
            {"WEIGHTSTREAM_GROUP_BY": "rows"},
            "WEIGHTSTREAM_GROUP_BY: 'rows': expected 'block' or 'layer'",
        ),
        ({"lookahead": -1}, {}, "weightstream.lookahead: -1: expected none, 0 or more"),
        ("8GiB", {}, "weightstream: expected a mapping of settings"),
    ],
)
def test_settings(section, env, want):
    if isinstance(want, Settings):
        assert Settings.load(section, env) == want
    else:
        with pytest.raises(ValueError) as e:
            Settings.load(section, env)
        assert str(e.value).startswith(want), str(e.value)


def test_the_settings_default_socket_is_the_client_s(monkeypatch, tmp_path):
    """No socket in the job's section or the environment: the manager connects where every
    weightstream client looks (``weightstream.client.socket_path``)."""
    monkeypatch.delenv("WEIGHTSTREAM_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    settings = Settings.load({})
    assert settings.socket is None
    assert weightstream.connect(settings.socket).socket == socket_path()
    named = Settings.load({"socket": "/srv/ws.sock"}, {})
    assert weightstream.connect(named.socket).socket == "/srv/ws.sock"


def test_other_modules_of_the_package_say_what_is_served(toolkit):
    with pytest.raises(ImportError, match="serves toolkit.memory_management .* no such module"):
        import toolkit.memory_management.test_memory_manager  # noqa: F401
