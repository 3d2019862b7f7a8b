"""ai-toolkit's loading with ``layer_offloading: true`` under weightstream-aitk
(``weightstream.integrations.ai_toolkit.loading``), on the CPU.

The loaders here re-enact, in their order, the device moves of ostris/ai-toolkit 27a03a91's:
- ``extensions_built_in/diffusion_models/flux2/flux2_model.py`` ``load_model``: the
  transformer moved to the device (``quantize: false``) or quantized block by block
  (``toolkit/util/quantize.py`` ``quantize_model``: each block ``.to(device, dtype)``, quantized,
  ``.to("cpu")``), ``MemoryManager.attach``, ``transformer.to("cpu")`` under ``low_vram``;
  ``load_te``: the text encoder ``.to(device, dtype)``, quantized, attached; "Preparing Model":
  ``text_encoder.to("cpu")`` / ``pipe.transformer.to("cpu")`` under ``low_vram``.
- ``toolkit/stable_diffusion_model.py`` ``load_model``, FLUX.1 branch: the transformer kept on
  the CPU under ``low_vram`` and quantized there, then ``transformer.to(device)``; T5
  ``.to(device, dtype)`` then quantized; CLIP ``.to(device, dtype)``; "Preparing Model" moves
  them all to the device again, ``vae.to(device)``, ``unet.to(device, dtype)``; no
  ``MemoryManager`` call.
"Quantizing" here replaces each Linear weight by a new tensor on the device the weight is on (as
torchao's ``quantize_`` does), so the tests see where quantization ran.

Without a GPU the accelerator is torch's ``meta`` device for the guard's own tests (a weight
that reached it would have lost its data); the tests that train against the daemon's host
backend run on the CPU, where nothing is held, and check what the launcher attached and that
training equals the same job without offloading bit for bit.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from weightstream.integrations import ai_toolkit
from weightstream.integrations.ai_toolkit import launcher, loading
from weightstream.integrations.ai_toolkit.settings import Settings

from tests.python.ai_toolkit.test_ai_toolkit import (
    DTYPE,
    LoRANetwork,
    Run,
    TextEncoder,
    assert_equal_runs,
    make_transformer,
    prompts,
    transformer_inputs,
)
from tests.python.torch import aitk_layouts

META = torch.device("meta")


def on_meta(device: torch.device) -> bool:
    return device.type == "meta"


def quantize_linears(module: nn.Module, where: list):
    """Stands for torchao's ``quantize_``: each Linear's weight replaced by a new tensor made
    where the weight is (recorded in ``where``)."""
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            where.append((name, m.weight.device.type))
            m.weight = nn.Parameter(m.weight.detach().clone(), requires_grad=False)


class Model(nn.Module):
    """Every kind of tensor a loader moves: Linear and Conv2d layers (held), a norm, an
    embedding, a buffer (moved). The blocks hold only layers: they go to ``meta`` and come
    back (``meta`` is one way for anything else)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(2)
        )
        self.conv = nn.Conv2d(2, 4, 3)
        self.embed = nn.Embedding(5, 8)
        self.register_buffer("freqs", torch.arange(4.0))


def layers(model) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}


# --- the guard ----------------------------------------------------------------------------------


@pytest.fixture
def guard():
    g = loading.PlacementGuard(is_accelerator=on_meta)
    g.install()
    yield g
    g.uninstall()
    assert nn.Module.to is TORCH_TO and nn.Module.cuda is TORCH_CUDA


TORCH_TO, TORCH_CUDA = nn.Module.to, nn.Module.cuda


def test_the_guard_keeps_linear_and_conv_weights_on_the_cpu_and_moves_the_rest(guard):
    model, ref = Model(), Model()
    model.to(META, dtype=DTYPE)
    for name, p in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0])
        want = "cpu" if isinstance(owner, (nn.Linear, nn.Conv2d)) else "meta"
        assert (p.device.type, p.dtype) == (want, DTYPE), name
        if want == "cpu":  # cast as asked, data intact
            assert torch.equal(p, ref.get_parameter(name).to(DTYPE)), name
    assert model.freqs.device.type == "meta"
    assert {id(m) for m, _ in guard.pending()} == {id(m) for m in layers(model).values()}
    assert guard.pending_bytes() == sum(
        p.nbytes for m in layers(model).values() for p in m.parameters()
    )


class AraNetwork(nn.Module):
    """ai-toolkit's accuracy recovery adapter as ``quantize_model`` makes it (27a03a91): a
    ``LoRASpecialNetwork`` of ``LoRAModule``s (each holding the layer it wraps in
    ``org_module``), ``force_to(device_torch)``, then ``_update_torch_multiplier``: the
    multiplier made where the first module's ``lora_down`` is; its forward multiplies the
    LoRA's output by it."""

    def __init__(self, layer: nn.Linear, rank: int = 2):
        super().__init__()
        self.ara = aitk_layouts.Ara(layer, rank)
        self.torch_multiplier = torch.ones(1)

    def force_to(self, device, dtype):
        self.to(device, dtype)
        self.torch_multiplier = torch.ones(1).to(self.ara.lora_down.weight.device, dtype=dtype)


def test_an_adapters_layers_move_as_asked_the_base_layer_is_held(guard):
    """The ARA on the device with its multiplier, the layer it wraps held on the CPU (with the
    ARA's layers held, the multiplier stayed on the CPU and the ARA's forward on the device
    multiplied tensors of two devices)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    network = AraNetwork(model[1])
    network.force_to(META, DTYPE)
    assert {p.device.type for p in network.parameters()} == {"meta"}
    assert network.torch_multiplier.device.type == "meta"
    model.to(META)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert {id(m) for m, _ in guard.pending()} == {id(model[0]), id(model[1])}


def test_cuda_is_guarded_too(guard):
    """``.cuda()`` on a machine without CUDA: every weight is held, nothing reaches torch."""
    g = loading.PlacementGuard()  # the default: any device but cpu and meta is held
    guard.uninstall()
    g.install()
    try:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        model.cuda(0)
        assert all(p.device.type == "cpu" for p in model.parameters())
        assert [d for _, d in g.pending()] == [torch.device("cuda", 0)] * 2
    finally:
        g.uninstall()
        guard.install()


def test_the_last_destination_wins_whatever_the_order(guard):
    """quantize_model's round trip (each block to the device, quantized, back to the CPU), the
    whole model to the device, low_vram's move back, a block sent again: ``finish`` places each
    layer still held where it was sent last, the quantized weight included."""
    model, where = Model(), []
    for block in model.blocks:
        block.to(META, dtype=DTYPE, non_blocking=True)
        quantize_linears(block, where)
        block.to("cpu")
    assert where == [("0", "cpu"), ("2", "cpu")] * 2, "quantized where the weights are"
    assert guard.pending() == []
    model.blocks.to(META)
    model.blocks.to("cpu")  # low_vram
    model.blocks[1].to(META)
    assert {id(m) for m, _ in guard.pending()} == {id(m) for m in layers(model.blocks[1]).values()}
    assert guard.finish() == 2
    assert {n for n, p in model.named_parameters() if p.device.type == "meta"} == {
        "blocks.1.0.weight",
        "blocks.1.0.bias",
        "blocks.1.2.weight",
        "blocks.1.2.bias",
    }
    assert guard.pending() == []


def test_a_released_module_is_placed_by_whoever_attached_it(guard):
    model = Model()
    model.to(META)
    guard.release(model.blocks[0])
    with guard.suspended():
        model.blocks[0].to(META)  # attach's own moves: as torch moves them
    assert all(p.device.type == "meta" for p in model.blocks[0].parameters())
    assert model.proj.weight.device.type == "cpu"
    assert guard.finish() == 4  # proj, conv and the second block's two Linear layers
    assert model.proj.weight.device.type == "meta"


def test_a_failed_move_leaves_every_parameter_in_place(guard):
    class Refuses(nn.Module):
        def _apply(self, fn, recurse=True):
            raise RuntimeError("out of memory")

    model = nn.Sequential(nn.Linear(4, 4), Refuses())
    weight = model[0].weight
    with pytest.raises(RuntimeError, match="out of memory"):
        model.to(META)
    assert model[0].weight is weight and model[0].bias is not None
    assert guard.pending() == []


# --- a loading phase, with a recording manager --------------------------------------------------


class RecordingManager:
    """Stands for MemoryManager: records where the attached module's streamable weights were
    when attach got them, and places the module as weightstream's attach does (streamed
    weights stay with the manager, here on the CPU; the rest moves to the device)."""

    calls: list = []

    @classmethod
    def attach(cls, module, device, offload_percent=1.0, ignore_modules=()):
        if hasattr(module, "_memory_manager"):
            return None
        with loading.attaching(module):
            where = {
                n: p.device.type
                for n, p in module.named_parameters()
                if isinstance(module.get_submodule(n.rpartition(".")[0]), (nn.Linear, nn.Conv2d))
            }
            cls.calls.append((type(module).__name__, offload_percent, where))
            for m in module.modules():
                if not isinstance(m, (nn.Linear, nn.Conv2d)):
                    m._apply(lambda t: t.to(device), recurse=False)
            module._memory_manager = SimpleNamespace(handle=None)
            module.to = lambda *args, **kwargs: module  # the manager's own to (here: stays)
            return module._memory_manager


def config(**changes):
    values = dict(
        layer_offloading=True,
        layer_offloading_transformer_percent=1.0,
        layer_offloading_text_encoder_percent=1.0,
        low_vram=True,
        quantize=True,
    )
    values.update(changes)
    return SimpleNamespace(**values)


class Flux2Loader:
    """flux2_model.py's load_model and load_te, in order, with ``MemoryManager``."""

    def __init__(self, device, model_config, manager):
        self.device_torch, self.model_config, self.manager = device, model_config, manager
        self.quantized_on: list = []

    def load_model(self):
        c, device = self.model_config, self.device_torch
        transformer = Model()
        if c.quantize:  # quantize_model: block by block on the device, back to the CPU
            for block in transformer.blocks:
                block.to(device, dtype=DTYPE, non_blocking=True)
                quantize_linears(block, self.quantized_on)
                block.to("cpu")
            quantize_linears(transformer.proj, self.quantized_on)  # "quantizing extras"
        else:
            transformer.to(device, dtype=DTYPE)
        if c.layer_offloading and c.layer_offloading_transformer_percent > 0:
            self.manager.attach(transformer, device, c.layer_offloading_transformer_percent)
        if c.low_vram:
            transformer.to("cpu")
        text_encoder = Model()
        text_encoder.to(device, dtype=DTYPE)
        quantize_linears(text_encoder, self.quantized_on)
        if c.layer_offloading and c.layer_offloading_text_encoder_percent > 0:
            self.manager.attach(text_encoder, device, c.layer_offloading_text_encoder_percent)
        self.vae = Model()  # loaded on the CPU, moved by the trainer later
        text_encoder.to("cpu" if c.low_vram else device)
        self.unet, self.text_encoder = transformer, [text_encoder]


class Flux1Loader(Flux2Loader):
    """stable_diffusion_model.py's FLUX.1 branch: no MemoryManager call."""

    def load_model(self):
        c, device = self.model_config, self.device_torch
        transformer = Model()
        if not c.low_vram:
            transformer.to(device, dtype=DTYPE)
        quantize_linears(transformer, self.quantized_on)
        transformer.to(device)
        t5 = Model()
        t5.to(device, dtype=DTYPE)
        quantize_linears(t5, self.quantized_on)
        clip = Model()
        clip.to(device, dtype=DTYPE)
        transformer.to(device)
        clip.to(device)
        t5.to(device)
        self.vae = Model()
        self.vae.to(device, dtype=DTYPE)
        transformer.to(device, dtype=DTYPE)
        self.unet, self.text_encoder = transformer, [clip, t5]


@pytest.mark.parametrize("quantize", [True, False])
def test_flux2s_loader_attaches_with_its_weights_on_the_cpu(capsys, quantize):
    RecordingManager.calls = []
    sd = Flux2Loader(META, config(quantize=quantize), RecordingManager)
    loading.run_load_model(sd, sd.load_model, RecordingManager, is_accelerator=on_meta)
    assert nn.Module.to is TORCH_TO, "the guard is gone once loading is over"
    assert [(m, p) for m, p, _ in RecordingManager.calls] == [("Model", 1.0), ("Model", 1.0)]
    for _, _, where in RecordingManager.calls:
        assert set(where.values()) == {"cpu"}, "every streamable weight reached attach on the CPU"
    assert {d for _, d in sd.quantized_on} == {"cpu"}, "quantized on the CPU"
    assert all(p.device.type == "cpu" for p in sd.vae.parameters()), "never sent anywhere"
    out = capsys.readouterr().out.strip()
    assert out.startswith("weightstream-aitk: Flux2Loader loaded in ")
    assert (
        "attached: transformer Model (by ai-toolkit's loader, 0 layers streamed); "
        "text encoder Model (by ai-toolkit's loader, 0 layers streamed); " in out
    )
    assert "peak device memory while loading: no device memory used (meta); " in out
    assert "; host memory peak: this process " in out
    assert out.endswith("; read from the files by the trainer: 0.00 GB")
    report = loading.REPORTS[-1]
    assert report.placed_after == 0 and report.held_bytes > 0


@pytest.mark.parametrize(
    "percents,attached",
    [
        ((1.0, 1.0), ["transformer", "text encoder", "text encoder"]),
        ((0.5, 0.0), ["transformer"]),
        ((0.0, 0.25), ["text encoder", "text encoder"]),
    ],
)
def test_flux1s_loader_gets_its_models_attached_after_loading(percents, attached):
    RecordingManager.calls = []
    c = config(
        layer_offloading_transformer_percent=percents[0],
        layer_offloading_text_encoder_percent=percents[1],
    )
    sd = Flux1Loader(META, c, RecordingManager)
    loading.run_load_model(sd, sd.load_model, RecordingManager, is_accelerator=on_meta)
    report = loading.REPORTS[-1]
    assert [a["role"] for a in report.attached] == attached
    assert {a["by"] for a in report.attached} == {"by weightstream-aitk"}
    want_percents = [percents[0] if r == "transformer" else percents[1] for r in attached]
    assert [p for _, p, _ in RecordingManager.calls] == want_percents
    for _, _, where in RecordingManager.calls:
        assert set(where.values()) == {"cpu"}
    # What was not attached ends where the loader sent it: the VAE, and models at percent 0.
    unattached = [m for m in [sd.unet, *sd.text_encoder] if not hasattr(m, "_memory_manager")]
    for module in [sd.vae, *unattached]:
        assert all(p.device.type == "meta" for p in module.parameters())
    assert report.placed_after == len(layers(Model())) * (1 + len(unattached))


def test_without_layer_offloading_loading_is_untouched():
    RecordingManager.calls = []
    reports = len(loading.REPORTS)
    sd = Flux1Loader(META, config(layer_offloading=False), RecordingManager)
    loading.run_load_model(sd, sd.load_model, RecordingManager, is_accelerator=on_meta)
    for module in (sd.unet, *sd.text_encoder, sd.vae):
        assert {p.device.type for p in module.parameters()} == {"meta"}, "torch's own moves"
    assert {d for _, d in sd.quantized_on} == {"cpu", "meta"}
    assert RecordingManager.calls == [] and len(loading.REPORTS) == reports


def test_a_failing_loader_leaves_torch_as_it_was():
    class Fails(Flux2Loader):
        def load_model(self):
            Model().to(self.device_torch)
            raise OSError("flux2-dev.safetensors: no such file")

    sd = Fails(META, config(), RecordingManager)
    with pytest.raises(OSError, match="no such file"):
        loading.run_load_model(sd, sd.load_model, RecordingManager, is_accelerator=on_meta)
    assert nn.Module.to is TORCH_TO and loading.ACTIVE is None


# --- through the launcher, against the daemon ----------------------------------------------------

BASE_MODEL = '''
import torch

class BaseModel:
    """ai-toolkit's toolkit/models/base_model.py, reduced: the trainer's handle on a model."""
    def __init__(self, device, model_config, dtype="bf16", **kwargs):
        self.device_torch = torch.device(device)
        self.model_config = model_config
        self.model = None
        self.text_encoder = None

    @property
    def unet(self):
        return self.model

    def load_model(self):
        raise NotImplementedError
'''

STABLE_DIFFUSION = '''
import torch

class StableDiffusion:
    """ai-toolkit's toolkit/stable_diffusion_model.py, reduced."""
    def __init__(self, device, model_config, dtype="fp16", **kwargs):
        self.device_torch = torch.device(device)
        self.model_config = model_config
        self.unet = None
        self.text_encoder = None

    def load_model(self):
        raise NotImplementedError
'''


@pytest.fixture
def aitk_models(toolkit):
    """ai-toolkit's model base classes beside the ``toolkit`` fixture's package, imported
    through the launcher's finders."""
    (toolkit.root / "toolkit" / "models").mkdir()
    (toolkit.root / "toolkit" / "models" / "__init__.py").write_text("")
    (toolkit.root / "toolkit" / "models" / "base_model.py").write_text(BASE_MODEL)
    (toolkit.root / "toolkit" / "stable_diffusion_model.py").write_text(STABLE_DIFFUSION)
    from toolkit.models.base_model import BaseModel
    from toolkit.stable_diffusion_model import StableDiffusion

    return SimpleNamespace(BaseModel=BaseModel, StableDiffusion=StableDiffusion, tk=toolkit)


def write_toolkit(tk, loader: tuple[str, str], **util: str):
    """Writes stand-ins of ai-toolkit's modules into ``tk``'s package: ``toolkit/util/NAME.py``
    for each of ``util`` (``quantize=...``) and the loader, ``(name, source)``, as
    ``toolkit/models/NAME.py``."""
    root = tk.root / "toolkit"
    (root / "util").mkdir()
    (root / "util" / "__init__.py").write_text("")
    for name, text in util.items():
        (root / "util" / f"{name}.py").write_text(text)
    (root / "models" / f"{loader[0]}.py").write_text(loader[1])


def flux1_on(base):
    class Flux1(base):
        """The FLUX.1 branch with a tiny diffusers FLUX.1 transformer and two text encoders."""

        def load_model(self):
            device = self.device_torch
            transformer = make_transformer("flux")
            transformer.to(device)
            te2, te1 = TextEncoder(), TextEncoder()
            te2.to(device, dtype=DTYPE)
            te1.to(device, dtype=DTYPE)
            transformer.to(device, dtype=DTYPE)
            for te in (te1, te2):
                te.to(device)
                te.requires_grad_(False)
                te.eval()
            self.unet, self.text_encoder = transformer, [te1, te2]

    return Flux1


def train_flux1(sd, steps=3) -> Run:
    """BaseSDTrainProcess / SDTrainer after load_model, as in test_ai_toolkit's replay."""
    run, device = Run(), sd.device_torch
    transformer = sd.unet
    transformer.to(device, dtype=DTYPE)
    transformer.requires_grad_(False)
    transformer.eval()
    network = LoRANetwork(transformer)
    network.force_to(device, torch.float32)
    network.apply_to()
    network.requires_grad_(True)
    params = list(network.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    with torch.no_grad():
        run.embeds = [sd.text_encoder[0](ids) for ids in prompts(steps)]
    for step, (embeds, pooled) in enumerate(run.embeds):
        out = transformer(**transformer_inputs("flux", step, embeds, pooled)).sample
        loss = out.float().pow(2).mean()
        loss.backward()
        run.losses.append(loss.detach())
        run.grads.append([p.grad.clone() for p in params])
        optimizer.step()
        optimizer.zero_grad()
    run.lora = [p.detach().clone() for p in params]
    return run


def test_flux1_through_the_launcher_streams_and_trains_bit_exact(daemon, aitk_models, capsys):
    Flux1 = flux1_on(aitk_models.StableDiffusion)
    ref = Flux1("cpu", config(layer_offloading=False))
    ref.load_model()
    assert "load_model" in vars(ref), "the launcher's hook wrapped the instance's load_model"
    sd = Flux1("cpu", config(layer_offloading_text_encoder_percent=1.0))
    sd.load_model()
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("weightstream-aitk: Flux1 loaded in "), line
    assert "attached: transformer FluxTransformer2DModel (by weightstream-aitk, " in line
    assert line.count("text encoder TextEncoder (by weightstream-aitk, 6 layers streamed)") == 2
    for module in (sd.unet, *sd.text_encoder):
        assert module._memory_manager.handle.streamed, type(module).__name__
    names = {m.name for m in daemon.client.list_models().models}
    assert names == {"FluxTransformer2DModel", "TextEncoder"}
    got = train_flux1(sd)
    assert_equal_runs(train_flux1(ref), got)
    assert sd.unet._memory_manager.handle.stats()["acquires"] > 0
    for module in (sd.unet, *sd.text_encoder):
        aitk_models.tk.package.MemoryManager.free(module)
    assert daemon.client.list_models().models == []


def test_a_loader_that_attaches_is_not_attached_twice(daemon, aitk_models, capsys):
    class Flux2(aitk_models.BaseModel):
        def load_model(self):
            from toolkit.memory_management.manager import MemoryManager

            transformer = make_transformer("flux2").to(self.device_torch, dtype=DTYPE)
            MemoryManager.attach(transformer, self.device_torch, offload_percent=1.0)
            transformer.to("cpu")
            self.model, self.text_encoder = transformer, [TextEncoder().to(dtype=DTYPE)]

    sd = Flux2("cpu", config(layer_offloading_text_encoder_percent=0.0))
    sd.load_model()
    report = loading.REPORTS[-1]
    assert [(a["role"], a["by"]) for a in report.attached] == [
        ("transformer", "by ai-toolkit's loader")
    ]
    assert [m.name for m in daemon.client.list_models().models] == ["Flux2Transformer2DModel"]
    assert not hasattr(sd.text_encoder[0], "_memory_manager"), "percent 0: left on the device"
    aitk_models.tk.package.MemoryManager.free(sd.model)


def test_model_classes_imported_before_the_launcher_are_hooked_too(tmp_path):
    root = tmp_path / "early"
    (root / "toolkit" / "models").mkdir(parents=True)
    (root / "toolkit" / "__init__.py").write_text("")
    (root / "toolkit" / "models" / "__init__.py").write_text("")
    (root / "toolkit" / "models" / "base_model.py").write_text(BASE_MODEL)
    sys.path.insert(0, str(root))
    try:
        from toolkit.models.base_model import BaseModel

        launcher.install()
        assert getattr(BaseModel, "_weightstream_loading", False)
        assert "load_model" in vars(BaseModel("cpu", config()))
    finally:
        launcher.uninstall()
        for name in [n for n in sys.modules if n == "toolkit" or n.startswith("toolkit.")]:
            del sys.modules[name]
        sys.path.remove(str(root))


def test_a_renamed_model_class_is_an_error_naming_it(tmp_path):
    root = tmp_path / "renamed"
    (root / "toolkit").mkdir(parents=True)
    (root / "toolkit" / "__init__.py").write_text("")
    (root / "toolkit" / "stable_diffusion_model.py").write_text("class StableDiffusionXL: ...\n")
    sys.path.insert(0, str(root))
    launcher.install()
    try:
        with pytest.raises(ImportError, match="toolkit.stable_diffusion_model has no StableDiff"):
            import toolkit.stable_diffusion_model  # noqa: F401
    finally:
        launcher.uninstall()
        for name in [n for n in sys.modules if n == "toolkit" or n.startswith("toolkit.")]:
            del sys.modules[name]
        sys.path.remove(str(root))
        ai_toolkit.configure(None)


@pytest.fixture
def toolkit(tmp_path, daemon):
    """test_ai_toolkit's fixture: a ``toolkit`` package whose own memory manager fails if
    imported, the launcher's finders installed, each session's budget all staging."""
    from tests.python.ai_toolkit.test_ai_toolkit import BUDGET

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

        yield SimpleNamespace(package=package, root=root)
    finally:
        ai_toolkit.configure(None)
        launcher.uninstall()
        for name in [n for n in sys.modules if n == "toolkit" or n.startswith("toolkit.")]:
            del sys.modules[name]
        sys.path.remove(str(root))


def test_the_real_manager_under_the_guard_places_what_it_attaches(daemon, aitk_models):
    """The guard holding every move, the CPU's included (the host backend's device), around
    weightstream's own MemoryManager: attach takes the layers over (streamed, or moved with the
    rest), nothing it attached is placed again afterwards, and training equals the job without
    offloading bit for bit."""
    Flux1 = flux1_on(aitk_models.StableDiffusion)
    ref = Flux1("cpu", config(layer_offloading=False))
    ref.load_model()
    sd = Flux1("cpu", config())
    manager = aitk_models.tk.package.MemoryManager
    loading.run_load_model(
        sd, type(sd).load_model.__get__(sd), manager, is_accelerator=lambda d: d.type == "cpu"
    )
    report = loading.REPORTS[-1]
    assert [a["role"] for a in report.attached] == ["transformer", "text encoder", "text encoder"]
    assert report.placed_after == 0 and report.held_bytes > 0
    assert_equal_runs(train_flux1(ref), train_flux1(sd))
    for module in (sd.unet, *sd.text_encoder):
        manager.free(module)


def make_unet():
    """A tiny SDXL-shaped diffusers UNet: Conv2d layers beside the attention's Linear ones."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )


def test_an_sdxl_shaped_unet_is_attached_after_loading_and_trains_bit_exact(daemon, aitk_models):
    """StableDiffusion's SDXL branch attaches nothing either: the launcher streams the UNet,
    Conv2d layers included, and the text encoder."""

    class Sdxl(aitk_models.StableDiffusion):
        def load_model(self):
            unet, te = make_unet(), TextEncoder()
            te.to(self.device_torch, dtype=DTYPE)
            unet.to(self.device_torch, dtype=DTYPE)
            unet.requires_grad_(False)
            te.requires_grad_(False)
            self.unet, self.text_encoder = unet, [te]

    def train(sd, steps=2):
        run, unet = Run(), sd.unet
        network = LoRANetwork(unet)
        network.force_to("cpu", torch.float32)
        network.apply_to()
        network.requires_grad_(True)
        params = list(network.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        g = torch.Generator().manual_seed(5)
        for ids in prompts(steps):
            with torch.no_grad():
                embeds, _ = sd.text_encoder[0](ids)
            x = torch.randn(1, 4, 8, 8, generator=g).to(DTYPE)
            out = unet(x, torch.tensor([10]), encoder_hidden_states=embeds).sample
            loss = out.float().pow(2).mean()
            loss.backward()
            run.losses.append(loss.detach())
            run.grads.append([p.grad.clone() for p in params])
            optimizer.step()
            optimizer.zero_grad()
        run.lora = [p.detach().clone() for p in params]
        return run

    ref = Sdxl("cpu", config(layer_offloading=False))
    ref.load_model()
    sd = Sdxl("cpu", config())
    sd.load_model()
    streamed = sd.unet._memory_manager.handle.streamed
    kinds = {type(layer.module).__name__ for layer in streamed.values()}
    assert kinds == {"Conv2d", "Linear"}, kinds
    assert sd.text_encoder[0]._memory_manager.handle.streamed
    got = train(sd)
    assert len(got.grads[0]) > 0
    assert_equal_runs(train(ref), got)
    for module in (sd.unet, *sd.text_encoder):
        aitk_models.tk.package.MemoryManager.free(module)
