"""Measured rates of the cost model, per machine key (``mergepipe/machine.py``).

A catalog keeps its own rates, so a second catalog on the same machine sees
none until it is calibrated: a catalog on another disk reads at other rates.
``calibrate`` replaces a machine's rows; every merge then moves the rates it
measured (``spec/seconds.py``: ``observe``, ``refine``), counting in
``samples`` how many merges moved each.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from mergepipe.catalog.database import Database
from mergepipe.spec.seconds import Rates


@dataclass(frozen=True)
class RateRecord:
    """One stored rate."""

    machine: str
    name: str
    value: float
    samples: int  # merges that refined it since calibration
    updated_at: str


class RateStore:
    """The ``rates`` table."""

    def __init__(self, db: Database, now: Callable[[], str]) -> None:
        self._db = db
        self._now = now

    def get(self, machine: str) -> Rates | None:
        """The rates of ``machine``; None when it was never calibrated in this catalog."""
        rows = self._db.query("SELECT name, value FROM rates WHERE machine = ?", (machine,))
        return Rates.from_values(dict(rows))

    def records(self, machine: str | None = None) -> list[RateRecord]:
        """Every stored rate (of ``machine``), by machine and name."""
        sql = "SELECT machine, name, value, samples, updated_at FROM rates"
        params: tuple[str, ...] = ()
        if machine is not None:
            sql, params = sql + " WHERE machine = ?", (machine,)
        return [RateRecord(*row) for row in self._db.query(sql + " ORDER BY machine, name", params)]

    def calibrated(self, machine: str, rates: Rates, keep: Collection[str] = ()) -> None:
        """Replace ``machine``'s rates with freshly measured ones (no samples yet), except those named in
        ``keep`` that merges have refined (samples > 0): they stay as they are."""
        now = self._now()
        with self._db.transaction():
            stored = dict(self._db.query("SELECT name, samples FROM rates WHERE machine = ?", (machine,)))
            kept = {name for name, samples in stored.items() if name in keep and samples > 0}
            for name in sorted(set(stored) - kept):
                self._db.write("DELETE FROM rates WHERE machine = ? AND name = ?", (machine, name))
            self._db.write_many(
                "INSERT INTO rates (machine, name, value, samples, updated_at) VALUES (?, ?, ?, 0, ?)",
                [(machine, name, value, now) for name, value in rates.to_values().items() if name not in kept],
            )

    def refined(self, machine: str, values: Mapping[str, float]) -> None:
        """Store refined ``values`` of rates ``machine`` has, each one more sample."""
        now = self._now()
        with self._db.transaction():
            for name, value in sorted(values.items()):
                self._db.write(
                    "UPDATE rates SET value = ?, samples = samples + 1, updated_at = ? WHERE machine = ? AND name = ?",
                    (value, now, machine, name),
                )
