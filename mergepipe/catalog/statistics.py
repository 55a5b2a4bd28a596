"""Analysis results in the catalog: block hashes and (expert, base) statistics.

One ``analyses`` row marks an (expert, base) pair as completely recorded:
it is written in the same transaction as every ``block_deltas`` and
``tensor_stats`` row of the pair, and readers refuse a pair without it.

Kept apart from ``db.py`` only for size: ``Catalog`` inherits these methods.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

from mergepipe.catalog.records import AnalysisRecord, BlockDelta, TensorStats
from mergepipe.catalog.thresholds import TrimThreshold
from mergepipe.errors import CatalogError

if TYPE_CHECKING:
    from mergepipe.catalog.db import Catalog


class AnalysisStore:
    """Hash and statistics methods of ``Catalog`` (see the module docstring)."""

    def set_block_hashes(self: Catalog, model_id: str, hashes: Iterable[tuple[str, int, str]]) -> None:
        """Record content hashes as (tensor, block index, hex digest).

        Only NULL hashes are filled: a hash never changes for a registered
        model, so a concurrent analyse writing the same value is harmless.
        """
        with self.transaction():
            self._write_many(
                "UPDATE blocks SET hash = ? WHERE model_id = ? AND tensor = ? AND idx = ? AND hash IS NULL",
                ((digest, model_id, tensor, index) for tensor, index, digest in hashes),
            )

    def is_analyzed(self: Catalog, expert_id: str, base_id: str) -> bool:
        row = self._execute(
            "SELECT 1 FROM analyses WHERE expert_id = ? AND base_id = ?", (expert_id, base_id)
        ).fetchone()
        return row is not None

    def analyses(self: Catalog, model_id: str | None = None) -> list[AnalysisRecord]:
        """Recorded (expert, base) analyses, all or those involving ``model_id``."""
        sql = "SELECT expert_id, base_id, analyzed_at FROM analyses"
        params: tuple[str, ...] = ()
        if model_id is not None:
            sql += " WHERE expert_id = ? OR base_id = ?"
            params = (model_id, model_id)
        rows = self._execute(sql + " ORDER BY expert_id, base_id", params).fetchall()
        return [AnalysisRecord(*row) for row in rows]

    def record_analysis(
        self: Catalog,
        expert_id: str,
        base_id: str,
        deltas: Iterable[BlockDelta],
        stats: Iterable[TensorStats],
    ) -> None:
        """Write one complete (expert, base) analysis; the ``analyses`` row is
        what marks it done, so partial results can never be mistaken for it."""
        with self.transaction():
            self._write(
                "INSERT INTO analyses (expert_id, base_id, analyzed_at) VALUES (?, ?, ?)",
                (expert_id, base_id, self.now()),
            )
            self._write_many(
                "INSERT INTO block_deltas (expert_id, base_id, tensor, idx, l2, maxabs, nnz, identical) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    (expert_id, base_id, d.tensor, d.index, d.l2, d.maxabs, d.nnz, int(d.identical))
                    for d in deltas
                ),
            )
            self._write_many(
                "INSERT INTO tensor_stats (expert_id, base_id, tensor, numel, mergeable, identical, thresholds) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    (
                        expert_id, base_id, s.tensor, s.numel, int(s.mergeable), int(s.identical),
                        json.dumps([t.to_json() for t in s.thresholds.values()]) if s.mergeable else None,
                    )
                    for s in stats
                ),
            )

    def _require_analysis(self: Catalog, expert_id: str, base_id: str) -> None:
        if not self.is_analyzed(expert_id, base_id):
            self._require_model(expert_id)
            self._require_model(base_id)
            raise CatalogError(
                f"model '{expert_id}' has not been analysed against '{base_id}'; "
                f"run `mergepipe analyze --base {base_id} {expert_id}`"
            )

    def block_deltas(self: Catalog, expert_id: str, base_id: str) -> dict[str, list[BlockDelta]]:
        """Tensor name -> per-block delta statistics in block order (tensors in
        the expert's file order)."""
        self._require_analysis(expert_id, base_id)
        rows = self._execute(
            "SELECT d.tensor, d.idx, d.l2, d.maxabs, d.nnz, d.identical FROM block_deltas d "
            "JOIN tensors t ON t.model_id = d.expert_id AND t.name = d.tensor "
            "WHERE d.expert_id = ? AND d.base_id = ? ORDER BY t.ordinal, d.idx",
            (expert_id, base_id),
        ).fetchall()
        out: dict[str, list[BlockDelta]] = {}
        for tensor, index, l2, maxabs, nnz, identical in rows:
            out.setdefault(tensor, []).append(BlockDelta(tensor, index, l2, maxabs, nnz, bool(identical)))
        return out

    def tensor_stats(self: Catalog, expert_id: str, base_id: str) -> dict[str, TensorStats]:
        """Tensor name -> per-tensor results (identical flag, thresholds)."""
        self._require_analysis(expert_id, base_id)
        rows = self._execute(
            "SELECT s.tensor, s.numel, s.mergeable, s.identical, s.thresholds FROM tensor_stats s "
            "JOIN tensors t ON t.model_id = s.expert_id AND t.name = s.tensor "
            "WHERE s.expert_id = ? AND s.base_id = ? ORDER BY t.ordinal",
            (expert_id, base_id),
        ).fetchall()
        out: dict[str, TensorStats] = {}
        for tensor, numel, mergeable, identical, thresholds in rows:
            parsed = [TrimThreshold.from_json(t) for t in json.loads(thresholds)] if thresholds else []
            out[tensor] = TensorStats(
                tensor, numel, bool(mergeable), bool(identical), {t.density: t for t in parsed}
            )
        return out

    def tensor_thresholds(self: Catalog, expert_id: str, base_id: str) -> dict[str, dict[float, TrimThreshold]]:
        """Tensor name -> density -> exact trim threshold, for mergeable tensors."""
        return {
            name: stats.thresholds
            for name, stats in self.tensor_stats(expert_id, base_id).items()
            if stats.mergeable
        }
