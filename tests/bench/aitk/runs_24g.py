"""The runs tests/bench/ai_toolkit_24g.py is told to make (``parse_runs``), what each one is given
(``run_spec``: its folder, job.yaml and environment), how it is started (``launch``: in this
process, or under tests/bench/card.py as ``--one``), and the figures taken from it
(``summarize``, ``trainable_report``)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from tests.bench.aitk import cgroup, measure

BENCH = Path(__file__).resolve().parent.parent  # tests/bench

TEMPLATE = BENCH / "ai_toolkit_24g.yaml"

#: In the order they are worth the device time: the comparison at rank 32 first (ai-toolkit's
#: run is the shorter: it quantizes on the device), then the full link, then rank 128.
DEFAULT_RUNS = (
    "aitk:r32,weightstream:r32:25GB/s,weightstream:r32:full,weightstream:r128:25GB/s,"
    "aitk:r128,weightstream:r128:full"
)

CARD_CMD = "{python} tests/bench/card.py --gib {gib}{link} --json {json}"

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


def sample_yaml(every: int, steps: int, prompt: str, resolution: int, seed: int) -> str:
    """ai-toolkit's ``sample:`` section (SampleConfig): one prompt at the job's resolution,
    ``steps`` denoising steps, rendered at step 0, every ``every`` steps and at the end."""
    return "".join(
        f"        {line}\n"
        for line in (
            "sampler: flowmatch",
            f"sample_every: {every}",
            f"width: {resolution}",
            f"height: {resolution}",
            f"seed: {seed}",
            "walk_seed: false",
            "guidance_scale: 4",
            f"sample_steps: {steps}",
            'neg: ""',  # SampleConfig's default (False) is encoded as a prompt, and fails
            f"prompts: [{json.dumps(prompt)}]",
        )
    )


def job_yaml(
    arch,
    device,
    steps,
    resolution,
    rank,
    optimizer,
    quantize,
    save_dtype,
    sample=None,
    qtype="qfloat8",
    ara=None,
) -> str:
    """The template filled in; ``sample``: ``sample_yaml``'s text, sampling turned on (at step
    0 too: ``skip_first_sample: false``); ``qtype``: the transformer's ``model.qtype`` (the
    text encoder keeps ``qtype_te``); ``ara``: the ``model.accuracy_recovery_adapter`` file."""
    text = TEMPLATE.read_text()
    assert "        qtype: qfloat8\n" in text, "the template no longer sets model.qtype"
    line = f"        qtype: {qtype}\n"
    if ara:
        line += f"        accuracy_recovery_adapter: {json.dumps(str(ara))}\n"
    text = text.replace("        qtype: qfloat8\n", line, 1)
    if sample:
        for key in ("disable_sampling", "skip_first_sample"):
            assert f"{key}: true" in text, f"the template no longer sets {key}"
            text = text.replace(f"{key}: true", f"{key}: false")
        text = text.replace("      model:\n", "      sample:\n" + sample + "      model:\n", 1)
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
        sample_yaml(
            args.sample_every, args.sample_steps, args.sample_prompt, common["resolution"], 42
        )
        if args.sample_every
        else None,
        qtype=args.qtype,
        ara=common.get("ara"),
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


def host_limit_conflict(runs: list[dict], args) -> str | None:
    """Why ``--host-limit-gib`` cannot hold these runs, or None: the cgroup holds card.py's
    subprocess, so every run must be one (``--card``, no ``resident`` run, which runs in this
    process), and the daemon must be the run's own (``--daemon-socket``'s is outside it)."""
    if not getattr(args, "host_limit_gib", 0):
        return None
    if not args.card:
        return (
            "--host-limit-gib needs --card: the limit holds each run's card.py subprocess (its"
            " daemon and trainer); without --card the runs are in this process"
        )
    resident = [r["label"] for r in runs if r["kind"] == "resident"]
    if resident:
        return (
            f"--host-limit-gib: {', '.join(resident)} run in this process, not under card.py;"
            " drop them from --runs"
        )
    if getattr(args, "daemon_socket", None):
        return (
            "--host-limit-gib with --daemon-socket: that daemon runs outside the runs' cgroups"
            " and its memory would not count; drop one of them"
        )
    return None


def host_limit(args, name: str, common: dict):
    """The memory cgroup card.py runs in (``--host-limit-gib``: the daemon and the trainer
    below it count together), or no cgroup; the work folder's files (the model, the data) out
    of the page cache first, so that the run's cgroup counts what it reads of them."""
    gib = getattr(args, "host_limit_gib", 0)
    if not gib:
        return contextlib.nullcontext()
    root = getattr(args, "cgroup_root", None)
    cgroup.drop_page_cache(Path(common["work"]))
    return cgroup.memory_cgroup(
        int(gib * (1 << 30)), root, f"weightstream-bench-{os.getpid()}-{name}"
    )


def launch(run: dict, common: dict, args, cuda: bool) -> dict:
    """One run: in this process, or under card.py (``--card``) as ``--one``, there in a memory
    cgroup of its own with ``--host-limit-gib`` (``host_limit``)."""
    spec = run_spec(run, common, args, cuda)
    name = spec["folder_name"]
    work = Path(common["work"])
    if not args.card or run["kind"] == "resident":
        if getattr(args, "host_limit_gib", 0):
            raise ValueError(host_limit_conflict([run], args))
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
        with host_limit(args, name, common) as cg:
            try:  # the run inside has its own --timeout; this one is for card.py itself
                rc = subprocess.run(
                    cmd,
                    cwd=measure.REPO,
                    timeout=args.timeout + 120,
                    preexec_fn=cg.preexec if cg else None,
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            limit = cg.report() if cg else None
        result_path = Path(spec["result"])
        if result_path.exists():
            result = json.loads(result_path.read_text())
        else:
            result = {"mode": name, "rc": rc, "wall_s": time.monotonic() - t0}
        result["card_rc"] = rc
        result["card_command"] = cmd
        if card_json.exists():
            result["card"] = json.loads(card_json.read_text())
        if limit:
            result["host_limit"] = limit
    log = work / name / "trainer.log"
    if log.exists():
        result["trainable_host"] = trainable_report(log.read_text(errors="replace"))
    result["dropped_bytes"] = drop_outputs(work / name)
    result.update(run)
    result["yaml"] = spec["yaml"]
    return result


def drop_outputs(folder: Path) -> int:
    """A finished run's saved files (its LoRA, ``optimizer.pt``) and ai-toolkit's caches in
    its data folder (``_latent_cache``, text embeddings) removed, its logs and loss database
    kept: the next run needs the disk (FLUX.2-dev at full size in bf16 leaves 1.4 GB of a
    64 GiB disk, where ai-toolkit's text embedding cache failed for want of room once a run
    before it had saved). Returns the bytes removed."""
    gone = [p for p in folder.glob("output/**/*") if p.suffix in (".safetensors", ".pt")]
    gone += [p for p in folder.glob("data/**/_*cache*") if p.is_dir()]
    freed = 0
    for p in gone:
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
        freed += sum(f.stat().st_size for f in files)
        if p.is_file():
            p.unlink()
        else:
            shutil.rmtree(p)
    return freed


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


def streaming_summary(result: dict) -> list:
    """Each streamed module's daemon session as the shim read it when ai-toolkit freed or
    detached it, or at exit (the last reading a module, and when it was taken): the GPU's wait
    for copies in all and a step (where the trainer ends its steps: ``Handle.end_step``), the
    hit rate, the wait for the daemon's replies."""
    last: dict = {}
    for s in (result.get("stubs") or {}).get("memory_manager", {}).get("session_stats") or []:
        if "gpu_wait_ns_per_step" in s:
            last[s["module"]] = s
    return [
        {
            "module": module,
            "when": s["when"],
            "gpu_wait_ms": round(s.get("gpu_wait_ns", 0) / 1e6, 1),
            "gpu_wait_ms_per_step": [round(ns / 1e6, 1) for ns in s["gpu_wait_ns_per_step"]],
            "hit_rate": s.get("hit_rate"),
            "acquires": s.get("acquires"),
            "reply_wait_ms": round(s.get("reply_wait_ns", 0) / 1e6, 1),
            "bytes_copied": s.get("bytes_copied"),
        }
        for module, s in last.items()
    ]


def summarize(result: dict) -> dict:
    """The figures of one run: s/step (median of the logged steps' gaps after the first, the
    first holding the warm-up), time to the first step, torch's peaks while loading and while
    training, host memory (with ``trainable: host``, the LoRA's as weightstream-aitk reports
    it), the run's memory cgroup (``--host-limit-gib``: its limit, peak and OOM kills), an
    out-of-memory error if the run ended with one."""
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
        "sampling": sampling_summary(result),
        "streaming": streaming_summary(result),
    }
    tail = result.get("log_tail") or ""
    for line in tail.splitlines():
        if "out of memory" in line.lower() or "OutOfMemoryError" in line:
            out["oom"] = line.strip()[:400]
    limit = result.get("host_limit")
    if limit:  # the run's memory cgroup (--host-limit-gib)
        out["host_cgroup"] = {
            k: limit[k] for k in ("cgroup_version", "limit_bytes", "peak_bytes", "oom_kill")
        }
    card_oom = ((result.get("card") or {}).get("oom") or {}).get("lines")
    if card_oom and "oom" not in out:
        out["oom"] = str(card_oom[-1])[:400]
    return out


def sampling_summary(result: dict) -> list[dict]:
    """Each ``sample`` call of the run (the shim's ``WS_AITK_SAMPLING``): the step it came at,
    whether training had started, the transformer's no_grad passes (one a denoising step),
    the first pass's seconds and the median of the others, the call's seconds."""
    out = []
    for s in (result.get("sampling") or {}).get("samples", []):
        passes = s["forward_s"]
        out.append(
            {
                "step": s["step"],
                "after_training_started": s["after_training_started"],
                "passes": len(passes),
                "first_s": passes[0] if passes else None,
                "median_s": statistics.median(passes[1:]) if len(passes) > 1 else None,
                "wall_s": s["wall_s"],
            }
        )
    return out


#: What ``--work`` was built from and what was built, beside the model (``--reuse``).
BUILT = "built.json"


def reused(work: Path, what: dict) -> dict | None:
    """What an earlier call built in ``work`` from the same ``what`` (``--reuse``), or None."""
    try:
        old = json.loads((work / BUILT).read_text())
    except (OSError, ValueError):
        return None
    return old["built"] if old.get("what") == json.loads(json.dumps(what)) else None
