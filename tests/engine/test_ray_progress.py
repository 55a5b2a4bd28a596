"""The status line a distributed run shows beside the progress bar (mergepipe.engine.ray_executor):
units done, and each worker's output MB/s over its units' own wall time."""

from __future__ import annotations

from mergepipe.engine.ray_executor import MAX_LISTED, WorkerProgress, WorkerResult
from mergepipe.engine.stream import UnitRecord

MB = 1_000_000


def result(index: int, worker: str, written: int, seconds: float, read: dict[str, int] | None = None):
    return WorkerResult(UnitRecord(index, bytes_by_tag=read or {}, bytes_written=written), worker, seconds)


def test_nothing_to_say_before_a_run():
    assert WorkerProgress(0).status() == ""
    assert WorkerProgress(6).status() == "0/6 units"


def test_each_worker_of_one_host_by_pid_with_its_rate():
    progress = WorkerProgress(6)
    progress.add(result(0, "node-a:812", 40 * MB, 1.0, {"base": 10, "e1": 5}))
    progress.add(result(1, "node-a:815", 30 * MB, 2.0))
    progress.add(result(2, "node-a:812", 40 * MB, 1.0, {"e1": 7}))
    assert progress.units_done == 3
    assert progress.status() == "3/6 units · pid 812 40 MB/s, pid 815 15 MB/s"
    assert progress.workers["node-a:812"].bytes_read == 22
    assert progress.workers["node-a:812"].units == 2


def test_workers_of_several_hosts_by_host_and_pid():
    progress = WorkerProgress(2)
    progress.add(result(0, "node-a:1", 5 * MB, 1.0))
    progress.add(result(1, "node-b:1", 10 * MB, 1.0))
    assert progress.status() == "2/2 units · node-a:1 5 MB/s, node-b:1 10 MB/s"


def test_many_workers_are_summarised():
    progress = WorkerProgress(10)
    for i in range(MAX_LISTED + 1):  # 10, 20, 30, 40, 50 MB/s
        progress.add(result(i, f"node-{i}:7", (i + 1) * 10 * MB, 1.0))
    assert progress.status() == "5/10 units · 5 workers 10 / 30 / 50 MB/s (slowest / median / fastest)"
