"""Delta stores: where an expert's delta lives as largest-first entry chunks and sketch stages.

One store per analysed (expert, base) pair, at most; it goes when the pair's
analysis goes (re-registering the expert drops both). ``digest`` identifies
the store's content (every part's hash) so a plan that reads it can pin it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, astuple, dataclass

from mergepipe.catalog.database import Database
from mergepipe.catalog.statistics import StatisticsStore


@dataclass(frozen=True)
class DeltaChunk:
    """Chunk ``index`` of a tensor's entries: bytes ``[begin, end)`` of the store file."""

    tensor: str
    index: int
    begin: int
    end: int
    entries: int
    gap_bytes: int
    energy: float
    hash: str

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DeltaStage:
    """Sketch stage ``stage`` (1, 2, ...) of a tensor: bytes ``[begin, end)`` of the store file."""

    tensor: str
    stage: int
    begin: int
    end: int
    rows: int
    residual: float  # energy of the delta left after this stage
    norm: float  # norm of the approximation up to this stage
    hash: str

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class DeltaStoreRecord:
    expert_id: str
    base_id: str
    path: str
    file_size: int
    digest: str
    created_at: str

    def to_json(self) -> dict:
        return asdict(self)


def store_digest(chunks: Sequence[DeltaChunk], stages: Sequence[DeltaStage]) -> str:
    """sha256 over every part's (tensor, index, hash), in order: the store's identity."""
    h = hashlib.sha256()
    for c in chunks:
        h.update(f"{c.tensor}\0{c.index}\0{c.hash}\0{c.entries}\n".encode())
    for st in stages:
        h.update(f"{st.tensor}\0stage {st.stage}\0{st.hash}\n".encode())
    return h.hexdigest()


class DeltaStores:
    """Delta store records and their chunk index (see the module docstring)."""

    def __init__(self, db: Database, now: Callable[[], str], stats: StatisticsStore) -> None:
        self._db = db
        self._now = now
        self._stats = stats

    def record(self, expert_id: str, base_id: str, path: str, file_size: int,
               chunks: Sequence[DeltaChunk], stages: Sequence[DeltaStage]) -> DeltaStoreRecord:
        """Record (or replace) the store of an analysed pair, with its parts, in one transaction."""
        with self._db.transaction():
            self._stats.require(expert_id, base_id)
            self._db.write("DELETE FROM delta_stores WHERE expert_id = ? AND base_id = ?", (expert_id, base_id))
            record = DeltaStoreRecord(expert_id, base_id, path, file_size, store_digest(chunks, stages), self._now())
            self._db.write(
                "INSERT INTO delta_stores (expert_id, base_id, path, file_size, digest, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                astuple(record),
            )
            self._db.insert_rows(
                "delta_chunks", ("expert_id", "base_id", "tensor", "idx", "byte_begin", "byte_end", "entries",
                                 "gap_bytes", "energy", "hash"),
                ((expert_id, base_id, c.tensor, c.index, c.begin, c.end, c.entries, c.gap_bytes, c.energy, c.hash)
                 for c in chunks),
            )
            self._db.insert_rows(
                "delta_stages", ("expert_id", "base_id", "tensor", "stage", "byte_begin", "byte_end", "rows",
                                 "residual", "norm", "hash"),
                ((expert_id, base_id, st.tensor, st.stage, st.begin, st.end, st.rows, st.residual, st.norm, st.hash)
                 for st in stages),
            )
            return record

    def find(self, expert_id: str, base_id: str) -> DeltaStoreRecord | None:
        row = self._db.query_one(
            "SELECT expert_id, base_id, path, file_size, digest, created_at FROM delta_stores "
            "WHERE expert_id = ? AND base_id = ?",
            (expert_id, base_id),
        )
        return None if row is None else DeltaStoreRecord(*row)

    def paths(self) -> list[str]:
        """The file of every recorded store, sorted."""
        return [row[0] for row in self._db.query("SELECT path FROM delta_stores ORDER BY path")]

    def chunks(self, expert_id: str, base_id: str) -> dict[str, list[DeltaChunk]]:
        """Tensor name -> its chunks, largest entries first."""
        return self._by_tensor(
            "SELECT tensor, idx, byte_begin, byte_end, entries, gap_bytes, energy, hash FROM delta_chunks "
            "WHERE expert_id = ? AND base_id = ? ORDER BY tensor, idx",
            (expert_id, base_id), DeltaChunk,
        )

    def stages(self, expert_id: str, base_id: str) -> dict[str, list[DeltaStage]]:
        """Tensor name -> its sketch stages, in order."""
        return self._by_tensor(
            "SELECT tensor, stage, byte_begin, byte_end, rows, residual, norm, hash FROM delta_stages "
            "WHERE expert_id = ? AND base_id = ? ORDER BY tensor, stage",
            (expert_id, base_id), DeltaStage,
        )

    def _by_tensor(self, sql: str, params: tuple, record: type) -> dict[str, list]:
        """Rows whose first column is the tensor name, as ``record``s grouped by tensor (in query order)."""
        out: dict[str, list] = {}
        for row in self._db.query(sql, params):
            out.setdefault(row[0], []).append(record(*row))
        return out
