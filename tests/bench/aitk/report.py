"""The checks and the Markdown report of tests/bench/ai_toolkit_real.py: where two runs' layer
calls first differ (``probe_diff``), whether both managers took layers over and the daemon
copied bytes (``streaming_check``), and the report of a call (``markdown``)."""

from __future__ import annotations

from pathlib import Path

from tests.bench.aitk.build import KLEIN_TE_REPO, KLEIN_TRANSFORMER_FILE, KLEIN_VAE_FILE


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
