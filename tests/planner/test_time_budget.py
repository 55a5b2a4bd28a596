"""Time budgets and predicted seconds in the planner (planner/planner.py).

A freshly analysed catalog predicts from the prior alone; one with merges from its history. Expected values
come from independent numbers: byte counts from the checkpoints' headers (tests/planner/support.py), the read
rate from the catalog's rows by SQL, and histories timed on known coefficients.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mergepipe.catalog import Catalog
from mergepipe.catalog.snapshots import host_key
from mergepipe.errors import BudgetError, ConfigError
from mergepipe.spec.request import parse_budget
from mergepipe.planner.planner import Planner
from mergepipe.spec.plan import Plan
from mergepipe.catalog.records import Timing
from mergepipe.planner.planner import PRIOR_FIXED_SECONDS, PRIOR_SPREAD
from mergepipe.spec.request import MergeRequest
from tests.planner.support import block_ranges, build_catalog, changed_blocks, clone_catalog, raw_layout

BLOCK = 2048
EXPERTS = ("e1", "e2", "e3")
KERNEL = 2e-9  # seconds per element and expert of the task-arithmetic kernel, as a probe would record it
#: A machine where a merge costs 0.2 s, 1 µs per expert byte and 0.3 µs per output byte (a tiny model's merges
#: then spend about as long on each term).
TRUE = np.array([0.2, 1e-6, 0.3e-6])


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("seconds") / "t.db", BLOCK, tiny_family, base="base",
                         experts=EXPERTS)


@pytest.fixture
def catalog(template, tmp_path):
    with Catalog.open(clone_catalog(template, tmp_path / "c.db")) as cat:
        yield cat


def output_bytes(family) -> int:
    return sum(t.nbytes for t in raw_layout(family["base"]).values())


def element_bytes(family) -> float:
    tensors = [t for t in raw_layout(family["base"]).values() if t.dtype in ("F32", "F16", "BF16")]
    return sum(t.nbytes for t in tensors) / sum(math.prod(t.shape) for t in tensors)


def full_expert_bytes(family, experts=EXPERTS) -> int:
    layout = raw_layout(family["base"])
    total = 0
    for e in experts:
        for name, blocks in changed_blocks(family["base"], family[e], BLOCK).items():
            ranges = block_ranges(layout[name], BLOCK)
            total += sum(ranges[i][1] - ranges[i][0] for i in blocks)
    return total


def prior_coefficients(catalog: Catalog, family, kernel: float = 0.0) -> tuple[float, float, float]:
    """(a, b, c) of the prior: the read rate from analysis's rows, and ``kernel`` (a probe's seconds per element
    and expert) per expert byte."""
    (read_bytes, seconds), = catalog._db.query("SELECT SUM(bytes_read), SUM(seconds) FROM analyze_reads")
    per_byte = seconds / read_bytes
    return PRIOR_FIXED_SECONDS, per_byte + kernel / element_bytes(family), per_byte


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


def test_analysis_recorded_this_host_s_read_rate(catalog):
    rows = catalog._db.query("SELECT host, bytes_read, seconds FROM analyze_reads")
    assert rows and all(host == host_key() and n > 0 and s > 0 for host, n, s in rows)


def test_a_time_budget_on_a_freshly_analysed_catalog_is_the_prior_s_and_says_how_uncertain(catalog, tiny_family):
    catalog.timings.add_kernels(host_key(), "cpu", {"task_arithmetic": KERNEL})
    a, b, c = prior_coefficients(catalog, tiny_family, KERNEL)
    out, full = output_bytes(tiny_family), full_expert_bytes(tiny_family)
    seconds = a + c * out + b * full / 2
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=list(EXPERTS), operator="task_arithmetic", budget=f"{seconds!r}s"))
    assert abs(plan.budget_bytes - math.floor((seconds - a - c * out) / b)) <= 1  # about half the changed bytes
    assert 0 < plan.cost.expert_bytes <= plan.budget_bytes < full
    predicted = plan.seconds
    assert predicted is not None and predicted.merges == 0 and predicted.uncertainty == PRIOR_SPREAD
    assert predicted.seconds <= seconds + 1e-9
    assert predicted.seconds == pytest.approx(a + b * plan.cost.expert_bytes + c * out)
    assert predicted.machine == f"{host_key()}/cpu"


def test_the_tighter_of_a_time_and_a_byte_budget_wins(catalog, tiny_family):
    a, b, c = prior_coefficients(catalog, tiny_family)  # no kernel probed: the reads alone price an expert byte
    out, full = output_bytes(tiny_family), full_expert_bytes(tiny_family)
    seconds = a + c * out + b * full / 3
    by_time = math.floor((seconds - a - c * out) / b)
    planner = Planner(catalog)
    assert planner.plan(MergeRequest(base="base", experts=list(EXPERTS), operator="task_arithmetic", budget=f"{seconds!r}s,100B")).budget_bytes == 100
    assert abs(planner.plan(MergeRequest(base="base", experts=list(EXPERTS), operator="task_arithmetic", budget=f"{seconds!r}s,90%")).budget_bytes - by_time) <= 1
    assert planner.plan(MergeRequest(base="base", experts=list(EXPERTS), operator="task_arithmetic", budget="1h,10%")).budget_bytes == int(0.1 * full)


def test_a_time_budget_that_cannot_be_met_says_how_long_reading_nothing_takes(catalog, tiny_family):
    a, _, c = prior_coefficients(catalog, tiny_family)
    with pytest.raises(BudgetError, match=rf"predicted to take {a + c * output_bytes(tiny_family):.1f} s ± 50%"):
        Planner(catalog).plan(MergeRequest(base="base", experts=list(EXPERTS), operator="task_arithmetic", budget="0.01s"))


def test_after_merges_the_history_predicts_and_converts_time_budgets(catalog, tiny_family):
    """Forty merges timed on known coefficients: the plan's prediction and a time budget's bytes follow them."""
    out, full = output_bytes(tiny_family), full_expert_bytes(tiny_family)
    rng = np.random.default_rng(0)
    for i in range(40):
        experts = int(full * rng.uniform(0.05, 1.0))
        timing = Timing(experts, out, float(TRUE @ [1, experts, out]))
        catalog.timings.add_merge(f"i{i}", host_key(), "cpu", "ties", timing)
    planner = Planner(catalog)
    plan = planner.plan(MergeRequest(base="base", experts=list(EXPERTS), operator="ties", params={"density": 0.5}, budget="60%"))
    assert plan.seconds.merges == 40 and plan.seconds.uncertainty < PRIOR_SPREAD / 2
    assert plan.seconds.seconds == pytest.approx(TRUE @ [1, plan.cost.expert_bytes, out], rel=0.02)
    seconds = float(TRUE @ [1, full / 2, out])
    timed = planner.plan(MergeRequest(base="base", experts=list(EXPERTS), operator="ties", params={"density": 0.5}, budget=f"{seconds!r}s"))
    assert timed.budget_bytes == pytest.approx(full / 2, rel=0.05)
    other = planner.plan(MergeRequest(base="base", experts=list(EXPERTS), operator="task_arithmetic"))  # another operator: its own (empty) history
    assert other.seconds.merges == 0
    gpu = Planner(catalog, device="cuda").plan(MergeRequest(base="base", experts=list(EXPERTS), operator="ties", params={"density": 0.5}))
    assert gpu.seconds.merges == 0 and gpu.seconds.machine == f"{host_key()}/cuda"  # another device's history


def test_a_device_that_is_not_one_is_refused(catalog):
    with pytest.raises(ConfigError, match="--device must be cpu or cuda, got 'gpu'"):
        Planner(catalog, device="gpu").plan(MergeRequest(base="base", experts=list(EXPERTS), operator="task_arithmetic"))


def test_predicted_seconds_leave_the_plan_digest_alone(catalog):
    planner = Planner(catalog)
    before = planner.plan(MergeRequest(base="base", experts=list(EXPERTS), operator="ties", params={"density": 0.5}, budget="30%"))
    catalog.timings.add_merge("i", host_key(), "cpu", "ties", Timing(10**6, 10**6, 9.0))
    after = planner.plan(MergeRequest(base="base", experts=list(EXPERTS), operator="ties", params={"density": 0.5}, budget="30%"))
    assert after.seconds.seconds != before.seconds.seconds
    assert after.digest == before.digest
    assert Plan.from_json(after.to_json()).seconds == after.seconds  # carried, not hashed
