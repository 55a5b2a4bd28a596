"""Delta statistics per (expert, base): per block and per tensor, and the delta stores' index. One ``analyses``
row marks a pair completely recorded: it is written in the transaction of all the pair's rows."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from mergepipe.catalog.database import Database
from mergepipe.catalog.models import ModelStore
from mergepipe.catalog.records import AnalysisRecord, BlockDelta, Record, TensorStats, from_row
from mergepipe.errors import CatalogError
from mergepipe.spec.operators import TrimThreshold


class StatisticsStore:
    """Delta statistics of analysed (expert, base) pairs."""

    def __init__(self, db: Database, now: Callable[[], str], models: ModelStore) -> None:
        self._db = db
        self._now = now
        self._models = models

    def is_analyzed(self, expert_id: str, base_id: str) -> bool:
        sql = "SELECT 1 FROM analyses WHERE expert_id = ? AND base_id = ?"
        return self._db.query_one(sql, (expert_id, base_id)) is not None

    def analyses(self, model_id: str | None = None) -> list[AnalysisRecord]:
        """Recorded (expert, base) analyses, all or those involving ``model_id``."""
        where, params = ("", ()) if model_id is None else ("WHERE expert_id = ? OR base_id = ?", (model_id, model_id))
        sql = f"SELECT expert_id, base_id, analyzed_at FROM analyses {where} ORDER BY expert_id, base_id"
        return [from_row(AnalysisRecord, row) for row in self._db.query(sql, params)]

    def record(self, expert_id: str, base_id: str, deltas: Iterable[BlockDelta], stats: Iterable[TensorStats]) -> None:
        """Write one complete (expert, base) analysis."""
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
                    (expert_id, base_id, s.tensor, s.numel, int(s.mergeable), int(s.identical), _thresholds(s))
                    for s in stats
                ),
            )

    def require(self, expert_id: str, base_id: str) -> None:
        if not self.is_analyzed(expert_id, base_id):
            self._models.require(expert_id)
            self._models.require(base_id)
            raise CatalogError(
                f"model '{expert_id}' has not been analysed against '{base_id}'; "
                f"run `mergepipe analyze --db {self._db.path} --base {base_id} {expert_id}`"
            )

    def block_deltas(self, expert_id: str, base_id: str) -> dict[str, list[BlockDelta]]:
        """Tensor name -> per-block statistics in block order (tensors in the base's file order)."""
        self.require(expert_id, base_id)
        return self._db.grouped(
            "SELECT d.tensor, d.idx, d.l2, d.maxabs, d.nnz, d.identical FROM block_deltas d "
            "JOIN tensors t ON t.model_id = d.base_id AND t.name = d.tensor "
            "WHERE d.expert_id = ? AND d.base_id = ? ORDER BY t.ordinal, d.idx",
            (expert_id, base_id),
            lambda r: BlockDelta(r[0], r[1], r[2], r[3], r[4], bool(r[5])),
        )

    def block_norms(self, expert_id: str, base_id: str) -> dict[str, list[float | None]]:
        """Tensor name -> ``||Δ||₂`` per block in block order, None where identical to the base."""
        self.require(expert_id, base_id)
        norm = "CASE WHEN identical = 1 THEN NULL ELSE coalesce(l2, 0.0) END"
        array = self._db.dialect.ordered_array(norm, "idx")
        where = "FROM block_deltas WHERE expert_id = ? AND base_id = ?"
        if array is not None:  # a server: each tensor's name sent once, with its norms as one array
            return dict(
                self._db.query(f"SELECT tensor, {array} {where} GROUP BY tensor ORDER BY tensor", (expert_id, base_id))
            )
        return self._db.grouped(
            f"SELECT tensor, {norm} {where} ORDER BY tensor, idx", (expert_id, base_id), lambda row: row[1]
        )

    def tensor_stats(self, expert_id: str, base_id: str) -> dict[str, TensorStats]:
        """Tensor name -> per-tensor results (identical flag, thresholds)."""
        self.require(expert_id, base_id)
        rows = self._db.query(
            "SELECT s.tensor, s.numel, s.mergeable, s.identical, s.thresholds FROM tensor_stats s "
            "JOIN tensors t ON t.model_id = s.base_id AND t.name = s.tensor "
            "WHERE s.expert_id = ? AND s.base_id = ? ORDER BY t.ordinal",
            (expert_id, base_id),
        )
        return {t: TensorStats(t, n, bool(m), bool(i), StoredThresholds(text)) for t, n, m, i, text in rows}


def _thresholds(stats: TensorStats) -> str | None:
    return json.dumps([t.to_json() for t in stats.thresholds.values()]) if stats.mergeable else None


class StoredThresholds(Mapping[float, TrimThreshold]):
    """One tensor's stored trim thresholds (density -> threshold), each parsed on first use."""

    __slots__ = ("_text", "_raw", "_table")

    def __init__(self, text: str | None) -> None:
        self._text = text
        self._raw: dict[float, dict] | None = None  # density -> its stored JSON object
        self._table: dict[float, TrimThreshold] = {}  # those parsed so far

    def _densities(self) -> dict[float, dict]:
        if self._raw is None:
            self._raw = {float(t["density"]): t for t in json.loads(self._text)} if self._text else {}
        return self._raw

    def __getitem__(self, density: float) -> TrimThreshold:
        found = self._table.get(density)
        if found is None:
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


class DeltaStoreRecord(Record):
    expert_id: str
    base_id: str
    path: str
    file_size: int
    digest: str  # sha256 over every part's (tensor, index, hash): the store's identity
    created_at: str


_CHUNK = ("tensor", "idx", "byte_begin", "byte_end", "entries", "gap_bytes", "energy", "hash")
_STAGE = ("tensor", "stage", "byte_begin", "byte_end", "rows", "residual", "norm", "hash")


class DeltaStores:
    """Delta store records (``analysis/deltastore.py``) and the index of their parts."""

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
        """Record (or replace) the store of an analysed pair, with its parts."""
        digest = hashlib.sha256()
        for c in chunks:
            digest.update(f"{c.tensor}\0{c.index}\0{c.hash}\0{c.entries}\n".encode())
        for st in stages:
            digest.update(f"{st.tensor}\0stage {st.stage}\0{st.hash}\n".encode())
        record = DeltaStoreRecord(
            expert_id=expert_id,
            base_id=base_id,
            path=path,
            file_size=file_size,
            digest=digest.hexdigest(),
            created_at=self._now(),
        )
        with self._db.transaction():
            self._stats.require(expert_id, base_id)
            self._db.write("DELETE FROM delta_stores WHERE expert_id = ? AND base_id = ?", (expert_id, base_id))
            columns = ", ".join(DeltaStoreRecord.model_fields)
            self._db.write(
                f"INSERT INTO delta_stores ({columns}) VALUES (?, ?, ?, ?, ?, ?)", [*record.model_dump().values()]
            )
            self._db.insert_rows(
                "delta_chunks",
                ("expert_id", "base_id", *_CHUNK),
                (
                    (expert_id, base_id, c.tensor, c.index, c.begin, c.end, c.entries, c.gap_bytes, c.energy, c.hash)
                    for c in chunks
                ),
            )
            self._db.insert_rows(
                "delta_stages",
                ("expert_id", "base_id", *_STAGE),
                (
                    (expert_id, base_id, st.tensor, st.stage, st.begin, st.end, st.rows, st.residual, st.norm, st.hash)
                    for st in stages
                ),
            )
        return record

    def find(self, expert_id: str, base_id: str) -> DeltaStoreRecord | None:
        sql = f"SELECT {', '.join(DeltaStoreRecord.model_fields)} FROM delta_stores WHERE expert_id = ? AND base_id = ?"
        row = self._db.query_one(sql, (expert_id, base_id))
        return None if row is None else from_row(DeltaStoreRecord, row)

    def paths(self) -> list[str]:
        """The file of every recorded store, sorted."""
        return [row[0] for row in self._db.query("SELECT path FROM delta_stores ORDER BY path")]

    def chunks(self, expert_id: str, base_id: str) -> dict[str, list[DeltaChunk]]:
        """Tensor name -> its chunks, largest entries first."""
        sql = f"SELECT {', '.join(_CHUNK)} FROM delta_chunks WHERE expert_id = ? AND base_id = ? ORDER BY tensor, idx"
        return self._db.grouped(sql, (expert_id, base_id), lambda row: DeltaChunk(*row))

    def stages(self, expert_id: str, base_id: str) -> dict[str, list[DeltaStage]]:
        """Tensor name -> its sketch stages, in order."""
        sql = f"SELECT {', '.join(_STAGE)} FROM delta_stages WHERE expert_id = ? AND base_id = ? ORDER BY tensor, stage"
        return self._db.grouped(sql, (expert_id, base_id), lambda row: DeltaStage(*row))
