"""What a distributed run's progress bar says beside the bytes: units done and each worker's throughput.

The engine's bar already shows the aggregate (output bytes and MB/s, time
left); a distributed executor adds, from the records its tasks return, how
many units are done and how fast each worker process writes its units'
output (bytes per second of the units' own wall time on that worker), so a
slow node or a throttled disk stands out. Benchmarks read the same figures
(``WorkerProgress.workers``) for per-worker rates.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from mergepipe.engine.stream import UnitRecord

#: Workers listed one by one on the status line; more are summarised (slowest, median, fastest).
MAX_LISTED = 4


@dataclass(frozen=True)
class WorkerResult:
    """What a task returns: the unit's record, the worker process that ran it (``host:pid``) and the
    unit's wall seconds there."""

    record: UnitRecord
    worker: str
    seconds: float


@dataclass
class WorkerStats:
    """One worker process's units so far."""

    units: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def mb_per_second(self) -> float:
        """Output MB written per second of its units' wall time."""
        return self.bytes_written / max(self.seconds, 1e-9) / 1e6


@dataclass
class WorkerProgress:
    """Units done of ``total_units`` and the stats of every worker that finished one."""

    total_units: int
    workers: dict[str, WorkerStats] = field(default_factory=dict)

    @property
    def units_done(self) -> int:
        return sum(w.units for w in self.workers.values())

    def add(self, result: WorkerResult) -> None:
        stats = self.workers.setdefault(result.worker, WorkerStats())
        stats.units += 1
        stats.bytes_written += result.record.bytes_written
        stats.bytes_read += sum(result.record.bytes_by_tag.values())
        stats.seconds += result.seconds

    def status(self) -> str:
        """``7/24 units · pid 812 41 MB/s, pid 815 39 MB/s`` (many workers: slowest, median, fastest)."""
        if not self.total_units:
            return ""
        head = f"{self.units_done}/{self.total_units} units"
        if not self.workers:
            return head
        hosts = {name.rsplit(":", 1)[0] for name in self.workers}
        rates = {(f"pid {name.rsplit(':', 1)[1]}" if len(hosts) == 1 else name): w.mb_per_second
                 for name, w in self.workers.items()}
        if len(rates) <= MAX_LISTED:
            return head + " · " + ", ".join(f"{name} {rate:.0f} MB/s" for name, rate in sorted(rates.items()))
        values = sorted(rates.values())
        return (f"{head} · {len(values)} workers {values[0]:.0f} / {statistics.median(values):.0f} / "
                f"{values[-1]:.0f} MB/s (slowest / median / fastest)")
