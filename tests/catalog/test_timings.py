"""The catalog's timings (catalog/snapshots.py, TimingStore): analysis reads, kernel probes and merges, per machine, and the
migration that brought them (the calibrated rates' table dropped)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from mergepipe.catalog import Catalog, schema
from mergepipe.catalog.snapshots import READ_RUNS, host_key
from mergepipe.catalog.records import Timing


def clock_from(start: float = 1_000_000.0):
    """A clock that moves one second per call, so rows are ordered as written."""
    now = [start]

    def tick() -> float:
        now[0] += 1.0
        return now[0]

    return tick


@pytest.fixture
def ticking(tmp_path: Path):
    with Catalog.create(tmp_path / "c.db", clock=clock_from()) as catalog:
        yield catalog


def test_the_host_is_this_machine_s_name_and_cores():
    assert host_key() == f"{socket.gethostname()}/{os.cpu_count()} cpus"


def test_the_read_rate_weighs_the_last_runs_by_their_bytes(ticking):
    assert ticking.timings.read_rate("h") is None
    ticking.timings.add_read("h", 100, 1.0)  # the oldest: left out once READ_RUNS newer ones exist
    for i in range(READ_RUNS):
        ticking.timings.add_read("h", 1000 * (i + 1), 2.0)
    ticking.timings.add_read("other", 10**9, 1.0)
    newest = [1000 * (i + 1) for i in range(READ_RUNS)]
    assert ticking.timings.read_rate("h") == pytest.approx(sum(newest) / (2.0 * READ_RUNS))


def test_kernels_are_kept_per_host_and_device_and_a_new_probe_replaces_the_old(ticking):
    ticking.timings.add_kernels("h", "cpu", {"ties": 2e-9, "task_arithmetic": 5e-10})
    ticking.timings.add_kernels("h", "cuda", {"ties": 1e-11})
    ticking.timings.add_kernels("h", "cpu", {"ties": 3e-9})
    assert ticking.timings.kernel_seconds("h", "cpu") == {"ties": 3e-9, "task_arithmetic": 5e-10}
    assert ticking.timings.kernel_seconds("h", "cuda") == {"ties": 1e-11}
    assert ticking.timings.kernel_seconds("other", "cpu") == {}


def test_merges_are_returned_newest_first_for_one_host_device_and_operator(ticking):
    rows = [Timing(10 * i, 100, 1.0 + i) for i in range(5)]
    for i, row in enumerate(rows):
        ticking.timings.add_merge(f"intent-{i}", "h", "cpu", "ties", row)
    ticking.timings.add_merge("intent-x", "h", "cpu", "task_arithmetic", Timing(1, 1, 1.0))
    ticking.timings.add_merge("intent-y", "h", "cuda", "ties", Timing(1, 1, 1.0))
    ticking.timings.add_merge("intent-z", "g", "cpu", "ties", Timing(1, 1, 1.0))
    assert ticking.timings.merges("h", "cpu", "ties", 3) == rows[::-1][:3]
    assert ticking.timings.merges("h", "cpu", "ties", 100) == rows[::-1]


def test_migration_11_adds_the_timings_and_drops_the_calibrated_rates(tmp_path: Path, monkeypatch):
    path = tmp_path / "c.db"
    previous = tuple(m for m in schema.MIGRATIONS if m.version < 11)
    monkeypatch.setattr(schema, "MIGRATIONS", previous)
    with Catalog.create(path) as old:
        assert old.schema_version == 10
        with old.transaction():
            old._db.write("INSERT INTO rates (machine, name, value, samples, updated_at) "
                          "VALUES ('m', 'write', 1, 0, 't')")
    monkeypatch.undo()
    with Catalog.open(path) as catalog:
        assert catalog.schema_version == schema.MIGRATIONS[-1].version
        tables = {r[0] for r in catalog._db.query("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert {"analyze_reads", "kernel_probes", "merge_timings"} <= tables and "rates" not in tables
        catalog.timings.add_merge("i", "h", "cpu", "ties", Timing(1, 2, 3.0))
        assert catalog.timings.merges("h", "cpu", "ties", 1) == [Timing(1, 2, 3.0)]
