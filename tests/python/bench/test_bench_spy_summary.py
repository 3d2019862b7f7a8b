"""tests/bench/spy_summary.py on a made-up py-spy raw profile: samples count per process, only
under the step loop or autograd's threads, without a waiting thread's, with each function once
per stack however often it recurs, and the shares of stacks naming a frame."""

from __future__ import annotations

from tests.bench import spy_summary

P1 = 'process 7:"python3 a.py"'
P2 = 'process 9:"python3 b.py"'
PROFILE = f"""\
{P1};<module> (a.py:1);timing (a.py:5);op (x.py:3);op (x.py:3);mm (libtorch.so) 6
{P1};<module> (a.py:1);timing (a.py:5);op (x.py:4);regex::compile (libtorch.so) 3
{P1};<module> (a.py:1);build (a.py:9);op (x.py:3) 50
{P1};torch::autograd::Engine::thread_main (libtorch_cpu.so);op (x.py:3) 1
{P1};torch::autograd::Engine::thread_main (libtorch_cpu.so);pthread_cond_wait (libc.so.6) 40
{P2};<module> (b.py:1);timing (b.py:2);op (x.py:3) 2
not a sample line
"""


def test_samples_are_counted_per_process_under_the_step_and_its_threads():
    out = spy_summary.summarize(
        PROFILE.splitlines(True), spy_summary.UNDER, ["regex", "mm ("], top=3
    )
    assert out == {
        P1: {
            "samples": 10,
            "matched_share": {"regex": 0.3, "mm (": 0.6},
            "inclusive_share": {"op": 1.0, "<module>": 0.9, "timing": 0.9},
        },
        P2: {
            "samples": 2,
            "matched_share": {},
            "inclusive_share": {"<module>": 1.0, "timing": 1.0, "op": 1.0},
        },
    }


def test_idle_samples_are_kept_on_request():
    out = spy_summary.summarize(
        PROFILE.splitlines(True), spy_summary.UNDER[1:], [], 1, keep_idle=True
    )
    assert {p: s["samples"] for p, s in out.items()} == {P1: 41}
