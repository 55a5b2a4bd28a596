"""Where work units run: the ``Executor`` interface and the local one.

The engine (the coordinator) creates the staged shards, cuts the plan into
work units and hands them to an executor with the task that runs one unit;
it gets back one ``UnitRecord`` per unit, in unit order, and checks them
against the plan before anything is published. A distributed executor (a
Ray cluster, say) implements the same ``run``: units and records are small,
and a unit writes its output bytes itself, at fixed offsets.

``LocalExecutor`` runs units in this process: one after another by default
(each unit's read-ahead keeps the disk busy while torch uses the cores), or
on a few threads. The first failure cancels the units not yet started and
is raised; the coordinator then aborts the transaction.
"""

from __future__ import annotations

from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Callable, Protocol, Sequence

from mergepipe.engine.stream import UnitRecord
from mergepipe.engine.workunits import WorkUnit

#: ``task(unit)``: run one unit and return its record.
Task = Callable[[WorkUnit], UnitRecord]


class Executor(Protocol):
    """Runs every unit with ``task``; records in unit order, or the first error."""

    #: How many units run at once (they share the engine's memory bound).
    workers: int

    def run(self, units: Sequence[WorkUnit], task: Task) -> list[UnitRecord]: ...


class LocalExecutor:
    """Runs units in this process with ``workers`` threads (1: in the calling thread)."""

    def __init__(self, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers

    def run(self, units: Sequence[WorkUnit], task: Task) -> list[UnitRecord]:
        if self.workers == 1:
            return [task(unit) for unit in units]
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="mergepipe-unit") as pool:
            futures: list[Future[UnitRecord]] = [pool.submit(task, unit) for unit in units]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f in done and f.exception() is not None), None)
            if failed is not None:
                for future in futures:
                    future.cancel()
                raise failed.exception()  # type: ignore[misc]
            return [f.result() for f in futures]
