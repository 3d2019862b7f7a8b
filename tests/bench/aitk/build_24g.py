"""What tests/bench/ai_toolkit_24g.py gives ai-toolkit to train, at the real sizes where they
matter, with seeded random weights: FLUX.2-dev (``build_flux2``: ai-toolkit's own ``Flux2`` and
``AutoEncoder``, a Mistral3 text encoder in an HF cache) and FLUX.1-dev (``build_flux1``: a
diffusers folder, T5-XXL's encoder), and how many FLUX.2 blocks fit the host
(``flux2_singles_for_host``) or the disk (``flux2_singles_for_disk``). A text encoder at
Mistral Small 3.1's full size (``MISTRAL_FULL``, 47 GB of bf16) is written shard by shard
(``write_shards``): its weights are never all in host memory."""

from __future__ import annotations

import json
import shutil
import time
import zlib
from pathlib import Path

from tests.bench.aitk import build

MISTRAL_REPO = "mistralai/Mistral-Small-3.1-24B-Instruct-2503"  # flux2_model.MISTRAL_PATH

MISTRAL_LAYERS = 30  # pipeline.OUTPUT_LAYERS_MISTRAL reads hidden states 10, 20 and 30

FLUX2_FILE = "flux2-dev.safetensors"  # flux2_model.FLUX2_TRANSFORMER_FILENAME

FLUX2_CLASS = "extensions_built_in.diffusion_models.flux2.flux2_model:Flux2Params"

#: Mistral Small 3.1's text model at its real size, as transformers' Mistral3Config has it for
#: mistralai/Mistral-Small-3.1-24B-Instruct-2503 (its text_config defaults): 40 layers, width
#: 5120, 32 x 128 attention heads / 8 kv heads, MLP 32768, a vocabulary of 131072 in an untied
#: embedding and lm_head. The tokenizer stays the bench's byte-level one (its ids < 131072).
MISTRAL_FULL = dict(
    num_hidden_layers=40,
    hidden_size=5120,
    intermediate_size=32768,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=131072,
    rms_norm_eps=1e-5,
    rope_theta=1e9,
    max_position_embeddings=131072,
    sliding_window=None,
    tie_word_embeddings=False,
)

#: The full-size text encoder's shards: about the size of the real checkpoint's (10 of ~5 GB).
TE_SHARD_BYTES = 5 * 10**9

#: What a run writes to --work besides the build (each run's LoRA file, ai-toolkit's caches and
#: the logs: well under this), kept free when ``flux2_singles_for_disk`` fills the disk.
DISK_RESERVE = 1 << 30

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
        t = _init(name, shape, g, device)
        dtype = torch.float8_e4m3fn if fp8 and len(shape) == 2 and name.endswith("weight") else None
        out[name] = t.to(dtype or torch.bfloat16).cpu()
        del t
    return out


def _init(name: str, shape: tuple, g, device: str):
    """One float32 tensor of ``random_state``'s: norms' scales 1, biases 0, others N(0,
    1/fan_in) drawn from ``g``."""
    import torch

    if "norm" in name or name.endswith(".scale"):
        if name.endswith(("weight", "scale")):
            return torch.ones(shape, device=device)
        return torch.zeros(shape, device=device)
    if name.endswith("bias"):
        return torch.zeros(shape, device=device)
    fan_in = shape[-1] if len(shape) > 1 else shape[0]
    return torch.empty(shape, device=device).normal_(0.0, fan_in**-0.5, generator=g)


def seeded_tensor(name: str, shape: tuple, seed: int, device: str):
    """``name``'s bf16 tensor in a ``write_shards`` file, on ``device``: drawn from a generator
    of its own, seeded with the CRC-32 of ``seed`` and the name (a CPU generator keeps 32 bits
    of a seed), so that any one tensor can be made again without the others, in whatever
    order the shards hold them."""
    import torch

    g = torch.Generator(device).manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return _init(name, shape, g, device).to(torch.bfloat16)


def saved_names(model) -> dict:
    """``{name in the file: name in model.state_dict()}`` as ``save_pretrained`` names them:
    tied weights left out (``remove_tied_weights_from_state_dict``) and the state dict's names
    reverted to the checkpoint's (``revert_weight_conversion``: for Mistral3, the
    ``language_model.model.*`` layout). Works on a model on the meta device."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    kept = remove_tied_weights_from_state_dict(model.state_dict(), model)
    source = {id(t): k for k, t in kept.items()}
    reverted = revert_weight_conversion(model, dict(kept))
    lost = [k for k, t in reverted.items() if id(t) not in source]
    if lost:  # a converter (not a renaming) made these: the writer cannot make them alone
        raise ValueError(f"saved_names: {lost[:3]} are not renamed state-dict tensors")
    return {k: source[id(t)] for k, t in reverted.items()}


def write_shards(model, folder: Path, seed: int, device: str, shard_bytes: int) -> dict:
    """``model`` (on the meta device, bf16) saved as ``save_pretrained`` saves it, with seeded
    random weights (``seeded_tensor``): ``config.json``, ``generation_config.json``, the
    safetensors shards ``model-0000I-of-0000N.safetensors`` of at most ``shard_bytes`` each
    (one tensor larger than that is a shard of its own) and ``model.safetensors.index.json``.
    Each tensor is made on ``device`` and moved to the CPU into the shard being filled, which
    is written and dropped before the next: the host holds one shard at most
    (``largest_buffer_bytes``, counted here; safetensors writes from the tensors' memory)."""
    from safetensors.torch import save_file

    names = saved_names(model)
    state = model.state_dict()
    plan, size = [[]], 0
    for saved, name in names.items():
        t = state[name]
        if not t.is_floating_point():
            raise ValueError(f"write_shards: {name} is {t.dtype}; only float tensors are made")
        n = t.numel() * 2
        if plan[-1] and size + n > shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append(saved)
        size += n
    model.config.dtype = "bfloat16"  # what save_pretrained records of a bf16 model
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    if model.can_generate():
        model.generation_config.save_pretrained(folder)
    files = (
        ["model.safetensors"]
        if len(plan) == 1
        else [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    )
    weight_map, largest, total = {}, 0, 0
    for file, shard in zip(files, plan, strict=True):
        buf, held = {}, 0
        for saved in shard:
            t = state[names[saved]]
            buf[saved] = seeded_tensor(saved, tuple(t.shape), seed, device).cpu()
            held += buf[saved].numel() * buf[saved].element_size()
            largest = max(largest, held)
            weight_map[saved] = file
        save_file(buf, folder / file, metadata={"format": "pt"})
        total += held
        del buf
    if len(plan) > 1:
        meta = {"total_parameters": model.num_parameters(), "total_size": total}
        index = {"metadata": meta, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {
        "shards": len(files),
        "bytes_on_disk": sum((folder / f).stat().st_size for f in files),
        "largest_buffer_bytes": largest,
    }


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


def flux2_disk_bytes(aitk: Path, size: dict, fp8: bool) -> dict:
    """What ``build_flux2`` writes for ``size``, from the parameter counts: ``fixed``, the
    bytes of everything but the single-stream blocks (the transformer's double blocks and the
    rest of it, the bf16 VAE and text encoder), ``single``, one single block's bytes, and
    ``full``, FLUX.2-dev's number of single blocks (Linear weights 1 byte a parameter with
    ``fp8``, all else 2)."""
    import torch
    from transformers import Mistral3ForConditionalGeneration

    src = build.flux2_src(aitk, "model")
    ae = build.flux2_src(aitk, "autoencoder")

    def transformer(singles: int) -> int:
        with torch.device("meta"):
            model = src.Flux2(
                src.Flux2Params(**dict(size["transformer"], depth_single_blocks=singles))
            )
        return sum(
            t.numel() * (1 if fp8 and t.dim() == 2 and name.endswith("weight") else 2)
            for name, t in model.state_dict().items()
        )

    with torch.device("meta"):
        vae = sum(p.numel() for p in ae.AutoEncoder(ae.AutoEncoderParams()).parameters())
        te = Mistral3ForConditionalGeneration(mistral3_config(size["te"])).num_parameters()
    fixed = transformer(0)
    return {
        "fixed": fixed + 2 * (vae + te),
        "single": transformer(1) - fixed,
        "full": src.Flux2Params(**size["transformer"]).depth_single_blocks,
    }


def flux2_singles_for_disk(disk: dict, free: int) -> int:
    """The most single blocks (at most ``disk["full"]``) whose build (``flux2_disk_bytes``)
    fits ``free`` bytes with ``DISK_RESERVE`` left for the runs; 0 where none does."""
    room = free - DISK_RESERVE - disk["fixed"]
    return max(0, min(disk["full"], room // disk["single"]))


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
    info["text_encoder"] = mistral3(
        root.parent / "hf", size["te"], seed + 2, device, size.get("te_shard_bytes")
    )
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


def mistral_vocab() -> dict:
    """The byte-level tokenizer's ids: Mistral's special tokens, then one a byte (267 in all)."""
    vocab = {t: i for i, t in enumerate(MISTRAL_SPECIALS)}
    vocab.update({c: len(MISTRAL_SPECIALS) + i for i, c in enumerate(build.byte_chars())})
    return vocab


def mistral3_config(te: dict):
    """A Mistral3Config: ``te``'s text model (30 layers and the tokenizer's vocabulary unless
    it sets ``num_hidden_layers`` / ``vocab_size``; ``tie_word_embeddings`` set for the whole
    model too where it is given) and a one-layer Pixtral vision tower (Mistral Small 3.1's has
    24 layers of width 1024)."""
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig

    vocab = mistral_vocab()
    text = MistralConfig(
        **{
            "vocab_size": len(vocab),
            "num_hidden_layers": MISTRAL_LAYERS,
            "max_position_embeddings": 2048,
            "bos_token_id": vocab["<s>"],
            "eos_token_id": vocab["</s>"],
            "pad_token_id": vocab["<pad>"],
            "tie_word_embeddings": False,
            **te,
        }
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
    tie = {"tie_word_embeddings": te["tie_word_embeddings"]} if "tie_word_embeddings" in te else {}
    return Mistral3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        image_token_index=vocab["[IMG]"],
        spatial_merge_size=2,
        multimodal_projector_bias=False,
        **tie,
    )


def mistral3_snapshot(hf_home: Path) -> Path:
    """The HF cache's snapshot folder of ``MISTRAL_REPO`` (made), which ``from_pretrained``
    finds with HF_HUB_OFFLINE=1."""
    repo = hf_home / "hub" / ("models--" + MISTRAL_REPO.replace("/", "--"))
    rev = "0" * 40
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return snap


def mistral3_weights(
    snap: Path, te: dict, seed: int, device: str, shard_bytes: int | None = None
) -> dict:
    """The Mistral3ForConditionalGeneration of ``mistral3_config(te)`` in bf16 with random
    weights, saved in ``snap``: made whole on ``device`` and ``save_pretrained`` (the reduced
    encoder), or, with ``shard_bytes``, made on the meta device and written shard by shard
    (``write_shards``, seeded per tensor), which the full-size encoder needs."""
    import torch
    from transformers import Mistral3ForConditionalGeneration

    cfg = mistral3_config(te)
    if shard_bytes is None:
        torch.manual_seed(seed)
        with torch.device(device):
            model = Mistral3ForConditionalGeneration(cfg)
        model = model.to(torch.bfloat16)
        model.save_pretrained(snap)
        written = {}
    else:
        with torch.device("meta"):
            model = Mistral3ForConditionalGeneration(cfg).to(torch.bfloat16)
        written = write_shards(model, snap, seed, device, shard_bytes)
    n = sum(p.numel() for p in model.parameters())
    del model
    text = cfg.text_config
    return {
        "params": n,
        "layers": text.num_hidden_layers,
        "vocab": text.vocab_size,
        "tokenizer_ids": len(mistral_vocab()),
        "vision_layers": cfg.vision_config.num_hidden_layers,
        **written,
        **te,
    }


def mistral3(hf_home: Path, te: dict, seed: int, device: str, shard_bytes: int | None = None):
    """A Mistral3ForConditionalGeneration with random weights (``mistral3_weights``) and a
    PixtralProcessor over a byte-level tokenizer, in the HF cache layout that
    ``from_pretrained(MISTRAL_PATH)`` and ``AutoProcessor.from_pretrained(MISTRAL_PATH)`` read
    with HF_HUB_OFFLINE=1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    snap = mistral3_snapshot(hf_home)
    vocab = mistral_vocab()
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
    return mistral3_weights(snap, te, seed, device, shard_bytes)
