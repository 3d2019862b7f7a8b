"""``load_from_files`` (``weightstream.integrations.ai_toolkit.files``) on the CPU, against the
daemon's host backend: a FLUX.2-shaped loader's streamed weights go from its safetensors file
into the daemon and never into the trainer.

The loader (``LOADER`` below, a module of the fake ``toolkit`` package) reads its file the way
ostris/ai-toolkit 27a03a91's ``extensions_built_in/diffusion_models/flux2/flux2_model.py``
``Flux2Model.load_model`` does, re-enacted: the transformer built under ``torch.device("meta")``;
``safetensors.torch.load_file(path, device="cpu")``, imported into the loader's module; every
tensor cast with ``.to(dtype)``; ``load_state_dict(state_dict, assign=True)``; with ``quantize``
``quantize_model(self, transformer)`` from ``toolkit.util.quantize`` (here a stand-in that
records its calls and quantizes as weightstream's fp8 does), else ``transformer.to(device,
dtype=dtype)``; ``MemoryManager.attach(transformer, device, offload_percent=...)`` from
``toolkit.memory_management.manager``; ``transformer.to("cpu")`` under ``low_vram``. The
stand-in transformer has FLUX.2's own key names (``double_blocks.0.img_attn.qkv.weight``,
``...img_attn.norm.query_norm.scale``: BFL's, which that loader reads, not diffusers'), bias-free
Linear layers as FLUX.2's, and RMSNorm scales that do not stream.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from weightstream import quantize
from weightstream.integrations import ai_toolkit
from weightstream.integrations.ai_toolkit import loading
from weightstream.integrations.ai_toolkit.settings import Settings
from weightstream.torch import filetensor
from weightstream.torch.placeholder import is_placeholder

from tests.python.ai_toolkit.test_ai_toolkit import BUDGET, DTYPE, toolkit  # noqa: F401
from tests.python.ai_toolkit.test_ai_toolkit_loading import aitk_models, write_toolkit  # noqa: F401

DIM = 64  # a multiple of 64: fp8's blocks of 64


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        rrms = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (x.float() * rrms).to(x.dtype) * self.scale


class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.norm = nn.Module()
        self.norm.query_norm = RMSNorm(dim)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(self.norm.query_norm(q) * k.sigmoid() + v)


class DoubleBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.img_attn = Attention(dim)
        self.img_mlp = nn.Sequential(
            nn.Linear(dim, 2 * dim, bias=False), nn.GELU(), nn.Linear(2 * dim, dim, bias=False)
        )

    def forward(self, x):
        x = x + self.img_attn(x)
        return x + self.img_mlp(x)


class SingleBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.linear1 = nn.Linear(dim, 3 * dim, bias=False)
        self.linear2 = nn.Linear(3 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.linear2(nn.functional.gelu(self.linear1(x)))


class Flux2StandIn(nn.Module):
    """FLUX.2's layout, tiny: what the loader builds on ``meta`` and fills from the file."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.img_in = nn.Linear(32, dim, bias=False)
        self.double_stream_modulation_img = nn.Module()
        self.double_stream_modulation_img.lin = nn.Linear(dim, dim, bias=False)
        self.double_blocks = nn.ModuleList(DoubleBlock(dim) for _ in range(2))
        self.single_blocks = nn.ModuleList(SingleBlock(dim) for _ in range(2))
        self.final_layer = nn.Module()
        self.final_layer.linear = nn.Linear(dim, 32, bias=False)

    def forward(self, x):
        h = self.img_in(x)
        h = h * self.double_stream_modulation_img.lin(h).sigmoid()
        for block in [*self.double_blocks, *self.single_blocks]:
            h = block(h)
        return self.final_layer.linear(h)


LOADER = """
import torch
from safetensors.torch import load_file
from toolkit.memory_management.manager import MemoryManager
from toolkit.models.base_model import BaseModel
from toolkit.util.quantize import quantize_model


class Flux2Model(BaseModel):
    def load_model(self):
        dtype = self.torch_dtype
        with torch.device("meta"):
            transformer = self.build()
        transformer_state_dict = load_file(self.model_config.name_or_path, device="cpu")
        for key in transformer_state_dict:
            transformer_state_dict[key] = transformer_state_dict[key].to(dtype)
        transformer.load_state_dict(transformer_state_dict, assign=True)
        if self.model_config.quantize:
            quantize_model(self, transformer)
        else:
            transformer.to(self.device_torch, dtype=dtype)
        c = self.model_config
        if c.layer_offloading and c.layer_offloading_transformer_percent > 0:
            MemoryManager.attach(
                transformer, self.device_torch,
                offload_percent=c.layer_offloading_transformer_percent,
            )
        if c.low_vram:
            transformer.to("cpu")
        self.model = transformer
"""

QUANTIZE = """
CALLS = []


def quantize_model(base_model, model_to_quantize):
    from weightstream import quantize

    CALLS.append(type(model_to_quantize).__name__)
    quantize.to_fp8_resident(model_to_quantize, lambda n, m: type(m).__name__ == "Linear")
"""


def config(**changes):
    values = dict(
        name_or_path="",
        layer_offloading=True,
        layer_offloading_transformer_percent=1.0,
        low_vram=True,
        quantize=True,
        qtype="float8",  # ai-toolkit's qfloat8 under layer_offloading (config_modules.py)
        accuracy_recovery_adapter=None,
    )
    values.update(changes)
    return SimpleNamespace(**values)


def flux2_on(loader: type) -> type:
    """The stand-in loader's FLUX.2 over ``Flux2StandIn``, no quantization exclusions."""

    class Flux2(loader):
        torch_dtype = DTYPE

        def build(self):
            return Flux2StandIn()

        def get_quantization_exclude_modules(self):
            return None

    return Flux2


@pytest.fixture
def flux2(aitk_models):  # noqa: F811
    write_toolkit(aitk_models.tk, ("flux2_stand_in", LOADER), quantize=QUANTIZE)
    from toolkit.models.flux2_stand_in import Flux2Model
    from toolkit.util import quantize as quantizer

    Flux2 = flux2_on(Flux2Model)
    quantizer.CALLS.clear()
    return SimpleNamespace(cls=Flux2, quantizer=quantizer, tk=aitk_models.tk)


def write(path, dtype=DTYPE) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Flux2StandIn()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".scale"):
                p.uniform_(0.5, 1.5)
    tensors = {k: v.to(dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(path))
    return tensors


def in_place(path, quantized: bool) -> nn.Module:
    """The same file loaded in place, with the same quantization as the daemon's."""
    with torch.device("meta"):
        model = Flux2StandIn()
    model.load_state_dict({k: v.to(DTYPE) for k, v in load_file(str(path)).items()}, assign=True)
    if quantized:
        quantize.to_fp8_resident(model, lambda n, m: isinstance(m, nn.Linear))
    return model.requires_grad_(False)


def real_bytes(model: nn.Module) -> int:
    return sum(
        p.nbytes
        for p in model.parameters()
        if not is_placeholder(p) and not filetensor.is_file_tensor(p)
    )


def inputs():
    return torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3)).to(DTYPE)


@pytest.mark.parametrize("quantized", [True, False])
def test_the_streamed_weights_go_from_the_file_to_the_daemon_only(
    daemon, flux2, tmp_path, capsys, quantized
):
    path = tmp_path / "flux2-dev.safetensors"
    tensors = write(path)
    scales = sum(t.nbytes for k, t in tensors.items() if k.endswith(".scale"))
    before = filetensor.READ.read_bytes
    sd = flux2.cls("cpu", config(name_or_path=str(path), quantize=quantized))
    sd.load_model()
    sd.model.requires_grad_(False)  # the trainer freezes the base (BaseSDTrainProcess)
    assert filetensor.READ.read_bytes - before == scales, "only what does not stream was read"
    assert real_bytes(sd.model) == scales, "the trainer holds no streamed weight"
    linear = {f"{n}.weight" for n, m in sd.model.named_modules() if isinstance(m, nn.Linear)}
    assert {n for n, p in sd.model.named_parameters() if is_placeholder(p)} == linear
    assert flux2.quantizer.CALLS == [], "the daemon quantized, not ai-toolkit"
    (model,) = daemon.client.list_models().models
    assert model.source == "file"
    want = quantize.FP8_E4M3_BLOCK64 if quantized else ""
    held = {t.name: t.quantization for t in model.tensors if t.name in linear}
    assert held == dict.fromkeys(linear, want) if quantized else set(held.values()) <= {"", "none"}
    with torch.no_grad():
        assert torch.equal(sd.model(inputs()), in_place(path, quantized)(inputs()))
    line = capsys.readouterr().out.strip().splitlines()[-1]
    n = len(linear)
    assert (
        f"(by ai-toolkit's loader, {n} layers streamed, {n} tensors "
        f"({sum(tensors[k].nbytes for k in linear) / 1e9:.2f} GB) loaded by the daemon from "
        f"1 file(s) as {'fp8' if quantized else 'stored'})" in line
    ), line
    assert "; host memory peak: this process " in line and "the daemon's store unknown" not in line
    assert line.endswith(f"; read from the files by the trainer: {scales / 1e9:.2f} GB")
    assert loading.REPORTS[-1].host["process_vm_hwm"] > 0
    assert loading.REPORTS[-1].host["daemon_host_bytes"] > 0
    assert loading.exit_line().startswith(
        "weightstream-aitk: over the job, host memory peak: this process "
    )
    flux2.tk.package.MemoryManager.free(sd.model)
    assert daemon.client.list_models().models == []


def test_a_cast_on_load_is_read_and_uploaded_as_before_and_says_why(daemon, flux2, tmp_path):
    """A file in float32 that the loader casts to bf16: the daemon would load float32, so the
    layers are read, quantized as ai-toolkit's qtype asked (by weightstream's fp8) and
    uploaded; results equal the in-place model all the same."""
    path = tmp_path / "flux2-dev.safetensors"
    write(path, torch.float32)
    sd = flux2.cls("cpu", config(name_or_path=str(path)))
    sd.load_model()
    sd.model.requires_grad_(False)  # the trainer freezes the base (BaseSDTrainProcess)
    src = sd.model._memory_manager.files
    assert src.why == (
        "'double_blocks.0.img_attn.qkv.weight' is stored as torch.float32, the loader casts "
        "it to torch.bfloat16"
    )
    assert real_bytes(sd.model) == sum(
        p.nbytes for n, p in in_place(path, True).named_parameters() if n.endswith(".scale")
    )
    (model,) = daemon.client.list_models().models
    assert model.source == "upload"
    with torch.no_grad():
        assert torch.equal(sd.model(inputs()), in_place(path, True)(inputs()))
    flux2.tk.package.MemoryManager.free(sd.model)


def test_load_from_files_false_loads_as_ai_toolkit_does(daemon, flux2, tmp_path):
    path = tmp_path / "flux2-dev.safetensors"
    write(path)
    ai_toolkit.configure(
        Settings(
            socket=daemon.socket, vram_budget=BUDGET, staging_bytes=BUDGET, load_from_files=False
        )
    )
    before = filetensor.READ.read_bytes
    sd = flux2.cls("cpu", config(name_or_path=str(path)))
    sd.load_model()
    sd.model.requires_grad_(False)  # the trainer freezes the base (BaseSDTrainProcess)
    assert flux2.quantizer.CALLS == ["Flux2StandIn"]
    assert filetensor.READ.read_bytes == before
    assert sd.model._memory_manager.files is None
    (model,) = daemon.client.list_models().models
    assert model.source == "upload"
    with torch.no_grad():
        assert torch.equal(sd.model(inputs()), in_place(path, True)(inputs()))
    flux2.tk.package.MemoryManager.free(sd.model)


def test_the_setting_reads_from_the_job_and_the_environment():
    assert Settings.load().load_from_files is True
    assert Settings.load({"load_from_files": False}).load_from_files is False
    env = {"WEIGHTSTREAM_LOAD_FROM_FILES": "0"}
    assert Settings.load({"load_from_files": True}, env).load_from_files is False
    with pytest.raises(ValueError, match="weightstream.load_from_files: 'maybe': expected true"):
        Settings.load({"load_from_files": "maybe"})


def teardown_module():
    for name in [n for n in sys.modules if n == "toolkit" or n.startswith("toolkit.")]:
        del sys.modules[name]


def test_coding_reaches_the_daemons_load_of_the_files(daemon, flux2, tmp_path):
    """``coding: rans8``: the daemon loads the files coded (a model of its own: the same files
    and tensors loaded as they are are another model)."""
    path = tmp_path / "flux2-dev.safetensors"
    write(path)
    ai_toolkit.configure(
        Settings(socket=daemon.socket, vram_budget=BUDGET, staging_bytes=BUDGET, coding="rans8")
    )
    sd = flux2.cls("cpu", config(name_or_path=str(path)))
    sd.load_model()
    sd.model.requires_grad_(False)  # the trainer freezes the base (BaseSDTrainProcess)
    src = sd.model._memory_manager.files
    assert (src.why, src.coding, src.quantize) == ("", "rans8", "fp8")
    (coded,) = daemon.client.list_models().models
    plain = daemon.client.load_model([str(path)], quantize="fp8", tensors=src.keys)
    coded_again = daemon.client.load_model(
        [str(path)], quantize="fp8", tensors=src.keys, coding="rans8"
    )
    assert plain.model_id != coded.model_id == coded_again.model_id
    with torch.no_grad():
        assert torch.equal(sd.model(inputs()), in_place(path, True)(inputs()))
    flux2.tk.package.MemoryManager.free(sd.model)
