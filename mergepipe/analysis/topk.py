"""Exact trim thresholds (τ, p) for every density of a grid, from |Δ| seen one window at a time.

The contract is ``spec/trim.py``: keep the k = max(1, int(d·n)) largest |Δ|, ties by position; τ is
the k-th largest value, p the flat position of the last entry equal to τ that is kept.

Why a radix select: for non-negative fp32 values the bit pattern read as an int32 orders exactly like the
value, so the k-th largest is found digit by digit for every density at once in O(n), where a sort is
O(n log n) and a ``topk`` per density repeats the work. One structure, filled while each window of |Δ| is
in memory anyway (the pass that takes block statistics and hashes, ``add``):

* every entry has a 16-bit **key**: its high 16 bits (sign 0, exponent, 7 mantissa bits: its *bucket*),
  with bit 15 (the sign's place) set when its low 16 bits are not all zero (*impure*). A difference of two
  bf16 (or f16) values in one binade has at most 8 significant bits, so almost every entry of a bf16 delta
  is pure: its key says its exact value. Exact zeros are key 0.
* windows are cut into **pieces** of ``PIECE`` entries; one bincount of each piece's high digits counts
  its buckets, and its impure entries (found by their non-zero low halves: a handful in a bf16 delta) are
  moved to their own keys. Each piece keeps its non-zero counts (sparse); their sum is the histogram.

Afterwards the histogram of buckets names, for every density, the bucket holding the k-th largest entry and
how many entries lie above it; inside the bucket the impure entries lie above the pure ones (equal high
bits, larger low bits). So:

* **the k-th entry is pure** (the common case, zeros included): τ is the bucket's value, and p is the r-th
  entry with that key in position order: the pieces' counts name the one piece holding it, and only that
  piece is looked at again (a run of unchanged blocks, all zeros, is not even read);
* **it is impure** (fp32 deltas; the rare cross-binade entries of bf16 ones): the bucket's impure entries are
  collected from the pieces that hold any, and a stable sort of them gives τ and p.

Memory per tensor: the histogram, the pieces' sparse counts (a few thousand keys per piece) and, for impure
cuts, the impure entries of their buckets (12 bytes each: none for most bf16 tensors, at most a bucket —
1/128 of a binade — for fp32 ones). No step holds more than one window of values: the selector asks its
caller for a piece's values again (``values_of``), and the caller decides where they come from (still in
memory, or recomputed from the checkpoint's bytes).

Tensors below ``SORT_BELOW`` entries take a stable sort: the same answer, less fixed cost.
Everything runs on the device of the values (CPU or CUDA).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from mergepipe.spec.trim import TrimThreshold, kept_count

_DIGIT = 1 << 16
_IMPURE = 1 << 15  # key bit: the low 16 bits are not all zero (|Δ| ≥ 0: bit 31, the sign, is free)
#: Index of the low 16 bits of an fp32 value viewed as two int16 (the host's byte order; CUDA's is little).
_LOW = 0 if sys.byteorder == "little" else 1

#: Below this many entries a stable sort is cheaper than the histograms, and gives the same answer.
SORT_BELOW = 1 << 16

#: Entries per piece: what the search for a position looks at again. Smaller pieces make that cheaper and
#: counting dearer (a bincount of up to 32768 bins per piece, ~16K for typical deltas).
PIECE = 1 << 16

#: Entries counted at once (the int32 high digits of that many entries are held).
_COUNT_SPAN = 32 * PIECE

#: Impure entries are kept apart while at most one in this many is impure (12 bytes each); beyond, the
#: keys carry the impure bit and impure cuts collect their bucket's entries in a second look.
_FEW_IMPURE = 64

#: Most impure entries collected at once for impure cuts (12 bytes each); more buckets take more looks.
_COLLECT_CAP = 1 << 22

#: ``values_of(run, lo, hi)``: fp32 |Δ| of entries ``[lo, hi)`` of the ``run``-th run added, again.
ValuesOf = Callable[[int, int, int], torch.Tensor]


@dataclass(frozen=True)
class _Piece:
    """Entries ``[lo, hi)`` of run ``run`` (offsets in the run); ``start`` is the tensor position of ``lo``."""

    run: int
    lo: int
    hi: int
    start: int
    data: bool  # False: all exact zeros, never looked at


@dataclass
class _Counts:
    """Sparse (piece, key) counts of a tensor: ``keys`` = piece * 65536 + key, in piece order."""

    keys: list[torch.Tensor] = field(default_factory=list)
    counts: list[torch.Tensor] = field(default_factory=list)

    def add(self, keys: torch.Tensor, counts: torch.Tensor) -> None:
        self.keys.append(keys)
        self.counts.append(counts)

    def of_key(self, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pieces, counts) holding ``key``, in position order."""
        if len(self.keys) > 1:  # joined once, then every lookup filters one tensor
            self.keys, self.counts = [torch.cat(self.keys)], [torch.cat(self.counts)]
        keys, counts = self.keys[0], self.counts[0]
        hit = (keys & (_DIGIT - 1)) == key
        return keys[hit] >> 16, counts[hit]


class ThresholdSelector:
    """Exact (τ, p) at every density for one tensor's |Δ|, fed in position order (module docstring)."""

    def __init__(self, numel: int, densities: Sequence[float]) -> None:
        self.numel = numel
        self.densities = [float(d) for d in densities]
        self.ks = [kept_count(d, numel) for d in densities]
        self.pieces: list[_Piece] = []
        self._runs = 0
        self._end = 0
        self._hist = torch.zeros(_DIGIT, dtype=torch.int64)
        self._counts = _Counts()
        # the impure entries (bit patterns, positions) while they are few, None once a window had many
        self._impure: list[tuple[torch.Tensor, torch.Tensor]] | None = []

    def _next_run(self, start: int, numel: int) -> int:
        if start != self._end:
            raise ValueError(f"entries must come in position order without gaps: expected {self._end}, got {start}")
        self._end += numel
        self._runs += 1
        return self._runs - 1

    def add(self, start: int, values: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """Entries ``[start, start + len(values))``: fp32 |Δ|, 1-D, contiguous, non-negative, finite.
        ``keys`` is an int32 scratch buffer to reuse (one is allocated when None or too small)."""
        n = values.numel()
        run = self._next_run(start, n)
        if keys is None or keys.numel() < min(n, _COUNT_SPAN) or keys.device != values.device:
            keys = torch.empty(min(n, _COUNT_SPAN), dtype=torch.int32, device=values.device)
        for lo in range(0, n, _COUNT_SPAN):
            self._count(run, start, lo, values[lo : lo + _COUNT_SPAN], keys)

    def _count(self, run: int, start: int, offset: int, values: torch.Tensor, keys: torch.Tensor) -> None:
        """Count each piece's keys in ``values``, entries ``offset ...`` of run ``run``: one bincount of high
        digits per piece, less the impure entries (found by their non-zero low halves), counted apart and
        kept while they are few; where most entries are impure (fp32 deltas) the keys carry the bit."""
        n = values.numel()
        high = torch.bitwise_right_shift(values.view(torch.int32), 16, out=keys[:n])
        low = values.view(torch.int16)[_LOW::2]
        impure = torch.nonzero(low).flatten() if self._impure is not None else None
        if impure is not None and impure.numel() * _FEW_IMPURE > n:
            impure = self._impure = None
        if impure is None:
            high.add_(low != 0, alpha=_IMPURE)
            impure = high[:0].long()  # none apart
        else:
            assert self._impure is not None  # impure entries are looked for only while they are kept apart
            self._impure.append((values.view(torch.int32)[impure], impure + (start + offset)))
        pieces = -(-n // PIECE)
        impure_keys, impure_counts = _sparse_counts((impure // PIECE) * _DIGIT + high[impure], pieces * _DIGIT)
        starts = torch.arange(pieces + 1, device=impure_keys.device) * _DIGIT
        bounds = torch.searchsorted(impure_keys, starts).tolist()  # each piece's impure keys
        if self._hist.device != values.device:
            self._hist = self._hist.to(values.device)
        first, piece_keys, piece_counts = len(self.pieces), [], []
        for j, lo in enumerate(range(0, n, PIECE)):
            self.pieces.append(_Piece(run, offset + lo, offset + min(lo + PIECE, n), start + offset + lo, True))
            counts = torch.bincount(high[lo : lo + PIECE])  # as many bins as the largest key needs
            a, b = bounds[j], bounds[j + 1]
            if b > a:  # impure entries: their own keys, and no longer counted as pure
                buckets, n_impure = impure_keys[a:b] & (_DIGIT - 1), impure_counts[a:b]
                counts.index_add_(0, buckets, -n_impure)
                piece_keys.append(buckets + (_IMPURE + (first + j) * _DIGIT))
                piece_counts.append(n_impure)
            nonzero = torch.nonzero(counts).flatten()
            piece_keys.append(nonzero + (first + j) * _DIGIT)
            piece_counts.append(counts[nonzero])
        keys_, counts_ = torch.cat(piece_keys), torch.cat(piece_counts)
        self._hist.index_add_(0, keys_ & (_DIGIT - 1), counts_)
        self._counts.add(keys_.cpu(), counts_.cpu())

    def add_zeros(self, start: int, numel: int) -> None:
        """Entries ``[start, start + numel)`` are all exact zeros (unchanged blocks): nothing to look at."""
        run = self._next_run(start, numel)
        if numel:
            self.pieces.append(_Piece(run, 0, numel, start, False))
            self._hist[0] += numel
            self._counts.add(torch.tensor([(len(self.pieces) - 1) * _DIGIT]), torch.tensor([numel]))

    def thresholds(self, values_of: ValuesOf) -> list[TrimThreshold]:
        """The thresholds, in the order of the densities, once every entry has been added."""
        if self._end != self.numel:
            raise ValueError(f"entries added cover {self._end} of {self.numel}")
        if self.numel == 0:
            return [TrimThreshold(d, 0, float("inf"), -1) for d in self.densities]
        if self.numel < SORT_BELOW:
            return self._by_sort(values_of)
        buckets_hist = self._hist[:_IMPURE] + self._hist[_IMPURE:]
        above = _count_above_each(buckets_hist)
        pure: dict[int, list[tuple[int, int]]] = {}  # key -> [(density index, rank among that key)]
        impure: dict[int, list[tuple[int, int]]] = {}  # bucket -> [(density index, rank from its top)]
        for i, bucket in enumerate(_digit_of_kth(buckets_hist, self.ks)):
            rank = self.ks[i] - int(above[bucket])  # 1-based, from the top of the bucket
            n_impure = int(self._hist[bucket | _IMPURE])
            if rank > n_impure:
                pure.setdefault(bucket, []).append((i, rank - n_impure - 1))
            else:
                impure.setdefault(bucket, []).append((i, rank))
        found = self._pure_cuts(pure, values_of)
        found.update(self._impure_cuts(impure, values_of))
        return [found[i] for i in range(len(self.ks))]

    def _by_sort(self, values_of: ValuesOf) -> list[TrimThreshold]:
        """The k-th entry of a stable descending sort is τ and its position p (ties are ordered by position)."""
        parts = [values_of(p.run, p.lo, p.hi).clone() if p.data else None for p in self.pieces]  # may share a buffer
        device = next((v.device for v in parts if v is not None), torch.device("cpu"))
        full = torch.cat([v if v is not None else torch.zeros(p.hi - p.lo, device=device)
                          for v, p in zip(parts, self.pieces)])
        values, order = torch.sort(full, descending=True, stable=True)
        return [TrimThreshold(d, k, float(values[k - 1]), int(order[k - 1])) for d, k in zip(self.densities, self.ks)]

    def _pure_cuts(self, cuts: dict[int, list[tuple[int, int]]], values_of: ValuesOf) -> dict[int, TrimThreshold]:
        """τ is the key's value; p the rank-th entry with that key, in the one piece holding it."""
        targets = []  # (piece, key, rank in the piece, density index)
        for key, wanted in cuts.items():
            pieces, counts = self._counts.of_key(key)
            ends = counts.cumsum(0)
            ranks = torch.tensor([rank for _, rank in wanted], dtype=ends.dtype, device=ends.device)
            at = torch.searchsorted(ends, ranks, right=True).tolist()
            for (i, rank), j in zip(wanted, at):
                before = int(ends[j - 1]) if j else 0
                targets.append((int(pieces[j]), key, rank - before, i))
        found = {}
        hits, looked_at = None, None
        for piece_index, key, rank, i in sorted(targets):
            piece = self.pieces[piece_index]
            if not piece.data:  # all zeros: the rank-th zero is at rank
                position = rank
            else:
                if looked_at != (piece_index, key):
                    values = values_of(piece.run, piece.lo, piece.hi).view(torch.int32)
                    hits, looked_at = torch.nonzero(values == (key << 16)).flatten(), (piece_index, key)
                assert hits is not None  # found above at the first look at this piece
                position = int(hits[rank])
            found[i] = TrimThreshold(self.densities[i], self.ks[i], _value_of(key << 16), piece.start + position)
        return found

    def _impure_cuts(self, cuts: dict[int, list[tuple[int, int]]], values_of: ValuesOf) -> dict[int, TrimThreshold]:
        """The bucket's impure entries in position order (kept from the first look, or collected): a stable
        sort of them by value gives τ and p."""
        found = {}
        for batch in self._batches(sorted(cuts)):
            if self._impure:  # every impure entry was kept (an impure cut means there are some)
                bits, positions = torch.cat([b for b, _ in self._impure]), torch.cat([p for _, p in self._impure])
            else:
                bits, positions = self._collect(batch, values_of)
            for bucket in batch:
                inside = torch.nonzero((bits >> 16) == bucket).flatten()
                ordered, order = torch.sort(bits[inside], descending=True, stable=True)
                at = positions[inside]
                for i, rank in cuts[bucket]:
                    found[i] = TrimThreshold(self.densities[i], self.ks[i], _value_of(int(ordered[rank - 1])),
                                             int(at[order[rank - 1]]))
        return found

    def _batches(self, buckets: list[int]) -> list[list[int]]:
        """Buckets grouped so that each group's impure entries, collected at once, stay under the cap."""
        batches: list[list[int]] = []
        total = _COLLECT_CAP + 1
        for bucket in buckets:
            size = int(self._hist[bucket | _IMPURE])
            if self._impure is None and total + size > _COLLECT_CAP:
                batches.append([])
                total = 0
            elif not batches:
                batches.append([])
            batches[-1].append(bucket)
            total += size
        return batches

    def _collect(self, buckets: list[int], values_of: ValuesOf) -> tuple[torch.Tensor, torch.Tensor]:
        """Bit patterns and positions of the impure entries of ``buckets``, in position order, from a look at
        each piece that holds any."""
        member = torch.zeros(_IMPURE, dtype=torch.bool, device=self._hist.device)
        member[torch.tensor(buckets, device=member.device)] = True
        pieces = sorted({int(j) for bucket in buckets for j in self._counts.of_key(bucket | _IMPURE)[0]})
        bits = [torch.zeros(0, dtype=torch.int32, device=member.device)]
        positions = [torch.zeros(0, dtype=torch.int64, device=member.device)]
        for j in pieces:
            piece = self.pieces[j]
            values = values_of(piece.run, piece.lo, piece.hi).view(torch.int32)
            inside = torch.nonzero(member.index_select(0, values >> 16) & ((values & 0xFFFF) != 0)).flatten()
            bits.append(values[inside])
            positions.append(inside + piece.start)
        return torch.cat(bits), torch.cat(positions)


def _sparse_counts(keys: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted distinct keys and their counts: by sorting when there are few, else by one histogram."""
    if keys.numel() * 16 < bins:
        return torch.unique(keys, sorted=True, return_counts=True)
    counts = torch.bincount(keys, minlength=bins)
    nonzero = torch.nonzero(counts).flatten()
    return nonzero, counts[nonzero]


def _value_of(bits: int) -> float:
    return float(torch.tensor([bits], dtype=torch.int32).view(torch.float32).item())


def _count_above_each(hist: torch.Tensor) -> torch.Tensor:
    """``out[d]`` = number of entries whose digit is greater than ``d``."""
    return hist.flip(0).cumsum(0).flip(0) - hist


def _digit_of_kth(hist: torch.Tensor, ks: Sequence[int]) -> list[int]:
    """For each k, the digit holding the k-th largest entry: the largest d
    with (#entries with digit >= d) >= k, found by one binary search."""
    at_least = hist.flip(0).cumsum(0)  # at_least[j] = #entries with digit >= len(hist) - 1 - j
    first = torch.searchsorted(at_least, torch.tensor(ks, dtype=at_least.dtype, device=at_least.device), side="left")
    return [hist.numel() - 1 - int(j) for j in first]
