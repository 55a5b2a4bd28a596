"""Units balanced for N workers (mergepipe.engine.job.balanced_target): whole files for one worker,
else about UNITS_PER_WORKER units each, never above DEFAULT_UNIT_BYTES. Sizes are checked against the
safetensors headers parsed independently (tests/planner/support.py)."""

from __future__ import annotations

import pytest

from mergepipe.engine.job import DEFAULT_UNIT_BYTES, UNITS_PER_WORKER, WHOLE_FILES, balanced_target, cut_units
from mergepipe.storage.checkpoint import open_checkpoint
from tests.planner.support import raw_layout


def test_one_worker_gets_whole_files():
    assert balanced_target(10**12, 1) == WHOLE_FILES


@pytest.mark.parametrize("workers", [2, 4, 16])
def test_a_large_model_gets_units_of_the_default_size(workers):
    assert balanced_target(140 * 10**9, workers) == DEFAULT_UNIT_BYTES


@pytest.mark.parametrize("workers", [2, 3, 5])
def test_a_small_model_is_cut_into_about_four_units_per_worker(tiny_family, workers):
    layout = raw_layout(tiny_family["base"])
    total = sum(t.nbytes for t in layout.values())
    largest = max(t.nbytes for t in layout.values())
    target = balanced_target(total, workers)
    assert target == -(-total // (UNITS_PER_WORKER * workers))
    units = cut_units(open_checkpoint(tiny_family["base"]), target)
    assert sum(u.nbytes for u in units) == total
    # a unit closes once it reaches the target, so it is at most one tensor past it; the count follows
    assert all(u.nbytes < target + largest for u in units)
    assert len(units) <= UNITS_PER_WORKER * workers + 1
    assert len(units) >= total // (target + largest)
