"""Compact block-index sets: ``[0, 1, 2, 3, 7]`` <-> ``[[0, 3], [7, 7]]``.

A manifest records which blocks of which expert were read for every tensor.
Budgeted plans read runs of neighbouring blocks, so inclusive ranges keep the
manifest small while staying exact and canonical (sorted, disjoint, and not
adjacent: ``[[0, 1], [2, 3]]`` is always written ``[[0, 3]]``).
"""

from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["compress_indices", "expand_ranges", "canonical_ranges"]


def _check_index(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return int(value)


def compress_indices(indices: Iterable[int]) -> list[list[int]]:
    """Sorted, de-duplicated indices as canonical inclusive ``[first, last]`` ranges."""
    ordered = sorted({_check_index(i, "block index") for i in indices})
    ranges: list[list[int]] = []
    for index in ordered:
        if ranges and index == ranges[-1][1] + 1:
            ranges[-1][1] = index
        else:
            ranges.append([index, index])
    return ranges


def expand_ranges(ranges: Iterable[Sequence[int]]) -> list[int]:
    """Sorted, de-duplicated indices covered by inclusive ``[first, last]`` ranges.

    Accepts ranges in any order (overlaps are merged); rejects anything that is
    not a pair of non-negative ints with ``first <= last``.
    """
    covered: set[int] = set()
    for pair in ranges:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"a block range must be [first, last], got {pair!r}")
        first = _check_index(pair[0], "range start")
        last = _check_index(pair[1], "range end")
        if first > last:
            raise ValueError(f"a block range must have first <= last, got {list(pair)!r}")
        covered.update(range(first, last + 1))
    return sorted(covered)


def canonical_ranges(ranges: Iterable[Sequence[int]]) -> list[list[int]]:
    """The canonical spelling of any valid range list."""
    return compress_indices(expand_ranges(ranges))
