"""Where work units run (mergepipe.engine.stream.LocalExecutor), and that
running them on several threads changes nothing in what is published."""

from __future__ import annotations

import threading
import time

import pytest

import mergepipe.engine.engine as engine_module
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.engine.stream import LocalExecutor
from mergepipe.engine.stream import UnitRecord
from mergepipe.engine.job import WorkUnit, cut_units
from mergepipe.planner.planner import Planner
from mergepipe.storage.checkpoint import open_checkpoint
from mergepipe.spec.request import MergeRequest
from tests.planner.support import build_catalog, clone_catalog, snapshot_files

BLOCK_BYTES = 2048
#: Small enough that the sharded family is cut into many units.
UNIT_BYTES = 4096


def units(n: int) -> list[WorkUnit]:
    return [WorkUnit(i, "model.safetensors", (f"t{i}",), 1) for i in range(n)]


# ---------------------------------------------------------------- LocalExecutor


@pytest.mark.parametrize("workers", [1, 3])
def test_records_come_back_in_unit_order(workers):
    """Later units finish first (shorter sleeps); the records are still in unit order."""
    finished: list[int] = []
    lock = threading.Lock()
    delay = 0.01 if workers > 1 else 0.0  # one worker runs them in order anyway

    def task(unit: WorkUnit) -> UnitRecord:
        time.sleep(delay * (8 - unit.index))
        with lock:
            finished.append(unit.index)
        return UnitRecord(unit.index, bytes_written=10 * unit.index)

    records = LocalExecutor(workers).run(units(8), task)
    assert [r.index for r in records] == list(range(8))
    assert [r.bytes_written for r in records] == [10 * i for i in range(8)]
    assert sorted(finished) == list(range(8))
    if workers > 1:
        assert finished != list(range(8))  # the order really was shuffled


def test_one_worker_raises_the_first_failure_and_starts_nothing_after_it():
    started: list[int] = []

    def task(unit: WorkUnit) -> UnitRecord:
        started.append(unit.index)
        if unit.index in (2, 4):
            raise RuntimeError(f"unit {unit.index} failed")
        return UnitRecord(unit.index)

    with pytest.raises(RuntimeError, match="unit 2 failed"):
        LocalExecutor(1).run(units(6), task)
    assert started == [0, 1, 2]


def test_several_workers_raise_the_failure_and_cancel_units_not_started():
    started: list[int] = []
    lock = threading.Lock()

    def task(unit: WorkUnit) -> UnitRecord:
        with lock:
            started.append(unit.index)
        if unit.index == 0:
            raise RuntimeError("unit 0 failed")
        time.sleep(0.05)
        return UnitRecord(unit.index)

    with pytest.raises(RuntimeError, match="unit 0 failed"):
        LocalExecutor(3).run(units(30), task)
    assert 0 in started and len(started) < 30


@pytest.mark.parametrize("workers", [0, -2])
def test_workers_must_be_at_least_one(workers):
    with pytest.raises(ValueError, match="at least 1"):
        LocalExecutor(workers)


# --------------------------------------------------------------- whole merges


@pytest.fixture(scope="module")
def sharded_template(sharded_family, tmp_path_factory):
    path = tmp_path_factory.mktemp("executor") / "template.db"
    return build_catalog(path, BLOCK_BYTES, dict(sharded_family), base="base", experts=["e1", "e2"])


@pytest.fixture(scope="module")
def plan(sharded_template, tmp_path_factory):
    """A budgeted DARE-TIES plan: merged blocks, copied blocks and copied tensors."""
    db = clone_catalog(sharded_template, tmp_path_factory.mktemp("executor-plan") / "c.db")
    with Catalog.open(db) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="dare_ties", weights=[1.0, 0.6], params={"density": 0.5}, seed=3, budget="60%"))
    assert 0 < plan.cost.expert_bytes < plan.cost.full_expert_bytes
    return plan


def _execute(template, plan, root, **engine_kwargs):
    """The plan executed in a private copy of the catalog (a plan runs once per catalog)."""
    root.mkdir()
    with Catalog.open(clone_catalog(template, root / "c.db")) as catalog:
        snapshot_id, manifest = Engine(catalog, **engine_kwargs).execute(plan, out=root / "out", model_id="m")
    return snapshot_id, manifest, snapshot_files(root / "out")


def test_three_workers_publish_the_bytes_and_snapshot_of_one(sharded_family, sharded_template, plan, tmp_path,
                                                             monkeypatch):
    assert len(cut_units(open_checkpoint(sharded_family["base"]), UNIT_BYTES)) >= 10
    one = _execute(sharded_template, plan, tmp_path / "one", executor=LocalExecutor(1), unit_bytes=UNIT_BYTES)

    # the first two units wait for each other: three workers must run them at once
    barrier = threading.Barrier(2, timeout=30)
    threads: set[str] = set()
    real_run_unit = engine_module.run_unit

    def run_unit(unit, job, advance):
        threads.add(threading.current_thread().name)
        if unit.index < 2:
            barrier.wait()
        return real_run_unit(unit, job, advance)

    monkeypatch.setattr(engine_module, "run_unit", run_unit)
    three = _execute(sharded_template, plan, tmp_path / "three", executor=LocalExecutor(3), unit_bytes=UNIT_BYTES)
    monkeypatch.undo()
    assert len(threads) >= 2 and all(name.startswith("mergepipe-unit") for name in threads)

    # and one unit per shard (the default size) gives the same again
    default = _execute(sharded_template, plan, tmp_path / "default")

    for snapshot_id, manifest, files in (three, default):
        assert snapshot_id == one[0]
        assert files == one[2]
        assert manifest.files == one[1].files
        assert manifest.cost.realized.expert_bytes_by_model == one[1].cost.realized.expert_bytes_by_model
        assert manifest.cost.realized.base_bytes == one[1].cost.realized.base_bytes
        assert manifest.cost.realized.output_bytes == one[1].cost.realized.output_bytes
