"""The byte ranges a plan reads (planner/reads.py), against the blocks' ranges from the raw safetensors
headers and the ARCHITECTURE block contract (tests/planner/support.py), not MergePipe's catalog."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mergepipe.catalog import Catalog
from mergepipe.planner.planner import Planner
from mergepipe.planner.reads import coalesce, expert_ranges, read_order, startup_read_ahead
from mergepipe.spec.reuse import PlanReuse
from mergepipe.spec.seconds import READ_AHEAD_BYTES, Rates
from tests.planner.support import block_ranges, build_catalog, raw_layout

BLOCK_BYTES = 4096


def _merged(ranges):
    """Adjacent ranges of one file joined, in the order given (an independent coalesce)."""
    out = []
    for path, begin, end in ranges:
        if out and out[-1][0] == path and out[-1][2] == begin:
            out[-1] = (path, out[-1][1], end)
        else:
            out.append((path, begin, end))
    return out


def test_coalesce_merges_adjacent_and_overlapping_ranges_of_one_file():
    a, b = Path("a"), Path("b")
    ranges = [(a, 10, 20), (b, 0, 5), (a, 0, 10), (a, 15, 30), (a, 40, 50), (b, 5, 6)]
    assert coalesce(ranges) == [(a, 0, 30), (a, 40, 50), (b, 0, 6)]


@pytest.fixture(scope="module")
def planned(tiny_family, tmp_path_factory):
    db = build_catalog(tmp_path_factory.mktemp("reads") / "c.db", BLOCK_BYTES, dict(tiny_family), base="base",
                       experts=["e1", "e2"])
    catalog = Catalog.open(db)
    plan = Planner(catalog).plan("base", ["e2", "e1"], "ties", params={"density": 0.5}, budget="40%")
    yield catalog, plan
    catalog.close()


def _expected(family, plan, reused=None):
    """(tensor -> the base's block ranges, tensor -> expert -> its planned block ranges), blocks in
    ``reused`` left out; tensors in the base's file order."""
    reused = reused or {}
    base = sorted(raw_layout(family["base"]).values(), key=lambda t: t.begin)
    base_blocks, expert_blocks = {}, {}
    for t in base:
        keep = [i for i in range(len(block_ranges(t, BLOCK_BYTES))) if i not in reused.get(t.name, ())]
        base_blocks[t.name] = _merged([(t.file, *block_ranges(t, BLOCK_BYTES)[i]) for i in keep])
        expert_blocks[t.name] = {}
        for expert in plan.merge.expert_ids:
            raw = raw_layout(family[expert])[t.name]
            indices = [i for i in plan.reads_of(t.name, expert) if i not in reused.get(t.name, ())]
            if indices:
                expert_blocks[t.name][expert] = _merged([(raw.file, *block_ranges(raw, BLOCK_BYTES)[i])
                                                         for i in sorted(indices)])
    return base_blocks, expert_blocks


def test_the_expert_ranges_are_the_planned_blocks(planned, tiny_family):
    catalog, plan = planned
    assert 0 < plan.cost.expert_bytes < plan.cost.full_expert_bytes
    _, experts = _expected(tiny_family, plan)
    expected = sorted(r for per in experts.values() for ranges in per.values() for r in ranges)
    assert expert_ranges(catalog, plan) == _merged(expected)
    assert sum(e - b for _, b, e in expected) == plan.cost.expert_bytes


def test_the_read_order_is_tensor_by_tensor_base_first(planned, tiny_family):
    catalog, plan = planned
    base, experts = _expected(tiny_family, plan)
    expected = []
    for tensor, ranges in base.items():
        expected += ranges
        for expert in plan.merge.expert_ids:  # the plan's order: experts sorted by id
            expected += experts[tensor].get(expert, [])
    assert read_order(catalog, plan) == expected
    base_file = tiny_family["base"] / "model.safetensors"
    assert sum(e - b for p, b, e in read_order(catalog, plan) if p == base_file) == \
        sum(t.nbytes for t in raw_layout(tiny_family["base"]).values())


def test_the_read_order_stops_after_the_tensor_that_reaches_the_limit(planned, tiny_family):
    catalog, plan = planned
    base, experts = _expected(tiny_family, plan)
    per_tensor = [ranges + [r for e in plan.merge.expert_ids for r in experts[t].get(e, [])]
                  for t, ranges in base.items()]
    sizes = [sum(e - b for _, b, e in ranges) for ranges in per_tensor]
    limit = sum(sizes[:3]) - 1  # reached inside the third tensor: the third is the last listed
    assert read_order(catalog, plan, limit) == [r for ranges in per_tensor[:3] for r in ranges]
    assert read_order(catalog, plan, sum(sizes[:3])) == [r for ranges in per_tensor[:3] for r in ranges]
    assert read_order(catalog, plan, 1) == per_tensor[0]


def test_blocks_reused_from_a_previous_snapshot_are_not_read(planned, tiny_family):
    catalog, plan = planned
    tensor = next(t for t, per in plan.reads.items() if any(per.values()))
    expert = next(e for e, indices in plan.reads[tensor].items() if indices)
    first = plan.reads[tensor][expert][0]
    reused = {tensor: (first,)}
    plan = replace(plan, reuse=PlanReuse(snapshot="m", manifest_hash="0" * 64, blocks=reused, output_bytes=1))
    base, experts = _expected(tiny_family, plan, reused)
    assert read_order(catalog, plan) == [r for t in base for r in base[t] + [x for e in plan.merge.expert_ids
                                                                           for x in experts[t].get(e, [])]]
    assert all(not (p.parent == tiny_family[expert] and b <= r[0] < e)
               for p, b, e in expert_ranges(catalog, plan)
               for r in [block_ranges(raw_layout(tiny_family[expert])[tensor], BLOCK_BYTES)[first]])


def test_the_start_up_read_ahead_is_what_the_disk_reads_while_torch_loads():
    rates = Rates(startup_seconds=1.5, exit_share=0.1, publish_seconds=0.05, sequential_read=2e9, random_read=1e9,
                  write=1e9, flush=2e9, overlap=1.3)
    slower = replace(rates, sequential_read=1e9)
    assert startup_read_ahead(slower) == 1_500_000_000  # no served start-up measured: the whole 1.5 s
    assert startup_read_ahead(replace(slower, served_startup_seconds=0.25)) == 1_250_000_000  # 1.25 s of loading
    assert startup_read_ahead(replace(slower, served_startup_seconds=2.0)) == 0
    assert startup_read_ahead(rates) == READ_AHEAD_BYTES == 2 * 1024**3  # 3e9 in 1.5 s: capped
    assert startup_read_ahead(None) == READ_AHEAD_BYTES
