"""`mergepipe-yaml CONFIG OUT` run again and again, as a mergekit user does: OUT may exist, projects apart.

An empty OUT (``mkdir -p out`` first) is used; the same config into the OUT it published is a no-op that
says so; another config there replaces it as the model's next version (the old snapshot stays in the
catalog and comes back with `execute --plan`); a folder holding files MergePipe did not write is
refused, naming them, without ``--out`` (a flag this command lacks). Two projects' ``./out`` in the
default catalog are two models, not two versions of one. A missing relative path says which folder was
looked for, from which directory. Each test runs in its own HOME (the per-user default catalog is the
test's) with task arithmetic configs whose result is computed here with torch.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import yaml

from mergepipe.catalog import Catalog
from tests.fixtures.checkpoints import load_tensors
from tests.fixtures.cli import all_files, mergepipe_yaml, run_main


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A fresh HOME and the per-user data directory under it; the catalog is the default one."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.delenv("MERGEPIPE_DB", raising=False)
    return tmp_path / "home"


def catalog_path(home: Path) -> Path:
    return home / ".local" / "share" / "mergepipe" / "catalog.db"


def project(root: Path, family: dict[str, Path], weight: float, name: str = "merge.yml") -> Path:
    """A project folder holding a task arithmetic config (e1 at ``weight``), as the current directory."""
    root.mkdir(parents=True, exist_ok=True)
    config = {"merge_method": "task_arithmetic", "base_model": str(family["base"]), "dtype": "float32",
              "models": [{"model": str(family["e1"]), "parameters": {"weight": weight}}]}
    (root / name).write_text(yaml.safe_dump(config, sort_keys=False))
    return root


def expected(family: dict[str, Path], weight: float) -> dict[str, torch.Tensor]:
    """base + weight·(e1 − base), in float32."""
    base, e1 = load_tensors(family["base"]), load_tensors(family["e1"])
    return {k: base[k].float() + weight * (e1[k].float() - base[k].float()) for k in base}


def assert_merged(out: Path, reference: dict[str, torch.Tensor]) -> None:
    mine = load_tensors(out)
    assert mine.keys() == reference.keys()
    for k, value in reference.items():
        assert torch.allclose(mine[k], value, rtol=1e-6, atol=1e-7), k


def staging_left(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if "mergepipe-staging" in p.name]


def test_an_empty_out_is_used_and_the_same_config_again_is_a_no_op(tiny_family, home, tmp_path, monkeypatch,
                                                                    capsys):
    work = project(tmp_path / "work", tiny_family, 0.5)
    monkeypatch.chdir(work)
    (work / "out").mkdir()  # `mkdir -p out` first, as scripts do
    code, out, err = mergepipe_yaml(["merge.yml", "out", "--quiet"], capsys)
    assert code == 0, err
    assert_merged(work / "out", expected(tiny_family, 0.5))
    first = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (work / "out").iterdir()}
    snapshot = json.loads((work / "out" / "manifest.json").read_text())["snapshot_id"]

    code, out, err = mergepipe_yaml(["merge.yml", "out", "--quiet"], capsys)
    assert code == 0, err
    assert out.strip() == (f"{work / 'out'} already holds snapshot {snapshot} (model 'out'), which this merge makes: "
                           f"nothing to do (`mergepipe verify {work / 'out'}` checks every byte)")
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (work / "out").iterdir()} == first
    with Catalog.open(catalog_path(home)) as catalog:
        assert [s.id for s in catalog.snapshots.list()] == [snapshot]
    assert staging_left(work) == []


def test_another_config_replaces_the_out_it_published_as_the_next_version(tiny_family, home, tmp_path, monkeypatch,
                                                                           capsys):
    work = project(tmp_path / "work", tiny_family, 0.5)
    project(work, tiny_family, 1.0, "other.yml")
    monkeypatch.chdir(work)
    code, _, err = mergepipe_yaml(["merge.yml", "./out", "--quiet"], capsys)
    assert code == 0, err
    old_files = all_files(work / "out")
    old = json.loads(old_files["manifest.json"])

    code, _, err = mergepipe_yaml(["other.yml", "./out", "--quiet"], capsys)
    assert code == 0, err
    assert_merged(work / "out", expected(tiny_family, 1.0))
    new = json.loads((work / "out" / "manifest.json").read_text())
    assert (new["model_id"], old["model_id"]) == ("out@2", "out")
    assert (f"replaced snapshot {old['snapshot_id']} (model 'out') at {work / 'out'}; the catalog keeps it: "
            f"`mergepipe execute --plan {old['plan_digest'][:12]} --out DIR` re-materialises it") in err
    assert staging_left(work) == [] and sorted(p.name for p in work.iterdir()) == ["merge.yml", "other.yml", "out"]
    with Catalog.open(catalog_path(home)) as catalog:
        (location,) = catalog.snapshots.locations(old["snapshot_id"])
        assert location.path == str(work / "out") and location.removed_at is not None
        assert [loc.removed_at for loc in catalog.snapshots.locations(new["snapshot_id"])] == [None]

    # the old snapshot comes back, byte for byte, where the user asks
    code, _, err = run_main(["execute", "--plan", old["plan_digest"][:12], "--out", work / "back", "--no-progress"],
                            capsys)
    assert code == 0, err
    assert all_files(work / "back") == old_files
    code, listed, err = run_main(["snapshots"], capsys)
    assert code == 0 and "replaced by another snapshot" in listed, err


def test_a_folder_with_files_mergepipe_did_not_write_is_refused_naming_them(tiny_family, home, tmp_path,
                                                                            monkeypatch, capsys):
    work = project(tmp_path / "work", tiny_family, 0.5)
    monkeypatch.chdir(work)
    (work / "out" / "notes").mkdir(parents=True)
    (work / "out" / "notes" / "todo.txt").write_text("mine")
    (work / "out" / "weights.bin").write_text("mine too")
    code, out, err = mergepipe_yaml(["merge.yml", "out", "--quiet"], capsys)
    lines = err.strip().splitlines()
    assert code not in (0, None) and out == "" and "Traceback" not in err
    assert lines[-1] == (f"error: OUT {work / 'out'} holds files MergePipe did not write (notes/todo.txt, "
                         "weights.bin); move them away, or choose another OUT")
    assert "--out" not in err
    assert sorted(p.relative_to(work).as_posix() for p in (work / "out").rglob("*")) == [
        "out/notes", "out/notes/todo.txt", "out/weights.bin"]
    assert staging_left(work) == []

    # a snapshot MergePipe published, with a file of the user's added since: refused the same way, left as it is
    (work / "out2").mkdir()
    code, _, err = mergepipe_yaml(["merge.yml", "out2", "--quiet"], capsys)
    assert code == 0, err
    (work / "out2" / "eval.json").write_text("{}")
    before = all_files(work / "out2")
    project(work, tiny_family, 1.0, "other.yml")
    code, _, err = mergepipe_yaml(["other.yml", "out2", "--quiet"], capsys)
    assert code not in (0, None) and err.strip().splitlines()[-1] == (
        f"error: OUT {work / 'out2'} holds files MergePipe did not write (eval.json); move them away, or choose "
        "another OUT")
    assert all_files(work / "out2") == before


def test_two_projects_out_folders_are_two_models(tiny_family, home, tmp_path, monkeypatch, capsys):
    """Both projects merge into ./out in the default catalog: the second is not `out@2` of the first; its id
    has 8 hex digits of a hash of its path (as an input folder's id does), and the output says so."""
    a, b = project(tmp_path / "a", tiny_family, 0.5), project(tmp_path / "b", tiny_family, 1.0)
    monkeypatch.chdir(a)
    code, _, err = mergepipe_yaml(["merge.yml", "./out", "--quiet"], capsys)
    assert code == 0, err
    assert "model id: out (the output folder's name; --model-id to choose another)" in err.splitlines()
    monkeypatch.chdir(b)
    code, _, err = mergepipe_yaml(["merge.yml", "./out", "--quiet"], capsys)
    assert code == 0, err
    other = f"out-{hashlib.sha256(str(b / 'out').encode()).hexdigest()[:8]}"
    assert (f"model id: {other} (the output folder's name and a hash of its path: a model of that name was "
            "published from another folder; --model-id to choose another)") in err.splitlines()
    assert json.loads((b / "out" / "manifest.json").read_text())["model_id"] == other
    assert_merged(b / "out", expected(tiny_family, 1.0))
    with Catalog.open(catalog_path(home)) as catalog:
        assert [m.id for m in catalog.models.versions("out")] == ["out"]  # no out@2
        assert Path(catalog.models.get("out").uri) == a / "out" and Path(catalog.models.get(other).uri) == b / "out"

    # project b again, another config: the next version of b's model, never of a's
    project(b, tiny_family, 0.25)
    code, _, err = mergepipe_yaml(["merge.yml", "./out", "--quiet"], capsys)
    assert code == 0, err
    assert json.loads((b / "out" / "manifest.json").read_text())["model_id"] == f"{other}@2"
    assert json.loads((a / "out" / "manifest.json").read_text())["model_id"] == "out"


def test_a_missing_relative_path_says_which_folder_from_which_directory(tiny_family, home, tmp_path, monkeypatch,
                                                                        capsys):
    work = tmp_path / "work"
    work.mkdir()
    config = {"merge_method": "task_arithmetic", "base_model": "./models/base", "dtype": "float32",
              "models": [{"model": str(tiny_family["e1"]), "parameters": {"weight": 1.0}}]}
    (work / "merge.yml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(work)
    code, out, err = mergepipe_yaml(["merge.yml", "out", "--quiet"], capsys)
    assert code not in (0, None) and out == "" and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"error: model './models/base': {work / 'models' / 'base'} does not exist (read as a path, relative to the "
        f"current directory {work}); give a checkpoint's folder or a registered model id")
    assert not (work / "out").exists()
