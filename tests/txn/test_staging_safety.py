"""recover and gc delete only MergePipe's own staging directories.

A catalog row names a staging path; a forged or damaged row must never make
MergePipe delete a user's folder. Removed: only a real directory at exactly
the staging path of its intent beside its output, that is empty or holds the
marker with that intent id. Everything else is reported and left alone.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from mergepipe.cli import cli
from mergepipe.catalog import Catalog
from mergepipe.txn.recover import recover
from mergepipe.txn.publish import MARKER, remove_staging, staging_path_for, write_marker
from tests.txn.helpers import PLAN


def victim_dir(root: Path) -> Path:
    """A user's folder with data in it."""
    root.mkdir(parents=True)
    (root / "thesis.tex").write_text("years of work")
    (root / "sub").mkdir()
    (root / "sub" / "data.bin").write_bytes(b"\x00" * 100)
    return root


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def forge_intent(catalog: Catalog, intent_id: str, out: Path, staging: Path, status: str = "pending") -> None:
    """A snapshot row written behind the stores' back (a damaged or forged catalog)."""
    with catalog.transaction():
        catalog._db.write(
            "INSERT INTO snapshots (intent_id, id, plan_id, model_id, out_path, staging_path, status, "
            "manifest_hash, manifest, created_at, committed_at) VALUES (?, NULL, ?, ?, ?, ?, ?, NULL, NULL, ?, NULL)",
            (intent_id, PLAN, f"m-{intent_id[:6]}", str(out), str(staging), status, catalog.now()),
        )


def test_a_forged_intent_cannot_make_recover_delete_a_folder(catalog, tmp_path):
    victim = victim_dir(tmp_path / "home" / "papers")
    before = files(victim)
    intent_id = uuid.uuid4().hex
    forge_intent(catalog, intent_id, tmp_path / "out", victim)
    report = recover(catalog)
    assert files(victim) == before
    assert victim not in report.removed
    assert any(str(victim) in p and "not where intent" in p for p in report.problems)
    assert catalog.snapshots.get(intent_id).status == "aborted"  # the row is resolved, the folder kept


def test_a_folder_named_like_staging_but_unmarked_is_left(catalog, tmp_path):
    """The right name at the right place is not enough: it must hold our marker."""
    intent_id = uuid.uuid4().hex
    out = tmp_path / "out"
    victim = victim_dir(staging_path_for(out, intent_id))
    before = files(victim)
    forge_intent(catalog, intent_id, out, victim)
    report = recover(catalog)
    assert files(victim) == before
    assert any("holds no MergePipe staging marker" in p for p in report.problems)
    (victim / MARKER).write_text("0" * 32 + "\n")  # another intent's marker does not count either
    assert remove_staging(victim, intent_id, out) is not None and victim.exists()


def test_gc_never_deletes_what_an_aborted_row_points_at(catalog, tmp_path):
    victim = victim_dir(tmp_path / "projects")
    before = files(victim)
    forge_intent(catalog, uuid.uuid4().hex, tmp_path / "out", victim, status="aborted")
    catalog.close()
    result = CliRunner().invoke(cli, ["gc", "--db", str(tmp_path / "catalog.db")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert files(victim) == before
    assert "removed 0 staging directories" in result.output
    assert str(victim) in result.output  # reported


def test_a_symlink_at_the_staging_path_is_not_followed(catalog, tmp_path):
    intent_id = uuid.uuid4().hex
    out = tmp_path / "out"
    victim = victim_dir(tmp_path / "elsewhere")
    write_marker(victim, intent_id)  # even a marker behind the link does not make it ours
    link = staging_path_for(out, intent_id)
    link.symlink_to(victim, target_is_directory=True)
    assert "not a directory" in remove_staging(link, intent_id, out)
    assert link.is_symlink() and (victim / "thesis.tex").exists()


@pytest.mark.parametrize("known_parent", [True, False])
def test_an_empty_staging_folder_from_a_kill_right_after_mkdir_is_removed(catalog, tmp_path, known_parent):
    """Killed between mkdir and the marker: empty, so removing it loses nothing.
    In a parent the catalog does not know yet, the next merge into it finds it."""
    parent = tmp_path / ("snaps" if known_parent else "fresh")
    parent.mkdir()
    if known_parent:
        forge_intent(catalog, uuid.uuid4().hex, parent / "earlier", parent / ".earlier.x", status="aborted")
    empty = staging_path_for(parent / "out", uuid.uuid4().hex)
    empty.mkdir()
    report = recover(catalog, also_scan=[] if known_parent else [parent])
    assert not empty.exists() and empty in report.removed
