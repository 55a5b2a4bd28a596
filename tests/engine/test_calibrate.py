"""Calibration's choice between two timings of an operator, and the seek it derives from two read rates."""

from __future__ import annotations

import pytest

from mergepipe.engine.calibrate import STEPS, faster, seek_seconds
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


def test_a_seek_is_a_scattered_blocks_time_less_its_bytes_at_the_sequential_rate():
    # a 1 MiB block: 1048576 / 500e6 = 2.097152 ms scattered, 1048576 / 2e9 = 0.524288 ms in order
    assert seek_seconds(1024 * 1024, 2e9, 500e6) == pytest.approx(2.097152e-3 - 0.524288e-3)
    assert seek_seconds(1024 * 1024, 2e9, 2.5e9) == 0.0  # scattered blocks read faster: no seek, never below
