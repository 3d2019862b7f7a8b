"""The pure parts of tests/bench/ai_toolkit_24g.py (the runs it is told to make, the YAML it
writes, the figures it takes from a run), on the CPU; the bench itself runs ai-toolkit."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests" / "bench"))
import ai_toolkit_24g as bench  # noqa: E402

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
        ("aitk:r32:25GB/s", "the link cap reaches weightstream's daemon only"),
        ("resident:r32", "expected aitk|weightstream:rRANK"),
        ("weightstream:32", "expected aitk|weightstream:rRANK"),
        ("weightstream:r32:25GB/s:x", "expected aitk|weightstream:rRANK"),
    ],
)
def test_runs(text, want):
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want):
            bench.parse_runs(text)
    else:
        got = [(r["mode"], r["rank"], r["link"], r["label"]) for r in bench.parse_runs(text)]
        assert got == want


def test_every_default_run_parses():
    labels = [r["label"] for r in bench.parse_runs(bench.DEFAULT_RUNS)]
    assert labels[:2] == ["aitk r32", "weightstream r32 25GB/s"]
    assert len(labels) == len(set(labels)) == 6


@pytest.mark.parametrize("quantize", [True, False])
def test_the_yaml_is_the_recipe_with_every_placeholder_filled(quantize):
    text = bench.job_yaml("flux2", "cuda:0", 6, 1024, 128, "adamw8bit", quantize)
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
    ):
        assert line in text, line


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
    got = bench.summarize(result)
    assert got["s_per_step"] == 3.0 and got["steps_timed"] == 3
    assert (got["torch_loading_peak"], got["torch_training_peak"]) == (1 << 30, 20 << 30)
    assert (got["host_trainer_peak"], got["host_daemon_peak"]) == (5, 7)
    assert got["oom"].startswith("torch.OutOfMemoryError: CUDA out of memory.")
    quiet = bench.summarize({"step_gaps_s": [1.0], "card": {"oom": {"lines": ["out of memory"]}}})
    assert quiet["s_per_step"] is None and quiet["oom"] == "out of memory"


def test_card_phases_read_card_pys_report():
    card = {"phases": {"loading": {"peak_card_gib": 3.25}, "training": {"peak_card_gib": 23.5}}}
    assert bench._card_phases(card) == ("3.25", "23.50")
    assert bench._card_phases({"phases": {"loading": {"peak_card_gib": 1}}}) == ("1.00", "-")
    assert bench._card_phases(None) == ("-", "-")
