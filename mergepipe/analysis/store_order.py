"""The order of a delta store's entries, largest ``|Δ|`` first, in memory bounded by a band.

A store lists a tensor's non-zero entries by descending ``|Δ|``, equal ones by position (NaN first): what
a stable descending sort gives, and the order every magnitude trim uses. Sorting a whole tensor needs its
every entry in memory at once (a fully changed 155M-entry embedding: ~3 GB). So a large tensor is ordered
a *band* at a time: a band is a range of magnitudes holding at most ``band_entries`` entries, found from a
histogram of the magnitudes' top 16 bits (refined to exact values for a histogram bucket that alone holds
more); each band is collected in one more pass over the tensor and sorted, bands in descending order. A
single magnitude held by more entries than a band needs no sort: its entries go out in position order, as
the pass meets them (a *streamed* band).

Magnitudes are compared through their fp32 bits as int32: for non-negative floats the order is the same,
and every NaN is given one bit pattern (``_NAN_BITS``, above infinity's), so all NaNs tie and come first.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

_INF_BITS, _NAN_BITS, _MAX_BITS = 0x7F800000, 0x7FC00000, 0x7FFFFFFF  # of fp32 magnitudes, as int32
_KEY_BITS = 63  # of a non-negative int64 sort key
_LOW_BITS = 15  # of a magnitude's bits below its histogram bucket (31 bits in all: the sign is 0)
BUCKETS = 1 << (31 - _LOW_BITS)
_INDEX_SLICE = 1 << 20


def magnitude_bits(values: np.ndarray) -> np.ndarray:
    """The int32 bits of ``|values|`` (fp32), every NaN as ``_NAN_BITS``: they order as the magnitudes do."""
    bits = np.abs(values).view(np.int32)
    bits[bits > _INF_BITS] = _NAN_BITS
    return bits


def in_order(bits: np.ndarray, positions: np.ndarray | None, numel: int,
             size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(positions, bits)`` of the given entries by descending magnitude, equal ones by position, ``size``
    at a time. ``positions`` (int64) are flat positions in a tensor of ``numel`` entries, unique; ``None``
    stands for ``0, 1, ... len(bits) - 1`` (then ``numel`` is ``len(bits)``): the indices of entries listed
    in position order, which sort as their positions would, in fewer key bits.

    One in-place sort of int64 keys ``(2³¹ - 1 - bits) << p | position``: about half the memory of sorting
    the magnitudes with their indices, and faster. Drop your own references to ``bits`` before iterating:
    they are freed once the keys are built.
    """
    width = max(1, (numel - 1).bit_length())
    if width + 31 > _KEY_BITS:  # positions too wide to share a key with the magnitude (over 2³² entries)
        positions = np.arange(len(bits)) if positions is None else positions
        order = np.lexsort((positions, -bits.astype(np.int64)))
        for start in range(0, len(order), size):
            chosen = order[start : start + size]
            yield positions[chosen], bits[chosen]
        return
    keys = bits.astype(np.int64)
    del bits
    np.subtract(_MAX_BITS, keys, out=keys)
    keys <<= width
    if positions is None:  # a slice at a time: no second array as long as the keys
        for start in range(0, len(keys), _INDEX_SLICE):
            keys[start : start + _INDEX_SLICE] |= np.arange(start, min(len(keys), start + _INDEX_SLICE))
    else:
        keys |= positions
    del positions
    keys.sort()
    mask = (1 << width) - 1
    for start in range(0, len(keys), size):
        part = keys[start : start + size]
        yield part & mask, (_MAX_BITS - (part >> width)).astype(np.int32)


def histogram(bits: np.ndarray) -> np.ndarray:
    """Counts of the non-zero magnitudes ``bits`` by their top 16 bits (``BUCKETS`` int64)."""
    return np.bincount(bits[bits > 0] >> _LOW_BITS, minlength=BUCKETS).astype(np.int64)


def oversized(counts: np.ndarray, band_entries: int) -> np.ndarray:
    """The buckets holding more than a band (ascending), whose exact values ``plan_bands`` needs."""
    return np.flatnonzero(counts > band_entries)


def exact_counts(bits: np.ndarray, buckets: np.ndarray) -> np.ndarray:
    """Counts of the exact magnitudes ``bits`` that fall in ``buckets`` (ascending): one row of
    ``2^15`` values per bucket."""
    out = np.zeros((len(buckets), 1 << _LOW_BITS), dtype=np.int64)
    if not len(buckets):
        return out
    rank = np.searchsorted(buckets, bits >> _LOW_BITS)
    inside = (rank < len(buckets)) & (buckets[np.minimum(rank, len(buckets) - 1)] == bits >> _LOW_BITS)
    inside &= bits > 0
    flat = rank[inside].astype(np.int64) << _LOW_BITS | (bits[inside] & ((1 << _LOW_BITS) - 1))
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
