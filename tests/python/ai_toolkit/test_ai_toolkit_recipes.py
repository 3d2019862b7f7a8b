"""Quantized once for every job (``weightstream.integrations.ai_toolkit.recipes``) on the CPU,
against the daemon's host backend: ai-toolkit's qtypes the daemon does not make, loaded through
``load_from_files`` twice; the second job attaches the first one's stored model by id.

The loader is ``test_ai_toolkit_files``'s FLUX.2 re-enactment. ``toolkit.util.quantize`` is a
stand-in of ai-toolkit 27a03a91's ``quantize_model``: without an accuracy recovery adapter it
moves each block (cast to the train dtype) and quantizes its Linears, then the extras; with one,
it wraps each layer the adapter's file names in the adapter (``aitk_layouts.Ara``), then
quantizes it with the qtype (ai-toolkit's order: the adapter runs ``nn.Linear.forward`` on the
dequantized weight), and the rest with ``uint8`` (a no-op in ai-toolkit).
``toolkit.util.ostris_quant`` holds ``convert_linear_to_ostris`` over ``aitk_layouts``'
stand-in quantizers (which, like ai-toolkit's, run on ``meta``), recording each quantization's
device.
"""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from weightstream.integrations.ai_toolkit import recipes
from weightstream.torch import filetensor

from tests.python.ai_toolkit.test_ai_toolkit import DTYPE, toolkit  # noqa: F401
from tests.python.ai_toolkit.test_ai_toolkit_files import (  # noqa: F401
    LOADER,
    Flux2StandIn,
    config,
    flux2_on,
    inputs,
    write,
)
from tests.python.ai_toolkit.test_ai_toolkit_loading import aitk_models, write_toolkit  # noqa: F401

OSTRIS_QUANT = """
from tests.python.torch import aitk_layouts as aitk

OstrisLinear = aitk.OstrisLinear
CALLS = []  # (qtype, the weight's device type) per quantization
QUANTIZERS = {
    "uint4": lambda: aitk.UIntX(4),
    "nvfp4": lambda: aitk.Nvfp4(pre_scale=True),
    "convrot8": aitk.ConvRot8,
}


def get_ostris_quantizer(qtype):
    return QUANTIZERS[qtype]() if qtype in QUANTIZERS else None


def convert_linear_to_ostris(module, quantizer):
    if isinstance(module, OstrisLinear):
        return True
    if module.in_features % 64:  # the stand-ins' can_quantize
        return False
    CALLS.append((quantizer.qtype, module.weight.device.type))
    aitk.convert(module, quantizer)
    return True
"""

QUANTIZE = """
from fnmatch import fnmatch

import torch
from safetensors.torch import load_file

from tests.python.torch import aitk_layouts as aitk
from toolkit.util.ostris_quant import convert_linear_to_ostris, get_ostris_quantizer

AFTER = []  # called when quantize_model returns (a test's hook)


def quantize(model, weights=None, exclude=None):
    quantizer = get_ostris_quantizer(weights)
    if quantizer is None:  # uint8: ai-toolkit's is a no-op
        return
    for name, m in model.named_modules():
        if type(m) is torch.nn.Linear and not any(fnmatch(name, e) for e in exclude or ()):
            convert_linear_to_ostris(m, quantizer)


def quantize_model(base_model, model_to_quantize):
    config = base_model.model_config
    exclude = base_model.get_quantization_exclude_modules() or []
    if config.accuracy_recovery_adapter is not None:
        lora = load_file(config.accuracy_recovery_adapter)
        done, base_model.accuracy_recovery_adapter = [], []
        for name in sorted({k.split(".lora_")[0] for k in lora}):
            layer = model_to_quantize.get_submodule(name)
            layer.to(base_model.torch_dtype)
            for p in layer.parameters():
                p.requires_grad = False
            ara = aitk.Ara(layer, rank=lora[name + ".lora_down.weight"].shape[0])
            quantize(layer, weights=config.qtype)
            ara.lora_down.weight.data = lora[name + ".lora_down.weight"]
            ara.lora_up.weight.data = lora[name + ".lora_up.weight"]
            base_model.accuracy_recovery_adapter.append(ara)
            done.append(name)
        quantize(model_to_quantize, weights="uint8", exclude=done + exclude)
    else:
        for block in [*model_to_quantize.double_blocks, *model_to_quantize.single_blocks]:
            block.to(base_model.device_torch, dtype=base_model.torch_dtype)
            quantize(block, weights=config.qtype, exclude=exclude)
            block.to("cpu")
        quantize(model_to_quantize, weights=config.qtype, exclude=exclude)
    for hook in AFTER:
        hook()
"""

ARA_LAYERS = ("double_blocks.0.img_attn.qkv", "single_blocks.1.linear1")


@pytest.fixture
def aitk(aitk_models, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv(recipes.DIR_ENV, str(tmp_path / "recipes"))
    loader = ("flux2_stand_in", LOADER)
    write_toolkit(aitk_models.tk, loader, ostris_quant=OSTRIS_QUANT, quantize=QUANTIZE)
    from toolkit.models.flux2_stand_in import Flux2Model
    from toolkit.util import ostris_quant, quantize

    Flux2 = flux2_on(Flux2Model)

    path = tmp_path / "flux2-dev.safetensors"
    write(path)
    ara = tmp_path / "ara.safetensors"
    torch.manual_seed(5)
    save_file(
        {
            f"{n}.lora_{part}.weight": (torch.randn(shape) * 0.05).to(DTYPE)
            for n, (i, o) in zip(ARA_LAYERS, ((64, 192), (64, 192)), strict=True)
            for part, shape in (("down", (4, i)), ("up", (o, 4)))
        },
        str(ara),
    )
    yield _Env(Flux2, ostris_quant, quantize, aitk_models.tk, str(path), str(ara))


class _Env:
    def __init__(self, cls, ostris_quant, quantize, tk, path, ara):
        self.cls, self.ostris_quant, self.quantize, self.tk = cls, ostris_quant, quantize, tk
        self.path, self.ara = path, ara

    def config(self, qtype, ara=False, **changes):
        return config(
            name_or_path=self.path,
            qtype=qtype,
            accuracy_recovery_adapter=self.ara if ara else None,
            **changes,
        )

    def job(self, qtype, ara=False, **changes):
        """One job: load, a forward and backward, the summary; then free (the job exits)."""
        self.ostris_quant.CALLS.clear()
        before = filetensor.READ.read_bytes
        sd = self.cls("cpu", self.config(qtype, ara, **changes))
        sd.load_model()
        sd.model.requires_grad_(False)
        read = filetensor.READ.read_bytes - before
        x = inputs().requires_grad_(True)
        out = sd.model(x)
        out.float().square().sum().backward()
        aras = getattr(sd, "accuracy_recovery_adapter", None) or []
        grads = [p.grad for a in aras for p in a.parameters()]
        run = {
            "out": out.detach(),
            "x_grad": x.grad,
            "ara_grads": grads,
            "read": read,
            "calls": list(self.ostris_quant.CALLS),
            "recipe": sd.model._memory_manager.recipe,
        }
        self.tk.package.MemoryManager.free(sd.model)
        return run

    def in_place(self, qtype, ara=False):
        """The same file quantized by the same ``quantize_model`` in place, no weightstream."""
        sd = self.cls("cpu", self.config(qtype, ara, layer_offloading=False))
        with torch.device("meta"):
            model = Flux2StandIn()
        model.load_state_dict(
            {k: v.to(DTYPE) for k, v in load_file(self.path).items()}, assign=True
        )
        self.quantize.quantize_model(sd, model)
        model.requires_grad_(False)
        x = inputs().requires_grad_(True)
        out = model(x)
        out.float().square().sum().backward()
        aras = getattr(sd, "accuracy_recovery_adapter", None) or []
        return {
            "out": out.detach(),
            "x_grad": x.grad,
            "ara_grads": [p.grad for a in aras for p in a.parameters()],
        }


def scales(path) -> int:
    return sum(t.nbytes for k, t in load_file(path).items() if k.endswith(".scale"))


def assert_same(a, b):
    assert torch.equal(a["out"], b["out"])
    assert torch.equal(a["x_grad"], b["x_grad"])
    assert len(a["ara_grads"]) == len(b["ara_grads"])
    for ga, gb in zip(a["ara_grads"], b["ara_grads"], strict=True):
        assert torch.equal(ga, gb)


@pytest.mark.parametrize(("qtype", "ara"), [("uint4", True), ("convrot8", False), ("nvfp4", False)])
def test_the_second_job_attaches_the_stored_model_without_reading_or_quantizing(
    daemon, aitk, qtype, ara, capsys
):
    first = aitk.job(qtype, ara)
    assert first["recipe"].model_id is None and first["recipe"].stored
    assert first["read"] > scales(aitk.path), "the first job read the layers to quantize them"
    assert {d for _, d in first["calls"]} == {"cpu"}
    (stored,) = daemon.client.list_models().models
    assert stored.model_id == first["recipe"].stored

    second = aitk.job(qtype, ara)
    assert second["read"] == scales(aitk.path), "only what does not stream was read"
    assert second["calls"] and {d for _, d in second["calls"]} == {"meta"}, second["calls"]
    assert second["recipe"].model_id == stored.model_id
    assert [m.model_id for m in daemon.client.list_models().models] == [stored.model_id]
    assert_same(second, first)
    assert_same(second, aitk.in_place(qtype, ara))
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert (
        f", {qtype} layers attached from the daemon's stored model {stored.model_id[:12]} "
        f"(recipe {second['recipe'].key[:12]}), none read or quantized by this job)" in line
    ), line


def test_another_recipe_is_quantized_by_the_job(daemon, aitk, capsys):
    aitk.job("uint4", ara=True)
    other = aitk.job("convrot8")
    assert {d for _, d in other["calls"]} == {"cpu"}
    why = f"no job stored recipe {other['recipe'].key[:12]} yet"
    assert other["recipe"].why == why
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"convrot8 quantized by ai-toolkit in this job: {why}; kept in the daemon as" in line
    assert_same(other, aitk.in_place("convrot8"))


def test_a_model_the_daemon_lost_is_quantized_again(daemon, aitk):
    first = aitk.job("convrot8")
    assert daemon.client.release_model(first["recipe"].stored) == 0
    again = aitk.job("convrot8")
    assert again["recipe"].why == (
        f"the daemon no longer holds model {first['recipe'].stored[:12]} (restarted or evicted)"
    )
    assert {d for _, d in again["calls"]} == {"cpu"}
    assert again["recipe"].stored == first["recipe"].stored, "the same bytes: the same model"
    assert_same(again, first)


def test_a_model_lost_after_the_lookup_falls_back_at_attach(daemon, aitk):
    first = aitk.job("uint4", ara=True)
    lost = lambda: daemon.client.release_model(first["recipe"].stored)  # noqa: E731
    aitk.quantize.AFTER.append(lost)
    try:
        again = aitk.job("uint4", ara=True)
    finally:
        aitk.quantize.AFTER.remove(lost)
    assert again["recipe"].why == (
        f"the daemon no longer holds model {first['recipe'].stored[:12]} (restarted or evicted)"
    )
    assert [d for _, d in again["calls"]] == ["meta"] * len(ARA_LAYERS) + ["cpu"] * len(ARA_LAYERS)
    assert_same(again, first)


def test_a_stored_model_without_the_layers_this_job_streams_falls_back(daemon, aitk):
    half = aitk.job("convrot8", layer_offloading_transformer_percent=0.5)
    full = aitk.job("convrot8")
    assert full["recipe"].why.startswith(
        f"the stored model {half['recipe'].stored[:12]} has no "
    ), full["recipe"].why
    assert "cpu" in {d for _, d in full["calls"]}
    assert_same(full, aitk.in_place("convrot8"))
    # and the other way: a job streaming fewer layers makes the rest from the file
    fewer = aitk.job("convrot8", layer_offloading_transformer_percent=0.5)
    assert fewer["recipe"].model_id == full["recipe"].stored
    assert 0 < sum(d == "cpu" for _, d in fewer["calls"]) < len(full["calls"])
    assert_same(fewer, full)


def teardown_module():
    for name in [n for n in sys.modules if n == "toolkit" or n.startswith("toolkit.")]:
        del sys.modules[name]


def test_a_tied_layer_stays_out_of_the_recipe_key(tmp_path):
    # ai-toolkit's FLUX.2 quantizes Mistral with the transformer's qtype; its lm_head shares
    # embed_tokens' weight (tie_word_embeddings), read whole, which files._lazy_layers leaves to
    # be quantized by every job: the key is of the file layers alone.
    path = tmp_path / "m.safetensors"
    save_file({"proj.weight": torch.randn(4, 4).to(DTYPE)}, str(path))
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(4, 4)
    model.proj = torch.nn.Linear(4, 4, bias=False)
    model.head = torch.nn.Linear(4, 4, bias=False)
    model.load_state_dict(
        {"proj.weight": filetensor.load_file(path)["proj.weight"]}, strict=False, assign=True
    )
    model.head.weight = model.embed.weight
    untied = torch.nn.Module()
    untied.proj = model.proj
    call = {"fn": "quantize", "qtype": "uint4"}
    assert recipes.key(model, (torch.nn.Linear,), call, None) == recipes.key(
        untied, (torch.nn.Linear,), call, None
    )
