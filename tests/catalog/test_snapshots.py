"""The snapshot state machine (intent -> committed | aborted) and its lookups."""

from __future__ import annotations

import json
import shutil

import pytest

from mergepipe.analysis.experts import describe_checkpoint
from mergepipe.analysis.register import register_model
from mergepipe.catalog.records import ModelRecord, SnapshotRecord
from mergepipe.errors import CatalogError, PublishError, StalePlanError
from mergepipe.storage.checkpoint import open_checkpoint
from tests.catalog.helpers import db_dump

PARENTS = [("base", "base"), ("e1", "expert"), ("e3", "expert")]


def hash_blocks(catalog, model_id: str, salt: str = "") -> None:
    """Record made-up block hashes (the stores do not care how they were made)."""
    blocks = catalog.blocks.by_tensor(model_id)
    catalog.blocks.set_hashes(
        model_id, [(t, b.index, f"{salt}{model_id}/{t}/{b.index}") for t, per in blocks.items() for b in per]
    )


def plan_json(catalog, inputs=("base", "e1", "e3"), **extra) -> str:
    """A stored plan's JSON as far as the snapshot store reads it: its inputs' ids and fingerprints."""
    refs = [{"id": m, "fingerprint": catalog.blocks.content_fingerprint(m)} for m in inputs]
    return json.dumps({"base": refs[0], "experts": refs[1:], **extra})


@pytest.fixture
def publishing(family_catalog, tiny_family, tmp_path):
    """A catalog with hashed inputs, two saved plans over them, and a 'published' output directory."""
    for model_id in ("base", "e1", "e3"):
        hash_blocks(family_catalog, model_id)
    family_catalog.plans.save("plan1", plan_json(family_catalog))
    family_catalog.plans.save("plan2", plan_json(family_catalog, note="another plan over the same inputs"))
    out = shutil.copytree(tiny_family["e2"], tmp_path / "out")
    return family_catalog, out


def described(catalog, out, model_id: str = "merged"):
    """What the engine hands to commit: the published directory's rows."""
    return describe_checkpoint(open_checkpoint(out), model_id, "snapshot", catalog.block_bytes, catalog.now())


def commit(catalog, out, intent_id: str, snapshot_id: str, model_id: str = "merged", parents=PARENTS):
    return catalog.snapshots.commit(
        intent_id, snapshot_id, "mh", '{"m": 1}', described(catalog, out, model_id), parents
    )


def test_commit_registers_the_snapshot_with_lineage(publishing, tmp_path):
    catalog, out = publishing
    intent = catalog.snapshots.add_intent("i1", "plan1", catalog.plans.get("plan1"), "merged", out, tmp_path / ".staging")
    assert intent.status == "pending" and intent.out_path == str(out)
    assert intent.staging_path == str(tmp_path / ".staging")
    assert catalog.snapshots.pending() == [intent]
    assert not catalog.models.exists("merged")
    assert catalog.snapshots.of_model("merged") is None
    with pytest.raises(CatalogError, match="snapshot i1 is pending: it has no manifest"):
        intent.manifest_data()

    content = described(catalog, out)
    snap = catalog.snapshots.commit("i1", "snap-abc", "mh", '{"m": 1}', content, PARENTS)
    assert (snap.status, snap.id, snap.manifest_hash, snap.manifest) == ("committed", "snap-abc", "mh", '{"m": 1}')
    assert snap.manifest_data() == {"m": 1}
    assert snap.committed_at is not None
    model = catalog.models.get("merged")
    assert model == content.record
    assert model.kind == "snapshot" and model.uri == str(out.resolve())
    assert tuple(catalog.models.tensors("merged")) == content.tensors
    assert catalog.models.parents("merged") == PARENTS
    assert catalog.models.children("e1") == ["merged"]
    assert catalog.snapshots.pending() == []
    assert catalog.snapshots.get("snap-a") == snap == catalog.snapshots.get("i1")
    assert catalog.snapshots.of_model("merged") == snap
    assert catalog.snapshots.committed_for_plan("plan1") == snap
    assert catalog.snapshots.list() == [snap]
    # recover may repeat a commit
    assert catalog.snapshots.commit("i1", "snap-abc", "mh", '{"m": 1}', content, PARENTS) == snap


def test_paths_are_stored_as_given(publishing, tmp_path):
    """The catalog does no filesystem I/O: no resolve(), no normalisation."""
    catalog, _ = publishing
    out = tmp_path / "a" / ".." / "out"
    intent = catalog.snapshots.add_intent("i1", "plan1", catalog.plans.get("plan1"), "merged", str(out), tmp_path / "s")
    assert intent.out_path == str(out) and ".." in intent.out_path


@pytest.mark.parametrize("which", ["out", "staging"])
def test_relative_paths_are_refused(publishing, tmp_path, which):
    catalog, out = publishing
    paths = {"out": out, "staging": tmp_path / ".staging"}
    paths[which] = "relative/dir"
    before = db_dump(catalog.path)
    with pytest.raises(ValueError, match="snapshot paths are stored absolute, got 'relative/dir'"):
        catalog.snapshots.add_intent("i1", "plan1", catalog.plans.get("plan1"), "merged", paths["out"], paths["staging"])
    assert db_dump(catalog.path) == before


def test_parent_of_a_snapshot_cannot_be_replaced(publishing, tmp_path, sharded_family):
    catalog, out = publishing
    catalog.snapshots.add_intent("i1", "plan1", catalog.plans.get("plan1"), "merged", out, tmp_path / ".staging")
    commit(catalog, out, "i1", "snap")
    with pytest.raises(CatalogError, match="parent of snapshot"):
        register_model(catalog, "e1", sharded_family["base"], force=True)
    with pytest.raises(CatalogError, match="published snapshot"):
        catalog.models.delete("merged")
    assert catalog.models.get("e1").architecture == "LlamaForCausalLM"


def test_failed_commit_changes_nothing(publishing, tmp_path):
    catalog, out = publishing
    catalog.snapshots.add_intent("i1", "plan1", catalog.plans.get("plan1"), "merged", out, tmp_path / ".staging")
    before = db_dump(catalog.path)
    with pytest.raises(CatalogError, match="unknown model 'ghost'"):
        commit(catalog, out, "i1", "snap", parents=[("base", "base"), ("ghost", "expert")])
    assert db_dump(catalog.path) == before
    assert catalog.snapshots.get("i1").status == "pending"


def test_commit_of_a_duplicate_snapshot_id_changes_nothing(publishing, tmp_path):
    catalog, out = publishing
    catalog.snapshots.add_intent("i1", "plan1", catalog.plans.get("plan1"), "m1", out, tmp_path / ".s1")
    commit(catalog, out, "i1", "snap", model_id="m1")
    catalog.snapshots.add_intent("i2", "plan2", catalog.plans.get("plan2"), "m2", out, tmp_path / ".s2")
    before = db_dump(catalog.path)
    with pytest.raises(CatalogError, match="snapshot snap already exists"):
        commit(catalog, out, "i2", "snap", model_id="m2")
    assert db_dump(catalog.path) == before
    assert not catalog.models.exists("m2")


def test_abort_and_plan_gc(publishing, tmp_path):
    catalog, out = publishing
    catalog.snapshots.add_intent("i1", "plan1", catalog.plans.get("plan1"), "merged", out, tmp_path / ".staging")
    with pytest.raises(CatalogError, match="already in progress"):
        catalog.snapshots.add_intent("i2", "plan2", catalog.plans.get("plan2"), "merged", out, tmp_path / ".staging2")
    catalog.snapshots.abort("i1")
    catalog.snapshots.abort("i1")  # idempotent
    assert catalog.snapshots.get("i1").status == "aborted"
    assert catalog.snapshots.pending() == []
    assert catalog.snapshots.committed_for_plan("plan1") is None
    # an aborted intent frees the model id; its plan stays referenced
    catalog.snapshots.add_intent("i2", "plan1", catalog.plans.get("plan1"), "merged", out, tmp_path / ".staging2")
    assert catalog.plans.delete_unreferenced() == 1
    assert [p.id for p in catalog.plans.list()] == ["plan1"]  # plan2 was never used
    snap = commit(catalog, out, "i2", "s2")
    with pytest.raises(CatalogError, match="committed; it cannot be aborted"):
        catalog.snapshots.abort("i2")
    with pytest.raises(CatalogError, match="not pending"):
        commit(catalog, out, "i1", "s3", model_id="other")
    assert catalog.snapshots.get("s2") == snap


def test_intent_refusals(publishing, tmp_path):
    catalog, out = publishing
    before = db_dump(catalog.path)
    with pytest.raises(CatalogError, match="model 'e1' is already registered; choose another --model-id"):
        catalog.snapshots.add_intent("i1", "plan1", catalog.plans.get("plan1"), "e1", out, tmp_path / ".s")
    with pytest.raises(CatalogError, match="unknown snapshot 'x'"):
        catalog.snapshots.get("x")
    with pytest.raises(CatalogError, match="unknown snapshot intent"):
        catalog.snapshots.abort("x")
    assert db_dump(catalog.path) == before


def test_intent_stores_its_plan_in_the_same_transaction(publishing, tmp_path):
    """A gc between `plan --save` and the intent cannot make the intent fail."""
    catalog, out = publishing
    text = plan_json(catalog, note="saved, then collected")
    catalog.plans.save("plan9", text)
    assert catalog.plans.delete_unreferenced() == 3  # plan1, plan2, plan9: nothing uses them yet
    intent = catalog.snapshots.add_intent("i1", "plan9", text, "merged", out, tmp_path / ".s")
    assert intent.plan_id == "plan9" and catalog.plans.get("plan9") == text


def test_the_same_plan_cannot_run_twice(publishing, tmp_path):
    catalog, out = publishing
    catalog.snapshots.add_intent("i1", "plan1", catalog.plans.get("plan1"), "m1", out, tmp_path / ".s1")
    before = db_dump(catalog.path)
    with pytest.raises(PublishError, match="plan plan1 is already being executed into model 'm1'.*intent i1"):
        catalog.snapshots.add_intent("i2", "plan1", catalog.plans.get("plan1"), "m2", out, tmp_path / ".s2")
    assert db_dump(catalog.path) == before
    commit(catalog, out, "i1", "snap-1", model_id="m1")
    # a second snapshot intent for an executed plan: the engine adds a location of its snapshot instead
    with pytest.raises(PublishError, match=r"plan plan1 was executed before: snapshot snap-1 \(model 'm1'\) is its "
                       r"result; executing the plan again adds a location of that snapshot"):
        catalog.snapshots.add_intent("i2", "plan1", catalog.plans.get("plan1"), "m2", out, tmp_path / ".s2")
    catalog.snapshots.add_intent("i3", "plan2", catalog.plans.get("plan2"), "m3", out, tmp_path / ".s3")


def test_an_intent_over_changed_inputs_is_refused(publishing, tmp_path):
    catalog, out = publishing
    stale = catalog.plans.get("plan1")
    catalog.models.delete("e3")  # re-registered with other bytes
    register_model(catalog, "e3", out)
    hash_blocks(catalog, "e3", salt="new:")
    before = db_dump(catalog.path)
    with pytest.raises(StalePlanError, match="model 'e3' was re-registered or changed since it was planned"):
        catalog.snapshots.add_intent("i1", "plan1", stale, "merged", out, tmp_path / ".s")
    assert db_dump(catalog.path) == before


def test_a_commit_over_changed_inputs_is_refused(publishing, tmp_path):
    """Lineage must be true: a parent whose content changed after the intent
    (here the stored fingerprint is edited) blocks the commit."""
    catalog, out = publishing
    catalog.snapshots.add_intent("i1", "plan1", catalog.plans.get("plan1"), "merged", out, tmp_path / ".s")
    with catalog.transaction():
        catalog._db.write("UPDATE models SET content_fingerprint = 'other' WHERE id = 'e1'")
    before = db_dump(catalog.path)
    with pytest.raises(StalePlanError, match="model 'e1' .* its lineage would not be true"):
        commit(catalog, out, "i1", "snap")
    assert db_dump(catalog.path) == before
    assert catalog.snapshots.get("i1").status == "pending"


def test_pending_inputs_name_the_intents_reading_each_model(publishing, tmp_path):
    catalog, out = publishing
    assert catalog.snapshots.pending_inputs() == {}
    intent = catalog.snapshots.add_intent("i1", "plan1", catalog.plans.get("plan1"), "m", out, tmp_path / ".s")
    assert catalog.snapshots.pending_inputs() == {"base": [intent], "e1": [intent], "e3": [intent]}
    catalog.snapshots.abort("i1")
    assert catalog.snapshots.pending_inputs() == {}


def test_find_by_id_intent_or_prefix(publishing, tmp_path):
    catalog, out = publishing
    for plan_id in ("plan3", "plan4", "plan5"):
        catalog.plans.save(plan_id, plan_json(catalog, note=plan_id))
    catalog.snapshots.add_intent("i1", "plan3", catalog.plans.get("plan3"), "m1", out, tmp_path / ".s1")
    first = commit(catalog, out, "i1", "snap-abc", model_id="m1")
    catalog.snapshots.add_intent("i2", "plan4", catalog.plans.get("plan4"), "m2", out, tmp_path / ".s2")
    second = commit(catalog, out, "i2", "snap-abd", model_id="m2")
    pending = catalog.snapshots.add_intent("i3", "plan5", catalog.plans.get("plan5"), "m3", out, tmp_path / ".s3")
    assert catalog.snapshots.find("snap-abc") == first
    assert catalog.snapshots.find("snap-abd") == catalog.snapshots.find("i2") == second
    assert catalog.snapshots.find("i3") == pending
    assert catalog.snapshots.find("snap-abx") is None
    assert catalog.snapshots.find("nothing") is None
    assert catalog.snapshots.find("") is None
    for prefix in ("snap-ab", "snap", "s"):
        with pytest.raises(CatalogError, match=f"snapshot prefix '{prefix}' matches several snapshots"):
            catalog.snapshots.find(prefix)
    with pytest.raises(CatalogError, match="matches several"):
        catalog.snapshots.get("snap-ab")


def test_records_round_trip_json(publishing, tmp_path):
    catalog, out = publishing
    intent = catalog.snapshots.add_intent(
        "i1", "plan1", catalog.plans.get("plan1"), "merged", out, tmp_path / ".staging"
    )
    assert SnapshotRecord.model_validate_json(intent.model_dump_json()) == intent
    model = catalog.models.get("base")
    assert ModelRecord.model_validate_json(model.model_dump_json()) == model
