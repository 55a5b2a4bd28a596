"""Plans and snapshots: the catalog side of plan storage and of publishing.

A snapshot goes through a small state machine kept in the catalog:
``pending`` (an intent: staging is under way) -> ``committed`` (the directory
is in place, registered as a model with its parents, manifest stored) or
``aborted``. ``recover`` reads ``pending_snapshots`` after a crash. The
commit registers the output and flips the state in one transaction, so a
committed snapshot always has its model and lineage, and vice versa.

Kept apart from ``db.py`` only for size: ``Catalog`` inherits these methods.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mergepipe.catalog.records import PlanRecord, SnapshotRecord
from mergepipe.catalog.register import describe_checkpoint
from mergepipe.errors import CatalogError, PlanError
from mergepipe.storage.checkpoint import open_checkpoint

if TYPE_CHECKING:
    from mergepipe.catalog.db import Catalog

_SNAPSHOT_COLUMNS = (
    "intent_id, id, plan_id, model_id, out_path, staging_path, status, manifest_hash, manifest, "
    "created_at, committed_at"
)


def _abs(path: str | os.PathLike[str]) -> str:
    return str(Path(path).expanduser().resolve())


class PlansAndSnapshots:
    """Plan and snapshot methods of ``Catalog`` (see the module docstring)."""

    # ----------------------------------------------------------------------- plans

    def save_plan(self: Catalog, plan_id: str, plan_json: str) -> None:
        """Store a plan under its digest; saving the same digest again is a no-op."""
        with self.transaction():
            self._write(
                "INSERT INTO plans (id, json, created_at) VALUES (?, ?, ?) ON CONFLICT (id) DO NOTHING",
                (plan_id, plan_json, self.now()),
            )

    def _resolve_plan(self: Catalog, plan_id: str) -> str:
        if self._execute("SELECT 1 FROM plans WHERE id = ?", (plan_id,)).fetchone():
            return plan_id
        rows = self._execute(
            "SELECT id FROM plans WHERE substr(id, 1, ?) = ? ORDER BY id LIMIT 2", (len(plan_id), plan_id)
        ).fetchall()
        if not rows or not plan_id:
            raise PlanError(f"unknown plan '{plan_id}'; make one with `mergepipe plan`")
        if len(rows) > 1:
            raise PlanError(f"plan prefix '{plan_id}' matches several plans; give more characters")
        return rows[0][0]

    def get_plan(self: Catalog, plan_id: str) -> str:
        """The JSON text of a plan, by digest or unique digest prefix."""
        resolved = self._resolve_plan(plan_id)
        return self._execute("SELECT json FROM plans WHERE id = ?", (resolved,)).fetchone()[0]

    def list_plans(self: Catalog) -> list[PlanRecord]:
        rows = self._execute("SELECT id, created_at FROM plans ORDER BY created_at, id").fetchall()
        return [PlanRecord(*row) for row in rows]

    def delete_unreferenced_plans(self: Catalog) -> int:
        """Delete plans no snapshot (of any state) refers to; return how many."""
        with self.transaction():
            cursor = self._write(
                "DELETE FROM plans WHERE id NOT IN (SELECT plan_id FROM snapshots)"
            )
            return cursor.rowcount

    # ------------------------------------------------------------------- snapshots

    def add_snapshot_intent(
        self: Catalog,
        intent_id: str,
        plan_id: str,
        model_id: str,
        out_path: str | os.PathLike[str],
        staging_path: str | os.PathLike[str],
    ) -> SnapshotRecord:
        """Record that publishing ``model_id`` to ``out_path`` has started."""
        with self.transaction():
            plan_id = self._resolve_plan(plan_id)
            if self.model_exists(model_id):
                raise CatalogError(f"model '{model_id}' is already registered; choose another --model-id")
            live = self._execute(
                "SELECT intent_id FROM snapshots WHERE model_id = ? AND status != 'aborted'", (model_id,)
            ).fetchone()
            if live is not None:
                raise CatalogError(
                    f"a merge into model '{model_id}' is already in progress (intent {live[0]}); "
                    "run `mergepipe recover` or choose another --model-id"
                )
            self._write(
                f"INSERT INTO snapshots ({_SNAPSHOT_COLUMNS}) VALUES (?, NULL, ?, ?, ?, ?, 'pending', "
                "NULL, NULL, ?, NULL)",
                (intent_id, plan_id, model_id, _abs(out_path), _abs(staging_path), self.now()),
            )
            return self._snapshot_by_intent(intent_id)

    def commit_snapshot(
        self: Catalog,
        intent_id: str,
        snapshot_id: str,
        manifest_hash: str,
        manifest_json: str,
        parents: Sequence[tuple[str, str]],
    ) -> SnapshotRecord:
        """Register the published directory as a snapshot model with ``parents``
        ((id, 'base' | 'expert') in order) and mark the intent committed, in
        one transaction. Committing the same intent with the same id again
        returns the stored record (so ``recover`` can repeat it)."""
        intent = self._snapshot_by_intent(intent_id)
        if intent.status == "committed" and intent.id == snapshot_id:
            return intent
        checkpoint = open_checkpoint(intent.out_path)  # headers only; before taking the write lock
        content = describe_checkpoint(
            checkpoint, intent.model_id, kind="snapshot", block_bytes=self.block_bytes, created_at=self.now()
        )
        with self.transaction():
            intent = self._snapshot_by_intent(intent_id)
            if intent.status != "pending":
                raise CatalogError(
                    f"snapshot intent {intent_id} is {intent.status}, not pending; it cannot be committed"
                )
            duplicate = self._snapshots("WHERE id = ?", (snapshot_id,))
            if duplicate:
                raise CatalogError(
                    f"snapshot {snapshot_id} already exists at {duplicate[0].out_path} (the same plan executed "
                    f"twice gives the same snapshot); remove {intent.out_path} and run `mergepipe recover`"
                )
            self.add_model(content, parents)
            self._write(
                "UPDATE snapshots SET status = 'committed', id = ?, manifest_hash = ?, manifest = ?, "
                "committed_at = ? WHERE intent_id = ?",
                (snapshot_id, manifest_hash, manifest_json, self.now(), intent_id),
            )
            return self._snapshot_by_intent(intent_id)

    def abort_snapshot(self: Catalog, intent_id: str) -> None:
        """Mark a pending intent aborted; aborting an aborted one is a no-op."""
        with self.transaction():
            intent = self._snapshot_by_intent(intent_id)
            if intent.status == "committed":
                raise CatalogError(f"snapshot {intent.id} is committed; it cannot be aborted")
            self._write("UPDATE snapshots SET status = 'aborted' WHERE intent_id = ?", (intent_id,))

    def pending_snapshots(self: Catalog) -> list[SnapshotRecord]:
        return self._snapshots("WHERE status = 'pending'", ())

    def list_snapshots(self: Catalog) -> list[SnapshotRecord]:
        return self._snapshots("", ())

    def get_snapshot(self: Catalog, snapshot_id: str) -> SnapshotRecord:
        """A snapshot by id, unique id prefix, or intent id."""
        exact = self._snapshots("WHERE id = ? OR intent_id = ?", (snapshot_id, snapshot_id))
        if exact:
            return exact[0]
        found = self._snapshots("WHERE substr(id, 1, ?) = ?", (len(snapshot_id), snapshot_id)) if snapshot_id else []
        if len(found) > 1:
            raise CatalogError(f"snapshot prefix '{snapshot_id}' matches several snapshots; give more characters")
        if not found:
            raise CatalogError(f"unknown snapshot '{snapshot_id}'; list them with `mergepipe snapshots`")
        return found[0]

    def snapshot_by_path(self: Catalog, path: str | os.PathLike[str]) -> SnapshotRecord | None:
        """The live (committed, else pending) snapshot published at ``path``, if any."""
        found = self._snapshots(
            "WHERE out_path = ? AND status != 'aborted' ORDER BY status = 'committed' DESC, created_at DESC",
            (_abs(path),),
            order=False,
        )
        return found[0] if found else None

    def _snapshot_by_intent(self: Catalog, intent_id: str) -> SnapshotRecord:
        found = self._snapshots("WHERE intent_id = ?", (intent_id,))
        if not found:
            raise CatalogError(f"unknown snapshot intent '{intent_id}'; list them with `mergepipe snapshots`")
        return found[0]

    def _snapshots(
        self: Catalog, where: str, params: Sequence[object], order: bool = True
    ) -> list[SnapshotRecord]:
        sql = f"SELECT {_SNAPSHOT_COLUMNS} FROM snapshots {where}"
        if order:
            sql += " ORDER BY created_at, intent_id"
        return [SnapshotRecord(*row) for row in self._execute(sql, params).fetchall()]
