"""Incremental analysis: a new version of an expert inherits what did not change.

A retrained expert registered as version N of its id usually changes only
some tensors. When version N-1 is analysed against the same base, analysis
of version N first hashes N's blocks (one read of its files), then takes
every tensor whose block hashes all equal N-1's straight from N-1's
statistics (same bytes, same base: the same deltas, norms and trim
thresholds), and computes only the others (those are read again, with the
base). ``analyze`` reports how many tensors it computed and how many it
inherited.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mergepipe.analysis.stats import TensorResult
from mergepipe.catalog import Catalog


@dataclass(frozen=True)
class Inheritance:
    """Where expert ``expert`` may take unchanged tensors from, and how many it took."""

    expert: str
    previous: str  # the previous version's id
    results: dict[str, TensorResult]  # tensor -> the previous version's rows
    previous_hashes: dict[str, list[str | None]]


def previous_versions(catalog: Catalog, experts: Sequence[str], base_id: str) -> dict[str, str]:
    """Expert id -> the id of its previous version, for experts whose previous version is analysed
    against ``base_id``."""
    out = {}
    for expert_id in experts:
        record = catalog.models.get(expert_id)
        if record.version < 2:
            continue
        previous = next((v for v in catalog.models.versions(record.name) if v.version == record.version - 1), None)
        if previous is not None and catalog.stats.is_analyzed(previous.id, base_id):
            out[expert_id] = previous.id
    return out


def inheritance(catalog: Catalog, expert_id: str, previous_id: str, base_id: str) -> Inheritance:
    """The previous version's rows, per tensor, ready to be taken over."""
    deltas = catalog.stats.block_deltas(previous_id, base_id)
    stats = catalog.stats.tensor_stats(previous_id, base_id)
    results = {name: (list(deltas.get(name, [])), s) for name, s in stats.items()}
    return Inheritance(expert_id, previous_id, results, catalog.blocks.hashes(previous_id))


def inherited(inherit: Inheritance | None, tensor: str, hashes: list[str | None]) -> TensorResult | None:
    """The previous version's result for ``tensor`` if the expert's blocks there are byte-identical to
    it (every hash known and equal), else None."""
    if inherit is None or tensor not in inherit.results or any(h is None for h in hashes):
        return None
    return inherit.results[tensor] if inherit.previous_hashes.get(tensor) == hashes else None
