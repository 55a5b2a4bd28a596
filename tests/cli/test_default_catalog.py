"""A one-command merge: `mergepipe merge --config ties.yml --out ./ties`, with no --db and no --model-id.

The catalog is --db, else $MERGEPIPE_DB, else ``mergepipe/catalog.db`` in the per-user data directory
($XDG_DATA_HOME when it is an absolute path, else HOME/.local/share), named on stderr; the model id is
the --out folder's name. The same config into another folder publishes the same snapshot under that
folder's name too (an alias), and ``mergepipe.merge_config`` from Python gives the snapshot the command
gives. Every test runs in its own HOME and data directory under tmp: the real ones are never touched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import mergepipe
from mergepipe.catalog import Catalog
from tests.fixtures.cli import run_main

MERGE = ["merge", "--config", "ties.yml", "--out", "./ties"]
DEFAULT_NOTE = "(the default; --db or MERGEPIPE_DB to choose)"
MODEL_ID_NOTE = "model id: {} (the output folder's name; --model-id to choose another)"


@pytest.fixture
def user(tiny_family, tmp_path, monkeypatch) -> Path:
    """A user's working folder holding ``ties.yml`` (a mergekit config of absolute paths), as the current
    directory; HOME and XDG_DATA_HOME under tmp, MERGEPIPE_DB unset."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("MERGEPIPE_DB", raising=False)
    work = tmp_path / "work"
    work.mkdir()
    config = {"merge_method": "ties", "base_model": str(tiny_family["base"]), "dtype": "float32",
              "parameters": {"density": 0.5},
              "models": [{"model": str(tiny_family["e1"]), "parameters": {"weight": 1.0}},
                         {"model": str(tiny_family["e2"]), "parameters": {"weight": 0.5}}]}
    (work / "ties.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    monkeypatch.chdir(work)
    return work


def _merged(catalog_path: Path, model_id: str, out: Path) -> str:
    """The snapshot id that ``model_id`` names in the catalog at ``catalog_path``, checked to be published at
    ``out`` with a manifest of that id and model."""
    with Catalog.open(catalog_path) as catalog:
        record = catalog.snapshots.of_model(model_id)
        assert record is not None and Path(record.out_path) == out.resolve()
        assert catalog.models.get(model_id).kind == "snapshot"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["snapshot_id"] == record.id
    return record.id


def test_merge_with_no_db_and_no_model_id_uses_the_per_user_catalog(user, tmp_path, capsys):
    code, out, err = run_main(MERGE, capsys)
    assert code == 0, err
    expected = tmp_path / "xdg" / "mergepipe" / "catalog.db"
    lines = err.splitlines()
    assert lines[0] == f"catalog: {expected} {DEFAULT_NOTE}"  # named first, before anything is done
    assert MODEL_ID_NOTE.format("ties") in lines
    assert expected.is_file()
    assert not (tmp_path / "home" / ".local").exists()  # XDG_DATA_HOME is absolute: HOME's default is not used
    _merged(expected, "ties", user / "ties")
    assert json.loads((user / "ties" / "manifest.json").read_text())["model_id"] == "ties"
    assert "snapshot snap-" in out and "published at" in out


@pytest.mark.parametrize("chosen", ["MERGEPIPE_DB", "--db", "relative XDG_DATA_HOME"])
def test_which_catalog_is_used(user, tmp_path, monkeypatch, capsys, chosen):
    """--db wins over $MERGEPIPE_DB, which wins over $XDG_DATA_HOME; a relative XDG_DATA_HOME is ignored,
    as the XDG specification says (HOME/.local/share then)."""
    (tmp_path / "env").mkdir()
    monkeypatch.setenv("MERGEPIPE_DB", str(tmp_path / "env" / "cat.db"))
    argv = list(MERGE)
    if chosen == "MERGEPIPE_DB":
        expected, line = tmp_path / "env" / "cat.db", f"catalog: {tmp_path / 'env' / 'cat.db'} (from $MERGEPIPE_DB)"
    elif chosen == "--db":
        expected, line = tmp_path / "flag.db", None
        argv += ["--db", str(expected)]
    else:
        monkeypatch.delenv("MERGEPIPE_DB")
        monkeypatch.setenv("XDG_DATA_HOME", "relative/data")
        expected = tmp_path / "home" / ".local" / "share" / "mergepipe" / "catalog.db"
        line = f"catalog: {expected} {DEFAULT_NOTE}"
    code, _, err = run_main(argv, capsys)
    assert code == 0, err
    named = [x for x in err.splitlines() if x.startswith("catalog: ")]
    assert named == ([] if line is None else [line])  # --db needs no naming
    assert expected.is_file()
    _merged(expected, "ties", user / "ties")
    # no other catalog was made
    candidates = {tmp_path / "env" / "cat.db", tmp_path / "flag.db", tmp_path / "xdg" / "mergepipe" / "catalog.db",
                  tmp_path / "home" / ".local" / "share" / "mergepipe" / "catalog.db",
                  user / "relative" / "data" / "mergepipe" / "catalog.db"}
    assert [p for p in candidates if p.exists()] == [expected]
    assert not (user / "relative").exists()


def test_the_same_config_into_another_folder_publishes_the_same_snapshot_under_its_name(user, tmp_path, capsys):
    code, _, err = run_main([*MERGE, "--json-summary", "first.json"], capsys)
    assert code == 0, err
    code, out, err = run_main(["merge", "--config", "ties.yml", "--out", "./ties-copy", "--json-summary",
                               "second.json"], capsys)
    assert code == 0, err  # not an error: an alias
    catalog_path = tmp_path / "xdg" / "mergepipe" / "catalog.db"
    first = _merged(catalog_path, "ties", user / "ties")
    second = _merged(catalog_path, "ties-copy", user / "ties-copy")
    assert first == second
    assert MODEL_ID_NOTE.format("ties-copy") in err.splitlines()
    assert f"published snapshot {first} as 'ties-copy' too: the same merge as model 'ties'" in err
    summary = json.loads((user / "second.json").read_text())
    assert (summary["snapshot_id"], summary["model_id"], summary["same_snapshot_as"]) == (first, "ties-copy", "ties")
    assert summary["manifest_hash"] == json.loads((user / "first.json").read_text())["manifest_hash"]
    assert (user / "ties-copy" / "model.safetensors").read_bytes() == (user / "ties" / "model.safetensors").read_bytes()
    with Catalog.open(catalog_path) as catalog:
        assert catalog.models.same_snapshot_as("ties-copy") == "ties"
        assert [m.id for m in catalog.models.versions("ties")] == ["ties"]  # no second version either
        assert len(catalog.snapshots.list()) == 1


def test_merge_config_from_python_gives_the_commands_snapshot(user, tmp_path, monkeypatch, capsys):
    code, _, err = run_main(MERGE, capsys)
    assert code == 0, err
    cli_snapshot = _merged(tmp_path / "xdg" / "mergepipe" / "catalog.db", "ties", user / "ties")
    # another user's data directory: a fresh catalog, so the merge is computed again, not re-materialised
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-python"))
    merged = mergepipe.merge_config("ties.yml", out=tmp_path / "python" / "ties")
    assert (merged.snapshot_id, merged.model_id, merged.rematerialised) == (cli_snapshot, "ties", False)
    fresh = tmp_path / "xdg-python" / "mergepipe" / "catalog.db"
    assert _merged(fresh, "ties", tmp_path / "python" / "ties") == cli_snapshot
    mine, theirs = tmp_path / "python" / "ties", user / "ties"
    assert (mine / "model.safetensors").read_bytes() == (theirs / "model.safetensors").read_bytes()
    assert (json.loads((mine / "manifest.json").read_text())["files"]
            == json.loads((theirs / "manifest.json").read_text())["files"])
