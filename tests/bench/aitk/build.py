"""What tests/bench/ai_toolkit_real.py gives ai-toolkit to train, with seeded random weights:
a diffusers FLUX.1 folder (``build_model``: transformer, a small VAE, one-layer CLIP and T5 with
tokenizers from a made-up vocabulary), FLUX.2 klein 4B (``build_klein``: ai-toolkit's own
``Flux2`` and ``AutoEncoder``, loaded by path from the checkout, and a Qwen3 text encoder in an
HF cache), the images with their captions (``build_data``) and the job's YAML (``job_yaml``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent  # tests/bench

TEMPLATES = {
    "flux1": BENCH / "ai_toolkit_flux.yaml",
    "flux2_klein_4b": BENCH / "ai_toolkit_flux2_klein.yaml",
}

SIZES = {
    # name: FluxTransformer2DModel config, CLIP width, T5 width are the transformer's
    "tiny": dict(
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    ),
    "flux1": dict(  # black-forest-labs/FLUX.1-dev's transformer/config.json
        num_layers=19,
        num_single_layers=38,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=4096,
        pooled_projection_dim=768,
        axes_dims_rope=(16, 56, 56),
    ),
}

#: FLUX.2 klein 4B: the transformer's Klein4BParams fields that differ from ai-toolkit's (the
#: shim rebinds `Klein4BParams` in flux2_klein_model.py to these: WS_AITK_FLUX2_PARAMS), and
#: the Qwen3 text encoder's config. The pipeline stacks Qwen3's hidden states 9, 18 and 27
#: (OUTPUT_LAYERS_QWEN3), so the encoder has 27 layers, and context_in_dim = 3 x its width.
KLEIN_SIZES = {
    "tiny": {
        "transformer": dict(
            hidden_size=64,
            num_heads=2,
            axes_dim=[8, 8, 8, 8],
            depth=1,
            depth_single_blocks=2,
            context_in_dim=96,
        ),
        "te": dict(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        ),
    },
    "klein4b": {  # ai-toolkit's Klein4BParams (hidden 3072, 5 + 20 blocks); Qwen3-4B's width
        "transformer": {},
        "te": dict(
            hidden_size=2560,
            intermediate_size=9728,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
        ),
    },
}

KLEIN_TE_LAYERS = 27

KLEIN_TE_REPO = "Qwen/Qwen3-4B"  # Flux2Klein4BModel.flux2_klein_te_path, from the HF cache

KLEIN_TRANSFORMER_FILE = "flux-2-klein-base-4b.safetensors"  # Flux2Klein4BModel.flux2_te_filename

KLEIN_VAE_FILE = "ae.safetensors"  # flux2_model.FLUX2_VAE_FILENAME, looked for in name_or_path


def _fill(model, seed: int, device):
    """Deterministic random weights (the same bytes on every machine for a seed): a CPU
    generator per tensor, in a fixed order, then moved."""
    import torch

    g = torch.Generator("cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")) or ".norm" in name:
                t = torch.ones(p.shape) if name.endswith("weight") else torch.zeros(p.shape)
            elif name.endswith("bias"):
                t = torch.zeros(p.shape)
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else p.numel()
                t = torch.randn(p.shape, generator=g) * (1.0 / fan_in**0.5)
            p.copy_(t.to(device=device, dtype=p.dtype))


def _transformer(folder: Path, cfg: dict, seed: int, device: str):
    import torch
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = FluxTransformer2DModel(guidance_embeds=True, **cfg)
    model = model.to_empty(device=device).to(torch.bfloat16)
    if device == "cpu":
        _fill(model, seed, device)
    else:  # 12B parameters: a CPU generator would take minutes; the device's is seeded too
        g = torch.Generator(device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".norm" in name or "norm." in name:
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    fan_in = p.shape[-1] if p.dim() > 1 else p.numel()
                    p.normal_(0.0, 1.0 / fan_in**0.5, generator=g)
    folder.mkdir(parents=True)
    model.save_config(folder)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    del model
    save_file(state, folder / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})
    n = sum(v.numel() for v in state.values())
    return n, sum(v.numel() * v.element_size() for v in state.values())


def _vocabulary() -> list[str]:
    return [f"w{i}" for i in range(64)] + ["a", "photo", "of", "tok", "cube", "red", "blue"]


def byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table (CLIP's and Qwen's byte-level BPE): one character per
    byte, the printable ones as themselves."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def _clip(root: Path, width: int, seed: int):
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel

    # CLIP's byte-level BPE with no merges: every character is a token.
    chars = byte_chars()
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    tok = root / "tokenizer"
    tok.mkdir()
    (tok / "vocab.json").write_text(json.dumps(vocab))
    (tok / "merges.txt").write_text("#version: 0.2\n")
    (tok / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "CLIPTokenizer",
                "model_max_length": 77,
                "bos_token": "<|startoftext|>",
                "eos_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
            }
        )
    )
    cfg = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=width,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=77,
        projection_dim=width,
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
    )
    model = CLIPTextModel(cfg).to(torch.bfloat16)
    _fill(model, seed, "cpu")
    model.save_pretrained(root / "text_encoder")


def _t5(root: Path, width: int, seed: int):
    import torch
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    # A Unigram vocabulary in T5's order (<pad>, </s>, <unk>, then pieces), no sentinels.
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + w, -1.0) for w in _vocabulary()]
    tok = T5TokenizerFast(vocab=pieces, extra_ids=0)
    tok.model_max_length = 512
    tok.save_pretrained(root / "tokenizer_2")
    words = list(range(len(tok)))
    cfg = T5Config(
        vocab_size=len(words),
        d_model=width,
        d_kv=32,
        d_ff=64,
        num_layers=1,
        num_heads=2,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    model = T5EncoderModel(cfg).to(torch.bfloat16)
    _fill(model, seed, "cpu")
    model.save_pretrained(root / "text_encoder_2")


def _vae(root: Path, seed: int):
    import torch
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=16,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[32, 32, 32, 32],
        layers_per_block=1,
        norm_num_groups=32,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).to(torch.bfloat16)
    _fill(vae, seed, "cpu")
    vae.save_pretrained(root / "vae")


def build_model(root: Path, cfg: dict, seed: int, device: str) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    t0 = time.monotonic()
    root.mkdir(parents=True)
    n, nbytes = _transformer(root / "transformer", cfg, seed, device)
    _vae(root, seed + 1)
    _clip(root, cfg["pooled_projection_dim"], seed + 2)
    _t5(root, cfg["joint_attention_dim"], seed + 3)
    FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    ).save_pretrained(root / "scheduler")
    return {"transformer_params": n, "transformer_bytes": nbytes, "build_s": time.monotonic() - t0}


def flux2_src(aitk: Path, name: str):
    """ai-toolkit's FLUX.2 source file `src/<name>.py` (torch and einops only), loaded by path:
    importing it as a package would import every ai-toolkit model."""
    import importlib.util

    path = aitk / "extensions_built_in" / "diffusion_models" / "flux2" / "src" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_aitk_flux2_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_module(module, path: Path) -> tuple[int, int]:
    from safetensors.torch import save_file

    state = {k: v.detach().to("cpu").contiguous() for k, v in module.state_dict().items()}
    save_file(state, path, metadata={"format": "pt"})
    return sum(v.numel() for v in state.values()), sum(
        v.numel() * v.element_size() for v in state.values()
    )


def _qwen3(hf_home: Path, te: dict, seed: int, device: str) -> dict:
    """A Qwen3ForCausalLM with random weights and a byte-level tokenizer, in the HF cache layout
    that `from_pretrained("Qwen/Qwen3-4B")` reads with HF_HUB_OFFLINE=1:
    hub/models--Qwen--Qwen3-4B/{refs/main, snapshots/<rev>/}."""
    import torch
    import transformers
    from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM

    repo = hf_home / "hub" / ("models--" + KLEIN_TE_REPO.replace("/", "--"))
    rev = "0" * 40
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    # GPT-2's byte-to-unicode table, no merges: every byte is a token.
    vocab = {c: i for i, c in enumerate(byte_chars())}
    special = dict(
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if int(transformers.__version__.split(".")[0]) >= 5:
        tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token=None, **special)
    else:
        (snap / "vocab.json").write_text(json.dumps(vocab))
        (snap / "merges.txt").write_text("#version: 0.2\n")
        tok = Qwen2Tokenizer(snap / "vocab.json", snap / "merges.txt", **special)
    # Qwen3's chat template, reduced to what the FLUX.2 pipeline renders (no thinking).
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}"
        "<think>\n\n</think>\n\n{% endif %}{% endif %}"
    )
    tok.model_max_length = 512
    tok.save_pretrained(snap)
    cfg = Qwen3Config(
        vocab_size=len(tok),
        num_hidden_layers=KLEIN_TE_LAYERS,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        **te,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    model = model.to(torch.bfloat16)
    model.save_pretrained(snap)
    n = sum(p.numel() for p in model.parameters())
    del model
    return {"te_params": n, "te_bytes": 2 * n, "te_layers": KLEIN_TE_LAYERS, "vocab": len(tok)}


def build_klein(root: Path, aitk: Path, fields: dict, te: dict, seed: int, device: str) -> dict:
    """model/flux-2-klein-base-4b.safetensors (ai-toolkit's Flux2 at Klein4BParams(**fields)),
    model/ae.safetensors (its AutoEncoder at AutoEncoderParams(), FLUX.2's VAE size) and the
    Qwen3 text encoder in root/hf (HF_HOME), all with seeded random initialisation."""
    import torch

    t0 = time.monotonic()
    root.mkdir(parents=True)
    src = flux2_src(aitk, "model")
    torch.manual_seed(seed)
    with torch.device(device):
        transformer = src.Flux2(src.Klein4BParams(**fields))
    transformer = transformer.to(torch.bfloat16)
    n, nbytes = save_module(transformer, root / KLEIN_TRANSFORMER_FILE)
    del transformer
    if device != "cpu":
        torch.cuda.empty_cache()
    ae_src = flux2_src(aitk, "autoencoder")
    torch.manual_seed(seed + 1)
    vae = ae_src.AutoEncoder(ae_src.AutoEncoderParams())
    vae_params, _ = save_module(vae.to(torch.bfloat16), root / KLEIN_VAE_FILE)
    del vae
    te_info = _qwen3(root.parent / "hf", te, seed + 2, device)
    if device != "cpu":
        torch.cuda.empty_cache()
    return {
        "transformer_params": n,
        "transformer_bytes": nbytes,
        "vae_params": vae_params,
        **te_info,
        "build_s": time.monotonic() - t0,
    }


def build_data(folder: Path, images: int, resolution: int, seed: int):
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    words = _vocabulary()
    for i in range(images):
        pixels = rng.integers(0, 256, (resolution, resolution, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img{i}.png")
        caption = " ".join(
            ["a", "photo", "of", "tok"] + [words[(i * 7 + k) % 64] for k in range(4)]
        )
        (folder / f"img{i}.txt").write_text(caption)


def job_yaml(arch: str, device: str, steps: int, resolution: int) -> str:
    text = TEMPLATES[arch].read_text()
    for key, value in {"@DEVICE@": device, "@STEPS@": steps, "@RESOLUTION@": resolution}.items():
        text = text.replace(key, str(value))
    return text
