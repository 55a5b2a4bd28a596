"""Many processes, one PostgreSQL catalog: concurrent merges all commit, one model id has one winner.

(The SIGKILL cases of ``test_crash.py`` run on a server catalog too.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mergepipe.catalog import Catalog
from mergepipe.errors import CatalogError
from mergepipe.txn.recover import recover
from mergepipe.txn.verify import verify_snapshot
from tests.fixtures.cli import invoke, wide_runner
from tests.fixtures.postgres import postgres_server, postgres_url  # noqa: F401 (fixtures)
from tests.manifest.factories import sha
from tests.txn.conftest import catalog_parents, make_catalog
from tests.txn.helpers import PLAN, publish_snapshot

WRITERS = 8


def merge_args(db: str, seed: int, out: Path, model_id: str) -> list[str]:
    return ["merge", "--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "dare_ties",
            "--density", "0.5", "--seed", str(seed), "--out", str(out), "--model-id", model_id, "--no-progress"]


def test_eight_processes_merging_into_different_outputs_all_commit(tmp_path, tiny_family, postgres_url,
                                                                   monkeypatch):
    runner = wide_runner(monkeypatch)
    invoke(runner, ["init-db", "--db", postgres_url, "--block-bytes", "1KiB"])
    for model_id in ("base", "e1", "e2"):
        invoke(runner, ["register", "--db", postgres_url, "--model-id", model_id, "--uri", tiny_family[model_id]])
    invoke(runner, ["analyze", "--db", postgres_url, "--base", "base", "e1", "e2", "--no-progress"])

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    children = [subprocess.Popen([sys.executable, "-m", "mergepipe", *merge_args(postgres_url, seed, tmp_path /
                                  f"out{seed}", f"m{seed}")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env) for seed in range(WRITERS)]
    for child in children:
        _, err = child.communicate(timeout=600)
        assert child.returncode == 0, err

    snapshots = json.loads(invoke(runner, ["snapshots", "--db", postgres_url, "--json"]))
    assert sorted((s["model_id"], s["status"]) for s in snapshots) == [(f"m{i}", "committed") for i in range(WRITERS)]
    assert len({s["plan_id"] for s in snapshots}) == WRITERS  # eight seeds, eight plans
    for seed in range(WRITERS):
        check = verify_snapshot(tmp_path / f"out{seed}")
        assert check.ok and check.manifest is not None and check.manifest.model_id == f"m{seed}"
    # the reference: the same merge against a SQLite catalog on its own gives the same snapshot
    sqlite_db = str(tmp_path / "alone.db")
    invoke(runner, ["init-db", "--db", sqlite_db, "--block-bytes", "1KiB"])
    for model_id in ("base", "e1", "e2"):
        invoke(runner, ["register", "--db", sqlite_db, "--model-id", model_id, "--uri", tiny_family[model_id]])
    invoke(runner, merge_args(sqlite_db, 3, tmp_path / "alone", "m3"))
    assert verify_snapshot(tmp_path / "alone").manifest.snapshot_id == \
        verify_snapshot(tmp_path / "out3").manifest.snapshot_id
    with Catalog.open(postgres_url) as catalog:
        assert not recover(catalog).changed and catalog.snapshots.pending() == []


def test_two_processes_publishing_one_model_id_one_wins_nothing_is_lost(tmp_path, postgres_url):
    """A (another process) has recorded its intent for 'same' and is writing; B publishing 'same' from
    another plan meanwhile is refused in one line, leaves nothing behind, and A then commits."""
    catalog = make_catalog(tmp_path, postgres_url)
    other_plan = sha("another plan")
    catalog.plans.save(other_plan, catalog.plans.get(PLAN))
    parents = catalog_parents(catalog)
    staged, go = tmp_path / "a-staged", tmp_path / "a-go"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pid = os.fork()
    if pid == 0:  # process A: parks after its intent is recorded and its files are being written
        try:
            def park(step: str) -> None:
                if step == "written":
                    staged.touch()
                    while not go.exists():
                        time.sleep(0.01)

            with Catalog.open(postgres_url) as own:
                publish_snapshot(own, tmp_path / "a" / "same", "same", parents, on_step=park)
            os._exit(0)
        finally:
            os._exit(70)
    try:
        deadline = time.monotonic() + 60
        while not staged.exists():
            assert time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0), "A did not stage"
            time.sleep(0.01)
        with Catalog.open(postgres_url) as process_b:  # B: its own connection, as another process has
            with pytest.raises(CatalogError) as info:
                publish_snapshot(process_b, tmp_path / "b" / "same", "same", parents, plan=other_plan)
        message = str(info.value)
        assert "\n" not in message and message.startswith("a merge into model 'same' is already in progress")
        assert sorted(os.listdir(tmp_path / "b")) == []  # B's staging directory is gone, no output
    finally:
        go.touch()
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    (winner,) = catalog.snapshots.list()  # B recorded nothing; A committed
    assert (winner.model_id, winner.status, winner.plan_id) == ("same", "committed", PLAN)
    assert verify_snapshot(tmp_path / "a" / "same").ok
    assert not recover(catalog).changed
    catalog.close()
