"""Statistics: per-(expert, base) delta statistics per block and per tensor.

One ``analyses`` row marks an (expert, base) pair as completely recorded:
it is written in the same transaction as every ``block_deltas`` and
``tensor_stats`` row of the pair, and readers refuse a pair without it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, astuple, dataclass

from mergepipe.catalog.database import Database
from mergepipe.catalog.records import AnalysisRecord, BlockDelta, TensorStats, require_model
from mergepipe.errors import CatalogError
from mergepipe.spec.operators import TrimThreshold


class StatisticsStore:
    """Delta statistics of analysed (expert, base) pairs (see the module docstring)."""

    def __init__(self, db: Database, now: Callable[[], str]) -> None:
        self._db = db
        self._now = now

    def is_analyzed(self, expert_id: str, base_id: str) -> bool:
        row = self._db.query_one("SELECT 1 FROM analyses WHERE expert_id = ? AND base_id = ?", (expert_id, base_id))
        return row is not None

    def analyses(self, model_id: str | None = None) -> list[AnalysisRecord]:
        """Recorded (expert, base) analyses, all or those involving ``model_id``."""
        sql = "SELECT expert_id, base_id, analyzed_at FROM analyses"
        params: tuple[str, ...] = ()
        if model_id is not None:
            sql += " WHERE expert_id = ? OR base_id = ?"
            params = (model_id, model_id)
        rows = self._db.query(sql + " ORDER BY expert_id, base_id", params)
        return [AnalysisRecord(*row) for row in rows]

    def record(
        self,
        expert_id: str,
        base_id: str,
        deltas: Iterable[BlockDelta],
        stats: Iterable[TensorStats],
    ) -> None:
        """Write one complete (expert, base) analysis; the ``analyses`` row is
        what marks it done, so partial results can never be mistaken for it."""
        with self._db.transaction():
            self._db.write(
                "INSERT INTO analyses (expert_id, base_id, analyzed_at) VALUES (?, ?, ?)",
                (expert_id, base_id, self._now()),
            )
            self._db.insert_rows(
                "block_deltas",
                ("expert_id", "base_id", "tensor", "idx", "l2", "maxabs", "nnz", "identical"),
                ((expert_id, base_id, d.tensor, d.index, d.l2, d.maxabs, d.nnz, int(d.identical)) for d in deltas),
            )
            self._db.insert_rows(
                "tensor_stats",
                ("expert_id", "base_id", "tensor", "numel", "mergeable", "identical", "thresholds"),
                (
                    (
                        expert_id,
                        base_id,
                        s.tensor,
                        s.numel,
                        int(s.mergeable),
                        int(s.identical),
                        json.dumps([t.to_json() for t in s.thresholds.values()]) if s.mergeable else None,
                    )
                    for s in stats
                ),
            )

    def require(self, expert_id: str, base_id: str) -> None:
        if not self.is_analyzed(expert_id, base_id):
            require_model(self._db, expert_id)
            require_model(self._db, base_id)
            raise CatalogError(
                f"model '{expert_id}' has not been analysed against '{base_id}'; "
                f"run `mergepipe analyze --db {self._db.path} --base {base_id} {expert_id}`"
            )

    def block_deltas(self, expert_id: str, base_id: str) -> dict[str, list[BlockDelta]]:
        """Tensor name -> per-block delta statistics in block order (tensors in
        the base's file order: a delta checkpoint may leave tensors out, and has rows for them)."""
        self.require(expert_id, base_id)
        rows = self._db.query(
            "SELECT d.tensor, d.idx, d.l2, d.maxabs, d.nnz, d.identical FROM block_deltas d "
            "JOIN tensors t ON t.model_id = d.base_id AND t.name = d.tensor "
            "WHERE d.expert_id = ? AND d.base_id = ? ORDER BY t.ordinal, d.idx",
            (expert_id, base_id),
        )
        out: dict[str, list[BlockDelta]] = {}
        for tensor, index, l2, maxabs, nnz, identical in rows:
            out.setdefault(tensor, []).append(BlockDelta(tensor, index, l2, maxabs, nnz, bool(identical)))
        return out

    def block_norms(self, expert_id: str, base_id: str) -> dict[str, list[float | None]]:
        """Tensor name -> ``||Δ||₂`` per block in block order, ``None`` where the
        block is identical to the base (what the planner needs, without
        building a record per block: a 70B model has ~10^5 blocks per expert)."""
        self.require(expert_id, base_id)
        norm = "CASE WHEN identical = 1 THEN NULL ELSE coalesce(l2, 0.0) END"
        array = self._db.dialect.ordered_array(norm, "idx")
        if array is not None:  # a server: each tensor's name sent once, with its norms as one array
            return dict(
                self._db.query(
                    f"SELECT tensor, {array} FROM block_deltas WHERE expert_id = ? AND base_id = ? "
                    "GROUP BY tensor ORDER BY tensor",
                    (expert_id, base_id),
                )
            )
        rows = self._db.query(
            f"SELECT tensor, {norm} FROM block_deltas WHERE expert_id = ? AND base_id = ? ORDER BY tensor, idx",
            (expert_id, base_id),
        )
        out: dict[str, list[float | None]] = {}
        for tensor, l2 in rows:
            out.setdefault(tensor, []).append(l2)
        return out

    def tensor_stats(self, expert_id: str, base_id: str) -> dict[str, TensorStats]:
        """Tensor name -> per-tensor results (identical flag, thresholds)."""
        self.require(expert_id, base_id)
        rows = self._db.query(
            "SELECT s.tensor, s.numel, s.mergeable, s.identical, s.thresholds FROM tensor_stats s "
            "JOIN tensors t ON t.model_id = s.base_id AND t.name = s.tensor "
            "WHERE s.expert_id = ? AND s.base_id = ? ORDER BY t.ordinal",
            (expert_id, base_id),
        )
        return {
            tensor: TensorStats(tensor, numel, bool(mergeable), bool(identical), StoredThresholds(thresholds))
            for tensor, numel, mergeable, identical, thresholds in rows
        }


class StoredThresholds(Mapping[float, TrimThreshold]):
    """One tensor's trim thresholds (density -> threshold) as the catalog stores them, parsed on first use.

    Why lazily: a plan, and the engine again, fetch the statistics of every tensor of every expert, and
    most operators (linear, task arithmetic, SLERP, model stock) never look at a threshold; parsing
    the twelve of the grid per tensor was most of a plan's catalog time (about 60 ms for the 0.6B
    layout with 8 experts, in every merge's start-up). ``text`` is the stored JSON list, None for
    a tensor that has none (not mergeable)."""

    __slots__ = ("_text", "_raw", "_table")

    def __init__(self, text: str | None) -> None:
        self._text = text
        self._raw: dict[float, dict] | None = None  # density -> its stored JSON object
        self._table: dict[float, TrimThreshold] = {}  # those made into values so far

    def _densities(self) -> dict[float, dict]:
        if self._raw is None:
            self._raw = {float(t["density"]): t for t in json.loads(self._text)} if self._text else {}
        return self._raw

    def __getitem__(self, density: float) -> TrimThreshold:
        found = self._table.get(density)
        if found is None:  # a merge uses one or two densities of the grid: only those are made
            found = self._table[density] = TrimThreshold.from_json(self._densities()[density])
        return found

    def __iter__(self) -> Iterator[float]:
        return iter(self._densities())

    def __len__(self) -> int:
        return len(self._densities())

    def __repr__(self) -> str:
        return f"StoredThresholds({dict(self.items())!r})"

    def __reduce__(self) -> tuple:  # pickled (Ray ships the engine's inputs) as what it stores
        return (StoredThresholds, (self._text,))


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

    def record(
        self,
        expert_id: str,
        base_id: str,
        path: str,
        file_size: int,
        chunks: Sequence[DeltaChunk],
        stages: Sequence[DeltaStage],
    ) -> DeltaStoreRecord:
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
                "delta_chunks",
                (
                    "expert_id",
                    "base_id",
                    "tensor",
                    "idx",
                    "byte_begin",
                    "byte_end",
                    "entries",
                    "gap_bytes",
                    "energy",
                    "hash",
                ),
                (
                    (expert_id, base_id, c.tensor, c.index, c.begin, c.end, c.entries, c.gap_bytes, c.energy, c.hash)
                    for c in chunks
                ),
            )
            self._db.insert_rows(
                "delta_stages",
                (
                    "expert_id",
                    "base_id",
                    "tensor",
                    "stage",
                    "byte_begin",
                    "byte_end",
                    "rows",
                    "residual",
                    "norm",
                    "hash",
                ),
                (
                    (expert_id, base_id, st.tensor, st.stage, st.begin, st.end, st.rows, st.residual, st.norm, st.hash)
                    for st in stages
                ),
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
            (expert_id, base_id),
            DeltaChunk,
        )

    def stages(self, expert_id: str, base_id: str) -> dict[str, list[DeltaStage]]:
        """Tensor name -> its sketch stages, in order."""
        return self._by_tensor(
            "SELECT tensor, stage, byte_begin, byte_end, rows, residual, norm, hash FROM delta_stages "
            "WHERE expert_id = ? AND base_id = ? ORDER BY tensor, stage",
            (expert_id, base_id),
            DeltaStage,
        )

    def _by_tensor(self, sql: str, params: tuple, record: type) -> dict[str, list]:
        """Rows whose first column is the tensor name, as ``record``s grouped by tensor (in query order)."""
        out: dict[str, list] = {}
        for row in self._db.query(sql, params):
            out.setdefault(row[0], []).append(record(*row))
        return out
