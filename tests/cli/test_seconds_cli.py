"""Predicted seconds through the command line: `analyze` is all a time budget needs, every prediction says how
uncertain it is, and each merge teaches the next plan."""

from __future__ import annotations

import json
import re
import sqlite3

import pytest
import torch

from mergepipe.catalog import Catalog
from mergepipe.catalog.snapshots import host_key
from mergepipe.spec.operators import OPERATORS
from tests.fixtures.cli import invoke, run_main, wide_runner

#: ``predicted seconds`` as the tables print it: total, uncertainty, then where it comes from.
PREDICTED = re.compile(r"([\d.]+) s ± (\d+)%, start-up excluded \(fixed [\d.e+-]+ \+ experts [\d.e+-]+ \+ output "
                       r"[\d.e+-]+ s; (prior only|fitted to (\d+) merges? here)")


def test_a_time_budget_on_a_freshly_analysed_catalog_then_merges_that_teach_the_next_plan(tiny_family, tmp_path,
                                                                                          monkeypatch):
    runner = wide_runner(monkeypatch)
    db = str(tmp_path / "c.db")
    invoke(runner, ["init-db", "--db", db, "--block-bytes", "2048"])
    for name in ("base", "e1", "e2"):
        invoke(runner, ["register", "--db", db, "--model-id", name, "--uri", str(tiny_family[name])])
    invoke(runner, ["analyze", "--db", db, "--base", "base", "e1", "e2", "--no-progress"])
    with Catalog.open(db) as catalog:  # what analyze left: this host's read rate, every kernel probed
        assert catalog.timings.read_rate(host_key()) > 0
        assert set(catalog.timings.kernel_seconds(host_key(), "cpu")) == set(OPERATORS)

    args = ["--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "task_arithmetic"]
    planned = json.loads(invoke(runner, ["plan", *args, "--budget", "5s", "--json"]))
    assert planned["seconds"]["merges"] == 0 and planned["seconds"]["uncertainty"] == 0.5
    assert planned["seconds"]["total"] <= 5.0
    text = invoke(runner, ["plan", *args, "--budget", "5s"])
    match = PREDICTED.search(" ".join(text.replace("│", " ").split()))
    assert match and match.group(2) == "50" and match.group(3) == "prior only"

    for i in range(2):
        invoke(runner, ["merge", *args, "--budget", f"{50 + 25 * i}%", "--out", str(tmp_path / f"m{i}"),
                        "--model-id", f"m{i}", "--no-progress"])
    with Catalog.open(db) as catalog:
        assert len(catalog.timings.merges(host_key(), "cpu", "task_arithmetic", 10)) == 2
    text = invoke(runner, ["plan", *args, "--budget", "40%"])
    match = PREDICTED.search(" ".join(text.replace("│", " ").split()))
    assert match and match.group(4) == "2"


@pytest.mark.parametrize("device, message", [
    ("gpu", "--device must be cpu or cuda, got 'gpu'"),
    ("cuda", "no CUDA device is available"),
])
def test_a_device_that_is_not_here_is_one_line_before_any_probe(tiny_family, tmp_path, capsys, device, message):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    db = str(tmp_path / "c.db")
    code, _, err = run_main(["merge", "--db", db, "--base", str(tiny_family["base"]), "--experts",
                             str(tiny_family["e1"]), "--out", str(tmp_path / "out"), "--model-id", "m",
                             "--device", device, "--no-progress"], capsys)
    last = err.strip().splitlines()[-1]  # after the analysis the merge ran first
    assert code != 0 and last.startswith("error: ") and message in last and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("table, command", [("kernel_probes", "analyze"), ("merge_timings", "merge")])
def test_a_timing_row_the_catalog_refuses_fails_the_command_in_one_line(tiny_family, tmp_path, capsys, table,
                                                                        command):
    """A probe's or a merge's timing row is never dropped in silence: the command fails in one line, and a merge's
    row is part of its commit (which `recover` finishes once the catalog takes writes again)."""
    db = str(tmp_path / "c.db")
    for argv in (["init-db", "--db", db, "--block-bytes", "2048"],
                 *(["register", "--db", db, "--model-id", name, "--uri", str(tiny_family[name])]
                   for name in ("base", "e1"))):
        assert run_main(argv, capsys)[0] == 0
    analyze = ["analyze", "--db", db, "--base", "base", "e1", "--no-progress"]
    if command == "merge":
        assert run_main(analyze, capsys)[0] == 0
    conn = sqlite3.connect(db)
    conn.execute(f"CREATE TRIGGER full BEFORE INSERT ON {table} BEGIN SELECT RAISE(ABORT, 'database or disk is full');"
                 " END")
    conn.commit()
    merge = ["merge", "--db", db, "--base", "base", "--experts", "e1", "--operator", "task_arithmetic", "--out",
             str(tmp_path / "m"), "--model-id", "m", "--quiet"]
    code, _, err = run_main(analyze if command == "analyze" else merge, capsys)
    assert code != 0 and err.count("\n") == 1 and "the disk is full, nothing was changed" in err, err
    conn.execute("DROP TRIGGER full")
    conn.commit()
    conn.close()
    assert run_main(analyze if command == "analyze" else ["recover", "--db", db], capsys)[0] == 0
    with Catalog.open(db) as catalog:
        assert set(catalog.timings.kernel_seconds(host_key(), "cpu")) == set(OPERATORS)
        if command == "merge":  # committed by recover, which has no timing to record
            assert catalog.snapshots.of_model("m") is not None
            assert catalog.timings.merges(host_key(), "cpu", "task_arithmetic", 10) == []
