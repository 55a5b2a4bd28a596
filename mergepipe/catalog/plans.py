"""Plans: stored by their digest, found by digest or a unique prefix of it."""

from __future__ import annotations

from collections.abc import Callable

from mergepipe.catalog.database import Database
from mergepipe.catalog.records import PlanRecord
from mergepipe.errors import PlanError


class PlanStore:
    """Saved plans (canonical JSON text keyed by digest)."""

    def __init__(self, db: Database, now: Callable[[], str]) -> None:
        self._db = db
        self._now = now

    def save(self, plan_id: str, plan_json: str) -> None:
        """Store a plan under its digest; saving the same digest again is a no-op."""
        with self._db.transaction():
            self._db.write(
                "INSERT INTO plans (id, json, created_at) VALUES (?, ?, ?) ON CONFLICT (id) DO NOTHING",
                (plan_id, plan_json, self._now()),
            )

    def find(self, plan_id: str) -> str | None:
        """The full digest of the plan ``plan_id`` names (digest or unique
        prefix); None if it names none; PlanError if it names several."""
        if not plan_id:
            return None
        if self._db.query_one("SELECT 1 FROM plans WHERE id = ?", (plan_id,)):
            return plan_id
        rows = self._db.query(
            f"SELECT id FROM plans WHERE {self._db.dialect.prefix_match('id')} ORDER BY id LIMIT 2",
            (len(plan_id), plan_id),
        )
        if len(rows) > 1:
            raise PlanError(f"plan prefix '{plan_id}' matches several plans; give more characters")
        return rows[0][0] if rows else None

    def get(self, plan_id: str) -> str:
        """The JSON text of a plan, by digest or unique digest prefix."""
        resolved = self.find(plan_id)
        row = None if resolved is None else self._db.query_one("SELECT json FROM plans WHERE id = ?", (resolved,))
        if row is None:  # unknown, or removed by a concurrent `gc --plans` since find
            raise PlanError(f"unknown plan '{plan_id}'; make one with `mergepipe plan --save`")
        return row[0]

    def list(self) -> list[PlanRecord]:
        rows = self._db.query("SELECT id, created_at FROM plans ORDER BY created_at, id")
        return [PlanRecord(*row) for row in rows]

    def count_unreferenced(self) -> int:
        """How many plans no snapshot (of any state) refers to: saved with `plan --save`, never run."""
        row = self._db.query_row("SELECT COUNT(*) FROM plans WHERE id NOT IN (SELECT plan_id FROM snapshots)")
        return int(row[0])

    def delete_unreferenced(self) -> int:
        """Delete plans no snapshot (of any state) refers to; return how many."""
        with self._db.transaction():
            return self._db.write("DELETE FROM plans WHERE id NOT IN (SELECT plan_id FROM snapshots)")
