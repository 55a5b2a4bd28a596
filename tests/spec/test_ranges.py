"""Compact block-index ranges (mergepipe.spec.canonical) used in manifests and plans."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mergepipe.spec.canonical import canonical_ranges, compress_indices, expand_ranges


@pytest.mark.parametrize(("indices", "ranges"), [
    ([], []),
    ([5], [[5, 5]]),
    ([0, 1, 2, 3, 7], [[0, 3], [7, 7]]),
    ([7, 3, 2, 2, 0, 1], [[0, 3], [7, 7]]),
    ([1, 3, 5], [[1, 1], [3, 3], [5, 5]]),
])
def test_compress_examples(indices, ranges):
    assert compress_indices(indices) == ranges
    assert expand_ranges(ranges) == sorted(set(indices))


def test_non_canonical_ranges_are_canonicalised():
    assert canonical_ranges([[4, 5], [0, 1], [2, 3], [1, 2]]) == [[0, 5]]


@pytest.mark.parametrize("bad", [[[3, 2]], [[-1, 2]], [[1]], [[1, 2, 3]], [[0.5, 1]], [[True, 2]], [5]])
def test_bad_ranges_rejected(bad):
    with pytest.raises(ValueError):
        expand_ranges(bad)


@pytest.mark.parametrize("bad", [[-1], [1.0], [None]])
def test_bad_indices_rejected(bad):
    with pytest.raises(ValueError):
        compress_indices(bad)


@given(st.lists(st.integers(0, 10_000), max_size=60))
def test_expand_inverts_compress(indices):
    ranges = compress_indices(indices)
    assert expand_ranges(ranges) == sorted(set(indices))
    # canonical: sorted, disjoint, never adjacent, first <= last
    for (a, b), (c, d) in pairwise(ranges):
        assert a <= b and c > b + 1
    assert compress_indices(expand_ranges(ranges)) == ranges
