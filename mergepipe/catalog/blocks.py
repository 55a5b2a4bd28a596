"""Blocks: every model's block geometry and, once analysed, content hashes.

Geometry is written at registration (from the headers); ``hash`` stays NULL
until analysis hashes the block's bytes (blake3). A model's content
fingerprint combines its layout fingerprint with every block hash: plans
record it, so a plan made before a model's bytes changed is seen to be stale.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from mergepipe.catalog.database import Database
from mergepipe.catalog.lookup import require_model, unknown_model
from mergepipe.catalog.records import BlockRecord
from mergepipe.errors import CatalogError


class BlockStore:
    """Block rows of every model (see the module docstring)."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def add(self, model_id: str, blocks: Sequence[BlockRecord]) -> None:
        """Insert a model's blocks (inside the caller's transaction)."""
        self._db.insert_rows(
            "blocks", ("model_id", "tensor", "idx", "row_start", "row_end", "byte_begin", "byte_end", "hash"),
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
        rows = self._db.query("SELECT tensor, idx, hash FROM blocks WHERE model_id = ? ORDER BY tensor, idx",
                              (model_id,))
        if any(h is None for _, _, h in rows):
            raise CatalogError(
                f"model '{model_id}' is not analysed yet; run `mergepipe analyze --db {self._db.path} {model_id}`"
            )
        digest = hashlib.sha256(row[0].encode())
        digest.update("".join(f"{tensor}\0{index}\0{h}\n" for tensor, index, h in rows).encode())
        return digest.hexdigest()
