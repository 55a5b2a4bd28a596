"""How a budget is spent: which units a plan reads.

* ``energy`` (default): greedy by value per byte; a unit that does not fit
  is skipped and the scan goes on, so smaller valuable units still use what
  is left. Ties keep creation order (tensor, expert, block).
* ``uniform``: first the same fraction f = budget / full of every tensor's
  units, picked by a deterministic hash of (tensor, block) that ignores the
  catalog's statistics (a baseline), then what the floors left, one more
  unit each to the tensors furthest below f.
* ``full``: everything (the budget must cover it).
* ``entries``: experts' largest delta entries from their delta stores,
  blocks for experts without one (``entries.py``; the planner calls it,
  since it needs the stores).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise

import numpy as np

from mergepipe.catalog.records import TensorRecord
from mergepipe.catalog.statistics import DeltaChunk, DeltaStage
from mergepipe.errors import ConfigError
from mergepipe.spec.request import POLICIES

#: ``Units.expert`` / ``Units.block`` of a unit that covers several experts / blocks.
ALL = -1


@dataclass
class TensorPlan:
    """What the planner knows about one mergeable tensor."""

    record: TensorRecord
    block_bytes: np.ndarray  # int64 [blocks]
    l2: np.ndarray  # float64 [experts, blocks]; NaN = identical to the base
    beta: list[float]  # error-bound multiplier per expert (inf: none)
    bound_kind: str  # the operator's error-bound kind
    tensor_level: bool  # the operator needs whole tensors: plan all or nothing
    streams: bool  # the engine can merge block by block
    expert_streams: list[bool]  # the catalog has this expert's thresholds
    # per expert, how many of the largest delta entries the operator can use
    # (a magnitude trim's k); None: all of them (see planner/entries.py)
    useful_entries: list[int | None] | None = None
    # int64 [experts, blocks]: what reading each expert's block costs, where an expert's blocks are not
    # the base's (a delta checkpoint in another dtype); None: every expert's are ``block_bytes``
    expert_bytes: np.ndarray | None = None
    # int64 [experts]: bytes an expert reads once for this tensor whenever it reads any block of it (a LoRA
    # adapter's factor A, ``analysis/expert_format.py``); None: none
    shared_bytes: np.ndarray | None = None

    @property
    def costs(self) -> np.ndarray:
        """int64 [experts, blocks]: the bytes one (expert, block) read costs, less any shared part."""
        if self.expert_bytes is not None:
            return self.expert_bytes
        return np.broadcast_to(self.block_bytes, self.l2.shape)

    @property
    def shared(self) -> np.ndarray:
        """int64 [experts]: ``shared_bytes``, zeros where there is none."""
        if self.shared_bytes is None:
            return np.zeros(self.l2.shape[0], dtype=np.int64)
        return self.shared_bytes

    @property
    def block_units(self) -> np.ndarray:
        """bool [experts]: experts the planner reads block by block. The others are one unit per tensor:
        their thresholds need the whole tensor (not in the catalog), or their reads share bytes (a LoRA's
        A), so a block costs more alone than with its tensor and the cost of a unit is what is read."""
        return np.array(self.expert_streams, dtype=bool) & (self.shared == 0)

    def read_bytes(self, expert: int, blocks: np.ndarray) -> int:
        """What reading ``blocks`` of ``expert`` costs: theirs, and the shared part if any."""
        if not len(blocks):
            return 0
        return int(self.costs[expert, blocks].sum()) + int(self.shared[expert])

    @property
    def changed(self) -> np.ndarray:
        """bool [experts, blocks]: blocks that differ from the base."""
        return ~np.isnan(self.l2)

    @property
    def finite_beta(self) -> np.ndarray:
        """``beta`` with no bound (inf) ranked as 1: plain delta norm."""
        return np.array([b if math.isfinite(b) else 1.0 for b in self.beta], dtype=np.float64)

    def weighted(self) -> np.ndarray:
        """float64 [experts, blocks]: ``beta_i * ||Δi_b||``, 0 where unchanged."""
        return np.where(self.changed, self.finite_beta[:, None] * np.nan_to_num(self.l2), 0.0)


@dataclass
class Units:
    """Every unit of a plan (parallel arrays, creation order)."""

    tensor: np.ndarray  # int64: index into the tensor plans
    expert: np.ndarray  # int64: expert position, or ALL
    block: np.ndarray  # int64: block index, or ALL
    cost: np.ndarray  # int64 bytes
    value: np.ndarray  # float64
    rank: np.ndarray  # uint64: a deterministic pseudo-random order (uniform policy)

    def __len__(self) -> int:
        return len(self.cost)

    @property
    def total_cost(self) -> int:
        return int(self.cost.sum())


def hash_rank(tensor: str, index: int) -> int:
    """A deterministic pseudo-random rank of a block, the same for every expert."""
    h = hashlib.sha256(f"{tensor}\0{index}".encode()).digest()
    return int.from_bytes(h[:8], "big")


def build_units(plans: list[TensorPlan]) -> Units:
    """The units of every tensor plan, in creation order."""
    parts: list[tuple[np.ndarray, ...]] = []
    for t, tp in enumerate(plans):
        parts.extend(_tensor_units(t, tp))
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return Units(empty, empty, empty, empty, np.zeros(0), np.zeros(0, dtype=np.uint64))
    columns = [np.concatenate(c) for c in zip(*parts)]
    return Units(*columns)


def _tensor_units(t: int, tp: TensorPlan) -> list[tuple[np.ndarray, ...]]:
    name = tp.record.name
    changed = tp.changed
    weighted = tp.weighted()
    out = []
    if tp.tensor_level:
        experts, blocks = np.nonzero(changed)  # expert-major, like the reads' order
        if len(blocks):
            cost = tp.costs[experts, blocks].sum() + tp.shared[np.unique(experts)].sum()
            out.append(_one(t, ALL, ALL, cost, _seq_sum(weighted[experts, blocks]), hash_rank(name, -1)))
        return out
    ranks = None
    whole = ~tp.block_units
    for i in range(changed.shape[0]):
        blocks = np.nonzero(changed[i])[0]
        if not len(blocks):
            continue
        if whole[i]:  # thresholds from the whole tensor, or reads that share bytes (TensorPlan.block_units)
            cost = tp.read_bytes(i, blocks)
            out.append(_one(t, i, ALL, cost, _seq_sum(weighted[i, blocks]), hash_rank(name, -1)))
            continue
        if ranks is None:
            ranks = np.array([hash_rank(name, b) for b in range(changed.shape[1])], dtype=np.uint64)
        if tp.bound_kind == "consensus":
            continue  # read by column units, below
        n = len(blocks)
        out.append(
            (
                np.full(n, t, dtype=np.int64),
                np.full(n, i, dtype=np.int64),
                blocks.astype(np.int64),
                tp.costs[i, blocks].astype(np.int64),
                weighted[i, blocks],
                ranks[blocks],
            )
        )
    if tp.bound_kind == "consensus":
        out.extend(_column_units(t, tp, weighted, ranks))
    return out


def _column_units(
    t: int, tp: TensorPlan, weighted: np.ndarray, ranks: np.ndarray | None
) -> list[tuple[np.ndarray, ...]]:
    """One unit per block changed by a streaming expert: every such expert's block, together."""
    streaming = tp.block_units[:, None] & tp.changed
    blocks = np.flatnonzero(streaming.any(axis=0))
    if not len(blocks):
        return []
    assert ranks is not None  # computed with the units of the streaming experts, which changed these blocks
    n = len(blocks)
    cost = (streaming[:, blocks] * tp.costs[:, blocks]).sum(axis=0).astype(np.int64)
    value = np.cumsum(np.where(streaming[:, blocks], weighted[:, blocks], 0.0), axis=0)[-1]
    return [
        (
            np.full(n, t, dtype=np.int64),
            np.full(n, ALL, dtype=np.int64),
            blocks.astype(np.int64),
            cost,
            value,
            ranks[blocks],
        )
    ]


def _one(t: int, expert: int, block: int, cost: int, value: float, rank: int) -> tuple[np.ndarray, ...]:
    return (
        np.array([t], dtype=np.int64),
        np.array([expert], dtype=np.int64),
        np.array([block], dtype=np.int64),
        np.array([cost], dtype=np.int64),
        np.array([value], dtype=np.float64),
        np.array([rank], dtype=np.uint64),
    )


def _seq_sum(values: np.ndarray) -> float:
    """Left-to-right sum (the same rounding on every machine)."""
    return float(np.cumsum(values)[-1]) if len(values) else 0.0


def unit_reads(units: Units, chosen: np.ndarray, plans: list[TensorPlan]) -> dict[int, dict[int, np.ndarray]]:
    """tensor index -> expert position -> sorted block indices read by the ``chosen`` units."""
    reads: dict[int, dict[int, list[np.ndarray]]] = {}
    columns = chosen[(units.expert[chosen] == ALL) & (units.block[chosen] != ALL)]
    for t in np.unique(units.tensor[columns]):
        tp = plans[int(t)]
        blocks = units.block[columns[units.tensor[columns] == t]]
        for i in range(tp.changed.shape[0]):
            mine = blocks[tp.changed[i, blocks]] if tp.block_units[i] else blocks[:0]
            if len(mine):
                reads.setdefault(int(t), {}).setdefault(i, []).append(mine)
    for u in chosen:
        t, e, b = int(units.tensor[u]), int(units.expert[u]), int(units.block[u])
        if b != ALL:
            continue
        changed = plans[t].changed
        for i in range(changed.shape[0]) if e == ALL else (e,):
            blocks = np.nonzero(changed[i])[0]
            if len(blocks):
                reads.setdefault(t, {}).setdefault(i, []).append(blocks)
    single = chosen[(units.block[chosen] != ALL) & (units.expert[chosen] != ALL)]
    order = np.lexsort((units.block[single], units.expert[single], units.tensor[single]))
    single = single[order]
    keys = np.stack([units.tensor[single], units.expert[single]], axis=1) if len(single) else np.zeros((0, 2))
    starts = (
        np.flatnonzero(np.r_[True, np.any(keys[1:] != keys[:-1], axis=1)])
        if len(single)
        else np.zeros(0, dtype=np.int64)
    )
    ends = list(starts[1:]) + [len(single)] if len(single) else []
    for s, e in zip(starts, ends):
        t, i = int(keys[s, 0]), int(keys[s, 1])
        reads.setdefault(t, {}).setdefault(i, []).append(units.block[single[s:e]])
    return {t: {i: np.unique(np.concatenate(parts)) for i, parts in per.items()} for t, per in reads.items()}


def choose(units: Units, budget_bytes: int, policy: str, tensor_names: list[str]) -> np.ndarray:
    """Indices of the chosen units, under ``budget_bytes``."""
    if policy == "full":
        return np.arange(len(units))
    if policy == "energy":
        ratio = np.divide(units.value, units.cost, out=np.full(len(units), np.inf), where=units.cost > 0)
        ranked = np.argsort(-ratio, kind="stable")
        chosen, _ = greedy_fill(ranked, units.cost, budget_bytes, 0)
        return chosen
    if policy == "uniform":
        return _uniform(units, budget_bytes, tensor_names)
    raise ConfigError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")


def greedy_fill(ranked: np.ndarray, cost: np.ndarray, budget_bytes: int, spent: int) -> tuple[np.ndarray, int]:
    """Take units in ``ranked`` order while they fit: ``(taken, spent)``.

    Equal to a loop that adds each unit if ``spent + cost <= budget``, done
    in vectorised steps: take the longest prefix that fits, skip the unit
    that does not, and go on with only the units small enough for what is
    left (a unit too big now never fits later, since spending only grows).
    """
    taken: list[np.ndarray] = []
    candidates = ranked
    while len(candidates):
        cumulative = np.cumsum(cost[candidates])
        fit = int(np.searchsorted(cumulative, budget_bytes - spent, side="right"))
        if fit:
            taken.append(candidates[:fit])
            spent += int(cumulative[fit - 1])
        if fit == len(candidates):
            break
        rest = candidates[fit + 1 :]
        candidates = rest[cost[rest] <= budget_bytes - spent]
    out = np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
    return out, spent


def _uniform(units: Units, budget_bytes: int, tensor_names: list[str]) -> np.ndarray:
    total = units.total_cost
    fraction = min(1.0, budget_bytes / total) if total else 0.0
    tensors = [int(t) for t in dict.fromkeys(units.tensor.tolist())]  # ordinal order
    by_tensor = {}
    for t in tensors:
        members = np.flatnonzero(units.tensor == t)
        by_tensor[t] = members[np.argsort(units.rank[members], kind="stable")]  # hash order
    chosen: list[np.ndarray] = []
    picked = np.zeros(len(units), dtype=bool)
    spent = 0
    deficit = {}
    for t in tensors:
        members = by_tensor[t]
        head = members[: int(fraction * len(members))]
        taken, spent = greedy_fill(head, units.cost, budget_bytes, spent)
        chosen.append(taken)
        picked[taken] = True
        deficit[t] = fraction * len(members) - len(taken)
    # What floors left of the budget goes to the tensors furthest below the
    # fraction, at most one more unit each: every tensor stays within one
    # unit of f * its units.
    for t in sorted(tensors, key=lambda t: (-deficit[t], tensor_names[t])):
        if deficit[t] <= 0:
            continue
        members = by_tensor[t]
        fits = members[~picked[members] & (units.cost[members] <= budget_bytes - spent)]
        if len(fits):
            chosen.append(fits[:1])
            picked[fits[0]] = True
            spent += int(units.cost[fits[0]])
    return np.concatenate(chosen) if chosen else np.zeros(0, dtype=np.int64)


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
    return Bound(
        math.sqrt(total), "estimate" if "none" in kinds else "bound", _share(all_energy, omitted_energy), estimate
    )


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
    all_sum, read_sum, omitted_sum = (
        _column_sums(np.array(v, dtype=np.float64)[:, None]) for v in (everything, read_part, omitted)
    )
    return all_sum, read_sum, omitted_sum, (np.array(energy_all), np.array(energy_omitted))


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
            total = _entries_seq_sum(c.energy for c in chunks)
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
    ratios = np.concatenate(
        [
            _running_min(
                lad.gains(plans[lad.tensor].record.numel), lad.costs(), plans[lad.tensor].finite_beta[lad.expert]
            )
            for lad in steps
        ]
        or [np.zeros(0)]
    )
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


def _entries_seq_sum(values) -> float:
    total = 0.0
    for v in values:
        total += v
    return total
