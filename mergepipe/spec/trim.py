"""The trim-threshold contract: how a magnitude trim is applied block by block.

TIES-style trimming keeps, per expert and tensor, exactly
``k = max(1, int(density * n))`` entries of largest |delta|, ties broken by
position (what a stable descending sort keeps). To apply that to one block
without the whole tensor, the catalog stores for each density of
``DENSITY_GRID``

* ``tau``        the k-th largest |delta| (an fp32 value), and
* ``last_index`` p, the flat row-major index of the last entry equal to tau
                 that is still kept,

so entry j is kept iff ``|d_j| > tau or (|d_j| == tau and j <= p)``.
Computing them is ``analysis/thresholds.py``; applying them is the
operators' business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

#: Densities analysed per (expert, tensor). Covers the values people use for
#: TIES/DARE/breadcrumbs; an off-grid density falls back to a tensor-level
#: computation in the engine.
DENSITY_GRID: tuple[float, ...] = (
    0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9,
)

#: Densities closer than this are the same grid point: a fraction computed
#: as gamma + density (0.1 + 0.2 = 0.30000000000000004) must find 0.3.
DENSITY_TOLERANCE = 1e-9


@dataclass(frozen=True)
class TrimThreshold:
    """Where to cut |delta| of one tensor to keep the top ``k`` entries."""

    density: float
    k: int
    tau: float
    last_index: int

    def to_json(self) -> dict:
        return {"density": self.density, "k": self.k, "tau": self.tau, "last_index": self.last_index}

    @classmethod
    def from_json(cls, data: dict) -> "TrimThreshold":
        return cls(
            density=float(data["density"]),
            k=int(data["k"]),
            tau=float(data["tau"]),
            last_index=int(data["last_index"]),
        )


def find_threshold(table: Mapping[float, TrimThreshold] | None, density: float) -> TrimThreshold | None:
    """The threshold stored for ``density`` (within DENSITY_TOLERANCE), or None."""
    if not table:
        return None
    exact = table.get(density)
    if exact is not None:
        return exact
    for key, value in table.items():
        if abs(key - density) <= DENSITY_TOLERANCE:
            return value
    return None


def kept_count(density: float, n: int) -> int:
    """The number of entries a magnitude trim keeps: max(1, int(density * n))."""
    return 0 if n == 0 else max(1, int(density * n))
