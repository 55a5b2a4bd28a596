"""The error bound of a plan: how far its merge may be from the full-read merge,
and the share of the experts' (weighted) deltas it leaves out.

**Bound.** A Frobenius norm over blocks of the omitted part of the merged
delta. Per block b, with ``E_b = Σ_i beta_i ||Δi_b||`` over every expert:

* ``exact``/``separable`` operators change by at most ``Σ_omitted beta_i ||Δi_b||``;
* ``consensus`` operators (TIES family) by at most ``2 E_b`` when anything
  of the block is omitted, 0 when it is read from every expert. (At each
  entry both merges are weighted means, or with ``normalize`` off sums, of
  the experts' values there, so each is within ``Σ_i beta_i |Δi_j|`` of 0.)
  The bound only falls as more is read, and the energy policy, which reads
  whole blocks across experts for these operators, minimises it.
* tensor-level operators admit no bound: the figure is an estimate,
  ``Σ_omitted ||Δi_b||``.

The bound is on the fp32 merge, before rounding to the output dtype. A
tensor for which the plan reads delta stores (``planner/entries.py``) is one
"block": per store expert its whole-tensor norm and the residual energy its
sketch stages leave (0 when read exactly); the consensus term is
``E + max(E, R)`` with ``R`` the norm of what is read (a sketch's norm need
not stay below the delta's).

**Estimate.** ``sqrt(Σ_b (Σ_i beta_i ||what the plan omits of Δi_b||)²)``: the
first-order deviation, the exact operators' bound applied to every operator.
For a consensus operator the bound must cover a sign flipped anywhere in a
block, so it charges ``2 E_b`` for a block with anything omitted, and a
tensor read through delta stores is one block whose sketch always omits
something: its bound is the same at 25% as at 10%, and above a block policy's
whose measured deviation is larger. The estimate charges what is actually left
out (unread blocks, sketch residuals), so a smaller estimate goes with a
smaller measured deviation across policies and budgets (BENCHMARKS.md,
"Quality under a budget"); it is not a bound.

**Share.** ``sqrt(Σ omitted beta_i² ||Δ||² / Σ beta_i² ||Δ||²)`` over every
(expert, block), or the residual of a sketch: how much of the experts'
weighted task vectors the plan does not read, in %. People read it; it is a
measure of the plan, not a bound on the result.

Sums run in a fixed order (experts, then blocks in tensor order) with
``np.cumsum``, which is sequential: the same bits on every machine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from mergepipe.planner.units import TensorPlan

#: tensor index -> expert position -> (||Δ||², ||what the plan reads||², energy it omits)
EntryEnergy = Mapping[int, Mapping[int, tuple[float, float, float]]]


@dataclass(frozen=True)
class Bound:
    value: float
    kind: str  # "bound", or "estimate" when an operator admits none
    share: float  # of the weighted deltas left out, 0..1
    estimate: float  # first-order deviation: the weighted norm of what is left out (module docstring)


def error_bound(
    plans: list[TensorPlan], reads: dict[int, dict[int, np.ndarray]], entries: EntryEnergy | None = None
) -> Bound:
    """The bound and share of a plan that reads ``reads`` (and ``entries`` from delta stores)."""
    contributions: list[np.ndarray] = []
    first_order: list[np.ndarray] = []
    omitted_energy: list[np.ndarray] = []  # weighted norms (squared in ``_share``)
    all_energy: list[np.ndarray] = []
    kinds = set()
    with np.errstate(over="ignore"):  # weights of huge deltas may overflow: the bound is then inf, as it says
        for t, tp in enumerate(plans):
            kinds.add(tp.bound_kind)
            contribution, omitted, energies = _block_terms(tp, reads.get(t, {}), entries.get(t) if entries else None)
            contributions.append(contribution)
            first_order.append(omitted**2)
            all_energy.append(energies[0])
            omitted_energy.append(energies[1])
        total = _seq_total(contributions)
        estimate = math.sqrt(_seq_total(first_order))
    return Bound(math.sqrt(total), "estimate" if "none" in kinds else "bound", _share(all_energy, omitted_energy),
                 estimate)


def _block_terms(
    tp: TensorPlan, reads: Mapping[int, np.ndarray], stored: Mapping[int, tuple[float, float, float]] | None
) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """One tensor's squared bound per block, the weighted norm it omits per block, and its (all, omitted)
    weighted norms for the share."""
    weighted = tp.weighted()  # beta * ||Δ||, 0 where unchanged
    read = np.zeros(weighted.shape, dtype=bool)
    for i, blocks in reads.items():
        read[i, blocks] = True
    if stored:
        everything, read_part, omitted, energies = _tensor_terms(tp, weighted, read, stored)
    else:
        everything = _column_sums(weighted)
        read_part = _column_sums(np.where(read, weighted, 0.0))
        omitted = _column_sums(np.where(read, 0.0, weighted))
        energies = (weighted.reshape(-1), np.where(read, 0.0, weighted).reshape(-1))
    if tp.bound_kind == "consensus":
        per_block = (everything + np.maximum(everything, read_part)) ** 2
    else:
        per_block = omitted**2
    return np.where(omitted == 0.0, 0.0, per_block), omitted, energies


def _share(everything: list[np.ndarray], omitted: list[np.ndarray]) -> float:
    """``sqrt(Σ omitted² / Σ everything²)`` of weighted norms; rescaled only when the squares overflow."""
    with np.errstate(over="ignore"):
        energy = _seq_total([np.square(part) for part in everything])
        left = _seq_total([np.square(part) for part in omitted])
    if not math.isfinite(energy):
        flat = np.concatenate(everything)
        scale = float(np.max(flat))
        if not math.isfinite(scale):
            return 1.0
        energy = _seq_total([np.square(part / scale) for part in everything])
        left = _seq_total([np.square(part / scale) for part in omitted])
    return min(math.sqrt(left / energy), 1.0) if energy > 0 else 0.0


def _seq_total(parts: list[np.ndarray]) -> float:
    flat = np.concatenate(parts) if parts else np.zeros(0)
    return float(np.cumsum(flat)[-1]) if len(flat) else 0.0


def _column_sums(values: np.ndarray) -> np.ndarray:
    """Per block, the sum over experts in expert order (sequential)."""
    if values.shape[0] == 0:
        return np.zeros(values.shape[1])
    return np.cumsum(values, axis=0)[-1]


def _tensor_terms(
    tp: TensorPlan, weighted: np.ndarray, read: np.ndarray, stored: Mapping[int, tuple[float, float, float]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """The bound's three sums for a tensor taken as one block (some experts read delta stores),
    and the (all, omitted) weighted norms per expert, for the share."""
    beta = tp.finite_beta
    everything, read_part, omitted, energy_all, energy_omitted = [], [], [], [], []
    for i in range(weighted.shape[0]):
        parts: tuple[float, ...]
        if i in stored:
            total, got, left = (max(v, 0.0) for v in stored[i])
            parts = (beta[i] * math.sqrt(total), beta[i] * math.sqrt(got), beta[i] * math.sqrt(left))
        else:
            row, mask = weighted[i], read[i]
            parts = tuple(float(np.sqrt(np.sum(np.square(v)))) for v in (row, row[mask], row[~mask]))
        energy_all.append(parts[0])
        energy_omitted.append(parts[2])
        everything.append(parts[0])
        read_part.append(parts[1])
        omitted.append(parts[2])
    all_sum, read_sum, omitted_sum = (_column_sums(np.array(v, dtype=np.float64)[:, None])
                                      for v in (everything, read_part, omitted))
    return all_sum, read_sum, omitted_sum, (np.array(energy_all), np.array(energy_omitted))
