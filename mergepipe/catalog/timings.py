"""What this catalog saw take time, per machine: analysis's reads, kernel probes, and every merge.

The time model (``spec/time_model.py``) is fitted to these rows, so a catalog
predicts from its own history on the machine asking. A machine is its host
(``host_key``: hostname and CPU count) and, for kernels and merges, the
device they ran on (``cpu``, ``cuda``, ``cuda:1`` as given); two machines
sharing a catalog file keep their own rows, and a GPU merge never learns
from CPU ones. Analysis reads on the CPU, so its rows are the host's.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Mapping

from mergepipe.catalog.database import Database
from mergepipe.catalog.records import Timing

#: The most recent analysis runs a read rate is taken over: a disk or machine that changed shows within a few.
READ_RUNS = 20


def host_key() -> str:
    """``hostname/N cpus``: the rows of timings that apply to work done on this host."""
    return f"{socket.gethostname()}/{os.cpu_count() or 1} cpus"


class TimingStore:
    """The ``analyze_reads``, ``kernel_probes`` and ``merge_timings`` tables."""

    def __init__(self, db: Database, now: Callable[[], str]) -> None:
        self._db = db
        self._now = now

    # ---------------------------------------------------------------- analysis

    def add_read(self, host: str, bytes_read: int, seconds: float) -> None:
        """One analysis run (a fresh id: two runs may share a timestamp): ``bytes_read`` read and checked in
        ``seconds`` of reading."""
        with self._db.transaction():
            self._db.write("INSERT INTO analyze_reads (id, host, recorded_at, bytes_read, seconds) "
                           "VALUES (?, ?, ?, ?, ?)", (uuid.uuid4().hex, host, self._now(), bytes_read, seconds))

    def read_rate(self, host: str) -> float | None:
        """Bytes per second analysis read on ``host`` (its last ``READ_RUNS`` runs, weighted by bytes); None
        when it never analysed here."""
        row = self._db.query_one(
            "SELECT SUM(bytes_read), SUM(seconds) FROM (SELECT bytes_read, seconds FROM analyze_reads WHERE host = ? "
            "ORDER BY recorded_at DESC LIMIT ?) AS recent", (host, READ_RUNS))
        return None if row is None or not row[0] else float(row[0]) / float(row[1])

    # ---------------------------------------------------------------- kernels

    def add_kernels(self, host: str, device: str, seconds_per_element: Mapping[str, float]) -> None:
        """Probed kernels (``engine/probe.py``): operator -> seconds per element and expert on ``device``."""
        now = self._now()
        with self._db.transaction():
            self._db.write_many(
                "INSERT INTO kernel_probes (host, device, operator, seconds_per_element, recorded_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (host, device, operator) DO UPDATE SET "
                "seconds_per_element = excluded.seconds_per_element, recorded_at = excluded.recorded_at",
                [(host, device, op, value, now) for op, value in sorted(seconds_per_element.items())])

    def kernel_seconds(self, host: str, device: str) -> dict[str, float]:
        """Operator -> its probed seconds per element and expert on ``device`` of ``host``."""
        return dict(self._db.query("SELECT operator, seconds_per_element FROM kernel_probes "
                                   "WHERE host = ? AND device = ?", (host, device)))

    # ---------------------------------------------------------------- merges

    def add_merge(self, intent_id: str, host: str, device: str, operator: str, timing: Timing) -> None:
        """One merge (the publish intent that ran it) and what it took."""
        with self._db.transaction():
            self._db.write(
                "INSERT INTO merge_timings (intent_id, host, device, operator, expert_bytes, output_bytes, seconds, "
                "recorded_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (intent_id, host, device, operator, timing.expert_bytes, timing.output_bytes, timing.seconds,
                 self._now()))

    def merges(self, host: str, device: str, operator: str, limit: int) -> list[Timing]:
        """The last ``limit`` merges of ``operator`` on ``device`` of ``host``, newest first."""
        rows = self._db.query(
            "SELECT expert_bytes, output_bytes, seconds FROM merge_timings WHERE host = ? AND device = ? AND "
            "operator = ? ORDER BY recorded_at DESC LIMIT ?", (host, device, operator, limit))
        return [Timing(int(e), int(o), float(s)) for e, o, s in rows]
