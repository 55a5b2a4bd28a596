"""The error bound of a plan: how far its merge may be from the full-read merge.

A Frobenius norm over blocks of the omitted part of the merged delta. Per
block b: ``exact``/``separable`` operators change by at most
``Σ_omitted beta_i ||Δi_b||``; ``consensus`` operators (TIES family) by at
most ``Σ_all beta_i ||Δi_b|| + Σ_read beta_i ||Δi_b||`` when anything is
omitted. Tensor-level operators have no such bound: their figure is an
estimate, ``Σ_omitted ||Δi_b||``. The bound is on the fp32 merge, before
rounding to the output dtype (see docs/ARCHITECTURE.md, "Planning").

Sums run in a fixed order (experts, then blocks in tensor order) with
``np.cumsum``, which is sequential: the same bits on every machine.
"""

from __future__ import annotations

import math

import numpy as np

from mergepipe.planner.units import TensorPlan


def error_bound(plans: list[TensorPlan], reads: dict[int, dict[int, np.ndarray]]) -> tuple[float, str]:
    """``(bound, kind)``; kind is ``"estimate"`` when an operator admits no bound."""
    contributions: list[np.ndarray] = []
    kinds = set()
    for t, tp in enumerate(plans):
        kinds.add(tp.bound_kind)
        weighted = tp.weighted()  # beta * ||Δ||, 0 where unchanged
        read = np.zeros(weighted.shape, dtype=bool)
        for i, blocks in reads.get(t, {}).items():
            read[i, blocks] = True
        everything = _column_sums(weighted)
        read_part = _column_sums(np.where(read, weighted, 0.0))
        omitted = _column_sums(np.where(read, 0.0, weighted))
        if tp.bound_kind == "consensus":
            per_block = (everything + read_part) ** 2
        else:
            per_block = omitted**2
        contributions.append(np.where(omitted == 0.0, 0.0, per_block))
    flat = np.concatenate(contributions) if contributions else np.zeros(0)
    total = float(np.cumsum(flat)[-1]) if len(flat) else 0.0
    return math.sqrt(total), "estimate" if "none" in kinds else "bound"


def _column_sums(values: np.ndarray) -> np.ndarray:
    """Per block, the sum over experts in expert order (sequential)."""
    if values.shape[0] == 0:
        return np.zeros(values.shape[1])
    return np.cumsum(values, axis=0)[-1]
