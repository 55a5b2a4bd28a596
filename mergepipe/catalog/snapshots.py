"""Snapshots: the catalog side of publishing, as a small state machine.

``pending`` (an intent: staging is under way) -> ``committed`` (the directory
is in place, registered as a model with its parents, manifest stored) or
``aborted``. ``recover`` reads the pending intents after a crash. The commit
registers the output and flips the state in one transaction, so a committed
snapshot always has its model and lineage, and vice versa. Paths are stored
as given and must be absolute: the catalog does no filesystem I/O.

Locations: a plan always gives the same snapshot, so executing it again
re-materialises that snapshot in another directory rather than making a new
one. Each such attempt is a location intent with the same state machine
(``add_location_intent`` -> ``commit_location`` | ``abort_location``); its
commit adds the location and, when the caller says the current directory is
gone, makes it the snapshot's current one (``out_path`` and the model's
``uri``, with the new files' times), in one transaction. Every location keeps
its files' ``stamps`` as published, what ``mergepipe rm`` proves a file by;
``mark_removed`` records that it deleted a location's directory (the row stays).
A commit at a path where another snapshot's location is live (``mergepipe-yaml``
replaced that directory) marks that location removed the same way, in the
same transaction.

Aliases: the same merge asked for under another model id publishes the same
snapshot as that model too. Such a location intent names the model
(``add_location_intent(..., model_id=...)``, a row of ``snapshot_aliases``);
its commit registers the alias as a snapshot model at that location, with
the snapshot's files, tensors and blocks and the snapshot's own model as its
one parent (role ``same snapshot``), or, for an alias registered before,
makes the location its current one when the caller says so. ``of_model`` of
an alias gives its snapshot as found at the alias's location.

Owners: in a shared (PostgreSQL) catalog the process that records an
intent holds it (``Database.claim``) until it commits or aborts it, or its
connection ends; ``owner_alive`` is how ``recover`` on another machine,
which cannot see the owner's staging directory or its lock, tells a live
merge from a dead one.

Hub locations: ``add_hub_location`` records a Hugging Face Hub commit that
holds a committed snapshot's files (``mergepipe push``), once the commit
exists: there is no intent, since the Hub commit is all or nothing and a push
repeated after a crash finds the same files there and records that commit.
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
from dataclasses import replace
from pathlib import Path

from mergepipe.catalog.database import Database
from mergepipe.catalog.models import BlockStore, ModelStore
from mergepipe.catalog.records import (
    SAME_SNAPSHOT,
    SUBJECT_KINDS,
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
)
from mergepipe.errors import CatalogError, PlanError, PublishError, StalePlanError


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


_COLUMNS = (
    "intent_id, id, plan_id, model_id, out_path, staging_path, status, manifest_hash, manifest, "
    "created_at, committed_at"
)
_LOCATION_COLUMNS = "intent_id, snapshot_id, path, staging_path, status, created_at, committed_at"
_LOCATION_READ = f"{_LOCATION_COLUMNS}, removed_at"
_HUB_COLUMNS = "snapshot_id, repo_id, revision, commit_sha, private, pushed_at"


#: A published file as the filesystem knew it: (inode, mtime ns, ctime ns, size).
Stamp = tuple[int, ...]


def _json(stamps: Mapping[str, Stamp] | None) -> str | None:
    return None if stamps is None else json.dumps({k: list(v) for k, v in stamps.items()}, sort_keys=True)


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
        """Claim a new intent before it is recorded (so no other process ever sees it pending and
        unowned); give the claim up if recording it fails."""
        self._db.claim(intent_id)
        try:
            yield
        except BaseException:
            self._db.release(intent_id)
            raise

    def owner_alive(self, intent_id: str) -> bool:
        """Whether a process holding intent ``intent_id`` is alive, as the shared catalog knows it (False for
        a file catalog: its staging directory's lock says it, ``txn/lock.py``)."""
        return self._db.claimed_elsewhere(intent_id)

    def _check_model_free(self, model_id: str) -> None:
        """CatalogError if ``model_id`` is registered, or is what a merge or an alias publish in progress
        is about to register."""
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
        """PublishError if the plan is being executed or was executed (the same plan gives the same snapshot)."""
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
        """Register ``content`` (the published directory, described by the
        caller) as a snapshot model with ``parents`` ((id, 'base' | 'expert')
        in order) and mark the intent committed, in one transaction; ``outputs`` are its output blocks'
        (tensor, block, provenance key, hash, norm bound or None, error bound), ``stamps`` its files' as
        published (``stamps``).
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
                "INSERT INTO output_blocks (model_id, tensor, idx, key, hash, l2, error, drift) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                ((content.record.id, *row) for row in outputs),
            )
            now = self._now()
            self._db.write(
                "UPDATE snapshots SET status = 'committed', id = ?, manifest_hash = ?, manifest = ?, "
                "committed_at = ? WHERE intent_id = ?",
                (snapshot_id, manifest_hash, manifest_json, now, intent_id),
            )
            self._db.write(  # its first location: where the merge published it
                f"INSERT INTO snapshot_locations ({_LOCATION_COLUMNS}, stamps) "
                "VALUES (?, ?, ?, ?, 'committed', ?, ?, ?)",
                (intent_id, snapshot_id, intent.out_path, intent.staging_path, intent.created_at, now, _json(stamps)),
            )
            self._replaced(intent_id, intent.out_path, now)
        self._db.release(intent_id)
        return self.by_intent(intent_id)

    # -------------------------------------------------------------- locations

    def add_location_intent(
        self,
        intent_id: str,
        snapshot_id: str,
        path: str | Path,
        staging_path: str | Path,
        model_id: str | None = None,
    ) -> LocationRecord:
        """Record that re-materialising committed snapshot ``snapshot_id`` at ``path`` has started
        (its plan's inputs must still be the content it was made from). ``model_id``: the model it
        publishes there when that is not the snapshot's own: a new alias (an id that is free) or an
        alias of this snapshot registered before."""
        with self._claimed(intent_id), self._db.transaction():
            found = self._select("WHERE id = ? AND status = 'committed'", (snapshot_id,))
            if not found:
                raise CatalogError(
                    f"snapshot '{snapshot_id}' is not a committed snapshot; it cannot be "
                    "re-materialised (list them with `mergepipe snapshots`)"
                )
            self._check_inputs(found[0].plan_id, "its snapshot cannot be re-materialised")
            alias = None if model_id in (None, found[0].model_id) else model_id
            if alias is not None:
                self._check_alias(alias, found[0])
            self._db.write(
                f"INSERT INTO snapshot_locations ({_LOCATION_COLUMNS}) VALUES (?, ?, ?, ?, 'pending', ?, NULL)",
                (intent_id, snapshot_id, _absolute(path), _absolute(staging_path), self._now()),
            )
            if alias is not None:
                self._db.write("INSERT INTO snapshot_aliases (intent_id, model_id) VALUES (?, ?)", (intent_id, alias))
            return self.location(intent_id)

    def _check_alias(self, alias: str, snapshot: SnapshotRecord) -> None:
        """CatalogError unless ``alias`` is free, or is an alias of ``snapshot`` already."""
        if not self._models.exists(alias):
            self._check_model_free(alias)
        elif self._models.same_snapshot_as(alias) != snapshot.model_id:
            raise CatalogError(
                f"model '{alias}' is registered and is not snapshot {snapshot.id} under another "
                "id; choose another --model-id"
            )

    def commit_location(
        self, intent_id: str, files: Sequence[FileRecord] | None = None, stamps: Mapping[str, Stamp] | None = None
    ) -> LocationRecord:
        """Mark a location intent committed, with its files' ``stamps`` (a location of the same snapshot at the
        same path is replaced: that directory was made again). With ``files`` (the new directory's weight files)
        the location becomes the snapshot's current one: ``out_path``, the model's ``uri`` and its
        files' times move to it, in the same transaction; the caller passes them when the current
        directory no longer exists, or is this one (re-made in place). Committing a committed
        location again returns it."""
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
                (self._now(), _json(stamps), intent_id),
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
        """The alias a location intent publishes its snapshot as; None when it publishes the snapshot's
        own model."""
        row = self._db.query_one("SELECT model_id FROM snapshot_aliases WHERE intent_id = ?", (intent_id,))
        return None if row is None else str(row[0])

    def _add_alias(self, snapshot: SnapshotRecord, alias: str, path: str, files: Sequence[FileRecord] | None) -> None:
        """Register ``alias`` at ``path`` as the snapshot's model under another id: its record, files,
        tensors, blocks (with their hashes) and content fingerprint, with the snapshot's model as its
        parent. ``files`` are the new directory's (their times); without them (``recover`` gives none
        while the snapshot's own directory exists) the recorded ones."""
        owner = self._models.get(snapshot.model_id)
        recorded = self._models.files(owner.id)
        if files is not None:
            _check_same_files(recorded, files, path, snapshot)
        name, version = self._models.version_of(alias)
        record = replace(owner, id=alias, uri=path, created_at=self._now(), name=name, version=version)
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
        """Make ``path`` the current location of ``model_id``: the snapshot's own model (then also the
        snapshot's ``out_path``) or an alias of it. The files must be the recorded ones (names, sizes,
        headers): only their times may differ."""
        _check_same_files(self._models.files(model_id), files, path, snapshot)
        self._db.write_many(
            "UPDATE files SET mtime_ns = ? WHERE model_id = ? AND name = ?",
            ((f.mtime_ns, model_id, f.name) for f in files),
        )
        self._db.write("UPDATE models SET uri = ? WHERE id = ?", (path, model_id))
        if model_id == snapshot.model_id:
            self._db.write("UPDATE snapshots SET out_path = ? WHERE intent_id = ?", (path, snapshot.intent_id))

    def _replaced(self, intent_id: str, path: str, now: str) -> None:
        """The other live locations at ``path``, whose directory the commit of ``intent_id`` replaced, removed."""
        self._db.write(
            "UPDATE snapshot_locations SET removed_at = ? WHERE path = ? AND status = 'committed' "
            "AND removed_at IS NULL AND intent_id != ?",
            (now, path, intent_id),
        )

    def mark_removed(self, snapshot_id: str, path: str | Path) -> LocationRecord:
        """Record that the directory of a committed location was deleted (``mergepipe rm``). The row
        stays, with ``removed_at``: the snapshot keeps its lineage, and executing its plan again
        re-materialises it (at that path too, replacing the row). Marking it again keeps the first time."""
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
        """Name -> (inode, mtime ns, ctime ns, size) of each file of the committed location of ``snapshot_id`` at
        ``path`` as it was published (empty when not recorded): a file still with all four is the one written."""
        row = self._db.query_one(
            "SELECT stamps FROM snapshot_locations WHERE snapshot_id = ? AND path = ? AND status = 'committed'",
            (snapshot_id, str(path)),
        )
        return {} if row is None or row[0] is None else {k: tuple(v) for k, v in json.loads(row[0]).items()}

    def location_intents(self, status: str | None = None) -> list[LocationRecord]:
        """Every location row (with ``status``: only those), committed or not, oldest first."""
        return self._locations("" if status is None else "WHERE status = ?", () if status is None else (status,))

    def location(self, intent_id: str) -> LocationRecord:
        found = self._locations("WHERE intent_id = ?", (intent_id,))
        if not found:
            raise CatalogError(f"unknown location intent '{intent_id}'; list them with `mergepipe snapshots`")
        return found[0]

    def _locations(self, where: str, params: Sequence[object]) -> list[LocationRecord]:
        sql = f"SELECT {_LOCATION_READ} FROM snapshot_locations {where} ORDER BY created_at, intent_id"
        return [LocationRecord(*row) for row in self._db.query(sql, params)]

    # ---------------------------------------------------------- Hub locations

    def add_hub_location(self, snapshot_id: str, repo_id: str, revision: str, commit: str, private: bool) -> HubPush:
        """Record that Hub commit ``commit`` of ``repo_id`` (on branch ``revision``) holds committed snapshot
        ``snapshot_id``'s files. Recording the same commit again returns the first record (a push of files
        the repository already held makes no new commit)."""
        with self._db.transaction():
            if not self._select("WHERE id = ? AND status = 'committed'", (snapshot_id,)):
                raise CatalogError(
                    f"snapshot '{snapshot_id}' is not a committed snapshot; list them with `mergepipe snapshots`"
                )
            key = (snapshot_id, repo_id, commit)
            known = self._hub("WHERE snapshot_id = ? AND repo_id = ? AND commit_sha = ?", key)
            if known:
                return known[0]
            self._db.write(
                f"INSERT INTO hub_locations ({_HUB_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
                (snapshot_id, repo_id, revision, commit, int(private), self._now()),
            )
            return self._hub("WHERE snapshot_id = ? AND repo_id = ? AND commit_sha = ?", key)[0]

    def hub_locations(self, snapshot_id: str | None = None) -> builtins.list[HubPush]:
        """The Hub commits holding a snapshot (None: every snapshot's), oldest first."""
        if snapshot_id is None:
            return self._hub("", ())
        return self._hub("WHERE snapshot_id = ?", (snapshot_id,))

    def _hub(self, where: str, params: Sequence[object]) -> builtins.list[HubPush]:
        sql = f"SELECT {_HUB_COLUMNS} FROM hub_locations {where} ORDER BY pushed_at, repo_id, commit_sha"
        return [HubPush(s, r, v, c, bool(p), t) for s, r, v, c, p, t in self._db.query(sql, params)]

    # ------------------------------------------------------------------ reads

    def outputs(self, model_id: str) -> dict[tuple[str, int], OutputBlock]:
        """(tensor, block) -> provenance of a snapshot's output blocks (empty if not recorded)."""
        rows = self._db.query(
            "SELECT tensor, idx, key, hash, l2, error, drift FROM output_blocks WHERE model_id = ?", (model_id,)
        )
        return {(t, i): OutputBlock(k, h, m, e, d) for t, i, k, h, m, e, d in rows}

    def error_norm(self, model_id: str) -> float:
        """The Frobenius norm of a snapshot's output blocks' error bounds: how far it may be from the
        from-scratch merge (0 unless blocks were delta-updated)."""
        rows = self._db.query("SELECT error FROM output_blocks WHERE model_id = ? AND error > 0", (model_id,))
        return math.sqrt(sum(e * e for (e,) in rows))

    def abort(self, intent_id: str) -> None:
        """Mark a pending intent aborted; aborting an aborted one is a no-op."""
        with self._db.transaction():
            intent = self.by_intent(intent_id)
            if intent.status == "committed":
                raise CatalogError(f"snapshot {intent.id} is committed; it cannot be aborted")
            self._db.write("UPDATE snapshots SET status = 'aborted' WHERE intent_id = ?", (intent_id,))
        self._db.release(intent_id)

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
        """The committed snapshot that published model ``model_id``, if any. For an alias, the
        snapshot it publishes under another id, as found at the alias's location (``out_path``: the
        alias's ``uri``; ``model_id`` stays the snapshot's own model, which its provenance is kept under)."""
        found = self._select("WHERE model_id = ? AND status = 'committed'", (model_id,))
        if found:
            return found[0]
        owner = self._models.same_snapshot_as(model_id)
        record = None if owner is None else self.of_model(owner)
        return None if record is None else replace(record, out_path=self._models.get(model_id).uri)

    def model_at(self, snapshot_id: str, path: str | Path) -> str | None:
        """The model a committed location of ``snapshot_id`` at ``path`` publishes: an alias, or the
        snapshot's own model; None if the snapshot has no location there."""
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
        return [SnapshotRecord(*row) for row in self._db.query(sql, params)]


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

_EVALUATIONS_COLUMNS = (
    "subject, subject_kind, data_digest, data_name, metric, value, tokens, versions, device, seconds, created_at"
)


class EvaluationStore:
    """The ``evaluations`` table."""

    def __init__(self, db: Database, snapshots: SnapshotStore, blocks: BlockStore) -> None:
        self._db = db
        self._snapshots = snapshots
        self._blocks = blocks

    def subject_of(self, model: ModelRecord) -> EvaluationSubject | None:
        """What ``model``'s scores are stored under: a merged model's plan digest (its committed snapshot's, an
        alias's too), else its content fingerprint; None while that is unknown (its blocks are not hashed:
        ``mergepipe analyze``), since nothing can have been stored under it."""
        snapshot = self._snapshots.of_model(model.id) if model.kind == "snapshot" else None
        if snapshot is not None:
            return EvaluationSubject("plan", snapshot.plan_id)
        try:
            return EvaluationSubject("model", self._blocks.content_fingerprint(model.id))
        except CatalogError:
            return None

    def add(self, rows: Sequence[EvaluationRecord]) -> None:
        """Store ``rows`` in one transaction, each replacing the row of its (subject, data, metric) if any. Each
        row carries its own ``created_at`` (``catalog.now()`` when it was measured), so it reads back as given."""
        for row in rows:
            if row.subject_kind not in SUBJECT_KINDS:
                raise CatalogError(
                    f"evaluation of '{row.subject}': subject kind '{row.subject_kind}' is not one "
                    f"of {', '.join(SUBJECT_KINDS)}"
                )
        with self._db.transaction():
            self._db.write_many(
                f"INSERT INTO evaluations ({_EVALUATIONS_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (subject, data_digest, metric) DO UPDATE SET subject_kind = excluded.subject_kind, "
                "data_name = excluded.data_name, value = excluded.value, tokens = excluded.tokens, "
                "versions = excluded.versions, device = excluded.device, seconds = excluded.seconds, "
                "created_at = excluded.created_at",
                [
                    (
                        r.subject,
                        r.subject_kind,
                        r.data_digest,
                        r.data_name,
                        r.metric,
                        None if math.isnan(r.value) else r.value,
                        r.tokens,
                        json.dumps(r.versions, sort_keys=True),
                        r.device,
                        r.seconds,
                        r.created_at,
                    )
                    for r in rows
                ],
            )

    def get(self, subject: str, data_digest: str) -> list[EvaluationRecord]:
        """Every metric of ``subject`` on the data ``data_digest``, by metric."""
        rows = self._db.query(
            f"SELECT {_EVALUATIONS_COLUMNS} FROM evaluations WHERE subject = ? AND data_digest = ? ORDER BY metric",
            (subject, data_digest),
        )
        return [_record(row) for row in rows]

    def for_subjects(self, subjects: Sequence[str]) -> dict[str, list[EvaluationRecord]]:
        """Subject -> its rows, by data name, data digest and metric; a subject without rows is left out."""
        wanted = sorted(set(subjects))
        found: dict[str, list[EvaluationRecord]] = {}
        for start in range(0, len(wanted), _SUBJECTS_PER_QUERY):
            part = wanted[start : start + _SUBJECTS_PER_QUERY]
            rows = self._db.query(
                f"SELECT {_EVALUATIONS_COLUMNS} FROM evaluations WHERE subject IN ({', '.join('?' * len(part))}) "
                "ORDER BY subject, data_name, data_digest, metric",
                part,
            )
            for row in rows:
                found.setdefault(row[0], []).append(_record(row))
        return found


def _record(row: tuple) -> EvaluationRecord:
    subject, kind, digest, name, metric, value, tokens, versions, device, seconds, created_at = row
    return EvaluationRecord(
        subject=subject,
        subject_kind=kind,
        data_digest=digest,
        data_name=name,
        metric=metric,
        value=math.nan if value is None else float(value),
        tokens=None if tokens is None else int(tokens),
        versions=json.loads(versions),
        device=device,
        seconds=float(seconds),
        created_at=created_at,
    )


_SEARCHES_COLUMNS = "snapshot_id, study, trial, trials, objective, params, search_budget, created_at"


class SearchStore:
    """The ``searches`` table."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def add(self, row: SearchRecord) -> None:
        """Record that ``row.snapshot_id`` is the best trial of its study (again: the row is replaced)."""
        with self._db.transaction():
            self._db.write(
                f"INSERT INTO searches ({_SEARCHES_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (snapshot_id, study, trial) DO UPDATE SET trials = excluded.trials, "
                "objective = excluded.objective, params = excluded.params, search_budget = excluded.search_budget, "
                "created_at = excluded.created_at",
                (
                    row.snapshot_id,
                    row.study,
                    row.trial,
                    row.trials,
                    row.objective,
                    json.dumps(row.params, sort_keys=True),
                    row.search_budget,
                    row.created_at,
                ),
            )

    def of_snapshot(self, snapshot_id: str) -> list[SearchRecord]:
        """The searches whose best ``snapshot_id`` is, oldest first."""
        rows = self._db.query(
            f"SELECT {_SEARCHES_COLUMNS} FROM searches WHERE snapshot_id = ? ORDER BY created_at, study", (snapshot_id,)
        )
        return [
            SearchRecord(
                snapshot_id=r[0],
                study=r[1],
                trial=int(r[2]),
                trials=int(r[3]),
                objective=float(r[4]),
                params=json.loads(r[5]),
                search_budget=r[6],
                created_at=r[7],
            )
            for r in rows
        ]


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
            self._db.write(
                "INSERT INTO analyze_reads (id, host, recorded_at, bytes_read, seconds) VALUES (?, ?, ?, ?, ?)",
                (uuid.uuid4().hex, host, self._now(), bytes_read, seconds),
            )

    def read_rate(self, host: str) -> float | None:
        """Bytes per second analysis read on ``host`` (its last ``READ_RUNS`` runs, weighted by bytes); None
        when it never analysed here."""
        row = self._db.query_one(
            "SELECT SUM(bytes_read), SUM(seconds) FROM (SELECT bytes_read, seconds FROM analyze_reads WHERE host = ? "
            "ORDER BY recorded_at DESC LIMIT ?) AS recent",
            (host, READ_RUNS),
        )
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
                [(host, device, op, value, now) for op, value in sorted(seconds_per_element.items())],
            )

    def kernel_seconds(self, host: str, device: str) -> dict[str, float]:
        """Operator -> its probed seconds per element and expert on ``device`` of ``host``."""
        return dict(
            self._db.query(
                "SELECT operator, seconds_per_element FROM kernel_probes WHERE host = ? AND device = ?", (host, device)
            )
        )

    # ---------------------------------------------------------------- merges

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
