"""Models: what is registered, its files and tensors, its versions and its lineage.

A model is a checkpoint directory, a published snapshot, or a delta
checkpoint (Δ = E − B against the base its record names). Its record, files
(name, size, mtime, header hash at registration), tensors (byte ranges) and
block geometry are written together when it is registered; a snapshot also
gets its parents (the base and the experts it was merged from), and an
alias (a snapshot published under a second id) the model whose snapshot it
is (role ``same snapshot``).

Versions: a model id people use is a *name*; each registration of new
content under it (``register --new-version``, or publishing a merge under
an existing merged id) is a new version. Version 1 keeps the plain id, later
ones are stored as ``name@N``. ``resolve`` turns what people type into a
record: ``math`` is the latest version, ``math@1`` the first; internally
every table keys on the stored id, so a plan, a snapshot or an analysis
always names one exact version.
"""

from __future__ import annotations

import builtins
import hashlib
import json
from collections.abc import Iterable, Sequence

from mergepipe.catalog.database import Database
from mergepipe.catalog.records import (
    BASED_KINDS,
    MODEL_KINDS,
    PARENT_ROLES,
    SAME_SNAPSHOT,
    BlockRecord,
    FileRecord,
    ModelContent,
    ModelRecord,
    TensorRecord,
    require_model,
    unknown_model,
)
from mergepipe.errors import CatalogError, UnknownModelError
from mergepipe.spec.settings import VERSIONED


class BlockStore:
    """Block rows of every model (see the module docstring)."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def add(self, model_id: str, blocks: Sequence[BlockRecord]) -> None:
        """Insert a model's blocks (inside the caller's transaction)."""
        self._db.insert_rows(
            "blocks",
            ("model_id", "tensor", "idx", "row_start", "row_end", "byte_begin", "byte_end", "hash"),
            ((model_id, b.tensor, b.index, b.row_start, b.row_end, b.begin, b.end, b.hash) for b in blocks),
        )

    def by_tensor(self, model_id: str) -> dict[str, list[BlockRecord]]:
        """Tensor name -> its blocks in index order (tensors in file order)."""
        rows = self._db.query(
            "SELECT b.tensor, b.idx, b.row_start, b.row_end, b.byte_begin, b.byte_end, b.hash "
            "FROM blocks b JOIN tensors t ON t.model_id = b.model_id AND t.name = b.tensor "
            "WHERE b.model_id = ? ORDER BY t.ordinal, b.idx",
            (model_id,),
        )
        if not rows:
            require_model(self._db, model_id)
        out: dict[str, list[BlockRecord]] = {}
        for row in rows:
            out.setdefault(row[0], []).append(BlockRecord(*row))
        return out

    def of_tensor(self, model_id: str, tensor: str) -> list[BlockRecord]:
        """One tensor's blocks in index order (empty for a tensor the model does not have): a primary-key
        range, for callers that need a few tensors of a model whose blocks may number millions."""
        rows = self._db.query(
            "SELECT tensor, idx, row_start, row_end, byte_begin, byte_end, hash FROM blocks "
            "WHERE model_id = ? AND tensor = ? ORDER BY idx",
            (model_id, tensor),
        )
        return [BlockRecord(*row) for row in rows]

    def hashes(self, model_id: str) -> dict[str, list[str | None]]:
        """Tensor name -> content hash of each block in index order (``None`` until
        analysed); lighter than ``by_tensor`` when only hashes are needed."""
        rows = self._db.query("SELECT tensor, hash FROM blocks WHERE model_id = ? ORDER BY tensor, idx", (model_id,))
        if not rows:
            require_model(self._db, model_id)
        out: dict[str, list[str | None]] = {}
        for tensor, digest in rows:
            out.setdefault(tensor, []).append(digest)
        return out

    def hashed_count(self, model_id: str) -> int:
        (count,) = self._db.query_row(
            "SELECT count(*) FROM blocks WHERE model_id = ? AND hash IS NOT NULL", (model_id,)
        )
        return count

    def set_hashes(self, model_id: str, hashes: Iterable[tuple[str, int, str]]) -> None:
        """Record content hashes as (tensor, block index, hex digest).

        Only NULL hashes are filled: a hash never changes for a registered
        model, so a concurrent analyse writing the same value is harmless.
        """
        with self._db.transaction():
            self._db.write_many(
                "UPDATE blocks SET hash = ? WHERE model_id = ? AND tensor = ? AND idx = ? AND hash IS NULL",
                ((digest, model_id, tensor, index) for tensor, index, digest in hashes),
            )
            unhashed = self._db.query_row(
                "SELECT count(*) FROM blocks WHERE model_id = ? AND hash IS NULL", (model_id,)
            )[0]
            if not unhashed:
                self._db.write(
                    "UPDATE models SET content_fingerprint = ? WHERE id = ?",
                    (self._compute_fingerprint(model_id), model_id),
                )

    def content_fingerprint(self, model_id: str) -> str:
        """The layout fingerprint combined with every block's content hash.

        Experts fine-tuned from one base share a layout (so a layout
        fingerprint), but not their bytes. Stored when the last block is
        hashed; needs the model's blocks hashed (``mergepipe analyze``),
        CatalogError otherwise.
        """
        row = self._db.query_one("SELECT content_fingerprint FROM models WHERE id = ?", (model_id,))
        if row is None:
            raise unknown_model(self._db, model_id)
        return row[0] if row[0] is not None else self._compute_fingerprint(model_id)

    def _compute_fingerprint(self, model_id: str) -> str:
        row = self._db.query_one("SELECT fingerprint FROM models WHERE id = ?", (model_id,))
        if row is None:
            raise unknown_model(self._db, model_id)
        # tensors in name order (byte order of UTF-8 = code point order), blocks by index
        rows = self._db.query(
            "SELECT tensor, idx, hash FROM blocks WHERE model_id = ? ORDER BY tensor, idx", (model_id,)
        )
        if any(h is None for _, _, h in rows):
            raise CatalogError(
                f"model '{model_id}' is not analysed yet; run `mergepipe analyze --db {self._db.path} {model_id}`"
            )
        digest = hashlib.sha256(row[0].encode())
        digest.update("".join(f"{tensor}\0{index}\0{h}\n" for tensor, index, h in rows).encode())
        return digest.hexdigest()


_COLUMNS = (
    "id, uri, kind, fingerprint, architecture, num_layers, total_bytes, n_tensors, n_blocks, created_at, name, "
    "version, delta_base, side_files"
)
#: ``name@N``: version N of a model family.
_VERSIONED = VERSIONED


class ModelStore:
    """Models, files, tensors and parents (see the module docstring)."""

    def __init__(self, db: Database, blocks: BlockStore) -> None:
        self._db = db
        self._blocks = blocks

    # ------------------------------------------------------------------ reads

    def find(self, model_id: str) -> ModelRecord | None:
        row = self._db.query_one(f"SELECT {_COLUMNS} FROM models WHERE id = ?", (model_id,))
        return None if row is None else ModelRecord(*row)

    def get(self, model_id: str) -> ModelRecord:
        """The model's record; UnknownModelError listing the known ids if absent."""
        record = self.find(model_id)
        if record is None:
            raise self.unknown(model_id)
        return record

    def resolve(self, ref: str) -> ModelRecord:
        """The model ``ref`` names: a name (its latest version), ``name@N`` (version N) or a
        stored id; UnknownModelError otherwise."""
        record = self.latest(ref)
        if record is None:
            match = _VERSIONED.match(ref)
            if match:
                row = self._db.query_one(
                    f"SELECT {_COLUMNS} FROM models WHERE name = ? AND version = ?",
                    (match["name"], int(match["version"])),
                )
                record = None if row is None else ModelRecord(*row)
        if record is None:
            record = self.find(ref)
        if record is None:
            raise self.unknown(ref)
        return record

    def exact_ref(self, record: ModelRecord) -> str:
        """A reference that resolves to exactly ``record``: its name if it is the latest version, else
        ``name@N`` (version 1's stored id is also its family's name, which means the latest version)."""
        return record.ref(self.latest(record.name) == record)

    def latest(self, name: str) -> ModelRecord | None:
        """The latest version of a model family, or None."""
        row = self._db.query_one(f"SELECT {_COLUMNS} FROM models WHERE name = ? ORDER BY version DESC LIMIT 1", (name,))
        return None if row is None else ModelRecord(*row)

    def versions(self, name: str) -> list[ModelRecord]:
        """Every version of a model family, oldest first."""
        rows = self._db.query(f"SELECT {_COLUMNS} FROM models WHERE name = ? ORDER BY version", (name,))
        return [ModelRecord(*row) for row in rows]

    def next_snapshot_id(self, name: str) -> str:
        """The id a merge published as ``name`` gets: ``name`` for the first version, ``name@N`` after
        that; CatalogError when ``name`` is a registered checkpoint."""
        if _VERSIONED.match(name):
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
        match = _VERSIONED.match(model_id)
        if match:
            latest = self.latest(match["name"])
            if latest is not None and latest.version == int(match["version"]) - 1:
                return match["name"], int(match["version"])
        return model_id, 1

    def registered_at(self, uri: str) -> ModelRecord | None:
        """The checkpoint most recently registered from location ``uri`` (an absolute path), or None."""
        row = self._db.query_one(
            f"SELECT {_COLUMNS} FROM models WHERE uri = ? AND kind = 'checkpoint' "
            "ORDER BY created_at DESC, version DESC LIMIT 1",
            (uri,),
        )
        return None if row is None else ModelRecord(*row)

    def exists(self, model_id: str) -> bool:
        return self._db.query_one("SELECT 1 FROM models WHERE id = ?", (model_id,)) is not None

    def require(self, model_id: str) -> None:
        require_model(self._db, model_id)

    def list(self) -> list[ModelRecord]:
        rows = self._db.query(f"SELECT {_COLUMNS} FROM models ORDER BY created_at, id")
        return [ModelRecord(*row) for row in rows]

    def unknown(self, model_id: str) -> UnknownModelError:
        return unknown_model(self._db, model_id)

    def files(self, model_id: str) -> builtins.list[FileRecord]:
        rows = self._db.query(
            "SELECT name, size, mtime_ns, header_sha256, etag FROM files WHERE model_id = ? ORDER BY position",
            (model_id,),
        )
        if not rows:
            self.require(model_id)
        return [FileRecord(*row) for row in rows]

    def tensors(self, model_id: str) -> builtins.list[TensorRecord]:
        """Every tensor of the model, in file order then offset order."""
        rows = self._db.query(
            "SELECT name, file, dtype, shape, byte_begin, byte_end, ordinal FROM tensors "
            "WHERE model_id = ? ORDER BY ordinal",
            (model_id,),
        )
        if not rows:
            self.require(model_id)
        return [
            TensorRecord(name, file, dtype, tuple(json.loads(shape)), begin, end, ordinal)
            for name, file, dtype, shape, begin, end, ordinal in rows
        ]

    def parents(self, model_id: str) -> builtins.list[tuple[str, str]]:
        """(parent id, role) in the order given at commit: the lineage of a snapshot."""
        self.require(model_id)
        rows = self._db.query(
            "SELECT parent_id, role FROM model_parents WHERE model_id = ? ORDER BY position", (model_id,)
        )
        return [(p, r) for p, r in rows]

    def same_snapshot_as(self, model_id: str) -> str | None:
        """For an alias (a merge's snapshot published under another id), the model whose snapshot it
        publishes; None for every other model."""
        row = self._db.query_one(
            "SELECT parent_id FROM model_parents WHERE model_id = ? AND role = ?", (model_id, SAME_SNAPSHOT)
        )
        return None if row is None else str(row[0])

    def deltas_of(self, base_id: str) -> builtins.list[str]:
        """Models of kind ``delta`` taken against ``base_id``."""
        rows = self._db.query("SELECT id FROM models WHERE delta_base = ? ORDER BY id", (base_id,))
        return [r[0] for r in rows]

    def children(self, model_id: str) -> builtins.list[str]:
        """Models (snapshots) that have ``model_id`` as a parent."""
        rows = self._db.query(
            "SELECT DISTINCT model_id FROM model_parents WHERE parent_id = ? ORDER BY model_id", (model_id,)
        )
        return [r[0] for r in rows]

    # ----------------------------------------------------------------- writes

    def record_side_files(self, model_id: str, side_files: str) -> None:
        """Record the side files of a model an earlier release registered without them (``side_files`` NULL)."""
        self._db.write("UPDATE models SET side_files = ? WHERE id = ? AND side_files IS NULL", (side_files, model_id))

    def add(self, content: ModelContent, parents: Sequence[tuple[str, str]] = ()) -> None:
        """Insert a model with its files, tensors, blocks and parents.

        Low level: registration and snapshot commits decide whether a model
        may be added; this only refuses an id that is taken.
        """
        record = content.record
        if record.kind not in MODEL_KINDS:
            raise ValueError(f"model kind must be one of {MODEL_KINDS}, got {record.kind!r}")
        if (record.kind in BASED_KINDS) != (record.delta_base is not None):
            raise ValueError(
                f"a model of kind 'delta' or 'lora' (and only those) names its base, got "
                f"{record.kind!r} with base {record.delta_base!r}"
            )
        with self._db.transaction():
            if self.exists(record.id):
                raise CatalogError(f"model '{record.id}' is already registered; use a new id")
            for parent_id, role in parents:
                if role not in PARENT_ROLES:
                    raise ValueError(f"parent role must be one of {PARENT_ROLES}, got {role!r}")
                self.require(parent_id)
            if (
                self._db.query_one("SELECT 1 FROM models WHERE name = ? AND version = ?", (record.name, record.version))
                is not None
            ):
                raise CatalogError(f"model '{record.label}' is already registered")
            self._db.write(
                f"INSERT INTO models ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.id,
                    record.uri,
                    record.kind,
                    record.fingerprint,
                    record.architecture,
                    record.num_layers,
                    record.total_bytes,
                    record.n_tensors,
                    record.n_blocks,
                    record.created_at,
                    record.name,
                    record.version,
                    record.delta_base,
                    record.side_files,
                ),
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
            self._blocks.add(record.id, content.blocks)
            self._db.write_many(
                "INSERT INTO model_parents (model_id, position, parent_id, role) VALUES (?, ?, ?, ?)",
                ((record.id, i, parent, role) for i, (parent, role) in enumerate(parents)),
            )

    def delete(self, model_id: str) -> None:
        """Remove a model and everything derived from it (hashes, analyses it is
        part of). Refused for snapshots and for parents of snapshots."""
        with self._db.transaction():
            record = self.get(model_id)
            if record.kind == "snapshot":
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
