"""Two merges into one catalog at the same time both commit.

Each merge runs in its own process (forked children of one runner, see
tests/planner/support.py ``run_forked``). A barrier holds every process
right after it has staged until all have, so the publishes truly overlap:
two live intents, two staging directories, two commits racing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mergepipe.catalog import Catalog
from mergepipe.cli import main
from mergepipe.planner.planner import Planner
from mergepipe.txn.verify import verify_snapshot
from mergepipe.spec.request import MergeRequest
from tests.planner.support import build_catalog, load_tensors, run_forked

BLOCK_BYTES = 2048


def test_two_engine_merges_at_once_both_commit(tiny_family, tmp_path):
    db = build_catalog(tmp_path / "catalog.db", BLOCK_BYTES, dict(tiny_family), base="base",
                       experts=["e1", "e2", "e3"])
    plans = []
    with Catalog.open(db) as catalog:
        plans.append(Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", params={"density": 0.5}, budget="50%")))
        plans.append(Planner(catalog).plan(MergeRequest(base="base", experts=["e2", "e3"], operator="task_arithmetic", budget="100%")))
    jobs = []
    for i, plan in enumerate(plans):
        (tmp_path / f"plan{i}.json").write_text(plan.to_json_str())
        jobs.append({"db": str(db), "plan": str(tmp_path / f"plan{i}.json"), "out": str(tmp_path / "out" / f"m{i}"),
                     "model_id": f"m{i}", "barrier": str(tmp_path / "barrier"), "parties": 2})
    results = run_forked(jobs, tmp_path / "runner")
    assert all(r["code"] == 0 for r in results), results[0]["log"]
    assert len(list((tmp_path / "barrier").iterdir())) == 2
    with Catalog.open(db) as catalog:
        snapshots = catalog.snapshots.list()
        assert sorted((s.model_id, s.status) for s in snapshots) == [("m0", "committed"), ("m1", "committed")]
        for i, result in enumerate(results):
            record = next(s for s in snapshots if s.model_id == f"m{i}")
            assert record.id == result["result"]["snapshot_id"]
            assert record.manifest_hash == result["result"]["manifest_hash"]
            assert catalog.models.exists(f"m{i}")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["m0", "m1"]
    for i in range(2):
        assert verify_snapshot(tmp_path / "out" / f"m{i}").ok


def test_two_cli_merges_at_once_both_commit(tiny_family, tmp_path):
    """On-the-fly registration of the same paths, their analysis and the
    publishes all race; both merges must still commit."""
    db = tmp_path / "catalog.db"
    main(["init-db", "--db", str(db), "--block-bytes", "2KiB"])
    jobs = []
    for i, experts in enumerate((["e1", "e2"], ["e2", "e3"])):
        argv = ["merge", "--db", str(db), "--base", str(tiny_family["base"]),
                "--experts", *[str(tiny_family[e]) for e in experts],
                "--out", str(tmp_path / "out" / f"cli{i}"), "--model-id", f"cli{i}",
                "--budget", "40%", "--density", "0.5", "--no-progress",
                "--json-summary", str(tmp_path / f"summary{i}.json")]
        jobs.append({"argv": argv, "barrier": str(tmp_path / "barrier"), "parties": 2})
    results = run_forked(jobs, tmp_path / "runner")
    assert all(r["code"] == 0 for r in results), results[0]["log"]
    with Catalog.open(db) as catalog:
        committed = {s.model_id: s for s in catalog.snapshots.list() if s.status == "committed"}
        assert set(committed) == {"cli0", "cli1"}
        assert catalog.snapshots.pending() == []
        for i in range(2):
            summary = json.loads((tmp_path / f"summary{i}.json").read_text())
            assert committed[f"cli{i}"].id == summary["snapshot_id"]
            assert summary["realized"]["expert_bytes"] <= summary["planned"]["expert_bytes"] <= summary["budget_bytes"]
    for i in range(2):
        out = tmp_path / "out" / f"cli{i}"
        assert verify_snapshot(out).ok
        assert set(load_tensors(out)) == set(load_tensors(tiny_family["base"]))


def test_an_empty_db_file_is_refused_not_turned_into_a_catalog(tiny_family, tmp_path, capsys):
    """Catalogs are created complete (built beside, linked into place), so an
    empty file is never one being created: it is someone's file, and only
    `init-db` makes it a catalog."""
    db = tmp_path / "fresh.db"
    db.touch()
    argv = ["merge", "--db", str(db), "--base", str(tiny_family["base"]), "--experts", str(tiny_family["e1"]),
            "--out", str(tmp_path / "out"), "--model-id", "m", "--no-progress"]
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code != 0 and err.count("\n") == 1
    assert f"{db} is an empty file, not a MergePipe catalog; run `mergepipe init-db --db {db}`" in err
    assert db.stat().st_size == 0 and not (tmp_path / "out").exists()
    main(["init-db", "--db", str(db)])
    main(argv)
    assert verify_snapshot(tmp_path / "out").ok


def test_processes_creating_one_catalog_at_once_share_it(tmp_path):
    """The creation race: every creator builds its own file; the first link wins, the others open it."""
    db = tmp_path / "shared.db"
    script = (
        "import sys; from mergepipe.catalog import Catalog\n"
        "with Catalog.create(sys.argv[1]) as c: print(c._db.meta()['created_at'])\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(db)], stdout=subprocess.PIPE, text=True)
             for _ in range(6)]
    outputs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outputs)) == 1  # one catalog, created once
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("shared.db")) == []
