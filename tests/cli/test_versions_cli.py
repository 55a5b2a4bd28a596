"""Versions through the CLI: register --new-version, models/show, @N everywhere, lineage history, gc."""

from __future__ import annotations

import pytest

from tests.fixtures.checkpoints import make_expert
from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.planner.support import build_catalog


@pytest.fixture
def db(tiny_family, tmp_path):
    return build_catalog(tmp_path / "c.db", 2048, {m: tiny_family[m] for m in ("base", "e1", "e2")})


@pytest.fixture
def retrained(tiny_family, tmp_path):
    return make_expert(tiny_family["e1"], tmp_path / "e1-v2", seed=5, touch=lambda n: ".layers.0." in n)


def test_a_retrained_expert_becomes_version_2(db, retrained, tiny_family, tmp_path, monkeypatch, capsys):
    runner = wide_runner(monkeypatch)
    code, _, err = run_main(["register", "--db", db, "--model-id", "e1", "--uri", retrained], capsys)
    assert code == 1 and err.count("\n") == 1 and "--new-version" in err
    out = invoke(runner, ["register", "--db", db, "--model-id", "e1", "--uri", retrained, "--new-version"])
    assert out.startswith("registered 'e1@2' (version 2 of 'e1'):")
    again = invoke(runner, ["register", "--db", db, "--model-id", "e1", "--uri", retrained, "--new-version"])
    assert "nothing to do" in again and "e1@2" in again
    invoke(runner, ["analyze", "--db", db, "--no-progress"])  # hashes every model's latest version
    invoke(runner, ["analyze", "--db", db, "--no-progress", "e1@1"])
    models = invoke(runner, ["models", "--db", db])
    assert "e1@1" in models and "e1@2" in models
    show = invoke(runner, ["show", "--db", db, "e1"])
    assert "e1@2" in show and "versions of 'e1'" in show and "tensors changed" in show
    # a plan of e1@1 and one of e1 (= e1@2) name different exact versions
    for ref, out_dir in (("e1@1", "m1"), ("e1", "m2")):
        invoke(runner, ["merge", "--db", db, "--base", "base", "--experts", ref, "e2", "--operator",
                        "task_arithmetic", "--out", tmp_path / out_dir, "--model-id", "merged", "--no-progress"])
    lineage = invoke(runner, ["lineage", "--db", db, "merged"])
    lines = lineage.splitlines()
    assert lines[0].strip() == "merged@2"
    assert any("e1@2" in line and "expert" in line for line in lines)
    assert any("merged@1" in line and "previous version" in line for line in lines)
    assert any("e1@1" in line and "expert" in line for line in lines)  # the previous version's parents
    explained = invoke(runner, ["explain", "--db", db, "merged@1"])
    assert "e1" in explained
    dry = invoke(runner, ["gc", "--db", db, "--versions"])
    assert "no old versions" in dry  # e1@1 is a parent of merged@1
    assert (tiny_family["e1"] / "model.safetensors").exists()


def test_gc_versions_lists_then_drops(db, retrained, tmp_path, monkeypatch):
    runner = wide_runner(monkeypatch)
    invoke(runner, ["register", "--db", db, "--model-id", "e1", "--uri", retrained, "--new-version"])
    dry = invoke(runner, ["gc", "--db", db, "--versions"])
    assert "e1@1" in dry and "--yes" in dry
    assert "e1@1" in invoke(runner, ["models", "--db", db])
    done = invoke(runner, ["gc", "--db", db, "--versions", "--yes"])
    assert "dropped 1 old version" in done
    models = invoke(runner, ["models", "--db", db])
    assert "e1@1" not in models and "e1@2" in models


def test_analyze_of_a_new_version_says_what_it_inherited(db, retrained, monkeypatch):
    runner = wide_runner(monkeypatch)
    invoke(runner, ["analyze", "--db", db, "--base", "base", "--no-progress", "e1"])
    invoke(runner, ["register", "--db", db, "--model-id", "e1", "--uri", retrained, "--new-version"])
    out = invoke(runner, ["analyze", "--db", db, "--base", "base", "--no-progress", "e1"])
    assert "analysed e1@2 against 'base'" in out
    assert "e1@2: analysed 9 of 21 tensors (12 unchanged from its previous version" in out


def test_gc_removes_what_killed_delta_store_builds_left_beside_the_catalog_s_stores(db, tmp_path, monkeypatch):
    runner = wide_runner(monkeypatch)
    stores = tmp_path / "stores"
    built = invoke(runner, ["analyze", "--db", db, "--base", "base", "--store-deltas", stores, "--no-progress", "e1"])
    assert "delta store of 'e1'" in built
    (store,) = stores.iterdir()
    killed = stores / ".e2--base-0123abcd.mpdelta.writing"  # as a SIGKILLed build leaves it (nobody holds its lock)
    killed.write_bytes(b"MPDELTA1 half a store")
    mine = stores / "notes.writing"
    mine.write_text("a user's file")
    done = invoke(runner, ["gc", "--db", db])
    assert f"removed {killed}: left by a delta-store build that was killed" in done
    assert sorted(stores.iterdir()) == sorted([store, mine])
    assert "delta-store" not in invoke(runner, ["gc", "--db", db])  # nothing left to remove
