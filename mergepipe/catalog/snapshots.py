"""Snapshots: the catalog side of publishing, as a small state machine.

``pending`` (an intent: staging is under way) -> ``committed`` (the directory
is in place, registered as a model with its parents, manifest stored) or
``aborted``. ``recover`` reads the pending intents after a crash. The commit
registers the output and flips the state in one transaction, so a committed
snapshot always has its model and lineage, and vice versa. Paths are stored
as given and must be absolute: the catalog does no filesystem I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from mergepipe.catalog.blocks import BlockStore
from mergepipe.catalog.database import Database
from mergepipe.catalog.models import ModelStore
from mergepipe.catalog.plans import PlanStore
from mergepipe.catalog.records import ModelContent, OutputBlock, SnapshotRecord
from mergepipe.errors import CatalogError, PublishError, StalePlanError

_COLUMNS = (
    "intent_id, id, plan_id, model_id, out_path, staging_path, status, manifest_hash, manifest, "
    "created_at, committed_at"
)


def _absolute(path: str | Path) -> str:
    if not Path(path).is_absolute():
        raise ValueError(f"snapshot paths are stored absolute, got {str(path)!r}")
    return str(path)


class SnapshotStore:
    """Publish intents and committed snapshots (see the module docstring)."""

    def __init__(
        self, db: Database, now: Callable[[], str], models: ModelStore, blocks: BlockStore, plans: PlanStore
    ) -> None:
        self._db = db
        self._now = now
        self._models = models
        self._blocks = blocks
        self._plans = plans

    def add_intent(
        self,
        intent_id: str,
        plan_id: str,
        plan_json: str,
        model_id: str,
        out_path: str | Path,
        staging_path: str | Path,
    ) -> SnapshotRecord:
        """Record that publishing ``model_id`` to ``out_path`` from a plan has started.

        In one transaction: the plan is stored (if a ``gc`` removed it since
        it was saved, it is saved again), its inputs must still be the
        content it was made from, and it must not be executing or executed
        already; so two runs of one plan, or a ``register --force`` of an
        input, cannot slip in between the checks and the intent.
        """
        with self._db.transaction():
            self._plans.save(plan_id, plan_json)
            self._check_inputs(plan_id, "the merge cannot start")
            self._check_plan_free(plan_id)
            if self._models.exists(model_id):
                raise CatalogError(f"model '{model_id}' is already registered; choose another --model-id")
            live = self._db.query_one(
                "SELECT intent_id FROM snapshots WHERE model_id = ? AND status != 'aborted'", (model_id,)
            )
            if live is not None:
                raise CatalogError(
                    f"a merge into model '{model_id}' is already in progress (intent {live[0]}); "
                    "run `mergepipe recover` or choose another --model-id"
                )
            self._db.write(
                f"INSERT INTO snapshots ({_COLUMNS}) VALUES (?, NULL, ?, ?, ?, ?, 'pending', NULL, NULL, ?, NULL)",
                (intent_id, plan_id, model_id, _absolute(out_path), _absolute(staging_path), self._now()),
            )
            return self.by_intent(intent_id)

    def _check_inputs(self, plan_id: str, consequence: str) -> None:
        """StalePlanError unless every input of the plan still has the content it was planned with."""
        for model_id, fingerprint in _plan_inputs(self._plans.get(plan_id)):
            current = self._blocks.content_fingerprint(model_id) if self._models.exists(model_id) else None
            if current != fingerprint:
                raise StalePlanError(
                    f"plan {plan_id[:12]} is stale: model '{model_id}' was re-registered or changed since it was "
                    f"planned, so {consequence}; run `mergepipe plan` again"
                )

    def _check_plan_free(self, plan_id: str) -> None:
        """PublishError if the plan is being executed or was executed (the same plan gives the same snapshot)."""
        for record in self._select("WHERE plan_id = ? AND status != 'aborted'", (plan_id,)):
            if record.status == "committed":
                raise PublishError(
                    f"plan {plan_id[:12]} was already executed: snapshot {record.id} (model '{record.model_id}') "
                    f"at {record.out_path} is its result; use it, or re-plan"
                )
            raise PublishError(
                f"plan {plan_id[:12]} is already being executed into model '{record.model_id}' at "
                f"{record.out_path} (intent {record.intent_id}); wait for it to finish, or run `mergepipe recover` "
                "if that process is gone"
            )

    def pending_inputs(self) -> dict[str, list[SnapshotRecord]]:
        """Model id -> the pending intents whose plan reads it."""
        out: dict[str, list[SnapshotRecord]] = {}
        for record in self.pending():
            for model_id, _ in _plan_inputs(self._plans.get(record.plan_id)):
                out.setdefault(model_id, []).append(record)
        return out

    def commit(
        self,
        intent_id: str,
        snapshot_id: str,
        manifest_hash: str,
        manifest_json: str,
        content: ModelContent,
        parents: Sequence[tuple[str, str]],
        outputs: Sequence[tuple[str, int, str, str, float | None, float]] = (),
    ) -> SnapshotRecord:
        """Register ``content`` (the published directory, described by the
        caller) as a snapshot model with ``parents`` ((id, 'base' | 'expert')
        in order) and mark the intent committed, in one transaction; ``outputs`` are its output blocks'
        (tensor, block, provenance key, hash, norm bound or None, error bound).
        Committing the same intent with the same id again returns the stored
        record (so ``recover`` can repeat it)."""
        intent = self.by_intent(intent_id)
        if intent.status == "committed" and intent.id == snapshot_id:
            return intent
        with self._db.transaction():
            intent = self.by_intent(intent_id)
            if intent.status != "pending":
                raise CatalogError(
                    f"snapshot intent {intent_id} is {intent.status}, not pending; it cannot be committed"
                )
            self._check_inputs(intent.plan_id, "its lineage would not be true and it cannot be committed")
            duplicate = self._select("WHERE id = ?", (snapshot_id,))
            if duplicate:
                raise CatalogError(
                    f"snapshot {snapshot_id} already exists at {duplicate[0].out_path} (the same plan executed "
                    f"twice gives the same snapshot); remove {intent.out_path} and run `mergepipe recover`"
                )
            name, version = self._models.version_of(content.record.id)
            self._models.add(replace(content, record=replace(content.record, name=name, version=version)), parents)
            self._db.write_many(
                "INSERT INTO output_blocks (model_id, tensor, idx, key, hash, l2, error) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                ((content.record.id, *row) for row in outputs),
            )
            self._db.write(
                "UPDATE snapshots SET status = 'committed', id = ?, manifest_hash = ?, manifest = ?, "
                "committed_at = ? WHERE intent_id = ?",
                (snapshot_id, manifest_hash, manifest_json, self._now(), intent_id),
            )
            return self.by_intent(intent_id)

    def outputs(self, model_id: str) -> dict[tuple[str, int], OutputBlock]:
        """(tensor, block) -> provenance of a snapshot's output blocks (empty if not recorded)."""
        rows = self._db.query("SELECT tensor, idx, key, hash, l2, error FROM output_blocks WHERE model_id = ?",
                              (model_id,))
        return {(t, i): OutputBlock(k, h, m, e) for t, i, k, h, m, e in rows}

    def abort(self, intent_id: str) -> None:
        """Mark a pending intent aborted; aborting an aborted one is a no-op."""
        with self._db.transaction():
            intent = self.by_intent(intent_id)
            if intent.status == "committed":
                raise CatalogError(f"snapshot {intent.id} is committed; it cannot be aborted")
            self._db.write("UPDATE snapshots SET status = 'aborted' WHERE intent_id = ?", (intent_id,))

    def pending(self) -> list[SnapshotRecord]:
        return self._select("WHERE status = 'pending'", ())

    def list(self) -> list[SnapshotRecord]:
        return self._select("", ())

    def committed_for_plan(self, plan_id: str) -> SnapshotRecord | None:
        """The committed snapshot a plan already produced, if any."""
        found = self._select("WHERE plan_id = ? AND status = 'committed'", (plan_id,))
        return found[0] if found else None

    def find(self, snapshot_id: str) -> SnapshotRecord | None:
        """A snapshot by id, intent id or unique id prefix; None if none
        matches, CatalogError if a prefix matches several."""
        exact = self._select("WHERE id = ? OR intent_id = ?", (snapshot_id, snapshot_id))
        if exact:
            return exact[0]
        if not snapshot_id:
            return None
        found = self._select(f"WHERE {self._db.dialect.prefix_match('id')}", (len(snapshot_id), snapshot_id))
        if len(found) > 1:
            raise CatalogError(f"snapshot prefix '{snapshot_id}' matches several snapshots; give more characters")
        return found[0] if found else None

    def get(self, snapshot_id: str) -> SnapshotRecord:
        """Like ``find``, but an unknown id is a CatalogError."""
        found = self.find(snapshot_id)
        if found is None:
            raise CatalogError(f"unknown snapshot '{snapshot_id}'; list them with `mergepipe snapshots`")
        return found

    def of_model(self, model_id: str) -> SnapshotRecord | None:
        """The committed snapshot that published model ``model_id``, if any."""
        found = self._select("WHERE model_id = ? AND status = 'committed'", (model_id,))
        return found[0] if found else None

    def by_intent(self, intent_id: str) -> SnapshotRecord:
        found = self._select("WHERE intent_id = ?", (intent_id,))
        if not found:
            raise CatalogError(f"unknown snapshot intent '{intent_id}'; list them with `mergepipe snapshots`")
        return found[0]

    def _select(self, where: str, params: Sequence[object]) -> list[SnapshotRecord]:
        sql = f"SELECT {_COLUMNS} FROM snapshots {where} ORDER BY created_at, intent_id"
        return [SnapshotRecord(*row) for row in self._db.query(sql, params)]


def _plan_inputs(plan_json: str) -> list[tuple[str, str]]:
    """(model id, content fingerprint) of a stored plan's base and experts."""
    plan = json.loads(plan_json)
    return [(ref["id"], ref["fingerprint"]) for ref in (plan["base"], *plan["experts"])]
