"""tests/bench/generate_two.py on the CPU (host backend, its tiny FLUX.2 transformer): a process
alone, then two at once on one daemon; every process's latents equal the same pipeline's with
the transformer in memory, the second attach adds nothing to the daemon's store, and each
process's counters are exact. Times and host memory are only checked to be there."""

from __future__ import annotations

import torch

from tests.bench import generate_two

STEPS = 3


def test_two_processes_share_the_host_copy_and_equal_the_model_in_memory(daemon, tmp_path):
    args = generate_two.parse_args(["--smoke", "--out", str(tmp_path), "--device", "cpu"])
    args.steps, args.resolution = STEPS, 64
    measured = generate_two.run(args, daemon)
    res, summary = measured["results"], measured["summary"]
    assert all(res[n]["returncode"] == 0 for n in ("alone", "first", "second"))
    want = generate_two.pipeline("tiny", torch.bfloat16)(
        args.prompt, STEPS, 64, 64, torch.Generator().manual_seed(0)
    ).images[0]
    assert torch.equal(torch.load(tmp_path / "alone.pt"), want)
    assert summary["outputs_equal"] and res["first"]["equal_to_alone"]
    assert summary["second_attach_store_bytes"] == 0
    memory = measured["memory"]
    assert memory["first_attached"]["store_bytes"] == 4071424  # the tiny transformer, once
    assert set(memory["second_attached"]) == {
        "store_bytes",
        "MemAvailable",
        "daemon",
        "first",
        "second",
    }
    for name in ("alone", "first", "second"):
        assert res[name]["stats"] == (
            "transformer: 3 passes, 93 acquires, hit rate 0.925, GPU wait "
            + res[name]["stats"].rsplit("GPU wait ", 1)[1]
        )
        assert len(res[name]["step_s"]) == STEPS - 1
    md = generate_two.markdown(
        {
            "command": "c",
            "commit": "abc",
            "device": "cpu",
            "size": "tiny",
            "steps": STEPS,
            "resolution": 64,
            "vram_budget_gib": args.vram_budget_gib,
            "link": "full",
            **measured,
        }
    )
    assert "| second |" in md and "outputs equal to alone: yes" in md
