"""What may happen while a merge is in progress (its intent is pending).

Another process shares the catalog; each test pauses a merge right after its
intent is recorded (the ``staged`` step) and acts from a second connection:
re-registering an input with ``--force`` is refused (the merge's lineage
would be false), and a second run of the same plan is refused before it does
any work (it would publish the same snapshot twice).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.errors import CatalogError, MergePipeError, PublishError
from mergepipe.planner.planner import Planner
from mergepipe.spec.plan import Plan
from mergepipe.txn.verify import verify_snapshot
from mergepipe.spec.request import MergeRequest
from tests.planner.support import build_catalog, clone_catalog

BLOCK_BYTES = 4096


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("in-progress") / "template.db"
    return build_catalog(path, BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2"])


def merge_pausing_at_staged(db: Path, plan: Plan, out: Path, action) -> tuple[str, object]:
    """Execute ``plan``; when its intent is recorded, run ``action()`` and keep its outcome."""
    outcome = {}

    def on_step(step: str) -> None:
        if step == "staged":
            try:
                outcome["result"] = action()
            except MergePipeError as exc:  # anything else is a bug: let it fail the merge and the test
                outcome["error"] = exc

    with Catalog.open(db) as catalog:
        snapshot_id, _ = Engine(catalog, on_step=on_step).execute(plan, out=out, model_id="merged")
    return snapshot_id, outcome


def test_register_force_of_an_input_is_refused_while_its_merge_runs(template, tiny_family, tmp_path):
    db = clone_catalog(template, tmp_path / "c.db")
    with Catalog.open(db) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", params={"density": 0.5}))
        before = catalog.models.get("e1")

    def force_e1() -> None:
        with Catalog.open(db) as other:
            register_model(other, "e1", tiny_family["e3"], force=True)

    _, outcome = merge_pausing_at_staged(db, plan, tmp_path / "out", force_e1)
    error = outcome["error"]
    assert isinstance(error, CatalogError)
    assert "model 'e1' is an input of a merge in progress (into 'merged'" in str(error)
    with Catalog.open(db) as catalog:
        assert catalog.models.get("e1") == before  # nothing replaced: the lineage below is true
        assert catalog.models.parents("merged") == [("base", "base"), ("e1", "expert"), ("e2", "expert")]
        assert catalog.stats.is_analyzed("e1", "base")
    assert verify_snapshot(tmp_path / "out").ok


def test_a_second_run_of_the_same_plan_is_refused_before_any_work(template, tmp_path):
    db = clone_catalog(template, tmp_path / "c.db")
    with Catalog.open(db) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="task_arithmetic", budget="60%"))
    second_out = tmp_path / "second"

    def run_again() -> None:
        with Catalog.open(db) as other:
            Engine(other).execute(Plan.from_json(plan.to_json_str()), out=second_out, model_id="again")

    snapshot_id, outcome = merge_pausing_at_staged(db, plan, tmp_path / "first", run_again)
    error = outcome["error"]
    assert isinstance(error, PublishError)
    assert f"plan {plan.digest[:12]} is already being executed into model 'merged'" in str(error)
    assert not second_out.exists()
    assert [p.name for p in tmp_path.iterdir() if "staging" in p.name] == []
    with Catalog.open(db) as catalog:
        records = catalog.snapshots.list()
        assert [(r.model_id, r.status, r.id) for r in records] == [("merged", "committed", snapshot_id)]
        assert not catalog.models.exists("again")


def test_gc_versions_keeps_an_old_version_its_merge_reads(template, tiny_family, tmp_path):
    """`gc --versions --yes` during a merge of an old version (e1@1, e1@2 registered since) keeps it: the
    merge publishes and commits with true lineage; once it is done, gc drops nothing (a snapshot uses it)."""
    from click.testing import CliRunner

    from mergepipe.cli import cli

    db = clone_catalog(template, tmp_path / "c.db")
    with Catalog.open(db) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="task_arithmetic"))
        register_model(catalog, "e1", tiny_family["e3"], new_version=True)

    def gc_versions() -> str:
        result = CliRunner().invoke(cli, ["gc", "--db", str(db), "--versions", "--yes"], catch_exceptions=False)
        return result.output

    snapshot_id, outcome = merge_pausing_at_staged(db, plan, tmp_path / "out", gc_versions)
    assert "no old versions to drop" in outcome["result"], outcome
    with Catalog.open(db) as catalog:
        assert [v.id for v in catalog.models.versions("e1")] == ["e1", "e1@2"]
        assert catalog.snapshots.of_model("merged").id == snapshot_id
        assert [p for p, _ in catalog.models.parents("merged")] == ["base", "e1", "e2"]
    assert verify_snapshot(tmp_path / "out").ok
