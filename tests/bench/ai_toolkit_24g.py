"""ai-toolkit's own recipe for a 24 GB card, through its real `run.py`, on an emulated 24 GiB
card: ai-toolkit's MemoryManager against weightstream-aitk, with one YAML
(tests/bench/ai_toolkit_24g.yaml: `quantize: true` qfloat8, `quantize_te: true`, `low_vram`,
`layer_offloading: true`, LoRA, 1024 px, gradient checkpointing, adamw8bit).

    # on the GPU machine, one call per architecture (tests/bench/README.md has the commands)
    python3 -m tests.bench.ai_toolkit_24g --aitk .aitk --bin target/release/weightstream \\
        --arch flux2 --size dev --card 24 --budget-s 500 --out $OUT
    # rank 1024 with the LoRA in host memory (ai-toolkit's own manager is expected not to fit
    # rank 1024 on the card: its comparison is at rank 128)
    python3 -m tests.bench.ai_toolkit_24g --aitk .aitk --bin target/release/weightstream \\
        --arch flux2 --size dev --card 24 --runs host:r1024:25GB/s,host:r1024:full,aitk:r128 \\
        --budget-s 500 --out $OUT
    # the whole flow on a tiny model, no card (CPU or GPU)
    python3 -m tests.bench.ai_toolkit_24g --aitk .aitk --bin target/debug/weightstream \\
        --smoke --out /tmp/aitk-smoke

What runs, unchanged: ai-toolkit's `run.py` and everything under it (tests/bench/
aitk/measure.py's `run_one`, its stubs and shim), once per run of `--runs`:
`MODE:rRANK[:LINK]`, MODE `aitk` (`python run.py job.yaml`) or `weightstream`
(`python -m weightstream.integrations.ai_toolkit run.py job.yaml` against a daemon started for
the run, its copies capped at LINK, e.g. `25GB/s`, or `full`), or `host` (a `weightstream` run
with `WEIGHTSTREAM_TRAINABLE=host`: the LoRA's weights, gradients and optimizer state in host
memory; `--host-delay false` turns its delayed update off), or `resident` (`python run.py` with
`layer_offloading: false`: the 8-bit weights in place, never under the card, since they do not
fit one; the floor any offloading is measured against), or `resident16` (the same with
`quantize: false`: the bf16 weights in place, for ai-toolkit's resident 8-bit layers are
optimum-quanto's, not the torchao ones its layer offloading streams). ai-toolkit's own manager
copies with its own streams: the link cap does not reach it (it always has the device's full
link).

With `--card GIB` each run is wrapped in tests/bench/card.py (`--card-cmd`), which holds all but
GIB of the device for the run's whole life, daemon included, and reports the device's peak use
while loading and while training (the shim marks the training phase at ai-toolkit's first
train loop step, and splits torch's peaks in the trainer there). Runs
are started in order while `--budget-s` allows (a run is expected to take as long as the longest
so far, `--first-run-s` before any); the rest are recorded as not run.

Models, seeded random weights in the layout each loader reads (what is reduced is in the
report):
- flux2 (FLUX.2-dev, `extensions_built_in/diffusion_models/flux2/flux2_model.py`):
  `model/flux2-dev.safetensors` (ai-toolkit's own `Flux2(Flux2Params())`, 32 B parameters, Linear
  weights stored as float8 e4m3 unless `--disk-dtype bf16`: the loader casts them to bf16),
  `model/ae.safetensors` (its `AutoEncoder` at the real size), and a Mistral3ForConditional
  Generation saved as `mistralai/Mistral-Small-3.1-24B-Instruct-2503` in HF_HOME's cache with a
  PixtralProcessor over a byte-level tokenizer: the real width (5120: the transformer reads
  3 x 5120) and the 30 layers the pipeline reads (hidden states 10, 20, 30), with narrower
  attention and MLP and a tiny vision tower.
- flux (FLUX.1-dev, `toolkit/stable_diffusion_model.py`): a diffusers folder, the transformer at
  FLUX.1-dev's size (Linear weights float8 on disk), T5-XXL's encoder at its real size (bf16),
  one-layer CLIP, a small VAE (tests/bench/aitk/build.py's `build_model`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from tests.bench.aitk import build, measure
from tests.bench.provenance import commit

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "ai_toolkit_24g.yaml"
STEM = "ai_toolkit_24g"
MISTRAL_REPO = "mistralai/Mistral-Small-3.1-24B-Instruct-2503"  # flux2_model.MISTRAL_PATH
MISTRAL_LAYERS = 30  # pipeline.OUTPUT_LAYERS_MISTRAL reads hidden states 10, 20 and 30
FLUX2_FILE = "flux2-dev.safetensors"  # flux2_model.FLUX2_TRANSFORMER_FILENAME
FLUX2_CLASS = "extensions_built_in.diffusion_models.flux2.flux2_model:Flux2Params"
#: In the order they are worth the device time: the comparison at rank 32 first (ai-toolkit's
#: run is the shorter: it quantizes on the device), then the full link, then rank 128.
DEFAULT_RUNS = (
    "aitk:r32,weightstream:r32:25GB/s,weightstream:r32:full,weightstream:r128:25GB/s,"
    "aitk:r128,weightstream:r128:full"
)
CARD_CMD = "{python} tests/bench/card.py --gib {gib}{link} --json {json}"

#: Per architecture and size: the transformer's fields that differ from ai-toolkit's (flux2:
#: Flux2Params; flux: FluxTransformer2DModel's config) and the text encoder's.
SIZES = {
    "flux2": {
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


# --- random weights -------------------------------------------------------------------------


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


# --- runs ---------------------------------------------------------------------------------------


#: ``--runs`` modes: how each one runs (``run_one``'s kind) and the environment it adds.
MODES = {
    "aitk": ("aitk", {}),
    "weightstream": ("weightstream", {}),
    "host": ("weightstream", {"WEIGHTSTREAM_TRAINABLE": "host"}),
    "resident": ("resident", {}),
    "resident16": ("resident", {}),  # and the bf16 weights (quantize: false)
}


def parse_runs(text: str, host_delay: bool = True) -> list[dict]:
    """``MODE:rRANK[:LINK]`` comma-separated: e.g. ``weightstream:r32:25GB/s,aitk:r32``.

    ``host`` is a ``weightstream`` run with ``WEIGHTSTREAM_TRAINABLE=host`` (the LoRA's weights,
    gradients and optimizer state in host memory) and ``WEIGHTSTREAM_TRAINABLE_DELAY`` from
    ``host_delay`` (its label ends in ``delay off`` when that is false)."""
    runs = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        parts = item.split(":")
        mode, rank = parts[0], parts[1] if len(parts) > 1 else "r32"
        link = parts[2] if len(parts) > 2 else "full"
        if (
            mode not in MODES
            or not rank.startswith("r")
            or not rank[1:].isdigit()
            or int(rank[1:]) < 1
            or len(parts) > 3
        ):
            raise ValueError(
                f"--runs {item!r}: expected aitk|weightstream|host|resident|resident16:rRANK"
                "[:LINK|full] (RANK 1 or more)"
            )
        if mode in ("aitk", "resident", "resident16") and link != "full":
            raise ValueError(f"--runs {item!r}: the link cap reaches weightstream's daemon only")
        kind, env = MODES[mode]
        env = dict(env)
        label = f"{mode} r{int(rank[1:])}"
        if kind == "weightstream":
            label = f"weightstream{' host' if mode == 'host' else ''} r{int(rank[1:])} {link}"
        if mode == "host":
            env["WEIGHTSTREAM_TRAINABLE_DELAY"] = "true" if host_delay else "false"
            label += "" if host_delay else " delay off"
        if any(r["label"] == label for r in runs):
            raise ValueError(f"--runs {item!r}: {label!r} is listed twice")
        runs.append(
            {
                "mode": mode,
                "kind": kind,
                "rank": int(rank[1:]),
                "link": link,
                "label": label,
                "run_env": env,
            }
        )
    return runs


def job_yaml(arch, device, steps, resolution, rank, optimizer, quantize, save_dtype) -> str:
    text = TEMPLATE.read_text()
    text = text.replace("save: {dtype: float32,", f"save: {{dtype: {save_dtype},")
    for key, value in {
        "@DEVICE@": device,
        "@ARCH@": arch,
        "@STEPS@": steps,
        "@RESOLUTION@": resolution,
        "@RANK@": rank,
        "@OPTIMIZER@": optimizer,
    }.items():
        text = text.replace(key, str(value))
    if not quantize:  # the flow without ai-toolkit's 8-bit bases (CPU checks, or a reference)
        for key in ("quantize", "quantize_te"):
            text = text.replace(f"        {key}: true", f"        {key}: false")
    return text


def one(spec_path: str) -> int:
    """A run by itself (``--one SPEC``, under card.py): aitk.measure's ``run_one``, its
    result written beside the spec."""
    spec = json.loads(Path(spec_path).read_text())
    args = SimpleNamespace(**spec["args"])
    result, _ = measure.run_one(
        spec["folder_name"],
        args,
        Path(spec["work"]),
        Path(spec["model"]),
        Path(spec["data"]),
        spec["yaml"],
        spec["cuda"],
        spec["env"],
        kind=spec["kind"],
        link=None if spec["link"] == "full" else spec["link"],
    )
    Path(spec["result"]).write_text(json.dumps(result, default=str))
    return 0 if result["rc"] == 0 else 1


def run_spec(run: dict, common: dict, args, cuda: bool) -> dict:
    """What one run is given: its folder's name, ``run_one``'s kind and link, its job.yaml, and
    the environment: the call's (``common["env"]``) and the mode's (``run["run_env"]``)."""
    name = run["label"].replace(" ", "-").replace("/", "p")
    spec = dict(common, mode=run["mode"], kind=run["kind"], link=run["link"], folder_name=name)
    spec["env"] = {**common["env"], **run["run_env"]}
    spec["yaml"] = job_yaml(
        common["arch"],
        common["device"],
        args.steps,
        common["resolution"],
        run["rank"],
        args.optimizer or ("adamw8bit" if cuda else "adamw"),
        not args.no_quantize and run["mode"] != "resident16",
        args.save_dtype,
    )
    spec["result"] = str(Path(common["work"]) / f"{name}.result.json")
    return spec


def card_command(run: dict, args, spec_path: Path, card_json: Path) -> list[str]:
    """card.py (``--card-cmd``) around ``--one SPEC``; its ``--link`` for weightstream's runs
    with a link cap (ai-toolkit's own manager copies with its own streams)."""
    capped = run["kind"] == "weightstream" and run["link"] != "full"
    link = f" --link {run['link']}" if capped else ""
    card = shlex.split(
        args.card_cmd.format(python=sys.executable, gib=args.card, link=link, json=card_json)
    )
    return [
        *card,
        "--",
        sys.executable,
        "-m",
        "tests.bench.ai_toolkit_24g",
        "--one",
        str(spec_path),
    ]


def launch(run: dict, common: dict, args, cuda: bool) -> dict:
    """One run: in this process, or under card.py (``--card``) as ``--one``."""
    spec = run_spec(run, common, args, cuda)
    name = spec["folder_name"]
    work = Path(common["work"])
    if not args.card or run["kind"] == "resident":
        result, _ = measure.run_one(
            name,
            SimpleNamespace(**spec["args"]),
            work,
            Path(spec["model"]),
            Path(spec["data"]),
            spec["yaml"],
            cuda,
            spec["env"],
            kind=spec["kind"],
            link=None if run["link"] == "full" else run["link"],
        )
    else:
        spec_path = work / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        card_json = work / f"{name}.card.json"
        cmd = card_command(run, args, spec_path, card_json)
        print(f"[{run['label']}] {' '.join(cmd)}", flush=True)
        t0 = time.monotonic()
        try:  # the run inside has its own --timeout; this one is for card.py itself
            rc = subprocess.run(cmd, cwd=measure.REPO, timeout=args.timeout + 120).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        result_path = Path(spec["result"])
        if result_path.exists():
            result = json.loads(result_path.read_text())
        else:
            result = {"mode": name, "rc": rc, "wall_s": time.monotonic() - t0}
        result["card_rc"] = rc
        result["card_command"] = cmd
        if card_json.exists():
            result["card"] = json.loads(card_json.read_text())
    log = work / name / "trainer.log"
    if log.exists():
        result["trainable_host"] = trainable_report(log.read_text(errors="replace"))
    result.update(run)
    result["yaml"] = spec["yaml"]
    return result


#: The line weightstream-aitk prints when ``trainable: host`` takes the LoRA
#: (weightstream.integrations.ai_toolkit.trainable).
TRAINABLE_LINE = re.compile(
    r"weightstream-aitk: trainable: host: (?P<layers>\d+) LoRA layers and their (?P<optimizer>\S+)"
    r" state in (?P<gb>[\d.]+) GB of host memory \((?P<where>.*)\); computing on (?P<device>\S+);"
    r" delayed update (?P<delay>on|off)"
)


def trainable_report(log: str) -> dict | None:
    """weightstream-aitk's ``trainable: host`` line in a trainer's log: the LoRA layers, the
    optimizer, the host memory of their weights, gradients and optimizer state (GB), where
    that memory is (the daemon's session or the trainer's own), the delayed update; ``None``
    when the log has no such line (the LoRA stayed on the device)."""
    found = list(TRAINABLE_LINE.finditer(log))
    if not found:
        return None
    m = found[-1]
    return {
        "layers": int(m["layers"]),
        "optimizer": m["optimizer"],
        "host_gb": float(m["gb"]),
        "where": m["where"],
        "device": m["device"],
        "delay": m["delay"] == "on",
    }


def summarize(result: dict) -> dict:
    """The figures of one run: s/step (median of the logged steps' gaps after the first, the
    first holding the warm-up), time to the first step, torch's peaks while loading and while
    training, host memory (with ``trainable: host``, the LoRA's as weightstream-aitk reports
    it), an out-of-memory error if the run ended with one."""
    gaps = result.get("step_gaps_s") or []
    stats = result.get("torch_stats") or {}
    loading = (result.get("stubs") or {}).get("memory_manager", {}).get("loading") or []
    out = {
        "s_per_step": statistics.median(gaps[1:]) if len(gaps) > 1 else None,
        "steps_timed": max(0, len(gaps) - 1),
        "first_step_s": result.get("first_step_s"),
        "torch_loading_peak": (stats.get("loading") or {}).get("max_memory_allocated"),
        "torch_training_peak": (stats.get("training") or {}).get("max_memory_allocated"),
        "host_trainer_peak": result.get("trainer_peak_rss"),
        "host_daemon_peak": result.get("daemon_peak_rss"),
        "launcher_loading": loading,
        "trainable_host": result.get("trainable_host"),
    }
    tail = result.get("log_tail") or ""
    for line in tail.splitlines():
        if "out of memory" in line.lower() or "OutOfMemoryError" in line:
            out["oom"] = line.strip()[:400]
    card_oom = ((result.get("card") or {}).get("oom") or {}).get("lines")
    if card_oom and "oom" not in out:
        out["oom"] = str(card_oom[-1])[:400]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--aitk", help="ai-toolkit checkout (its run.py is run unchanged)")
    ap.add_argument("--bin", help="the weightstream daemon binary")
    ap.add_argument("--arch", choices=sorted(SIZES), default="flux2")
    ap.add_argument("--size", choices=["tiny", "dev"], default="dev")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 4 steps at 64 px")
    ap.add_argument("--runs", default=None, help=f"default: {DEFAULT_RUNS}")
    ap.add_argument(
        "--host-delay",
        choices=["true", "false"],
        default="true",
        help="host runs: WEIGHTSTREAM_TRAINABLE_DELAY (HostAdamW's delayed update)",
    )
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--images", type=int, default=2)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--optimizer", default=None, help="default: adamw8bit on CUDA, else adamw")
    ap.add_argument("--no-quantize", action="store_true", help="quantize/quantize_te: false")
    ap.add_argument("--disk-dtype", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument(
        "--save-dtype",
        choices=["float32", "bf16", "float16"],
        default="float32",
        help="the job's save.dtype: the LoRA's dtype in the file ai-toolkit saves at the end",
    )
    ap.add_argument("--device", default=None)
    ap.add_argument(
        "--host-gib",
        type=float,
        default=128,
        help="flux2 dev: the host's memory, which sets how many single blocks fit (see"
        " flux2_singles_for_host); 0 keeps all 48",
    )
    ap.add_argument("--card", type=float, default=0, help="emulated card GiB (card.py)")
    ap.add_argument("--card-cmd", default=CARD_CMD)
    ap.add_argument("--budget-s", type=float, default=None, help="start no run past this")
    ap.add_argument("--first-run-s", type=float, default=240)
    ap.add_argument("--timeout", type=float, default=1200, help="one run's limit")
    ap.add_argument("--work", default=None)
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="keep the model and data an earlier call built in --work from the same settings",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", action="append", default=[], help="earlier reports to include")
    ap.add_argument("--machine", default=None)
    ap.add_argument("--pythonpath", action="append", default=[])
    args = ap.parse_args(argv)
    if args.one:
        return one(args.one)
    if not (args.aitk and args.bin and args.out):
        ap.error("--aitk, --bin and --out are required")
    started = time.monotonic()
    import torch

    cuda = torch.cuda.is_available() if args.device is None else args.device.startswith("cuda")
    device = args.device or ("cuda:0" if cuda else "cpu")
    if args.smoke:
        args.size, args.steps, args.images = "tiny", 4, 1
        args.resolution = min(args.resolution, 64)
        args.runs = args.runs or "aitk:r4,weightstream:r4:full"
    runs = parse_runs(args.runs or DEFAULT_RUNS, host_delay=args.host_delay == "true")
    size = json.loads(json.dumps(SIZES[args.arch][args.size]))
    aitk = Path(args.aitk).resolve()
    fp8 = args.disk_dtype == "fp8"
    if args.arch == "flux2" and args.size == "dev" and args.host_gib:
        singles = flux2_singles_for_host(aitk, size["transformer"], args.host_gib, fp8)
        if singles < 48:
            size["transformer"]["depth_single_blocks"] = singles
    work = Path(args.work) if args.work else Path(f"/tmp/ws-aitk24-{os.getpid()}")
    what = {
        "arch": args.arch,
        "size": size,
        "seed": args.seed,
        "disk_dtype": args.disk_dtype,
        "images": args.images,
        "resolution": args.resolution,
    }
    built = reused(work, what) if args.reuse else None
    env = {}
    if args.arch == "flux2":
        env["HF_HOME"] = str(work / "hf")
        if size["transformer"]:
            env["WS_AITK_FLUX2_PARAMS"] = json.dumps(size["transformer"])
            env["WS_AITK_FLUX2_CLASS"] = FLUX2_CLASS
    if built is None:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        print(f"building {args.arch} {args.size} in {work}", flush=True)
        if args.arch == "flux2":
            built = build_flux2(work / "model", aitk, size, args.seed, device, fp8)
        else:
            built = build_flux1(work / "model", size, args.seed, device, fp8)
        build.build_data(work / "data", args.images, args.resolution, args.seed)
        (work / BUILT).write_text(json.dumps({"what": what, "built": built}))
    else:
        print(f"reusing {args.arch} {args.size} in {work}", flush=True)
        for old in work.iterdir():  # the runs' folders and results of an earlier call
            if old.name not in ("model", "data", "hf", BUILT):
                shutil.rmtree(old) if old.is_dir() else old.unlink()
    if cuda:
        torch.cuda.empty_cache()
    print(f"built: {json.dumps(built)}", flush=True)
    common = {
        "arch": args.arch,
        "device": device,
        "resolution": args.resolution,
        "work": str(work),
        "model": str(work / "model"),
        "data": str(work / "data"),
        "cuda": cuda,
        "env": env,
        "args": {
            "aitk": str(aitk),
            "bin": str(Path(args.bin).resolve()),
            "pythonpath": args.pythonpath,
            "seed": args.seed,
            "timeout": args.timeout,
        },
    }
    results, longest = [], args.first_run_s
    for run in runs:
        elapsed = time.monotonic() - started
        if args.budget_s is not None and elapsed + longest > args.budget_s:
            results.append(dict(run, rc="not run", why=f"{elapsed:.0f} s of {args.budget_s:.0f}"))
            continue
        result = launch(run, common, args, cuda)
        result["summary"] = summarize(result)
        longest = max(longest if results else 0, result.get("wall_s") or 0)
        results.append(result)
        print(
            json.dumps({"run": run["label"], "rc": result["rc"], **result["summary"]}, default=str),
            flush=True,
        )
    call = {
        "machine": args.machine or ("GPU: " + torch.cuda.get_device_name(0) if cuda else "CPU"),
        "host": platform.node(),
        "torch": torch.__version__,
        "commit": commit(),
        "ai_toolkit": measure.AITK_COMMIT,
        "command": " ".join(sys.argv),
        "arch": args.arch,
        "size": args.size,
        "sizes": size,
        "built": built,
        "disk_dtype": args.disk_dtype,
        "host_gib": args.host_gib,
        "card_gib": args.card or None,
        "host_delay": args.host_delay == "true",
        "steps": args.steps,
        "resolution": args.resolution,
        "images": args.images,
        "runs": [{k: v for k, v in r.items() if k not in ("stubs", "probe")} for r in results],
        "stubs_called_outside_imports": {r["label"]: measure.stubs_called(r) for r in results},
        "wall_s": time.monotonic() - started,
    }
    calls = [c for path in args.merge for c in json.loads(Path(path).read_text())["calls"]]
    report = {"calls": [*calls, call]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{STEM}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / f"{STEM}.md").write_text(markdown(report))
    print(markdown(report), flush=True)
    ok = all(r["rc"] in (0, "not run") or r["summary"].get("oom") for r in results)
    # weightstream's runs must have streamed: the transformer attached, layers streamed; the
    # host runs' LoRA must have been in host memory
    for r in results:
        if r["kind"] == "weightstream" and r["rc"] == 0:
            attached = [a for rep in r["summary"]["launcher_loading"] for a in rep["attached"]]
            ok = ok and any(a["role"] == "transformer" and a["streamed"] for a in attached)
        if r["mode"] == "host" and r["rc"] == 0:
            ok = ok and r["summary"]["trainable_host"] is not None
    return 0 if ok and not any(call["stubs_called_outside_imports"].values()) else 1


#: What ``--work`` was built from and what was built, beside the model (``--reuse``).
BUILT = "built.json"


def reused(work: Path, what: dict) -> dict | None:
    """What an earlier call built in ``work`` from the same ``what`` (``--reuse``), or None."""
    try:
        old = json.loads((work / BUILT).read_text())
    except (OSError, ValueError):
        return None
    return old["built"] if old.get("what") == json.loads(json.dumps(what)) else None


# --- the report ---------------------------------------------------------------------------------


def host_at_end(result: dict) -> str | None:
    """The trainer's host memory at the last point of its RSS timeline (aitk.measure's
    Sampler) that has it (a point after the trainer exited has the host's available memory
    only), the host's available memory then, its least over the run, and the trainer's largest
    point: where a run's memory was when it ended, and how close the host came to full."""
    timeline = result.get("trainer_rss_timeline") or []
    samples = [p for p in timeline if any(k in p for k in measure.RSS_FIELDS)]
    if not samples:
        return None
    last = samples[-1]
    parts = [f"{k} {last[k]:.2f}" for k in measure.RSS_FIELDS if k in last]
    text = (
        f"the trainer's host memory at {last['t']:.0f} s, its last sample: {', '.join(parts)} GiB"
    )
    if "MemAvailable" in last:
        text += f"; the host had {last['MemAvailable']:.2f} GiB available"
    available = [p for p in timeline if "MemAvailable" in p]
    least = min(available, key=lambda p: p["MemAvailable"], default=last)
    if least is not last:
        text += f", {least['MemAvailable']:.2f} at the least ({least['t']:.0f} s)"
    peak = max(samples, key=lambda p: sum(p.get(k, 0) for k in measure.RSS_FIELDS))
    if peak is not last:
        parts = [f"{k} {peak[k]:.2f}" for k in measure.RSS_FIELDS if k in peak]
        text += f" (largest at {peak['t']:.0f} s: {', '.join(parts)})"
    return text


def _gib(n) -> str:
    return "-" if not n else f"{n / (1 << 30):.2f}"


def _card_phases(card: dict | None) -> tuple[str, str]:
    """card.py's peak use of the card (what the run's processes took of the memory its helper
    left) while loading and while training, GiB (``phases.<phase>.peak_card_gib``)."""
    phases = (card or {}).get("phases") or {}
    got = [(phases.get(p) or {}).get("peak_card_gib") for p in ("loading", "training")]
    return tuple("-" if v is None else f"{float(v):.2f}" for v in got)


def _model_lines(call: dict) -> list[str]:
    b, s = call["built"], call["sizes"]
    if call["arch"] == "flux2":
        t, te = b["transformer"], b["text_encoder"]
        singles = s["transformer"].get("depth_single_blocks")
        cut = (
            [
                f"- reduced: {singles} of FLUX.2-dev's 48 single-stream blocks (all 8 double"
                " blocks, the real width): with float8 on disk the loader's bf16 state dict is"
                " anonymous memory until `load_model` returns (2 bytes a parameter), and"
                " weightstream-aitk's attach copies the 8-bit weights into the daemon before the"
                " trainer's copy goes (1 + 1): 4 bytes a parameter at the peak, which for 32 B"
                f" parameters is more than the {call.get('host_gib', 128):g} GiB host (with the"
                " real bf16 file those 2 bytes are the file's pages, which the kernel can drop)"
            ]
            if call["size"] == "dev" and singles
            else []
        )
        return cut + [
            f"- model: FLUX.2-dev (`arch: flux2`), size `{call['size']}`: ai-toolkit's"
            f" `Flux2(Flux2Params(**{s['transformer']}))`, {t['params']:,} parameters,"
            f" {t['bytes_on_disk'] / 1e9:.1f} GB on disk ({call['disk_dtype']} Linear weights,"
            " cast to bf16 by the loader); its `AutoEncoder` at the real size;",
            f"- reduced: the text encoder, Mistral3ForConditionalGeneration with"
            f" {te['layers']} layers (Mistral Small 3.1: 40; the pipeline reads hidden states"
            f" 10, 20, 30) of width {te['hidden_size']} (5120 in the real one), attention"
            f" {te['num_attention_heads']} x {te['head_dim']} / {te['num_key_value_heads']} kv"
            f" heads (32 / 8) and MLP {te['intermediate_size']} (32768), a byte-level vocabulary"
            f" of {te['vocab']} and a one-layer vision tower: {te['params'] / 1e9:.2f} B"
            " parameters, not 24 B. With the real one, ai-toolkit's `load_te` moves 48 GB of"
            " bf16 weights onto the device before quantizing (an out-of-memory error on a 24 GiB"
            " card); weightstream-aitk keeps them on the CPU either way.",
        ]
    t, te = b["transformer"], b.get("text_encoder")
    return [
        f"- model: FLUX.1-dev (`arch: flux`), size `{call['size']}`: a diffusers folder, the"
        f" transformer {t['params']:,} parameters, {t['bytes_on_disk'] / 1e9:.1f} GB on disk"
        f" ({call['disk_dtype']} Linear weights);"
        + (f" T5-XXL's encoder {te['params'] / 1e9:.2f} B parameters, bf16;" if te else ""),
        "- reduced: CLIP-L to one layer; the VAE is small (4 x 32 channels).",
    ]


def markdown(report: dict) -> str:
    lines = [
        "# ai-toolkit's 24 GB recipe on an emulated 24 GiB card: its MemoryManager and"
        " weightstream-aitk",
        "",
    ]
    for call in report["calls"]:
        lines += [
            f"## {call['arch']} `{call['size']}` — {call['machine']}, commit {call['commit']}",
            "",
            f"- command: `{call['command']}`",
            f"- ai-toolkit `{call['ai_toolkit']}`, `run.py` unchanged; card: "
            + (f"{call['card_gib']:g} GiB (card.py)" if call["card_gib"] else "none"),
            f"- {call['steps']} steps at {call['resolution']} px, {call['images']} images;"
            " s/step is the median of the logged steps' gaps after the first",
            *_model_lines(call),
            "",
            "| run | rc | s/step | first step | card GiB in use loading / training (card.py)"
            " | torch peak GiB loading / training | host GiB trainer / daemon |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in call["runs"]:
            s = r.get("summary") or {}
            loading, training = _card_phases(r.get("card"))
            spt = s.get("s_per_step")
            fs = s.get("first_step_s")
            rc = r["rc"] if not s.get("oom") else f"{r['rc']} (out of memory)"
            lines.append(
                f"| {r['label']} | {rc} | {'-' if spt is None else f'{spt:.3f}'} |"
                f" {'-' if fs is None else f'{fs:.0f} s'} | {loading} / {training} |"
                f" {_gib(s.get('torch_loading_peak'))} / {_gib(s.get('torch_training_peak'))} |"
                f" {_gib(s.get('host_trainer_peak'))} / {_gib(s.get('host_daemon_peak'))} |"
            )
        lines.append("")
        for r in call["runs"]:
            s = r.get("summary") or {}
            if s.get("oom"):
                lines.append(f"- {r['label']}: out of memory: `{s['oom']}`")
            if r["rc"] == "not run":
                lines.append(f"- {r['label']}: not run (time budget: {r['why']})")
            host = s.get("trainable_host")
            if host:
                lines.append(
                    f"- {r['label']}: `trainable: host`: {host['layers']} LoRA layers and their"
                    f" {host['optimizer']} state in {host['host_gb']:.2f} GB of host memory"
                    f" ({host['where']}), delayed update {'on' if host['delay'] else 'off'}"
                )
            elif r.get("mode") == "host" and r["rc"] == 0:
                lines.append(f"- {r['label']}: no `trainable: host` line in the trainer's log")
            for rep in s.get("launcher_loading") or []:
                peak = rep.get("peak") or {}
                lines.append(
                    f"- {r['label']}: weightstream-aitk loaded {rep['model']} in"
                    f" {rep['seconds']:.0f} s, attached"
                    " "
                    + ", ".join(
                        f"{a['role']} ({a['by']}, {a['streamed']} layers streamed)"
                        for a in rep["attached"]
                    )
                    + ","
                    f" held up to {rep['held_bytes'] / 1e9:.1f} GB on the CPU; peak while"
                    f" loading: torch {_gib(peak.get('torch_max_allocated'))} GiB, NVML"
                    f" {_gib(peak.get('nvml_used_peak'))} GiB (device, from"
                    f" {_gib(peak.get('nvml_used_at_start'))})"
                )
        for r in call["runs"]:
            end = host_at_end(r)
            if end:
                lines.append(f"- {r['label']}: {end}")
        lines += ["", "Losses (ai-toolkit's UILogger, the logged steps):", ""]
        lines += [f"- {r['label']}: {r.get('losses')}" for r in call["runs"] if r.get("losses")]
        lines += ["", "job.yaml (every run; rank and optimizer as the run says):", "", "```yaml"]
        lines += [next((r["yaml"] for r in call["runs"] if "yaml" in r), "").rstrip(), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
