"""Reproducibility, stale plans and verification.

Finding on "the same plan executed twice gives the same manifest hash": the
manifest records the model id, so two executions under two model ids have
different manifest hashes by design. What is reproducible, and pinned here:
byte-identical output files, the same snapshot id (derived from the plan
digest and the file hashes only), manifests that differ in nothing but the
model id and the excluded timing fields, and the same manifest hash when the
model id is the same too (executions in two catalogs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import stat

import pytest

import mergepipe.engine.engine as engine_module
from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.cli import main
from mergepipe.engine.engine import Engine
from mergepipe.errors import ModelChangedError, StalePlanError
from mergepipe.planner.planner import Planner
from mergepipe.spec.plan import Plan
from tests.fixtures.checkpoints import make_writable_tree
from mergepipe.txn.recover import recover
from mergepipe.txn.verify import verify_snapshot
from mergepipe.spec.request import MergeRequest
from tests.planner.support import build_catalog, clone_catalog, snapshot_files

BLOCK_BYTES = 2048


@pytest.fixture(scope="module")
def repro_template(tiny_family, tmp_path_factory):
    path = tmp_path_factory.mktemp("repro") / "template.db"
    return build_catalog(path, BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2", "e3"])


@pytest.fixture(scope="module")
def plan(repro_template, tmp_path_factory):
    path = clone_catalog(repro_template, tmp_path_factory.mktemp("repro-plan") / "c.db")
    with Catalog.open(path) as catalog:
        return Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2", "e3"], operator="dare_ties", weights=[1.0, 0.5, 0.8], params={"density": 0.5}, seed=11, budget="45%"))


@pytest.fixture(scope="module")
def published(repro_template, plan, tmp_path_factory):
    """The plan executed in two catalogs, under two model ids and the same one."""
    root = tmp_path_factory.mktemp("repro-runs")
    runs = {}
    for name, model_id in (("a", "merged-a"), ("b", "merged-b"), ("c", "merged-a")):
        with Catalog.open(clone_catalog(repro_template, root / f"{name}.db")) as catalog:
            snapshot_id, manifest = Engine(catalog).execute(
                Plan.from_json(plan.to_json_str()), out=root / name / "out", model_id=model_id
            )
        runs[name] = (snapshot_id, manifest, root / name / "out")
    return runs


def test_same_plan_gives_identical_files_and_snapshot_id(published):
    (id_a, m_a, out_a), (id_b, m_b, out_b) = published["a"], published["b"]
    assert snapshot_files(out_a) == snapshot_files(out_b)
    assert id_a == id_b
    assert m_a.files == m_b.files
    assert m_a.cost.realized.expert_bytes == m_b.cost.realized.expert_bytes
    # the manifests differ by the model id only: with it equal, the hashes agree
    assert m_a.manifest_hash != m_b.manifest_hash
    assert dataclasses.replace(m_b, model_id=m_a.model_id).manifest_hash == m_a.manifest_hash


def test_same_plan_and_model_id_gives_the_same_manifest_hash(published):
    (id_a, m_a, out_a), (id_c, m_c, out_c) = published["a"], published["c"]
    assert (id_a, m_a.manifest_hash) == (id_c, m_c.manifest_hash)
    # timestamps and timings differ, and stay out of the hash
    on_disk = [json.loads((out / "manifest.json").read_text()) for out in (out_a, out_c)]
    assert on_disk[0]["manifest_hash"] == on_disk[1]["manifest_hash"] == m_a.manifest_hash
    for data in on_disk:
        data.pop("created_at", None)
        data["cost"]["realized"].pop("seconds", None)
    assert on_disk[0] == on_disk[1]


def test_same_plan_twice_in_one_catalog(repro_template, plan, tmp_path):
    """Executing a plan again gives its snapshot again (tests/cli/test_rerun.py): under another model
    id, the same snapshot published as that id too (an alias of the snapshot's own model)."""
    with Catalog.open(clone_catalog(repro_template, tmp_path / "c.db")) as catalog:
        first_id, first = Engine(catalog).execute(plan, out=tmp_path / "one", model_id="one")
        two_id, two = Engine(catalog).execute(plan, out=tmp_path / "two", model_id="two")
        assert (two_id, two.manifest_hash, two.model_id) == (first_id, first.manifest_hash, "one")
        assert catalog.models.parents("two") == [("one", "same snapshot")]
        again_id, again = Engine(catalog).execute(plan, out=tmp_path / "again", model_id="one")
        assert (again_id, again.manifest_hash) == (first_id, first.manifest_hash)
        assert [s.model_id for s in catalog.snapshots.list()] == ["one"]
        assert [loc.path for loc in catalog.snapshots.locations(first_id)] == [
            str(tmp_path / "one"), str(tmp_path / "two"), str(tmp_path / "again")]
        recover(catalog)  # must not raise
        assert catalog.snapshots.pending() == []


def test_a_snapshot_sealed_with_sha256_file_hashes_is_made_again_as_it_was(repro_template, plan, tmp_path,
                                                                           monkeypatch):
    """A snapshot published before blake3 file hashes (manifest schema 1, sha256) can still be re-made after
    an upgrade: the re-run hashes as that snapshot did, so its id and manifest hash are reproduced."""
    with Catalog.open(clone_catalog(repro_template, tmp_path / "c.db")) as catalog:
        monkeypatch.setattr(engine_module, "MANIFEST_SCHEMA", 1)  # the version before schema 2
        old_id, old = Engine(catalog).execute(plan, out=tmp_path / "old", model_id="one")
        monkeypatch.undo()
        assert old.schema == 1 and {f.algorithm for f in old.files} == {"sha256"}
        weights = (tmp_path / "old" / "model.safetensors").read_bytes()
        assert {f.name: f.digest for f in old.files}["model.safetensors"] == hashlib.sha256(weights).hexdigest()
        again_id, again = Engine(catalog).execute(plan, out=tmp_path / "again", model_id="one")
        assert (again_id, again.manifest_hash, again.schema) == (old_id, old.manifest_hash, 1)
        assert verify_snapshot(tmp_path / "again").ok
        new_id, new = Engine(catalog).execute(Planner(catalog).plan(MergeRequest(base="base", experts=["e1"], operator="task_arithmetic")),
                                              out=tmp_path / "new", model_id="two")
        assert new.schema == 2 and {f.algorithm for f in new.files} == {"blake3"}


# ----------------------------------------------------------------------------- stale plans


@pytest.fixture
def own_expert(repro_template, tiny_family, tmp_path):
    """A catalog with a private, writable copy of e2 registered as 'mine'."""
    mine = tmp_path / "mine"
    shutil.copytree(tiny_family["e2"], mine)
    db = clone_catalog(repro_template, tmp_path / "c.db")
    with Catalog.open(db) as catalog:
        register_model(catalog, "mine", mine)
        analyze(catalog, ["mine"], base_id="base", progress=False)  # planning never analyses
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "mine"], operator="task_arithmetic", budget="100%"))
        yield catalog, plan, mine


def _flip_data_byte(directory):
    """Change one weight byte in place, keeping size (and so the header): a low bit, so the value stays finite
    and small, as a silent corruption would be (a high exponent bit makes it ~1e38, which analysis refuses)."""
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-8] ^= 0x01
    path.write_bytes(bytes(data))


def _assert_nothing_written(catalog, out):
    assert not out.exists()
    assert [p for p in out.parent.iterdir() if "staging" in p.name] == []
    assert catalog.snapshots.list() == []


def test_a_touched_expert_file_is_refused_before_writing(own_expert, tmp_path):
    catalog, plan, mine = own_expert
    st = os.stat(mine / "model.safetensors")
    os.utime(mine / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(ModelChangedError, match="mine"):
        Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
    _assert_nothing_written(catalog, tmp_path / "out")


def test_a_plan_over_a_re_registered_expert_is_stale(own_expert, tmp_path):
    catalog, plan, mine = own_expert
    _flip_data_byte(mine)
    register_model(catalog, "mine", mine, force=True)
    with pytest.raises(StalePlanError):
        Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
    _assert_nothing_written(catalog, tmp_path / "out")


def test_a_plan_over_changed_content_is_stale_even_after_reanalysis(own_expert, tmp_path):
    catalog, plan, mine = own_expert
    _flip_data_byte(mine)
    register_model(catalog, "mine", mine, force=True)
    analyze(catalog, ["mine"], base_id="base", progress=False)
    replanned = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "mine"], operator="task_arithmetic", budget="100%"))
    assert replanned.digest != plan.digest
    with pytest.raises(StalePlanError):
        Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")


def test_a_plan_for_another_block_size_is_stale(plan, tiny_family, tmp_path):
    db = build_catalog(tmp_path / "c.db", 2 * BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2", "e3"])
    with Catalog.open(db) as catalog:
        with pytest.raises(StalePlanError, match="block"):
            Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
        _assert_nothing_written(catalog, tmp_path / "out")


def test_a_missing_expert_file_is_refused_before_writing(own_expert, tmp_path):
    catalog, plan, mine = own_expert
    (mine / "model.safetensors").rename(mine / "moved.safetensors")
    with pytest.raises(ModelChangedError):
        Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
    _assert_nothing_written(catalog, tmp_path / "out")


# ----------------------------------------------------------------------------- verify


def test_published_files_are_read_only_and_verify(published):
    _, manifest, out = published["a"]
    report = verify_snapshot(out)
    assert report.ok and report.files_checked == len(manifest.files)
    for path in out.rglob("*"):
        assert not stat.S_IMODE(path.stat().st_mode) & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH), path


def _damaged_copy(out, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    make_writable_tree(copy)
    return copy


def test_verify_detects_a_flipped_byte(published, tmp_path, capsys):
    copy = _damaged_copy(published["a"][2], tmp_path)
    shard = copy / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    report = verify_snapshot(copy)
    assert not report.ok
    assert any("model.safetensors" in p and "blake3" in p for p in report.problems), report.problems
    with pytest.raises(SystemExit) as info:
        main(["verify", str(copy)])
    assert info.value.code != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "model.safetensors" in err and len(err.splitlines()) == 1


def test_verify_detects_a_truncated_shard(published, tmp_path):
    copy = _damaged_copy(published["a"][2], tmp_path)
    shard = copy / "model.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    report = verify_snapshot(copy)
    assert not report.ok
    assert any("model.safetensors" in p and "size" in p for p in report.problems), report.problems


def test_verify_detects_an_edited_manifest_and_an_extra_file(published, tmp_path):
    copy = _damaged_copy(published["a"][2], tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["seed"] = 12
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert any("manifest" in p for p in verify_snapshot(copy).problems)
    copy2 = _damaged_copy(published["b"][2], tmp_path / "2")
    (copy2 / "extra.bin").write_bytes(b"x")
    assert any("extra.bin" in p for p in verify_snapshot(copy2).problems)
