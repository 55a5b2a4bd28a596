"""The publish protocol: stage, write, fsync, rename, fsync parent, commit; aborts clean up."""

from __future__ import annotations

import os
import stat

import pytest

from mergepipe.errors import OutputExistsError, PublishError
from mergepipe.txn.publish import STEPS, StagingArea, TransactionManager, refuse_existing, resolve_output
from mergepipe.txn.publish import parse_staging_name, remove_staging
from mergepipe.txn.verify import verify_snapshot
from tests.txn.helpers import finish_snapshot, publish_snapshot, write_checkpoint


def listing(directory):
    return sorted(p.name for p in directory.iterdir())


class Boom(Exception):
    pass


def raise_at(step):
    def hook(name):
        if name == step:
            raise Boom(name)
    return hook


def test_happy_path(tmp_path):
    calls = []
    tm = TransactionManager(on_step=calls.append)
    out = tmp_path / "runs" / "merged"  # missing parents are created
    area = tm.stage(out, record_intent=lambda a: calls.append("intent"))
    assert area.path.parent == out.parent and area.path.is_dir() and not out.exists()
    assert parse_staging_name(area.path.name) == ("merged", area.intent_id)
    write_checkpoint(area.path)
    manifest = finish_snapshot(area.path, "m")

    def commit():
        calls.append("commit")
        assert verify_snapshot(out).ok  # complete and in place before the catalog commit

    tm.publish(area, commit=commit)
    assert calls == ["intent", "staged", "written", "fsynced", "renamed", "commit", "committed"]
    assert area.state == "committed" and not area.path.exists()
    assert listing(out.parent) == ["merged"]
    assert verify_snapshot(out).ok and verify_snapshot(out).manifest == manifest
    for path in [out, *out.rglob("*")]:
        # files read-only; directories writable by their owner alone, who may delete the snapshot
        mode = stat.S_IMODE(path.stat().st_mode)
        assert (mode & 0o722 == 0o700) if path.is_dir() else not mode & 0o222, (path, oct(mode))


class OddPath(os.PathLike):
    """A path-like whose ``str`` is not its path (only ``os.fspath`` is)."""

    def __init__(self, path):
        self.path = str(path)

    def __fspath__(self):
        return self.path

    def __str__(self):
        return "<not a path>"


def test_an_output_is_any_path_like_by_its_fspath(tmp_path):
    out = tmp_path / "out"
    assert resolve_output(OddPath(out)) == refuse_existing(OddPath(out)) == out
    out.mkdir()
    with pytest.raises(OutputExistsError, match="already exists"):
        refuse_existing(OddPath(out))


def test_steps_constant_matches_protocol():
    assert STEPS == ("staged", "written", "fsynced", "renamed", "committed")


@pytest.mark.parametrize("kind", ["dir", "file", "empty_dir", "broken_symlink"])
def test_existing_output_refused_before_anything_is_created(tmp_path, kind):
    out = tmp_path / "out"
    if kind == "dir":
        write_checkpoint(out)
    elif kind == "file":
        out.write_text("x")
    elif kind == "empty_dir":
        out.mkdir()
    else:
        out.symlink_to(tmp_path / "nowhere")
    before = listing(tmp_path)
    recorded = []
    with pytest.raises(OutputExistsError, match=r"output path .*out already exists; choose another --out or remove it"):
        TransactionManager(on_step=recorded.append).stage(out, record_intent=recorded.append)
    assert listing(tmp_path) == before and recorded == []


@pytest.mark.parametrize("step", ["staged", "written", "fsynced"])
def test_exception_before_rename_aborts(tmp_path, step):
    aborted = []
    tm = TransactionManager(on_step=raise_at(step))
    out = tmp_path / "out"
    with pytest.raises(Boom):
        with tm.staged(out, on_abort=aborted.append) as area:
            write_checkpoint(area.path)
            finish_snapshot(area.path, "m")
            tm.publish(area, commit=lambda: pytest.fail("commit after an abort"))
    assert listing(tmp_path) == [] and len(aborted) == 1 and aborted[0].state == "aborted"


def test_failed_record_intent_leaves_nothing_and_does_not_abort_intent(tmp_path):
    aborted = []

    def refuse(area):
        raise PublishError("catalog says no")

    with pytest.raises(PublishError, match="catalog says no"):
        TransactionManager().stage(tmp_path / "out", record_intent=refuse, on_abort=aborted.append)
    assert listing(tmp_path) == [] and aborted == []


def test_exception_while_writing_aborts(tmp_path):
    tm = TransactionManager()
    with pytest.raises(Boom):
        with tm.staged(tmp_path / "out") as area:
            write_checkpoint(area.path)
            raise Boom("writer failed")
    assert listing(tmp_path) == []


def test_leaving_block_without_publish_aborts(tmp_path):
    tm = TransactionManager()
    with tm.staged(tmp_path / "out") as area:
        write_checkpoint(area.path)
    assert area.state == "aborted" and listing(tmp_path) == []


@pytest.mark.parametrize("step", ["renamed", "committed"])
def test_exception_after_rename_keeps_complete_output(tmp_path, step):
    tm = TransactionManager(on_step=raise_at(step))
    committed = []
    with pytest.raises(Boom):
        with tm.staged(tmp_path / "out") as area:
            write_checkpoint(area.path)
            finish_snapshot(area.path, "m")
            tm.publish(area, commit=lambda: committed.append(True))
    assert listing(tmp_path) == ["out"] and verify_snapshot(tmp_path / "out").ok
    assert committed == ([True] if step == "committed" else [])
    with pytest.raises(PublishError, match="cannot be aborted"):
        tm.abort(area)


def test_commit_failure_keeps_output_and_propagates(tmp_path):
    tm = TransactionManager()

    def commit():
        raise PublishError("db locked")

    with pytest.raises(PublishError, match="db locked"):
        with tm.staged(tmp_path / "out") as area:
            write_checkpoint(area.path)
            finish_snapshot(area.path, "m")
            tm.publish(area, commit=commit)
    assert area.state == "published" and verify_snapshot(tmp_path / "out").ok


def test_output_appearing_meanwhile_is_not_replaced(tmp_path):
    out = tmp_path / "out"

    def someone_else(step):
        if step == "fsynced":
            out.mkdir()  # empty: a plain rename would silently replace it

    aborted = []
    tm = TransactionManager(on_step=someone_else)
    area = tm.stage(out, on_abort=aborted.append)
    write_checkpoint(area.path)
    with pytest.raises(OutputExistsError, match="appeared while merging"):
        tm.publish(area)
    assert listing(tmp_path) == ["out"] and listing(out) == [] and aborted == [area]


@pytest.mark.parametrize("step", ["fsynced", "renamed", "committed"])
def test_replace_swaps_the_whole_output_in_one_step(tmp_path, step):
    """``replace`` (mergepipe-yaml's re-run into the OUT it published): whatever step it stops at, the output is
    the whole old snapshot or the whole new one; once swapped, the old one is the staging area, marked as this
    intent's, which recover may remove; after the commit it is gone."""
    out = tmp_path / "out"
    tm = TransactionManager()
    with tm.staged(out) as area:
        write_checkpoint(area.path, seed=1)
        old = finish_snapshot(area.path, "m")
        tm.publish(area)
    with pytest.raises(Boom), TransactionManager(on_step=raise_at(step)).staged(out, replace=True) as area:
        write_checkpoint(area.path, seed=2)
        new = finish_snapshot(area.path, "m@2")
        TransactionManager(on_step=raise_at(step)).publish(area)
    assert old != new and verify_snapshot(out).ok and verify_snapshot(out).manifest == (
        old if step == "fsynced" else new)
    if step == "renamed":
        assert verify_snapshot(area.path).manifest == old
        assert remove_staging(area.path, area.intent_id, out) is None
    assert listing(tmp_path) == ["out"]


def test_publish_and_abort_state_rules(tmp_path):
    tm = TransactionManager()
    area = tm.stage(tmp_path / "out")
    tm.abort(area)
    tm.abort(area)  # idempotent
    with pytest.raises(PublishError, match="it is aborted"):
        tm.publish(area)
    assert isinstance(area, StagingArea) and listing(tmp_path) == []


def test_publish_with_real_catalog(catalog, parents, tmp_path):
    out = tmp_path / "snapshots" / "merged"
    manifest = publish_snapshot(catalog, out, "merged", parents)
    record = catalog.snapshots.get(manifest.snapshot_id)
    assert record.status == "committed" and record.manifest_hash == manifest.manifest_hash
    assert record.out_path == str(out.resolve()) and catalog.models.parents("merged") == [("base", "base"), ("e1", "expert")]
    assert catalog.snapshots.pending() == []
    # the published directory is registered as a model, described from its own files
    model = catalog.models.get("merged")
    assert model.kind == "snapshot" and model.uri == str(out.resolve())
    assert [(t.name, t.dtype, t.shape) for t in catalog.models.tensors("merged")] == [("w", "F32", (64,))]


def test_abort_with_real_catalog_marks_intent_aborted(catalog, parents, tmp_path):
    with pytest.raises(Boom):
        publish_snapshot(catalog, tmp_path / "out", "merged", parents, on_step=raise_at("fsynced"))
    (record,) = catalog.snapshots.list()
    assert record.status == "aborted" and not (tmp_path / "out").exists()
    assert not os.path.exists(record.staging_path)
    # the same merge then succeeds
    manifest = publish_snapshot(catalog, tmp_path / "out", "merged", parents)
    assert catalog.snapshots.get(manifest.snapshot_id).status == "committed"
