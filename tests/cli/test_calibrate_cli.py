"""`mergepipe calibrate`, and predicted seconds in `plan`, `merge` and `explain`, through the CLI.

Calibration is shrunk here (smaller files, shorter timings: module constants
of engine/calibrate*.py) so a test takes seconds; what it measures and
stores is the same. Failures run through ``mergepipe.cli.main``: one
``error:`` line, a non-zero exit, no traceback.
"""

from __future__ import annotations

import json

import pytest
import torch

from mergepipe.catalog import Catalog
from mergepipe.cli import calibrate_probe
from mergepipe.engine import calibrate as calibrate_module
from mergepipe.engine import calibrate_io
from mergepipe.machine import machine_key
from mergepipe.spec.operators import OPERATORS
from mergepipe.spec.seconds import SCALAR_RATES
from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.planner.support import build_catalog, clone_catalog

BLOCK_BYTES = 2048
EXPERTS = ["e1", "e2"]


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("calcli") / "t.db", BLOCK_BYTES, dict(tiny_family), base="base",
                         experts=EXPERTS)


@pytest.fixture
def quick(monkeypatch):
    """Calibration in well under a second per step."""
    monkeypatch.setattr(calibrate_io, "MIN_FILE_BYTES", 256 * 1024)
    monkeypatch.setattr(calibrate_io, "MAX_FILE_BYTES", 1024 * 1024)
    monkeypatch.setattr(calibrate_io, "STEP_SECONDS", 0.05)
    monkeypatch.setattr(calibrate_io, "STARTUP_RUNS", 1)
    monkeypatch.setattr(calibrate_module, "SECONDS_PER_OPERATOR", 0.01)
    monkeypatch.setattr(calibrate_module, "OVERLAP_PART_SECONDS", 0.05)
    monkeypatch.setattr(calibrate_probe, "ROWS", 64)  # a probe merge of 4 tensors of 64 x 1024 bf16
    monkeypatch.setattr(calibrate_probe, "PROBE_MODEL_BYTES", 4 * 64 * 1024 * 2)


@pytest.fixture
def no_probe(monkeypatch):
    """The start-up timed without starting Python again (the first test starts it for real)."""
    monkeypatch.setattr(calibrate_module, "measure_startup", lambda: (1.5, 0.2))
    monkeypatch.setattr(calibrate_module, "measure_served_startup", lambda: 0.3)


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


def plan_args(db, *extra):
    return ["plan", "--db", db, "--base", "base", "--experts", *EXPERTS, "--operator", "ties", "--density", "0.5",
            *extra]


def test_calibrate_keeps_the_rates_in_this_catalog_only(template, tmp_path, quick, runner):
    first, second = clone_catalog(template, tmp_path / "a.db"), clone_catalog(template, tmp_path / "b.db")
    out = invoke(runner, ["calibrate", "--db", first, "--dir", tmp_path, "--no-progress"])
    assert f"rates of {machine_key()}" in out and "start-up" in out and "compute ties" in out
    with Catalog.open(first) as catalog:
        rates = catalog.rates.get(machine_key())
        records = catalog.rates.records()
    assert rates is not None and set(rates.compute) == set(OPERATORS)
    assert {r.name for r in records} >= set(SCALAR_RATES) and all(r.samples == 0 for r in records)
    assert all(r.value > 0 for r in records if r.name != "steal")
    assert 0 <= rates.steal < 1e-6  # measured by the probe merge (seconds per byte)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".mergepipe-calibrate")] == []  # cleaned up
    with Catalog.open(second) as catalog:
        assert catalog.rates.get(machine_key()) is None and catalog.rates.records() == []
    assert "uncalibrated: run `mergepipe calibrate`" in invoke(runner, plan_args(second))
    planned = invoke(runner, plan_args(first))
    assert "start-up" in planned and "expert read" in planned and "total" in planned
    assert "uncalibrated" not in planned


def test_a_time_budget_on_the_command_line(template, tmp_path, quick, no_probe, runner, capsys):
    db = clone_catalog(template, tmp_path / "c.db")
    code, _, err = run_main(plan_args(db, "--budget", "20s"), capsys)
    assert code != 0 and err.startswith("error: ") and err.count("\n") == 1
    assert "mergepipe calibrate" in err and "Traceback" not in err
    invoke(runner, ["calibrate", "--db", db, "--dir", tmp_path, "--no-progress"])
    with Catalog.open(db) as catalog:
        rates = catalog.rates.get(machine_key())
    generous = rates.startup_seconds + 3600
    data = json.loads(invoke(runner, plan_args(db, "--budget", f"{generous}s,1000B", "--json")))
    assert data["budget"] == {"text": f"{generous}s,1000B", "bytes": 1000}
    assert data["seconds"]["phases"]["total"] <= generous


def test_calibrating_again_keeps_the_steal_merges_measured(template, tmp_path, quick, no_probe, runner,
                                                           monkeypatch):
    db = clone_catalog(template, tmp_path / "c.db")
    probed: list[float] = []

    def probe(*args) -> calibrate_probe.Probed:
        probed.append(0.2e-9 + len(probed) * 0.01e-9)
        return calibrate_probe.Probed(probed[-1], 1.375)

    monkeypatch.setattr(calibrate_probe, "measure", probe)
    out = invoke(runner, ["calibrate", "--db", db, "--dir", tmp_path, "--no-progress"])
    assert f"{0.2e-9 * 2**30:.2f} s per GiB moved" in out and "1.38 of 3" in out
    with Catalog.open(db) as catalog:
        assert catalog.rates.get(machine_key()).steal == 0.2e-9  # the probe's, until a merge refines it
        assert catalog.rates.get(machine_key()).overlap == 1.375  # the probe's, not the side-by-side step's
        catalog.rates.refined(machine_key(), {"steal": 0.3e-9, "write": 123e6})  # as merges would have
    out = invoke(runner, ["calibrate", "--db", db, "--dir", tmp_path, "--no-progress"])
    assert f"{0.3e-9 * 2**30:.2f} s per GiB moved" in out and len(probed) == 2
    with Catalog.open(db) as catalog:
        rates, records = catalog.rates.get(machine_key()), catalog.rates.records(machine_key())
    assert rates.steal == 0.3e-9  # what this machine's merges taught stays, with its samples
    assert [r.samples for r in records if r.name == "steal"] == [1]
    assert rates.write != 123e6  # what calibrate measures is measured again


def test_the_probe_merge_measures_steal_and_overlap_as_merges_do(template, tmp_path, quick, no_probe, monkeypatch):
    """The probe's steal and overlap are ``observe``'s on its own merges, as of served ones (torch is loaded):
    what compute took beyond the operator's own cost, per byte moved, and the parts of the stream (the reads as
    predicted, compute and write as realized) over the worker's time where that is longer than each part —
    checked here against each merge's realized seconds and planned bytes —, the least of its ``TRIES`` merges
    each; nothing stays."""
    seen = []
    real_observe = calibrate_probe.observe

    def spy(work, rates, realized, served=False):
        seen.append((work, dict(realized), served))
        return real_observe(work, rates, realized, served)

    monkeypatch.setattr(calibrate_probe, "observe", spy)
    rates = calibrate_module.calibrate(tmp_path, "cpu", BLOCK_BYTES)
    probed = calibrate_probe.measure(tmp_path, rates, "cpu", BLOCK_BYTES)
    assert len(seen) == calibrate_probe.TRIES == 2
    steals, overlaps = [], []
    for work, realized, served in seen:
        assert served and work.operator == "task_arithmetic" and work.expert_bytes == 2 * work.base_bytes
        own = work.merged_bytes / rates.compute["task_arithmetic"][0] + work.expert_bytes / rates.compute[
            "task_arithmetic"][1]
        moved = work.base_bytes + work.expert_bytes + work.output_bytes
        steals.append(max(0.0, realized["compute"] - own) / moved)
        parts = (work.base_bytes / rates.sequential_read + work.expert_bytes / rates.random_read,
                 realized["compute"], realized["write"])
        worker = realized["read_wait"] + realized["compute"] + realized.get("write_wait", realized["write"])
        if worker > max(parts):
            overlaps.append(min(3.0, max(1.0, sum(parts) / worker)))
    assert seen[0][0] == seen[1][0]  # the same merge twice, each in its own catalog (a second run would not merge)
    assert seen[0][1]["compute"] > 0 and seen[1][1]["compute"] > 0
    assert probed.steal == pytest.approx(min(steals), rel=1e-9)
    assert probed.overlap == (pytest.approx(min(overlaps), rel=1e-9) if overlaps else None)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".mergepipe-calibrate")] == []


@pytest.mark.parametrize("args, message", [
    (["plan", "--budget", "20s,30s"], "one of each"),
    (["plan", "--budget", "0s"], "more than 0 seconds"),
    (["calibrate", "--dir", "/nonexistent/place"], "is not a directory"),
])
def test_cli_errors_are_one_line(template, tmp_path, capsys, args, message):
    db = clone_catalog(template, tmp_path / "c.db")
    full = plan_args(db, *args[1:]) if args[0] == "plan" else [args[0], "--db", db, *args[1:]]
    code, _, err = run_main(full, capsys)
    assert code != 0 and err.startswith("error: ") and message in err and err.count("\n") == 1


def test_calibrate_needs_an_existing_catalog(tmp_path, capsys):
    code, _, err = run_main(["calibrate", "--db", tmp_path / "none.db"], capsys)
    assert code != 0 and "mergepipe init-db" in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there")
def test_calibrating_a_missing_gpu_is_refused(template, tmp_path, capsys):
    db = clone_catalog(template, tmp_path / "c.db")
    code, _, err = run_main(["calibrate", "--db", db, "--device", "cuda"], capsys)
    assert code != 0 and "no CUDA device" in err and err.count("\n") == 1


def test_merge_and_explain_show_predicted_beside_realized_seconds(template, tmp_path, quick, no_probe, runner):
    db = clone_catalog(template, tmp_path / "c.db")
    invoke(runner, ["calibrate", "--db", db, "--dir", tmp_path, "--no-progress"])
    summary = tmp_path / "summary.json"
    out = invoke(runner, ["merge", "--db", db, "--base", "base", "--experts", *EXPERTS, "--operator", "ties",
                          "--density", "0.5", "--budget", "50%", "--out", tmp_path / "m", "--model-id", "m",
                          "--json-summary", summary, "--no-progress"])
    assert "predicted seconds" in out
    data = json.loads(summary.read_text())
    assert set(data["predicted_seconds"]) == {"startup", "base_read", "expert_read", "compute", "write", "publish",
                                              "total"}
    explained = invoke(runner, ["explain", "--db", db, "m"])
    assert "predicted seconds" in explained and "realized seconds" in explained and "total" in explained
    as_json = json.loads(invoke(runner, ["explain", "--db", db, "m", "--json"]))
    assert as_json["predicted"] == pytest.approx(data["predicted_seconds"])


def test_a_probe_that_cannot_write_its_checkpoints_is_one_line(template, tmp_path, quick, no_probe, monkeypatch,
                                                               capsys):
    """A full disk under --dir stops calibrate with one line naming the directory; nothing is left there."""
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(calibrate_probe, "save_file", full)
    db = clone_catalog(template, tmp_path / "c.db")
    code, _, err = run_main(["calibrate", "--db", str(db), "--dir", str(tmp_path), "--no-progress"], capsys)
    assert code != 0 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert "No space left on device" in err and str(tmp_path) in err
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".mergepipe-calibrate")] == []
    with Catalog.open(db) as catalog:
        assert catalog.rates.get(machine_key()) is None  # nothing recorded
