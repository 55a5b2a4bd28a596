"""The units a plan chooses from, the policies that choose (``energy``, ``uniform``, ``full``, ``entries``)
and the error bound of what they leave out; every sum is sequential (``seq_sum``): the same bits anywhere."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise

import numpy as np

from mergepipe.catalog.records import TensorRecord
from mergepipe.catalog.statistics import DeltaChunk, DeltaStage
from mergepipe.errors import ConfigError
from mergepipe.spec.request import POLICIES

#: ``Units.expert`` / ``Units.block`` of a unit that covers several experts / blocks.
ALL = -1


def seq_sum(values: Iterable[float] | np.ndarray) -> float:
    """Left-to-right sum (numpy's ``sum`` is pairwise)."""
    flat = np.fromiter(values, dtype=np.float64) if not isinstance(values, np.ndarray) else values.ravel()
    return float(np.cumsum(flat)[-1]) if len(flat) else 0.0


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
    useful_entries: list[int | None] | None = None  # per expert, a magnitude trim's k (None: every entry)
    expert_bytes: np.ndarray | None = None  # int64 [experts, blocks] where an expert's blocks are not the base's
    shared_bytes: np.ndarray | None = None  # int64 [experts]: read once with any block (a LoRA's A)

    @property
    def costs(self) -> np.ndarray:
        """int64 [experts, blocks]: what one (expert, block) read costs, less any shared part."""
        return np.broadcast_to(self.block_bytes, self.l2.shape) if self.expert_bytes is None else self.expert_bytes

    @property
    def shared(self) -> np.ndarray:
        return np.zeros(self.l2.shape[0], dtype=np.int64) if self.shared_bytes is None else self.shared_bytes

    @property
    def block_units(self) -> np.ndarray:
        """bool [experts]: experts read block by block; the others are one unit per tensor."""
        return np.array(self.expert_streams, dtype=bool) & (self.shared == 0)

    def read_bytes(self, expert: int, blocks: np.ndarray) -> int:
        if not len(blocks):
            return 0
        return int(self.costs[expert, blocks].sum()) + int(self.shared[expert])

    @property
    def changed(self) -> np.ndarray:
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
    return int.from_bytes(hashlib.sha256(f"{tensor}\0{index}".encode()).digest()[:8], "big")


def build_units(plans: list[TensorPlan]) -> Units:
    """The units of every tensor plan, in creation order: per tensor, the whole tensor (tensor-level
    operators); else per expert its blocks, or the whole tensor (``block_units``); consensus operators
    take a changed block of every block-read expert as one unit."""
    parts: list[tuple] = []  # (tensor, expert, block, cost, value, rank) columns
    for t, tp in enumerate(plans):
        name, changed, weighted = tp.record.name, tp.changed, tp.weighted()
        if tp.tensor_level:
            experts, blocks = np.nonzero(changed)  # expert-major, like the reads' order
            if len(blocks):
                cost = tp.costs[experts, blocks].sum() + tp.shared[np.unique(experts)].sum()
                parts.append(([t], [ALL], [ALL], [cost], [seq_sum(weighted[experts, blocks])], [hash_rank(name, -1)]))
            continue
        ranks = np.array([hash_rank(name, b) for b in range(changed.shape[1])], dtype=np.uint64)
        for i in range(changed.shape[0]):
            blocks = np.nonzero(changed[i])[0]
            if not len(blocks):
                continue
            if not tp.block_units[i]:
                value = seq_sum(weighted[i, blocks])
                parts.append(([t], [i], [ALL], [tp.read_bytes(i, blocks)], [value], [hash_rank(name, -1)]))
            elif tp.bound_kind != "consensus":
                n = len(blocks)
                parts.append(([t] * n, [i] * n, blocks, tp.costs[i, blocks], weighted[i, blocks], ranks[blocks]))
        if tp.bound_kind == "consensus":
            streaming = tp.block_units[:, None] & changed
            blocks = np.flatnonzero(streaming.any(axis=0))
            if len(blocks):
                cost = (streaming[:, blocks] * tp.costs[:, blocks]).sum(axis=0)
                value = np.cumsum(np.where(streaming[:, blocks], weighted[:, blocks], 0.0), axis=0)[-1]
                parts.append(([t] * len(blocks), [ALL] * len(blocks), blocks, cost, value, ranks[blocks]))
    dtypes = (np.int64, np.int64, np.int64, np.int64, np.float64, np.uint64)
    return Units(
        *(np.concatenate([np.asarray(p[k], dtype=d) for p in parts] or [np.zeros(0, d)]) for k, d in enumerate(dtypes))
    )


def unit_reads(units: Units, chosen: np.ndarray, plans: list[TensorPlan]) -> dict[int, dict[int, np.ndarray]]:
    """tensor index -> expert position -> sorted block indices read by the ``chosen`` units."""
    reads: dict[int, dict[int, list[np.ndarray]]] = {}

    def add(t: int, i: int, blocks: np.ndarray) -> None:
        if len(blocks):
            reads.setdefault(t, {}).setdefault(i, []).append(blocks)

    columns = chosen[(units.expert[chosen] == ALL) & (units.block[chosen] != ALL)]
    for t in np.unique(units.tensor[columns]):
        tp = plans[int(t)]
        blocks = units.block[columns[units.tensor[columns] == t]]
        for i in range(tp.changed.shape[0]):
            add(int(t), i, blocks[tp.changed[i, blocks]] if tp.block_units[i] else blocks[:0])
    for u in chosen[units.block[chosen] == ALL]:
        t, e = int(units.tensor[u]), int(units.expert[u])
        for i in range(plans[t].changed.shape[0]) if e == ALL else (e,):
            add(t, i, np.nonzero(plans[t].changed[i])[0])
    single = chosen[(units.block[chosen] != ALL) & (units.expert[chosen] != ALL)]
    if len(single):  # in runs of one (tensor, expert)
        single = single[np.lexsort((units.expert[single], units.tensor[single]))]
        tensors, experts = units.tensor[single], units.expert[single]
        starts = np.flatnonzero(np.r_[True, (tensors[1:] != tensors[:-1]) | (experts[1:] != experts[:-1])])
        for s, e in zip(starts, [*starts[1:], len(single)]):
            add(int(tensors[s]), int(experts[s]), units.block[single[s:e]])
    return {t: {i: np.unique(np.concatenate(parts)) for i, parts in per.items()} for t, per in reads.items()}


def choose(units: Units, budget_bytes: int, policy: str, tensor_names: list[str]) -> np.ndarray:
    """Indices of the chosen units, under ``budget_bytes``: ``energy`` greedy by value per byte (ties in
    creation order), ``uniform`` the same fraction of every tensor in hash order, ``full`` everything."""
    if policy == "full":
        return np.arange(len(units))
    if policy == "energy":
        ratio = np.divide(units.value, units.cost, out=np.full(len(units), np.inf), where=units.cost > 0)
        return greedy_fill(np.argsort(-ratio, kind="stable"), units.cost, budget_bytes, 0)[0]
    if policy == "uniform":
        return _uniform(units, budget_bytes, tensor_names)
    raise ConfigError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")


def greedy_fill(ranked: np.ndarray, cost: np.ndarray, budget_bytes: int, spent: int) -> tuple[np.ndarray, int]:
    """``(taken, spent)`` of a loop taking each unit in ``ranked`` order that still fits, vectorised."""
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
    return (np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)), spent


def _uniform(units: Units, budget_bytes: int, tensor_names: list[str]) -> np.ndarray:
    """The fraction f = budget / full of every tensor's units in hash order, then at most one more unit
    each to the tensors furthest below f: every tensor within one unit of f times its units."""
    total = units.total_cost
    fraction = min(1.0, budget_bytes / total) if total else 0.0
    by_tensor = {}
    for t in dict.fromkeys(units.tensor.tolist()):
        members = np.flatnonzero(units.tensor == t)
        by_tensor[t] = members[np.argsort(units.rank[members], kind="stable")]
    chosen: list[np.ndarray] = []
    picked = np.zeros(len(units), dtype=bool)
    spent = 0
    deficit = {}
    for t, members in by_tensor.items():
        taken, spent = greedy_fill(members[: int(fraction * len(members))], units.cost, budget_bytes, spent)
        chosen.append(taken)
        picked[taken] = True
        deficit[t] = fraction * len(members) - len(taken)
    for t in sorted(by_tensor, key=lambda t: (-deficit[t], tensor_names[t])):
        members = by_tensor[t]
        fits = members[~picked[members] & (units.cost[members] <= budget_bytes - spent)]
        if deficit[t] > 0 and len(fits):
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
    estimate: float  # first-order deviation: the weighted norm of what is left out


def error_bound(
    plans: list[TensorPlan], reads: dict[int, dict[int, np.ndarray]], entries: EntryEnergy | None = None
) -> Bound:
    """The bound and share of a plan that reads ``reads`` (and ``entries`` from delta stores)."""
    contributions, first_order, all_energy, omitted_energy = [], [], [], []
    with np.errstate(over="ignore"):  # weights of huge deltas may overflow: the bound is then inf, as it says
        for t, tp in enumerate(plans):
            contribution, omitted, energies = _block_terms(tp, reads.get(t, {}), entries.get(t) if entries else None)
            contributions.append(contribution)
            first_order.append(omitted**2)
            all_energy.append(energies[0])
            omitted_energy.append(energies[1])
        total = _seq_total(contributions)
        estimate = math.sqrt(_seq_total(first_order))
    kind = "estimate" if any(tp.bound_kind == "none" for tp in plans) else "bound"
    return Bound(math.sqrt(total), kind, _share(all_energy, omitted_energy), estimate)


def _block_terms(
    tp: TensorPlan, reads: Mapping[int, np.ndarray], stored: Mapping[int, tuple[float, float, float]] | None
) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """One tensor's squared bound and omitted weighted norm per block, and its (all, omitted) norms."""
    weighted = tp.weighted()
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
        scale = float(np.max(np.concatenate(everything)))
        if not math.isfinite(scale):
            return 1.0
        energy = _seq_total([np.square(part / scale) for part in everything])
        left = _seq_total([np.square(part / scale) for part in omitted])
    return min(math.sqrt(left / energy), 1.0) if energy > 0 else 0.0


def _seq_total(parts: list[np.ndarray]) -> float:
    return seq_sum(np.concatenate(parts)) if parts else 0.0


def _column_sums(values: np.ndarray) -> np.ndarray:
    """Per block, the sum over experts in expert order (sequential)."""
    return np.cumsum(values, axis=0)[-1] if values.shape[0] else np.zeros(values.shape[1])


def _tensor_terms(
    tp: TensorPlan, weighted: np.ndarray, read: np.ndarray, stored: Mapping[int, tuple[float, float, float]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """The bound's three sums (all, read, omitted) for a tensor taken as one block (some experts read
    delta stores), and the (all, omitted) weighted norms per expert, for the share."""
    beta = tp.finite_beta
    rows = []
    for i in range(weighted.shape[0]):
        if i in stored:
            rows.append([beta[i] * math.sqrt(max(v, 0.0)) for v in stored[i]])
        else:
            row, mask = weighted[i], read[i]
            rows.append([float(np.sqrt(np.sum(np.square(v)))) for v in (row, row[mask], row[~mask])])
    norms = np.array(rows, dtype=np.float64).reshape(-1, 3)
    everything, read_part, omitted = (_column_sums(norms[:, k : k + 1]) for k in range(3))
    return everything, read_part, omitted, (norms[:, 0], norms[:, 2])


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

    def ratios(self, numel: int, beta: float) -> np.ndarray:
        """Per step: beta² x the share of ``||Δ||²`` it removes x ``numel``, per byte, as a running
        minimum (a greedy fill then keeps prefixes)."""
        residuals = [self.total] + [s.residual for s in self.stages]
        steps = [max(a - b, 0.0) for a, b in pairwise(residuals)] + [residuals[-1]]
        gains = np.array(steps, dtype=np.float64) * (numel / self.total if self.total > 0 else 0.0)
        costs = self.costs()
        ratio = np.divide(beta**2 * gains, costs, out=np.full(len(costs), np.inf), where=costs > 0)
        return np.minimum.accumulate(ratio)


@dataclass
class EntryChoice:
    """What the entries policy chose beyond block units."""

    sketch: dict[int, dict[int, int]] = field(default_factory=dict)  # tensor -> expert -> stages read
    chunks: dict[int, dict[int, int]] = field(default_factory=dict)  # tensor -> expert -> chunks read
    blocks: dict[int, dict[int, np.ndarray]] = field(default_factory=dict)  # exact through blocks
    bytes_by_expert: dict[int, int] = field(default_factory=dict)  # store bytes read
    energy: dict[int, dict[int, tuple[float, float, float]]] = field(default_factory=dict)  # EntryEnergy

    @property
    def complete(self) -> bool:
        """Whether every stored (tensor, expert) is read exactly."""
        return all(omitted == 0.0 for per in self.energy.values() for _, _, omitted in per.values())


def ladders(plans: Sequence[TensorPlan], stores: Mapping[int, Store]) -> list[Ladder]:
    """The ladder of every changed (tensor, expert with a store), in creation order; exact reads the
    chunks up to the operator's useful entries, or the changed blocks, whichever is cheaper."""
    out = []
    for t, tp in enumerate(plans):
        for i in sorted(stores):
            chunks = stores[i].chunks.get(tp.record.name, ())
            if not chunks:
                continue
            limit = tp.useful_entries[i] if tp.useful_entries else None
            before = np.cumsum([0] + [c.entries for c in chunks[:-1]])  # entries before each chunk
            useful = len(chunks) if limit is None else int(np.searchsorted(before, limit))
            chunk_cost = sum(c.nbytes for c in chunks[:useful])
            block_cost = tp.read_bytes(i, np.flatnonzero(tp.changed[i]))
            exact_cost, exact_chunks = (chunk_cost, useful) if chunk_cost <= block_cost else (block_cost, 0)
            stages, spent = [], 0
            for stage in stores[i].stages.get(tp.record.name, ()):
                spent += stage.nbytes
                if spent >= exact_cost:
                    break
                stages.append(stage)
            out.append(Ladder(t, i, seq_sum(c.energy for c in chunks), stages, exact_cost, exact_chunks))
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
        energy *= np.square(tp.finite_beta)[:, None] * tp.record.numel
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
    """``(block units, chosen ones, entry choice)``: stores read through ladders, the rest as block units."""
    without = []  # the plans as if the experts with a store had no changed block
    for tp in plans:
        l2 = tp.l2.copy()
        l2[list(stores)] = np.nan
        without.append(replace(tp, l2=l2))
    subset = build_units(without)
    steps = ladders(plans, stores)
    costs = np.concatenate([lad.costs() for lad in steps] or [np.zeros(0, dtype=np.int64)])
    ratios = [lad.ratios(plans[lad.tensor].record.numel, plans[lad.tensor].finite_beta[lad.expert]) for lad in steps]
    ranked = np.argsort(-np.concatenate([block_energy_ratio(subset, plans), *ratios]), kind="stable")
    taken, _ = greedy_fill(ranked, np.concatenate([subset.cost, costs]), budget_bytes, 0)
    got = np.zeros(len(costs), dtype=bool)
    got[taken[taken >= len(subset)] - len(subset)] = True
    choice = EntryChoice(bytes_by_expert={i: 0 for i in stores})
    start = 0
    for lad in steps:
        n = len(lad.stages) + 1
        level = n if got[start : start + n].all() else int(np.argmin(got[start : start + n]))  # prefix kept
        _record(choice, lad, level, plans[lad.tensor])
        start += n
    return subset, np.sort(taken[taken < len(subset)]), choice


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
    elif level:
        choice.sketch.setdefault(t, {})[i] = level
        choice.bytes_by_expert[i] += sum(s.nbytes for s in lad.stages[:level])
        stage = lad.stages[level - 1]
        choice.energy.setdefault(t, {})[i] = (lad.total, stage.norm**2, stage.residual)
    else:
        choice.energy.setdefault(t, {})[i] = (lad.total, 0.0, lad.total)
