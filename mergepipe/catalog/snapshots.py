"""Plans, snapshots and what was measured of them: saved plans, the publish state machine of snapshots and
their locations and aliases, Hub pushes, evaluations, search results and timings.
"""

from __future__ import annotations

import builtins
import json
import math
import os
import socket
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from pydantic import TypeAdapter

from mergepipe.catalog.database import Database
from mergepipe.catalog.models import BlockStore, ModelStore
from mergepipe.catalog.records import (
    SAME_SNAPSHOT,
    EvaluationRecord,
    EvaluationSubject,
    FileRecord,
    HubPush,
    LocationRecord,
    ModelContent,
    ModelRecord,
    OutputBlock,
    PlanRecord,
    SearchRecord,
    SnapshotRecord,
    Timing,
    from_row,
)
from mergepipe.errors import CatalogError, PlanError, PublishError, StalePlanError


class PlanStore:
    """Saved plans: canonical JSON text keyed by digest."""

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
        """The digest ``plan_id`` names (a digest or unique prefix); None if none; PlanError if several."""
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
        return str(row[0])

    def list(self) -> list[PlanRecord]:
        rows = self._db.query("SELECT id, created_at FROM plans ORDER BY created_at, id")
        return [from_row(PlanRecord, row) for row in rows]

    def count_unreferenced(self) -> int:
        """How many plans no snapshot (of any state) refers to: saved, never run."""
        return int(self._db.query_row(f"SELECT COUNT(*) {_UNREFERENCED}")[0])

    def delete_unreferenced(self) -> int:
        with self._db.transaction():
            return self._db.write(f"DELETE {_UNREFERENCED}")


_UNREFERENCED = "FROM plans WHERE id NOT IN (SELECT plan_id FROM snapshots)"
_COLUMNS = ", ".join(SnapshotRecord.model_fields)
_LOCATION_COLUMNS = "intent_id, snapshot_id, path, staging_path, status, created_at, committed_at"
_HUB_COLUMNS = "snapshot_id, repo_id, revision, commit_sha, private, pushed_at"
#: A published file as the filesystem knew it: (inode, mtime ns, ctime ns, size).
Stamp = tuple[int, ...]
_STAMPS = TypeAdapter(dict[str, Stamp])


def _stamps_json(stamps: Mapping[str, Stamp] | None) -> str | None:
    return None if stamps is None else _STAMPS.dump_json(dict(sorted(stamps.items()))).decode()


def _absolute(path: str | Path) -> str:
    if not Path(path).is_absolute():
        raise ValueError(f"snapshot paths are stored absolute, got {str(path)!r}")
    return str(path)


class SnapshotStore:
    """Publish intents, committed snapshots, their locations, aliases, Hub pushes and output blocks."""

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
        """Record that publishing ``model_id`` from a plan has started, the plan saved, in one transaction."""
        with self._claimed(intent_id), self._db.transaction():
            self._plans.save(plan_id, plan_json)
            self._check_inputs(plan_id, "the merge cannot start")
            self._check_plan_free(plan_id)
            self._check_model_free(model_id)
            self._db.write(
                f"INSERT INTO snapshots ({_COLUMNS}) VALUES (?, NULL, ?, ?, ?, ?, 'pending', NULL, NULL, ?, NULL)",
                (intent_id, plan_id, model_id, _absolute(out_path), _absolute(staging_path), self._now()),
            )
            return self.by_intent(intent_id)

    @contextmanager
    def _claimed(self, intent_id: str) -> Iterator[None]:
        """Claim an intent before it is recorded (no one sees it pending and unowned); released if that fails."""
        self._db.claim(intent_id)
        try:
            yield
        except BaseException:
            self._db.release(intent_id)
            raise

    def owner_alive(self, intent_id: str) -> bool:
        """Whether a live process holds the intent, as a server catalog knows it (a file catalog: False)."""
        return self._db.claimed_elsewhere(intent_id)

    def _check_model_free(self, model_id: str) -> None:
        if self._models.exists(model_id):
            raise CatalogError(f"model '{model_id}' is already registered; choose another --model-id")
        live = self._db.query_one(
            "SELECT intent_id FROM snapshots WHERE model_id = ? AND status != 'aborted'", (model_id,)
        ) or self._db.query_one(
            "SELECT a.intent_id FROM snapshot_aliases a JOIN snapshot_locations l ON l.intent_id = a.intent_id "
            "WHERE a.model_id = ? AND l.status = 'pending'",
            (model_id,),
        )
        if live is not None:
            raise CatalogError(
                f"a merge into model '{model_id}' is already in progress (intent {live[0]}); "
                "run `mergepipe recover` or choose another --model-id"
            )

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
        for record in self._select("WHERE plan_id = ? AND status != 'aborted'", (plan_id,)):
            if record.status == "committed":  # the engine re-materialises it instead (add_location_intent)
                raise PublishError(
                    f"plan {plan_id[:12]} was executed before: snapshot {record.id} (model '{record.model_id}') "
                    f"is its result; executing the plan again adds a location of that snapshot "
                    f"(`mergepipe execute --plan {plan_id[:12]} --out DIR`)"
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
        outputs: Sequence[tuple[str, int, str, str, float | None, float, float | None]] = (),
        stamps: Mapping[str, Stamp] | None = None,
    ) -> SnapshotRecord:
        """Register ``content`` as a snapshot model with ``parents``, its output blocks (tensor, block, ``OutputBlock``
        fields) and files' ``stamps``, and mark the intent committed; again with the same id: the record."""
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
            record = content.record.model_copy(update={"name": name, "version": version})
            self._models.add(ModelContent(record, content.files, content.tensors, content.blocks), parents)
            self._db.write_many(
                "INSERT INTO output_blocks (model_id, tensor, idx, key, hash, l2, error, drift) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                ((record.id, *row) for row in outputs),
            )
            now = self._now()
            self._db.write(
                "UPDATE snapshots SET status = 'committed', id = ?, manifest_hash = ?, manifest = ?, "
                "committed_at = ? WHERE intent_id = ?",
                (snapshot_id, manifest_hash, manifest_json, now, intent_id),
            )
            first = (intent_id, snapshot_id, intent.out_path, intent.staging_path, intent.created_at, now)
            self._db.write(  # its first location: where the merge published it
                f"INSERT INTO snapshot_locations ({_LOCATION_COLUMNS}, stamps) "
                "VALUES (?, ?, ?, ?, 'committed', ?, ?, ?)",
                (*first, _stamps_json(stamps)),
            )
            self._replaced(intent_id, intent.out_path, now)
        self._db.release(intent_id)
        return self.by_intent(intent_id)

    def abort(self, intent_id: str) -> None:
        """Mark a pending intent aborted; aborting an aborted one is a no-op."""
        with self._db.transaction():
            intent = self.by_intent(intent_id)
            if intent.status == "committed":
                raise CatalogError(f"snapshot {intent.id} is committed; it cannot be aborted")
            self._db.write("UPDATE snapshots SET status = 'aborted' WHERE intent_id = ?", (intent_id,))
        self._db.release(intent_id)

    # -------------------------------------------------------------- locations

    def add_location_intent(
        self,
        intent_id: str,
        snapshot_id: str,
        path: str | Path,
        staging_path: str | Path,
        model_id: str | None = None,
    ) -> LocationRecord:
        """Record that re-materialising a committed snapshot at ``path`` has started."""
        with self._claimed(intent_id), self._db.transaction():
            found = self._select("WHERE id = ? AND status = 'committed'", (snapshot_id,))
            if not found:
                raise CatalogError(
                    f"snapshot '{snapshot_id}' is not a committed snapshot; it cannot be "
                    "re-materialised (list them with `mergepipe snapshots`)"
                )
            self._check_inputs(found[0].plan_id, "its snapshot cannot be re-materialised")
            alias = None if model_id in (None, found[0].model_id) else model_id
            if alias is not None and not self._models.exists(alias):
                self._check_model_free(alias)
            elif alias is not None and self._models.same_snapshot_as(alias) != found[0].model_id:
                raise CatalogError(
                    f"model '{alias}' is registered and is not snapshot {found[0].id} under another "
                    "id; choose another --model-id"
                )
            self._db.write(
                f"INSERT INTO snapshot_locations ({_LOCATION_COLUMNS}) VALUES (?, ?, ?, ?, 'pending', ?, NULL)",
                (intent_id, snapshot_id, _absolute(path), _absolute(staging_path), self._now()),
            )
            if alias is not None:
                self._db.write("INSERT INTO snapshot_aliases (intent_id, model_id) VALUES (?, ?)", (intent_id, alias))
            return self.location(intent_id)

    def commit_location(
        self, intent_id: str, files: Sequence[FileRecord] | None = None, stamps: Mapping[str, Stamp] | None = None
    ) -> LocationRecord:
        """Mark a location intent committed with its files' ``stamps``."""
        location = self.location(intent_id)
        if location.status == "committed":
            return location
        with self._db.transaction():
            location = self.location(intent_id)
            if location.status != "pending":
                raise CatalogError(
                    f"location intent {intent_id} is {location.status}, not pending; it cannot be committed"
                )
            replaced = "FROM snapshot_locations WHERE snapshot_id = ? AND path = ? AND status = 'committed'"
            self._db.write(
                f"DELETE FROM snapshot_aliases WHERE intent_id IN (SELECT intent_id {replaced})",
                (location.snapshot_id, location.path),
            )
            self._db.write(f"DELETE {replaced}", (location.snapshot_id, location.path))
            self._db.write(
                "UPDATE snapshot_locations SET status = 'committed', committed_at = ?, stamps = ? WHERE intent_id = ?",
                (self._now(), _stamps_json(stamps), intent_id),
            )
            self._replaced(intent_id, location.path, self._now())
            snapshot = self.get(location.snapshot_id)
            alias = self.alias_published(intent_id)
            if alias is not None and not self._models.exists(alias):
                self._add_alias(snapshot, alias, location.path, files)
            elif files is not None:
                self._move(snapshot, alias or snapshot.model_id, location.path, files)
        self._db.release(intent_id)
        return self.location(intent_id)

    def alias_published(self, intent_id: str) -> str | None:
        """The alias a location intent publishes its snapshot as; None for the snapshot's own model."""
        row = self._db.query_one("SELECT model_id FROM snapshot_aliases WHERE intent_id = ?", (intent_id,))
        return None if row is None else str(row[0])

    def _add_alias(self, snapshot: SnapshotRecord, alias: str, path: str, files: Sequence[FileRecord] | None) -> None:
        """Register ``alias`` at ``path``: the snapshot's model under another id, with that model as its parent."""
        owner = self._models.get(snapshot.model_id)
        recorded = self._models.files(owner.id)
        if files is not None:
            _check_same_files(recorded, files, path, snapshot)
        name, version = self._models.version_of(alias)
        record = owner.model_copy(
            update={"id": alias, "uri": path, "created_at": self._now(), "name": name, "version": version}
        )
        blocks = tuple(b for per in self._blocks.by_tensor(owner.id).values() for b in per)
        content = ModelContent(
            record, tuple(recorded if files is None else files), tuple(self._models.tensors(owner.id)), blocks
        )
        self._models.add(content, [(owner.id, SAME_SNAPSHOT)])
        self._db.write(
            "UPDATE models SET content_fingerprint = (SELECT content_fingerprint FROM models WHERE id = ?) "
            "WHERE id = ?",
            (owner.id, alias),
        )

    def _move(self, snapshot: SnapshotRecord, model_id: str, path: str, files: Sequence[FileRecord]) -> None:
        """Make ``path`` the current location of ``model_id`` (the snapshot's own model, or an alias)."""
        _check_same_files(self._models.files(model_id), files, path, snapshot)
        self._db.write_many(
            "UPDATE files SET mtime_ns = ? WHERE model_id = ? AND name = ?",
            ((f.mtime_ns, model_id, f.name) for f in files),
        )
        self._db.write("UPDATE models SET uri = ? WHERE id = ?", (path, model_id))
        if model_id == snapshot.model_id:
            self._db.write("UPDATE snapshots SET out_path = ? WHERE intent_id = ?", (path, snapshot.intent_id))

    def _replaced(self, intent_id: str, path: str, now: str) -> None:
        """The other live locations at ``path``, whose directory this commit replaced, marked removed."""
        self._db.write(
            "UPDATE snapshot_locations SET removed_at = ? WHERE path = ? AND status = 'committed' "
            "AND removed_at IS NULL AND intent_id != ?",
            (now, path, intent_id),
        )

    def mark_removed(self, snapshot_id: str, path: str | Path) -> LocationRecord:
        """Record that ``mergepipe rm`` deleted a committed location's directory (the row stays; again: kept)."""
        with self._db.transaction():
            found = self._locations(
                "WHERE snapshot_id = ? AND path = ? AND status = 'committed'", (snapshot_id, str(path))
            )
            if not found:
                raise CatalogError(
                    f"snapshot '{snapshot_id}' has no location at {path}; list them with `mergepipe snapshots`"
                )
            self._db.write(
                "UPDATE snapshot_locations SET removed_at = ? WHERE intent_id = ? AND removed_at IS NULL",
                (self._now(), found[0].intent_id),
            )
            return self.location(found[0].intent_id)

    def abort_location(self, intent_id: str) -> None:
        """Mark a pending location intent aborted; aborting an aborted one is a no-op."""
        with self._db.transaction():
            if self.location(intent_id).status == "committed":
                raise CatalogError(f"location intent {intent_id} is committed; it cannot be aborted")
            self._db.write("UPDATE snapshot_locations SET status = 'aborted' WHERE intent_id = ?", (intent_id,))
        self._db.release(intent_id)

    def locations(self, snapshot_id: str) -> list[LocationRecord]:
        """Every location of a committed snapshot, oldest first."""
        return self._locations("WHERE snapshot_id = ? AND status = 'committed'", (snapshot_id,))

    def stamps(self, snapshot_id: str, path: str | Path) -> dict[str, Stamp]:
        """Each file of a committed location as published (empty when not recorded)."""
        row = self._db.query_one(
            "SELECT stamps FROM snapshot_locations WHERE snapshot_id = ? AND path = ? AND status = 'committed'",
            (snapshot_id, str(path)),
        )
        return {} if row is None or row[0] is None else _STAMPS.validate_json(row[0])

    def location_intents(self, status: str | None = None) -> list[LocationRecord]:
        """Every location row (with ``status``: only those)."""
        return self._locations("" if status is None else "WHERE status = ?", () if status is None else (status,))

    def location(self, intent_id: str) -> LocationRecord:
        found = self._locations("WHERE intent_id = ?", (intent_id,))
        if not found:
            raise CatalogError(f"unknown location intent '{intent_id}'; list them with `mergepipe snapshots`")
        return found[0]

    def _locations(self, where: str, params: Sequence[object]) -> list[LocationRecord]:
        sql = f"SELECT {_LOCATION_COLUMNS}, removed_at FROM snapshot_locations {where} ORDER BY created_at, intent_id"
        return [from_row(LocationRecord, row) for row in self._db.query(sql, params)]

    # ---------------------------------------------------------- Hub locations

    def add_hub_location(self, snapshot_id: str, repo_id: str, revision: str, commit: str, private: bool) -> HubPush:
        """Record that a Hub commit (on branch ``revision``) holds a committed snapshot's files; again: the first."""
        with self._db.transaction():
            if not self._select("WHERE id = ? AND status = 'committed'", (snapshot_id,)):
                raise CatalogError(
                    f"snapshot '{snapshot_id}' is not a committed snapshot; list them with `mergepipe snapshots`"
                )
            self._db.write(
                f"INSERT INTO hub_locations ({_HUB_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (snapshot_id, repo_id, revision, commit, int(private), self._now()),
            )
            return self._hub(
                "WHERE snapshot_id = ? AND repo_id = ? AND commit_sha = ?", (snapshot_id, repo_id, commit)
            )[0]

    def hub_locations(self, snapshot_id: str | None = None) -> builtins.list[HubPush]:
        """The Hub commits holding a snapshot (None: every snapshot's)."""
        return self._hub("", ()) if snapshot_id is None else self._hub("WHERE snapshot_id = ?", (snapshot_id,))

    def _hub(self, where: str, params: Sequence[object]) -> builtins.list[HubPush]:
        sql = f"SELECT {_HUB_COLUMNS} FROM hub_locations {where} ORDER BY pushed_at, repo_id, commit_sha"
        return [from_row(HubPush, row) for row in self._db.query(sql, params)]

    # ------------------------------------------------------------------ reads

    def outputs(self, model_id: str) -> dict[tuple[str, int], OutputBlock]:
        """(tensor, block) -> a snapshot's output block (empty if not recorded)."""
        sql = "SELECT tensor, idx, key, hash, l2, error, drift FROM output_blocks WHERE model_id = ?"
        return {(t, i): OutputBlock(*rest) for t, i, *rest in self._db.query(sql, (model_id,))}

    def error_norm(self, model_id: str) -> float:
        """The Frobenius norm of a snapshot's output blocks' error bounds."""
        rows = self._db.query("SELECT error FROM output_blocks WHERE model_id = ? AND error > 0", (model_id,))
        return math.sqrt(sum(e * e for (e,) in rows))

    def pending(self) -> list[SnapshotRecord]:
        return self._select("WHERE status = 'pending'", ())

    def list(self) -> list[SnapshotRecord]:
        return self._select("", ())

    def committed_for_plan(self, plan_id: str) -> SnapshotRecord | None:
        return next(iter(self._select("WHERE plan_id = ? AND status = 'committed'", (plan_id,))), None)

    def find(self, snapshot_id: str) -> SnapshotRecord | None:
        """A snapshot by id, intent id or unique id prefix; None if none, CatalogError if several."""
        exact = self._select("WHERE id = ? OR intent_id = ?", (snapshot_id, snapshot_id))
        if exact or not snapshot_id:
            return next(iter(exact), None)
        found = self._select(f"WHERE {self._db.dialect.prefix_match('id')}", (len(snapshot_id), snapshot_id))
        if len(found) > 1:
            raise CatalogError(f"snapshot prefix '{snapshot_id}' matches several snapshots; give more characters")
        return next(iter(found), None)

    def get(self, snapshot_id: str) -> SnapshotRecord:
        found = self.find(snapshot_id)
        if found is None:
            raise CatalogError(f"unknown snapshot '{snapshot_id}'; list them with `mergepipe snapshots`")
        return found

    def of_model(self, model_id: str) -> SnapshotRecord | None:
        """The committed snapshot that published ``model_id``; an alias's as found at its location (``out_path``)."""
        found = self._select("WHERE model_id = ? AND status = 'committed'", (model_id,))
        if found:
            return found[0]
        owner = self._models.same_snapshot_as(model_id)
        record = None if owner is None else self.of_model(owner)
        return None if record is None else record.model_copy(update={"out_path": self._models.get(model_id).uri})

    def model_at(self, snapshot_id: str, path: str | Path) -> str | None:
        """The model a committed location of ``snapshot_id`` at ``path`` publishes (an alias, or its own)."""
        row = self._db.query_one(
            "SELECT intent_id FROM snapshot_locations WHERE snapshot_id = ? AND path = ? AND status = 'committed'",
            (snapshot_id, str(path)),
        )
        if row is None:
            return None
        return self.alias_published(row[0]) or self.get(snapshot_id).model_id

    def by_intent(self, intent_id: str) -> SnapshotRecord:
        found = self._select("WHERE intent_id = ?", (intent_id,))
        if not found:
            raise CatalogError(f"unknown snapshot intent '{intent_id}'; list them with `mergepipe snapshots`")
        return found[0]

    def _select(self, where: str, params: Sequence[object]) -> builtins.list[SnapshotRecord]:
        sql = f"SELECT {_COLUMNS} FROM snapshots {where} ORDER BY created_at, intent_id"
        return [from_row(SnapshotRecord, row) for row in self._db.query(sql, params)]


def _check_same_files(
    recorded: Sequence[FileRecord], given: Sequence[FileRecord], path: str, snapshot: SnapshotRecord
) -> None:
    """CatalogError unless ``given`` are the ``recorded`` files (names, sizes, headers; times may differ)."""
    if {f.name: (f.size, f.header_sha256) for f in recorded} != {f.name: (f.size, f.header_sha256) for f in given}:
        raise CatalogError(f"the files at {path} are not those of snapshot {snapshot.id}; it cannot be moved there")


def _plan_inputs(plan_json: str) -> list[tuple[str, str]]:
    """(model id, content fingerprint) of a stored plan's base and experts."""
    plan = json.loads(plan_json)
    return [(ref["id"], ref["fingerprint"]) for ref in (plan["base"], *plan["experts"])]


#: Subjects per query of ``for_subjects``: well under SQLite's smallest limit on bound parameters (999).
_SUBJECTS_PER_QUERY = 500
_EVALUATION_COLUMNS = ", ".join(EvaluationRecord.model_fields)


class EvaluationStore:
    """What models scored: one row per (subject, data digest, metric); the subject is content, never a model id."""

    def __init__(self, db: Database, snapshots: SnapshotStore, blocks: BlockStore) -> None:
        self._db = db
        self._snapshots = snapshots
        self._blocks = blocks

    def subject_of(self, model: ModelRecord) -> EvaluationSubject | None:
        """A merged model's plan digest (an alias's too), else its content fingerprint (None until analysed)."""
        snapshot = self._snapshots.of_model(model.id) if model.kind == "snapshot" else None
        if snapshot is not None:
            return EvaluationSubject(kind="plan", id=snapshot.plan_id)
        if self._blocks.hashed_count(model.id) < model.n_blocks:
            return None
        return EvaluationSubject(kind="model", id=self._blocks.content_fingerprint(model.id))

    def add(self, rows: Sequence[EvaluationRecord]) -> None:
        """Store ``rows``, each replacing the row of its (subject, data, metric)."""
        values = [
            {
                **r.model_dump(),
                "value": None if math.isnan(r.value) else r.value,  # SQLite stores a NaN as NULL
                "versions": json.dumps(r.versions, sort_keys=True),
            }
            for r in rows
        ]
        self._db.upsert("evaluations", ("subject", "data_digest", "metric"), values)

    def get(self, subject: str, data_digest: str) -> list[EvaluationRecord]:
        return self._select("subject = ? AND data_digest = ? ORDER BY metric", (subject, data_digest))

    def for_subjects(self, subjects: Sequence[str]) -> dict[str, list[EvaluationRecord]]:
        """Subject -> its rows, by data name, data digest and metric (a subject without rows left out)."""
        wanted = sorted(set(subjects))
        found: dict[str, list[EvaluationRecord]] = {}
        for start in range(0, len(wanted), _SUBJECTS_PER_QUERY):
            part = wanted[start : start + _SUBJECTS_PER_QUERY]
            where = f"subject IN ({', '.join('?' * len(part))}) ORDER BY subject, data_name, data_digest, metric"
            for record in self._select(where, part):
                found.setdefault(record.subject, []).append(record)
        return found

    def _select(self, where: str, params: Sequence[object]) -> list[EvaluationRecord]:
        rows = self._db.query(f"SELECT {_EVALUATION_COLUMNS} FROM evaluations WHERE {where}", params)
        return [
            from_row(
                EvaluationRecord,
                (*row[:5], math.nan if row[5] is None else row[5], row[6], json.loads(row[7]), *row[8:]),
            )
            for row in rows
        ]


_SEARCH_COLUMNS = ", ".join(SearchRecord.model_fields)


class SearchStore:
    """Which `mergepipe search` study and trial a published snapshot is the best of."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def add(self, row: SearchRecord) -> None:
        """Record that ``row.snapshot_id`` is the best trial of its study (again: the row is replaced)."""
        values = {**row.model_dump(), "params": json.dumps(row.params, sort_keys=True)}
        self._db.upsert("searches", ("snapshot_id", "study", "trial"), [values])

    def of_snapshot(self, snapshot_id: str) -> list[SearchRecord]:
        sql = f"SELECT {_SEARCH_COLUMNS} FROM searches WHERE snapshot_id = ? ORDER BY created_at, study"
        rows = self._db.query(sql, (snapshot_id,))
        return [from_row(SearchRecord, (*row[:5], json.loads(row[5]), *row[6:])) for row in rows]


#: The most recent analysis runs a read rate is taken over: a disk or machine that changed shows within a few.
READ_RUNS = 20


def host_key() -> str:
    """``hostname/N cpus``: the rows of timings that apply to work done on this host."""
    return f"{socket.gethostname()}/{os.cpu_count() or 1} cpus"


class TimingStore:
    """What took time, per host: analysis reads, kernel probes (per device) and merges (per device, operator)."""

    def __init__(self, db: Database, now: Callable[[], str]) -> None:
        self._db = db
        self._now = now

    def add_read(self, host: str, bytes_read: int, seconds: float) -> None:
        """One analysis run (a fresh id: two runs may share a timestamp)."""
        with self._db.transaction():
            self._db.write(
                "INSERT INTO analyze_reads (id, host, recorded_at, bytes_read, seconds) VALUES (?, ?, ?, ?, ?)",
                (uuid.uuid4().hex, host, self._now(), bytes_read, seconds),
            )

    def read_rate(self, host: str) -> float | None:
        """Bytes per second analysis read on ``host`` (its last ``READ_RUNS`` runs); None if it never did."""
        row = self._db.query_one(
            "SELECT SUM(bytes_read), SUM(seconds) FROM (SELECT bytes_read, seconds FROM analyze_reads WHERE host = ? "
            "ORDER BY recorded_at DESC LIMIT ?) AS recent",
            (host, READ_RUNS),
        )
        return None if row is None or not row[0] else float(row[0]) / float(row[1])

    def add_kernels(self, host: str, device: str, seconds_per_element: Mapping[str, float]) -> None:
        """Probed kernels (``engine/probe.py``): operator -> seconds per element and expert on ``device``."""
        now = self._now()
        rows = [
            {"host": host, "device": device, "operator": op, "seconds_per_element": s, "recorded_at": now}
            for op, s in sorted(seconds_per_element.items())
        ]
        self._db.upsert("kernel_probes", ("host", "device", "operator"), rows)

    def kernel_seconds(self, host: str, device: str) -> dict[str, float]:
        sql = "SELECT operator, seconds_per_element FROM kernel_probes WHERE host = ? AND device = ?"
        return dict(self._db.query(sql, (host, device)))

    def add_merge(self, intent_id: str, host: str, device: str, operator: str, timing: Timing) -> None:
        """One merge (the publish intent that ran it) and what it took."""
        with self._db.transaction():
            self._db.write(
                "INSERT INTO merge_timings (intent_id, host, device, operator, expert_bytes, output_bytes, seconds, "
                "recorded_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    intent_id,
                    host,
                    device,
                    operator,
                    timing.expert_bytes,
                    timing.output_bytes,
                    timing.seconds,
                    self._now(),
                ),
            )

    def merges(self, host: str, device: str, operator: str, limit: int) -> list[Timing]:
        """The last ``limit`` merges of ``operator`` on ``device`` of ``host``, newest first."""
        rows = self._db.query(
            "SELECT expert_bytes, output_bytes, seconds FROM merge_timings WHERE host = ? AND device = ? AND "
            "operator = ? ORDER BY recorded_at DESC LIMIT ?",
            (host, device, operator, limit),
        )
        return [Timing(int(e), int(o), float(s)) for e, o, s in rows]
