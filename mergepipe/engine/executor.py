"""Where work units run: the ``Executor`` interface and the local one.

The engine (the coordinator) creates the staged shards, cuts the plan into
work units and hands them to an executor with the task that runs one unit;
it gets back one ``UnitRecord`` per unit, in unit order, and checks them
against the plan before anything is published. A distributed executor
implements the same ``run`` (``RayExecutor``, ``ray_executor.py``): units
and records are small, and a unit writes its output bytes itself, at fixed
offsets.

``LocalExecutor`` runs units in this process: one after another by default
(each unit's read-ahead keeps the disk busy while torch uses the cores), or
on a few threads. The first failure cancels the units not yet started and
is raised; the coordinator then aborts the transaction.
"""

from __future__ import annotations

from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Callable, Protocol, Sequence

from mergepipe.engine.stream import UnitJob, UnitRecord, run_unit
from mergepipe.engine.job import WorkUnit
from mergepipe.runtime import Advance

#: ``task(unit)``: run one unit and return its record.
Task = Callable[[WorkUnit], UnitRecord]


def no_progress(nbytes: int, description: str) -> None:
    """The ``advance`` of a unit run away from the coordinator's progress bar: its executor reports the
    unit's bytes when the record comes back."""


@dataclass(frozen=True)
class UnitTask:
    """The task the engine hands an executor: ``run(unit, job, advance)`` (``stream.run_unit``) with one
    execution's shared job.

    ``job`` is plain data (no open files, no catalog, no locks; the streamed file hashers only when the
    units run in this process), so an executor that runs units in other processes ships ``detached()``
    once and reports each unit's bytes to ``advance`` itself as its record comes back."""

    job: UnitJob
    advance: Advance = no_progress
    run: Callable[[WorkUnit, UnitJob, Advance], UnitRecord] = run_unit

    def __call__(self, unit: WorkUnit) -> UnitRecord:
        return self.run(unit, self.job, self.advance)

    def detached(self) -> UnitTask:
        """This task without the coordinator's progress bar: what another process runs."""
        return replace(self, advance=no_progress)


class Executor(Protocol):
    """Runs every unit with ``task``; records in unit order, or the first error."""

    #: How many units run at once (they share the engine's memory bound).
    workers: int
    #: Whether units run in this process: they then feed the coordinator's streamed file hashes as they
    #: write; an executor that runs them elsewhere says False, and the written files are hashed after.
    in_process: bool

    def run(self, units: Sequence[WorkUnit], task: UnitTask) -> list[UnitRecord]: ...

    def status(self) -> str:
        """A short line for the progress bar while units run (units done, per-worker rates); may be empty."""
        ...


class LocalExecutor:
    """Runs units in this process with ``workers`` threads (1: in the calling thread)."""

    in_process = True

    def __init__(self, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers

    def status(self) -> str:
        return ""  # the bar's own speed is this process's

    def run(self, units: Sequence[WorkUnit], task: Task) -> list[UnitRecord]:
        if self.workers == 1:
            return [task(unit) for unit in units]
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="mergepipe-unit") as pool:
            futures: list[Future[UnitRecord]] = [pool.submit(task, unit) for unit in units]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            error = next((exc for f in futures if f in done and (exc := f.exception()) is not None), None)
            if error is not None:
                for future in futures:
                    future.cancel()
                raise error
            return [f.result() for f in futures]
