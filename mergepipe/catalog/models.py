"""Models and their blocks: records, files, tensors, block geometry and content hashes, versions (stored as
``name@N`` after the first) and lineage.
"""

from __future__ import annotations

import builtins
import hashlib
import json
from collections.abc import Iterable, Sequence

from mergepipe.catalog.database import Database
from mergepipe.catalog.records import (
    PARENT_ROLES,
    SAME_SNAPSHOT,
    BlockRecord,
    FileRecord,
    ModelContent,
    ModelRecord,
    TensorRecord,
    from_row,
)
from mergepipe.errors import CatalogError, UnknownModelError
from mergepipe.spec.settings import VERSIONED

#: How many registered ids an "unknown model" message lists.
MAX_IDS_SHOWN = 10
_COLUMNS = ", ".join(ModelRecord.model_fields)


class ModelStore:
    """Models, their files, tensors, versions and parents."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def _select(self, where: str, params: Sequence[object]) -> builtins.list[ModelRecord]:
        return [from_row(ModelRecord, row) for row in self._db.query(f"SELECT {_COLUMNS} FROM models {where}", params)]

    def find(self, model_id: str) -> ModelRecord | None:
        return next(iter(self._select("WHERE id = ?", (model_id,))), None)

    def get(self, model_id: str) -> ModelRecord:
        record = self.find(model_id)
        if record is None:
            raise self.unknown(model_id)
        return record

    def resolve(self, ref: str) -> ModelRecord:
        """The model ``ref`` names: a name (its latest version), ``name@N`` or a stored id."""
        record = self.latest(ref)
        match = VERSIONED.match(ref)
        if record is None and match:
            sql = "WHERE name = ? AND version = ?"
            record = next(iter(self._select(sql, (match["name"], int(match["version"])))), None)
        return record or self.get(ref)

    def exact_ref(self, record: ModelRecord) -> str:
        """A reference that resolves to exactly ``record`` (``ModelRecord.ref``)."""
        return record.ref(self.latest(record.name) == record)

    def latest(self, name: str) -> ModelRecord | None:
        """The latest version of a model family, or None."""
        return next(iter(self._select("WHERE name = ? ORDER BY version DESC LIMIT 1", (name,))), None)

    def versions(self, name: str) -> builtins.list[ModelRecord]:
        """Every version of a model family, oldest first."""
        return self._select("WHERE name = ? ORDER BY version", (name,))

    def next_snapshot_id(self, name: str) -> str:
        """The id a merge published as ``name`` gets."""
        if VERSIONED.match(name):
            raise CatalogError(
                f"--model-id {name!r} ends in @<number>, which names a version; give the merged model's name "
                "(MergePipe numbers its versions)"
            )
        latest = self.latest(name)
        if latest is None:
            if self.exists(name):
                raise CatalogError(f"model '{name}' is already registered; choose another --model-id")
            return name
        if latest.kind != "snapshot":
            raise CatalogError(
                f"model '{name}' is a registered checkpoint, not a merged model; choose another --model-id"
            )
        return f"{name}@{latest.version + 1}"

    def version_of(self, model_id: str) -> tuple[str, int]:
        """``(name, version)`` of a new model row with id ``model_id`` (``name@N`` continues a family)."""
        match = VERSIONED.match(model_id)
        if match:
            latest = self.latest(match["name"])
            if latest is not None and latest.version == int(match["version"]) - 1:
                return match["name"], int(match["version"])
        return model_id, 1

    def registered_at(self, uri: str) -> ModelRecord | None:
        """The checkpoint most recently registered from ``uri`` (an absolute path), or None."""
        sql = "WHERE uri = ? AND kind = 'checkpoint' ORDER BY created_at DESC, version DESC LIMIT 1"
        return next(iter(self._select(sql, (uri,))), None)

    def exists(self, model_id: str) -> bool:
        return self._db.query_one("SELECT 1 FROM models WHERE id = ?", (model_id,)) is not None

    def require(self, model_id: str) -> None:
        if not self.exists(model_id):
            raise self.unknown(model_id)

    def list(self) -> builtins.list[ModelRecord]:
        return self._select("ORDER BY created_at, id", ())

    def unknown(self, model_id: str) -> UnknownModelError:
        ids = [r[0] for r in self._db.query("SELECT id FROM models ORDER BY id")]
        known = "registered: " + ", ".join(ids[:MAX_IDS_SHOWN]) if ids else "none registered yet"
        if len(ids) > MAX_IDS_SHOWN:
            known += f" … ({len(ids)} in all)"
        return UnknownModelError(f"unknown model '{model_id}'; {known} (register it with `mergepipe register`)")

    def files(self, model_id: str) -> builtins.list[FileRecord]:
        sql = "SELECT name, size, mtime_ns, header_sha256, etag FROM files WHERE model_id = ? ORDER BY position"
        rows = self._db.query(sql, (model_id,))
        if not rows:
            self.require(model_id)
        return [from_row(FileRecord, row) for row in rows]

    def tensors(self, model_id: str) -> builtins.list[TensorRecord]:
        """Every tensor of the model, in file order then offset order."""
        rows = self._db.query(
            "SELECT name, file, dtype, shape, byte_begin, byte_end, ordinal FROM tensors "
            "WHERE model_id = ? ORDER BY ordinal",
            (model_id,),
        )
        if not rows:
            self.require(model_id)
        return [TensorRecord(n, f, d, tuple(json.loads(shape)), b, e, o) for n, f, d, shape, b, e, o in rows]

    def parents(self, model_id: str) -> builtins.list[tuple[str, str]]:
        """(parent id, role) in the order given at commit: the lineage of a snapshot."""
        self.require(model_id)
        sql = "SELECT parent_id, role FROM model_parents WHERE model_id = ? ORDER BY position"
        return [(p, r) for p, r in self._db.query(sql, (model_id,))]

    def same_snapshot_as(self, model_id: str) -> str | None:
        """For an alias (a snapshot published under another id), the model whose snapshot it is; else None."""
        sql = "SELECT parent_id FROM model_parents WHERE model_id = ? AND role = ?"
        row = self._db.query_one(sql, (model_id, SAME_SNAPSHOT))
        return None if row is None else str(row[0])

    def deltas_of(self, base_id: str) -> builtins.list[str]:
        """Models of kind ``delta`` (or ``lora``) taken against ``base_id``."""
        return [r[0] for r in self._db.query("SELECT id FROM models WHERE delta_base = ? ORDER BY id", (base_id,))]

    def children(self, model_id: str) -> builtins.list[str]:
        """Models (snapshots) that have ``model_id`` as a parent."""
        sql = "SELECT DISTINCT model_id FROM model_parents WHERE parent_id = ? ORDER BY model_id"
        return [r[0] for r in self._db.query(sql, (model_id,))]

    def record_side_files(self, model_id: str, side_files: str) -> None:
        """Record the side files of a model an earlier release registered without them."""
        self._db.write("UPDATE models SET side_files = ? WHERE id = ? AND side_files IS NULL", (side_files, model_id))

    def add(self, content: ModelContent, parents: Sequence[tuple[str, str]] = ()) -> None:
        """Insert a model with its files, tensors, blocks and parents ((id, role) in order)."""
        record = content.record
        with self._db.transaction():
            if self.exists(record.id):
                raise CatalogError(f"model '{record.id}' is already registered; use a new id")
            for parent_id, role in parents:
                if role not in PARENT_ROLES:
                    raise ValueError(f"parent role must be one of {PARENT_ROLES}, got {role!r}")
                self.require(parent_id)
            if self._select("WHERE name = ? AND version = ?", (record.name, record.version)):
                raise CatalogError(f"model '{record.label}' is already registered")
            values = record.model_dump()
            self._db.write(
                f"INSERT INTO models ({_COLUMNS}) VALUES ({', '.join('?' * len(values))})", [*values.values()]
            )
            self._db.write_many(
                "INSERT INTO files (model_id, name, position, size, mtime_ns, header_sha256, etag) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    (record.id, f.name, i, f.size, f.mtime_ns, f.header_sha256, f.etag)
                    for i, f in enumerate(content.files)
                ),
            )
            self._db.write_many(
                "INSERT INTO tensors (model_id, name, file, dtype, shape, byte_begin, byte_end, ordinal) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    (record.id, t.name, t.file, t.dtype, json.dumps(list(t.shape)), t.begin, t.end, t.ordinal)
                    for t in content.tensors
                ),
            )
            self._db.insert_rows(
                "blocks",
                ("model_id", "tensor", "idx", "row_start", "row_end", "byte_begin", "byte_end", "hash"),
                (
                    (record.id, b.tensor, b.index, b.row_start, b.row_end, b.begin, b.end, b.hash)
                    for b in content.blocks
                ),
            )
            self._db.write_many(
                "INSERT INTO model_parents (model_id, position, parent_id, role) VALUES (?, ?, ?, ?)",
                ((record.id, i, parent, role) for i, (parent, role) in enumerate(parents)),
            )

    def delete(self, model_id: str) -> None:
        """Remove a model and everything derived from it; refused for snapshots, parents and bases of deltas."""
        with self._db.transaction():
            if self.get(model_id).kind == "snapshot":
                raise CatalogError(
                    f"model '{model_id}' is a published snapshot and cannot be replaced; "
                    "register the new content under a new id"
                )
            children = self.children(model_id)
            if children:
                raise CatalogError(
                    f"model '{model_id}' is a parent of snapshot(s) {', '.join(children)} and cannot be "
                    "replaced (they were made from it); register the new content as its next version with "
                    "--new-version instead of --force"
                )
            deltas = self.deltas_of(model_id)
            if deltas:
                raise CatalogError(
                    f"model '{model_id}' is the base of delta checkpoint(s) {', '.join(deltas)} and cannot be "
                    "replaced; register the new content under a new id"
                )
            self._db.write("DELETE FROM models WHERE id = ?", (model_id,))


class BlockStore:
    """Block rows of every model: geometry, content hashes, content fingerprints."""

    def __init__(self, db: Database, models: ModelStore) -> None:
        self._db = db
        self._models = models

    def by_tensor(self, model_id: str) -> dict[str, list[BlockRecord]]:
        """Tensor name -> its blocks in index order (tensors in file order)."""
        out = self._db.grouped(
            "SELECT b.tensor, b.idx, b.row_start, b.row_end, b.byte_begin, b.byte_end, b.hash "
            "FROM blocks b JOIN tensors t ON t.model_id = b.model_id AND t.name = b.tensor "
            "WHERE b.model_id = ? ORDER BY t.ordinal, b.idx",
            (model_id,),
            lambda row: BlockRecord(*row),
        )
        if not out:
            self._models.require(model_id)
        return out

    def hashes(self, model_id: str) -> dict[str, list[str | None]]:
        """Tensor name -> each block's content hash in index order (None until analysed)."""
        sql = "SELECT tensor, hash FROM blocks WHERE model_id = ? ORDER BY tensor, idx"
        out = self._db.grouped(sql, (model_id,), lambda row: row[1])
        if not out:
            self._models.require(model_id)
        return out

    def hashed_count(self, model_id: str) -> int:
        sql = "SELECT count(*) FROM blocks WHERE model_id = ? AND hash IS NOT NULL"
        return int(self._db.query_row(sql, (model_id,))[0])

    def set_hashes(self, model_id: str, hashes: Iterable[tuple[str, int, str]]) -> None:
        """Record (tensor, block index, hex digest)s."""
        with self._db.transaction():
            self._db.write_many(
                "UPDATE blocks SET hash = ? WHERE model_id = ? AND tensor = ? AND idx = ? AND hash IS NULL",
                ((digest, model_id, tensor, index) for tensor, index, digest in hashes),
            )
            sql = "SELECT count(*) FROM blocks WHERE model_id = ? AND hash IS NULL"
            if not self._db.query_row(sql, (model_id,))[0]:
                self._db.write(
                    "UPDATE models SET content_fingerprint = ? WHERE id = ?",
                    (self._compute_fingerprint(model_id), model_id),
                )

    def content_fingerprint(self, model_id: str) -> str:
        """The layout fingerprint combined with every block's hash (experts of one base share a layout, not their
        bytes); CatalogError until the model is analysed."""
        row = self._db.query_one("SELECT content_fingerprint FROM models WHERE id = ?", (model_id,))
        if row is None:
            raise self._models.unknown(model_id)
        return row[0] if row[0] is not None else self._compute_fingerprint(model_id)

    def _compute_fingerprint(self, model_id: str) -> str:
        row = self._db.query_one("SELECT fingerprint FROM models WHERE id = ?", (model_id,))
        if row is None:
            raise self._models.unknown(model_id)
        # tensors in name order (byte order of UTF-8 = code point order), blocks by index
        sql = "SELECT tensor, idx, hash FROM blocks WHERE model_id = ? ORDER BY tensor, idx"
        rows = self._db.query(sql, (model_id,))
        if any(h is None for _, _, h in rows):
            raise CatalogError(
                f"model '{model_id}' is not analysed yet; run `mergepipe analyze --db {self._db.path} {model_id}`"
            )
        digest = hashlib.sha256(row[0].encode())
        digest.update("".join(f"{tensor}\0{index}\0{h}\n" for tensor, index, h in rows).encode())
        return digest.hexdigest()
