"""The Markdown report of tests/bench/ai_toolkit_24g.py: one section per call, a row per run
(with ``--host-limit-gib``, its memory cgroup's peak and limit, and its OOM kills), and where
each run's host memory was when it ended (``host_at_end``)."""

from __future__ import annotations

from tests.bench.aitk import measure


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


def _host_cgroup(summary: dict) -> str:
    """The run's memory cgroup (``--host-limit-gib``): its peak and its limit, GiB."""
    cg = summary.get("host_cgroup") or {}
    peak = cg.get("peak_bytes")
    return f"{'-' if peak is None else f'{peak / (1 << 30):.2f}'} / {_gib(cg.get('limit_bytes'))}"


def _card_phases(card: dict | None) -> tuple[str, str]:
    """card.py's peak use of the card (what the run's processes took of the memory its helper
    left) while loading and while training, GiB (``phases.<phase>.peak_card_gib``)."""
    phases = (card or {}).get("phases") or {}
    got = [(phases.get(p) or {}).get("peak_card_gib") for p in ("loading", "training")]
    return tuple("-" if v is None else f"{float(v):.2f}" for v in got)


def _singles_cut(call: dict, singles: int) -> str:
    """Why the transformer has ``singles`` of its 48 single blocks: the host
    (``--host-gib``) or the disk (``--single-blocks``)."""
    head = (
        f"- reduced: {singles} of FLUX.2-dev's 48 single-stream blocks (all 8 double blocks,"
        " the real width): "
    )
    disk = call.get("disk")
    if call.get("singles_by") in ("disk", "single-blocks") and disk:
        given = "disk" if call["singles_by"] == "disk" else singles
        need = disk["fixed"] + singles * disk["single"]
        return head + (
            f"for the disk (`--single-blocks {given}`): the build wrote"
            f" {need / 1e9:.2f} GB ({disk['single'] / 1e9:.3f} GB a single block) where"
            f" {disk['free'] / 1e9:.2f} GB were free, 1 GiB kept for the runs"
        )
    return head + (
        "with float8 on disk the loader's bf16 state dict is"
        " anonymous memory until `load_model` returns (2 bytes a parameter), and"
        " weightstream-aitk's attach copies the 8-bit weights into the daemon before the"
        " trainer's copy goes (1 + 1): 4 bytes a parameter at the peak, which for 32 B"
        f" parameters is more than the {call.get('host_gib', 128):g} GiB host (with the"
        " real bf16 file those 2 bytes are the file's pages, which the kernel can drop)"
    )


def _te_lines(call: dict, te: dict) -> list[str]:
    """The Mistral3 text encoder: at Mistral Small 3.1's full size (``--te-size full``) with
    its vision tower and tokenizer reduced, or reduced (the default)."""
    if call.get("te_size") == "full":
        return [
            "- text encoder: Mistral Small 3.1's text model at its full size"
            f" (Mistral3ForConditionalGeneration): {te['layers']} layers of width"
            f" {te['hidden_size']}, attention {te['num_attention_heads']} x {te['head_dim']} /"
            f" {te['num_key_value_heads']} kv heads, MLP {te['intermediate_size']}, an untied"
            f" embedding and lm_head of {te['vocab']} x {te['hidden_size']}:"
            f" {te['params'] / 1e9:.2f} B parameters, bf16, in {te['shards']} safetensors"
            f" shards ({te['bytes_on_disk'] / 1e9:.1f} GB), written one shard at a time (at"
            f" most {te['largest_buffer_bytes'] / 1e9:.2f} GB of it in host memory);",
            f"- reduced: the text encoder's vision tower ({te['vision_layers']} Pixtral layer of"
            " width 32; 24 of width 1024 in the real one) and its tokenizer, byte-level:"
            f" {te['tokenizer_ids']} ids, all below the embedding's {te['vocab']} (Tekken's"
            " 131072 in the real one).",
        ]
    return [
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


def _model_lines(call: dict) -> list[str]:
    b, s = call["built"], call["sizes"]
    if call["arch"] == "flux2":
        t, te = b["transformer"], b["text_encoder"]
        singles = s["transformer"].get("depth_single_blocks")
        cut = [_singles_cut(call, singles)] if call["size"] == "dev" and singles else []
        return [
            *cut,
            f"- model: FLUX.2-dev (`arch: flux2`), size `{call['size']}`: ai-toolkit's"
            f" `Flux2(Flux2Params(**{s['transformer']}))`, {t['params']:,} parameters,"
            f" {t['bytes_on_disk'] / 1e9:.1f} GB on disk ({call['disk_dtype']} Linear weights,"
            " cast to bf16 by the loader); its `AutoEncoder` at the real size;",
            *_te_lines(call, te),
        ]
    t, te = b["transformer"], b.get("text_encoder")
    return [
        f"- model: FLUX.1-dev (`arch: flux`), size `{call['size']}`: a diffusers folder, the"
        f" transformer {t['params']:,} parameters, {t['bytes_on_disk'] / 1e9:.1f} GB on disk"
        f" ({call['disk_dtype']} Linear weights);"
        + (f" T5-XXL's encoder {te['params'] / 1e9:.2f} B parameters, bf16;" if te else ""),
        "- reduced: CLIP-L to one layer; the VAE is small (4 x 32 channels).",
    ]


def _limit_lines(call: dict) -> list[str]:
    """The host limit (``--host-limit-gib``), when the call had one."""
    if not call.get("host_limit_gib"):
        return []
    versions = sorted(
        {
            str(r["summary"]["host_cgroup"]["cgroup_version"])
            for r in call["runs"]
            if (r.get("summary") or {}).get("host_cgroup")
        }
    )
    return [
        f"- host limit: {call['host_limit_gib']:g} GiB, swap off: each run's card.py, its daemon"
        f" and its trainer in a memory cgroup of their own (cgroup v{'/'.join(versions) or '?'});"
        " its peak counts the page cache the run read as well as its own memory"
    ]


def _sampling_lines(call: dict) -> list[str]:
    """Each run's ``sample`` calls (the shim times ai-toolkit's own): one row a call."""
    rows = [
        (r["label"], s)
        for r in call["runs"]
        for s in (r.get("summary") or {}).get("sampling") or []
    ]
    if not rows:
        return []
    sample = call.get("sample") or {}
    lines = [
        "",
        f"Sampling (ai-toolkit's `sample:`, one prompt, {sample.get('steps', '?')} denoising"
        f" steps at {call['resolution']} px, every {sample.get('every', '?')} steps): each"
        " no_grad pass of the transformer, the device synchronised around it; the first pass"
        " apart, the median of the others.",
        "",
        "| run | at step | training started | passes | first pass s | median pass s | sample s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, s in rows:
        first, median = s["first_s"], s["median_s"]
        lines.append(
            f"| {label} | {s['step']} | {'yes' if s['after_training_started'] else 'no'} |"
            f" {s['passes']} | {'-' if first is None else f'{first:.3f}'} |"
            f" {'-' if median is None else f'{median:.3f}'} | {s['wall_s']:.2f} |"
        )
    return lines


def markdown(report: dict) -> str:
    lines = [
        "# ai-toolkit's 24 GB recipe on an emulated 24 GiB card: its MemoryManager and"
        " weightstream-aitk",
        "",
    ]
    for call in report["calls"]:
        limited = any((r.get("summary") or {}).get("host_cgroup") for r in call["runs"])
        lines += [
            f"## {call['arch']} `{call['size']}` — {call['machine']}, commit {call['commit']}",
            "",
            f"- command: `{call['command']}`",
            f"- ai-toolkit `{call['ai_toolkit']}`, `run.py` unchanged; card: "
            + (f"{call['card_gib']:g} GiB (card.py)" if call["card_gib"] else "none"),
            f"- {call['steps']} steps at {call['resolution']} px, {call['images']} images;"
            " s/step is the median of the logged steps' gaps after the first",
            *_model_lines(call),
            *_limit_lines(call),
            "",
            "| run | rc | s/step | first step | card GiB in use loading / training (card.py)"
            " | torch peak GiB loading / training | host GiB trainer / daemon |"
            + (" host GiB peak (cgroup) / limit |" if limited else ""),
            "| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if limited else ""),
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
                + (f" {_host_cgroup(s)} |" if limited else "")
            )
        lines.append("")
        for r in call["runs"]:
            s = r.get("summary") or {}
            if s.get("oom"):
                lines.append(f"- {r['label']}: out of memory: `{s['oom']}`")
            kills = (s.get("host_cgroup") or {}).get("oom_kill")
            if kills:
                lines.append(
                    f"- {r['label']}: OOM-killed: the kernel's OOM killer ended {kills}"
                    f" process{'es' if kills > 1 else ''} of the run at its"
                    f" {_gib(s['host_cgroup']['limit_bytes'])} GiB host limit"
                )
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
            for st in s.get("streaming") or []:
                per_step = st["gpu_wait_ms_per_step"]
                lines.append(
                    f"- {r['label']}: {st['module']}'s session (read at {st['when']}): GPU wait"
                    f" for copies {st['gpu_wait_ms']} ms"
                    + (f" ({per_step} ms a step)" if per_step else "")
                    + f", hit rate {st['hit_rate']:.3f}, {st['acquires']} acquires,"
                    f" {st['reply_wait_ms']} ms waiting for replies"
                )
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
        lines += _sampling_lines(call)
        lines += ["", "Losses (ai-toolkit's UILogger, the logged steps):", ""]
        lines += [f"- {r['label']}: {r.get('losses')}" for r in call["runs"] if r.get("losses")]
        lines += ["", "job.yaml (every run; rank and optimizer as the run says):", "", "```yaml"]
        lines += [next((r["yaml"] for r in call["runs"] if "yaml" in r), "").rstrip(), "```", ""]
    return "\n".join(lines)
