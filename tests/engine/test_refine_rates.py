"""After a merge: the manifest records estimated beside realized seconds, and the machine's rates move
toward what the merge measured (engine/record.py, spec/seconds.py) — without touching any identity."""

from __future__ import annotations

import json

import pytest

from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.machine import machine_key
from mergepipe.manifest.manifest import Manifest
from mergepipe.planner.planner import Planner
from mergepipe.spec import refinement as refinement_module
from mergepipe.spec.seconds import Rates
from tests.planner.support import build_catalog, clone_catalog, raw_layout

BLOCK = 2048
EXPERTS = ["e1", "e2"]
RATES = Rates(startup_seconds=0.001, exit_share=0.3, publish_seconds=0.05, sequential_read=50e6, random_read=20e6,
              write=30e6, flush=100e6, overlap=1.5, compute={"ties": (20e6, 10e6), "task_arithmetic": (60e6, 40e6)})


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("refine") / "t.db", BLOCK, tiny_family, base="base",
                         experts=EXPERTS)


def merge(db, out, model_id="m"):
    with Catalog.open(db) as catalog:
        plan = Planner(catalog).plan("base", EXPERTS, "ties", params={"density": 0.5}, budget="60%")
        _, manifest = Engine(catalog).execute(plan, out=out, model_id=model_id)
        return plan, manifest, {r.name: r for r in catalog.rates.records(machine_key())}


def test_a_merge_refines_the_rates_it_measured_by_the_documented_weight(template, tmp_path, tiny_family, monkeypatch):
    db = clone_catalog(template, tmp_path / "c.db")
    with Catalog.open(db) as catalog:
        catalog.rates.calibrated(machine_key(), RATES)
    monkeypatch.setattr(refinement_module, "OUTLIER_FACTOR", float("inf"))  # tiny merges are far from any real rate
    plan, manifest, records = merge(db, tmp_path / "out")
    realized = manifest.cost.realized.seconds
    output_bytes = sum(t.nbytes for t in raw_layout(tiny_family["base"]).values())
    measured_write = output_bytes / realized["write"]
    assert records["write"].value == pytest.approx(30e6 + (measured_write - 30e6) / 3)
    assert records["write"].samples == 1
    # compute: what it took beyond the operator's own cost, per byte read and written, moved a third of the way
    work = plan.seconds.work
    own = work.merged_bytes / 20e6 + work.expert_bytes / 10e6
    moved = work.base_bytes + work.expert_bytes + work.output_bytes
    assert records["steal"].value == pytest.approx(max(0.0, realized["compute"] - own) / moved / 3)
    assert records["steal"].samples == 1
    if realized["compute"] < own:  # faster than timed alone: calibrate's timing was slowed, both rates speed up
        factor = own / realized["compute"]
        assert records["compute_merged:ties"].value == pytest.approx(20e6 + (20e6 * factor - 20e6) / 3)
        assert records["compute_expert:ties"].value == pytest.approx(10e6 + (10e6 * factor - 10e6) / 3)
        assert records["compute_merged:ties"].samples == records["compute_expert:ties"].samples == 1
    else:  # the operator's own rates stay calibrate's
        assert records["compute_merged:ties"].samples == records["compute_expert:ties"].samples == 0
    assert records["compute_merged:task_arithmetic"].samples == 0  # another operator: untouched
    assert records["random_read"].samples == 0  # reads are never timed alone


def test_an_implausible_start_up_is_not_learned(template, tmp_path):
    """The engine's start-up is the process's age: in a long-running process (this test run) it is no
    start-up, and the rule against outliers leaves the rate alone."""
    db = clone_catalog(template, tmp_path / "c.db")
    with Catalog.open(db) as catalog:
        catalog.rates.calibrated(machine_key(), RATES)
    _, manifest, records = merge(db, tmp_path / "out")
    assert manifest.cost.realized.seconds.get("startup", 1.0) > 0.01  # the process is older than 10 ms
    assert records["startup_seconds"].value == 0.001 and records["startup_seconds"].samples == 0


def test_the_manifest_records_estimated_seconds_outside_its_hash(template, tmp_path):
    calibrated, plain = clone_catalog(template, tmp_path / "a.db"), clone_catalog(template, tmp_path / "b.db")
    with Catalog.open(calibrated) as catalog:
        catalog.rates.calibrated(machine_key(), RATES)
    plan, with_seconds, _ = merge(calibrated, tmp_path / "a")
    plan_plain, without, records = merge(plain, tmp_path / "b")
    assert records == {}  # an uncalibrated machine stays uncalibrated
    assert plan.digest == plan_plain.digest
    assert with_seconds.cost.estimated.seconds == plan.seconds.seconds
    assert with_seconds.cost.estimated.seconds["total"] > 0
    assert without.cost.estimated.seconds is None
    assert (with_seconds.snapshot_id, with_seconds.manifest_hash) == (without.snapshot_id, without.manifest_hash)
    on_disk = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert on_disk["cost"]["estimated"]["seconds"] == pytest.approx(plan.seconds.seconds)
    assert "seconds" not in json.loads((tmp_path / "b" / "manifest.json").read_text())["cost"]["estimated"]
    assert Manifest.load(tmp_path / "a").manifest_hash == with_seconds.manifest_hash
