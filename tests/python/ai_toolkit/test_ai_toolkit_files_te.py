"""``load_from_files`` for text encoders, on the CPU against the daemon's host backend: a
transformers model that the loader's ``from_pretrained`` reads from a sharded checkpoint keeps its
streamed weights in the files, and the daemon loads them.

The loader (``LOADER``, a module of the fake ``toolkit`` package) re-enacts ostris/ai-toolkit
27a03a91's ``extensions_built_in/diffusion_models/flux2/flux2_model.py`` ``Flux2Model.load_te``
and the text encoder's part of ``load_model``: ``Mistral3ForConditionalGeneration.from_pretrained
(MISTRAL_PATH, torch_dtype=dtype)`` (here the checkpoint is a folder the test wrote with
``save_pretrained``: several shards and ``model.safetensors.index.json``),
``text_encoder.to(device, dtype=dtype)``, with ``quantize_te`` ``quantize(text_encoder,
weights=get_qtype(qtype))`` from ``toolkit.util.quantize`` (a stand-in that records its calls and
quantizes as weightstream's fp8 does), ``MemoryManager.attach(text_encoder, device,
offload_percent=layer_offloading_text_encoder_percent)`` where that percent is above 0, then
"Preparing Model": ``text_encoder.to("cpu")`` under ``low_vram``, ``requires_grad_(False)``,
``eval()``. Each test loads the same checkpoint as ai-toolkit does today (``load_from_files:
false``) beside it and compares the hidden states FLUX.2 caches.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch import nn
from weightstream import quantize
from weightstream.integrations import ai_toolkit
from weightstream.integrations.ai_toolkit import loading
from weightstream.integrations.ai_toolkit.settings import Settings
from weightstream.torch import filetensor
from weightstream.torch.placeholder import is_placeholder

from tests.python.ai_toolkit.test_ai_toolkit import BUDGET, DTYPE, toolkit  # noqa: F401
from tests.python.ai_toolkit.test_ai_toolkit_loading import aitk_models, write_toolkit  # noqa: F401

LOADER = """
import torch
from transformers import Mistral3ForConditionalGeneration, MistralForCausalLM
from toolkit.memory_management.manager import MemoryManager
from toolkit.models.base_model import BaseModel
from toolkit.util.quantize import quantize, get_qtype

CLASSES = {"mistral3": Mistral3ForConditionalGeneration, "mistral": MistralForCausalLM}


class Flux2Model(BaseModel):
    def load_te(self):
        dtype = self.torch_dtype
        text_encoder = CLASSES[self.te_class].from_pretrained(
            self.model_config.te_path, torch_dtype=dtype
        )
        text_encoder.to(self.device_torch, dtype=dtype)
        if self.model_config.quantize_te:
            quantize(text_encoder, weights=get_qtype(self.model_config.qtype))
        c = self.model_config
        if c.layer_offloading and c.layer_offloading_text_encoder_percent > 0:
            MemoryManager.attach(
                text_encoder, self.device_torch,
                offload_percent=c.layer_offloading_text_encoder_percent,
            )
        return text_encoder, None

    def load_model(self):
        text_encoder, tokenizer = self.load_te()
        text_encoder = [text_encoder]
        if self.model_config.low_vram:
            text_encoder[0].to("cpu")
        else:
            text_encoder[0].to(self.device_torch)
        text_encoder[0].requires_grad_(False)
        text_encoder[0].eval()
        self.text_encoder = text_encoder
"""

QUANTIZE = """
CALLS = []


class aotype:
    def __init__(self, name):
        self.name = name


def get_qtype(qtype):
    return aotype(qtype)


def quantize_model(base_model, model_to_quantize):
    raise AssertionError("the transformer is not loaded here")


def quantize(model, weights=None, activations=None, optimizer=None, include=None, exclude=None,
             quantize_device=None):
    from weightstream import quantize as wq

    CALLS.append(type(model).__name__)
    wq.to_fp8_resident(model, lambda n, m: type(m).__name__ == "Linear")
"""


def config(**changes):
    values = dict(
        te_path="",
        layer_offloading=True,
        layer_offloading_text_encoder_percent=1.0,
        low_vram=True,
        quantize_te=True,
        qtype="float8",  # ai-toolkit's qfloat8 under layer_offloading (config_modules.py)
    )
    values.update(changes)
    return SimpleNamespace(**values)


def text_config(**changes):
    values = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    values.update(changes)
    return transformers.MistralConfig(**values)


def write(folder, kind="mistral", dtype=DTYPE, **changes) -> dict[str, torch.Tensor]:
    """A small ``kind`` text encoder saved as transformers saves one, in shards; its tensors."""
    torch.manual_seed(0)
    if kind == "mistral":
        model = transformers.MistralForCausalLM(text_config(**changes))
    else:
        vision = transformers.PixtralVisionConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            image_size=32,
            patch_size=16,
            head_dim=16,
        )
        model = transformers.Mistral3ForConditionalGeneration(
            transformers.Mistral3Config(
                vision_config=vision,
                text_config=text_config(**changes),
                image_token_index=10,
                tie_word_embeddings=False,
            )
        )
    model.to(dtype).save_pretrained(str(folder), max_shard_size="40KB")
    return dict(model.state_dict())


@pytest.fixture
def te(aitk_models):  # noqa: F811
    write_toolkit(aitk_models.tk, ("flux2_te_stand_in", LOADER), quantize=QUANTIZE)
    from toolkit.models.flux2_te_stand_in import Flux2Model
    from toolkit.util import quantize as quantizer

    class Flux2(Flux2Model):
        torch_dtype = DTYPE
        te_class = "mistral"

    quantizer.CALLS.clear()
    return SimpleNamespace(cls=Flux2, quantizer=quantizer, tk=aitk_models.tk)


def load(te, daemon, folder, from_files: bool, te_class="mistral", **changes):
    """The loader's model, loaded with ``load_from_files`` ``from_files``; its summary line."""
    ai_toolkit.configure(
        Settings(
            socket=daemon.socket,
            vram_budget=BUDGET,
            staging_bytes=BUDGET,
            load_from_files=from_files,
        )
    )
    sd = type("Flux2", (te.cls,), {"te_class": te_class})(
        "cpu", config(te_path=str(folder), **changes)
    )
    sd.load_model()
    return sd, loading.REPORTS[-1]


def hidden_states(model) -> list[torch.Tensor]:
    """What FLUX.2 caches of its text encoder: the hidden states of every layer."""
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return list(model(input_ids=ids, output_hidden_states=True).hidden_states)


def assert_equal(a: nn.Module, b: nn.Module):
    for x, y in zip(hidden_states(a), hidden_states(b), strict=True):
        assert torch.equal(x, y)


def streamed_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{n}.weight": m.weight for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def real_bytes(model: nn.Module) -> int:
    return sum(p.nbytes for p in model.parameters() if not is_placeholder(p))


@pytest.mark.parametrize("quantized", [True, False])
def test_the_text_encoder_s_streamed_weights_go_from_its_shards_to_the_daemon_only(
    daemon, te, tmp_path, capsys, quantized
):
    folder = tmp_path / "mistral"
    tensors = write(folder)
    linear = {k for k in tensors if k.endswith("_proj.weight") or k == "lm_head.weight"}
    rest = sum(t.nbytes for k, t in tensors.items() if k not in linear)
    today, _ = load(te, daemon, folder, False, quantize_te=quantized)
    assert te.quantizer.CALLS == (["MistralForCausalLM"] if quantized else [])
    te.quantizer.CALLS.clear()
    capsys.readouterr()
    before = filetensor.READ.read_bytes
    sd, report = load(te, daemon, folder, True, quantize_te=quantized)
    (encoder,) = sd.text_encoder
    assert filetensor.READ.read_bytes - before == rest, "only what does not stream was read"
    assert report.read_from_files == rest
    assert real_bytes(encoder) == rest, "the trainer holds no streamed weight"
    assert {n for n, p in encoder.named_parameters() if is_placeholder(p)} == linear
    assert te.quantizer.CALLS == [], "the daemon quantized, not ai-toolkit"
    by_source = {m.source: m for m in daemon.client.list_models().models}
    assert set(by_source) == {"upload", "file"}
    want = quantize.FP8_E4M3_BLOCK64 if quantized else ""
    held = {t.name: t.quantization for t in by_source["file"].tensors}
    assert held.keys() == linear, "the daemon holds the streamed tensors only"
    stored = {
        k: quantize.fp8_nbytes(tensors[k].shape) if quantized else tensors[k].nbytes for k in linear
    }
    assert {t.name: t.nbytes for t in by_source["file"].tensors} == stored
    assert by_source["file"].total_bytes == sum(stored.values())
    assert set(held.values()) == {want} if quantized else set(held.values()) <= {"", "none"}
    assert_equal(encoder, today.text_encoder[0])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    shards = {p for p in folder.glob("*.safetensors") if linear & set(load_file(str(p)))}
    assert (
        f"attached: text encoder MistralForCausalLM (by ai-toolkit's loader, {len(linear)} "
        f"layers streamed, {len(linear)} tensors "
        f"({sum(tensors[k].nbytes for k in linear) / 1e9:.2f} GB) loaded by the daemon from "
        f"{len(shards)} file(s) as {'fp8' if quantized else 'stored'})" in line
    ), line
    assert len(shards) > 1
    assert line.endswith(f"; read from the files by the trainer: {rest / 1e9:.2f} GB"), line
    for model in (encoder, today.text_encoder[0]):
        te.tk.package.MemoryManager.free(model)
    assert daemon.client.list_models().models == []


def test_a_checkpoint_whose_keys_transformers_renames_streams_from_its_files(
    daemon, te, tmp_path, capsys
):
    """Mistral3ForConditionalGeneration, FLUX.2's own text encoder class: its checkpoint says
    ``language_model.model.layers...``, transformers 5 loads it as ``model.language_model.
    layers...``; the daemon's model keeps the files' names and the layers attach under
    theirs. The vision tower's patch Conv2d is not quantized by ai-toolkit's float8 (Linear
    layers only), so it stays on the device rather than stream the daemon's fp8 of it."""
    folder = tmp_path / "mistral3"
    tensors = write(folder, "mistral3")
    today, _ = load(te, daemon, folder, False, "mistral3")
    capsys.readouterr()
    sd, report = load(te, daemon, folder, True, "mistral3")
    (encoder,) = sd.text_encoder
    linear = {f"{n}.weight" for n, m in encoder.named_modules() if isinstance(m, nn.Linear)}
    assert {n for n, p in encoder.named_parameters() if is_placeholder(p)} == linear
    renamed = {k for k in tensors if k.startswith("model.language_model.")}
    assert renamed and all(k in linear or not k.endswith("_proj.weight") for k in renamed)
    assert report.read_from_files == real_bytes(encoder)
    assert te.quantizer.CALLS == ["Mistral3ForConditionalGeneration"], "today's only"
    assert_equal(encoder, today.text_encoder[0])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"as fp8, {len(linear)} under other names there)" in line, line
    assert "vision_tower.patch_conv" not in encoder._memory_manager.handle.streamed
    for model in (encoder, today.text_encoder[0]):
        te.tk.package.MemoryManager.free(model)


@pytest.mark.parametrize(
    "case, want",
    [
        (
            "cast",
            "text encoder MistralForCausalLM (by ai-toolkit's loader, 15 layers streamed, read "
            "by the trainer: 'model.layers.0.self_attn.q_proj.weight' is stored as "
            "torch.float32, the loader casts it to torch.bfloat16)",
        ),
        (
            "not attached",
            "attached: nothing; ",
        ),
    ],
)
def test_what_cannot_stream_from_the_files_loads_as_today_and_says_why(
    daemon, te, tmp_path, capsys, case, want
):
    folder = tmp_path / "mistral"
    write(
        folder,
        tie_word_embeddings=case == "tied",
        dtype=torch.float32 if case == "cast" else DTYPE,
    )
    percent = 0.0 if case == "not attached" else 1.0
    today, _ = load(te, daemon, folder, False, layer_offloading_text_encoder_percent=percent)
    capsys.readouterr()
    sd, report = load(te, daemon, folder, True, layer_offloading_text_encoder_percent=percent)
    (encoder,) = sd.text_encoder
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert want in line, line
    assert te.quantizer.CALLS == ["MistralForCausalLM"] * 2, "ai-toolkit quantized, both times"
    if case == "not attached":
        assert line.endswith("GB (MistralForCausalLM read by the trainer: not attached)"), line
    else:
        assert {m.source for m in daemon.client.list_models().models} == {"upload"}
    assert not any(filetensor.is_file_tensor(p) for p in encoder.parameters())
    assert_equal(encoder, today.text_encoder[0])
    for model in (encoder, today.text_encoder[0]):
        te.tk.package.MemoryManager.free(model)


@pytest.mark.parametrize("quantized", [False, True])
def test_a_tied_lm_head_stays_on_the_device_and_the_rest_streams_from_the_files(
    daemon, te, tmp_path, capsys, quantized
):
    """An ``lm_head`` tied to the embedding (``tie_word_embeddings``) is read once as
    ``from_pretrained`` returns, still one tensor with the embedding; policy keeps its layer on
    the device (tied), and every other Linear streams from the shards: in bf16, the hidden
    states equal today's; with ``quantize_te`` the daemon quantizes the streamed layers and the
    tied one stays as the files hold it (ai-toolkit's quantizer, which would have made the
    lm_head a tensor of its own, is not called)."""
    folder = tmp_path / "mistral"
    tensors = write(folder, tie_word_embeddings=True)
    today, _ = load(te, daemon, folder, False, quantize_te=quantized)
    te.quantizer.CALLS.clear()
    capsys.readouterr()
    sd, report = load(te, daemon, folder, True, quantize_te=quantized)
    (encoder,) = sd.text_encoder
    assert encoder.lm_head.weight is encoder.model.embed_tokens.weight
    assert not is_placeholder(encoder.lm_head.weight)
    assert encoder.lm_head.weight.dtype == DTYPE
    streamed = {n for n, p in encoder.named_parameters() if is_placeholder(p)}
    assert streamed == {k for k in tensors if k.endswith("_proj.weight")}
    by_source = {m.source: m for m in daemon.client.list_models().models}
    assert set(by_source) == {"upload", "file"}
    want = {quantize.FP8_E4M3_BLOCK64} if quantized else {"", "none"}
    assert {t.quantization for t in by_source["file"].tensors if t.name in streamed} <= want
    assert te.quantizer.CALLS == []
    assert report.read_from_files == real_bytes(encoder)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"{len(streamed)} layers streamed, {len(streamed)} tensors" in line, line
    assert "read by the trainer" not in line, line
    if not quantized:
        assert_equal(encoder, today.text_encoder[0])
    for model in (encoder, today.text_encoder[0]):
        te.tk.package.MemoryManager.free(model)


def teardown_module():
    for name in [n for n in sys.modules if n == "toolkit" or n.startswith("toolkit.")]:
        del sys.modules[name]
