"""ai-toolkit's real quantizers, streamed: every qtype its ``OstrisLinear`` offers, quantized by
ai-toolkit's own ``quantize_model`` and streamed through ``weightstream.torch.attach``, against
the same quantized layers in place.

    python3 -m tests.bench.aitk_packed_real --aitk .aitk --bin target/debug/weightstream \\
        --out tests/bench/results          # -> $OUT/aitk_packed_real.{json,md}
    ... --checkpoint                       # each block checkpointed: ..._checkpoint.{json,md}

What runs, unchanged, from ``--aitk`` (ai-toolkit's source at the pinned commit, laid out by
tests/bench/ai_toolkit_prepare.sh; never part of this repository): ``toolkit.util.quantize``'s
``get_qtype`` and ``quantize_model`` (the path a job's ``model.quantize`` takes: each
transformer block quantized with ``quantize``/``convert_linear_to_ostris`` and frozen; with
``model.accuracy_recovery_adapter``, the ARA built as ``LoRASpecialNetwork(is_ara=True)`` from a
safetensors file, its layers quantized under it, the rest given ``uint8``), the quantizers of
``toolkit/util/{uintx,nvfp4,convrot,orbit,orbit_vq}_quant.py`` and their forwards, and the
training LoRA, a second ``LoRASpecialNetwork`` applied after the attach as ai-toolkit's trainer
applies it after loading. What this script supplies: a two-block model of Linears whose widths
exercise two rotation sizes and k-groups (192: rotation 64, k-group 64; 512: 256 and 128), the
``BaseModel`` attributes ``quantize_model`` reads, seeded random weights and ARA tensors.

Per qtype, two copies made alike: one stays in place (the reference), the other is attached to
a daemon on its host backend (every packed layer streamed, no group resident). Then three
training steps (AdamW on the training LoRA), each with an input that requires grad, and one
forward under no_grad (the quantizers' inference branch). Checked with ``torch.equal``: the
outputs, the input gradients, the training LoRA's gradients (and the ARA's, which ai-toolkit
leaves requiring grad); that every ``OstrisLinear`` streamed in its form (the handle's summary);
that a qtype ``packed_forms`` refuses is refused before anything is uploaded, naming the qtype.
Beside them, the layout each stand-in of tests/python/torch/aitk_layouts.py builds for the same
layer (buffer names, dtypes, shapes, the attributes that stay) against the real one.

ai-toolkit's imports need optimum-quanto (``pip install --target DIR optimum-quanto==0.2.7``,
on PYTHONPATH); modules it imports but these quantizers never call (torchaudio, av, ...) are
served by tests/bench/aitk_shim's stubs where not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

from tests.bench import provenance
from tests.bench.aitk.measure import AITK_COMMIT, STUBS

HIDDEN, MLP, BLOCKS, RANK = 192, 512, 2, 4
TOKENS, STEPS = 6, 3
DTYPE_NAME = "bfloat16"
#: Where the models are quantized and trained, and the daemon's backend (``--device``).
DEVICE = "cpu"
#: Each block under torch's non-reentrant checkpoint, as ai-toolkit's FLUX.2 runs its blocks
#: with ``gradient_checkpointing`` (``--checkpoint``).
CHECKPOINT = False
#: The qtypes that come with an accuracy recovery adapter in ai-toolkit's UI (``uint3``/``uint4``
#: "with ARA": Qwen-Image, HiDream, Wan 2.2).
ARA_QTYPES = ("uint3", "uint4")


def ostris_qtypes() -> list[str]:
    """Every qtype ``get_ostris_quantizer`` resolves, in ai-toolkit's own tables' order."""
    from toolkit.util.convrot_quant import CONVROT_QTYPES
    from toolkit.util.nvfp4_quant import NVFP4_QTYPES
    from toolkit.util.orbit_quant import ORBIT_QTYPES
    from toolkit.util.orbit_vq_quant import ORBIT_VQ_QTYPES
    from toolkit.util.uintx_quant import UINTX_QTYPES

    return [*UINTX_QTYPES, *NVFP4_QTYPES, *CONVROT_QTYPES, *ORBIT_QTYPES, *ORBIT_VQ_QTYPES]


def install_aitk(aitk: Path) -> None:
    """ai-toolkit's source on sys.path, the shim's stubs for what is not installed."""
    os.environ.setdefault("WS_AITK_STUBS", ",".join(STUBS))
    os.environ.setdefault("WS_AITK_NO_CUDNN_SDP", "0")
    shim = Path(__file__).resolve().parent / "aitk_shim" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("_ws_aitk_shim", shim)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    sys.path.insert(0, str(aitk.resolve()))


# --- the model and what quantize_model reads -------------------------------------------------


def make_model(torch, seed: int):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(HIDDEN, HIDDEN)
            self.fc1 = nn.Linear(HIDDEN, MLP)
            self.fc2 = nn.Linear(MLP, HIDDEN, bias=False)

        def forward(self, h):
            h = h + self.q(h)
            return h + self.fc2(torch.nn.functional.gelu(self.fc1(h)))

    class TinyTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer_blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

        def forward(self, h):
            for block in self.transformer_blocks:
                if CHECKPOINT and torch.is_grad_enabled():
                    h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
                else:
                    h = block(h)
            return h

    torch.manual_seed(seed)
    model = TinyTransformer().to(torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class BaseModel:
    """What ``quantize_model`` and ``LoRASpecialNetwork`` read off ai-toolkit's BaseModel."""

    def __init__(self, torch, qtype: str, ara_path: str | None):
        self.model_config = SimpleNamespace(
            qtype=qtype, accuracy_recovery_adapter=ara_path, low_vram=False
        )
        self.device_torch = torch.device(DEVICE)
        self.torch_dtype = torch.bfloat16
        self.is_transformer = True
        self.use_old_lokr_format = False
        self.target_lora_modules = ["TinyTransformer"]

    def get_transformer_block_names(self):
        return ["transformer_blocks"]

    def get_quantization_exclude_modules(self):
        return []

    def convert_lora_weights_before_load(self, state_dict):
        return state_dict

    def convert_lora_weights_before_save(self, state_dict):
        return state_dict

    def print_and_status_update(self, text):
        print(text, flush=True)


def write_ara(torch, path: Path, seed: int, layers: dict | None = None, rank: int = 8) -> None:
    """An ARA file in the peft layout ai-toolkit's hub ARAs have (``KEY.lora_A.weight``
    ``[rank, in]``, ``KEY.lora_B.weight`` ``[out, rank]``, bf16): ``quantize_model`` takes the
    rank from the first ``lora_A`` and puts the adapter on every Linear a key names. ``layers``:
    ``{KEY: (in, out)}``, KEY the Linear's name under the model with ``transformer.`` before it;
    by default this script's tiny model's."""
    from safetensors.torch import save_file

    if layers is None:
        layers = {
            f"transformer.transformer_blocks.{i}.{name}": shape
            for i in range(BLOCKS)
            for name, shape in {
                "q": (HIDDEN, HIDDEN),
                "fc1": (HIDDEN, MLP),
                "fc2": (MLP, HIDDEN),
            }.items()
        }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, (inp, out) in layers.items():
        tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, inp, generator=g) * 0.05).bfloat16()
        tensors[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * 0.05).bfloat16()
    save_file(tensors, str(path))


def quantized(torch, qtype: str, ara_path: str | None, seed: int):
    """The model quantized by ai-toolkit's ``quantize_model``; (model, base model)."""
    from toolkit.util.quantize import quantize_model

    model = make_model(torch, seed).to(DEVICE)
    base = BaseModel(torch, qtype, ara_path)
    quantize_model(base, model)
    return model, base


def training_lora(torch, model, base, seed: int):
    """ai-toolkit's LoRA network on the model's Linears, as its trainer applies it, with its
    up weights made non-zero (a fresh one's are zero: no gradient would reach the down ones)."""
    from toolkit.config_modules import NetworkConfig
    from toolkit.lora_special import LoRASpecialNetwork

    torch.manual_seed(seed)
    config = NetworkConfig(type="lora", linear=RANK, linear_alpha=RANK)
    network = LoRASpecialNetwork(
        text_encoder=None,
        unet=model,
        lora_dim=RANK,
        multiplier=1.0,
        alpha=RANK,
        train_unet=True,
        train_text_encoder=False,
        network_config=config,
        network_type="lora",
        is_transformer=True,
        base_model=base,
        target_lin_modules=["TinyTransformer"],
    )
    network.apply_to(None, model, apply_text_encoder=False, apply_unet=True)
    network.force_to(base.device_torch, dtype=torch.float32)
    network._update_torch_multiplier()
    network.is_active = True
    with torch.no_grad():
        for lora in network.unet_loras:
            lora.lora_up.weight.normal_(std=0.02)
    return network


# --- one qtype -------------------------------------------------------------------------------


def ostris_layers(model) -> dict:
    return {n: m for n, m in model.named_modules() if type(m).__name__ == "OstrisLinear"}


def layout(torch, m) -> dict:
    """A quantized Linear's streamed state: buffers (dtype, shape) and the scalar attributes
    its quantizer set."""
    skip = {"training", "in_features", "out_features", "ostris_quantizer", "ostris_orig_dtype"}
    attrs = {
        k: v
        for k, v in vars(m).items()
        if not k.startswith("_") and k not in skip and isinstance(v, (bool, int, float, str))
    }
    buffers = {n: [str(b.dtype), list(b.shape)] for n, b in m._buffers.items() if b is not None}
    return {"buffers": buffers, "attrs": attrs}


def stand_in_layout(torch, qtype: str, real) -> dict | None:
    """The layout tests/python/torch/aitk_layouts.py's stand-in of ``qtype`` builds for a layer
    of ``real``'s size, or None when it has none."""
    from tests.python.torch import aitk_layouts as aitk

    makers = {
        **{f"uint{b}": (lambda b=b: aitk.UIntX(b)) for b in range(2, 8)},
        "nvfp4": aitk.Nvfp4,
        "convrot8": aitk.ConvRot8,
        "convrot4": aitk.ConvRot4,
        **{f"convrotint{b}": (lambda b=b: aitk.ConvRotIntN(b)) for b in range(2, 9)},
    }
    if qtype not in makers:
        return None
    torch.manual_seed(0)
    m = torch.nn.Linear(real.in_features, real.out_features, bias=real.bias is not None)
    m = m.to(real.ostris_orig_dtype)
    aitk.convert(m, makers[qtype]())
    return layout(torch, m)


def attach_streamed(torch, wst, client, model):
    """``model`` attached with a staging arena of three of its largest groups and nothing
    resident (tests/python/torch/test_packed.py's attach_packed, "streamed")."""
    from weightstream.torch import packed, policy

    selected = policy.select(model, wst.StreamOptions(min_bytes=0)).streamed
    packs = {n: packed.Packed.of(m) for n, m in selected if packed.form_of(m) is not None}
    alignment = client.info().alignment
    sizes = policy.choose_groups(model, selected, "layer", alignment, None, 0, packs=packs)
    staging = 3 * max(sizes.sizes)
    handle = wst.attach(
        model,
        DEVICE,
        client=client,
        min_bytes=0,
        vram_budget=staging,
        staging_bytes=staging,
        group_by="layer",
    )
    if any(g.resident for g in handle.session.groups):
        raise AssertionError("a group stayed resident: the check must stream every group")
    return handle


def first_difference(torch, a, b) -> str | None:
    if a is None or b is None:
        return None if a is b else f"one is None ({a is None}, {b is None})"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"
    if torch.equal(a, b):
        return None
    diff = (a.float() - b.float()).abs()
    i = int(diff.flatten().argmax())
    return (
        f"{int((a != b).sum())} of {a.numel()} elements differ, largest at flat index {i}: "
        f"{a.flatten()[i].item()!r} vs {b.flatten()[i].item()!r}"
    )


def run_steps(torch, model, params: dict, seed: int) -> dict:
    """``STEPS`` training steps and one no_grad forward; every output and gradient, by name."""
    trainable = [p for n, p in params.items() if n.startswith("lora.")]
    opt = torch.optim.AdamW(trainable, lr=1e-2) if trainable else None
    g = torch.Generator().manual_seed(seed)
    record = {}
    for step in range(STEPS):
        x = torch.randn(2, TOKENS, HIDDEN, generator=g).bfloat16().to(DEVICE).requires_grad_(True)
        proj = torch.randn(2, TOKENS, HIDDEN, generator=g).to(DEVICE)
        out = model(x)
        (out.float() * proj).sum().backward()
        record[f"step{step}.output"] = out.detach().clone()
        record[f"step{step}.input_grad"] = x.grad.clone()
        for n, p in params.items():
            record[f"step{step}.grad.{n}"] = None if p.grad is None else p.grad.clone()
        if opt is not None:
            opt.step()
        for p in params.values():
            p.grad = None
    with torch.no_grad():
        x = torch.randn(2, TOKENS, HIDDEN, generator=g).bfloat16().to(DEVICE)
        record["no_grad.output"] = model(x).clone()
    return record


def trainable_params(network, ara) -> dict:
    params = {}
    if network is not None:
        params = {f"lora.{n}": p for n, p in network.named_parameters() if p.requires_grad}
    if ara is not None:
        params.update({f"ara.{n}": p for n, p in ara.named_parameters() if p.requires_grad})
    return params


def probe_lora_after_attach(torch, wst, client, qtype: str, ara_path) -> str:
    """ai-toolkit's order: the loader attaches, the trainer then makes its LoRA network. "ok",
    or the error that making it after the attach raised."""
    model, base = quantized(torch, qtype, ara_path, seed=5)
    try:
        handle = attach_streamed(torch, wst, client, model)
    except Exception as e:  # noqa: BLE001 - the probe's result
        return f"attach failed first: {type(e).__name__}: {e}"
    try:
        training_lora(torch, model, base, seed=7)
    except Exception as e:  # noqa: BLE001 - the probe's result
        return f"{type(e).__name__}: {e}"
    finally:
        handle.detach()
    return "ok"


def check_qtype(torch, wst, daemon_factory, qtype: str, with_ara: bool, work: Path) -> dict:
    from weightstream.torch import packed

    entry: dict = {"qtype": qtype, "ara": with_ara}
    ara_path = None
    if with_ara:
        ara_path = str(work / f"ara_{qtype}.safetensors")
        write_ara(torch, Path(ara_path), seed=11)
    t0 = time.perf_counter()
    try:
        ref, ref_base = quantized(torch, qtype, ara_path, seed=5)
        st, st_base = quantized(torch, qtype, ara_path, seed=5)
    except Exception as e:  # noqa: BLE001 - recorded per qtype
        entry.update(
            status=f"could not run on {DEVICE}", reason=f"quantize: {type(e).__name__}: {e}"
        )
        entry["traceback"] = traceback.format_exc(limit=6)
        return entry
    entry["quantize_s"] = round(time.perf_counter() - t0, 3)
    layers = ostris_layers(st)
    entry["ostris_layers"] = len(layers)
    if not layers:
        entry.update(
            status="not quantized",
            reason="ai-toolkit leaves every layer an nn.Linear for this qtype "
            "(its quantizer's can_quantize refuses); nothing packed to stream",
        )
        return entry
    entry["layout"] = {n: layout(torch, m) for n, m in layers.items()}
    for n, m in layers.items():
        for b, t in m._buffers.items():
            rt = ostris_layers(ref)[n]._buffers[b]
            if not torch.equal(t, rt):
                raise AssertionError(f"{qtype}: the two quantizations of {n}.{b} differ")
    forms = {n: packed.form_of(m) for n, m in layers.items()}
    entry["form"] = sorted({f.name for f in forms.values() if f is not None}) or None
    refusals = {n: packed.refusal(n, m) for n, m in layers.items()}
    entry["refusals"] = {n: r for n, r in refusals.items() if r is not None}
    stand_ins = {n: stand_in_layout(torch, qtype, m) for n, m in layers.items()}
    if all(v is not None for v in stand_ins.values()):
        differ = {
            n: {"real": entry["layout"][n], "stand_in": v}
            for n, v in stand_ins.items()
            if v != entry["layout"][n]
        }
        entry["stand_in"] = {"same": not differ, "differ": differ}

    with daemon_factory() as daemon:
        client = daemon.client
        if all(f is None for f in forms.values()):
            try:
                attach_streamed(torch, wst, client, st)
            except Exception as e:  # noqa: BLE001 - the refusal is the result
                msg = str(e)
                uploaded = len(client.list_models().models)
                named = f"qtype {qtype!r}" in msg
                entry.update(
                    status="refused" if named and uploaded == 0 else "fail",
                    reason=msg,
                    uploaded_models=uploaded,
                )
                if not named:
                    entry["why_fail"] = f"the refusal does not name qtype {qtype!r}"
                return entry
            entry.update(status="fail", reason="attach took a qtype packed_forms does not stream")
            return entry
        if entry["refusals"]:
            entry.update(status="fail", reason="packed_forms refuses the real layout")
            return entry
        entry["lora_after_attach"] = probe_lora_after_attach(torch, wst, client, qtype, ara_path)
    if with_ara:
        # A training LoRA made before the attach would wrap the ARA's forward, a chain
        # weightstream cannot follow; made after it, it reads the weight (lora_after_attach).
        ref_net = st_net = None
    else:
        ref_net = training_lora(torch, ref, ref_base, seed=7)
        st_net = training_lora(torch, st, st_base, seed=7)
    entry["training_lora"] = "none (ARA row)" if with_ara else "made before the attach"
    ref_ara = getattr(ref_base, "accuracy_recovery_adapter", None)
    st_ara = getattr(st_base, "accuracy_recovery_adapter", None)
    with daemon_factory() as daemon:
        try:
            handle = attach_streamed(torch, wst, daemon.client, st)
        except Exception as e:  # noqa: BLE001 - recorded per qtype
            entry.update(status="fail", reason=f"attach: {type(e).__name__}: {e}")
            entry["traceback"] = traceback.format_exc(limit=8)
            return entry
        summary = handle.stats()["packed_formats"]
        entry["summary"] = summary
        t1 = time.perf_counter()
        try:
            want = run_steps(torch, ref, trainable_params(ref_net, ref_ara), seed=9)
            got = run_steps(torch, st, trainable_params(st_net, st_ara), seed=9)
        except Exception as e:  # noqa: BLE001 - recorded per qtype
            entry.update(status="fail", reason=f"run: {type(e).__name__}: {e}")
            entry["traceback"] = traceback.format_exc(limit=8)
            return entry
        finally:
            handle.detach()
        entry["run_s"] = round(time.perf_counter() - t1, 3)
        diffs = {k: first_difference(torch, want[k], got[k]) for k in want}
        diffs = {k: d for k, d in diffs.items() if d is not None}
        entry["compared"] = len(want)
        entry["grads_compared"] = sum(1 for k, v in want.items() if ".grad." in k and v is not None)
        streamed = sum(e["layers"] for e in summary.values())
        if diffs:
            entry.update(status="fail", reason="differs from the layers in place", diffs=diffs)
        elif streamed != len(layers):
            entry.update(
                status="fail",
                reason=f"{streamed} packed layers streamed of {len(layers)} OstrisLinear",
            )
        else:
            entry["status"] = "pass"
    return entry


# --- report ----------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    lines = [
        "# ai-toolkit's real quantizers streamed (`aitk_packed_real.py`)",
        "",
        f"Command: `{report['command']}`  ",
        f"Commit: {report['commit']}; ai-toolkit {report['aitk_commit'][:8]}; device "
        f"{report['device']}; torch {report['torch']}; {report['dtype']} weights, "
        f"{BLOCKS} blocks of Linears {HIDDEN}->{HIDDEN} (bias), {HIDDEN}->{MLP} (bias), "
        f"{MLP}->{HIDDEN}; {STEPS} training steps with a rank-{RANK} ai-toolkit LoRA, then one "
        "no_grad forward"
        + (
            "; each block under torch's non-reentrant checkpoint."
            if report.get("checkpoint")
            else "."
        ),
        "",
        "| qtype | status | form | layers | bits/weight | compared (grads) | stand-in layout | "
        "LoRA made after attach | reason |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in report["qtypes"]:
        q = e["qtype"] + (" + ARA" if e["ara"] else "")
        form = ", ".join(e.get("form") or []) or "—"
        summary = e.get("summary") or {}
        bits = ", ".join(str(v["bits_per_weight"]) for v in summary.values()) or "—"
        compared = f"{e['compared']} ({e['grads_compared']})" if "compared" in e else "—"
        s = e.get("stand_in")
        stand = "none" if s is None else ("same" if s["same"] else f"{len(s['differ'])} differ")
        after = e.get("lora_after_attach")
        after = "—" if after is None else ("ok" if after == "ok" else "fails")
        reason = (e.get("reason") or "").replace("|", "\\|").replace("\n", " ")
        if len(reason) > 160:
            reason = reason[:157] + "..."
        lines.append(
            f"| {q} | {e['status']} | {form} | {e.get('ostris_layers', '—')} | {bits} | "
            f"{compared} | {stand} | {after} | {reason} |"
        )
    for e in report["qtypes"]:
        s = e.get("stand_in")
        for n, d in (s or {}).get("differ", {}).items():
            lines.append(
                f"- stand-in differs, {e['qtype']} `{n}`: real {json.dumps(d['real'])}; "
                f"stand-in {json.dumps(d['stand_in'])}"
            )
    after = [e for e in report["qtypes"] if e.get("lora_after_attach") not in (None, "ok")]
    if after:
        e = after[0]
        lines += ["", f"LoRA made after attach ({e['qtype']}): {e['lora_after_attach']}"]
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--aitk", required=True, help="ai-toolkit's source (ai_toolkit_prepare.sh)")
    ap.add_argument("--bin", default=None, help="the weightstream daemon binary")
    ap.add_argument("--out", required=True, help="where aitk_packed_real.{json,md} go")
    ap.add_argument("--qtypes", default=None, help="comma-separated (default: every one)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a new one)")
    ap.add_argument(
        "--device",
        default="cpu",
        help="cpu (the daemon's host backend) or cuda (its CUDA backend): where ai-toolkit "
        "quantizes the models and both copies train",
    )
    ap.add_argument(
        "--checkpoint",
        action="store_true",
        help="each block under torch's non-reentrant checkpoint, both copies (ai-toolkit's "
        "gradient_checkpointing); writes aitk_packed_real_checkpoint.{json,md}",
    )
    args = ap.parse_args(argv)
    global DEVICE, CHECKPOINT
    DEVICE, CHECKPOINT = args.device, args.checkpoint

    install_aitk(Path(args.aitk))
    import torch
    import weightstream.torch as wst

    from tests.daemon import BIN, Daemon

    binary = args.bin or BIN
    work = Path(args.work or tempfile.mkdtemp(prefix="ws-aitk-packed-"))
    work.mkdir(parents=True, exist_ok=True)

    class _Daemon:
        def __enter__(self):
            backend = "host" if DEVICE == "cpu" else "cuda"
            self.d = Daemon(tempfile.mkdtemp(dir=work), binary=binary, backend=backend)
            return self.d

        def __exit__(self, *exc):
            self.d.stop()

    qtypes = args.qtypes.split(",") if args.qtypes else ostris_qtypes()
    cases = [(q, False) for q in qtypes] + [(q, True) for q in ARA_QTYPES if q in qtypes]
    results = []
    for qtype, with_ara in cases:
        print(f"== {qtype}{' + ARA' if with_ara else ''}", flush=True)
        entry = check_qtype(torch, wst, _Daemon, qtype, with_ara, work)
        print(f"   {entry['status']}: {entry.get('reason', '')[:300]}", flush=True)
        results.append(entry)
    report = {
        "command": provenance.command(),
        "commit": provenance.commit(),
        "aitk_commit": AITK_COMMIT,
        "device": "CPU" if DEVICE == "cpu" else torch.cuda.get_device_name(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "dtype": DTYPE_NAME,
        "checkpoint": CHECKPOINT,
        "qtypes": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "aitk_packed_real_checkpoint" if CHECKPOINT else "aitk_packed_real"
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(report))
    failed = [e["qtype"] for e in results if e["status"] == "fail"]
    print(f"failed: {failed}" if failed else "no failures", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
