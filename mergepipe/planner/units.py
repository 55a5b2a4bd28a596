"""The planner's choices: *units* of expert reads, each all-or-nothing,
with a byte cost and a value, as flat numpy arrays.

Per mergeable tensor the planner knows, from the catalog, every block's byte
size (per expert: a delta checkpoint in another dtype than the base reads
other byte counts for the same rows, ``analysis/expert_format.py``) and each
expert's ``||Δi_b||`` (NaN where the block is identical to the
base: it costs nothing and is never a unit). Units are, in creation order
(tensor ordinal, then expert, then block):

* streaming operators: one unit per changed (expert, block) — value
  ``beta_i * ||Δi_b||``; for consensus operators (TIES family) one unit per
  block across every expert that changed it — value ``Σ_i beta_i ||Δi_b||``
  — since their error bound falls only when a block is read from every
  expert (``bound.py``);
* tensor-level operators (SLERP, model stock): one unit per tensor covering
  every expert's changed blocks;
* a streaming operator whose trim thresholds for an expert are not in the
  catalog (an off-grid density) merges that tensor whole: one unit per
  (expert, tensor), since thresholds from part of a tensor would be wrong;
  so is an expert whose block reads share bytes (a LoRA adapter's factor A,
  read once per tensor): the unit costs its blocks and the shared part once.

Arrays, not objects: a 70B model with 20 experts has millions of units.
Sums are sequential in creation order (``np.cumsum``), so values are the
same bits on every machine and Python version.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from mergepipe.catalog.records import TensorRecord

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
        out.append((
            np.full(n, t, dtype=np.int64), np.full(n, i, dtype=np.int64), blocks.astype(np.int64),
            tp.costs[i, blocks].astype(np.int64), weighted[i, blocks], ranks[blocks],
        ))
    if tp.bound_kind == "consensus":
        out.extend(_column_units(t, tp, weighted, ranks))
    return out


def _column_units(t: int, tp: TensorPlan, weighted: np.ndarray, ranks: np.ndarray | None
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
    return [(np.full(n, t, dtype=np.int64), np.full(n, ALL, dtype=np.int64), blocks.astype(np.int64),
             cost, value, ranks[blocks])]


def _one(t: int, expert: int, block: int, cost: int, value: float, rank: int) -> tuple[np.ndarray, ...]:
    return (
        np.array([t], dtype=np.int64), np.array([expert], dtype=np.int64), np.array([block], dtype=np.int64),
        np.array([cost], dtype=np.int64), np.array([value], dtype=np.float64), np.array([rank], dtype=np.uint64),
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
    starts = (np.flatnonzero(np.r_[True, np.any(keys[1:] != keys[:-1], axis=1)]) if len(single)
              else np.zeros(0, dtype=np.int64))
    ends = list(starts[1:]) + [len(single)] if len(single) else []
    for s, e in zip(starts, ends):
        t, i = int(keys[s, 0]), int(keys[s, 1])
        reads.setdefault(t, {}).setdefault(i, []).append(units.block[single[s:e]])
    return {t: {i: np.unique(np.concatenate(parts)) for i, parts in per.items()} for t, per in reads.items()}
