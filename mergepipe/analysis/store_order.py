"""The order of a delta store's entries, largest ``|Δ|`` first, in memory bounded by a band.

A store lists a tensor's non-zero entries by descending ``|Δ|``, equal ones by position (NaN first): what
a stable descending sort gives, and the order every magnitude trim uses. Sorting a whole tensor needs its
every entry in memory at once (a fully changed 155M-entry embedding: ~3 GB). So a large tensor is ordered
a *band* at a time: a band is a range of magnitudes holding at most ``band_entries`` entries, found from a
histogram of the magnitudes' top 16 bits (refined to exact values for a histogram bucket that alone holds
more: known from the histogram's pass when the bucket holds one magnitude, as nearly every bucket of a bf16
delta does, else counted by one more pass); each band is collected in one more pass over the tensor and
sorted, bands in descending order. A single magnitude held by more entries than a band needs no sort: its
entries go out in position order, as the pass meets them (a *streamed* band).

Magnitudes are compared through their fp32 bits as int32: for non-negative floats the order is the same,
and every NaN is given one bit pattern (``_NAN_BITS``, above infinity's), so all NaNs tie and come first.

A chunk stores its entries in position order, so what the store needs of the order is only which chunk
each entry falls in (``in_chunks``): an entry whose histogram bucket lies inside one chunk's ranks has its
chunk from the bucket alone, and only the few buckets a chunk boundary cuts need more. A stable radix
sort by that (8- or 16-bit) label groups the entries, keeping each group in position order: no comparison
sort of all the entries, which bf16 deltas (a few thousand distinct magnitudes, some held by millions of
entries) would spend most of its time on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

_INF_BITS, _NAN_BITS, _MAX_BITS = 0x7F800000, 0x7FC00000, 0x7FFFFFFF  # of fp32 magnitudes, as int32
_LOW_BITS = 15  # of a magnitude's bits below its histogram bucket (31 bits in all: the sign is 0)
BUCKETS = 1 << (31 - _LOW_BITS)
_DIGIT_BITS = 16  # of a radix sort's digit (numpy sorts 16-bit integers stably by radix)
_FINE_LOW_BITS = 11  # below the buckets ``in_chunks`` ranks a large set of entries by (2^20 of them, 8 MB)
_FINE_ENTRIES = 1 << 20  # a set of entries this large is ranked by the fine buckets
_PIECE = 1 << 20  # entries labelled and grouped at a time


def magnitude_bits(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The int32 bits of ``|values|`` (fp32), every NaN as ``_NAN_BITS``: they order as the magnitudes do.
    In ``out`` (fp32, of their length: ``values`` itself when they are no longer needed) if given."""
    bits = np.abs(values, out=out).view(np.int32)
    if bits.size and bits.max() > _INF_BITS:
        bits[bits > _INF_BITS] = _NAN_BITS
    return bits


def in_chunks(bits: np.ndarray, positions: np.ndarray | None, first: int,
              size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(positions, bits)`` of the given entries' store order (descending magnitude, equal ones by position)
    cut into slices: the first ``first`` entries (``1 <= first <= size``), then ``size`` at a time; each slice
    in *position* order, as a chunk stores it. The entries are listed in position order: ``positions`` (int64,
    ascending), or ``None`` for ``0, 1, ... len(bits) - 1`` (the indices of a band's entries, which sort as
    their positions would).

    How: a histogram of the magnitudes' top bits ranks whole buckets of them; a bucket whose ranks fall in one
    slice belongs to it, and the few buckets a slice edge cuts (at most one per edge) are kept apart. A stable
    radix sort by that label groups the entries, each group in position order. A cut bucket of one magnitude
    (nearly every one, for bf16 deltas) is then split at the edges as it is; one of several is ordered first.
    A slice's own group and the pieces of cut buckets it gets are merged by position."""
    count = len(bits)
    if not count:
        return
    edges = np.arange(first, count, size)  # the first rank of each slice after the first
    slices = len(edges) + 1
    low_bits = _FINE_LOW_BITS if count > _FINE_ENTRIES else _LOW_BITS
    keys = bits >> low_bits
    lowest = int(keys.min())
    keys -= lowest  # buckets from the smallest magnitude there is: counts as long as the magnitudes' span
    counts = np.zeros(int(keys.max()) + 1, dtype=np.int64)
    for start in range(0, count, _PIECE):
        counts += np.bincount(keys[start : start + _PIECE], minlength=len(counts))
    above = _entries_above(counts)  # the first rank of each bucket's entries
    first_slice, cut = _spans(above, counts, edges)
    cut_buckets = np.flatnonzero(cut)
    label = first_slice.astype(_small_uint(slices + len(cut_buckets)))
    label[cut_buckets] = slices + np.arange(len(cut_buckets))  # a cut bucket: a group of its own
    groups = _grouped(keys, label, slices + len(cut_buckets))
    del keys
    runs: list[list[np.ndarray]] = [[groups[k]] for k in range(slices)]
    for number, b in enumerate(cut_buckets.tolist(), start=slices):
        run = groups[number]  # the bucket's entries, position order
        run_bits = bits[run.astype(np.intp)]  # (numpy's own conversion of an int32 index is slower)
        one = bool((run_bits == run_bits[0]).all())
        ranked = run if one else run[_stable_order(_MAX_BITS - run_bits)]  # by rank
        inner = edges[(edges > above[b]) & (edges < above[b] + counts[b])] - above[b]
        for k, piece in enumerate(np.split(ranked, inner), start=int(first_slice[b])):
            runs[k].append(piece if one else np.sort(piece))
    del groups
    for k in range(slices):
        chosen = runs[k][0] if len(runs[k]) == 1 else np.sort(np.concatenate(runs[k]), kind="stable")  # a merge
        runs[k] = []
        chosen = chosen.astype(np.intp)  # what numpy would make of it at each use as an index
        yield (chosen if positions is None else positions[chosen]), bits[chosen]


def _grouped(keys: np.ndarray, label: np.ndarray, labels: int) -> list[np.ndarray]:
    """Per label, the indices of the entries whose bucket (``keys``) has it, ascending (int32 where they fit):
    a stable radix sort by label of a piece of the entries at a time, the pieces' groups joined (the memory of
    the indices, and of one piece besides)."""
    index = np.int32 if len(keys) <= np.iinfo(np.int32).max else np.int64
    parts: list[list[np.ndarray]] = [[] for _ in range(labels)]
    for start in range(0, len(keys), _PIECE):
        piece = label[keys[start : start + _PIECE].astype(np.intp)]
        order = np.argsort(piece, kind="stable").astype(index)
        order += start
        ends = np.cumsum(np.bincount(piece, minlength=labels))
        for k, part in enumerate(np.split(order, ends[:-1])):
            if len(part):
                parts[k].append(part)
    groups = []
    for k in range(labels):  # joined one label at a time, its parts dropped as it is
        groups.append(np.concatenate(parts[k]) if len(parts[k]) > 1 else parts[k][0] if parts[k]
                      else np.zeros(0, dtype=index))
        parts[k] = []
    return groups


def _spans(starts: np.ndarray, counts: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For units of ``counts`` entries ranked from ``starts``: the slice of each unit's first entry, and
    whether a slice edge cuts the unit."""
    first = np.searchsorted(edges, starts, side="right")
    last = np.searchsorted(edges, starts + counts - 1, side="right")
    return first, (first != last) & (counts > 0)


def _entries_above(counts: np.ndarray) -> np.ndarray:
    """Per bucket, the entries in the buckets above it (larger magnitudes come first)."""
    return np.cumsum(counts[::-1])[::-1] - counts


def _small_uint(values: int) -> type[np.unsignedinteger]:
    """The narrowest unsigned dtype that holds ``0 .. values - 1``: radix sorts of 8 and 16 bits are cheaper."""
    return np.uint8 if values <= 1 << 8 else np.uint16 if values <= 1 << 16 else np.uint32


def _stable_order(keys: np.ndarray) -> np.ndarray:
    """The indices that sort non-negative integer ``keys`` (below 2³²) stably: equal keys keep their order.

    numpy's stable sort of 8- and 16-bit integers is a radix sort; wider keys are sorted in 16-bit digits,
    least significant first, a digit that every key shares skipped."""
    if keys.dtype.itemsize <= 2:
        return np.argsort(keys, kind="stable")
    order: np.ndarray | None = None
    for shift in (0, _DIGIT_BITS):
        digit = ((keys >> shift) & ((1 << _DIGIT_BITS) - 1)).astype(np.uint16)
        if (digit == digit[0]).all():
            continue
        step = np.argsort(digit if order is None else digit[order], kind="stable")
        order = step if order is None else order[step]
    return np.arange(len(keys)) if order is None else order


def histogram(bits: np.ndarray) -> np.ndarray:
    """Counts of the non-zero magnitudes ``bits`` by their top 16 bits (``BUCKETS`` int64)."""
    scan = Histogram()
    scan.add(bits)
    return scan.counts


class Histogram:
    """``histogram`` of magnitudes fed a window at a time, and for each bucket whether all its entries seen
    so far share one magnitude: then that magnitude and the bucket's count are its exact counts, and an
    oversized bucket needs no pass of its own (``exact``). A bf16 delta's buckets nearly always hold one
    magnitude each: a bucket keeps fp32's top 16 bits, bf16's precision."""

    def __init__(self) -> None:
        self.counts = np.zeros(BUCKETS, dtype=np.int64)
        self._value = np.zeros(BUCKETS, dtype=np.int32)  # the magnitude of a bucket of one magnitude
        self._mixed = np.zeros(BUCKETS, dtype=bool)
        self._mixed[0] = True  # zeros (no entries) share bucket 0 with the smallest subnormals: never inferred

    def add(self, bits: np.ndarray) -> None:
        buckets = bits.astype(np.intp)  # numpy converts other indices to these at every use
        buckets >>= _LOW_BITS
        counts = np.bincount(buckets, minlength=BUCKETS)  # zeros too (bits >= 0: magnitudes), taken off below
        counts[0] -= np.count_nonzero(bits == 0)
        value = np.zeros(BUCKETS, dtype=np.int32)
        value[buckets] = bits  # one of each bucket's magnitudes (the last written)
        self._mixed[buckets[value[buckets] != bits]] = True
        self._mixed |= (counts > 0) & (self.counts > 0) & (value != self._value)
        fresh = (counts > 0) & (self.counts == 0)
        self._value[fresh] = value[fresh]
        self.counts += counts

    def exact(self, buckets: np.ndarray) -> tuple[dict[int, np.ndarray], np.ndarray]:
        """``(exact counts of those of ``buckets`` that hold one magnitude, the others)``: each row as
        ``exact_counts`` gives it."""
        known = {}
        for bucket in buckets[~self._mixed[buckets]].tolist():
            row = np.zeros(1 << _LOW_BITS, dtype=np.int64)
            row[self._value[bucket] & ((1 << _LOW_BITS) - 1)] = self.counts[bucket]
            known[bucket] = row
        return known, buckets[self._mixed[buckets]]


def oversized(counts: np.ndarray, band_entries: int) -> np.ndarray:
    """The buckets holding more than a band (ascending), whose exact values ``plan_bands`` needs."""
    return np.flatnonzero(counts > band_entries)


def exact_counts(bits: np.ndarray, buckets: np.ndarray) -> np.ndarray:
    """Counts of the exact magnitudes ``bits`` that fall in ``buckets`` (ascending): one row of
    ``2^15`` values per bucket."""
    out = np.zeros((len(buckets), 1 << _LOW_BITS), dtype=np.int64)
    if not len(buckets):
        return out
    rank = np.full(BUCKETS, -1, dtype=np.int32)  # each bucket's row, -1 for the others: one lookup an entry
    rank[buckets] = np.arange(len(buckets))
    row = rank[bits >> _LOW_BITS]
    inside = (row >= 0) & (bits > 0)
    flat = row[inside].astype(np.int64) << _LOW_BITS | (bits[inside] & ((1 << _LOW_BITS) - 1))
    out.reshape(-1)[:] = np.bincount(flat, minlength=out.size)
    return out


@dataclass(frozen=True)
class Band:
    """The entries whose magnitude bits lie in ``[low, high]``: ``count`` of them."""

    low: int
    high: int
    count: int

    @property
    def streamed(self) -> bool:
        """One magnitude: its entries go out in position order, with no sort."""
        return self.low == self.high

    def holds(self, bits: np.ndarray) -> np.ndarray:
        return (bits >= self.low) & (bits <= self.high)


def plan_bands(counts: np.ndarray, exact: dict[int, np.ndarray], band_entries: int) -> list[Band]:
    """Bands of at most ``band_entries`` entries (a single magnitude may hold more: it is streamed), in
    descending order of magnitude, from bucket ``counts`` and the ``exact`` counts of oversized buckets."""
    units: list[Band] = []  # descending: whole buckets, or exact values of oversized ones
    for bucket in np.flatnonzero(counts)[::-1].tolist():
        low = bucket << _LOW_BITS
        if bucket not in exact:  # (bucket 0 starts at 1: a zero is no entry)
            units.append(Band(max(low, 1), low | ((1 << _LOW_BITS) - 1), int(counts[bucket])))
            continue
        values = exact[bucket]
        units += [Band(low | v, low | v, int(values[v])) for v in np.flatnonzero(values)[::-1].tolist()]
    bands: list[Band] = []
    for unit in units:
        last = bands[-1] if bands else None
        if last is not None and last.count + unit.count <= band_entries:
            bands[-1] = Band(unit.low, last.high, last.count + unit.count)
        else:
            bands.append(unit)
    return bands
