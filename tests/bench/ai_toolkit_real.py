"""ai-toolkit's real code, run twice on one model: its own layer offloading, then weightstream's
launcher, with the same YAML.

    # FLUX.2 klein 4B: the loader attaches the transformer and the Qwen3 text encoder
    python3 -m tests.bench.ai_toolkit_real --aitk .aitk --bin target/release/weightstream \\
        --arch flux2_klein_4b --size klein4b --out $OUT          # -> $OUT/ai_toolkit.{json,md}
    # FLUX.1: the loader attaches nothing at the pinned commit
    python3 -m tests.bench.ai_toolkit_real --aitk .aitk --bin target/release/weightstream \\
        --arch flux1 --size flux1 --out $OUT                     # -> $OUT/ai_toolkit_flux1.*

What runs, unchanged: ai-toolkit's `run.py` (given by --aitk, a checkout of ostris/ai-toolkit,
kept outside this repository), its ExtensionJob, SDTrainer, the model's loader (FLUX.1:
`toolkit/stable_diffusion_model.py`; FLUX.2 klein 4B:
`extensions_built_in/diffusion_models/flux2/flux2{,_klein}_model.py`, which call
`MemoryManager.attach` on the transformer and on the Qwen3 text encoder when
`model.layer_offloading` is set), latent and text-embedding caching, the unloader
(`MemoryManager.free` of the text encoder), its LoRA network and training steps, and its
UILogger (every step's loss in `output/<name>/loss_log.db`). Run (a) is `python run.py
job.yaml`; run (b) is `python -m weightstream.integrations.ai_toolkit run.py job.yaml` against a
daemon this script starts (`--bin`). Each run has its own folder with the same `job.yaml`, a
link to the shared model, a fresh copy of the dataset (ai-toolkit writes its caches there) and
its own output. `network.layer_offloading` stays off (the LoRA stays on the device in both).

What this script makes, with seeded random weights:
- flux1 (tests/bench/ai_toolkit_flux.yaml): a diffusers FLUX.1 folder (FluxTransformer2DModel at
  `--size tiny|flux1`, `--double`/`--single` to cut blocks; a small AutoencoderKL; one-layer
  CLIP and T5 encoders whose widths match the transformer's, tokenizers from a made-up
  vocabulary).
- flux2_klein_4b (tests/bench/ai_toolkit_flux2_klein.yaml): `model/flux-2-klein-base-4b.
  safetensors` (ai-toolkit's own `Flux2` class, loaded by path from --aitk, at
  `Klein4BParams(**fields)`: `--size klein4b` is the real 4B, `--double`/`--single` cut its 5 +
  20 blocks, `--size tiny` is narrow too), `model/ae.safetensors` (ai-toolkit's FLUX.2
  `AutoEncoder` at its real size) and a 27-layer Qwen3ForCausalLM with a byte-level tokenizer
  saved as `Qwen/Qwen3-4B` in an HF cache (`<work>/hf/hub/models--Qwen--Qwen3-4B/{refs/main,
  snapshots/<rev>}`; the runs get HF_HOME=<work>/hf and HF_HUB_OFFLINE=1), where klein's
  `load_te` finds it with `from_pretrained("Qwen/Qwen3-4B")`. When the transformer's fields
  differ from ai-toolkit's Klein4BParams, the shim rebinds that name in
  `flux2_klein_model.py` (WS_AITK_FLUX2_PARAMS, both runs): the only patch of ai-toolkit.
- a few random images with captions, and the YAML.

What it stubs: tests/bench/aitk_shim/sitecustomize.py serves the modules in STUBS when they are
not installed (ai-toolkit imports every extension and model at start-up; none of these is on
these runs' path, and the shim records any call into a stub outside an import, which fails the
bench). On a machine without CUDA it hides `triton` (OmniGen2's kernels query the CUDA device at
import). Pure-Python packages missing from the GPU image travel as wheels (`.whl/`: ai-toolkit's
pinned diffusers commit, oyaml, python-dotenv).

Measured per run: seconds per step (UILogger's wall times, after the first logged step), the
run's wall time, the trainer's peak RSS (VmHWM) and, on CUDA, torch's peak allocated/reserved
bytes in the trainer and nvidia-smi's peak device memory in use; the daemon's peak RSS; what
each `MemoryManager.attach` took over (ai-toolkit: the layers it bounces from the CPU;
weightstream: the handle's streamed layers) and weightstream's daemon session statistics.
Checked: every logged loss and the saved LoRA tensors are bit-identical between the two runs;
for klein, that both managers took layers over and that the daemon copied bytes for acquires.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.bench.card import phase
from tests.daemon import Daemon

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SHIM = HERE / "aitk_shim"
TEMPLATES = {
    "flux1": HERE / "ai_toolkit_flux.yaml",
    "flux2_klein_4b": HERE / "ai_toolkit_flux2_klein.yaml",
}
AITK_COMMIT = "27a03a91f23eb1b757d5ec2e80ee3e129cfcc350"

#: Imported by ai-toolkit at start-up, absent from the GPU image, off a FLUX.1 LoRA run's path.
STUBS = [
    "albumentations",  # toolkit/dataloader_mixins.py (augmentations: not configured)
    "av",  # diffusers' LTX-2 export utilities (video)
    "controlnet_aux",  # toolkit/stable_diffusion_model.py (ControlNet adapters)
    "lpips",  # SDTrainer (LPIPS loss: not configured)
    "lycoris",  # toolkit/lycoris_special.py (LoKr/LoCon networks: `type: lora` here)
    "optimum",  # optimum.quanto (quantize: false)
    "torchao",  # toolkit/util/quantize.py builds its configs at import (quantize: false)
    "torchaudio",  # audio models (real one used where installed)
    "cv2",  # image/video helpers (real one used where installed)
    "httpx",  # hub helpers (real one used where installed)
]
#: Stubs that must also look installed to importlib.metadata (diffusers checks PyAV).
STUB_DISTS = ["av"]

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


# --- the model, the data, the job ---------------------------------------------------------------


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


def _byte_chars() -> list[str]:
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
    chars = _byte_chars()
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


def _aitk_flux2_src(aitk: Path, name: str):
    """ai-toolkit's FLUX.2 source file `src/<name>.py` (torch and einops only), loaded by path:
    importing it as a package would import every ai-toolkit model."""
    import importlib.util

    path = aitk / "extensions_built_in" / "diffusion_models" / "flux2" / "src" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_aitk_flux2_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _save(module, path: Path) -> tuple[int, int]:
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
    vocab = {c: i for i, c in enumerate(_byte_chars())}
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
    src = _aitk_flux2_src(aitk, "model")
    torch.manual_seed(seed)
    with torch.device(device):
        transformer = src.Flux2(src.Klein4BParams(**fields))
    transformer = transformer.to(torch.bfloat16)
    n, nbytes = _save(transformer, root / KLEIN_TRANSFORMER_FILE)
    del transformer
    if device != "cpu":
        torch.cuda.empty_cache()
    ae_src = _aitk_flux2_src(aitk, "autoencoder")
    torch.manual_seed(seed + 1)
    vae = ae_src.AutoEncoder(ae_src.AutoEncoderParams())
    vae_params, _ = _save(vae.to(torch.bfloat16), root / KLEIN_VAE_FILE)
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


# --- running and measuring ----------------------------------------------------------------------


#: The /proc/PID/status fields of the RSS timeline: its anonymous memory (the trainer's own
#: heap and tensors), file pages (mapped files: the model read from disk) and shared memory
#: (the daemon's regions it maps), and the host's MemAvailable beside them.
RSS_FIELDS = ("RssAnon", "RssFile", "RssShmem")
#: Seconds between two points of the RSS timeline.
TIMELINE_EVERY = 2.0


class Sampler(threading.Thread):
    """Polls a process tree's VmHWM/RSS and, on CUDA, nvidia-smi's memory in use; every
    ``TIMELINE_EVERY`` s a point of ``timeline``: seconds since the start, the RSS_FIELDS and
    the host's MemAvailable, in GiB (what a process killed by the host's out-of-memory killer
    held, and where, up to its end)."""

    def __init__(self, pid: int, gpu: bool):
        super().__init__(daemon=True)
        self.pid, self.gpu = pid, gpu
        self.hwm = 0
        self.gpu_used = 0
        self.timeline: list[dict] = []
        self.stop = threading.Event()

    def _point(self, status: str, t: float):
        point = {"t": round(t, 1)}
        for line in status.splitlines():
            name, _, value = line.partition(":")
            if name in RSS_FIELDS:
                point[name] = round(int(value.split()[0]) / (1 << 20), 2)
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    point["MemAvailable"] = round(int(line.split()[1]) / (1 << 20), 2)
        except OSError:
            pass
        self.timeline.append(point)

    def run(self):
        last_smi = 0.0
        start = last_point = time.monotonic()
        while not self.stop.is_set():
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
                for line in status.splitlines():
                    if line.startswith("VmHWM:"):
                        self.hwm = max(self.hwm, int(line.split()[1]) * 1024)
                now = time.monotonic()
                if not self.timeline or now - last_point >= TIMELINE_EVERY:
                    last_point = now
                    self._point(status, now - start)
            except (OSError, ValueError, IndexError):
                pass
            if self.gpu and time.monotonic() - last_smi > 0.5:
                last_smi = time.monotonic()
                try:
                    out = subprocess.run(
                        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                        capture_output=True,
                        text=True,
                        timeout=10,
                    ).stdout
                    self.gpu_used = max(self.gpu_used, int(out.split()[0]) * (1 << 20))
                except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                    pass
            self.stop.wait(0.1)


def read_log(db: Path) -> dict:
    con = sqlite3.connect(db)
    try:
        steps = con.execute("SELECT step, wall_time FROM steps ORDER BY step").fetchall()
        losses = con.execute(
            "SELECT step, value_real FROM metrics WHERE key = 'loss/loss' ORDER BY step"
        ).fetchall()
    finally:
        con.close()
    times = [t for _, t in steps]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {
        "logged_steps": [s for s, _ in steps],
        "losses": [v for _, v in losses],
        "loss_steps": [s for s, _ in losses],
        "s_per_it": (sum(gaps) / len(gaps)) if gaps else None,
        "step_gaps_s": gaps,
    }


def read_log_times(db: Path) -> list[float]:
    con = sqlite3.connect(db)
    try:
        return [t for (t,) in con.execute("SELECT wall_time FROM steps ORDER BY step")]
    finally:
        con.close()


def lora_tensors(output: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(output.glob("*/*.safetensors"))
    assert files, f"no LoRA saved under {output}"
    return load_file(files[-1])


def run_one(
    mode: str,
    args,
    work: Path,
    model: Path,
    data: Path,
    yaml_text: str,
    cuda: bool,
    extra_env: dict,
    kind: str | None = None,
    link: str | None = None,
):
    # "MODE#N": MODE once more (its own folder and result), e.g. resident#2 to see whether a
    # run repeats itself bit for bit on this machine. ``kind`` (aitk, weightstream, resident)
    # when the mode is a longer label; ``link`` caps weightstream's daemon.
    kind = kind or mode.partition("#")[0]
    folder = work / mode.replace("#", "-")
    folder.mkdir()
    (folder / "model").symlink_to(model)
    shutil.copytree(data, folder / "data")
    if kind == "resident":
        # The reference: the same job without any offloading (the weights in place).
        assert "layer_offloading: true" in yaml_text, "the template no longer offloads"
        yaml_text = yaml_text.replace("layer_offloading: true", "layer_offloading: false")
    (folder / "job.yaml").write_text(yaml_text)
    aitk = Path(args.aitk).resolve()
    env = dict(os.environ)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(
                [
                    str(SHIM),
                    str(REPO / "client-py" / "src"),
                    *args.pythonpath,
                    env.get("PYTHONPATH", ""),
                ]
            ),
            "WS_AITK_STUBS": ",".join(STUBS),
            "WS_AITK_STUB_DISTS": ",".join(STUB_DISTS),
            "WS_AITK_STUB_LOG": str(folder / "stubs.json"),
            "WS_AITK_STATS": str(folder / "torch_stats.json"),
            "WS_AITK_PROBE": str(folder / "probe.json"),
            "WS_AITK_DETERMINISTIC": "1",
            "SEED": str(args.seed),
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
            "PYTHONHASHSEED": "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONUNBUFFERED": "1",
            "TQDM_MININTERVAL": "5",
        }
    )
    env.update(extra_env)
    env["WS_PHASE_LABEL"] = mode  # the shim marks the training phase for tests/bench/card.py
    if not cuda:
        env["WS_AITK_HIDE"] = "triton"
    daemon = None
    if kind in ("aitk", "resident"):
        cmd = [sys.executable, str(aitk / "run.py"), "job.yaml"]
    else:
        # ``link`` (e.g. ``25GB/s``) caps the daemon's copies.
        daemon = Daemon(
            folder,
            *(["--copy-bandwidth-limit", link] if link else []),
            binary=args.bin,
            backend="cuda" if cuda else "host",
            log_level=os.environ.get("WEIGHTSTREAM_LOG", "warn"),
            log_stdout=True,
            ready_s=60,
        )
        env["WEIGHTSTREAM_SOCKET"] = daemon.socket
        cmd = [
            sys.executable,
            "-m",
            "weightstream.integrations.ai_toolkit",
            str(aitk / "run.py"),
            "job.yaml",
        ]
    print(f"[{mode}] {' '.join(cmd)}  (cwd {folder})", flush=True)
    phase("loading", mode)
    t0, started = time.monotonic(), time.time()
    with open(folder / "trainer.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = Sampler(proc.pid, cuda)
        dsampler = Sampler(daemon.pid, False) if daemon else None
        sampler.start()
        if dsampler:
            dsampler.start()
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        wall = time.monotonic() - t0
        sampler.stop.set()
        sampler.join()
        if dsampler:
            dsampler.stop.set()
            dsampler.join()
    if daemon:
        daemon.stop(timeout=30)
    tail = (folder / "trainer.log").read_text(errors="replace")[-6000:]
    result = {
        "mode": mode,
        "command": cmd,
        "rc": rc,
        "wall_s": wall,
        "trainer_peak_rss": sampler.hwm,
        "trainer_rss_timeline": sampler.timeline,
    }
    if dsampler:
        result["daemon_peak_rss"] = dsampler.hwm
        result["daemon_rss_timeline"] = dsampler.timeline
    if cuda:
        result["nvidia_smi_peak_used"] = sampler.gpu_used
    for name in ("torch_stats.json", "stubs.json", "probe.json"):
        p = folder / name
        if p.exists():
            result[name.removesuffix(".json")] = json.loads(p.read_text())
    if rc != 0:
        result["log_tail"] = tail
        print(tail, flush=True)
        return result, None
    db = next(folder.glob("output/*/loss_log.db"))
    result.update(read_log(db))
    # UILogger's wall times are time.time() when each step was logged: the first one's, from
    # the launch, is the time to the first step done.
    times = read_log_times(db)
    result["first_step_s"] = times[0] - started if times else None
    return result, lora_tensors(folder / "output")


def stubs_called(result: dict) -> list:
    return [c for c in result.get("stubs", {}).get("calls", []) if not c["in_import"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--aitk", required=True, help="ai-toolkit checkout (its run.py is run unchanged)"
    )
    ap.add_argument("--bin", required=True, help="the weightstream daemon binary")
    ap.add_argument(
        "--arch",
        choices=sorted(TEMPLATES),
        default="flux1",
        help="flux1: the FLUX.1 loader (attaches nothing at the pinned commit); flux2_klein_4b:"
        " FLUX.2 klein 4B (attaches the transformer and the Qwen3 text encoder)",
    )
    ap.add_argument(
        "--size",
        choices=sorted(set(SIZES) | set(KLEIN_SIZES)),
        default="tiny",
        help="flux1: tiny|flux1; flux2_klein_4b: tiny|klein4b",
    )
    ap.add_argument("--double", type=int, help="double-stream blocks (default: the size's)")
    ap.add_argument("--single", type=int, help="single-stream blocks (default: the size's)")
    ap.add_argument("--steps", type=int, default=4, help="ai-toolkit's train.steps")
    ap.add_argument("--resolution", type=int, default=None, help="image side (tiny 64, flux1 512)")
    ap.add_argument("--images", type=int, default=2)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--device", default=None, help="cuda:0 or cpu (default: cuda:0 when present)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a new one under /tmp)")
    ap.add_argument("--out", required=True, help="where ai_toolkit.json and .md go")
    ap.add_argument("--machine", default=None, help="what to call this machine in the results")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument(
        "--pythonpath", action="append", default=[], help="more entries for the runs' PYTHONPATH"
    )
    ap.add_argument("--modes", default="aitk,weightstream")
    args = ap.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available() if args.device is None else args.device.startswith("cuda")
    device = args.device or ("cuda:0" if cuda else "cpu")
    resolution = args.resolution or (64 if args.size == "tiny" else 512)
    klein = args.arch == "flux2_klein_4b"
    sizes = KLEIN_SIZES if klein else SIZES
    if args.size not in sizes:
        ap.error(f"--size {args.size} is not one of {sorted(sizes)} for --arch {args.arch}")
    if klein:
        cfg = dict(KLEIN_SIZES[args.size]["transformer"])
        te_cfg = dict(KLEIN_SIZES[args.size]["te"])
        double, single = "depth", "depth_single_blocks"
    else:
        cfg, te_cfg = dict(SIZES[args.size]), None
        double, single = "num_layers", "num_single_layers"
    if args.double is not None:
        cfg[double] = args.double
    if args.single is not None:
        cfg[single] = args.single
    work = Path(args.work) if args.work else Path(f"/tmp/ws-aitk-{os.getpid()}")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    print(f"building the model ({args.arch} {args.size}, {cfg}) in {work}", flush=True)
    extra_env = {}
    if klein:
        built = build_klein(
            work / "model", Path(args.aitk).resolve(), cfg, te_cfg, args.seed, device
        )
        extra_env["HF_HOME"] = str(work / "hf")  # Qwen/Qwen3-4B from its cache, offline
        if cfg:
            extra_env["WS_AITK_FLUX2_PARAMS"] = json.dumps(cfg)
    else:
        built = build_model(work / "model", cfg, args.seed, device if cuda else "cpu")
    build_data(work / "data", args.images, resolution, args.seed)
    yaml_text = job_yaml(args.arch, device, args.steps, resolution)
    print(f"built: {built}", flush=True)
    if cuda:
        torch.cuda.empty_cache()

    runs, loras = [], {}
    for mode in args.modes.split(","):
        result, lora = run_one(
            mode, args, work, work / "model", work / "data", yaml_text, cuda, extra_env
        )
        runs.append(result)
        loras[mode] = lora
        print(
            json.dumps({k: v for k, v in result.items() if k not in ("stubs", "log_tail")}),
            flush=True,
        )

    report = {
        "machine": args.machine or ("GPU: " + torch.cuda.get_device_name(0) if cuda else "CPU"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ai_toolkit": {"path": str(Path(args.aitk).resolve()), "commit": AITK_COMMIT},
        "device": device,
        "arch": args.arch,
        "size": args.size,
        "transformer_config": cfg,
        "text_encoder_config": te_cfg,
        "env": extra_env,
        "model": built,
        "steps": args.steps,
        "resolution": resolution,
        "images": args.images,
        "seed": args.seed,
        "job_yaml": yaml_text,
        "stubs": STUBS,
        "stub_dists": STUB_DISTS,
        "hidden": [] if cuda else ["triton"],
        "runs": runs,
    }
    ok = all(r["rc"] == 0 for r in runs)
    called = {r["mode"]: stubs_called(r) for r in runs}
    report["stubs_called_outside_imports"] = called
    ok = ok and not any(called.values())
    if klein and ok:
        report["streaming"] = streaming = streaming_check(
            [r for r in runs if not r["mode"].startswith("resident")]
        )
        ok = ok and streaming["ok"]
    by_mode = {r["mode"]: r for r in runs}
    if ok and "resident" in by_mode:
        # With the weights-in-place run present, each offloading run is compared with it;
        # weightstream's must equal it bit for bit (ai-toolkit's is reported).
        ref, ref_lora = by_mode["resident"], loras["resident"]
        report["vs_resident"] = {}
        for mode, run in by_mode.items():
            if mode == "resident":
                continue
            lora = loras[mode]
            report["vs_resident"][mode] = {
                "losses_equal": run["losses"] == ref["losses"] and len(ref["losses"]) > 0,
                "lora_equal": lora.keys() == ref_lora.keys()
                and all(torch.equal(lora[k], ref_lora[k]) for k in lora),
                "loss_diffs": [x - y for x, y in zip(run["losses"], ref["losses"], strict=False)],
                "probe": probe_diff(ref.get("probe"), run.get("probe")),
            }
        ws = report["vs_resident"].get("weightstream", {})
        ok = bool(ws.get("losses_equal") and ws.get("lora_equal"))
    elif ok and len(runs) == 2:
        a, b = runs
        report["losses_equal"] = a["losses"] == b["losses"] and len(a["losses"]) > 0
        la, lb = loras[a["mode"]], loras[b["mode"]]
        report["lora_equal"] = la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)
        report["lora_tensors"] = len(la)
        if not report["losses_equal"]:
            report["loss_diffs"] = [x - y for x, y in zip(a["losses"], b["losses"], strict=False)]
        ok = report["losses_equal"] and report["lora_equal"]
    report["ok"] = bool(ok)
    stem = "ai_toolkit" if klein else "ai_toolkit_flux1"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report), flush=True)
    return 0 if ok else 1


def _mm(run: dict) -> dict:
    return (run.get("stubs") or {}).get("memory_manager") or {}


def probe_diff(a: dict | None, b: dict | None) -> dict | None:
    """Where two runs' nn.Linear calls (the shim's WS_AITK_PROBE, in call order) first differ:
    the call's index, what it was, and how many calls were compared."""
    if not a or not b:
        return None
    calls_a, calls_b = a.get("calls", []), b.get("calls", [])
    for i, (x, y) in enumerate(zip(calls_a, calls_b, strict=False)):
        if x != y:
            return {"first_difference": i, "a": x, "b": y, "compared": i + 1}
    n = min(len(calls_a), len(calls_b))
    return {"first_difference": None, "compared": n, "lengths": [len(calls_a), len(calls_b)]}


def streaming_check(runs: list[dict]) -> dict:
    """FLUX.2 klein: both loaders' attaches happened, ai-toolkit's manager bounced layers from
    the CPU in its run, weightstream's handle streamed layers in its run, and the daemon copied
    bytes for acquires (session statistics taken before `free` and at exit)."""
    out = {"ok": True, "problems": []}
    for run in runs:
        attaches = [c for c in _mm(run).get("calls", []) if c["call"] == "attach"]
        modules = sorted(c["module"] for c in attaches)
        if modules != ["Flux2", "Qwen3ForCausalLM"]:
            out["problems"].append(f"{run['mode']}: attached {modules}")
        aitk = run["mode"].startswith("aitk")
        key = "aitk_managed_layers" if aitk else "ws_streamed_layers"
        for c in attaches:
            if not c.get(key):
                out["problems"].append(f"{run['mode']}: {c['module']} has no {key}")
        if not aitk:
            stats = _mm(run).get("session_stats", [])
            for module in modules:
                best = max(
                    (s for s in stats if s["module"] == module),
                    key=lambda s: s.get("acquires", 0),
                    default={},
                )
                if not (best.get("acquires", 0) > 0 and best.get("bytes_copied", 0) > 0):
                    out["problems"].append(f"{run['mode']}: {module} session stats {best}")
    out["ok"] = not out["problems"]
    return out


def _gib(n) -> str:
    return "-" if not n else f"{n / (1 << 30):.2f} GiB"


def _cmd(command: list[str]) -> str:
    return " ".join(
        Path(c).name if i == 0 or c.endswith(".py") else c for i, c in enumerate(command)
    )


def _model_lines(r: dict) -> list[str]:
    m, cfg = r["model"], r["transformer_config"]
    data = f"{r['images']} images at {r['resolution']} px, {r['steps']} steps, seed {r['seed']}"
    if r.get("arch", "flux1") == "flux1":
        return [
            f"- model: FLUX.1 transformer `{r['size']}` {cfg}, {m['transformer_params']:,}"
            f" params, {_gib(m['transformer_bytes'])} bf16 (random weights, safetensors); {data}"
        ]
    return [
        f"- model: FLUX.2 klein 4B (`arch: flux2_klein_4b`), size `{r['size']}`: ai-toolkit's"
        f" `Flux2` at `Klein4BParams(**{cfg})`, {m['transformer_params']:,} params,"
        f" {_gib(m['transformer_bytes'])} bf16 in `model/{KLEIN_TRANSFORMER_FILE}`; its"
        f" `AutoEncoder(AutoEncoderParams())` ({m['vae_params']:,} params) in"
        f" `model/{KLEIN_VAE_FILE}`; a Qwen3ForCausalLM ({m['te_layers']} layers,"
        f" {r['text_encoder_config']}, vocabulary {m['vocab']} byte tokens, {m['te_params']:,}"
        f" params) as `{KLEIN_TE_REPO}` in HF_HOME's cache (HF_HUB_OFFLINE=1); random"
        f" weights; {data}",
        "- patched: "
        + (
            "`Klein4BParams` in `flux2_klein_model.py` rebound by the shim to"
            f" `Klein4BParams(**{cfg})` (WS_AITK_FLUX2_PARAMS), in both runs"
            if cfg
            else "nothing (ai-toolkit's Klein4BParams)"
        ),
    ]


def _streaming_lines(r: dict) -> list[str]:
    lines = [
        "",
        "What each manager took over at `attach` (ai-toolkit: layers it bounces from the CPU,"
        " `_layer_memory_manager`; weightstream: the handle's streamed layers), and the daemon's"
        " session statistics (taken when ai-toolkit frees the text encoder, and at exit):",
        "",
        "| run | module | Linear/Conv2d layers | managed / streamed | bytes | kept on device |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in r["runs"]:
        for c in _mm(run).get("calls", []):
            if c["call"] != "attach":
                continue
            if "aitk_managed_layers" in c:
                managed, nbytes = c["aitk_managed_layers"], c["aitk_managed_bytes"]
                kept = f"{c['aitk_unmanaged']} unmanaged modules (norms, embeddings, ...)"
            else:
                managed, nbytes = c.get("ws_streamed_layers", 0), c.get("ws_streamed_bytes", 0)
                kept = f"{c.get('ws_resident_layers', 0)} layers {c.get('ws_resident', {})}"
            lines.append(
                f"| {run['mode']} | {c['module']} | {c['linear_conv_layers']} | {managed} |"
                f" {nbytes:,} of {c['linear_conv_bytes']:,} | {kept} |"
            )
    stats = [(run["mode"], s) for run in r["runs"] for s in _mm(run).get("session_stats", [])]
    if stats:
        lines += [
            "",
            "| run | session | taken at | acquires | hits | misses | copies | bytes copied |"
            " prefetches | GPU wait | acquire pending |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for mode, s in stats:
            lines.append(
                f"| {mode} | {s['module']} | {s['when']} | {s.get('acquires')} |"
                f" {s.get('hits')} | {s.get('misses')} | {s.get('copies')} |"
                f" {s.get('bytes_copied', 0):,} | {s.get('prefetches')} |"
                f" {s.get('gpu_wait_ns', 0) / 1e6:.1f} ms |"
                f" {s.get('acquire_pending_ns', 0) / 1e6:.1f} ms |"
            )
    check = r.get("streaming")
    if check:
        lines += [
            "",
            f"Streaming check: **{'OK' if check['ok'] else 'FAILED'}**"
            + (f" ({'; '.join(check['problems'])})" if check["problems"] else "")
            + ": both loaders attached `Flux2` and `Qwen3ForCausalLM`; ai-toolkit managed"
            " layers in its run, weightstream streamed layers in its run and its daemon copied"
            " bytes for acquires of both sessions.",
        ]
    return lines


def markdown(r: dict) -> str:
    result = f"**{'OK' if r['ok'] else 'FAILED'}**"
    if "losses_equal" in r:
        result += (
            f", losses bit-identical: {r['losses_equal']},"
            f" saved LoRA tensors bit-identical: {r['lora_equal']} ({r['lora_tensors']} tensors)"
        )
    for mode, cmp in (r.get("vs_resident") or {}).items():
        result += (
            f"; {mode} vs no offloading: losses bit-identical {cmp['losses_equal']},"
            f" LoRA bit-identical {cmp['lora_equal']}"
        )
    lines = [
        "# ai-toolkit's real run: its layer offloading vs weightstream's launcher",
        "",
        f"- machine: {r['machine']} (python {r['python']}, torch {r['torch']}),"
        f" device `{r['device']}`",
        f"- ai-toolkit: ostris/ai-toolkit at `{r['ai_toolkit']['commit']}`, `run.py` unchanged",
        *_model_lines(r),
        f"- stubbed where not installed: {', '.join(r['stubs'])};"
        f" hidden: {', '.join(r['hidden']) or 'none'}",
        f"- result: {result}",
        "",
        "| run | rc | s/it | wall | trainer peak RSS | daemon peak RSS |"
        " torch peak alloc / reserved | nvidia-smi peak |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in r["runs"]:
        ts = run.get("torch_stats") or {}
        spi = run.get("s_per_it")
        cells = [
            run["mode"],
            str(run["rc"]),
            "-" if spi is None else f"{spi:.3f}",
            f"{run['wall_s']:.1f} s",
            _gib(run.get("trainer_peak_rss")),
            _gib(run.get("daemon_peak_rss")),
            f"{_gib(ts.get('max_memory_allocated'))} / {_gib(ts.get('max_memory_reserved'))}",
            _gib(run.get("nvidia_smi_peak_used")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Losses (ai-toolkit's UILogger, every step after the first):", ""]
    lines += [f"- {run['mode']}: {run.get('losses')}" for run in r["runs"]]
    lines += ["", "The MemoryManager that served each run, and ai-toolkit's calls to it:", ""]
    for run in r["runs"]:
        mm = (run.get("stubs") or {}).get("memory_manager") or {}
        calls = [c["call"] + f"({c.get('module', '')})" for c in mm.get("calls", [])]
        impl = mm.get("implementation")
        lines.append(f"- {run['mode']}: `{impl}`: {', '.join(calls) or 'no call'}")
    attached = any(c["call"] == "attach" for run in r["runs"] for c in _mm(run).get("calls", []))
    if attached:
        lines += _streaming_lines(r)
    if not attached:
        lines += [
            "",
            "**No `MemoryManager.attach` call**: at this commit ai-toolkit's FLUX.1 loader"
            " (`toolkit/stable_diffusion_model.py`) does not attach the transformer or the text"
            " encoders, so with `layer_offloading: true` neither run offloads or streams a"
            " weight: the transformer stays whole on the device in both. What differs is only"
            " which MemoryManager frees the text encoders after caching. The s/it and memory"
            " columns compare two non-offloaded runs.",
        ]
    lines += ["", "Commands (each in its run's folder):", ""]
    lines += [f"- {run['mode']}: `{_cmd(run['command'])}`" for run in r["runs"]]
    lines += ["", "job.yaml (both runs):", "", "```yaml", r["job_yaml"].rstrip(), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
