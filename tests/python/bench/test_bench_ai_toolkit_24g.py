"""The pure parts of tests/bench/ai_toolkit_24g.py (the runs it is told to make, the YAML it
writes, the figures it takes from a run), on the CPU; the bench itself runs ai-toolkit."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.bench.aitk import measure, report_24g, runs_24g
from tests.bench.aitk.measure import RSS_FIELDS, Sampler

pytestmark = pytest.mark.no_daemon


@pytest.mark.parametrize(
    "text,want",
    [
        (
            "weightstream:r32:25GB/s,aitk:r128",
            [
                ("weightstream", 32, "25GB/s", "weightstream r32 25GB/s"),
                ("aitk", 128, "full", "aitk r128"),
            ],
        ),
        ("weightstream:r4", [("weightstream", 4, "full", "weightstream r4 full")]),
        (" aitk , ", [("aitk", 32, "full", "aitk r32")]),
        (
            "host:r1024:25GB/s,host:r1024:full,aitk:r128",
            [
                ("host", 1024, "25GB/s", "weightstream host r1024 25GB/s"),
                ("host", 1024, "full", "weightstream host r1024 full"),
                ("aitk", 128, "full", "aitk r128"),
            ],
        ),
        (
            "host:r8,weightstream:r8",
            [
                ("host", 8, "full", "weightstream host r8 full"),
                ("weightstream", 8, "full", "weightstream r8 full"),
            ],
        ),
        ("aitk:r32:25GB/s", "--runs 'aitk:r32:25GB/s': the link cap reaches weightstream's"),
        (
            "resident:r32,aitk:r32",
            [
                ("resident", 32, "full", "resident r32"),
                ("aitk", 32, "full", "aitk r32"),
            ],
        ),
        ("resident:r32:25GB/s", "--runs 'resident:r32:25GB/s': the link cap reaches weightstream"),
        (
            "plain:r32",
            "--runs 'plain:r32': expected aitk|weightstream|host|resident|resident16:rRANK[:LINK",
        ),
        (
            "weightstream:32",
            "--runs 'weightstream:32': expected aitk|weightstream|host|resident|resident16",
        ),
        ("host:rx", "--runs 'host:rx': expected aitk|weightstream|host|resident|resident16:rRANK"),
        ("host:r0", "--runs 'host:r0': expected aitk|weightstream|host|resident|resident16:rRANK"),
        (
            "host:r-4",
            "--runs 'host:r-4': expected aitk|weightstream|host|resident|resident16:rRANK",
        ),
        (
            "weightstream:r32:25GB/s:x",
            "expected aitk|weightstream|host|resident|resident16:rRANK[:LINK|full] (RANK",
        ),
        ("host:r64,aitk:r8,host:r64:full", "'weightstream host r64 full' is listed twice"),
    ],
)
def test_runs(text, want):
    if isinstance(want, str):
        with pytest.raises(ValueError) as e:
            runs_24g.parse_runs(text)
        assert want in str(e.value)
    else:
        got = [(r["mode"], r["rank"], r["link"], r["label"]) for r in runs_24g.parse_runs(text)]
        assert got == want


def test_reuse_takes_only_what_the_same_settings_built(tmp_path):
    what = {"arch": "flux2", "size": {"transformer": {"depth_single_blocks": 33}}, "seed": 42}
    assert runs_24g.reused(tmp_path, what) is None  # nothing built yet
    (tmp_path / runs_24g.BUILT).write_text(json.dumps({"what": what, "built": {"params": 7}}))
    assert runs_24g.reused(tmp_path, what) == {"params": 7}
    assert runs_24g.reused(tmp_path, {**what, "seed": 43}) is None
    (tmp_path / runs_24g.BUILT).write_text("{not json")
    assert runs_24g.reused(tmp_path, what) is None


def test_every_default_run_parses():
    labels = [r["label"] for r in runs_24g.parse_runs(runs_24g.DEFAULT_RUNS)]
    assert labels[:2] == ["aitk r32", "weightstream r32 25GB/s"]
    assert len(labels) == len(set(labels)) == 6


@pytest.mark.parametrize("quantize", [True, False])
def test_the_yaml_is_the_recipe_with_every_placeholder_filled(quantize):
    text = runs_24g.job_yaml("flux2", "cuda:0", 6, 1024, 128, "adamw8bit", quantize, "bf16")
    assert "@" not in text.replace("[name]", "")
    for line in (
        'device: "cuda:0"',
        "network: {type: lora, linear: 128, linear_alpha: 128}",
        "resolution: [1024]",
        "steps: 6",
        "optimizer: adamw8bit",
        "arch: flux2",
        "gradient_checkpointing: true",
        "low_vram: true",
        "layer_offloading: true",
        f"quantize: {str(quantize).lower()}",
        f"quantize_te: {str(quantize).lower()}",
        "qtype: qfloat8",
        "save: {dtype: bf16, save_every: 100000, max_step_saves_to_keep: 1}",
    ):
        assert line in text, line


def test_qtype_and_ara_set_the_transformers_quantization_only():
    text = runs_24g.job_yaml(
        "flux2", "cpu", 4, 64, 4, "adamw", True, "float32", qtype="uint4", ara="/w/ara.safetensors"
    )
    model = text[text.index("      model:\n") : text.index("meta:")].splitlines()
    assert model[3:8] == [
        "        quantize: true             # qfloat8, which layer_offloading turns into torchao"
        " float8",
        "        qtype: uint4",
        '        accuracy_recovery_adapter: "/w/ara.safetensors"',
        "        quantize_te: true",
        "        qtype_te: qfloat8",
    ]
    plain = runs_24g.job_yaml("flux2", "cpu", 4, 64, 4, "adamw", True, "float32")
    assert plain == runs_24g.TEMPLATE.read_text().replace("@DEVICE@", "cpu").replace(
        "@ARCH@", "flux2"
    ).replace("@STEPS@", "4").replace("@RESOLUTION@", "64").replace("@RANK@", "4").replace(
        "@OPTIMIZER@", "adamw"
    )
    assert "accuracy_recovery_adapter" not in plain
    common, args = _spec_inputs()
    args.qtype = "convrot8"
    (run,) = runs_24g.parse_runs("weightstream:r4")
    spec = runs_24g.run_spec(run, dict(common, ara=None), args, cuda=False)["yaml"]
    assert "        qtype: convrot8\n" in spec and "accuracy_recovery_adapter" not in spec
    spec = runs_24g.run_spec(run, dict(common, ara="/w/a.safetensors"), args, cuda=False)["yaml"]
    assert '        accuracy_recovery_adapter: "/w/a.safetensors"\n' in spec


def test_the_ara_file_is_the_layout_quantize_model_reads(tmp_path):
    import torch
    from safetensors.torch import load_file

    from tests.bench.aitk_packed_real import write_ara

    layers = {"transformer.double_blocks.0.img_attn.qkv": (16, 48)}
    write_ara(torch, tmp_path / "ara.safetensors", 3, layers, rank=2)
    got = load_file(tmp_path / "ara.safetensors")
    assert {k: (v.dtype, list(v.shape)) for k, v in got.items()} == {
        "transformer.double_blocks.0.img_attn.qkv.lora_A.weight": (torch.bfloat16, [2, 16]),
        "transformer.double_blocks.0.img_attn.qkv.lora_B.weight": (torch.bfloat16, [48, 2]),
    }


def test_a_runs_figures():
    result = {
        "step_gaps_s": [9.0, 2.0, 4.0, 3.0],  # the first gap holds the warm-up
        "first_step_s": 120.5,
        "torch_stats": {
            "loading": {"max_memory_allocated": 1 << 30},
            "training": {"max_memory_allocated": 20 << 30},
        },
        "trainer_peak_rss": 5,
        "daemon_peak_rss": 7,
        "log_tail": "step 3\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n",
    }
    got = runs_24g.summarize(result)
    assert got["s_per_step"] == 3.0 and got["steps_timed"] == 3
    assert (got["torch_loading_peak"], got["torch_training_peak"]) == (1 << 30, 20 << 30)
    assert (got["host_trainer_peak"], got["host_daemon_peak"]) == (5, 7)
    assert got["oom"].startswith("torch.OutOfMemoryError: CUDA out of memory.")
    quiet = runs_24g.summarize(
        {"step_gaps_s": [1.0], "card": {"oom": {"lines": ["out of memory"]}}}
    )
    assert quiet["s_per_step"] is None and quiet["oom"] == "out of memory"


def test_card_phases_read_card_pys_report():
    card = {"phases": {"loading": {"peak_card_gib": 3.25}, "training": {"peak_card_gib": 23.5}}}
    assert report_24g._card_phases(card) == ("3.25", "23.50")
    assert report_24g._card_phases({"phases": {"loading": {"peak_card_gib": 1}}}) == ("1.00", "-")
    assert report_24g._card_phases(None) == ("-", "-")


def _spec_inputs():
    common = {
        "arch": "flux2",
        "device": "cuda:0",
        "resolution": 1024,
        "work": "/w",
        "env": {"HF_HOME": "/w/hf"},
    }
    args = SimpleNamespace(
        steps=6,
        optimizer=None,
        no_quantize=False,
        qtype="qfloat8",
        card=24,
        card_cmd=runs_24g.CARD_CMD,
        save_dtype="float32",
        sample_every=0,
        sample_steps=28,
        sample_prompt="a lighthouse",
    )
    return common, args


def test_sampling_turns_on_ai_toolkits_sample_section_at_step_0_too():
    common, args = _spec_inputs()
    (run,) = runs_24g.parse_runs("aitk:r32")
    plain = runs_24g.run_spec(run, common, args, cuda=True)["yaml"]
    assert "disable_sampling: true" in plain and "      sample:" not in plain
    args.sample_every = 3
    text = runs_24g.run_spec(run, common, args, cuda=True)["yaml"]
    assert "disable_sampling: false" in text and "skip_first_sample: false" in text
    section = text[text.index("      sample:\n") : text.index("      model:\n")]
    assert section.splitlines() == [
        "      sample:",
        "        sampler: flowmatch",
        "        sample_every: 3",
        "        width: 1024",
        "        height: 1024",
        "        seed: 42",
        "        walk_seed: false",
        "        guidance_scale: 4",
        "        sample_steps: 28",
        '        neg: ""',
        '        prompts: ["a lighthouse"]',
    ]


def test_a_runs_sampling_is_each_sample_calls_passes():
    sampling = {
        "samples": [
            {
                "step": 0,
                "after_training_started": False,
                "forward_s": [3.0, 1.0, 2.0, 1.5],
                "wall_s": 9.0,
            },
            {"step": 4, "after_training_started": True, "forward_s": [1.2], "wall_s": 2.0},
        ]
    }
    got = runs_24g.summarize({"sampling": sampling})["sampling"]
    assert got == [
        {
            "step": 0,
            "after_training_started": False,
            "passes": 4,
            "first_s": 3.0,
            "median_s": 1.5,
            "wall_s": 9.0,
        },
        {
            "step": 4,
            "after_training_started": True,
            "passes": 1,
            "first_s": 1.2,
            "median_s": None,
            "wall_s": 2.0,
        },
    ]
    call = {
        "resolution": 64,
        "sample": {"every": 2, "steps": 4},
        "runs": [
            {"label": "aitk r4", "summary": {"sampling": got}},
            {"label": "ws", "summary": {}},
        ],
    }
    lines = report_24g._sampling_lines(call)
    assert lines[-2:] == [
        "| aitk r4 | 0 | no | 4 | 3.000 | 1.500 | 9.00 |",
        "| aitk r4 | 4 | yes | 1 | 1.200 | - | 2.00 |",
    ]
    assert report_24g._sampling_lines({"runs": [{"label": "ws", "summary": {}}]}) == []


def test_a_host_run_is_a_weightstream_run_with_the_lora_in_host_memory():
    common, args = _spec_inputs()
    host, ws, aitk = runs_24g.parse_runs("host:r1024:25GB/s,weightstream:r1024:25GB/s,aitk:r128")
    spec = runs_24g.run_spec(host, common, args, cuda=True)
    assert (spec["mode"], spec["kind"], spec["link"]) == ("host", "weightstream", "25GB/s")
    assert spec["folder_name"] == "weightstream-host-r1024-25GBps"
    assert spec["result"] == "/w/weightstream-host-r1024-25GBps.result.json"
    assert spec["env"] == {
        "HF_HOME": "/w/hf",
        "WEIGHTSTREAM_TRAINABLE": "host",
        "WEIGHTSTREAM_TRAINABLE_DELAY": "true",
    }
    assert "network: {type: lora, linear: 1024, linear_alpha: 1024}" in spec["yaml"]
    assert "optimizer: adamw8bit" in spec["yaml"]
    plain = runs_24g.run_spec(ws, common, args, cuda=True)
    assert (plain["kind"], plain["env"]) == ("weightstream", {"HF_HOME": "/w/hf"})
    assert plain["yaml"] == spec["yaml"]  # the same job; only the environment differs
    theirs = runs_24g.run_spec(aitk, common, args, cuda=True)
    assert (theirs["kind"], theirs["env"]) == ("aitk", {"HF_HOME": "/w/hf"})
    assert common["env"] == {"HF_HOME": "/w/hf"}  # the call's environment is left as it was


def test_host_delay_false_reaches_the_runs_environment_and_label():
    common, args = _spec_inputs()
    (run,) = runs_24g.parse_runs("host:r256", host_delay=False)
    assert run["label"] == "weightstream host r256 full delay off"
    assert runs_24g.run_spec(run, common, args, cuda=False)["env"] == {
        "HF_HOME": "/w/hf",
        "WEIGHTSTREAM_TRAINABLE": "host",
        "WEIGHTSTREAM_TRAINABLE_DELAY": "false",
    }
    (plain,) = runs_24g.parse_runs("weightstream:r256", host_delay=False)
    assert plain["run_env"] == {}


def test_card_py_caps_the_link_of_weightstreams_runs_only():
    _, args = _spec_inputs()
    host, full, aitk = runs_24g.parse_runs("host:r1024:25GB/s,host:r1024:full,aitk:r128")
    cmd = runs_24g.card_command(host, args, Path("/w/s.json"), Path("/w/c.json"))
    card = cmd[: cmd.index("--")]
    assert card == [
        sys.executable,
        "tests/bench/card.py",
        "--gib",
        "24",
        "--link",
        "25GB/s",
        "--json",
        "/w/c.json",
    ]
    assert cmd[cmd.index("--") + 1 :] == [
        sys.executable,
        "-m",
        "tests.bench.ai_toolkit_24g",
        "--one",
        "/w/s.json",
    ]
    for run in (full, aitk):
        assert "--link" not in runs_24g.card_command(run, args, Path("/s"), Path("/c"))


#: As weightstream-aitk prints it (weightstream.integrations.ai_toolkit.trainable).
HOST_LINE = (
    "weightstream-aitk: trainable: host: 504 LoRA layers and their adamw8bit state in 61.87 GB"
    " of host memory (held by the daemon for the session of Flux2); computing on cuda:0;"
    " delayed update off"
)


def test_the_trainable_host_line_is_read_from_the_trainers_log():
    log = f"loading\n{HOST_LINE}\nstep 1\n"
    assert runs_24g.trainable_report(log) == {
        "layers": 504,
        "optimizer": "adamw8bit",
        "host_gb": 61.87,
        "where": "held by the daemon for the session of Flux2",
        "device": "cuda:0",
        "delay": False,
    }
    assert runs_24g.trainable_report("loading\nstep 1\n") is None
    # the line tests/python/ai_toolkit/test_ai_toolkit_trainable.py has the launcher print
    own = runs_24g.trainable_report(
        "weightstream-aitk: trainable: host: 12 LoRA layers and their adamw state in 0.00 GB "
        "of host memory (the trainer's own: no attached model holds the layers the LoRA wraps); "
        "computing on cpu; delayed update on\n"
    )
    assert own == {
        "layers": 12,
        "optimizer": "adamw",
        "host_gb": 0.0,
        "where": "the trainer's own: no attached model holds the layers the LoRA wraps",
        "device": "cpu",
        "delay": True,
    }
    got = runs_24g.summarize({"trainable_host": runs_24g.trainable_report(log)})
    assert got["trainable_host"]["host_gb"] == 61.87


def report_call(runs: list, **fields) -> dict:
    """One call of the bench's report (tiny FLUX.1 on the CPU) over ``runs``, ``fields``
    replacing its own."""
    return {
        "arch": "flux",
        "size": "tiny",
        "machine": "CPU",
        "commit": "abc",
        "command": "x",
        "ai_toolkit": "def",
        "card_gib": None,
        "steps": 4,
        "resolution": 64,
        "images": 1,
        "disk_dtype": "fp8",
        "built": {"transformer": {"params": 10, "bytes_on_disk": 20}},
        "sizes": {},
        "runs": runs,
        **fields,
    }


def test_the_report_gives_a_host_runs_lora_memory():
    (run,) = runs_24g.parse_runs("host:r1024:25GB/s")
    result = dict(run, rc=0, trainable_host=runs_24g.trainable_report(HOST_LINE))
    result["summary"] = runs_24g.summarize(result)
    missing = dict(run, label="weightstream host r1024 full", rc=0)
    missing["summary"] = runs_24g.summarize(missing)
    text = report_24g.markdown({"calls": [report_call([result, missing])]})
    assert (
        "- weightstream host r1024 25GB/s: `trainable: host`: 504 LoRA layers and their adamw8bit"
        " state in 61.87 GB of host memory (held by the daemon for the session of Flux2),"
        " delayed update off\n"
    ) in text
    assert (
        "- weightstream host r1024 full: no `trainable: host` line in the trainer's log\n" in text
    )


def test_the_report_gives_each_streamed_modules_waits_from_its_last_reading():
    (run,) = runs_24g.parse_runs("weightstream:r32:25GB/s")
    reading = {"acquires": 10, "hit_rate": 0.5, "bytes_copied": 7, "reply_wait_ns": 2_500_000}
    stats = [
        {"module": "Flux2", "when": "free", "gpu_wait_ns_per_step": [9_000_000], **reading},
        {"module": "Mistral", "when": "free", "error": "RuntimeError('closed')"},
        {"module": "Mistral", "when": "free", "gpu_wait_ns_per_step": [], **reading},
        {
            "module": "Flux2",
            "when": "exit",
            "gpu_wait_ns": 1_550_000,
            "gpu_wait_ns_per_step": [1_250_000, 300_000],
            **reading,
            "acquires": 40,
        },
    ]
    result = dict(run, rc=0, stubs={"memory_manager": {"session_stats": stats}})
    result["summary"] = runs_24g.summarize(result)
    assert result["summary"]["streaming"][0] == {
        "module": "Flux2",
        "when": "exit",
        "gpu_wait_ms": 1.6,
        "gpu_wait_ms_per_step": [1.2, 0.3],
        "hit_rate": 0.5,
        "acquires": 40,
        "reply_wait_ms": 2.5,
        "bytes_copied": 7,
    }
    text = report_24g.markdown({"calls": [report_call([result])]})
    assert (
        "- weightstream r32 25GB/s: Flux2's session (read at exit): GPU wait for copies 1.6 ms"
        " ([1.2, 0.3] ms a step), hit rate 0.500, 40 acquires, 2.5 ms waiting for replies\n"
        "- weightstream r32 25GB/s: Mistral's session (read at free): GPU wait for copies 0.0 ms,"
        " hit rate 0.500, 10 acquires, 2.5 ms waiting for replies\n"
    ) in text


def test_the_host_memory_at_a_runs_end_is_its_last_sample():
    timeline = [
        {"t": 0.0, "RssAnon": 1.0, "RssFile": 0.5, "RssShmem": 0.0, "MemAvailable": 120.0},
        {"t": 60.0, "RssAnon": 70.0, "RssFile": 25.0, "RssShmem": 0.0, "MemAvailable": 30.0},
        {"t": 220.0, "RssAnon": 60.0, "RssFile": 1.0, "RssShmem": 45.0, "MemAvailable": 2.5},
    ]
    assert report_24g.host_at_end({"trainer_rss_timeline": timeline}) == (
        "the trainer's host memory at 220 s, its last sample: RssAnon 60.00, RssFile 1.00,"
        " RssShmem 45.00 GiB; the host had 2.50 GiB available"
    )
    # A point after the trainer exited has the host's memory only: the last sample stays.
    timeline.append({"t": 222.0, "MemAvailable": 90.0})
    assert report_24g.host_at_end({"trainer_rss_timeline": timeline}) == (
        "the trainer's host memory at 220 s, its last sample: RssAnon 60.00, RssFile 1.00,"
        " RssShmem 45.00 GiB; the host had 2.50 GiB available"
    )
    timeline[1]["RssAnon"], timeline[1]["MemAvailable"] = 100.0, 1.5
    assert report_24g.host_at_end({"trainer_rss_timeline": timeline}).endswith(
        " GiB available, 1.50 at the least (60 s)"
        " (largest at 60 s: RssAnon 100.00, RssFile 25.00, RssShmem 0.00)"
    )
    assert report_24g.host_at_end({}) is None
    assert (
        report_24g.host_at_end({"trainer_rss_timeline": [{"t": 1.0, "MemAvailable": 9.0}]}) is None
    )


def test_the_sampler_reads_the_rss_fields_of_a_status():
    sampler = Sampler(0, False)
    status = "Name:\tpython\nVmHWM:\t 4096 kB\nRssAnon:\t 2097152 kB\nRssFile:\t 1048576 kB\n"
    status += "RssShmem:\t 0 kB\n"
    sampler._point(status, 3.04)
    point = sampler.timeline[0]
    assert {k: point[k] for k in ("t", *RSS_FIELDS)} == {
        "t": 3.0,
        "RssAnon": 2.0,
        "RssFile": 1.0,
        "RssShmem": 0.0,
    }


def test_a_finished_runs_saves_and_caches_are_dropped_its_logs_kept(tmp_path):
    run = tmp_path / "weightstream-r32-full"
    files = {
        "output/ws_24g_lora/ws_24g_lora.safetensors": 300,
        "output/ws_24g_lora/optimizer.pt": 200,
        "output/ws_24g_lora/loss_log.db": 7,
        "data/_latent_cache/a.safetensors": 40,
        "data/_t_e_cache/a.safetensors": 30,
        "data/a.jpg": 5,
        "trainer.log": 3,
    }
    for name, size in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(b"x" * size)
    assert runs_24g.drop_outputs(run) == 570
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
    assert left == ["data/a.jpg", "output/ws_24g_lora/loss_log.db", "trainer.log"]


def write_loss_log(folder, steps):
    """ai-toolkit's UILogger database (``toolkit/logging_aitk.py``'s tables) with ``steps``:
    (step, wall time, loss)."""
    db = folder / "output" / "ws_24g_lora" / "loss_log.db"
    db.parent.mkdir(parents=True)
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE steps (step INTEGER PRIMARY KEY, wall_time REAL NOT NULL)")
    con.execute(
        "CREATE TABLE metrics (step INTEGER NOT NULL, key TEXT NOT NULL, value_real REAL, "
        "value_text TEXT, PRIMARY KEY (step, key))"
    )
    for step, wall, loss in steps:
        con.execute("INSERT INTO steps VALUES (?, ?)", (step, wall))
        con.execute("INSERT INTO metrics VALUES (?, 'loss/loss', ?, NULL)", (step, loss))
    con.commit()
    con.close()


def test_a_stopped_runs_logged_steps_are_read_too(tmp_path):
    """A run stopped at its timeout after three steps of ~60 s: its gaps and its time to the
    first step, which the figures give as s/step beside the timeout."""
    assert measure.logged_steps(tmp_path, 1000.0) == {}
    write_loss_log(tmp_path, [(0, 1160.0, 2.5), (1, 1221.0, 2.25), (2, 1285.5, 2.0)])
    got = measure.logged_steps(tmp_path, 1000.0)
    assert got["first_step_s"] == 160.0
    assert got["step_gaps_s"] == [61.0, 64.5]
    assert got["losses"] == [2.5, 2.25, 2.0]
    figures = runs_24g.summarize({"rc": "timeout", **got})
    assert (figures["s_per_step"], figures["steps_timed"]) == (64.5, 1)
