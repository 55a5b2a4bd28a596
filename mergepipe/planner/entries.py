"""The ``entries`` policy: spend the budget on experts' delta stores.

An expert with a delta store (``mergepipe analyze --store-deltas``) offers
each changed tensor at increasing *levels* of fidelity, each a prefix of the
next in what it costs:

* sketch stages 1, 2, 3 (``analysis/sketch.py``): a coarse value for every
  entry at 1.6 bits per element each, every stage shrinking the residual;
* exact: the operator's exact delta, from whichever is cheaper — the store's
  chunks up to the entries the operator can use (a magnitude trim never
  uses entries past its top ``k = max(1, int(density * n))``), or the
  expert's changed blocks. Sketch bytes already read are not needed then.

Real fine-tunes change most entries of every tensor by similar amounts, so a
coarse value for every entry keeps far more of a merge's quality per byte
than whole blocks or the largest entries (BENCHMARKS.md, "Quality under a
budget"). Each level step is a unit: its cost the bytes it adds, its value

    beta² × (share of the tensor's delta energy it removes) × (elements of the tensor)

(energies recorded when the store was built): every element's delta counts
the same *relative to its own tensor*. Absolute energy would be the wrong
scale: Adam moves every parameter by about the learning rate, so the size of
a tensor's delta says how large its weights are (bf16 rounding), not how
much the loss depends on it; ranked by absolute energy, a budget buys the
second stage of a few large-valued tensors before the first stage of the
rest, and the merge loses more (measured). Experts without a store offer
their changed blocks as units valued the same way (the block's share of its
tensor's ``||Δ||²``), so one greedy fill ranks everything by value per byte.
Within a (tensor, expert) the value per byte is made non-increasing (a
running minimum), ties keep creation order, and each (tensor, expert) keeps
the longest prefix of steps it got.

At a budget that reaches the exact level everywhere, the merge equals the
full-read merge bit for bit (for TIES, reading the chunks up to each
expert's top-k entries is enough: the store holds exact values).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise

import numpy as np

from mergepipe.catalog.deltas import DeltaChunk, DeltaStage
from mergepipe.planner.policies import greedy_fill
from mergepipe.planner.units import ALL, TensorPlan, Units, build_units


@dataclass(frozen=True)
class Store:
    """What the planner knows about one expert's delta store."""

    chunks: Mapping[str, Sequence[DeltaChunk]]
    stages: Mapping[str, Sequence[DeltaStage]]


@dataclass
class Ladder:
    """The levels of one (tensor, expert): sketch stages, then exact."""

    tensor: int
    expert: int
    total: float  # ||Δ||²
    stages: Sequence[DeltaStage]  # the stages cheaper than exact
    exact_cost: int
    exact_chunks: int  # chunks read for exact (0: exact reads the blocks)

    def costs(self) -> np.ndarray:
        steps = [s.nbytes for s in self.stages]
        return np.array(steps + [self.exact_cost - sum(steps)], dtype=np.int64)

    def gains(self, numel: int) -> np.ndarray:
        """Per step: the share of ``||Δ||²`` it removes, times ``numel``."""
        residuals = [self.total] + [s.residual for s in self.stages]
        steps = [max(a - b, 0.0) for a, b in pairwise(residuals)] + [residuals[-1]]
        scale = numel / self.total if self.total > 0 else 0.0
        return np.array(steps, dtype=np.float64) * scale


@dataclass
class EntryChoice:
    """What the entries policy chose beyond block units."""

    sketch: dict[int, dict[int, int]] = field(default_factory=dict)  # tensor -> expert -> stages read
    chunks: dict[int, dict[int, int]] = field(default_factory=dict)  # tensor -> expert -> chunks read
    blocks: dict[int, dict[int, np.ndarray]] = field(default_factory=dict)  # exact through blocks
    bytes_by_expert: dict[int, int] = field(default_factory=dict)  # store bytes read
    # tensor -> expert -> (||Δ||², ||what is read||², energy omitted), for the bound
    energy: dict[int, dict[int, tuple[float, float, float]]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Whether every stored (tensor, expert) is read exactly."""
        return all(omitted == 0.0 for per in self.energy.values() for _, _, omitted in per.values())


def useful_chunks(chunks: Sequence[DeltaChunk], useful_entries: int | None) -> int:
    """How many leading chunks hold entries the operator can use (all if None)."""
    if useful_entries is None:
        return len(chunks)
    seen = 0
    for index, chunk in enumerate(chunks):
        if seen >= useful_entries:
            return index
        seen += chunk.entries
    return len(chunks)


def ladders(plans: Sequence[TensorPlan], stores: Mapping[int, Store]) -> list[Ladder]:
    """The ladder of every changed (tensor, expert with a store), in creation order."""
    out = []
    for t, tp in enumerate(plans):
        for i in sorted(stores):
            chunks = stores[i].chunks.get(tp.record.name, ())
            if not chunks:
                continue
            useful = useful_chunks(chunks, tp.useful_entries[i] if tp.useful_entries else None)
            chunk_cost = sum(c.nbytes for c in chunks[:useful])
            block_cost = tp.read_bytes(i, np.flatnonzero(tp.changed[i]))
            exact_cost, exact_chunks = (chunk_cost, useful) if chunk_cost <= block_cost else (block_cost, 0)
            stages, spent = [], 0
            for stage in stores[i].stages.get(tp.record.name, ()):
                spent += stage.nbytes
                if spent >= exact_cost:
                    break
                stages.append(stage)
            total = _seq_sum(c.energy for c in chunks)
            out.append(Ladder(t, i, total, stages, exact_cost, exact_chunks))
    return out


def block_energy_ratio(units: Units, plans: Sequence[TensorPlan]) -> np.ndarray:
    """Value per byte of block units in the entries policy's unit: beta² x the block's share of its
    tensor's ``||Δ||²`` x the tensor's elements, per byte."""
    value = np.zeros(len(units))
    bounds = np.searchsorted(units.tensor, np.arange(len(plans) + 1))  # units come in tensor order
    for t, tp in enumerate(plans):
        s, e = int(bounds[t]), int(bounds[t + 1])
        if s == e:
            continue
        energy = np.square(np.nan_to_num(tp.l2))
        totals = energy.sum(axis=1, keepdims=True)
        energy = np.divide(energy, totals, out=np.zeros_like(energy), where=totals > 0)
        energy *= np.square(tp.finite_beta)[:, None] * tp.record.numel  # beta² x share x elements
        experts, blocks = units.expert[s:e], units.block[s:e]
        single = blocks != ALL
        part = np.zeros(e - s)
        part[single] = energy[experts[single], blocks[single]]
        for k in np.flatnonzero(~single):  # whole-tensor units: one expert, or all of them
            part[k] = energy.sum() if experts[k] == ALL else energy[experts[k]].sum()
        value[s:e] = part
    return np.divide(value, units.cost, out=np.full(len(units), np.inf), where=units.cost > 0)


def plan_entries(
    plans: Sequence[TensorPlan], stores: Mapping[int, Store], budget_bytes: int
) -> tuple[Units, np.ndarray, EntryChoice]:
    """``(block units, the chosen ones, entry choice)``: experts with a store are read through their
    ladders, the others through block units."""
    subset = build_units([_without(tp, stores) for tp in plans])
    steps = ladders(plans, stores)
    costs = np.concatenate([lad.costs() for lad in steps] or [np.zeros(0, dtype=np.int64)])
    ratios = np.concatenate([
        _running_min(lad.gains(plans[lad.tensor].record.numel), lad.costs(), plans[lad.tensor].finite_beta[lad.expert])
        for lad in steps] or [np.zeros(0)])
    ranked = np.argsort(-np.concatenate([block_energy_ratio(subset, plans), ratios]), kind="stable")
    taken, _ = greedy_fill(ranked, np.concatenate([subset.cost, costs]), budget_bytes, 0)
    got = np.zeros(len(costs), dtype=bool)
    got[taken[taken >= len(subset)] - len(subset)] = True
    choice = EntryChoice(bytes_by_expert={i: 0 for i in stores})
    start = 0
    for k, lad in enumerate(steps):
        n = len(lad.stages) + 1
        level = n if got[start : start + n].all() else int(np.argmin(got[start : start + n]))  # prefix kept
        _record(choice, lad, level, plans[lad.tensor])
        start += n
    return subset, np.sort(taken[taken < len(subset)]), choice


def _without(tp: TensorPlan, stores: Mapping[int, Store]) -> TensorPlan:
    """``tp`` as if the experts with a store had no changed block (they are read through the store)."""
    l2 = tp.l2.copy()
    l2[list(stores)] = np.nan
    return replace(tp, l2=l2)


def _record(choice: EntryChoice, lad: Ladder, level: int, tp: TensorPlan) -> None:
    """Note what ladder ``lad`` reads at ``level`` (0: nothing; len(stages)+1: exact)."""
    t, i = lad.tensor, lad.expert
    if level > len(lad.stages):
        if lad.exact_chunks:
            choice.chunks.setdefault(t, {})[i] = lad.exact_chunks
            choice.bytes_by_expert[i] += lad.exact_cost
        else:
            choice.blocks.setdefault(t, {})[i] = np.flatnonzero(tp.changed[i])
        choice.energy.setdefault(t, {})[i] = (lad.total, lad.total, 0.0)
        return
    if level:
        stage = lad.stages[level - 1]
        choice.sketch.setdefault(t, {})[i] = level
        choice.bytes_by_expert[i] += sum(s.nbytes for s in lad.stages[:level])
        choice.energy.setdefault(t, {})[i] = (lad.total, stage.norm**2, stage.residual)
    else:
        choice.energy.setdefault(t, {})[i] = (lad.total, 0.0, lad.total)


def _running_min(gains: np.ndarray, costs: np.ndarray, beta: float) -> np.ndarray:
    ratio = np.divide(beta**2 * gains, costs, out=np.full(len(costs), np.inf), where=costs > 0)
    return np.minimum.accumulate(ratio)


def _seq_sum(values) -> float:
    total = 0.0
    for v in values:
        total += v
    return total
