"""`merge`, `execute` and `integrate` with `--executor ray`: the snapshots of a local run, and one-line errors.

A local Ray instance (two CPUs) is started once for the module; the CLI
finds this process connected to it and uses it. Every comparison is with the
same command run by the local executor in its own copy of the catalog.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from tests.engine.test_stale_bytes import flip
from tests.fixtures.checkpoints import make_expert
from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.fixtures.ray_tasks import ray_instance
from tests.planner.support import build_catalog, clone_catalog, snapshot_files

ray = pytest.importorskip("ray")

BLOCK_BYTES = 2048
MERGE = ["--base", "base", "--experts", "e1", "e2", "e3", "--operator", "ties", "--density", "0.5",
         "--budget", "60%", "--model-id", "m", "--no-progress"]


@pytest.fixture(scope="module", autouse=True)
def ray_runtime():
    with ray_instance(ray):
        yield ray


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory):
    path = tmp_path_factory.mktemp("raycli") / "template.db"
    return build_catalog(path, BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2", "e3"])


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


def merged(runner, template, root: Path, *extra) -> tuple[dict, dict[str, bytes]]:
    """`merge` into ``root/out`` with a private catalog: its JSON summary and the output's files."""
    root.mkdir()
    db = clone_catalog(template, root / "c.db")
    invoke(runner, ["merge", "--db", db, *MERGE, "--out", root / "out", "--json-summary", root / "s.json", *extra])
    return json.loads((root / "s.json").read_text()), snapshot_files(root / "out")


@pytest.mark.parametrize("extra", [["--executor", "ray", "--workers", "2"], ["--executor", "ray"],
                                   ["--workers", "2"]], ids=["ray-2", "ray-default-workers", "local-2-threads"])
def test_merge_publishes_the_local_snapshot(runner, template, tmp_path, extra):
    local = merged(runner, template, tmp_path / "local")
    other = merged(runner, template, tmp_path / "other", *extra)
    for key in ("snapshot_id", "manifest_hash", "plan_id", "realized"):
        assert other[0][key] == local[0][key], key
    assert other[1] == local[1]


def test_execute_a_stored_plan_on_ray(runner, template, tmp_path):
    db = clone_catalog(template, tmp_path / "c.db")
    out = invoke(runner, ["plan", "--db", db, *[a for a in MERGE if a not in ("--model-id", "m")], "--save"])
    plan_id = out.strip().splitlines()[-1].split()[-1]
    local_db = clone_catalog(db, tmp_path / "local.db")
    invoke(runner, ["execute", "--db", local_db, "--plan", plan_id, "--out", tmp_path / "local", "--model-id", "m",
                    "--no-progress", "--json-summary", tmp_path / "local.json"])
    invoke(runner, ["execute", "--db", db, "--plan", plan_id, "--out", tmp_path / "ray", "--model-id", "m",
                    "--no-progress", "--json-summary", tmp_path / "ray.json", "--executor", "ray", "--workers", "2"])
    local, far = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("local", "ray"))
    assert (far["snapshot_id"], far["manifest_hash"]) == (local["snapshot_id"], local["manifest_hash"])
    assert snapshot_files(tmp_path / "ray") == snapshot_files(tmp_path / "local")


def test_integrate_on_ray_publishes_the_versions_a_local_run_does(tiny_family, runner, tmp_path):
    """Two iterations of a recipe, v1 and then v2 merged incrementally from v1 after e1 is retrained in place,
    run by Ray and by the local executor, each in its own copy of the experts and catalog."""
    published = {}
    for name, extra in (("local", []), ("ray", ["--executor", "ray", "--workers", "2"])):
        root = tmp_path / name
        for expert in ("e1", "e2"):
            shutil.copytree(tiny_family[expert], root / "experts" / expert)
        recipe = root / "recipe.yml"
        recipe.write_text(json.dumps({"base": str(tiny_family["base"]), "experts": {"e1": "experts/e1",
                                      "e2": "experts/e2"}, "operator": "ties", "params": {"density": 0.5},
                                      "output": {"root": "deploy", "model_id": "merged"}}))  # JSON is YAML
        first = invoke(runner, ["integrate", "--db", root / "c.db", recipe, "--no-progress", *extra])
        retrained = make_expert(root / "experts" / "e1", root / "e1-new", seed=9, touch=lambda n: ".layers.1." in n)
        shutil.copy(retrained / "model.safetensors", root / "experts" / "e1" / "model.safetensors")
        second = invoke(runner, ["integrate", "--db", root / "c.db", recipe, "--no-progress", *extra])
        assert "published merged" in first and "e1@2" in second and "published merged@2" in second
        assert "reused" in second  # incrementally, from v1
        published[name] = [snapshot_files(root / "deploy" / f"merged-v{v}") for v in (1, 2)]
    assert published["ray"] == published["local"]
    assert published["local"][0] != published["local"][1]


def test_a_unit_failing_on_a_worker_is_one_error_line(tiny_family, tmp_path, capsys):
    family = {name: Path(shutil.copytree(tiny_family[name], tmp_path / name)) for name in ("base", "e1", "e2")}
    db = tmp_path / "c.db"
    with Catalog.create(db, BLOCK_BYTES) as catalog:
        for name, path in family.items():
            register_model(catalog, name, path)
        analyze(catalog, ["e1", "e2"], base_id="base", progress=False)
    tensor = "model.layers.1.mlp.down_proj.weight"
    flip(family["e1"], tensor, 0)  # read at 100%: every changed block of e1 is planned
    out = tmp_path / "out"
    code, stdout, stderr = run_main(["merge", "--db", db, "--base", "base", "--experts", "e1", "e2", "--operator",
                                     "ties", "--density", "0.5", "--model-id", "m", "--out", out, "--no-progress",
                                     "--executor", "ray", "--workers", "2"], capsys)
    assert code == 1
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "model 'e1' changed on disk" in lines[0] and tensor in lines[0], stderr
    assert "Traceback" not in stderr
    assert not out.exists()
    with Catalog.open(db) as catalog:
        assert [s.status for s in catalog.snapshots.list()] == ["aborted"]
        assert not catalog.models.exists("m")


def test_ray_address_needs_the_ray_executor(template, tmp_path, capsys):
    db = clone_catalog(template, tmp_path / "c.db")
    code, _, stderr = run_main(["merge", "--db", db, *MERGE, "--out", tmp_path / "out", "--ray-address", "auto"],
                               capsys)
    assert code == 2 and "error: --ray-address needs --executor ray" in stderr
    assert not (tmp_path / "out").exists()


def test_without_ray_the_error_names_the_extra(template, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    db = clone_catalog(template, tmp_path / "c.db")
    code, _, stderr = run_main(["merge", "--db", db, *MERGE, "--out", tmp_path / "out", "--executor", "ray"], capsys)
    assert code == 2
    assert "error: --executor ray needs Ray, which is not installed: pip install 'mergepipe[ray]'" in stderr
    assert not (tmp_path / "out").exists()
    with Catalog.open(db) as catalog:
        assert not catalog.models.exists("m") and catalog.snapshots.list() == []
