"""The I/O floor beside every suite row (benchmarks/floor.py): the plan's expert ranges are the bytes the
engine reads, and each part of the floor moves the bytes it says."""

from __future__ import annotations

import pytest

from benchmarks import floor
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.planner.planner import Planner
from tests.planner.support import build_catalog, raw_layout

BLOCK_BYTES = 4096


@pytest.fixture(scope="module")
def executed(tiny_family, tmp_path_factory):
    root = tmp_path_factory.mktemp("floor")
    db = build_catalog(root / "c.db", BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2"])
    with Catalog.open(db) as catalog:
        plan = Planner(catalog).plan("base", ["e1", "e2"], "ties", params={"density": 0.5}, budget="40%")
        _, manifest = Engine(catalog).execute(plan, out=root / "out", model_id="m")
    return db, plan, manifest


def test_the_plan_ranges_are_the_expert_bytes_the_engine_read(executed, tiny_family):
    db, plan, manifest = executed
    ranges = floor.plan_ranges(db, plan.digest)
    assert sum(end - begin for _, begin, end in ranges) == manifest.cost.realized.expert_bytes > 0
    experts = {tiny_family["e1"] / "model.safetensors", tiny_family["e2"] / "model.safetensors"}
    assert {path for path, _, _ in ranges} <= experts
    for path, begin, end in ranges:  # inside the data of one file's tensors (from the raw header)
        spans = [(t.begin, t.end) for t in raw_layout(path.parent).values()]
        assert min(s for s, _ in spans) <= begin < end <= max(e for _, e in spans)


def test_measure_reads_and_writes_what_it_reports(executed, tiny_family, tmp_path):
    db, plan, manifest = executed
    experts = [tiny_family["e1"], tiny_family["e2"]]
    ranged = floor.measure(tiny_family["base"], experts, floor.plan_ranges(db, plan.digest), 12345, tmp_path)
    assert ranged.expert_bytes == manifest.cost.realized.expert_bytes
    assert ranged.output_bytes == 12345 and not list(tmp_path.iterdir())  # the written file is removed
    whole = floor.measure(tiny_family["base"], experts, None, 1, tmp_path)
    assert whole.expert_bytes == sum((e / "model.safetensors").stat().st_size for e in experts)
    for f in (ranged, whole):
        assert f.seconds == f.base_seconds + f.expert_seconds + f.write_seconds > 0
