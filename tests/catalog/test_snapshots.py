"""Plans and the snapshot state machine (intent -> committed | aborted)."""

from __future__ import annotations

import shutil

import pytest

from mergepipe.catalog.register import register_model
from mergepipe.errors import CatalogError, PlanError
from tests.catalog.helpers import db_dump

PARENTS = [("base", "base"), ("e1", "expert"), ("e3", "expert")]


def test_plans_round_trip_by_prefix(catalog):
    catalog.save_plan("abc123", '{"a": 1}')
    catalog.save_plan("abd456", '{"b": 2}')
    catalog.save_plan("abc123", '{"other": "ignored"}')  # same digest: no-op
    assert catalog.get_plan("abc123") == '{"a": 1}'
    assert catalog.get_plan("abd") == '{"b": 2}'
    assert [p.id for p in catalog.list_plans()] == ["abc123", "abd456"]
    with pytest.raises(PlanError, match="matches several plans"):
        catalog.get_plan("ab")
    with pytest.raises(PlanError, match="unknown plan 'zz'"):
        catalog.get_plan("zz")
    with pytest.raises(PlanError, match="unknown plan"):
        catalog.get_plan("")


@pytest.fixture
def publishing(family_catalog, tiny_family, tmp_path):
    """A catalog with a saved plan and a 'published' output directory."""
    family_catalog.save_plan("plan1", "{}")
    out = shutil.copytree(tiny_family["e2"], tmp_path / "out")
    return family_catalog, out


def test_commit_registers_the_snapshot_with_lineage(publishing, tmp_path):
    catalog, out = publishing
    intent = catalog.add_snapshot_intent("i1", "plan1", "merged", out, tmp_path / ".staging")
    assert intent.status == "pending" and intent.out_path == str(out.resolve())
    assert catalog.pending_snapshots() == [intent]
    assert not catalog.model_exists("merged")

    snap = catalog.commit_snapshot("i1", "snap-abc", "mh", '{"m": 1}', PARENTS)
    assert (snap.status, snap.id, snap.manifest_hash, snap.manifest) == ("committed", "snap-abc", "mh", '{"m": 1}')
    assert snap.committed_at is not None
    model = catalog.get_model("merged")
    assert model.kind == "snapshot" and model.uri == str(out.resolve())
    assert catalog.parents("merged") == PARENTS
    assert catalog.children("e1") == ["merged"]
    assert catalog.pending_snapshots() == []
    assert catalog.get_snapshot("snap-a") == snap == catalog.get_snapshot("i1")
    assert catalog.snapshot_by_path(out) == snap
    assert catalog.snapshot_by_path(tmp_path / "elsewhere") is None
    assert catalog.list_snapshots() == [snap]
    # recover may repeat a commit
    assert catalog.commit_snapshot("i1", "snap-abc", "mh", '{"m": 1}', PARENTS) == snap


def test_parent_of_a_snapshot_cannot_be_replaced(publishing, tmp_path, sharded_family):
    catalog, out = publishing
    catalog.add_snapshot_intent("i1", "plan1", "merged", out, tmp_path / ".staging")
    catalog.commit_snapshot("i1", "snap", "mh", "{}", PARENTS)
    with pytest.raises(CatalogError, match="parent of snapshot"):
        register_model(catalog, "e1", sharded_family["base"], force=True)
    with pytest.raises(CatalogError, match="published snapshot"):
        catalog.delete_model("merged")
    assert catalog.get_model("e1").architecture == "LlamaForCausalLM"


def test_failed_commit_changes_nothing(publishing, tmp_path):
    catalog, out = publishing
    catalog.add_snapshot_intent("i1", "plan1", "merged", out, tmp_path / ".staging")
    before = db_dump(catalog.path)
    with pytest.raises(CatalogError, match="unknown model 'ghost'"):
        catalog.commit_snapshot("i1", "snap", "mh", "{}", [("base", "base"), ("ghost", "expert")])
    assert db_dump(catalog.path) == before
    assert catalog.get_snapshot("i1").status == "pending"


def test_abort_and_plan_gc(publishing, tmp_path):
    catalog, out = publishing
    catalog.save_plan("plan2", "{}")
    catalog.add_snapshot_intent("i1", "plan1", "merged", out, tmp_path / ".staging")
    with pytest.raises(CatalogError, match="already in progress"):
        catalog.add_snapshot_intent("i2", "plan1", "merged", out, tmp_path / ".staging2")
    catalog.abort_snapshot("i1")
    catalog.abort_snapshot("i1")  # idempotent
    assert catalog.get_snapshot("i1").status == "aborted"
    assert catalog.pending_snapshots() == []
    assert catalog.snapshot_by_path(out) is None
    # an aborted intent frees the model id; its plan stays referenced
    catalog.add_snapshot_intent("i2", "plan1", "merged", out, tmp_path / ".staging2")
    assert catalog.delete_unreferenced_plans() == 1
    assert [p.id for p in catalog.list_plans()] == ["plan1"]
    snap = catalog.commit_snapshot("i2", "s2", "mh", "{}", PARENTS)
    with pytest.raises(CatalogError, match="committed; it cannot be aborted"):
        catalog.abort_snapshot("i2")
    with pytest.raises(CatalogError, match="not pending"):
        catalog.commit_snapshot("i1", "s3", "mh", "{}", PARENTS)
    assert catalog.get_snapshot("s2") == snap


def test_intent_refusals(publishing, tmp_path):
    catalog, out = publishing
    with pytest.raises(CatalogError, match="model 'e1' is already registered; choose another --model-id"):
        catalog.add_snapshot_intent("i1", "plan1", "e1", out, tmp_path / ".s")
    with pytest.raises(PlanError, match="unknown plan"):
        catalog.add_snapshot_intent("i1", "nope", "m", out, tmp_path / ".s")
    with pytest.raises(CatalogError, match="unknown snapshot 'x'"):
        catalog.get_snapshot("x")
    with pytest.raises(CatalogError, match="unknown snapshot intent"):
        catalog.abort_snapshot("x")


def test_records_round_trip_json(publishing, tmp_path):
    from mergepipe.catalog.records import ModelRecord, SnapshotRecord, TensorRecord

    catalog, out = publishing
    intent = catalog.add_snapshot_intent("i1", "plan1", "merged", out, tmp_path / ".staging")
    assert SnapshotRecord.from_json(intent.to_json()) == intent
    model = catalog.get_model("base")
    assert ModelRecord.from_json(model.to_json()) == model
    tensor = catalog.tensors("base")[0]
    assert TensorRecord.from_json(tensor.to_json()) == tensor
