"""tests/bench/flux_train.py's coded modes on the CPU: each is its mode held coded
(``coding="rans8"`` whatever ``--coding`` says), not among the default modes, and its
deterministic losses are checked against the same mode uncoded (the coding is lossless): equal
passes, another loss fails the run; the W8A8 check against the layers in place is the uncoded
mode's only."""

from __future__ import annotations

import functools

from tests.bench.benchlib import runner


def test_a_coded_mode_is_its_mode_held_coded():
    for mode in ("weightstream", "weightstream-w8a8-fp8", "weightstream-w8a8-int8"):
        coded = runner.MODES[mode + runner.CODED]
        assert isinstance(coded, functools.partial), mode
        assert coded.func is runner.MODES["weightstream"]
        plain = runner.MODES[mode]
        plain_kwargs = plain.keywords if isinstance(plain, functools.partial) else {}
        assert coded.keywords == {**plain_kwargs, "coding": "rans8"}, mode


def results(coded_losses):
    return {
        "modes": [
            {"mode": "resident-w8a8-fp8", "det_losses": [1.0, 0.5]},
            {"mode": "weightstream-w8a8-fp8", "det_losses": [1.0, 0.5]},
            {"mode": "weightstream-w8a8-fp8-rans8", "det_losses": coded_losses},
        ]
    }


def test_a_coded_mode_must_lose_what_its_mode_uncoded_loses():
    same = results([1.0, 0.5])
    assert runner.check_equality(same)
    coded = same["modes"][2]
    assert coded["losses_equal_uncoded"] is True
    assert "losses_equal_resident" not in coded
    assert same["modes"][1]["losses_equal_resident"] is True

    other = results([1.0, 0.25])
    assert not runner.check_equality(other)
    assert other["modes"][2]["losses_equal_uncoded"] is False
