"""tests/bench/timeline_gaps.py on a written timeline: the link's busy time is each dispatched
copy's bytes over the rate, and each idle gap goes to the copy after it, ``pending`` when it was
submitted before the link fell idle, ``late`` when only after."""

from __future__ import annotations

from tests.bench import timeline_gaps

T = "2026-12-06T10:00:00.{:06d}Z DEBUG weightstream::timeline: "


def line(us: int, text: str) -> str:
    return T.format(us) + text


def test_gaps_are_split_by_when_the_next_copy_was_submitted():
    lines = [
        line(0, "copy submitted session=1 group=0 offset=0 priority=Prefetch evicted=[]"),
        line(0, "copy submitted session=1 group=1 offset=0 priority=Prefetch evicted=[]"),
        line(10, 'copy dispatched session=1 group=0 priority=Prefetch what="copy" bytes=1000000'),
        # the link is busy until 10 + 1000 us (1 MB at 1 GB/s); group 1 was asked for at 0
        line(3010, 'copy dispatched session=1 group=1 priority=Prefetch what="copy" bytes=500000'),
        # busy until 3510; group 2 asked for only at 5000
        line(5000, "copy submitted session=1 group=2 offset=0 priority=Prefetch evicted=[]"),
        line(5010, 'copy dispatched session=1 group=2 priority=Prefetch what="copy" bytes=1000'),
        "2026-12-06T10:00:00.005020Z  INFO weightstream_daemon: not a timeline line",
    ]
    got = timeline_gaps.gaps(timeline_gaps.events(lines), rate=1e9)
    assert got["gaps"] == {"pending": 1, "late": 1}
    assert abs(got["idle_s"]["pending"] - 0.002) < 1e-6
    assert abs(got["idle_s"]["late"] - 0.0015) < 1e-6
    assert abs(got["busy_s"] - 0.001501) < 1e-12
    assert abs(got["span_s"] - 0.005001) < 1e-6
    assert [g["group"] for g in got["longest"]] == ["1", "2"]


def test_the_rate_is_read_in_gb_and_mb_per_second():
    assert timeline_gaps.parse_rate("25GB/s") == 25e9
    assert timeline_gaps.parse_rate("800MB/s") == 800e6
