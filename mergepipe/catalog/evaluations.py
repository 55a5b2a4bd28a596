"""What models scored: one row per (subject, data, metric), shown by explain, diff and lineage.

Rows are keyed by content, never by a model id: a merged model by its plan
digest (the same plan gives the same bytes, so the in-memory evaluation of a
plan and that of its snapshot are one subject), any other model by its
content fingerprint. So a row stays true after ``gc`` or ``rm`` (which leave
it), and holds again for whatever later has that content. Evaluating the
same subject on the same data again replaces its rows. The evaluation itself
(data, loss, digests) is the application's; this store keeps its numbers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from mergepipe.catalog.blocks import BlockStore
from mergepipe.catalog.database import Database
from mergepipe.catalog.records import SUBJECT_KINDS, EvaluationRecord, EvaluationSubject, ModelRecord
from mergepipe.catalog.snapshots import SnapshotStore
from mergepipe.errors import CatalogError

#: Subjects per query of ``for_subjects``: well under SQLite's smallest limit on bound parameters (999).
_SUBJECTS_PER_QUERY = 500

_COLUMNS = ("subject, subject_kind, data_digest, data_name, metric, value, tokens, versions, device, seconds, "
            "created_at")


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
                raise CatalogError(f"evaluation of '{row.subject}': subject kind '{row.subject_kind}' is not one "
                                   f"of {', '.join(SUBJECT_KINDS)}")
        with self._db.transaction():
            self._db.write_many(
                f"INSERT INTO evaluations ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (subject, data_digest, metric) DO UPDATE SET subject_kind = excluded.subject_kind, "
                "data_name = excluded.data_name, value = excluded.value, tokens = excluded.tokens, "
                "versions = excluded.versions, device = excluded.device, seconds = excluded.seconds, "
                "created_at = excluded.created_at",
                [(r.subject, r.subject_kind, r.data_digest, r.data_name, r.metric,
                  None if math.isnan(r.value) else r.value, r.tokens, json.dumps(r.versions, sort_keys=True),
                  r.device, r.seconds, r.created_at) for r in rows])

    def get(self, subject: str, data_digest: str) -> list[EvaluationRecord]:
        """Every metric of ``subject`` on the data ``data_digest``, by metric."""
        rows = self._db.query(f"SELECT {_COLUMNS} FROM evaluations WHERE subject = ? AND data_digest = ? "
                              "ORDER BY metric", (subject, data_digest))
        return [_record(row) for row in rows]

    def for_subjects(self, subjects: Sequence[str]) -> dict[str, list[EvaluationRecord]]:
        """Subject -> its rows, by data name, data digest and metric; a subject without rows is left out."""
        wanted = sorted(set(subjects))
        found: dict[str, list[EvaluationRecord]] = {}
        for start in range(0, len(wanted), _SUBJECTS_PER_QUERY):
            part = wanted[start:start + _SUBJECTS_PER_QUERY]
            rows = self._db.query(
                f"SELECT {_COLUMNS} FROM evaluations WHERE subject IN ({', '.join('?' * len(part))}) "
                "ORDER BY subject, data_name, data_digest, metric", part)
            for row in rows:
                found.setdefault(row[0], []).append(_record(row))
        return found


def _record(row: tuple) -> EvaluationRecord:
    subject, kind, digest, name, metric, value, tokens, versions, device, seconds, created_at = row
    return EvaluationRecord(subject=subject, subject_kind=kind, data_digest=digest, data_name=name, metric=metric,
                            value=math.nan if value is None else float(value),
                            tokens=None if tokens is None else int(tokens), versions=json.loads(versions),
                            device=device, seconds=float(seconds), created_at=created_at)
