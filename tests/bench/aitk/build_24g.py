"""What tests/bench/ai_toolkit_24g.py gives ai-toolkit to train, at the real sizes where they
matter, with seeded random weights: FLUX.2-dev (``build_flux2``: ai-toolkit's own ``Flux2`` and
``AutoEncoder``, a Mistral3 text encoder in an HF cache) and FLUX.1-dev (``build_flux1``: a
diffusers folder, T5-XXL's encoder), and how many FLUX.2 blocks fit the host
(``flux2_singles_for_host``)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from tests.bench.aitk import build

MISTRAL_REPO = "mistralai/Mistral-Small-3.1-24B-Instruct-2503"  # flux2_model.MISTRAL_PATH

MISTRAL_LAYERS = 30  # pipeline.OUTPUT_LAYERS_MISTRAL reads hidden states 10, 20 and 30

FLUX2_FILE = "flux2-dev.safetensors"  # flux2_model.FLUX2_TRANSFORMER_FILENAME

FLUX2_CLASS = "extensions_built_in.diffusion_models.flux2.flux2_model:Flux2Params"

#: Per architecture and size: the transformer's fields that differ from ai-toolkit's (flux2:
#: Flux2Params; flux: FluxTransformer2DModel's config) and the text encoder's.
SIZES = {
    "flux2": {
        # The same tiny FLUX.2 and text encoder as the klein bench's (each run copies it).
        "tiny": build.KLEIN_SIZES["tiny"],
        "dev": {  # Flux2Params() as it is; Mistral Small 3.1's width, 30 of its 40 layers
            "transformer": {},
            "te": dict(
                hidden_size=5120,
                intermediate_size=2048,  # 32768 in Mistral Small 3.1
                num_attention_heads=8,  # 32
                num_key_value_heads=2,  # 8
                head_dim=128,
            ),
        },
    },
    "flux": {
        "tiny": {"transformer": build.SIZES["tiny"], "te": None},
        "dev": {  # FLUX.1-dev's transformer; T5-XXL's encoder (google/t5-v1_1-xxl)
            "transformer": build.SIZES["flux1"],
            "te": dict(d_ff=10240, num_layers=24, num_heads=64, d_kv=64),
        },
    },
}


def random_state(shapes: dict, seed: int, device: str, fp8: bool) -> dict:
    """Seeded random tensors for a state dict's names and shapes, made one at a time on
    ``device`` and moved to the CPU: norms' scales 1, biases 0, other weights N(0, 1/fan_in);
    2-D weights in float8 e4m3 when ``fp8`` (the loaders cast them to bf16), the rest bf16."""
    import torch

    g = torch.Generator(device).manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if "norm" in name or name.endswith(".scale"):
            t = torch.ones(shape, device=device) if name.endswith(("weight", "scale")) else None
            t = torch.zeros(shape, device=device) if t is None else t
        elif name.endswith("bias"):
            t = torch.zeros(shape, device=device)
        else:
            fan_in = shape[-1] if len(shape) > 1 else shape[0]
            t = torch.empty(shape, device=device).normal_(0.0, fan_in**-0.5, generator=g)
        dtype = torch.float8_e4m3fn if fp8 and len(shape) == 2 and name.endswith("weight") else None
        out[name] = t.to(dtype or torch.bfloat16).cpu()
        del t
    return out


def _shapes(module) -> dict:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def _save(state: dict, path: Path) -> dict:
    from safetensors.torch import save_file

    save_file(state, path, metadata={"format": "pt"})
    return {
        "params": sum(t.numel() for t in state.values()),
        "bytes_on_disk": path.stat().st_size,
        "fp8_tensors": sum(1 for t in state.values() if t.element_size() == 1),
    }


def flux2_singles_for_host(aitk: Path, fields: dict, host_gib: float, fp8: bool) -> int:
    """The most single-stream blocks (48 in FLUX.2-dev) whose weightstream run fits the host.

    ai-toolkit's FLUX.2 loader keeps its state dict until ``load_model`` returns: with float8
    on disk the bf16 casts are 2 bytes a parameter of anonymous memory (with bf16 on disk they
    are the file's pages, which the kernel can drop); the torchao copy is 1 more, and
    weightstream-aitk's attach copies it into the daemon (1 more) before the trainer's copy goes:
    4 bytes a parameter at the peak, 2 with bf16 on disk; plus 8 GiB for the rest. The run must
    stay under 80 % of the host's memory."""
    import torch

    src = build.flux2_src(aitk, "model")

    def params(singles: int) -> int:
        with torch.device("meta"):
            model = src.Flux2(src.Flux2Params(**dict(fields, depth_single_blocks=singles)))
        return sum(p.numel() for p in model.parameters())

    per_param = 4 if fp8 else 2
    full = src.Flux2Params(**fields).depth_single_blocks
    base, one = params(0), params(1) - params(0)
    room = 0.8 * host_gib * (1 << 30) - (8 << 30)
    return max(1, min(full, int((room / per_param - base) // one)))


def build_flux2(root: Path, aitk: Path, size: dict, seed: int, device: str, fp8: bool) -> dict:
    import torch

    t0 = time.monotonic()
    root.mkdir(parents=True)
    src = build.flux2_src(aitk, "model")
    with torch.device("meta"):
        transformer = src.Flux2(src.Flux2Params(**size["transformer"]))
    info = {
        "transformer": _save(
            random_state(_shapes(transformer), seed, device, fp8), root / FLUX2_FILE
        )
    }
    ae = build.flux2_src(aitk, "autoencoder")
    torch.manual_seed(seed + 1)
    vae = ae.AutoEncoder(ae.AutoEncoderParams()).to(torch.bfloat16)
    info["vae_params"], _ = build.save_module(vae, root / build.KLEIN_VAE_FILE)
    del vae
    info["text_encoder"] = mistral3(root.parent / "hf", size["te"], seed + 2, device)
    info["build_s"] = time.monotonic() - t0
    return info


def flux2_ara_layers(aitk: Path, fields: dict) -> dict:
    """``{KEY: (in, out)}`` for an accuracy recovery adapter on FLUX.2's transformer: every
    Linear of its blocks (``get_transformer_block_names``: ``double_blocks``,
    ``single_blocks``), KEY its name with ``transformer.`` before it, as ai-toolkit names the
    adapter's layers (``convert_lora_weights_before_load`` maps ``diffusion_model.`` to it)."""
    import torch

    src = build.flux2_src(aitk, "model")
    with torch.device("meta"):
        model = src.Flux2(src.Flux2Params(**fields))
    return {
        f"transformer.{name}": (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.startswith(("double_blocks.", "single_blocks."))
    }


def build_flux1(root: Path, size: dict, seed: int, device: str, fp8: bool) -> dict:
    import torch
    from diffusers import FluxTransformer2DModel

    t0 = time.monotonic()
    cfg = dict(size["transformer"])
    build.build_model(
        root,
        dict(
            build.SIZES["tiny"],
            **{k: cfg[k] for k in ("joint_attention_dim", "pooled_projection_dim")},
        ),
        seed,
        "cpu",
    )  # VAE, CLIP, T5 (one layer), scheduler, and a tiny transformer, replaced:
    with torch.device("meta"):
        transformer = FluxTransformer2DModel(guidance_embeds=True, **cfg)
    folder = root / "transformer"
    shutil.rmtree(folder)
    folder.mkdir()
    transformer.save_config(folder)
    info = {
        "transformer": _save(
            random_state(_shapes(transformer), seed, device, fp8),
            folder / "diffusion_pytorch_model.safetensors",
        )
    }
    if size["te"]:
        info["text_encoder"] = t5(
            root / "text_encoder_2", cfg["joint_attention_dim"], size["te"], seed + 3, device
        )
    info["build_s"] = time.monotonic() - t0
    return info


def t5(folder: Path, width: int, te: dict, seed: int, device: str) -> dict:
    """T5's encoder at ``te``'s depth and widths (in place of the one-layer one), bf16."""
    import torch
    from transformers import T5Config, T5EncoderModel

    old = T5Config.from_pretrained(folder)
    cfg = T5Config(**{**old.to_dict(), "d_model": width, **te})
    torch.manual_seed(seed)
    with torch.device(device):
        model = T5EncoderModel(cfg).to(torch.bfloat16)
    shutil.rmtree(folder)
    model.save_pretrained(folder)
    n = sum(p.numel() for p in model.parameters())
    return {"params": n, "layers": cfg.num_layers, "d_model": width, **te}


MISTRAL_SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
]

#: Mistral's chat format, reduced to what the FLUX.2 pipeline renders (system + user text).
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{% for c in m['content'] %}{{ c['text'] }}{% endfor %}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}{% else %}[IMG]{% endif %}{% endfor %}[/INST]"
    "{% else %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)


def mistral3(hf_home: Path, te: dict, seed: int, device: str) -> dict:
    """A Mistral3ForConditionalGeneration with random weights and a PixtralProcessor over a
    byte-level tokenizer, in the HF cache layout that ``from_pretrained(MISTRAL_PATH)`` and
    ``AutoProcessor.from_pretrained(MISTRAL_PATH)`` read with HF_HUB_OFFLINE=1."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralImageProcessor,
        PixtralProcessor,
        PixtralVisionConfig,
        PreTrainedTokenizerFast,
    )

    repo = hf_home / "hub" / ("models--" + MISTRAL_REPO.replace("/", "--"))
    rev = "0" * 40
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    vocab = {t: i for i, t in enumerate(MISTRAL_SPECIALS)}
    vocab.update({c: len(MISTRAL_SPECIALS) + i for i, c in enumerate(build.byte_chars())})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(MISTRAL_SPECIALS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    tok.model_max_length = 1024
    PixtralProcessor(
        image_processor=PixtralImageProcessor(patch_size=16),
        tokenizer=tok,
        patch_size=16,
        spatial_merge_size=2,
        chat_template=MISTRAL_TEMPLATE,
    ).save_pretrained(snap)
    text = MistralConfig(
        vocab_size=len(vocab),
        num_hidden_layers=MISTRAL_LAYERS,
        max_position_embeddings=2048,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
        **te,
    )
    vision = PixtralVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=16,
        image_size=64,
        patch_size=16,
    )
    cfg = Mistral3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        image_token_index=vocab["[IMG]"],
        spatial_merge_size=2,
        multimodal_projector_bias=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Mistral3ForConditionalGeneration(cfg)
    model = model.to(torch.bfloat16)
    model.save_pretrained(snap)
    n = sum(p.numel() for p in model.parameters())
    del model
    return {"params": n, "layers": MISTRAL_LAYERS, "vocab": len(vocab), **te}
