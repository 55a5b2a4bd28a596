"""Time budgets and predicted seconds in the planner (planner/seconds.py, planner/budget.py).

Rates are synthetic, stored in the catalog for this machine as `calibrate`
would; byte counts come from the checkpoints' headers, read by hand
(tests/planner/support.py), so the expected conversion is the documented
formula applied to independent numbers.
"""

from __future__ import annotations

import math

import pytest

from mergepipe.catalog import Catalog
from mergepipe.errors import BudgetError
from mergepipe.machine import machine_key
from mergepipe.planner.budget import parse_budget
from mergepipe.planner.planner import Planner
from mergepipe.planner.seconds import describe_rates
from mergepipe.spec.seconds import Rates
from tests.planner.support import block_ranges, build_catalog, changed_blocks, clone_catalog, raw_layout

BLOCK = 2048
EXPERTS = ("e1", "e2", "e3")
FAST = 1e15  # a rate whose phase takes no time worth counting


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("seconds") / "t.db", BLOCK, tiny_family, base="base",
                         experts=EXPERTS)


@pytest.fixture
def catalog(template, tmp_path):
    with Catalog.open(clone_catalog(template, tmp_path / "c.db")) as cat:
        yield cat


def base_bytes(family) -> int:
    return sum(t.nbytes for t in raw_layout(family["base"]).values())


def full_expert_bytes(family, experts=EXPERTS) -> int:
    layout = raw_layout(family["base"])
    total = 0
    for e in experts:
        for name, blocks in changed_blocks(family["base"], family[e], BLOCK).items():
            ranges = block_ranges(layout[name], BLOCK)
            total += sum(ranges[i][1] - ranges[i][0] for i in blocks)
    return total


def rates(**overrides) -> Rates:
    values = dict(startup_seconds=0.8, exit_share=0.25, publish_seconds=0.5, sequential_read=FAST, random_read=FAST,
                  write=FAST, flush=FAST, overlap=3.0,
                  compute={op: (FAST, FAST) for op in ("task_arithmetic", "ties", "slerp")})
    values.update(overrides)
    return Rates(**values)


@pytest.mark.parametrize("text, seconds, nbytes, fraction", [
    ("20s", 20.0, None, None),
    ("1.5min", 90.0, None, None),
    ("2 h", 7200.0, None, None),
    ("20s,8GiB", 20.0, 8 * 2**30, None),
    ("8GiB, 20s", 20.0, 8 * 2**30, None),
    ("20s,25%", 20.0, None, 0.25),
])
def test_time_budgets_parse(text, seconds, nbytes, fraction):
    budget = parse_budget(text)
    assert (budget.seconds, budget.bytes, budget.fraction) == (seconds, nbytes, fraction)
    assert not budget.unlimited


@pytest.mark.parametrize("text", ["0s", "20s,30s", "20s,none", "20s,8GiB,25%", "20s,", "-5s"])
def test_malformed_time_budgets_are_refused(text):
    with pytest.raises(BudgetError):
        parse_budget(text)


def test_a_time_budget_is_the_seconds_left_converted_at_the_expert_read_rate(catalog, tiny_family):
    base = base_bytes(tiny_family)
    full = full_expert_bytes(tiny_family)
    # reading the base takes 1 s, an expert byte 1/full s; all else is next to free and fully overlapped,
    # so the reads decide: (S - start-up and exit - publish - output/flush - base/sequential) * random,
    # where the first 0.8 s of reads (the start-up: loading torch, no served start-up measured) are free
    catalog.rates.calibrated(machine_key(), rates(sequential_read=float(base), random_read=float(full)))
    seconds = 2.25
    plan = Planner(catalog).plan("base", list(EXPERTS), "task_arithmetic", budget=f"{seconds}s")
    expected = math.floor((seconds - (0.8 * (1 + 0.25) + 0.5) - base / FAST - (base / base - 0.8)) * full)
    assert plan.budget_bytes == expected  # about half of the changed bytes
    assert 0 < plan.cost.expert_bytes <= expected < full
    assert plan.budget_text == "2.25s"
    assert plan.seconds is not None and plan.seconds.seconds["total"] <= seconds


def test_the_tighter_of_a_time_and_a_byte_budget_wins(catalog, tiny_family):
    base, full = base_bytes(tiny_family), full_expert_bytes(tiny_family)
    catalog.rates.calibrated(machine_key(), rates(sequential_read=float(base), random_read=float(full)))
    by_time = math.floor((2.25 - (0.8 * (1 + 0.25) + 0.5) - base / FAST - (1.0 - 0.8)) * full)
    planner = Planner(catalog)
    assert planner.plan("base", list(EXPERTS), "task_arithmetic", budget="2.25s,100B").budget_bytes == 100
    assert planner.plan("base", list(EXPERTS), "task_arithmetic", budget="2.25s,90%").budget_bytes == by_time
    assert planner.plan("base", list(EXPERTS), "task_arithmetic", budget="1h,10%").budget_bytes == int(0.1 * full)


@pytest.mark.parametrize("operator, params", [
    ("task_arithmetic", {}), ("ties", {"density": 0.5}), ("slerp", {"t": 0.5}),
])
def test_a_plan_under_a_time_budget_is_predicted_within_it(catalog, tiny_family, operator, params):
    """Rates where every phase counts: the plan's own prediction stays within the time given."""
    base, full = base_bytes(tiny_family), full_expert_bytes(tiny_family)
    experts = ["e1"] if operator == "slerp" else list(EXPERTS)
    slow = rates(sequential_read=base / 0.8, random_read=full / 2.0, write=base / 0.6, flush=base / 0.3,
                 overlap=1.5, compute={operator: (base / 0.9, full / 1.7)})
    catalog.rates.calibrated(machine_key(), slow)
    planner = Planner(catalog)
    everything = planner.plan("base", experts, operator, params=params).seconds.seconds["total"]
    nothing = planner.plan("base", experts, operator, params=params, budget=0).seconds.seconds["total"]
    for seconds in (nothing + 0.25 * (everything - nothing), nothing + 0.6 * (everything - nothing)):
        plan = planner.plan("base", experts, operator, params=params, budget=f"{seconds:.3f}s")
        assert plan.seconds.seconds["total"] <= seconds
        assert plan.budget_bytes < plan.cost.full_expert_bytes


def test_a_time_budget_needs_calibration(catalog):
    with pytest.raises(BudgetError, match="mergepipe calibrate"):
        Planner(catalog).plan("base", list(EXPERTS), "task_arithmetic", budget="20s")


def test_a_time_budget_that_cannot_be_met_says_how_long_reading_nothing_takes(catalog):
    catalog.rates.calibrated(machine_key(), rates(startup_seconds=30.0))
    with pytest.raises(BudgetError, match=r"predicted to take 38\.0 s"):  # 30 to start, a quarter more to exit, 0.5
        Planner(catalog).plan("base", list(EXPERTS), "task_arithmetic", budget="20s")


def test_predicted_seconds_leave_the_plan_digest_alone(catalog, template, tmp_path, tiny_family):
    uncalibrated = Planner(catalog).plan("base", list(EXPERTS), "ties", params={"density": 0.5}, budget="30%")
    assert uncalibrated.seconds is None
    catalog.rates.calibrated(machine_key(), rates(sequential_read=base_bytes(tiny_family) / 2.0))
    calibrated = Planner(catalog).plan("base", list(EXPERTS), "ties", params={"density": 0.5}, budget="30%")
    assert calibrated.digest == uncalibrated.digest
    work = calibrated.seconds.work
    assert (work.base_bytes, work.output_bytes) == (base_bytes(tiny_family), base_bytes(tiny_family))
    assert work.expert_bytes == calibrated.cost.expert_bytes
    layout = raw_layout(tiny_family["base"])
    merged = sum(block_ranges(layout[t], BLOCK)[i][1] - block_ranges(layout[t], BLOCK)[i][0]
                 for t, per in calibrated.reads.items() for i in set().union(*map(set, per.values())))
    assert work.merged_bytes == merged  # every block read from any expert, merged once
    # 2 s of reading the base, less the 0.8 s read while torch loads (the experts' reads take next to nothing)
    assert calibrated.seconds.seconds["base_read"] == pytest.approx(2.0 - 0.8)
    assert calibrated.seconds.machine == machine_key()


def test_rates_for_people_say_when_steal_is_not_measured():
    """A steal of 0 (rates calibrated before calibrate's probe merge measured it) is said to be unmeasured,
    not printed as a measured 0; a measured one in seconds per GiB."""
    unmeasured = Rates(1.6, 0.25, 0.5, 100e6, 50e6, 200e6, 400e6, 2.0, {"ties": (80e6, 40e6)})
    measured = Rates(1.6, 0.25, 0.5, 100e6, 50e6, 200e6, 400e6, 2.0, {"ties": (80e6, 40e6)}, steal=0.25 / 2**30)
    assert dict(describe_rates(unmeasured))["compute lost to reads and writes"].startswith("not measured yet")
    assert dict(describe_rates(measured))["compute lost to reads and writes"] == "0.25 s per GiB moved"
