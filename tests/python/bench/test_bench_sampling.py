"""tests/bench/sampling.py on the CPU: its weightstream phases (sampling before any training
step, two steps, sampling again, one more step) against the daemon's host backend with the
8-block model of tests/python/torch/test_sampling.py, and its report from made-up results.
The counts are exact; the times are only checked to be there."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from tests.bench import sampling
from tests.daemon import Daemon
from tests.gpu.link_cap import free_port, scrape
from tests.python.torch.test_sampling import BLOCK_BYTES, X, make_pair


def test_the_phases_count_each_kind_of_pass(daemon):
    ref, model, handle = make_pair(daemon)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)

    def train_step():
        model(X).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    forward = model.forward
    model.forward = lambda x=X: forward(x)  # the bench calls model(**inputs)
    calls = iter(range(100))
    record = sampling.weightstream_run(
        model, {}, 5, handle, train_step, lambda: None, allocs=lambda: 2 * next(calls)
    )
    before, after = record["before"]["counters"], record["after"]["counters"]
    # Five passes timed alone, then four back to back: 9 passes of 8 blocks.
    assert (before["sample_acquires"], before["sample_hits"], before["sample_passes"]) == (
        72,
        71,
        9,
    )
    assert (after["sample_acquires"], after["sample_hits"], after["train_acquires"]) == (72, 72, 0)
    step = record["train_counters_step_after"]
    assert (step["train_acquires"], step["train_hits"]) == (15, 15)
    step = record["train_counters_step_before"]
    assert (step["train_acquires"], step["train_hits"], step["train_passes"]) == (15, 14, 1)
    assert record["train_step_device_allocs"] == [2, 2, 2, 2]
    assert record["before"]["enter_s"] >= 0 and record["after"]["exit_s"] >= 0
    assert record["after"]["segments"] == {  # on the CPU nothing is given back
        "sampling_segments_given": 0,
        "sampling_segments_made": 0,
        "sampling_segments_made_bytes": 0,
        "sampling_resident_kept_groups": 0,
        "sampling_resident_kept_bytes": 0,
        "sampling_resident_kept_staged_groups": 0,
        "sampling_resident_kept_staged_bytes": 0,
    }
    assert len(record["train_step_s"]) == 4 and len(record["before"]["pass_s"]) == 4
    assert record["before"]["back_to_back_s"] > 0
    assert sampling.streamed_bytes_per_pass(handle) == 8 * 132352
    handle.detach(release=True)


def test_a_phase_records_what_the_copy_thread_did_from_the_daemons_metrics(tmp_path):
    """With the daemon's metrics (as the GPU child scrapes them), a phase records what its copy
    thread did over the passes after the first: the bytes it copied (whole blocks, within one
    block of what the session's stats count over the same passes: prefetches run on between
    the two reads), and their rate; no cap, no throttling."""
    port = free_port()
    d = Daemon(tmp_path, "--metrics-listen", f"127.0.0.1:{port}")
    try:
        _, model, handle = make_pair(d)
        forward = model.forward
        model.forward = lambda x=X: forward(x)
        copied = []

        def device():
            copied.append(handle.session.stats().bytes_copied)
            return scrape(f"http://127.0.0.1:{port}/metrics")

        phase = sampling.sampling_phase(model, {}, 5, handle, lambda: None, device=device)
        link = phase["link"]
        assert link["streamed_bytes"] % 132352 == 0
        assert abs(link["streamed_bytes"] - (copied[1] - copied[0])) <= 132352
        assert link["streamed_bytes"] >= 4 * 3 * 132352  # 4 passes, 8 blocks, 3 staged
        assert link["gb_per_s"] == link["streamed_bytes"] / link["seconds"] / 1e9
        assert link["throttled_share"] == 0.0 and link["copies"] > 0
        handle.detach(release=True)
    finally:
        d.stop()


def test_a_sampling_budget_phase_is_held_by_around_and_streams_less(daemon):
    """With ``sample_vram_budget`` the passes run inside ``around`` (the GPU child holds the
    trainer to its share of the card there), itself inside ``sampling()``: the session has
    grown before it and shrinks after it. The phase records the bytes a pass streams at the
    sampling budget: 3 of the 8 blocks (staging), the other 5 resident."""
    _, model, handle = make_pair(daemon, sample_vram_budget=f"{8 * BLOCK_BYTES}")
    forward = model.forward
    model.forward = lambda x=X: forward(x)
    held = []

    @contextlib.contextmanager
    def around():
        held.append(("enter", handle.vram_budget))
        yield
        held.append(("exit", handle.vram_budget))

    phase = sampling.sampling_phase(model, {}, 3, handle, lambda: None, around)
    assert held == [("enter", 8 * BLOCK_BYTES), ("exit", 8 * BLOCK_BYTES)]
    assert phase["bytes_per_pass"] == 3 * 132352
    assert sampling.streamed_bytes_per_pass(handle) == 8 * 132352  # given back after
    handle.detach(release=True)


def test_the_report_compares_with_the_resident_pass_and_the_link():
    results = {
        "resident": {
            "first_pass_s": 1.0,
            "median_s": 0.5,
            "back_to_back_s": 0.4,
            "returncode": 0,
        },
        "weightstream": {
            "bytes_per_pass": 25 * 10**9,
            "before": {
                "first_pass_s": 2.0,
                "median_s": 1.05,
                "back_to_back_s": 1.1,
                "link": {"gb_per_s": 23.61, "throttled_share": 0.812, "busy_share": 0.953},
            },
            "after": {
                "first_pass_s": 1.1,
                "median_s": 1.0,
                "enter_s": 0.7,
                "exit_s": 0.4,
                "segments": {
                    "sampling_segments_given": 124,
                    "sampling_segments_made": 124,
                    "sampling_segments_made_bytes": 3 << 30,
                    "sampling_resident_kept_groups": 12,
                    "sampling_resident_kept_bytes": 6 << 30,
                    "sampling_resident_kept_staged_groups": 6,
                    "sampling_resident_kept_staged_bytes": 3 << 30,
                },
            },
            "train_step_s": [3.0, 2.0, 2.1, 2.05],
            "train_step_device_allocs": [9, 0, 4, 0],
            "train_counters_step_before": {"train_gpu_wait_ns": 250_000_000},
            "train_counters_step_after": {"train_gpu_wait_ns": 320_400_000},
        },
    }
    r = sampling.ratios(results, 25 * 10**9)
    assert r == {
        "before_over_resident": 2.1,
        "before_over_bound": 1.05,
        "after_over_resident": 2.0,
        "after_over_bound": 1.0,
        "b2b_before_over_resident": 2.75,
        "b2b_before_over_bound": 1.1,
    }
    md = sampling.markdown(
        {"command": "cmd", "commit": "abc", "device": "H100", "results": results, "ratios": r}
    )
    assert "| resident bf16 | - | 1.000 | 0.500 | 1.00 | - | 0.400 | 1.00 | - |" in md
    assert (
        "| weightstream | before training | 2.000 | 1.050 | 2.10 | 1.05 | 1.100 | 2.75 | 1.10 |"
        in md
    )
    assert "| weightstream | after training | 1.100 | 1.000 | 2.00 | 1.00 | - | - | - |" in md
    assert (
        "- after training, `sampling()` began in 0.700 s and ended in 0.400 s (at a sampling "
        "budget: the session opened again); the trainer's idle segments: 124 given back, 124 "
        "made again (3.00 GiB); resident groups kept through the reopen: 12 (6.00 GiB); the "
        "groups the next step stages first, staged within the device: 6 (3.00 GiB)"
    ) in md
    assert (
        "Training step before / after sampling: 2.000 / 2.100 s (the next: 2.050 s); the "
        "trainer's device allocations in each step: [9, 0, 4, 0]; GPU wait before / after: "
        "250 / 320 ms"
    ) in md
    assert (
        "\n\n- before training, the passes after the first: the daemon copied 23.61 GB/s, its "
        "copy thread throttled by the link cap 81.2 % of the time, the copy engine busy 95.3 %\n"
    ) in md


def test_the_weightstream_child_holds_itself_to_the_card():
    """FLUX.2 is built on the device before attach, so the child is not run under card.py: it
    gets the card and the link, and caps its allocator after attach."""
    args = SimpleNamespace(
        out="/o",
        bin="b",
        passes=3,
        vram_budget_gib=15.0,
        quantize="fp8",
        compute="fp8",
        sample_vram_budget_gib=20.0,
        sample_staging_gib=0.0,
        card_gib=24.0,
        link="25GB/s",
        daemon_log="warn",
    )
    cmd = sampling.child_cmd(args, "weightstream")
    assert cmd[1:] == [
        "-m",
        "tests.bench.sampling",
        "--child",
        "weightstream",
        "--out",
        "/o",
        "--bin",
        "b",
        "--passes",
        "3",
        "--daemon-log",
        "warn",
        "--vram-budget-gib",
        "15.0",
        "--quantize",
        "fp8",
        "--compute",
        "fp8",
        "--sample-vram-budget-gib",
        "20.0",
        "--card-gib",
        "24.0",
        "--link",
        "25GB/s",
    ]
    assert "--card-gib" not in sampling.child_cmd(args, "resident")


def test_a_child_that_gives_no_result_is_reported_with_its_error():
    """A child that dies before its RESULT line (the GPU machine without diffusers, say): the
    report names it, its exit status and the last lines of its stderr."""
    from tests.bench.benchlib.runner import result_of

    stderr = (
        "Traceback (most recent call last):\n  File x\n"
        "ModuleNotFoundError: No module named 'diffusers'\n"
    )
    results = {"resident": {**result_of("resident", "loading\n", stderr), "returncode": 1}}
    results["weightstream"] = {**result_of("weightstream", "RESULT {}\n", ""), "returncode": 0}
    md = sampling.markdown(
        {"command": "cmd", "commit": "abc", "device": "H100", "results": results, "ratios": {}}
    )
    assert (
        "- resident failed (exit status 1): `Traceback (most recent call last): / File x / "
        "ModuleNotFoundError: No module named 'diffusers'`"
    ) in md
    assert "weightstream failed" not in md
