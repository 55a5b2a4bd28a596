"""Calibration's choice between two timings of an operator."""

from __future__ import annotations

from mergepipe.engine.calibrate import STEPS, faster
from mergepipe.spec.operators import OPERATORS


def test_the_faster_timing_is_kept_whole():
    slowed, normal = (700e6, 2.1e9), (3.2e9, 7.0e9)
    assert faster(None, slowed) == slowed
    assert faster(slowed, normal) == normal and faster(normal, slowed) == normal
    # never one rate of each: (4e9, 1e9) merges a block with two experts' blocks in 2.25 ns per byte,
    # (1e9, 8e9) in 1.25 ns: the second is kept as it was measured, its slow merged rate with it
    assert faster((4e9, 1e9), (1e9, 8e9)) == (1e9, 8e9)


def test_the_second_sweep_is_a_step_of_its_own():
    operators = [f"compute {op}" for op in OPERATORS]
    first = STEPS.index(operators[0])
    assert list(STEPS[first:first + len(operators) + 1]) == [*operators, "compute again"]
