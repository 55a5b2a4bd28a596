"""A base's side files (config, tokenizer, generation config) are copied into every merge of it, so they are
part of what identifies a model version: the user who adds tokenizer files to a base folder after a first
merge (eval and search need them) runs the same config again and gets them, as a new version of the base,
never "did not reproduce its snapshot" forever; `register --new-version` records them; a plan made before
they changed is refused in one line that says what to do; a catalog made before side files counted keeps
working, and re-registering its models is no false new version."""

from __future__ import annotations

import json
import shutil
import sqlite3

import pytest
import yaml

from mergepipe.catalog import Catalog
from tests.fixtures.cli import mergepipe_yaml, run_main
from examples.demo_models import write_tokenizer


@pytest.fixture
def story(tiny_family, tmp_path, monkeypatch):
    """A user's folders (the base copied: the user edits it) and a mergekit config, in a fresh HOME."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.delenv("MERGEPIPE_DB", raising=False)
    base = tmp_path / "base"
    shutil.copytree(tiny_family["base"], base)
    config = tmp_path / "merge.yml"
    config.write_text(yaml.safe_dump({
        "merge_method": "linear", "base_model": str(base), "dtype": "bfloat16",
        "models": [{"model": str(tiny_family["e1"]), "parameters": {"weight": 0.5}},
                   {"model": str(tiny_family["e2"]), "parameters": {"weight": 0.5}}],
    }))
    return {"base": base, "config": config, "root": tmp_path, "db": tmp_path / "c.db"}


def _tokenizer_files(base) -> dict[str, bytes]:
    before = {p.name for p in base.iterdir()}
    write_tokenizer(base)
    return {p.name: p.read_bytes() for p in base.iterdir() if p.name not in before or p.name == "tokenizer_config.json"}


def test_the_same_config_runs_again_after_tokenizer_files_are_added_to_the_base(story, capsys):
    root = story["root"]
    code, _, err = mergepipe_yaml([story["config"], root / "first", "--no-progress"], capsys)
    assert code == 0, err
    added = _tokenizer_files(story["base"])
    assert "tokenizer.json" in added

    code, _, err = mergepipe_yaml([story["config"], root / "second", "--no-progress"], capsys)
    assert code == 0, err
    for name, content in added.items():  # the base's files as they are now
        assert (root / "second" / name).read_bytes() == content, name
    assert not (root / "first" / "tokenizer.json").exists()  # the first snapshot is the first base's
    for out in ("first", "second"):
        code, _, err = run_main(["verify", root / out], capsys)
        assert code == 0, err
    catalog_db = root / "home" / ".local" / "share" / "mergepipe" / "catalog.db"
    with Catalog.open(catalog_db) as catalog:
        assert [v.label for v in catalog.models.versions("base")] == ["base@1", "base@2"]
    bases = [json.loads((root / out / "manifest.json").read_text())["base"]["id"] for out in ("first", "second")]
    assert bases == ["base", "base@2"]


def test_register_new_version_records_side_files_and_an_old_plan_says_what_to_do(story, tiny_family, capsys):
    db, base, root = story["db"], story["base"], story["root"]
    for name, path in (("base", base), ("e1", tiny_family["e1"])):
        assert run_main(["register", "--db", db, "--model-id", name, "--uri", path], capsys)[0] == 0
    merge = ["merge", "--db", db, "--base", "base", "--experts", "e1", "--operator", "task_arithmetic",
             "--no-progress"]
    code, _, err = run_main([*merge, "--out", root / "first"], capsys)
    assert code == 0, err
    plan = json.loads((root / "first" / "manifest.json").read_text())["plan_digest"][:12]
    added = _tokenizer_files(base)

    code, _, err = run_main(["execute", "--db", db, "--plan", plan, "--out", root / "again", "--no-progress"], capsys)
    assert code != 0 and len(err.strip().splitlines()) == 1, err
    assert "side files" in err and "--new-version" in err and not (root / "again").exists()

    code, out, err = run_main(["register", "--db", db, "--model-id", "base", "--uri", base, "--new-version"], capsys)
    assert code == 0 and "version 2 of 'base'" in out, out + err
    code, _, err = run_main([*merge, "--out", root / "second"], capsys)
    assert code == 0, err
    assert all((root / "second" / n).read_bytes() == c for n, c in added.items())
    assert run_main(["verify", root / "second"], capsys)[0] == 0


def _as_an_earlier_release_left_it(catalog_db, model_id: str) -> None:
    """The model's row as a release before side files counted wrote it: no side files recorded."""
    with sqlite3.connect(catalog_db) as connection:
        connection.execute("UPDATE models SET side_files = NULL WHERE id = ?", (model_id,))


def test_a_catalog_made_before_side_files_counted_keeps_working(story, tiny_family, capsys):
    """Its snapshots re-materialise from their plans; registering its folder again records the side files into
    the same version, said so, after which merges name them."""
    db, base, root = story["db"], story["base"], story["root"]
    assert run_main(["register", "--db", db, "--model-id", "base", "--uri", base], capsys)[0] == 0
    _as_an_earlier_release_left_it(db, "base")
    merge = ["merge", "--db", db, "--base", "base", "--experts", tiny_family["e1"], "--operator", "task_arithmetic",
             "--no-progress"]
    code, _, err = run_main([*merge, "--out", root / "old"], capsys)
    assert code == 0, err
    old = json.loads((root / "old" / "manifest.json").read_text())

    code, out, err = run_main(["register", "--db", db, "--model-id", "base", "--uri", base], capsys)
    assert code == 0 and "recorded now, no new version" in out, out + err  # said so
    with Catalog.open(db) as catalog:
        assert [v.label for v in catalog.models.versions("base")] == ["base@1"]
        assert "config.json" in (catalog.models.get("base").side_digests or {})
    code, out, err = run_main(["register", "--db", db, "--model-id", "base", "--uri", base], capsys)
    assert code == 0 and "nothing to do" in out, out + err

    code, _, err = run_main(["execute", "--db", db, "--plan", old["plan_digest"][:12], "--out", root / "again",
                             "--no-progress"], capsys)  # the earlier plan still gives its snapshot
    assert code == 0, err
    assert json.loads((root / "again" / "manifest.json").read_text())["snapshot_id"] == old["snapshot_id"]
    code, _, err = run_main([*merge, "--out", root / "new"], capsys)
    assert code == 0, err
    new = json.loads((root / "new" / "manifest.json").read_text())
    assert new["plan_digest"] != old["plan_digest"]  # it names the side files now
    assert [f for f in new["files"] if f["name"] != "README.md"] == [f for f in old["files"] if f["name"] != "README.md"]
