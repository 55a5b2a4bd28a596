"""Which `mergepipe search` study and trial a published snapshot is the best of (table ``searches``).

The study (every trial, its parameters and scores) is Optuna's, in its own
tables of the same database file; these rows are what the catalog's views
show of it (``explain``, ``lineage``) without importing Optuna.
"""

from __future__ import annotations

import json

from mergepipe.catalog.database import Database
from mergepipe.catalog.records import SearchRecord

_COLUMNS = "snapshot_id, study, trial, trials, objective, params, search_budget, created_at"


class SearchStore:
    """The ``searches`` table."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def add(self, row: SearchRecord) -> None:
        """Record that ``row.snapshot_id`` is the best trial of its study (again: the row is replaced)."""
        with self._db.transaction():
            self._db.write(
                f"INSERT INTO searches ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (snapshot_id, study, trial) DO UPDATE SET trials = excluded.trials, "
                "objective = excluded.objective, params = excluded.params, search_budget = excluded.search_budget, "
                "created_at = excluded.created_at",
                (row.snapshot_id, row.study, row.trial, row.trials, row.objective,
                 json.dumps(row.params, sort_keys=True), row.search_budget, row.created_at))

    def of_snapshot(self, snapshot_id: str) -> list[SearchRecord]:
        """The searches whose best ``snapshot_id`` is, oldest first."""
        rows = self._db.query(f"SELECT {_COLUMNS} FROM searches WHERE snapshot_id = ? ORDER BY created_at, study",
                              (snapshot_id,))
        return [SearchRecord(snapshot_id=r[0], study=r[1], trial=int(r[2]), trials=int(r[3]), objective=float(r[4]),
                             params=json.loads(r[5]), search_budget=r[6], created_at=r[7]) for r in rows]
